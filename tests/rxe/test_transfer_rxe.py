"""Descriptor-list transfers on kernel Soft-RoCE (rxe0 in scripts/rxe-vm, pyverbs provider).

The kernel checks every descriptor against the rkey and moves the bytes; the
initiator posts each chunk of the list as one chain through pyverbs' extended
verbs (``PyverbsQP.post_rdma_table``: ``ibv_wr_rdma_read``/``ibv_wr_set_sge`` per
descriptor, one ``ibv_wr_complete``), no SendWR object per descriptor.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

import aiordma
from aiordma.providers.pyverbs import PyverbsQP

pytestmark = pytest.mark.rxe

T = 60  # per transfer (s): TCG is slow
DEVICE = os.environ.get("AIORDMA_RXE_DEVICE") or None
BLOCK = 512
REGION = 1 << 20


@pytest.fixture
def device():
    return aiordma.get_device("pyverbs", DEVICE)


@pytest.fixture
async def pool(device):
    """A server exposing ``REGION`` bytes of a known pattern as "pool" (read/write)."""
    mem = bytearray(np.random.default_rng(7).integers(0, 256, REGION, dtype=np.uint8).tobytes())
    region = aiordma.register(mem, device=device)

    async def handler(conn):
        async for _ in conn:
            pass

    server = await aiordma.start_server(handler, "127.0.0.1", 0, device=device, expose={"pool": region.exposed("rw")})
    yield server, mem
    server.close()
    await server.wait_closed()
    region.close()


@pytest.fixture
def chains(monkeypatch):
    """How many chains went through ``post_rdma_table`` (the real method, counted)."""
    calls: list[int] = []
    real = PyverbsQP.post_rdma_table

    def counted(self, opcode, rkey, lkey, fields):
        posted = real(self, opcode, rkey, lkey, fields)
        if posted:
            calls.append(len(fields) // 4)
        return posted

    monkeypatch.setattr(PyverbsQP, "post_rdma_table", counted)
    return calls


async def test_scattered_reads_and_writes_move_every_byte(pool, device, chains) -> None:
    server, mem = pool
    n = 1500
    rng = np.random.default_rng(3)
    places = rng.choice(REGION // BLOCK, n, replace=False).astype(np.uint64) * BLOCK
    table = np.stack([np.arange(n, dtype=np.uint64) * BLOCK, places, np.full(n, BLOCK, dtype=np.uint64)], axis=1)
    async with await aiordma.connect("127.0.0.1", server.port, device=device, timeout=T) as conn:
        local = conn.register(bytearray(n * BLOCK))
        await asyncio.wait_for(conn.transfer("read", local, conn.remote("pool"), table), T)
        got = bytes(local.view)
        for i, p in enumerate(places.tolist()):
            assert got[i * BLOCK : (i + 1) * BLOCK] == mem[p : p + BLOCK], f"descriptor {i}"
        if conn.qp.extended:
            assert sum(chains) == n, chains  # every descriptor went through a table chain
        # write them back shifted by one block's worth of new bytes, then read a subset again
        fresh = np.random.default_rng(4).integers(0, 256, n * BLOCK, dtype=np.uint8).tobytes()
        local.view[:] = fresh
        await asyncio.wait_for(conn.transfer("write", local, conn.remote("pool"), table), T)
        for i, p in enumerate(places.tolist()):
            assert mem[p : p + BLOCK] == fresh[i * BLOCK : (i + 1) * BLOCK], f"descriptor {i}"
        prepared = conn.prepare_transfer("read", local, conn.remote("pool"), table)
        local.view[:] = bytes(n * BLOCK)
        picked = np.array([5, 1499, 0, 700], dtype=np.uint32)
        await asyncio.wait_for(prepared.start(picked), T)
        for i in picked.tolist():
            assert bytes(local.view[i * BLOCK : (i + 1) * BLOCK]) == fresh[i * BLOCK : (i + 1) * BLOCK]


async def test_a_descriptor_outside_the_remote_buffer_is_refused_before_anything_is_posted(pool, device, chains):
    server, _ = pool
    async with await aiordma.connect("127.0.0.1", server.port, device=device, timeout=T) as conn:
        local = conn.register(bytearray(4 * BLOCK))
        table = [(0, 0, BLOCK), (BLOCK, REGION - BLOCK // 2, BLOCK)]
        with pytest.raises(aiordma.DescriptorError, match="1"):
            conn.transfer("read", local, conn.remote("pool"), table)
        assert chains == []
        await asyncio.wait_for(conn.transfer("read", local, conn.remote("pool"), table[:1]), T)
