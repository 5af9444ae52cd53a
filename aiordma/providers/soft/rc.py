"""Reliable Connected (RC) transport: requester and responder, sans-IO.

This is the part of a RoCE NIC that turns work requests into packets and
packets into memory writes and completions. It does no I/O, owns no thread
and reads no clock: the caller feeds it work requests (:meth:`post_send`,
:meth:`post_recv`), packets (:meth:`receive`) and the time (``now``, seconds),
and collects what it produced:

* :meth:`transmit` → the packets to put on the wire (new requests within the
  window, retransmissions, responses and coalesced ACKs),
* :meth:`take_completions` → ``(is_recv, WorkCompletion)`` for the send or
  the receive CQ,
* :meth:`next_timer` → when :meth:`on_timer` must be called next.

The one RDMA Write that the docs follow step by step is, here:
``post_send`` builds the WQE (step 1; the doorbell, step 2, is the device
calling :meth:`transmit`), :meth:`_gather` reads the local buffer checked
against its lkey (step 3), ``_emit_request`` builds BTH+RETH (step 4, the
ICRC is added by the wire codec), the responder's :meth:`_check_rkey` checks
the rkey (step 6), ``_execute_write`` DMAs into the remote region (step 7)
and the ACK it queues completes the WQE in :meth:`_on_ack` (step 8, CQE).

Semantics follow the InfiniBand spec and Linux rxe: 24-bit PSNs that wrap,
segmentation by path MTU, go-back-N on NAK (PSN sequence error) or timeout
(``timeout`` → 4.096 µs × 2**timeout, ``retry_cnt`` retries, then
IBV_WC_RETRY_EXC_ERR), RNR NAK when no receive is posted (``rnr_retry``, 7 =
forever, then IBV_WC_RNR_RETRY_EXC_ERR), duplicate requests re-acknowledged,
receives taken from a shared receive queue when the QP has one (``srq``:
:mod:`.srq`; RNR NAK when it is empty, as with an empty receive queue),
READ and atomics answered again from saved responder resources (an atomic is
never executed twice), rkey/bounds/access checks answered with NAK remote
access error (→ IBV_WC_REM_ACCESS_ERR on the requester), and on error the QP
goes to IBV_QPS_ERR and every outstanding WR is flushed (IBV_WC_WR_FLUSH_ERR).
"""

from __future__ import annotations

import struct
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ...errors import InvalidWorkRequestError, QueuePairStateError
from ..base import (
    MTU,
    WC_OPCODE_FOR_WR,
    Access,
    QPAttr,
    QPCap,
    QPState,
    RecvWR,
    SendFlags,
    SendWR,
    WCFlags,
    WCOpcode,
    WCStatus,
    WorkCompletion,
    WROpcode,
    mtu_bytes,
    srq_qp_post_recv_error,
)
from . import wire
from .trace import TraceEvent
from .wire import Opcode, Packet, psn_add, psn_diff

_WITH_IMM = WCFlags.IBV_WC_WITH_IMM
# plain ints: IntFlag operators run Python code, the hot path tests bits on ints
_SIGNALED = int(SendFlags.IBV_SEND_SIGNALED)
_SOLICITED = int(SendFlags.IBV_SEND_SOLICITED)
_LOCAL_WRITE = int(Access.LOCAL_WRITE)
_NO_FLAGS = WCFlags(0)
_ATOMIC_FMT = struct.Struct("<Q" if sys.byteorder == "little" else ">Q")
_U64 = 0xFFFFFFFFFFFFFFFF
_SUCCESS = WCStatus.IBV_WC_SUCCESS
PSN_MASK = wire.PSN_MASK

#: request opcodes of a SEND/WRITE work request: (ONLY, FIRST, MIDDLE, LAST) packet
_REQUEST_CODES = {
    WROpcode.IBV_WR_SEND: (Opcode.SEND_ONLY, Opcode.SEND_FIRST, Opcode.SEND_MIDDLE, Opcode.SEND_LAST),
    WROpcode.IBV_WR_SEND_WITH_IMM: (
        Opcode.SEND_ONLY_WITH_IMMEDIATE, Opcode.SEND_FIRST, Opcode.SEND_MIDDLE, Opcode.SEND_LAST_WITH_IMMEDIATE,
    ),
    WROpcode.IBV_WR_RDMA_WRITE: (
        Opcode.RDMA_WRITE_ONLY, Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_MIDDLE, Opcode.RDMA_WRITE_LAST,
    ),
    WROpcode.IBV_WR_RDMA_WRITE_WITH_IMM: (
        Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE, Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_MIDDLE,
        Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE,
    ),
}  # fmt: skip


class Region(Protocol):
    """A registered memory region as the RC engine sees it."""

    addr: int
    length: int
    access: Access
    lkey: int
    rkey: int

    @property
    def view(self) -> memoryview: ...


class MemoryTable(Protocol):
    """The protection domain's memory regions, looked up by key."""

    def by_lkey(self, lkey: int) -> Region | None: ...

    def by_rkey(self, rkey: int) -> Region | None: ...


def timeout_seconds(code: int) -> float | None:
    """The local ACK timeout for the verbs ``timeout`` attribute (None = infinite)."""
    return None if code == 0 else 4.096e-6 * (1 << code)


#: the soft device's retransmit timer doubles with each retry that brought no
#: progress, up to this many times the local ACK timeout (TCP's RTO back-off):
#: ``retry_cnt=7`` then spans 127 timeouts instead of 8 (the default 67 ms:
#: 8.5 s instead of 0.54 s), so a peer stalled for seconds (a GC pause, SIGSTOP,
#: a VM migration) is not taken for dead, while a lost packet is still resent
#: after one timeout. Local policy only: nothing of it is on the wire.
RETRY_BACKOFF_CAP = 32


def retry_backoff(retry_cnt: int, retries_left: int) -> int:
    """The multiple of the ACK timeout the next retry waits (1, 2, 4, ... capped)."""
    return min(1 << max(0, retry_cnt - retries_left), RETRY_BACKOFF_CAP)


# ------------------------------------------------------------ counters ----


@dataclass
class Counters:
    """Per-QP transport counters (summed into the device's, like rxe's hw counters)."""

    sent_pkts: int = 0
    rcvd_pkts: int = 0
    retransmits: int = 0
    timeouts: int = 0
    rnr_naks_sent: int = 0
    rnr_naks_rcvd: int = 0
    seq_naks_sent: int = 0
    seq_naks_rcvd: int = 0
    duplicate_requests: int = 0
    out_of_sequence: int = 0
    remote_access_errors: int = 0
    invalid_requests: int = 0
    dropped_responses: int = 0
    dropped_wrong_state: int = 0
    acks_sent: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


# --------------------------------------------------------------- WQEs ----

_READ_ATOMIC = (WROpcode.IBV_WR_RDMA_READ, WROpcode.IBV_WR_ATOMIC_CMP_AND_SWP, WROpcode.IBV_WR_ATOMIC_FETCH_AND_ADD)


@dataclass(slots=True)
class _SendWQE:
    wr: SendWR
    opcode: WROpcode
    length: int
    segments: list[memoryview]
    psn_first: int
    npkts: int  # PSNs this WQE occupies
    signaled: bool
    is_read_atomic: bool  # READ or atomic: completed by a response, not by an ACK
    psn_last: int
    # read/atomic progress: response packets (and bytes) received in order; a
    # retried READ asks only for the rest (the IBA read retry)
    resp_offset: int = 0
    resp_pkts: int = 0
    # READ: packets asked for so far. A READ longer than the send window is asked
    # for in window-sized requests, one at a time, so that no more than a window
    # of responses is ever on its way (a 256 MiB response burst overflows any
    # receiver's socket, and every retry of it would again)
    req_pkts: int = 0


@dataclass(slots=True)
class RecvWQE:
    """A posted receive work request, its SGEs resolved to memory: in a QP's
    receive queue or a shared receive queue (:mod:`.srq`)."""

    wr: RecvWR
    segments: list[memoryview]
    length: int


class ReceiveSource(Protocol):
    """Where a responder takes its receive WQEs from when it has no receive
    queue of its own: a shared receive queue (:class:`.srq.RCSharedReceiveQueue`)."""

    def __len__(self) -> int:
        """How many receive WQEs are posted."""

    def take(self) -> RecvWQE:
        """Remove and return the oldest (the caller checked that one is posted)."""

    def attach(self) -> None:
        """A queue pair starts taking its receives from it (ibv_create_qp with ``srq``)."""

    def detach(self) -> None:
        """That queue pair is destroyed."""


def resolve_segments(
    memory: MemoryTable, sg_list: Any, need: int, what: Callable[[], str]
) -> tuple[list[memoryview], int]:
    """Resolve SGEs to memory, checking each lkey and range (the NIC's lkey check).

    ``need``: access bits every region must grant (0 or LOCAL_WRITE);
    ``what()`` names the work request in errors."""
    segs: list[memoryview] = []
    total = 0
    by_lkey = memory.by_lkey
    for sge in sg_list:
        length = sge.length
        if length == 0:
            continue
        region = by_lkey(sge.lkey)
        if region is None:
            raise InvalidWorkRequestError(f"{what()}: lkey 0x{sge.lkey:08x} is not a memory region of this PD")
        off = sge.addr - region.addr
        if off < 0 or off + length > region.length:
            raise InvalidWorkRequestError(
                f"{what()}: SGE [0x{sge.addr:x}, +{length}) is outside MR lkey 0x{sge.lkey:08x} "
                f"[0x{region.addr:x}, +{region.length})"
            )
        if need and not (int(region.access) & need):
            raise InvalidWorkRequestError(
                f"{what()}: MR lkey 0x{sge.lkey:08x} lacks IBV_ACCESS_LOCAL_WRITE, which a receive/read target needs"
            )
        segs.append(region.view[off : off + length])
        total += length
    return segs, total


@dataclass(slots=True)
class _ReadResource:
    """Saved responder state for a READ or atomic, to answer duplicates."""

    psn: int
    npkts: int
    opcode: int
    va: int = 0
    rkey: int = 0
    length: int = 0
    orig: int = 0  # atomic result
    msn: int = 0


def _scatter(segments: list[memoryview], offset: int, data: Any) -> None:
    """Copy ``data`` into the concatenation of ``segments`` at ``offset``."""
    n = len(data)
    if not n:
        return
    src = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    if offset == 0 and len(segments) == 1 and n <= len(segments[0]):
        segments[0][:n] = src  # the common case: one receive buffer, from its start
        return
    pos = 0
    for seg in segments:
        sl = len(seg)
        if offset >= sl:
            offset -= sl
            continue
        take = min(sl - offset, n - pos)
        seg[offset : offset + take] = src[pos : pos + take]
        pos += take
        offset = 0
        if pos >= n:
            return


def _gather(segments: list[memoryview], offset: int, length: int) -> memoryview | bytes:
    """``length`` bytes at ``offset`` of the concatenated segments (zero-copy when in one segment)."""
    if length == 0:
        return b""
    for i, seg in enumerate(segments):
        sl = len(seg)
        if offset >= sl:
            offset -= sl
            continue
        if offset + length <= sl:
            return seg[offset : offset + length]
        parts = []
        need = length
        for s in segments[i:]:
            piece = s[offset : offset + need]
            parts.append(piece)
            need -= len(piece)
            offset = 0
            if need == 0:
                break
        return b"".join(parts)
    raise ValueError("gather past the end of the SGE list")


class RCQueuePair:
    """The transport state of one RC queue pair: requester and responder.

    ``memory`` resolves lkeys and rkeys to registered regions of the QP's
    protection domain. With ``srq`` the responder takes its receives from
    that shared receive queue (``ibv_qp_init_attr.srq``) and the QP has no
    receive queue: ``cap.max_recv_wr`` is ignored and :meth:`post_recv` is
    refused. All methods must be called by one thread at a time (the soft
    device holds its lock).
    """

    #: packets sent but not acknowledged before the requester stops (a NIC's send window)
    window_pkts = 256
    #: the requester asks for an ACK at least this often inside a long message
    ack_req_every = 32

    def __init__(
        self,
        qp_num: int,
        memory: MemoryTable,
        cap: QPCap | None = None,
        sq_sig_all: bool = False,
        srq: ReceiveSource | None = None,
    ) -> None:
        if srq is not None and self.__dict__.get("srq") is not srq:  # (a reset keeps its SRQ)
            srq.attach()
        self.qp_num = qp_num
        self.memory = memory
        self.cap = cap or QPCap()
        self.sq_sig_all = sq_sig_all
        #: the shared receive queue the responder takes its receives from (None: its own rq)
        self.srq = srq
        self.state = QPState.IBV_QPS_RESET
        self.counters = Counters()
        # attributes
        self.port_num = 1
        self.access = Access(0)
        self.path_mtu = MTU.IBV_MTU_1024
        self.mtu = 1024
        self.dest_qp_num = 0
        self.dgid: bytes | None = None
        self.dport: int | None = None
        self.sgid_index = 0
        self.timeout_code = 14
        self.timeout_s = timeout_seconds(14)  # the local ACK timeout in seconds (None: infinite)
        self.retry_cnt = 7
        self.rnr_retry = 7
        self.min_rnr_timer = 12
        self.max_rd_atomic = 16
        self.max_dest_rd_atomic = 16
        # requester
        self.sq: deque[_SendWQE] = deque()
        self.next_psn = 0  # PSN for the next posted WQE
        self.una_psn = 0  # oldest unacknowledged PSN
        self.cursor = 0  # index in sq of the next WQE to (re)transmit
        self.cursor_pkt = 0  # packet index inside sq[cursor]
        self.retries_left = 7
        self.rnr_retries_left = 7
        self.retransmit_deadline: float | None = None
        self.rnr_deadline: float | None = None
        self.rnr_psn: int | None = None  # PSN an RNR NAK told us to resend after rnr_deadline
        self.last_progress = 0.0
        self.sent_high = 0  # one past the highest PSN transmitted so far
        # the current go-back-N round resends [retry_from, retry_until); until it
        # makes progress, a NAK or implied NAK for a PSN it already resent crossed
        # the resend on the wire (a duplicated NAK, an ACK the responder sent before
        # our resent READ reached it) and must not start another round: otherwise a
        # duplicating or reordering link turns every NAK into a window of resends
        self.retry_from: int | None = None
        self.retry_until = 0
        # an error NAK that arrived while an earlier READ/atomic still lacked its
        # response: (psn, status, why), applied once that WQE has completed
        self.deferred_nak: tuple[int, WCStatus, str] | None = None
        # responder
        self.rq: deque[RecvWQE] = deque()
        self.epsn = 0
        self.msn = 0
        self.nak_sent = False
        self.ack_due: int | None = None  # PSN to acknowledge at the next transmit
        self.cur_recv: RecvWQE | None = None
        self.cur_recv_offset = 0
        self.cur_send_opcode: int | None = None  # SEND_FIRST/MIDDLE seen, waiting MIDDLE/LAST
        self.cur_write: tuple[Region, int, int, int] | None = None  # (region, offset, remaining, dma_len)
        self.cur_write_opcode: int | None = None
        self.resources: deque[_ReadResource] = deque()
        self.responses: list[Packet] = []
        # output
        self._completions: list[tuple[bool, WorkCompletion]] = []
        #: called with a human-readable reason when the QP enters IBV_QPS_ERR
        self.on_error: Callable[[str], None] | None = None
        self.error_reason: str | None = None
        #: optional tracer(event: TraceEvent, **fields) used by the RDMA Write walk-through
        self.tracer: Callable[..., None] | None = None

    # ------------------------------------------------------------ verbs ----
    _TRANSITIONS = {
        (QPState.IBV_QPS_RESET, QPState.IBV_QPS_INIT),
        (QPState.IBV_QPS_INIT, QPState.IBV_QPS_INIT),
        (QPState.IBV_QPS_INIT, QPState.IBV_QPS_RTR),
        (QPState.IBV_QPS_RTR, QPState.IBV_QPS_RTS),
        (QPState.IBV_QPS_RTS, QPState.IBV_QPS_RTS),
    }

    def modify(self, attr: QPAttr, now: float = 0.0) -> None:
        """``ibv_modify_qp``: validate the transition and take the attributes it needs."""
        new = attr.qp_state
        if new is None:
            raise QueuePairStateError("modify_qp needs qp_state")
        new = QPState(new)
        cur = self.state
        if new == QPState.IBV_QPS_ERR:
            self._enter_error("moved to IBV_QPS_ERR by modify_qp")
            return
        if new == QPState.IBV_QPS_RESET:
            hooks = self.on_error, self.tracer  # installed by the device, not QP state
            self.__init__(self.qp_num, self.memory, self.cap, self.sq_sig_all, self.srq)  # type: ignore[misc]
            self.on_error, self.tracer = hooks
            return
        if (cur, new) not in self._TRANSITIONS:
            raise QueuePairStateError(
                f"QP 0x{self.qp_num:06x}: illegal transition {cur.name} -> {new.name} "
                "(RC QPs go RESET -> INIT -> RTR -> RTS)"
            )
        if new == QPState.IBV_QPS_INIT:
            if attr.qp_access_flags is not None:
                self.access = Access(attr.qp_access_flags)
            self.port_num = attr.port_num
        elif new == QPState.IBV_QPS_RTR:
            missing = [n for n in ("dest_qp_num", "rq_psn", "dgid") if getattr(attr, n) is None]
            if missing:
                raise QueuePairStateError(f"INIT -> RTR needs {', '.join(missing)}")
            self.dest_qp_num = attr.dest_qp_num  # type: ignore[assignment]
            self.epsn = attr.rq_psn & wire.PSN_MASK  # type: ignore[operator]
            self.dgid = bytes(attr.dgid)  # type: ignore[arg-type]
            self.dport = attr.dport
            if attr.path_mtu is not None:
                self.path_mtu = MTU(attr.path_mtu)
                self.mtu = mtu_bytes(self.path_mtu)
            if attr.max_dest_rd_atomic is not None:
                self.max_dest_rd_atomic = attr.max_dest_rd_atomic
            if attr.min_rnr_timer is not None:
                self.min_rnr_timer = attr.min_rnr_timer & 0x1F
            if attr.sgid_index is not None:
                self.sgid_index = attr.sgid_index
            if attr.qp_access_flags is not None:
                self.access = Access(attr.qp_access_flags)
        elif new == QPState.IBV_QPS_RTS:
            if cur == QPState.IBV_QPS_RTR:
                if attr.sq_psn is None:
                    raise QueuePairStateError("RTR -> RTS needs sq_psn")
                self.next_psn = self.una_psn = self.sent_high = attr.sq_psn & wire.PSN_MASK
            for name in ("timeout", "retry_cnt", "rnr_retry", "max_rd_atomic"):
                v = getattr(attr, name)
                if v is not None:
                    setattr(self, "timeout_code" if name == "timeout" else name, v)
            self.timeout_s = timeout_seconds(self.timeout_code)
            self.retries_left = self.retry_cnt
            self.rnr_retries_left = self.rnr_retry
        self.state = new

    def query(self) -> QPAttr:
        return QPAttr(
            qp_state=self.state,
            port_num=self.port_num,
            qp_access_flags=self.access,
            path_mtu=self.path_mtu,
            dest_qp_num=self.dest_qp_num,
            rq_psn=self.epsn,
            sq_psn=self.next_psn,
            max_dest_rd_atomic=self.max_dest_rd_atomic,
            max_rd_atomic=self.max_rd_atomic,
            min_rnr_timer=self.min_rnr_timer,
            timeout=self.timeout_code,
            retry_cnt=self.retry_cnt,
            rnr_retry=self.rnr_retry,
            dgid=self.dgid,
            sgid_index=self.sgid_index,
            dport=self.dport,
        )

    def _segments(self, sg_list: Any, need: int, what: Callable[[], str]) -> tuple[list[memoryview], int]:
        """:func:`resolve_segments` in this QP's protection domain."""
        return resolve_segments(self.memory, sg_list, need, what)

    def close(self) -> None:
        """``ibv_destroy_qp``: let go of the shared receive queue (it may be destroyed
        once no queue pair uses it)."""
        srq, self.srq = self.srq, None
        if srq is not None:
            srq.detach()

    def post_send(self, wr: SendWR, now: float = 0.0) -> None:
        """``ibv_post_send`` of one WR: build the WQE (assign its PSNs)."""
        if self.state == QPState.IBV_QPS_ERR:
            self._complete(False, wr.wr_id, WCStatus.IBV_WC_WR_FLUSH_ERR, WC_OPCODE_FOR_WR.get(wr.opcode, 0))
            return
        if self.state != QPState.IBV_QPS_RTS:
            raise QueuePairStateError(
                f"post_send on QP 0x{self.qp_num:06x} in state {self.state.name}: the send queue works only in "
                "IBV_QPS_RTS (connect the QP first)"
            )
        if len(self.sq) >= self.cap.max_send_wr:
            raise InvalidWorkRequestError(f"send queue full ({self.cap.max_send_wr} WRs outstanding)")
        if len(wr.sg_list) > self.cap.max_send_sge:
            raise InvalidWorkRequestError(f"{len(wr.sg_list)} SGEs > max_send_sge {self.cap.max_send_sge}")
        try:
            op = wr.opcode if type(wr.opcode) is WROpcode else WROpcode(wr.opcode)
        except ValueError:
            raise InvalidWorkRequestError(f"unsupported send opcode {wr.opcode!r}") from None
        read_atomic = op in _READ_ATOMIC
        segs, length = self._segments(
            wr.sg_list, _LOCAL_WRITE if read_atomic else 0, lambda: f"{op.name} wr_id={wr.wr_id}"
        )
        if op in (WROpcode.IBV_WR_ATOMIC_CMP_AND_SWP, WROpcode.IBV_WR_ATOMIC_FETCH_AND_ADD):
            if length != 8:
                raise InvalidWorkRequestError(f"{op.name} needs one 8-byte local SGE for the old value, got {length}")
            npkts = 1
        elif op == WROpcode.IBV_WR_RDMA_READ:
            npkts = max(1, -(-length // self.mtu))
        else:
            if length > 1 << 31:
                raise InvalidWorkRequestError(f"message of {length} bytes exceeds the 2 GiB RC maximum")
            npkts = max(1, -(-length // self.mtu))
        signaled = self.sq_sig_all or bool(int(wr.send_flags) & _SIGNALED)
        psn = self.next_psn
        wqe = _SendWQE(wr, op, length, segs, psn, npkts, signaled, read_atomic, (psn + npkts - 1) & wire.PSN_MASK)
        self.next_psn = (psn + npkts) & wire.PSN_MASK
        self.sq.append(wqe)
        if self.tracer:
            self.tracer(TraceEvent.WQE, qpn=self.qp_num, wr=wr, psn=wqe.psn_first, npkts=npkts)

    def post_recv(self, wr: RecvWR) -> None:
        """``ibv_post_recv`` of one WR."""
        if self.srq is not None:
            raise srq_qp_post_recv_error(self.qp_num)
        if self.state == QPState.IBV_QPS_RESET:
            raise QueuePairStateError(f"post_recv on QP 0x{self.qp_num:06x} in IBV_QPS_RESET: move it to INIT first")
        if self.state == QPState.IBV_QPS_ERR:
            self._complete(True, wr.wr_id, WCStatus.IBV_WC_WR_FLUSH_ERR, WCOpcode.IBV_WC_RECV)
            return
        if len(self.rq) >= self.cap.max_recv_wr:
            raise InvalidWorkRequestError(f"receive queue full ({self.cap.max_recv_wr} WRs posted)")
        if len(wr.sg_list) > self.cap.max_recv_sge:
            raise InvalidWorkRequestError(f"{len(wr.sg_list)} SGEs > max_recv_sge {self.cap.max_recv_sge}")
        segs, length = self._segments(wr.sg_list, _LOCAL_WRITE, lambda: f"post_recv wr_id={wr.wr_id}")
        self.rq.append(RecvWQE(wr, segs, length))

    # ------------------------------------------------------- outputs ----
    def take_completions(self) -> list[tuple[bool, WorkCompletion]]:
        """The completions produced since the last call, oldest first: ``(is_recv, wc)``
        (the receive CQ's when ``is_recv``). Returns the (empty, shared) list
        without allocating when there are none: do not modify it."""
        out = self._completions
        if out:
            self._completions = []
        return out

    def next_timer(self) -> float | None:
        t = self.retransmit_deadline
        if self.rnr_deadline is not None and (t is None or self.rnr_deadline < t):
            t = self.rnr_deadline
        return t

    def _complete(
        self,
        is_recv: bool,
        wr_id: int,
        status: WCStatus,
        opcode: int,
        byte_len: int = 0,
        imm: int | None = None,
    ) -> None:
        wc = WorkCompletion(
            wr_id,
            status,
            opcode if type(opcode) is WCOpcode else WCOpcode(opcode),
            byte_len,
            self.qp_num,
            self.dest_qp_num,
            imm,
            _WITH_IMM if imm is not None else _NO_FLAGS,
        )
        self._completions.append((is_recv, wc))

    # ----------------------------------------------------- requester ----
    def _rd_atomic_outstanding(self) -> int:
        n = 0
        for i in range(self.cursor):
            if self.sq[i].is_read_atomic:
                n += 1
        if self.cursor < len(self.sq):  # a READ partly asked for has one request out
            wqe = self.sq[self.cursor]
            if wqe.req_pkts > wqe.resp_pkts:
                n += 1
        return n

    def _outstanding(self) -> bool:
        """Whether something was sent that awaits an ACK or a response."""
        if self.cursor or self.cursor_pkt:
            return True
        return bool(self.sq) and self.sq[0].req_pkts > self.sq[0].resp_pkts

    def transmit(self, now: float) -> list[Packet]:
        """Packets to send now: responder output first, then new/retransmitted requests."""
        out: list[Packet] = []
        if self.responses:
            out.extend(self.responses)
            self.responses = []
        if self.ack_due is not None:
            out.append(self._ack_packet(wire.AETH_ACK | wire.AETH_CREDITS_INVALID, self.ack_due))
            self.counters.acks_sent += 1
            self.ack_due = None
        if self.state == QPState.IBV_QPS_RTS and self.rnr_deadline is None:
            self._send_requests(now, out)
        self.counters.sent_pkts += len(out)
        return out

    def _ack_packet(self, syndrome: int, psn: int) -> Packet:
        return Packet(Opcode.ACKNOWLEDGE, self.dest_qp_num, psn, syndrome=syndrome, msn=self.msn)

    def _send_requests(self, now: float, out: list[Packet]) -> None:
        sq = self.sq
        rd_out = -1
        sent_any = False
        una = self.una_psn
        window = self.window_pkts
        while self.cursor < len(sq):
            wqe = sq[self.cursor]
            psn = (wqe.psn_first + self.cursor_pkt) & PSN_MASK
            if window <= (psn - una) & PSN_MASK < 0x800000:  # psn_diff(psn, una) >= window
                break
            if wqe.is_read_atomic:
                if wqe.req_pkts > wqe.resp_pkts:
                    break  # the READ's previous request is not answered yet
                if rd_out < 0:
                    rd_out = self._rd_atomic_outstanding()
                if rd_out >= max(1, self.max_rd_atomic):
                    break
                out.append(self._read_atomic_request(wqe, window))
                rd_out += 1
                if wqe.req_pkts >= wqe.npkts:
                    self.cursor += 1
                    self.cursor_pkt = 0
            else:
                out.append(self._emit_request(wqe, self.cursor_pkt, psn, now))
                self.cursor_pkt += 1
                if self.cursor_pkt >= wqe.npkts:
                    self.cursor += 1
                    self.cursor_pkt = 0
            sent_any = True
        if sent_any:
            cur = self._cursor_psn()
            if 0 < (cur - self.sent_high) & PSN_MASK < 0x800000:  # psn_diff(cur, sent_high) > 0
                self.sent_high = cur
            if self.retransmit_deadline is None:
                to = self.timeout_s
                self.retransmit_deadline = None if to is None else now + to
                self.last_progress = now

    def _emit_request(self, wqe: _SendWQE, idx: int, psn: int, now: float) -> Packet:
        """Build the idx-th packet of a SEND or WRITE WQE (BTH [+RETH] [+ImmDt] + payload)."""
        op = wqe.opcode
        n = wqe.npkts
        mtu = self.mtu
        off = idx * mtu
        length = wqe.length
        plen = min(mtu, length - off) if length else 0
        segs = wqe.segments
        if len(segs) == 1 and n == 1:
            payload: memoryview | bytes = segs[0]  # the whole message, in place
        else:
            payload = _gather(segs, off, plen)
        only, first, middle, last_code = _REQUEST_CODES[op]
        last = idx == n - 1
        wr = wqe.wr
        if n == 1:
            code = only
        elif idx == 0:
            code = first
        elif last:
            code = last_code
        else:
            code = middle
        every = self.ack_req_every
        pkt = Packet(
            code,
            self.dest_qp_num,
            psn,
            last or idx % every == every - 1,
            last and bool(int(wr.send_flags) & _SOLICITED),
            payload=payload,
        )
        if idx == 0 and (op == WROpcode.IBV_WR_RDMA_WRITE or op == WROpcode.IBV_WR_RDMA_WRITE_WITH_IMM):
            pkt.va, pkt.rkey, pkt.dma_len = wr.remote_addr, wr.rkey, length
        if last and (op == WROpcode.IBV_WR_SEND_WITH_IMM or op == WROpcode.IBV_WR_RDMA_WRITE_WITH_IMM):
            pkt.imm = (wr.imm_data or 0) & 0xFFFFFFFF
        if self.tracer:
            self.tracer(TraceEvent.LKEY_READ, qpn=self.qp_num, wqe=wqe, offset=off, length=plen)
            self.tracer(TraceEvent.PACKET_OUT, qpn=self.qp_num, pkt=pkt)
        return pkt

    def _read_atomic_request(self, wqe: _SendWQE, window: int) -> Packet:
        """The next request of a READ (at most ``window`` packets of it) or the atomic."""
        wr = wqe.wr
        if wqe.opcode == WROpcode.IBV_WR_RDMA_READ:
            # asks for the packets from the first one still missing (on a retry too:
            # the IBA read retry, what rxe's req_retry does) to the end of their
            # window-sized piece of the READ: a retry stays inside the range of the
            # request it repeats, which the responder checks against what it saved
            first = wqe.resp_pkts
            window = max(1, window)
            n = min(wqe.npkts, (first // window + 1) * window) - first
            wqe.req_pkts = first + n
            done = wqe.resp_offset
            return Packet(
                Opcode.RDMA_READ_REQUEST,
                self.dest_qp_num,
                (wqe.psn_first + first) & PSN_MASK,
                ack_req=True,
                va=(wr.remote_addr + done) & _U64,
                rkey=wr.rkey,
                dma_len=min(wqe.length - done, n * self.mtu),
            )
        wqe.req_pkts = 1
        code = Opcode.COMPARE_SWAP if wqe.opcode == WROpcode.IBV_WR_ATOMIC_CMP_AND_SWP else Opcode.FETCH_ADD
        return Packet(
            code,
            self.dest_qp_num,
            wqe.psn_first,
            ack_req=True,
            va=wr.remote_addr,
            rkey=wr.rkey,
            swap_add=(wr.swap if code == Opcode.COMPARE_SWAP else wr.compare_add) & _U64,
            compare=(wr.compare_add if code == Opcode.COMPARE_SWAP else 0) & _U64,
        )

    def _cursor_psn(self) -> int:
        """The PSN of the next packet the requester will (re)transmit."""
        if self.cursor < len(self.sq):
            wqe = self.sq[self.cursor]
            return psn_add(wqe.psn_first, wqe.req_pkts if wqe.is_read_atomic else self.cursor_pkt)
        return self.next_psn

    def _resent_in_round(self, psn: int) -> bool:
        """Whether ``psn`` was already retransmitted by the current go-back-N round."""
        if self.retry_from is None:
            return False
        return (
            psn_diff(psn, self.retry_from) >= 0
            and psn_diff(psn, self._cursor_psn()) < 0
            and psn_diff(psn, self.retry_until) < 0
        )

    def _rewind(self, psn: int, *, nak: bool = False) -> None:
        """Go back N: retransmit starting with the packet whose PSN is ``psn``.

        ``nak`` marks a rewind asked for by a (possibly implied) NAK: it is
        skipped when the current round has already resent ``psn``.
        """
        if nak and self._resent_in_round(psn):
            return
        sq = self.sq
        for i, wqe in enumerate(sq):
            d = psn_diff(psn, wqe.psn_first)
            if d < wqe.npkts:
                if i > self.cursor or (
                    i == self.cursor
                    and (wqe.req_pkts <= wqe.resp_pkts if wqe.is_read_atomic else max(d, 0) >= self.cursor_pkt)
                ):
                    return  # not sent yet: nothing to go back to
                self.cursor = i
                self.cursor_pkt = 0 if wqe.is_read_atomic else max(d, 0)
                # READs from here on are asked for again from their first missing packet
                for j in range(i, len(sq)):
                    w = sq[j]
                    if w.is_read_atomic:
                        w.req_pkts = w.resp_pkts
                self.counters.retransmits += 1
                self.retry_from = self._cursor_psn()
                self.retry_until = self.sent_high
                return

    def _retire_acked(self, psn: int, now: float) -> None:
        """Complete SEND/WRITE WQEs whose last PSN is <= ``psn`` (an ACK or implied ACK)."""
        sq = self.sq
        progressed = False
        while sq:
            wqe = sq[0]
            if wqe.is_read_atomic or 0 < (wqe.psn_last - psn) & PSN_MASK < 0x800000:  # psn_last > psn
                break
            sq.popleft()
            if self.cursor > 0:
                self.cursor -= 1
            else:  # rewound into this WQE: continue with the next one
                self.cursor_pkt = 0
            progressed = True
            if wqe.signaled:
                self._complete(False, wqe.wr.wr_id, _SUCCESS, WC_OPCODE_FOR_WR[wqe.opcode], wqe.length)
        nxt = (psn + 1) & PSN_MASK
        if 0 < (nxt - self.una_psn) & PSN_MASK < 0x800000:  # psn + 1 > una
            self.una_psn = nxt
            # moving una past a READ/atomic that still waits for its response is
            # no progress: that WQE is exactly where it was
            if not (sq and sq[0].is_read_atomic and psn_diff(psn, sq[0].psn_first) >= 0):
                progressed = True
        if progressed:
            self._progress(now)

    def _progress(self, now: float) -> None:
        self.retries_left = self.retry_cnt
        self.rnr_retries_left = self.rnr_retry
        self.retry_from = None  # progress ends the go-back-N round: the next NAK is news
        self.last_progress = now
        if self.sq and self._outstanding():
            to = self.timeout_s
            self.retransmit_deadline = None if to is None else now + to
        else:
            self.retransmit_deadline = None

    def _on_ack(self, pkt: Packet, now: float) -> None:
        kind = pkt.syndrome & 0x60  # wire.aeth_kind
        # an acknowledgement must name a PSN that was sent: [una-1, next_psn)
        # (in 24-bit PSN space: 0 <= psn - (una - 1) < next_psn - (una - 1))
        base = self.una_psn - 1
        if (pkt.psn - base) & PSN_MASK >= (self.next_psn - base) & PSN_MASK:
            self.counters.dropped_responses += 1
            return
        if kind == wire.AETH_ACK:
            # SEND/WRITEs up to pkt.psn are done (una moves even past a READ/atomic
            # still waiting for its response, so that those behind it retire as soon
            # as it completes)
            self._retire_acked(pkt.psn, now)
            if self.sq and self.sq[0].is_read_atomic:
                head = self.sq[0]
                if self.cursor > 0 and psn_diff(pkt.psn, head.psn_first) >= 0:
                    # an ACK past an outstanding READ/atomic means its response was lost
                    self._rewind(psn_add(head.psn_first, head.resp_pkts), nak=True)
                return
            if self.tracer:
                self.tracer(TraceEvent.ACK_IN, qpn=self.qp_num, pkt=pkt)
            return
        prev = psn_add(pkt.psn, -1)
        if kind == wire.AETH_RNR_NAK:
            if self.rnr_deadline is not None and self.rnr_psn == pkt.psn:
                return  # a duplicate of the RNR NAK we are already waiting out
            self.counters.rnr_naks_rcvd += 1
            self._retire_acked(prev, now)
            if self.rnr_retry != 7:
                if self.rnr_retries_left <= 0:
                    self._fail_head(
                        WCStatus.IBV_WC_RNR_RETRY_EXC_ERR, "RNR retry count exceeded: the peer posted no receive"
                    )
                    return
                self.rnr_retries_left -= 1
            # an RNR NAK is an answer: the responder is there and only short of
            # receives. The transport retry count is for a peer that does not
            # answer at all; without this, a responder that is both short of
            # receives and slow to answer (100 senders on one soft device) had
            # its senders' timeouts between RNR waits add up to RETRY_EXC_ERR.
            self.retries_left = self.retry_cnt
            self._rewind(pkt.psn)
            self.rnr_psn = pkt.psn
            self.rnr_deadline = now + wire.RNR_TIMER_US[pkt.syndrome & 0x1F] * 1e-6
            self.retransmit_deadline = None
            return
        code = pkt.syndrome & 0x1F
        if code == wire.NAK_PSN_SEQUENCE_ERROR:
            self.counters.seq_naks_rcvd += 1
            self._retire_acked(prev, now)
            self._rewind(pkt.psn, nak=True)
            return
        self._retire_acked(prev, now)
        status, why = {
            wire.NAK_INVALID_REQUEST: (WCStatus.IBV_WC_REM_INV_REQ_ERR, "the responder found the request invalid"),
            wire.NAK_REMOTE_ACCESS_ERROR: (
                WCStatus.IBV_WC_REM_ACCESS_ERR,
                "the responder refused the rkey, address range or access right",
            ),
            wire.NAK_REMOTE_OPERATIONAL_ERROR: (WCStatus.IBV_WC_REM_OP_ERR, "the responder failed the operation"),
        }.get(code, (WCStatus.IBV_WC_REM_INV_REQ_ERR, f"NAK code {code}"))
        if self.sq and self.sq[0].is_read_atomic and psn_diff(pkt.psn, self.sq[0].psn_last) > 0:
            # the responder answered the READ/atomic at the head before it failed a
            # later request, and that answer was lost (or is still on its way):
            # get it first, then fail the request the NAK names (rxe does the same)
            self.deferred_nak = (pkt.psn, status, why)
            head = self.sq[0]
            self._rewind(psn_add(head.psn_first, head.resp_pkts), nak=True)
            return
        self._fail_head(status, why)

    def _apply_deferred_nak(self) -> None:
        if self.deferred_nak is None or not self.sq:
            return
        psn, status, why = self.deferred_nak
        head = self.sq[0]
        if head.is_read_atomic and psn_diff(psn, head.psn_last) > 0:
            return  # another READ/atomic to wait for first
        self.deferred_nak = None
        self._fail_head(status, why)

    def _fail_head(self, status: WCStatus, why: str) -> None:
        if self.sq:
            wqe = self.sq.popleft()
            self.cursor = max(0, self.cursor - 1)
            self._complete(False, wqe.wr.wr_id, status, WC_OPCODE_FOR_WR[wqe.opcode])
        self._enter_error(f"{status.name}: {why}")

    def _on_read_response(self, pkt: Packet, now: float) -> None:
        sq = self.sq
        # responses are for READ/atomics sent: before the cursor, or the READ at the
        # cursor that is partly asked for
        limit = self.cursor
        if limit < len(sq) and sq[limit].req_pkts:
            limit += 1
        # responses imply that every earlier SEND/WRITE arrived
        head_idx = 0
        while head_idx < limit and not sq[head_idx].is_read_atomic:
            head_idx += 1
        if head_idx >= limit:
            self.counters.dropped_responses += 1
            return
        wqe = sq[head_idx]
        d = psn_diff(pkt.psn, wqe.psn_first)
        if d < 0 or d >= wqe.npkts:
            self.counters.dropped_responses += 1
            return
        if head_idx:
            self._retire_acked(psn_add(wqe.psn_first, -1), now)
        op = pkt.opcode
        if wqe.opcode == WROpcode.IBV_WR_RDMA_READ:
            if op not in (
                Opcode.RDMA_READ_RESPONSE_FIRST,
                Opcode.RDMA_READ_RESPONSE_MIDDLE,
                Opcode.RDMA_READ_RESPONSE_LAST,
                Opcode.RDMA_READ_RESPONSE_ONLY,
            ):
                self.counters.dropped_responses += 1
                return
            if d != wqe.resp_pkts:
                self.counters.dropped_responses += 1
                if d > wqe.resp_pkts:
                    # a response went missing: ask again for the rest, from the first missing PSN
                    self._rewind(psn_add(wqe.psn_first, wqe.resp_pkts), nak=True)
                return  # (d < resp_pkts: a duplicate of a response already placed)
            plen = len(pkt.payload)
            if wqe.resp_offset + plen > wqe.length:
                self._fail_head(WCStatus.IBV_WC_BAD_RESP_ERR, "read response longer than requested")
                return
            _scatter(wqe.segments, wqe.resp_offset, pkt.payload)
            wqe.resp_offset += plen
            wqe.resp_pkts += 1
            if wqe.req_pkts < wqe.resp_pkts:  # the answer to a request made before a rewind
                wqe.req_pkts = wqe.resp_pkts
            self._progress(now)
            if wqe.resp_pkts == wqe.npkts:
                if wqe.resp_offset != wqe.length:
                    self._fail_head(WCStatus.IBV_WC_BAD_RESP_ERR, "read response shorter than requested")
                    return
                self._finish_read_atomic(wqe, now)
        else:
            if op != Opcode.ATOMIC_ACKNOWLEDGE:
                self.counters.dropped_responses += 1
                return
            _scatter(wqe.segments, 0, _ATOMIC_FMT.pack(pkt.orig & _U64))
            self._finish_read_atomic(wqe, now)

    def _finish_read_atomic(self, wqe: _SendWQE, now: float) -> None:
        assert self.sq[0] is wqe
        self.sq.popleft()
        if self.cursor > 0:
            self.cursor -= 1
        else:  # completed while still at the cursor (the last answers came in before it moved on)
            self.cursor_pkt = 0
        if wqe.signaled:
            self._complete(False, wqe.wr.wr_id, WCStatus.IBV_WC_SUCCESS, WC_OPCODE_FOR_WR[wqe.opcode], wqe.length)
        last = wqe.psn_last
        if psn_diff(psn_add(last, 1), self.una_psn) > 0:
            self.una_psn = psn_add(last, 1)
        # WQEs behind the read may have been acknowledged while it was outstanding
        self._retire_acked(psn_add(self.una_psn, -1), now)
        self._progress(now)
        if self.deferred_nak is not None:
            self._apply_deferred_nak()

    def on_timer(self, now: float) -> None:
        """Handle an expired retransmit or RNR timer."""
        if self.rnr_deadline is not None and now >= self.rnr_deadline:
            self.rnr_deadline = None
            self.rnr_psn = None
            to = self.timeout_s
            self.retransmit_deadline = None if to is None else now + to
        if self.retransmit_deadline is not None and now >= self.retransmit_deadline:
            if not self.sq or not self._outstanding():
                self.retransmit_deadline = None
                return
            self.counters.timeouts += 1
            if self.retries_left <= 0:
                self._fail_head(
                    WCStatus.IBV_WC_RETRY_EXC_ERR,
                    f"no ACK after {self.retry_cnt} retries from {timeout_seconds(self.timeout_code):.3f} s "
                    "(backing off): the peer is unreachable or its QP is gone",
                )
                return
            self.retries_left -= 1
            head = self.sq[0]
            self._rewind(head.psn_first if head.is_read_atomic else self.una_psn)
            to = self.timeout_s
            backoff = retry_backoff(self.retry_cnt, self.retries_left)
            self.retransmit_deadline = None if to is None else now + to * backoff

    # ----------------------------------------------------- responder ----
    def receive(self, pkt: Packet, now: float) -> None:
        """Process one packet addressed to this QP."""
        self.counters.rcvd_pkts += 1
        if self.state not in (QPState.IBV_QPS_RTR, QPState.IBV_QPS_RTS):
            self.counters.dropped_wrong_state += 1
            return
        op = pkt.opcode
        if op in wire.RESPONSE_OPCODES:
            if self.state != QPState.IBV_QPS_RTS:
                self.counters.dropped_wrong_state += 1
                return
            if op == Opcode.ACKNOWLEDGE:
                self._on_ack(pkt, now)
            else:
                self._on_read_response(pkt, now)
            return
        self._on_request(pkt, now)

    def _on_request(self, pkt: Packet, now: float) -> None:
        d = (pkt.psn - self.epsn) & PSN_MASK  # psn_diff(pkt.psn, epsn), inlined
        if d >= 0x800000:
            d -= 0x1000000
        if d > 0:
            self.counters.out_of_sequence += 1
            if not self.nak_sent:
                self.nak_sent = True
                self.counters.seq_naks_sent += 1
                self.responses.append(self._ack_packet(wire.AETH_NAK | wire.NAK_PSN_SEQUENCE_ERROR, self.epsn))
            return
        if d < 0:
            self.counters.duplicate_requests += 1
            self._on_duplicate(pkt)
            return
        self.nak_sent = False
        op = pkt.opcode
        # message sequencing: after FIRST/MIDDLE only MIDDLE/LAST of the same kind may follow
        if self.cur_send_opcode is not None:
            if op not in (Opcode.SEND_MIDDLE, Opcode.SEND_LAST, Opcode.SEND_LAST_WITH_IMMEDIATE):
                return self._class_error(wire.NAK_INVALID_REQUEST, f"{pkt.name} inside a multi-packet SEND")
        elif self.cur_write_opcode is not None:
            if op not in (Opcode.RDMA_WRITE_MIDDLE, Opcode.RDMA_WRITE_LAST, Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE):
                return self._class_error(wire.NAK_INVALID_REQUEST, f"{pkt.name} inside a multi-packet RDMA WRITE")
        elif op in (
            Opcode.SEND_MIDDLE,
            Opcode.SEND_LAST,
            Opcode.SEND_LAST_WITH_IMMEDIATE,
            Opcode.RDMA_WRITE_MIDDLE,
            Opcode.RDMA_WRITE_LAST,
            Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE,
        ):
            return self._class_error(wire.NAK_INVALID_REQUEST, f"{pkt.name} without a FIRST packet")
        if op <= 0x05:  # SEND_*
            done = self._execute_send(pkt)
        elif op <= 0x0B:  # RDMA_WRITE_*
            done = self._execute_write(pkt)
        elif op == Opcode.RDMA_READ_REQUEST:
            done = self._execute_read(pkt)
            return  # epsn advanced by the read itself
        else:
            done = self._execute_atomic(pkt)
            return
        if not done:
            return
        self.epsn = (self.epsn + 1) & PSN_MASK
        if pkt.ack_req:
            self.ack_due = pkt.psn

    def _rnr(self) -> None:
        self.counters.rnr_naks_sent += 1
        self.responses.append(self._ack_packet(wire.AETH_RNR_NAK | self.min_rnr_timer, self.epsn))

    def _recv_posted(self) -> bool:
        """Whether a receive WQE waits: in the shared receive queue when the QP has one."""
        srq = self.srq
        return bool(self.rq) if srq is None else len(srq) > 0

    def _take_recv(self) -> RecvWQE:
        """The oldest receive WQE (the caller checked :meth:`_recv_posted`); from the
        SRQ, whose limit event this may raise."""
        srq = self.srq
        return self.rq.popleft() if srq is None else srq.take()

    def _execute_send(self, pkt: Packet) -> bool:
        op = pkt.opcode
        if op in (Opcode.SEND_FIRST, Opcode.SEND_ONLY, Opcode.SEND_ONLY_WITH_IMMEDIATE):
            if not self._recv_posted():
                self._rnr()
                return False
            self.cur_recv = self._take_recv()
            self.cur_recv_offset = 0
        rwqe = self.cur_recv
        assert rwqe is not None
        plen = len(pkt.payload)
        if op in (Opcode.SEND_FIRST, Opcode.SEND_MIDDLE) and plen != self.mtu:
            self._class_error(wire.NAK_INVALID_REQUEST, f"{pkt.name} payload {plen} != path MTU {self.mtu}")
            return False
        if self.cur_recv_offset + plen > rwqe.length:
            self._complete(True, rwqe.wr.wr_id, WCStatus.IBV_WC_LOC_LEN_ERR, WCOpcode.IBV_WC_RECV)
            self.cur_recv = None
            self._class_error(
                wire.NAK_INVALID_REQUEST,
                f"SEND of more than {rwqe.length} bytes does not fit the posted receive buffer",
            )
            return False
        _scatter(rwqe.segments, self.cur_recv_offset, pkt.payload)
        self.cur_recv_offset += plen
        if op in wire.LAST_OPCODES:
            self.msn = (self.msn + 1) & 0xFFFFFF
            self.cur_send_opcode = None
            self.cur_recv = None
            self._complete(
                True, rwqe.wr.wr_id, WCStatus.IBV_WC_SUCCESS, WCOpcode.IBV_WC_RECV, self.cur_recv_offset, pkt.imm
            )
        else:
            self.cur_send_opcode = op
        return True

    def _check_rkey(self, pkt: Packet, length: int, need: Access) -> Region | None:
        """The responder's memory protection: rkey exists, grants ``need``, covers [va, va+length)."""
        region = self.memory.by_rkey(pkt.rkey)
        why = None
        if region is None:
            why = f"rkey 0x{pkt.rkey:08x} is not a memory region of this PD"
        elif not (region.access & need) or not (self.access & need):
            missing = Access(need).name or str(need)
            owner = f"rkey 0x{pkt.rkey:08x}" if not (region.access & need) else f"QP 0x{self.qp_num:06x}"
            why = f"{owner} does not grant {missing}"
        else:
            off = pkt.va - region.addr
            if off < 0 or off + length > region.length:
                why = (
                    f"[0x{pkt.va:x}, +{length}) is outside the region of rkey 0x{pkt.rkey:08x} "
                    f"[0x{region.addr:x}, +{region.length})"
                )
        if self.tracer:
            self.tracer(TraceEvent.RKEY_CHECK, qpn=self.qp_num, pkt=pkt, ok=why is None, why=why)
        if why is not None:
            self.counters.remote_access_errors += 1
            self._class_error(wire.NAK_REMOTE_ACCESS_ERROR, why)
            return None
        return region

    def _execute_write(self, pkt: Packet) -> bool:
        op = pkt.opcode
        with_imm = op in (Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE, Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE)
        if with_imm and not self._recv_posted():
            self._rnr()  # the receive is consumed before any byte is placed
            return False
        if op in (Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_ONLY, Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE):
            if pkt.dma_len == 0 and len(pkt.payload) == 0:
                region = None
                self.cur_write = (None, 0, 0, 0)  # type: ignore[assignment]
            else:
                region = self._check_rkey(pkt, pkt.dma_len, Access.REMOTE_WRITE)
                if region is None:
                    return False
                self.cur_write = (region, pkt.va - region.addr, pkt.dma_len, pkt.dma_len)
        assert self.cur_write is not None
        region, off, remaining, dma_len = self.cur_write
        plen = len(pkt.payload)
        if plen > remaining or (op in (Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_MIDDLE) and plen != self.mtu):
            self._class_error(wire.NAK_INVALID_REQUEST, f"{pkt.name} payload {plen} does not match the RETH length")
            return False
        last = op in wire.LAST_OPCODES
        if last and remaining - plen != 0:
            # checked before the DMA: a request refused as invalid places no byte
            self._class_error(wire.NAK_INVALID_REQUEST, "RDMA WRITE shorter than its RETH DMA length")
            return False
        if plen:
            region.view[off : off + plen] = pkt.payload
            if self.tracer:
                self.tracer(TraceEvent.DMA_WRITE, qpn=self.qp_num, pkt=pkt, region=region, offset=off, length=plen)
        if last:
            self.cur_write = None
            self.cur_write_opcode = None
            self.msn = (self.msn + 1) & 0xFFFFFF
            if with_imm:
                rwqe = self._take_recv()
                self._complete(
                    True, rwqe.wr.wr_id, WCStatus.IBV_WC_SUCCESS, WCOpcode.IBV_WC_RECV_RDMA_WITH_IMM, dma_len, pkt.imm
                )
        else:
            self.cur_write = (region, off + plen, remaining - plen, dma_len)
            self.cur_write_opcode = op
        return True

    def _read_responses(
        self, res: _ReadResource, region: Region | None, skip: int = 0, va: int = 0, length: int = 0
    ) -> list[Packet]:
        """The response packets of the READ ``res`` (all of them), or, with
        ``skip`` > 0, of a retried READ that resumes at its ``skip``-th packet and
        asks for ``length`` bytes at ``va``: those keep the opcodes of their
        place in the whole response (MIDDLE ... LAST), like rxe's replay.
        Payloads are views of the region, read when the packets are encoded."""
        mtu = self.mtu
        if skip:
            n = skip + max(1, -(-length // mtu))
        else:
            n, va, length = res.npkts, res.va, res.length
        out = []
        base = (va - region.addr) if region is not None else 0
        view = region.view if region is not None else None
        syndrome = wire.AETH_ACK | wire.AETH_CREDITS_INVALID
        for i in range(skip, n):
            pos = (i - skip) * mtu
            plen = min(mtu, length - pos) if length else 0
            data = view[base + pos : base + pos + plen] if plen else b""  # type: ignore[index]
            if n == 1:
                code = Opcode.RDMA_READ_RESPONSE_ONLY
            elif i == 0:
                code = Opcode.RDMA_READ_RESPONSE_FIRST
            elif i == n - 1:
                code = Opcode.RDMA_READ_RESPONSE_LAST
            else:
                code = Opcode.RDMA_READ_RESPONSE_MIDDLE
            out.append(
                Packet(code, self.dest_qp_num, psn_add(res.psn, i), syndrome=syndrome, msn=res.msn, payload=data)
            )
        return out

    def _save_resource(self, res: _ReadResource) -> None:
        self.resources.append(res)
        while len(self.resources) > max(1, self.max_dest_rd_atomic):
            self.resources.popleft()

    def _execute_read(self, pkt: Packet) -> bool:
        region = None
        if pkt.dma_len:
            region = self._check_rkey(pkt, pkt.dma_len, Access.REMOTE_READ)
            if region is None:
                return False
        npkts = max(1, -(-pkt.dma_len // self.mtu))
        self.msn = (self.msn + 1) & 0xFFFFFF
        res = _ReadResource(pkt.psn, npkts, pkt.opcode, pkt.va, pkt.rkey, pkt.dma_len, msn=self.msn)
        self._save_resource(res)
        self.responses.extend(self._read_responses(res, region))
        self.epsn = psn_add(self.epsn, npkts)
        return True

    def _execute_atomic(self, pkt: Packet) -> bool:
        region = self._check_rkey(pkt, 8, Access.REMOTE_ATOMIC)
        if region is None:
            return False
        if pkt.va & 7:
            self._class_error(wire.NAK_INVALID_REQUEST, f"atomic address 0x{pkt.va:x} is not 8-byte aligned")
            return False
        off = pkt.va - region.addr
        view = region.view
        orig = _ATOMIC_FMT.unpack_from(view, off)[0]
        if pkt.opcode == Opcode.COMPARE_SWAP:
            if orig == pkt.compare:
                _ATOMIC_FMT.pack_into(view, off, pkt.swap_add)
        else:
            _ATOMIC_FMT.pack_into(view, off, (orig + pkt.swap_add) & _U64)
        self.msn = (self.msn + 1) & 0xFFFFFF
        res = _ReadResource(pkt.psn, 1, pkt.opcode, pkt.va, pkt.rkey, 8, orig=orig, msn=self.msn)
        self._save_resource(res)
        self.responses.append(self._atomic_ack(res))
        self.epsn = psn_add(self.epsn, 1)
        return True

    def _atomic_ack(self, res: _ReadResource) -> Packet:
        return Packet(
            Opcode.ATOMIC_ACKNOWLEDGE,
            self.dest_qp_num,
            res.psn,
            syndrome=wire.AETH_ACK | wire.AETH_CREDITS_INVALID,
            msn=res.msn,
            orig=res.orig,
        )

    def _on_duplicate(self, pkt: Packet) -> None:
        op = pkt.opcode
        if op in (Opcode.RDMA_READ_REQUEST, Opcode.COMPARE_SWAP, Opcode.FETCH_ADD):
            for res in self.resources:
                k = (pkt.psn - res.psn) & PSN_MASK  # the request's place in the saved one's PSN range
                if k < res.npkts and res.opcode == op:
                    if op != Opcode.RDMA_READ_REQUEST:
                        self.responses.append(self._atomic_ack(res))  # never executed twice
                        return
                    region = self.memory.by_rkey(res.rkey) if res.length else None
                    if res.length and region is None:
                        return
                    if k == 0:
                        self.responses.extend(self._read_responses(res, region))
                        return
                    # a READ retried from its k-th packet: the rest of the same range, from where
                    # that packet's bytes begin (a requester's retry always starts there). rxe
                    # checks only that the range lies inside; a forged duplicate could then
                    # answer the k-th PSN with bytes from elsewhere in the range, which the
                    # requester, waiting for exactly that PSN, would take as its own
                    if (
                        pkt.rkey != res.rkey
                        or pkt.va != (res.va + k * self.mtu) & _U64
                        or pkt.va + pkt.dma_len > res.va + res.length
                    ):
                        self.counters.dropped_responses += 1
                        return
                    self.responses.extend(self._read_responses(res, region, k, pkt.va, pkt.dma_len))
                    return
            self.counters.dropped_responses += 1
            return
        # SEND/WRITE already executed: acknowledge again (everything up to epsn-1)
        self.ack_due = psn_add(self.epsn, -1)

    def _class_error(self, nak_code: int, why: str) -> None:
        """A responder error: NAK the request and put this QP in the error state."""
        if nak_code == wire.NAK_INVALID_REQUEST:
            self.counters.invalid_requests += 1
        self.responses.append(self._ack_packet(wire.AETH_NAK | nak_code, self.epsn))
        self._enter_error(f"responder: {why}")

    # --------------------------------------------------------- errors ----
    def _enter_error(self, reason: str) -> None:
        """IBV_QPS_ERR: flush every outstanding send and receive WR. A shared
        receive queue's WQEs are not this QP's: only the one it had taken (a
        message in progress) is flushed, the SRQ keeps the others."""
        if self.state == QPState.IBV_QPS_ERR:
            return
        self.state = QPState.IBV_QPS_ERR
        self.error_reason = reason
        for wqe in self.sq:
            self._complete(False, wqe.wr.wr_id, WCStatus.IBV_WC_WR_FLUSH_ERR, WC_OPCODE_FOR_WR[wqe.opcode])
        self.sq.clear()
        self.cursor = self.cursor_pkt = 0
        if self.cur_recv is not None:
            self._complete(True, self.cur_recv.wr.wr_id, WCStatus.IBV_WC_WR_FLUSH_ERR, WCOpcode.IBV_WC_RECV)
            self.cur_recv = None
        for r in self.rq:
            self._complete(True, r.wr.wr_id, WCStatus.IBV_WC_WR_FLUSH_ERR, WCOpcode.IBV_WC_RECV)
        self.rq.clear()
        self.retransmit_deadline = self.rnr_deadline = None
        self.deferred_nak = None
        if self.on_error is not None:
            self.on_error(reason)
