"""Descriptor-list transfers: thousands of scattered Reads or Writes as one handle.

A KV-cache page table, a set of tensor shards, the chunks of an array: many
pieces of one registered local region moved to or from many places of one peer's
remote buffer. :meth:`Connection.prepare_transfer
<aiordma.Connection.prepare_transfer>` checks such a list once
(:mod:`aiordma.descriptors` holds the rules) and converts it to the engine's form,
addresses and lengths; :meth:`PreparedTransfer.start` posts it, whole or a subset
by index, as often as wanted, and returns a :class:`Transfer`: a handle that is
awaited, or polled (:meth:`Transfer.done`) while other transfers are in flight.

How it moves: the list is cut into chunks of at most half the send queue. Each
chunk's work requests are built and posted in C (the compiled core; the
interpreted one builds them in Python, the reference) as one linked list with one
doorbell, and only the chunk's last request is signaled: an RC queue pair runs
its send queue in order, so that one completion says the whole chunk moved
(selective signaling). Two chunks are in flight at once; as one completes, its
slots carry the next. So there is no Python object per descriptor, and the
send queue stays full whatever the list's length.

A failure: an RC queue pair stops at its first failed request and flushes the
rest, so the transfer knows exactly which descriptors moved. It raises
:class:`~aiordma.errors.TransferError` naming the first failed descriptor's index
and how many, in posting order, completed (the error of the work completion is
its cause), once every posted request has come back: the memory of a failed
transfer is untouched by the NIC when the error is raised. Cancelling (the handle,
or the task awaiting it) stops posting; the chunks already posted complete, and
:meth:`Transfer.settled` waits for them before the memory may be reused.
"""

from __future__ import annotations

import asyncio
import collections
import weakref
from collections.abc import Callable, Generator
from typing import Any, Literal

from . import descriptors
from .errors import (
    ConnectionClosedError,
    InvalidWorkRequestError,
    TransferAbortedError,
    TransferError,
    WorkCompletionError,
    fresh,
)
from .memory import Region, RegionSlice, RemoteBuffer
from .ops import consume_exception
from .providers.base import Access, WROpcode

__all__ = ["PreparedTransfer", "Transfer", "TransferPath"]

#: the verb of each kind of transfer
OPCODES = {"read": int(WROpcode.IBV_WR_RDMA_READ), "write": int(WROpcode.IBV_WR_RDMA_WRITE)}
_NAMES = {"read": "RDMA_READ", "write": "RDMA_WRITE"}
#: chunks of one transfer in flight at once (one completing while the next runs)
CHUNKS_IN_FLIGHT = 2


class TransferPath:
    """A connection's transfers: what posting them needs, and those in flight (made by
    :class:`~aiordma.Connection`; see the module's docstring)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fast: Any,
        sq: Any,
        check_usable: Callable[[], None],
        prepare: Callable[..., tuple[Any, int]],
        prepare_indices: Callable[[memoryview, int], Any],
    ) -> None:
        self.loop = loop
        self.fast = fast
        self.sq = sq
        self.check_usable = check_usable
        self.prepare_table = prepare
        self.prepare_indices = prepare_indices
        #: at most half the send queue per chunk: two chunks keep it full
        self.chunk = max(1, sq.depth // CHUNKS_IN_FLIGHT)
        self.live: weakref.WeakSet[Transfer] = weakref.WeakSet()
        self.error: BaseException | None = None

    def prepare(
        self, op: Literal["read", "write"], local: Region | RegionSlice, remote: RemoteBuffer, table: Any
    ) -> PreparedTransfer:
        if op not in OPCODES:
            raise ValueError(f"a transfer is 'read' or 'write', not {op!r}")
        if type(local) is Region:
            base, length, lkey, region = local.addr, local.length, local.lkey, local
        elif type(local) is RegionSlice:
            region = local.region
            base, length, lkey = region.addr + local.offset, local.length, region.lkey
        else:
            raise TypeError(
                f"a transfer's local side is registered memory (Region or a slice of one), not {type(local).__name__}"
            )
        if not isinstance(remote, RemoteBuffer):
            raise TypeError(f"a transfer's remote side is a RemoteBuffer, not {type(remote).__name__}")
        if op == "read" and not (region.access & Access.LOCAL_WRITE):
            raise InvalidWorkRequestError(
                "an RDMA Read lands in local memory registered with LOCAL_WRITE; this region was registered without it"
            )
        flat = descriptors.as_table(table)
        addresses, total = self.prepare_table(flat, base, length, remote.addr, remote.length, op == "read")
        return PreparedTransfer(self, op, local, remote, addresses, len(flat) // 3, total, lkey)

    def close(self, error: BaseException | None) -> None:
        """The connection is torn down: every transfer still waiting fails."""
        self.error = error if error is not None else ConnectionClosedError("the connection is closed")
        for transfer in list(self.live):
            transfer._abandon(self.error)


class PreparedTransfer:
    """A descriptor list checked against its local region and remote buffer, in the
    engine's form: start it (:meth:`start`) as often as wanted.

    ``op`` is ``"read"`` (from the peer's memory into the local region) or
    ``"write"``; ``count`` descriptors move ``nbytes`` bytes in all."""

    __slots__ = ("_addresses", "_lkey", "_path", "count", "local", "nbytes", "op", "remote")

    def __init__(
        self,
        path: TransferPath,
        op: Literal["read", "write"],
        local: Region | RegionSlice,
        remote: RemoteBuffer,
        addresses: Any,
        count: int,
        nbytes: int,
        lkey: int,
    ) -> None:
        self._path = path
        self.op = op
        self.local = local
        self.remote = remote
        self._addresses = addresses
        self.count = count
        self.nbytes = nbytes
        self._lkey = lkey

    def __len__(self) -> int:
        return self.count

    def start(self, indices: Any = None) -> Transfer:
        """Post the list (or the descriptors at ``indices``, in that order: a NumPy
        array or a sequence of ints) and return its :class:`Transfer`. The first
        chunk is on the send queue when this returns, where slots are free."""
        path = self._path
        path.check_usable()
        order = None
        if indices is not None:
            order = path.prepare_indices(descriptors.as_indices(indices), self.count)
        return Transfer(self, order)

    def __repr__(self) -> str:
        return f"<PreparedTransfer {self.op} of {self.count} descriptors, {self.nbytes} bytes>"


class Transfer:
    """One transfer of a descriptor list in flight: awaitable, and pollable.

    ``await transfer`` returns None when every descriptor moved, or raises
    :class:`~aiordma.errors.TransferError` (:class:`~aiordma.errors.TransferAbortedError`
    when the connection failed). :meth:`done`, :meth:`exception` and
    :attr:`completed` look without waiting; :meth:`cancel` stops it."""

    def __init__(self, prepared: PreparedTransfer, order: Any) -> None:
        path = prepared._path
        self._prepared = prepared
        self._path = path
        self._order = order
        #: descriptors this transfer moves
        self.count = len(order) if order is not None else prepared.count
        self._future: asyncio.Future[None] = path.loop.create_future()
        self._future.add_done_callback(self._on_outcome)
        self._posted = 0
        self._completed = 0
        #: (chunk future, first position, length, its wr_ids) in posting order
        self._chunks: collections.deque[tuple[asyncio.Future[Any], int, int, Any]] = collections.deque()
        self._failure: TransferError | None = None
        self._stopped = False
        self._abandoned: BaseException | None = None
        self._waiting_for_slots = False
        self._settled: asyncio.Future[None] | None = None
        path.live.add(self)
        if self.count == 0:
            self._finish()
        else:
            self._pump()

    # --------------------------------------------------------- the handle ----
    @property
    def completed(self) -> int:
        """Descriptors known complete so far, counted in posting order (a chunk at a time)."""
        return self._completed

    @property
    def in_flight(self) -> int:
        """Descriptors posted whose chunk has not come back yet."""
        return sum(k for _, _, k, _ in self._chunks)

    def done(self) -> bool:
        """Whether the transfer has an outcome (moved, failed or cancelled)."""
        return self._future.done()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def exception(self) -> BaseException | None:
        """The transfer's error, or None (raises InvalidStateError while it runs)."""
        return self._future.exception()

    def result(self) -> None:
        """None when it moved every descriptor; else raises its error."""
        return self._future.result()

    def cancel(self) -> bool:
        """Stop posting. The chunks already posted still run to completion (their
        memory is in use until :meth:`settled`); awaiting raises CancelledError."""
        return self._future.cancel()

    def add_done_callback(self, fn: Callable[[Transfer], Any]) -> None:
        self._future.add_done_callback(lambda _: fn(self))

    def __await__(self) -> Generator[Any, None, None]:
        return self._future.__await__()

    async def settled(self) -> None:
        """Wait until nothing of this transfer is on the send queue any more (after
        a cancel, before the memory is reused); returns at once when nothing is."""
        if not self._chunks:
            return
        if self._settled is None:
            self._settled = self._path.loop.create_future()
        await asyncio.shield(self._settled)

    def __repr__(self) -> str:
        state = "done" if self.done() else f"{self._completed}/{self.count} complete"
        return f"<Transfer {self._prepared.op} of {self.count} descriptors: {state}>"

    # ------------------------------------------------------------ driving ----
    def _pump(self) -> None:
        """Post chunks while slots are free and fewer than CHUNKS_IN_FLIGHT are out."""
        path = self._path
        sq = path.sq
        prepared = self._prepared
        opcode = OPCODES[prepared.op]
        while self._posted < self.count and len(self._chunks) < CHUNKS_IN_FLIGHT and not self._stopped:
            k = min(path.chunk, self.count - self._posted)
            if not (sq.free >= k and not sq.waiters):
                if not self._chunks:
                    self._wait_for_slots(k)
                return  # (else: a chunk of ours completing frees slots)
            try:
                path.check_usable()
            except BaseException as e:
                self._fail_posting(e)
                return
            sq.free -= k
            start = self._posted
            chunk: asyncio.Future[Any] = path.loop.create_future()
            describe = f"{_NAMES[prepared.op]}s {start}..{start + k - 1} of a transfer of {self.count}"
            try:
                wr_ids = path.fast.post_descriptors(
                    opcode,
                    prepared._addresses,
                    self._order,
                    start,
                    k,
                    prepared._lkey,
                    prepared.remote.rkey,
                    chunk,
                    describe,
                )
            except BaseException as e:  # nothing of this chunk was posted; its slots are back
                self._fail_posting(e)
                return
            self._posted += k
            self._chunks.append((chunk, start, k, wr_ids))
            chunk.add_done_callback(self._on_chunk)

    def _wait_for_slots(self, k: int) -> None:
        if self._waiting_for_slots:
            return
        self._waiting_for_slots = True

        async def acquire() -> None:
            try:
                await self._path.sq.acquire(k)
            except BaseException as e:
                self._waiting_for_slots = False
                self._fail_posting(e)
                return
            self._waiting_for_slots = False
            self._path.sq.release(k)  # (handed to _pump, which takes them now: nothing runs between)
            self._pump()

        self._path.loop.create_task(acquire())

    def _on_chunk(self, chunk: asyncio.Future[Any]) -> None:
        # chunks complete in posting order (one RC send queue), so this is the oldest
        if chunk.cancelled() or chunk not in (c[0] for c in self._chunks):
            return
        while self._chunks and self._chunks[0][0].done():
            fut, start, k, wr_ids = self._chunks.popleft()
            exc = fut.exception()
            if exc is None:  # (an RC queue pair runs nothing after a failed request)
                self._completed = start + k
                continue
            self._record(self._failure_from(exc, start, k, wr_ids))
        if self._failure is None and self._completed == self.count:
            self._finish()
            return
        if self._failure is None and not self._stopped:
            self._pump()
        if not self._chunks:
            if self._failure is None and self._abandoned is not None:
                self._record(self._error(self._abandoned, self._posted))
            self._all_back()

    def _failure_from(self, exc: BaseException, start: int, k: int, wr_ids: Any) -> TransferError:
        position = start
        wc = exc.wc if isinstance(exc, WorkCompletionError) else None
        if wc is not None:
            try:
                position = start + list(wr_ids).index(wc.wr_id)
            except ValueError:
                pass
        return self._error(exc, position)

    def _error(self, exc: BaseException, position: int) -> TransferError:
        index = int(self._order[position]) if self._order is not None and position < self.count else position
        cls = TransferAbortedError if isinstance(exc, ConnectionError) else TransferError
        err = cls(
            f"{self._prepared.op} transfer failed at descriptor {index} (position {position} of {self.count}; "
            f"the {position} before it completed): {exc}",
            index,
            position,
            exc,
        )
        err.__cause__ = exc
        return err

    def _record(self, failure: TransferError) -> None:
        """Keep the failure at the earliest position (a posting refused after a chunk
        already posted failed, or the other way round)."""
        self._stopped = True
        if self._failure is None or failure.completed < self._failure.completed:
            self._failure = failure

    def _fail_posting(self, exc: BaseException) -> None:
        """Posting failed (nothing of that chunk is on the send queue)."""
        self._record(self._error(exc, self._posted))
        if not self._chunks:
            self._all_back()

    def _abandon(self, error: BaseException) -> None:
        """The connection is gone: chunks that never came back will not (their
        failure, or the first position not posted, is where the transfer stopped)."""
        self._abandoned = error
        self._stopped = True
        if not self._chunks:
            self._record(self._error(error, self._posted))
            self._all_back()
        for fut, _, _, _ in self._chunks:
            if not fut.done():
                fut.set_exception(fresh(error))
                fut.add_done_callback(consume_exception)

    def _finish(self) -> None:
        self._path.live.discard(self)
        if not self._future.done():
            self._future.set_result(None)
        self._all_back()

    def _all_back(self) -> None:
        """Nothing of the transfer is in flight any more: its outcome can be given."""
        self._path.live.discard(self)
        if self._failure is not None and not self._future.done():
            failure, self._failure = self._failure, None
            self._future.set_exception(failure)
        if self._settled is not None and not self._settled.done():
            self._settled.set_result(None)

    def _on_outcome(self, fut: asyncio.Future[None]) -> None:
        if fut.cancelled():
            self._stopped = True
            if not self._chunks:
                self._all_back()
