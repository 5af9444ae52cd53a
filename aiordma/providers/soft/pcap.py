"""A tiny pcap writer for debugging the soft RoCEv2 device.

The soft device sends RoCEv2 packets as UDP payloads on an ordinary socket, so
the kernel writes the Ethernet, IP and UDP headers and a capture on the socket
side never shows them. :class:`PcapWriter` writes those datagrams to a classic
libpcap file (``LINKTYPE_ETHERNET``) with synthesised Ethernet / IPv4-or-IPv6 /
UDP headers built from the :class:`~aiordma.providers.soft.wire.Flow` the
datagram was sent on, so that:

* Wireshark / ``tshark`` decode it as RoCEv2 (UDP port 4791; for another port
  use ``-d udp.port==N,infiniband``), and
* the ICRC that :mod:`wire` computed is the correct one for the headers in the
  file: the IPv4 header carries the flow's IP identification, DF and the
  addresses and ports of the flow, exactly what the ICRC covers.

The synthesised headers carry the flow's traffic class (TOS) and hop limit (TTL;
64 when the flow leaves it to the system), both masked out of the ICRC, a correct IPv4 header checksum, UDP checksum 0 over
IPv4 and the real UDP checksum over IPv6 (where 0 is illegal). MAC addresses
are fixed, locally administered addresses derived from the IP addresses.

It has no dependencies and is meant as an opt-in debug capture: writes are
serialised by a lock (it may be called from a NIC thread and the event loop at
once) and the file is flushed after every packet, so a capture is readable
while the program runs and complete if it crashes.
"""

from __future__ import annotations

import ipaddress
import os
import struct
import threading
import time
from collections.abc import Sequence
from typing import BinaryIO

from . import wire

__all__ = ["LINKTYPE_ETHERNET", "PcapWriter", "build_frame"]

LINKTYPE_ETHERNET = 1
PCAP_MAGIC = 0xA1B2C3D4  # microsecond timestamps
PCAP_VERSION = (2, 4)
DEFAULT_SNAPLEN = 262144

_ETHERTYPE_IPV4 = 0x0800
_ETHERTYPE_IPV6 = 0x86DD
_IPPROTO_UDP = 17
_TTL = 64

_GLOBAL_HDR = struct.Struct("<IHHiIII")
_REC_HDR = struct.Struct("<IIII")

Buffer = bytes | bytearray | memoryview


def _mac(ip_packed: bytes) -> bytes:
    """A locally administered unicast MAC (02:...) made from the low bytes of an IP address."""
    return b"\x02" + ip_packed[-5:] if len(ip_packed) >= 5 else b"\x02\x00" + ip_packed[-4:]


def _ones_complement_sum(data: bytes) -> int:
    if len(data) & 1:
        data += b"\0"
    s: int = sum(struct.unpack(f">{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def _checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of ``data``."""
    return ~_ones_complement_sum(data) & 0xFFFF


def build_frame(udp_payload: Buffer, flow: wire.Flow) -> bytes:
    """The Ethernet frame (without FCS) carrying ``udp_payload`` on ``flow``."""
    src = ipaddress.ip_address(flow.src).packed
    dst = ipaddress.ip_address(flow.dst).packed
    payload = bytes(udp_payload)
    udp_len = 8 + len(payload)
    if udp_len > 0xFFFF:
        raise ValueError(f"UDP payload of {len(payload)} bytes does not fit in a UDP datagram")
    if flow.ipv6:
        ethertype = _ETHERTYPE_IPV6
        ip = (
            struct.pack(">IHBB", 0x60000000 | flow.tclass << 20, udp_len, _IPPROTO_UDP, flow.hop_limit or _TTL)
            + src
            + dst
        )
        pseudo = src + dst + struct.pack(">IxxxB", udp_len, _IPPROTO_UDP)
        udp0 = struct.pack(">HHHH", flow.sport, flow.dport, udp_len, 0)
        csum = _checksum(pseudo + udp0 + payload)
        udp = struct.pack(">HHHH", flow.sport, flow.dport, udp_len, csum or 0xFFFF)
    else:
        ethertype = _ETHERTYPE_IPV4
        hdr = struct.pack(
            ">BBHHHBBH4s4s",
            0x45,
            flow.tclass,
            20 + udp_len,
            flow.ip_id & 0xFFFF,
            0x4000,
            flow.hop_limit or _TTL,
            _IPPROTO_UDP,
            0,
            src,
            dst,
        )
        csum = _checksum(hdr)
        ip = hdr[:10] + struct.pack(">H", csum) + hdr[12:]
        udp = struct.pack(">HHHH", flow.sport, flow.dport, udp_len, 0)
    eth = _mac(dst) + _mac(src) + struct.pack(">H", ethertype)
    return eth + ip + udp + payload


class PcapWriter:
    """Write RoCEv2 UDP payloads to a classic libpcap file as Ethernet frames.

    ``target`` is a path (opened, truncated, and closed by :meth:`close`) or a
    binary file object (written to and flushed, but left open by
    :meth:`close`). Usable as a context manager. Thread-safe.
    """

    def __init__(self, target: str | os.PathLike[str] | BinaryIO, *, snaplen: int = DEFAULT_SNAPLEN) -> None:
        self._lock = threading.Lock()
        self._snaplen = snaplen
        if isinstance(target, (str, os.PathLike)):
            self._f: BinaryIO = open(target, "wb")
            self._owns = True
        else:
            self._f = target
            self._owns = False
        self._closed = False
        self._f.write(_GLOBAL_HDR.pack(PCAP_MAGIC, *PCAP_VERSION, 0, 0, snaplen, LINKTYPE_ETHERNET))
        self._f.flush()

    @property
    def closed(self) -> bool:
        return self._closed

    def write(
        self,
        udp_payload: Buffer | Sequence[Buffer],
        flow: wire.Flow,
        timestamp: float | None = None,
    ) -> None:
        """Append one frame carrying ``udp_payload`` (the whole RoCEv2 datagram,
        ICRC included: a bytes-like object, or the list of buffers
        :func:`wire.encode` returns) sent on ``flow``. ``timestamp`` is seconds
        since the epoch (default: now)."""
        if not isinstance(udp_payload, (bytes, bytearray, memoryview)):
            udp_payload = b"".join(udp_payload)
        frame = build_frame(udp_payload, flow)
        if timestamp is None:
            timestamp = time.time()
        sec, usec = divmod(round(timestamp * 1_000_000), 1_000_000)
        caplen = min(len(frame), self._snaplen)
        rec = _REC_HDR.pack(sec, usec, caplen, len(frame))
        with self._lock:
            if self._closed:
                raise ValueError("write to a closed PcapWriter")
            self._f.write(rec + frame[:caplen])
            self._f.flush()

    def close(self) -> None:
        """Flush, and close the file if this writer opened it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._owns:
                self._f.close()
            else:
                self._f.flush()

    def __enter__(self) -> PcapWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
