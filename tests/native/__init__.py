"""Test-only native code: ``_testing``, the RC core of the native engine driven
sans-IO (built in place by setup.py in a checkout; never in a wheel)."""
