"""Control messages (:class:`aiordma.control.ControlMessages`) on their own: what
each op that arrives is handed to, what a lying or broken peer's message does
(logged and dropped, or the connection ended: never an exception out of the
receive path), the peer's advertised buffers and their waiters, and the
checks on what is sent. The goodbye on the rendezvous
(:func:`aiordma.rendezvous.goodbye` / ``parse_goodbye``) is the other half of
what one end tells the other outside its messages."""

from __future__ import annotations

import asyncio
import logging

import msgpack
import pytest

from aiordma import ConnectionClosedError, ConnectionLostError, RemoteBufferNotFoundError
from aiordma.control import RESERVED_OPS, ControlMessages
from aiordma.events import ControlReceived
from aiordma.memory import RemoteBuffer
from aiordma.rendezvous import goodbye, parse_goodbye


class Wired:
    """A ControlMessages with every callback recorded."""

    def __init__(self) -> None:
        self.announced: list = []
        self.pulled: list = []
        self.emitted: list = []
        self.violations: list = []
        self.control = ControlMessages(
            asyncio.get_running_loop(),
            announced=self.announced.append,
            pulled=self.pulled.append,
            emit=lambda e: bool(self.emitted.append(e)),
            violation=self.violations.append,
        )

    def receive(self, msg: object) -> None:
        self.control.receive(msgpack.packb(msg, use_bin_type=True))


async def test_each_op_goes_to_whoever_it_is_for():
    w = Wired()
    w.receive({"op": "rndv", "id": 7, "buf": [0x1000, 300_000, 42]})
    w.receive({"op": "rndv_done", "id": 7})
    w.receive({"op": "eof", "stream": 1})
    (item,) = w.announced
    assert (item.msg_id, item.nbytes) == (7, 300_000)
    assert w.pulled == [{"op": "rndv_done", "id": 7}]
    (event,) = w.emitted
    assert isinstance(event, ControlReceived) and event.message == {"op": "eof", "stream": 1}
    assert w.violations == []


async def test_an_advertised_buffer_joins_the_peers_and_wakes_its_waiter():
    w = Wired()
    waiting = asyncio.ensure_future(w.control.wait_remote("late", timeout=5))
    await asyncio.sleep(0)
    rb = RemoteBuffer(0x2000, 64, 99, "late")
    w.control.receive(ControlMessages.advertisement("late", rb))
    got = await waiting
    assert (got.addr, got.length, got.rkey, got.name) == (0x2000, 64, 99, "late")
    assert w.control.remote("late") == got
    with pytest.raises(RemoteBufferNotFoundError, match=r"no buffer named 'other' \(it has: late\)"):
        w.control.remote("other")
    with pytest.raises(TimeoutError, match="did not expose a buffer named 'never'"):
        await w.control.wait_remote("never", timeout=0.01)


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1 not msgpack",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"no": "op"}),
        msgpack.packb({"op": "advertise", "name": 5, "buf": [1, 2, 3]}),
        msgpack.packb({"op": "advertise", "name": "x", "buf": "nonsense"}),
        msgpack.packb({"op": "advertise", "name": "x", "buf": [1, 2, 3], "rights": 7}),
    ],
)
async def test_a_malformed_message_is_logged_and_dropped(raw, caplog):
    w = Wired()
    with caplog.at_level(logging.WARNING, logger="aiordma"):
        w.control.receive(raw)
    assert caplog.records, "a dropped control message is logged"
    assert (w.announced, w.pulled, w.emitted, w.violations) == ([], [], [], [])
    assert w.control.remote_buffers == {}


async def test_a_lying_large_message_announcement_ends_the_connection():
    w = Wired()
    w.receive({"op": "rndv", "id": -1, "buf": [1, 2, 3]})
    (error,) = w.violations
    assert isinstance(error, ConnectionLostError) and "invalid large message" in str(error)
    assert w.announced == []


async def test_waiters_get_the_connections_error_and_callbacks_are_let_go():
    w = Wired()
    waiting = asyncio.ensure_future(w.control.wait_remote("x", timeout=5))
    await asyncio.sleep(0)
    w.control.fail(ConnectionClosedError("the connection was closed locally"))
    with pytest.raises(ConnectionClosedError, match="closed locally"):
        await waiting
    w.control.close()
    w.receive({"op": "eof"})  # after close: delivered to nobody, and no error
    assert w.emitted == []


def test_what_is_sent_is_checked():
    assert msgpack.unpackb(ControlMessages.encode({"op": "credit", "n": 3})) == {"op": "credit", "n": 3}
    for op in sorted(RESERVED_OPS) + ["_private"]:
        with pytest.raises(ValueError, match="reserved by aiordma"):
            ControlMessages.encode({"op": op})
    with pytest.raises(TypeError, match='a map with a string "op"'):
        ControlMessages.encode({"op": 3})
    with pytest.raises(TypeError, match="msgpack-serialisable"):
        ControlMessages.encode({"op": "x", "value": object()})


@pytest.mark.parametrize(
    ("message", "kind", "text"),
    [
        (goodbye(), ConnectionClosedError, "the peer closed the connection"),
        (goodbye(aborted=True), ConnectionLostError, "the peer aborted the connection"),
        (goodbye(abandoned=True), ConnectionLostError, "ended without closing the connection"),
        (goodbye("rkey 0x1234 not valid"), ConnectionLostError, "the peer's queue pair failed: rkey 0x1234"),
    ],
)
def test_a_goodbye_says_how_the_peer_ended(message, kind, text):
    reason, error = parse_goodbye(message)
    assert isinstance(error, kind) and text in str(error)
    assert reason == message.get("reason")


def test_only_a_goodbye_ends_a_connection_and_a_reason_is_bounded():
    assert parse_goodbye({"t": "ping"}) is None
    reason, _ = parse_goodbye(goodbye("x" * 10_000))
    assert reason is not None and len(reason) == 500
    reason, error = parse_goodbye({"t": "bye", "reason": 12})  # a lying peer: not a string
    assert reason is None and isinstance(error, ConnectionClosedError)


def test_a_torn_down_collaborator_raises_the_connections_own_error():
    """After teardown a collaborator's check raises a copy of the connection's
    error (not a generic one), and that the connection is closed when it had none."""
    from aiordma.errors import raiser, stored

    kept = stored(ConnectionLostError("the peer aborted the connection"))
    with pytest.raises(ConnectionLostError, match="the peer aborted") as first:
        raiser(kept)()
    assert first.value is not kept
    with pytest.raises(ConnectionClosedError, match="the connection is closed"):
        raiser(None)()
