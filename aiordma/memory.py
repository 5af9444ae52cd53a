"""Registered memory as the public API sees it.

* :class:`Region` — memory registered with the device (an ``ibv_mr``):
  its ``lkey`` lets the local NIC read/write it, its ``rkey`` lets a peer
  reach it with RDMA Write/Read/atomics when it was registered with the
  matching ``REMOTE_*`` access. Slicing a region gives a :class:`RegionSlice`
  (still registered, zero copy).
* :class:`RemoteBuffer` — the peer's view of a region: ``(addr, length,
  rkey)``. This is what the rendezvous carries; slice it to target a part.
* :meth:`Region.exposed` — what a peer may do to a region it is given
  (``"r"``, ``"rw"``, ``"rwa"``: :mod:`aiordma.rights`), an
  :class:`Exposure`: exposing registers the memory once more with exactly
  those rights, and the peer gets that registration's rkey (see
  :mod:`aiordma.exposure`). :func:`register` grants no remote right by
  default (``LOCAL_WRITE``), so memory that was never exposed cannot be
  reached with any rkey a peer learns.
* :class:`BufferPool` — a few pre-registered buffers for bytes messages,
  so ``send(b"...")`` needs no registration per call.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .ops import WaitQueue
from .providers.base import (
    SGE,
    WRITE_ACCESS,
    Access,
    DeviceContext,
    MemoryRegion,
    ProtectionDomain,
    buffer_address,
)
from .rights import DEFAULT_RIGHTS, Rights, parse_rights, registration_access


class Region:
    """A registered memory region (zero-copy: the bytes stay where they are)."""

    __slots__ = ("__weakref__", "_closed", "_derived", "_owner", "mr")

    def __init__(self, mr: MemoryRegion, owner: Any = None) -> None:
        self.mr = mr
        self._owner = owner
        self._closed = False
        #: registrations of this memory made to expose it (closed with it)
        self._derived: weakref.WeakSet[Region] | None = None

    @property
    def addr(self) -> int:
        return self.mr.addr

    @property
    def length(self) -> int:
        return self.mr.length

    def __len__(self) -> int:
        return self.mr.length

    @property
    def lkey(self) -> int:
        return self.mr.lkey

    @property
    def rkey(self) -> int:
        return self.mr.rkey

    @property
    def access(self) -> Access:
        return self.mr.access

    @property
    def view(self) -> memoryview:
        """The registered bytes (writable)."""
        return self.mr.view

    def __getitem__(self, s: slice) -> RegionSlice:
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise TypeError("regions are sliced with [start:stop]")
        start, stop, _ = s.indices(self.length)
        return _region_slice(self, start, max(0, stop - start))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` deregistered it."""
        return self._closed

    def exposed(self, rights: Rights = "r") -> Exposure:
        """This region as offered to a peer with ``rights``: ``"r"``
        (REMOTE_READ), ``"w"`` (REMOTE_WRITE), ``"a"`` (REMOTE_ATOMIC), or a
        combination (``"rw"``, ``"rwa"``). Pass it in ``expose=`` or to
        :meth:`~aiordma.Connection.advertise`; a region passed there as it is
        is exposed read-only."""
        return Exposure(self, rights)

    def remote(self, offset: int = 0, length: int | None = None) -> RemoteBuffer:
        """The descriptor of this registration's own rkey (``addr, length,
        rkey``); it grants a peer only the ``REMOTE_*`` rights the region was
        registered with (none by default: expose it instead)."""
        if length is None:
            length = self.length - offset
        if offset < 0 or length < 0 or offset + length > self.length:
            raise ValueError(f"[{offset}, {offset + length}) is outside a region of {self.length} bytes")
        return _remote_buffer(self.addr + offset, length, self.rkey, None, None)

    def sge(self, offset: int = 0, length: int | None = None) -> SGE:
        return self.mr.sge(offset, length)

    def add_derived(self, child: Region) -> None:
        """Record ``child``, another registration of this memory (made to expose it
        with narrower rights): closing this region closes it too."""
        if self._derived is None:
            self._derived = weakref.WeakSet()
        self._derived.add(child)

    def close(self) -> None:
        """Deregister (``ibv_dereg_mr``), and every registration of this
        memory made to expose it: no peer reaches it any more."""
        self._closed = True
        if self._derived is not None:
            for child in list(self._derived):
                child.close()
            self._derived = None
        self.mr.close()

    def __repr__(self) -> str:
        return f"<Region addr=0x{self.addr:x} len={self.length} lkey=0x{self.lkey:08x} rkey=0x{self.rkey:08x}>"


@dataclass(frozen=True, slots=True)
class RegionSlice:
    """``length`` bytes at ``offset`` of a registered :class:`Region`."""

    region: Region
    offset: int
    length: int

    def __len__(self) -> int:
        return self.length

    @property
    def view(self) -> memoryview:
        return self.region.view[self.offset : self.offset + self.length]

    def sge(self) -> SGE:
        return self.region.sge(self.offset, self.length)

    def remote(self) -> RemoteBuffer:
        return self.region.remote(self.offset, self.length)

    def exposed(self, rights: Rights = "r") -> Exposure:
        """These bytes (only these) as offered to a peer with ``rights``; see :meth:`Region.exposed`."""
        return Exposure(self, rights)


Local = Region | RegionSlice


@dataclass(frozen=True, slots=True)
class Exposure:
    """A region (or a slice of one) as offered to a peer, with the rights the
    peer gets: made by :meth:`Region.exposed` / :meth:`RegionSlice.exposed`.
    Each connection it is given to registers those bytes once more with only
    these rights (:class:`aiordma.exposure.ExposedRegions`)."""

    target: Region | RegionSlice
    #: canonical letters after construction (``"r"``, ``"rw"``, ``"rwa"``, …)
    rights: Rights = DEFAULT_RIGHTS

    def __post_init__(self) -> None:
        if not isinstance(self.target, (Region, RegionSlice)):
            raise TypeError(f"only registered memory can be exposed (a Region or a slice), not {self.target!r}")
        object.__setattr__(self, "rights", parse_rights(self.rights))
        if len(self.target) == 0:
            raise ValueError("cannot expose an empty slice: a peer could reach nothing")

    @property
    def access(self) -> Access:
        """The access flags of the registration a peer is given."""
        return registration_access(self.rights)

    def __len__(self) -> int:
        return len(self.target)

    def __repr__(self) -> str:
        return f"<Exposure rights={self.rights!r} of {self.target!r}>"


@dataclass(frozen=True, slots=True)
class RemoteBuffer:
    """A peer's registered memory: virtual address, length and rkey.

    Slice it (``buf[4096:8192]``) or use :meth:`at` to target a part; the
    peer's NIC checks every access against the rkey and the bounds.
    ``rights`` is what the peer said it allows (``"r"``, ``"rw"``, ...; None
    when it did not say): informative only, the peer's NIC enforces it.
    """

    addr: int
    length: int
    rkey: int
    name: str | None = None
    rights: str | None = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, s: slice) -> RemoteBuffer:
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise TypeError("remote buffers are sliced with [start:stop]")
        start, stop, _ = s.indices(self.length)
        return _remote_buffer(self.addr + start, max(0, stop - start), self.rkey, self.name, self.rights)

    def at(self, offset: int, length: int) -> RemoteBuffer:
        """``length`` bytes at ``offset`` (not clipped: the peer's NIC enforces the bounds)."""
        return _remote_buffer(self.addr + offset, length, self.rkey, self.name, self.rights)

    def to_wire(self) -> list[int]:
        return [self.addr, self.length, self.rkey]

    @classmethod
    def from_wire(cls, value: Any, name: str | None = None) -> RemoteBuffer:
        if (
            not isinstance(value, (list, tuple))
            or len(value) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            raise ValueError("a remote buffer is [addr, length, rkey]")
        addr, length, rkey = value
        if not (0 <= addr < 1 << 64 and 0 <= length < 1 << 63 and 0 <= rkey < 1 << 32):
            raise ValueError("remote buffer fields out of range")
        return cls(addr, length, rkey, name)

    def __repr__(self) -> str:
        n = f" {self.name!r}" if self.name else ""
        r = f" rights={self.rights!r}" if self.rights is not None else ""
        return f"<RemoteBuffer{n} addr=0x{self.addr:x} len={self.length} rkey=0x{self.rkey:08x}{r}>"


# RemoteBuffer.at() and slicing run once per operation in code that targets many
# places of a peer's memory (a key-value client: one per slot it reads). A frozen
# dataclass's __init__ sets each field through object.__setattr__, about 1 µs for
# five fields; filling the same slots on a plain twin and retyping it as the frozen
# class takes a third of that. The twin must name the frozen class's slots (Python
# lays slots out in sorted order, and ``__class__`` assignment refuses layouts that
# differ): tests/unit/test_memory.py compares what both ways build.


class _RemoteBufferFields:
    __slots__ = ("addr", "length", "name", "rights", "rkey")


class _RegionSliceFields:
    __slots__ = ("length", "offset", "region")


def _remote_buffer(addr: int, length: int, rkey: int, name: str | None, rights: str | None) -> RemoteBuffer:
    """``RemoteBuffer(addr, length, rkey, name, rights)``, built faster (see above)."""
    b: Any = _RemoteBufferFields()
    b.addr = addr
    b.length = length
    b.rkey = rkey
    b.name = name
    b.rights = rights
    b.__class__ = RemoteBuffer
    return b  # type: ignore[no-any-return]


def _region_slice(region: Region, offset: int, length: int) -> RegionSlice:
    """``RegionSlice(region, offset, length)``, built faster (see above)."""
    s: Any = _RegionSliceFields()
    s.region = region
    s.offset = offset
    s.length = length
    s.__class__ = RegionSlice
    return s  # type: ignore[no-any-return]


class BufferPool:
    """Fixed-size registered buffers (slots) carved out of one region.

    Slots are handed to waiting coroutines in order (see
    :class:`aiordma.ops.SendQueue`): a waiter cancelled just after it was
    given a slot passes the slot on, so none is ever stranded free while
    others sleep."""

    def __init__(self, region: Region, size: int) -> None:
        self.region = region
        self.size = size
        self.count = region.length // size
        #: free slot indices (taken from the end; a caller may pop one itself when
        #: nobody is in :attr:`waiters`)
        self.free = list(range(self.count - 1, -1, -1))
        #: coroutines waiting for a slot, first come first served
        self.waiters = WaitQueue()

    def try_acquire(self) -> int | None:
        """A free slot now, or None (also when coroutines are already waiting: no overtaking)."""
        if self.free and not self.waiters:
            return self.free.pop()
        return None

    async def acquire(self) -> int:
        if self.free and not self.waiters:
            return self.free.pop()
        slot: int = await self.waiters.wait(1, self.release, self._hand_over)
        return slot

    def release(self, index: int) -> None:
        if not 0 <= index < self.count or len(self.free) >= self.count or index in self.free:
            raise ValueError(f"slot {index} is not a taken slot of this pool")
        self.free.append(index)
        if self.waiters:
            self._hand_over()

    def _hand_over(self) -> None:
        waiters = self.waiters
        while waiters and self.free and waiters.first_need() is not None:
            waiters.resolve_first(self.free.pop())

    @property
    def waiting(self) -> int:
        """Coroutines waiting for a slot."""
        return len(self.waiters)

    def view(self, index: int, length: int | None = None) -> memoryview:
        off = index * self.size
        return self.region.view[off : off + (self.size if length is None else length)]

    def sge(self, index: int, length: int | None = None) -> SGE:
        return self.region.sge(index * self.size, self.size if length is None else length)

    def close(self) -> None:
        self.region.close()


class BufferTable:
    """Registered buffers of one size, by slot: each slot's address and lkey.

    The buffers of a pool that grows lie in several registrations (one per
    growth step), so a slot's address is looked up, not computed. A receive
    completion names its buffer by ``wr_id`` (the slot), and with a shared
    receive queue that slot belongs to the device, not to the connection the
    completion landed on. The compiled core has a twin with C arrays
    (:class:`aiordma._core.BufferTable`); slots at or above :attr:`active` are
    being retired (their pool takes them back one by one)."""

    __slots__ = ("active", "addrs", "lkeys", "size")

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"a buffer size must be positive, got {size}")
        self.size = size
        self.addrs: list[int] = []
        self.lkeys: list[int] = []
        #: slots below this are in service
        self.active = 0

    def add(self, addr: int, lkey: int, n: int) -> int:
        """``n`` buffers side by side from ``addr`` (one registration, ``lkey``): their
        slots follow the last one; returns the first. Every slot is then in service."""
        if n <= 0:
            raise ValueError(f"add at least one buffer, not {n}")
        first = len(self.addrs)
        size = self.size
        self.addrs.extend(addr + i * size for i in range(n))
        self.lkeys.extend([lkey] * n)
        self.active = len(self.addrs)
        return first

    def truncate(self, n: int) -> None:
        """Forget the slots from ``n`` on (their registration is gone)."""
        if not 0 <= n <= len(self.addrs):
            raise ValueError(f"cannot truncate {len(self.addrs)} slots to {n}")
        del self.addrs[n:]
        del self.lkeys[n:]
        if self.active > n:
            self.active = n

    def addr(self, slot: int) -> int:
        if slot < 0:
            raise IndexError("list index out of range")
        return self.addrs[slot]

    def lkey(self, slot: int) -> int:
        if slot < 0:
            raise IndexError("list index out of range")
        return self.lkeys[slot]

    def __len__(self) -> int:
        return len(self.addrs)


class SlotTable(dict[int, Any]):
    """Per-slot objects (a view, a work request, an op) built the first time a
    slot is asked for, then kept: indexed like a list, ``table[slot]``.

    A connection that has exchanged a message or two has used a slot or two of
    its pools (a send pool reuses its most recently freed slot first), so it holds
    those slots' objects, not all of them (built up front, they were 13 KiB of
    Python objects per connection).
    ``make(slot)`` must not refer to the table's owner (the table would keep it
    in a reference cycle)."""

    __slots__ = ("_make",)

    def __init__(self, make: Callable[[int], Any]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, slot: int) -> Any:
        value = self[slot] = self._make(slot)
        return value


def protection_domain(device: DeviceContext) -> ProtectionDomain:
    """The protection domain every connection on ``device`` shares (regions
    registered once work on all of them): the device's own
    :meth:`~aiordma.providers.base.DeviceContext.shared_pd`."""
    return device.shared_pd()


def register(
    buffer: Any,
    access: Access = Access.LOCAL_WRITE,
    *,
    provider: str | None = None,
    device: DeviceContext | str | None = None,
) -> Region:
    """Register ``buffer`` (bytearray, mmap, writable memoryview, numpy array, or
    an int size to allocate) with the default device, zero copy (``ibv_reg_mr``).

    ``access`` says what the device may do with it. The default,
    ``Access.LOCAL_WRITE``, lets local work requests use it (the source of a
    Write or a send, the target of a Read or a receive) and grants a peer
    nothing: a peer reaches memory only once it is exposed (``expose=``,
    :meth:`~aiordma.Connection.advertise`), which registers it again with
    exactly the rights declared there (:meth:`Region.exposed`). The
    ``REMOTE_*`` flags here put rights on this registration's own rkey,
    for code that hands out :meth:`Region.remote` itself."""
    from .providers import device_for

    device = device_for(provider, device)
    return Region(protection_domain(device).reg_mr(buffer, access), buffer)


class RegistrationCache:
    """Registrations of caller memory kept for reuse (UCX's "rcache").

    On hardware, registering memory pins its pages and costs microseconds per
    page; a program that sends the same buffers again and again (a framework
    with pooled frames) should not pay that every time. :meth:`acquire`
    registers a buffer's exact byte range with this cache's ``access``, or
    reuses the registration made for the same range of the same object;
    :meth:`release` gives it back. Entries not in use are dropped, oldest
    first, past ``max_entries`` or ``max_bytes``.

    A cached registration keeps its object alive, and an object with a live
    registration cannot be resized (Python refuses while a buffer is
    exported), so ``bytearray`` objects — the one common buffer that can
    grow — are registered afresh each time and never cached.

    Least privilege: a registration with remote rights stays valid while it
    is cached, so a peer that was given its rkey could use it again. The
    connection's send cache grants only ``REMOTE_READ`` of exactly the bytes
    that were sent to that peer, and is emptied when the connection closes.
    """

    def __init__(
        self, pd: ProtectionDomain, access: Access, *, max_entries: int = 64, max_bytes: int = 1 << 30
    ) -> None:
        self.pd = pd
        self.access = Access(access)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        #: (id of the exporting object, address, length) -> [region, users]
        self._entries: collections.OrderedDict[tuple[int, int, int], list[Any]] = collections.OrderedDict()
        self._bytes = 0
        self._closed = False
        self.hits = 0
        self.misses = 0

    def acquire(self, buffer: Any) -> Region:
        """A registration of ``buffer`` (any contiguous buffer; read-only ones
        too when ``access`` grants no write right). Call :meth:`release` after use."""
        mv = memoryview(buffer).cast("B")
        exporter = mv.obj
        writable = bool(self.access & WRITE_ACCESS)
        if type(exporter) is bytearray or self.max_entries <= 0 or self._closed:
            self.misses += 1
            return Region(self.pd.reg_mr(mv, self.access), mv)
        addr, _ = buffer_address(mv, writable=writable)
        key = (id(exporter), addr, mv.nbytes)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            entry[1] += 1
            self.hits += 1
            return entry[0]  # type: ignore[no-any-return]
        self.misses += 1
        region = Region(self.pd.reg_mr(mv, self.access), exporter)
        self._entries[key] = [region, 1]
        self._bytes += mv.nbytes
        self._evict()
        return region

    def release(self, region: Region) -> None:
        """Done with a registration from :meth:`acquire`."""
        for key, entry in self._entries.items():
            if entry[0] is region:
                entry[1] -= 1
                if self._closed and entry[1] == 0:
                    self._drop(key)
                else:
                    self._evict()
                return
        region.close()  # not cached (a bytearray, or evicted/closed meanwhile)

    def _evict(self) -> None:
        if len(self._entries) <= self.max_entries and self._bytes <= self.max_bytes:
            return
        for key in [k for k, e in self._entries.items() if e[1] == 0]:
            if len(self._entries) <= self.max_entries and self._bytes <= self.max_bytes:
                break
            self._drop(key)

    def _drop(self, key: tuple[int, int, int]) -> None:
        region, _ = self._entries.pop(key)
        self._bytes -= key[2]
        region.close()

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        """Deregister everything not in use now, the rest as it is released."""
        self._closed = True
        for key in [k for k, e in self._entries.items() if e[1] == 0]:
            self._drop(key)
