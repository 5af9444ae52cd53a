"""Waiting for a condition instead of sleeping for a guessed time.

A test that sleeps "long enough" for something to happen fails on a loaded
machine; one that polls for the thing itself, with a generous bound that only
a hang reaches, does not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

#: bound for waits in tests: long enough for a loaded 2-core CI machine, short enough to fail a hang
DEFAULT_TIMEOUT = 20.0


async def wait_until(predicate: Callable[[], object], what: str = "", timeout: float = DEFAULT_TIMEOUT) -> None:
    """Return once ``predicate()`` is true (checked every millisecond or so); fail
    with ``what`` after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or predicate}")
        await asyncio.sleep(0.001)
