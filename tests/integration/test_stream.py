"""RDMA byte streams (aiordma.stream) over the soft device, on both loops.

The checks every stream must pass, run against asyncio's TCP streams as
well, are in ``test_stream_conformance.py``. This file has aiordma's own:
ring sizes and wrap-around, credits and backpressure, progress modes, the
errors aiordma raises where asyncio defines nothing (misuse after close
raises ConnectionClosedError; a broken peer shows up as ConnectionLostError),
and a cancelled ``read(-1)`` that keeps what it had collected (asyncio's
loses it).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import struct

import pytest

import aiordma
from aiordma import ConnectionClosedError, ConnectionLostError

from ..support.waiting import wait_until

T = 20  # generous per-step timeout (s)


@pytest.fixture
async def stream_pair():
    """``await make(**opts)`` -> (client_reader, client_writer, server_reader, server_writer)."""
    servers = []
    writers = []

    async def make(server_opts=None, **client_opts):
        accepted: asyncio.Queue = asyncio.Queue()

        async def cb(reader, writer):
            await accepted.put((reader, writer))

        server = await aiordma.start_stream_server(cb, "127.0.0.1", 0, provider="soft", **(server_opts or {}))
        servers.append(server)
        cr, cw = await aiordma.open_connection("127.0.0.1", server.port, provider="soft", **client_opts)
        sr, sw = await asyncio.wait_for(accepted.get(), T)
        writers.extend([cw, sw])
        return cr, cw, sr, sw

    yield make
    for w in writers:
        w.close()
    for w in writers:
        await asyncio.wait_for(w.wait_closed(), T)
    for s in servers:
        s.close()
        await s.wait_closed()


async def test_echo_lines():
    async def echo(reader, writer):
        async for line in reader:
            writer.write(line.upper())
            await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await aiordma.start_stream_server(echo, "127.0.0.1", 0, provider="soft")
    try:
        reader, writer = await aiordma.open_connection("127.0.0.1", server.port, provider="soft")
        assert writer.get_extra_info("peername")[0] == "127.0.0.1"
        assert isinstance(writer.get_extra_info("connection"), aiordma.Connection)
        assert writer.can_write_eof()
        for i in range(50):
            writer.write(b"line %d\n" % i)
            await writer.drain()
            assert await asyncio.wait_for(reader.readline(), T) == b"LINE %d\n" % i
        writer.writelines([b"a\n", b"b", b"c\n", b"tail-without-newline"])
        writer.write_eof()
        got = [line async for line in reader]
        assert got == [b"A\n", b"BC\n", b"TAIL-WITHOUT-NEWLINE"]
        assert reader.at_eof()
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), T)
        assert writer.is_closing()
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("ring_size", [100_000, 1 << 20])
async def test_16mib_transfer_sha256_with_wraparound(stream_pair, ring_size):
    # a ring size that is no power of two and chunks that do not divide it: writes split at the ring end
    cr, cw, sr, sw = await stream_pair(server_opts={"ring_size": ring_size}, ring_size=ring_size)
    total = 16 << 20
    data = os.urandom(1 << 20) * 16
    expected = hashlib.sha256(data).hexdigest().encode()
    sizes = [1, 7, 4095, 65537, 99_999, 300_001, 1 << 20]

    async def send():
        off = i = 0
        while off < total:
            n = sizes[i % len(sizes)]
            cw.write(data[off : off + n])
            await cw.drain()
            off += n
            i += 1
        cw.write_eof()

    async def receive():
        h = hashlib.sha256()
        n = i = 0
        while True:
            want = sizes[(i * 3) % len(sizes)]
            if i % 2:
                chunk = await sr.read(want)
                if not chunk:
                    break
            else:
                try:
                    chunk = await sr.readexactly(want)
                except asyncio.IncompleteReadError as e:
                    chunk = e.partial
                    h.update(chunk)
                    n += len(chunk)
                    break
            h.update(chunk)
            n += len(chunk)
            i += 1
        assert n == total
        sw.write(h.hexdigest().encode() + b"\n")
        await sw.drain()

    await asyncio.wait_for(asyncio.gather(send(), receive()), 60)
    assert await asyncio.wait_for(cr.readline(), T) == expected + b"\n"
    stream = sr._s
    assert stream._rx_tail == total and stream._rx_tail > 10 * ring_size  # the ring wrapped many times
    assert cw.get_extra_info("peer_ring_size") == ring_size
    assert cw.connection.device.counters.get("rnr_naks_sent", 0) == 0


async def test_read_semantics(stream_pair):
    cr, cw, sr, sw = await stream_pair(server_opts={"limit": 64})
    cw.write(b"abcdef")
    assert await asyncio.wait_for(sr.readexactly(2), T) == b"ab"
    assert await sr.readexactly(0) == b""
    with pytest.raises(ValueError):
        await sr.readexactly(-1)
    assert await sr.read(0) == b""
    assert await sr.readexactly(4) == b"cdef"
    # readuntil with a multi-byte separator arriving in pieces
    cw.write(b"key: val")
    task = asyncio.ensure_future(sr.readuntil(b"\r\n"))
    await asyncio.sleep(0.05)
    assert not task.done()
    cw.write(b"ue\r")
    await asyncio.sleep(0.05)
    assert not task.done()
    cw.write(b"\nrest")
    assert await asyncio.wait_for(task, T) == b"key: value\r\n"
    assert await sr.readuntil((b"!", b"s")) == b"res"
    # limit: separator not within `limit` bytes -> LimitOverrunError, the bytes stay buffered
    cw.write(b"x" * 100 + b"\n")
    await asyncio.sleep(0.05)
    with pytest.raises(asyncio.LimitOverrunError):
        await asyncio.wait_for(sr.readuntil(b"\n"), T)
    assert await sr.readexactly(1) == b"t"
    assert await sr.readexactly(101) == b"x" * 100 + b"\n"
    # readline past the limit: ValueError and the line is dropped (asyncio semantics)
    cw.write(b"y" * 100 + b"\nnext\n")
    await asyncio.sleep(0.05)
    with pytest.raises(ValueError):
        await asyncio.wait_for(sr.readline(), T)
    assert await asyncio.wait_for(sr.readline(), T) == b"next\n"
    # EOF: readexactly -> IncompleteReadError with the partial bytes
    cw.write(b"123")
    cw.write_eof()
    with pytest.raises(asyncio.IncompleteReadError) as ei:
        await asyncio.wait_for(sr.readexactly(10), T)
    assert ei.value.partial == b"123" and ei.value.expected == 10
    assert sr.at_eof()
    with pytest.raises(asyncio.IncompleteReadError) as ei:
        await sr.readuntil(b"\n")
    assert ei.value.partial == b""
    # EOF is sticky
    for _ in range(3):
        assert await sr.read() == b""
        assert await sr.read(10) == b""
        assert await sr.readline() == b""
    assert sr.exception() is None


async def test_readuntil_and_read_all_at_eof(stream_pair):
    cr, cw, sr, sw = await stream_pair()
    cw.write(b"no separator here")
    cw.write_eof()
    with pytest.raises(asyncio.IncompleteReadError) as ei:
        await asyncio.wait_for(sr.readuntil(b"\n"), T)
    assert ei.value.partial == b"no separator here" and ei.value.expected is None
    assert sr.at_eof()
    # read(-1) collects everything up to EOF, here far more than the ring
    payload = os.urandom(300_000) * 10
    sw.write(payload)
    sw.write_eof()
    assert await asyncio.wait_for(cr.read(), T) == payload
    assert await cr.readline() == b""


async def test_lines_longer_than_the_ring(stream_pair):
    cr, cw, sr, sw = await stream_pair(server_opts={"ring_size": 8192, "limit": 1 << 20})
    line = b"z" * 50_000 + b"\n"
    cw.write(line * 3)
    for _ in range(3):
        assert await asyncio.wait_for(sr.readline(), T) == line


async def test_half_close(stream_pair):
    cr, cw, sr, sw = await stream_pair()
    cw.write(b"request")
    cw.write_eof()
    cw.write_eof()  # idempotent
    with pytest.raises(RuntimeError):
        cw.write(b"more")
    assert await asyncio.wait_for(sr.read(), T) == b"request"
    assert sr.at_eof()
    # the other direction still works, in both senses
    assert not sw.is_closing()
    for i in range(20):
        sw.write(b"reply %d\n" % i)
        await sw.drain()
    for i in range(20):
        assert await asyncio.wait_for(cr.readline(), T) == b"reply %d\n" % i
    sw.write(b"last")
    sw.close()
    await asyncio.wait_for(sw.wait_closed(), T)
    assert await asyncio.wait_for(cr.read(), T) == b"last"
    assert await cr.read() == b""


async def test_backpressure(stream_pair):
    ring = 65536
    high = 32768
    cr, cw, sr, sw = await stream_pair(server_opts={"ring_size": ring}, write_buffer_high=high)
    data = os.urandom(ring + 3 * high)
    cw.write(data)
    # the peer's ring takes `ring` bytes, the rest stays in the writer's buffer
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(cw.drain(), 0.5)
    await wait_until(lambda: cw.transport.get_write_buffer_size() == len(data) - ring)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(cw.drain(), 0.2)  # still blocked, and cancelling drain is harmless
    drain = asyncio.ensure_future(cw.drain())
    await asyncio.sleep(0.05)
    assert not drain.done()
    got = await asyncio.wait_for(sr.readexactly(len(data)), T)
    await asyncio.wait_for(drain, T)
    assert got == data
    assert cw.transport.get_write_buffer_size() == 0
    # and the stream still flows both ways
    cw.write(b"ping\n")
    assert await asyncio.wait_for(sr.readline(), T) == b"ping\n"


async def test_close_and_wait_closed(stream_pair):
    cr, cw, sr, sw = await stream_pair()
    pending_read = asyncio.ensure_future(cr.read(10))
    await asyncio.sleep(0.01)
    cw.write(b"x" * 200_000)
    cw.close()
    assert cw.is_closing()
    cw.close()  # idempotent
    # closing wakes the pending read with EOF, as closing an asyncio stream does
    assert await asyncio.wait_for(pending_read, T) == b""
    await asyncio.wait_for(cw.wait_closed(), T)
    await asyncio.wait_for(cw.wait_closed(), T)
    assert cw.connection.closed
    with pytest.raises(ConnectionClosedError):
        cw.write(b"y")
    with pytest.raises(ConnectionClosedError):
        cw.write_eof()
    with pytest.raises(ConnectionClosedError):
        await cw.drain()
    assert await cr.read() == b""  # reading after close() is EOF (asyncio's behaviour)
    assert await cr.readline() == b""
    with pytest.raises(asyncio.IncompleteReadError):
        await cr.readexactly(1)
    assert cr.at_eof()
    # the peer gets every byte written before close, then EOF
    assert await asyncio.wait_for(sr.read(), T) == b"x" * 200_000
    assert sr.at_eof()
    # and its writer finds the connection gone (the goodbye travels over the rendezvous TCP connection)
    await wait_until(sw.is_closing)
    with pytest.raises(ConnectionLostError):
        sw.write(b"z")
    with pytest.raises(ConnectionLostError):
        await sw.drain()


async def test_close_wakes_a_blocked_drain(stream_pair):
    cr, cw, sr, sw = await stream_pair(server_opts={"ring_size": 8192}, write_buffer_high=1024)
    cw.write(b"b" * 50_000)
    drain = asyncio.ensure_future(cw.drain())
    await asyncio.sleep(0.05)
    assert not drain.done()
    cw.transport.close_timeout = 0.5  # the peer never reads: close gives up and aborts
    cw.close()
    with pytest.raises(ConnectionClosedError):
        await asyncio.wait_for(drain, T)
    await asyncio.wait_for(cw.wait_closed(), T)
    await wait_until(sw.is_closing)
    with pytest.raises(ConnectionLostError):
        await asyncio.wait_for(sr.read(), T)


async def test_cancelled_read_keeps_stream_usable(stream_pair):
    cr, cw, sr, sw = await stream_pair()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(sr.read(100), 0.1)
    cw.write(b"abc")
    await asyncio.sleep(0.05)
    # a readexactly that waits for more is cancelled: the bytes it saw are not lost
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(sr.readexactly(6), 0.1)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(sr.readuntil(b"\n"), 0.1)
    cw.write(b"def\n")
    assert await asyncio.wait_for(sr.readexactly(6), T) == b"abcdef"
    assert await asyncio.wait_for(sr.readline(), T) == b"\n"
    # read(-1) cancelled mid-way keeps what it had collected
    cw.write(b"partial")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(sr.read(), 0.1)
    cw.write(b" and the rest")
    cw.write_eof()
    assert await asyncio.wait_for(sr.read(), T) == b"partial and the rest"


async def test_concurrent_reads_are_refused(stream_pair):
    cr, cw, sr, sw = await stream_pair()
    first = asyncio.ensure_future(sr.read(10))
    await asyncio.sleep(0.01)
    with pytest.raises(RuntimeError, match="already waiting"):
        await sr.read(10)
    cw.write(b"hi")
    assert await asyncio.wait_for(first, T) == b"hi"


async def test_concurrent_writers_keep_each_write_contiguous(stream_pair):
    cr, cw, sr, sw = await stream_pair(server_opts={"ring_size": 32768})
    head = struct.Struct(">HII")  # writer id, sequence, payload length

    async def producer(wid: int) -> None:
        for seq in range(60):
            n = (wid * 7919 + seq * 104729) % 20000 + 1
            cw.write(head.pack(wid, seq, n) + bytes([wid]) * n)
            if seq % 3 == 0:
                await cw.drain()
            else:
                await asyncio.sleep(0)

    writers = [asyncio.ensure_future(producer(w)) for w in range(6)]

    async def consume() -> None:
        nxt = {w: 0 for w in range(6)}
        while any(v < 60 for v in nxt.values()):
            wid, seq, n = head.unpack(await sr.readexactly(head.size))
            assert seq == nxt[wid], "one writer's records out of order"
            nxt[wid] += 1
            assert await sr.readexactly(n) == bytes([wid]) * n, "a write was interleaved with another"

    await asyncio.wait_for(asyncio.gather(consume(), *writers), 60)


@pytest.mark.parametrize("who", ["client", "server"])
async def test_abort_breaks_the_peer(stream_pair, who):
    cr, cw, sr, sw = await stream_pair(server_opts={"ring_size": 16384}, ring_size=16384)
    if who == "client":
        victim_r, victim_w, other_w = sr, sw, cw
    else:
        victim_r, victim_w, other_w = cr, cw, sw
    # the victim has a pending read and a blocked drain when its peer aborts
    victim_w.write(b"q" * (16384 + 200_000))
    drain = asyncio.ensure_future(victim_w.drain())
    read = asyncio.ensure_future(victim_r.readexactly(100))
    await asyncio.sleep(0.05)
    assert not drain.done() and not read.done()
    other_w.transport.abort()
    with pytest.raises(ConnectionLostError):
        await asyncio.wait_for(read, T)
    with pytest.raises(ConnectionLostError):
        await asyncio.wait_for(drain, T)
    with pytest.raises(ConnectionLostError):
        victim_w.write(b"more")
    with pytest.raises(ConnectionLostError):
        await victim_r.read(1)
    assert victim_w.is_closing()
    assert isinstance(victim_r.exception(), ConnectionLostError)
    # close on a broken stream is fine
    victim_w.close()
    await asyncio.wait_for(victim_w.wait_closed(), T)


async def test_bytes_that_arrived_before_a_break_are_still_read(stream_pair):
    cr, cw, sr, sw = await stream_pair()
    cw.write(b"delivered")
    assert await asyncio.wait_for(sr.readexactly(3), T) == b"del"  # all nine bytes are in sr's ring
    cw.connection.abort()  # no EOF: the stream breaks
    await wait_until(sw.is_closing, "the server's stream noticed the break")
    assert isinstance(sr.exception(), ConnectionLostError)
    assert await sr.read(100) == b"ivered"
    with pytest.raises(ConnectionLostError):
        await asyncio.wait_for(sr.read(100), T)


async def test_misuse_raises(stream_pair):
    cr, cw, sr, sw = await stream_pair()
    with pytest.raises(TypeError):
        cw.write("text")  # type: ignore[arg-type]
    cw.write(b"")  # empty writes are fine
    cw.write(memoryview(b"abcdef")[::2])  # non-contiguous buffers are copied
    cw.write(bytearray(b"!"))
    assert await asyncio.wait_for(sr.readexactly(4), T) == b"ace!"
    with pytest.raises(ValueError):
        await sr.readuntil(b"")
    with pytest.raises(ValueError):
        cw.transport.set_write_buffer_limits(high=1, low=2)


@pytest.mark.parametrize("progress", ["thread", "busy"])
async def test_progress_modes(stream_pair, progress):
    cr, cw, sr, sw = await stream_pair(server_opts={"progress": progress}, progress=progress)
    assert cw.connection.progress_mode == progress
    payload = os.urandom(3 << 20)
    cw.write(payload)
    cw.write_eof()
    assert await asyncio.wait_for(sr.read(), T) == payload


async def test_too_few_receive_buffers_are_refused():
    with pytest.raises(ValueError, match="recv_buffers"):
        await aiordma.open_connection("127.0.0.1", 1, provider="soft", recv_buffers=2)


async def test_plain_peers_are_refused():
    """Stream endpoints and plain message endpoints find out at the rendezvous
    (capability ``stream-ring-v1``), not later through a missing ring."""

    async def handler(conn):
        await conn.recv()

    plain = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft")
    try:
        with pytest.raises(aiordma.CapabilityError, match="stream-ring-v1.*not an aiordma stream endpoint"):
            await aiordma.open_connection("127.0.0.1", plain.port, provider="soft")
        await wait_until(lambda: plain.refused == 1)
        assert plain.accepted == 0
    finally:
        plain.close()
        await plain.wait_closed()

    async def cb(reader, writer):  # pragma: no cover - never called
        raise AssertionError("a plain client reached the stream callback")

    server = await aiordma.start_stream_server(cb, "127.0.0.1", 0, provider="soft")
    try:
        with pytest.raises(aiordma.CapabilityError, match="stream-ring-v1"):
            await aiordma.connect("127.0.0.1", server.port, provider="soft")
        await wait_until(lambda: server.refused == 1)
        assert server.accepted == 0
    finally:
        server.close()
        await server.wait_closed()


async def test_server_close_stops_accepting_and_abort_clients_ends_streams():
    """asyncio's lifetimes: close() stops accepting, live streams go on;
    abort_clients() ends them; wait_closed() returns once they are closed."""
    accepted: asyncio.Queue = asyncio.Queue()

    async def cb(reader, writer):
        await accepted.put(writer)
        writer.write(await reader.readexactly(5))  # echo one greeting
        await reader.read()  # blocks until the server goes away

    server = await aiordma.start_stream_server(cb, "127.0.0.1", 0, provider="soft")
    reader, writer = await aiordma.open_connection("127.0.0.1", server.port, provider="soft")
    await asyncio.wait_for(accepted.get(), T)
    server.close()
    assert not server.is_serving()
    with pytest.raises(OSError):  # the listener is gone: a RendezvousError is a ConnectionError
        await aiordma.open_connection("127.0.0.1", server.port, provider="soft")
    writer.write(b"hello")  # the stream made before close() still works
    assert await asyncio.wait_for(reader.readexactly(5), T) == b"hello"
    assert len(server.connections) == 1
    server.abort_clients()
    await asyncio.wait_for(server.wait_closed(), T)
    assert not server.connections
    with pytest.raises(ConnectionLostError, match="aborted"):
        await asyncio.wait_for(reader.read(), T)
    writer.close()
    await asyncio.wait_for(writer.wait_closed(), T)
