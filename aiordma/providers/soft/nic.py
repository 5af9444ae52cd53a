"""The soft device's "NIC": the thread that owns the UDP socket and the timers.

A real RoCE NIC receives packets, checks their ICRC, finds the destination
queue pair, DMAs payloads into registered memory and writes completion-queue
entries, all without the host CPU. Here a thread does that:

* it blocks in ``poll()`` on the UDP socket (RoCEv2 packets to port 4791)
  and on a wake-up eventfd, with the earliest transport timer as timeout;
* for each datagram: decode the BTH and extension headers, verify the ICRC
  (see :class:`IcrcPolicy`), hand the packet to the QP's sans-IO RC engine
  (:class:`~aiordma.providers.soft.rc.RCQueuePair`), which writes into
  memory and produces responses and completions;
* it sends what the engines produce and delivers completions to the CQs,
  which raise events on their completion channels.

Posting a work request (the doorbell) runs the requester in the caller's
thread under the same lock, so a post reaches the wire without a thread hop.
One-sided operations (RDMA Write/Read, atomics) complete without any code of
the remote application running: only the remote NIC thread.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ... import settings
from . import wire
from .faults import LinkFaults
from .gso import CAPTURE_RECHECK_S, capture_listeners
from .trace import TraceEvent

if TYPE_CHECKING:  # pragma: no cover
    from ..base import WorkCompletion
    from .rc import RCQueuePair

__all__ = ["IcrcPolicy", "LinkFaults", "NicCompletionQueue", "NicQueuePair", "SoftNIC"]

log = logging.getLogger("aiordma.soft")

IP_MTU_DISCOVER = 10  # <linux/in.h>
IP_PMTUDISC_DO = 2
SO_RCVBUFFORCE = 33
SO_SNDBUFFORCE = 32

MAX_DATAGRAM = 4096 + 64
SOL_UDP = 17
UDP_SEGMENT = 103  # <linux/udp.h>: UDP GSO, one sendmsg for many datagrams
UDP_GRO = 104  # <linux/udp.h>: take a GSO batch as one datagram, with its segment size
_GRO_CMSG_SPACE = socket.CMSG_SPACE(4)
#: what one GSO send may carry (the kernel's UDP_MAX_SEGMENTS is 64; the IP
#: datagram it builds must stay below 64 KiB)
GSO_MAX_SEGMENTS = 64
GSO_MAX_BYTES = 60000
#: longest a due transport timer waits for the receive queue to be drained (s)
MAX_TIMER_LAG = 0.5


class IcrcPolicy:
    """How received ICRCs are checked.

    A UDP socket does not show the IP header, and the ICRC covers the IP
    identification field the sender's kernel chose. The soft device sends
    with DF set on an unconnected socket, for which Linux writes ID 0; other
    senders do not: kernel Soft-RoCE (rdma_rxe) numbers its packets with
    ``__ip_select_ident`` (per-destination counters starting at a random
    value), UDP GSO numbers segments 0, 1, 2, ... The receiver therefore
    checks the ICRC for ID 0 first and otherwise solves for the ID that
    would make it match (:func:`~aiordma.providers.soft.wire.icrc_ip_id`:
    the CRC is affine in the ID bits, so that is a 32 x 16 linear system
    with at most one solution):

    ``"strict"`` (default)
        accept ID 0 and, via the solver, IDs 1..63 (GSO segments; counted
        in ``rx_icrc_ip_id_inferred``); drop everything else
        (``rx_icrc_errors``, plus ``rx_icrc_ip_id_out_of_range`` when some
        larger ID would have matched — the sign of a peer such as kernel
        rxe, which needs ``"any-ip-id"``). A corrupted packet passes with
        probability 64 / 2**32.
    ``"any-ip-id"``
        accept when some IP ID makes the ICRC match (non-zero ones counted
        in ``rx_icrc_ip_id_inferred``). Needed to talk to kernel rxe. The
        ICRC then protects with 16 of its 32 bits: a corrupted packet
        passes with probability 2**-16 (the UDP checksum, which rxe leaves
        at 0, is no help). IPv6 has no ID and is checked exactly.
    ``"off"``
        accept every ICRC and count the packets not checked
        (``rx_icrc_unchecked``).

    Set with ``AIORDMA_SOFT_ICRC`` or ``SoftDevice(icrc=...)``.
    """

    STRICT = "strict"
    ANY_IP_ID = "any-ip-id"
    OFF = "off"
    ALL = (STRICT, ANY_IP_ID, OFF)
    #: the largest inferred IP ID "strict" accepts (UDP GSO segment numbers)
    STRICT_MAX_IP_ID = 63


class NicCompletionQueue(Protocol):
    """What the NIC needs from a completion queue: somewhere to write a CQE.

    ``push`` returns True when the CQ was armed (``req_notify``) and has a
    completion channel: the NIC then raises the channel's event with
    :meth:`fire_event` once it has released its lock (the CQ event sink)."""

    def push(self, wc: WorkCompletion) -> bool: ...

    def fire_event(self) -> None: ...


class NicQueuePair(Protocol):
    """What the NIC needs from a queue pair: its RC engine, where its packets
    go and come from, and its CQs."""

    qp_num: int
    rc: RCQueuePair
    tx_flow: wire.Flow | None
    peer_addr: tuple[str, int] | None

    @property
    def send_cq(self) -> NicCompletionQueue: ...

    @property
    def recv_cq(self) -> NicCompletionQueue: ...


class SoftNIC:
    """UDP socket + thread that runs the RC engines of one soft device."""

    def __init__(self, ip: str, port: int, *, icrc: str = IcrcPolicy.STRICT, capture: str | None = None) -> None:
        if icrc not in IcrcPolicy.ALL:
            raise ValueError(f"ICRC policy must be one of {IcrcPolicy.ALL}, not {icrc!r}")
        self.icrc_policy = icrc
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self.sock.bind((ip, port))
        except OSError:
            self.sock.close()
            raise
        self.ip, self.port = self.sock.getsockname()[:2]
        if family == socket.AF_INET:
            # DF set and IP ID 0: the IP header the ICRC is computed over
            self.sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        for opt, force, size in (
            (socket.SO_RCVBUF, SO_RCVBUFFORCE, 8 << 20),
            (socket.SO_SNDBUF, SO_SNDBUFFORCE, 4 << 20),
        ):
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, force, size)
            except OSError:
                self.sock.setsockopt(socket.SOL_SOCKET, opt, size)
        self.sock.setblocking(False)
        self.lock = threading.RLock()
        self._qps: dict[int, NicQueuePair] = {}
        self.counters: dict[str, int] = defaultdict(int)
        #: the transport counters of the QPs removed so far (the device's transport_totals)
        self.closed_qp_counters: dict[str, int] = defaultdict(int)
        self.faults: LinkFaults | None = None
        self.capture = None
        if capture:
            from .pcap import PcapWriter

            self.capture = PcapWriter(capture)
        self._rx_flows: dict[tuple[str, int], wire.Flow] = {}
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._closing = False
        self._wait_deadline: float | None = None  # when the NIC thread wakes up by itself
        #: CQs whose channel must fire, collected under the lock and fired after it
        self._events: list[NicCompletionQueue] = []
        self._rxbuf = bytearray(65536)
        self._rxview = memoryview(self._rxbuf)
        self._rxbufs = [self._rxbuf]  # (recvmsg_into's buffer list, made once)
        self._undrained_since: float | None = None  # receive queue not emptied since then
        self._loops: dict[Any, int] = {}
        #: with an event loop attached, the NIC thread only steps in when the loop
        #: has not serviced the socket for this long (s); it also bounds its sleep
        self.watchdog_interval = 0.005
        self._last_service = 0.0
        #: send equal-size datagrams to one peer with one UDP GSO sendmsg
        #: (``AIORDMA_SOFT_GSO=0`` turns it off; it turns itself off if the
        #: kernel refuses it)
        self.gso = settings.SOFT_GSO.get()
        #: the netdev (ifindex) whose captures pause GSO batches (gso.py: it carries a
        #: batch whole, and a capture would see it so), or None; gso_paused: what the
        #: last reading of /proc/net/packet found
        self.gso_watch: int | None = None
        self.gso_paused = False
        self._gso_watch_next = 0.0
        #: the kernel hands a peer's GSO batch over as one datagram with its segment
        #: size (UDP_GRO): each packet's index in it is the IP ID its ICRC was made for
        self.gro = False
        if settings.SOFT_GRO.get():
            try:
                self.sock.setsockopt(SOL_UDP, UDP_GRO, 1)
                self.gro = True
            except OSError:  # an old kernel: plain datagrams
                pass
        #: the traffic class and hop limit (0: the system's) the socket sends with now
        self._sock_tclass = self._sock_hop_limit = 0
        #: with an event loop attached: after receiving packets, keep the loop
        #: polling the socket for this long (s) before it sleeps in the selector,
        #: so that the next request of a one-sided operation (which no local
        #: post or completion announces) finds the NIC awake: the NIC side of
        #: the poll window (``AIORDMA_SPIN_US``; 0 turns it off)
        self.poll_window = settings.SPIN_US.get() * 1e-6
        self._poll_until = 0.0
        self._polling: set[Any] = set()  # loops with a poll-window callback pending
        self._thread = threading.Thread(target=self._run, name=f"aiordma-nic-{self.ip}:{self.port}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------- control ----
    def wake(self) -> None:
        """Make the NIC thread re-evaluate its timers."""
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:
            pass

    # ------------------------------------------------------ queue pairs ----
    def add_qp(self, qp: NicQueuePair) -> None:
        """Route packets for ``qp.qp_num`` to ``qp`` (lock held by the caller)."""
        self._qps[qp.qp_num] = qp

    def remove_qp(self, qp_num: int) -> None:
        """Stop routing packets to ``qp_num`` (lock held by the caller)."""
        qp = self._qps.pop(qp_num, None)
        if qp is not None:
            for name, value in qp.rc.counters.as_dict().items():
                self.closed_qp_counters[name] += value

    @property
    def thread_alive(self) -> bool:
        """Whether the NIC thread runs (until the device closes)."""
        return self._thread.is_alive()

    def has_qp(self, qp_num: int) -> bool:
        return qp_num in self._qps

    def qp_count(self) -> int:
        return len(self._qps)

    def queue_pairs(self) -> list[NicQueuePair]:
        """The live queue pairs (lock held by the caller)."""
        return list(self._qps.values())

    def fire_events(self) -> None:
        """Raise the completion-channel events collected while the lock was held.

        Firing after the lock is released matters with the GIL: the woken
        consumer thread would otherwise run into a lock the NIC still holds.
        """
        if not self._events:
            return
        with self.lock:
            cqs, self._events = self._events, []
        for cq in cqs:
            cq.fire_event()

    def timer_armed(self, deadline: float | None) -> None:
        """Called after a post: wake the NIC thread if it sleeps past ``deadline``."""
        if deadline is not None and (self._wait_deadline is None or deadline < self._wait_deadline):
            self.wake()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self.wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        # a watched fd must leave its event loop before it is closed (uvloop aborts otherwise)
        for loop in list(self._loops):
            if not loop.is_closed():
                try:
                    loop.remove_reader(self.sock.fileno())
                except Exception:
                    pass
        self._loops.clear()
        self.sock.close()
        os.close(self._wake_fd)
        if self.capture is not None:
            self.capture.close()

    # ------------------------------------------------------------- send ----
    def send_packets(self, qp: NicQueuePair, pkts: list[wire.Packet]) -> None:
        flow = qp.tx_flow
        assert flow is not None, "a QP transmits only once it is connected (RTR)"
        addr = (flow.dst, flow.dport)
        if flow.tclass != self._sock_tclass or flow.hop_limit != self._sock_hop_limit:
            self._use_path(flow)
        faults = self.faults
        tracer = qp.rc.tracer
        if faults is None and self.capture is None and tracer is None:
            if len(pkts) == 1:  # the common case: one packet, one sendmsg
                self._sendto(wire.encode(pkts[0], flow), addr)
            else:
                self._send_batch(flow, addr, pkts)
            return
        for pkt in pkts:
            parts = wire.encode(pkt, flow)
            if faults is not None or self.capture is not None or tracer is not None:
                data = b"".join(parts)
                if self.capture is not None:
                    self.capture.write(data, flow)
                if tracer is not None:
                    tracer(TraceEvent.UDP_SEND, qpn=qp.qp_num, pkt=pkt, datagram=data, flow=flow)
                if faults is not None:
                    for d, a in faults.apply(data, addr):
                        self._sendto([d], a)
                    continue
                parts = [data]
            self._sendto(parts, addr)

    def _use_path(self, flow: wire.Flow) -> None:
        """Send the next datagrams with ``flow``'s traffic class and hop limit: the
        QPs share one socket, so the IP header's fields are set on it when they
        change (never, while every QP keeps the defaults; the lock is held)."""
        v6 = flow.ipv6
        if flow.tclass != self._sock_tclass:
            if v6:
                self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, flow.tclass)
            else:
                self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, flow.tclass)
            self._sock_tclass = flow.tclass
        if flow.hop_limit != self._sock_hop_limit:
            hops = flow.hop_limit or -1  # -1: the system's default
            if v6:
                self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS, hops)
            else:
                self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, hops)
            self._sock_hop_limit = flow.hop_limit

    def watch_captures(self, ifindex: int | None) -> None:
        """Pause GSO batches while a capture listens on netdev ``ifindex`` (None: never)."""
        with self.lock:
            self.gso_watch = ifindex
            self.gso_paused = False
            self._gso_watch_next = 0.0

    def _gso_on(self) -> bool:
        """Whether a run of datagrams may leave as one GSO batch now: on, and no
        capture listening on a netdev that carries batches whole (lock held)."""
        if not self.gso:
            return False
        if self.gso_watch is None:
            return True
        now = time.monotonic()
        if now >= self._gso_watch_next:
            paused = capture_listeners(self.gso_watch) > 0
            if paused and not self.gso_paused:
                self.counters["gso_capture_pauses"] += 1
            self.gso_paused = paused
            self._gso_watch_next = now + CAPTURE_RECHECK_S
        return not self.gso_paused

    def _send_batch(self, flow: wire.Flow, addr: tuple[str, int], pkts: list[wire.Packet]) -> None:
        """Send ``pkts`` to one peer, runs of equal-size datagrams (the last of
        a run may be shorter) in one UDP GSO sendmsg each.

        Where the kernel cuts a batch into datagrams it numbers their IPv4
        identification 0, 1, 2, ... (DF set, unconnected socket), and the ICRC
        covers it: segment i is encoded for ID i, and a soft receiver that gets
        the batch whole (UDP_GRO) checks packet i for ID i (gso.py)."""
        if len(pkts) == 1 or not self._gso_on():
            for pkt in pkts:
                self._sendto(wire.encode(pkt, flow), addr)
            return
        sizes = [wire.datagram_length(pkt) for pkt in pkts]
        i, n = 0, len(pkts)
        while i < n:
            seg = sizes[i]
            j = i + 1
            total = seg
            while j < n and j - i < GSO_MAX_SEGMENTS and total + sizes[j] <= GSO_MAX_BYTES:
                if sizes[j] > seg:
                    break
                total += sizes[j]
                j += 1
                if sizes[j - 1] < seg:
                    break  # a shorter datagram ends the run
            if j - i == 1:
                self._sendto(wire.encode(pkts[i], flow), addr)
            else:
                parts: list[bytes | bytearray | memoryview] = []
                for k in range(i, j):
                    parts.extend(wire.encode(pkts[k], flow, None if flow.ipv6 else k - i))
                if not self._sendto_gso(parts, seg, j - i, addr):
                    for k in range(i, j):  # GSO refused: one sendmsg each, with the plain IP ID
                        self._sendto(wire.encode(pkts[k], flow), addr)
            i = j

    def _sendto_gso(
        self, parts: list[bytes | bytearray | memoryview], seg: int, count: int, addr: tuple[str, int]
    ) -> bool:
        try:
            self.sock.sendmsg(parts, [(SOL_UDP, UDP_SEGMENT, seg.to_bytes(2, sys.byteorder))], 0, addr)
        except BlockingIOError:
            self.counters["tx_dropped_full"] += count
            return True
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EIO, errno.ENOPROTOOPT, errno.EOPNOTSUPP, errno.EMSGSIZE):
                log.info("soft NIC %s:%d: UDP GSO refused (%s); sending one datagram per call", self.ip, self.port, e)
                self.gso = False
                return False
            self.counters["tx_errors"] += count
            if e.errno not in (errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH):
                log.warning("soft NIC %s:%d: sendmsg to %s failed: %s", self.ip, self.port, addr, e)
            return True
        self.counters["tx_packets"] += count
        self.counters["tx_bytes"] += sum(len(p) for p in parts)
        self.counters["tx_gso_sends"] += 1
        return True

    def _sendto(self, parts: list[bytes | bytearray | memoryview], addr: tuple[str, int]) -> None:
        try:
            sent = self.sock.sendmsg(parts, (), 0, addr)
            self.counters["tx_packets"] += 1
            self.counters["tx_bytes"] += sent
        except BlockingIOError:
            # socket buffer full: the packet is lost like on a congested link;
            # the requester's retransmission recovers it
            self.counters["tx_dropped_full"] += 1
        except OSError as e:
            self.counters["tx_errors"] += 1
            if e.errno not in (errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH):
                log.warning("soft NIC %s:%d: sendmsg to %s failed: %s", self.ip, self.port, addr, e)

    def deliver_completions(self, qp: NicQueuePair) -> None:
        """Write ``qp``'s new completions into its CQs (lock held); the events of
        armed CQs fire at the next :meth:`fire_events`."""
        wcs = qp.rc.take_completions()
        if wcs:
            recv_cq, send_cq = qp.recv_cq, qp.send_cq
            for is_recv, wc in wcs:
                cq = recv_cq if is_recv else send_cq
                if cq.push(wc):
                    self._events.append(cq)

    def flush(self, qp: NicQueuePair, now: float) -> None:
        """Send what ``qp``'s engine produced and deliver its completions (lock held)."""
        pkts = qp.rc.transmit(now)
        # CQEs first: once the peer sees our ACK it may tell the application
        # (e.g. over the rendezvous) and the completion must already be in the CQ
        self.deliver_completions(qp)
        if pkts:
            self.send_packets(qp, pkts)

    # ---------------------------------------------------------- receive ----
    def _rx_flow(self, src: tuple[str, int]) -> wire.Flow:
        f = self._rx_flows.get(src)
        if f is None:
            f = wire.Flow(src[0], self.ip, src[1], self.port)
            if len(self._rx_flows) < 4096:
                self._rx_flows[src] = f
        return f

    def _receive_one(
        self, data: memoryview, src: tuple[str, int], now: float, touched: set[Any], index: int = 0
    ) -> None:
        """One RoCEv2 datagram; ``index``: its place in a coalesced (UDP_GRO)
        datagram, the IP ID its sender's ICRC was made for (0: a datagram of its own)."""
        c = self.counters
        c["rx_packets"] += 1
        c["rx_bytes"] += len(data)
        try:
            pkt = wire.decode(data)
        except wire.MalformedPacketError as e:
            c["rx_malformed"] += 1
            c["rx_malformed_" + e.reason] += 1
            return
        flow = self._rx_flows.get(src) or self._rx_flow(src)
        if index:
            flow = wire.Flow(flow.src, flow.dst, flow.sport, flow.dport, index)
        policy = self.icrc_policy
        ip_id: int | None = flow.ip_id
        if policy == IcrcPolicy.OFF:
            c["rx_icrc_unchecked"] += 1
        else:
            # the flow's guess is ID 0 (what a Linux UDP socket with DF sends), or the
            # packet's index in a GSO batch; the solver costs nothing more when it is right
            ip_id = wire.icrc_ip_id(data, flow)
            if ip_id is None:
                c["rx_icrc_errors"] += 1
                return
            if ip_id != flow.ip_id:
                if policy == IcrcPolicy.STRICT and ip_id > IcrcPolicy.STRICT_MAX_IP_ID:
                    c["rx_icrc_errors"] += 1
                    c["rx_icrc_ip_id_out_of_range"] += 1
                    return
                c["rx_icrc_ip_id_inferred"] += 1
        if self.capture is not None:
            if ip_id is not None and ip_id != flow.ip_id:  # record the IP header the packet came with
                flow = wire.Flow(flow.src, flow.dst, flow.sport, flow.dport, ip_id)
            self.capture.write(bytes(data), flow)
        qp = self._qps.get(pkt.dest_qp)
        if qp is None:
            c["rx_unknown_qp"] += 1
            return
        peer = qp.peer_addr
        if peer is not None and src[0] != peer[0]:
            c["rx_wrong_source"] += 1
            return
        # (decode accepts only RC opcodes: requests and responses)
        tracer = qp.rc.tracer
        if tracer is not None:
            tracer(TraceEvent.UDP_RECV, qpn=qp.qp_num, pkt=pkt, datagram=bytes(data), flow=flow)
        qp.rc.receive(pkt, now)
        touched.add(qp)

    def service(self, readable: bool = True) -> None:
        """One round of NIC work: receive what is queued on the socket, run
        due timers, transmit, then fire completion events (after the lock).

        ACKs go out as soon as they are due, not with the reply the
        application may be about to send."""
        # Holding ACKs until the end of the loop iteration, to leave in one UDP GSO
        # batch with that reply (like TCP's delayed ACK), saves CPU but raised the
        # 64-byte ping-pong latency by 10-40 % both times it was measured: the peer
        # then retires its request on the critical path instead of while this side works.
        touched: set[Any] = set()
        buf = self._rxbuf
        mv = self._rxview
        with self.lock:
            if self._closing:
                return
            # read the clock once the lock is ours: after a long wait for it, an
            # older "now" would re-arm retransmit timers that are already due
            now = time.monotonic()
            self._last_service = now
            drained = True
            if readable:
                drained = False
                recvfrom_into = self.sock.recvfrom_into
                recvmsg_into = self.sock.recvmsg_into if self.gro else None
                bufs = self._rxbufs
                anc: list[tuple[int, int, bytes]] = []
                flags = seg = 0
                for _ in range(256):
                    try:
                        if recvmsg_into is None:
                            n, src = recvfrom_into(buf)
                        else:
                            n, anc, flags, src = recvmsg_into(bufs, _GRO_CMSG_SPACE)
                    except (BlockingIOError, InterruptedError):
                        drained = True
                        break
                    except OSError as e:
                        if self._closing:
                            return
                        self.counters["rx_errors"] += 1
                        log.debug("recvfrom failed: %s", e)
                        break
                    try:
                        if anc or flags:  # (rare: a peer's GSO batch, whole, or a truncated one)
                            seg = _gro_segment(anc)
                            if flags & socket.MSG_CTRUNC:  # its segment size may be lost: not split safely
                                self.counters["rx_errors"] += 1
                                continue
                        if seg and seg < n:  # a GSO batch, whole: each packet at its index
                            self.counters["rx_gro_datagrams"] += 1
                            for k, off in enumerate(range(0, n, seg)):
                                self._receive_one(mv[off : min(off + seg, n)], src, now, touched, k)
                            seg = 0
                        else:
                            self._receive_one(mv[:n], src, now, touched)
                    except Exception:  # never let one packet kill the NIC
                        self.counters["rx_internal_errors"] += 1
                        log.exception("soft NIC: error while processing a packet")
            # Transport timers run once the receive queue is empty: an ACK or READ
            # response still waiting in the socket (the NIC fell behind, e.g. on a
            # busy host) must be seen before its request counts as timed out, or the
            # requester resends (whole READs) what is already answered and the extra
            # traffic makes the receiver fall further behind. A receive queue that
            # never empties delays the timers by at most MAX_TIMER_LAG.
            if drained:
                self._undrained_since = None
            elif self._undrained_since is None:
                self._undrained_since = now
            if drained or (self._undrained_since is not None and now - self._undrained_since >= MAX_TIMER_LAG):
                for qp in list(self._qps.values()):
                    t = qp.rc.next_timer()
                    if t is not None and t <= now:
                        qp.rc.on_timer(now)
                        touched.add(qp)
            for qp in touched:
                try:
                    self.flush(qp, now)
                except Exception:
                    self.counters["rx_internal_errors"] += 1
                    log.exception("soft NIC: error while transmitting")
            if self.faults is not None:
                for d, a in self.faults.flush():
                    self._sendto([d], a)
            cqs, self._events = self._events, []
        for cq in cqs:
            cq.fire_event()

    # ------------------------------------------------- event-loop assist ----
    def attach_loop(self, loop: Any) -> Callable[[], None]:
        """Let ``loop`` run the receive path in its own thread (the fast path).

        With the GIL, handing every packet from the NIC thread to the loop
        thread costs a thread switch or worse; when an event loop watches the
        socket itself, packets are processed where their completions are
        consumed. The NIC thread becomes a watchdog: it no longer wakes for
        every datagram, runs the transport timers, and processes the socket
        itself when the loop has not done so for ``watchdog_interval`` seconds,
        so one-sided operations still complete while the loop is busy or
        blocked. Returns the detach callable.
        """
        with self.lock:
            n = self._loops.get(loop, 0)
            self._loops[loop] = n + 1
            if n == 0:
                loop.add_reader(self.sock.fileno(), self._service_on_loop, loop)
        self.wake()  # switch the thread to watchdog mode now

        def detach() -> None:
            with self.lock:
                left = self._loops.get(loop, 0) - 1
                if left > 0:
                    self._loops[loop] = left
                    return
                self._loops.pop(loop, None)
            if not loop.is_closed():
                try:
                    loop.remove_reader(self.sock.fileno())
                except Exception:
                    pass

        return detach

    def _service_on_loop(self, loop: Any) -> None:
        """The loop's reader callback: service the socket, then open (or
        extend) the poll window if packets came in."""
        counters = self.counters
        before = counters["rx_packets"]
        self.service()
        if self.poll_window and counters["rx_packets"] != before:
            self._poll_until = time.monotonic() + self.poll_window
            if loop not in self._polling:
                self._polling.add(loop)
                loop.call_soon(self._poll_tick, loop)

    def _poll_tick(self, loop: Any) -> None:
        """A ready callback for one loop iteration of the poll window: the
        selector then polls the socket with a zero timeout instead of sleeping."""
        if self._closing or loop not in self._loops or time.monotonic() >= self._poll_until:
            self._polling.discard(loop)
            return
        self.counters["poll_window_ticks"] += 1
        loop.call_soon(self._poll_tick, loop)

    def _run(self) -> None:
        sock_fd = self.sock.fileno()
        full = select.poll()  # socket + wake-up fd: the NIC does all the work
        full.register(sock_fd, select.POLLIN)
        full.register(self._wake_fd, select.POLLIN)
        watch = select.poll()  # wake-up fd only: an event loop does the receive work
        watch.register(self._wake_fd, select.POLLIN)
        probe = select.poll()
        probe.register(sock_fd, select.POLLIN)
        timeout_ms = -1
        while not self._closing:
            loop_driven = bool(self._loops)
            if loop_driven:
                wd = int(self.watchdog_interval * 1000)
                timeout_ms = wd if timeout_ms < 0 else min(timeout_ms, wd)
            try:
                events = (watch if loop_driven else full).poll(timeout_ms)
            except InterruptedError:
                continue
            if self._closing:
                break
            readable = False
            for fd, _ev in events:
                if fd == self._wake_fd:
                    try:
                        os.eventfd_read(self._wake_fd)
                    except OSError:
                        pass
                else:
                    readable = True
            if self._loops:
                # watchdog: take over only when the loop has not serviced the
                # socket for a while (it is busy or blocked) and packets wait.
                # Asked again after the wait: a loop that attached while this
                # thread slept on the socket owns the packets from then on
                idle = time.monotonic() - self._last_service
                readable = idle >= self.watchdog_interval and bool(probe.poll(0))
            self.service(readable)
            timeout_ms = self._next_timeout_ms()

    def _next_timeout_ms(self) -> int:
        with self.lock:
            earliest = None
            for qp in self._qps.values():
                t = qp.rc.next_timer()
                if t is not None and (earliest is None or t < earliest):
                    earliest = t
            # published under the lock: a post that arms an earlier timer after this
            # point sees the deadline the thread is about to sleep until and wakes it
            # (set after the lock was released, a post in between saw a stale value,
            # did not wake the thread, and its retransmit timer never fired)
            self._wait_deadline = earliest
            if self._loops:  # watchdog mode: the thread sleeps at most watchdog_interval
                cap = time.monotonic() + self.watchdog_interval
                self._wait_deadline = cap if earliest is None else min(earliest, cap)
            if self.faults is not None and self.faults.holding:
                self._wait_deadline = time.monotonic()
                return 1
        if earliest is None:
            return -1
        return max(0, int((earliest - time.monotonic()) * 1000) + 1)


def _gro_segment(ancdata: list[tuple[int, int, bytes]]) -> int:
    """The segment size of a coalesced datagram (UDP_GRO), 0 for a plain one."""
    for level, kind, data in ancdata:
        if level == SOL_UDP and kind == UDP_GRO and len(data) >= 4:
            return int.from_bytes(data[:4], sys.byteorder)
    return 0
