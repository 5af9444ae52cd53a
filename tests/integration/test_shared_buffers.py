"""Connections sharing their device's buffers, through the public API: the shared
receive queue (``srq=True``), the send pool, credits that grow.

Real connections between soft devices over UDP, on both engines, both cores
(``AIORDMA_CORE``) and both loops (every async test runs on asyncio and
uvloop): messages keep their order and their bytes through the device's SRQ,
a busy connection earns its full window while a ping-pong keeps its first
credits, every connection of a device takes from one SRQ and one send pool
and the last one's close releases them, an SRQ that runs dry makes senders
wait (RNR NAKs, retried without limit) and fails none, the send pool grows
with traffic and shrinks when idle, and an older peer (no ``msg-credits-v2``)
keeps receive buffers of its own.
"""

from __future__ import annotations

import asyncio

import pytest

import aiordma
from aiordma import handshake, pools, rendezvous
from aiordma.errors import CapabilityError
from aiordma.providers.soft.engine import native_status

from .test_soft_device import new_device, pattern

ENGINES = ("native", "python") if native_status()[0] else ("python",)
T = 60


@pytest.fixture(params=[f"{e}-{c}" for e in ENGINES for c in ("compiled", "python")])
def devices(request, monkeypatch):
    """A server device and a client device (soft, on their own addresses) of one engine, and the core."""
    engine, core = request.param.split("-")
    monkeypatch.setenv("AIORDMA_CORE", core)
    sdev, cdev = new_device(engine=engine), new_device(engine=engine)
    yield sdev, cdev
    sdev.close()
    cdev.close()


async def echo_pair(sdev, cdev, n: int = 1, **options):
    """An echo server on ``sdev`` and ``n`` connections to it from ``cdev``; the
    server's connections are collected in the returned list as they come."""
    accepted: list[aiordma.Connection] = []

    async def handler(conn):
        accepted.append(conn)
        async for m in conn:
            await conn.send(m)

    server = await aiordma.start_server(handler, "127.0.0.1", 0, device=sdev, **options)
    conns = await asyncio.gather(
        *(aiordma.connect("127.0.0.1", server.port, device=cdev, timeout=T, **options) for _ in range(n))
    )
    for _ in range(T * 100):  # (a handler starts once its rendezvous ended)
        if len(accepted) == n:
            break
        await asyncio.sleep(0.01)
    return server, list(conns), accepted


async def shut(server, conns) -> None:
    await asyncio.gather(*(c.close() for c in conns))
    server.close()
    await server.wait_closed()


def the_pool(device, kind):
    found = [p for p in pools.pools_of(device) if isinstance(p, kind)]
    assert len(found) == 1, found
    return found[0]


async def test_messages_keep_order_and_bytes_through_the_shared_receive_queue(devices):
    sdev, cdev = devices
    server, (conn,), accepted = await echo_pair(sdev, cdev, srq=True)
    try:
        assert conn.stats["srq"] == 1 and accepted[0].stats["srq"] == 1
        assert conn.capabilities.count(rendezvous.SRQ_CAPABILITY) == 1
        for size in (0, 1, 64, 4096, 65536, 65537, 200_000, 300_000):
            msg = pattern(size, size)
            await conn.send(msg)
            assert await asyncio.wait_for(conn.recv(), T) == msg
        # a stream: each end's window toward its peer starts at 4 credits and doubles (at most
        # to recv_buffers, 16) every time the peer, not held back, ran short: the rule, not
        # how often a run happens to run short
        msgs = [pattern(3000 + i, i) for i in range(300)]
        sender = asyncio.ensure_future(asyncio.gather(*(conn.send(m) for m in msgs)))
        for m in msgs:
            assert await asyncio.wait_for(conn.recv(), T) == m
        await sender
        # 300 sends at once ran the client short, and the server (never behind) grew its grant
        assert conn.stats["send_starved_marks"] >= 1, conn.stats
        assert accepted[0].stats["recv_grant_grown"] >= 1, accepted[0].stats
        for receiver, sender_end in ((accepted[0], conn), (conn, accepted[0])):
            grown, stats = receiver.stats["recv_grant_grown"], receiver.stats
            assert grown <= sender_end.stats["send_starved_marks"], (stats, sender_end.stats)
            assert stats["recv_grant"] == min(16, 4 << grown), stats
        assert accepted[0].stats["shared_registered_bytes"] > 0
        assert accepted[0].stats["registered_bytes"] <= 1024  # no receive buffers of its own
    finally:
        await shut(server, [conn])


async def test_a_ping_pong_keeps_its_first_credits(devices):
    sdev, cdev = devices
    server, (conn,), accepted = await echo_pair(sdev, cdev, srq=True)
    try:
        for i in range(50):
            await conn.send(i.to_bytes(64, "little"))
            assert await asyncio.wait_for(conn.recv(), T) == i.to_bytes(64, "little")
        # one message at a time never takes the last credit: no STARVED, no growth
        assert accepted[0].stats["recv_grant"] == 4, accepted[0].stats
        assert conn.stats["recv_grant"] == 4, conn.stats
    finally:
        await shut(server, [conn])


async def test_a_devices_connections_share_one_srq_and_send_pool_and_the_last_close_releases_them(devices):
    sdev, cdev = devices
    base = sdev.registered_memory()
    n = 40
    server, conns, accepted = await echo_pair(sdev, cdev, n, srq=True)
    try:
        await asyncio.gather(*(c.send(b"x" * 64) for c in conns))
        assert [await asyncio.wait_for(c.recv(), T) for c in conns] == [b"x" * 64] * n
        recv_pool = the_pool(sdev, pools.ReceivePool)
        send_pool = the_pool(sdev, pools.SendPool)
        assert recv_pool.users == n and send_pool.users == n
        assert {c.stats["shared_pool_users"] for c in accepted} == {n}
        held = sdev.registered_memory()["bytes"] - base["bytes"]
        own = sum(c.stats["registered_bytes"] for c in accepted)  # (each one's atomics' result words)
        assert own <= n * 1024
        assert held == recv_pool.registered_bytes + send_pool.registered_bytes + own
        # 40 connections with buffers of their own registered 16 x 64 KiB each way: 80 MiB; here
        # the SRQ (grown by the burst of 40 messages, to at most its limit) and the send pool
        assert recv_pool.registered_bytes <= pools.DEFAULT_RECV_POOL_BYTES
        assert held <= pools.DEFAULT_RECV_POOL_BYTES + (2 << 20) + own, (held, recv_pool.stats(), send_pool.stats())
        share = accepted[0].stats["registered_bytes_share"]
        assert share <= held // n + 1024, accepted[0].stats
    finally:
        await shut(server, conns)
    for _ in range(100):
        if sdev.registered_memory() == base:
            break
        await asyncio.sleep(0.05)
    assert sdev.registered_memory() == base
    assert pools.pools_of(sdev) == [] and pools.pools_of(cdev) == []


async def test_an_srq_that_runs_dry_slows_its_senders_and_fails_none(devices, monkeypatch):
    sdev, cdev = devices
    # a receive queue of 4 buffers to start with (fault injection: the size of a growth step)
    monkeypatch.setattr(pools, "step_slots", lambda size: 4)
    n, per = 12, 20
    server, conns, accepted = await echo_pair(sdev, cdev, n, srq=True, recv_buffer_size=16384)
    try:

        async def blast(i: int, conn: aiordma.Connection) -> None:
            msgs = [pattern(16384, i * 1000 + k) for k in range(per)]
            sending = asyncio.ensure_future(asyncio.gather(*(conn.send(m) for m in msgs)))
            for m in msgs:
                assert await asyncio.wait_for(conn.recv(), T) == m
            await sending

        await asyncio.gather(*(blast(i, c) for i, c in enumerate(conns)))
        recv_pool = the_pool(sdev, pools.ReceivePool)
        assert recv_pool.limit_events >= 1, recv_pool.stats()
        assert recv_pool.count > 4, recv_pool.stats()  # it grew before the receivers ran dry for good
        assert all(c.error is None for c in conns + accepted)
    finally:
        await shut(server, conns)


async def test_the_send_pool_grows_with_traffic_and_shrinks_when_idle(devices, monkeypatch):
    sdev, cdev = devices
    monkeypatch.setattr(pools, "SHRINK_PERIOD", 0.05)
    server, conns, _ = await echo_pair(sdev, cdev, 8)
    try:
        pool = the_pool(cdev, pools.SendPool)
        first = pool.registered_bytes
        # 8 connections x 16 chunks of 64 KiB in flight need more than one step (16 buffers)
        big = pattern(65536 * 3, 7)
        await asyncio.gather(*(c.send(big) for c in conns for _ in range(4)))
        assert pool.grown > 1, pool.stats()
        grown = pool.registered_bytes
        assert grown > first
        for c in conns:
            for _ in range(4):
                assert await asyncio.wait_for(c.recv(), T) == big
        for _ in range(200):
            if pool.registered_bytes == first:
                break
            await asyncio.sleep(0.05)
        assert pool.registered_bytes == first and pool.shrunk >= 1, pool.stats()
        # and it still sends
        await conns[0].send(b"after")
        assert await asyncio.wait_for(conns[0].recv(), T) == b"after"
    finally:
        await shut(server, conns)


async def test_a_peer_without_growing_credits_keeps_receive_buffers_of_its_own(devices, monkeypatch):
    sdev, cdev = devices
    monkeypatch.setenv("AIORDMA_SRQ", "on")
    older = tuple(c for c in rendezvous.BASE_CAPABILITIES if c != rendezvous.SRQ_CAPABILITY)

    def offer_of_an_older_version(streams: bool):
        return older, ()

    # the client speaks as a version before msg-credits-v2
    monkeypatch.setattr(handshake, "capabilities", offer_of_an_older_version)
    server, (conn,), accepted = await echo_pair(sdev, cdev)
    try:
        assert rendezvous.SRQ_CAPABILITY not in conn.capabilities
        assert conn.stats["srq"] == 0 and accepted[0].stats["srq"] == 0
        assert accepted[0].stats["registered_bytes"] >= 16 * 65536  # its own receive buffers, as before
        for i in range(40):
            await conn.send(pattern(70000, i))
            assert await asyncio.wait_for(conn.recv(), T) == pattern(70000, i)
        # asked for explicitly, a shared receive queue toward such a peer is refused, naming why
        with pytest.raises(CapabilityError, match="msg-credits-v2"):
            await aiordma.connect("127.0.0.1", server.port, device=cdev, timeout=T, srq=True)
    finally:
        await shut(server, [conn])


async def test_a_byte_stream_keeps_its_own_receive_buffers_unless_asked(devices, monkeypatch):
    sdev, cdev = devices
    monkeypatch.setenv("AIORDMA_SRQ", "on")
    seen: list[aiordma.Connection] = []

    async def echo(reader, writer):
        seen.append(writer.connection)
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await aiordma.start_stream_server(echo, "127.0.0.1", 0, device=sdev)
    try:
        for srq in (None, True):
            reader, writer = await aiordma.open_connection("127.0.0.1", server.port, device=cdev, srq=srq)
            data = pattern(300_000, 3)
            writer.write(data)
            await writer.drain()
            assert await asyncio.wait_for(reader.readexactly(len(data)), T) == data
            assert writer.connection.stats["srq"] == (1 if srq else 0)
            writer.close()
            await writer.wait_closed()
        # (the server's side: its default too, whatever AIORDMA_SRQ says)
        assert seen[0].stats["srq"] == 0 or seen[0].closed
    finally:
        server.close()
        await server.wait_closed()
