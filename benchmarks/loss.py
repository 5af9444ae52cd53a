#!/usr/bin/env python3
"""Throughput of the soft device's RC transport on a lossy link.

Client and server share one process and its soft device, whose NIC drops a
fraction of the datagrams it transmits (``LinkFaults(drop=...)``: requests,
ACKs, NAKs and READ responses alike), so go-back-N, the retransmit timer and
duplicate detection carry the traffic. For each drop rate, messages of mixed
sizes (0 B .. 300 KiB, four in flight) are echoed for ``--seconds``; then
RDMA Write / Read / FETCH_ADD / CMP_SWAP rounds run at 5 % drop. Every echoed
message, read-back and atomic result is checked: a benchmark that moved wrong
bytes fails instead of reporting a figure.

MB/s counts each byte once (one way); ``cpu_s`` is the process's CPU time
(both ends and every thread), which a busy machine disturbs less than the
wall-clock figure. The retransmit timer is ``ack_timeout=12`` (≈ 17 ms),
``retry_cnt=7``, as in ``tests/integration/test_loss.py`` (which checks the
same paths for correctness, at smaller volumes).

    python benchmarks/loss.py                          # 0/1/5/20 % drop, 20 s each, uvloop
    python benchmarks/loss.py --seconds 5 --drops 0.05 --loop asyncio --json loss.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import struct
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiordma  # noqa: E402
from aiordma.providers.soft.faults import LinkFaults  # noqa: E402

OPTS = dict(ack_timeout=12, retry_cnt=7)
SIZES = [0, 1, 7, 100, 1023, 4096, 4097, 20_000, 65_535, 65_536, 65_537, 131_072, 200_000, 300 * 1024]
IN_FLIGHT = 4


class WrongBytes(AssertionError):
    """The link delivered something other than what was sent."""


def _device():
    return aiordma.get_device("soft")


async def _echo_handler(conn) -> None:
    async for msg in conn:
        await conn.send(msg)


async def echo_run(drop: float, volume: int, seed: int) -> dict[str, Any]:
    """Echo ``volume`` bytes of mixed-size messages through a link dropping ``drop``."""
    server = await aiordma.start_server(_echo_handler, "127.0.0.1", 0, provider="soft", **OPTS)
    try:
        conn = await aiordma.connect("127.0.0.1", server.port, provider="soft", **OPTS)
        try:
            rng = random.Random(seed)
            faults = LinkFaults(drop=drop, seed=seed)
            _device().faults = faults
            try:
                t0, c0 = time.monotonic(), time.process_time()
                total = n = 0
                order = SIZES + [rng.choice(SIZES) for _ in range(100_000)]
                window: list[bytes] = []

                async def collect() -> None:
                    for m in window:
                        got = await asyncio.wait_for(conn.recv(), 120)
                        if got != m:
                            raise WrongBytes(f"a {len(m)}-byte message came back as {len(got)} other bytes")
                    window.clear()

                while total < volume:
                    msg = rng.randbytes(order[n % len(order)])
                    n += 1
                    total += len(msg)
                    window.append(msg)
                    await conn.send(msg)
                    if len(window) >= IN_FLIGHT:
                        await collect()
                await collect()
                wall, cpu = time.monotonic() - t0, time.process_time() - c0
            finally:
                _device().faults = None
        finally:
            await conn.close()
    finally:
        server.close()
        await server.wait_closed()
    return {"messages": n, "bytes": total, "seconds": wall, "cpu_s": cpu, "dropped": faults.dropped}


async def rdma_run(drop: float, rounds: int, seed: int) -> dict[str, Any]:
    """``rounds`` of concurrent Writes, Reads back, FETCH_ADD bursts and CMP_SWAPs under ``drop``."""
    mem = bytearray(1 << 20)
    region = aiordma.register(mem, provider="soft")
    server = await aiordma.start_server(
        _echo_handler, "127.0.0.1", 0, provider="soft", expose={"mem": region.exposed("rwa")}, **OPTS
    )
    try:
        conn = await aiordma.connect("127.0.0.1", server.port, provider="soft", **OPTS)
        try:
            rb = conn.remote("mem")
            counter, cas_word = rb[0:8], rb[8:16]
            rng = random.Random(seed)
            adds = moved = 0
            originals: list[int] = []
            faults = LinkFaults(drop=drop, seed=seed)
            _device().faults = faults
            try:
                t0, c0 = time.monotonic(), time.process_time()
                for _ in range(rounds):
                    slots = rng.sample(range(1, 16), 4)
                    datas = [rng.randbytes(rng.choice([1, 100, 4096, 5000, 16_384, 65_536 - 8])) for _ in slots]
                    await asyncio.gather(*(conn.write(d, rb.at(s * 65536, len(d))) for s, d in zip(slots, datas)))
                    back = await asyncio.gather(*(conn.read(rb.at(s * 65536, len(d))) for s, d in zip(slots, datas)))
                    if back != datas:
                        raise WrongBytes("an RDMA Read returned other bytes than were written")
                    moved += 2 * sum(map(len, datas))
                    k = rng.randint(1, 40)
                    originals += await asyncio.gather(*(conn.fetch_and_add(counter, 1) for _ in range(k)))
                    adds += k
                    old = struct.unpack_from("<Q", mem, 8)[0]
                    results = await asyncio.gather(*(conn.compare_and_swap(cas_word, old, old + 1) for _ in range(3)))
                    if results.count(old) != 1:
                        raise WrongBytes(f"CMP_SWAP succeeded {results.count(old)} times instead of once")
                wall, cpu = time.monotonic() - t0, time.process_time() - c0
            finally:
                _device().faults = None
            if struct.unpack_from("<Q", mem, 0)[0] != adds or sorted(originals) != list(range(adds)):
                raise WrongBytes("a FETCH_ADD was executed twice or lost")
        finally:
            await conn.close()
    finally:
        server.close()
        await server.wait_closed()
        region.close()
    return {"rounds": rounds, "bytes": moved, "adds": adds, "seconds": wall, "cpu_s": cpu, "dropped": faults.dropped}


async def main_async(opts: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for drop in opts.drops:
        t_end = time.monotonic() + opts.seconds
        agg: dict[str, Any] = {"kind": "echo", "drop": drop, "runs": 0, "messages": 0, "bytes": 0}
        agg.update(seconds=0.0, cpu_s=0.0, dropped=0)
        seed = 1
        while agg["runs"] == 0 or time.monotonic() < t_end:
            r = await echo_run(drop, opts.volume, seed)
            seed += 1
            agg["runs"] += 1
            for key in ("messages", "bytes", "seconds", "cpu_s", "dropped"):
                agg[key] += r[key]
        rows.append(agg)
        _print_row(agg, opts.table)
    if opts.rdma_rounds:
        r = await rdma_run(opts.rdma_drop, opts.rdma_rounds, seed=11)
        row = {"kind": "rdma", "drop": opts.rdma_drop, "runs": 1, **r}
        rows.append(row)
        _print_row(row, opts.table)
    return rows


def _print_row(row: dict[str, Any], out: Any) -> None:
    mbps = row["bytes"] / row["seconds"] / 1e6 if row["seconds"] else 0.0
    what = f"{row['kind']:<4} drop {row['drop']:>4.0%}"
    print(
        f"{what}: {row['bytes'] / 1e6:7.1f} MB in {row['seconds']:6.1f} s = {mbps:7.2f} MB/s one way, "
        f"CPU {row['cpu_s']:.1f} s, {row['dropped']} datagrams dropped",
        file=out,
        flush=True,
    )


def _drops(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"drop rates are fractions separated by commas, not {text!r}") from None
    if not out or any(not 0.0 <= d < 1.0 for d in out):
        raise argparse.ArgumentTypeError(f"drop rates must lie in [0, 1): {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--drops", type=_drops, default=[0.0, 0.01, 0.05, 0.20], help="drop rates (default 0,0.01,0.05,0.2)"
    )
    ap.add_argument(
        "--seconds", type=float, default=20.0, help="echo time per drop rate (default 20; at least one run)"
    )
    ap.add_argument("--volume", type=int, default=4 << 20, help="bytes echoed per run (default 4 MiB)")
    ap.add_argument("--rdma-rounds", type=int, default=200, help="RDMA Write/Read/atomic rounds (default 200; 0 skips)")
    ap.add_argument("--rdma-drop", type=float, default=0.05, help="drop rate of the RDMA rounds (default 0.05)")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop (default uvloop)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-': stdout)")
    args = ap.parse_args(argv)
    if args.seconds < 0 or args.volume < 1 or args.rdma_rounds < 0 or not 0.0 <= args.rdma_drop < 1.0:
        ap.error("--seconds must not be negative, --volume positive, --rdma-rounds >= 0, --rdma-drop in [0, 1)")
    args.table = sys.stderr if args.json == "-" else sys.stdout  # the JSON alone on stdout
    if args.loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    else:
        factory = asyncio.new_event_loop
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            rows = runner.run(main_async(args))
    except WrongBytes as e:
        print(f"loss: wrong bytes on the lossy link: {e}", file=sys.stderr)
        return 1
    finally:
        aiordma.close_shared_devices()
    if args.json:
        doc = {
            "benchmark": "aiordma-loss",
            "python": platform.python_version(),
            "loop": args.loop,
            "ack_timeout": OPTS["ack_timeout"],
            "retry_cnt": OPTS["retry_cnt"],
            "results": [{**r, "MBps": r["bytes"] / r["seconds"] / 1e6 if r["seconds"] else None} for r in rows],
        }
        text = json.dumps(doc, indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
