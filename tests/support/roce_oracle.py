"""An ICRC oracle that shares nothing with aiordma's wire code, and a live capture.

:func:`icrc_matches` follows the IBA's RoCEv2 rule from the frame as captured: CRC-32
(zlib's) over 8 bytes of 0xFF (the LRH RoCEv2 has not), the IPv4 header with its
type of service, TTL and header checksum set to ones, the UDP header with its
checksum set to ones, the BTH with its reserved byte 4 set to ones, and the rest of
the packet up to the ICRC, which is that CRC little-endian. The IP identification
is whatever the frame carries: a packet is right when the header on the wire says
so, not when some ID would make it match.

:class:`PacketCapture` is what tcpdump opens: an ``AF_PACKET`` socket with
``ETH_P_ALL`` on one netdev (root or ``CAP_NET_RAW``), on a thread, keeping every
IPv4 UDP frame to or from port 4791 as a :class:`Frame`.
"""

from __future__ import annotations

import socket
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Any

ROCE_PORT = 4791
ETH_P_ALL = 0x0003

#: the BTH opcodes of the RC transport, by kind (IBA 9.2)
KINDS = {
    **{op: "send" for op in range(0x00, 0x06)},
    **{op: "write" for op in range(0x06, 0x0C)},
    0x0C: "read request",
    **{op: "read response" for op in range(0x0D, 0x11)},
    0x11: "acknowledge",
    0x12: "atomic acknowledge",
    0x13: "compare and swap",
    0x14: "fetch and add",
}


@dataclass(frozen=True)
class Frame:
    """One captured IPv4/UDP frame: its IP header and UDP datagram, as on the wire."""

    ip_header: bytes
    udp: bytes  # the UDP header and payload, cut at the IP total length

    @property
    def src(self) -> str:
        return socket.inet_ntoa(self.ip_header[12:16])

    @property
    def dst(self) -> str:
        return socket.inet_ntoa(self.ip_header[16:20])

    @property
    def ip_id(self) -> int:
        return int(struct.unpack_from(">H", self.ip_header, 4)[0])

    @property
    def dont_fragment(self) -> bool:
        return bool(self.ip_header[6] & 0x40)

    @property
    def payload(self) -> bytes:
        return self.udp[8:]

    @property
    def opcode(self) -> int:
        return self.payload[0]

    @property
    def kind(self) -> str:
        """The packet's kind ("send", "write", ...); an acknowledge that is a NAK
        (AETH syndrome 011xxxxx) is "nak", an RNR NAK "rnr nak"."""
        kind = KINDS.get(self.opcode, f"opcode {self.opcode:#x}")
        if kind == "acknowledge" and len(self.payload) >= 16:
            syndrome = self.payload[12] >> 5
            kind = {1: "rnr nak", 3: "nak"}.get(syndrome, kind)
        return kind


def icrc_matches(frame: Frame) -> bool:
    """Whether the frame's ICRC is right for the header it carries (IPv4)."""
    ip = bytearray(frame.ip_header)
    ip[1] = 0xFF  # type of service
    ip[8] = 0xFF  # TTL
    ip[10:12] = b"\xff\xff"  # header checksum
    udp = bytearray(frame.udp[:8])
    udp[6:8] = b"\xff\xff"  # UDP checksum
    packet = frame.payload
    if len(packet) < 16:
        return False
    bth = bytearray(packet[:12])
    bth[4] = 0xFF  # reserved
    crc = zlib.crc32(b"\xff" * 8 + bytes(ip) + bytes(udp) + bytes(bth) + packet[12:-4])
    return struct.pack("<I", crc & 0xFFFFFFFF) == packet[-4:]


def parse(frame: bytes, link_header: int = 14) -> Frame | None:
    """The RoCEv2 frame in ``frame`` (Ethernet by default), or None."""
    ip = frame[link_header:]
    if len(ip) < 28 or ip[0] >> 4 != 4 or ip[9] != socket.IPPROTO_UDP:
        return None
    ihl = (ip[0] & 0x0F) * 4
    total = struct.unpack_from(">H", ip, 2)[0]
    sport, dport = struct.unpack_from(">HH", ip, ihl)
    if ROCE_PORT not in (sport, dport):
        return None
    return Frame(bytes(ip[:ihl]), bytes(ip[ihl:total]))


class PacketCapture:
    """Every RoCEv2 frame crossing ``netdev`` (each one once: the copy it went out with)."""

    def __init__(self, netdev: str = "lo") -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE (root)
        except OSError:
            pass
        self.sock.bind((netdev, 0))
        self.sock.settimeout(0.05)
        self.frames: list[Any] = []  # (Frame; a subclass's _take keeps what it likes)
        self._loopback = netdev == "lo"
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _take(self, frame: bytes, addr: tuple) -> None:
        """Keep one captured frame (``addr``: the packet socket's address tuple)."""
        # lo shows each frame twice, going out and coming in: keep the one that left
        if self._loopback and addr[2] != socket.PACKET_OUTGOING:
            return
        parsed = parse(frame)
        if parsed is not None:
            self.frames.append(parsed)

    def _run(self) -> None:
        while not self._stop:
            try:
                frame, addr = self.sock.recvfrom(70000)
            except TimeoutError:
                continue
            except OSError:
                return
            self._take(frame, addr)

    def stop(self) -> list[Frame]:
        """Stop, after taking every frame still queued on the socket."""
        if not self._stop:
            self._stop = True
            self._thread.join()
            self.sock.setblocking(False)
            while True:
                try:
                    frame, addr = self.sock.recvfrom(70000)
                except (BlockingIOError, OSError):
                    break
                self._take(frame, addr)
            self.sock.close()
        return self.frames
