"""Fuzzing a live soft device over real UDP (the integration half of
``tests/unit/test_fuzz_receive.py``).

Two soft devices on their own loopback addresses carry a connected RC queue
pair (A → B). An attacker's UDP socket throws datagrams at B's NIC:

* datagrams B's NIC must drop before any queue pair sees them: random bytes,
  truncated packets, a wrong ICRC, wrong pad counts, unknown opcodes, a bad
  transport version, a valid ICRC but an unknown destination QPN, a valid
  ICRC from the wrong source address. Every one of them is counted: the
  deltas of ``rx_malformed`` + ``rx_icrc_errors`` + ``rx_unknown_qp`` +
  ``rx_wrong_source`` add up to exactly the number sent, and
  ``rx_malformed`` is the sum of its ``rx_malformed_<reason>`` counters;
* packets with a valid ICRC from A's address aimed at B's connected QP:
  rkey guesses and out-of-bounds addresses at PSNs outside the window (the
  responder NAKs or re-acknowledges, never executes) and, at exactly the
  expected PSN, writes/reads/atomics with a guessed rkey, the rkey of a
  region that does not grant the access, or an address past the region
  (refused with a NAK: that QP goes to IBV_QPS_ERR, as on any RoCE NIC).

Throughout: the NIC thread survives (a normal write and read work after
every batch), B's memory outside the regions that granted the access is
unchanged (guard bytes around each region, a read-only region, a region
without remote access), and the writable region holds exactly what the
legitimate writes put there.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiordma.errors import DeviceNotFoundError
from aiordma.providers.base import (
    ACCESS_ALL,
    MTU,
    Access,
    QPAttr,
    QPCap,
    QPState,
    RecvWR,
    SendWR,
    WCStatus,
    WROpcode,
)
from aiordma.providers.soft import wire
from aiordma.providers.soft.device import SoftDevice
from aiordma.providers.soft.wire import Opcode, Packet

DEADLINE = 20.0
GUARD = 256
GUARD_BYTE = 0x5A
DROP_COUNTERS = ("rx_malformed", "rx_icrc_errors", "rx_unknown_qp", "rx_wrong_source")
SENT = {"dropped": 0, "hostile_valid": 0, "legit_ops": 0}


def new_device() -> SoftDevice:
    rng = random.Random(os.getpid() * 7919 + time.monotonic_ns())
    for _ in range(100):
        ip = f"127.{rng.randrange(100, 250)}.{rng.randrange(0, 256)}.{rng.randrange(2, 250)}"
        try:
            return SoftDevice(f"{ip}:4791")
        except DeviceNotFoundError:
            continue
    raise RuntimeError("no free loopback address")


class GuardedMR:
    """A memory region registered over the middle of a bigger buffer."""

    def __init__(self, pd, size: int, access: Access, fill: bytes | None = None) -> None:
        self.backing = bytearray([GUARD_BYTE]) * (size + 2 * GUARD)
        if fill is not None:
            self.backing[GUARD : GUARD + size] = fill
        self.mr = pd.reg_mr(memoryview(self.backing)[GUARD : GUARD + size], access)
        self.size = size
        self.shadow = bytearray(self.backing)  # what the backing must hold

    def check(self) -> None:
        assert self.backing[:GUARD] == bytes([GUARD_BYTE]) * GUARD, "guard bytes before a region changed"
        assert self.backing[GUARD + self.size :] == bytes([GUARD_BYTE]) * GUARD, "guard bytes after a region changed"
        assert self.backing == self.shadow, "a region changed where nobody may write"


class Link:
    """Devices A and B, a connected QP pair, B's guarded regions, an attacker socket."""

    def __init__(self) -> None:
        self.da, self.db = new_device(), new_device()
        self.pa, self.pb = self.da.alloc_pd(), self.db.alloc_pd()
        rng = random.Random(5)
        self.rw = GuardedMR(self.pb, 1 << 16, ACCESS_ALL, rng.randbytes(1 << 16))
        self.ro = GuardedMR(self.pb, 1 << 14, Access.LOCAL_WRITE | Access.REMOTE_READ, rng.randbytes(1 << 14))
        self.priv = GuardedMR(self.pb, 1 << 14, Access.LOCAL_WRITE, rng.randbytes(1 << 14))
        self.src = self.pa.reg_mr(bytearray(rng.randbytes(1 << 16)), Access.LOCAL_WRITE)
        self.dst = self.pa.reg_mr(bytearray(1 << 16), Access.LOCAL_WRITE)
        self.rng = rng
        self.qa = self.qb = None
        self.connect()
        # the attacker: same IP as A (so the source check passes), its own port
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((self.da.address[0], 0))
        self.flow = wire.Flow(self.da.address[0], self.db.address[0], self.sock.getsockname()[1], self.db.udp_port)
        # a stranger on another address
        self.stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.stranger.bind(("127.0.0.1", 0))
        self.stranger_flow = wire.Flow(
            "127.0.0.1", self.db.address[0], self.stranger.getsockname()[1], self.db.udp_port
        )
        self.reconnects = 0

    def connect(self) -> None:
        """A fresh QP pair on the same devices (after a hostile packet put one in ERR)."""
        for q in (self.qa, self.qb):
            if q is not None:
                q.close()
        if self.qb is not None:
            self.qb_recv.close()
            for cq in (self.cqa, self.cqb):
                cq.close()
        self.cqa = self.da.create_cq(1024)
        self.cqb = self.db.create_cq(1024)
        cap = QPCap(max_send_wr=256, max_recv_wr=64, max_send_sge=4, max_recv_sge=4)
        self.qa = self.pa.create_qp(self.cqa, self.cqa, cap)
        self.qb = self.pb.create_qp(self.cqb, self.cqb, cap)
        self.qb_recv = self.pb.reg_mr(bytearray(4 * 4096), Access.LOCAL_WRITE)
        psn_a, psn_b = self.rng.getrandbits(24), self.rng.getrandbits(24)
        for q in (self.qa, self.qb):
            q.to_init(QPAttr(qp_access_flags=ACCESS_ALL))
        for x, _dev, peer, peer_dev, rq, sq in (
            (self.qa, self.da, self.qb, self.db, psn_b, psn_a),
            (self.qb, self.db, self.qa, self.da, psn_a, psn_b),
        ):
            x.to_rtr(
                QPAttr(
                    dest_qp_num=peer.qp_num,
                    rq_psn=rq,
                    dgid=peer_dev.query_gid().gid,
                    dport=peer_dev.udp_port,
                    path_mtu=MTU.IBV_MTU_4096,
                    max_dest_rd_atomic=16,
                )
            )
            x.to_rts(QPAttr(sq_psn=sq, timeout=12, retry_cnt=7, max_rd_atomic=16))
        # receives for write-with-immediate (consumed before the rkey check, as in rxe)
        self.qb.post_recv([RecvWR(100 + i, [self.qb_recv.sge(i * 4096, 4096)]) for i in range(4)])

    def close(self) -> None:
        self.sock.close()
        self.stranger.close()
        for q in (self.qa, self.qb):
            q.close()
        self.da.close()
        self.db.close()

    # ----------------------------------------------------------- traffic ----
    def wait(self, cq, n: int) -> list:
        got: list = []
        deadline = time.monotonic() + DEADLINE
        while len(got) < n:
            got += cq.poll(n - len(got))
            if len(got) >= n:
                break
            assert time.monotonic() < deadline, f"{len(got)} of {n} completions after {DEADLINE} s"
            time.sleep(0.0005)
        return got

    def legit_write_read(self) -> None:
        """A normal RDMA Write then Read A -> B: the NIC is alive and the data is right."""
        off = self.rng.randrange(0, (1 << 16) - 9000)
        n = self.rng.randrange(1, 9000)
        soff = self.rng.randrange(0, (1 << 16) - n)
        self.qa.post_send(
            SendWR(
                1,
                WROpcode.IBV_WR_RDMA_WRITE,
                [self.src.sge(soff, n)],
                remote_addr=self.rw.mr.addr + off,
                rkey=self.rw.mr.rkey,
            )
        )
        self.qa.post_send(
            SendWR(
                2,
                WROpcode.IBV_WR_RDMA_READ,
                [self.dst.sge(0, n)],
                remote_addr=self.rw.mr.addr + off,
                rkey=self.rw.mr.rkey,
            )
        )
        wcs = self.wait(self.cqa, 2)
        assert [wc.status for wc in wcs] == [WCStatus.IBV_WC_SUCCESS] * 2, wcs
        data = bytes(self.src.view[soff : soff + n])
        assert bytes(self.dst.view[:n]) == data
        self.rw.shadow[GUARD + off : GUARD + off + n] = data
        SENT["legit_ops"] += 2
        self.check_memory()

    def check_memory(self) -> None:
        for g in (self.rw, self.ro, self.priv):
            g.check()

    def counters(self) -> dict:
        return self.db.counters

    def expected_psn(self) -> int:
        return self.qb.query().rq_psn  # the responder's expected PSN

    def packet(self, opcode: int, psn: int, **kw) -> Packet:
        return Packet(opcode, kw.pop("qpn", self.qb.qp_num), psn, **kw)


@pytest.fixture(scope="module")
def link():
    lk = Link()
    yield lk
    print(
        f"\nfuzz over UDP: {SENT['dropped']} datagrams that must be dropped, {SENT['hostile_valid']} valid-ICRC "
        f"hostile packets at a connected QP, {SENT['legit_ops']} legitimate operations, {lk.reconnects} reconnects"
    )
    lk.close()


def wait_counted(link: Link, before: dict, n: int) -> dict:
    """Wait until B's NIC counted ``n`` more dropped datagrams; return the deltas."""
    deadline = time.monotonic() + DEADLINE
    while True:
        after = link.counters()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        total = sum(delta.get(k, 0) for k in DROP_COUNTERS)
        if total >= n or time.monotonic() > deadline:
            return delta
        time.sleep(0.002)


# ------------------------------------------------------- dropped datagrams ----


@st.composite
def dropped_datagram(draw):
    """(kind, builder) for a datagram B's NIC must drop before any QP sees it."""
    kind = draw(
        st.sampled_from(
            ["random", "truncated", "bad_icrc", "bad_pad", "unknown_opcode", "bad_tver", "wrong_qpn", "wrong_source"]
        )
    )
    opcode = draw(st.sampled_from(sorted(wire.REQUEST_OPCODES | wire.RESPONSE_OPCODES)))
    payload = draw(st.binary(max_size=300))
    raw = draw(st.binary(max_size=200))
    cut = draw(st.integers(0, 400))
    flip = draw(st.integers(1, 255))
    pad = draw(st.integers(0, 3))
    bad_op = draw(st.integers(0x15, 0xFF))
    tver = draw(st.integers(1, 15))
    fields = draw(st.tuples(st.integers(0, 2**24 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1)))
    return kind, opcode, payload, raw, cut, flip, pad, bad_op, tver, fields


def make_dropped(link: Link, spec) -> tuple[bytes, bool]:
    """The datagram and whether it goes out through the stranger's socket."""
    kind, opcode, payload, raw, cut, flip, pad, bad_op, tver, (psn, va, rkey) = spec
    pkt = link.packet(opcode, psn, va=va, rkey=rkey, dma_len=len(payload), payload=payload, imm=1)
    good = wire.encode_bytes(pkt, link.flow)
    if kind == "random":
        return raw, False
    if kind == "truncated":
        # a valid packet cut short (an ICRC over fewer bytes cannot match, or the header is incomplete)
        return good[: cut % len(good)], False
    if kind == "bad_icrc":
        b = bytearray(good)
        b[-1 - (cut % 4)] ^= flip
        return bytes(b), False
    if kind == "bad_pad":
        b = bytearray(good)
        old = (b[1] >> 4) & 3
        b[1] = (b[1] & 0xCF) | (((old + 1 + pad % 3) % 4) << 4)  # a different pad count, ICRC left as it was
        return bytes(b), False
    if kind == "unknown_opcode":
        b = bytearray(good)
        b[0] = bad_op
        return bytes(b[:-4]) + struct.pack("<I", link.flow.icrc([bytes(b[:12]), bytes(b[12:-4])], len(b))), False
    if kind == "bad_tver":
        b = bytearray(good)
        b[1] = (b[1] & 0xF0) | tver
        return bytes(b[:-4]) + struct.pack("<I", link.flow.icrc([bytes(b[:12]), bytes(b[12:-4])], len(b))), False
    if kind == "wrong_qpn":
        qpn = psn if psn not in (link.qa.qp_num, link.qb.qp_num) else psn ^ 1
        return wire.encode_bytes(link.packet(opcode, psn, qpn=qpn, payload=payload), link.flow), False
    # wrong source: a valid packet for B's QP, from an address that is not A's
    return wire.encode_bytes(pkt, link.stranger_flow), True


def classify_random_is_droppable(data: bytes, link: Link) -> bool:
    """Random bytes are dropped unless they happen to be a valid packet (ICRC 2**-32)."""
    try:
        wire.decode(data)
    except wire.MalformedPacketError:
        return True
    return not wire.icrc_ok(data, link.flow)


@settings(
    max_examples=int(os.environ.get("AIORDMA_UDP_FUZZ_EXAMPLES", "150")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(specs=st.lists(dropped_datagram(), min_size=1, max_size=60))
def test_malformed_datagrams_are_dropped_and_counted(link, specs) -> None:
    before = link.counters()
    sent = 0
    for spec in specs:
        data, stranger = make_dropped(link, spec)
        if spec[0] == "random" and not classify_random_is_droppable(data, link):
            continue
        (link.stranger if stranger else link.sock).sendto(data, link.db.address)
        sent += 1
    delta = wait_counted(link, before, sent)
    total = sum(delta.get(k, 0) for k in DROP_COUNTERS)
    assert total == sent, f"sent {sent} bad datagrams, the NIC counted {total} drops: {delta}"
    assert delta.get("rx_packets", 0) >= sent
    sub = sum(v for k, v in delta.items() if k.startswith("rx_malformed_"))
    assert sub == delta.get("rx_malformed", 0), delta
    assert delta.get("rx_internal_errors", 0) == 0
    assert link.qb.state == QPState.IBV_QPS_RTS  # nothing reached the QP
    SENT["dropped"] += sent
    link.legit_write_read()


def test_every_drop_reason_is_counted(link) -> None:
    """One datagram of each kind, each landing in its own counter."""
    cases = {
        "rx_malformed_truncated": wire.encode_bytes(link.packet(Opcode.RDMA_WRITE_ONLY, 1, payload=b"x"), link.flow)[
            :20
        ],
        "rx_malformed_bad_opcode": b"\x7f" + bytes(30),
        "rx_malformed_bad_tver": b"\x11\x07" + bytes(30),
        "rx_malformed_bad_length": None,  # an ACK with a pad count (no payload allowed)
        "rx_icrc_errors": None,  # a SEND whose ICRC has one byte flipped
        "rx_unknown_qp": wire.encode_bytes(link.packet(Opcode.SEND_ONLY, 1, qpn=link.qb.qp_num ^ 0x800000), link.flow),
    }
    # an ACK (no payload allowed) carrying two pad bytes
    ack = bytearray(wire.encode_headers(link.packet(Opcode.ACKNOWLEDGE, 1))) + b"\0\0"
    ack[1] |= 0x20
    cases["rx_malformed_bad_length"] = bytes(ack) + struct.pack(
        "<I", link.flow.icrc([bytes(ack[:12]), bytes(ack[12:])], len(ack) + 4)
    )
    # (flipped, never overwritten with a constant: the ICRC's byte may already be it)
    good = wire.encode_bytes(link.packet(Opcode.SEND_ONLY, 1, payload=b"abc"), link.flow)
    cases["rx_icrc_errors"] = good[:-1] + bytes([good[-1] ^ 0xFF])
    for counter, data in cases.items():
        before = link.counters()
        link.sock.sendto(data, link.db.address)
        delta = wait_counted(link, before, 1)
        assert delta.get(counter, 0) == 1, (counter, delta)
        SENT["dropped"] += 1
    before = link.counters()
    link.stranger.sendto(wire.encode_bytes(link.packet(Opcode.SEND_ONLY, 1), link.stranger_flow), link.db.address)
    assert wait_counted(link, before, 1).get("rx_wrong_source", 0) == 1
    SENT["dropped"] += 1
    link.legit_write_read()


def test_a_coalesced_batch_of_bad_datagrams_is_split_and_each_counted(link) -> None:
    """A UDP GSO send of four equal datagrams and a shorter fifth: a native device with
    UDP_GRO gets them as one coalesced datagram and splits it; every piece is a
    packet of its own and is dropped and counted for its own reason (without GRO
    the kernel hands over five datagrams, with the same counts)."""
    unknown = [
        wire.encode_bytes(link.packet(Opcode.SEND_ONLY, i, qpn=link.qb.qp_num ^ 0x800000, payload=bytes(40)), link.flow)
        for i in range(4)
    ]
    seg = len(unknown[0])
    truncated = unknown[0][:10]  # shorter than a BTH plus its ICRC
    before = link.counters()
    link.sock.sendmsg(
        [b"".join(unknown) + truncated],
        [(socket.SOL_UDP, 103, struct.pack("=H", seg))],  # UDP_SEGMENT
        0,
        link.db.address,
    )
    delta = wait_counted(link, before, 5)
    assert delta.get("rx_unknown_qp", 0) == 4 and delta.get("rx_malformed_truncated", 0) == 1, delta
    assert sum(delta.get(k, 0) for k in DROP_COUNTERS) == 5
    assert delta.get("rx_gro_datagrams", 0) == (1 if link.db.gro else 0), delta
    assert link.qb.state == QPState.IBV_QPS_RTS
    SENT["dropped"] += 5
    link.legit_write_read()


# --------------------------------------------- valid packets, hostile intent ----


@st.composite
def off_window_packet(draw):
    opcode = draw(st.sampled_from(sorted(wire.REQUEST_OPCODES)))
    delta = draw(st.one_of(st.integers(1, 1 << 22), st.integers(-(1 << 22), -300)))
    rkey = draw(st.integers(0, 2**32 - 1))
    va = draw(st.integers(0, 2**64 - 1))
    dma_len = draw(st.one_of(st.integers(0, (1 << 32) - 1), st.just(0xFFFFFFFF)))
    payload = draw(st.binary(max_size=512))
    use_real_rkey = draw(st.booleans())
    return opcode, delta, rkey, va, dma_len, payload, use_real_rkey


@settings(
    max_examples=int(os.environ.get("AIORDMA_UDP_FUZZ_EXAMPLES", "150")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(specs=st.lists(off_window_packet(), min_size=1, max_size=40))
def test_hostile_packets_outside_the_window_never_execute(link, specs) -> None:
    """Valid ICRC, right source, right QPN, rkey guesses or the real rkey with
    addresses anywhere: outside the PSN window nothing is executed and the QP
    stays up (future PSNs get one sequence NAK, old ones a re-acknowledgement)."""
    before = link.counters()
    epsn = link.expected_psn()
    for opcode, delta, rkey, va, dma_len, payload, real in specs:
        if real:
            rkey = link.rw.mr.rkey
            va = link.rw.mr.addr + (va % (2 * link.rw.size)) - link.rw.size // 2
        pkt = link.packet(
            opcode,
            wire.psn_add(epsn, delta),
            va=va,
            rkey=rkey,
            dma_len=dma_len,
            payload=payload,
            swap_add=va,
            compare=rkey,
        )
        link.sock.sendto(wire.encode_bytes(pkt, link.flow), link.db.address)
    SENT["hostile_valid"] += len(specs)
    deadline = time.monotonic() + DEADLINE
    while True:
        after = link.counters()
        seen = (after.get("out_of_sequence", 0) - before.get("out_of_sequence", 0)) + (
            after.get("duplicate_requests", 0) - before.get("duplicate_requests", 0)
        )
        if seen >= len(specs) or time.monotonic() > deadline:
            break
        time.sleep(0.002)
    assert seen == len(specs), f"{len(specs)} off-window requests, {seen} counted as out of sequence/duplicate"
    assert after.get("remote_access_errors", 0) == before.get("remote_access_errors", 0)
    assert link.qb.state == QPState.IBV_QPS_RTS
    link.check_memory()
    link.legit_write_read()


EXACT_CASES = [
    ("write, guessed rkey", Opcode.RDMA_WRITE_ONLY, "guess", "start", 64),
    ("write, read-only region", Opcode.RDMA_WRITE_ONLY, "ro", "start", 64),
    ("write, no remote access", Opcode.RDMA_WRITE_ONLY, "priv", "start", 64),
    ("write past the end", Opcode.RDMA_WRITE_ONLY, "rw", "end", 64),
    ("write before the start", Opcode.RDMA_WRITE_ONLY, "rw", "before", 64),
    ("write-with-imm, guessed rkey", Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE, "guess", "start", 64),
    ("write FIRST, huge length", Opcode.RDMA_WRITE_FIRST, "rw", "start", -1),
    ("write MIDDLE without FIRST", Opcode.RDMA_WRITE_MIDDLE, "rw", "start", 4096),
    ("send LAST without FIRST", Opcode.SEND_LAST, "rw", "start", 10),
    ("read, guessed rkey", Opcode.RDMA_READ_REQUEST, "guess", "start", 64),
    ("read, no remote access", Opcode.RDMA_READ_REQUEST, "priv", "start", 64),
    ("read, huge length", Opcode.RDMA_READ_REQUEST, "rw", "start", 0xFFFFFFFF),
    ("atomic, misaligned", Opcode.FETCH_ADD, "rw", "misaligned", 8),
    ("atomic, read-only region", Opcode.FETCH_ADD, "ro", "start", 8),
    ("atomic, guessed rkey", Opcode.COMPARE_SWAP, "guess", "start", 8),
]


def _is_nak(datagram: bytes) -> bool:
    p = wire.decode(datagram)
    return p.opcode == Opcode.ACKNOWLEDGE and wire.aeth_kind(p.syndrome) == wire.AETH_NAK


@pytest.mark.parametrize("name, opcode, rkey_mode, va_mode, length", EXACT_CASES, ids=[c[0] for c in EXACT_CASES])
def test_hostile_packet_at_the_expected_psn_is_refused(link, name, opcode, rkey_mode, va_mode, length) -> None:
    """The attacker knows the QPN and the PSN: the responder refuses with a NAK
    and its QP goes to ERR; no byte outside a region that allows it changes,
    nothing of a region without REMOTE_READ leaves the NIC; the device (a new
    QP pair on the same NICs) keeps working."""
    regions = {"rw": link.rw, "ro": link.ro, "priv": link.priv}
    g = regions.get(rkey_mode)
    rkey = g.mr.rkey if g is not None else link.rng.getrandbits(32)
    while g is None and rkey in (link.rw.mr.rkey, link.ro.mr.rkey, link.priv.mr.rkey):
        rkey = link.rng.getrandbits(32)
    base = g.mr.addr if g is not None else link.rw.mr.addr
    size = g.size if g is not None else link.rw.size
    va = {"start": base, "end": base + size - 8, "before": base - 16, "misaligned": base + 3}[va_mode]
    dma_len = (1 << 31) if length == -1 else length
    plen = 0 if opcode in (Opcode.RDMA_READ_REQUEST, Opcode.FETCH_ADD, Opcode.COMPARE_SWAP) else min(dma_len, 4096)
    if opcode == Opcode.SEND_LAST:
        plen = length
    before = link.counters()
    epsn = link.expected_psn()
    pkt = link.packet(
        opcode, epsn, va=va, rkey=rkey, dma_len=dma_len, payload=b"\xee" * plen, swap_add=1, ack_req=True, imm=7
    )
    out: list[bytes] = []
    link.db.set_tracer(lambda event, **f: out.append(bytes(f["datagram"])) if event == "udp_send" else None)
    try:
        link.sock.sendto(wire.encode_bytes(pkt, link.flow), link.db.address)
        SENT["hostile_valid"] += 1
        # refused: the QP in the error state and the NAK on the wire (the NIC thread
        # may change the state before it sends the NAK: wait for both, not a guessed time)
        deadline = time.monotonic() + DEADLINE
        while not (link.qb.state == QPState.IBV_QPS_ERR and any(_is_nak(d) for d in list(out))):
            if time.monotonic() > deadline:
                break
            time.sleep(0.002)
    finally:
        link.db.set_tracer(None)
    secret = bytes(link.priv.backing[GUARD : GUARD + link.priv.size])
    for d in out:
        for i in range(0, len(secret) - 16, 16):
            assert secret[i : i + 16] not in d, "memory without REMOTE_READ left the NIC"
    assert out, "no NAK went out"
    assert any(_is_nak(d) for d in out), [wire.decode(d) for d in out]
    assert link.qb.state == QPState.IBV_QPS_ERR, f"{name}: {pkt!r} was not refused"
    assert link.qb.error_reason and "responder" in link.qb.error_reason
    after = link.counters()
    assert after.get("rx_internal_errors", 0) == before.get("rx_internal_errors", 0)
    link.check_memory()
    link.reconnects += 1
    link.connect()
    link.legit_write_read()


# ------------------------------------------------- through the asyncio layer ----


async def test_connection_learns_its_qp_was_killed_by_a_forged_packet():
    """A forged request at the expected PSN puts the server's QP in ERR (as on
    any RoCE NIC). The server's Connection must notice — its receives are
    flushed — and fail, instead of looking open while every later send is
    flushed in silence and ``recv()`` waits forever; the client then learns
    it too, and the server keeps accepting new clients."""
    import asyncio

    import aiordma

    accepted: list = []
    ended: list = []

    async def handler(conn):
        accepted.append(conn)
        try:
            async for m in conn:
                await conn.send(m)
        except aiordma.ConnectionLostError as e:
            ended.append(e)
            raise

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft")
    device = aiordma.get_device("soft")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        conn = await aiordma.connect("127.0.0.1", server.port, provider="soft")
        await conn.send(b"before")
        assert await conn.recv() == b"before"
        sconn = accepted[0]
        epsn = sconn.qp.query().rq_psn
        sock.bind((device.address[0], 0))
        flow = wire.Flow(device.address[0], device.address[0], sock.getsockname()[1], device.udp_port)
        forged = Packet(
            Opcode.RDMA_WRITE_ONLY,
            sconn.qp.qp_num,
            epsn,
            va=0x1000,
            rkey=0x12345678,
            dma_len=4,
            payload=b"evil",
            ack_req=True,
        )
        sock.sendto(wire.encode_bytes(forged, flow), device.address)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not ended and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert ended, "the server's connection did not notice its QP went to IBV_QPS_ERR"
        assert "IBV_QPS_ERR" in str(ended[0]) and "rkey" in str(ended[0]), str(ended[0])
        with pytest.raises((aiordma.ConnectionLostError, aiordma.ConnectionClosedError)):
            await asyncio.wait_for(conn.recv(), 10)
        await conn.close()
        async with await aiordma.connect("127.0.0.1", server.port, provider="soft") as again:
            await again.send(b"after")
            assert await again.recv() == b"after"
    finally:
        sock.close()
        server.close()
        await server.wait_closed()
