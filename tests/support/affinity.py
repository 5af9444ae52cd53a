"""Pinning every thread of a process to some CPUs for a test, and back."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def pin(pid: int, cpus: set[int]) -> dict[int, set[int]]:
    """Every thread of process pid onto cpus: each thread's affinity before."""
    before = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        before[tid] = os.sched_getaffinity(tid)
        os.sched_setaffinity(tid, cpus)
    return before


@contextmanager
def pinned(pid: int, cpus: set[int]) -> Iterator[None]:
    """Every thread of process pid on cpus meanwhile; then each thread as before (a
    thread started meanwhile as the process's first thread was)."""
    before = pin(pid, cpus)
    try:
        yield
    finally:
        everywhere = before[pid]
        try:
            tids = list(map(int, os.listdir(f"/proc/{pid}/task")))
        except FileNotFoundError:  # (the process ended)
            tids = []
        for tid in tids:
            try:
                os.sched_setaffinity(tid, before.get(tid, everywhere))
            except OSError:  # (a thread that ended meanwhile)
                pass
