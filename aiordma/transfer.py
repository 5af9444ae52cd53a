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
import itertools
import weakref
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Literal

from . import descriptors
from .control import MAX_NOTIFICATION_PAYLOAD, ControlMessages, TransferNotification
from .errors import (
    ConnectionClosedError,
    InvalidWorkRequestError,
    TransferAbortedError,
    TransferError,
    WorkCompletionError,
    fresh,
    raiser,
)
from .memory import Region, RegionSlice, RemoteBuffer
from .ops import consume_exception
from .providers.base import Access, WROpcode

__all__ = [
    "PreparedTransfer",
    "StripedTransfer",
    "Transfer",
    "TransferNotification",
    "TransferPath",
    "striped_transfer",
]

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
        post_control: Callable[[bytes], Awaitable[None]],
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
        #: posts a control message (a Write transfer's notification) in order on the queue pair
        self.post_control = post_control
        #: the ids of this connection's transfers (the peer's notifications carry them)
        self.ids = itertools.count(1)

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
        """The connection is torn down: every transfer still waiting fails, and the
        callbacks that hold the connection are let go (it is freed by reference counting)."""
        self.error = error if error is not None else ConnectionClosedError("the connection is closed")
        self.check_usable = raiser(error)
        self.post_control = _closed_control
        for transfer in list(self.live):
            transfer._abandon(self.error)


async def _closed_control(_: bytes) -> None:
    raise ConnectionClosedError("the connection is closed")


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

    def start(self, indices: Any = None, *, notify: bytes | None = None) -> Transfer:
        """Post the list (or the descriptors at ``indices``, in that order: a NumPy
        array or a sequence of ints) and return its :class:`Transfer`. The first
        chunk is on the send queue when this returns, where slots are free.

        ``notify`` (a Write transfer's, up to 4 KiB, ``b""`` for none): once every
        byte is in the peer's memory the peer gets one
        :class:`~aiordma.control.TransferNotification` with the transfer's
        :attr:`~Transfer.id` and these bytes (:meth:`Connection.recv_notification
        <aiordma.Connection.recv_notification>`); a transfer that fails sends none."""
        path = self._path
        if notify is not None:
            if self.op != "write":
                raise ValueError("only a Write transfer notifies the peer (a Read moves nothing into its memory)")
            notify = bytes(notify)
            if len(notify) > MAX_NOTIFICATION_PAYLOAD:
                raise ValueError(f"a notification carries at most {MAX_NOTIFICATION_PAYLOAD} bytes, not {len(notify)}")
        path.check_usable()
        order = None
        if indices is not None:
            order = path.prepare_indices(descriptors.as_indices(indices), self.count)
        return Transfer(self, order, notify)

    def __repr__(self) -> str:
        return f"<PreparedTransfer {self.op} of {self.count} descriptors, {self.nbytes} bytes>"


class Transfer:
    """One transfer of a descriptor list in flight: awaitable, and pollable.

    ``await transfer`` returns None when every descriptor moved, or raises
    :class:`~aiordma.errors.TransferError` (:class:`~aiordma.errors.TransferAbortedError`
    when the connection failed). :meth:`done`, :meth:`exception` and
    :attr:`completed` look without waiting; :meth:`cancel` stops it."""

    def __init__(self, prepared: PreparedTransfer, order: Any, notify: bytes | None = None) -> None:
        path = prepared._path
        self._prepared = prepared
        self._path = path
        self._order = order
        self._notify = notify
        #: this transfer's id on its connection (what the peer's notification carries)
        self.id = next(path.ids)
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
        if self._notify is not None and not self._future.done():
            # every byte is in the peer's memory (acknowledged): now the notification
            self._path.loop.create_task(self._send_notification(self._notify))
        elif not self._future.done():
            self._future.set_result(None)
        self._all_back()

    async def _send_notification(self, payload: bytes) -> None:
        try:
            await self._path.post_control(ControlMessages.notification_message(self.id, payload))
        except BaseException as e:
            if not self._future.done():
                err = self._error(e, self.count)
                err.args = (f"every descriptor moved, but the peer could not be notified: {e}",)
                self._future.set_exception(err)
            if not isinstance(e, Exception):
                raise
            return
        if not self._future.done():
            self._future.set_result(None)

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


# ------------------------------------------------------------ several rails ----


class StripedTransfer:
    """One descriptor list moved over several rails at once (:func:`striped_transfer`).

    The list is cut into slices of ``slice_size`` descriptors; each rail (a connection to
    the same peer, with the local memory and the peer's buffer as registered for it) takes
    a slice whenever it has fewer than two in flight, so a faster rail (an idle NIC, a
    shorter path) takes more of them, as UCX's multi-rail and Mooncake's spraying do. A
    rail whose slice fails is dropped: the part of its slice that did not move goes back
    to the others, and the transfer fails only when no rail is left. The handle is
    awaitable and pollable like a :class:`Transfer`."""

    def __init__(
        self,
        op: Literal["read", "write"],
        rails: list[tuple[Any, Region | RegionSlice, RemoteBuffer]],
        table: Any,
        slice_size: int,
    ) -> None:
        if not rails:
            raise ValueError("a striped transfer needs at least one rail")
        if slice_size < 1:
            raise ValueError(f"slice_size must be at least 1, not {slice_size}")
        loops = {conn.loop for conn, _, _ in rails}
        if len(loops) != 1:
            raise ValueError("the rails of a striped transfer must run on one event loop")
        # checked and converted once per rail (each has its own lkey and rkey)
        self._prepared = [conn.prepare_transfer(op, local, remote, table) for conn, local, remote in rails]
        self.count = self._prepared[0].count
        self.op = op
        self._slice = slice_size
        self._loop = loops.pop()
        #: descriptors each rail moved (by rail index)
        self.moved_by_rail = [0] * len(rails)
        #: the errors of the rails dropped (by rail index)
        self.rail_errors: dict[int, BaseException] = {}
        self._completed = 0
        self._positions = memoryview(_positions(self.count))
        self._future: asyncio.Future[None] = self._loop.create_future()
        self._task = self._loop.create_task(self._run())

    @property
    def completed(self) -> int:
        """Descriptors known moved so far (over every rail)."""
        return self._completed

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> None:
        return self._future.result()

    def exception(self) -> BaseException | None:
        return self._future.exception()

    def cancel(self) -> bool:
        """Stop handing out slices; those in flight run to completion (see :meth:`settled`)."""
        return self._future.cancel()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def __await__(self) -> Generator[Any, None, None]:
        return self._future.__await__()

    async def settled(self) -> None:
        """Wait until no slice of this transfer is in flight on any rail."""
        await asyncio.shield(self._task)

    async def _run(self) -> None:
        pending: collections.deque[tuple[int, int]] = collections.deque(
            (s, min(s + self._slice, self.count)) for s in range(0, self.count, self._slice)
        )
        alive = set(range(len(self._prepared)))
        busy: dict[asyncio.Future[None], tuple[int, int, int]] = {}  # a slice's -> (rail, first position, end)
        first_error: BaseException | None = None
        while (pending and alive and not self._future.done()) or busy:
            for rail in sorted(alive, key=lambda r: sum(1 for b in busy.values() if b[0] == r)):
                while pending and sum(1 for b in busy.values() if b[0] == rail) < CHUNKS_IN_FLIGHT:
                    if self._future.done():
                        break
                    start, end = pending.popleft()
                    try:
                        t = self._prepared[rail].start(self._positions[start:end])
                    except BaseException as e:
                        pending.appendleft((start, end))
                        self.rail_errors[rail] = e
                        alive.discard(rail)
                        first_error = first_error or e
                        break
                    busy[t._future] = (rail, start, end)
            if not busy:
                break
            done, _ = await asyncio.wait(list(busy), return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                rail, start, end = busy.pop(t)
                exc = None if t.cancelled() else t.exception()
                moved = end - start if exc is None else (exc.completed if isinstance(exc, TransferError) else 0)
                self._completed += moved
                self.moved_by_rail[rail] += moved
                if exc is not None:
                    pending.appendleft((start + moved, end))
                    if rail in alive:
                        alive.discard(rail)
                        self.rail_errors[rail] = exc
                        first_error = first_error or exc
        if self._future.done():
            return
        if self._completed == self.count:
            self._future.set_result(None)
            return
        position = pending[0][0] if pending else self._completed
        err = (TransferAbortedError if isinstance(first_error, ConnectionError) else TransferError)(
            f"{self.op} transfer failed on every rail at position {position} of {self.count} "
            f"({self._completed} moved): {first_error}",
            position,
            self._completed,
            first_error,
        )
        err.__cause__ = first_error
        self._future.set_exception(err)

    def __repr__(self) -> str:
        state = "done" if self.done() else f"{self._completed}/{self.count} complete"
        return f"<StripedTransfer {self.op} of {self.count} descriptors over {len(self._prepared)} rails: {state}>"


def _positions(n: int) -> Any:
    import array

    return array.array("q", range(n))


def striped_transfer(
    op: Literal["read", "write"],
    rails: list[tuple[Any, Region | RegionSlice, RemoteBuffer]],
    descriptors: Any,
    *,
    slice_size: int = 1024,
) -> StripedTransfer:
    """Move one descriptor list over several rails: ``rails`` are ``(connection, local,
    remote)`` triples, each a connection to the same peer (over another device, port or
    soft device) with the same local memory registered for it and the peer's same buffer
    as exposed to it; the descriptors' offsets count from each rail's ``local`` and
    ``remote`` (see :class:`StripedTransfer`)."""
    return StripedTransfer(op, list(rails), descriptors, slice_size)
