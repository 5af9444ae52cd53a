"""tests/unit as a package (module names tests.unit.test_*; helpers import relatively)."""
