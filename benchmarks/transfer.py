#!/usr/bin/env python3
"""Scattered blocks: one descriptor-list transfer against one contiguous transfer of the
same bytes, and against NIXL and Mooncake's transfer engine, in one run.

Two processes on this host. The target exposes a ``--region`` (64 MiB) of random
bytes; this process moves ``--blocks`` distinct blocks of ``--block-size`` bytes at
random block-aligned places of it into consecutive places of one registered local
buffer (Reads), or back (Writes). Every byte is checked after every Read (outside the
timing). Ways, alternated round by round (``--rounds``, 5; the order rotated each
round), each transfer timed alone after one warm-up:

* ``transfer read`` / ``transfer write``: ``await conn.transfer(op, local, remote,
  table)`` with a NumPy ``(N, 3)`` table: prepare (check, convert) and post, in one
  call;
* ``prepared read``: a list prepared once, ``await prepared.start()`` each time;
* ``contiguous read`` / ``contiguous write``: one ``conn.read``/``conn.write`` of
  the same number of bytes (the baseline of the bars);
* ``striped read`` (``--rails N``, N soft devices at each end): the same list over
  N rails with :func:`aiordma.striped_transfer`, beside ``transfer read`` over one;
* ``nixl read``/``write``, ``mooncake read``/``write`` (``--peers``): the same
  pattern through ``benchmarks/peers_scatter.py`` run by ``--peers-python`` (an
  interpreter with ``nixl-cu12`` / ``mooncake-transfer-engine-non-cuda``), one
  timed transfer per round; skipped with the reason when not installed.

The table gives the median time per transfer (and its range), GB/s, and the CPU
time each process spent per transfer (aiordma: ``getrusage`` of both processes,
every thread; the peers: ``process_time`` and ``/proc`` ticks).

    python benchmarks/transfer.py                              # 10,000 x 4 KiB
    python benchmarks/transfer.py --blocks 1000 --block-size 64K --json out.json
    python benchmarks/transfer.py --peers nixl,mooncake --peers-python PEERS_VENV/bin/python
    python benchmarks/transfer.py --rails 2 --blocks 1024 --block-size 256K --region 512M
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# numpy's OpenBLAS starts a thread per CPU that spins after each call it serves: on
# two cores that took a fifth of the machine from the two processes measured (one
# contiguous 41 MB Read: 8.5-11 ms with it, 6-8.5 without). Nothing here needs BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiordma  # noqa: E402
from aiordma.providers.soft.device import SoftDevice  # noqa: E402
from aiordma.tools import int_type, size_type  # noqa: E402

WAYS = ("transfer read", "prepared read", "contiguous read", "transfer write", "contiguous write")
#: with --rails N: the same list over one rail and striped over N, beside one contiguous Read
RAIL_WAYS = ("transfer read", "striped read", "contiguous read")
PEERS = ("nixl", "mooncake")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ------------------------------------------------------------------ target ----


async def serve(region_bytes: int, seed: int, rails: int) -> None:
    mem = bytearray(np.random.default_rng(seed).integers(0, 256, region_bytes, dtype=np.uint8).tobytes())
    region = aiordma.register(mem)
    devices = [SoftDevice() for _ in range(rails - 1)]  # (each binds the next free 127.0.0.N)

    async def handler(conn: aiordma.Connection) -> None:
        try:
            while True:
                cmd = await conn.recv()
                if cmd == b"cpu":
                    await conn.send(str(_cpu()).encode())
                elif cmd.startswith(b"digest "):  # the bytes of the places written: checked by the initiator
                    offsets = np.frombuffer(await conn.recv(), dtype=np.uint64)
                    block = int(cmd.split()[1])
                    view = memoryview(mem)
                    await conn.send(b"".join(view[o : o + block] for o in offsets.tolist()))
        except aiordma.ConnectionClosedError:
            pass

    server = await aiordma.start_server(handler, "127.0.0.1", 0, expose={"m": region.exposed("rw")})
    more = [
        await aiordma.start_server(handler, "127.0.0.1", 0, device=d, expose={"m": aiordma.register(mem, device=d)})
        for d in devices
    ]
    print(json.dumps({"port": server.port, "rails": [s.port for s in more]}), flush=True)
    await asyncio.Event().wait()


# --------------------------------------------------------------- initiator ----


async def measure(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    n, block = args.blocks, args.block_size
    nbytes = n * block
    rng = np.random.default_rng(args.seed)
    offsets = rng.choice(args.region // block, n, replace=False).astype(np.uint64) * block
    table = np.stack([np.arange(n, dtype=np.uint64) * block, offsets, np.full(n, block, dtype=np.uint64)], axis=1)
    expected = np.random.default_rng(args.seed).integers(0, 256, args.region, dtype=np.uint8)
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--region", str(args.region), "--seed", str(args.seed),
         "--rails", str(args.rails)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )  # fmt: skip
    ways = WAYS if args.rails == 1 else RAIL_WAYS
    results: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
    try:
        assert child.stdout is not None
        ports = json.loads(child.stdout.readline())
        conn = await aiordma.connect("127.0.0.1", ports["port"])
        remote = conn.remote("m")
        local = conn.register(bytearray(nbytes))
        view = np.frombuffer(local.view, dtype=np.uint8)
        prepared = conn.prepare_transfer("read", local, remote, table)
        rails = [(conn, local, remote)]
        for port in ports["rails"]:
            other = await aiordma.connect("127.0.0.1", port, device=SoftDevice())
            rails.append((other, other.register(local.view), other.remote("m")))

        async def child_cpu() -> float:
            await conn.send(b"cpu")
            return float(await conn.recv())

        def check_read(way: str) -> None:
            got = view.reshape(n, block)
            want = expected.reshape(-1, block)[(offsets // block).astype(np.int64)]
            if not np.array_equal(got, want):
                raise SystemExit(f"transfer.py: {way} moved wrong bytes")

        async def one(way: str) -> None:
            if way == "transfer read":
                await conn.transfer("read", local, remote, table)
            elif way == "prepared read":
                await prepared.start()
            elif way == "contiguous read":
                await conn.read(remote[0:nbytes], into=local)
            elif way == "transfer write":
                await conn.transfer("write", local, remote, table)
            elif way == "striped read":
                await aiordma.striped_transfer("read", rails, table, slice_size=args.slice)
            else:
                await conn.write(local, remote[0:nbytes])

        def after(way: str) -> None:
            """Check what a Read brought; follow what a Write changed in the target's memory."""
            if way.endswith("read") and way != "contiguous read":
                check_read(way)
            elif way == "transfer write":
                expected.reshape(-1, block)[(offsets // block).astype(np.int64)] = view.reshape(n, block)
            elif way == "contiguous write":
                expected[:nbytes] = view

        for way in ways:  # warm-up
            if way.endswith("read") and way != "contiguous read":
                view[:] = 0
            await one(way)
            after(way)
        for r in range(args.rounds):
            # (rotated: no way is always the first after the peers' runs or the checks)
            for way in ways[r % len(ways) :] + ways[: r % len(ways)]:
                if way.endswith("read") and way != "contiguous read":
                    view[:] = 0
                c0, p0 = await child_cpu(), _cpu()
                t0 = time.perf_counter()
                await one(way)
                dt = time.perf_counter() - t0
                p1 = _cpu()
                c1 = await child_cpu()
                results[way].append({"seconds": dt, "initiator_cpu_s": p1 - p0, "target_cpu_s": c1 - c0})
                after(way)
            for peer in args.peers:
                for op in ("read", "write"):
                    row = run_peer(args, peer, op)
                    if row is not None:
                        results.setdefault(f"{peer} {op}", []).append(row)
            if args.peers:
                await asyncio.sleep(1.0)  # (a peer's processes and their spinning threads gone)
        for other, _, _ in rails[1:]:
            await other.close()
        # the places written hold what the writes put there
        await conn.send(f"digest {block}".encode())
        await conn.send(offsets.tobytes())
        if await conn.recv() != expected.reshape(-1, block)[(offsets // block).astype(np.int64)].tobytes():
            raise SystemExit("transfer.py: the writes left wrong bytes in the peer's memory")
        await conn.close()
    finally:
        child.kill()
        child.wait()
    return results


SKIPPED: dict[str, str] = {}


def run_peer(args: argparse.Namespace, peer: str, op: str) -> dict[str, float] | None:
    """One timed transfer (after a warm-up) of ``peer`` through benchmarks/peers_scatter.py."""
    if peer in SKIPPED:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peer.json"
        cmd = [args.peers_python, str(ROOT / "benchmarks" / "peers_scatter.py"), "--engine", peer, "--op", op]
        cmd += ["--blocks", str(args.blocks), "--block-size", str(args.block_size)]
        cmd += ["--region-mib", str(args.region >> 20), "--rounds", "1", "--json", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode == 3 or not out.exists():
            said = (proc.stdout + proc.stderr).strip().splitlines()
            SKIPPED[peer] = said[-1] if said else f"exit status {proc.returncode}"
            return None
        doc = json.loads(out.read_text())
        if proc.returncode != 0 or not doc.get("verified"):
            raise SystemExit(f"transfer.py: {peer} {op} moved wrong bytes")
        t = doc["transfers"][0]
        return {"seconds": t["wall_s"], "initiator_cpu_s": t["initiator_cpu_s"], "target_cpu_s": t["target_cpu_s"]}


def summarize(results: dict[str, list[dict[str, float]]], nbytes: int) -> dict[str, dict[str, float]]:
    out = {}
    for way, rows in results.items():
        if not rows:
            continue
        secs = [r["seconds"] for r in rows]
        out[way] = {
            "median_ms": statistics.median(secs) * 1e3,
            "min_ms": min(secs) * 1e3,
            "max_ms": max(secs) * 1e3,
            "gb_s": nbytes / statistics.median(secs) / 1e9,
            "initiator_cpu_ms": statistics.median(r["initiator_cpu_s"] for r in rows) * 1e3,
            "target_cpu_ms": statistics.median(r["target_cpu_s"] for r in rows) * 1e3,
            "rounds": len(rows),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int_type(1), default=10_000, help="descriptors per transfer (default 10000)")
    p.add_argument("--block-size", type=size_type(1), default=4096, help="bytes per block (default 4K)")
    p.add_argument("--region", type=size_type(1), default=64 << 20, help="the target's region (default 64M)")
    p.add_argument("--rounds", type=int_type(1), default=5, help="alternating rounds (default 5)")
    p.add_argument("--seed", type=int_type(0), default=0)
    p.add_argument("--rails", type=int_type(1), default=1, help="soft devices each end; >1: a striped read too")
    p.add_argument("--slice", type=int_type(1), default=1024, help="descriptors per slice of a striped read")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    p.add_argument("--peers", default="", help="comma-separated, of nixl, mooncake (default: none)")
    p.add_argument("--peers-python", default=sys.executable, help="the interpreter that has the peers installed")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(serve(args.region, args.seed, args.rails))
        return
    args.peers = [x for x in args.peers.split(",") if x]
    for peer in args.peers:
        if peer not in PEERS:
            p.error(f"--peers: {peer!r} is not one of {', '.join(PEERS)}")
    if args.blocks * args.block_size > args.region:
        p.error(f"--blocks x --block-size ({args.blocks * args.block_size}) exceeds --region ({args.region})")
    runner: Any = asyncio.run
    if args.loop == "uvloop":
        import uvloop

        runner = uvloop.run
    nbytes = args.blocks * args.block_size
    res = summarize(runner(measure(args)), nbytes)
    engine = getattr(aiordma.get_device("soft"), "engine", "?")
    print(
        f"{args.blocks} blocks of {args.block_size} B ({nbytes} B) at random places of a {args.region >> 20} MiB "
        f"region, two processes; {args.rounds} alternating rounds; soft device ({engine} engine), {args.loop}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs, Linux {platform.release()}"
    )
    print("| way | ms per transfer, median (min-max) | GB/s | initiator CPU ms | target CPU ms |")
    print("|---|---:|---:|---:|---:|")
    for way, r in res.items():
        print(
            f"| {way} | {r['median_ms']:.2f} ({r['min_ms']:.2f}-{r['max_ms']:.2f}) | {r['gb_s']:.2f} "
            f"| {r['initiator_cpu_ms']:.2f} | {r['target_cpu_ms']:.2f} |"
        )
    for peer, why in SKIPPED.items():
        print(f"{peer}: skipped ({why})")
    base = res.get("contiguous read")
    if base:
        for way in ("transfer read", "prepared read", "striped read"):
            if way in res:
                print(f"{way}: {res[way]['median_ms'] / base['median_ms']:.2f}x one contiguous Read of the same bytes")
        if "transfer write" in res:
            print(
                f"transfer write: {res['transfer write']['median_ms'] / res['contiguous write']['median_ms']:.2f}x "
                "one contiguous Write"
            )
        if "nixl read" in res:
            print(
                f"transfer read: {res['nixl read']['median_ms'] / res['transfer read']['median_ms']:.2f}x NIXL's throughput"
            )
    if args.json:
        doc = {
            "blocks": args.blocks,
            "block_size": args.block_size,
            "region": args.region,
            "rounds": args.rounds,
            "rails": args.rails,
            "loop": args.loop,
            "engine": engine,
            "python": platform.python_version(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "skipped": SKIPPED,
            "results": res,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
