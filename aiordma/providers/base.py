"""The verbs device interface every provider implements.

This is a narrow, Pythonic mirror of libibverbs (``ibv_*``): a *device
context* opens a port, allocates a *protection domain* (PD), registers
*memory regions* (MR, with an lkey for local use and an rkey for the peer),
creates *completion queues* (CQ) that may report to a *completion channel*
(a file descriptor that becomes readable when an armed CQ gets a completion),
*reliable-connected queue pairs* (RC QP) that move through the verbs
state machine RESET → INIT → RTR → RTS (→ ERR), and *shared receive queues*
(SRQ) that several queue pairs take their receive buffers from.

Two providers implement it: ``pyverbs`` (real devices: mlx5, irdma, kernel
Soft-RoCE rxe) and ``soft`` (a userspace RoCEv2 device speaking the real wire
format over UDP). Everything above this module is written once against it.

Names, values and enums are the verbs ones (``IBV_WC_REM_ACCESS_ERR`` = 10,
``IBV_WR_RDMA_WRITE_WITH_IMM`` = 1, ...), so they can be searched for. The
enums and the work requests and completions are :mod:`aiordma.verbs`'s (the
errors are named after them too), re-exported here.
"""

from __future__ import annotations

import abc
import ctypes
import dataclasses
import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import settings
from ..errors import DeviceNotFoundError, GIDError, InvalidWorkRequestError, MemoryRegistrationError

# the verbs' vocabulary, re-exported: the device interface speaks it, and the layers above
# and the providers import it from here (isort would split each `as` into a statement of its own)
# isort: off
from ..verbs import (
    ACCESS_ALL as ACCESS_ALL,
    AsyncEventType as AsyncEventType,
    MTU as MTU,
    SGE as SGE,
    WC_OPCODE_FOR_WR as WC_OPCODE_FOR_WR,
    WC_OPCODE_VALUES as WC_OPCODE_VALUES,
    WC_STATUS_VALUES as WC_STATUS_VALUES,
    WRITE_ACCESS as WRITE_ACCESS,
    Access as Access,
    PortState as PortState,
    QPState as QPState,
    RecvWR as RecvWR,
    SendFlags as SendFlags,
    SendWR as SendWR,
    WCFlags as WCFlags,
    WCOpcode as WCOpcode,
    WCStatus as WCStatus,
    WorkCompletion as WorkCompletion,
    WROpcode as WROpcode,
    mtu_bytes as mtu_bytes,
    mtu_from_bytes as mtu_from_bytes,
)
# isort: on

#: RoCEv2 UDP destination port (IANA; defined once, in settings, which parses soft addresses)
ROCE_V2_UDP_PORT = settings.ROCE_V2_PORT

# -------------------------------------------------------------- GID helpers ----


def gid_problem(entry: GIDEntry) -> str | None:
    """Why ``entry`` cannot be a connection's source GID, or None when it can.

    A link-local GID (fe80::/10: RoCE v1 and v2 entries derived from the
    interface's link-local IPv6 address) reaches no routed RoCEv2 peer, and a
    GID on no network device has no address for the IP header."""
    gid = bytes(entry.gid)
    if gid == bytes(16):
        return "the slot is empty (an all-zero GID)"
    if gid[0] == 0xFE and gid[1] & 0xC0 == 0x80:
        return "it is a link-local GID (fe80::/10), which no routed RoCEv2 peer can reach"
    if entry.gid_type == "RoCE v2" and entry.netdev is None and entry.ipv4 is None:
        return "no network device carries its address"
    return None


#: the order aiordma prefers a port's GIDs in, and why each is chosen: the one rule
#: behind choose_gid (over the usable GIDs) and DeviceContext.default_gid_index
GID_PREFERENCES: tuple[tuple[Callable[[GIDEntry], bool], str], ...] = (
    (lambda e: e.gid_type == "RoCE v2" and e.ipv4 is not None, "the first RoCE v2 GID with an IPv4 address"),
    (lambda e: e.gid_type == "RoCE v2", "the first RoCE v2 GID (IPv6: none carries an IPv4 address)"),
    (lambda e: True, "the first usable GID"),
)


def preferred_gid(entries: list[GIDEntry]) -> tuple[GIDEntry, str] | None:
    """The entry :data:`GID_PREFERENCES` puts first, and why (None: no entries)."""
    for wanted, why in GID_PREFERENCES:
        for e in entries:
            if wanted(e):
                return e, why
    return None


def choose_gid(device: str, port_num: int, table: list[GIDEntry], index: int | None) -> tuple[GIDEntry, str]:
    """The source GID of a connection on ``device`` port ``port_num`` whose GID
    table is ``table``, and why: ``index`` (the caller's or ``AIORDMA_GID_INDEX``)
    when it can carry RoCEv2 traffic, else a :class:`~aiordma.errors.GIDError`
    naming a usable index; with ``index`` None, the first RoCE v2 GID with an
    IPv4 address, else the first usable RoCE v2 GID, else the first usable GID."""
    usable = [e for e in table if gid_problem(e) is None]

    def suggestion() -> str:
        preferred = preferred_gid(usable)
        if preferred is None:
            return f"{device} port {port_num} has no usable GID (is its network interface up, with an address?)"
        best = preferred[0]
        where = f"{best.ipv4 or gid_str(best.gid)}" + (f" on {best.netdev}" if best.netdev else "")
        return f"use GID index {best.index} ({best.gid_type}, {where}): gid_index={best.index} or AIORDMA_GID_INDEX={best.index}"

    if index is None:
        preferred = preferred_gid(usable)
        if preferred is None:
            raise GIDError(suggestion())
        best, why = preferred
        return best, why if best.gid_type == "RoCE v2" else f"{why} ({best.gid_type})"
    entry = next((e for e in table if e.index == index), None)
    if entry is None:
        raise GIDError(f"{device} port {port_num} has no GID at index {index}; {suggestion()}")
    problem = gid_problem(entry)
    if problem is not None:
        raise GIDError(
            f"GID index {index} of {device} port {port_num} ({gid_str(entry.gid)}) cannot be used: {problem}; {suggestion()}"
        )
    return entry, f"GID index {index}, as asked"


def gid_from_ipv4(ip: str) -> bytes:
    """The IPv4-mapped GID (``::ffff:a.b.c.d``) a RoCEv2 port uses for an IPv4 address."""
    return ipaddress.IPv6Address("::ffff:" + ip).packed


def gid_to_ipv4(gid: bytes) -> str | None:
    """The IPv4 address inside an IPv4-mapped GID, or None for any other GID."""
    mapped = ipaddress.IPv6Address(bytes(gid)).ipv4_mapped
    return str(mapped) if mapped is not None else None


def gid_is_loopback(gid: bytes) -> bool:
    """Whether a GID is a loopback address (IPv4-mapped 127.0.0.0/8, or ``::1``):
    packets to it never leave the host."""
    address = ipaddress.IPv6Address(bytes(gid))
    mapped = address.ipv4_mapped
    return (mapped if mapped is not None else address).is_loopback


def gid_str(gid: bytes) -> str:
    """A GID in the fully written form ibv_devinfo prints (8 groups of 4 hex digits)."""
    b = bytes(gid)
    return ":".join(b[i : i + 2].hex() for i in range(0, 16, 2))


def parse_gid(text: str | bytes) -> bytes:
    """A GID from 16 raw bytes, an IPv6 text form (``::ffff:10.0.0.1``) or an IPv4 address."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        b = bytes(text)
        if len(b) != 16:
            raise ValueError(f"a GID is 16 bytes, got {len(b)}")
        return b
    try:
        return ipaddress.IPv6Address(text).packed
    except ValueError:
        return gid_from_ipv4(str(ipaddress.IPv4Address(text)))


# ------------------------------------------------------------- attributes ----


@dataclass(slots=True)
class QPCap:
    """Queue sizes (``struct ibv_qp_cap``)."""

    max_send_wr: int = 128
    max_recv_wr: int = 128
    max_send_sge: int = 4
    max_recv_sge: int = 4
    max_inline_data: int = 0


@dataclass(slots=True)
class QPAttr:
    """Queue-pair attributes for ``modify``/``query`` (``struct ibv_qp_attr``
    plus the address vector). ``None`` means "leave as it is".

    ``dgid`` is the peer's GID (16 bytes); on RoCEv2 the IPv4-mapped address.
    ``dport``, ``path_mtu_bytes`` and ``skip_icrc`` are aiordma extensions for
    the soft device only: the peer's UDP port (RoCEv2 always uses 4791; a soft
    device may listen elsewhere), a path MTU in bytes beyond ``IBV_MTU_4096``
    ("jumbo", used only between two soft devices whose path allows it), and
    whether the QP's datagrams may leave their ICRC out and its received ones go
    unchecked (only between two soft devices on loopback that both offered it:
    :attr:`DeviceContext.skips_loopback_icrc`).
    """

    qp_state: QPState | None = None
    port_num: int = 1
    pkey_index: int = 0
    qp_access_flags: Access | None = None
    path_mtu: MTU | None = None
    dest_qp_num: int | None = None
    rq_psn: int | None = None
    sq_psn: int | None = None
    max_dest_rd_atomic: int | None = None
    max_rd_atomic: int | None = None
    min_rnr_timer: int | None = None
    timeout: int | None = None
    retry_cnt: int | None = None
    rnr_retry: int | None = None
    dgid: bytes | None = None
    sgid_index: int | None = None
    hop_limit: int = 64
    #: the GRH's traffic class: on RoCEv2, the IP header's DSCP << 2 | ECN
    traffic_class: int = 0
    #: the address vector's service level (RoCE: the priority the NIC maps to a VLAN PCP)
    service_level: int = 0
    #: the GRH's flow label (RoCEv2 over IPv6: the IPv6 flow label)
    flow_label: int = 0
    dport: int | None = None
    path_mtu_bytes: int | None = None
    skip_icrc: bool | None = None


@dataclass(slots=True)
class SRQAttr:
    """Shared-receive-queue attributes (``struct ibv_srq_attr``), as
    ``ibv_query_srq`` reports them. ``srq_limit`` is the armed limit, 0 when
    the SRQ is not armed (the limit event disarms it)."""

    max_wr: int
    max_sge: int
    srq_limit: int = 0


@dataclass(slots=True)
class PortAttr:
    """``struct ibv_port_attr`` (the fields aiordma uses)."""

    state: PortState
    max_mtu: MTU
    active_mtu: MTU
    link_layer: str = "Ethernet"
    gid_tbl_len: int = 1
    port_num: int = 1


@dataclass(slots=True)
class GIDEntry:
    """One entry of a port's GID table. ``gid_type`` is ``"RoCE v2"``,
    ``"RoCE v1"`` or ``"IB"``; ``ipv4`` is set for IPv4-mapped GIDs."""

    index: int
    gid: bytes
    gid_type: str = "RoCE v2"
    netdev: str | None = None

    @property
    def ipv4(self) -> str | None:
        return gid_to_ipv4(self.gid)

    def __str__(self) -> str:
        return gid_str(self.gid)


@dataclass(slots=True)
class DeviceAttr:
    """``struct ibv_device_attr`` (the fields aiordma uses), plus the provider name."""

    name: str
    provider: str
    fw_ver: str = ""
    node_guid: str = ""
    vendor_id: int = 0
    vendor_part_id: int = 0
    max_qp: int = 0
    max_qp_wr: int = 0
    max_sge: int = 0
    max_cq: int = 0
    max_cqe: int = 0
    max_mr: int = 0
    max_mr_size: int = 0
    max_qp_rd_atom: int = 0
    max_qp_init_rd_atom: int = 0
    max_srq: int = 0
    max_srq_wr: int = 0
    max_srq_sge: int = 0
    atomic_cap: str = "IBV_ATOMIC_HCA"
    phys_port_cnt: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------- objects ----


class MemoryRegion(abc.ABC):
    """Registered memory (``ibv_mr``): the device may DMA into or out of it.

    ``addr`` is the virtual address of the first byte (what SGEs and a peer's
    RDMA requests name), ``lkey`` authorises local use in SGEs, ``rkey`` is
    what a peer presents in RETH/AtomicETH to reach it with the access rights
    in ``access``. ``view`` is a writable memoryview of the bytes.
    """

    addr: int
    length: int
    lkey: int
    rkey: int
    access: Access

    @property
    @abc.abstractmethod
    def view(self) -> memoryview: ...

    def sge(self, offset: int = 0, length: int | None = None) -> SGE:
        """An SGE for ``length`` bytes at ``offset`` in this region."""
        if length is None:
            length = self.length - offset
        if offset < 0 or length < 0 or offset + length > self.length:
            raise ValueError(f"SGE [{offset}, {offset + length}) outside MR of {self.length} bytes")
        return SGE(self.addr + offset, length, self.lkey)

    @abc.abstractmethod
    def close(self) -> None:
        """Deregister (``ibv_dereg_mr``)."""

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} addr=0x{self.addr:x} len={self.length} "
            f"lkey=0x{self.lkey:x} rkey=0x{self.rkey:x} access={Access(self.access)!s}>"
        )


class CompletionChannel(abc.ABC):
    """``ibv_comp_channel``: a file descriptor that becomes readable when a CQ
    armed with :meth:`CompletionQueue.req_notify` receives a completion.

    ``fd_mode`` says how the fd was obtained: ``"native"`` (pyverbs exposes
    it), ``"discovered"`` (found in /proc/self/fd, pyverbs < 57) or
    ``"eventfd"`` (soft device).

    Verbs let one channel serve many CQs (``ibv_get_cq_event`` names the CQ
    that fired); ``shareable`` says whether this provider can tell them apart.
    The completion dispatch shares one channel per device and event loop where
    it can, so thousands of connections need not hold an fd each.
    """

    fd_mode: str = "native"
    #: one channel may serve many CQs (pyverbs' ``get_cq_event`` takes the CQ it
    #: expects, so a pyverbs channel serves one)
    shareable: bool = False
    #: the poll window (µs) the completion dispatcher uses on this channel when the
    #: application asks for none (``AIORDMA_SPIN_US`` unset): None = the global default
    default_spin_us: float | None = None
    #: ``expect_traffic()``, when a device provides it: called after each post and
    #: completion, it tells the device that traffic for this channel's loop is coming
    #: (the native soft engine then lets the loop receive for a while: see
    #: ``NativeEngine.attach_loop``). None: nothing to tell (hardware).
    expect_traffic: Callable[[], None] | None = None

    @abc.abstractmethod
    def fileno(self) -> int: ...

    @abc.abstractmethod
    def get_cq_event(self) -> CompletionQueue | None:
        """``ibv_get_cq_event`` without blocking: the CQ that fired, or None if
        no event is pending. Each event must be acked with ``cq.ack_events``."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def set_direct_handler(self, handler: Callable[[CompletionQueue], None] | None) -> bool:
        """Ask to have ``handler(cq)`` called instead of the fd becoming readable
        when ``cq``'s event is raised on the calling thread (the event loop's).

        A device whose "NIC" runs on the event loop's thread (the soft device
        with loop assist) can then hand completions over without a system call
        or a trip through the selector. Events raised on other threads still
        go through the fd. Returns False when the device cannot do this
        (hardware: the kernel raises the event). ``None`` removes the handler.
        """
        return False


class CompletionQueue(abc.ABC):
    """``ibv_cq``: where work completions (CQEs) are delivered."""

    cqe: int
    channel: CompletionChannel | None

    def c_verbs(self) -> tuple[Any, Any] | None:
        """``(capsule, handle)`` when this CQ can be polled from C (see
        :meth:`QueuePair.c_verbs`), else None."""
        return None

    def set_drain_handler(self, handler: Callable[[], Any] | None) -> bool:
        """Where the device raises this CQ's completion events on the event loop's
        own thread (the channel's direct handler, :meth:`CompletionChannel.set_direct_handler`),
        call ``handler()`` for them instead: whoever polls this CQ is told at once,
        with no dispatch by channel in between. False where the device has no such
        path (every hardware device: events come through the channel's fd)."""
        return False

    @abc.abstractmethod
    def poll(self, num_entries: int = 16) -> list[WorkCompletion]:
        """``ibv_poll_cq``: up to ``num_entries`` completions, oldest first."""

    @abc.abstractmethod
    def req_notify(self, solicited_only: bool = False) -> None:
        """``ibv_req_notify_cq``: arm the CQ so the next completion fires one
        event on its channel. Poll again after arming: a completion that
        arrived before arming fires no event (the lost-wakeup rule)."""

    @abc.abstractmethod
    def ack_events(self, n: int) -> None:
        """``ibv_ack_cq_events``."""

    @abc.abstractmethod
    def close(self) -> None: ...


def check_srq_limit(limit: int, max_wr: int) -> int:
    """``limit`` if ``ibv_modify_srq(IBV_SRQ_LIMIT)`` accepts it for an SRQ of
    ``max_wr`` WQEs (0 disarms, else 1 .. max_wr), else ``ValueError``."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"the SRQ limit is an int, not {type(limit).__name__}")
    if not 0 <= limit <= max_wr:
        raise ValueError(
            f"SRQ limit {limit}: expected 0 (disarm) .. max_wr {max_wr} (IBV_SRQ_LIMIT may not exceed the SRQ)"
        )
    return limit


def srq_qp_post_recv_error(qp_num: int) -> InvalidWorkRequestError:
    """What ``post_recv`` on a queue pair created with an SRQ raises (verbs: EINVAL)."""
    return InvalidWorkRequestError(
        f"post_recv on QP 0x{qp_num:06x}: it takes its receives from a shared receive queue "
        "(created with srq=, IBV_QPT_RC with ibv_qp_init_attr.srq set) and has no receive queue of its own: "
        "post them to the SRQ (ibv_post_srq_recv)"
    )


#: ``handler(srq)`` of :meth:`SharedReceiveQueue.set_limit_handler`
LimitHandler = Callable[["SharedReceiveQueue"], None]


class SharedReceiveQueue(abc.ABC):
    """A shared receive queue (``ibv_srq``): receive work requests that every
    queue pair created with it (``create_qp(..., srq=srq)``) takes its
    receives from, instead of a receive queue of its own.

    A SEND (or RDMA Write with immediate) arriving at any of those queue pairs
    consumes the SRQ's oldest receive WQE; its completion lands on the receive
    CQ of the queue pair that consumed it, with the ``wr_id`` posted here and
    that queue pair's ``qp_num``. With the SRQ empty the responder answers RNR
    NAK, as with an empty receive queue (the sender retries after its
    ``min_rnr_timer``, up to ``rnr_retry`` times). A queue pair entering
    IBV_QPS_ERR flushes only a receive it had already taken (a message in
    progress), never the SRQ's: the SRQ keeps them for the other queue pairs.

    **The limit event** (``IBV_EVENT_SRQ_LIMIT_REACHED``). :meth:`arm_limit`
    (``ibv_modify_srq`` with ``IBV_SRQ_LIMIT``) arms it: when the responder
    takes a WQE and fewer than ``limit`` remain posted, the device raises the
    event once and disarms (``query().srq_limit`` reads 0 again); re-arm to
    hear of the next time. The limit is checked when a WQE is taken (as rxe
    does), so arming an SRQ that already holds fewer than the limit raises
    nothing until the next receive consumes one. The event reaches Python
    through the device's async-event fd, never by polling: see
    :meth:`set_limit_handler`.
    """

    #: the receive work requests it holds: what the device granted, which may be more than
    #: asked for (kernel rxe rounds 32 up to 63)
    max_wr: int
    #: the SGEs each receive work request may have
    max_sge: int

    @abc.abstractmethod
    def post_recv(self, wrs: RecvWR | Sequence[RecvWR]) -> None:
        """``ibv_post_srq_recv``: queue receive work requests (in order) for any
        of the SRQ's queue pairs. Raises
        :class:`~aiordma.errors.InvalidWorkRequestError` (SRQ full, too many
        SGEs, a bad lkey or a region without ``IBV_ACCESS_LOCAL_WRITE``) before
        the failing request; those before it are posted."""

    @abc.abstractmethod
    def arm_limit(self, limit: int) -> None:
        """``ibv_modify_srq(IBV_SRQ_LIMIT)``: raise ``IBV_EVENT_SRQ_LIMIT_REACHED``
        once when the count of posted receive WQEs drops below ``limit``
        (1 .. ``max_wr``), then disarm; 0 disarms. ``ValueError`` outside that range."""

    @abc.abstractmethod
    def query(self) -> SRQAttr:
        """``ibv_query_srq``: the capacity and the armed limit (0: not armed)."""

    @abc.abstractmethod
    def set_limit_handler(self, handler: LimitHandler | None, loop: Any = None) -> None:
        """Call ``handler(srq)`` each time this SRQ's limit event fires.

        It runs on ``loop``'s thread (an asyncio event loop; default: the running
        loop), as a callback of that loop: the device's async-event fd is
        watched with ``loop.add_reader`` and the handler is called from there,
        or through ``loop.call_soon_threadsafe`` when another loop watching the
        same device read the event. Never on a NIC thread, never while the
        device holds a lock: it may post receives to this SRQ and re-arm it
        (``srq.post_recv(...); srq.arm_limit(n)``), which is what a message
        layer refilling its receive buffers does. An exception it raises goes
        to the loop's exception handler. Arm after setting the handler: an
        event read while the SRQ has none is dropped, as an application
        ignoring an ``ibv_get_async_event`` result would. ``None`` removes
        the handler (and the reader, once no SRQ of the device needs it)."""

    def c_verbs(self) -> tuple[Any, Any] | None:
        """``(capsule, handle)`` when receives can be posted to this SRQ from C
        (``aiordma/cverbs.h``: ``post_srq_recv``), else None."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """``ibv_destroy_srq``. Refused with :class:`~aiordma.errors.ResourceBusyError`
        (EBUSY) while queue pairs created with it are alive; the receive WQEs
        still posted are dropped (no completion: verbs flush nothing on destroy)."""


class QueuePair(abc.ABC):
    """A reliable-connected queue pair (``ibv_qp``, IBV_QPT_RC)."""

    qp_num: int
    cap: QPCap

    @property
    def error_reason(self) -> str | None:
        """Why the QP went to IBV_QPS_ERR, when the provider knows (the soft device
        does: "rkey 0x... does not grant REMOTE_WRITE"); None otherwise."""
        return None

    @property
    @abc.abstractmethod
    def state(self) -> QPState: ...

    @abc.abstractmethod
    def modify(self, attr: QPAttr) -> None:
        """``ibv_modify_qp`` to ``attr.qp_state`` with the attributes that
        transition needs; raises :class:`QueuePairStateError` on an illegal
        transition or missing attribute."""

    # the caller's QPAttr is never modified: it may be a template reused for many QPs
    def to_init(self, attr: QPAttr) -> None:
        self.modify(dataclasses.replace(attr, qp_state=QPState.IBV_QPS_INIT))

    def to_rtr(self, attr: QPAttr) -> None:
        self.modify(dataclasses.replace(attr, qp_state=QPState.IBV_QPS_RTR))

    def to_rts(self, attr: QPAttr) -> None:
        self.modify(dataclasses.replace(attr, qp_state=QPState.IBV_QPS_RTS))

    def to_error(self) -> None:
        """Move to IBV_QPS_ERR: outstanding work requests are flushed."""
        self.modify(QPAttr(qp_state=QPState.IBV_QPS_ERR))

    def c_verbs(self) -> tuple[Any, Any] | None:
        """``(capsule, handle)`` when this QP can be posted to from C (``aiordma/cverbs.h``:
        the capsule holds the provider's function table, ``handle`` is what its calls
        take), else None: the compiled core then posts through :meth:`post_send`."""
        return None

    @abc.abstractmethod
    def post_send(self, wrs: SendWR | Sequence[SendWR]) -> None:
        """``ibv_post_send``: queue the WRs and ring the doorbell."""

    @abc.abstractmethod
    def post_recv(self, wrs: RecvWR | Sequence[RecvWR]) -> None:
        """``ibv_post_recv``. A queue pair created with an SRQ has no receive
        queue of its own: posting to it raises
        :class:`~aiordma.errors.InvalidWorkRequestError` (post to the SRQ)."""

    @abc.abstractmethod
    def query(self) -> QPAttr: ...

    @abc.abstractmethod
    def close(self) -> None:
        """``ibv_destroy_qp``."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} qpn=0x{self.qp_num:06x} {self.state.name}>"


class ProtectionDomain(abc.ABC):
    """``ibv_pd``: memory regions and queue pairs of one PD may be used together."""

    @abc.abstractmethod
    def reg_mr(self, buffer: Any, access: Access = Access.LOCAL_WRITE) -> MemoryRegion:
        """``ibv_reg_mr``. ``buffer`` is a writable buffer-protocol object
        (bytearray, mmap, writable memoryview, numpy array: registered in place,
        zero copy) or an ``int`` length (the provider allocates)."""

    @abc.abstractmethod
    def create_qp(
        self,
        send_cq: CompletionQueue,
        recv_cq: CompletionQueue,
        cap: QPCap | None = None,
        sq_sig_all: bool = False,
        srq: SharedReceiveQueue | None = None,
    ) -> QueuePair:
        """``ibv_create_qp`` (IBV_QPT_RC), in IBV_QPS_RESET. With ``srq`` (an SRQ
        of this protection domain) the queue pair takes its receives from it
        (``ibv_qp_init_attr.srq``): ``cap.max_recv_wr`` and ``max_recv_sge``
        are then ignored, and its own ``post_recv`` is refused."""

    @abc.abstractmethod
    def create_srq(self, max_wr: int, max_sge: int = 1, srq_limit: int = 0) -> SharedReceiveQueue:
        """``ibv_create_srq``: a shared receive queue of ``max_wr`` receive work
        requests of up to ``max_sge`` SGEs each. ``srq_limit`` > 0 arms the
        limit event at once (an ``ibv_modify_srq`` after the create: verbs'
        create ignores the limit)."""

    @abc.abstractmethod
    def close(self) -> None: ...


class DeviceContext(abc.ABC):
    """An opened RDMA device (``ibv_context``)."""

    name: str
    provider: str
    #: the port its connections use (one of several: ``open_device(..., port_num=2)``, ``"mlx5_0:2"``)
    port_num: int = 1
    #: the largest path MTU (bytes) this device offers toward another soft device
    #: beyond RoCE's 4096 ("jumbo", an aiordma extension); 0: none (every real device)
    soft_mtu: int = 0
    #: a soft device on a loopback address that may leave the ICRC out of its datagrams
    #: to another such device, and take theirs unchecked, when both offer it at the
    #: rendezvous (QPAttr.skip_icrc): nothing crosses a wire there. False: every real device
    skips_loopback_icrc: bool = False
    #: a soft device (native engine) whose large RDMA Reads to and from another process
    #: of this host may move by cross-memory attach (aiordma.providers.soft.cma): offered
    #: at the rendezvous and used only where the two processes can read each other
    cross_memory_attach: bool = False
    #: a soft device (native engine) whose packets to and from a soft device of another
    #: process of this host may go through a shared-memory link
    #: (aiordma.providers.soft.shm), and why not (None when they may)
    shared_memory_links: bool = False
    shared_memory_reason: str | None = "not a soft device"

    def shared_pd(self) -> ProtectionDomain:
        """The protection domain every aiordma connection on this device shares,
        so a region registered once works on all of them. Allocated on first use
        and owned by the device: it goes away with the device, not with a cache."""
        pd: ProtectionDomain | None = self.__dict__.get("_shared_pd")
        if pd is None:
            pd = self.__dict__["_shared_pd"] = self.alloc_pd()
        return pd

    @abc.abstractmethod
    def query_device(self) -> DeviceAttr: ...

    @abc.abstractmethod
    def query_port(self, port_num: int = 1) -> PortAttr: ...

    @abc.abstractmethod
    def query_gid_table(self, port_num: int = 1) -> list[GIDEntry]:
        """The port's populated GID entries (empty slots left out)."""

    def default_gid_index(self, port_num: int = 1) -> int:
        """The index aiordma uses (:func:`choose_gid`'s with no index asked for,
        :data:`GID_PREFERENCES` over the usable GIDs); where none is usable, the
        same order over them all (``aiordma devices`` still marks one)."""
        table = self.query_gid_table(port_num)
        preferred = preferred_gid([e for e in table if gid_problem(e) is None]) or preferred_gid(table)
        if preferred is None:
            raise DeviceNotFoundError(f"{self.name} port {port_num} has an empty GID table")
        return preferred[0].index

    def choose_gid(self, port_num: int = 1, index: int | None = None) -> tuple[GIDEntry, str]:
        """The source GID for a connection and why it was chosen: ``index``
        when it can carry RoCEv2 traffic, else a :class:`~aiordma.errors.GIDError`
        naming one that can; with ``index`` None, :meth:`default_gid_index`'s."""
        return choose_gid(self.name, port_num, self.query_gid_table(port_num), index)

    def query_gid(self, port_num: int = 1, index: int | None = None) -> GIDEntry:
        if index is None:
            index = self.default_gid_index(port_num)
        for e in self.query_gid_table(port_num):
            if e.index == index:
                return e
        raise DeviceNotFoundError(f"{self.name} port {port_num} has no GID at index {index}")

    @property
    def udp_port(self) -> int:
        """The UDP port peers send RoCEv2 packets to (4791 except for a soft
        device that listens elsewhere)."""
        return ROCE_V2_UDP_PORT

    def attach_event_loop(self, loop: Any) -> Callable[[], None] | None:
        """Let an asyncio loop drive this device's progress where that helps
        (the soft device processes its packets on the loop's thread). Returns a
        detach callable, or None when the device needs nothing (hardware)."""
        return None

    @abc.abstractmethod
    def registered_memory(self) -> dict[str, int]:
        """What this device has registered now: ``{"bytes": sum of the live
        memory regions' lengths, "regions": how many}`` (every protection
        domain; a region counts from ``reg_mr`` until its ``close``). The count
        is aiordma's own; on a kernel device ``rdma resource show mr`` gives the
        kernel's."""

    @abc.abstractmethod
    def alloc_pd(self) -> ProtectionDomain: ...

    @abc.abstractmethod
    def create_comp_channel(self) -> CompletionChannel: ...

    @abc.abstractmethod
    def create_cq(self, cqe: int, channel: CompletionChannel | None = None) -> CompletionQueue: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> DeviceContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def device_label(device: DeviceContext) -> str:
    """How metrics and counters name a device: ``provider:name``, and ``@ip:port`` for a
    soft device (a process may have several)."""
    label = f"{device.provider}:{device.name}"
    address = getattr(device, "address", None)
    if isinstance(address, tuple) and len(address) == 2:
        label += f"@{address[0]}:{address[1]}"
    return label


def buffer_address(buf: Any, writable: bool = True) -> tuple[int, memoryview]:
    """Virtual address and a byte view of a buffer-protocol object.

    With ``writable`` (a registration whose access lets anything write into
    it) the buffer must be writable; without, read-only buffers (``bytes``,
    read-only memoryviews and arrays) are accepted too: verbs allows a
    registration without ``IBV_ACCESS_LOCAL_WRITE`` as the source of sends,
    writes and remote reads. Raises :class:`MemoryRegistrationError` when the
    buffer is not C-contiguous (the device needs one contiguous range).
    """
    try:
        mv = memoryview(buf)
    except TypeError as e:
        raise MemoryRegistrationError(f"cannot register {type(buf).__name__}: not a buffer") from e
    if mv.readonly and writable:
        raise MemoryRegistrationError(
            f"cannot register a read-only {type(buf).__name__} with write access: the device must be able to "
            "write into it (use bytearray, mmap or a writable array, or register it without "
            "LOCAL_WRITE/REMOTE_WRITE/REMOTE_ATOMIC as a source only)"
        )
    if not mv.c_contiguous:
        raise MemoryRegistrationError("cannot register a non-contiguous buffer")
    mv = mv.cast("B")
    if mv.nbytes == 0:
        raise MemoryRegistrationError("cannot register an empty buffer")
    if not mv.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv)), mv
    return _readonly_address(mv), mv


class _PyBuffer(ctypes.Structure):
    """``Py_buffer`` (Include/pybuffer.h), to learn where a read-only buffer lives."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.py_object),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


def _readonly_address(mv: memoryview) -> int:
    """The address of a read-only buffer (ctypes' from_buffer wants a writable one)."""
    view = _PyBuffer()
    get = ctypes.pythonapi.PyObject_GetBuffer
    get.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
    get.restype = ctypes.c_int
    release = ctypes.pythonapi.PyBuffer_Release
    release.argtypes = [ctypes.POINTER(_PyBuffer)]
    release.restype = None
    if get(mv, ctypes.byref(view), 0) != 0:  # PyBUF_SIMPLE  # pragma: no cover - a memoryview always exports
        raise BufferError("cannot read the buffer's address")
    try:
        return int(view.buf or 0)
    finally:
        release(ctypes.byref(view))
