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
:func:`read_chain` build them; the connection posts them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .memory import Region, RegionSlice, RegistrationCache, RemoteBuffer
from .providers.base import SGE, Access, ProtectionDomain, SendFlags, SendWR, WROpcode

__all__ = ["Chain", "atomic_operand", "check_imm", "destination", "read_chain", "source", "write_chain"]

#: what runs when a work request's completion arrives (frees what it used)
Release = Callable[[], None]
_LOCAL = (Region, RegionSlice)
_U64 = 1 << 64


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
