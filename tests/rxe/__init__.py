"""tests/rxe as a package (module names tests.rxe.test_*; helpers import relatively)."""
