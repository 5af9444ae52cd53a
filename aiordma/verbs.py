"""The verbs' vocabulary: the libibverbs enums, and the work requests and completions.

The names and values are the verbs ones (``IBV_WC_REM_ACCESS_ERR`` = 10,
``IBV_WR_RDMA_WRITE_WITH_IMM`` = 1, ...), so they can be searched for. They
are what every layer says: an application's access flags, the work requests
the message layer posts, the completions it reaps and the statuses the errors
are named after (:mod:`aiordma.errors` maps each :class:`WCStatus` to its
exception). Plain values with no dependency, below both the errors and the
device interface (:mod:`aiordma.providers.base`, which re-exports every name
here, so ``from aiordma.providers.base import WCStatus`` keeps working).
Immediate data is a host-order ``int``; providers convert to network byte
order on the wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum, IntFlag

# ------------------------------------------------------------------ enums ----


class Access(IntFlag):
    """Memory-region and QP access flags (``enum ibv_access_flags``)."""

    IBV_ACCESS_LOCAL_WRITE = 1
    IBV_ACCESS_REMOTE_WRITE = 2
    IBV_ACCESS_REMOTE_READ = 4
    IBV_ACCESS_REMOTE_ATOMIC = 8
    # short aliases
    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8


ACCESS_ALL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC
#: access rights that let the device (or a peer) write into a region
WRITE_ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC


class WROpcode(IntEnum):
    """Send work-request opcodes (``enum ibv_wr_opcode``)."""

    IBV_WR_RDMA_WRITE = 0
    IBV_WR_RDMA_WRITE_WITH_IMM = 1
    IBV_WR_SEND = 2
    IBV_WR_SEND_WITH_IMM = 3
    IBV_WR_RDMA_READ = 4
    IBV_WR_ATOMIC_CMP_AND_SWP = 5
    IBV_WR_ATOMIC_FETCH_AND_ADD = 6


class WCOpcode(IntEnum):
    """Work-completion opcodes (``enum ibv_wc_opcode``)."""

    IBV_WC_SEND = 0
    IBV_WC_RDMA_WRITE = 1
    IBV_WC_RDMA_READ = 2
    IBV_WC_COMP_SWAP = 3
    IBV_WC_FETCH_ADD = 4
    IBV_WC_RECV = 128
    IBV_WC_RECV_RDMA_WITH_IMM = 129


#: the WC opcode a successful send-queue WR completes with
WC_OPCODE_VALUES = frozenset(int(o) for o in WCOpcode)

WC_OPCODE_FOR_WR = {
    WROpcode.IBV_WR_RDMA_WRITE: WCOpcode.IBV_WC_RDMA_WRITE,
    WROpcode.IBV_WR_RDMA_WRITE_WITH_IMM: WCOpcode.IBV_WC_RDMA_WRITE,
    WROpcode.IBV_WR_SEND: WCOpcode.IBV_WC_SEND,
    WROpcode.IBV_WR_SEND_WITH_IMM: WCOpcode.IBV_WC_SEND,
    WROpcode.IBV_WR_RDMA_READ: WCOpcode.IBV_WC_RDMA_READ,
    WROpcode.IBV_WR_ATOMIC_CMP_AND_SWP: WCOpcode.IBV_WC_COMP_SWAP,
    WROpcode.IBV_WR_ATOMIC_FETCH_AND_ADD: WCOpcode.IBV_WC_FETCH_ADD,
}


class WCStatus(IntEnum):
    """Work-completion status (``enum ibv_wc_status``)."""

    IBV_WC_SUCCESS = 0
    IBV_WC_LOC_LEN_ERR = 1
    IBV_WC_LOC_QP_OP_ERR = 2
    IBV_WC_LOC_EEC_OP_ERR = 3
    IBV_WC_LOC_PROT_ERR = 4
    IBV_WC_WR_FLUSH_ERR = 5
    IBV_WC_MW_BIND_ERR = 6
    IBV_WC_BAD_RESP_ERR = 7
    IBV_WC_LOC_ACCESS_ERR = 8
    IBV_WC_REM_INV_REQ_ERR = 9
    IBV_WC_REM_ACCESS_ERR = 10
    IBV_WC_REM_OP_ERR = 11
    IBV_WC_RETRY_EXC_ERR = 12
    IBV_WC_RNR_RETRY_EXC_ERR = 13
    IBV_WC_LOC_RDD_VIOL_ERR = 14
    IBV_WC_REM_INV_RD_REQ_ERR = 15
    IBV_WC_REM_ABORT_ERR = 16
    IBV_WC_INV_EECN_ERR = 17
    IBV_WC_INV_EEC_STATE_ERR = 18
    IBV_WC_FATAL_ERR = 19
    IBV_WC_RESP_TIMEOUT_ERR = 20
    IBV_WC_GENERAL_ERR = 21


#: the values that are verbs statuses / completion opcodes (to name them in messages)
WC_STATUS_VALUES = frozenset(int(s) for s in WCStatus)


class WCFlags(IntFlag):
    """``enum ibv_wc_flags``."""

    IBV_WC_GRH = 1
    IBV_WC_WITH_IMM = 2


class SendFlags(IntFlag):
    """``enum ibv_send_flags``."""

    IBV_SEND_FENCE = 1
    IBV_SEND_SIGNALED = 2
    IBV_SEND_SOLICITED = 4
    IBV_SEND_INLINE = 8


class QPState(IntEnum):
    """Queue-pair states (``enum ibv_qp_state``)."""

    IBV_QPS_RESET = 0
    IBV_QPS_INIT = 1
    IBV_QPS_RTR = 2
    IBV_QPS_RTS = 3
    IBV_QPS_SQD = 4
    IBV_QPS_SQE = 5
    IBV_QPS_ERR = 6


class AsyncEventType(IntEnum):
    """Asynchronous events of a device (``enum ibv_event_type``): what
    ``ibv_get_async_event`` reads from the device's async-event fd."""

    IBV_EVENT_CQ_ERR = 0
    IBV_EVENT_QP_FATAL = 1
    IBV_EVENT_QP_REQ_ERR = 2
    IBV_EVENT_QP_ACCESS_ERR = 3
    IBV_EVENT_COMM_EST = 4
    IBV_EVENT_SQ_DRAINED = 5
    IBV_EVENT_PATH_MIG = 6
    IBV_EVENT_PATH_MIG_ERR = 7
    IBV_EVENT_DEVICE_FATAL = 8
    IBV_EVENT_PORT_ACTIVE = 9
    IBV_EVENT_PORT_ERR = 10
    IBV_EVENT_LID_CHANGE = 11
    IBV_EVENT_PKEY_CHANGE = 12
    IBV_EVENT_SM_CHANGE = 13
    IBV_EVENT_SRQ_ERR = 14
    IBV_EVENT_SRQ_LIMIT_REACHED = 15
    IBV_EVENT_QP_LAST_WQE_REACHED = 16
    IBV_EVENT_CLIENT_REREGISTER = 17
    IBV_EVENT_GID_CHANGE = 18
    IBV_EVENT_WQ_FATAL = 19


class PortState(IntEnum):
    """``enum ibv_port_state``."""

    IBV_PORT_NOP = 0
    IBV_PORT_DOWN = 1
    IBV_PORT_INIT = 2
    IBV_PORT_ARMED = 3
    IBV_PORT_ACTIVE = 4
    IBV_PORT_ACTIVE_DEFER = 5


class MTU(IntEnum):
    """Path MTU (``enum ibv_mtu``). Use :func:`mtu_bytes` / :func:`mtu_from_bytes`."""

    IBV_MTU_256 = 1
    IBV_MTU_512 = 2
    IBV_MTU_1024 = 3
    IBV_MTU_2048 = 4
    IBV_MTU_4096 = 5


def mtu_bytes(mtu: int) -> int:
    """Bytes of payload per packet for an ``ibv_mtu`` value (1 → 256 … 5 → 4096)."""
    if not 1 <= int(mtu) <= 5:
        raise ValueError(f"invalid ibv_mtu {mtu!r}: expected 1 (256) .. 5 (4096)")
    return 128 << int(mtu)


def mtu_from_bytes(nbytes: int) -> MTU:
    """The ``ibv_mtu`` for 256, 512, 1024, 2048 or 4096 bytes."""
    for m in MTU:
        if mtu_bytes(m) == nbytes:
            return m
    raise ValueError(f"invalid path MTU {nbytes}: RoCE path MTU is 256, 512, 1024, 2048 or 4096 bytes")


# ----------------------------------------------------------- work requests ----


@dataclass(slots=True)
class SGE:
    """A scatter/gather element (``struct ibv_sge``): ``length`` bytes at
    virtual address ``addr`` inside the memory region whose lkey is ``lkey``."""

    addr: int
    length: int
    lkey: int


@dataclass(slots=True)
class SendWR:
    """A send-queue work request (``struct ibv_send_wr``).

    ``remote_addr``/``rkey`` are used by RDMA Write/Read and atomics,
    ``compare_add``/``swap`` by atomics, ``imm_data`` (host order) by the
    ``*_WITH_IMM`` opcodes. Unsignaled requests (no ``IBV_SEND_SIGNALED``)
    produce a completion only when they fail.
    """

    wr_id: int
    opcode: WROpcode
    sg_list: Sequence[SGE] = ()
    send_flags: SendFlags = SendFlags.IBV_SEND_SIGNALED
    imm_data: int | None = None
    remote_addr: int = 0
    rkey: int = 0
    compare_add: int = 0
    swap: int = 0

    @property
    def length(self) -> int:
        return sum(s.length for s in self.sg_list)


@dataclass(slots=True)
class RecvWR:
    """A receive-queue work request (``struct ibv_recv_wr``)."""

    wr_id: int
    sg_list: Sequence[SGE] = ()

    @property
    def length(self) -> int:
        return sum(s.length for s in self.sg_list)


@dataclass(slots=True)
class WorkCompletion:
    """A completion-queue entry (``struct ibv_wc``). ``imm_data`` is host order."""

    wr_id: int
    status: WCStatus
    opcode: WCOpcode
    byte_len: int = 0
    qp_num: int = 0
    src_qp: int = 0
    imm_data: int | None = None
    wc_flags: WCFlags = WCFlags(0)
    vendor_err: int = 0

    @property
    def ok(self) -> bool:
        return self.status == WCStatus.IBV_WC_SUCCESS

    def __repr__(self) -> str:
        st = WCStatus(self.status).name if self.status in WC_STATUS_VALUES else self.status
        op = WCOpcode(self.opcode).name if self.opcode in WC_OPCODE_VALUES else self.opcode
        imm = f" imm=0x{self.imm_data:08x}" if self.imm_data is not None else ""
        return f"<WC wr_id={self.wr_id} {st} {op} len={self.byte_len} qp=0x{self.qp_num:x}{imm}>"
