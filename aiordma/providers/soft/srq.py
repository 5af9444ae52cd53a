"""A shared receive queue (SRQ), sans-IO: the receive WQEs several RC queue pairs take from.

The reference of the soft device's ``ibv_srq`` (the native engine's is
``struct rc_srq`` in ``_native/rc.c``, the same rules line by line). Like
:class:`~.rc.RCQueuePair` it does no I/O and owns no thread: the device posts
into it (:meth:`RCSharedReceiveQueue.post_recv`, ``ibv_post_srq_recv``) and
the responder of every queue pair created with it takes from it
(:meth:`~RCSharedReceiveQueue.take`) when a SEND or an RDMA Write with
immediate needs a receive; an empty SRQ makes that responder answer RNR NAK.

The limit (``ibv_modify_srq`` with ``IBV_SRQ_LIMIT``, :meth:`arm`): when a
take leaves fewer than ``limit`` WQEs posted, the SRQ raises
``IBV_EVENT_SRQ_LIMIT_REACHED`` once (``on_limit``, called while the device
holds its lock: it must only queue the event) and disarms (``limit`` back to
0), as rxe does. Nothing of an SRQ is on the wire.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ...errors import InvalidWorkRequestError, ResourceBusyError
from ..base import RecvWR, check_srq_limit
from .rc import MemoryTable, RecvWQE, resolve_segments

__all__ = ["RCSharedReceiveQueue", "srq_busy_error"]

_LOCAL_WRITE = 1  # IBV_ACCESS_LOCAL_WRITE: a receive buffer is written by the device


def srq_busy_error(srq_num: int, users: int) -> ResourceBusyError:
    """The refusal of ``ibv_destroy_srq`` while ``users`` queue pairs take their receives from the SRQ (EBUSY)."""
    return ResourceBusyError(
        f"ibv_destroy_srq of shared receive queue 0x{srq_num:06x}: {users} queue pair(s) still take their "
        "receives from it (EBUSY): destroy them first"
    )


class RCSharedReceiveQueue:
    """One shared receive queue of a protection domain (see the module docstring).

    ``memory`` resolves the lkeys of posted SGEs (the PD's regions); ``srq_num``
    names it in async events. All methods must be called by one thread at a
    time (the soft device holds its lock)."""

    def __init__(self, srq_num: int, memory: MemoryTable, max_wr: int, max_sge: int) -> None:
        self.srq_num = srq_num
        self.memory = memory
        self.max_wr = max_wr
        self.max_sge = max_sge
        self.wqes: deque[RecvWQE] = deque()
        #: the armed limit (0: not armed)
        self.limit = 0
        #: how many times the limit event fired
        self.limit_events = 0
        #: queue pairs that take their receives from it (destroy is refused while > 0)
        self.users = 0
        #: called with this SRQ when its limit event fires (the device's async-event queue)
        self.on_limit: Callable[[RCSharedReceiveQueue], None] | None = None

    def __len__(self) -> int:
        return len(self.wqes)

    # ------------------------------------------------------------ verbs ----
    def post_recv(self, wr: RecvWR) -> None:
        """``ibv_post_srq_recv`` of one WR."""
        if len(self.wqes) >= self.max_wr:
            raise InvalidWorkRequestError(f"shared receive queue 0x{self.srq_num:06x} full ({self.max_wr} WRs posted)")
        if len(wr.sg_list) > self.max_sge:
            raise InvalidWorkRequestError(f"{len(wr.sg_list)} SGEs > the SRQ's max_sge {self.max_sge}")
        segs, length = resolve_segments(
            self.memory, wr.sg_list, _LOCAL_WRITE, lambda: f"post_srq_recv wr_id={wr.wr_id}"
        )
        self.wqes.append(RecvWQE(wr, segs, length))

    def arm(self, limit: int) -> None:
        """``ibv_modify_srq(IBV_SRQ_LIMIT)``: arm the limit event (0 disarms)."""
        self.limit = check_srq_limit(limit, self.max_wr)

    # -------------------------------------------------------- responder ----
    def take(self) -> RecvWQE:
        """The oldest WQE, for a responder that checked one is posted; raises the
        limit event when fewer than the armed limit remain."""
        wqe = self.wqes.popleft()
        if self.limit and len(self.wqes) < self.limit:
            self.limit = 0
            self.limit_events += 1
            if self.on_limit is not None:
                self.on_limit(self)
        return wqe

    def attach(self) -> None:
        self.users += 1

    def detach(self) -> None:
        self.users -= 1

    def clear(self) -> None:
        """``ibv_destroy_srq``: drop the posted WQEs (no completion is written)."""
        self.wqes.clear()

    def __repr__(self) -> str:
        return f"<RCSharedReceiveQueue 0x{self.srq_num:06x} {len(self.wqes)}/{self.max_wr} limit={self.limit}>"
