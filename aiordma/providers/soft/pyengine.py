"""The Python engine: ``wire.py`` + ``rc.py`` + ``nic.py`` behind the engine protocol.

The readable reference for what the soft device does (and the fallback when
the compiled engine is not built). A :class:`~.nic.SoftNIC` thread owns the
UDP socket and the timers and runs one sans-IO
:class:`~.rc.RCQueuePair` per queue pair (and one
:class:`~.srq.RCSharedReceiveQueue` per SRQ) under one lock; posting runs the
requester in the caller's thread under the same lock. Completions go into
:class:`PyCQ` objects, which tell the NIC (their event sink) when an armed CQ
must raise its channel's event; the NIC raises it after releasing its lock.
An SRQ's limit event goes into the engine's async-event queue
(:class:`PyAsyncEvents`, ``ibv_get_async_event``'s fd).
See :mod:`.engine` for the protocol.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import InvalidWorkRequestError, QueuePairStateError
from ..base import (
    Access,
    AsyncEventType,
    QPAttr,
    QPCap,
    QPState,
    RecvWR,
    SendWR,
    WorkCompletion,
    buffer_address,
)
from . import wire
from .faults import LinkFaults
from .nic import IcrcPolicy, SoftNIC
from .rc import Counters, RCQueuePair
from .srq import RCSharedReceiveQueue, srq_busy_error
from .trace import TraceEvent

__all__ = ["PyAsyncEvents", "PyCQ", "PyChannel", "PyEngine", "PyMR", "PyPD", "PyQP", "PySRQ"]

_SRQ_LIMIT_REACHED = int(AsyncEventType.IBV_EVENT_SRQ_LIMIT_REACHED)

_WRITE_RIGHTS = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC


def crc32_implementation() -> str:
    """Which CRC-32 the Python codec uses for the ICRC."""
    return "isa-l (python-isal)" if wire.crc32_module().startswith("isal") else "zlib"


class PyMR:
    """A registered region: a byte view of the caller's buffer, held while registered."""

    def __init__(self, pd: PyPD, buffer: Any, access: Access, lkey: int, rkey: int) -> None:
        self.access = Access(access)
        self.addr, self._view = buffer_address(buffer, writable=bool(self.access & _WRITE_RIGHTS))
        self._owner = buffer  # keep the memory alive while registered
        self.length = self._view.nbytes
        self.pd = pd
        self.lkey, self.rkey = lkey, rkey
        self._closed = False

    @property
    def view(self) -> memoryview:
        return self._view

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # under the NIC lock: the RC engines look regions up only while holding it
        with self.pd.engine.nic.lock:
            self.pd.forget(self)


class PyPD:
    """A protection domain: the MemoryTable the RC engines resolve keys in."""

    def __init__(self, engine: PyEngine) -> None:
        self.engine = engine
        self._by_lkey: dict[int, PyMR] = {}
        self._by_rkey: dict[int, PyMR] = {}

    def by_lkey(self, lkey: int) -> PyMR | None:
        return self._by_lkey.get(lkey)

    def by_rkey(self, rkey: int) -> PyMR | None:
        return self._by_rkey.get(rkey)

    def reg_mr(self, buffer: Any, access: Access, lkey: int, rkey: int) -> PyMR:
        mr = PyMR(self, buffer, access, lkey, rkey)
        with self.engine.nic.lock:
            self._by_lkey[lkey] = mr
            self._by_rkey[rkey] = mr
        return mr

    def forget(self, mr: PyMR) -> None:
        self._by_lkey.pop(mr.lkey, None)
        self._by_rkey.pop(mr.rkey, None)

    def mr_count(self) -> int:
        return len(self._by_lkey)

    def mr_bytes(self) -> int:
        return sum(mr.length for mr in self._by_lkey.values())

    def create_qp(
        self, qp_num: int, send_cq: PyCQ, recv_cq: PyCQ, cap: QPCap, sq_sig_all: bool, srq: PySRQ | None = None
    ) -> PyQP:
        return PyQP(self, qp_num, send_cq, recv_cq, cap, sq_sig_all, srq)

    def create_srq(self, srq_num: int, max_wr: int, max_sge: int) -> PySRQ:
        return PySRQ(self, srq_num, max_wr, max_sge)

    def close(self) -> None:
        for mr in list(self._by_lkey.values()):
            mr.close()
        self.engine._pds.discard(self)


class PyChannel:
    """A completion channel backed by an eventfd (a semaphore: readable exactly
    while events are queued). It serves any number of CQs: the queued events
    are the CQs that fired, oldest first."""

    def __init__(self) -> None:
        self._fd = os.eventfd(0, os.EFD_SEMAPHORE | os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._events: deque[PyCQ] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self._direct: Callable[[Any], None] | None = None
        self._direct_thread = 0

    def fileno(self) -> int:
        return self._fd

    def set_direct_handler(self, handler: Callable[[Any], None] | None) -> bool:
        """Events raised on this thread call ``handler(cq)`` instead of the eventfd.

        With loop assist the soft NIC receives on the event loop's thread, so
        a completion found there is handed to the dispatcher at once: no
        eventfd write, no selector round, no eventfd read."""
        self._direct = handler
        self._direct_thread = threading.get_ident() if handler is not None else 0
        return True

    def notify(self, cq: PyCQ) -> None:
        """Raise ``cq``'s event (called by the CQ once the NIC released its lock)."""
        direct = self._direct
        if direct is not None and threading.get_ident() == self._direct_thread:
            if cq.facade is not None:
                direct(cq.facade)
            return
        with self._lock:  # queued and signalled together: readable <=> an event is queued
            if self._closed:
                return
            try:
                os.eventfd_write(self._fd, 1)
            except OSError:
                return
            self._events.append(cq)

    def get_cq_event(self) -> Any:
        """The oldest event's CQ (as bound), or None. Asking an empty channel costs
        no system call; events of CQs unbound since are skipped."""
        with self._lock:
            while self._events:
                cq = self._events.popleft()
                try:
                    os.eventfd_read(self._fd)
                except BlockingIOError:  # pragma: no cover - every queued event was counted
                    pass
                if cq.facade is not None:
                    return cq.facade
            return None

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._events.clear()
                os.close(self._fd)


class PyCQ:
    """A completion queue the NIC writes into (:meth:`push`)."""

    def __init__(self, engine: PyEngine, cqe: int, channel: PyChannel | None) -> None:
        self.engine = engine
        self.cqe = cqe
        self.channel = channel
        self._entries: deque[WorkCompletion] = deque()
        self._armed = False
        self._lock = threading.Lock()
        self.overflows = 0
        #: what the channel's get_cq_event returns for this CQ's events
        self.facade: Any = None

    def bind(self, facade: Any) -> None:
        self.facade = facade

    def push(self, wc: WorkCompletion) -> bool:
        """Write a CQE. True when the channel's event must fire (the CQ was
        armed): the NIC calls :meth:`fire_event` after releasing its lock."""
        with self._lock:
            if len(self._entries) >= self.cqe:
                self.overflows += 1
            self._entries.append(wc)
            fire = self._armed
            self._armed = False
        tracer = self.engine.tracer
        if tracer is not None:
            tracer(TraceEvent.CQE, wc=wc)
        return fire and self.channel is not None

    def fire_event(self) -> None:
        if self.channel is not None:
            self.channel.notify(self)

    def poll(self, num_entries: int = 16) -> list[WorkCompletion]:
        entries = self._entries
        n = len(entries)  # the NIC only appends: these n are ours to take
        if n <= 1:
            return [entries.popleft()] if n and num_entries > 0 else []
        popleft = entries.popleft
        return [popleft() for _ in range(min(n, num_entries))]

    def req_notify(self, solicited_only: bool = False) -> None:
        with self._lock:
            self._armed = True

    def close(self) -> None:
        self.engine._cqs.discard(self)


class PyAsyncEvents:
    """The device's async-event queue (``ibv_get_async_event``): an eventfd (a
    semaphore) readable exactly while events are queued, each ``(type,
    element)``, the element named by number (an SRQ's srq_num). Filled under
    the NIC lock, read on the event loop under a lock of its own."""

    #: events kept while nobody reads them (then counted in ``dropped``)
    MAX = 4096

    def __init__(self) -> None:
        self._fd = os.eventfd(0, os.EFD_SEMAPHORE | os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._events: deque[tuple[int, int]] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self.dropped = 0

    def fileno(self) -> int:
        return self._fd

    def push(self, event_type: int, element: int) -> None:
        with self._lock:  # queued and signalled together: readable <=> an event is queued
            if self._closed:
                return
            if len(self._events) >= self.MAX:
                self.dropped += 1
                return
            try:
                os.eventfd_write(self._fd, 1)
            except OSError:
                return
            self._events.append((event_type, element))

    def get(self) -> tuple[int, int] | None:
        """The oldest event, or None (no system call when none is queued)."""
        with self._lock:
            if not self._events or self._closed:
                return None
            try:
                os.eventfd_read(self._fd)
            except BlockingIOError:  # pragma: no cover - every queued event was counted
                pass
            return self._events.popleft()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._events.clear()
                os.close(self._fd)


class PySRQ:
    """A shared receive queue: an :class:`RCSharedReceiveQueue` the responders of
    its QPs take from under the NIC lock; its limit event goes to the engine's
    :class:`PyAsyncEvents`."""

    def __init__(self, pd: PyPD, srq_num: int, max_wr: int, max_sge: int) -> None:
        self.pd = pd
        self.engine = pd.engine
        self.nic = pd.engine.nic
        self.srq_num = srq_num
        self.max_wr, self.max_sge = max_wr, max_sge
        self.rc = RCSharedReceiveQueue(srq_num, pd, max_wr, max_sge)
        self.rc.on_limit = self._on_limit
        self._closed = False
        with self.nic.lock:
            self.engine._srqs.add(self)

    def _on_limit(self, rc: RCSharedReceiveQueue) -> None:
        # (NIC lock held: the event is only queued; the loop reads it)
        self.engine.async_events.push(_SRQ_LIMIT_REACHED, self.srq_num)

    def post_recv(self, wrs: RecvWR | Sequence[RecvWR]) -> None:
        if isinstance(wrs, RecvWR):
            wrs = (wrs,)
        with self.nic.lock:
            if self._closed:
                raise InvalidWorkRequestError("post_srq_recv on a destroyed shared receive queue")
            rc = self.rc
            for wr in wrs:
                rc.post_recv(wr)

    def arm_limit(self, limit: int) -> None:
        with self.nic.lock:
            if self._closed:
                raise InvalidWorkRequestError("modify_srq on a destroyed shared receive queue")
            self.rc.arm(limit)

    def query(self) -> tuple[int, int, int]:
        with self.nic.lock:
            return self.max_wr, self.max_sge, self.rc.limit

    @property
    def limit_events(self) -> int:
        return self.rc.limit_events

    @property
    def users(self) -> int:
        return self.rc.users

    def __len__(self) -> int:
        return len(self.rc)

    def close(self) -> None:
        with self.nic.lock:
            if self._closed:
                return
            if self.rc.users:
                raise srq_busy_error(self.srq_num, self.rc.users)
            self._closed = True
            self.rc.clear()
            self.engine._srqs.discard(self)


class PyQP:
    """An RC queue pair: an :class:`RCQueuePair` the NIC routes packets to."""

    def __init__(
        self,
        pd: PyPD,
        qp_num: int,
        send_cq: PyCQ,
        recv_cq: PyCQ,
        cap: QPCap,
        sq_sig_all: bool,
        srq: PySRQ | None = None,
    ) -> None:
        self.pd = pd
        self.nic = pd.engine.nic
        self.qp_num = qp_num
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        self.tx_flow: wire.Flow | None = None
        self.peer_addr: tuple[str, int] | None = None
        self._closed = False
        with self.nic.lock:
            if srq is not None and srq._closed:
                raise QueuePairStateError("create_qp with a destroyed shared receive queue")
            self.rc = RCQueuePair(qp_num, pd, cap, sq_sig_all, srq.rc if srq is not None else None)
            self.rc.tracer = pd.engine.tracer
            self.nic.add_qp(self)

    @property
    def state(self) -> QPState:
        return self.rc.state

    @property
    def error_reason(self) -> str | None:
        return self.rc.error_reason

    @property
    def counters(self) -> dict[str, int]:
        return self.rc.counters.as_dict()

    def modify(
        self, attr: QPAttr, peer: tuple[str, int] | None, mtu_bytes: int | None, skip_icrc: bool = False
    ) -> None:
        if self._closed:
            raise QueuePairStateError("QP is destroyed")
        if skip_icrc:
            raise QueuePairStateError("the Python engine computes and checks every ICRC")
        nic = self.nic
        with nic.lock:
            if peer is not None:
                # the address vector's IP header fields (the kernel writes them on every datagram)
                self.tx_flow = wire.Flow(
                    nic.ip,
                    peer[0],
                    nic.port,
                    peer[1],
                    tclass=attr.traffic_class & 0xFF,
                    hop_limit=attr.hop_limit & 0xFF,
                )
                self.peer_addr = peer
            rc = self.rc
            rc.modify(attr, time.monotonic())
            if attr.qp_state == QPState.IBV_QPS_RTR:
                if mtu_bytes:
                    rc.mtu = mtu_bytes
                # keep about 2 MiB in flight whatever the MTU (the receiver's socket buffer is 8 MiB)
                rc.window_pkts = max(16, min(256, (2 << 20) // rc.mtu))
            nic.flush(self, time.monotonic())
        nic.fire_events()

    def post_send(self, wrs: SendWR | Sequence[SendWR]) -> None:
        if isinstance(wrs, SendWR):
            wrs = (wrs,)
        nic = self.nic
        with nic.lock:
            if self._closed:
                raise QueuePairStateError("post_send on a destroyed QP")
            now = time.monotonic()
            rc = self.rc
            tracer = rc.tracer
            for wr in wrs:
                rc.post_send(wr, now)
            if tracer is not None:
                tracer(TraceEvent.DOORBELL, qpn=self.qp_num, n=len(wrs))
            nic.flush(self, now)
            nic.timer_armed(rc.next_timer())
        nic.fire_events()

    def post_recv(self, wrs: RecvWR | Sequence[RecvWR]) -> None:
        if isinstance(wrs, RecvWR):
            wrs = (wrs,)
        nic = self.nic
        with nic.lock:
            if self._closed:
                raise QueuePairStateError("post_recv on a destroyed QP")
            rc = self.rc
            for wr in wrs:
                rc.post_recv(wr)
            nic.deliver_completions(self)  # a receive posted in IBV_QPS_ERR is flushed at once
        nic.fire_events()

    def query(self) -> QPAttr:
        with self.nic.lock:
            return self.rc.query()

    def close(self) -> None:
        if self._closed:
            return
        with self.nic.lock:
            self._closed = True
            self.nic.remove_qp(self.qp_num)
            self.rc.close()  # (an SRQ it took from may be destroyed now)


class PyEngine:
    """The Python engine of one soft device (see the module docstring)."""

    name = "python"

    def __init__(self, ip: str, port: int, *, icrc: str = IcrcPolicy.STRICT, capture: str | None = None) -> None:
        self.nic = SoftNIC(ip, port, icrc=icrc, capture=capture)
        self.ip, self.port = self.nic.ip, self.nic.port
        self.icrc_policy = icrc
        self.crc32 = crc32_implementation()
        self.tracer: Callable[..., None] | None = None
        self._pds: set[PyPD] = set()
        self._cqs: set[PyCQ] = set()
        self._srqs: set[PySRQ] = set()
        #: the async-event queue (SRQ limit events)
        self.async_events = PyAsyncEvents()

    @property
    def gso(self) -> bool:
        return self.nic.gso

    @gso.setter
    def gso(self, on: bool) -> None:
        self.nic.gso = bool(on)

    @property
    def gso_watch(self) -> int | None:
        """The netdev (ifindex) whose captures pause GSO batches, or None."""
        return self.nic.gso_watch

    @gso_watch.setter
    def gso_watch(self, ifindex: int | None) -> None:
        self.nic.watch_captures(ifindex)

    @property
    def gso_paused(self) -> bool:
        """Whether GSO batches are paused now: a capture listens on the watched netdev."""
        return bool(self.nic.gso_paused)

    @property
    def gro(self) -> bool:
        return bool(self.nic.gro)

    @property
    def faults(self) -> LinkFaults | None:
        return self.nic.faults

    @faults.setter
    def faults(self, faults: LinkFaults | None) -> None:
        with self.nic.lock:
            self.nic.faults = faults

    def counters(self) -> dict[str, int]:
        nic = self.nic
        with nic.lock:
            out = dict(nic.counters)
            for qp in nic.queue_pairs():
                for k, v in qp.rc.counters.as_dict().items():
                    out[k] = out.get(k, 0) + v
        return out

    @property
    def thread_alive(self) -> bool:
        return self.nic.thread_alive

    def transport_totals(self) -> dict[str, int]:
        nic = self.nic
        with nic.lock:
            out = {f.name: nic.closed_qp_counters.get(f.name, 0) for f in dataclasses.fields(Counters)}
            for qp in nic.queue_pairs():
                for k, v in qp.rc.counters.as_dict().items():
                    out[k] += v
        return out

    def live_objects(self) -> dict[str, int]:
        with self.nic.lock:
            return {
                "qps": self.nic.qp_count(),
                "mrs": sum(pd.mr_count() for pd in self._pds),
                "cqs": len(self._cqs),
                "srqs": len(self._srqs),
            }

    def registered_memory(self) -> dict[str, int]:
        with self.nic.lock:
            return {
                "bytes": sum(pd.mr_bytes() for pd in self._pds),
                "regions": sum(pd.mr_count() for pd in self._pds),
            }

    def async_fd(self) -> int:
        return self.async_events.fileno()

    def get_async_event(self) -> tuple[int, int] | None:
        return self.async_events.get()

    def has_qp(self, qp_num: int) -> bool:
        return self.nic.has_qp(qp_num)

    def alloc_pd(self) -> PyPD:
        pd = PyPD(self)
        self._pds.add(pd)
        return pd

    def create_channel(self) -> PyChannel:
        return PyChannel()

    def create_cq(self, cqe: int, channel: PyChannel | None) -> PyCQ:
        cq = PyCQ(self, cqe, channel)
        self._cqs.add(cq)
        return cq

    def set_tracer(self, tracer: Callable[..., None] | None) -> None:
        with self.nic.lock:
            self.tracer = tracer
            for qp in self.nic.queue_pairs():
                qp.rc.tracer = tracer

    def attach_loop(self, loop: Any) -> Callable[[], None] | None:
        return self.nic.attach_loop(loop)

    def close(self) -> None:
        self.nic.close()
        self.async_events.close()
