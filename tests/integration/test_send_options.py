"""Two options of the message layer that a framework's transport needs (the Dask
backend uses both): ``send(..., wait_pulled=False)`` returns once a large
message is announced whatever its buffer, as TCP's write returns once queued;
``registration_cache=0`` keeps no buffer alive past its message.

Every async test runs on asyncio and uvloop (root conftest)."""

from __future__ import annotations

import array
import asyncio
import gc
import os
import weakref
from collections.abc import AsyncIterator

import pytest

import aiordma
from aiordma.connection import default_registration_cache

from ..support.waiting import wait_until

T = 30
N = 1 << 20  # above the default large-message threshold (256 KiB): pulled by RDMA Read


class HeldReceiver:
    """A server whose application reads one message into a buffer only when told."""

    def __init__(self) -> None:
        self.conn: aiordma.Connection | None = None
        self.read = asyncio.Event()
        self.got: asyncio.Queue[bytes] = asyncio.Queue()
        self.server: aiordma.Server | None = None

    async def handler(self, conn: aiordma.Connection) -> None:
        self.conn = conn
        while True:
            await self.read.wait()
            self.read.clear()
            buf = bytearray(N)
            n = await conn.recv_into(buf)
            await self.got.put(bytes(buf[:n]))


@pytest.fixture
async def held() -> AsyncIterator[HeldReceiver]:
    rx = HeldReceiver()
    rx.server = await aiordma.start_server(rx.handler, "127.0.0.1", 0, provider="soft")
    yield rx
    rx.server.close()
    rx.server.abort_clients()
    await rx.server.wait_closed()


async def _announced(rx: HeldReceiver) -> None:
    await wait_until(lambda: rx.conn is not None, "the server accepted the connection")
    assert rx.conn is not None
    conn = rx.conn
    await wait_until(lambda: conn.stats["recv_queued_large_messages"] == 1, "the large message was announced")


async def test_wait_pulled_false_returns_once_announced(held: HeldReceiver) -> None:
    assert held.server is not None
    async with await aiordma.connect("127.0.0.1", held.server.port, provider="soft") as conn:
        data = bytearray(os.urandom(N))
        # a writable buffer: by default send waits until the peer pulled it, and this peer does not read
        await asyncio.wait_for(conn.send(data, wait_pulled=False), T)
        assert conn.stats["large_bytes_unpulled"] == N
        assert conn.stats["large_messages_in_flight"] == 1
        await _announced(held)
        held.read.set()
        assert await asyncio.wait_for(held.got.get(), T) == bytes(data)
        await asyncio.wait_for(conn.drain(), T)  # drain() says when the buffer may change
        assert conn.stats["large_bytes_unpulled"] == 0


@pytest.mark.parametrize("kind", ["bytearray (default)", "bytes with wait_pulled=True"])
async def test_a_send_that_waits_for_the_pull(held: HeldReceiver, kind: str) -> None:
    assert held.server is not None
    async with await aiordma.connect("127.0.0.1", held.server.port, provider="soft") as conn:
        payload = os.urandom(N)
        if kind.startswith("bytearray"):
            send = asyncio.ensure_future(conn.send(bytearray(payload)))
        else:
            send = asyncio.ensure_future(conn.send(payload, wait_pulled=True))
        await _announced(held)
        for _ in range(20):  # the peer has it announced and does not read: send must still wait
            await asyncio.sleep(0.005)
            assert not send.done()
        held.read.set()
        await asyncio.wait_for(send, T)
        assert await asyncio.wait_for(held.got.get(), T) == payload


async def test_a_cancelled_send_that_later_fails_is_not_an_unretrieved_error(held: HeldReceiver) -> None:
    """The caller of a large send gives up (cancelled) while the peer has not
    pulled; the connection is then aborted. The message's own task fails, and
    that failure is the connection's (its error), not a "Task exception was
    never retrieved" on the loop (loop_hygiene fails the test on that)."""
    assert held.server is not None
    conn = await aiordma.connect("127.0.0.1", held.server.port, provider="soft")
    send = asyncio.ensure_future(conn.send(bytearray(N)))  # writable: waits for the pull
    await _announced(held)
    send.cancel()
    with pytest.raises(asyncio.CancelledError):
        await send
    conn.abort()
    await conn.wait_closed()
    gc.collect()  # an unretrieved exception is reported when its task is collected
    for _ in range(3):
        await asyncio.sleep(0)


async def test_registration_cache_zero_keeps_no_buffer_alive() -> None:
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def reader(conn: aiordma.Connection) -> None:
        async for msg in conn:
            await got.put(msg)

    server = await aiordma.start_server(reader, "127.0.0.1", 0, provider="soft")
    try:
        # None: the soft device's default, where a registration is a buffer export and
        # none is kept (a device that pins memory to register it keeps 64: tests/rxe)
        for entries, kept in ((64, True), (0, False), (None, False)):
            options = {} if entries is None else {"registration_cache": entries}
            async with await aiordma.connect("127.0.0.1", server.port, provider="soft", **options) as conn:
                if entries is None:
                    assert default_registration_cache(conn.device) == 0
                buf = array.array("B", os.urandom(N))  # an exporter that is cached (unlike bytearray)
                ref = weakref.ref(buf)
                await asyncio.wait_for(conn.send(buf), T)  # writable: returns once pulled
                assert await asyncio.wait_for(got.get(), T) == buf.tobytes()
                del buf
                gc.collect()
                # cached, the registration (and so the buffer) is kept for another send of it
                assert (ref() is not None) is kept, f"registration_cache={entries}"
                assert conn.stats["registration_cache_misses"] == 1
    finally:
        server.close()
        server.abort_clients()
        await server.wait_closed()


async def test_registration_cache_is_validated(held: HeldReceiver) -> None:
    assert held.server is not None
    with pytest.raises(ValueError, match="registration_cache must be a number of entries"):
        await aiordma.connect("127.0.0.1", held.server.port, provider="soft", registration_cache=-1)
