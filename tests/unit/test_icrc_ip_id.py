"""Solving the ICRC for the IPv4 identification (wire.icrc_ip_id) and the
soft NIC's ICRC policies that use it (strict: IDs 0..63, any-ip-id, off).

Kernel Soft-RoCE numbers its packets with non-zero IP IDs, which a receiver
on a UDP socket cannot see but the ICRC covers; see IcrcPolicy.
"""

from __future__ import annotations

import random
import struct
import time
import zlib

import pytest

from aiordma.providers.soft import wire
from aiordma.providers.soft.engine import native_status
from aiordma.providers.soft.nic import IcrcPolicy, SoftNIC
from aiordma.providers.soft.wire import Opcode

ENGINES = ["python", "native"] if native_status()[0] else ["python"]

SEED = 20240611

# (opcode, builds a packet with a payload of n bytes)
_KINDS = [
    (Opcode.SEND_ONLY, True),
    (Opcode.SEND_MIDDLE, True),
    (Opcode.SEND_LAST_WITH_IMMEDIATE, True),
    (Opcode.RDMA_WRITE_FIRST, True),
    (Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE, True),
    (Opcode.RDMA_READ_RESPONSE_MIDDLE, True),
    (Opcode.RDMA_READ_REQUEST, False),
    (Opcode.ACKNOWLEDGE, False),
    (Opcode.ATOMIC_ACKNOWLEDGE, False),
    (Opcode.FETCH_ADD, False),
]


def random_datagram(rng: random.Random, ip_id: int) -> tuple[bytes, wire.Flow]:
    """A random RC datagram as a sender using ``ip_id`` puts it on the wire,
    and the flow a receiver knows (same addresses and ports, ID guess 0)."""
    op, has_payload = rng.choice(_KINDS)
    n = rng.choice([0, 1, 3, 4, 64, 256, 1023, 1024, 2048, 4096, rng.randrange(4097)]) if has_payload else 0
    pkt = wire.Packet(
        op,
        rng.randrange(1 << 24),
        rng.randrange(1 << 24),
        ack_req=rng.random() < 0.5,
        va=rng.randrange(1 << 64),
        rkey=rng.randrange(1 << 32),
        dma_len=n,
        syndrome=rng.randrange(256),
        msn=rng.randrange(1 << 24),
        imm=rng.randrange(1 << 32),
        swap_add=rng.randrange(1 << 64),
        orig=rng.randrange(1 << 64),
        payload=rng.randbytes(n),
    )
    src = f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}"
    dst = f"192.168.{rng.randrange(256)}.{rng.randrange(1, 255)}"
    sport = rng.randrange(49152, 65536)
    sent = wire.Flow(src, dst, sport, 4791, ip_id=ip_id)
    return wire.encode_bytes(pkt, sent), wire.Flow(src, dst, sport, 4791)


def brute_force_ids(datagram: bytes, flow: wire.Flow) -> list[int]:
    """Every IP ID for which the ICRC matches, by trying all 65536 (zlib only)."""
    n = len(datagram)
    pseudo = bytearray(flow.pseudo_header(n, ip_id=0))
    bth = bytearray(datagram[:12])
    bth[4] = 0xFF
    rest = bytes(pseudo[14:]) + bytes(bth) + datagram[12 : n - 4]
    want = struct.unpack("<I", datagram[n - 4 :])[0]
    head = zlib.crc32(pseudo[:12])
    return [x for x in range(65536) if zlib.crc32(rest, zlib.crc32(struct.pack(">H", x), head)) == want]


# ------------------------------------------------------------------ solver ----


def test_recovers_random_ids() -> None:
    rng = random.Random(SEED)
    for _ in range(500):
        ip_id = rng.choice([0, 1, 2, 63, 64, 0xFFFF, rng.randrange(65536)])
        dgram, flow = random_datagram(rng, ip_id)
        assert wire.icrc_ip_id(dgram, flow) == ip_id
        # any starting guess gives the same answer
        guess = rng.randrange(65536)
        other = wire.Flow(flow.src, flow.dst, flow.sport, flow.dport, ip_id=guess)
        assert wire.icrc_ip_id(dgram, other) == ip_id
        assert wire.icrc_ok(dgram, flow) == (ip_id == 0)


def test_solution_is_the_only_id_that_matches() -> None:
    rng = random.Random(SEED + 1)
    for _ in range(3):
        ip_id = rng.randrange(1, 65536)
        dgram, flow = random_datagram(rng, ip_id)
        assert brute_force_ids(dgram, flow) == [ip_id] == [wire.icrc_ip_id(dgram, flow)]


def test_matrix_has_full_rank_for_every_length() -> None:
    # a CRC-32 detects every burst of <= 32 bits, so the 16 ID bits always map injectively
    for total in list(range(36 + 12, 36 + 200)) + list(range(36 + 4000, 36 + 4200)):
        s = wire._IpIdSolver(total)
        assert len(s.pivots) == 16
        assert all(c for c in s.cols)


def test_corrupted_datagrams_are_rejected() -> None:
    """A flipped bit anywhere the ICRC covers (BTH byte 4 is masked) is not
    explained by an IP ID below 64 (strict), and almost never by any ID."""
    rng = random.Random(SEED + 2)
    trials = 3000
    explained_by_any_id = 0
    for i in range(trials):
        ip_id = rng.choice([0, rng.randrange(64), rng.randrange(65536)])
        dgram, flow = random_datagram(rng, ip_id)
        bad = bytearray(dgram)
        pos = rng.choice([p for p in (rng.randrange(len(bad)), len(bad) - 1, 0, 11) if p != 4])
        bad[pos] ^= 1 << rng.randrange(8) if i % 2 else rng.randrange(1, 256)
        got = wire.icrc_ip_id(bytes(bad), flow)
        assert got is None or got > IcrcPolicy.STRICT_MAX_IP_ID, (i, pos, got)
        explained_by_any_id += got is not None
    # any-ip-id keeps 16 bits of the ICRC: about trials / 65536 slip through
    assert explained_by_any_id <= 2, explained_by_any_id


def test_wrong_flow_is_rejected() -> None:
    rng = random.Random(SEED + 3)
    dgram, flow = random_datagram(rng, 4242)
    for other in (
        wire.Flow(flow.src, flow.dst, flow.sport + 1, flow.dport),
        wire.Flow(flow.dst, flow.src, flow.sport, flow.dport),
    ):
        got = wire.icrc_ip_id(dgram, other)
        assert got is None or got > IcrcPolicy.STRICT_MAX_IP_ID


def test_ipv6_has_no_id_to_solve_for() -> None:
    flow = wire.Flow("fd00::1", "fd00::2", 50000)
    dgram = wire.encode_bytes(wire.Packet(Opcode.SEND_ONLY, 7, 8, payload=b"v6"), flow)
    assert wire.icrc_ip_id(dgram, flow) == 0
    bad = bytearray(dgram)
    bad[13] ^= 1
    assert wire.icrc_ip_id(bytes(bad), flow) is None


def test_short_datagrams() -> None:
    flow = wire.Flow("10.0.0.1", "10.0.0.2", 50000)
    for n in range(16):
        assert wire.icrc_ip_id(b"\0" * n, flow) is None


def test_solver_is_cheap() -> None:
    """Every packet from kernel rxe goes through it under any-ip-id."""
    rng = random.Random(SEED + 4)
    flow = wire.Flow("10.0.3.1", "10.0.3.2", 50000)
    sent = wire.Flow("10.0.3.1", "10.0.3.2", 50000, ip_id=58951)
    dgram = wire.encode_bytes(wire.Packet(Opcode.SEND_MIDDLE, 5, 6, payload=rng.randbytes(4096)), sent)
    wire.icrc_ip_id(dgram, flow)
    t0 = time.thread_time()  # CPU time: a busy machine does not inflate it
    for _ in range(200):
        assert wire.icrc_ip_id(dgram, flow) == 58951
    per_packet = (time.thread_time() - t0) / 200
    assert per_packet < 0.001, f"{per_packet * 1e6:.0f} us per 4 KiB packet"


# ------------------------------------------------------------- NIC policy ----


class _Nic:
    """One engine's NIC, reduced to what these tests need: deliver a datagram as if
    received from ``src``, read the counters (each engine's own test hook)."""

    def __init__(self, engine: str, policy: str) -> None:
        if engine == "python":
            self.nic = SoftNIC("127.0.0.1", 0, icrc=policy)
        else:
            from aiordma.providers.soft._native._engine import NativeEngine

            self.nic = NativeEngine("127.0.0.1", 0, icrc=policy)
        self.engine = engine
        self.ip, self.port = self.nic.ip, self.nic.port

    def deliver(self, dgram: bytes, src: tuple[str, int]) -> None:
        if self.engine == "python":
            with self.nic.lock:
                self.nic._receive_one(memoryview(dgram), src, time.monotonic(), set())
        else:
            self.nic._inject(dgram, src)

    @property
    def counters(self) -> dict:
        return self.nic.counters if self.engine == "python" else self.nic.counters()

    def close(self) -> None:
        self.nic.close()


@pytest.fixture(params=ENGINES)
def nic_for(request):
    nics = []

    def make(policy: str) -> _Nic:
        nic = _Nic(request.param, policy)
        nics.append(nic)
        return nic

    yield make
    for nic in nics:
        nic.close()


def _deliver(nic: _Nic, dgram: bytes, src: tuple[str, int]) -> None:
    nic.deliver(dgram, src)


def _datagram(nic: _Nic, ip_id: int, corrupt: bool = False) -> tuple[bytes, tuple[str, int]]:
    src = ("127.0.0.1", 50123)
    flow = wire.Flow(src[0], nic.ip, src[1], nic.port, ip_id=ip_id)
    # to a QP that does not exist: a packet that passes the ICRC is counted as rx_unknown_qp
    d = bytearray(wire.encode_bytes(wire.Packet(Opcode.SEND_ONLY, 0xABCDEF, 1, payload=b"rxe" * 50), flow))
    if corrupt:
        d[20] ^= 0x10
    return bytes(d), src


@pytest.mark.parametrize(
    "policy, ip_id, corrupt, passed, counters",
    [
        ("strict", 0, False, True, {}),
        ("strict", 1, False, True, {"rx_icrc_ip_id_inferred": 1}),
        ("strict", 63, False, True, {"rx_icrc_ip_id_inferred": 1}),
        ("strict", 64, False, False, {"rx_icrc_errors": 1, "rx_icrc_ip_id_out_of_range": 1}),
        ("strict", 58951, False, False, {"rx_icrc_errors": 1, "rx_icrc_ip_id_out_of_range": 1}),
        ("strict", 5, True, False, {"rx_icrc_errors": 1}),
        ("any-ip-id", 0, False, True, {}),
        ("any-ip-id", 58951, False, True, {"rx_icrc_ip_id_inferred": 1}),
        ("any-ip-id", 0xFFFF, False, True, {"rx_icrc_ip_id_inferred": 1}),
        ("any-ip-id", 58951, True, False, {"rx_icrc_errors": 1}),
        ("off", 58951, True, True, {"rx_icrc_unchecked": 1}),
    ],
)
def test_nic_icrc_policy(nic_for, policy: str, ip_id: int, corrupt: bool, passed: bool, counters: dict) -> None:
    nic = nic_for(policy)
    dgram, src = _datagram(nic, ip_id, corrupt)
    _deliver(nic, dgram, src)
    c = nic.counters
    assert c["rx_packets"] == 1
    assert c.get("rx_unknown_qp", 0) == (1 if passed else 0)
    for key in ("rx_icrc_errors", "rx_icrc_ip_id_out_of_range", "rx_icrc_ip_id_inferred", "rx_icrc_unchecked"):
        assert c.get(key, 0) == counters.get(key, 0), (key, dict(c))


@pytest.mark.parametrize("engine", ENGINES)
def test_policy_names(engine: str) -> None:
    assert IcrcPolicy.ALL == ("strict", "any-ip-id", "off")
    with pytest.raises(ValueError, match="any-ip-id"):
        _Nic(engine, "lenient")
