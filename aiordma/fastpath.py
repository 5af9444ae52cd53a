"""A connection's per-operation paths, interpreted: the reference and the fallback.

:class:`FastPath` posts the operations a connection does most — an RDMA Write
from, or Read into, registered memory, and a message that fits one chunk —
before the caller yields, when everything they need is free now; each method
returns None (or False) where the general path must run instead (a slot to wait
for, a message queued before, a buffer to register).

Its compiled twin, :class:`aiordma._core.FastPath`, does the same with C fields
and, where the provider drives its queue pairs from C, also finishes the
successful completions itself (:meth:`drain`); :mod:`aiordma.core` says which one
a connection gets. Both are tested against each other through the public API.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .memory import Region, RegionSlice, RemoteBuffer
from .messages import Inbound, Outbox
from .ops import Op, OperationTracker, SendQueue
from .pools import SendPool
from .providers.base import SGE, CompletionQueue, QueuePair, SendFlags, SendWR, WorkCompletion, WROpcode
from .window import IMM_LAST, MessageWindow

_RDMA_READ = WROpcode.IBV_WR_RDMA_READ
_SEND_WITH_IMM = WROpcode.IBV_WR_SEND_WITH_IMM


class FastPath:
    """The per-operation paths of one connection (see the module's docstring)."""

    #: this implementation never posts through the provider's C verbs nor drains a CQ itself
    posts_in_c = False
    can_drain = False

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        ops: OperationTracker,
        sq: SendQueue,
        window: MessageWindow,
        qp: QueuePair,
        cq: CompletionQueue,
        on_completion: Callable[[WorkCompletion], None],
        expect: Callable[[], None],
    ) -> None:
        self.loop = loop
        self.ops = ops
        self.sq = sq
        self.window = window
        #: the connection accepts operations (not failed, closing or closed)
        self.usable = True
        #: completions are held back (a remote error waits for the peer's reason)
        self.hold = False
        self.fast_completions = 0
        self.slow_completions = 0
        self._outbox: Outbox | None = None
        self._pool: SendPool | None = None

    def bind_outbox(self, outbox: Outbox) -> None:
        """The send side is connected (``Outbox.start`` registered the send buffers)."""
        self._outbox = outbox
        self._pool = outbox.pool

    def bind_inbound(self, inbound: Inbound) -> None:
        """The receive side (its completions stay with the connection's handler here)."""

    def bind_scratch(self, pool: Any) -> None:
        """The atomics' result buffers (the general path, Requester.atomic, uses them here)."""

    def close(self) -> None:
        self.usable = False
        self._outbox = None
        self._pool = None

    def drain(self) -> int:
        """Nothing: the completion dispatcher polls, and the connection handles every completion."""
        return 0

    def completed(self, wc: WorkCompletion) -> bool:
        """False: the connection's completion handler takes every completion here."""
        return False

    def one_sided(
        self, opcode: WROpcode, mem: Any, remote: RemoteBuffer, awaited: bool
    ) -> asyncio.Future[WorkCompletion] | None:
        """An RDMA Write from, or Read into, registered memory ``mem``, posted before
        any suspension when a send-queue slot is free and nobody queues for one.
        Returns its future (its result is the work completion), or None when the
        general path must run. (``awaited``: whether the caller only awaits it; the
        compiled core gives such a caller a future of its own.)"""
        sq = self.sq
        mem_type = type(mem)
        if not ((mem_type is RegionSlice or mem_type is Region) and sq.free > 0 and not sq.waiters and self.usable):
            return None
        if opcode is _RDMA_READ:
            n = remote.length
            if mem.length < n:
                raise ValueError(f"read of {n} bytes does not fit the {mem.length}-byte destination")
            describe = lambda: f"RDMA_READ of {n} bytes from {remote!r}"
        else:
            n = mem.length
            if n > remote.length:
                raise ValueError(f"write of {n} bytes does not fit the remote buffer of {remote.length} bytes")
            describe = lambda: f"RDMA_WRITE of {n} bytes to {remote!r}"
        if mem_type is Region:
            mr = mem.mr
            sges = [SGE(mr.addr, n, mr.lkey)] if n else []
        else:
            mr = mem.region.mr
            sges = [SGE(mr.addr + mem.offset, n, mr.lkey)] if n else []
        sq.free -= 1
        fut = self.loop.create_future()
        self.ops.post(
            SendWR(0, opcode, sges, remote_addr=remote.addr, rkey=remote.rkey), Op(fut, None, describe, opcode)
        )
        return fut

    def send_small(self, data: Any, wait_ack: bool) -> asyncio.Future[WorkCompletion] | bool:
        """A message (``bytes`` or a byte memoryview) that fits one chunk, posted at
        once when a credit, a send buffer and a send-queue slot are free and no
        message queues before it. Returns False when the general path must run;
        else the future of its acknowledgement (``wait_ack``) or True."""
        outbox = self._outbox
        pool = self._pool
        if outbox is None or pool is None or not self.usable:
            return False
        if type(data) is bytes:
            n = len(data)
        elif type(data) is memoryview and data.format == "B" and data.ndim == 1:
            n = data.nbytes
        else:
            return False  # (the caller makes it a byte view first)
        window = self.window
        sq = self.sq
        # (window.can_send_chunk() and window.spend(), inlined on the per-message path)
        if not (
            n <= window.chunk_size
            and window.credits >= 2
            and sq.free > 0
            and not outbox.busy
            and not sq.waiters
            and outbox.tail is None
            and pool.free
            and not pool.waiters
        ):
            return False
        slot = pool.free.pop()
        # fast path: one chunk and everything it needs is free now, so it is posted
        # before the caller yields (atomic w.r.t. other messages; the completion
        # releases the slot, so cancelling the caller's await is safe)
        window.credits -= 1
        sq.free -= 1
        if n:
            pool.view(slot)[:n] = data
            sges = [pool.sge(slot, n)]
        else:
            sges = []
        wr = SendWR(0, _SEND_WITH_IMM, sges, imm_data=IMM_LAST | window.take_owed())
        op = outbox.slot_ops[slot]  # the slot's reusable op: its release frees the slot
        op.nbytes = n
        fut = op.fut = self.loop.create_future() if wait_ack else None
        self.ops.post(wr, op)
        return fut if fut is not None else True

    def recv_message(self) -> bytes | None:
        """None: messages are received by the general path here (:meth:`aiordma.messages.Inbound.recv`)."""
        return None

    def recv_waiter(self) -> asyncio.Future[None] | None:
        """None: the general path waits (:meth:`aiordma.messages.Inbound.recv`)."""
        return None

    def recv_cancelled(self, waiter: asyncio.Future[None]) -> None:
        """(never called: :meth:`recv_waiter` hands out no waiter)"""

    def atomic(self, opcode: WROpcode, remote: RemoteBuffer, compare_add: int, swap: int) -> asyncio.Future[int] | None:
        """None: atomics take the general path here (:meth:`aiordma.work_requests.Requester.atomic`)."""
        return None

    def post_descriptors(
        self,
        opcode: int,
        table: Any,
        order: Any,
        start: int,
        k: int,
        lkey: int,
        rkey: int,
        fut: asyncio.Future[Any],
        describe: str,
    ) -> list[int]:
        """Post the descriptors at positions ``start .. start + k - 1`` of a prepared
        transfer as one chain, only the last signaled (see the compiled twin; here a
        SendWR per descriptor: the reference). ``k`` slots must be held. Returns the
        chain's wr_ids in posting order."""
        if k <= 0:
            raise ValueError("a chain of no work requests")
        wrs = []
        for j in range(start, start + k):
            d = order[j] if order is not None else j
            wrs.append(
                SendWR(
                    0,
                    WROpcode(opcode),
                    [SGE(table[3 * d], table[3 * d + 2], lkey)],
                    remote_addr=table[3 * d + 1],
                    rkey=rkey,
                    send_flags=SendFlags.IBV_SEND_SIGNALED if j == start + k - 1 else SendFlags(0),
                )
            )
        self.ops.post_chain(wrs, Op(fut, None, describe, opcode))
        return [wr.wr_id for wr in wrs]

    def batch(self, opcode: WROpcode, pairs: Any) -> asyncio.Future[None] | None:
        """None: batches take the general path here (:meth:`aiordma.work_requests.Requester.post_chain`)."""
        return None
