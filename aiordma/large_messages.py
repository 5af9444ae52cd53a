"""Large messages without bounce copies: the rendezvous ("rndv") protocol.

Small messages travel as SEND chunks through the peer's receive buffers
(:mod:`aiordma.window`): a copy into registered send buffers, a copy out of
the receive buffers. For a large message those copies cost more than the
network, so above ``large_message_threshold`` bytes :meth:`Connection.send`
uses the "get" rendezvous of UCX and MPI implementations instead:

1. the sender registers the message where it lies (``REMOTE_READ`` only,
   exactly its bytes; read-only buffers such as ``bytes`` work) and sends a
   control message ``{"op": "rndv", "id", "buf": [addr, length, rkey]}``, in
   order with its other messages;
2. the receiver's :meth:`~Connection.recv_into` RDMA-Reads the bytes straight
   into the destination — a registered region, or any writable buffer
   registered for the occasion — with no copy (:meth:`~Connection.recv` reads
   into a new buffer and returns it as ``bytes``: one copy);
3. the receiver answers ``{"op": "rndv_done", "id"}`` (in the background: the
   receive returns as soon as the bytes are in place); the registration goes
   back to the sender's cache.

A ``send`` of a writable buffer returns once the peer has pulled the message
(the buffer may then be reused); a ``send`` of ``bytes``, which cannot change,
returns once it is announced, and at most ``large_send_window`` bytes of such
messages wait to be pulled. Either way a receiver that does not read holds the
sender back without buffering anything itself: the natural flow control of a
pull protocol.
Both sides must offer the ``msg-rndv-v1`` capability (every aiordma of this
version does); otherwise large messages go as chunks.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgpack

from . import metrics
from .errors import fresh
from .memory import Region, RegionSlice, RegistrationCache, RemoteBuffer
from .ops import consume_exception
from .providers.base import Access, ProtectionDomain

#: messages of at least this many bytes are pulled by RDMA Read (connect(..., large_message_threshold=))
DEFAULT_LARGE_THRESHOLD = 256 * 1024
#: bytes of immutable large messages (``bytes``) announced and not yet pulled before send() waits
DEFAULT_SEND_WINDOW = 64 << 20
#: the capability both sides must offer
CAPABILITY = "msg-rndv-v1"
#: the largest RDMA Read the receiver posts for one piece of a large message
READ_PIECE = 8 << 20
#: control operations of the protocol (reserved: not for send_control)
OPS = frozenset({"rndv", "rndv_done"})


class LargeMessage:
    """A large message the peer announced, waiting in the receive queue.

    It also remembers a pull that a cancelled receive left running
    (``pulling``, into ``dest``): the next receive into the same destination
    resumes it instead of reading the message again from the start, so a
    receive retried under a short timeout finishes."""

    __slots__ = ("dest", "msg_id", "own", "pulling", "remote")

    def __init__(self, msg_id: int, remote: RemoteBuffer) -> None:
        self.msg_id = msg_id
        self.remote = remote
        self.pulling: asyncio.Task[None] | None = None
        self.dest: Any = None
        #: ``dest`` is the pull's own buffer (a receive that returns ``bytes``)
        self.own = False

    @property
    def nbytes(self) -> int:
        return self.remote.length

    def __repr__(self) -> str:
        return f"LargeMessage(msg_id={self.msg_id}, remote={self.remote!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LargeMessage) and (self.msg_id, self.remote) == (other.msg_id, other.remote)

    __hash__ = None  # type: ignore[assignment]


def announcement(msg_id: int, addr: int, length: int, rkey: int) -> dict[str, Any]:
    return {"op": "rndv", "id": msg_id, "buf": [addr, length, rkey]}


def parse_announcement(msg: dict[str, Any]) -> LargeMessage:
    """Validate the peer's ``rndv`` control message (a lying peer gets a clear ValueError)."""
    msg_id = msg.get("id")
    if not isinstance(msg_id, int) or isinstance(msg_id, bool) or not 0 <= msg_id < 1 << 63:
        raise ValueError(f"invalid large-message id {msg_id!r}")
    remote = RemoteBuffer.from_wire(msg.get("buf"), None)
    if remote.length == 0:
        raise ValueError("a large message of 0 bytes")
    return LargeMessage(msg_id, remote)


def pieces(length: int, piece: int = READ_PIECE) -> list[tuple[int, int]]:
    """``(offset, length)`` of the RDMA Reads that fetch ``length`` bytes."""
    return [(off, min(piece, length - off)) for off in range(0, length, piece)]


def check_options(threshold: int, cache_entries: int | None) -> None:
    """``ValueError`` for a bad ``large_message_threshold`` or ``registration_cache``
    (a connection checks them before it allocates anything on the device)."""
    if threshold < 1:
        raise ValueError(f"large_message_threshold must be at least 1 byte, got {threshold}")
    if cache_entries is None:  # the device's default
        return
    if not isinstance(cache_entries, int) or isinstance(cache_entries, bool) or cache_entries < 0:
        raise ValueError(f"registration_cache must be a number of entries >= 0, got {cache_entries!r}")


async def _closed(*_: Any) -> None:
    raise RuntimeError("the connection is closed")


def _nothing(*_: Any) -> None:
    pass


class LargeMessages:
    """Both ends of the protocol for one connection.

    The connection gives it what it needs as callables (the sans-IO habit:
    no reach into the connection): ``post_control(data)`` sends a control
    message in order with the connection's messages, ``read(remote, into)``
    RDMA-Reads, ``check_usable()`` raises once the connection is over,
    ``settled()`` is called whenever a large message stops being in flight
    (``drain``/``close`` wait on that) and ``requeue(item)`` puts an announced
    message back at the front of the receive queue."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        pd: ProtectionDomain,
        *,
        threshold: int,
        send_window: int,
        cache_entries: int,
        post_control: Callable[[bytes], Coroutine[Any, Any, None]],
        read: Callable[[RemoteBuffer, Any], Awaitable[Any]],
        check_usable: Callable[[], None],
        settled: Callable[[], None],
        requeue: Callable[[LargeMessage], None],
    ) -> None:
        check_options(threshold, cache_entries)
        self.loop = loop
        self.threshold = threshold
        #: both sides offered the capability (set once the rendezvous is done)
        self.enabled = False
        self._post_control = post_control
        self._read = read
        self._check_usable = check_usable
        self._settled = settled
        self._requeue = requeue
        self._ids = itertools.count(1)
        #: sender: announced messages not yet pulled, by id
        self.pending: dict[int, asyncio.Future[None]] = {}
        #: sender: bytes of announced messages that may return early, and their limit
        self.unpulled = 0
        self.window = send_window
        self._window_waiters: list[asyncio.Future[None]] = []
        #: receiver: rndv_done messages on their way (kept referenced until sent)
        self._acks: set[asyncio.Task[None]] = set()
        #: registrations of messages sent by RDMA Read (REMOTE_READ of exactly their bytes)
        self.send_cache = RegistrationCache(pd, Access.REMOTE_READ, max_entries=cache_entries)
        #: registrations of recv_into destinations (local access only)
        self.recv_cache = RegistrationCache(pd, Access.LOCAL_WRITE, max_entries=cache_entries)

    def wants(self, nbytes: int) -> bool:
        """A message of ``nbytes`` goes by this protocol."""
        return self.enabled and nbytes >= self.threshold

    # ------------------------------------------------------------ sender ----
    async def announce(self, data: Any, nbytes: int, early: bool) -> asyncio.Future[None] | None:
        """Announce ``data`` for the peer to pull. With ``early`` (the buffer
        cannot change, or the caller promised not to change it) return once
        announced, within the send window, and None; otherwise return the future
        of its pull, which the sender awaits (once the message has its place in
        the connection's order, so a later message need not wait for the pull). The
        registration is held until the peer has pulled the message or the
        connection failed."""
        if early:
            while self.unpulled and self.unpulled + nbytes > self.window:
                self._check_usable()
                fut: asyncio.Future[None] = self.loop.create_future()
                self._window_waiters.append(fut)
                try:
                    await fut
                finally:
                    if fut in self._window_waiters:
                        self._window_waiters.remove(fut)
            self._check_usable()
        region = self.send_cache.acquire(data)
        msg_id = next(self._ids)
        done: asyncio.Future[None] = self.loop.create_future()
        self.pending[msg_id] = done
        self.unpulled += nbytes

        def pulled(_: object = None) -> None:
            self.pending.pop(msg_id, None)
            self.unpulled -= nbytes
            self.send_cache.release(region)
            self._settled()
            waiters, self._window_waiters = self._window_waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)

        try:
            await self._post_control(msgpack.packb(announcement(msg_id, region.addr, region.length, region.rkey)))
        except BaseException:
            pulled()
            raise
        done.add_done_callback(pulled)  # the peer pulls it later (the sender's buffer stays registered)
        return None if early else done

    def on_done(self, msg: dict[str, Any]) -> None:
        """The peer's ``rndv_done``: it has pulled the message."""
        done = self.pending.get(msg.get("id"))  # type: ignore[arg-type]
        if done is not None and not done.done():
            done.set_result(None)

    # ---------------------------------------------------------- receiver ----
    async def pull(self, item: LargeMessage, dest: Any = None) -> Any:
        """RDMA-Read an announced message into ``dest`` (a region, a slice or
        any writable buffer; None: a ``bytearray`` of its own), tell the
        sender, and return the destination.

        Cancel safe: if the caller is cancelled, the reads already posted go on
        into the destination (it stays registered until they complete), and
        the message goes back to the front of the queue for the next receive,
        whole (the sender keeps it until told it was received). That receive
        resumes the pull when it reads into the same destination (the same
        object; always for ``dest=None``) instead of starting again."""
        task = item.pulling
        if task is not None and (item.own if dest is None else dest is item.dest):
            dest = item.dest  # resume: the reads a cancelled receive left are still going
        else:
            item.own = dest is None
            if dest is None:
                dest = bytearray(item.nbytes)
            task = item.pulling = self._start_pull(item, dest)
            item.dest = dest
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            self._requeue(item)
            raise
        item.pulling = item.dest = None
        item.own = False
        metrics.received(1, item.nbytes)
        # The bytes are in place: from here on the receive must return them, so the
        # sender is told without a suspension point a cancellation could land on (a
        # failure to tell it is the connection's failure, reported by drain()/close()).
        ack = self.loop.create_task(self._post_control(msgpack.packb({"op": "rndv_done", "id": item.msg_id})))
        self._acks.add(ack)
        ack.add_done_callback(self._acks.discard)
        ack.add_done_callback(consume_exception)
        return dest

    def _start_pull(self, item: LargeMessage, dest: Any) -> asyncio.Task[None]:
        """The RDMA Reads of ``item`` into ``dest``, as one task."""
        n = item.nbytes
        release: Callable[[], None] | None = None
        if isinstance(dest, Region):
            base = dest[0:n]
        elif isinstance(dest, RegionSlice):
            base = RegionSlice(dest.region, dest.offset, n)
        else:
            reg = self.recv_cache.acquire(memoryview(dest).cast("B")[:n])
            base = reg[0:n]
            release = functools.partial(self.recv_cache.release, reg)
        region, start = base.region, base.offset

        async def reads() -> None:
            await asyncio.gather(
                *(
                    self._read(item.remote.at(off, length), region[start + off : start + off + length])
                    for off, length in pieces(n)
                )
            )

        task = self.loop.create_task(reads())
        if release is not None:
            task.add_done_callback(lambda _: release())
        task.add_done_callback(consume_exception)  # (a failure is the receive's, if one awaits it)
        return task

    # ------------------------------------------------------------- end ----
    def fail(self, exc: BaseException) -> None:
        """The connection is over: senders waiting for a pull get ``exc``."""
        for done in list(self.pending.values()):
            if not done.done():
                done.set_exception(fresh(exc))
                done.add_done_callback(consume_exception)
        for fut in self._window_waiters:
            if not fut.done():
                fut.set_result(None)

    def close(self) -> None:
        self.send_cache.close()
        self.recv_cache.close()
        # the connection's callbacks are let go: they hold the connection, which holds this
        self._post_control = self._read = _closed
        self._check_usable = self._settled = _nothing
        self._requeue = _nothing

    def stats(self) -> dict[str, int]:
        return {
            "large_messages_in_flight": len(self.pending),
            "large_bytes_unpulled": self.unpulled,
            "registration_cache_hits": self.send_cache.hits + self.recv_cache.hits,
            "registration_cache_misses": self.send_cache.misses + self.recv_cache.misses,
        }
