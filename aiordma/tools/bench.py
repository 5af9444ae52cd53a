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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from . import positive_size as parse_size

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
MB = 1 << 20  # perftest's MB/sec is 2^20 bytes per second
MAX_ALL_SIZE = 8 << 20
DEFAULT_PORT = 18515
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (
        "examples:\n"
        "  aiordma bench write_bw -s 64K            # both ends on loopback, TCP baseline beside\n"
        "  aiordma bench send_lat -a --max-size 64K --loop uvloop --json\n"
        "  aiordma bench read_bw --server           # machine A\n"
        "  aiordma bench read_bw --client A         # machine B (same options on both)\n"
    )
    p.add_argument("test", choices=sorted(TESTS), help="which test (perftest names)")
    p.add_argument(
        "-s",
        "--size",
        type=parse_size,
        default=None,
        help="message size in bytes (default 65536 bw, 2 lat; atomics: 8)",
    )
    p.add_argument("-a", "--all", action="store_true", help="all sizes 2 B ... 8 MiB (powers of two)")
    p.add_argument("--max-size", type=parse_size, default=MAX_ALL_SIZE, help="largest size for --all (default 8M)")
    p.add_argument(
        "-n",
        "--iters",
        type=int,
        default=None,
        help=f"iterations (default {DEF_ITERS_BW} bw, {DEF_ITERS_LAT} lat; fewer for big sizes)",
    )
    p.add_argument(
        "--budget",
        type=parse_size,
        default=None,
        help="cap the bytes moved per measurement (iterations = min(n, budget / size), at least 16); "
        "default 256M bw, 64M lat when -n is not given, no cap when it is",
    )
    p.add_argument(
        "-D", "--duration", type=float, default=None, help="run each measurement for about this many seconds instead"
    )
    p.add_argument("-t", "--tx-depth", type=int, default=16, help="outstanding operations in bw tests (default 16)")
    p.add_argument(
        "-l",
        "--post-list",
        type=int,
        default=1,
        help="write_bw: post this many writes per doorbell as one chain with only the last signaled "
        "(Connection.write_batch; perftest's --post_list with --cq-mod of the same size); default 1",
    )
    p.add_argument(
        "-r",
        "--rx-depth",
        type=int,
        default=None,
        help="receive buffers per connection (default max(16, 2 x tx-depth))",
    )
    p.add_argument(
        "--provider", choices=("auto", "soft", "pyverbs"), default="auto", help="RDMA provider (default auto)"
    )
    p.add_argument(
        "--loop", choices=("asyncio", "uvloop"), default="asyncio", help="event loop for both ends and the baseline"
    )
    p.add_argument("--progress", choices=("event", "thread", "busy"), default="event", help="completion progress mode")
    p.add_argument(
        "--baseline", choices=("tcp", "none"), default="tcp", help="asyncio TCP baseline in the same run (default tcp)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per size on stdout instead of the table")
    p.add_argument("--server", action="store_true", help="be the server end (two machines)")
    p.add_argument("--client", metavar="HOST", default=None, help="be the client end, connecting to HOST")
    p.add_argument(
        "-p",
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help="aiordma port; the TCP baseline uses port+1 (default 18515)",
    )
    p.add_argument("--tcp-port", type=int, default=None, help="TCP baseline port (default port+1)")
    p.add_argument(
        "--tcp-limit",
        type=parse_size,
        default=None,
        help="baseline StreamReader buffer limit (default: the faster one per loop, 1M asyncio, 64K uvloop)",
    )
    p.add_argument("--bind", default="0.0.0.0", help="server: address to listen on (default all)")
    p.add_argument(
        "--warmup", type=int, default=None, help="warm-up iterations per measurement (default ~10%%, at most 200)"
    )
    p.add_argument("--persistent", action="store_true", help="server: keep serving after a client finished")
    p.add_argument("--serve", choices=("rdma", "tcp", "both"), default=None, help=argparse.SUPPRESS)


# ------------------------------------------------------------------ stats ----


def percentile(sorted_vals: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_vals:
        return float("nan")
    k = max(0, min(len(sorted_vals) - 1, math.ceil(q * len(sorted_vals)) - 1))
    return sorted_vals[k]


def lat_stats(samples_ns: list[int] | None) -> dict[str, float] | None:
    if not samples_ns:
        return None
    v = sorted(x / 1000.0 for x in samples_ns)
    n = len(v)
    avg = sum(v) / n
    var = sum((x - avg) ** 2 for x in v) / (n - 1) if n > 1 else 0.0
    return {
        "min": v[0],
        "p50": percentile(v, 0.50),
        "p99": percentile(v, 0.99),
        "p999": percentile(v, 0.999),
        "max": v[-1],
        "avg": avg,
        "stdev": math.sqrt(var),
    }


def peak_rate(t0: int, stamps: list[int], cum: list[int], window: int) -> float:
    """Best bytes/s over any stretch of at least ``window`` bytes.

    ``stamps``/``cum``: completion times (ns, ascending) and bytes completed
    by then; ``t0`` is when the first operation was posted."""
    ts = [t0] + stamps
    cs = [0] + cum
    best = 0.0
    i = 0
    for j in range(1, len(ts)):
        while i + 1 < j and cs[j] - cs[i + 1] >= window:
            i += 1
        if cs[j] - cs[i] >= window and ts[j] > ts[i]:
            best = max(best, (cs[j] - cs[i]) * 1e9 / (ts[j] - ts[i]))
    if best == 0.0 and ts[-1] > t0:
        best = cs[-1] * 1e9 / (ts[-1] - t0)
    return best


@dataclass
class Measurement:
    """What one transport measured for one size."""

    transport: str
    test: str
    size: int
    iterations: int
    elapsed_ns: int
    tx_depth: int
    lat_samples_ns: list[int] | None = None
    done_stamps: list[int] | None = None  # completion times, for the peak
    t0_ns: int = 0
    peak_Bps: float | None = None  # when the receiver measured it
    cpu_client_s: float | None = None  # process CPU time (all threads) during the measurement
    cpu_server_s: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, dict[str, int]] = field(default_factory=dict)  # soft-device counter deltas per end

    def summary(self) -> dict[str, Any]:
        secs = self.elapsed_ns / 1e9
        nbytes = self.size * self.iterations
        bw = nbytes / secs / MB if secs > 0 else 0.0
        peak = self.peak_Bps
        if peak is None and self.done_stamps:
            window = self.size * max(self.tx_depth, self.iterations // 20, 1)
            cum = [self.size * (k + 1) for k in range(len(self.done_stamps))]
            peak = peak_rate(self.t0_ns, sorted(self.done_stamps), cum, window)
        return {
            "iterations": self.iterations,
            "elapsed_s": secs,
            "bw_MBps": bw,
            "bw_peak_MBps": max(peak / MB, bw) if peak is not None else bw,
            "msg_rate_Mpps": self.iterations / secs / 1e6 if secs > 0 else 0.0,
            "lat_us": lat_stats(self.lat_samples_ns),
            "cpu_us_per_op": self.cpu_per_op(),
            **({"counters": self.counters} if self.counters else {}),
        }

    def cpu_per_op(self) -> dict[str, float] | None:
        """CPU time (user + system, every thread) per operation, each end: less
        sensitive to a busy machine than wall-clock figures."""
        if self.cpu_client_s is None or self.cpu_server_s is None or not self.iterations:
            return None
        c = self.cpu_client_s * 1e6 / self.iterations
        s = self.cpu_server_s * 1e6 / self.iterations
        return {"client": c, "server": s, "total": c + s}


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
        return n if args.budget is None else min(n, max(16, args.budget // size))
    base = DEF_ITERS_BW if bw else DEF_ITERS_LAT
    budget = args.budget or (BYTE_BUDGET_BW if bw else BYTE_BUDGET_LAT)
    return max(16, min(base, budget // size))


def warmup_for(args: argparse.Namespace, iters: int) -> int:
    if args.warmup is not None:
        return max(0, args.warmup)
    depth = args.tx_depth if TESTS[args.test][0] == "bw" else 1
    return max(2, min(200, max(depth, iters // 10)))


def tcp_limit(args: argparse.Namespace) -> int:
    return args.tcp_limit or TCP_LIMIT[args.loop]


def rx_depth(args: argparse.Namespace) -> int:
    return args.rx_depth or min(512, max(16, 2 * args.tx_depth))


# ------------------------------------------------------- aiordma: server ----


def _counters(conn: Any) -> dict[str, int]:
    """The transport counters of ``conn``'s QP and its device's packet counters
    (soft device; empty where a provider has none)."""
    out: dict[str, int] = {}
    try:
        out.update({k: v for k, v in conn.device.counters.items() if k.startswith(("tx_", "rx_"))})
        out.update(conn.qp.counters)
    except (AttributeError, TypeError):
        pass
    return out


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, int) and v != before.get(k, 0)}


# counters that mean the link or a receiver could not keep up (reported next to the figures)
TROUBLE = (
    "retransmits",
    "timeouts",
    "seq_naks_sent",
    "seq_naks_rcvd",
    "rnr_naks_sent",
    "rnr_naks_rcvd",
    "out_of_sequence",
    "duplicate_requests",
    "tx_dropped_full",
    "rx_icrc_errors",
)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


class _ServerState:
    """When the server process is done: after the client's last goodbye
    (on the aiordma connection, or on the TCP one when a baseline follows)."""

    def __init__(self) -> None:
        self.finished = asyncio.Event()
        self.active = 0


def _rdma_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "progress": args.progress,
        "recv_buffers": rx_depth(args),
        "send_queue_depth": max(256, args.tx_depth + 16),
    }


async def _rdma_serve(args: argparse.Namespace, state: _ServerState, port: int) -> Any:
    import aiordma

    bufsize = max(MAX_ALL_SIZE, args.max_size, args.size or 0)
    region = aiordma.register(bytearray(bufsize + 64), provider=args.provider)

    async def handler(conn: Any) -> None:
        state.active += 1
        last = False
        try:
            client_buf = conn.remote_buffers.get("buf")
            while True:
                try:
                    cmd = _unpack(await conn.recv())
                except aiordma.RDMAError:  # closed, or lost (the client reports why)
                    return
                op = cmd.get("op")
                if op == "bye":
                    last = bool(cmd.get("last")) and not (cmd.get("tcp_follows") and args.serve != "rdma")
                    # let the client close first, so its last send is never cut short by our goodbye
                    try:
                        await asyncio.wait_for(conn.recv(), 10)
                    except (TimeoutError, aiordma.RDMAError):
                        pass
                    return
                if op == "cpu":
                    await conn.send(_pack({"op": "cpu", "cpu": time.process_time(), "counters": _counters(conn)}))
                    continue
                test, size, iters = cmd["test"], cmd["size"], cmd["iters"]
                await conn.send(
                    _pack(
                        {
                            "op": "ready",
                            "device": f"{conn.device.provider}:{conn.device.name}",
                            "progress": conn.progress_mode,
                            "cpu": time.process_time(),
                            "counters": _counters(conn),
                        }
                    )
                )
                if test == "send_bw":
                    recv = conn.recv
                    for _ in range(iters):
                        await recv()
                    await conn.send(b"done")
                elif test == "send_lat":
                    recv, send = conn.recv, conn.send
                    for _ in range(iters):
                        await send(await recv())
                elif test == "write_lat":
                    src = region[0:size]
                    dst = client_buf[0:size]
                    recv_imm, write = conn.recv_immediate, conn.write
                    for _ in range(iters):
                        await recv_imm()
                        await write(src, dst, imm=1)
                # write_bw / read_bw / read_lat / atomic_lat: one-sided, nothing to do here
        finally:
            state.active -= 1
            if last and not args.persistent:
                state.finished.set()

    server = await aiordma.start_server(
        handler, args.bind, port, provider=args.provider, expose={"buf": region}, **_rdma_options(args)
    )
    return server


# -------------------------------------------------------- aiordma: client ----


class RdmaClient:
    def __init__(self, args: argparse.Namespace, host: str, port: int, max_size: int) -> None:
        self.args = args
        self.host = host
        self.port = port
        self.max_size = max_size
        self.conn: Any = None
        self.region: Any = None
        self.device = ""
        self.progress = ""
        self.poll_window_us: float | None = None

    async def open(self) -> None:
        import aiordma

        if self.region is None:  # registered once for the whole run
            self.region = aiordma.register(bytearray(self.max_size + 64), provider=self.args.provider)
        self.conn = await aiordma.connect(
            self.host, self.port, provider=self.args.provider, expose={"buf": self.region}, **_rdma_options(self.args)
        )
        self.device = f"{self.conn.device.provider}:{self.conn.device.name}"
        self.progress = self.conn.progress_mode
        #: event mode's poll window (µs) before the loop sleeps on the completion fd
        self.poll_window_us = self.conn.dispatcher.spin_s * 1e6 if self.progress == "event" else None

    async def close(self, last: bool) -> None:
        if self.conn is None:
            return
        import aiordma

        try:
            await self.conn.send(_pack({"op": "bye", "last": last, "tcp_follows": self.args.baseline == "tcp"}))
        except aiordma.RDMAError:
            pass  # the server said goodbye first, or the connection already failed (reported by the caller)
        finally:
            await self.conn.close()
            self.conn = None

    async def phase(self, test: str, size: int, iters: int, depth: int) -> Measurement:
        conn = self.conn
        rb = conn.remote("buf")
        if size > rb.length - 64:
            raise SystemExit(
                f"the server exposes {rb.length - 64} bytes, less than size {size}: give it the same -s/--max-size"
            )
        await conn.send(_pack({"op": "phase", "test": test, "size": size, "iters": iters}))
        ready = _unpack(await conn.recv())
        assert ready.get("op") == "ready", ready
        cpu0 = time.process_time()
        counters0 = _counters(conn)
        local = self.region[0:size]
        remote = rb[0:size]
        m = Measurement("aiordma", test, size, iters, 0, depth)
        m.info["server_device"] = ready.get("device")
        m.info["server_progress"] = ready.get("progress")
        if test == "write_bw" and self.args.post_list > 1:
            # chains of post_list writes, one completion each; depth counts writes
            chain = [(local, remote)] * self.args.post_list
            write_batch = conn.write_batch
            batches = max(1, iters // len(chain))
            await _windowed(m, lambda: write_batch(chain), batches, max(1, depth // len(chain)))
            m.iterations = batches * len(chain)
            m.done_stamps = [t for t in (m.done_stamps or []) for _ in chain]
            m.info["post_list"] = len(chain)
        elif test == "write_bw":
            write = conn.write
            await _windowed(m, lambda: write(local, remote), iters, depth)
        elif test == "read_bw":
            read = conn.read
            await _windowed(m, lambda: read(remote, into=local), iters, depth)
        elif test == "send_bw":
            send = conn.send
            view = local.view
            await _windowed(m, lambda: send(view), iters, depth)
            reply = await conn.recv()  # the receiver got every message
            assert reply == b"done", reply
            m.elapsed_ns = time.perf_counter_ns() - m.t0_ns
        elif test == "read_lat":
            read = conn.read
            await _serial(m, lambda: read(remote, into=local), iters, half=False)
        elif test == "atomic_lat":
            word = rb[0:8] if rb.addr % 8 == 0 else rb.at(8 - rb.addr % 8, 8)
            faa = conn.fetch_and_add
            await _serial(m, lambda: faa(word, 1), iters, half=False)
        elif test == "send_lat":
            send, recv = conn.send, conn.recv
            view = local.view

            async def pingpong() -> None:
                await send(view)
                await recv()

            await _serial(m, pingpong, iters, half=True)
        elif test == "write_lat":
            write, recv_imm = conn.write, conn.recv_immediate

            async def pingpong() -> None:
                await write(local, remote, imm=1)
                await recv_imm()

            await _serial(m, pingpong, iters, half=True)
        else:  # pragma: no cover
            raise ValueError(test)
        m.cpu_client_s = time.process_time() - cpu0
        m.counters["client"] = _delta(_counters(conn), counters0)
        await conn.send(_pack({"op": "cpu"}))
        reply = _unpack(await conn.recv())
        m.cpu_server_s = reply["cpu"] - ready["cpu"]
        m.counters["server"] = _delta(reply.get("counters") or {}, ready.get("counters") or {})
        return m


async def _windowed(m: Measurement, op: Callable[[], Any], iters: int, depth: int) -> None:
    """Keep ``depth`` operations outstanding until ``iters`` completed."""
    post = [0] * iters
    done = [0] * iters
    nxt = 0
    clock = time.perf_counter_ns

    async def worker() -> None:
        nonlocal nxt
        while nxt < iters:
            i = nxt
            nxt += 1
            post[i] = clock()
            await op()
            done[i] = clock()

    m.t0_ns = clock()
    await asyncio.gather(*[worker() for _ in range(max(1, min(depth, iters)))])
    m.elapsed_ns = clock() - m.t0_ns
    m.done_stamps = done
    m.lat_samples_ns = [d - p for d, p in zip(done, post)]


async def _serial(m: Measurement, op: Callable[[], Any], iters: int, half: bool) -> None:
    samples = [0] * iters
    clock = time.perf_counter_ns
    m.t0_ns = start = clock()
    for i in range(iters):
        t = clock()
        await op()
        samples[i] = clock() - t
    m.elapsed_ns = clock() - start
    if half:  # ping-pong: half the round trip, as perftest reports
        samples = [s // 2 for s in samples]
    m.lat_samples_ns = samples


# ------------------------------------------------------ TCP baseline ----
# control frames: 4-byte big-endian length + msgpack; data follows the "ready" frame

_HDR = struct.Struct("!I")
_Q = struct.Struct("!Q")


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def _write_frame(writer: asyncio.StreamWriter, obj: Any) -> None:
    body = _pack(obj)
    writer.write(_HDR.pack(len(body)) + body)


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    try:
        hdr = await reader.readexactly(4)
    except asyncio.IncompleteReadError:
        return None
    return _unpack(await reader.readexactly(_HDR.unpack(hdr)[0]))


async def _tcp_serve(args: argparse.Namespace, state: _ServerState, port: int) -> Any:
    bufsize = max(MAX_ALL_SIZE, args.max_size, args.size or 0)
    payload = bytes(bufsize)

    async def session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _nodelay(writer)
        state.active += 1
        last = False
        counter = 0
        try:
            while True:
                cmd = await _read_frame(reader)
                if cmd is None:
                    return
                if cmd.get("op") == "bye":
                    last = bool(cmd.get("last"))
                    return
                if cmd.get("op") == "cpu":
                    _write_frame(writer, {"op": "cpu", "cpu": time.process_time()})
                    await writer.drain()
                    continue
                test, size, iters, depth = cmd["test"], cmd["size"], cmd["iters"], cmd.get("depth", 1)
                _write_frame(writer, {"op": "ready", "cpu": time.process_time()})
                await writer.drain()
                window = size * max(depth, iters // 20, 1)
                if test == "write_bw":
                    total, got = size * iters, 0
                    stamps, cum = [], []
                    t0 = time.perf_counter_ns()
                    read = reader.read
                    while got < total:
                        data = await read(min(TCP_READ, total - got))
                        if not data:
                            return
                        got += len(data)
                        stamps.append(time.perf_counter_ns())
                        cum.append(got)
                    _write_frame(writer, {"op": "done", "peak": peak_rate(t0, stamps, cum, window)})
                    await writer.drain()
                elif test == "send_bw":
                    stamps = [0] * iters
                    t0 = time.perf_counter_ns()
                    readexactly, unpack = reader.readexactly, _HDR.unpack
                    for i in range(iters):
                        (n,) = unpack(await readexactly(4))
                        await readexactly(n)
                        stamps[i] = time.perf_counter_ns()
                    cum = [size * (k + 1) for k in range(iters)]
                    _write_frame(writer, {"op": "done", "peak": peak_rate(t0, stamps, cum, window)})
                    await writer.drain()
                elif test in ("read_bw", "read_lat"):
                    left = iters
                    data = payload[:size]
                    while left:
                        reqs = await reader.read(left)
                        if not reqs:
                            return
                        for _ in range(len(reqs)):
                            writer.write(data)
                        left -= len(reqs)
                        await writer.drain()
                elif test == "atomic_lat":
                    for _ in range(iters):
                        (add,) = _Q.unpack(await reader.readexactly(8))
                        writer.write(_Q.pack(counter))
                        counter = (counter + add) & 0xFFFFFFFFFFFFFFFF
                        await writer.drain()
                elif test == "send_lat":
                    readexactly, unpack = reader.readexactly, _HDR.unpack
                    for _ in range(iters):
                        hdr = await readexactly(4)
                        body = await readexactly(unpack(hdr)[0])
                        writer.write(hdr + body)
                        await writer.drain()
                elif test == "write_lat":
                    readexactly = reader.readexactly
                    for _ in range(iters):
                        writer.write(await readexactly(size))
                        await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            state.active -= 1
            writer.close()
            if last and not args.persistent:
                state.finished.set()

    return await asyncio.start_server(session, args.bind, port, limit=tcp_limit(args))


class TcpClient:
    def __init__(self, args: argparse.Namespace, host: str, port: int, max_size: int) -> None:
        self.args = args
        self.host = host
        self.port = port
        self.buf = bytearray(max_size)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=tcp_limit(self.args))
        _nodelay(self.writer)

    async def close(self, last: bool) -> None:
        if self.writer is None:
            return
        try:
            _write_frame(self.writer, {"op": "bye", "last": last})
            await self.writer.drain()
        finally:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except ConnectionError:
                pass
            self.reader = self.writer = None

    async def phase(self, test: str, size: int, iters: int, depth: int) -> Measurement:
        reader, writer = self.reader, self.writer
        assert reader is not None and writer is not None
        _write_frame(writer, {"op": "phase", "test": test, "size": size, "iters": iters, "depth": depth})
        await writer.drain()
        ready = await _read_frame(reader)
        assert ready and ready.get("op") == "ready", ready
        cpu0 = time.process_time()
        m = Measurement("tcp", test, size, iters, 0, depth)
        view = memoryview(self.buf)[:size]
        clock = time.perf_counter_ns
        write, drain = writer.write, writer.drain
        readexactly = reader.readexactly
        if test == "write_bw":
            m.t0_ns = clock()
            for _ in range(iters):
                write(view)
                await drain()
            done = await _read_frame(reader)
            m.elapsed_ns = clock() - m.t0_ns
            m.peak_Bps = done["peak"]
        elif test == "send_bw":
            hdr = _HDR.pack(size)
            m.t0_ns = clock()
            for _ in range(iters):
                write(hdr)
                write(view)
                await drain()
            done = await _read_frame(reader)
            m.elapsed_ns = clock() - m.t0_ns
            m.peak_Bps = done["peak"]
        elif test in ("read_bw", "read_lat"):
            depth = depth if test == "read_bw" else 1
            post = [0] * iters
            stamps = [0] * iters
            first = min(depth, iters)
            m.t0_ns = clock()
            for k in range(first):
                post[k] = m.t0_ns
            write(b"\x01" * first)
            await drain()
            sent = first
            for i in range(iters):
                await readexactly(size)
                stamps[i] = clock()
                if sent < iters:
                    post[sent] = stamps[i]
                    write(b"\x01")
                    sent += 1
                    await drain()
            m.elapsed_ns = clock() - m.t0_ns
            m.lat_samples_ns = [d - p for d, p in zip(stamps, post)]
            if test == "read_bw":
                m.done_stamps = stamps
        elif test == "atomic_lat":
            one = _Q.pack(1)

            async def faa() -> None:
                write(one)
                await drain()
                await readexactly(8)

            await _serial(m, faa, iters, half=False)
        elif test == "send_lat":
            msg = _HDR.pack(size) + bytes(view)
            unpack = _HDR.unpack

            async def pingpong() -> None:
                write(msg)
                await drain()
                await readexactly(unpack(await readexactly(4))[0])

            await _serial(m, pingpong, iters, half=True)
        elif test == "write_lat":

            async def pingpong() -> None:
                write(view)
                await drain()
                await readexactly(size)

            await _serial(m, pingpong, iters, half=True)
        else:  # pragma: no cover
            raise ValueError(test)
        m.cpu_client_s = time.process_time() - cpu0
        _write_frame(writer, {"op": "cpu"})
        await writer.drain()
        m.cpu_server_s = (await _read_frame(reader))["cpu"] - ready["cpu"]
        return m


# ------------------------------------------------------------- running ----


async def _measure(client: Any, args: argparse.Namespace, size: int, iters: int, last: bool) -> Measurement:
    """One transport, one size: fresh connection, warm-up, (calibration), measurement."""
    test = args.test
    depth = args.tx_depth if TESTS[test][0] == "bw" else 1
    await client.open()
    try:
        if args.duration:
            # calibrate: probes that grow (at most 8x) until one lasts 0.2 s (they are the
            # warm-up too), then as many iterations as fit the duration at the probe's rate
            probe_n = max(depth, 10) if args.warmup is None else max(1, args.warmup)
            while True:
                probe = await asyncio.wait_for(client.phase(test, size, probe_n, depth), PHASE_TIMEOUT)
                if probe.elapsed_ns >= 0.2e9 or probe_n >= 1 << 22:
                    break
                probe_n = int(probe_n * min(8.0, max(2.0, 0.3e9 / max(probe.elapsed_ns, 1))))
            per_op = max(probe.elapsed_ns, 1) / probe_n / 1e9
            iters = max(10, int(args.duration / per_op))
        else:
            warm = warmup_for(args, iters)
            if warm:
                await asyncio.wait_for(client.phase(test, size, warm, depth), PHASE_TIMEOUT)
        m = await asyncio.wait_for(client.phase(test, size, iters, depth), PHASE_TIMEOUT + (args.duration or 0) * 4)
    finally:
        await client.close(last)
    return m


def _record(
    args: argparse.Namespace, rdma: Measurement, rdma_client: RdmaClient, base: Measurement | None
) -> dict[str, Any]:
    kind = TESTS[args.test][0]
    rec: dict[str, Any] = {
        "test": args.test,
        "transport": "aiordma",
        "provider": rdma_client.device,
        "loop": args.loop,
        "progress": rdma_client.progress,
        "poll_window_us": rdma_client.poll_window_us,
        "size": rdma.size,
        "tx_depth": rdma.tx_depth,
    }
    rec.update(rdma.summary())
    if kind == "lat":
        rec["latency"] = LATENCY_KIND[args.test]
    elif rdma.info.get("post_list"):
        rec["post_list"] = rdma.info["post_list"]
        rec["latency"] = "per chain of post_list writes, post to completion"
    else:
        rec["latency"] = "per operation, post to completion, with tx_depth outstanding"
    if base is not None:
        b = {"transport": f"tcp ({args.loop} streams)", "size": base.size, "tx_depth": base.tx_depth}
        b.update(base.summary())
        rec["baseline"] = b
        if kind == "bw":
            rec["ratio"] = rec["bw_MBps"] / b["bw_MBps"] if b["bw_MBps"] else None
            rec["ratio_basis"] = "bw_MBps aiordma/baseline"
        else:
            rec["ratio"] = b["lat_us"]["p50"] / rec["lat_us"]["p50"] if rec["lat_us"]["p50"] else None
            rec["ratio_basis"] = "lat_us.p50 baseline/aiordma"
    else:
        rec["baseline"] = None
        rec["ratio"] = None
    rec["host"] = {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()}
    rec["time"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return rec


# --------------------------------------------------------------- table ----

BW_HEADER = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"
LAT_HEADER = (
    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]"
    "   99% percentile[usec]   99.9% percentile[usec] "
)
RULE = "-" * 120


def _banner(args: argparse.Namespace, device: str, progress: str, poll_window_us: float | None = None) -> str:
    kind, title = TESTS[args.test]
    if progress == "event" and poll_window_us is not None:
        progress += (
            f" (polls {poll_window_us:g} us after each post/completion, then sleeps)"
            if poll_window_us
            else " (no poll window)"
        )
    lines = [
        RULE,
        f"                    {title}  (aiordma)",
        f" Device          : {device}",
        f" Event loop      : {args.loop}",
        f" Progress mode   : {progress}",
    ]
    if kind == "bw":
        lines.append(f" TX depth        : {args.tx_depth}")
        if args.post_list > 1:
            lines.append(f" Post list       : {args.post_list} writes per doorbell, the last signaled")
    else:
        lines.append(f" Latency         : {LATENCY_KIND[args.test]}")
    if args.baseline == "tcp":
        lines.append(
            f" Baseline        : asyncio TCP streams on {args.loop}, same pattern and sizes, measured in this run"
        )
        basis = "aiordma/tcp BW average" if kind == "bw" else "tcp/aiordma t_typical"
        lines.append(f" ratio           : {basis} (higher is better)")
    lines.append(" CPU[usec/op]    : process CPU time (all threads) per operation at each end")
    lines.append(RULE)
    hdr = BW_HEADER if kind == "bw" else LAT_HEADER
    lines.append(hdr + "   transport         ratio  CPU[usec/op] client+server")
    return "\n".join(lines)


def _row(kind: str, size: int, s: dict[str, Any], label: str, ratio: float | None) -> str:
    if kind == "bw":
        core = f" {size:<10d} {s['iterations']:<14d} {s['bw_peak_MBps']:<18.2f} {s['bw_MBps']:<20.2f} {s['msg_rate_Mpps']:<14.6f}"
    else:
        lat = s["lat_us"]
        core = (
            f" {size:<6d} {s['iterations']:<14d} {lat['min']:<14.2f} {lat['max']:<12.2f} {lat['p50']:<18.2f}"
            f" {lat['avg']:<14.2f} {lat['stdev']:<15.2f} {lat['p99']:<22.2f} {lat['p999']:<23.2f}"
        )
    r = f"{ratio:.2f}" if ratio is not None else ""
    cpu = s.get("cpu_us_per_op")
    c = f"{cpu['client']:.1f}+{cpu['server']:.1f}" if cpu else ""
    return f"{core}  {label:<17s} {r:<6s} {c}"


def print_rows(rec: dict[str, Any]) -> None:
    kind = TESTS[rec["test"]][0]
    print(_row(kind, rec["size"], rec, "aiordma", rec.get("ratio")))
    if rec.get("baseline"):
        print(_row(kind, rec["size"], rec["baseline"], "tcp (baseline)", None))
    trouble = []
    for end, c in (rec.get("counters") or {}).items():
        bad = {k: v for k, v in c.items() if k in TROUBLE and v}
        if bad:
            trouble.append(f"{end}: " + ", ".join(f"{k}={v}" for k, v in sorted(bad.items())))
    if trouble:
        print(f"   ^ soft device recovered from loss/overrun during this measurement ({'; '.join(trouble)})")
    sys.stdout.flush()


# ------------------------------------------------------------ processes ----


def _child_argv(args: argparse.Namespace, serve: str) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "aiordma.tools.bench",
        args.test,
        "--server",
        "--serve",
        serve,
        "--port",
        "0",
        "--bind",
        "127.0.0.1",
        "--provider",
        args.provider,
        "--loop",
        args.loop,
        "--progress",
        args.progress,
        "--tx-depth",
        str(args.tx_depth),
        "--rx-depth",
        str(rx_depth(args)),
        "--max-size",
        str(args.max_size),
        "--tcp-limit",
        str(tcp_limit(args)),
    ]
    if args.size:
        argv += ["--size", str(args.size)]
    return argv


async def _spawn(args: argparse.Namespace, serve: str) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # the child must import the same aiordma as this process
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    prof = os.environ.get("AIORDMA_BENCH_PROFILE_SERVER")
    argv = _child_argv(args, serve)
    if prof:  # cProfile the server end too: AIORDMA_BENCH_PROFILE_SERVER=/path/prefix
        argv = [argv[0], "-m", "cProfile", "-o", f"{prof}.{serve}.prof", "-m", "aiordma.tools.bench"] + argv[3:]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    try:
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            if not line:
                code = await proc.wait()
                raise SystemExit(
                    f"aiordma bench: the {serve} server end exited ({code}) before it was ready: {shlex.join(argv)}"
                )
            text = line.decode(errors="replace").strip()
            if text.startswith(READY):
                return proc, json.loads(text[len(READY) :])
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise SystemExit(f"aiordma bench: the {serve} server end did not start within 60 s") from None


async def _reap(proc: asyncio.subprocess.Process) -> None:
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except TimeoutError:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def client_main(args: argparse.Namespace) -> int:
    sizes = sizes_for(args)
    children: list[asyncio.subprocess.Process] = []
    try:
        if args.client:
            host = args.client
            rdma_port = args.port
            tcp_port = args.tcp_port if args.tcp_port is not None else args.port + 1
        else:
            host = "127.0.0.1"
            proc, info = await _spawn(args, "rdma")
            children.append(proc)
            rdma_port = info["rdma_port"]
            tcp_port = 0
            if args.baseline == "tcp":
                proc, info = await _spawn(args, "tcp")
                children.append(proc)
                tcp_port = info["tcp_port"]
        rdma = RdmaClient(args, host, rdma_port, max(sizes))
        tcp = TcpClient(args, host, tcp_port, max(sizes)) if args.baseline == "tcp" else None
        printed = False
        failures = 0
        for idx, size in enumerate(sizes):
            last = idx == len(sizes) - 1
            iters = iters_for(args, size)
            try:
                m_rdma = await _measure(rdma, args, size, iters, last)
            except (TimeoutError, RDMAErrorType()) as e:
                # a failed size is a result too: say so and go on with the next size
                failures += 1
                rdma.conn = None
                rec = {
                    "test": args.test,
                    "transport": "aiordma",
                    "provider": rdma.device,
                    "loop": args.loop,
                    "progress": rdma.progress,
                    "size": size,
                    "iterations": iters,
                    "error": f"{type(e).__name__}: {e}",
                }
                if args.json:
                    print(json.dumps(rec), flush=True)
                else:
                    if not printed:
                        print(_banner(args, rdma.device or args.provider, rdma.progress or args.progress))
                        printed = True
                    print(f" {size:<10d} {iters:<14d} FAILED: {rec['error']}", flush=True)
                if tcp is not None and last:  # the baseline server leaves after its last goodbye
                    await _measure(tcp, args, size, min(iters, 16), last)
                continue
            m_tcp = await _measure(tcp, args, size, iters, last) if tcp is not None else None
            rec = _record(args, m_rdma, rdma, m_tcp)
            if args.json:
                print(json.dumps(rec), flush=True)
            else:
                if not printed:
                    print(_banner(args, rdma.device, rdma.progress, rdma.poll_window_us))
                    printed = True
                print_rows(rec)
        if not args.json:
            print(RULE, flush=True)
    finally:
        for proc in children:
            await _reap(proc)
    return 1 if failures else 0


async def server_main(args: argparse.Namespace) -> int:
    serve = args.serve or ("both" if args.baseline == "tcp" else "rdma")
    args.serve = serve
    state = _ServerState()
    info: dict[str, Any] = {}
    servers = []
    if serve in ("rdma", "both"):
        s = await _rdma_serve(args, state, args.port)
        servers.append(s)
        info["rdma_port"] = s.port
    if serve in ("tcp", "both"):
        tcp_port = args.tcp_port if args.tcp_port is not None else (0 if args.port == 0 else args.port + 1)
        s = await _tcp_serve(args, state, tcp_port)
        servers.append(s)
        info["tcp_port"] = s.sockets[0].getsockname()[1]
    print(f"{READY} {json.dumps(info)}", flush=True)
    if not args.client and serve == "both":
        print(
            f"aiordma bench: serving {args.test} (aiordma on {info['rdma_port']}, TCP baseline on {info['tcp_port']})",
            file=sys.stderr,
        )
    await state.finished.wait()
    while state.active:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)
    for s in servers:
        s.close()
    for s in servers:
        await s.wait_closed()
    return 0


def RDMAErrorType() -> type:
    from aiordma import RDMAError

    return RDMAError


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(args: argparse.Namespace) -> int:
    if args.server and args.client:
        raise SystemExit("aiordma bench: --server and --client are exclusive")
    if args.post_list < 1 or (args.post_list > 1 and args.test != "write_bw"):
        raise SystemExit("--post-list must be >= 1, and above 1 only for write_bw")
    if args.tx_depth < 1:
        raise SystemExit("aiordma bench: --tx-depth must be at least 1")
    if args.duration is not None and args.duration <= 0:
        raise SystemExit("aiordma bench: --duration must be positive")
    prof = os.environ.get("AIORDMA_BENCH_PROFILE_CLIENT")
    main = server_main if args.server else client_main
    with asyncio.Runner(loop_factory=_loop_factory(args.loop)) as runner:
        if prof and not args.server:  # cProfile the client end: AIORDMA_BENCH_PROFILE_CLIENT=out.prof
            import cProfile

            pr = cProfile.Profile()
            pr.enable()
            try:
                return runner.run(main(args))
            finally:
                pr.disable()
                pr.dump_stats(prof)
        return runner.run(main(args))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiordma.tools.bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
