"""aiordma connections over RDMA CM on kernel Soft-RoCE (rxe0 in scripts/rxe-vm).

``connect(..., rdma_cm=True)`` resolves the server's address and route with
librdmacm and connects the queue pairs with the CM's REQ/REP/RTU; the server
(``start_server(..., rdma_cm=True)``) listens in the CM's port space and
answers each CONNECT_REQUEST. Client and server live in this process, both
on rxe0 (rxe loopback), so the CM's MADs really travel through the kernel's
IB CM. Every API is then the same as over the TCP rendezvous: messages,
one-sided operations on exposed buffers, streams, the token, the goodbye.
"""

from __future__ import annotations

import asyncio
import os

import pytest

import aiordma
from aiordma import ConnectionClosedError, ConnectionLostError, RendezvousError

pytestmark = pytest.mark.rxe

T = 30  # per-step timeout (s): TCG is slow
DEVICE = os.environ.get("AIORDMA_RXE_DEVICE") or "rxe0"
IP = os.environ.get("AIORDMA_RXE_IP") or "10.0.2.15"
TOKEN = b"a token of at least sixteen bytes, for the CM tests"


async def until(condition, timeout: float = T) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


async def echo(conn: aiordma.Connection) -> None:
    async for msg in conn:
        await conn.send(msg)


@pytest.fixture
async def cm_server():
    servers = []

    async def start(handler=echo, **kw):
        kw.setdefault("token", TOKEN)
        server = await aiordma.start_server(handler, IP, 0, device=DEVICE, rdma_cm=True, **kw)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()
        await server.close_clients()
        await server.wait_closed()


async def test_messages_and_one_sided_operations_over_rdma_cm(cm_server):
    mem = aiordma.get_device("pyverbs", DEVICE)
    buf = bytearray(4096)
    region = aiordma.register(buf, device=mem)
    buf[:5] = b"hello"
    server = await cm_server(expose={"mem": region.exposed("rwa")})
    conn = await asyncio.wait_for(aiordma.connect(IP, server.port, rdma_cm=True, token=TOKEN, device=DEVICE), T)
    try:
        assert conn.path is not None
        assert "RDMA CM" in conn.path.gid_reason
        assert conn.mtu in (256, 512, 1024, 2048, 4096)
        # the rendezvous's addresses are the CM's: the server's address and port
        assert conn._peer_address[0] == IP and conn._peer_address[1] == server.port
        for size in (1, 64, 4096, 200_000):  # a small message, a chunked one, a large one (RDMA Read)
            data = os.urandom(size)
            await asyncio.wait_for(conn.send(data), T)
            assert await asyncio.wait_for(conn.recv(), T) == data
        remote = await conn.wait_remote("mem", T)
        got = bytearray(5)
        await asyncio.wait_for(conn.read(remote[:5], into=got), T)
        assert bytes(got) == b"hello"
        await asyncio.wait_for(conn.write(b"world", remote[100:105]), T)
        assert bytes(buf[100:105]) == b"world"
        old = await asyncio.wait_for(conn.fetch_and_add(remote[8:16], 5), T)
        assert old == 0
        assert int.from_bytes(buf[8:16], "little") == 5
    finally:
        await conn.close()
    assert server.accepted == 1


async def test_traffic_class_and_the_cm_path_are_on_the_queue_pair(cm_server):
    """A traffic class (DSCP 26) asked of an RDMA CM connection is in its QP's
    address vector (kernel rxe writes it into every packet's IP header: see
    test_soft_rxe's capture), and the QP talks to the QP the CM connected."""
    accepted: asyncio.Queue[aiordma.Connection] = asyncio.Queue()

    async def keep(conn):
        await accepted.put(conn)
        await conn.recv()

    server = await cm_server(keep)
    conn = await asyncio.wait_for(aiordma.connect(IP, server.port, rdma_cm=True, token=TOKEN, traffic_class=26 << 2), T)
    try:
        theirs = await asyncio.wait_for(accepted.get(), T)
        attr = conn.qp.query()
        assert attr.traffic_class == 104 and conn.path.traffic_class == 104
        assert attr.dest_qp_num == theirs.qp.qp_num
        assert theirs.qp.query().dest_qp_num == conn.qp.qp_num
    finally:
        await conn.close()


async def test_a_wrong_token_is_refused_over_rdma_cm_and_nothing_is_exposed(cm_server):
    server = await cm_server(
        expose={"mem": aiordma.register(bytearray(64), device=aiordma.get_device("pyverbs", DEVICE))}
    )
    with pytest.raises(aiordma.AuthenticationError):
        await asyncio.wait_for(
            aiordma.connect(IP, server.port, rdma_cm=True, token=b"not the token, but just as long!", device=DEVICE), T
        )
    await until(lambda: server.refused == 1)  # (the client hears of it before the server counts it)
    assert server.accepted == 0


async def test_closing_either_end_is_seen_by_the_other_over_rdma_cm(cm_server):
    accepted: asyncio.Queue[aiordma.Connection] = asyncio.Queue()

    async def keep(conn):
        conn.detach()
        await accepted.put(conn)

    server = await cm_server(keep)
    client = await asyncio.wait_for(aiordma.connect(IP, server.port, rdma_cm=True, token=TOKEN), T)
    theirs = await asyncio.wait_for(accepted.get(), T)
    await client.send(b"last words")
    await client.close()
    # the goodbye travelled on the queue pair after the message: a clean close
    assert await asyncio.wait_for(theirs.recv(), T) == b"last words"
    with pytest.raises(ConnectionClosedError):
        await asyncio.wait_for(theirs.recv(), T)
    await theirs.wait_closed()

    client = await asyncio.wait_for(aiordma.connect(IP, server.port, rdma_cm=True, token=TOKEN), T)
    theirs = await asyncio.wait_for(accepted.get(), T)
    theirs.abort()  # (its goodbye is best effort: the DREQ ends the client's connection in any case)
    with pytest.raises(ConnectionLostError):
        await asyncio.wait_for(client.recv(), T)
    await client.wait_closed()


async def test_many_connections_over_one_listener(cm_server):
    server = await cm_server()
    conns = await asyncio.wait_for(
        asyncio.gather(*(aiordma.connect(IP, server.port, rdma_cm=True, token=TOKEN) for _ in range(8))), 4 * T
    )
    try:
        for i, conn in enumerate(conns):
            await conn.send(b"n%d" % i)
        for i, conn in enumerate(conns):
            assert await asyncio.wait_for(conn.recv(), T) == b"n%d" % i
        # one closes: only its server connection ends (its DISCONNECTED found the right id)
        await conns[0].close()
        await conns[1].send(b"still here")
        assert await asyncio.wait_for(conns[1].recv(), T) == b"still here"
    finally:
        await asyncio.gather(*(c.close() for c in conns[1:]), return_exceptions=True)
    assert server.accepted == 8


async def test_a_stream_over_rdma_cm(cm_server):
    async def handle(reader, writer):
        data = await reader.readexactly(100_000)
        writer.write(data[::-1])
        await writer.drain()
        writer.close()

    server = await aiordma.start_stream_server(handle, IP, 0, device=DEVICE, rdma_cm=True, token=TOKEN)
    try:
        reader, writer = await asyncio.wait_for(aiordma.open_connection(IP, server.port, rdma_cm=True, token=TOKEN), T)
        payload = os.urandom(100_000)
        writer.write(payload)
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(100_000), T) == payload[::-1]
        writer.close()
    finally:
        server.close()
        await server.close_clients()
        await server.wait_closed()


async def test_no_listener_is_a_clear_connection_error():
    with pytest.raises(RendezvousError, match="rejected|refused|unreachable|failed"):
        await asyncio.wait_for(aiordma.connect(IP, 1, rdma_cm=True, token=TOKEN, timeout=T), 2 * T)


async def test_an_address_no_rdma_device_carries_is_refused_with_the_reason():
    with pytest.raises(RendezvousError, match="RDMA CM cannot resolve|RDMA CM found no route|rdma_resolve_route"):
        await asyncio.wait_for(aiordma.connect("127.0.0.1", 1, rdma_cm=True, token=TOKEN, timeout=T), 2 * T)


async def test_the_listener_needs_an_address_an_rdma_device_carries():
    async def nothing(conn):
        pass

    with pytest.raises(RendezvousError, match="RDMA CM cannot listen on 127.0.0.1"):
        await aiordma.start_server(nothing, "127.0.0.1", 0, device=DEVICE, rdma_cm=True)


async def test_a_client_that_is_not_aiordma_gets_a_reject_that_says_why(cm_server):
    """A REQ whose private data is not an aiordma hello (rping's is empty): the
    server answers with a REJ naming the reason, and stays up."""
    from aiordma.cm import _Events, _next_event, rejection_reason
    from aiordma.providers.librdmacm import CMId, EventType

    server = await cm_server()
    events = _Events(asyncio.get_running_loop())
    cm_id = CMId(events.channel)
    queue = events.watch(cm_id.handle)
    try:
        cm_id.resolve_addr(IP, server.port, 2000)
        assert (await _next_event(queue, T, "addr")).type == EventType.ADDR_RESOLVED
        cm_id.resolve_route(2000)
        assert (await _next_event(queue, T, "route")).type == EventType.ROUTE_RESOLVED
        dev = aiordma.get_device("pyverbs", DEVICE)
        conn = aiordma.Connection(dev)  # (a QP for the REQ to name)
        try:
            cm_id.connect(conn.qp.qp_num, b"rping!", depth=1, retry=7)
            ev = await _next_event(queue, T, "connect")
        finally:
            conn.abort()
        assert ev.type == EventType.REJECTED
        assert "not an aiordma hello" in (rejection_reason(ev.private_data) or "")
    finally:
        cm_id.destroy()
        events.forget(cm_id.handle)
        events.close()
    await until(lambda: server.refused == 1)
    # the server still serves. (The kernel CM resends a lost REQ or REP only after
    # its response timeout, about 8 s: under TCG a VM now and then loses one, so
    # this connection gets room for a resend; what is tested is that it works.)
    conn = await asyncio.wait_for(aiordma.connect(IP, server.port, rdma_cm=True, token=TOKEN, timeout=T), 2 * T)
    await conn.close()
