"""``Connection.read_batch``: many small RDMA Reads in one call, posted as one
chain (one doorbell, only the last signaled), over the soft device with both
engines and both event loops."""

from __future__ import annotations

import os

import pytest

import aiordma
import aiordma.providers.base
from aiordma import RemoteAccessError, RemoteBuffer
from aiordma.providers.soft.device import SoftDevice
from aiordma.providers.soft.engine import native_status
from aiordma.providers.soft.trace import TraceEvent

ENGINES = ("python", "native") if native_status()[0] else ("python",)


@pytest.fixture(params=ENGINES)
async def pair(request):
    dev = SoftDevice(engine=request.param)  # the first free loopback address
    mem = bytearray(os.urandom(1 << 20))
    region = aiordma.register(mem, device=dev)

    async def handler(conn):
        await conn.wait_closed()

    server = await aiordma.start_server(handler, "127.0.0.1", 0, device=dev, expose={"m": region})
    conn = await aiordma.connect("127.0.0.1", server.port, device=dev, send_queue_depth=128)
    yield conn, mem, dev
    await conn.close()
    server.close()
    await server.wait_closed()
    region.close()
    dev.close()


async def test_many_small_reads_land_in_their_buffers(pair):
    conn, mem, dev = pair
    remote = conn.remote("m")
    offsets = [(i * 7919 * 64) % ((1 << 20) - 4096) for i in range(100)]
    sizes = [64, 1, 4096, 100, 0] * 20
    # half into one registered region's slices, half into plain bytearrays (registered for the read)
    local = conn.register(bytearray(100 * 4096))
    plain = [bytearray(s) for s in sizes]
    reads = [
        (remote[o : o + s], local[i * 4096 : i * 4096 + s] if i % 2 == 0 else plain[i])
        for i, (o, s) in enumerate(zip(offsets, sizes))
    ]
    await conn.read_batch(reads)
    for i, (o, s) in enumerate(zip(offsets, sizes)):
        got = bytes(local.view[i * 4096 : i * 4096 + s]) if i % 2 == 0 else bytes(plain[i])
        assert got == bytes(mem[o : o + s]), i
    local.close()


async def test_one_completion_for_the_batch(pair):
    """Only the last Read is signaled: the device writes one work completion for
    the whole chain (counted through the soft device's tracer)."""
    conn, mem, dev = pair
    remote = conn.remote("m")
    into = conn.register(bytearray(64 * 50))
    cqes = []
    dev.set_tracer(lambda event, **f: cqes.append(f["wc"]) if event is TraceEvent.CQE else None)
    try:
        await conn.read_batch([(remote[i * 64 : (i + 1) * 64], into[i * 64 : (i + 1) * 64]) for i in range(50)])
    finally:
        dev.set_tracer(None)
    assert bytes(into.view) == bytes(mem[: 64 * 50])
    mine = [wc for wc in cqes if wc.qp_num == conn.qp_num]
    assert len(mine) == 1 and mine[0].opcode == aiordma.providers.base.WCOpcode.IBV_WC_RDMA_READ, mine
    into.close()


async def test_a_failing_read_fails_the_batch(pair):
    conn, _mem, _dev = pair
    remote = conn.remote("m")
    bad = RemoteBuffer(remote.addr, 64, remote.rkey ^ 0x5A5A)
    reads = [(remote[0:64], bytearray(64)), (bad, bytearray(64)), (remote[64:128], bytearray(64))]
    with pytest.raises(RemoteAccessError):
        await conn.read_batch(reads)


async def test_bad_batches_are_refused_before_anything_is_posted(pair):
    conn, _mem, _dev = pair
    remote = conn.remote("m")
    await conn.read_batch([])  # nothing to do
    with pytest.raises(ValueError, match="exceeds the send queue depth"):
        await conn.read_batch([(remote[0:8], bytearray(8))] * 1000)
    with pytest.raises(TypeError, match="into must be a buffer"):
        await conn.read_batch([(remote[0:8], None)])
    with pytest.raises(ValueError, match="does not fit"):
        await conn.read_batch([(remote[0:64], bytearray(8))])
    assert await conn.read(remote[0:8]) is not None  # the connection is still usable
