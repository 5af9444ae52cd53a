"""Two-sided messages over one queue pair: the receive FIFO and the send side.

A message travels as SEND-with-immediate chunks into the receive buffers the
peer posted; the immediate data says which chunk is the last and returns
credits (the sans-IO rules are :class:`~aiordma.window.MessageWindow`'s).
This module holds the asyncio side of those rules for a
:class:`~aiordma.Connection`:

* :class:`Inbox`: received messages (and immediates) waiting for
  ``recv()``;
* :class:`Inbound`: the receive half: the receive buffers posted for the
  peer's SENDs, what each receive completion brought (a chunk of a message,
  a control message, a Write-with-immediate's notification) and the
  ``recv()`` family;
* :class:`Outbox`: the send side. Messages are posted whole, in the order of
  their ``send()`` calls, even when a caller is cancelled while its message
  waits (a *turn* per message); a message longer than one receive buffer
  goes out in chunks, each needing a credit (a receive buffer free at the
  peer), a registered send buffer and a send-queue slot; when enough
  credits are owed to the peer and nothing is going out to carry them, a
  credit update (an empty SEND) returns them.

The connection's per-message fast path (one chunk, everything free) posts
directly through the outbox's send buffers (:attr:`Outbox.pool`,
:attr:`Outbox.views`, ...); everything that has to wait is here.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import Callable
from typing import Any

from . import large_messages, metrics
from .errors import ConnectionClosedError, RDMAError, fresh, raiser
from .events import ConnectionEvent, ImmediateReceived
from .memory import BufferPool, BufferTable, Region, RegionSlice, SlotTable
from .ops import OP_CREDIT, OP_MESSAGE, Op, OperationTracker, SendQueue, consume_exception
from .pools import RECV_TAG, ReceivePool, SendPool
from .providers.base import (
    SGE,
    Access,
    ProtectionDomain,
    QueuePair,
    RecvWR,
    SendWR,
    WCOpcode,
    WCStatus,
    WorkCompletion,
    WROpcode,
)
from .window import K_CONTROL, K_CREDIT, K_LAST, K_MORE, MessageWindow

_received = metrics.received

__all__ = ["RECV_TAG", "Inbound", "Inbox", "Outbox"]

log = logging.getLogger("aiordma")

_SEND_WITH_IMM = WROpcode.IBV_WR_SEND_WITH_IMM
# plain-int forms of the enum values the per-message path compares against
# (an int compare instead of a global load and an attribute lookup each time)
_WC_SUCCESS = int(WCStatus.IBV_WC_SUCCESS)
_WC_RECV_RDMA_WITH_IMM = int(WCOpcode.IBV_WC_RECV_RDMA_WITH_IMM)
_LOCAL = (Region, RegionSlice)


class Inbox:
    """An unbounded FIFO of received items with the semantics of the
    ``asyncio.Queue`` it replaces (``put`` never blocks; a ``get`` that has to
    wait is woken with the item left in the queue, so a cancelled waiter loses
    nothing, and waiters are woken in order), minus its per-call overhead.

    ``items`` is read directly on the fast paths: a non-empty inbox hands its
    head over without a suspension, as ``Queue.get`` does. (What bounds it is
    the connection's receive budget, :class:`~aiordma.window.MessageWindow`.)"""

    __slots__ = ("items", "loop", "waiters")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.items: collections.deque[Any] = collections.deque()
        # a list, not a deque: rarely more than one waiter, and an empty deque is 760 bytes
        self.waiters: list[asyncio.Future[None]] = []
        self.loop = loop

    def put(self, item: Any) -> None:
        self.items.append(item)
        if self.waiters:
            self.wake_next()

    def put_back(self, item: Any) -> None:
        """Return ``item`` to the head (a receive that took it did not keep it)."""
        self.items.appendleft(item)
        if self.waiters:
            self.wake_next()

    def wake_next(self) -> None:
        """Wake the first waiter that is still waiting (if any)."""
        waiters = self.waiters
        while waiters:
            waiter = waiters.pop(0)
            if not waiter.done():
                waiter.set_result(None)
                break

    async def get(self) -> Any:
        items = self.items
        while not items:
            waiter = self.loop.create_future()
            self.waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                waiter.cancel()  # in case it is not done yet
                try:
                    self.waiters.remove(waiter)
                except ValueError:  # put() had already taken it off
                    pass
                if items and not waiter.cancelled():
                    # woken by put() but cancelled before taking the item: pass it on
                    self.wake_next()
                raise
        return items.popleft()


def _slot_release(pool: SendPool, slot: int) -> Callable[[], None]:
    return functools.partial(pool.release, slot)


def _no_slots(slot: int) -> Any:
    raise IndexError(f"send slot {slot}: the connection has no send pool (not connected)")


def _slot_send_op_of(releases: SlotTable, slot: int) -> Op:
    return _slot_send_op(releases[slot])


def _slot_send_op(release: Callable[[], None]) -> Op:
    """The reusable :class:`Op` of one send-buffer slot for one-chunk messages.

    A slot carries at most one SEND at a time and its op leaves the tracker
    (its completion) before the slot is released, so the connection's fast path
    fills in ``fut`` and ``nbytes`` instead of building an op, a release closure
    and a description per message."""
    # (no description closure over the op itself: that cycle would outlive the connection)
    return Op(None, release, None, _SEND_WITH_IMM, OP_MESSAGE)


#: ``(previous message's "posted" future or None, this message's)``
Turn = tuple["asyncio.Future[None] | None", "asyncio.Future[None]"]


class Outbox:
    """The send side of a connection's messages (see the module's docstring).

    ``check_usable()`` raises the connection's error (or that it is closed);
    ``large`` sends what is too large to copy (the peer pulls it)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        window: MessageWindow,
        sq: SendQueue,
        ops: OperationTracker,
        *,
        check_usable: Callable[[], None],
        large: large_messages.LargeMessages,
    ) -> None:
        self.loop = loop
        self.window = window
        self.sq = sq
        self.ops = ops
        self._check_usable = check_usable
        self.large = large
        #: the device's registered send buffers, one chunk each (given by :meth:`start`)
        self.pool: SendPool | None = None
        # per send-buffer slot, built on first use: its release and its one-chunk op
        # (the fast path reads them; the buffer itself is the pool's)
        self.releases: SlotTable = SlotTable(_no_slots)
        self.slot_ops: SlotTable = self.releases
        self._lock = asyncio.Lock()
        #: a chunked message holds the lock (what ``_lock.locked()`` says, without the call)
        self.busy = False
        #: set once the last message whose send began is posted (None: every one is): a
        #: later message waits for it, so messages are posted in the order of their
        #: send() calls even when a caller was cancelled while its message waited
        self.tail: asyncio.Future[None] | None = None
        self.credit_waiters: list[asyncio.Future[None]] = []
        #: who waits for the messages sent so far to be acknowledged (drain, close)
        self.drain_waiters: list[asyncio.Future[None]] = []
        #: set when the connection can post no more (failed or closed)
        self.stopped = False
        self._left = False

    def start(self, pool: SendPool) -> None:
        """Chunks go out of ``pool``'s buffers (the device's send pool of the chunk
        size: :func:`aiordma.pools.send_pool`, whose user this connection now is)."""
        self.pool = pool
        self.releases = SlotTable(functools.partial(_slot_release, pool))
        self.slot_ops = SlotTable(functools.partial(_slot_send_op_of, self.releases))

    # ------------------------------------------------------------ credits ----
    async def take_credit(self) -> None:
        """Spend a message credit (never the last one: that is kept for credit updates).
        A caller that does not post the chunk after all calls :meth:`return_credit`."""
        window = self.window
        while not window.can_send_chunk():
            self._check_usable()
            fut = self.loop.create_future()
            self.credit_waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self.credit_waiters:
                    self.credit_waiters.remove(fut)
        self._check_usable()
        window.spend()

    def return_credit(self) -> None:
        """Give back a credit taken for a chunk that was not posted (its sender was
        cancelled while waiting for a buffer or a send-queue slot): it was never used,
        so the peer will not return it."""
        self.window.give_back()
        self.wake_credit_waiters()

    def wake_credit_waiters(self) -> None:
        waiters, self.credit_waiters = self.credit_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    def return_credits(self) -> None:
        """Send a credit update when enough credits are owed and no message is going out."""
        window = self.window
        if self.stopped or not window.credit_update_due() or self.sq.free <= 0:
            return
        window.spend()
        self.sq.free -= 1
        window.credit_update_inflight = True
        imm = (K_CREDIT << 30) | window.take_owed()

        def done() -> None:
            window.credit_update_inflight = False

        try:
            self.ops.post(
                SendWR(0, _SEND_WITH_IMM, [], imm_data=imm), Op(None, done, "credit update", _SEND_WITH_IMM, OP_CREDIT)
            )
        except RDMAError as e:
            window.credit_update_inflight = False
            log.debug("credit update failed: %s", e)

    # -------------------------------------------------------------- order ----
    async def send_queued(self, mv: Any, n: int, wait_ack: bool, wait_pulled: bool | None) -> None:
        """Send a message that cannot go out at once (see
        :meth:`aiordma.Connection.send`): in its turn, in chunks, or announced for
        the peer to pull when it is large. Its task is shielded: a cancelled caller
        does not cut it in half."""
        if self.large.wants(n):
            if wait_pulled is None:
                immutable = type(mv) is bytes or (type(mv) is memoryview and type(mv.obj) is bytes)
            else:
                immutable = not wait_pulled
            task = self.loop.create_task(self.send_in_order(mv, self.take_turn(), large=True, immutable=immutable))
        else:
            if type(mv) is bytes:
                mv = memoryview(mv)
            task = self.loop.create_task(self.send_in_order(mv, self.take_turn(), wait_ack=wait_ack))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            # the message goes on without its caller: a failure later (the
            # connection aborted) is the connection's to report, not the loop's
            task.add_done_callback(consume_exception)
            raise

    def take_turn(self) -> Turn:
        """A place in the order of messages, taken when send() is called (not when
        its task first runs): the previous message's "posted" future and this one's."""
        prev = self.tail
        posted: asyncio.Future[None] = self.loop.create_future()
        self.tail = posted
        return prev, posted

    def _turn_done(self, posted: asyncio.Future[None]) -> None:
        posted.set_result(None)
        if self.tail is posted:
            self.tail = None

    async def send_in_order(
        self,
        mv: Any,
        turn: Turn,
        *,
        kind_last: int = K_LAST,
        wait_ack: bool = False,
        large: bool = False,
        immutable: bool = False,
    ) -> None:
        """Post a message once every message sent before it is posted, then wait
        for what the caller waits for (its acknowledgements, its pull).

        A message is posted whole or not at all and never after one sent
        later: a cancelled ``send()`` goes on in its place in the order (its
        task is shielded), and a ``send_control()`` cancelled before its turn
        is not sent."""
        prev, posted = turn
        try:
            if prev is not None and not prev.done():
                await asyncio.wait((prev,))  # (not `await prev`: a cancellation would cancel prev)
            if large:
                pulled = await self.large.announce(mv, len(mv) if type(mv) is bytes else mv.nbytes, immutable)
                waits: list[asyncio.Future[Any]] = [] if pulled is None else [pulled]
            else:
                waits = await self.post_message(mv, kind_last, wait_ack)
        finally:
            if prev is not None and not prev.done():
                # cancelled before its turn (a send_control): the next message still
                # waits for the one before this
                prev.add_done_callback(lambda _: self._turn_done(posted))
            else:
                self._turn_done(posted)
        if waits:
            await asyncio.gather(*waits)

    async def post_message(self, mv: memoryview, kind_last: int, wait_ack: bool) -> list[asyncio.Future[Any]]:
        """Post ``mv`` as SEND chunks; returns the chunks' completions when ``wait_ack``."""
        async with self._lock:
            self.busy = True
            try:
                pool = self.pool
                assert pool is not None
                window = self.window
                chunk = window.chunk_size
                n = mv.nbytes
                futs: list[asyncio.Future[Any]] = []
                off = 0
                while True:
                    piece = mv[off : off + chunk]
                    last = off + chunk >= n
                    await self.take_credit()
                    try:
                        slot = await pool.acquire()
                    except BaseException:
                        self.return_credit()
                        raise
                    plen = piece.nbytes
                    pool.view(slot)[:plen] = piece
                    try:
                        await self.sq.acquire()
                    except BaseException:
                        pool.release(slot)
                        self.return_credit()
                        raise
                    imm = ((kind_last if last else K_MORE) << 30) | window.take_owed()
                    sges = [pool.sge(slot, plen)] if plen else []
                    fut: asyncio.Future[WorkCompletion] | None = self.loop.create_future() if wait_ack else None
                    describe = functools.partial("SEND of a {}-byte chunk".format, plen)
                    self.ops.post(
                        SendWR(0, _SEND_WITH_IMM, sges, imm_data=imm),
                        Op(fut, self.releases[slot], describe, _SEND_WITH_IMM, OP_MESSAGE),
                    )
                    if fut is not None:
                        futs.append(fut)
                    off += chunk
                    if last:
                        break
            finally:
                self.busy = False
        return futs

    # -------------------------------------------------------------- drain ----
    def wake_drain_waiters(self) -> None:
        waiters, self.drain_waiters = self.drain_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def unacknowledged(self) -> int:
        """Message chunks sent and not yet acknowledged, and large messages not yet pulled."""
        return self.ops.outstanding(OP_MESSAGE) + len(self.large.pending)

    async def drained(self, timeout: float | None, *, pulls: bool = True) -> bool:
        """Wait until the messages sent so far were acknowledged by the peer's NIC
        (and, with ``pulls``, the large ones pulled), or the connection failed;
        False if ``timeout`` passed first."""
        loop = self.loop
        deadline = None if timeout is None else loop.time() + timeout
        while not self.stopped and ((pulls and self.large.pending) or self.ops.outstanding(OP_MESSAGE)):
            if deadline is not None and loop.time() >= deadline:
                return False
            fut = loop.create_future()
            self.drain_waiters.append(fut)
            try:
                await asyncio.wait_for(fut, None if deadline is None else max(0.0, deadline - loop.time()))
            except TimeoutError:
                return False
            finally:
                if fut in self.drain_waiters:
                    self.drain_waiters.remove(fut)
        return True

    # ---------------------------------------------------------------- end ----
    def fail(self) -> None:
        """The connection failed: nothing more is posted; credit and drain waiters wake."""
        self.stopped = True
        self.wake_credit_waiters()
        self.wake_drain_waiters()

    def close(self, error: BaseException | None) -> None:
        """The queue pair is gone: the send buffers are released, and the
        connection's callbacks let go (they hold the connection, which holds
        this); a sender still waiting raises the connection's ``error``."""
        self.stopped = True
        if self.pool is not None and not self._left:
            self._left = True
            self.pool.leave()
        self._check_usable = raiser(error)


def _recv_wr(addr: int, size: int, lkey: int, slot: int) -> RecvWR:
    """The receive WR of one slot of the receive pool at ``addr`` (its wr_id tags
    the slot). Built 16 times per connection at set-up: no bounds checks, a slot
    lies inside its pool."""
    return RecvWR(RECV_TAG | slot, [SGE(addr + slot * size, size, lkey)])


def _not_emitted(_: ConnectionEvent) -> bool:
    return False


def _ignore(_: Any) -> None:
    pass


class Inbound:
    """The receive half of a connection's messages (see the module's docstring).

    Without ``shared``, registers ``recv_buffers`` receive buffers of
    ``recv_buffer_size`` bytes in ``pd`` and posts them on ``qp`` (in INIT or
    later); with ``shared`` (a :class:`~aiordma.pools.ReceivePool`, whose SRQ
    ``qp`` was created with) the buffers are the device's and a receive
    completion's buffer goes back to the SRQ. :attr:`table` says where each
    buffer is (``table_cls``: the core's :class:`~aiordma.memory.BufferTable`).
    Complete messages go to ``messages``, immediates to ``immediates`` unless
    ``emit(event)`` (the event handler) consumed them; a control message's
    bytes go to ``control(data)``; a failed receive completion, which means
    the queue pair failed under the connection, to ``qp_failed(wc)``."""

    def __init__(
        self,
        pd: ProtectionDomain,
        qp: QueuePair,
        window: MessageWindow,
        outbox: Outbox,
        large: large_messages.LargeMessages,
        *,
        recv_buffers: int,
        recv_buffer_size: int,
        messages: Inbox,
        immediates: Inbox,
        control: Callable[[bytes], None],
        emit: Callable[[ConnectionEvent], bool],
        qp_failed: Callable[[WorkCompletion], None],
        table_cls: Any = BufferTable,
        shared: ReceivePool | None = None,
    ) -> None:
        self.qp = qp
        self.window = window
        self.outbox = outbox
        self.large = large
        self.messages = messages
        self.immediates = immediates
        self._control = control
        self._emit = emit
        self._qp_failed = qp_failed
        #: why the connection ended (set by :meth:`fail`), and whether it is torn down
        self.error: BaseException | None = None
        self.closed = False
        #: the device's shared receive queue and its buffers (None: this connection's own)
        self.shared = shared
        #: the SRQ the buffers are reposted to (None: the QP's own receive queue)
        self.srq = shared.srq if shared is not None else None
        self.pool: BufferPool | None = None
        if shared is not None:
            self.table = shared.table
            self.wrs = shared.wrs
            self.views = shared.views
            return
        self.pool = BufferPool(Region(pd.reg_mr(recv_buffers * recv_buffer_size, Access.LOCAL_WRITE)), recv_buffer_size)
        # one receive WR per slot, built when the slot is first reposted and then
        # reposted as it is (providers read posted WRs, never modify them)
        region = self.pool.region
        self.table = table_cls(recv_buffer_size)
        self.table.add(region.addr, region.lkey, recv_buffers)
        make_recv_wr = functools.partial(_recv_wr, region.addr, recv_buffer_size, region.lkey)
        self.wrs = SlotTable(make_recv_wr)
        self.views = SlotTable(self.pool.view)
        qp.post_recv([make_recv_wr(i) for i in range(recv_buffers)])

    @property
    def registered_bytes(self) -> int:
        """What this connection registered for receiving (0 with a shared receive queue)."""
        return self.pool.region.length if self.pool is not None else 0

    # --------------------------------------------------- from the device ----
    def on_recv(self, wc: WorkCompletion, slot: int) -> None:
        """The receive completion of buffer ``slot``."""
        if wc.status != _WC_SUCCESS:
            if self.shared is not None:
                # the SRQ's buffer this QP had taken for a message in progress: it is
                # free, and the device's other connections still need it
                self.shared.repost(slot)
            if self.error is None:
                # our own close/abort fails the connection before it flushes the QP,
                # so a flushed receive here means the QP went to IBV_QPS_ERR under us:
                # on the responder side (a request it refused, e.g. a forged or bad
                # rkey) nothing else tells the application
                self._qp_failed(wc)
            return
        nbytes = wc.byte_len
        imm = wc.imm_data or 0
        window = self.window
        if wc.opcode == _WC_RECV_RDMA_WITH_IMM:
            self.repost(slot)
            window.owed += 1
            event = ImmediateReceived(imm, nbytes)  # one object, for the handler or for recv_immediate()
            if not self._emit(event):
                self.immediates.put(event)
            if window.owed >= window.threshold:
                self.outbox.return_credits()
            return
        data = bytes(self.views[slot][:nbytes]) if nbytes else b""
        self.repost(slot)
        before = window.credits
        kind, item = window.on_chunk(imm, data)
        if window.credits != before and self.outbox.credit_waiters:
            self.outbox.wake_credit_waiters()
        if kind == K_LAST:
            _received(1, nbytes, 1)
            self.messages.put(item)
        elif kind == K_CONTROL:
            self._control(item)
        elif kind == K_MORE:
            _received(0, nbytes, 1)
        if window.owed >= window.threshold:  # what Outbox.return_credits() checks first
            self.outbox.return_credits()

    def deliver_control(self, data: bytes) -> None:
        """A control message's bytes arrived (the compiled core's receive path,
        :class:`aiordma._core.FastPath`, hands them here)."""
        self._control(data)

    def repost(self, slot: int) -> None:
        if self.shared is not None:
            self.shared.repost(slot)  # (the device's: whatever becomes of this connection)
            return
        if self.closed or self.error is not None:  # (no ibv_query_qp per message)
            return
        try:
            self.qp.post_recv(self.wrs[slot])
        except RDMAError as e:
            log.debug("repost failed: %s", e)

    # ------------------------------------------------- to the application ----
    def _check_usable(self) -> None:
        if self.error is not None:
            raise fresh(self.error)
        if self.closed:
            raise ConnectionClosedError("the connection is closed")

    async def recv(self) -> bytes:
        """The next message (see :meth:`aiordma.Connection.recv`)."""
        inbox = self.messages
        if inbox.items:
            item = inbox.items.popleft()
        else:
            if self.error is not None or self.closed:
                self._check_usable()
            item = await inbox.get()
        if type(item) is bytes:
            n = len(item)
        elif type(item) is list:
            n = sum(len(p) for p in item)
            item = b"".join(item)
        elif type(item) is large_messages.LargeMessage:
            return bytes(await self.large.pull(item))
        else:
            inbox.put_back(item)  # every later recv() fails the same way
            raise fresh(item)
        window = self.window
        window.consumed(n)
        if window.owed >= window.threshold:
            self.outbox.return_credits()
        return item

    async def recv_into(self, buffer: Any) -> int:
        """The next message into ``buffer`` (see :meth:`aiordma.Connection.recv_into`)."""
        if isinstance(buffer, _LOCAL):
            dest_len = buffer.length
            view = buffer.view
        else:
            try:
                view = memoryview(buffer).cast("B")
            except TypeError:
                raise TypeError(
                    "recv_into needs registered memory (Region) or a writable buffer "
                    f"(bytearray, writable memoryview, numpy array), not {type(buffer).__name__}"
                ) from None
            if view.readonly:
                raise TypeError(f"recv_into needs a writable buffer: this {type(buffer).__name__} is read-only")
            dest_len = view.nbytes
        inbox = self.messages
        if inbox.items:
            item = inbox.items.popleft()
        else:
            if self.error is not None or self.closed:
                self._check_usable()
            item = await inbox.get()
        if type(item) is bytes or type(item) is list:
            parts: list[bytes] = [item] if isinstance(item, bytes) else item
            n = sum(len(p) for p in parts)
            if n > dest_len:
                inbox.items.appendleft(item)
                raise ValueError(f"a message of {n} bytes does not fit the {dest_len}-byte buffer (it stays queued)")
            off = 0
            for p in parts:
                view[off : off + len(p)] = p
                off += len(p)
            window = self.window
            window.consumed(n)
            if window.owed >= window.threshold:
                self.outbox.return_credits()
            return n
        if type(item) is large_messages.LargeMessage:
            n = item.nbytes
            if n > dest_len:
                inbox.items.appendleft(item)
                raise ValueError(f"a message of {n} bytes does not fit the {dest_len}-byte buffer (it stays queued)")
            await self.large.pull(item, buffer)
            return n
        inbox.put_back(item)
        raise fresh(item)

    async def recv_immediate(self) -> ImmediateReceived:
        """The next Write-with-immediate notification."""
        inbox = self.immediates
        if inbox.items:
            item = inbox.items.popleft()
        else:
            self._check_usable()
            item = await inbox.get()
        if isinstance(item, BaseException):
            inbox.put_back(item)
            raise fresh(item)
        immediate: ImmediateReceived = item
        return immediate

    def queued_large_messages(self) -> int:
        return sum(1 for i in self.messages.items if type(i) is large_messages.LargeMessage)

    # ---------------------------------------------------------------- end ----
    def fail(self, exc: BaseException) -> None:
        """The connection ended with ``exc``: receives return what arrived before, then raise it."""
        self.error = exc
        self.messages.put(exc)
        self.immediates.put(exc)

    def close(self) -> None:
        """The queue pair is gone: the receive buffers are released, and the
        connection's callbacks let go (they hold the connection, which holds this)."""
        self.closed = True
        if self.pool is not None:
            self.pool.close()
        if self.shared is not None:
            self.shared.leave()
        self._control = _ignore
        self._emit = _not_emitted
        self._qp_failed = _ignore
