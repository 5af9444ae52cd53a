"""Shared test configuration.

* No ``AIORDMA_*`` setting of a developer's shell reaches the tests: every
  ``AIORDMA_*`` variable is removed from the environment here, before any test
  module (or aiordma) is imported, except the few that configure the test suite
  itself (``tests/support/environment.py``). A test that wants a setting sets it
  itself (``monkeypatch.setenv``, or a child process's ``env``).
* Every async test runs on asyncio's default loop and on uvloop
  (pytest-asyncio's ``pytest_asyncio_loop_factories`` hook).
"""

from __future__ import annotations

import asyncio

import uvloop

from tests.support.environment import clear_aiordma_environment
from tests.support.loopback_turns import loopback_turn  # noqa: F401  (a fixture for every test module)

#: the variables removed (tests/unit/test_environment.py names them when it fails)
CLEARED_FROM_ENVIRONMENT = clear_aiordma_environment()


def pytest_asyncio_loop_factories(config, item):
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
