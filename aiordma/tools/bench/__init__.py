"""``aiordma bench``: perftest-style benchmarks, each next to an asyncio TCP baseline.

Tests (perftest names)::

    write_bw    RDMA Write, --tx-depth writes outstanding       (ib_write_bw)
    read_bw     RDMA Read, --tx-depth reads outstanding          (ib_read_bw)
    send_bw     send()/recv() messages, --tx-depth sends in flight (ib_send_bw)
    write_lat   ping-pong of RDMA Write-with-immediate, half round trip (ib_write_lat)
    send_lat    ping-pong of send()/recv(), half round trip      (ib_send_lat)
    read_lat    one outstanding RDMA Read, full operation        (ib_read_lat)
    atomic_lat  one outstanding fetch-and-add, full operation    (ib_atomic_lat)

By default one invocation starts everything itself on loopback: the server
ends run in child processes (``python -m aiordma.tools.bench TEST --server``,
one for aiordma and one for the TCP baseline; each prints a ready line with
its port on stdout) and this process is the client. For two machines run
``aiordma bench TEST --server`` on one (aiordma on ``--port``, the TCP
baseline on ``--port + 1``) and ``aiordma bench TEST --client HOST`` with the
same options on the other.

How it measures (so the numbers can be trusted):

* Local buffers are registered once (zero copy), like perftest; remote
  targets are one exposed region; every operation of a size hits the same
  offset, like perftest.
* For each message size, aiordma and then the TCP baseline run back to back
  on fresh connections, each with warm-up iterations that are not counted,
  so the two rows of a size share the machine's conditions.
* BW average = bytes / (first post → last completion), MB = 2^20 bytes as in
  perftest; BW peak = the best rate over any window of max(tx_depth,
  iterations/20) consecutive completions; MsgRate = operations / time.
* Latency: ``t_typical`` is the median; percentiles are nearest-rank.
  ``*_lat`` ping-pong tests report half the round trip of each iteration
  (perftest's habit); ``read_lat``/``atomic_lat`` report the full time of
  one outstanding operation (also perftest's). ``write_lat`` is a ping-pong
  of RDMA Write-with-immediate: each side writes into the other's exposed
  buffer with an immediate and waits for the peer's (perftest polls the
  last byte instead; an asyncio program waits for the immediate).
* The baseline is asyncio TCP streams (StreamReader/StreamWriter) on the same
  loop kind (uvloop's TCP with ``--loop uvloop``), doing the same pattern and
  sizes: write_bw = a byte stream (write + drain, 1 MiB reads); send_bw =
  length-prefixed messages read with readexactly; read_* = pipelined
  requests answered with ``size`` bytes; atomic_lat = 8-byte request, 8-byte
  reply; *_lat ping-pongs of the same sizes. TCP_NODELAY is set; the
  StreamReader limit is the faster one for each loop (``--tcp-limit``).
* CPU[usec/op] is the process CPU time (user + system, every thread) per
  operation at each end: a busy machine disturbs it less than wall time.
  Soft-device retransmissions during a measurement are reported with it.
* ``ratio`` is "higher is better" in both kinds: bandwidth = aiordma /
  baseline (BW average), latency = baseline / aiordma (t_typical).

The package::

    common   the tests, defaults, what the options imply, control messages
    stats    the timing loops, percentiles, peak bandwidth, CPU per op
    rdma     the aiordma server handler and client phases
    tcp      the asyncio TCP baseline, both ends
    report   the JSON record and perftest's table
    runner   server processes, and each size measured on both transports
    status   progress of long runs, on stderr
    cli      the arguments (one sub-command per test, with its own --help);
             ``python -m aiordma.tools.bench`` = ``aiordma bench``
"""

from __future__ import annotations

from .cli import DESCRIPTION, _loop_factory, add_arguments, main, parse_size, run, validate
from .common import (
    BYTE_BUDGET_BW,
    BYTE_BUDGET_LAT,
    DEF_ITERS_BW,
    DEF_ITERS_LAT,
    DEFAULT_PORT,
    LATENCY_KIND,
    MAX_ALL_SIZE,
    MAX_DEPTH,
    MAX_DURATION,
    MAX_ITERS,
    MB,
    PHASE_TIMEOUT,
    READY,
    TCP_LIMIT,
    TCP_READ,
    TEST_HELP,
    TESTS,
    _pack,
    _ServerState,
    _unpack,
    iters_for,
    rx_depth,
    sizes_for,
    tcp_limit,
    warmup_for,
)
from .rdma import TROUBLE, RdmaClient, _counters, _delta, _rdma_options, _rdma_serve
from .report import BW_HEADER, LAT_HEADER, RULE, _banner, _record, _row, print_rows
from .runner import RDMAErrorType, _child_argv, _measure, _reap, _spawn, client_main, server_main
from .stats import Measurement, _serial, _windowed, lat_stats, peak_rate, percentile
from .status import Status, size_text
from .tcp import TcpClient, _tcp_serve

__all__ = [
    "BW_HEADER",
    "BYTE_BUDGET_BW",
    "BYTE_BUDGET_LAT",
    "DEFAULT_PORT",
    "DEF_ITERS_BW",
    "DEF_ITERS_LAT",
    "DESCRIPTION",
    "LATENCY_KIND",
    "LAT_HEADER",
    "MAX_ALL_SIZE",
    "MAX_DEPTH",
    "MAX_DURATION",
    "MAX_ITERS",
    "MB",
    "PHASE_TIMEOUT",
    "READY",
    "RULE",
    "TCP_LIMIT",
    "TCP_READ",
    "TESTS",
    "TEST_HELP",
    "TROUBLE",
    "Measurement",
    "RDMAErrorType",
    "RdmaClient",
    "Status",
    "TcpClient",
    "_ServerState",
    "_banner",
    "_child_argv",
    "_counters",
    "_delta",
    "_loop_factory",
    "_measure",
    "_pack",
    "_rdma_options",
    "_rdma_serve",
    "_reap",
    "_record",
    "_row",
    "_serial",
    "_spawn",
    "_tcp_serve",
    "_unpack",
    "_windowed",
    "add_arguments",
    "client_main",
    "iters_for",
    "lat_stats",
    "main",
    "parse_size",
    "peak_rate",
    "percentile",
    "print_rows",
    "run",
    "rx_depth",
    "server_main",
    "size_text",
    "sizes_for",
    "tcp_limit",
    "validate",
    "warmup_for",
]
