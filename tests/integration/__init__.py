"""tests/integration as a package (module names tests.integration.test_*; helpers import relatively)."""
