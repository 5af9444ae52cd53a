"""The soft device: a userspace RoCEv2 verbs device behind the base interface.

It has one port whose GID table holds the IPv4-mapped GID of the address its
UDP socket is bound to, an active MTU of 4096, and the usual verbs objects.
Memory regions are registered in place over caller memory (their ``addr`` is
the real virtual address), lkeys and rkeys are random 32-bit values, and
queue-pair numbers are random 24-bit values, so none of them can be guessed.
A shared receive queue (:class:`SoftSharedReceiveQueue`, ``ibv_srq``) is a
verbs object of the device only: nothing of it is on the wire. Its limit
event comes through the device's async-event fd (``ibv_get_async_event``),
which :class:`~aiordma.providers.async_events.AsyncEventDispatcher` watches
on the event loop.

Addressing: RoCEv2 sends to UDP port 4791 and the GID is the IPv4-mapped
address, so each soft device owns one ``IP:4791``. By default it binds the
first free loopback address 127.0.0.N:4791 (all of 127.0.0.0/8 is loopback
on Linux), so several processes on one host each get their own, and a kernel
rxe peer can reach one bound to a real interface address. Set
``AIORDMA_SOFT_ADDR=IP[:PORT]`` (or pass ``address=``) to choose.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import mmap
import secrets
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ... import settings
from ...errors import DeviceNotFoundError, MemoryRegistrationError, QueuePairStateError
from ..async_events import AsyncEventDispatcher
from ..base import (
    MTU,
    ROCE_V2_UDP_PORT,
    Access,
    CompletionChannel,
    CompletionQueue,
    DeviceAttr,
    DeviceContext,
    GIDEntry,
    LimitHandler,
    MemoryRegion,
    PortAttr,
    PortState,
    ProtectionDomain,
    QPAttr,
    QPCap,
    QPState,
    QueuePair,
    RecvWR,
    SendWR,
    SharedReceiveQueue,
    SRQAttr,
    WorkCompletion,
    check_srq_limit,
    gid_from_ipv4,
    gid_to_ipv4,
    mtu_bytes,
)
from . import gso, shm
from .engine import SoftEngine, choose_engine
from .faults import LinkFaults
from .gso import GsoRule
from .nic import IcrcPolicy

DEFAULT_PORT = ROCE_V2_UDP_PORT
#: path MTU between two soft devices on loopback (64 KiB writes take 2 packets, not 16)
JUMBO_MTU = 32768
#: the largest payload that still fits one UDP datagram with BTH+RETH+ImmDt+ICRC
MAX_SOFT_MTU = settings.MAX_SOFT_MTU
#: the soft device's limits (query_device): work requests of a queue, SGEs of one
MAX_QUEUE_WR = 16384
MAX_SGE = 32

_WRITE_RIGHTS = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC


#: buffers the device allocates itself from this size up are anonymous mappings
MMAP_THRESHOLD = 64 * 1024


def allocate(nbytes: int) -> Any:
    """A zeroed buffer of ``nbytes`` for a registration the device allocates
    (``reg_mr(size)``: a connection's receive and send buffers).

    Large ones are anonymous mappings rather than heap memory: a page costs
    memory only once it is touched (an idle connection's buffers cost next to
    nothing), and the whole mapping goes back to the system when the region is
    freed (freed heap memory stays with the process, and glibc's adaptive
    threshold moves later buffers of the same size onto the heap)."""
    if nbytes < MMAP_THRESHOLD:
        return bytearray(nbytes)
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class SoftMemoryRegion(MemoryRegion):
    """A memory region registered in place over the caller's buffer.

    Writable buffers may be registered with any access. A read-only buffer
    (``bytes``, a read-only memoryview or array) registers only without
    ``LOCAL_WRITE``, ``REMOTE_WRITE`` and ``REMOTE_ATOMIC``: the device then
    only reads it (a send or RDMA Write source, a target of remote reads)."""

    def __init__(self, pd: SoftProtectionDomain, buffer: Any, access: Access) -> None:
        access = Access(access)
        if access & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC) and not access & Access.LOCAL_WRITE:
            raise MemoryRegistrationError(
                "IBV_ACCESS_REMOTE_WRITE/REMOTE_ATOMIC require IBV_ACCESS_LOCAL_WRITE (verbs rule)"
            )
        if isinstance(buffer, int):
            if buffer <= 0:
                raise MemoryRegistrationError(f"cannot register {buffer} bytes")
            buffer = allocate(buffer)
        lkey, rkey = pd._new_keys()
        self._mr = pd._engine_pd.reg_mr(buffer, access, lkey, rkey)
        self.pd = pd
        self.addr, self.length = self._mr.addr, self._mr.length
        self.lkey, self.rkey, self.access = lkey, rkey, access
        pd._by_lkey[lkey] = self
        pd._by_rkey[rkey] = self
        self._closed = False

    @property
    def view(self) -> memoryview:
        return self._mr.view

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._mr.close()
        self.pd._by_lkey.pop(self.lkey, None)
        self.pd._by_rkey.pop(self.rkey, None)


class SoftProtectionDomain(ProtectionDomain):
    def __init__(self, device: SoftDevice) -> None:
        self.device = device
        self._engine_pd = device._engine.alloc_pd()
        self._by_lkey: dict[int, SoftMemoryRegion] = {}
        self._by_rkey: dict[int, SoftMemoryRegion] = {}

    def _new_keys(self) -> tuple[int, int]:
        """Random non-zero 32-bit lkey and rkey, unused in this PD (a peer cannot guess an rkey)."""
        while True:
            lkey, rkey = secrets.randbits(32), secrets.randbits(32)
            if lkey and rkey and lkey not in self._by_lkey and rkey not in self._by_rkey:
                return lkey, rkey

    def by_lkey(self, lkey: int) -> SoftMemoryRegion | None:
        return self._by_lkey.get(lkey)

    def by_rkey(self, rkey: int) -> SoftMemoryRegion | None:
        return self._by_rkey.get(rkey)

    def reg_mr(self, buffer: Any, access: Access = Access.LOCAL_WRITE) -> SoftMemoryRegion:
        return SoftMemoryRegion(self, buffer, access)

    def create_qp(
        self,
        send_cq: CompletionQueue,
        recv_cq: CompletionQueue,
        cap: QPCap | None = None,
        sq_sig_all: bool = False,
        srq: SharedReceiveQueue | None = None,
    ) -> SoftQueuePair:
        if not (
            isinstance(send_cq, SoftCompletionQueue)
            and isinstance(recv_cq, SoftCompletionQueue)
            and send_cq.device is self.device
            and recv_cq.device is self.device
        ):
            raise TypeError("the CQs of a soft QP must be CQs of the same soft device")
        if srq is not None and not (isinstance(srq, SoftSharedReceiveQueue) and srq.pd is self):
            raise TypeError("the SRQ of a soft QP must be an SRQ of the same protection domain (ibv_qp_init_attr.srq)")
        return SoftQueuePair(self, send_cq, recv_cq, cap or QPCap(), sq_sig_all, srq)

    def create_srq(self, max_wr: int, max_sge: int = 1, srq_limit: int = 0) -> SoftSharedReceiveQueue:
        return SoftSharedReceiveQueue(self, max_wr, max_sge, srq_limit)

    def close(self) -> None:
        for mr in list(self._by_lkey.values()):
            mr.close()
        self._engine_pd.close()


class SoftSharedReceiveQueue(SharedReceiveQueue):
    """A shared receive queue of the soft device (``ibv_srq``; see
    :class:`~aiordma.providers.base.SharedReceiveQueue`). ``srq_num`` is a
    random 24-bit number, unique on the device, that names it in async events."""

    def __init__(self, pd: SoftProtectionDomain, max_wr: int, max_sge: int, srq_limit: int) -> None:
        for name, value, top in (("max_wr", max_wr, MAX_QUEUE_WR), ("max_sge", max_sge, MAX_SGE)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise ValueError(f"ibv_create_srq: {name} must be 1 .. {top} on the soft device, not {value!r}")
        check_srq_limit(srq_limit, max_wr)
        self.pd = pd
        self.device = pd.device
        self.max_wr, self.max_sge = max_wr, max_sge
        srqs = self.device._srqs
        with self.device._srq_lock:
            while True:  # random, like QPNs
                num = secrets.randbits(24)
                if num and num not in srqs:
                    break
            self.srq_num = num
            self._srq = pd._engine_pd.create_srq(num, max_wr, max_sge)
            srqs[num] = self
        self.post_recv = self._srq.post_recv  # type: ignore[method-assign]
        self._closed = False
        if srq_limit:
            self.arm_limit(srq_limit)

    def post_recv(self, wrs: RecvWR | Sequence[RecvWR]) -> None:
        self._srq.post_recv(wrs)

    def arm_limit(self, limit: int) -> None:
        self._srq.arm_limit(limit)

    def query(self) -> SRQAttr:
        max_wr, max_sge, limit = self._srq.query()
        return SRQAttr(max_wr, max_sge, limit)

    def c_verbs(self) -> tuple[Any, Any] | None:
        get = getattr(self._srq, "c_verbs", None)  # (the native engine's SRQ has them)
        return None if get is None else get()

    def set_limit_handler(self, handler: LimitHandler | None, loop: Any = None) -> None:
        if self._closed and handler is not None:
            raise QueuePairStateError("set_limit_handler on a destroyed shared receive queue")
        self.device._async_events().set_handler(self, handler, loop)

    @property
    def limit_events(self) -> int:
        """How many times the limit event fired (the device counts them)."""
        return int(self._srq.limit_events)

    @property
    def users(self) -> int:
        """The queue pairs that take their receives from it now."""
        return int(self._srq.users)

    def __len__(self) -> int:
        """The receive work requests posted and not consumed yet."""
        return len(self._srq)

    def close(self) -> None:
        if self._closed:
            return
        self._srq.close()  # ResourceBusyError while QPs use it
        self._closed = True
        with self.device._srq_lock:
            self.device._srqs.pop(self.srq_num, None)
        dispatcher = self.device._dispatcher
        if dispatcher is not None:
            dispatcher.forget(self)

    def __repr__(self) -> str:
        state = " closed" if self._closed else f" {len(self)}/{self.max_wr}"
        return f"<SoftSharedReceiveQueue 0x{self.srq_num:06x}{state}>"


class _SoftAsyncSource:
    """The soft device's async-event fd for the dispatcher: the engine's queue,
    its SRQ numbers resolved to the device's SRQs (one destroyed since: None)."""

    def __init__(self, device: SoftDevice) -> None:
        self._engine = device._engine
        self._device = weakref.ref(device)

    def fileno(self) -> int:
        return int(self._engine.async_fd())

    def read_events(self) -> list[tuple[int, SharedReceiveQueue | None]]:
        out: list[tuple[int, SharedReceiveQueue | None]] = []
        device = self._device()
        get = self._engine.get_async_event
        while (event := get()) is not None:
            event_type, element = event
            srq = device._srqs.get(element) if device is not None else None
            out.append((event_type, srq))
        return out


class SoftCompletionChannel(CompletionChannel):
    """A completion channel backed by an eventfd: readable exactly while events
    are queued, like the kernel's. Any number of CQs may share it."""

    fd_mode = "eventfd"
    shareable = True

    def __init__(self, device: SoftDevice) -> None:
        self._ch = device._engine.create_channel()
        self._closed = False
        # the hot calls go straight to the engine's (no frame of this facade)
        self.get_cq_event = self._ch.get_cq_event  # type: ignore[method-assign]
        self.fileno = self._ch.fileno  # type: ignore[method-assign]
        # the native engine: no poll window by default (its NIC thread and the expect
        # window do better for less CPU), and the expect hook
        self.expect_traffic = getattr(self._ch, "expect_traffic", None)
        if self.expect_traffic is not None:
            self.default_spin_us = 0.0

    def fileno(self) -> int:
        return self._ch.fileno()

    def get_cq_event(self) -> SoftCompletionQueue | None:
        """The CQ whose event is next, or None (no system call when empty)."""
        cq: SoftCompletionQueue | None = self._ch.get_cq_event()
        return cq

    def set_direct_handler(self, handler: Callable[[CompletionQueue], None] | None) -> bool:
        return bool(self._ch.set_direct_handler(handler))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._ch.close()


class SoftCompletionQueue(CompletionQueue):
    def __init__(self, device: SoftDevice, cqe: int, channel: SoftCompletionChannel | None) -> None:
        self.device = device
        self.cqe = cqe
        self.channel = channel
        self._cq = device._engine.create_cq(cqe, channel._ch if channel is not None else None)
        self._cq.bind(self)
        self.events_acked = 0
        self.poll = self._cq.poll  # type: ignore[method-assign]
        self.req_notify = self._cq.req_notify  # type: ignore[method-assign]

    @property
    def overflows(self) -> int:
        """CQEs written while the CQ already held ``cqe`` entries (kept, and counted)."""
        return int(self._cq.overflows)

    def poll(self, num_entries: int = 16) -> list[WorkCompletion]:
        return self._cq.poll(num_entries)

    def req_notify(self, solicited_only: bool = False) -> None:
        self._cq.req_notify(solicited_only)

    def ack_events(self, n: int) -> None:
        self.events_acked += n

    def c_verbs(self) -> tuple[Any, Any] | None:
        get = getattr(self._cq, "c_verbs", None)  # (the native engine's CQ has them)
        return None if get is None else get()

    def set_drain_handler(self, handler: Callable[[], Any] | None) -> bool:
        set_handler = getattr(self._cq, "set_drain_handler", None)  # (the native engine's CQ)
        return bool(set_handler is not None and set_handler(handler))

    def close(self) -> None:
        # unbound: the engine's CQ and this one must not keep each other alive, and
        # an event still queued on the channel for it is skipped
        self._cq.bind(None)
        self._cq.close()


class SoftQueuePair(QueuePair):
    def __init__(
        self,
        pd: SoftProtectionDomain,
        send_cq: SoftCompletionQueue,
        recv_cq: SoftCompletionQueue,
        cap: QPCap,
        sq_sig_all: bool,
        srq: SoftSharedReceiveQueue | None = None,
    ) -> None:
        self.pd = pd
        self.device = pd.device
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        self.cap = cap
        #: the shared receive queue it takes its receives from (None: its own receive queue)
        self.srq = srq
        engine = self.device._engine
        while True:  # random: a peer cannot guess a QPN (1 is reserved for GSI)
            qpn = secrets.randbits(24)
            if qpn > 1 and not engine.has_qp(qpn):
                break
        self.qp_num = qpn
        self._qp = pd._engine_pd.create_qp(
            qpn, send_cq._cq, recv_cq._cq, cap, sq_sig_all, srq._srq if srq is not None else None
        )
        self.post_send = self._qp.post_send  # type: ignore[method-assign]
        self.post_recv = self._qp.post_recv  # type: ignore[method-assign]
        self._closed = False
        self._final_counters: dict[str, int] | None = None

    @property
    def state(self) -> QPState:
        return QPState(self._qp.state)

    @property
    def counters(self) -> dict[str, int]:
        """This QP's transport counters (the same names on both engines; after
        close, their last values)."""
        if self._final_counters is not None:
            return dict(self._final_counters)
        return self._qp.counters

    @property
    def error_reason(self) -> str | None:
        """Why the QP went to IBV_QPS_ERR (None if it did not)."""
        return self._qp.error_reason

    def modify(self, attr: QPAttr) -> None:
        if self._closed:
            raise QueuePairStateError("QP is destroyed")
        attr = dataclasses.replace(attr)  # the caller's QPAttr stays as it was
        peer = None
        jumbo = None
        if attr.qp_state == QPState.IBV_QPS_RTR:
            if attr.path_mtu is None:
                attr.path_mtu = MTU.IBV_MTU_4096
            if attr.dgid is not None:
                ip = gid_to_ipv4(attr.dgid)
                if ip is None:
                    raise QueuePairStateError(
                        "the soft device reaches peers by IPv4-mapped GID (::ffff:a.b.c.d); "
                        f"got {bytes(attr.dgid).hex()}"
                    )
                peer = (ip, attr.dport or DEFAULT_PORT)
                # the address vector, as query() reports it (the engine writes the IP fields)
                self._av = (attr.traffic_class, attr.hop_limit, attr.service_level, attr.flow_label)
            if attr.path_mtu_bytes:
                jumbo = int(attr.path_mtu_bytes)
                if not 256 <= jumbo <= self.device.soft_mtu:
                    raise QueuePairStateError(
                        f"path MTU of {jumbo} bytes: this soft device allows 256 .. {self.device.soft_mtu}"
                    )
            if attr.skip_icrc:
                if not self.device.skips_loopback_icrc:
                    raise QueuePairStateError(
                        f"skip_icrc: this soft device ({self.device.engine} engine at {self.device.address[0]}) "
                        "computes and checks every ICRC (only the native engine on a loopback address skips them)"
                    )
                if peer is None or not ipaddress.ip_address(peer[0]).is_loopback:
                    raise QueuePairStateError(f"skip_icrc toward {peer!r}: only toward a loopback address")
                self._qp.modify(attr, peer, jumbo, True)
                return
        self._qp.modify(attr, peer, jumbo)

    def post_send(self, wrs: SendWR | Sequence[SendWR]) -> None:
        self._qp.post_send(wrs)

    def use_cma(self, peer_pid: int, respond: bool) -> None:
        """Cross-memory attach toward the peer (:mod:`.cma`): with ``peer_pid``
        this QP copies the bytes of its large READs out of that process when the
        peer grants them; with ``respond`` it grants the peer's large READs.
        Only the native engine's QPs have it (:attr:`SoftDevice.cross_memory_attach`)."""
        use = getattr(self._qp, "use_cma", None)
        if use is None:
            raise QueuePairStateError(f"cross-memory attach: the {self.device.engine} engine has none")
        use(peer_pid, respond)

    def use_link(self, link_id: int, tx: bool) -> None:
        """Take the peer's packets from the shared-memory link ``link_id``
        (:mod:`.shm`) and, with ``tx``, send through it. Only the native engine's
        QPs have links (:attr:`SoftDevice.shared_memory_links`)."""
        use = getattr(self._qp, "use_link", None)
        if use is None:
            raise QueuePairStateError(f"shared-memory links: the {self.device.engine} engine has none")
        use(link_id, tx)

    def c_verbs(self) -> tuple[Any, Any] | None:
        get = getattr(self._qp, "c_verbs", None)  # (the native engine's QP has them)
        return None if get is None else get()

    def post_recv(self, wrs: RecvWR | Sequence[RecvWR]) -> None:
        self._qp.post_recv(wrs)

    def query(self) -> QPAttr:
        attr: QPAttr = self._qp.query()
        av = self.__dict__.get("_av")
        if av is not None:
            attr.traffic_class, attr.hop_limit, attr.service_level, attr.flow_label = av
        return attr

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._final_counters = dict(self._qp.counters)
        self._qp.close()


class SoftDevice(DeviceContext):
    """A userspace RoCEv2 device bound to ``ip:port`` (UDP).

    ``engine`` picks what does the NIC's work: ``"native"`` (compiled, no GIL)
    or ``"python"`` (the reference); default ``AIORDMA_SOFT_ENGINE``, else
    native when it is built. :attr:`engine` says which one runs and
    :attr:`engine_reason` why. ``mtu`` is the largest path MTU toward another
    soft device (default ``AIORDMA_SOFT_MTU``, else from the interface); two
    soft devices connect at the smaller of their limits.
    """

    provider = "soft"

    def __init__(
        self,
        address: str | None = None,
        *,
        name: str | None = None,
        icrc: str | None = None,
        capture: str | None = None,
        engine: str | None = None,
        mtu: int | None = None,
    ) -> None:
        if mtu is not None and not 256 <= mtu <= MAX_SOFT_MTU:
            raise ValueError(f"mtu must be from 256 to {MAX_SOFT_MTU} bytes, not {mtu!r}")
        icrc = icrc or settings.SOFT_ICRC.get()
        if icrc not in IcrcPolicy.ALL:
            raise ValueError(f"ICRC policy must be one of {IcrcPolicy.ALL}, not {icrc!r}")
        capture = capture or settings.SOFT_PCAP.get()
        address = address or settings.SOFT_ADDR.get()
        configured_mtu = settings.SOFT_MTU.get()  # (checked before anything is bound)
        #: which engine does the NIC's work: "native" or "python"
        self.engine, self.engine_reason = choose_engine(engine)
        self.tracer: Callable[..., None] | None = None
        self._engine: SoftEngine = _bind_engine(self.engine, address, icrc, capture)
        self.name = name or "soft0"
        self._gid = gid_from_ipv4(self._engine.ip)
        #: the MTU of the network interface that owns the bound address (None: unknown)
        self.netdev, self.netdev_mtu = netdev_of(self._engine.ip)
        #: the port's active MTU, as kernel rxe derives it from its netdev: the largest
        #: RoCE MTU that leaves room for the headers (1500 -> 1024, 9000 -> 4096)
        self.active_mtu = roce_mtu_for(self.netdev_mtu)
        #: what the kernel does to a UDP GSO batch on that netdev, and so whether
        #: this device batches there (:mod:`~aiordma.providers.soft.gso`)
        self.gso_rule: GsoRule = gso.learn(self._engine.ip, self.netdev)
        if not self.gso_rule.batching:
            self._engine.gso = False
        if self.gso_rule.pause_under_capture:
            self._engine.gso_watch = self.gso_rule.ifindex
        default_mtu = JUMBO_MTU if self._engine.ip.startswith("127.") else 4096
        if self.netdev_mtu is not None:
            default_mtu = max(mtu_bytes(self.active_mtu), min(default_mtu, self.netdev_mtu - ROCE_HEADROOM))
        if mtu is None:
            mtu = default_mtu if configured_mtu is None else configured_mtu
        #: largest path MTU (bytes) toward another soft device: 32 KiB on loopback
        #: (an aiordma extension, "jumbo"), else the port's RoCE MTU (at most what
        #: the interface carries). ``mtu=``, else AIORDMA_SOFT_MTU, overrides.
        self.soft_mtu = mtu
        #: the native engine on a loopback address offers to leave the ICRC out toward
        #: another soft device on loopback (AIORDMA_SOFT_SKIP_LOOPBACK_ICRC=0: it does not)
        self.skips_loopback_icrc = (
            self.engine == "native"
            and ipaddress.ip_address(self._engine.ip).is_loopback
            and settings.SOFT_SKIP_LOOPBACK_ICRC.get()
            and not capture  # (a capture shows every ICRC as it should be)
        )
        #: large READs between this device and a soft device of another process on this
        #: host may move by cross-memory attach (the native engine; AIORDMA_SOFT_CMA=0: not)
        self.cross_memory_attach = (
            self.engine == "native"
            and settings.SOFT_CMA.get()
            and not capture  # (a capture shows every READ's bytes, as a wire would carry them)
        )
        #: the packets between this device and a soft device of another process on this
        #: host may go through a shared-memory link (:mod:`.shm`; the native engine;
        #: AIORDMA_SOFT_SHM=0: not), and why not when they may not
        self.shared_memory_reason = self._shared_memory_reason(capture)
        self.shared_memory_links = self.shared_memory_reason is None
        self._closed = False
        #: the live SRQs by srq_num (what an async event names)
        self._srqs: weakref.WeakValueDictionary[int, SoftSharedReceiveQueue] = weakref.WeakValueDictionary()
        self._srq_lock = threading.Lock()
        self._dispatcher: AsyncEventDispatcher | None = None

    def _shared_memory_reason(self, capture: str | None) -> str | None:
        if self.engine != "native":
            return (
                f"the {self.engine} engine keeps UDP (the interpreted reference: its per-packet cost is "
                "Python's, not the system calls a link saves)"
            )
        if not settings.SOFT_SHM.get():
            return "AIORDMA_SOFT_SHM=0 turns them off"
        if capture:
            return "the device writes a capture (which shows every packet as the wire carries it)"
        if shm.offer(self._engine) is None:
            return "this kernel does not say its boot id or network namespace (two processes cannot tell they share a host)"
        return shm.kernel_reason()

    def shm_offer(self) -> tuple[str, int, int, int, int, int] | None:
        """What this device offers at the rendezvous for a shared-memory link
        (:func:`.shm.offer`), or None when links are off."""
        return shm.offer(self._engine) if self.shared_memory_links and not self._closed else None

    def shm_make(self, peer_pid: int, peer_device: int, peer_wakefd: int) -> tuple[int, int]:
        """The link toward a peer device (made now or before): ``(link id, memfd
        number)``; OSError with the reason when it cannot be made."""
        make = getattr(self._engine, "shm_make", None)
        if make is None or not self.shared_memory_links:
            raise OSError(f"shared-memory links are off: {self.shared_memory_reason}")
        result: tuple[int, int] = make(peer_pid, peer_device, peer_wakefd)
        return result

    def shm_attach(self, peer_pid: int, peer_device: int, link_id: int, memfd: int, wakefd: int) -> None:
        """Map the link a peer device made; OSError with the reason when it cannot."""
        attach = getattr(self._engine, "shm_attach", None)
        if attach is None or not self.shared_memory_links:
            raise OSError(f"shared-memory links are off: {self.shared_memory_reason}")
        attach(peer_pid, peer_device, link_id, memfd, wakefd)

    def capture_listening(self) -> bool:
        """Whether a packet capture (tcpdump, tshark, any ``AF_PACKET`` socket with a
        protocol) listens on this device's netdev now: where the netdev carries a
        GSO batch whole (:attr:`gso_rule`), batches pause meanwhile, so that the
        capture shows every packet as a wire would carry it."""
        return gso.capture_listeners(self.gso_rule.ifindex) > 0 if self.gso_rule.ifindex else False

    @property
    def nic(self) -> Any:
        """The Python engine's :class:`~.nic.SoftNIC` (its internals; the native engine has none)."""
        nic = getattr(self._engine, "nic", None)
        if nic is None:
            raise AttributeError(f"the {self.engine} engine has no Python NIC object")
        return nic

    @property
    def address(self) -> tuple[str, int]:
        """The (IP, UDP port) this device receives RoCEv2 packets on."""
        return self._engine.ip, self._engine.port

    @property
    def udp_port(self) -> int:
        return self._engine.port

    @property
    def icrc_policy(self) -> str:
        """How received ICRCs are checked (:class:`~.nic.IcrcPolicy`)."""
        return self._engine.icrc_policy

    @property
    def counters(self) -> dict[str, int]:
        """Device counters (like rxe's hw_counters): packets, drops by reason,
        and the transport counters summed over live QPs."""
        return self._engine.counters()

    @property
    def nic_thread_alive(self) -> bool:
        """Whether the soft NIC's thread runs: it receives every packet and runs the
        transport's timers, so a device without it serves nothing (a health check reads it)."""
        return not self._closed and bool(self._engine.thread_alive)

    @property
    def transport_totals(self) -> dict[str, int]:
        """The transport counters (``retransmits``, ``rnr_naks_sent``, ...) summed over every
        QP this device has had, closed ones included: unlike :attr:`counters`' (live QPs
        only) they never go down, as a Prometheus counter must not."""
        return self._engine.transport_totals()

    def live_objects(self) -> dict[str, int]:
        """How many QPs, memory regions, CQs and SRQs are alive on this device."""
        return self._engine.live_objects()

    def registered_memory(self) -> dict[str, int]:
        return self._engine.registered_memory()

    def _async_events(self) -> AsyncEventDispatcher:
        """The dispatcher of this device's async events (made on first use)."""
        with self._srq_lock:
            if self._dispatcher is None:
                if self._closed:
                    raise DeviceNotFoundError(f"{self.name} is closed")
                self._dispatcher = AsyncEventDispatcher(_SoftAsyncSource(self), self.name)
            return self._dispatcher

    @property
    def async_event_counts(self) -> dict[str, int]:
        """The async events read so far, by type (``IBV_EVENT_SRQ_LIMIT_REACHED``: ...)."""
        return dict(self._dispatcher.counts) if self._dispatcher is not None else {}

    @property
    def faults(self) -> LinkFaults | None:
        """Fault injection on the transmit path (tests only): a :class:`LinkFaults` or None."""
        faults: LinkFaults | None = self._engine.faults
        return faults

    @faults.setter
    def faults(self, faults: LinkFaults | None) -> None:
        if faults is not None and not isinstance(faults, LinkFaults):
            raise TypeError("device.faults takes a LinkFaults (or None)")
        self._engine.faults = faults

    @property
    def gso(self) -> bool:
        """Whether equal-size datagrams to one peer leave in one UDP GSO send: where
        :attr:`gso_rule` says each segment's ICRC is exact (``AIORDMA_SOFT_GSO=0``
        turns it off; it turns itself off when the kernel refuses). Setting it True
        forces batches where the rule was not learned."""
        return bool(self._engine.gso)

    @gso.setter
    def gso(self, on: bool) -> None:
        self._engine.gso = bool(on)

    @property
    def gso_paused(self) -> bool:
        """Whether batches are paused now because a capture listens on the netdev
        (as the last check found; :attr:`gso_rule` says where that applies)."""
        if self._engine.gso_watch is not None and self._engine.gso and self.capture_listening():
            return True
        return bool(self._engine.gso_paused)

    @property
    def gro(self) -> bool:
        """Whether the kernel hands the device a peer's GSO batch as one coalesced
        datagram (UDP_GRO), which the engine splits into its packets: one receive,
        on loopback no segmentation by the kernel, and each packet's index in the
        batch is the IP ID its ICRC was made for, so none is inferred
        (``AIORDMA_SOFT_GRO=0`` turns it off)."""
        return bool(getattr(self._engine, "gro", False))

    @property
    def local_delivery(self) -> bool:
        """Whether the packets between two queue pairs of this device — both ends
        in this process, e.g. a client and a server of one process — are handed
        over in memory (the native engine: the payload copied once, straight from
        the source region into the destination, no socket and no ICRC; the
        transport, its rkey checks and its completions are the same) instead of
        through the UDP socket (``AIORDMA_SOFT_LOCAL=0`` turns it off; the Python
        engine always uses the socket). Faults, a capture and a tracer send every
        packet through the socket."""
        return bool(getattr(self._engine, "local_delivery", False))

    @local_delivery.setter
    def local_delivery(self, on: bool) -> None:
        if hasattr(self._engine, "local_delivery"):
            self._engine.local_delivery = bool(on)

    def set_tracer(self, tracer: Any) -> None:
        """Install ``tracer(event, **fields)`` on the device and its QPs (the
        RDMA Write walk-through uses it)."""
        self.tracer = tracer
        self._engine.set_tracer(tracer)

    def attach_event_loop(self, loop: Any) -> Any:
        """Let the engine use ``loop``'s thread where that helps (the Python
        engine processes packets there; the NIC thread remains the backstop).
        ``AIORDMA_SOFT_LOOP_ASSIST=0`` turns it off."""
        if not settings.SOFT_LOOP_ASSIST.get() or self._closed:
            return None
        return self._engine.attach_loop(loop)

    def query_device(self) -> DeviceAttr:
        return DeviceAttr(
            name=self.name,
            provider="soft",
            fw_ver=f"aiordma-soft ({self.engine} engine)",
            max_qp=1 << 16,
            max_qp_wr=MAX_QUEUE_WR,
            max_sge=MAX_SGE,
            max_cq=1 << 16,
            max_cqe=1 << 20,
            max_mr=1 << 20,
            max_mr_size=1 << 40,
            max_qp_rd_atom=128,  # (what kernel rxe allows: RXE_MAX_QP_RD_ATOM)
            max_qp_init_rd_atom=128,
            max_srq=1 << 16,
            max_srq_wr=MAX_QUEUE_WR,
            max_srq_sge=MAX_SGE,
            extra={
                "address": f"{self._engine.ip}:{self._engine.port}",
                "icrc": self._engine.icrc_policy,
                "soft_mtu": self.soft_mtu,
                "engine": self.engine,
                "engine_reason": self.engine_reason,
                "crc32": self._engine.crc32,
                "gso": self.gso_rule.describe(),
            },
        )

    def query_port(self, port_num: int = 1) -> PortAttr:
        if port_num != 1:
            raise DeviceNotFoundError(f"{self.name} has one port (1), not {port_num}")
        return PortAttr(PortState.IBV_PORT_ACTIVE, MTU.IBV_MTU_4096, self.active_mtu, "Ethernet", 1, 1)

    def query_gid_table(self, port_num: int = 1) -> list[GIDEntry]:
        self.query_port(port_num)
        return [
            GIDEntry(
                0, self._gid, "RoCE v2", netdev=self.netdev or ("lo" if self._engine.ip.startswith("127.") else None)
            )
        ]

    def alloc_pd(self) -> SoftProtectionDomain:
        return SoftProtectionDomain(self)

    def create_comp_channel(self) -> SoftCompletionChannel:
        return SoftCompletionChannel(self)

    def create_cq(self, cqe: int, channel: CompletionChannel | None = None) -> SoftCompletionQueue:
        if channel is not None and not isinstance(channel, SoftCompletionChannel):
            raise TypeError("the channel belongs to another device")
        return SoftCompletionQueue(self, cqe, channel)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._dispatcher is not None:  # (its fd leaves the loops before it is closed)
                self._dispatcher.close()
            self._engine.close()


def _engine_factory(engine: str) -> Callable[..., Any]:  # a SoftEngine (checked by the tests, not mypy)
    if engine == "native":
        from ._native._engine import NativeEngine

        return NativeEngine  # type: ignore[no-any-return,unused-ignore]
    from .pyengine import PyEngine

    return PyEngine


def _bind_engine(engine: str, address: str | None, icrc: str, capture: str | None) -> SoftEngine:
    make = _engine_factory(engine)
    if address:
        ip, port = settings.parse_soft_address(address)
        try:
            engine_: SoftEngine = make(ip, port, icrc=icrc, capture=capture)
            return engine_
        except OSError as e:
            raise DeviceNotFoundError(f"soft device cannot bind UDP {ip}:{port}: {e.strerror}") from e
    last: OSError | None = None
    for n in range(1, 255):
        try:
            bound: SoftEngine = make(f"127.0.0.{n}", DEFAULT_PORT, icrc=icrc, capture=capture)
            return bound
        except OSError as e:
            last = e
            if e.errno != errno.EADDRINUSE:
                break
    raise DeviceNotFoundError(f"soft device found no free loopback address for UDP port 4791: {last}")


#: bytes an interface MTU must leave for IP, UDP, BTH, the extension headers and the
#: ICRC around a RoCE payload (kernel rxe's RXE_MAX_HDR_LENGTH)
ROCE_HEADROOM = 80
_SIOCGIFADDR = 0x8915
_SIOCGIFMTU = 0x8921


def roce_mtu_for(netdev_mtu: int | None) -> MTU:
    """The largest RoCE path MTU an interface of ``netdev_mtu`` bytes carries
    (unknown: 4096, RoCE's largest)."""
    if netdev_mtu is None:
        return MTU.IBV_MTU_4096
    room = netdev_mtu - ROCE_HEADROOM
    for mtu in (MTU.IBV_MTU_4096, MTU.IBV_MTU_2048, MTU.IBV_MTU_1024, MTU.IBV_MTU_512):
        if mtu_bytes(mtu) <= room:
            return mtu
    return MTU.IBV_MTU_256


def netdev_of(ip: str) -> tuple[str | None, int | None]:
    """The interface that owns IPv4 address ``ip`` and its MTU, or (None, None).

    A datagram bigger than the interface MTU leaves with DF set only as an
    error (EMSGSIZE), so the soft device sizes its packets from it, as kernel
    rxe sizes them from its netdev."""
    import fcntl
    import socket
    import struct

    if ip.startswith("127."):
        names = ["lo"]
    else:
        try:
            names = [name for _, name in socket.if_nameindex()]
        except OSError:
            return None, None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            req = struct.pack("256s", name.encode()[:15])
            try:
                if not ip.startswith("127."):
                    addr = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
                    if socket.inet_ntoa(addr[20:24]) != ip:
                        continue
                mtu = struct.unpack_from("i", fcntl.ioctl(s.fileno(), _SIOCGIFMTU, req), 16)[0]
            except OSError:
                continue
            return name, int(mtu)
    return None, None
