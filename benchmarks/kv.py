#!/usr/bin/env python3
"""One-sided key-value service vs the same work as TCP RPCs: throughput, server CPU, server Python.

The aiordma side is ``examples/kv_server.py`` in its own process: a hash table
and counters in registered memory, which the server never touches again.
``--clients`` clients (connections of this process, default 8) run a mix of
GET (RDMA Read), PUT (RDMA Read + compare-and-swap lock + RDMA Write +
fetch-and-add unlock) and INCR (fetch-and-add) on it. The baseline is the
same mix, the same keys and values in the same order, as RPCs over asyncio
TCP streams to an asyncio server (another process) that does the work itself
(a dict and a list of counters), measured in the same run on the same loop
kind. ``--rounds`` alternates the two (aiordma round, TCP round, ...) and
reports the median and the range.

Figures:

* KV ops/s: KV operations / wall time from the first to the last completion
  (every client at once);
* server CPU: the server process's CPU time (every thread, from
  ``/proc/PID/task/*/schedstat``, nanoseconds; ``/proc/PID/stat`` ticks where
  schedstat is missing) over the measured window, per KV operation and, for
  aiordma, per one-sided operation (what the issue-14 bar is about: <= 5 µs
  for 10,000 one-sided ops);
* server Python: bytecodes the server process runs (every thread) per
  operation, counted in a separate run of ``--count-ops`` KV operations
  against a second server process under ``benchmarks/cost.py``'s counter
  (counting slows Python down, so it never overlaps the timed rounds); the
  bar is 0, which only an engine that does the NIC's work outside Python
  (the native engine, or hardware) can meet;
* client CPU per KV op (this process), latency percentiles per KV op.

    python benchmarks/kv.py                          # 8 clients, 6000 KV ops (~10,500 one-sided), 1 round
    python benchmarks/kv.py --rounds 5 --loop uvloop --json kv.json
    python benchmarks/kv.py --clients 2 --ops 200 --count-ops 50 --rounds 1   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import select
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
EXAMPLES = ROOT / "examples"
for _p in (str(HERE), str(EXAMPLES), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import cost  # noqa: E402
from kv_store import KVClient, KVStats, Layout  # noqa: E402
from run import process_cpu_ns  # noqa: E402

import aiordma  # noqa: E402

MIX_DEFAULT = "get=50,put=25,incr=25"
OPS = ("get", "put", "incr")
SERVER_TIMEOUT = 60.0
BAR_SERVER_CPU_US = 5.0

# --------------------------------------------------------------- workload ----


@dataclass(frozen=True)
class Workload:
    clients: int
    ops: int  # KV operations per round, over all clients
    mix: dict[str, int]  # op -> weight
    keys: int
    value_size: int
    counters: int
    seed: int

    def key(self, i: int) -> bytes:
        return b"key-%06d" % i

    def value(self, i: int, version: int) -> bytes:
        head = b"%d:%d:" % (i, version)
        return (head + b"v" * self.value_size)[: self.value_size]

    def script(self, client: int, n: int, round_: int) -> list[tuple[str, int, int]]:
        """Client ``client``'s ``n`` operations of round ``round_``: (op, key or counter, value version).
        The same for both transports."""
        rng = random.Random(self.seed * 1_000_003 + round_ * 1009 + client)
        ops = list(self.mix)
        weights = [self.mix[o] for o in ops]
        out = []
        for j in range(n):
            op = rng.choices(ops, weights)[0]
            target = rng.randrange(self.counters) if op == "incr" else rng.randrange(self.keys)
            out.append((op, target, j))
        return out

    def per_client(self) -> list[int]:
        base, extra = divmod(self.ops, self.clients)
        return [base + (1 if c < extra else 0) for c in range(self.clients)]


def parse_mix(text: str) -> dict[str, int]:
    mix: dict[str, int] = {}
    for part in text.split(","):
        name, sep, weight = part.partition("=")
        name = name.strip()
        if not sep or name not in OPS:
            raise ValueError(f"--mix: {part!r} is not OP=WEIGHT with OP one of {', '.join(OPS)}")
        try:
            w = int(weight)
        except ValueError:
            raise ValueError(f"--mix: the weight of {name} must be an integer, not {weight!r}") from None
        if w < 0:
            raise ValueError(f"--mix: the weight of {name} must not be negative")
        mix[name] = w
    if not any(mix.values()):
        raise ValueError("--mix: at least one weight must be positive")
    return {k: v for k, v in mix.items() if v}


# ------------------------------------------------------------ servers ----


class ServerProcess:
    """A server in a child process; its first stdout line matching ``pattern`` gives its port."""

    def __init__(self, argv: list[str], pattern: str, what: str) -> None:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.what = what
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.banner = ""
        deadline = time.monotonic() + SERVER_TIMEOUT
        assert self.proc.stdout is not None
        while True:
            left = deadline - time.monotonic()
            ready = select.select([self.proc.stdout], [], [], max(0.0, left))[0] if left > 0 else []
            line = self.proc.stdout.readline() if ready else ""
            if not line:
                err = self.proc.stderr.read() if self.proc.poll() is not None and self.proc.stderr else ""
                self.stop()
                raise SystemExit(f"kv.py: {what} did not start: {err.strip()[-2000:]}")
            m = re.search(pattern, line)
            if m:
                self.port = int(m.group(1))
                self.banner = line.strip()
                return

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> str:
        """Stop it (SIGTERM); what it printed after its banner."""
        out = ""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                out, _ = self.proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, _ = self.proc.communicate()
        return out or ""


# the TCP baseline: a request is "<BHH" (op, key length, value length) + key + value; the
# reply "<BH" (status, value length) + value. INCR carries the counter (u32) as the key
# and the delta (i64) as the value, and gets the new value (u64) back.
REQ = struct.Struct("<BHH")
REP = struct.Struct("<BH")
OP_GET, OP_PUT, OP_INCR = 1, 2, 3
U32, I64, U64 = struct.Struct("<I"), struct.Struct("<q"), struct.Struct("<Q")
MASK64 = (1 << 64) - 1


async def _tcp_server_main(port: int, counters: int) -> asyncio.Server:
    """An asyncio TCP key-value server doing the work itself (the baseline)."""
    table: dict[bytes, bytes] = {}
    values = [0] * counters

    async def session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            import socket

            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        readexactly, write = reader.readexactly, writer.write
        try:
            while True:
                op, klen, vlen = REQ.unpack(await readexactly(REQ.size))
                body = await readexactly(klen + vlen)
                key, value = body[:klen], body[klen:]
                if op == OP_GET:
                    v = table.get(key)
                    write(REP.pack(0, 0) if v is None else REP.pack(1, len(v)) + v)
                elif op == OP_PUT:
                    table[key] = value
                    write(REP.pack(1, 0))
                else:
                    (idx,) = U32.unpack(key)
                    (delta,) = I64.unpack(value)
                    values[idx] = new = (values[idx] + delta) & MASK64
                    write(REP.pack(1, 8) + U64.pack(new))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(session, "127.0.0.1", port)


def _tcp_server(args: argparse.Namespace) -> int:
    import signal

    async def main() -> None:
        server = await _tcp_server_main(0, args.counters)
        print(f"tcp kv server listening on 127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        server.close()
        await server.wait_closed()

    with asyncio.Runner(loop_factory=cost._loop_factory(args.loop)) as runner:
        runner.run(main())
    return 0


def _counted_server(args: argparse.Namespace) -> int:
    """A kv server (aiordma or TCP) in a process counting its own Python (cost.py's counter)."""

    async def main(ready: cost.ReadyFn, quit_: asyncio.Event) -> None:
        if args.counted_server == "tcp":
            server = await _tcp_server_main(0, args.counters)
            ready({"port": server.sockets[0].getsockname()[1], "engine": "tcp"})
            await quit_.wait()
            server.close()
            await server.wait_closed()
            return
        import kv_server

        layout = Layout(args.buckets, 32, max(1, args.value_size), args.counters)
        kv = await kv_server.start(layout, "127.0.0.1", 0, provider=args.provider)
        ready({"port": kv.port, "engine": cost.engine_of(kv.device)})
        await quit_.wait()
        await kv.close()

    return cost.counted_child(main, args.loop)


# ------------------------------------------------------------ clients ----


class TcpKVClient:
    """The baseline's client: the same operations as RPCs."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.stats = KVStats()

    @classmethod
    async def connect(cls, port: int) -> TcpKVClient:
        import socket

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    async def _call(self, op: int, key: bytes, value: bytes) -> bytes | None:
        self.writer.write(REQ.pack(op, len(key), len(value)) + key + value)
        await self.writer.drain()
        status, n = REP.unpack(await self.reader.readexactly(REP.size))
        data = await self.reader.readexactly(n) if n else b""
        return data if status else None

    async def get(self, key: bytes) -> bytes | None:
        self.stats.gets += 1
        return await self._call(OP_GET, key, b"")

    async def put(self, key: bytes, value: bytes) -> None:
        self.stats.puts += 1
        await self._call(OP_PUT, key, value)

    async def incr(self, index: int, delta: int = 1) -> int:
        self.stats.incrs += 1
        data = await self._call(OP_INCR, U32.pack(index), I64.pack(delta))
        assert data is not None
        return int(U64.unpack(data)[0])

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass


async def _run_script(client: Any, w: Workload, script: list[tuple[str, int, int]], lat: list[int]) -> None:
    clock = time.perf_counter_ns
    get, put, incr = client.get, client.put, client.incr
    for op, target, version in script:
        t = clock()
        if op == "get":
            value = await get(w.key(target))
            if value is None:
                raise RuntimeError(f"GET {w.key(target)!r}: not found (every key was stored first)")
        elif op == "put":
            await put(w.key(target), w.value(target, version))
        else:
            await incr(target, 1)
        lat.append(clock() - t)


async def _connect_clients(transport: str, port: int, n: int, provider: str | None) -> list[Any]:
    if transport == "aiordma":
        return list(await asyncio.gather(*[KVClient.connect("127.0.0.1", port, provider=provider) for _ in range(n)]))
    return list(await asyncio.gather(*[TcpKVClient.connect(port) for _ in range(n)]))


async def preload(transport: str, port: int, w: Workload, provider: str | None) -> None:
    """Store every key once (not measured), so that every GET finds its key."""
    clients = await _connect_clients(transport, port, min(4, w.clients), provider)
    try:

        async def fill(c: Any, keys: range) -> None:
            for i in keys:
                await c.put(w.key(i), w.value(i, 0))

        n = len(clients)
        await asyncio.gather(*[fill(c, range(k, w.keys, n)) for k, c in enumerate(clients)])
    finally:
        for c in clients:
            await c.close()


@dataclass
class RoundResult:
    transport: str
    round: int
    kv_ops: int
    one_sided_ops: int | None
    elapsed_s: float
    server_cpu_s: float
    client_cpu_s: float
    lat_us: dict[str, float]
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def ops_per_s(self) -> float:
        return self.kv_ops / self.elapsed_s

    def summary(self) -> dict[str, Any]:
        out = {
            "transport": self.transport,
            "round": self.round,
            "kv_ops": self.kv_ops,
            "one_sided_ops": self.one_sided_ops,
            "elapsed_s": round(self.elapsed_s, 4),
            "kv_ops_per_s": round(self.ops_per_s, 1),
            "server_cpu_ms": round(self.server_cpu_s * 1e3, 2),
            "server_cpu_us_per_kv_op": round(self.server_cpu_s * 1e6 / self.kv_ops, 2),
            "server_cpu_us_per_one_sided_op": (
                round(self.server_cpu_s * 1e6 / self.one_sided_ops, 2) if self.one_sided_ops else None
            ),
            "client_cpu_us_per_kv_op": round(self.client_cpu_s * 1e6 / self.kv_ops, 2),
            "lat_us": self.lat_us,
            "stats": self.stats,
        }
        return out


def _lat(samples: list[int]) -> dict[str, float]:
    v = sorted(samples)
    if not v:
        return {}

    def q(p: float) -> float:
        return round(v[max(0, min(len(v) - 1, int(p * len(v) + 0.5) - 1))] / 1000, 1)

    return {"p50": q(0.5), "p99": q(0.99), "max": round(v[-1] / 1000, 1)}


async def measure(transport: str, port: int, pid: int, w: Workload, round_: int, provider: str | None) -> RoundResult:
    """One round: connect the clients, warm up, then every client runs its script at once."""
    clients = await _connect_clients(transport, port, w.clients, provider)
    try:
        warm = [c for c in clients]
        await asyncio.gather(
            *[
                _run_script(c, w, w.script(k, max(2, n // 20), -1 - round_), [])
                for k, (c, n) in enumerate(zip(warm, w.per_client()))
            ]
        )
        before = [KVStats(**vars(c.stats)) for c in clients]
        scripts = [w.script(k, n, round_) for k, n in enumerate(w.per_client())]
        lat: list[int] = []
        cpu0, srv0 = time.process_time(), process_cpu_ns(pid)
        t0 = time.perf_counter()
        await asyncio.gather(*[_run_script(c, w, s, lat) for c, s in zip(clients, scripts)])
        elapsed = time.perf_counter() - t0
        srv1, cpu1 = process_cpu_ns(pid), time.process_time()
    finally:
        for c in clients:
            await c.close()
    total = KVStats()
    for c, b in zip(clients, before):
        d = KVStats(**{k: getattr(c.stats, k) - getattr(b, k) for k in vars(b)})
        total.add(d)
    one_sided = total.one_sided_ops if transport == "aiordma" else None
    return RoundResult(
        transport=transport,
        round=round_,
        kv_ops=total.kv_ops,
        one_sided_ops=one_sided,
        elapsed_s=elapsed,
        server_cpu_s=(srv1 - srv0) / 1e9,
        client_cpu_s=cpu1 - cpu0,
        lat_us=_lat(lat),
        stats={k: v for k, v in vars(total).items() if v},
    )


async def count_server(transport: str, args: argparse.Namespace, w: Workload) -> dict[str, Any]:
    """Bytecodes the server process runs per operation, counted (every thread) in a
    separate server process over ``--count-ops`` KV operations."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--counted-server", transport, "--loop", args.loop]
    argv += ["--buckets", str(args.buckets), "--value-size", str(args.value_size), "--counters", str(args.counters)]
    if args.provider:
        argv += ["--provider", args.provider]
    proc = cost.CountedProcess(argv, f"kv.py: the counted {transport} server")
    try:
        port = proc.info["port"]
        await preload(transport, port, w, args.provider)
        counted = Workload(
            min(w.clients, args.count_ops), args.count_ops, w.mix, w.keys, w.value_size, w.counters, w.seed
        )
        clients = await _connect_clients(transport, port, counted.clients, args.provider)
        try:
            # a warm-up with the connections the count uses, then settle (the server's last ACKs)
            await asyncio.gather(
                *[_run_script(c, counted, counted.script(k, 5, -99), []) for k, c in enumerate(clients)]
            )
            await asyncio.sleep(0.05)
            before = [KVStats(**vars(c.stats)) for c in clients]
            proc.ask("count-start")
            scripts = [counted.script(k, n, 0) for k, n in enumerate(counted.per_client())]
            await asyncio.gather(*[_run_script(c, counted, s, []) for c, s in zip(clients, scripts)])
            await asyncio.sleep(0.05)
            functions, threads, _cpu = proc.counts()
        finally:
            for c in clients:
                await c.close()
    finally:
        proc.close()
    total = KVStats()
    for c, b in zip(clients, before):
        total.add(KVStats(**{k: getattr(c.stats, k) - getattr(b, k) for k in vars(b)}))
    ops = sum(f.ops for f in functions)
    top: dict[str, int] = {}
    for f in functions:
        top[f.file] = top.get(f.file, 0) + f.ops
    return {
        "transport": transport,
        "engine": proc.info.get("engine"),
        "counter": proc.info.get("backend"),
        "kv_ops": total.kv_ops,
        "one_sided_ops": total.one_sided_ops if transport == "aiordma" else None,
        "bytecodes": ops,
        "bytecodes_per_kv_op": round(ops / max(1, total.kv_ops), 1),
        "bytecodes_per_one_sided_op": (
            round(ops / total.one_sided_ops, 1) if transport == "aiordma" and total.one_sided_ops else None
        ),
        "by_thread": [{"thread": n, "bytecodes": o} for n, o, _c in threads],
        "by_file": dict(sorted(top.items(), key=lambda kv: -kv[1])[:12]),
    }


# -------------------------------------------------------------- report ----


def _stat(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(rounds: list[RoundResult]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for transport in ("aiordma", "tcp"):
        rs = [r for r in rounds if r.transport == transport]
        if not rs:
            continue
        s: dict[str, Any] = {
            "rounds": len(rs),
            "kv_ops_per_s": _stat([r.ops_per_s for r in rs]),
            "server_cpu_us_per_kv_op": _stat([r.server_cpu_s * 1e6 / r.kv_ops for r in rs]),
            "client_cpu_us_per_kv_op": _stat([r.client_cpu_s * 1e6 / r.kv_ops for r in rs]),
            "lat_p50_us": _stat([r.lat_us["p50"] for r in rs]),
            "lat_p99_us": _stat([r.lat_us["p99"] for r in rs]),
            "kv_ops": rs[0].kv_ops,
        }
        if transport == "aiordma":
            s["server_cpu_us_per_one_sided_op"] = _stat(
                [r.server_cpu_s * 1e6 / r.one_sided_ops for r in rs if r.one_sided_ops]
            )
            s["one_sided_ops"] = _stat([float(r.one_sided_ops or 0) for r in rs])
        out[transport] = s
    return out


def _fmt(s: dict[str, float], digits: int = 1) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def report(doc: dict[str, Any]) -> str:
    cfg, summ, counted = doc["config"], doc["summary"], doc.get("bytecodes", {})
    lines = [
        "-" * 110,
        f" KV service: {cfg['clients']} clients, {cfg['ops']} KV ops per round ({cfg['mix']}), {cfg['keys']} keys of "
        f"{cfg['value_size']} B values, {cfg['rounds']} round(s) alternating aiordma/TCP",
        f" aiordma: {doc['aiordma_server']}",
        f" machine: {doc['machine']['cpus']} CPUs, Python {doc['machine']['python']}, loop {cfg['loop']}, "
        f"soft engine {doc['machine']['engine']}; load average {doc['machine']['loadavg']}",
        " figures: median (min-max) over the rounds; server CPU from /proc (every thread of the server process)",
        "-" * 110,
        f" {'':9} {'KV ops/s':>22} {'server CPU us/KV op':>24} {'us/one-sided op':>22} {'client CPU us/KV op':>22}"
        f" {'p50 us':>8} {'bytecodes/op':>14}",
    ]
    for t in ("aiordma", "tcp"):
        if t not in summ:
            continue
        s = summ[t]
        per1 = _fmt(s["server_cpu_us_per_one_sided_op"], 2) if "server_cpu_us_per_one_sided_op" in s else "-"
        bc = counted.get(t)
        bcs = "-" if bc is None else f"{bc['bytecodes_per_kv_op']:.0f}"
        lines.append(
            f" {t:9} {_fmt(s['kv_ops_per_s'], 0):>22} {_fmt(s['server_cpu_us_per_kv_op'], 2):>24} {per1:>22} "
            f"{_fmt(s['client_cpu_us_per_kv_op'], 1):>22} {s['lat_p50_us']['median']:>8.1f} {bcs:>14}"
        )
    if "aiordma" in summ:
        a = summ["aiordma"]
        lines.append(
            f" one-sided ops per round: {_fmt(a['one_sided_ops'], 0)} "
            f"({a['one_sided_ops']['median'] / a['kv_ops']:.2f} per KV op)"
        )
        if "tcp" in summ:
            t = summ["tcp"]
            lines.append(
                f" aiordma / TCP: KV ops/s {a['kv_ops_per_s']['median'] / t['kv_ops_per_s']['median']:.2f}x, "
                f"server CPU per KV op {a['server_cpu_us_per_kv_op']['median'] / t['server_cpu_us_per_kv_op']['median']:.2f}x"
            )
    bc = counted.get("aiordma")
    if bc is not None:
        lines.append(
            f" server bytecodes (counted over {bc['kv_ops']} KV ops = {bc['one_sided_ops']} one-sided ops, "
            f"{bc['counter']}): {bc['bytecodes']} in all, {bc['bytecodes_per_one_sided_op']} per one-sided op"
        )
    for bar in doc["bars"]:
        lines.append(f" bar: {bar['bar']}: {bar['value']} -> {'met' if bar['met'] else 'NOT MET'}")
    lines.append(f" reproduce: {doc['command']}")
    lines.append("-" * 110)
    return "\n".join(lines)


def _engine(provider: str | None) -> str:
    try:
        dev = aiordma.open_device(provider)
    except Exception as e:  # a machine without the device says so in the report
        return f"unavailable ({e})"
    try:
        return cost.engine_of(dev)
    finally:
        dev.close()


async def run(args: argparse.Namespace, w: Workload) -> dict[str, Any]:
    kv_argv = [
        sys.executable,
        str(EXAMPLES / "kv_server.py"),
        "--port",
        "0",
        "--buckets",
        str(args.buckets),
        "--value-size",
        str(max(1, args.value_size)),
        "--counters",
        str(args.counters),
        "--loop",
        args.loop,
    ]
    if args.provider:
        kv_argv += ["--provider", args.provider]
    servers: list[ServerProcess] = []
    rounds: list[RoundResult] = []
    try:
        kv = ServerProcess(kv_argv, r"listening on [\d.]+:(\d+)", "the aiordma kv server")
        servers.append(kv)
        tcp = None
        if args.baseline == "tcp":
            tcp_argv = [sys.executable, str(Path(__file__).resolve()), "--tcp-server", "--loop", args.loop]
            tcp_argv += ["--counters", str(args.counters)]
            tcp = ServerProcess(tcp_argv, r"listening on [\d.]+:(\d+)", "the TCP kv server")
            servers.append(tcp)
        await preload("aiordma", kv.port, w, args.provider)
        if tcp is not None:
            await preload("tcp", tcp.port, w, args.provider)
        for r in range(args.rounds):
            rounds.append(await measure("aiordma", kv.port, kv.pid, w, r, args.provider))
            if tcp is not None:
                rounds.append(await measure("tcp", tcp.port, tcp.pid, w, r, args.provider))
            if not args.json_only:
                for rr in rounds[-2:] if tcp is not None else rounds[-1:]:
                    s = rr.summary()
                    print(
                        f"   round {r + 1} {rr.transport:8}: {s['kv_ops_per_s']:.0f} KV ops/s, server CPU "
                        f"{s['server_cpu_us_per_kv_op']:.2f} us/KV op",
                        file=sys.stderr,
                        flush=True,
                    )
        banner = kv.banner
    finally:
        for server in servers:
            server.stop()
    counted: dict[str, Any] = {}
    if args.count_ops:
        counted["aiordma"] = await count_server("aiordma", args, w)
        if args.baseline == "tcp":
            counted["tcp"] = await count_server("tcp", args, w)
    summ = summarise(rounds)
    bars = []
    if "aiordma" in summ:
        per1 = summ["aiordma"]["server_cpu_us_per_one_sided_op"]["median"]
        bars.append(
            {
                "bar": f"server CPU <= {BAR_SERVER_CPU_US:g} us per one-sided op",
                "value": round(per1, 2),
                "met": per1 <= BAR_SERVER_CPU_US,
            }
        )
    if "aiordma" in counted:
        bc = counted["aiordma"]["bytecodes"]
        bars.append({"bar": "0 Python bytecodes in the server per one-sided op", "value": bc, "met": bc == 0})
    return {
        "benchmark": "aiordma-kv",
        "config": {
            "clients": w.clients,
            "ops": w.ops,
            "mix": ",".join(f"{k}={v}" for k, v in w.mix.items()),
            "keys": w.keys,
            "value_size": w.value_size,
            "counters": w.counters,
            "buckets": args.buckets,
            "rounds": args.rounds,
            "loop": args.loop,
            "provider": args.provider or os.environ.get("AIORDMA_PROVIDER") or "auto",
            "count_ops": args.count_ops,
            "seed": w.seed,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "engine": _engine(args.provider),
            "loadavg": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        },
        "aiordma_server": banner,
        "rounds": [r.summary() for r in rounds],
        "summary": summ,
        "bytecodes": counted,
        "bars": bars,
        "command": "python benchmarks/kv.py " + " ".join(args.argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (connections), default 8")
    p.add_argument("--ops", type=int, default=6000, help="KV operations per round over all clients (default 6000)")
    p.add_argument("--rounds", type=int, default=1, help="alternating aiordma/TCP rounds (default 1)")
    p.add_argument("--mix", default=MIX_DEFAULT, help=f"operation weights (default {MIX_DEFAULT})")
    p.add_argument("--keys", type=int, default=1000, help="distinct keys (default 1000)")
    p.add_argument("--value-size", type=int, default=32, help="bytes per value (default 32)")
    p.add_argument("--buckets", type=int, default=4096, help="hash-table slots on the server (default 4096)")
    p.add_argument("--counters", type=int, default=64, help="fetch-and-add counters (default 64)")
    p.add_argument(
        "--count-ops",
        type=int,
        default=1000,
        help="KV operations in the run that counts the servers' bytecodes (default 1000; 0 skips it)",
    )
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio", help="event loop of every process")
    p.add_argument("--provider", choices=("auto", "soft", "pyverbs"), default=None, help="device provider")
    p.add_argument("--baseline", choices=("tcp", "none"), default="tcp", help="TCP RPC baseline (default tcp)")
    p.add_argument("--seed", type=int, default=1, help="workload seed (default 1)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-': stdout only)")
    p.add_argument("--tcp-server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--counted-server", choices=("aiordma", "tcp"), default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw)
    args.argv = raw
    if args.tcp_server:
        return _tcp_server(args)
    if args.counted_server:
        return _counted_server(args)
    for name in ("clients", "ops", "rounds", "keys", "buckets", "counters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.count_ops < 0:
        p.error("--count-ops must not be negative")
    if not 1 <= args.value_size <= 0xFFFF:
        p.error("--value-size must be between 1 and 65535 bytes")
    if args.keys > args.buckets:
        p.error(f"--keys ({args.keys}) must not exceed --buckets ({args.buckets}): the table would be full")
    if args.ops < args.clients:
        p.error("--ops must be at least --clients (every client does at least one operation)")
    try:
        mix = parse_mix(args.mix)
    except ValueError as e:
        p.error(str(e))
    args.json_only = args.json == "-"
    w = Workload(args.clients, args.ops, mix, args.keys, args.value_size, args.counters, args.seed)
    with asyncio.Runner(loop_factory=cost._loop_factory(args.loop)) as runner:
        doc = runner.run(run(args, w))
    if args.json == "-":
        print(json.dumps(doc, indent=2))
    else:
        print(report(doc))
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
