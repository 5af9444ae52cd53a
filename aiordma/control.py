"""Control messages: what a connection says to its peer's connection, beside the application's messages.

A control message is a small msgpack map with a string ``"op"``, sent as a
SEND whose immediate data marks it ``K_CONTROL`` (:mod:`aiordma.window`), so
it travels in order with the messages and writes of the same queue pair. Some
ops are aiordma's own:

* ``advertise``: the peer exposes a buffer after the handshake
  (:meth:`~aiordma.Connection.advertise`); it joins ``remote_buffers`` and
  wakes whoever waits for that name (:meth:`~aiordma.Connection.wait_remote`);
* ``rndv`` / ``rndv_done``: a large message is announced / was pulled
  (:mod:`aiordma.large_messages`);
* ``xfer``: a Write transfer's notification (:mod:`aiordma.transfer`): the peer's
  transfer ``id`` and its small payload, sent once every byte of it is in this
  end's memory; queued for :meth:`~aiordma.Connection.recv_notification`;
* ``_rv``: a rendezvous message carried on the queue pair itself, for a
  connection that RDMA CM connected (:mod:`aiordma.cm`): the handshake's
  first exchange and, afterwards, the goodbye;

every other op is a protocol's above the connection (a byte stream's EOF and
ring credits), handed to the connection's event handler as
:class:`~aiordma.events.ControlReceived`. :class:`ControlMessages` is the
connection's collaborator for all of it, wired by callbacks (as
:class:`~aiordma.large_messages.LargeMessages` is): it decodes and dispatches
what arrives, checks and encodes what is sent, and keeps the peer's exposed
buffers and their waiters. It posts nothing itself.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from . import large_messages
from .errors import ConnectionLostError, RemoteBufferNotFoundError, fresh
from .events import ConnectionEvent, ControlReceived
from .memory import RemoteBuffer
from .ops import consume_exception
from .rights import parse_rights

__all__ = ["RESERVED_OPS", "ControlMessages", "TransferNotification"]

log = logging.getLogger("aiordma")

#: the op of a rendezvous message carried on the queue pair (RDMA CM connections)
RENDEZVOUS_OP = "_rv"
#: the op of a Write transfer's notification
NOTIFICATION_OP = "xfer"
#: the most bytes a notification's payload carries
MAX_NOTIFICATION_PAYLOAD = 4096


@dataclass(frozen=True)
class TransferNotification:
    """The peer's Write transfer is complete: every byte of it is in this end's memory.
    ``id`` is the transfer's (:attr:`aiordma.Transfer.id`, unique among the peer's
    transfers on this connection), ``payload`` the bytes it was started with."""

    id: int
    payload: bytes


#: control ops the connection itself uses (not for send_control, not passed to the event handler)
RESERVED_OPS = frozenset({"advertise", RENDEZVOUS_OP, NOTIFICATION_OP}) | large_messages.OPS


def _nothing(_: Any) -> None:
    pass


def _not_delivered(_: ConnectionEvent) -> bool:
    return False


class ControlMessages:
    """A connection's control messages and the peer's exposed buffers.

    ``announced(item)`` queues a large message's announcement for the
    receiver; ``pulled(msg)`` tells the sender's large messages one was
    pulled; ``emit(event)`` gives a protocol's control message to the
    event handler; ``violation(error)`` ends the connection when the peer
    broke the protocol."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        announced: Callable[[large_messages.LargeMessage], None],
        pulled: Callable[[dict[str, Any]], None],
        emit: Callable[[ConnectionEvent], bool],
        violation: Callable[[BaseException], None],
    ) -> None:
        self.loop = loop
        self._announced = announced
        self._pulled = pulled
        self._emit = emit
        self._violation = violation
        #: the buffers the peer exposed, by name (at the handshake, then advertised)
        self.remote_buffers: dict[str, RemoteBuffer] = {}
        #: who takes the rendezvous messages carried on the queue pair (an RDMA CM
        #: connection's :class:`aiordma.cm.CMChannel`); None: they are dropped
        self.on_rendezvous: Callable[[dict[str, Any]], None] | None = None
        self._waiters: dict[str, list[asyncio.Future[RemoteBuffer]]] = {}
        #: the peer's transfer notifications not yet taken, and who waits for one
        self._notifications: collections.deque[TransferNotification] = collections.deque()
        self._notified: collections.deque[asyncio.Future[None]] = collections.deque()
        self._error: BaseException | None = None

    # ------------------------------------------------ the peer's buffers ----
    def _names(self) -> str:
        return ", ".join(sorted(self.remote_buffers)) or "none"

    def remote(self, name: str) -> RemoteBuffer:
        """The buffer the peer exposed under ``name``."""
        try:
            return self.remote_buffers[name]
        except KeyError:
            raise RemoteBufferNotFoundError(
                f"the peer exposed no buffer named {name!r} (it has: {self._names()})"
            ) from None

    async def wait_remote(self, name: str, timeout: float | None) -> RemoteBuffer:
        """The buffer ``name`` once the peer exposes it (now if it has)."""
        if name in self.remote_buffers:
            return self.remote_buffers[name]
        fut = self.loop.create_future()
        self._waiters.setdefault(name, []).append(fut)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise TimeoutError(
                f"the peer did not expose a buffer named {name!r} within {timeout} s (it has: {self._names()})"
            ) from None
        finally:
            waiters = self._waiters.get(name)
            if waiters is not None and fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del self._waiters[name]

    # ---------------------------------------------- transfer notifications ----
    async def notification(self) -> TransferNotification:
        """The next transfer notification from the peer (waits for one)."""
        while not self._notifications:
            if self._error is not None:
                raise fresh(self._error)
            waiter: asyncio.Future[None] = self.loop.create_future()
            self._notified.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._notified:
                    self._notified.remove(waiter)
        return self._notifications.popleft()

    @staticmethod
    def notification_message(transfer_id: int, payload: bytes) -> bytes:
        """A Write transfer's notification, packed."""
        data: bytes = msgpack.packb({"op": NOTIFICATION_OP, "id": transfer_id, "p": payload}, use_bin_type=True)
        return data

    def _notified_by_peer(self, msg: dict[str, Any]) -> None:
        transfer_id, payload = msg.get("id"), msg.get("p", b"")
        if not isinstance(transfer_id, int) or isinstance(transfer_id, bool) or not isinstance(payload, bytes):
            log.warning("peer sent a malformed transfer notification")
            return
        self._notifications.append(TransferNotification(transfer_id, payload))
        while self._notified:
            waiter = self._notified.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    def fail(self, exc: BaseException) -> None:
        """The connection is over: whoever waits for a buffer or a notification gets (a copy of) ``exc``."""
        self._error = exc
        for notified in self._notified:
            if not notified.done():
                notified.set_exception(fresh(exc))
                notified.add_done_callback(consume_exception)
        self._notified.clear()
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(fresh(exc))
                    waiter.add_done_callback(consume_exception)
        self._waiters.clear()

    def close(self) -> None:
        """The connection is torn down: its callbacks are let go (they hold the
        connection, which holds this)."""
        self._announced = self._pulled = _nothing
        self._emit = _not_delivered
        self._violation = _nothing
        self.on_rendezvous = None

    # ----------------------------------------------------------- sending ----
    @staticmethod
    def rendezvous_message(message: dict[str, Any]) -> bytes:
        """A rendezvous message (a typed map) packed to travel on the queue pair."""
        data: bytes = msgpack.packb({"op": RENDEZVOUS_OP, "m": message}, use_bin_type=True)
        return data

    @staticmethod
    def advertisement(name: str, rb: RemoteBuffer) -> bytes:
        """The ``advertise`` message for ``rb`` exposed under ``name``."""
        msg: dict[str, Any] = {"op": "advertise", "name": name, "buf": rb.to_wire()}
        if rb.rights is not None:
            msg["rights"] = rb.rights
        data: bytes = msgpack.packb(msg, use_bin_type=True)
        return data

    @staticmethod
    def encode(message: Mapping[str, Any]) -> bytes:
        """A protocol's control message, checked and packed: a map with a string
        ``"op"`` that is not aiordma's own (not reserved, not starting with ``_``)."""
        if not isinstance(message, Mapping) or not isinstance(message.get("op"), str):
            raise TypeError('a control message is a map with a string "op"')
        if message["op"] in RESERVED_OPS or message["op"].startswith("_"):
            raise ValueError(f"control op {message['op']!r} is reserved by aiordma")
        try:
            data: bytes = msgpack.packb(dict(message), use_bin_type=True)
        except (TypeError, ValueError) as e:
            raise TypeError(f"a control message must be msgpack-serialisable: {e}") from None
        return data

    # --------------------------------------------------------- receiving ----
    def receive(self, data: bytes) -> None:
        """A control message arrived: decode it and hand it to whoever it is for.
        A malformed one is logged and dropped (the messages around it are not
        affected); an invalid large-message announcement ends the connection."""
        try:
            msg = msgpack.unpackb(data, raw=False)
        except Exception:
            log.warning("peer sent a malformed control message")
            return
        if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
            log.warning("peer sent a control message without an op")
            return
        op = msg["op"]
        if op == "rndv":
            try:
                item = large_messages.parse_announcement(msg)
            except ValueError as e:
                self._violation(ConnectionLostError(f"the peer announced an invalid large message: {e}"))
                return
            self._announced(item)
        elif op == "rndv_done":
            self._pulled(msg)
        elif op == "advertise":
            self._advertised(msg)
        elif op == NOTIFICATION_OP:
            self._notified_by_peer(msg)
        elif op == RENDEZVOUS_OP:
            inner = msg.get("m")
            if self.on_rendezvous is None or not isinstance(inner, dict) or not isinstance(inner.get("t"), str):
                log.warning("peer sent a rendezvous message this connection does not expect")
                return
            self.on_rendezvous(inner)
        else:
            self._emit(ControlReceived(msg))

    def _advertised(self, msg: dict[str, Any]) -> None:
        name = msg.get("name")
        try:
            if not isinstance(name, str):
                raise ValueError("the name is not a string")
            rb = RemoteBuffer.from_wire(msg.get("buf"), name)
            if msg.get("rights") is not None:
                rights = msg["rights"]
                if not isinstance(rights, str):
                    raise ValueError("the rights are not a string")
                rb = RemoteBuffer(rb.addr, rb.length, rb.rkey, name, parse_rights(rights))
        except ValueError as e:
            log.warning("peer advertised an invalid buffer: %s", e)
            return
        self.remote_buffers[name] = rb
        for fut in self._waiters.pop(name, []):
            if not fut.done():
                fut.set_result(rb)
