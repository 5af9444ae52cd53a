"""What both ends and both transports share: the tests and their kinds, the
defaults, what a run's options imply (sizes, iterations, warm-up, depths),
the msgpack codec of the control messages and the server's lifetime."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import msgpack

from ...rendezvous import DEFAULT_PORT as DEFAULT_PORT  # one of the defaults above, defined once

TESTS: dict[str, tuple[str, str]] = {
    # name: (kind, perftest title)
    "write_bw": ("bw", "RDMA_Write BW Test"),
    "read_bw": ("bw", "RDMA_Read BW Test"),
    "send_bw": ("bw", "Send BW Test"),
    "write_lat": ("lat", "RDMA_Write Latency Test"),
    "read_lat": ("lat", "RDMA_Read Latency Test"),
    "send_lat": ("lat", "Send Latency Test"),
    "atomic_lat": ("lat", "Atomic FETCH_AND_ADD Latency Test"),
}
LATENCY_KIND = {
    "write_lat": "half round trip (ping-pong of RDMA Write-with-immediate)",
    "send_lat": "half round trip (ping-pong of send/recv)",
    "read_lat": "full operation (one outstanding RDMA Read)",
    "atomic_lat": "full operation (one outstanding fetch-and-add)",
}
#: what each test measures, for ``aiordma bench TEST --help``
TEST_HELP = {
    "write_bw": (
        "RDMA Write bandwidth (like ib_write_bw): --tx-depth writes outstanding, each from a registered local "
        "buffer into the server's exposed buffer at the same offset, posted with conn.post_write() and reaped "
        "oldest first by one coroutine; the server's CPU takes no part. BW average "
        "= bytes / (first post -> last completion). Baseline: a TCP byte stream (write + drain)."
    ),
    "read_bw": (
        "RDMA Read bandwidth (like ib_read_bw): --tx-depth reads outstanding from the server's exposed buffer "
        "into a registered local one, posted with conn.post_read() and reaped oldest first by one coroutine; "
        "the server's CPU takes no part. Baseline: pipelined TCP requests, each "
        "answered with SIZE bytes."
    ),
    "send_bw": (
        "Message bandwidth (like ib_send_bw): conn.send() of SIZE-byte messages with --tx-depth in flight, "
        "each taken by the server's conn.recv(); timed until the server confirms it has them all. Baseline: "
        "length-prefixed TCP messages read with readexactly()."
    ),
    "write_lat": (
        "RDMA Write latency (like ib_write_lat): a ping-pong of RDMA Write-with-immediate, each side writing "
        "SIZE bytes into the other's exposed buffer and waiting for the peer's immediate; reports half the "
        "round trip. Baseline: a TCP ping-pong of SIZE bytes."
    ),
    "read_lat": (
        "RDMA Read latency (like ib_read_lat): one outstanding RDMA Read of SIZE bytes at a time; reports the "
        "whole operation. Baseline: a TCP request answered with SIZE bytes."
    ),
    "send_lat": (
        "Message latency (like ib_send_lat): a ping-pong of conn.send()/recv() of SIZE bytes; reports half "
        "the round trip. Baseline: a TCP ping-pong of length-prefixed messages."
    ),
    "atomic_lat": (
        "Atomic latency (like ib_atomic_lat): one outstanding fetch-and-add on an 8-byte word of the server's "
        "exposed buffer at a time; reports the whole operation. Atomics work on one 64-bit word, so there is "
        "no size to choose. Baseline: an 8-byte TCP request and its 8-byte reply."
    ),
}
MB = 1 << 20  # perftest's MB/sec is 2^20 bytes per second
MAX_ALL_SIZE = 8 << 20
READY = "AIORDMA-BENCH-READY"
DEF_ITERS_BW = 5000
DEF_ITERS_LAT = 1000
# without an explicit -n, big sizes run fewer iterations (like perftest -a on slow links)
BYTE_BUDGET_BW = 256 << 20
BYTE_BUDGET_LAT = 64 << 20
TCP_READ = 1 << 20  # the baseline's stream reads ask for up to 1 MiB at a time
# StreamReader buffer limit per loop kind: whichever made the baseline faster on
# loopback (asyncio: 1 MiB is ~2x faster than its 64 KiB default for 64 KiB
# streams; uvloop: 1 MiB is ~4x slower than 64 KiB). See --tcp-limit.
TCP_LIMIT = {"asyncio": 1 << 20, "uvloop": 1 << 16}
PHASE_TIMEOUT = 600.0
# what the command line accepts: each iteration keeps its timestamps in memory,
# and the send queue holds tx-depth + 16 work requests (within every device's max_qp_wr)
MAX_ITERS = 10_000_000
MAX_DEPTH = 8192
MAX_DURATION = 86400.0


def sizes_for(args: argparse.Namespace) -> list[int]:
    if args.test == "atomic_lat":
        return [8]
    if args.all:  # like perftest -a: 2 B ... 8 MiB (--max-size moves the top)
        top = args.max_size
        out, s = [], 2
        while s <= top:
            out.append(s)
            s *= 2
        return out
    return [args.size or (65536 if TESTS[args.test][0] == "bw" else 2)]  # perftest's defaults


def iters_for(args: argparse.Namespace, size: int) -> int:
    bw = TESTS[args.test][0] == "bw"
    if args.iters is not None:
        n = max(1, args.iters)
        return int(n if args.budget is None else min(n, max(16, args.budget // size)))
    base = DEF_ITERS_BW if bw else DEF_ITERS_LAT
    budget = args.budget or (BYTE_BUDGET_BW if bw else BYTE_BUDGET_LAT)
    return max(16, min(base, budget // size))


def warmup_for(args: argparse.Namespace, iters: int, size: int | None = None) -> int:
    """Warm-up iterations: ``--warmup``, else about 10 % (at least the tx depth,
    at most 200), and never more bytes than the default byte budget (at least
    2 iterations), so ``-s 1G -n 2`` does not warm up with 16 GiB."""
    if args.warmup is not None:
        return max(0, int(args.warmup))
    bw = TESTS[args.test][0] == "bw"
    depth = args.tx_depth if bw else 1
    n = max(2, min(200, max(depth, iters // 10)))
    if size:
        n = min(n, max(2, (BYTE_BUDGET_BW if bw else BYTE_BUDGET_LAT) // size))
    return n


def tcp_limit(args: argparse.Namespace) -> int:
    return args.tcp_limit or TCP_LIMIT[args.loop]


def rx_depth(args: argparse.Namespace) -> int:
    return int(args.rx_depth or min(512, max(16, 2 * args.tx_depth)))


def _pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


class _ServerState:
    """When the server process is done: after the client's last goodbye
    (on the aiordma connection, or on the TCP one when a baseline follows)."""

    def __init__(self) -> None:
        self.finished = asyncio.Event()
        self.active = 0
