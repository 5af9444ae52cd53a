"""Tests of the ``rdma://`` Dask comm backend (``aiordma.integrations.dask``).

They need Dask ``distributed`` and numpy (``pip install -e '.[test,dask]'``);
without them the whole directory is skipped, saying so.

* Async tests written with pytest-asyncio run on asyncio and uvloop (the root
  conftest) and fail on a call of the loop's exception handler or a leaked
  task (``loop_hygiene``, as in tests/integration).
* Tests built on ``distributed.utils_test`` (``gen_test``, ``gen_cluster``)
  and on ``LocalCluster`` run their own event loop; the ``dask_loop`` fixture
  runs each on both loops through Dask's own setting
  (``distributed.admin.event-loop``: ``asyncio`` or ``uvloop``), and the
  test checks which loop it got.
* ``gen_test``'s thread-leak check sees every thread started during a test;
  the soft device's NIC is one, started on first use and kept for the
  process. ``soft_device`` opens the device before the check looks (its
  thread is then not new) and closes it afterwards; the check stays on for
  every other thread.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("distributed", reason="Dask distributed is not installed: pip install 'aiordma[dask]'")
pytest.importorskip("numpy", reason="numpy is not installed: pip install 'aiordma[dask]'")

import distributed.utils_test as dask_utils_test

import aiordma

from ..integration.conftest import loop_hygiene  # noqa: F401  (every async test here)

LOOPS = ("asyncio", "uvloop")


@pytest.fixture(params=LOOPS)
def dask_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test's Dask event loop on asyncio or uvloop.

    ``gen_test``/``gen_cluster`` reset Dask's configuration to the one
    ``distributed.utils_test`` saw at import before they create their loop, so
    the setting goes there; ``LocalCluster`` and ``Client`` read the current
    configuration, so it goes there too."""
    import dask

    name = request.param
    monkeypatch.setitem(dask_utils_test.original_config["distributed"]["admin"], "event-loop", name)
    monkeypatch.setitem(dask.config.config["distributed"]["admin"], "event-loop", name)
    return str(name)


def running_loop_kind() -> str:
    """``uvloop`` or ``asyncio``: the loop the calling coroutine runs on."""
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


@pytest.fixture
def soft_device():
    """The process's soft device, opened before the test (and its thread-leak
    check) begins and closed after it ends."""
    dev = aiordma.get_device("soft")
    yield dev
    aiordma.close_shared_devices()
