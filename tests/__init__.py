"""aiordma's test suite: a package, so that test modules import their shared helpers (``tests.support``) plainly."""
