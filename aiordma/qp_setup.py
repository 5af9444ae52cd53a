"""An RC queue pair's connection set-up: RESET → INIT → RTR → RTS.

A reliable-connected queue pair talks to exactly one remote queue pair, and
the verbs make the caller walk it through its states with what each end must
know of the other (rdma-core's ``ibv_modify_qp``):

* **INIT** (``port_num``, access flags): receives may now be posted;
* **RTR**, ready to receive: the peer's QP number and starting PSN, the
  path (destination GID, source GID index, path MTU, and the address
  vector's traffic class, hop limit, flow label and service level), and how
  many RDMA Reads and atomics the peer may have outstanding here;
* **RTS**, ready to send: this end's starting PSN, the ACK timeout, the retry
  counts, how many Reads and atomics this end may have outstanding.

:class:`QueuePairSetup` holds this end's part (the GID chosen and why, a
random starting PSN, the MTU it announces, the address vector, the timers),
says it for the rendezvous (:meth:`~QueuePairSetup.endpoint`) and, given the
peer's, takes the queue pair to RTS (:meth:`~QueuePairSetup.connect`). The
handshake (:mod:`aiordma.handshake`) carries the two ends' endpoints.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import TYPE_CHECKING, Any

from .memory import RemoteBuffer
from .path import AddressVector, MTUChoice, PathInfo
from .providers.base import (
    ACCESS_ALL,
    DeviceContext,
    QPAttr,
    QueuePair,
    gid_is_loopback,
    gid_str,
    mtu_bytes,
    mtu_from_bytes,
)
from .providers.soft import cma, shm
from .rendezvous import Endpoint, cma_reads_flag, shm_reads_flag

if TYPE_CHECKING:
    from .providers.librdmacm import QueuePairAttributes

__all__ = ["MIN_RNR_TIMER", "RNR_RETRY", "QueuePairSetup"]

log = logging.getLogger(__name__)

#: the RNR NAK timer this end asks a sender to wait before retrying (IB's 12: 0.64 ms)
MIN_RNR_TIMER = 12
#: retry forever when the peer has no receive posted (7: the verbs' "infinite")
RNR_RETRY = 7
#: RDMA Reads and atomics in flight where neither the caller nor the device says (and
#: what a peer that does not say accepts): ConnectX's max_qp_rd_atom
DEFAULT_RD_ATOMIC = 16


class QueuePairSetup:
    """This end's part in connecting ``qp`` (created by the caller, in RESET) on
    ``device``'s port (:attr:`~aiordma.providers.base.DeviceContext.port_num`). Chooses the source GID now (``gid_index``, else the
    best one: :meth:`~aiordma.providers.base.DeviceContext.choose_gid`; a bad
    choice raises :class:`~aiordma.errors.GIDError`) and takes the QP to INIT."""

    def __init__(
        self,
        device: DeviceContext,
        qp: QueuePair,
        *,
        gid_index: int | None,
        av: AddressVector,
        path_mtu: int | None,
        max_rd_atomic: int | None,
        ack_timeout: int,
        retry_cnt: int,
    ) -> None:
        self.device = device
        self.qp = qp
        self.av = av
        attr = device.query_device()
        #: RDMA Reads and atomics this end's responder accepts in flight (max_dest_rd_atomic):
        #: what the caller asked for, else what the device allows (a soft device and kernel
        #: rxe 128, ConnectX 16); the peer hears it at the rendezvous
        self.max_rd_atomic = max_rd_atomic or int(attr.max_qp_rd_atom or 0) or DEFAULT_RD_ATOMIC
        #: ... and this end's requester may have in flight (max_rd_atomic): no more than
        #: the peer accepts (set by connect(); a real NIC refuses the excess)
        self.requester_rd_atomic = min(
            max_rd_atomic or int(attr.max_qp_init_rd_atom or 0) or DEFAULT_RD_ATOMIC, self.max_rd_atomic
        )
        self.ack_timeout = ack_timeout
        self.retry_cnt = retry_cnt
        #: the port's active MTU
        self.port_num = port = device.port_num
        self.port_mtu = mtu_bytes(device.query_port(port).active_mtu)
        self.mtu_choice = MTUChoice(self.port_mtu, path_mtu, int(device.soft_mtu))
        gid_entry, self.gid_reason = device.choose_gid(port, gid_index)
        self.gid_index = gid_entry.index
        self.gid = gid_entry.gid
        self.gid_type = gid_entry.gid_type
        #: this end offers to leave the ICRC out (a soft device on loopback: nothing
        #: crosses a wire); both ends must offer it
        self.skip_icrc_offer = bool(device.skips_loopback_icrc) and gid_is_loopback(self.gid)
        #: this end's cross-memory attach offer (a soft device of the native engine:
        #: aiordma.providers.soft.cma), and what came of the peer's
        self.cma_offer = cma.offer() if device.cross_memory_attach else None
        #: the peer's process, when this end can read it (0: it cannot, or it offered nothing)
        self.cma_peer_pid = 0
        #: this end answers the peer's large READs with grants
        self.cma_respond = False
        #: this end's shared-memory link offer (aiordma.providers.soft.shm), the link
        #: its QP takes the peer's packets from (id, memfd number), and what carries
        #: its packets (PathInfo.transport)
        self.shm_offer = device.shm_offer() if device.shared_memory_links else None  # type: ignore[attr-defined]
        self.shm_link: tuple[int, int] | None = None
        self.transport = (
            f"UDP (shared-memory links: {device.shared_memory_reason})"
            if device.provider == "soft"
            else "the device's own network (RoCEv2 or InfiniBand)"
        )
        self._announced = False  # this end told the peer its endpoint (the client, before connect)
        #: this end's starting packet sequence number: random, as rdma-core's examples draw it
        self.psn = int.from_bytes(os.urandom(3), "big")
        qp.to_init(QPAttr(port_num=port, qp_access_flags=ACCESS_ALL))
        #: the peer's endpoint this end connected to
        self.peer: Endpoint | None = None

    @property
    def transport_timeout(self) -> float:
        """How long the transport retries an unacknowledged request before it fails it
        with ``IBV_WC_RETRY_EXC_ERR``: the ACK timeout (4.096 µs × 2^``ack_timeout``)
        times (``retry_cnt`` + 1); infinite for ``ack_timeout=0`` (IBTA: no timeout,
        the transport waits for an ACK forever)."""
        if self.ack_timeout == 0:
            return math.inf
        return 4.096e-6 * (1 << self.ack_timeout) * (self.retry_cnt + 1)

    def endpoint(
        self,
        *,
        recv_buffers: int,
        recv_buffer_size: int,
        buffers: dict[str, Any],
        stream_ring: RemoteBuffer | None = None,
    ) -> Endpoint:
        """What the rendezvous tells the peer: QPN, PSN, GID, the MTUs this end
        announces, its receive buffers for messages and the buffers it exposes."""
        self._announced = True
        offer = self.shm_offer
        if offer is not None and self.shm_link is not None:
            offer = (*offer[:4], *self.shm_link)
        return Endpoint(
            qpn=self.qp.qp_num,
            psn=self.psn,
            gid=bytes(self.gid),
            mtu=self.mtu_choice.announced,
            port=self.device.udp_port,
            provider=self.device.provider,
            recv_buffers=recv_buffers,
            recv_buffer_size=recv_buffer_size,
            buffers=buffers,
            stream_ring=stream_ring,
            soft_mtu=self.mtu_choice.announced_soft,
            soft_skip_icrc=self.skip_icrc_offer,
            soft_cma=self.cma_offer,
            soft_cma_reads=self.cma_peer_pid > 0,
            rd_atomic=self.max_rd_atomic,
            soft_shm=offer,
        )

    def ready(self) -> dict[str, Any]:
        """The client's last handshake message (its QP is in RTS); it tells the
        server whether the client can read the server's process (cross-memory
        attach) and whether it reads the shared-memory link the server made."""
        msg: dict[str, Any] = {"t": "ready"}
        if self.cma_peer_pid:
            msg["soft_cma_reads"] = True
        if self.shm_link is not None:
            msg["soft_shm"] = True
        return msg

    def peer_ready(self, msg: dict[str, Any], path: PathInfo) -> PathInfo:
        """The server's side of :meth:`ready`: grant the client's large READs
        when it can read this process; send through the link once the client
        reads it. Returns the path with what carries its packets now."""
        self._use_cma(cma_reads_flag(msg))
        if self.shm_link is not None:
            if shm_reads_flag(msg):
                self.qp.use_link(self.shm_link[0], True)  # type: ignore[attr-defined]
                self.transport = shm.LINK_TRANSPORT
            else:
                self.transport = "UDP (the client did not map the shared-memory link)"
        return dataclasses.replace(path, transport=self.transport)

    def _use_shm(self, peer: Endpoint) -> str:
        """Shared-memory link toward the peer (:mod:`aiordma.providers.soft.shm`):
        the server makes the link (or reuses its own toward that device) and takes
        the client's packets from it; the client maps it and uses it both ways.
        Returns what carries this end's packets (a reason when it is UDP)."""
        mine, theirs = self.shm_offer, peer.soft_shm
        if mine is None:
            return self.transport
        if theirs is None:
            return "UDP (the peer offers no shared-memory link)"
        if not shm.same_host_peer(mine, theirs):
            return "UDP (the peer is on another host or in another network namespace, or in this process)"
        _, pid, device, wakefd, link, memfd = theirs
        try:
            if not self._announced:  # the server: the client's offer came first
                self.shm_link = self.device.shm_make(pid, device, wakefd)  # type: ignore[attr-defined]
                self.qp.use_link(self.shm_link[0], False)  # type: ignore[attr-defined]
                return "UDP until the client maps the shared-memory link"
            if not link:
                return "UDP (the server made no shared-memory link)"
            self.device.shm_attach(pid, device, link, memfd, wakefd)  # type: ignore[attr-defined]
            self.qp.use_link(link, True)  # type: ignore[attr-defined]
            self.shm_link = (link, memfd)
            return shm.LINK_TRANSPORT
        except OSError as e:
            log.debug("no shared-memory link toward process %d: %s", pid, e)
            self.shm_link = None
            return f"UDP (no shared-memory link: {e})"

    def _use_cma(self, peer_reads: bool) -> None:
        """Cross-memory attach toward the peer (:mod:`aiordma.providers.soft.cma`):
        take grants when this end reads the peer's process; give them when the
        peer, on this host, says it reads this one."""
        peer = self.peer
        if self.cma_offer is None or peer is None or peer.soft_cma is None:
            return
        same_host = peer.soft_cma[0] == self.cma_offer[0] and peer.soft_cma[1] != self.cma_offer[1]
        respond = peer_reads and same_host
        if self.cma_peer_pid or respond != self.cma_respond:
            self.cma_respond = respond
            self.qp.use_cma(self.cma_peer_pid, respond)  # type: ignore[attr-defined]

    def connect_cm(self, peer: Endpoint, cm: QueuePairAttributes) -> PathInfo:
        """INIT → RTR → RTS with what RDMA CM resolved and exchanged (its REQ and
        REP carried the QP numbers and starting PSNs; its route, the GIDs and
        the path MTU): the source GID is the one the CM bound to the address, the
        PSNs are the CM's, the path MTU the smaller of the CM's and the two ends'
        caps. The address vector and the timers are this end's, as over the
        TCP rendezvous. :attr:`peer` is then the peer as the CM described it."""
        gid_entry, _ = self.device.choose_gid(self.port_num, cm.sgid_index)
        self.gid_index, self.gid, self.gid_type = gid_entry.index, gid_entry.gid, gid_entry.gid_type
        self.gid_reason = f"index {cm.sgid_index}: the GID RDMA CM resolved the connection's address to"
        self.psn = cm.sq_psn
        cm_mtu = mtu_bytes(cm.path_mtu)
        self.peer = dataclasses.replace(
            peer,
            qpn=cm.dest_qp_num,
            psn=cm.rq_psn,
            gid=cm.dgid,
            mtu=min(peer.mtu, cm_mtu),
            soft_mtu=0,
            soft_skip_icrc=False,
            soft_cma=None,
            soft_cma_reads=False,
            soft_shm=None,
        )
        path = self.connect(self.peer)
        return dataclasses.replace(path, mtu_reason=f"{path.mtu_reason}; RDMA CM's path MTU is {cm_mtu}")

    def connect(self, peer: Endpoint) -> PathInfo:
        """INIT → RTR → RTS toward the peer's queue pair; returns the path chosen."""
        self.peer = peer
        mtu, jumbo, why = self.mtu_choice.negotiate(peer.mtu, peer.soft_mtu)
        skip_icrc = self.skip_icrc_offer and peer.soft_skip_icrc and gid_is_loopback(peer.gid)
        av = self.av
        self.qp.to_rtr(
            QPAttr(
                port_num=self.port_num,
                path_mtu=mtu_from_bytes(mtu),
                dest_qp_num=peer.qpn,
                rq_psn=peer.psn,
                dgid=peer.gid,
                dport=peer.port,
                path_mtu_bytes=jumbo,
                skip_icrc=skip_icrc or None,
                sgid_index=self.gid_index,
                traffic_class=av.traffic_class,
                service_level=av.service_level,
                hop_limit=av.hop_limit,
                flow_label=av.flow_label,
                max_dest_rd_atomic=self.max_rd_atomic,
                min_rnr_timer=MIN_RNR_TIMER,
                qp_access_flags=ACCESS_ALL,
            )
        )
        self.qp.to_rts(
            QPAttr(
                sq_psn=self.psn,
                timeout=self.ack_timeout,
                retry_cnt=self.retry_cnt,
                rnr_retry=RNR_RETRY,
                max_rd_atomic=min(self.requester_rd_atomic, peer.rd_atomic or DEFAULT_RD_ATOMIC),
            )
        )
        if self.cma_offer is not None:
            self.cma_peer_pid = cma.readable_peer(peer.soft_cma)
            self._use_cma(peer.soft_cma_reads)
        self.transport = self._use_shm(peer)
        return PathInfo(
            mtu=jumbo or mtu,
            mtu_reason=why,
            port_mtu=self.port_mtu,
            peer_port_mtu=peer.mtu,
            gid_index=self.gid_index,
            gid=gid_str(self.gid),
            gid_type=self.gid_type,
            gid_reason=self.gid_reason,
            peer_gid=gid_str(peer.gid),
            address_vector=av,
            icrc=(
                "left out: two soft devices on loopback, both offering it (nothing crosses a wire)"
                if skip_icrc
                else "computed and checked"
            ),
            transport=self.transport,
        )
