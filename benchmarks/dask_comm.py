#!/usr/bin/env python3
"""Dask's ``rdma://`` comm backend against its ``tcp://`` backend, same run.

Three bars (issue 15), each measured in alternating rdma/tcp rounds on each
event loop Dask can run (``distributed.admin.event-loop``: asyncio, uvloop):

``comm_bw``   one 64 MiB numpy frame through ``Comm.write`` / ``Comm.read``
              between two processes (the peer answers each with a small ack),
              30 frames per round after 3 unmeasured ones: MB/s, target >= 1x
              TCP's;
``pingpong``  a small dict (a few keys) written and echoed back through a
              ``Comm``: round-trip p50, target <= 1.25x TCP's;
``cluster``   ``LocalCluster(n_workers=2, processes=True)``:
              ``(x + x.T).sum()`` of a 16000x16000 float64 array in
              4000x4000 chunks: the same result as over TCP in <= 1.1x its wall
              time (cluster start-up excluded), with the backend's byte
              counters accounting for the worker-to-worker transfers Dask's
              ``transfer_incoming_log`` records. A fresh cluster per round,
              ``--cluster-computes`` computations in it (3), the round's figure
              their median; before the rounds, one unmeasured cluster per
              protocol (the run's first cluster pays for cold caches). One
              computation's time swings by 2x either way with the kernel's
              work on the workers' fresh memory (page faults, huge-page
              compaction: their system time), which the median of several
              damps.
``workload``  the issue-33 workload, as a user of ``LocalCluster(protocol=...,
              n_workers=2)`` runs it: a ``--workload-size`` square float64
              array (20000) in tenths as chunks (2000 x 2000), two computations:
              ``transpose_sum`` ``(x + x.T).sum()`` and ``rechunk_sum``
              ``x.rechunk((n, n // 100)).sum(axis=0)`` (Dask's P2P rechunk).
              One cluster per protocol, both kept for the whole bar, each warmed
              by one unmeasured pass of both computations; then rounds that
              alternate the protocols (warm rounds, one client process). Target:
              the same result in <= 1.0 x TCP's wall time (median of the rounds);
              beside it the CPU time of the workers and the scheduler per
              computation (steadier than wall time on a shared machine).

CPU: the comm bars report the CPU time of both processes per operation, which
a busy machine disturbs less than wall-clock figures. Medians over the rounds,
with the range beside them.

    python benchmarks/dask_comm.py                       # every bar, both loops, 3 rounds
    python benchmarks/dask_comm.py --quick               # 1 round, fewer iterations
    python benchmarks/dask_comm.py --only comm_bw,pingpong --loops uvloop --json out.json
    python benchmarks/dask_comm.py --cluster-size 8000   # a smaller array for the cluster bar
    python benchmarks/dask_comm.py --only workload --loops asyncio --rounds 5

The soft device's engine is the one aiordma picks (``AIORDMA_SOFT_ENGINE``);
the report names it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aiordma.tools import int_type, size_type  # noqa: E402

BARS = ("comm_bw", "pingpong", "cluster", "workload")
WORKLOAD_COMPUTATIONS = ("transpose_sum", "rechunk_sum")
LOOPS = ("asyncio", "uvloop")
PROTOCOLS = ("rdma", "tcp")
SMALL_MSG = {"op": "ping", "key": "x-1234", "n": 42, "ok": True}


def _loop_factory(loop: str) -> Any:
    if loop == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def _run(coro: Any, loop: str) -> Any:
    with asyncio.Runner(loop_factory=_loop_factory(loop)) as runner:
        return runner.run(coro)


# ----------------------------------------------------------- the peer ----


async def _serve_raw() -> None:
    """The peer of the raw figure: aiordma alone, each message received into a new
    buffer of its size (what the backend does for a large frame), a small ack back."""
    import numpy as np

    import aiordma

    done = asyncio.Event()

    async def handle(conn: aiordma.Connection) -> None:
        while True:
            head = await conn.recv()
            if head == b"stop":
                done.set()
                return
            if head == b"cpu":
                await conn.send(str(time.process_time()).encode())
                continue
            n = int(head)
            buf = np.empty(n, dtype="u1")
            await conn.recv_into(buf)
            await conn.send(str(int(buf[:: 1 << 16].sum())).encode())

    server = await aiordma.start_server(handle, "127.0.0.1", 0, provider="soft", registration_cache=0)
    print(f"127.0.0.1:{server.port}", flush=True)
    await done.wait()
    server.close()
    await server.close_clients()
    await server.wait_closed()


async def _raw_round(address: str, opts: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    import aiordma

    host, port = address.rsplit(":", 1)
    conn = await aiordma.connect(host, int(port), provider="soft", registration_cache=0)
    try:
        await conn.send(b"cpu")
        peer_cpu0 = float(await conn.recv())
        cpu0 = time.process_time()
        arr = np.random.default_rng(0).integers(0, 255, opts.size, dtype="u1")
        expect = int(arr[:: 1 << 16].sum())
        for i in range(opts.warmup_bw + opts.iters_bw):
            if i == opts.warmup_bw:
                t0 = time.perf_counter()
            await conn.send(str(arr.nbytes).encode())
            await conn.send(arr, wait_pulled=False)
            if int(await conn.recv()) != expect:
                raise AssertionError("the peer got other bytes")
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        await conn.send(b"cpu")
        peer_cpu = float(await conn.recv()) - peer_cpu0
        await conn.send(b"stop")
        await conn.drain()
        n = opts.iters_bw
        return {
            "value": arr.nbytes * n / elapsed / 1e6,
            "seconds": elapsed,
            "iters": n,
            "cpu_us_per_op": (cpu + peer_cpu) / n * 1e6,
        }
    finally:
        await conn.close()


async def _serve(protocol: str) -> None:
    """The peer process: listen, answer every message, report CPU on request."""
    if protocol == "raw":
        return await _serve_raw()
    from distributed.comm import listen

    import aiordma.integrations.dask  # noqa: F401  (the rdma backend's defaults)

    done = asyncio.Event()

    async def handle(comm: Any) -> None:
        try:
            while True:
                msg = await comm.read()
                if isinstance(msg, dict) and msg.get("op") == "ping":
                    await comm.write(msg)
                elif isinstance(msg, dict) and msg.get("op") == "cpu":
                    await comm.write({"cpu": time.process_time()})
                elif isinstance(msg, dict) and msg.get("op") == "stop":
                    done.set()
                    return
                else:
                    x = msg["x"]
                    await comm.write({"n": int(x.nbytes), "sum": float(x[:: 1 << 16].sum())})
        except Exception:
            pass
        finally:
            await comm.close()

    host = "127.0.0.1"
    listener = await listen(f"{protocol}://{host}", handle, deserialize=True)
    print(listener.contact_address, flush=True)
    await done.wait()
    listener.stop()


# ------------------------------------------------------------ comm bars ----


class Peer:
    def __init__(self, protocol: str, loop: str) -> None:
        env = dict(os.environ, DASK_DISTRIBUTED__ADMIN__EVENT_LOOP=loop)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", protocol, "--serve-loop", loop],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert self.proc.stdout is not None
        self.address = self.proc.stdout.readline().strip()
        if not self.address:
            raise RuntimeError(f"the {protocol} peer did not start (exit {self.proc.wait()})")

    def close(self) -> None:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _comm_round(address: str, bar: str, opts: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from distributed.comm import connect
    from distributed.protocol import to_serialize

    comm = await connect(address)
    try:
        await comm.write({"op": "cpu"})
        peer_cpu0 = (await comm.read())["cpu"]
        cpu0 = time.process_time()
        if bar == "comm_bw":
            arr = np.random.default_rng(0).random(opts.size // 8)
            expect = float(arr[:: 1 << 16].sum())
            for _ in range(opts.warmup_bw):
                await comm.write({"x": to_serialize(arr)})
                await comm.read()
            t0 = time.perf_counter()
            for _ in range(opts.iters_bw):
                await comm.write({"x": to_serialize(arr)})
                ack = await comm.read()
                if ack["n"] != arr.nbytes or ack["sum"] != expect:
                    raise AssertionError(f"the peer got other bytes: {ack}")
            elapsed = time.perf_counter() - t0
            n = opts.iters_bw
            value = arr.nbytes * n / elapsed / 1e6
            extra = {"bytes": arr.nbytes, "iters": n, "seconds": elapsed}
        else:
            for _ in range(opts.warmup_pp):
                await comm.write(SMALL_MSG)
                await comm.read()
            lat = []
            for _ in range(opts.iters_pp):
                t0 = time.perf_counter()
                await comm.write(SMALL_MSG)
                got = await comm.read()
                lat.append(time.perf_counter() - t0)
                if got != SMALL_MSG:
                    raise AssertionError(f"the echo differs: {got}")
            n = opts.iters_pp
            lat.sort()
            value = lat[len(lat) // 2] * 1e6
            extra = {"p99_us": lat[int(len(lat) * 0.99)] * 1e6, "iters": n}
        cpu = time.process_time() - cpu0
        await comm.write({"op": "cpu"})
        peer_cpu = (await comm.read())["cpu"] - peer_cpu0
        extra["cpu_us_per_op"] = (cpu + peer_cpu) / n * 1e6
        await comm.write({"op": "stop"})
        return {"value": value, **extra}
    finally:
        await comm.close()


def comm_bar(bar: str, loop: str, opts: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    protocols = (*PROTOCOLS, "raw") if bar == "comm_bw" else PROTOCOLS
    out: dict[str, list[dict[str, Any]]] = {p: [] for p in protocols}
    import dask

    for r in range(opts.rounds):
        for protocol in protocols if r % 2 == 0 else protocols[::-1]:
            peer = Peer(protocol, loop)
            try:
                with dask.config.set({"distributed.admin.event-loop": loop}):
                    if protocol == "raw":
                        res = _run(_raw_round(peer.address, opts), loop)
                    else:
                        res = _run(_comm_round(peer.address, bar, opts), loop)
            finally:
                peer.close()
            out[protocol].append(res)
            _say(f"  {bar} {loop} {protocol} round {r + 1}: {res['value']:.1f}")
    return out


# ---------------------------------------------------------- cluster bar ----


def _transfers(dask_worker: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in dask_worker.transfer_incoming_log:
        out[e["who"]] = out.get(e["who"], 0) + e["total"]
    return out


def _rx_by_peer() -> dict[str, int]:
    from aiordma.integrations.dask import byte_counters

    return {peer: c["rx_bytes"] for peer, c in byte_counters()["peers"].items()}


def _reset() -> None:
    from aiordma.integrations.dask import reset_byte_counters

    reset_byte_counters()


def cluster_round(protocol: str, loop: str, opts: argparse.Namespace) -> dict[str, Any]:
    import dask
    import dask.array as da
    from distributed import Client, LocalCluster

    n, c = opts.cluster_size, opts.cluster_size // 4
    with (
        dask.config.set({"distributed.admin.event-loop": loop}),
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, protocol=f"{protocol}://", dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        if protocol == "rdma":
            client.run(_reset)
        times, results = [], []
        for _ in range(opts.cluster_computes):
            x = da.random.RandomState(0).random((n, n), chunks=(c, c))
            t0 = time.perf_counter()
            results.append(float((x + x.T).sum().compute()))
            times.append(time.perf_counter() - t0)
        transfers = client.run(_transfers)
        out: dict[str, Any] = {
            "value": statistics.median(times),
            "times": times,
            "result": results[0],
            "results": results,
            "transferred": sum(map(sum, [list(v.values()) for v in transfers.values()])) / len(times),
        }
        if protocol == "rdma":
            rx = client.run(_rx_by_peer)
            accounted = True
            rows = []
            for worker, by_peer in transfers.items():
                for peer, nbytes in by_peer.items():
                    got = rx[worker].get(peer, 0)
                    ok = nbytes <= got <= nbytes * 1.01 + 64 * 1024 * len(times)
                    accounted &= ok
                    rows.append({"worker": worker, "peer": peer, "transfer_log_bytes": nbytes, "rx_bytes": got})
            out["accounting"] = rows
            out["accounted"] = accounted
        return out


def cluster_bar(loop: str, opts: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {p: [] for p in PROTOCOLS}
    if not opts.quick:
        # one unmeasured cluster per protocol first: the first cluster of a run pays for
        # cold caches (imports, page cache), which would land on whichever goes first
        for protocol in PROTOCOLS:
            res = cluster_round(protocol, loop, opts)
            _say(f"  cluster {loop} {protocol} warm-up: {res['value']:.2f} s (not counted)")
    for r in range(opts.rounds):
        for protocol in PROTOCOLS if r % 2 == 0 else PROTOCOLS[::-1]:
            res = cluster_round(protocol, loop, opts)
            out[protocol].append(res)
            _say(
                f"  cluster {loop} {protocol} round {r + 1}: {res['value']:.2f} s, {res['transferred'] / 1e6:.0f} MB moved"
            )
    return out


# --------------------------------------------------------- workload bar ----


def _process_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cluster_cpu(client: Any) -> float:
    """CPU seconds the workers and the scheduler have used so far."""
    return float(sum(client.run(_process_cpu).values()) + client.run_on_scheduler(_process_cpu))


def _computation(name: str, n: int) -> Any:
    import dask.array as da

    x = da.random.RandomState(0).random((n, n), chunks=(n // 10, n // 10))
    if name == "transpose_sum":
        return (x + x.T).sum()
    return x.rechunk((n, n // 100)).sum(axis=0).sum()


def _compute(client: Any, name: str, n: int) -> dict[str, Any]:
    cpu0 = _cluster_cpu(client)
    t0 = time.perf_counter()
    value = float(client.compute(_computation(name, n)).result())
    wall = time.perf_counter() - t0
    return {"value": wall, "cpu_s": _cluster_cpu(client) - cpu0, "result": value, "results": [value]}


def workload_bar(loop: str, opts: argparse.Namespace) -> dict[str, dict[str, list[dict[str, Any]]]]:
    import contextlib

    import dask
    from distributed import Client, LocalCluster

    n = opts.workload_size
    out: dict[str, dict[str, list[dict[str, Any]]]] = {c: {p: [] for p in PROTOCOLS} for c in WORKLOAD_COMPUTATIONS}
    with contextlib.ExitStack() as stack:
        stack.enter_context(dask.config.set({"distributed.admin.event-loop": loop}))
        clients = {}
        for protocol in PROTOCOLS:
            cluster = stack.enter_context(
                LocalCluster(
                    n_workers=2, threads_per_worker=1, processes=True, protocol=f"{protocol}://", dashboard_address=None
                )
            )
            clients[protocol] = client = stack.enter_context(Client(cluster, set_as_default=False))
            for name in WORKLOAD_COMPUTATIONS:  # warm-up, not counted
                res = _compute(client, name, n)
                _say(f"  workload {loop} {protocol} {name} warm-up: {res['value']:.2f} s (not counted)")
        for r in range(opts.rounds):
            for protocol in PROTOCOLS if r % 2 == 0 else PROTOCOLS[::-1]:
                for name in WORKLOAD_COMPUTATIONS:
                    res = _compute(clients[protocol], name, n)
                    out[name][protocol].append(res)
                    _say(
                        f"  workload {loop} {protocol} {name} round {r + 1}: {res['value']:.2f} s, "
                        f"{res['cpu_s']:.2f} s CPU (workers + scheduler)"
                    )
    return out


# ---------------------------------------------------------------- report ----


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _median(rows: list[dict[str, Any]], key: str = "value") -> float:
    return float(statistics.median(r[key] for r in rows))


def _range(rows: list[dict[str, Any]], key: str = "value") -> tuple[float, float]:
    vals = [r[key] for r in rows]
    return float(min(vals)), float(max(vals))


def verdict(bar: str, res: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rdma, tcp = res["rdma"], res["tcp"]
    a, t = _median(rdma), _median(tcp)
    if bar == "comm_bw":
        ratio = a / t
        met = ratio >= 1.0
        target, unit = ">= 1 x TCP MB/s", "MB/s"
    elif bar.startswith("workload"):
        ratio = a / t
        same = all(r["result"] == tcp[0]["result"] for r in rdma + tcp)
        met = ratio <= 1.0 and same
        target, unit = "<= 1.0 x TCP wall time, same result", "s"
    elif bar == "pingpong":
        ratio = a / t
        met = ratio <= 1.25
        target, unit = "<= 1.25 x TCP p50", "µs round trip p50"
    else:
        ratio = a / t
        same = all(abs(v - tcp[0]["result"]) <= 1e-9 * abs(tcp[0]["result"]) for r in rdma + tcp for v in r["results"])
        accounted = all(r.get("accounted", False) for r in rdma)
        met = ratio <= 1.1 and same and accounted
        target, unit = "<= 1.1 x TCP wall time, same result, bytes accounted", "s"
    out = {"bar": bar, "target": target, "unit": unit, "rdma": a, "tcp": t, "ratio": ratio, "met": met}
    out["rdma_range"], out["tcp_range"] = _range(rdma), _range(tcp)
    if bar.startswith("workload"):
        out["same_result"] = same
        out["rdma_cpu_s"] = _median(rdma, "cpu_s")
        out["tcp_cpu_s"] = _median(tcp, "cpu_s")
    elif bar == "cluster":
        out["same_result"] = same
        out["accounted"] = accounted
        out["rdma_moved_mb"] = _median(rdma, "transferred") / 1e6
        out["tcp_moved_mb"] = _median(tcp, "transferred") / 1e6
    else:
        out["rdma_cpu_us_per_op"] = _median(rdma, "cpu_us_per_op")
        out["tcp_cpu_us_per_op"] = _median(tcp, "cpu_us_per_op")
    if res.get("raw"):
        # context: aiordma alone between the same processes (the device's figure)
        out["raw_aiordma"] = _median(res["raw"])
        out["raw_cpu_us_per_op"] = _median(res["raw"], "cpu_us_per_op")
    return out


def _engine() -> str:
    import aiordma

    dev = aiordma.open_device("soft")
    try:
        return str(getattr(dev, "engine", "python"))
    finally:
        dev.close()


def table(doc: dict[str, Any]) -> str:
    lines = [
        f"Dask comm bars, {doc['date']}: soft engine **{doc['engine']}**, distributed {doc['distributed']}, "
        f"Python {doc['python']}, {doc['cpus']} CPUs, load {doc['load_start']} at the start, {doc['load_end']} at "
        f"the end; {doc['rounds']} alternating rounds. {doc['note']}",
        "",
        "| bar | loop | rdma:// | tcp:// | ratio | target | met | CPU/op rdma | CPU/op tcp |",
        "|---|---|---:|---:|---:|---|:-:|---:|---:|",
    ]
    for v in doc["verdicts"]:
        lo_a, hi_a = v["rdma_range"]
        lo_t, hi_t = v["tcp_range"]
        cpu_a = f"{v['rdma_cpu_us_per_op']:,.0f} µs" if "rdma_cpu_us_per_op" in v else "—"
        cpu_t = f"{v['tcp_cpu_us_per_op']:,.0f} µs" if "tcp_cpu_us_per_op" in v else "—"
        if "rdma_cpu_s" in v:  # a computation's CPU (workers + scheduler)
            cpu_a, cpu_t = f"{v['rdma_cpu_s']:,.2f} s", f"{v['tcp_cpu_s']:,.2f} s"
        lines.append(
            f"| {v['bar']} | {v['loop']} | {v['rdma']:,.1f} ({lo_a:,.1f}–{hi_a:,.1f}) {v['unit']} | "
            f"{v['tcp']:,.1f} ({lo_t:,.1f}–{hi_t:,.1f}) | {v['ratio']:.2f} | {v['target']} | "
            f"{'yes' if v['met'] else '**no**'} | {cpu_a} | {cpu_t} |"
        )
    for v in doc["verdicts"]:
        if v["bar"] == "cluster":
            lines.append(
                f"\n- cluster ({v['loop']}): same result {'yes' if v['same_result'] else '**no**'}; the rdma "
                f"byte counters account for every transfer in transfer_incoming_log: "
                f"{'yes' if v['accounted'] else '**no**'}; the workers moved {v['rdma_moved_mb']:,.0f} MB "
                f"(rdma) and {v['tcp_moved_mb']:,.0f} MB (tcp) between them per computation (median; Dask's "
                f"scheduling decides); each round's time is the median of its cluster's computations."
            )
        if "raw_aiordma" in v:
            lines.append(
                f"\n- {v['bar']} ({v['loop']}): aiordma alone between the same two processes (send of the "
                f"buffer, registered anew each time, recv_into a fresh buffer, no Dask): "
                f"{v['raw_aiordma']:,.1f} MB/s, {v['raw_cpu_us_per_op']:,.0f} µs CPU per message (the kernel "
                f"maps and zeroes the fresh buffer's pages, which the backend's buffer pool spares)."
            )
    lines.append(f"\nReproduce: `{doc['command']}`")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(BARS), help=f"bars to run, comma-separated ({', '.join(BARS)})")
    ap.add_argument("--loops", default=",".join(LOOPS), help="event loops, comma-separated (asyncio, uvloop)")
    ap.add_argument("--rounds", type=int_type(1), default=3, help="alternating rdma/tcp rounds per bar and loop (3)")
    ap.add_argument("--quick", action="store_true", help="1 round, fewer iterations")
    ap.add_argument("--size", type=size_type(8), default=64 << 20, help="bytes of the comm_bw frame (64 MiB)")
    ap.add_argument("--cluster-size", type=int_type(4), default=16000, help="n of the n x n array of the cluster bar")
    ap.add_argument(
        "--cluster-computes",
        type=int_type(1),
        default=3,
        help="computations per cluster, their median is the round's (3)",
    )
    ap.add_argument(
        "--workload-size", type=int_type(100), default=20000, help="n of the n x n array of the workload bar (20000)"
    )
    ap.add_argument("--note", default="", help="a note for the report (e.g. the machine's load)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-': stdout)")
    ap.add_argument("--serve", choices=(*PROTOCOLS, "raw"), help=argparse.SUPPRESS)
    ap.add_argument("--serve-loop", choices=LOOPS, default="asyncio", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts.serve:
        _run(_serve(opts.serve), opts.serve_loop)
        return 0
    bars = [b for b in opts.only.split(",") if b]
    loops = [lp for lp in opts.loops.split(",") if lp]
    for b in bars:
        if b not in BARS:
            ap.error(f"unknown bar {b!r}: expected some of {', '.join(BARS)}")
    for lp in loops:
        if lp not in LOOPS:
            ap.error(f"unknown loop {lp!r}: expected asyncio or uvloop")
    if opts.cluster_size % 4:
        ap.error("--cluster-size must be a multiple of 4 (4 x 4 chunks)")
    if opts.workload_size % 100:
        ap.error("--workload-size must be a multiple of 100 (10 x 10 chunks, rechunked into 100 columns)")
    if opts.quick:
        opts.rounds = 1
        opts.cluster_computes = 1
    opts.iters_bw, opts.warmup_bw = (4, 1) if opts.quick else (30, 3)
    opts.iters_pp, opts.warmup_pp = (500, 50) if opts.quick else (3000, 200)

    import distributed

    doc: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "engine": _engine(),
        "distributed": distributed.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "rounds": opts.rounds,
        "note": opts.note,
        "command": shlex.join([sys.executable, *sys.argv]),
        "results": {},
        "verdicts": [],
    }
    for loop in loops:
        for bar in bars:
            _say(f"{bar} on {loop}")
            if bar == "workload":
                for name, res in workload_bar(loop, opts).items():
                    doc["results"][f"workload {name}/{loop}"] = res
                    v = verdict(f"workload {name}", res)
                    v["loop"] = loop
                    doc["verdicts"].append(v)
                continue
            res = cluster_bar(loop, opts) if bar == "cluster" else comm_bar(bar, loop, opts)
            doc["results"][f"{bar}/{loop}"] = res
            v = verdict(bar, res)
            v["loop"] = loop
            doc["verdicts"].append(v)
    doc["load_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(table(doc))
    if opts.json:
        text = json.dumps(doc, indent=1)
        if opts.json == "-":
            print(text)
        else:
            Path(opts.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
