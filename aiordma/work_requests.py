"""Work requests from Python objects: the scatter/gather lists of the one-sided verbs.

A NIC reads an RDMA Write's source, and writes a Read's destination, only
inside registered memory: each piece is an SGE (address, length, lkey). A
caller may pass registered memory (a :class:`~aiordma.memory.Region` or a
slice of one), used in place, or any Python buffer: a source is copied into
a temporary registration, a destination is registered for the transfer
(through a :class:`~aiordma.memory.RegistrationCache`, so a buffer read into
again is registered once). Each builder returns the SGEs and the release to
run when the work request's completion arrives (never before: the NIC may
still touch the memory until then).

A *chain* is several work requests linked and posted with one
``ibv_post_send`` (one doorbell), only the last one signaled: an RC queue
pair executes its send queue in order, so the last completion says every
request before it is done (selective signaling). :func:`write_chain` and
:func:`read_chain` build them.

:class:`Requester` is a connection's requester side of the one-sided verbs
beyond its per-operation fast path (registered memory, a send-queue slot
free): it waits for send-queue slots, posts, and hands back the futures the
completions resolve; the atomics' 8-byte results land in its scratch buffers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import raiser
from .memory import BufferPool, Region, RegionSlice, RegistrationCache, RemoteBuffer
from .ops import Op, OperationTracker, SendQueue
from .providers.base import SGE, Access, ProtectionDomain, SendFlags, SendWR, WorkCompletion, WROpcode

if TYPE_CHECKING:
    from .messages import Outbox

__all__ = [
    "Chain",
    "Requester",
    "atomic_operand",
    "check_imm",
    "destination",
    "read_chain",
    "source",
    "write_chain",
]

log = logging.getLogger("aiordma")

#: what runs when a work request's completion arrives (frees what it used)
Release = Callable[[], None]
_LOCAL = (Region, RegionSlice)
_U64 = 1 << 64
_ATOMIC = struct.Struct("<Q")
_RDMA_READ = WROpcode.IBV_WR_RDMA_READ
#: atomics in flight at once per connection (each needs an 8-byte scratch buffer)
ATOMIC_SLOTS = 64


def source(pd: ProtectionDomain, local: Any) -> tuple[list[SGE], Release | None]:
    """SGEs for a Write's (or Send's) source: registered memory in place; any
    other bytes-like object copied into a temporary registration of ``pd``,
    closed by the release."""
    if isinstance(local, _LOCAL):
        return ([local.sge()] if local.length else []), None
    try:
        mv = memoryview(local).cast("B")
    except TypeError:
        raise TypeError(
            f"the source must be bytes-like or registered memory (Region), not {type(local).__name__}"
        ) from None
    if mv.nbytes == 0:
        return [], None
    tmp = Region(pd.reg_mr(bytearray(mv), Access.LOCAL_WRITE))
    return [tmp.sge()], tmp.close


def destination(remote: RemoteBuffer, into: Any, cache: RegistrationCache) -> tuple[list[SGE], Release | None]:
    """SGEs for a Read of ``remote`` into ``into``: registered memory in place;
    any other writable buffer of at least ``remote.length`` bytes registered
    through ``cache`` (given back by the release)."""
    n = remote.length
    if isinstance(into, _LOCAL):
        if into.length < n:
            raise ValueError(f"read of {n} bytes does not fit the {into.length}-byte destination")
        sg = into.sge()
        return ([SGE(sg.addr, n, sg.lkey)] if n else []), None
    try:
        mv = memoryview(into)
    except TypeError:
        raise TypeError(
            "into must be registered memory (Region) or a writable buffer "
            f"(bytearray, writable memoryview, numpy array), not {type(into).__name__}"
        ) from None
    if mv.readonly:
        raise TypeError(f"into must be writable: this {type(into).__name__} is read-only")
    if mv.nbytes < n:
        raise ValueError(f"read of {n} bytes does not fit the {mv.nbytes}-byte destination")
    if n == 0:
        return [], None
    region = cache.acquire(mv)
    sg = region.sge()
    return [SGE(sg.addr, n, sg.lkey)], functools.partial(cache.release, region)


def check_imm(imm: int | None) -> None:
    """Immediate data is 32 bits (the ``imm_data`` of a work request)."""
    if imm is not None and (not isinstance(imm, int) or not 0 <= imm <= 0xFFFFFFFF):
        raise ValueError(f"immediate data is 32 bits (0 <= imm < 2**32), got {imm!r}")


def atomic_operand(value: int, what: str) -> int:
    """An atomic operand as the 64-bit word the NIC sees (negative values as two's complement)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    if not -(1 << 63) <= value < _U64:
        raise ValueError(f"{what} must fit in 64 bits (-2**63 <= value < 2**64), got {value}")
    return value & (_U64 - 1)


@dataclass
class Chain:
    """Linked work requests, only the last signaled, and what their completion releases."""

    wrs: list[SendWR] = field(default_factory=list)
    releases: list[Release] = field(default_factory=list)
    #: bytes moved by the whole chain
    total: int = 0

    def release_all(self) -> None:
        for release in self.releases:
            release()

    @property
    def release(self) -> Release | None:
        """What the last completion runs (None: nothing to free)."""
        return self.release_all if self.releases else None

    def describe(self) -> str:
        name = "RDMA_READ" if self.wrs[-1].opcode == WROpcode.IBV_WR_RDMA_READ else "RDMA_WRITE"
        return f"batch of {len(self.wrs)} {name}s ({self.total} bytes)"

    def _add(self, i: int, k: int, op: WROpcode, sges: list[SGE], remote: RemoteBuffer, imm: int | None) -> None:
        last = i == k - 1
        self.wrs.append(
            SendWR(
                0,
                op,
                sges,
                remote_addr=remote.addr,
                rkey=remote.rkey,
                imm_data=imm if last else None,
                send_flags=SendFlags.IBV_SEND_SIGNALED if last else SendFlags(0),
            )
        )


def write_chain(pd: ProtectionDomain, writes: Sequence[tuple[Any, RemoteBuffer]], imm: int | None) -> Chain:
    """The chain of RDMA Writes ``(local, remote)``; with ``imm`` the last one
    is a Write with immediate. A bad pair raises, naming it, with nothing held."""
    chain = Chain()
    k = len(writes)
    try:
        for i, (local, remote) in enumerate(writes):
            sges, release = source(pd, local)
            if release:
                chain.releases.append(release)
            n = sum(s.length for s in sges)
            if n > remote.length:
                raise ValueError(
                    f"write {i} of the batch: {n} bytes do not fit the remote buffer of {remote.length} bytes"
                )
            chain.total += n
            with_imm = i == k - 1 and imm is not None
            op = WROpcode.IBV_WR_RDMA_WRITE_WITH_IMM if with_imm else WROpcode.IBV_WR_RDMA_WRITE
            chain._add(i, k, op, sges, remote, imm)
    except BaseException:
        chain.release_all()
        raise
    return chain


def read_chain(cache: RegistrationCache, reads: Sequence[tuple[RemoteBuffer, Any]]) -> Chain:
    """The chain of RDMA Reads ``(remote, into)``, each ``into`` a buffer as for
    :func:`destination`. A bad pair raises, naming it, with nothing held."""
    chain = Chain()
    k = len(reads)
    try:
        for i, (remote, into) in enumerate(reads):
            if into is None:
                raise TypeError(f"read {i} of the batch: into must be a buffer (read_batch returns no bytes)")
            sges, release = destination(remote, into, cache)
            if release:
                chain.releases.append(release)
            chain.total += remote.length
            chain._add(i, k, WROpcode.IBV_WR_RDMA_READ, sges, remote, None)
    except BaseException:
        chain.release_all()
        raise
    return chain


class Requester:
    """The requester side of a connection's one-sided verbs (see the module's docstring).

    ``check_usable()`` raises the connection's error (or that it is closed);
    ``outbox`` lends a message credit to a Write with immediate (the peer's
    receive completion consumes a posted receive); ``cache`` registers plain
    buffers that Reads land in."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        pd: ProtectionDomain,
        sq: SendQueue,
        ops: OperationTracker,
        outbox: Outbox,
        cache: RegistrationCache,
        *,
        check_usable: Callable[[], None],
        pool_class: Callable[[Region, int], BufferPool] = BufferPool,
    ) -> None:
        self.loop = loop
        self.pd = pd
        self.sq = sq
        self.ops = ops
        self.outbox = outbox
        self.cache = cache
        self._check_usable = check_usable
        self.scratch = pool_class(Region(pd.reg_mr(8 * ATOMIC_SLOTS, Access.LOCAL_WRITE)), 8)

    def post_nowait(
        self, wr: SendWR, release: Release | None, describe: str | Callable[[], str]
    ) -> asyncio.Future[WorkCompletion]:
        """Post ``wr`` now (a send-queue slot must be held); its completion's future."""
        fut: asyncio.Future[WorkCompletion] = self.loop.create_future()
        self.ops.post(wr, Op(fut, release, describe, wr.opcode))
        return fut

    async def post_when_free(
        self, wr: SendWR, release: Release | None, describe: str | Callable[[], str]
    ) -> asyncio.Future[WorkCompletion]:
        """Wait for a send-queue slot, then post ``wr``; returns its completion's
        future. If the wait fails (cancelled, QP gone), ``release`` runs at once."""
        try:
            await self.sq.acquire()
        except BaseException:
            if release is not None:
                release()
            raise
        return self.post_nowait(wr, release, describe)

    async def _post(self, wr: SendWR, release: Release | None, describe: str | Callable[[], str]) -> WorkCompletion:
        self._check_usable()
        fut = await self.post_when_free(wr, release, describe)
        return await fut  # cancelling this leaves the op (and its buffers) pending until its CQE

    async def post_write(self, local: Any, remote: RemoteBuffer, imm: int | None) -> asyncio.Future[WorkCompletion]:
        """An RDMA Write from any source (see :meth:`aiordma.Connection.post_write`)."""
        check_imm(imm)
        sges, release = source(self.pd, local)
        n = sum(s.length for s in sges)
        if n > remote.length:
            if release:
                release()
            raise ValueError(f"write of {n} bytes does not fit the remote buffer of {remote.length} bytes")
        op = WROpcode.IBV_WR_RDMA_WRITE
        credit = False
        try:
            if imm is not None:
                op = WROpcode.IBV_WR_RDMA_WRITE_WITH_IMM
                await self.outbox.take_credit()
                credit = True
            await self.sq.acquire()
        except BaseException:
            if credit:
                self.outbox.return_credit()
            if release:
                release()
            raise
        wr = SendWR(0, op, sges, remote_addr=remote.addr, rkey=remote.rkey, imm_data=imm)
        name = "RDMA_WRITE_WITH_IMM" if imm is not None else "RDMA_WRITE"
        return self.post_nowait(wr, release, lambda: f"{name} of {n} bytes to {remote!r}")

    async def post_read(self, remote: RemoteBuffer, into: Any) -> asyncio.Future[WorkCompletion]:
        """An RDMA Read into any writable buffer (see :meth:`aiordma.Connection.post_read`)."""
        sges, release = destination(remote, into, self.cache)
        n = remote.length
        wr = SendWR(0, _RDMA_READ, sges, remote_addr=remote.addr, rkey=remote.rkey)
        return await self.post_when_free(wr, release, lambda: f"RDMA_READ of {n} bytes from {remote!r}")

    async def read_bytes(self, remote: RemoteBuffer) -> bytes:
        """An RDMA Read of ``remote`` into a temporary registration, returned as ``bytes``."""
        n = remote.length
        data = b""
        tmp = Region(self.pd.reg_mr(max(n, 1), Access.LOCAL_WRITE))
        sges = [tmp.sge(0, n)] if n else []
        view = tmp.view

        def release_tmp() -> None:
            nonlocal data
            data = bytes(view[:n])
            tmp.close()

        # the temporary region stays alive until the completion: release() is the completion's job
        wr = SendWR(0, _RDMA_READ, sges, remote_addr=remote.addr, rkey=remote.rkey)
        await self._post(wr, release_tmp, lambda: f"RDMA_READ of {n} bytes from {remote!r}")
        return data

    async def atomic(self, opcode: WROpcode, remote: RemoteBuffer, compare_add: int, swap: int, name: str) -> int:
        """An atomic on the peer's 8-byte word at ``remote``; returns its original value."""
        if remote.length < 8:
            raise ValueError(f"{name} needs an 8-byte remote buffer, got {remote.length}")
        if remote.addr & 7:
            log.debug("%s at unaligned address 0x%x: the peer will refuse it", name, remote.addr)
        scratch = self.scratch
        slot = await scratch.acquire()
        result = [0]

        def release() -> None:
            result[0] = _ATOMIC.unpack(scratch.view(slot))[0]
            scratch.release(slot)

        wr = SendWR(
            0,
            opcode,
            [scratch.sge(slot)],
            remote_addr=remote.addr,
            rkey=remote.rkey,
            compare_add=compare_add,
            swap=swap,
        )
        await self._post(wr, release, lambda: f"{name} on {remote!r}")
        return result[0]

    async def post_chain(self, chain: Chain, credit: bool = False) -> None:
        """Post ``chain`` once its send-queue slots (and, for a Write with immediate,
        a message credit) are free; returns at its last completion."""
        took_credit = False
        try:
            if credit:
                await self.outbox.take_credit()
                took_credit = True
            await self.sq.acquire(len(chain.wrs))
        except BaseException:
            if took_credit:
                self.outbox.return_credit()
            chain.release_all()
            raise
        fut: asyncio.Future[WorkCompletion] = self.loop.create_future()
        self.ops.post_chain(chain.wrs, Op(fut, chain.release, chain.describe, chain.wrs[-1].opcode))
        await fut  # cancelling this leaves the chain (and its buffers) pending until the last CQE

    def close(self, error: BaseException | None) -> None:
        """The queue pair is gone: the scratch buffers are released, and the
        connection's callback let go (it holds the connection, which holds
        this); an operation still waiting raises the connection's ``error``."""
        self.scratch.close()
        self._check_usable = raiser(error)
