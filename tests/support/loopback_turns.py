"""Tests that capture packets on ``lo``, and tests that need ``lo`` with no capture, take
turns across processes.

A packet capture listening on a netdev pauses the soft device's UDP GSO batches there
(:mod:`aiordma.providers.soft.gso`), in every process of the host. CI runs the suite on
two Pythons at once, and the AddressSanitizer run beside the reference suite: a capture in
one would pause the batches another test counts on. So each such test holds an exclusive
lock on one file for as long as it runs (``fcntl.flock``, released if the process dies),
and the others wait their turn. A capture from outside the test suite still shows: the
tests that need none skip then, saying so."""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

LOCK = Path(tempfile.gettempdir()) / "aiordma-tests-loopback-captures.lock"
#: how long a test waits for its turn (a capture test takes seconds; pytest's own limit is 600 s)
WAIT = 300.0


@contextmanager
def loopback_to_ourselves(wait: float = WAIT) -> Iterator[None]:
    """Hold ``lo`` for this test: no other test of this host captures on it meanwhile."""
    fd = os.open(LOCK, os.O_CREAT | os.O_RDWR, 0o666)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"waited {wait:g} s for another test process's capture on lo ({LOCK})")
                time.sleep(0.02)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@pytest.fixture
def loopback_turn() -> Iterator[None]:
    """A test that captures on ``lo``, or counts GSO batches there, holds it for its run."""
    with loopback_to_ourselves():
        yield
