"""The TCP rendezvous under hostile and broken peers: every bad case gets a clear
error on both sides, and the server goes on serving real clients."""

from __future__ import annotations

import asyncio
import secrets
import struct

import msgpack
import pytest

import aiordma
from aiordma import rendezvous as rdv

from ..support.waiting import wait_until


def frame(msg: dict) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


async def raw_client(port: int, data: bytes, *, read: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = b""
    if read:
        try:
            out = await asyncio.wait_for(reader.read(65536), 5)
        except (TimeoutError, ConnectionResetError):
            pass
    writer.close()
    try:
        await writer.wait_closed()
    except ConnectionResetError:
        pass
    return out


async def assert_still_serves(server) -> None:
    async with await aiordma.connect("127.0.0.1", server.port, provider="soft") as conn:
        await conn.send(b"still here")
        assert await conn.recv() == b"still here"


def hello(v: int = rdv.PROTOCOL_VERSION) -> dict:
    return {"t": "hello", "v": v, "caps": list(rdv.CAPABILITIES), "nonce": secrets.token_bytes(16)}


@pytest.mark.parametrize(
    "payload, expect",
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "exceeds|limit"),
        (struct.pack(">I", 10_000_000) + b"x" * 16, "limit"),
        (struct.pack(">I", 100) + b"short", "truncated"),
        (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "malformed"),
        (frame({"nope": 1}), "malformed"),
        (frame({"t": "endpoint"}), "expected 'hello'"),
    ],
    ids=["http", "oversize", "truncated", "garbage-msgpack", "untyped", "out-of-order"],
)
async def test_garbage_is_refused_and_server_keeps_serving(echo_server, payload, expect):
    await raw_client(echo_server.port, payload, read=False)
    await wait_until(lambda: echo_server.refused, "the server refused the client")
    assert echo_server.refused == 1
    assert isinstance(echo_server.last_error, aiordma.RendezvousError)
    import re

    assert re.search(expect, str(echo_server.last_error)), str(echo_server.last_error)
    await assert_still_serves(echo_server)


async def test_wrong_version_refused_both_sides(echo_server):
    reply = await raw_client(echo_server.port, frame(hello(v=99)))
    msg = msgpack.unpackb(reply[4:], raw=False)
    assert msg["t"] == "error" and msg["code"] == "version"
    assert isinstance(echo_server.last_error, aiordma.ProtocolVersionError)

    async def fake_server(reader, writer):
        await reader.readexactly(4)
        writer.write(frame(hello(v=2)))
        await writer.drain()
        await reader.read()  # until the client hangs up
        writer.close()

    srv = await asyncio.start_server(fake_server, "127.0.0.1", 0)
    try:
        with pytest.raises(aiordma.ProtocolVersionError, match="version 2"):
            await aiordma.connect("127.0.0.1", srv.sockets[0].getsockname()[1], provider="soft", timeout=5)
    finally:
        srv.close()
        await srv.wait_closed()
    await assert_still_serves(echo_server)


async def test_token_authentication():
    async def handler(conn):
        async for m in conn:
            await conn.send(m)

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft", token="s3cret")
    try:
        async with await aiordma.connect("127.0.0.1", server.port, provider="soft", token="s3cret") as conn:
            await conn.send(b"authenticated")
            assert await conn.recv() == b"authenticated"
        with pytest.raises(aiordma.AuthenticationError, match="wrong token|refused"):
            await aiordma.connect("127.0.0.1", server.port, provider="soft", token="guess")
        with pytest.raises(aiordma.AuthenticationError, match="requires a shared-secret token"):
            await aiordma.connect("127.0.0.1", server.port, provider="soft")
        # the server notices the second refusal a moment later
        await wait_until(lambda: server.refused >= 2, "the server counted both refusals")
        assert server.refused == 2
        assert isinstance(server.last_error, aiordma.AuthenticationError)
    finally:
        server.close()
        await server.wait_closed()


async def test_client_with_token_refuses_unauthenticated_server(echo_server):
    with pytest.raises(aiordma.AuthenticationError, match="does not authenticate"):
        await aiordma.connect("127.0.0.1", echo_server.port, provider="soft", token="t")


async def test_lying_endpoint_is_refused(echo_server):
    reader, writer = await asyncio.open_connection("127.0.0.1", echo_server.port)
    ch = rdv.Channel(reader, writer)
    await rdv.client_hello(ch, None)
    await ch.send(
        {
            "t": "endpoint",
            "qpn": 77,
            "psn": 1,
            "gid": b"abc",
            "mtu": 4096,
            "port": 4791,
            "recv_buffers": 4,
            "recv_buffer_size": 4096,
            "buffers": {},
        }
    )
    with pytest.raises(aiordma.RendezvousError, match="gid must be 16 bytes"):
        await ch.recv()
    ch.close()
    assert "gid must be 16 bytes" in str(echo_server.last_error)
    bad = rdv.Endpoint(qpn=77, psn=1, gid=bytes(16), mtu=4096).to_wire()
    for key, value, text in [
        ("mtu", 3000, "path MTU"),
        ("qpn", 1 << 30, "qpn"),
        ("psn", -1, "psn"),
        ("buffers", {"x": [1, 2]}, "buffer 'x'"),
        ("soft_skip_icrc", 1, "soft_skip_icrc"),
    ]:
        with pytest.raises(aiordma.RendezvousError, match=text):
            rdv.Endpoint.from_wire({**bad, key: value})
    # the ICRC offer travels only when made, and a peer that does not know it ignores it
    assert "soft_skip_icrc" not in bad and not rdv.Endpoint.from_wire(bad).soft_skip_icrc
    offer = rdv.Endpoint(qpn=77, psn=1, gid=bytes(16), mtu=4096, soft_skip_icrc=True).to_wire()
    assert offer["soft_skip_icrc"] is True and rdv.Endpoint.from_wire(offer).soft_skip_icrc
    await assert_still_serves(echo_server)


async def test_slow_loris_is_bounded_and_real_clients_connect():
    async def handler(conn):
        async for m in conn:
            await conn.send(m)

    # 1 s: the silent clients wait it out; the real client beside them must finish within it
    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft", handshake_timeout=1.0)
    idle = []
    try:
        for _ in range(200):
            idle.append(await asyncio.open_connection("127.0.0.1", server.port))
        await assert_still_serves(server)  # while 200 silent clients hold sockets
        await wait_until(lambda: server.refused >= 200, "the 200 silent clients timed out")
        assert server.refused == 200
        assert isinstance(server.last_error, aiordma.HandshakeTimeoutError)
        await assert_still_serves(server)
    finally:
        for _, w in idle:
            w.close()
        server.close()
        await server.wait_closed()


async def test_a_slow_but_answering_client_is_served():
    """handshake_timeout bounds silence, not a busy handshake: a client whose every
    message reaches the server 0.6 s late (a relay delays them) finishes a handshake
    that takes well over the server's 1 s, and its connection works."""

    async def handler(conn):
        async for m in conn:
            await conn.send(m)

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft", handshake_timeout=1.0)

    async def pump(reader, writer, delay):
        try:
            while data := await reader.read(65536):
                await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    pumps: list[asyncio.Task] = []

    async def relay(client_reader, client_writer):
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", server.port)
        pumps.append(asyncio.create_task(pump(client_reader, server_writer, 0.6)))
        pumps.append(asyncio.create_task(pump(server_reader, client_writer, 0.0)))

    slow = await asyncio.start_server(relay, "127.0.0.1", 0)
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        conn = await aiordma.connect("127.0.0.1", slow.sockets[0].getsockname()[1], provider="soft")
        assert loop.time() - t0 > 1.0  # longer than the server's handshake_timeout
        await conn.send(b"slow but alive")
        assert await asyncio.wait_for(conn.recv(), 10) == b"slow but alive"
        assert server.refused == 0
        await conn.close()
    finally:
        for t in pumps:
            t.cancel()
        slow.close()
        server.close()
        await server.close_clients()
        await server.wait_closed()


async def test_connect_errors_are_clear():
    # nothing listening
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    with pytest.raises(aiordma.RendezvousError, match="cannot reach the aiordma server"):
        await aiordma.connect("127.0.0.1", port, provider="soft", timeout=2)

    # a server that accepts and says nothing
    async def silent(reader, writer):
        await reader.read()  # says nothing until the client hangs up
        writer.close()

    srv = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        with pytest.raises(aiordma.HandshakeTimeoutError, match="did not finish within 0.3"):
            await aiordma.connect("127.0.0.1", srv.sockets[0].getsockname()[1], provider="soft", timeout=0.3)
    finally:
        srv.close()
        await srv.wait_closed()
