"""Many connections through one echo server.

64 client connections, all on the same event loop as the server, each keep
a few messages in flight (window 4) until they have sent N, and check every
echo (content and order). Nothing may be lost; per-connection throughput
(fairness: slowest vs fastest), the total rate and round-trip latency
percentiles are printed (``pytest -s``). No speed thresholds: the machine
may be busy. Default run N=200; ``test_load_10k`` (slow) uses N=10,000.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import struct
import time

import pytest

import aiordma

N_CONNS = 64
WINDOW = 4
OPTS = dict(recv_buffers=8, recv_buffer_size=4096)


SIZES = [0, 8, 64, 200, 1000, 4000, 5000]


def message(conn_idx: int, k: int) -> bytes:
    """The k-th message of a connection (made when needed: 64 x 10,000 of them
    held at once would take a gigabyte)."""
    size = SIZES[(conn_idx * 7919 + k * 104729) % len(SIZES)]
    return struct.pack(">II", conn_idx, k) + bytes([(conn_idx + k) & 0xFF]) * size


def percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    idx = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[idx]


async def run_load(n_conns: int, n_msgs: int) -> dict:
    async def echo(conn):
        async for m in conn:
            await conn.send(m)

    server = await aiordma.start_server(echo, "127.0.0.1", 0, provider="soft", **OPTS)
    conns: list[aiordma.Connection] = []
    try:
        for i in range(0, n_conns, 16):  # connect in waves (the TCP accept backlog)
            conns += await asyncio.gather(
                *(
                    aiordma.connect("127.0.0.1", server.port, provider="soft", timeout=60, **OPTS)
                    for _ in range(min(16, n_conns - i))
                )
            )
        loop = asyncio.get_running_loop()
        start = asyncio.Event()

        async def client(idx: int, conn: aiordma.Connection) -> tuple[float, list[float], int]:
            window = asyncio.Semaphore(WINDOW)
            sent_at: list[float] = [0.0] * n_msgs
            lat: list[float] = []
            nbytes = 0

            async def receiver() -> None:
                nonlocal nbytes
                for k in range(n_msgs):
                    got = await conn.recv()
                    lat.append(loop.time() - sent_at[k])
                    assert got == message(idx, k), f"connection {idx}: message {k} came back wrong or out of order"
                    nbytes += len(got)
                    window.release()

            await start.wait()
            t0 = loop.time()
            rtask = asyncio.ensure_future(receiver())
            try:
                for k in range(n_msgs):
                    await window.acquire()
                    sent_at[k] = loop.time()
                    await conn.send(message(idx, k))
                await rtask
            finally:
                if not rtask.done():
                    rtask.cancel()
                    await asyncio.gather(rtask, return_exceptions=True)
            return loop.time() - t0, lat, nbytes

        tasks = [asyncio.ensure_future(client(i, c)) for i, c in enumerate(conns)]
        t0 = time.monotonic()
        start.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks), max(120, n_msgs * 0.1))
        wall = time.monotonic() - t0
        rates = sorted(n_msgs / d for d, _, _ in results)
        lats = sorted(x for _, lat, _ in results for x in lat)
        total_bytes = sum(b for _, _, b in results)
        assert len(lats) == n_conns * n_msgs
        return {
            "conns": n_conns,
            "msgs": n_conns * n_msgs,
            "wall": wall,
            "total_rate": n_conns * n_msgs / wall,
            "MB/s": 2 * total_bytes / wall / 1e6,
            "rate_min": rates[0],
            "rate_median": statistics.median(rates),
            "rate_max": rates[-1],
            "p50_ms": percentile(lats, 50) * 1e3,
            "p99_ms": percentile(lats, 99) * 1e3,
            "max_ms": lats[-1] * 1e3,
            "server_accepted": server.accepted,
        }
    finally:
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
        server.close()
        await server.wait_closed()


def report(stats: dict, loop_name: str) -> str:
    return (
        f"\nload [{loop_name}]: {stats['conns']} connections x {stats['msgs'] // stats['conns']} messages = "
        f"{stats['msgs']} round trips in {stats['wall']:.1f} s ({stats['total_rate']:.0f} msg/s, "
        f"{stats['MB/s']:.1f} MB/s both ways); per-connection msg/s min {stats['rate_min']:.0f} / median "
        f"{stats['rate_median']:.0f} / max {stats['rate_max']:.0f} (fairness min/max "
        f"{stats['rate_min'] / stats['rate_max']:.2f}); RTT p50 {stats['p50_ms']:.2f} ms, p99 {stats['p99_ms']:.2f} ms, "
        f"max {stats['max_ms']:.1f} ms"
    )


async def test_load_64_connections():
    stats = await run_load(N_CONNS, int(os.environ.get("AIORDMA_LOAD_MSGS", "200")))
    assert stats["server_accepted"] == N_CONNS
    assert stats["rate_min"] > 0
    print(report(stats, type(asyncio.get_running_loop()).__module__.split(".")[0]))


@pytest.mark.slow
async def test_load_10k():
    stats = await run_load(N_CONNS, int(os.environ.get("AIORDMA_LOAD_MSGS_SLOW", "10000")))
    assert stats["server_accepted"] == N_CONNS
    print(report(stats, type(asyncio.get_running_loop()).__module__.split(".")[0]))
