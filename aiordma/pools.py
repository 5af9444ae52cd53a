"""Registered buffers a device's connections share: the send pool and the shared receive queue.

Registration pins memory on a real NIC, so what a connection registers for
itself is resident from its first moment: 16 receive and 16 send buffers of
64 KiB each way were about 2 MiB per connection, however idle. Here both
sides become the device's, one set per protection domain, event loop and
buffer size:

* :class:`SendPool`: registered send buffers (one chunk of a message each),
  registered a *step* at a time (about 1 MiB) as traffic needs them, up to
  ``max_bytes``; when the buffers of the last step go unused for a while
  (sampled every :data:`SHRINK_PERIOD` s) that step is retired: its free
  buffers leave at once, the ones in flight as their completions come, then
  its registration is released. The first step stays while connections use
  the pool.
* :class:`ReceivePool`: a shared receive queue (``ibv_srq``) and the receive
  buffers posted to it. Every queue pair created with it takes its receives
  from it; a completion lands on the CQ of the connection whose peer sent,
  with the ``wr_id`` of the buffer (its slot in the pool's
  :class:`~aiordma.memory.BufferTable`, which the compiled core reads in C).
  The receiver copies the message out and reposts the buffer at once, so the
  SRQ runs low only when messages arrive faster than completions are
  handled. Its limit event (``IBV_EVENT_SRQ_LIMIT_REACHED``) is armed at a
  quarter of the buffers: when it fires, the pool registers and posts another
  step (doubling, up to ``max_bytes``) before the receivers run dry. An SRQ
  cannot give back a receive it holds, so the pool does not shrink while
  connections use it; it goes, SRQ and registrations, with the last one.

A connection takes a pool with :func:`send_pool` / :func:`receive_pool` and
gives it back with :meth:`SendPool.leave` / :meth:`ReceivePool.leave` once its
queue pair is destroyed (verbs destroy an SRQ only after every queue pair that
uses it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .errors import RDMAError
from .memory import Region, SlotTable
from .ops import WaitQueue
from .providers.base import (
    SGE,
    Access,
    CompletionQueue,
    DeviceContext,
    ProtectionDomain,
    QPCap,
    QueuePair,
    RecvWR,
    SharedReceiveQueue,
)

__all__ = [
    "DEFAULT_RECV_POOL_BYTES",
    "DEFAULT_SEND_POOL_BYTES",
    "RECV_TAG",
    "ReceivePool",
    "SendPool",
    "create_queue_pair",
    "pools_of",
    "receive_pool",
    "registered_memory",
    "send_pool",
]

log = logging.getLogger("aiordma")

#: the wr_id bit that marks a receive work request (the rest is its slot)
RECV_TAG = 1 << 62
#: bytes one growth step registers (at least 16 buffers)
STEP_BYTES = 1 << 20
#: the most a device's send pool of one size registers
DEFAULT_SEND_POOL_BYTES = 64 << 20
#: the most a device's shared receive queue of one size registers (128 buffers of 64 KiB:
#: the full windows of 8 busy connections; past it, senders meet RNR NAKs and wait). An
#: SRQ cannot give back the receives it holds, so this is also what a burst may leave
#: pinned until the device's last connection of that size closes
DEFAULT_RECV_POOL_BYTES = 8 << 20
#: receive buffers a shared receive queue may grow by per connection using it (bytes): a
#: burst of messages from many connections grows it no further than this share each
SRQ_SHARE_BYTES = 32 << 10
#: how often an idle send pool's last step is looked at (s), and how many looks in a
#: row must find it unused before it is retired
SHRINK_PERIOD = 0.5
SHRINK_LOOKS = 4

#: the live pools: (id(pd), id(loop), kind, size) -> pool
_POOLS: dict[tuple[int, int, str, int], Any] = {}


def step_slots(size: int) -> int:
    """Buffers per growth step: about :data:`STEP_BYTES`, at least 16."""
    return max(16, STEP_BYTES // size)


class _DevicePool:
    """What the device's send pool and shared receive queue have in common: the
    protection domain and loop they serve, their buffer size, the table of where
    each slot's buffer is, and how many buffers one registration step adds."""

    def __init__(
        self, device: DeviceContext, pd: ProtectionDomain, loop: asyncio.AbstractEventLoop, size: int, table_cls: Any
    ) -> None:
        self.device = device
        self.pd = pd
        self.loop = loop
        self.size = size
        self.table = table_cls(size)
        self.step = step_slots(size)


class SendPool(_DevicePool):
    """Registered send buffers of one size shared by the connections of one
    protection domain and event loop (see the module's docstring).

    The interface of :class:`~aiordma.memory.BufferPool` (``free``,
    ``waiters``, ``acquire``, ``try_acquire``, ``release``, ``view``,
    ``size``), plus :attr:`table`: where each slot's buffer is."""

    def __init__(
        self,
        device: DeviceContext,
        pd: ProtectionDomain,
        loop: asyncio.AbstractEventLoop,
        size: int,
        table_cls: Any,
        *,
        max_bytes: int = DEFAULT_SEND_POOL_BYTES,
    ) -> None:
        super().__init__(device, pd, loop, size, table_cls)
        self.max_slots = max(self.step, max_bytes // size)
        #: free slots (taken from the end)
        self.free: list[int] = []
        self.waiters = WaitQueue()
        #: one registration per step: (region, first slot, buffers)
        self.steps: list[tuple[Region, int, int]] = []
        self.views = SlotTable(self._view)
        #: slots of a step being retired still in flight
        self._retiring = 0
        self._looks = 0
        self._timer: asyncio.TimerHandle | None = None
        self.users = 0
        self.closed = False
        #: steps registered / retired so far
        self.grown = 0
        self.shrunk = 0
        self._grow()

    # ----------------------------------------------------------- the pool ----
    @property
    def count(self) -> int:
        """Buffers in service."""
        return int(self.table.active)

    @property
    def registered_bytes(self) -> int:
        return sum(r.length for r, _, _ in self.steps)

    def _view(self, slot: int) -> memoryview:
        for region, first, n in self.steps:
            if first <= slot < first + n:
                off = (slot - first) * self.size
                return region.view[off : off + self.size]
        raise IndexError(f"send buffer {slot} is not in the pool")

    def view(self, slot: int, length: int | None = None) -> memoryview:
        v: memoryview = self.views[slot]
        return v if length is None else v[:length]

    def sge(self, slot: int, length: int | None = None) -> SGE:
        return SGE(self.table.addr(slot), self.size if length is None else length, self.table.lkey(slot))

    def _grow(self) -> bool:
        """Register another step (False: at the limit, or being retired)."""
        if self.closed or self._retiring or (len(self.table) + self.step > self.max_slots and self.steps):
            return False
        region = Region(self.pd.reg_mr(self.step * self.size, Access.LOCAL_WRITE))
        first = self.table.add(region.addr, region.lkey, self.step)
        self.steps.append((region, first, self.step))
        # the new slots go under the free ones: the buffers already in use come first
        self.free[:0] = range(first + self.step - 1, first - 1, -1)
        self.grown += 1
        self._looks = 0
        if len(self.steps) > 1:
            self._watch()
        return True

    def try_acquire(self) -> int | None:
        if self.free and not self.waiters:
            return self.free.pop()
        if not self.waiters and self._grow():
            return self.free.pop()
        return None

    async def acquire(self) -> int:
        if self.closed:
            raise RDMAError("the send pool was closed (its last connection closed)")
        slot = self.try_acquire()
        if slot is not None:
            return slot
        got: int = await self.waiters.wait(1, self.release, self._hand_over)
        return got

    def release(self, slot: int) -> None:
        if slot >= self.table.active:
            self._retired_one()
            return
        self.free.append(slot)
        if self.waiters:
            self._hand_over()

    def _hand_over(self) -> None:
        waiters = self.waiters
        while waiters and waiters.first_need() is not None:
            if not self.free and not self._grow():
                return
            waiters.resolve_first(self.free.pop())

    @property
    def waiting(self) -> int:
        return len(self.waiters)

    # ---------------------------------------------------------- shrinking ----
    def _watch(self) -> None:
        if self._timer is None and not self.closed:
            self._timer = self.loop.call_later(SHRINK_PERIOD, self._look)

    def _look(self) -> None:
        """Retire the last step once it went unused for :data:`SHRINK_LOOKS` looks in a row."""
        self._timer = None
        if self.closed or len(self.steps) < 2 or self._retiring:
            return
        _, first, n = self.steps[-1]
        in_use = self.count - len(self.free)
        if in_use <= first // 2 and not self.waiters:
            self._looks += 1
        else:
            self._looks = 0
        if self._looks >= SHRINK_LOOKS:
            self._looks = 0
            # every unused step goes, the last first (one in flight may have to come back first)
            while len(self.steps) > 1 and not self._retiring:
                self._retire()
                if self.count - len(self.free) > self.steps[-1][1] // 2:
                    break
        if len(self.steps) > 1:
            self._watch()

    def _retire(self) -> None:
        _, first, n = self.steps[-1]
        self.table.active = first
        kept = [s for s in self.free if s < first]
        self._retiring = n - (len(self.free) - len(kept))
        self.free[:] = kept
        if not self._retiring:
            self._drop_last()

    def _retired_one(self) -> None:
        self._retiring -= 1
        if self._retiring <= 0:
            self._retiring = 0
            self._drop_last()
            if self.waiters:  # (senders that came while it was retired may grow the pool now)
                self._hand_over()

    def _drop_last(self) -> None:
        region, first, _ = self.steps.pop()
        for slot in [s for s in self.views if s >= first]:
            del self.views[slot]
        self.table.truncate(first)
        self.shrunk += 1
        try:
            region.close()
        except Exception as e:  # pragma: no cover
            log.debug("deregistering a send pool step: %s", e)

    # ------------------------------------------------------------- users ----
    def leave(self) -> None:
        """A connection is done with the pool (its queue pair is destroyed and its
        buffers released): the last one's leaving deregisters it."""
        self.users -= 1
        if self.users <= 0:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        _forget(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.waiters.fail_all(RDMAError("the send pool was closed"))
        self.free.clear()
        self.views.clear()
        for region, _, _ in self.steps:
            try:
                region.close()
            except Exception as e:  # pragma: no cover
                log.debug("deregistering a send pool step: %s", e)
        self.steps.clear()
        self.table.truncate(0)

    def stats(self) -> dict[str, int]:
        return {
            "buffers": self.count,
            "free": len(self.free),
            "registered_bytes": self.registered_bytes,
            "regions": len(self.steps),
            "users": self.users,
            "grown": self.grown,
            "shrunk": self.shrunk,
        }


class ReceivePool(_DevicePool):
    """A shared receive queue and its receive buffers, for the connections of
    one protection domain and event loop (see the module's docstring)."""

    def __init__(
        self,
        device: DeviceContext,
        pd: ProtectionDomain,
        loop: asyncio.AbstractEventLoop,
        size: int,
        table_cls: Any,
        *,
        max_bytes: int = DEFAULT_RECV_POOL_BYTES,
    ) -> None:
        super().__init__(device, pd, loop, size, table_cls)
        attr = device.query_device()
        max_wr = int(getattr(attr, "max_srq_wr", 0) or 0)
        self.max_slots = max(self.step, min(max_bytes // size, max_wr or (1 << 14)))
        self.srq: SharedReceiveQueue = pd.create_srq(self.max_slots)
        self.max_slots = min(self.max_slots, self.srq.max_wr)
        self.steps: list[tuple[Region, int, int]] = []
        self.views = SlotTable(self._view)
        self.wrs = SlotTable(self._wr)
        #: receives posted to the SRQ as this pool counts them (pyverbs cannot say):
        #: every buffer but those a flush or a failed repost kept out
        self.posted = 0
        self.users = 0
        self.closed = False
        self.limit_events = 0
        self.grown = 0
        #: the limit event is armed (not while the pool is at its cap)
        self.armed = False
        self.srq.set_limit_handler(self._on_limit, loop)
        self._grow(self.step)
        self._arm()

    @property
    def count(self) -> int:
        return len(self.table)

    @property
    def registered_bytes(self) -> int:
        return sum(r.length for r, _, _ in self.steps)

    def _view(self, slot: int) -> memoryview:
        for region, first, n in self.steps:
            if first <= slot < first + n:
                off = (slot - first) * self.size
                return region.view[off : off + self.size]
        raise IndexError(f"receive buffer {slot} is not in the pool")

    def _wr(self, slot: int) -> RecvWR:
        return RecvWR(RECV_TAG | slot, [SGE(self.table.addr(slot), self.size, self.table.lkey(slot))])

    def _grow(self, n: int) -> bool:
        n = min(n, self.max_slots - len(self.table))
        if n <= 0 or self.closed:
            return False
        region = Region(self.pd.reg_mr(n * self.size, Access.LOCAL_WRITE))
        first = self.table.add(region.addr, region.lkey, n)
        self.steps.append((region, first, n))
        self.srq.post_recv([self.wrs[s] for s in range(first, first + n)])
        self.posted += n
        self.grown += 1
        return True

    def _arm(self) -> None:
        """Arm the limit event at a quarter of the buffers; the device checks it only
        when a receive is taken, so a count already below it is acted on now. (At its
        limit the pool arms nothing: its senders meet RNR NAKs and wait.)"""
        if self.closed or self.count >= self.cap:
            self.armed = False
            return
        limit = max(1, self.count // 4)
        self.srq.arm_limit(limit)
        self.armed = True
        if self.posted < limit:
            self._on_limit(self.srq)

    @property
    def cap(self) -> int:
        """The most buffers the pool grows to now: a step, plus :data:`SRQ_SHARE_BYTES` of
        buffers per connection, at most ``max_slots``. An SRQ keeps what it grew to while
        connections use it, so a burst must not leave more pinned per idle connection."""
        return min(self.max_slots, self.step + self.users * SRQ_SHARE_BYTES // self.size)

    def rearm(self) -> None:
        """Arm the limit event again if the pool may grow (its cap rose)."""
        self._arm()

    def _on_limit(self, srq: SharedReceiveQueue) -> None:
        """``IBV_EVENT_SRQ_LIMIT_REACHED``: the receivers are close to running dry:
        double the buffers (up to :attr:`cap`) and re-arm."""
        if self.closed:
            return
        self.limit_events += 1
        try:
            self._grow(min(max(self.step, self.count), self.cap - self.count))
        except RDMAError as e:
            log.warning("the shared receive queue could not grow: %s", e)
        self._arm()

    def repost(self, slot: int) -> None:
        """Buffer ``slot`` is free again (its message was copied out, or a flush
        returned it): back to the SRQ."""
        if self.closed:
            return
        try:
            self.srq.post_recv(self.wrs[slot])
        except RDMAError as e:
            self.posted -= 1
            log.debug("repost to the shared receive queue failed: %s", e)

    def lost(self) -> None:
        """A receive taken from the SRQ will not come back (its repost failed in the core)."""
        self.posted -= 1

    def leave(self) -> None:
        """A connection's queue pair is destroyed: the last one's leaving
        destroys the SRQ (every queue pair that used it is gone) and
        deregisters the buffers."""
        self.users -= 1
        if self.users <= 0:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        _forget(self)
        try:
            self.srq.set_limit_handler(None)
        except Exception:  # pragma: no cover
            pass
        try:
            self.srq.close()
        except RDMAError as e:
            # a queue pair still takes from it (its connection was not torn down):
            # the SRQ and its buffers stay until the device closes
            log.warning("the shared receive queue stays: %s", e)
            return
        self.views.clear()
        self.wrs.clear()
        for region, _, _ in self.steps:
            try:
                region.close()
            except Exception as e:  # pragma: no cover
                log.debug("deregistering receive buffers: %s", e)
        self.steps.clear()
        self.table.truncate(0)

    def stats(self) -> dict[str, int]:
        attr = self.srq.query() if not self.closed else None
        return {
            "buffers": self.count,
            "posted": self.posted,
            "registered_bytes": self.registered_bytes,
            "regions": len(self.steps),
            "users": self.users,
            "limit_events": self.limit_events,
            "cap": self.cap,
            "srq_limit": attr.srq_limit if attr is not None else 0,
            "max_wr": self.srq.max_wr,
        }


def _key(pd: ProtectionDomain, loop: asyncio.AbstractEventLoop, kind: str, size: int) -> tuple[int, int, str, int]:
    return (id(pd), id(loop), kind, size)


def _forget(pool: SendPool | ReceivePool) -> None:
    kind = "send" if isinstance(pool, SendPool) else "recv"
    key = _key(pool.pd, pool.loop, kind, pool.size)
    if _POOLS.get(key) is pool:
        del _POOLS[key]


def send_pool(
    device: DeviceContext, pd: ProtectionDomain, loop: asyncio.AbstractEventLoop, size: int, table_cls: Any
) -> SendPool:
    """The send pool of ``pd`` (on ``device``), ``loop`` and buffer ``size`` (made on
    first use), with one more user."""
    key = _key(pd, loop, "send", size)
    pool = _POOLS.get(key)
    if pool is None or pool.closed:
        pool = _POOLS[key] = SendPool(device, pd, loop, size, table_cls)
    pool.users += 1
    assert isinstance(pool, SendPool)
    return pool


def receive_pool(
    device: DeviceContext, pd: ProtectionDomain, loop: asyncio.AbstractEventLoop, size: int, table_cls: Any
) -> ReceivePool:
    """The shared receive queue of ``pd`` (on ``device``), ``loop`` and buffer ``size``
    (made on first use), with one more user."""
    key = _key(pd, loop, "recv", size)
    pool = _POOLS.get(key)
    if pool is None or pool.closed:
        pool = _POOLS[key] = ReceivePool(device, pd, loop, size, table_cls)
    pool.users += 1
    if not pool.armed:  # (one more user raises its cap)
        pool.rearm()
    assert isinstance(pool, ReceivePool)
    return pool


def create_queue_pair(
    device: DeviceContext,
    pd: ProtectionDomain,
    loop: asyncio.AbstractEventLoop,
    cq: CompletionQueue,
    cap: QPCap,
    srq_size: int,
    table_cls: Any,
) -> tuple[QueuePair, ReceivePool | None]:
    """A connection's RC queue pair on ``cq``; with ``srq_size`` (a receive buffer
    size), created with the device's shared receive queue of that size, which
    is returned too (the connection is one more of its users)."""
    pool = receive_pool(device, pd, loop, srq_size, table_cls) if srq_size else None
    try:
        qp = pd.create_qp(cq, cq, cap, srq=pool.srq if pool is not None else None)
    except BaseException:
        if pool is not None:
            pool.leave()
        raise
    return qp, pool


def registered_memory(own: int, *pools: SendPool | ReceivePool | None) -> dict[str, int]:
    """What a connection's stats say of registered memory: ``own`` (its own
    registrations) and the shared ``pools`` it uses, whole and its share."""
    shared = share = users = 0
    for pool in pools:
        if pool is not None and not pool.closed:
            shared += pool.registered_bytes
            share += pool.registered_bytes // max(1, pool.users)
            users = max(users, pool.users)
    return {
        "srq": int(any(isinstance(p, ReceivePool) and not p.closed for p in pools)),
        "registered_bytes": own,
        "shared_registered_bytes": shared,
        "shared_pool_users": users,
        "registered_bytes_share": own + share,
    }


def pools_of(device: Any) -> list[SendPool | ReceivePool]:
    """The live pools of ``device`` (every protection domain and loop)."""
    return [p for p in list(_POOLS.values()) if p.device is device]
