"""Soak: echo traffic under 1 % loss for minutes, memory stays flat.

Slow (``pytest -m slow -s tests/integration/test_soak.py``). Four
connections echo messages of mixed sizes (window 4 each) and do RDMA
Write/Read round trips for ``AIORDMA_SOAK_SECONDS`` (default 180) per event
loop, with 1 % of datagrams dropped. Every echo and every read is checked.
RSS (``/proc/self/statm``) is sampled every second: after a warm-up (the
first 20 % of the run) it may not grow by more than 32 MiB, and the last
fifth of the run may not sit more than 16 MiB above the second fifth. Tasks
and file descriptors are back to their starting numbers at the end.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import struct
import time

import pytest

import aiordma
from aiordma.providers.soft.faults import LinkFaults

SECONDS = float(os.environ.get("AIORDMA_SOAK_SECONDS", "180"))
N_CONNS = 4
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


@pytest.mark.slow
async def test_soak_echo_under_1_percent_loss():
    device = aiordma.get_device("soft")
    mem = bytearray(N_CONNS << 20)
    region = aiordma.register(mem, provider="soft")

    async def echo(conn):
        async for m in conn:
            await conn.send(m)

    opts = dict(ack_timeout=12, retry_cnt=7)
    server = await aiordma.start_server(
        echo, "127.0.0.1", 0, provider="soft", expose={"mem": region.exposed("rwa")}, **opts
    )
    fds_before = len(os.listdir("/proc/self/fd"))
    tasks_before = len(asyncio.all_tasks())
    conns = [await aiordma.connect("127.0.0.1", server.port, provider="soft", **opts) for _ in range(N_CONNS)]
    samples: list[tuple[float, int]] = []
    totals = {"messages": 0, "bytes": 0, "rdma": 0}
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + SECONDS
    device.faults = LinkFaults(drop=0.01, seed=int(time.time()))
    before = device.counters

    async def sampler():
        while loop.time() < stop_at:
            samples.append((loop.time(), rss()))
            await asyncio.sleep(1.0)

    async def echo_client(idx: int, conn: aiordma.Connection):
        rng = random.Random(idx)
        k = 0
        while loop.time() < stop_at:
            batch = []
            for _ in range(4):
                size = rng.choice([0, 10, 500, 4000, 20_000, 70_000, 200_000])
                m = struct.pack(">II", idx, k) + rng.randbytes(size)
                k += 1
                batch.append(m)
                await conn.send(m)
            for m in batch:
                got = await asyncio.wait_for(conn.recv(), 120)
                assert got == m, f"connection {idx}: echo differs"
                totals["messages"] += 1
                totals["bytes"] += len(m)

    async def rdma_client(idx: int, conn: aiordma.Connection):
        rng = random.Random(1000 + idx)
        rb = conn.remote("mem")[idx << 20 : (idx + 1) << 20]
        while loop.time() < stop_at:
            n = rng.randint(1, 64 * 1024)
            off = rng.randrange(0, (1 << 20) - n)
            data = rng.randbytes(n)
            await asyncio.wait_for(conn.write(data, rb.at(off, n)), 120)
            assert await asyncio.wait_for(conn.read(rb.at(off, n)), 120) == data
            totals["rdma"] += 1

    t0 = time.monotonic()
    try:
        await asyncio.gather(
            sampler(),
            *(echo_client(i, c) for i, c in enumerate(conns)),
            *(rdma_client(i, c) for i, c in enumerate(conns)),
        )
    finally:
        device.faults = None
        faults_after = device.counters
        for c in conns:
            await c.close()
        server.close()
        await server.wait_closed()
        region.close()
    elapsed = time.monotonic() - t0
    for _ in range(20):
        await asyncio.sleep(0.05)
    fds_after = len(os.listdir("/proc/self/fd"))
    tasks_after = len(asyncio.all_tasks())

    values = [v for _, v in samples]
    n = len(values)
    assert n >= 5, "too few RSS samples"
    warm = values[n // 5 :]
    base = statistics.median(values[n // 5 : 2 * n // 5] or warm)
    last = statistics.median(values[4 * n // 5 :])
    peak = max(warm)
    retrans = faults_after.get("retransmits", 0) - before.get("retransmits", 0)
    print(
        f"\nsoak [{type(loop).__module__.split('.')[0]}]: {elapsed:.0f} s under 1 % loss, {N_CONNS} connections: "
        f"{totals['messages']} echoes ({totals['bytes'] / 1e6:.0f} MB each way, "
        f"{2 * totals['bytes'] / elapsed / 1e6:.1f} MB/s), {totals['rdma']} write+read pairs; "
        f"RSS start {values[0] / 2**20:.1f} MiB, after warm-up {base / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB, "
        f"end {last / 2**20:.1f} MiB; retransmits {retrans}"
    )
    assert totals["messages"] > 0 and totals["rdma"] > 0
    assert peak - base < 32 << 20, f"RSS grew by {(peak - base) / 2**20:.1f} MiB after the warm-up"
    assert last - base < 16 << 20, f"RSS drifted up by {(last - base) / 2**20:.1f} MiB"
    assert fds_after <= fds_before, f"file descriptors {fds_before} -> {fds_after}"
    assert tasks_after <= tasks_before, f"tasks {tasks_before} -> {tasks_after}"
