"""RoCEv2 wire format: BTH and its extension headers, and the ICRC.

Pure functions, no I/O. A RoCEv2 packet is carried in a UDP datagram to port
4791::

    | BTH (12) | RETH / AETH / ImmDt / AtomicETH / AtomicAckETH | payload | pad 0-3 | ICRC (4) |

All fields are big-endian, except the ICRC, which is a CRC-32 (``zlib.crc32``)
over a pseudo-packet (8 bytes of 0xFF standing for the masked LRH, the IP
header with TOS/TTL/checksum masked to ones, the UDP header with its checksum
masked, the BTH with byte 4 masked, then everything up to the ICRC) and is put
on the wire little-endian. The layouts are those of the InfiniBand
specification's RoCEv2 annex as Linux's rxe driver implements them
(``rxe_hdr.h``, ``rxe_opcode.c``, ``rxe_icrc.c``); the ``_LAYOUT`` table below
says which extension headers each opcode carries.

The ICRC covers the IP header (including the IP identification field), which
a program on a UDP socket neither writes nor sees: :class:`Flow` rebuilds the
header Linux sends for an unconnected socket with ``IP_PMTUDISC_DO`` (DF set,
ID 0) and the receiver rebuilds the same one from the addresses it knows.
"""

from __future__ import annotations

import ipaddress
import struct
import zlib

try:  # ISA-L's CRC-32 is the same function, about 4x faster on large payloads
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency, zlib the fallback
    _crc32 = zlib.crc32
from dataclasses import dataclass
from enum import IntEnum

BTH_LEN = 12
RETH_LEN = 16
AETH_LEN = 4
IMMDT_LEN = 4
ATOMIC_ETH_LEN = 28
ATOMIC_ACK_ETH_LEN = 8
ICRC_LEN = 4

DEFAULT_PKEY = 0xFFFF
PSN_MASK = 0xFFFFFF


class MalformedPacketError(ValueError):
    """A datagram that is not a well-formed RC RoCEv2 packet. ``reason`` is a
    short counter name (e.g. ``"truncated"``, ``"bad_opcode"``)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"malformed RoCEv2 packet ({reason}){': ' + detail if detail else ''}")
        self.reason = reason


class Opcode(IntEnum):
    """Reliable Connected (RC) BTH opcodes (IBA 9.2.1 / rxe_opcode.c)."""

    SEND_FIRST = 0x00
    SEND_MIDDLE = 0x01
    SEND_LAST = 0x02
    SEND_LAST_WITH_IMMEDIATE = 0x03
    SEND_ONLY = 0x04
    SEND_ONLY_WITH_IMMEDIATE = 0x05
    RDMA_WRITE_FIRST = 0x06
    RDMA_WRITE_MIDDLE = 0x07
    RDMA_WRITE_LAST = 0x08
    RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x09
    RDMA_WRITE_ONLY = 0x0A
    RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x0B
    RDMA_READ_REQUEST = 0x0C
    RDMA_READ_RESPONSE_FIRST = 0x0D
    RDMA_READ_RESPONSE_MIDDLE = 0x0E
    RDMA_READ_RESPONSE_LAST = 0x0F
    RDMA_READ_RESPONSE_ONLY = 0x10
    ACKNOWLEDGE = 0x11
    ATOMIC_ACKNOWLEDGE = 0x12
    COMPARE_SWAP = 0x13
    FETCH_ADD = 0x14
    #: aiordma's own opcode, in the range the IBA leaves to manufacturers (0xC0-0xFF):
    #: a soft device's answer to a READ from a process on the same host that reads
    #: the bytes itself (cross-memory attach, the native engine's ``rc.c``). The
    #: AETH acknowledges the READ's last PSN; the payload is the 8-byte address of
    #: the first byte in the responder's process. A peer that did not ask for it
    #: drops it as a stray response.
    CMA_READ_GRANT = 0xC0


# header-presence bits
_RETH, _AETH, _IMM, _ATOMIC, _ATOMIC_ACK, _PAYLOAD = 1, 2, 4, 8, 16, 32

_LAYOUT: dict[int, int] = {
    Opcode.SEND_FIRST: _PAYLOAD,
    Opcode.SEND_MIDDLE: _PAYLOAD,
    Opcode.SEND_LAST: _PAYLOAD,
    Opcode.SEND_LAST_WITH_IMMEDIATE: _IMM | _PAYLOAD,
    Opcode.SEND_ONLY: _PAYLOAD,
    Opcode.SEND_ONLY_WITH_IMMEDIATE: _IMM | _PAYLOAD,
    Opcode.RDMA_WRITE_FIRST: _RETH | _PAYLOAD,
    Opcode.RDMA_WRITE_MIDDLE: _PAYLOAD,
    Opcode.RDMA_WRITE_LAST: _PAYLOAD,
    Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE: _IMM | _PAYLOAD,
    Opcode.RDMA_WRITE_ONLY: _RETH | _PAYLOAD,
    Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE: _RETH | _IMM | _PAYLOAD,
    Opcode.RDMA_READ_REQUEST: _RETH,
    Opcode.RDMA_READ_RESPONSE_FIRST: _AETH | _PAYLOAD,
    Opcode.RDMA_READ_RESPONSE_MIDDLE: _PAYLOAD,
    Opcode.RDMA_READ_RESPONSE_LAST: _AETH | _PAYLOAD,
    Opcode.RDMA_READ_RESPONSE_ONLY: _AETH | _PAYLOAD,
    Opcode.ACKNOWLEDGE: _AETH,
    Opcode.ATOMIC_ACKNOWLEDGE: _AETH | _ATOMIC_ACK,
    Opcode.COMPARE_SWAP: _ATOMIC,
    Opcode.FETCH_ADD: _ATOMIC,
    Opcode.CMA_READ_GRANT: _AETH | _PAYLOAD,
}
_LAYOUT = {int(op): lay for op, lay in _LAYOUT.items()}  # plain int keys: the codec looks up raw bytes

#: opcodes that start a new message (the responder's "first" packet)
FIRST_OPCODES = frozenset(
    {
        Opcode.SEND_FIRST,
        Opcode.SEND_ONLY,
        Opcode.SEND_ONLY_WITH_IMMEDIATE,
        Opcode.RDMA_WRITE_FIRST,
        Opcode.RDMA_WRITE_ONLY,
        Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE,
        Opcode.RDMA_READ_REQUEST,
        Opcode.COMPARE_SWAP,
        Opcode.FETCH_ADD,
    }
)
#: opcodes that end a message
LAST_OPCODES = frozenset(
    {
        Opcode.SEND_LAST,
        Opcode.SEND_LAST_WITH_IMMEDIATE,
        Opcode.SEND_ONLY,
        Opcode.SEND_ONLY_WITH_IMMEDIATE,
        Opcode.RDMA_WRITE_LAST,
        Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE,
        Opcode.RDMA_WRITE_ONLY,
        Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE,
        Opcode.RDMA_READ_REQUEST,
        Opcode.COMPARE_SWAP,
        Opcode.FETCH_ADD,
    }
)
REQUEST_OPCODES = frozenset(range(0x00, 0x0D)) | {Opcode.COMPARE_SWAP, Opcode.FETCH_ADD}
RESPONSE_OPCODES = frozenset(range(0x0D, 0x13)) | {Opcode.CMA_READ_GRANT}

# ------------------------------------------------------------------ AETH ----
AETH_ACK = 0x00
AETH_RNR_NAK = 0x20
AETH_NAK = 0x60
NAK_PSN_SEQUENCE_ERROR = 0
NAK_INVALID_REQUEST = 1
NAK_REMOTE_ACCESS_ERROR = 2
NAK_REMOTE_OPERATIONAL_ERROR = 3
NAK_INVALID_RD_REQUEST = 4
AETH_CREDITS_INVALID = 0x1F  # "no credit limit"

#: RNR timer code → microseconds (IBA table 45)
RNR_TIMER_US = (
    655360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920,
    2560, 3840, 5120, 7680, 10240, 15360, 20480, 30720, 40960, 61440, 81920,
    122880, 163840, 245760, 327680, 491520,
)  # fmt: skip


def aeth_kind(syndrome: int) -> int:
    """AETH_ACK, AETH_RNR_NAK or AETH_NAK (bits 6-5 of the syndrome)."""
    return syndrome & 0x60


# ---------------------------------------------------------------- packet ----


@dataclass(init=False)
class Packet:
    """One RC packet: BTH fields, the extension headers its opcode carries, payload.

    Fields of headers the opcode does not carry are ignored when encoding and
    left at their defaults when decoding. ``imm`` is host order. ``payload``
    excludes pad and ICRC.

    The defaults are class attributes and the constructor stores only what
    differs from them: a packet is built and parsed four times per message
    round trip, and most of its 21 fields keep their defaults.
    """

    opcode: int
    dest_qp: int
    psn: int
    ack_req: bool = False
    solicited: bool = False
    migreq: bool = False
    pkey: int = DEFAULT_PKEY
    fecn: bool = False
    becn: bool = False
    tver: int = 0
    # RETH (and the VA/R_Key of AtomicETH)
    va: int = 0
    rkey: int = 0
    dma_len: int = 0
    # AETH
    syndrome: int = 0
    msn: int = 0
    # ImmDt
    imm: int | None = None
    # AtomicETH
    swap_add: int = 0
    compare: int = 0
    # AtomicAckETH
    orig: int = 0
    payload: bytes | bytearray | memoryview = b""

    def __init__(
        self,
        opcode: int,
        dest_qp: int,
        psn: int,
        ack_req: bool = False,
        solicited: bool = False,
        migreq: bool = False,
        pkey: int = DEFAULT_PKEY,
        fecn: bool = False,
        becn: bool = False,
        tver: int = 0,
        va: int = 0,
        rkey: int = 0,
        dma_len: int = 0,
        syndrome: int = 0,
        msn: int = 0,
        imm: int | None = None,
        swap_add: int = 0,
        compare: int = 0,
        orig: int = 0,
        payload: bytes | bytearray | memoryview = b"",
    ) -> None:
        self.opcode = opcode
        self.dest_qp = dest_qp
        self.psn = psn
        self.ack_req = ack_req
        if payload:
            self.payload = payload
        if solicited or migreq or fecn or becn or tver or pkey != DEFAULT_PKEY:
            self.solicited, self.migreq, self.pkey = solicited, migreq, pkey
            self.fecn, self.becn, self.tver = fecn, becn, tver
        if va or rkey or dma_len:
            self.va, self.rkey, self.dma_len = va, rkey, dma_len
        if syndrome or msn:
            self.syndrome, self.msn = syndrome, msn
        if imm is not None:
            self.imm = imm
        if swap_add or compare or orig:
            self.swap_add, self.compare, self.orig = swap_add, compare, orig

    @property
    def name(self) -> str:
        try:
            return Opcode(self.opcode).name
        except ValueError:
            return f"OPCODE_0x{self.opcode:02x}"

    def __repr__(self) -> str:
        parts = [self.name, f"qp=0x{self.dest_qp:06x}", f"psn={self.psn}"]
        lay = _LAYOUT.get(self.opcode, 0)
        if lay & (_RETH | _ATOMIC):
            parts.append(f"va=0x{self.va:x} rkey=0x{self.rkey:08x}")
        if lay & _RETH:
            parts.append(f"len={self.dma_len}")
        if lay & _AETH:
            parts.append(f"syndrome=0x{self.syndrome:02x} msn={self.msn}")
        if lay & _IMM:
            parts.append(f"imm=0x{(self.imm or 0):08x}")
        if lay & _PAYLOAD:
            parts.append(f"payload={len(self.payload)}B")
        if self.ack_req:
            parts.append("A")
        return "<" + " ".join(parts) + ">"


_BTH = struct.Struct(">BBHI I")  # opcode, flags, pkey, [fb|destqp], [a|psn]
_RETH_S = struct.Struct(">QII")
_ATOMIC_S = struct.Struct(">QIQQ")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_ICRC_S = struct.Struct("<I")


def header_length(opcode: int) -> int:
    """Bytes of BTH plus extension headers for ``opcode``."""
    return _HEADER_LENGTH[opcode]


def _header_length(lay: int) -> int:
    n = BTH_LEN
    if lay & _RETH:
        n += RETH_LEN
    if lay & _AETH:
        n += AETH_LEN
    if lay & _ATOMIC_ACK:
        n += ATOMIC_ACK_ETH_LEN
    if lay & _IMM:
        n += IMMDT_LEN
    if lay & _ATOMIC:
        n += ATOMIC_ETH_LEN
    return n


_HEADER_LENGTH: dict[int, int] = {op: _header_length(lay) for op, lay in _LAYOUT.items()}

# BTH and the extension headers of each layout packed in one go (the order on
# the wire is RETH, AETH, AtomicAckETH, ImmDt, AtomicETH)
_H_BTH = struct.Struct(">BBHII")
_H_IMM = struct.Struct(">BBHIII")
_H_AETH = _H_IMM  # BTH + one 32-bit word
_H_RETH = struct.Struct(">BBHIIQII")
_H_RETH_IMM = struct.Struct(">BBHIIQIII")
_H_AETH_ATOMIC_ACK = struct.Struct(">BBHIIIQ")
_H_ATOMIC = struct.Struct(">BBHIIQIQQ")
_EXT = ~_PAYLOAD


def datagram_length(pkt: Packet) -> int:
    """Bytes of the UDP payload :func:`encode` makes for ``pkt`` (headers, payload, pad, ICRC)."""
    op = pkt.opcode
    n = _HEADER_LENGTH[op] + ICRC_LEN
    if _LAYOUT[op] & _PAYLOAD:
        plen = len(pkt.payload)
        n += plen + ((-plen) & 3)
    return n


def encode_headers(pkt: Packet) -> bytes:
    """BTH and extension headers of ``pkt`` (the pad count is taken from the payload length)."""
    op = pkt.opcode
    lay = _LAYOUT.get(op)
    if lay is None:
        raise ValueError(f"cannot encode opcode 0x{op:02x}: not an RC opcode")
    return _pack_headers(pkt, op, lay, (-len(pkt.payload)) & 3 if lay & _PAYLOAD else 0)


def _pack_headers(pkt: Packet, op: int, lay: int, pad: int) -> bytes:
    flags = (0x80 if pkt.solicited else 0) | (0x40 if pkt.migreq else 0) | (pad << 4) | (pkt.tver & 0xF)
    word1 = pkt.dest_qp & 0xFFFFFF
    if pkt.fecn:
        word1 |= 0x80000000
    if pkt.becn:
        word1 |= 0x40000000
    word2 = (0x80000000 | pkt.psn & PSN_MASK) if pkt.ack_req else pkt.psn & PSN_MASK
    ext = lay & _EXT
    if not ext:
        return _H_BTH.pack(op, flags, pkt.pkey, word1, word2)
    if ext == _IMM:
        return _H_IMM.pack(op, flags, pkt.pkey, word1, word2, (pkt.imm or 0) & 0xFFFFFFFF)
    if ext == _AETH:
        return _H_AETH.pack(op, flags, pkt.pkey, word1, word2, ((pkt.syndrome & 0xFF) << 24) | (pkt.msn & 0xFFFFFF))
    if ext == _RETH:
        return _H_RETH.pack(op, flags, pkt.pkey, word1, word2, pkt.va, pkt.rkey, pkt.dma_len)
    if ext == _RETH | _IMM:
        return _H_RETH_IMM.pack(
            op, flags, pkt.pkey, word1, word2, pkt.va, pkt.rkey, pkt.dma_len, (pkt.imm or 0) & 0xFFFFFFFF
        )
    if ext == _AETH | _ATOMIC_ACK:
        return _H_AETH_ATOMIC_ACK.pack(
            op, flags, pkt.pkey, word1, word2,
            ((pkt.syndrome & 0xFF) << 24) | (pkt.msn & 0xFFFFFF), pkt.orig & 0xFFFFFFFFFFFFFFFF,
        )  # fmt: skip
    assert ext == _ATOMIC, ext
    return _H_ATOMIC.pack(
        op, flags, pkt.pkey, word1, word2,
        pkt.va, pkt.rkey, pkt.swap_add & 0xFFFFFFFFFFFFFFFF, pkt.compare & 0xFFFFFFFFFFFFFFFF,
    )  # fmt: skip


_PADS = (b"", b"\0", b"\0\0", b"\0\0\0")


class Flow:
    """The IP and UDP headers one direction of traffic is carried in, for the ICRC.

    ``ip_id`` is the IPv4 identification the sender's kernel puts in the
    header (0 for an unconnected UDP socket with DF set, which is what the
    soft device uses). IPv6 is supported as well (pass IPv6 addresses).
    """

    __slots__ = ("_consts", "_dst_b", "_src_b", "dport", "dst", "hop_limit", "ip_id", "ipv6", "sport", "src", "tclass")

    def __init__(
        self,
        src: str,
        dst: str,
        sport: int,
        dport: int = 4791,
        ip_id: int = 0,
        *,
        tclass: int = 0,
        hop_limit: int = 0,
    ) -> None:
        self.src, self.dst, self.sport, self.dport, self.ip_id = src, dst, sport, dport, ip_id
        #: the IP header's traffic class (IPv4 TOS: DSCP << 2 | ECN) and hop limit
        #: (TTL; 0: the system's default) the sender's kernel writes; the ICRC masks both
        self.tclass, self.hop_limit = tclass, hop_limit
        a = ipaddress.ip_address(src)
        b = ipaddress.ip_address(dst)
        if a.version != b.version:
            raise ValueError(f"flow {src} -> {dst} mixes IPv4 and IPv6")
        self.ipv6 = a.version == 6
        self._src_b, self._dst_b = a.packed, b.packed
        self._consts: dict[int, tuple[int, int]] = {}

    def reversed(self) -> Flow:
        return Flow(self.dst, self.src, self.dport, self.sport, self.ip_id)

    def pseudo_header(self, udp_payload_len: int, ip_id: int | None = None) -> bytes:
        """The masked LRH + IP + UDP bytes that start the ICRC computation."""
        udp_len = 8 + udp_payload_len
        if self.ipv6:
            ip = (
                b"\x6f\xff\xff\xff"  # version 6, traffic class and flow label masked
                + struct.pack(">HBB", udp_len, 17, 0xFF)
                + self._src_b
                + self._dst_b
            )
        else:
            ipid = self.ip_id if ip_id is None else ip_id
            ip = (
                struct.pack(">BBHHHBBH", 0x45, 0xFF, 20 + udp_len, ipid, 0x4000, 0xFF, 17, 0xFFFF)
                + self._src_b
                + self._dst_b
            )
        udp = struct.pack(">HHHH", self.sport, self.dport, udp_len, 0xFFFF)
        return b"\xff" * 8 + ip + udp

    def icrc_constants(self, udp_payload_len: int, ip_id: int | None = None, byte4: int = 0) -> tuple[int, int]:
        """``(seed, fix)`` such that the ICRC of a datagram of ``udp_payload_len``
        bytes (ICRC included) whose BTH byte 4 is ``byte4`` is
        ``crc32(datagram_without_icrc, seed) ^ fix``.

        ``seed`` is the CRC of the masked pseudo-header. The ICRC masks BTH
        byte 4 (FECN, BECN, reserved) to 0xFF; a CRC is affine, so computing
        over the byte as sent and correcting by a constant that depends only
        on the length and the byte's value gives the same result with one
        ``crc32`` call and no copy. Cached per flow."""
        key = udp_payload_len | byte4 << 17 if ip_id is None else udp_payload_len | byte4 << 17 | (ip_id + 1) << 25
        c = self._consts.get(key)
        if c is None:
            head = self.pseudo_header(udp_payload_len, ip_id)
            total = len(head) + udp_payload_len - ICRC_LEN
            delta = bytearray(total)
            delta[len(head) + 4] = byte4 ^ 0xFF
            c = (_crc32(head), _crc32(delta) ^ _crc32(bytes(total)))
            if len(self._consts) >= 256:
                self._consts.pop(next(iter(self._consts)))  # oldest first
            self._consts[key] = c
        return c

    def icrc(
        self,
        parts: list[bytes | bytearray | memoryview],
        udp_payload_len: int | None = None,
        ip_id: int | None = None,
    ) -> int:
        """ICRC of a datagram given as the parts before the ICRC (headers first).

        ``ip_id`` overrides the flow's IPv4 identification (the ID the kernel
        gives the n-th segment of a UDP GSO send is the first one's plus n)."""
        if udp_payload_len is None:
            udp_payload_len = sum(len(p) for p in parts) + ICRC_LEN
        crc, fix = self.icrc_constants(udp_payload_len, ip_id, parts[0][4])
        for p in parts:
            crc = _crc32(p, crc)
        return crc ^ fix


def encode(pkt: Packet, flow: Flow, ip_id: int | None = None) -> list[bytes | bytearray | memoryview]:
    """The datagram for ``pkt`` as a list of buffers (headers, payload, pad+ICRC)
    ready for ``socket.sendmsg``; ``b"".join()`` it for one bytes object.
    ``ip_id``: the IPv4 identification it will be sent with, if not the flow's."""
    op = pkt.opcode
    lay = _LAYOUT.get(op)
    if lay is None:
        raise ValueError(f"cannot encode opcode 0x{op:02x}: not an RC opcode")
    if lay & _PAYLOAD and pkt.payload:
        payload = pkt.payload
        plen = len(payload)
        pad = (-plen) & 3
        hdr = _pack_headers(pkt, op, lay, pad)
        crc, fix = flow.icrc_constants(len(hdr) + plen + pad + ICRC_LEN, ip_id, hdr[4])
        crc = _crc32(payload, _crc32(hdr, crc))
        if pad:
            tail = _PADS[pad]
            return [hdr, payload, tail + _ICRC_S.pack(_crc32(tail, crc) ^ fix)]
        return [hdr, payload, _ICRC_S.pack(crc ^ fix)]
    hdr = _pack_headers(pkt, op, lay, 0)
    crc, fix = flow.icrc_constants(len(hdr) + ICRC_LEN, ip_id, hdr[4])
    return [hdr, _ICRC_S.pack(_crc32(hdr, crc) ^ fix)]


def encode_bytes(pkt: Packet, flow: Flow) -> bytes:
    """The whole UDP payload for ``pkt`` as one bytes object."""
    return b"".join(encode(pkt, flow))


def icrc_ok(datagram: bytes | bytearray | memoryview, flow: Flow) -> bool:
    """Whether the last 4 bytes of ``datagram`` are its ICRC for ``flow``."""
    n = len(datagram)
    if n < BTH_LEN + ICRC_LEN:
        return False
    received: int = _ICRC_S.unpack_from(datagram, n - ICRC_LEN)[0]
    return _icrc_of(memoryview(datagram), n, flow) == received


def _icrc_of(mv: memoryview, n: int, flow: Flow) -> int:
    """The ICRC the ``n``-byte datagram ``mv`` should carry on ``flow``."""
    crc, fix = flow.icrc_constants(n, None, mv[4])
    return _crc32(mv[: n - ICRC_LEN], crc) ^ fix


# ------------------------------------------------- IP identification solver ----
#
# The ICRC is a CRC-32, which is affine over GF(2): for datagrams of one length,
# flipping bits of the IP identification changes the CRC by a linear function of
# the flipped bits alone, whatever the other bytes are:
#
#     icrc(ID = x) = icrc(ID = 0) XOR M·x
#
# M is a 32 x 16 bit matrix whose column k is crc(z_k) XOR crc(0...0), z_k being
# the all-zero pseudo-packet of that length with only bit k of the ID field set.
# A CRC-32 detects every error burst of up to 32 bits, so M·x != 0 for x != 0:
# M has rank 16 and the ID that explains an ICRC, if there is one, is unique.
# The receiver that does not see the IP header (a UDP socket) computes the
# ICRC for its guess of the ID, takes d = computed XOR received and solves
# M·x = d. Only 2**16 of the 2**32 values of d have a solution, so a datagram
# corrupted anywhere else passes with probability 2**-16 (and with 64 * 2**-32
# if only IDs below 64 are allowed), against 2**-32 with the ID known.

#: offset of the IPv4 identification in the ICRC pseudo-packet (8 bytes of masked LRH, then the IP header)
_IP_ID_OFFSET = 8 + 4


class _IpIdSolver:
    """The reduced system M·x = d for one pseudo-packet length."""

    __slots__ = ("cols", "pivots")

    def __init__(self, total_len: int) -> None:
        zeros = bytearray(total_len)
        base = _crc32(zeros)
        cols = []
        for k in range(16):
            v = 1 << k
            zeros[_IP_ID_OFFSET] = v >> 8
            zeros[_IP_ID_OFFSET + 1] = v & 0xFF
            cols.append(_crc32(zeros) ^ base)
        self.cols = cols
        # Gaussian elimination on the columns, tracking which IDs bits make up
        # each reduced vector; fully reduced so that every pivot bit is set in
        # exactly one basis vector (its coefficient in d is then d's pivot bit)
        basis: list[list[int]] = []  # [vector, id_bits, pivot_bit]
        for k, c in enumerate(cols):
            vec, combo = c, 1 << k
            for b in basis:
                if vec >> b[2] & 1:
                    vec ^= b[0]
                    combo ^= b[1]
            if not vec:  # cannot happen for CRC-32 (bursts <= 32 bits are detected)
                continue
            p = vec.bit_length() - 1
            for b in basis:
                if b[0] >> p & 1:
                    b[0] ^= vec
                    b[1] ^= combo
            basis.append([vec, combo, p])
        self.pivots = tuple((b[2], b[1]) for b in basis)

    def solve(self, d: int) -> int | None:
        x = 0
        for p, combo in self.pivots:
            if d >> p & 1:
                x ^= combo
        check = 0
        cols = self.cols
        y = x
        k = 0
        while y:
            if y & 1:
                check ^= cols[k]
            y >>= 1
            k += 1
        return x if check == d else None


_ip_id_solvers: dict[int, _IpIdSolver] = {}
_IP_ID_SOLVER_CACHE = 256


def _ip_id_solver(total_len: int) -> _IpIdSolver:
    s = _ip_id_solvers.get(total_len)
    if s is None:
        if len(_ip_id_solvers) >= _IP_ID_SOLVER_CACHE:
            _ip_id_solvers.pop(next(iter(_ip_id_solvers)))  # oldest first
        s = _ip_id_solvers[total_len] = _IpIdSolver(total_len)
    return s


def icrc_ip_id(datagram: bytes | bytearray | memoryview, flow: Flow) -> int | None:
    """The IPv4 identification for which the datagram's ICRC is right, or None.

    ``flow`` gives everything else of the IP/UDP header (addresses, ports);
    its own ``ip_id`` only serves as the starting guess. Returns that guess
    when it is right, the unique other ID that makes the ICRC match
    otherwise, and None when no ID does (the datagram is corrupt, or the
    flow's addresses/ports are not the ones it was sent with). IPv6 has no
    identification: there the result is ``flow.ip_id`` or None.
    """
    n = len(datagram)
    if n < BTH_LEN + ICRC_LEN:
        return None
    d = _icrc_of(memoryview(datagram), n, flow) ^ _ICRC_S.unpack_from(datagram, n - ICRC_LEN)[0]
    if d == 0:
        return flow.ip_id
    if flow.ipv6:
        return None
    # pseudo-packet: 8 (LRH) + 20 (IPv4) + 8 (UDP) + the datagram minus its ICRC
    x = _ip_id_solver(36 + n - ICRC_LEN).solve(d)
    return None if x is None else x ^ flow.ip_id


def decode(datagram: bytes | bytearray | memoryview) -> Packet:
    """Parse a UDP payload (with its ICRC) into a :class:`Packet`.

    The ICRC is not checked here (see :func:`icrc_ok`). ``payload`` is a
    zero-copy memoryview into ``datagram``. Raises :class:`MalformedPacketError`.
    """
    mv = memoryview(datagram)
    n = len(mv)
    if n < BTH_LEN + ICRC_LEN:
        raise MalformedPacketError("truncated", f"{n} bytes is shorter than BTH + ICRC")
    op, flags, pkey, word1, word2 = _BTH.unpack_from(mv, 0)
    lay = _LAYOUT.get(op)
    if lay is None:
        raise MalformedPacketError("bad_opcode", f"opcode 0x{op:02x} is not an RC opcode aiordma handles")
    pad = (flags >> 4) & 3
    tver = flags & 0xF
    if tver != 0:
        raise MalformedPacketError("bad_tver", f"transport header version {tver}")
    pkt = Packet(op, word1 & 0xFFFFFF, word2 & PSN_MASK, word2 >= 0x80000000)
    if flags & 0xC0 or word1 >= 0x40000000 or pkey != DEFAULT_PKEY:
        pkt.solicited = flags >= 0x80
        pkt.migreq = bool(flags & 0x40)
        pkt.pkey = pkey
        pkt.fecn = word1 >= 0x80000000
        pkt.becn = bool(word1 & 0x40000000)
    hlen = _HEADER_LENGTH[op]
    end = n - ICRC_LEN - pad
    if end < hlen:
        raise MalformedPacketError("truncated", f"{pkt.name} needs {hlen} header bytes, datagram has {n}")
    ext = lay & _EXT
    if ext == _IMM:
        pkt.imm = _U32.unpack_from(mv, BTH_LEN)[0]
    elif ext == _AETH:
        w = _U32.unpack_from(mv, BTH_LEN)[0]
        pkt.syndrome = w >> 24
        pkt.msn = w & 0xFFFFFF
    elif ext:
        off = BTH_LEN
        if lay & _RETH:
            pkt.va, pkt.rkey, pkt.dma_len = _RETH_S.unpack_from(mv, off)
            off += RETH_LEN
        if lay & _AETH:
            w = _U32.unpack_from(mv, off)[0]
            pkt.syndrome, pkt.msn = w >> 24, w & 0xFFFFFF
            off += AETH_LEN
        if lay & _ATOMIC_ACK:
            pkt.orig = _U64.unpack_from(mv, off)[0]
            off += ATOMIC_ACK_ETH_LEN
        if lay & _IMM:
            pkt.imm = _U32.unpack_from(mv, off)[0]
            off += IMMDT_LEN
        if lay & _ATOMIC:
            pkt.va, pkt.rkey, pkt.swap_add, pkt.compare = _ATOMIC_S.unpack_from(mv, off)
    if lay & _PAYLOAD:
        pkt.payload = mv[hlen:end]
    elif end != hlen or pad:
        raise MalformedPacketError("bad_length", f"{pkt.name} carries no payload but has {end - hlen} extra bytes")
    return pkt


def psn_add(psn: int, n: int) -> int:
    """PSN arithmetic modulo 2**24."""
    return (psn + n) & PSN_MASK


def psn_diff(a: int, b: int) -> int:
    """Signed distance a - b in 24-bit PSN space, in [-2**23, 2**23)."""
    d = (a - b) & PSN_MASK
    return d - 0x1000000 if d & 0x800000 else d


def crc32(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """``zlib.crc32`` by the implementation the ICRC uses (see :func:`crc32_module`)."""
    return _crc32(data, crc)


def crc32_module() -> str:
    """The module whose CRC-32 computes the ICRC (``isal.isal_zlib`` or ``zlib``)."""
    return str(getattr(_crc32, "__module__", "") or "zlib")
