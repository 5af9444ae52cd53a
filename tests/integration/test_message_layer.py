"""The message layer users can trust: receive budget, honest close, zero-copy
large messages, lifetimes and addresses, errors that fit Python's hierarchy.

Every async test runs on asyncio and uvloop (root conftest)."""

from __future__ import annotations

import array
import asyncio
import hashlib
import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import aiordma
from aiordma import Access, ConnectionLostError, ConnectionState, MemoryRegistrationError, RendezvousError
from aiordma.providers.soft.faults import LinkFaults

from ..support.child_server import ChildServer
from ..support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
T = 30


async def _echo(conn: aiordma.Connection) -> None:
    async for msg in conn:
        await conn.send(msg)


@pytest.fixture
async def echo_server() -> AsyncIterator[aiordma.Server]:
    server = await aiordma.start_server(_echo, "127.0.0.1", 0, provider="soft")
    yield server
    server.close()
    server.abort_clients()
    await server.wait_closed()


# ----------------------------------------------------------- receive budget ----


class LazyReceiver:
    """tests/support/lazy_receiver.py: a peer whose application reads only when told."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc = proc
        self.port = port

    @classmethod
    async def start(cls) -> LazyReceiver:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.support.lazy_receiver",
            cwd=ROOT,
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), T)
        return cls(proc, int(line))

    async def ask(self, command: str, timeout: float = T) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command.encode() + b"\n")
        await self.proc.stdin.drain()
        return json.loads(await asyncio.wait_for(self.proc.stdout.readline(), timeout))

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()


@pytest.mark.parametrize("path", ["chunks", "rndv"])
async def test_a_receiver_that_does_not_read_holds_the_sender_back(path: str) -> None:
    """512 MiB sent in 1 MiB messages to an application that does not read:
    its memory grows by at most the receive budget plus a constant (the
    sender waits instead), and every byte arrives once it reads."""
    total, size = 512 << 20, 1 << 20
    child = await LazyReceiver.start()
    try:
        # "chunks": 1 MiB messages through the receive buffers (the receive budget bounds
        # them); "rndv": pulled by the receiver's RDMA Read, so nothing moves until it reads
        threshold = 1 << 30 if path == "chunks" else 256 * 1024
        conn = await aiordma.connect("127.0.0.1", child.port, provider="soft", large_message_threshold=threshold)
        base = (await child.ask("rss"))["rss"]
        payload = [os.urandom(size) for _ in range(4)]
        sent = 0
        digest = hashlib.sha256()

        async def sender() -> None:
            nonlocal sent
            for i in range(total // size):
                msg = payload[i % 4]
                await conn.send(msg)
                digest.update(msg)
                sent += size

        task = asyncio.ensure_future(sender())
        # wait until the sender is stuck: no progress for a while, far from done
        last = -1
        while sent != last:
            last = sent
            await asyncio.sleep(1.0)
        assert not task.done() and sent < total // 2, f"{sent >> 20} MiB went out to a peer that reads nothing"
        grown = (await child.ask("rss"))["rss"] - base
        budget = 32 << 20  # DEFAULT_RECV_BUDGET
        assert grown <= budget + (24 << 20), f"the receiver grew by {grown >> 20} MiB (budget {budget >> 20} MiB)"
        if path == "rndv":
            assert grown <= 24 << 20
        report = await child.ask(f"read {total // size}", timeout=300)
        await asyncio.wait_for(task, 60)
        assert report["bytes"] == total and report["sha256"] == digest.hexdigest()
        await conn.close()
    finally:
        await child.stop()


async def test_recv_budget_counters(echo_server: aiordma.Server) -> None:
    """The window holds credits back past the budget: what this side buffers stays
    within the budget plus what the peer's initial credits let it send ahead."""
    budget, slots, size = 128 * 1024, 4, 64 * 1024
    async with await aiordma.connect(
        "127.0.0.1",
        echo_server.port,
        provider="soft",
        recv_budget=budget,
        recv_buffers=slots,
        recv_buffer_size=size,
        large_message_threshold=1 << 30,
    ) as conn:
        msgs = [bytes([i]) * 100_000 for i in range(40)]  # 4 MB: far more than the budget
        sender = asyncio.ensure_future(asyncio.gather(*(conn.send(m) for m in msgs)))
        await wait_until(lambda: conn.stats["credits_held"] > 0, "the window held credits back")
        await asyncio.sleep(0.2)  # the echoes that can still come have come
        assert conn.stats["recv_buffered_bytes"] <= budget + 100_000 + slots * size
        for m in msgs:
            assert await asyncio.wait_for(conn.recv(), T) == m
        await asyncio.wait_for(sender, T)
        assert conn.stats["recv_buffered_bytes"] == 0 and conn.stats["credits_held"] == 0


# ------------------------------------------------------------ honest close ----


async def test_close_raises_when_a_message_was_not_delivered() -> None:
    """Peer frozen (SIGSTOP): send() returns at once, close() must not hide the loss."""
    with ChildServer.start() as child:
        conn = await aiordma.connect("127.0.0.1", child.port, provider="soft", ack_timeout=8, retry_cnt=3)
        assert await conn.send(b"ping") is None and await conn.recv() == b"ping"
        child.stop()
        try:
            await conn.send(b"x" * 1000)  # handed to the device: returns before any ACK
            with pytest.raises(ConnectionLostError, match="IBV_WC_RETRY_EXC_ERR") as info:
                await conn.close()
            assert "not delivered" in str(info.value)
            assert conn.state is ConnectionState.CLOSED
        finally:
            child.resume()


async def test_async_with_exit_raises_a_lost_message() -> None:
    with ChildServer.start() as child:
        conn = await aiordma.connect("127.0.0.1", child.port, provider="soft", ack_timeout=8, retry_cnt=3)
        child.stop()
        try:
            with pytest.raises(ConnectionLostError, match="not delivered|not acknowledged"):
                async with conn:
                    await conn.send(b"lost")
        finally:
            child.resume()


async def test_close_after_delivery_is_quiet(echo_server: aiordma.Server) -> None:
    conn = await aiordma.connect("127.0.0.1", echo_server.port, provider="soft")
    for i in range(50):
        await conn.send(bytes([i]) * 3000)
    await conn.close()  # everything was acknowledged: no error
    assert conn.stats["messages_undelivered"] == 0


# ---------------------------------------------------- zero-copy large messages ----


async def test_recv_into_every_kind_of_buffer(echo_server: aiordma.Server) -> None:
    async with await aiordma.connect("127.0.0.1", echo_server.port, provider="soft") as conn:
        region = conn.register(bytearray(3 << 20), Access.LOCAL_WRITE)
        for size in (0, 1, 5000, 200_000, 300_000, 3 << 20):  # chunks, several chunks, RDMA Read
            data = os.urandom(size)
            for dest in (bytearray(size + 7), memoryview(bytearray(size + 1)), region, region[0 : max(size, 1)]):
                await conn.send(data)
                n = await conn.recv_into(dest)
                assert n == size
                view = dest.view if hasattr(dest, "view") else memoryview(dest)
                assert bytes(view[:n]) == data
        assert conn.stats["large_messages_in_flight"] == 0


async def test_recv_into_too_small_keeps_the_message(echo_server: aiordma.Server) -> None:
    async with await aiordma.connect("127.0.0.1", echo_server.port, provider="soft") as conn:
        for size in (1000, 1 << 20):
            data = os.urandom(size)
            await conn.send(data)
            with pytest.raises(ValueError, match=f"a message of {size} bytes does not fit the 10-byte buffer"):
                await conn.recv_into(bytearray(10))
            assert await conn.recv() == data  # still there, whole
        with pytest.raises(TypeError, match="writable"):
            await conn.recv_into(b"read-only")
        with pytest.raises(TypeError, match="not int"):
            await conn.recv_into(5)


async def test_large_messages_move_without_bounce_copies(echo_server: aiordma.Server) -> None:
    """Above the threshold the payload never passes through the send and receive buffers:
    the packets that cross are RDMA Read responses, and the same buffer sent again is not
    registered again."""
    async with await aiordma.connect("127.0.0.1", echo_server.port, provider="soft", registration_cache=64) as conn:
        data = os.urandom(4 << 20)  # bytes: read-only, registered as a source as it is
        dest = bytearray(4 << 20)
        before = conn.stats
        for _ in range(3):
            await conn.send(data)
            assert await conn.recv_into(dest) == len(data)
            assert dest == data
        after = conn.stats
        # 3 sends of the same object: registered once, then found in the cache
        assert after["registration_cache_hits"] - before["registration_cache_hits"] >= 2
        # the receive window saw only the small announcements, never the payload
        assert after["recv_buffered_bytes"] == 0


@pytest.fixture
def through_the_socket() -> Iterator[None]:
    """The soft device's packets between two of its own queue pairs go through its UDP
    socket for the test (not handed over in memory, where an RDMA Read completes
    within its post): what it checks needs operations that stay in flight."""
    device = aiordma.get_device("soft")
    before = device.local_delivery
    device.local_delivery = False
    try:
        yield
    finally:
        device.local_delivery = before


async def test_cancelled_recv_into_loses_nothing(echo_server: aiordma.Server, through_the_socket: None) -> None:
    async with await aiordma.connect("127.0.0.1", echo_server.port, provider="soft") as conn:
        data = os.urandom(8 << 20)
        await conn.send(data)
        await conn.drain()
        await wait_until(lambda: conn.stats["recv_queued_large_messages"] == 1, "the echo was announced")
        dest = bytearray(8 << 20)
        task = asyncio.ensure_future(conn.recv_into(dest))
        for _ in range(10_000):  # one loop turn at a time until the RDMA Reads are posted
            if conn.stats["recv_queued_large_messages"] == 0 and conn.stats["operations_outstanding"]:
                break
            await asyncio.sleep(0)
        assert conn.stats["operations_outstanding"], "the RDMA Reads were never posted"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        again = bytearray(8 << 20)
        assert await asyncio.wait_for(conn.recv_into(again), T) == len(data)
        assert again == data


async def test_cancelled_senders_give_their_credit_back() -> None:
    """A control message or a Write with immediate cancelled while it waits for a
    send-queue slot, after it took a message credit, gives the credit back: the chunk
    was never posted, so the peer would never return it, and a few such cancellations
    would block every later send for good. (A cancelled send() is different: its
    message still goes out, with its credit.)"""
    region = aiordma.register(bytearray(64 << 20))

    async def handler(conn: aiordma.Connection) -> None:
        conn.detach()

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft", expose={"mem": region.exposed("rw")})
    conn = await aiordma.connect("127.0.0.1", server.port, provider="soft", send_queue_depth=1)
    device = aiordma.get_device("soft")
    # The link drops every datagram while ``held``: the Write holding the only
    # send-queue slot cannot complete until it is retransmitted after release, so
    # the small sender surely waits for the slot (not "the Write happened to finish
    # first", which a preempted test process saw on uvloop).
    held = False
    device.faults = LinkFaults(filter=lambda datagram: not held)
    try:
        remote = conn.remote("mem")
        src = conn.register(bytearray(4096))
        credits = conn.stats["send_credits"]
        for i in range(credits + 2):  # more cancellations than there are credits
            held = True
            big = asyncio.ensure_future(conn.write(src, remote))  # holds the only send-queue slot
            await asyncio.sleep(0)
            small = conn.write(b"abcd", remote[:4], imm=i) if i % 2 else conn.send_control({"op": "noop", "i": i})
            waiter = asyncio.ensure_future(small)
            await asyncio.sleep(0)  # it took a credit and waits for the slot
            assert not big.done() and not waiter.done()
            assert conn.stats["operations_outstanding"] == 1  # only the Write was posted
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            held = False
            await asyncio.wait_for(big, 10)
        assert conn.stats["send_credits"] == credits
        await asyncio.wait_for(conn.send(b"still sends"), 10)
    finally:
        device.faults = None
        conn.abort()
        server.close()
        server.abort_clients()
        await server.wait_closed()
        region.close()


async def test_a_pulled_large_message_is_returned_even_while_the_ack_cannot_go() -> None:
    """Once a large message's bytes were pulled, recv() returns them at once: telling the
    sender (its rndv_done) waits for a message credit in the background, not in the
    receive, where a cancellation (a timeout) used to lose the message and leave the
    sender's send() waiting for ever."""
    server_sent = asyncio.Event()
    server_conn: list[aiordma.Connection] = []
    big = bytearray(os.urandom(1 << 20))  # writable: the server's send returns once it was pulled

    async def handler(conn: aiordma.Connection) -> None:
        conn.detach()
        server_conn.append(conn)
        await conn.send(big)
        server_sent.set()

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft", recv_budget=0)
    conn = await aiordma.connect("127.0.0.1", server.port, provider="soft")
    sends = []
    try:
        # run this side out of credits toward a server that does not read
        sends = [asyncio.ensure_future(conn.send(b"m%d" % i)) for i in range(40)]
        await wait_until(lambda: conn.stats["send_credits"] < 2, "the credits ran out")
        got = await asyncio.wait_for(conn.recv(), 5)
        assert got == big
        assert not server_sent.is_set()  # the rndv_done waits for a credit
        (sconn,) = server_conn
        for _ in range(40):  # the server reads: credits come back, the rndv_done goes
            await asyncio.wait_for(sconn.recv(), 5)
        await asyncio.wait_for(server_sent.wait(), 5)
        assert sconn.stats["large_messages_in_flight"] == 0
        await asyncio.wait_for(asyncio.gather(*sends), 5)
    finally:
        for t in sends:
            t.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
        conn.abort()
        server.close()
        server.abort_clients()
        await server.wait_closed()


async def test_read_only_buffers_register_as_sources() -> None:
    dev = aiordma.get_device("soft")
    region = aiordma.register(b"immutable bytes", Access.REMOTE_READ, device=dev)
    assert bytes(region.view) == b"immutable bytes"
    region.close()
    with pytest.raises(MemoryRegistrationError, match="read-only .* with write access"):
        aiordma.register(b"immutable bytes", Access.LOCAL_WRITE, device=dev)


async def test_large_sends_interleave_in_order(echo_server: aiordma.Server) -> None:
    async with await aiordma.connect("127.0.0.1", echo_server.port, provider="soft") as conn:
        msgs = [os.urandom(n) for n in (10, 1 << 20, 20, 600_000, 30, 2 << 20, 40)]
        for m in msgs:  # bytes: a large send returns once announced, so these do not wait for the echo
            await conn.send(m)
        for m in msgs:
            assert await conn.recv() == m
        writable = [bytearray(os.urandom(n)) for n in (700_000, 5)]
        echo = asyncio.ensure_future(asyncio.gather(conn.recv(), conn.recv()))
        for m in writable:  # a writable buffer: send waits until the peer pulled it
            await conn.send(m)
        assert await asyncio.wait_for(echo, T) == [bytes(m) for m in writable]


# ------------------------------------------------------ lifetimes, addresses ----


async def test_handler_can_hand_the_connection_off() -> None:
    owned: asyncio.Queue[aiordma.Connection] = asyncio.Queue()

    async def handler(conn: aiordma.Connection) -> None:
        conn.detach()  # a background task owns it from now on
        await owned.put(conn)

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft")
    try:
        conn = await aiordma.connect("127.0.0.1", server.port, provider="soft")
        theirs = await asyncio.wait_for(owned.get(), T)
        await asyncio.sleep(0.05)  # the handler has returned
        assert theirs.state is ConnectionState.OPEN and theirs.detached
        await conn.send(b"still here")
        assert await theirs.recv() == b"still here"
        assert conn.peer_address == theirs.local_address
        assert conn.local_address == theirs.peer_address
        assert server.connections == {theirs}
        server.close()  # stops accepting, leaves the connection alone
        await theirs.send(b"after close")
        assert await conn.recv() == b"after close"
        await server.close_clients()
        assert theirs.state is ConnectionState.CLOSED
        await wait_until(lambda: conn.state is ConnectionState.LOST, "the client saw the goodbye")
        assert isinstance(conn.error, aiordma.ConnectionClosedError)
        assert "peer closed" in str(conn.error)
        await conn.close()
        assert conn.state is ConnectionState.CLOSED
        await server.wait_closed()
        assert server.port > 0  # still known after close
    finally:
        server.close()
        server.abort_clients()
        await server.wait_closed()


async def test_close_clients_right_after_connect_closes_the_servers_side_too() -> None:
    """A client's connect() returns before the server's side of the handshake has
    ended: close_clients() called then still closes those connections (it waits
    for the handshakes that are ending), and wait_closed() returns."""
    server = await aiordma.start_server(lambda conn: conn.wait_closed(), "127.0.0.1", 0)
    conns = await asyncio.gather(*(aiordma.connect("127.0.0.1", server.port) for _ in range(10)))
    server.close()
    await server.close_clients()
    await asyncio.wait_for(server.wait_closed(), T)
    assert server.accepted == 10 and not server.connections
    for conn in conns:
        with pytest.raises(aiordma.ConnectionClosedError):
            await asyncio.wait_for(conn.recv(), T)  # the goodbye came
        await conn.close()


async def test_abort_clients_tells_the_peer_it_was_aborted(echo_server: aiordma.Server) -> None:
    conn = await aiordma.connect("127.0.0.1", echo_server.port, provider="soft")
    await wait_until(lambda: len(echo_server.connections) == 1)
    echo_server.abort_clients()
    with pytest.raises(ConnectionLostError, match="the peer aborted the connection"):
        await asyncio.wait_for(conn.recv(), T)
    assert conn.state in (ConnectionState.LOST, ConnectionState.CLOSED)
    await conn.close()


# ------------------------------------------------------------------ errors ----


async def test_rendezvous_errors_are_connection_errors() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there
    with pytest.raises(ConnectionRefusedError.__mro__[1]) as info:  # ConnectionError
        await aiordma.connect("127.0.0.1", port, provider="soft")
    assert isinstance(info.value, RendezvousError) and isinstance(info.value, OSError)
    try:
        await aiordma.connect("127.0.0.1", port, provider="soft")
    except OSError as e:  # what a connect-retry loop catches
        assert "cannot reach the aiordma server" in str(e)


async def test_timeouts_say_what_timed_out(echo_server: aiordma.Server) -> None:
    async with await aiordma.connect("127.0.0.1", echo_server.port, provider="soft") as conn:
        with pytest.raises(TimeoutError, match="did not expose a buffer named 'nope' within 0.05 s"):
            await conn.wait_remote("nope", timeout=0.05)


async def test_the_peers_reason_for_a_remote_access_error_reaches_the_caller() -> None:
    mem = bytearray(64)
    region = aiordma.register(mem)

    async def handler(conn: aiordma.Connection) -> None:
        try:
            await conn.recv()
        except ConnectionLostError:
            pass

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft", expose={"mem": region.exposed("rw")})
    try:
        async with await aiordma.connect("127.0.0.1", server.port, provider="soft") as conn:
            rb = conn.remote("mem")
            with pytest.raises(aiordma.RemoteAccessError) as info:
                await conn.write(b"x" * 16, rb.at(60, 16))  # 12 bytes past the end
            text = str(info.value)
            assert "IBV_WC_REM_ACCESS_ERR" in text
            assert "outside" in text and f"0x{rb.rkey:08x}" in text, text  # the responder's own words
    finally:
        server.close()
        server.abort_clients()
        await server.wait_closed()
        region.close()


async def test_atomics_and_immediates_validate_their_ranges(echo_server: aiordma.Server) -> None:
    mem = aiordma.register(bytearray(64))
    async with await aiordma.connect("127.0.0.1", echo_server.port, provider="soft", expose={"m": mem}) as conn:
        # (the client exposes: the server could use it; here we only check the client's own validation)
        rb = mem.remote()[0:8]
        with pytest.raises(ValueError, match="64 bits"):
            await conn.fetch_and_add(rb, 1 << 64)
        with pytest.raises(ValueError, match="64 bits"):
            await conn.compare_and_swap(rb, 0, -(1 << 63) - 1)
        with pytest.raises(TypeError, match="must be an int"):
            await conn.fetch_and_add(rb, 1.5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="32 bits"):
            await conn.write(b"x", rb, imm=1 << 32)
    mem.close()


async def test_atomic_operands_at_their_edges_reach_the_peer_as_64_bit_words() -> None:
    """Negative operands are two's complement, the extremes pass, bools and floats are
    refused (before anything is posted), the same on the compiled and the interpreted core."""
    mem = aiordma.register(bytearray(8), provider="soft")
    server = await aiordma.start_server(
        lambda conn: conn.wait_closed(), "127.0.0.1", 0, provider="soft", expose={"w": mem.exposed("rwa")}
    )

    def word() -> int:
        return int.from_bytes(mem.view[0:8], "little")

    try:
        async with await aiordma.connect("127.0.0.1", server.port, provider="soft") as conn:
            rb = conn.remote("w")
            assert await conn.fetch_and_add(rb, -1) == 0
            assert word() == (1 << 64) - 1  # 0 - 1 wraps
            assert await conn.compare_and_swap(rb, -1, -(1 << 63)) == (1 << 64) - 1  # -1 is the word 2**64 - 1
            assert word() == 1 << 63
            assert await conn.compare_and_swap(rb, (1 << 64) - 1, 5) == 1 << 63  # no match: unchanged
            assert await conn.fetch_and_add(rb, (1 << 64) - 1) == 1 << 63
            assert word() == (1 << 63) - 1
            with pytest.raises(TypeError, match="add must be an int, not bool"):
                await conn.fetch_and_add(rb, True)
            with pytest.raises(TypeError, match="swap must be an int, not float"):
                await conn.compare_and_swap(rb, 0, 1.0)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="compare must fit in 64 bits"):
                await conn.compare_and_swap(rb, 1 << 64, 0)
            assert word() == (1 << 63) - 1
            assert conn.stats["operations_outstanding"] == 0
    finally:
        server.close()
        await server.close_clients()
        await server.wait_closed()
        mem.close()


async def test_read_into_any_writable_buffer() -> None:
    mem = bytearray(b"0123456789abcdef" * 4)
    region = aiordma.register(mem)
    server = await aiordma.start_server(_echo, "127.0.0.1", 0, provider="soft", expose={"mem": region})
    try:
        async with await aiordma.connect("127.0.0.1", server.port, provider="soft", registration_cache=64) as conn:
            rb = conn.remote("mem")
            dest = bytearray(64)
            assert await conn.read(rb, into=dest) is None
            assert dest == mem
            view = memoryview(bytearray(100))
            await conn.read(rb[0:16], into=view[10:26])
            assert bytes(view[10:26]) == b"0123456789abcdef"
            # a buffer read into again is registered once (not a bytearray: those are never cached)
            arr = array.array("b", bytes(64))
            hits = conn.stats["registration_cache_hits"]
            for _ in range(3):
                arr[:] = array.array("b", bytes(64))
                await conn.read(rb, into=arr)
                assert arr.tobytes() == mem
            assert conn.stats["registration_cache_hits"] == hits + 2
            with pytest.raises(ValueError, match="does not fit the 8-byte destination"):
                await conn.read(rb, into=bytearray(8))
            with pytest.raises(TypeError, match="read-only"):
                await conn.read(rb, into=b"x" * 64)
            with pytest.raises(TypeError, match="into must be registered memory .* not list"):
                await conn.read(rb, into=[0] * 64)
    finally:
        server.close()
        server.abort_clients()
        await server.wait_closed()
        region.close()


async def test_send_control_is_for_layered_protocols(echo_server: aiordma.Server) -> None:
    async with await aiordma.connect("127.0.0.1", echo_server.port, provider="soft") as conn:
        with pytest.raises(ValueError, match="reserved"):
            await conn.send_control({"op": "rndv"})
        with pytest.raises(TypeError, match='string "op"'):
            await conn.send_control({"no": "op"})


async def test_an_event_handler_that_fails_is_logged_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    got: asyncio.Queue = asyncio.Queue()

    async def handler(conn: aiordma.Connection) -> None:
        def on_event(event: object) -> None:
            got.put_nowait(event)
            raise RuntimeError("handler bug")

        conn.set_event_handler(on_event)
        await conn.recv()

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft")
    try:
        with caplog.at_level(logging.ERROR, logger="aiordma"):
            async with await aiordma.connect("127.0.0.1", server.port, provider="soft") as conn:
                await conn.send_control({"op": "hello", "n": 1})
                event = await asyncio.wait_for(got.get(), T)
                assert event == aiordma.ControlReceived({"op": "hello", "n": 1})
                await conn.send(b"and the connection still works")
        assert any("event handler failed" in r.message for r in caplog.records)
    finally:
        server.close()
        server.abort_clients()
        await server.wait_closed()
