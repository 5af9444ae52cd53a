#!/usr/bin/env python3
"""Scaling check: aggregate RDMA Write bandwidth and per-operation latency
over 1, 8, 64 connections x queue depths 1, 16, 128.

One server process (the ``aiordma bench`` server end, on loopback) and this
client process; every connection writes ``--size`` bytes into the server's
exposed region with ``depth`` writes outstanding, all connections at once.
Aggregate bandwidth = all bytes / (first post → last completion over every
connection), every connection starting at once (after the server said ready
to all of them, so no connection's setup is timed); latency = post →
completion of each write (so it includes the queueing that depth implies). The asyncio TCP baseline (one stream per
connection, write + drain, in the same run) is given per connection count.
Iteration counts are small on purpose: it is a shape check, not a soak.

    python benchmarks/scaling.py                    # the 3 x 3 grid, ~1-2 minutes
    python benchmarks/scaling.py --conns 1,8 --depths 1,16 --loop uvloop
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import Progress, process_cpu_ns  # noqa: E402

from aiordma.tools import bench  # noqa: E402


def _udp_rcvbuf_errors() -> int | None:
    """The kernel's count of UDP datagrams dropped for a full receive buffer (this host)."""
    try:
        lines = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines() if line.startswith("Udp:")]
        return int(lines[1][lines[0].index("RcvbufErrors")])
    except (OSError, ValueError, IndexError):
        return None


def _bench_args(opts: argparse.Namespace, depth: int) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(
        [
            "write_bw",
            "-s",
            str(opts.size),
            "-t",
            str(depth),
            "--rx-depth",
            "4",
            "--provider",
            opts.provider,
            "--loop",
            opts.loop,
            "--progress",
            opts.progress,
            "--max-size",
            str(max(opts.size, 4096)),
        ]
    )


def _ops_per_conn(opts: argparse.Namespace, conns: int, depth: int) -> int:
    return max(2 * depth, opts.ops // conns, 8)


async def rdma_cell(opts: argparse.Namespace, port: int, conns: int, depth: int) -> dict[str, Any]:
    args = _bench_args(opts, depth)
    clients = [bench.RdmaClient(args, "127.0.0.1", port, opts.size) for _ in range(conns)]
    for c in clients:
        await c.open()
    ops = _ops_per_conn(opts, conns, depth)
    drops0 = _udp_rcvbuf_errors()
    start = asyncio.Barrier(conns)  # every connection starts moving data once all are ready
    rec: dict[str, Any] = {
        "transport": "aiordma",
        "conns": conns,
        "depth": depth,
        "size": opts.size,
        "ops_per_conn": ops,
    }
    try:
        # warm-up (not counted), then all connections at once
        await asyncio.gather(*[c.phase("write_bw", opts.size, min(ops, 2 * depth), depth) for c in clients])
        ms = await asyncio.wait_for(
            asyncio.gather(*[c.phase("write_bw", opts.size, ops, depth, start) for c in clients]), opts.cell_timeout
        )
    except Exception as e:  # a cell that fails is a result too (e.g. retry exceeded under overload)
        rec["error"] = f"{type(e).__name__}: {e}"
        for c in clients:
            if c.conn is not None:
                c.conn.abort()
                c.conn = None
        return rec
    finally:
        for c in clients:
            try:
                await c.close(last=False)
            except Exception:
                pass
    t0 = min(m.t0_ns for m in ms)
    t1 = max(m.t0_ns + m.elapsed_ns for m in ms)
    nbytes = sum(m.size * m.iterations for m in ms)
    lat = bench.lat_stats([s for m in ms for s in (m.lat_samples_ns or [])])
    counters: dict[str, int] = {}
    for m in ms:
        for end in ("client", "server"):
            for k, v in m.counters.get(end, {}).items():
                if k in bench.TROUBLE:
                    counters[k] = counters.get(k, 0) + v
    drops1 = _udp_rcvbuf_errors()
    rec.update(
        {
            "bw_MBps": nbytes / ((t1 - t0) / 1e9) / bench.MB,
            "msg_rate_Mpps": sum(m.iterations for m in ms) / ((t1 - t0) / 1e9) / 1e6,
            "lat_us": lat,
            "cpu_us_per_op": _cpu_per_op(ms),
            "trouble": counters,
            "udp_rcvbuf_errors": (drops1 - drops0) if drops0 is not None and drops1 is not None else None,
        }
    )
    return rec


async def tcp_cell(opts: argparse.Namespace, port: int, conns: int) -> dict[str, Any]:
    args = _bench_args(opts, 16)
    clients = [bench.TcpClient(args, "127.0.0.1", port, opts.size) for _ in range(conns)]
    for c in clients:
        await c.open()
    ops = _ops_per_conn(opts, conns, 16)
    start = asyncio.Barrier(conns)
    try:
        await asyncio.gather(*[c.phase("write_bw", opts.size, min(ops, 32), 16) for c in clients])
        ms = await asyncio.wait_for(
            asyncio.gather(*[c.phase("write_bw", opts.size, ops, 16, start) for c in clients]), opts.cell_timeout
        )
    finally:
        for c in clients:
            await c.close(last=False)
    t0 = min(m.t0_ns for m in ms)
    t1 = max(m.t0_ns + m.elapsed_ns for m in ms)
    nbytes = sum(m.size * m.iterations for m in ms)
    return {
        "transport": "tcp",
        "conns": conns,
        "depth": 16,
        "size": opts.size,
        "ops_per_conn": ops,
        "bw_MBps": nbytes / ((t1 - t0) / 1e9) / bench.MB,
        "msg_rate_Mpps": sum(m.iterations for m in ms) / ((t1 - t0) / 1e9) / 1e6,
        "cpu_us_per_op": _cpu_per_op(ms),
    }


def _cpu_per_op(ms: list[Any]) -> dict[str, float] | None:
    """Process CPU per write at each end. Every connection's phase ran at the same
    time in the same two processes and each measured its process's CPU over about
    the same window: their mean is the process's CPU for all the writes."""
    if any(m.cpu_client_s is None or m.cpu_server_s is None for m in ms):
        return None
    n = sum(m.iterations for m in ms)
    client = sum(m.cpu_client_s for m in ms) / len(ms) * 1e6 / n
    server = sum(m.cpu_server_s for m in ms) / len(ms) * 1e6 / n
    return {"client": client, "server": server, "total": client + server}


def _table(rows: list[dict[str, Any]], tcp: dict[int, dict[str, Any]]) -> str:
    out = [
        " conns  depth  ops/conn  agg BW[MB/sec]  MsgRate[Mpps]  lat p50[usec]  lat p99[usec]  "
        "tcp agg BW[MB/sec]  ratio  CPU[usec/op] aiordma/tcp  trouble",
    ]
    for r in rows:
        t = tcp.get(r["conns"])
        tbw = f"{t['bw_MBps']:.1f}" if t else "n/a"
        if "error" in r:
            out.append(f" {r['conns']:<6d} {r['depth']:<6d} {r['ops_per_conn']:<9d} FAILED: {r['error'][:120]}")
            continue
        ratio = f"{r['bw_MBps'] / t['bw_MBps']:.2f}" if t else ""
        trouble = ", ".join(f"{k}={v}" for k, v in sorted(r["trouble"].items()) if v)
        if r.get("udp_rcvbuf_errors"):
            trouble += (", " if trouble else "") + f"kernel UDP RcvbufErrors={r['udp_rcvbuf_errors']}"
        lat = r["lat_us"]
        ca, ct = r.get("cpu_us_per_op"), (t or {}).get("cpu_us_per_op")
        cpu = f"{ca['total']:.1f}/{ct['total']:.1f}" if ca and ct else (f"{ca['total']:.1f}/-" if ca else "")
        out.append(
            f" {r['conns']:<6d} {r['depth']:<6d} {r['ops_per_conn']:<9d} {r['bw_MBps']:<15.2f} {r['msg_rate_Mpps']:<14.5f} "
            f"{lat['p50']:<14.1f} {lat['p99']:<14.1f} {tbw:<19s} {ratio:<6s} {cpu:<24s} {trouble}"
        )
    return "\n".join(out)


async def settle(pids: list[int], quiet_ns: int = 2_000_000, period: float = 0.05, limit: float = 3.0) -> None:
    """Wait until the server processes are idle (under ``quiet_ns`` of CPU in ``period``
    seconds, at most ``limit`` seconds): a cell's teardown (closing its connections)
    must not run during the next cell, which may be the other transport's. This
    process collects its garbage first, so that no collection of the last cell's
    objects falls into the next."""
    gc.collect()
    deadline = time.monotonic() + limit
    before = sum(process_cpu_ns(p) for p in pids)
    while time.monotonic() < deadline:
        await asyncio.sleep(period)
        now = sum(process_cpu_ns(p) for p in pids)
        if now - before < quiet_ns:
            return
        before = now


async def main_async(opts: argparse.Namespace) -> int:
    conns_list = [int(x) for x in opts.conns.split(",") if x]
    depths = [int(x) for x in opts.depths.split(",") if x]
    args = _bench_args(opts, max(depths))
    rdma_proc, info = await bench._spawn(args, "rdma")
    procs = [rdma_proc]
    tcp_port = None
    if opts.baseline == "tcp":
        tcp_proc, tinfo = await bench._spawn(args, "tcp")
        procs.append(tcp_proc)
        tcp_port = tinfo["tcp_port"]
    pids = [p.pid for p in procs]
    bar = Progress(len(conns_list) * (len(depths) + (1 if tcp_port else 0)))
    rows: list[dict[str, Any]] = []
    tcp: dict[int, dict[str, Any]] = {}
    t_start = time.monotonic()
    try:
        for conns in conns_list:
            if tcp_port:
                bar.label = f"tcp x{conns}"
                bar.draw()
                await settle(pids)
                tcp[conns] = await tcp_cell(opts, tcp_port, conns)
                bar.step()
            for depth in depths:
                bar.label = f"aiordma x{conns} depth {depth}"
                bar.draw()
                await settle(pids)
                rows.append(await rdma_cell(opts, info["rdma_port"], conns, depth))
                bar.step()
    finally:
        bar.finish()
        for p in procs:
            p.terminate()
            try:
                await asyncio.wait_for(p.wait(), 5)
            except TimeoutError:
                p.kill()
                await p.wait()
    elapsed = time.monotonic() - t_start
    table = _table(rows, tcp)
    header = (
        f"aiordma scaling: RDMA Write of {opts.size} B, provider {opts.provider}, loop {opts.loop}, "
        f"progress {opts.progress}; {elapsed:.0f} s"
    )
    print(header)
    print(table)
    opts.out.mkdir(parents=True, exist_ok=True)
    with open(opts.out / "scaling.json", "w") as f:
        for r in rows + list(tcp.values()):
            r = dict(
                r,
                loop=opts.loop,
                provider=opts.provider,
                progress=opts.progress,
                time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            )
            f.write(json.dumps(r) + "\n")
    (opts.out / "scaling.md").write_text(f"{header}\n\n```\n{table}\n```\n")
    sys.stderr.write(f"wrote {opts.out / 'scaling.json'} and {opts.out / 'scaling.md'}\n")
    return 0 if not any("error" in r for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--conns", default="1,8,64", help="connection counts (default 1,8,64)")
    p.add_argument("--depths", default="1,16,128", help="outstanding writes per connection (default 1,16,128)")
    p.add_argument("-s", "--size", type=bench.parse_size, default=4096, help="bytes per write (default 4096)")
    p.add_argument(
        "--ops", type=int, default=2000, help="writes per cell, spread over the connections (at least 2 x depth each)"
    )
    p.add_argument("--provider", default="soft", choices=("soft", "pyverbs", "auto"))
    p.add_argument("--loop", default="asyncio", choices=("asyncio", "uvloop"))
    p.add_argument("--progress", default="event", choices=("event", "thread", "busy"))
    p.add_argument("--baseline", default="tcp", choices=("tcp", "none"))
    p.add_argument("--cell-timeout", type=float, default=120.0, help="seconds allowed per cell")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    opts = p.parse_args(argv)
    with asyncio.Runner(loop_factory=bench._loop_factory(opts.loop)) as runner:
        return runner.run(main_async(opts))


if __name__ == "__main__":
    sys.exit(main())
