"""Conformance of the ``rdma://`` comm backend, in the spirit of Dask's own
``check_*`` helpers (distributed/comm/tests/test_comms.py, which the wheel does
not ship): what every Dask comm must do, checked through Dask's public comm
API (``distributed.comm.connect`` / ``listen``) on real aiordma connections
(soft device, TCP rendezvous).

Every test runs on asyncio and uvloop (root conftest) and fails on a leaked
task or a call of the loop's exception handler (``loop_hygiene``)."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import dask
import numpy as np
import pytest
from distributed.comm import CommClosedError, connect, listen, parse_address, parse_host_port
from distributed.comm.core import FatalCommClosedError
from distributed.comm.registry import backends, get_backend
from distributed.protocol import Serialized, deserialize, serialize, to_serialize
from distributed.utils import get_ip

from aiordma.integrations.dask import EncryptionRequiredError, RDMABackend, RDMAComm, RDMAConnector, byte_counters

from ..support.waiting import wait_until

T = 30
#: a token for listeners on a non-loopback address (a protected aiordma refuses them without one)
TOKEN = {"distributed.comm.rdma.token": "conformance-token"}


async def get_comm_pair(
    listen_addr: str = "rdma://127.0.0.1", listen_args: dict | None = None, connect_args: dict | None = None, **kw: Any
) -> tuple[Any, Any]:
    q: asyncio.Queue = asyncio.Queue()

    async def handle_comm(comm: Any) -> None:
        await q.put(comm)

    async with listen(listen_addr, handle_comm, **(listen_args or {}), **kw) as listener:
        comm = await connect(listener.contact_address, **(connect_args or {}), **kw)
    serv_comm = await asyncio.wait_for(q.get(), T)
    return comm, serv_comm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------- registration ----


def test_the_entry_point_registers_the_backend() -> None:
    backend = get_backend("rdma")
    assert isinstance(backend, RDMABackend)
    assert backends["rdma"] is backend
    assert backend.resolve_address("localhost:123") == "127.0.0.1:123"
    assert backend.get_address_host("10.1.2.3:8786") == "10.1.2.3"
    assert backend.get_address_host_port("10.1.2.3:8786") == ("10.1.2.3", 8786)
    assert backend.get_local_address_for("127.0.0.1:80") == "127.0.0.1"


# --------------------------------------------------------- client/server ----


def tcp_eq(expected_host: str, expected_port: int | None = None) -> Callable[[str], None]:
    def checker(loc: str) -> None:
        host, port = parse_host_port(loc)
        assert host == expected_host
        if expected_port is not None:
            assert port == expected_port
        else:
            assert 1023 < port < 65536

    return checker


async def check_client_server(
    addr: str,
    check_listen_addr: Callable[[str], None] | None = None,
    check_contact_addr: Callable[[str], None] | None = None,
) -> None:
    async def handle_comm(comm: Any) -> None:
        try:
            assert parse_address(comm.peer_address)[0] == "rdma"
            msg = await comm.read()
            assert msg["op"] == "ping"
            msg["op"] = "pong"
            await comm.write(msg)
            msg = await comm.read()
            assert msg["op"] == "foobar"
        finally:
            await comm.close()

    # arbitrary connection arguments are ignored
    listener = await listen(addr, handle_comm, xxx="bar")
    try:
        bound_scheme, bound_loc = parse_address(listener.listen_address)
        assert bound_scheme == "rdma"
        if check_listen_addr is not None:
            check_listen_addr(bound_loc)
        contact_scheme, contact_loc = parse_address(listener.contact_address)
        assert contact_scheme == "rdma"
        if check_contact_addr is not None:
            check_contact_addr(contact_loc)
        else:
            assert listener.contact_address == listener.listen_address

        seen: list[int] = []

        async def client_communicate(key: int, delay: float = 0) -> None:
            comm = await connect(listener.contact_address, xxx="foo")
            try:
                assert comm.peer_address == listener.contact_address
                await comm.write({"op": "ping", "data": key})
                await comm.write({"op": "foobar"})
                if delay:
                    await asyncio.sleep(delay)
                assert await comm.read() == {"op": "pong", "data": key}
                seen.append(key)
            finally:
                await comm.close()

        await client_communicate(1234)
        await asyncio.gather(*(client_communicate(i, delay=0.05) for i in range(20)))  # many clients at once
        assert set(seen) == {1234} | set(range(20))
    finally:
        listener.stop()


async def test_client_server_on_loopback() -> None:
    await check_client_server("rdma://127.0.0.1", tcp_eq("127.0.0.1"))
    port = _free_port()
    await check_client_server(f"rdma://127.0.0.1:{port}", tcp_eq("127.0.0.1", port))


async def test_client_server_on_every_interface() -> None:
    """A wildcard listener binds IPv4 and is contacted on the host's address
    (its soft device is bound there, not on loopback)."""
    external = get_ip()
    if external.startswith("127."):
        pytest.skip("this host has no non-loopback IPv4 address (get_ip() is loopback)")
    with dask.config.set(TOKEN):
        await check_client_server("rdma://0.0.0.0", tcp_eq("0.0.0.0"), tcp_eq(external))
        await check_client_server("rdma://", tcp_eq("0.0.0.0"), tcp_eq(external))


# ----------------------------------------------------------- deserialize ----


async def check_listener_deserialize(addr: str, deserialize: bool, in_value: Any, check_out: Callable) -> None:
    q: asyncio.Queue = asyncio.Queue()

    async def handle_comm(comm: Any) -> None:
        try:
            q.put_nowait(await comm.read())
        except Exception as exc:
            q.put_nowait(exc)
        finally:
            await comm.close()

    async with listen(addr, handle_comm, deserialize=deserialize) as listener:
        comm = await connect(listener.contact_address)
    await comm.write(in_value)
    out_value = await asyncio.wait_for(q.get(), T)
    if isinstance(out_value, Exception):
        raise out_value
    check_out(out_value)
    await comm.close()


async def check_connector_deserialize(addr: str, deserialize: bool, in_value: Any, check_out: Callable) -> None:
    done = asyncio.Event()

    async def handle_comm(comm: Any) -> None:
        try:
            await comm.write(in_value)
            await done.wait()
        finally:
            await comm.close()

    async with listen(addr, handle_comm) as listener:
        comm = await connect(listener.contact_address, deserialize=deserialize)
    try:
        out_value = await comm.read()
        done.set()
    finally:
        await comm.close()
    check_out(out_value)


async def test_deserialize_on_and_off() -> None:
    addr = "rdma://127.0.0.1"
    msg = {"op": "update", "x": b"abc", "to_ser": [to_serialize(123)], "ser": Serialized(*serialize(456))}
    msg_orig = msg.copy()

    def check_out_false(out_value: dict) -> None:
        out_value = out_value.copy()
        to_ser = out_value.pop("to_ser")
        ser = out_value.pop("ser")
        expected = {k: v for k, v in msg_orig.items() if k not in ("ser", "to_ser")}
        assert out_value == expected
        assert isinstance(ser, Serialized)
        assert deserialize(ser.header, ser.frames) == 456
        (one,) = to_ser
        assert deserialize(one.header, one.frames) == 123 if isinstance(one, Serialized) else one == to_serialize(123)

    def check_out_true(out_value: dict) -> None:
        assert list(out_value.pop("to_ser")) == [123]
        assert out_value == {"op": "update", "x": b"abc", "ser": 456}

    await check_listener_deserialize(addr, False, msg, check_out_false)
    await check_connector_deserialize(addr, False, msg, check_out_false)
    await check_listener_deserialize(addr, True, msg, check_out_true)
    await check_connector_deserialize(addr, True, msg, check_out_true)

    # an 8 MB payload, large enough to travel as separate frames pulled by RDMA Read
    big = os.urandom(1024**2) * 8
    msg = {"op": "update", "x": big, "to_ser": (to_serialize(big),), "ser": Serialized(*serialize(big))}

    def check_big(flag: bool, out_value: dict) -> None:
        assert sorted(out_value) == sorted(msg)
        assert out_value["op"] == "update" and out_value["x"] == big
        if flag:
            assert bytes(out_value["ser"]) == big and bytes(out_value["to_ser"][0]) == big
        else:
            assert deserialize(out_value["ser"].header, out_value["ser"].frames) == big

    await check_listener_deserialize(addr, False, msg, partial(check_big, False))
    await check_connector_deserialize(addr, False, msg, partial(check_big, False))
    await check_listener_deserialize(addr, True, msg, partial(check_big, True))
    await check_connector_deserialize(addr, True, msg, partial(check_big, True))


@pytest.mark.parametrize("should_deserialize", [True, False])
async def test_an_8_mb_round_trip(should_deserialize: bool) -> None:
    big = os.urandom(1024**2) * 8
    msg = {"op": "update", "x": big, "to_ser": [to_serialize(big)], "ser": Serialized(*serialize(big))}
    a, b = await get_comm_pair(deserialize=should_deserialize)
    try:
        await a.write(msg)  # write before the peer reads, as over TCP
        got = await b.read()
        await b.write(got)
        got = await a.read()
        assert sorted(got) == sorted(msg)
        assert got["op"] == "update" and got["x"] == big
        if should_deserialize:
            assert isinstance(got["to_ser"][0], (bytes, bytearray)) and bytes(got["to_ser"][0]) == big
            assert isinstance(got["ser"], (bytes, bytearray))
        else:
            assert isinstance(got["to_ser"][0], (to_serialize, Serialized))
            assert isinstance(got["ser"], Serialized)
    finally:
        await a.close()
        await b.close()


async def test_numpy_frames_arrive_writable_and_whole() -> None:
    """Out-of-band numpy data lands in a writable buffer of exactly its size (no copy
    after the RDMA Read), and the bytes counted are the bytes sent."""
    arr = np.random.default_rng(0).random((1024, 1024))  # 8 MiB
    small = np.arange(10)
    a, b = await get_comm_pair()
    try:
        before = byte_counters()["peers"].get(a.peer_address, {}).get("tx_bytes", 0)
        n = await a.write({"x": to_serialize(arr), "y": to_serialize(small)})
        got = await b.read()
        assert np.array_equal(got["x"], arr) and np.array_equal(got["y"], small)
        assert got["x"].flags.writeable
        assert got["x"].base is not None and memoryview(got["x"].base).nbytes == arr.nbytes
        assert n >= arr.nbytes
        assert b.counts.rx_bytes == a.counts.tx_bytes >= n
        assert b.counts.rx_large_bytes == a.counts.tx_large_bytes == arr.nbytes
        assert byte_counters()["peers"][a.peer_address]["tx_bytes"] - before == n
    finally:
        await a.close()
        await b.close()


async def test_the_shards_of_a_split_frame_arrive_side_by_side(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame larger than the shard size (``distributed.comm.shard``) travels as shards; they
    are received side by side into one buffer (as Dask's TCP comm reads), so Dask joins
    them without copying: the array handed to the application is that buffer's memory."""
    from aiordma.integrations.dask.buffers import FramePool

    allocated: list[memoryview] = []
    real_take = FramePool.take

    def recording_take(self: FramePool, n: int) -> memoryview:  # the real allocation, remembered
        buf = real_take(self, n)
        allocated.append(buf)
        return buf

    monkeypatch.setattr(FramePool, "take", recording_take)
    # distributed.comm.shard, which the comm class reads at import (as TCP's does)
    monkeypatch.setattr(RDMAComm, "max_shard_size", 1 << 20)
    arr = np.random.default_rng(1).random((1024, 1024))  # 8 MiB: 8 shards of 1 MiB
    a, b = await get_comm_pair()
    try:
        await a.write({"x": to_serialize(arr)})
        got = await b.read()
    finally:
        await a.close()
        await b.close()
    assert np.array_equal(got["x"], arr) and got["x"].flags.writeable
    [whole] = allocated  # one buffer for the message's separate frames
    assert whole.nbytes == arr.nbytes
    assert np.shares_memory(got["x"], np.frombuffer(whole, dtype="u1"))  # joined in place, not copied


async def test_two_arrays_of_one_message_never_share_a_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """As over Dask's TCP comm (its test_do_not_share_buffers): each array is received
    into memory of its own, exactly its size, so releasing one frees it even while the
    other lives (a worker's get_data answer carries many keys in one message); the
    shards of a split one still share theirs."""
    from distributed.protocol.utils_test import get_host_array

    monkeypatch.setattr(RDMAComm, "max_shard_size", 1 << 20)
    x = np.random.default_rng(2).random(3 << 17)  # 3 MiB: 3 shards
    y = np.random.default_rng(3).random(1 << 17)  # 1 MiB
    a, b = await get_comm_pair()
    try:
        await a.write({"data": to_serialize([x, y])})
        gx, gy = (await b.read())["data"]
    finally:
        await a.close()
        await b.close()
    assert np.array_equal(gx, x) and np.array_equal(gy, y)
    hx, hy = get_host_array(gx), get_host_array(gy)
    assert hx is not hy
    assert hx.nbytes == x.nbytes and hy.nbytes == y.nbytes
    assert gx.flags.writeable and gy.flags.writeable


async def test_per_peer_counts_are_kept_by_listener_address_only() -> None:
    """The comms a process opens count per peer under the listener's address; a comm a
    listener accepted (its peer address is a temporary port, new for every connection)
    counts toward its device only, so a long-lived listener's table does not grow."""
    accepted: asyncio.Queue = asyncio.Queue()

    async def handle_comm(comm: Any) -> None:
        await accepted.put(comm)

    async with listen("rdma://127.0.0.1", handle_comm) as listener:
        before = byte_counters()["peers"]
        sent = 0
        for i in range(10):
            a = await connect(listener.contact_address)
            b = await asyncio.wait_for(accepted.get(), T)
            try:
                sent += await a.write({"i": i})
                assert await b.read() == {"i": i}
            finally:
                await a.close()
                await b.close()
        after = byte_counters()["peers"]
    # Compared as deltas: an earlier test's listener may have had the same port (the
    # counters are process-wide and outlive it), so the address may already be there.
    grown = {peer for peer, counts in after.items() if counts != before.get(peer)}
    assert grown == {listener.contact_address}
    empty = dict.fromkeys(after[listener.contact_address], 0)
    was = before.get(listener.contact_address, empty)
    now = after[listener.contact_address]
    # (each connect also writes Dask's handshake: one message more per comm)
    assert now["tx_messages"] - was["tx_messages"] == 20, (was, now)
    assert now["tx_bytes"] - was["tx_bytes"] > sent, (was, now)


def _raise_eoferror() -> None:
    raise EOFError


class _EOFRaising:
    def __reduce__(self) -> tuple:
        return _raise_eoferror, ()


async def test_eoferror_while_deserializing_closes_the_comm() -> None:
    closed_there: asyncio.Future = asyncio.get_running_loop().create_future()

    async def handle_comm(comm: Any) -> None:
        await comm.write({"data": to_serialize(_EOFRaising())})
        try:
            await comm.read()
        except CommClosedError as e:
            closed_there.set_result(e)
        finally:
            await comm.close()

    async with listen("rdma://127.0.0.1", handle_comm) as listener:
        comm = await connect(listener.contact_address)
        with pytest.raises(CommClosedError, match="truncated"):
            await comm.read()
        assert comm.closed()
        assert isinstance(await asyncio.wait_for(closed_there, T), CommClosedError)


# ---------------------------------------------------------------- closing ----


async def test_comm_closed_implicit() -> None:
    async def handle_comm(comm: Any) -> None:
        await comm.close()

    async with listen("rdma://127.0.0.1", handle_comm) as listener:
        comm = await connect(listener.contact_address)
        with pytest.raises(CommClosedError):
            await comm.write({})
            await comm.read()
        assert comm.closed()
        comm = await connect(listener.contact_address)
        with pytest.raises(CommClosedError):
            await comm.read()
        assert comm.closed()


async def test_comm_closed_explicit_with_reads_in_flight() -> None:
    a, b = await get_comm_pair()
    a_read = asyncio.ensure_future(a.read())
    b_read = asyncio.ensure_future(b.read())
    await asyncio.sleep(0.01)
    assert not a_read.done() and not b_read.done()  # both reads are waiting
    assert not a.closed() and not b.closed()
    await a.close()
    # in-flight reads abort with CommClosedError, on both sides
    with pytest.raises(CommClosedError):
        await asyncio.wait_for(a_read, T)
    with pytest.raises(CommClosedError):
        await asyncio.wait_for(b_read, T)
    assert a.closed() and b.closed()
    # new reads and writes as well
    for comm in (a, b):
        with pytest.raises(CommClosedError):
            await comm.read()
        with pytest.raises(CommClosedError):
            await comm.write({})
    await b.close()
    await b.close()  # closing twice is harmless


async def test_messages_sent_before_close_are_still_read() -> None:
    """close() flushes: small messages were copied out and stay readable after the
    writer is gone; a large frame stays registered until the peer pulled it (the
    writer's close waits for that, up to close-timeout), so a reader that reads
    meanwhile gets it whole."""
    a, b = await get_comm_pair()
    await a.write({"n": 1})
    await a.write({"n": 2})
    await a.close()
    assert (await b.read()) == {"n": 1}
    assert not b.closed()  # one message still to read
    assert (await b.read()) == {"n": 2}
    with pytest.raises(CommClosedError):
        await b.read()
    assert b.closed()
    await b.close()

    a, b = await get_comm_pair()
    arr = np.arange(200_000.0)
    await a.write({"x": to_serialize(arr)})  # returns once announced
    reading = asyncio.ensure_future(b.read())
    await a.close()
    assert np.array_equal((await asyncio.wait_for(reading, T))["x"], arr)
    await b.close()


async def test_abort_is_immediate_and_synchronous() -> None:
    a, b = await get_comm_pair()
    b_read = asyncio.ensure_future(b.read())
    a.abort()
    assert a.closed()  # at once, no await
    with pytest.raises(CommClosedError):
        await asyncio.wait_for(b_read, T)
    await wait_until(b.closed, "the peer saw the abort")
    with pytest.raises(CommClosedError):
        await a.read()
    await b.close()


async def test_a_cancelled_read_aborts_the_comm() -> None:
    reader, writer = await get_comm_pair()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(reader.read(), 0.01)
    assert reader.closed()  # half a message may have been taken: nothing later can be trusted
    with pytest.raises(CommClosedError):
        await reader.read()
    await wait_until(writer.closed, "the peer saw the abort")
    await reader.close()
    await writer.close()


async def test_a_cancelled_write_aborts_the_comm() -> None:
    a, b = await get_comm_pair()
    writing = asyncio.ensure_future(a.write({"x": to_serialize(np.ones(1 << 20))}))
    await asyncio.sleep(0)  # serializing, then sending
    writing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writing
    # the cancellation landed before anything was sent (still usable) or in the middle (aborted)
    if a.closed():
        with pytest.raises(CommClosedError):
            await a.write({})
    else:  # nothing was sent: the comm still works both ways
        await a.write({"ok": 1})
        assert await asyncio.wait_for(b.read(), T) == {"ok": 1}
    a.abort()
    b.abort()


async def test_an_error_in_the_middle_of_a_write_aborts_the_comm() -> None:
    """Fault injection: the second send of a message (its large frame) fails."""
    a, b = await get_comm_pair()
    conn = a.connection
    real_send = conn.send
    calls = 0

    async def failing_send(data: Any, **kw: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError("injected failure")
        await real_send(data, **kw)

    conn.send = failing_send  # type: ignore[method-assign]
    with pytest.raises(CommClosedError, match="injected failure"):
        await a.write({"x": to_serialize(np.ones(1 << 20))})
    assert a.closed()
    with pytest.raises(CommClosedError):
        await b.read()  # the peer got the table, never the frame: the abort ends its read
    await b.close()


class _Interrupt(BaseException):
    """Neither an Exception nor a cancellation: an application's own BaseException."""


#: what may interrupt a write or a read in the middle besides an error or a cancellation
_BASE_EXCEPTIONS = [_Interrupt, KeyboardInterrupt, SystemExit, GeneratorExit]


@pytest.mark.parametrize("exc_type", _BASE_EXCEPTIONS)
async def test_a_baseexception_in_the_middle_of_a_write_aborts_the_comm_and_goes_on(exc_type: type) -> None:
    """As Dask's TCP comm (distributed#4133): half the message may be out, so the comm is
    aborted; the exception goes on as it is. Fault injection: the second send of the
    message (its large frame) raises. (Within the test's own task: a KeyboardInterrupt
    reaching asyncio's task machinery would stop the loop.)"""
    a, b = await get_comm_pair()
    conn = a.connection
    real_send = conn.send
    calls = 0
    injected = exc_type()

    async def interrupted_send(data: Any, **kw: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise injected
        await real_send(data, **kw)

    conn.send = interrupted_send  # type: ignore[method-assign]
    with pytest.raises(exc_type) as raised:
        await a.write({"x": to_serialize(np.ones(1 << 20))})
    assert raised.value is injected and calls == 2
    assert a.closed()
    with pytest.raises(CommClosedError):
        await a.write({})
    with pytest.raises(CommClosedError):
        await asyncio.wait_for(b.read(), T)  # the table came, the frame never will
    assert b.closed()
    await a.close()
    await b.close()


@pytest.mark.parametrize("exc_type", [OSError, *_BASE_EXCEPTIONS])
async def test_anything_raised_in_the_middle_of_a_read_aborts_the_comm(exc_type: type) -> None:
    """Fault injection: the batch has arrived, receiving the large frame raises. An error
    becomes CommClosedError (from it); any other BaseException goes on as it is."""
    a, b = await get_comm_pair()
    conn = b.connection
    injected = exc_type("injected")

    async def interrupted_recv_into(buffer: Any) -> int:
        raise injected

    conn.recv_into = interrupted_recv_into  # type: ignore[method-assign]
    await a.write({"x": to_serialize(np.ones(1 << 20))})
    expected = CommClosedError if issubclass(exc_type, Exception) else exc_type
    with pytest.raises(expected) as raised:
        await b.read()  # (in this task, not wait_for's: see the write's test)
    assert (raised.value.__cause__ if expected is CommClosedError else raised.value) is injected
    assert b.closed()
    with pytest.raises(CommClosedError):
        await b.read()
    await wait_until(a.closed, "the writer saw the abort")
    await a.close()
    await b.close()


class _Raising:
    """Pickling or unpickling it raises ``exc``."""

    def __init__(self, exc: BaseException, when: str) -> None:
        self.exc, self.when = exc, when

    def __reduce__(self) -> tuple:
        if self.when == "dumps":
            raise self.exc
        return _raise, (self.exc,)


def _raise(exc: BaseException) -> None:
    raise exc


@pytest.mark.parametrize("exc_type", [ValueError, _Interrupt])
async def test_a_message_that_cannot_be_serialized_leaves_the_comm_usable(exc_type: type) -> None:
    """Nothing was sent (as over TCP, whose write serializes before it touches the stream):
    the error is Dask's, the comm lives on both ways."""
    a, b = await get_comm_pair()
    try:
        with pytest.raises(BaseException) as raised:
            await a.write({"x": to_serialize(_Raising(exc_type("no pickling"), "dumps"))}, on_error="raise")
        assert not isinstance(raised.value, CommClosedError)
        assert isinstance(raised.value, exc_type) or isinstance(raised.value.__cause__, exc_type), raised.value
        assert not a.closed()
        await a.write({"ok": 1})
        assert await asyncio.wait_for(b.read(), T) == {"ok": 1}
        await b.write({"ok": 2})
        assert await asyncio.wait_for(a.read(), T) == {"ok": 2}
    finally:
        await a.close()
        await b.close()


async def test_a_baseexception_while_deserializing_a_whole_message_leaves_the_comm_usable() -> None:
    """The message was read whole, so the comm is still in step (as over TCP, which
    deserializes after the read too): the exception goes on, the next message comes."""
    a, b = await get_comm_pair()
    try:
        await a.write({"x": to_serialize(_Raising(_Interrupt("in unpickling"), "loads"))})
        await a.write({"next": 1})
        with pytest.raises(_Interrupt, match="in unpickling"):  # (raised by the unpickled copy)
            await asyncio.wait_for(b.read(), T)
        assert not b.closed()
        assert await asyncio.wait_for(b.read(), T) == {"next": 1}
    finally:
        await a.close()
        await b.close()


async def test_a_read_cancelled_while_another_holds_the_comm_takes_nothing() -> None:
    """Two reads at once: the second waits for the first; cancelling it while it waits
    took nothing from the comm, which stays open and in step."""
    a, b = await get_comm_pair()
    try:
        first = asyncio.ensure_future(b.read())
        second = asyncio.ensure_future(b.read())
        await asyncio.sleep(0.01)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        assert not b.closed()
        await a.write({"n": 1})
        await a.write({"n": 2})
        assert await asyncio.wait_for(first, T) == {"n": 1}
        assert await asyncio.wait_for(b.read(), T) == {"n": 2}
    finally:
        await a.close()
        await b.close()


# -------------------------------------------------------- connecting ----


async def test_connect_timeout() -> None:
    port = _free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(OSError, match="Timed out trying to connect"):
        await connect(f"rdma://127.0.0.1:{port}", timeout=0.15)
    assert 0.1 <= time.monotonic() - t0 <= 2


async def test_an_unreachable_peer_is_an_oserror_within_the_timeout() -> None:
    # TEST-NET-2 (RFC 5737): documentation addresses, nobody answers
    t0 = time.monotonic()
    with pytest.raises(OSError):
        await connect("rdma://198.51.100.1:8786", timeout=0.5)
    assert time.monotonic() - t0 <= 3


async def test_a_wrong_token_is_fatal_not_retried() -> None:
    with dask.config.set({"distributed.comm.rdma.token": "right"}):
        listener = await listen("rdma://127.0.0.1", lambda comm: comm.abort())
    try:
        with dask.config.set({"distributed.comm.rdma.token": "wrong"}):
            t0 = time.monotonic()
            with pytest.raises(FatalCommClosedError, match="token|HMAC|auth"):
                await connect(listener.contact_address, timeout=10)
            assert time.monotonic() - t0 < 5  # given up at once, not after 10 s of retries
        with dask.config.set({"distributed.comm.rdma.token": "right"}):
            comm = await connect(listener.contact_address)
            await wait_until(comm.closed, "the handler aborted it")
            comm.abort()
    finally:
        listener.stop()


async def test_encryption_is_refused_with_a_clear_error() -> None:
    with pytest.raises(EncryptionRequiredError, match="not encrypted.*authenticated"):
        await listen("rdma://127.0.0.1", lambda comm: None, require_encryption=True)
    with pytest.raises(EncryptionRequiredError, match="use tls://"):
        await connect("rdma://127.0.0.1:8786", require_encryption=True, timeout=1)


async def test_protected_mode_a_listener_off_loopback_needs_a_token() -> None:
    """aiordma refuses a server on a non-loopback address without a token (protected
    mode); the backend passes the token from distributed.comm.rdma.token, and
    distributed.comm.rdma.insecure is the explicit way out."""
    from aiordma import ProtectedModeError

    with pytest.raises(ProtectedModeError, match="token"):
        await listen("rdma://0.0.0.0", lambda comm: None)
    for config in (TOKEN, {"distributed.comm.rdma.insecure": True}):
        with dask.config.set(config):
            listener = await listen("rdma://0.0.0.0", lambda comm: None)
        assert listener.listen_address.startswith("rdma://0.0.0.0:")
        listener.stop()


async def test_the_listener_ignores_a_client_that_is_not_aiordma() -> None:
    called = False

    async def handle_comm(comm: Any) -> None:
        nonlocal called
        called = True

    with dask.config.set({"distributed.comm.rdma.handshake-timeout": "0.2 s"}):
        listener = await listen("rdma://127.0.0.1", handle_comm)
    try:
        host, port = listener.get_host_port()
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET / HTTP/1.0\r\n\r\n")
        # the listener refuses it in one error frame and hangs up (read() returns at EOF)
        assert b"aiordma peer" in await asyncio.wait_for(reader.read(), T)
        writer.close()
        await writer.wait_closed()
        # and it still serves real clients
        comm = await connect(listener.contact_address)
        await wait_until(lambda: called, "the real client was handled")
        comm.abort()
    finally:
        listener.stop()
    assert called


async def test_the_listener_hangs_up_on_a_client_that_says_nothing() -> None:
    """A TCP client that never starts aiordma's rendezvous: refused after the
    handshake timeout, never handed to the comm handler."""
    called = False

    def handle_comm(comm: Any) -> None:
        nonlocal called
        called = True

    with dask.config.set({"distributed.comm.rdma.handshake-timeout": "0.1 s"}):
        listener = await listen("rdma://127.0.0.1", handle_comm)
    try:
        reader, writer = await asyncio.open_connection(*listener.get_host_port())
        await asyncio.wait_for(reader.read(), T)  # EOF: the listener hung up
        writer.close()
        await writer.wait_closed()
    finally:
        listener.stop()
    assert not called


async def test_a_client_gone_before_the_dask_handshake_is_not_handled() -> None:
    """The rendezvous completes (a queue pair), then the client aborts before Dask's
    handshake: the listener drops that comm quietly (loop_hygiene: no error reaches
    the loop), never calls the handler, and serves the next client."""
    import aiordma

    handled: asyncio.Queue = asyncio.Queue()
    listener = await listen("rdma://127.0.0.1", handled.put)
    try:
        host, port = listener.get_host_port()
        conn = await aiordma.connect(host, port, timeout=T)
        conn.abort()
        comm = await connect(listener.contact_address)  # the next one is handled
        served = await asyncio.wait_for(handled.get(), T)
        assert served.peer_address == comm.local_address
        assert handled.empty()
        comm.abort()
        served.abort()
    finally:
        listener.stop()


async def test_a_listener_stopped_before_it_handles_a_connection_fails_the_client_fast() -> None:
    """stop() between the rendezvous and the handler: the connection is aborted, so the
    client's Dask handshake (which no timeout bounds) fails at once instead of hanging.
    Fault injection: the aiordma server's handler stops the listener first."""
    listener = await listen("rdma://127.0.0.1", lambda comm: comm.abort())
    server = listener.server
    handle = server._handler

    async def stop_then_handle(conn: Any) -> None:
        listener.stop()
        await handle(conn)

    server._handler = stop_then_handle
    t0 = time.monotonic()
    with pytest.raises(CommClosedError):
        await asyncio.wait_for(connect(listener.contact_address), T)
    assert time.monotonic() - t0 < 5


class _SlowComm(RDMAComm):
    """Every read and write first sleeps: a slow peer, for the handshake."""

    delay = 0.25

    async def read(self, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(self.delay)
        return await super().read(*args, **kwargs)

    async def write(self, *args: Any, **kwargs: Any) -> int:
        await asyncio.sleep(self.delay)
        return await super().write(*args, **kwargs)


async def test_a_slow_handshake_is_not_bound_by_the_connect_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dask's connect timeout bounds making the connection (the rendezvous); its handshake
    after that may take longer, as over TCP."""

    class SlowConnector(RDMAConnector):
        comm_class = _SlowComm

    class SlowBackend(RDMABackend):
        _connector_class = SlowConnector

    async def echo(comm: Any) -> None:
        await comm.write(await comm.read())
        await comm.close()

    monkeypatch.setitem(backends, "rdma", SlowBackend())
    listener = await listen("rdma://127.0.0.1", echo)
    try:
        with dask.config.set({"distributed.comm.timeouts.connect": "200 ms"}):
            comm = await connect(listener.contact_address)  # the handshake alone takes 0.5 s
        assert isinstance(comm, _SlowComm)
        await comm.write(b"test")
        assert await comm.read() == b"test"
        await comm.close()
    finally:
        listener.stop()


async def test_connect_retries_until_the_listener_is_there() -> None:
    """A peer not listening yet (a worker started before its scheduler) is an OSError that
    Dask's connect retries until its timeout: the listener that comes up meanwhile gets
    the comm."""
    port = _free_port()

    async def echo(comm: Any) -> None:
        await comm.write(await comm.read())
        await comm.close()

    connecting = asyncio.ensure_future(connect(f"rdma://127.0.0.1:{port}", timeout=T))
    await asyncio.sleep(0.3)
    assert not connecting.done()  # refused so far, and retried
    listener = await listen(f"rdma://127.0.0.1:{port}", echo)
    try:
        comm = await asyncio.wait_for(connecting, T)
        await comm.write({"op": "ping"})
        assert await comm.read() == {"op": "ping"}
        await comm.close()
    finally:
        listener.stop()


async def test_failing_to_connect_starts_no_pile_of_threads() -> None:
    """Retrying a refused connect (a name to resolve each time) adds at most the couple of
    threads a resolver pool keeps, not one per attempt."""
    import threading

    before = threading.active_count()
    most = before

    async def watch() -> None:
        nonlocal most
        for _ in range(60):
            await asyncio.sleep(0.001)
            most = max(most, threading.active_count())

    watching = asyncio.ensure_future(watch())
    with pytest.raises(OSError):
        await connect(f"rdma://localhost:{_free_port()}", timeout=0.05)
    await watching
    assert most <= before + 2


async def test_stop_only_stops_accepting() -> None:
    q: asyncio.Queue = asyncio.Queue()

    async def handle_comm(comm: Any) -> None:
        await q.put(comm)

    listener = await listen("rdma://127.0.0.1", handle_comm)
    a = await connect(listener.contact_address)
    b = await asyncio.wait_for(q.get(), T)
    listener.stop()
    await a.write({"still": "open"})
    assert await b.read() == {"still": "open"}
    with pytest.raises(OSError):
        await connect(listener.contact_address, timeout=0.3)
    await a.close()
    await b.close()


async def test_many_listeners() -> None:
    listeners = [await listen("rdma://127.0.0.1", lambda comm: None) for _ in range(100)]
    try:
        assert len({lst.listen_address for lst in listeners}) == 100
        assert len({lst.contact_address for lst in listeners}) == 100
    finally:
        for lst in listeners:
            lst.stop()


# ------------------------------------------------------------- properties ----


async def test_addresses() -> None:
    a, b = await get_comm_pair()
    assert a.peer_address == b.local_address
    assert a.local_address == b.peer_address
    assert a.same_host and b.same_host
    a.abort()
    b.abort()


async def test_repr() -> None:
    a, b = await get_comm_pair()
    assert isinstance(a, RDMAComm)
    assert a.local_address in repr(b) and b.local_address in repr(a)
    assert "closed" not in repr(a) and "closed" not in repr(b)
    await a.close()
    assert "closed" in repr(a)
    assert a.local_address in repr(a) and b.peer_address in repr(a)
    await b.close()
    assert "closed" in repr(b)
    assert a.local_address in repr(b) and b.peer_address in repr(b)


async def test_extra_info_names_the_device_and_queue_pairs() -> None:
    a, b = await get_comm_pair()
    try:
        ia, ib = a.extra_info, b.extra_info
        assert ia["provider"] == "soft" and ia["device"] == "soft0"
        assert ia["peer_qp_num"] == ib["qp_num"] and ib["peer_qp_num"] == ia["qp_num"]
        assert ia["tx_bytes"] > 0  # Dask's handshake
    finally:
        await a.close()
        await b.close()


async def test_comm_instances_are_tracked() -> None:
    from distributed.comm.core import Comm

    a, b = await get_comm_pair()
    assert a in Comm._instances and b in Comm._instances
    a.abort()
    b.abort()
    assert a.closed() and b.closed()
