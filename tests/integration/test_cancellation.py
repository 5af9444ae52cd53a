"""Cancellation storms: thousands of operations cancelled at random points.

3000 operations (RDMA Write, RDMA Read, FETCH_ADD, SEND) are started at once
on one connection, and a seeded random choice cancels most of them: before
they run, after one loop iteration, or a few milliseconds later (by then
many are posted and their completion is still to come). Afterwards:

* no completion went to the wrong waiter: every Write has its own remote
  slot and pattern, every Read its own source slot (and, for half of them,
  its own registered destination), and every operation that was not
  cancelled saw exactly its own data;
* no buffer was reused before its completion: a slot holds either its
  initial bytes or its write's whole pattern (never a mix, which a temporary
  buffer released early and refilled would produce); every echoed message
  is exactly one of the messages sent (a cancelled SEND is sent whole or
  not at all, never mixed with another's chunk buffers);
* the FETCH_ADD counter is at least the number of adds that completed and
  at most the number started, and the originals the adds saw are distinct;
* operations issued afterwards work, and ``conn.stats["operations_outstanding"]`` drains to zero.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import struct

import pytest

import aiordma
from aiordma.providers.soft.faults import LinkFaults

from ..support.waiting import wait_until

N_OPS = int(os.environ.get("AIORDMA_CANCEL_OPS", "3000"))
SLOT = 8192


def pattern(kind: str, i: int, n: int) -> bytes:
    seed = hashlib.sha256(f"{kind}-{i}".encode()).digest()
    return (seed * (n // 32 + 1))[:n]


def message(i: int, n: int) -> bytes:
    return struct.pack(">I", i) + pattern("msg", i, max(0, n - 4))


@pytest.mark.parametrize("lossy", [False, True], ids=["clean", "lossy"])
async def test_cancellation_storm(lossy):
    """``lossy``: 5 % of datagrams dropped, 2 % duplicated and reordered, so
    many cancelled operations wait for retransmissions when they are cancelled."""
    rng = random.Random(1234)
    kinds = [rng.choice(["write", "write", "read", "read", "faa", "send"]) for _ in range(N_OPS)]
    n_slots = N_OPS
    # server memory: [counter 8 B | pad][write slots][read slots, prefilled]
    wbase = 4096
    rbase = wbase + n_slots * SLOT
    mem = bytearray(rbase + n_slots * SLOT)
    for i, k in enumerate(kinds):
        if k == "read":
            mem[rbase + i * SLOT : rbase + (i + 1) * SLOT] = pattern("read", i, SLOT)
    initial = bytes(mem)
    region = aiordma.register(mem, provider="soft")

    async def echo(conn):
        async for m in conn:
            await conn.send(m)

    opts = dict(recv_buffer_size=4096, recv_buffers=16, ack_timeout=12, retry_cnt=7)
    server = await aiordma.start_server(
        echo, "127.0.0.1", 0, provider="soft", expose={"mem": region.exposed("rwa")}, **opts
    )
    device = aiordma.get_device("soft")
    try:
        conn = await aiordma.connect("127.0.0.1", server.port, provider="soft", send_queue_depth=128, **opts)
        if lossy:
            device.faults = LinkFaults(drop=0.05, duplicate=0.02, reorder=0.02, seed=99)
        try:
            rb = conn.remote("mem")
            counter = rb[0:8]
            dest = conn.register(bytearray(n_slots * SLOT))
            sizes = [rng.randint(1, SLOT) for _ in range(N_OPS)]
            sent_msgs: dict[int, bytes] = {}

            async def op(i: int):
                k = kinds[i]
                n = sizes[i]
                if k == "write":
                    await conn.write(pattern("write", i, n), rb.at(wbase + i * SLOT, n))
                    return None
                if k == "read":
                    if i % 2:
                        await conn.read(rb.at(rbase + i * SLOT, n), into=dest[i * SLOT : i * SLOT + n])
                        return bytes(dest.view[i * SLOT : i * SLOT + n])
                    return await conn.read(rb.at(rbase + i * SLOT, n))
                if k == "faa":
                    return await conn.fetch_and_add(counter, 1)
                m = message(i, n * 2)  # up to 16 KiB: several 4 KiB chunks
                sent_msgs[i] = m
                await conn.send(m)
                return None

            loop = asyncio.get_running_loop()
            tasks = []
            policy = []
            for i in range(N_OPS):
                t = loop.create_task(op(i))
                tasks.append(t)
                p = rng.choices(["keep", "now", "yield", "later"], weights=[3, 2, 2, 3])[0]
                policy.append(p)
                if p == "now":
                    t.cancel()
                elif p == "later":
                    loop.call_later(rng.uniform(0, 0.02), t.cancel)
            yielders = [t for t, p in zip(tasks, policy) if p == "yield"]
            await asyncio.sleep(0)
            for t in yielders:
                t.cancel()
            done, pending = await asyncio.wait(tasks, timeout=120)
            assert not pending, f"{len(pending)} operations never finished"
            results = {}
            errors = []
            for i, t in enumerate(tasks):
                if t.cancelled():
                    continue
                if t.exception() is not None:
                    errors.append((i, kinds[i], t.exception()))
                    continue
                results[i] = t.result()
            assert not errors, f"uncancelled operations failed: {errors[:5]}"
            if lossy:
                assert device.faults.dropped > 0
            # drain: every posted operation completes (buffers released by completions)
            await wait_until(
                lambda: not conn.stats["operations_outstanding"],
                f"{conn.stats['operations_outstanding']} operations still pending",
            )

            # --- writes: a slot holds its initial bytes or its whole pattern
            n_write_done = 0
            for i, k in enumerate(kinds):
                if k != "write":
                    continue
                got = bytes(mem[wbase + i * SLOT : wbase + (i + 1) * SLOT])
                want = pattern("write", i, sizes[i]) + initial[wbase + i * SLOT + sizes[i] : wbase + (i + 1) * SLOT]
                if i in results:
                    assert got == want, f"write {i} did not land whole"
                    n_write_done += 1
                else:
                    assert got == want or got == initial[wbase + i * SLOT : wbase + (i + 1) * SLOT], (
                        f"slot of cancelled write {i} holds a mix of patterns"
                    )
            # --- reads: each waiter saw its own slot
            for i, r in results.items():
                if kinds[i] == "read":
                    assert r == pattern("read", i, SLOT)[: sizes[i]], f"read {i} got someone else's data"
            # --- the read area and the gaps were never written
            assert bytes(mem[rbase:]) == initial[rbase:]
            assert bytes(mem[8:wbase]) == initial[8:wbase]
            # --- atomics: never lost for a completed add, never twice
            adds_started = sum(1 for i, k in enumerate(kinds) if k == "faa")
            originals = [r for i, r in results.items() if kinds[i] == "faa"]
            assert len(set(originals)) == len(originals), "two adds saw the same original value"
            value = struct.unpack_from("<Q", mem, 0)[0]
            assert len(originals) <= value <= adds_started, (len(originals), value, adds_started)
            assert all(o < value for o in originals)
            # --- messages: the echo of every send that was not cancelled, nothing mixed
            await conn.send(b"END")
            echoed = []
            while True:
                m = await asyncio.wait_for(conn.recv(), 60)
                if m == b"END":
                    break
                echoed.append(m)
            ids = []
            for m in echoed:
                i = struct.unpack(">I", m[:4])[0]
                assert i in sent_msgs and m == sent_msgs[i], f"echoed message {i} is not what was sent"
                ids.append(i)
            assert len(set(ids)) == len(ids), "a message arrived twice"
            uncancelled_sends = {i for i in results if kinds[i] == "send"}
            assert uncancelled_sends <= set(ids), f"sends lost: {sorted(uncancelled_sends - set(ids))[:10]}"
            # --- later operations work
            await conn.write(b"after", rb.at(wbase, 5))
            assert await conn.read(rb.at(wbase, 5)) == b"after"
            assert await conn.fetch_and_add(counter, 5) == value
            await conn.send(b"still fine")
            assert await conn.recv() == b"still fine"
            await wait_until(lambda: not conn.stats["operations_outstanding"], "every operation completed")
            n_cancelled = sum(1 for t in tasks if t.cancelled())
            print(
                f"\ncancellation ({'lossy' if lossy else 'clean'}): {N_OPS} ops, {n_cancelled} cancelled, {len(results)} completed "
                f"({n_write_done} writes); FETCH_ADD counter {value} (completed {len(originals)}, "
                f"started {adds_started}); {len(ids)} messages echoed ({len(uncancelled_sends)} uncancelled)"
                + (f"; {device.faults.dropped} datagrams dropped" if lossy else "")
            )
            dest.close()
        finally:
            device.faults = None
            await conn.close()
    finally:
        device.faults = None
        server.close()
        await server.wait_closed()
        region.close()
