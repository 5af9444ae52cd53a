"""Receive buffers for large frames, reused: the RDMA Read destinations of a process.

Every large frame a comm reads arrives in a new buffer of exactly its size (the
frame becomes a Dask array, released on its own: :mod:`.framing`). A new buffer
of many megabytes is fresh memory: the kernel maps it page by page as the RDMA
Read (or TCP's ``recv``) first writes it, and zeroes every page before — in the
issue-33 workload a fifth of a worker's CPU time goes to that zeroing, over
either protocol. :class:`FramePool` keeps the buffers of frames Dask has released
and gives one to the next frame of the same size, already mapped (UCX keeps its
receive buffers the same way). Dask's workloads repeat their sizes: a chunk of
an array, a shard of a rechunk.

A buffer is a numpy array of exactly the frame's size that owns its memory, as
:func:`distributed.protocol.utils.host_array` makes them (so Dask's
``get_host_array`` finds the frame's own buffer, its size). The pool keeps a
reference to each buffer it tracks; every view Dask derives from the frame (the
arrays, memoryviews and pickle buffers of the message) holds one more, so a
buffer is idle — reusable — exactly when only the pool refers to it: memory Dask
still uses is never handed out twice. At most ``max_bytes`` of buffers are
tracked, in use or idle (``distributed.comm.rdma.buffer-pool``); to make room the
longest-idle ones are let go, and a frame that finds no room gets a buffer of
its own, untracked, as before. Idle buffers count in the process's RSS (Dask's
unmanaged memory) while they wait.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict

import numpy
from distributed.protocol.utils import host_array

#: frames smaller than this come from numpy's allocator every time (small ones come
#: from the heap, which keeps its pages: nothing to save)
MIN_POOLED = 64 * 1024


class FramePool:
    """Buffers of released frames, by size, for the next frames received (thread-safe:
    Dask releases a frame on whichever thread drops it last)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        #: every tracked buffer, least recently handed out first (id -> buffer)
        self._owners: OrderedDict[int, numpy.ndarray] = OrderedDict()
        self._by_size: dict[int, list[numpy.ndarray]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        #: frames given a tracked buffer again / a new tracked one / an untracked one
        self.reused = 0
        self.tracked = 0
        self.untracked = 0
        # the references an idle buffer has, counted where the callers count them: the
        # pool's two, the caller's one local variable, and the call's own
        probe = numpy.empty(1, dtype=numpy.uint8)
        self._owners[id(probe)] = probe
        self._by_size[1] = [probe]
        self._idle_refs = self._refs(probe)
        del self._owners[id(probe)], self._by_size[1]

    @staticmethod
    def _refs(buf: numpy.ndarray) -> int:
        return sys.getrefcount(buf)

    def take(self, n: int) -> memoryview:
        """A writable buffer of exactly ``n`` bytes, as :func:`host_array` gives them
        (a numpy array's memoryview): an idle one of that size when there is one."""
        if n < MIN_POOLED or self.max_bytes <= 0:
            return host_array(n)
        with self._lock:
            for buf in self._by_size.get(n, ()):
                if self._refs(buf) <= self._idle_refs:
                    self._owners.move_to_end(id(buf))
                    self.reused += 1
                    return buf.data
            room = self._bytes + n <= self.max_bytes or self._make_room(n)
        buf = numpy.empty(n, dtype=numpy.uint8)
        if not room:
            self.untracked += 1
            return buf.data
        with self._lock:
            self._owners[id(buf)] = buf
            self._by_size.setdefault(n, []).append(buf)
            self._bytes += n
            self.tracked += 1
        return buf.data

    def _make_room(self, n: int) -> bool:
        """Let idle buffers go, longest idle first, until ``n`` more bytes fit (lock held)."""
        for key in list(self._owners):
            if self._bytes + n <= self.max_bytes:
                break
            buf = self._owners[key]
            if self._refs(buf) > self._idle_refs:
                continue
            del self._owners[key]
            same = self._by_size[buf.nbytes]
            # (by identity: list.remove would compare arrays by value)
            del same[next(i for i, b in enumerate(same) if b is buf)]
            if not same:
                del self._by_size[buf.nbytes]
            self._bytes -= buf.nbytes
        return self._bytes + n <= self.max_bytes

    @property
    def tracked_bytes(self) -> int:
        """Bytes of the buffers the pool tracks, in use or idle."""
        return self._bytes

    def idle_bytes(self) -> int:
        """Bytes of the tracked buffers no frame uses now."""
        with self._lock:
            idle = 0
            for buf in self._owners.values():
                if self._refs(buf) <= self._idle_refs:
                    idle += buf.nbytes
            return idle

    def clear(self) -> None:
        """Stop tracking every buffer (those in use stay Dask's; the idle ones are freed)."""
        with self._lock:
            self._owners.clear()
            self._by_size.clear()
            self._bytes = 0


_pools: dict[int, FramePool] = {}
_pools_lock = threading.Lock()


def pool_for(max_bytes: int) -> FramePool:
    """The process's pool of that size (comms with the same setting share one)."""
    with _pools_lock:
        pool = _pools.get(max_bytes)
        if pool is None:
            pool = _pools[max_bytes] = FramePool(max_bytes)
        return pool
