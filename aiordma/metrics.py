"""What this process's connections did: operations, bytes, failures and latency, by kind.

Each queue pair's send queue finishes work requests; the table of requests in
flight (:class:`aiordma.ops.OperationTracker` and its compiled twin) counts
them as their completions (CQEs) are reaped, process-wide, in plain integers:

* an **operation** is what one call posted: one work request (an awaited
  ``write``, a ``read``, one chunk of a message, an atomic), or a chain of
  them rung with one doorbell (``write_batch``, ``read_batch``); it counts
  once, when its signaled completion says it succeeded, with the time from
  its post to that completion in a latency histogram;
* a **work request** counts once per request that completed successfully
  (a chain of 16 Writes is one operation and 16 work requests);
* its **bytes** are the request's scatter/gather length: what the NIC moved;
* a **failed** work request is a completion with an error status
  (``IBV_WC_REM_ACCESS_ERR``, a flush, ...), counted by the kind and the
  status; it counts in no other series.

Kinds come from the work request's opcode (one table, :data:`KIND_OF_OPCODE`):
``write`` (RDMA Write, with or without immediate), ``read``, ``send`` (SEND
work requests of the message layer: one per chunk of a message, control
messages included; credit updates are not counted), ``atomic``
(compare-and-swap, fetch-and-add). The receiving side counts ``receive``:
messages delivered to ``recv()`` (a large message, pulled with Reads, included),
and the bytes of their chunks.

The compiled core keeps its counts in C (:func:`aiordma._core.metrics_counts`);
the interpreted core and the message layer's Python paths keep theirs here;
:func:`snapshot` adds the two. Counts are updated on the event loop's thread
without a lock: exact for one event loop per process (the usual service, a
Dask worker), possibly short by a few where several loops in several threads
complete operations at the same instant.

Timing costs two clock reads per operation; ``AIORDMA_METRICS_LATENCY=0``
turns it off (the histograms stay empty, everything else still counts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from . import settings

__all__ = [
    "BUCKET_BOUNDS_SECONDS",
    "KINDS",
    "KIND_OF_OPCODE",
    "Counts",
    "latency_timing",
    "set_latency_timing",
    "snapshot",
]

#: the kinds counted, by index (0: not counted, e.g. a credit update); the compiled core uses the same numbers
KINDS: tuple[str, ...] = ("", "write", "read", "send", "atomic", "receive")
WRITE, READ, SEND, ATOMIC, RECEIVE = 1, 2, 3, 4, 5
#: the kind of a work request, by its opcode (ibv_wr_opcode)
KIND_OF_OPCODE: dict[int, int] = {0: WRITE, 1: WRITE, 2: SEND, 3: SEND, 4: READ, 5: ATOMIC, 6: ATOMIC}
#: the latency histogram's upper bounds: 1 µs · 2**k for k = 0..20 (1 µs to about 1 s), then +Inf
BUCKET_BOUNDS_NS: tuple[int, ...] = tuple(1000 << k for k in range(21))
BUCKET_BOUNDS_SECONDS: tuple[float, ...] = tuple(b / 1e9 for b in BUCKET_BOUNDS_NS)
N_BUCKETS = len(BUCKET_BOUNDS_NS) + 1
#: completion statuses are counted by value below this (ibv_wc_status has 22)
N_STATUSES = 32


def bucket_of(ns: int) -> int:
    """The histogram bucket of a latency of ``ns`` nanoseconds: the first bound it does not exceed."""
    us = (ns + 999) // 1000
    if us <= 1:
        return 0
    return min((us - 1).bit_length(), N_BUCKETS - 1)


@dataclass
class Counts:
    """The counts of one kind of operation."""

    operations: int = 0
    work_requests: int = 0
    bytes: int = 0
    #: failed work requests by completion status (its numeric value)
    failed: dict[int, int] = field(default_factory=dict)
    #: operations per latency bucket (not cumulative), and their summed latency
    buckets: list[int] = field(default_factory=lambda: [0] * N_BUCKETS)
    latency_sum_ns: int = 0

    def add(self, other: Counts) -> None:
        self.operations += other.operations
        self.work_requests += other.work_requests
        self.bytes += other.bytes
        for status, n in other.failed.items():
            self.failed[status] = self.failed.get(status, 0) + n
        self.buckets = [a + b for a, b in zip(self.buckets, other.buckets)]
        self.latency_sum_ns += other.latency_sum_ns

    @property
    def timed(self) -> int:
        """How many operations the histogram holds."""
        return sum(self.buckets)


# ------------------------------------------------- the interpreted store ----
# (the interpreted core's tracker and the message layer's Python paths)

_ops = [0] * len(KINDS)
_wrs = [0] * len(KINDS)
_bytes = [0] * len(KINDS)
_failed: dict[tuple[int, int], int] = {}
_buckets = [[0] * N_BUCKETS for _ in KINDS]
_sum_ns = [0] * len(KINDS)
_timing = settings.METRICS_LATENCY.get()
now_ns = time.monotonic_ns


def stamp() -> int:
    """A post's timestamp (0 while timing is off)."""
    return now_ns() if _timing else 0


def completed(kind: int, work_requests: int, nbytes: int, posted_ns: int) -> None:
    """An operation of ``kind`` completed successfully (the interpreted twin of the compiled core's count)."""
    if not kind:
        return
    _ops[kind] += 1
    _wrs[kind] += work_requests
    _bytes[kind] += nbytes
    if posted_ns:
        ns = now_ns() - posted_ns
        _sum_ns[kind] += ns
        _buckets[kind][bucket_of(ns)] += 1


def failed(kind: int, status: int) -> None:
    """A work request of ``kind`` completed with error ``status``."""
    if kind:
        key = (kind, status if 0 <= status < N_STATUSES else N_STATUSES - 1)
        _failed[key] = _failed.get(key, 0) + 1


def received(messages: int, nbytes: int, chunks: int = 0) -> None:
    """Messages (and chunks of messages) delivered to the receiver, and their bytes."""
    _ops[RECEIVE] += messages
    _wrs[RECEIVE] += chunks
    _bytes[RECEIVE] += nbytes


# connections: made, and ended by the error their later operations get
# (ConnectionClosedError: a clean close by either end; anything else: a failure)
connections_opened = 0
connections_ended: dict[str, int] = {}


def connection_opened() -> None:
    global connections_opened
    connections_opened += 1


def connection_ended(exc: BaseException) -> None:
    name = type(exc).__name__
    connections_ended[name] = connections_ended.get(name, 0) + 1


def latency_timing() -> bool:
    """Whether operations are timed for the latency histograms (``AIORDMA_METRICS_LATENCY``)."""
    return _timing


def set_latency_timing(on: bool) -> None:
    """Time operations from now on (or stop): both cores. Operations already posted
    while timing was off stay out of the histograms."""
    global _timing
    _timing = bool(on)
    if _compiled is not None:
        _compiled.set_timing(_timing)


@dataclass(frozen=True)
class _CompiledCounts:
    """The compiled core's counters, as it registered them (see :func:`add_compiled`)."""

    counts: Any  # () -> [(ops, wrs, bytes, {status: n}, buckets, sum_ns)] by kind
    layout: tuple[int, int, int, tuple[int, ...]]
    set_timing: Any  # (bool) -> None


_compiled: _CompiledCounts | None = None


def add_compiled(counts: Any, layout: tuple[int, int, int, tuple[int, ...]], set_timing: Any) -> None:
    """The compiled core (:mod:`aiordma._core`) registers its counters as it is imported
    (it imports this module, not the reverse); :func:`snapshot` adds them. Its layout
    must be this module's: kinds, latency buckets, statuses and the kind of each opcode."""
    global _compiled
    kinds, buckets, statuses, opcodes = layout
    expected = tuple(KIND_OF_OPCODE.get(op, 0) for op in range(len(opcodes)))
    if (kinds, buckets, statuses, opcodes) != (len(KINDS), N_BUCKETS, N_STATUSES, expected):
        raise ImportError(f"aiordma._core counts in another layout than aiordma.metrics: {layout}")
    _compiled = _CompiledCounts(counts, layout, set_timing)
    set_timing(_timing)


def _python_counts() -> dict[str, Counts]:
    out = {}
    failed_now = dict(_failed)  # (one C call: a copy another thread cannot change under us)
    for k in range(1, len(KINDS)):
        failed_k = {status: n for (kind, status), n in failed_now.items() if kind == k}
        out[KINDS[k]] = Counts(_ops[k], _wrs[k], _bytes[k], failed_k, list(_buckets[k]), _sum_ns[k])
    return out


def snapshot() -> dict[str, Counts]:
    """Everything counted so far in this process, by kind (``write``, ``read``, ``send``,
    ``atomic``, ``receive``): both cores added up. Counts only grow."""
    out = _python_counts()
    if _compiled is not None:
        for k, (ops, wrs, nbytes, failed_k, buckets, sum_ns) in enumerate(_compiled.counts()):
            if k:
                out[KINDS[k]].add(Counts(ops, wrs, nbytes, failed_k, list(buckets), sum_ns))
    return out
