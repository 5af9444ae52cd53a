"""Helpers shared by the test suite (not tests themselves)."""
