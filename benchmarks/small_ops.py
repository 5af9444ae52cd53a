#!/usr/bin/env python3
"""Small operations against asyncio TCP: the issue-31 bars, measured as the issue asks.

Everything goes through the public API with default settings, both ends on this
host (the server ends in child processes), and every aiordma figure is taken next
to its asyncio TCP baseline in the same run: ``--rounds`` (at least 5) rounds,
each measuring aiordma and then TCP, so the two alternate; a bar's verdict is on
the median of the per-round ratios, its range beside it, and CPU per operation
(both processes) beside the rates. Items:

``reads64``
    8 connections, each awaiting one 64 B RDMA Read after the other
    (``await conn.read(remote, into=region)``), against 8 TCP connections each
    making one 64 B request/response RPC after the other. Bar: >= 1.5 x TCP's rate.
``post_write``
    8 connections, 4 KiB ``post_write`` kept 16 deep on each, against 8 TCP
    streams writing 4 KiB messages (``aiordma bench write_bw``'s baseline). Bar: >= 1.0.
``write_batch``
    8 connections, 4 KiB writes in ``write_batch`` calls of 16, against the same
    TCP baseline. Bar: >= 2.0.
``reads64_spin``
    ``reads64`` with a process spinning on a CPU beside both (on 2 cores: the
    client, the server and the spinner share them). Bar: >= 1.0.
``send_lat``
    ``aiordma bench send_lat -s 64 -D D`` (one connection, its own TCP baseline):
    p50 >= 1.0 x TCP's, CPU per round trip (both ends) <= TCP's.
``kv``
    ``benchmarks/kv.py --rounds N``: the one-sided key-value service >= 0.75 x
    the TCP RPC service's KV ops/s.

    python benchmarks/small_ops.py                       # every item, asyncio and uvloop, 5 rounds, -D 2
    python benchmarks/small_ops.py --only reads64 --loops uvloop --rounds 5 -D 1
    python benchmarks/small_ops.py --json out.json --markdown out.md --note 'quiet 2-core VM'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(HERE), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import bars  # noqa: E402

from aiordma.tools import bench  # noqa: E402

ITEMS = ("reads64", "post_write", "write_batch", "reads64_spin", "send_lat", "kv")
LOOPS = ("asyncio", "uvloop")
MIN_ROUNDS = 5
CONNS = 8
TARGETS = {
    "reads64": ">= 1.5",
    "post_write": ">= 1.0",
    "write_batch": ">= 2.0",
    "reads64_spin": ">= 1.0",
    "kv": ">= 0.75",
}
TITLES = {
    "reads64": "8 connections: 64 B awaited RDMA Reads vs 64 B TCP RPCs",
    "post_write": "8 connections: 4 KiB post_write, 16 deep",
    "write_batch": "8 connections: 4 KiB write_batch of 16",
    "reads64_spin": "8 connections: 64 B reads beside a CPU-spinning process",
    "kv": "benchmarks/kv.py: KV ops/s",
}
#: per item: (bench test, size, depth, post_list)
SHAPES = {
    "reads64": ("read_lat", 64, 1, 1),
    "reads64_spin": ("read_lat", 64, 1, 1),
    "post_write": ("write_bw", 4096, 16, 1),
    "write_batch": ("write_bw", 4096, 16, 16),
}


def _bench_args(loop: str, size: int, depth: int, post_list: int) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(
        ["write_bw", "-s", str(size), "-t", str(depth), "--loop", loop, "--provider", "soft", "--max-size", "4096"]
    )
    args.post_list = post_list
    return args


async def _cell(kind: str, clients: list[Any], test: str, size: int, iters: int, depth: int) -> dict[str, Any]:
    """Every client's phase at once; aggregate rate and CPU per operation of both processes."""
    start = asyncio.Barrier(len(clients))
    ms = await asyncio.gather(*[c.phase(test, size, iters, depth, start) for c in clients])
    t0 = min(m.t0_ns for m in ms)
    t1 = max(m.t0_ns + m.elapsed_ns for m in ms)
    n = sum(m.iterations for m in ms)
    # each client measured its process's CPU over about the same window: the mean is the process's
    client = sum(m.cpu_client_s for m in ms) / len(ms) * 1e6 / n
    server = sum(m.cpu_server_s for m in ms) / len(ms) * 1e6 / n
    return {
        "transport": kind,
        "ops": n,
        "seconds": (t1 - t0) / 1e9,
        "rate": n / ((t1 - t0) / 1e9),
        "cpu_us_per_op": {"client": client, "server": server, "total": client + server},
    }


class Spinner:
    """A process that keeps one CPU busy (``while True: pass``) while it lives."""

    def __enter__(self) -> Spinner:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


async def conn_item(item: str, loop: str, rounds: int, duration: float) -> list[dict[str, Any]]:
    """``rounds`` rounds of one 8-connection item: aiordma, then TCP, each about ``duration`` s."""
    test, size, depth, post_list = SHAPES[item]
    args = _bench_args(loop, size, depth, post_list)
    rdma_proc, info = await bench._spawn(args, "rdma")
    tcp_proc, tinfo = await bench._spawn(args, "tcp")
    procs = [rdma_proc, tcp_proc]
    out = []
    try:
        rdma = [bench.RdmaClient(args, "127.0.0.1", info["rdma_port"], 4096) for _ in range(CONNS)]
        tcp = [bench.TcpClient(args, "127.0.0.1", tinfo["tcp_port"], 4096) for _ in range(CONNS)]
        for c in rdma + tcp:
            await c.open()
        packet_path = rdma[0].packet_path  # (what carries the packets: conn.path.transport)
        # warm-up, and a probe of each side's rate to size the measured phases
        iters = {}
        for kind, clients in (("aiordma", rdma), ("tcp", tcp)):
            probe = await _cell(kind, clients, test, size, 200 if depth == 1 else 512, depth)
            iters[kind] = max(64, int(probe["rate"] * duration / CONNS) // post_list * post_list)
        for r in range(rounds):
            with Spinner() if item == "reads64_spin" else _Nothing():
                await bars_settle([p.pid for p in procs])
                a = await _cell("aiordma", rdma, test, size, iters["aiordma"], depth)
                await bars_settle([p.pid for p in procs])
                t = await _cell("tcp", tcp, test, size, iters["tcp"], depth)
            a["packet_path"] = packet_path
            out.append({"round": r, "aiordma": a, "tcp": t, "ratio": a["rate"] / t["rate"]})
            sys.stderr.write(
                f"  {item} {loop} round {r + 1}/{rounds}: {a['rate']:,.0f} vs {t['rate']:,.0f} ops/s "
                f"= {a['rate'] / t['rate']:.2f} x TCP\n"
            )
        for c in rdma + tcp:
            await c.close(last=False)
    finally:
        for p in procs:
            p.terminate()
            try:
                await asyncio.wait_for(p.wait(), 5)
            except TimeoutError:
                p.kill()
                await p.wait()
    return out


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


async def bars_settle(pids: list[int]) -> None:
    """Wait until the server processes are idle (scaling.py's rule)."""
    import scaling

    await scaling.settle(pids)


def _stat(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def conn_bar(item: str, loop: str, runs: list[dict[str, Any]]) -> bars.Bar:
    return bars.Bar(
        TITLES[item],
        loop,
        TARGETS[item],
        _stat([r["ratio"] for r in runs]),
        aiordma=_stat([r["aiordma"]["rate"] for r in runs]),
        tcp=_stat([r["tcp"]["rate"] for r in runs]),
        cpu_aiordma=_stat([r["aiordma"]["cpu_us_per_op"]["total"] for r in runs]),
        cpu_tcp=_stat([r["tcp"]["cpu_us_per_op"]["total"] for r in runs]),
        raw_unit="ops/s",
        notes=sorted({f"packets: {r['aiordma']['packet_path']}" for r in runs if r["aiordma"].get("packet_path")}),
        commands=[f"python benchmarks/small_ops.py --only {item} --loops {loop}"],
    )


def send_lat_bars(runner: bars.Runner, loop: str, rounds: int, duration: float) -> list[bars.Bar]:
    recs = [
        bars.bench(runner, "send_lat", ["-s", "64", "-D", str(duration)], loop, "soft", None) for _ in range(rounds)
    ]
    p50, cpu = bars.lat_bars("default settings", loop, recs)
    p50.target, cpu.target = ">= 1.0", "<= 1.0"
    return [p50, cpu]


def kv_bar(runner: bars.Runner, loop: str, rounds: int) -> bars.Bar:
    doc = bars.kv(runner, loop, "soft", rounds, 6000, 200)
    by_round: dict[int, dict[str, Any]] = {}
    for r in doc.get("rounds", []):
        by_round.setdefault(r["round"], {})[r["transport"]] = r
    pairs = [(r["aiordma"], r["tcp"]) for r in by_round.values() if "aiordma" in r and "tcp" in r]
    return bars.Bar(
        TITLES["kv"],
        loop,
        TARGETS["kv"],
        _stat([a["kv_ops_per_s"] / t["kv_ops_per_s"] for a, t in pairs if t["kv_ops_per_s"]]),
        aiordma=_stat([a["kv_ops_per_s"] for a, _ in pairs]),
        tcp=_stat([t["kv_ops_per_s"] for _, t in pairs]),
        cpu_aiordma=_stat([a["server_cpu_us_per_kv_op"] + a["client_cpu_us_per_kv_op"] for a, _ in pairs]),
        cpu_tcp=_stat([t["server_cpu_us_per_kv_op"] + t["client_cpu_us_per_kv_op"] for _, t in pairs]),
        raw_unit="KV ops/s",
        notes=[doc["error"][:300]] if "error" in doc else [],
        commands=[doc["command"]],
    )


def markdown_table(results: list[bars.Bar]) -> str:
    """The bars as a Markdown table: the figure (median, min–max), both sides' rates and CPU."""
    lines = [
        "| bar | loop | figure | target | met | aiordma | asyncio TCP | CPU aiordma | CPU TCP |",
        "|---|---|---:|---|:-:|---:|---:|---:|---:|",
    ]
    for b in results:
        d = b.as_dict()
        met = {True: "yes", False: "**no**", None: "no data"}[d["met"]]
        raw = f" {b.raw_unit}" if b.raw_unit else ""
        cpu_a, cpu_t = d["cpu_us_per_op"]["aiordma"], d["cpu_us_per_op"]["tcp"]
        lines.append(
            f"| {b.name} | {b.loop} | {bars._cell(b.value, 2)} | {d['target']} | {met} | "
            f"{bars._cell(b.aiordma, 0)}{raw} | {bars._cell(b.tcp, 0)}{raw} | "
            f"{bars._cell(cpu_a)} {b.cpu_unit if cpu_a else ''} | {bars._cell(cpu_t)} {b.cpu_unit if cpu_t else ''} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--only", default=",".join(ITEMS), help=f"comma-separated items (default all: {','.join(ITEMS)})")
    p.add_argument("--loops", default=",".join(LOOPS), help="event loops (default asyncio,uvloop)")
    p.add_argument(
        "--rounds", type=int, default=MIN_ROUNDS, help=f"alternating rounds (default and least {MIN_ROUNDS})"
    )
    p.add_argument("-D", "--duration", type=float, default=2.0, help="seconds per measurement (default 2)")
    p.add_argument("--json", type=Path, default=None, help="write every figure and the verdicts as JSON here")
    p.add_argument("--markdown", type=Path, default=None, help="write the table as Markdown here")
    p.add_argument("--note", default="", help="a line about the machine and its load, for the report")
    opts = p.parse_args(argv)
    items = [i for i in opts.only.split(",") if i]
    loops = [x for x in opts.loops.split(",") if x]
    bad = [i for i in items if i not in ITEMS] + [x for x in loops if x not in LOOPS]
    if bad:
        p.error(f"unknown item or loop: {', '.join(bad)} (items: {', '.join(ITEMS)}; loops: {', '.join(LOOPS)})")
    if opts.rounds < MIN_ROUNDS:
        p.error(f"--rounds must be at least {MIN_ROUNDS} (the issue's rule for a bar)")
    if opts.duration <= 0:
        p.error("-D must be positive")
    runner = bars.Runner(timeout=600)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0 = os.getloadavg()
    results: list[bars.Bar] = []
    raw: dict[str, Any] = {}
    for loop in loops:
        for item in items:
            sys.stderr.write(f"{item} on {loop}\n")
            if item in SHAPES:
                if loop == "uvloop":
                    import uvloop

                    runs = uvloop.run(conn_item(item, loop, opts.rounds, opts.duration))
                else:
                    runs = asyncio.run(conn_item(item, loop, opts.rounds, opts.duration))
                raw[f"{item}.{loop}"] = runs
                results.append(conn_bar(item, loop, runs))
            elif item == "send_lat":
                results.extend(send_lat_bars(runner, loop, opts.rounds, opts.duration))
            else:
                results.append(kv_bar(runner, loop, opts.rounds))
    header = (
        f"Issue-31 bars, {started}: soft device, default settings, {opts.rounds} alternating aiordma/TCP rounds, "
        f"-D {opts.duration:g}. Machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"load {' '.join(f'{x:.2f}' for x in load0)} at the start, "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end" + (f"; {opts.note}" if opts.note else "") + "."
    )
    table = markdown_table(results)
    print(header + "\n\n" + table)
    if opts.markdown:
        opts.markdown.write_text(
            header
            + "\n\n"
            + table
            + "\n\nReproduce: `python benchmarks/small_ops.py "
            + " ".join(argv if argv is not None else sys.argv[1:])
            + "`\n"
        )
    if opts.json:
        opts.json.write_text(
            json.dumps(
                {"header": header, "bars": [b.as_dict() for b in results], "raw": raw, "log": runner.log}, indent=1
            )
            + "\n"
        )
    return 0 if all(b.met for b in results) else 1


if __name__ == "__main__":
    sys.exit(main())
