"""Cancellation keeps messages in order and makes progress.

* A ``send()`` cancelled (or timed out) while its message waits is still
  delivered whole, in its place: never after a message sent later.
* A ``recv()`` or ``recv_into()`` of a large message (pulled by RDMA Read)
  cancelled midway does not throw the pull away: the next receive into the
  same destination resumes it, so a receive polled under a short timeout
  finishes.

Real connections over the soft device, on both event loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import struct

import pytest

import aiordma

pytestmark = pytest.mark.asyncio

HEADER = struct.Struct(">I")


def message(i: int, n: int) -> bytes:
    body = hashlib.sha256(str(i).encode()).digest()
    return (HEADER.pack(i) + body * (n // 32 + 1))[:n]


def check(data: bytes) -> int:
    (i,) = HEADER.unpack_from(data)
    assert data == message(i, len(data)), f"message {i} is corrupted"
    return i


@contextlib.asynccontextmanager
async def pair(**options):
    accepted: asyncio.Queue[aiordma.Connection] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(conn: aiordma.Connection) -> None:
        await accepted.put(conn)
        await done.wait()

    server = await aiordma.start_server(handler, "127.0.0.1", 0, **options)
    client = await aiordma.connect("127.0.0.1", server.port, **options)
    try:
        yield client, await asyncio.wait_for(accepted.get(), 5)
    finally:
        done.set()
        await client.close()
        server.close()
        await server.close_clients()
        await server.wait_closed()


@pytest.mark.parametrize("payload", [bytes, bytearray], ids=["bytes", "bytearray"])
async def test_timed_out_sends_arrive_in_order(payload) -> None:
    """300 sends of 4 B - 2 MiB, most under a 0-200 us timeout: all arrive,
    each whole and exactly once, in the order the send() calls were made."""
    rng = random.Random(20)
    sizes = [rng.choice([4, 100, 60_000, 300_000, 1 << 20, 2 << 20]) for _ in range(300)]
    async with pair() as (client, server_side):
        timed_out = 0
        got: list[int] = []

        async def receive() -> None:
            while len(got) < len(sizes):
                got.append(check(await server_side.recv()))

        receiver = asyncio.create_task(receive())
        for i, n in enumerate(sizes):
            data = payload(message(i, n))
            try:
                await asyncio.wait_for(client.send(data), rng.uniform(0, 200e-6))
            except TimeoutError:
                timed_out += 1
        await asyncio.wait_for(receiver, 60)
        assert got == list(range(len(sizes)))
        assert timed_out > 0  # the timeouts did cut sends short
        await client.drain(10)


async def test_a_cancelled_large_send_is_not_overtaken_by_a_small_one() -> None:
    async with pair() as (client, server_side):
        big = asyncio.create_task(client.send(message(0, 8 << 20)))
        await asyncio.sleep(0)
        big.cancel()
        await client.send(message(1, 16))  # the fast path must wait for the big one
        await client.send_control({"op": "after"})
        assert check(await asyncio.wait_for(server_side.recv(), 10)) == 0
        assert check(await asyncio.wait_for(server_side.recv(), 10)) == 1


@pytest.mark.parametrize("how", ["recv", "recv_into"])
async def test_a_receive_polled_under_a_short_timeout_finishes(how) -> None:
    """Two 64 MiB messages, received by a loop that gives each try 10 ms."""
    size = 64 << 20
    async with pair() as (client, server_side):
        sent = [message(i, size) for i in range(2)]
        senders = asyncio.gather(*(client.send(m) for m in sent))
        dest = bytearray(size)
        received: list[bytes] = []
        tries = 0
        while len(received) < 2 and tries < 2000:
            tries += 1
            try:
                if how == "recv":
                    received.append(await asyncio.wait_for(server_side.recv(), 0.01))
                else:
                    n = await asyncio.wait_for(server_side.recv_into(dest), 0.01)
                    received.append(bytes(dest[:n]))
            except TimeoutError:
                pass
        assert len(received) == 2, f"{len(received)} of 2 messages after {tries} tries of 10 ms"
        assert received == sent
        await asyncio.wait_for(senders, 10)
        stats = server_side.stats
        assert stats["operations_outstanding"] == 0


async def test_a_control_message_cancelled_before_its_turn_keeps_the_order() -> None:
    """send_control() cancelled while it waits for a large send before it: it is
    not sent, and a message sent after it still waits for the large one."""
    received: list[object] = []
    async with pair() as (client, server_side):
        server_side.set_event_handler(lambda event: received.append(event) or True)
        big = asyncio.create_task(client.send(message(0, 8 << 20)))
        await asyncio.sleep(0)
        control = asyncio.create_task(client.send_control({"op": "dropped"}))
        await asyncio.sleep(0)
        control.cancel()
        big.cancel()
        await client.send(message(1, 16))
        assert check(await asyncio.wait_for(server_side.recv(), 10)) == 0
        assert check(await asyncio.wait_for(server_side.recv(), 10)) == 1
        with pytest.raises(asyncio.CancelledError):
            await control
