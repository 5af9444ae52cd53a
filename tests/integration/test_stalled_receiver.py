"""A receiver that stops reading under load from 100 senders (soft device, the
shared receive queue on): nobody fails, nothing is lost or reordered, and what
the receiving process holds stays within the process-wide receive budget.

100 connections from one client device send numbered messages as fast as
credits let them to one server whose handlers stop reading for
``AIORDMA_STALL_S`` seconds (default 5) while the load runs, then read
everything. The server's connections share one SRQ, so while its application
does not read, its credits are held back (the budget), and where its device
runs short of posted receives the senders meet RNR NAKs and retry without
limit: they wait, as a TCP writer waits on a full window. Every async test runs
on asyncio and uvloop.
"""

from __future__ import annotations

import asyncio
import os
import struct
import time

import aiordma
from aiordma import pools
from aiordma.window import PROCESS_RECV_BUDGET

from .test_soft_device import new_device

SENDERS = 100
MESSAGES = 60  # per sender
SIZE = 2048
STALL = float(os.environ.get("AIORDMA_STALL_S", "5"))
BUDGET = 2 << 20  # the process-wide receive budget during the test
T = 120


async def test_a_stalled_receiver_slows_a_hundred_senders_and_loses_nothing():
    sdev, cdev = new_device(), new_device()
    received: dict[int, list[int]] = {}
    stalled = asyncio.Event()
    resume = asyncio.Event()
    done = asyncio.Event()
    peak = 0
    old_limit = PROCESS_RECV_BUDGET.limit
    aiordma.set_process_recv_budget(BUDGET)

    async def handler(conn):
        first = await conn.recv()
        sender = struct.unpack_from("<I", first)[0]
        seqs = received.setdefault(sender, [])
        seqs.append(struct.unpack_from("<I", first, 4)[0])
        stalled.set()
        await resume.wait()  # the application stops reading while the load runs
        while len(seqs) < MESSAGES:
            m = await conn.recv()
            assert len(m) == SIZE and struct.unpack_from("<I", m)[0] == sender
            seqs.append(struct.unpack_from("<I", m, 4)[0])
        if sum(len(s) for s in received.values()) == SENDERS * MESSAGES:
            done.set()
        await conn.recv()  # until the client closes

    server = await aiordma.start_server(handler, "127.0.0.1", 0, device=sdev, srq=True)
    try:
        conns = await asyncio.gather(
            *(aiordma.connect("127.0.0.1", server.port, device=cdev, timeout=T, srq=True) for _ in range(SENDERS))
        )

        async def send_all(i: int, conn: aiordma.Connection) -> None:
            for k in range(MESSAGES):
                msg = struct.pack("<II", i, k) + bytes((i + k) & 0xFF for _ in range(SIZE - 8))
                await conn.send(msg)

        async def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, PROCESS_RECV_BUDGET.buffered)
                await asyncio.sleep(0.02)

        watcher = asyncio.ensure_future(watch())
        senders = asyncio.ensure_future(asyncio.gather(*(send_all(i, c) for i, c in enumerate(conns))))
        await asyncio.wait_for(stalled.wait(), T)
        t0 = time.monotonic()
        await asyncio.sleep(STALL)
        # the senders are held back by credits, not finished: the receiver holds their messages' credits
        assert not senders.done()
        stalled_for = time.monotonic() - t0
        resume.set()
        await asyncio.wait_for(senders, T)
        await asyncio.wait_for(done.wait(), T)
        watcher.cancel()
        # nothing lost, nothing reordered, nobody failed
        assert sorted(received) == list(range(SENDERS))
        assert all(seqs == list(range(MESSAGES)) for seqs in received.values())
        assert all(c.error is None for c in conns)
        # within the budget: past it a connection holds its credits back; each may still queue its
        # first message and what its sender had in flight (its grant: at most recv_buffers chunks)
        slack = SENDERS * (16 + 1) * SIZE
        assert peak <= BUDGET + slack, (peak, BUDGET, slack)
        recv_pool = next(p for p in pools.pools_of(sdev) if isinstance(p, pools.ReceivePool))
        print(
            f"\nstalled {stalled_for:.1f} s under {SENDERS} senders: peak queued {peak >> 10} KiB "
            f"(budget {BUDGET >> 10} KiB), SRQ {recv_pool.stats()}, RNR NAKs sent "
            f"{sdev.counters.get('rnr_naks_sent', 0)}"
        )
        await asyncio.gather(*(c.close() for c in conns))
    finally:
        aiordma.set_process_recv_budget(old_limit)
        server.close()
        await server.wait_closed()
        sdev.close()
        cdev.close()
