"""Operations in flight on one queue pair: send-queue slots and pending work requests.

A queue pair's send queue has a fixed depth: a work request may be posted
only into a free slot, and the slot is free again when the request's
completion (CQE) has been reaped. :class:`SendQueue` hands out slots to
waiting coroutines in order; :class:`OperationTracker` remembers what each
posted work request (``wr_id``) was for, so that its completion resolves the
right future and releases the right buffers.

Cancel safety: a buffer used by a work request is released by the request's
completion, never by the coroutine that awaited it, so cancelling that
coroutine cannot let the buffer be reused while the device may still read
or write it (the rule async-rdma follows too).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from . import metrics
from .errors import MAY_HAVE_EXECUTED, error_for_status, fresh, may_have_executed
from .providers.base import WC_STATUS_VALUES, QueuePair, SendWR, WCStatus, WorkCompletion, WROpcode
from .rights import access_error_explanation

_WC_SUCCESS = int(WCStatus.IBV_WC_SUCCESS)

#: what an operation is, for drain() and close(): a message chunk or control
#: message (waited for by drain), a credit update (not), anything else
OP_OTHER, OP_MESSAGE, OP_CREDIT = 0, 1, 2

_KIND_OF_OPCODE = metrics.KIND_OF_OPCODE
_stamp = metrics.stamp

#: operations that change the peer's memory or deliver a message: their error says when they may have run
NOT_IDEMPOTENT = frozenset(int(op) for op in WROpcode if op != WROpcode.IBV_WR_RDMA_READ)
#: completion statuses the responder caused: the peer knows the precise reason
REMOTE_STATUSES = frozenset(
    int(s) for s in (WCStatus.IBV_WC_REM_ACCESS_ERR, WCStatus.IBV_WC_REM_INV_REQ_ERR, WCStatus.IBV_WC_REM_OP_ERR)
)

# (IBV_WC_REM_ACCESS_ERR: aiordma.rights.access_error_explanation names the missing right)
_EXPLAIN = {
    WCStatus.IBV_WC_REM_INV_REQ_ERR: "the peer's NIC found the request invalid (too long for the posted receive, "
    "misaligned atomic, or not allowed)",
    WCStatus.IBV_WC_RETRY_EXC_ERR: "no acknowledgement after timeout x retry_cnt: the peer is gone or unreachable",
    WCStatus.IBV_WC_RNR_RETRY_EXC_ERR: "the peer had no receive posted (RNR) too many times",
    WCStatus.IBV_WC_WR_FLUSH_ERR: "the queue pair went to the error state before this request ran",
    WCStatus.IBV_WC_LOC_PROT_ERR: "a local SGE is not inside a registered region (lkey/bounds)",
    WCStatus.IBV_WC_LOC_LEN_ERR: "a message did not fit the posted receive buffer",
}


def completion_error(
    op: Op,
    wc: WorkCompletion,
    connection_error: BaseException | None,
    peer_reason: str | None,
    local_reason: str | None = None,
) -> BaseException:
    """The error a failed work completion ``wc`` means for ``op``.

    A flush (``IBV_WC_WR_FLUSH_ERR``) after the connection failed is that
    failure (``connection_error``); anything else names the status, the
    operation and why, in RDMA's terms: for a remote access error the right
    the peer's exposure lacked, for another refusal the responder's own words
    (``peer_reason``, sent over the rendezvous), else this end's (``local_reason``:
    why its queue pair failed, e.g. a cross-memory READ it could not copy). An operation that changes the
    peer's memory or delivers a message says when it may have executed anyway
    (its request may have arrived though the acknowledgement did not)."""
    status = WCStatus(wc.status) if wc.status in WC_STATUS_VALUES else wc.status
    exc: BaseException
    if status == WCStatus.IBV_WC_WR_FLUSH_ERR and connection_error is not None:
        exc = fresh(connection_error)
        if op.opcode in NOT_IDEMPOTENT:
            may_have_executed(exc)
        return exc
    name = getattr(status, "name", str(status))
    explain = _EXPLAIN.get(status, "failed")
    if status == WCStatus.IBV_WC_REM_ACCESS_ERR:
        explain = access_error_explanation(op.opcode, peer_reason)  # names the right it lacked
    elif int(status) in REMOTE_STATUSES and peer_reason is not None:
        explain = f"the peer's NIC refused it: {peer_reason}"
    elif explain == "failed" and local_reason:
        explain = local_reason.removeprefix(f"{name}: ")
    if status == WCStatus.IBV_WC_RETRY_EXC_ERR and op.opcode in NOT_IDEMPOTENT:
        explain += "; " + MAY_HAVE_EXECUTED
    err = error_for_status(wc.status)(f"{name}: {op.description()}: {explain}", wc)
    if status in (WCStatus.IBV_WC_RETRY_EXC_ERR, WCStatus.IBV_WC_WR_FLUSH_ERR) and op.opcode in NOT_IDEMPOTENT:
        err.may_have_executed = True
    return err


class WaitQueue(collections.deque[tuple[int, "asyncio.Future[Any]"]]):
    """A FIFO of coroutines waiting for ``n`` units of something.

    Units are handed over: the owner takes them from its pool for the first
    waiter and then resolves its future (:meth:`resolve_first`), so a waiter
    that wakes up owns them. A waiter cancelled after it was handed its
    units gives them back (which hands them to the next waiter), and one
    cancelled before leaves the queue and lets the next look: no wake-up is
    ever lost, which is the classic bug of "set a future, let the woken task
    take the unit". (A deque itself, so that "is anybody waiting?" on the
    per-message path is a C-level truth test.)
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__()
        self.loop = loop

    async def wait(self, n: int, give_back: Callable[[Any], None], on_leave: Callable[[], None]) -> Any:
        """Queue for ``n`` units; returns what :meth:`resolve_first` passed. On
        cancellation, ``give_back(value)`` returns units already handed over,
        or ``on_leave()`` lets the next waiter look."""
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = self.loop.create_future()
        entry = (n, fut)
        self.append(entry)
        try:
            return await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                give_back(fut.result())
            else:
                try:
                    self.remove(entry)
                except ValueError:
                    pass
                on_leave()
            raise

    def first_need(self) -> int | None:
        """How many units the first live waiter needs (None: nobody waits)."""
        while self:
            n, fut = self[0]
            if not fut.done():
                return n
            self.popleft()
        return None

    def resolve_first(self, value: Any) -> None:
        """Hand ``value`` to the first live waiter (``first_need`` said it may have it)."""
        _, fut = self.popleft()
        fut.set_result(value)

    def fail_all(self, exc: BaseException) -> None:
        waiting = list(self)
        self.clear()
        for _, fut in waiting:
            if not fut.done():
                fut.set_exception(fresh(exc))
                fut.add_done_callback(consume_exception)


class SendQueue:
    """The free slots of a queue pair's send queue (``max_send_wr``)."""

    __slots__ = ("_failed", "depth", "free", "waiters")

    def __init__(self, depth: int, loop: asyncio.AbstractEventLoop) -> None:
        self.depth = depth
        self.free = depth
        self.waiters = WaitQueue(loop)
        self._failed: BaseException | None = None

    async def acquire(self, n: int = 1) -> None:
        """Take ``n`` slots at once (a chain must not hold some and wait for the rest)."""
        if self._failed is not None:
            raise fresh(self._failed)
        if self.free >= n and not self.waiters:
            self.free -= n
            return
        if n > self.depth:
            raise ValueError(f"{n} work requests exceed the send queue depth ({self.depth})")
        await self.waiters.wait(n, lambda _: self.release(n), self._hand_over)

    def release(self, n: int = 1) -> None:
        """``n`` completions were reaped: their slots are free."""
        self.free += n
        if self.waiters:
            self._hand_over()

    def _hand_over(self) -> None:
        waiters = self.waiters
        while True:
            need = waiters.first_need()
            if need is None or self.free < need:
                return
            self.free -= need
            waiters.resolve_first(None)

    def fail(self, exc: BaseException) -> None:
        """The queue pair is gone: every waiter (and every later acquire) raises ``exc``."""
        self._failed = exc
        self.waiters.fail_all(exc)


class Op:
    """One posted work request (or chain), what its completion must do."""

    __slots__ = (
        "describe",
        "fut",
        "kind",
        "members",
        "metric",
        "nbytes",
        "opcode",
        "posted_bytes",
        "posted_ns",
        "release",
    )

    def __init__(
        self,
        fut: asyncio.Future[Any] | None,
        release: Callable[[], None] | None,
        describe: str | Callable[[], str] | None,
        opcode: int,
        kind: int = OP_OTHER,
    ) -> None:
        self.fut = fut
        self.release = release
        self.describe = describe
        self.opcode = opcode
        self.kind = kind
        #: a chain posted with one doorbell: the wr_ids still without a completion
        #: (only the last is signaled; a failure completes every one of them)
        self.members: set[int] | None = None
        #: the message size of a one-chunk send (the per-slot ops of the send fast path)
        self.nbytes = 0
        #: what it counts as in aiordma.metrics (0: nothing), the bytes its work
        #: requests move, and when it was posted (0: not timed); set by the tracker
        self.metric = 0
        self.posted_bytes = 0
        self.posted_ns = 0

    def description(self) -> str:
        d = self.describe
        if d is None:  # a one-chunk send of the fast path
            return f"SEND of a {self.nbytes}-byte message"
        return d() if callable(d) else d


class OperationTracker:
    """The work requests a queue pair has in flight, by ``wr_id``."""

    __slots__ = ("_ids", "_qp", "_sq", "expect", "pending")

    def __init__(self, qp: QueuePair, sq: SendQueue, expect: Callable[[], None]) -> None:
        self._qp = qp
        self._sq = sq
        #: called after each post (the completion dispatcher's poll window)
        self.expect = expect
        self.pending: dict[int, Op] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self.pending)

    def post(self, wr: SendWR, op: Op) -> None:
        """Post ``wr`` as ``op``'s work request (a send-queue slot must be held).
        If the device refuses it, the slot and ``op``'s buffer are given back."""
        wr.wr_id = wr_id = next(self._ids)
        pending = self.pending
        pending[wr_id] = op
        op.metric = metric = 0 if op.kind == OP_CREDIT else _KIND_OF_OPCODE.get(op.opcode, 0)
        if metric:
            op.posted_bytes = wr.length
            op.posted_ns = _stamp()
        try:
            self._qp.post_send(wr)
            self.expect()
        except BaseException:
            pending.pop(wr_id, None)
            op.fut = None
            self._sq.release()
            if op.release is not None:
                op.release()
            raise

    def post_chain(self, wrs: Sequence[SendWR], op: Op) -> None:
        """Post linked work requests with one doorbell; only the last is
        signaled. ``len(wrs)`` send-queue slots must be held."""
        members: set[int] = set()
        for wr in wrs:
            wr.wr_id = next(self._ids)
            members.add(wr.wr_id)
            self.pending[wr.wr_id] = op
        op.members = members
        op.metric = metric = 0 if op.kind == OP_CREDIT else _KIND_OF_OPCODE.get(op.opcode, 0)
        if metric:
            op.posted_bytes = sum(wr.length for wr in wrs)
            op.posted_ns = _stamp()
        try:
            self._qp.post_send(wrs)
            self.expect()
        except BaseException:
            for wr in wrs:
                self.pending.pop(wr.wr_id, None)
            self._sq.release(len(wrs))
            if op.release is not None:
                op.release()
            raise

    def complete(self, wc: WorkCompletion) -> Op | None:
        """A send-queue completion: retire its work request (and, for a chain,
        the members it implies). Returns the op it completes, or None for an
        unknown ``wr_id``. A failed chain whose later members are still to be
        flushed comes back with ``op.members`` non-empty: its caller should
        learn of the failure now, its buffers are released with the last flush."""
        wr_id = wc.wr_id
        pending = self.pending
        op = pending.pop(wr_id, None)
        if op is None:
            return None
        sq = self._sq
        if sq.waiters:
            sq.release()
        else:
            sq.free += 1
        members = op.members
        ok = wc.status == _WC_SUCCESS
        if op.metric:
            if not ok:
                metrics.failed(op.metric, wc.status)
            elif not members:
                metrics.completed(op.metric, 1, op.posted_bytes, op.posted_ns)
            else:  # a chain: its members (this one among them) are done
                metrics.completed(op.metric, len(members), op.posted_bytes, op.posted_ns)
        if members is None:
            return op
        members.discard(wr_id)
        if ok:
            # the signaled last of a chain: every write before it is done
            for m in members:
                if pending.pop(m, None) is not None:
                    sq.release()
            members.clear()
            return op
        # the queue pair ran the chain in order: the members before the one that
        # failed completed (unsignaled, so silently)
        for m in [m for m in members if m < wr_id]:
            members.discard(m)
            if pending.pop(m, None) is not None:
                sq.release()
        return op

    def ops(self) -> list[Op]:
        """The operations in flight, each once (a chain's members share one)."""
        return list({id(op): op for op in self.pending.values()}.values())

    def oldest_posted_ns(self) -> int:
        """When the oldest work request still in flight was posted (time.monotonic_ns),
        or 0: none in flight, or none timed (AIORDMA_METRICS_LATENCY=0)."""
        return min((op.posted_ns for op in self.pending.values() if op.posted_ns), default=0)

    def outstanding(self, kind: int) -> int:
        """How many ops of ``kind`` are in flight (chains count once)."""
        seen: set[int] = set()
        n = 0
        for op in self.pending.values():
            if op.kind == kind and id(op) not in seen:
                seen.add(id(op))
                n += 1
        return n

    def release_all(self) -> None:
        """The queue pair is destroyed: nothing can touch the buffers any more."""
        released: set[int] = set()
        for op in list(self.pending.values()):
            if op.release is not None and id(op) not in released:
                released.add(id(op))
                try:
                    op.release()
                except Exception:  # pragma: no cover
                    pass
        self.pending.clear()


def consume_exception(fut: asyncio.Future[Any]) -> None:
    """A done-callback that marks a future's exception as retrieved."""
    if not fut.cancelled():
        fut.exception()
