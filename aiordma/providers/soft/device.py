"""The soft device: a userspace RoCEv2 verbs device behind the base interface.

It has one port whose GID table holds the IPv4-mapped GID of the address its
UDP socket is bound to, an active MTU of 4096, and the usual verbs objects.
Memory regions are registered in place over caller memory (their ``addr`` is
the real virtual address), lkeys and rkeys are random 32-bit values, and
queue-pair numbers are random 24-bit values, so none of them can be guessed.

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
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import DeviceNotFoundError, MemoryRegistrationError, QueuePairStateError
from ..base import (
    MTU,
    WRITE_ACCESS,
    Access,
    CompletionChannel,
    CompletionQueue,
    DeviceAttr,
    DeviceContext,
    GIDEntry,
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
    WorkCompletion,
    buffer_address,
    gid_from_ipv4,
    gid_to_ipv4,
)
from . import wire
from .nic import IcrcPolicy, SoftNIC
from .rc import RCQueuePair

DEFAULT_PORT = 4791
#: path MTU between two soft devices on loopback (64 KiB writes take 2 packets, not 16)
JUMBO_MTU = 32768
#: the largest payload that still fits one UDP datagram with BTH+RETH+ImmDt+ICRC
MAX_SOFT_MTU = 61440


class SoftMemoryRegion(MemoryRegion):
    def __init__(self, pd: SoftProtectionDomain, buffer: Any, access: Access) -> None:
        if isinstance(buffer, int):
            if buffer <= 0:
                raise MemoryRegistrationError(f"cannot register {buffer} bytes")
            buffer = bytearray(buffer)
        self.access = Access(access)
        self.addr, self._view = buffer_address(buffer, writable=bool(self.access & WRITE_ACCESS))
        self._owner = buffer  # keep the memory alive while registered
        self.length = self._view.nbytes
        if self.access & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC) and not self.access & Access.LOCAL_WRITE:
            raise MemoryRegistrationError(
                "IBV_ACCESS_REMOTE_WRITE/REMOTE_ATOMIC require IBV_ACCESS_LOCAL_WRITE (verbs rule)"
            )
        self.pd = pd
        self.lkey = pd._new_key(pd._by_lkey)
        self.rkey = pd._new_key(pd._by_rkey)
        pd._by_lkey[self.lkey] = self
        pd._by_rkey[self.rkey] = self
        self._closed = False

    @property
    def view(self) -> memoryview:
        return self._view

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self.pd.device.nic.lock:
            self.pd._by_lkey.pop(self.lkey, None)
            self.pd._by_rkey.pop(self.rkey, None)


class SoftProtectionDomain(ProtectionDomain):
    def __init__(self, device: SoftDevice) -> None:
        self.device = device
        self._by_lkey: dict[int, SoftMemoryRegion] = {}
        self._by_rkey: dict[int, SoftMemoryRegion] = {}

    @staticmethod
    def _new_key(table: dict) -> int:
        while True:
            k = secrets.randbits(32)
            if k and k not in table:
                return k

    # MemoryTable protocol for the RC engine
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
    ) -> SoftQueuePair:
        return SoftQueuePair(self, send_cq, recv_cq, cap or QPCap(), sq_sig_all)

    def close(self) -> None:
        for mr in list(self._by_lkey.values()):
            mr.close()


class SoftCompletionChannel(CompletionChannel):
    """A completion channel backed by an eventfd."""

    fd_mode = "eventfd"

    def __init__(self) -> None:
        self._fd = os.eventfd(0, os.EFD_SEMAPHORE | os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._events: deque[SoftCompletionQueue] = deque()
        self._lock = threading.Lock()
        self._cq: SoftCompletionQueue | None = None
        self._closed = False
        self._direct: Callable[[], None] | None = None
        self._direct_thread = 0

    def fileno(self) -> int:
        return self._fd

    def set_direct_handler(self, handler: Callable[[], None] | None) -> bool:
        """Events raised on this thread call ``handler()`` instead of the eventfd.

        With loop assist the soft NIC receives on the event loop's thread, so
        a completion found there is handed to the dispatcher at once: no
        eventfd write, no selector round, no eventfd read."""
        self._direct = handler
        self._direct_thread = threading.get_ident() if handler is not None else 0
        return True

    def _notify(self, cq: SoftCompletionQueue) -> None:
        direct = self._direct
        if direct is not None and threading.get_ident() == self._direct_thread:
            direct()
            return
        with self._lock:  # queue and count together: readable <=> an event is queued
            try:
                os.eventfd_write(self._fd, 1)
            except OSError:
                return
            self._events.append(cq)

    def get_cq_event(self) -> SoftCompletionQueue | None:
        """The next event, or None. Like the kernel's channel, the fd stays
        readable exactly while events are queued: the eventfd is a semaphore
        incremented before each event is queued and decremented after each is
        taken, so asking an empty channel costs no system call."""
        with self._lock:
            try:
                cq = self._events.popleft()
            except IndexError:
                return None
            try:
                os.eventfd_read(self._fd)
            except BlockingIOError:  # pragma: no cover - every queued event was counted
                pass
            return cq

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._fd)


class SoftCompletionQueue(CompletionQueue):
    def __init__(self, device: SoftDevice, cqe: int, channel: SoftCompletionChannel | None) -> None:
        if channel is not None:
            if channel._cq is not None:
                raise ValueError("one completion channel per CQ: this channel already serves a CQ")
            channel._cq = self
        self.device = device
        self.cqe = cqe
        self.channel = channel
        self._entries: deque[WorkCompletion] = deque()
        self._armed = False
        self._lock = threading.Lock()
        self.overflows = 0
        self.events_acked = 0

    def push(self, wc: WorkCompletion) -> None:
        """Called by the NIC: write a CQE and fire the channel if armed."""
        with self._lock:
            if len(self._entries) >= self.cqe:
                self.overflows += 1
            self._entries.append(wc)
            fire = self._armed
            self._armed = False
        tracer = self.device.tracer
        if tracer is not None:
            tracer("cqe", wc=wc)
        if fire and self.channel is not None:
            # fired by the NIC once it has released its lock (see SoftNIC.fire_events)
            self.device.nic.pending_events.append(self)

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

    def ack_events(self, n: int) -> None:
        self.events_acked += n

    def close(self) -> None:
        if self.channel is not None:
            self.channel._cq = None


class SoftQueuePair(QueuePair):
    def __init__(
        self,
        pd: SoftProtectionDomain,
        send_cq: CompletionQueue,
        recv_cq: CompletionQueue,
        cap: QPCap,
        sq_sig_all: bool,
    ) -> None:
        self.pd = pd
        self.device = pd.device
        self.nic = pd.device.nic
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        self.cap = cap
        with self.nic.lock:
            while True:
                qpn = secrets.randbits(24)
                if qpn > 1 and qpn not in self.nic.qps:
                    break
            self.qp_num = qpn
            self.rc = RCQueuePair(qpn, pd, cap, sq_sig_all)
            self.rc.tracer = self.device.tracer
            self.nic.qps[qpn] = self
        self.tx_flow: wire.Flow | None = None
        self.peer_addr: tuple[str, int] | None = None
        self._closed = False

    @property
    def state(self) -> QPState:
        return self.rc.state

    @property
    def counters(self) -> dict[str, int]:
        return self.rc.counters.as_dict()

    @property
    def error_reason(self) -> str | None:
        """Why the QP went to IBV_QPS_ERR (None if it did not)."""
        return self.rc.error_reason

    def modify(self, attr: QPAttr) -> None:
        if self._closed:
            raise QueuePairStateError("QP is destroyed")
        with self.nic.lock:
            if attr.qp_state == QPState.IBV_QPS_RTR:
                if attr.path_mtu is None:  # (a copy: the caller's QPAttr stays as it is)
                    attr = dataclasses.replace(attr, path_mtu=MTU.IBV_MTU_4096)
                if attr.dgid is not None:
                    ip = gid_to_ipv4(attr.dgid)
                    if ip is None:
                        raise QueuePairStateError(
                            "the soft device reaches peers by IPv4-mapped GID (::ffff:a.b.c.d); "
                            f"got {bytes(attr.dgid).hex()}"
                        )
                    dport = attr.dport or DEFAULT_PORT
                    self.tx_flow = wire.Flow(self.nic.ip, ip, self.nic.port, dport)
                    self.peer_addr = (ip, dport)
            self.rc.modify(attr, time.monotonic())
            if attr.qp_state == QPState.IBV_QPS_RTR and attr.path_mtu_bytes:
                jumbo = int(attr.path_mtu_bytes)
                if not 256 <= jumbo <= self.device.soft_mtu:
                    raise QueuePairStateError(
                        f"path MTU of {jumbo} bytes: this soft device allows 256 .. {self.device.soft_mtu}"
                    )
                self.rc.mtu = jumbo
            if attr.qp_state == QPState.IBV_QPS_RTR:
                # keep about 2 MiB in flight whatever the MTU (the receiver's socket buffer is 8 MiB)
                self.rc.window_pkts = max(16, min(256, (2 << 20) // self.rc.mtu))
            self.nic.flush(self, time.monotonic())
        if self.nic.pending_events:
            self.nic.fire_events()

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
                tracer("doorbell", qpn=self.qp_num, n=len(wrs))
            nic.flush(self, now)
            nic.timer_armed(rc.next_timer())
        if nic.pending_events:
            nic.fire_events()

    def post_recv(self, wrs: RecvWR | Sequence[RecvWR]) -> None:
        if isinstance(wrs, RecvWR):
            wrs = (wrs,)
        with self.nic.lock:
            if self._closed:
                raise QueuePairStateError("post_recv on a destroyed QP")
            for wr in wrs:
                self.rc.post_recv(wr)
            if self.rc._completions:
                self.nic.flush(self, time.monotonic())
        if self.nic.pending_events:
            self.nic.fire_events()

    def query(self) -> QPAttr:
        with self.nic.lock:
            return self.rc.query()

    def close(self) -> None:
        if self._closed:
            return
        with self.nic.lock:
            self._closed = True
            self.nic.qps.pop(self.qp_num, None)


class SoftDevice(DeviceContext):
    """A userspace RoCEv2 device bound to ``ip:port`` (UDP)."""

    provider = "soft"

    def __init__(
        self,
        address: str | None = None,
        *,
        name: str | None = None,
        icrc: str | None = None,
        capture: str | None = None,
    ) -> None:
        icrc = icrc or os.environ.get("AIORDMA_SOFT_ICRC", IcrcPolicy.STRICT)
        capture = capture or os.environ.get("AIORDMA_SOFT_PCAP") or None
        address = address or os.environ.get("AIORDMA_SOFT_ADDR") or None
        self.tracer = None
        self.nic = _bind_nic(address, icrc, capture)
        self.name = name or "soft0"
        self._gid = gid_from_ipv4(self.nic.ip)
        #: largest path MTU (bytes) toward another soft device: 32 KiB on loopback
        #: (an aiordma extension, "jumbo"), else RoCE's 4096. AIORDMA_SOFT_MTU overrides.
        default_mtu = JUMBO_MTU if self.nic.ip.startswith("127.") else 4096
        self.soft_mtu = int(os.environ.get("AIORDMA_SOFT_MTU") or default_mtu)
        if not 256 <= self.soft_mtu <= MAX_SOFT_MTU:
            raise ValueError(f"AIORDMA_SOFT_MTU must be between 256 and {MAX_SOFT_MTU}")
        self._closed = False

    @property
    def address(self) -> tuple[str, int]:
        """The (IP, UDP port) this device receives RoCEv2 packets on."""
        return self.nic.ip, self.nic.port

    @property
    def udp_port(self) -> int:
        return self.nic.port

    @property
    def counters(self) -> dict[str, int]:
        """Device counters (like rxe's hw_counters): packets, drops by reason,
        and the transport counters summed over live QPs."""
        with self.nic.lock:
            out = dict(self.nic.counters)
            for qp in self.nic.qps.values():
                for k, v in qp.rc.counters.as_dict().items():
                    out[k] = out.get(k, 0) + v
        return out

    def set_tracer(self, tracer: Any) -> None:
        """Install ``tracer(event, **fields)`` on the device and its QPs (the
        RDMA Write walk-through uses it)."""
        with self.nic.lock:
            self.tracer = tracer
            for qp in self.nic.qps.values():
                qp.rc.tracer = tracer

    def attach_event_loop(self, loop: Any) -> Any:
        """Process this device's packets on ``loop``'s thread as well (the NIC
        thread remains the backstop). ``AIORDMA_SOFT_LOOP_ASSIST=0`` turns it off."""
        if os.environ.get("AIORDMA_SOFT_LOOP_ASSIST", "1") == "0" or self._closed:
            return None
        return self.nic.attach_loop(loop)

    def query_device(self) -> DeviceAttr:
        return DeviceAttr(
            name=self.name,
            provider="soft",
            fw_ver="aiordma-soft",
            max_qp=1 << 16,
            max_qp_wr=16384,
            max_sge=32,
            max_cq=1 << 16,
            max_cqe=1 << 20,
            max_mr=1 << 20,
            max_mr_size=1 << 40,
            max_qp_rd_atom=16,
            max_qp_init_rd_atom=16,
            extra={
                "address": f"{self.nic.ip}:{self.nic.port}",
                "icrc": self.nic.icrc_policy,
                "soft_mtu": self.soft_mtu,
            },
        )

    def query_port(self, port_num: int = 1) -> PortAttr:
        if port_num != 1:
            raise DeviceNotFoundError(f"{self.name} has one port (1), not {port_num}")
        return PortAttr(PortState.IBV_PORT_ACTIVE, MTU.IBV_MTU_4096, MTU.IBV_MTU_4096, "Ethernet", 1, 1)

    def query_gid_table(self, port_num: int = 1) -> list[GIDEntry]:
        self.query_port(port_num)
        return [GIDEntry(0, self._gid, "RoCE v2", netdev="lo" if self.nic.ip.startswith("127.") else None)]

    def alloc_pd(self) -> SoftProtectionDomain:
        return SoftProtectionDomain(self)

    def create_comp_channel(self) -> SoftCompletionChannel:
        return SoftCompletionChannel()

    def create_cq(self, cqe: int, channel: CompletionChannel | None = None) -> SoftCompletionQueue:
        if channel is not None and not isinstance(channel, SoftCompletionChannel):
            raise TypeError("the channel belongs to another device")
        return SoftCompletionQueue(self, cqe, channel)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.nic.close()


def _parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if sep and host and "." in host:
        return host, int(port)
    return address, DEFAULT_PORT


def _bind_nic(address: str | None, icrc: str, capture: str | None) -> SoftNIC:
    if address:
        ip, port = _parse_address(address)
        try:
            return SoftNIC(ip, port, icrc=icrc, capture=capture)
        except OSError as e:
            raise DeviceNotFoundError(f"soft device cannot bind UDP {ip}:{port}: {e.strerror}") from e
    last: OSError | None = None
    for n in range(1, 255):
        try:
            return SoftNIC(f"127.0.0.{n}", DEFAULT_PORT, icrc=icrc, capture=capture)
        except OSError as e:
            last = e
            if e.errno != errno.EADDRINUSE:
                break
    raise DeviceNotFoundError(f"soft device found no free loopback address for UDP port 4791: {last}")
