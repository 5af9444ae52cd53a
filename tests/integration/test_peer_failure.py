"""Dead and misbehaving peers: every pending await fails promptly, naming the cause."""

from __future__ import annotations

import asyncio
import time

import pytest

import aiordma
from aiordma.providers.soft.faults import LinkFaults

from ..support.child_server import ChildServer


@pytest.fixture
def child_server():
    with ChildServer.start(mem_size=16 << 20) as child:
        yield child


async def test_peer_killed_mid_traffic_fails_everything_promptly(child_server):
    conn = await aiordma.connect("127.0.0.1", child_server.port, provider="soft")
    try:
        rb = conn.remote("mem")
        await conn.write(b"warm-up", rb[0:7])
        assert await conn.read(rb[0:7]) == b"warm-up"
        src = conn.register(bytearray(1 << 20))
        writes = [asyncio.ensure_future(conn.write(src, rb[i << 20 : (i + 1) << 20])) for i in range(16)]
        reads = [asyncio.ensure_future(conn.read(rb[0:65536])) for _ in range(8)]
        recv = asyncio.ensure_future(conn.recv())
        await asyncio.sleep(0.01)
        child_server.kill()
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*writes, *reads, recv, return_exceptions=True), 10)
        elapsed = time.monotonic() - t0
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed, "nothing failed although the peer died"
        assert recv.exception() is not None
        for r in failed:
            assert isinstance(r, aiordma.ConnectionLostError | aiordma.WorkCompletionError), repr(r)
        assert any("peer vanished" in str(r) or "IBV_WC_RETRY_EXC_ERR" in str(r) for r in failed)
        assert elapsed < 5, f"took {elapsed:.1f} s to notice the dead peer"
        with pytest.raises(aiordma.ConnectionLostError):
            await conn.send(b"after death")
        assert not conn.stats["operations_outstanding"]
    finally:
        await conn.close()


async def test_peer_that_stops_acknowledging_gives_retry_exceeded():
    mem = aiordma.register(bytearray(1 << 16), provider="soft")

    async def handler(conn):
        async for m in conn:
            await conn.send(m)

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft", expose={"mem": mem.exposed("rwa")})
    device = aiordma.get_device("soft")
    try:
        conn = await aiordma.connect("127.0.0.1", server.port, provider="soft", ack_timeout=10, retry_cnt=3)
        rb = conn.remote("mem")
        await conn.write(b"ok", rb[0:2])
        device.faults = LinkFaults(filter=lambda datagram: False)  # the link eats everything
        with pytest.raises(aiordma.RetryExceededError, match="IBV_WC_RETRY_EXC_ERR"):
            await asyncio.wait_for(conn.write(b"lost", rb[0:4]), 10)
        # promptly means after exactly 1 + retry_cnt retransmit timeouts (of 4 ms), counted
        assert conn.qp.counters["timeouts"] == 4, conn.qp.counters
        with pytest.raises(aiordma.ConnectionLostError, match="IBV_QPS_ERR"):
            await conn.read(rb[0:2])
        await conn.close()
    finally:
        device.faults = None
        server.close()
        await server.wait_closed()
        mem.close()


ACKNOWLEDGE, ATOMIC_ACKNOWLEDGE = 0x11, 0x12  # RC opcodes (BTH's first byte)


async def test_an_operation_whose_acknowledgement_was_lost_may_have_executed():
    """The peer executes a FETCH_ADD but every acknowledgement is lost: the error
    says the operation may have run (it did: the counter moved), and a Read
    that fails the same way is not said to have."""
    mem = aiordma.register(bytearray(64), provider="soft")
    server = await aiordma.start_server(
        lambda conn: conn.wait_closed(), "127.0.0.1", 0, provider="soft", expose={"mem": mem.exposed("rwa")}
    )
    device = aiordma.get_device("soft")
    try:
        conn = await aiordma.connect("127.0.0.1", server.port, provider="soft", ack_timeout=10, retry_cnt=2)
        rb = conn.remote("mem")
        assert await conn.fetch_and_add(rb[0:8], 1) == 0
        device.faults = LinkFaults(filter=lambda d: d[0] not in (ACKNOWLEDGE, ATOMIC_ACKNOWLEDGE))
        with pytest.raises(aiordma.RetryExceededError) as info:
            await asyncio.wait_for(conn.fetch_and_add(rb[0:8], 1), 10)
        assert info.value.may_have_executed
        assert "may have executed at the peer" in str(info.value)
        assert int.from_bytes(mem.view[0:8], "little") == 2  # it did run, once
        await conn.close()

        device.faults = None
        conn = await aiordma.connect("127.0.0.1", server.port, provider="soft", ack_timeout=10, retry_cnt=2)
        device.faults = LinkFaults(filter=lambda d: False)
        with pytest.raises(aiordma.RetryExceededError) as info:
            await asyncio.wait_for(conn.read(rb[0:8]), 10)
        assert not info.value.may_have_executed
        assert "may have executed" not in str(info.value)
        await conn.close()
    finally:
        device.faults = None
        server.close()
        await server.close_clients()
        await server.wait_closed()
        mem.close()


async def test_a_goodbye_that_overtakes_the_last_acknowledgement_loses_nothing():
    """The peer takes our last message and says goodbye over TCP before its ACK
    reaches us (the two travel apart: here the first ACK is lost and comes again
    on the retransmission). drain() and close() succeed: the message arrived."""
    taken = asyncio.Event()
    server_side: list[aiordma.Connection] = []

    async def handler(conn):
        server_side.append(conn)
        assert await conn.recv() == b"last words"
        taken.set()
        await conn.wait_closed()  # the queue pair stays up: it answers the retransmission

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft")
    device = aiordma.get_device("soft")
    try:
        conn = await aiordma.connect("127.0.0.1", server.port, provider="soft", ack_timeout=12, retry_cnt=7)
        await conn.drain()
        eaten: list[bytes] = []

        def eat_first_ack_to_us(d: bytes) -> bool:
            if d[0] == ACKNOWLEDGE and int.from_bytes(d[5:8], "big") == conn.qp_num and not eaten:
                eaten.append(d)
                return False
            return True

        device.faults = LinkFaults(filter=eat_first_ack_to_us)
        await conn.send(b"last words")
        drained = asyncio.ensure_future(conn.drain())
        await asyncio.wait_for(taken.wait(), 5)
        assert eaten and not drained.done(), "the ACK was not held back: nothing tested"
        # the peer's goodbye, sent before its queue pair acknowledged what it took
        await server_side[0]._rendezvous.send(aiordma.rendezvous.goodbye())
        await asyncio.wait_for(drained, 5)  # the retransmission was acknowledged: delivered
        with pytest.raises(aiordma.ConnectionClosedError, match="the peer closed the connection"):
            await asyncio.wait_for(conn.recv(), 5)
        with pytest.raises(aiordma.ConnectionClosedError):
            await conn.send(b"after the goodbye")
        await conn.close()  # nothing was lost: no ConnectionLostError
        assert conn.stats["messages_undelivered"] == 0
    finally:
        device.faults = None
        server.close()
        await server.close_clients()
        await server.wait_closed()


async def test_a_refused_read_fails_as_itself_when_the_goodbye_overtakes_the_nak():
    """The responder refuses a Read (a forged rkey): it NAKs the request over the
    RDMA path and says why over the rendezvous as its queue pair fails; the two
    race. Here our device takes the NAK 0.2 s late (fault injection: its tracer
    waits on it in the NIC thread), so the goodbye surely comes first: the Read
    still fails as a RemoteAccessError with the responder's reason, not as a lost
    connection, and the connection is lost after it."""
    from aiordma.providers import open_device
    from aiordma.providers.soft.trace import TraceEvent

    def late_naks(event: str, **fields: object) -> None:
        datagram = fields.get("datagram")
        # BTH (12 bytes), then the AETH: syndrome 011xxxxx is a NAK
        if event == TraceEvent.UDP_RECV and datagram[0] == ACKNOWLEDGE and datagram[12] >> 5 == 0b011:
            time.sleep(0.2)

    device = open_device("soft")
    device.shared_memory_links = False  # (the tracer watches datagrams)
    device.set_tracer(late_naks)
    with ChildServer.start(mem_size=1 << 20) as child:
        conn = await aiordma.connect("127.0.0.1", child.port, device=device)
        try:
            remote = conn.remote("mem")
            assert await conn.read(remote[0:64]) == bytes(64)
            forged = aiordma.RemoteBuffer(remote.addr, 4096, remote.rkey ^ 0x5A5A)
            t0 = time.monotonic()
            with pytest.raises(aiordma.RemoteAccessError, match="rkey") as info:
                await asyncio.wait_for(conn.read(forged), 10)
            elapsed = time.monotonic() - t0
            assert not isinstance(info.value, aiordma.ConnectionLostError)
            assert elapsed >= 0.15, f"the NAK was not late ({elapsed:.3f} s): the test forced nothing"
            assert conn.state is aiordma.ConnectionState.LOST
            with pytest.raises(aiordma.ConnectionLostError, match="IBV_QPS_ERR"):
                await conn.read(remote[0:64])
        finally:
            await conn.close()
            device.set_tracer(None)
            device.close()
