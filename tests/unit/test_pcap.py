"""Tests of the debug pcap writer: scapy and tshark must read back what wire.py wrote."""

from __future__ import annotations

import io
import shutil
import struct
import subprocess
import threading
from pathlib import Path

import pytest

from aiordma.providers.soft import wire
from aiordma.providers.soft.pcap import PcapWriter

scapy_all = pytest.importorskip("scapy.all")
roce = pytest.importorskip("scapy.contrib.roce")
IP, IPv6, UDP, Ether, raw, rdpcap = (
    scapy_all.IP, scapy_all.IPv6, scapy_all.UDP, scapy_all.Ether, scapy_all.raw, scapy_all.rdpcap,
)  # fmt: skip
BTH = roce.BTH

O = wire.Opcode  # noqa: E741 (the opcode table, as in the wire tests)
OTHER_PORT = 18515

REQ = wire.Flow("10.0.0.1", "10.0.0.2", 50000, 4791)
RESP = wire.Flow("10.0.0.2", "10.0.0.1", 50001, 4791)
REQ6 = wire.Flow("fd00::1", "fd00::2", 50002, 4791)
RESP6 = wire.Flow("fd00::2", "fd00::1", 50003, 4791)
OTHER = wire.Flow("192.168.7.1", "192.168.7.2", 40000, OTHER_PORT, ip_id=0x1234)

MTU = 256


def _packets() -> list[tuple[wire.Packet, wire.Flow]]:
    body = bytes(range(256)) * 3
    return [
        (wire.Packet(O.SEND_ONLY, 0x000011, 100, ack_req=True, payload=b"hello, rdma"), REQ),
        (
            wire.Packet(
                O.RDMA_WRITE_FIRST,
                0xABCDEF,
                101,
                va=0x1122334455667788,
                rkey=0xDEADBEEF,
                dma_len=3 * MTU - 5,
                payload=body[:MTU],
            ),
            REQ,
        ),
        (wire.Packet(O.RDMA_WRITE_MIDDLE, 0xABCDEF, 102, payload=body[MTU : 2 * MTU]), REQ),
        (wire.Packet(O.RDMA_WRITE_LAST, 0xABCDEF, 103, ack_req=True, payload=body[2 * MTU : 3 * MTU - 5]), REQ),
        (wire.Packet(O.ACKNOWLEDGE, 0x000022, 103, syndrome=0x1F, msn=2), RESP),
        (
            wire.Packet(
                O.RDMA_WRITE_ONLY_WITH_IMMEDIATE,
                0x000011,
                0xFFFFFF,
                va=0x7F0000001000,
                rkey=0x01020304,
                dma_len=7,
                imm=0xCAFEBABE,
                payload=b"1234567",
            ),
            REQ,
        ),
        (wire.Packet(O.RDMA_READ_REQUEST, 0x000011, 0, va=0xFFFFFFFFFFFFFFF0, rkey=0xFFFFFFFF, dma_len=64), REQ),
        (wire.Packet(O.RDMA_READ_RESPONSE_ONLY, 0x000022, 0, syndrome=0x1F, msn=4, payload=b"r" * 64), RESP),
        (wire.Packet(O.COMPARE_SWAP, 0x000011, 1, va=0x2000, rkey=0x55, swap_add=9, compare=8), REQ),
        (wire.Packet(O.ATOMIC_ACKNOWLEDGE, 0x000022, 1, syndrome=0x1F, msn=5, orig=8), RESP),
        # IPv6
        (wire.Packet(O.SEND_ONLY, 0x000033, 7, payload=b"over ipv6!"), REQ6),
        (wire.Packet(O.RDMA_WRITE_ONLY, 0x000033, 8, va=0x3000, rkey=0x66, dma_len=3, payload=b"abc"), REQ6),
        (wire.Packet(O.ACKNOWLEDGE, 0x000044, 8, syndrome=0x1F, msn=2), RESP6),
        # a non-default UDP port, with a nonzero IP ID
        (
            wire.Packet(O.RDMA_WRITE_FIRST, 0x000055, 200, va=0x4000, rkey=0x77, dma_len=2 * MTU, payload=body[:MTU]),
            OTHER,
        ),
        (wire.Packet(O.RDMA_READ_REQUEST, 0x000055, 201, va=0x5000, rkey=0x88, dma_len=4096), OTHER),
    ]


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[wire.Packet, wire.Flow, bytes]]]:
    path = tmp_path_factory.mktemp("pcap") / "roce.pcap"
    written = []
    with PcapWriter(path) as w:
        for i, (pkt, flow) in enumerate(_packets()):
            dgram = wire.encode_bytes(pkt, flow)
            if i % 2:
                w.write(dgram, flow, timestamp=1_700_000_000.25 + i)
            else:
                w.write(wire.encode(pkt, flow), flow, timestamp=1_700_000_000.25 + i)  # list of buffers
            written.append((pkt, flow, dgram))
    return path, written


def test_file_format(capture) -> None:
    path, written = capture
    data = path.read_bytes()
    magic, vmaj, vmin, zone, sigfigs, snaplen, linktype = struct.unpack_from("<IHHiIII", data, 0)
    assert (magic, vmaj, vmin, zone, sigfigs, linktype) == (0xA1B2C3D4, 2, 4, 0, 0, 1)
    assert snaplen >= 65535
    off = 24
    for i, (_, flow, dgram) in enumerate(written):
        sec, usec, incl, orig = struct.unpack_from("<IIII", data, off)
        assert (sec, usec) == (1_700_000_000 + i, 250_000)
        assert incl == orig == 14 + (40 if flow.ipv6 else 20) + 8 + len(dgram)
        frame = data[off + 16 : off + 16 + incl]
        assert frame.endswith(dgram)
        off += 16 + incl
    assert off == len(data)


def test_scapy_reads_back_and_agrees_on_icrc(capture) -> None:
    path, written = capture
    frames = rdpcap(str(path))
    assert len(frames) == len(written)
    for frame, (pkt, flow, dgram) in zip(frames, written):
        assert Ether in frame and UDP in frame
        ipl = frame[IPv6] if flow.ipv6 else frame[IP]
        assert (ipl.src, ipl.dst) == (flow.src, flow.dst)
        udp = frame[UDP]
        assert (udp.sport, udp.dport, udp.len) == (flow.sport, flow.dport, 8 + len(dgram))
        assert bytes(udp.payload) == dgram
        if flow.ipv6:
            assert (ipl.hlim, ipl.plen, ipl.nh) == (64, 8 + len(dgram), 17)
            # the real UDP checksum: scapy recomputes the same one
            assert udp.chksum != 0
            redo = ipl.copy()
            redo[UDP].chksum = None
            assert IPv6(raw(redo))[UDP].chksum == udp.chksum
        else:
            assert (ipl.id, int(ipl.flags), ipl.ttl, ipl.tos, ipl.len) == (flow.ip_id, 2, 64, 0, 28 + len(dgram))
            assert udp.chksum == 0
            redo = ipl.copy()
            redo.chksum = None
            assert IP(raw(redo)).chksum == ipl.chksum
        # scapy recomputes the ICRC over the headers in the file
        hdr = ipl.copy()
        hdr[UDP].remove_payload()
        rebuilt = hdr / BTH(dgram)
        bth = rebuilt[BTH]
        assert (bth.opcode, bth.dqpn, bth.psn, bth.ackreq) == (pkt.opcode, pkt.dest_qp, pkt.psn, int(pkt.ack_req))
        bth.icrc = None
        out = raw(rebuilt)
        assert len(out) == len(raw(ipl))
        assert out[-4:] == dgram[-4:], pkt


def test_scapy_detects_a_wrong_icrc_in_the_file(tmp_path: Path) -> None:
    """The check above can fail: a capture whose IP ID differs from the flow's gives another ICRC."""
    pkt = wire.Packet(O.SEND_ONLY, 1, 2, payload=b"x")
    dgram = wire.encode_bytes(pkt, wire.Flow("10.0.0.1", "10.0.0.2", 50000, ip_id=0))
    with PcapWriter(tmp_path / "bad.pcap") as w:
        w.write(dgram, wire.Flow("10.0.0.1", "10.0.0.2", 50000, ip_id=1))
    (frame,) = rdpcap(str(tmp_path / "bad.pcap"))
    frame[BTH].icrc = None
    assert raw(frame)[-4:] != dgram[-4:]


def test_fileobj_target_left_open_and_thread_safe() -> None:
    buf = io.BytesIO()
    flow = wire.Flow("10.0.0.1", "10.0.0.2", 50000)
    dgrams = [wire.encode_bytes(wire.Packet(O.SEND_ONLY, 1, i, payload=b"p" * (i % 7)), flow) for i in range(200)]
    w = PcapWriter(buf)
    threads = [threading.Thread(target=lambda k=k: [w.write(d, flow) for d in dgrams[k::4]]) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    w.close()  # idempotent
    assert not buf.closed
    with pytest.raises(ValueError):
        w.write(dgrams[0], flow)
    data = buf.getvalue()
    off, seen = 24, []
    while off < len(data):
        incl = struct.unpack_from("<I", data, off + 8)[0]
        seen.append(data[off + 16 + 42 : off + 16 + incl])
        off += 16 + incl
    assert off == len(data)
    assert sorted(seen) == sorted(dgrams)


def test_flushes_each_write(tmp_path: Path) -> None:
    path = tmp_path / "live.pcap"
    flow = wire.Flow("10.0.0.1", "10.0.0.2", 50000)
    dgram = wire.encode_bytes(wire.Packet(O.SEND_ONLY, 1, 2, payload=b"abc"), flow)
    with PcapWriter(path) as w:
        w.write(dgram, flow)
        assert path.stat().st_size == 24 + 16 + 42 + len(dgram)
        assert len(rdpcap(str(path))) == 1


# ---------------------------------------------------------------- tshark ----

TSHARK_FIELDS = [
    "frame.protocols",
    "infiniband.bth.opcode",
    "infiniband.bth.destqp",
    "infiniband.bth.psn",
    "infiniband.bth.a",
    "infiniband.reth.va",
    "infiniband.reth.r_key",
    "infiniband.reth.dmalen",
    "infiniband.aeth.syndrome",
    "infiniband.aeth.msn",
    "infiniband.atomiceth.swapdt",
    "infiniband.atomiceth.cmpdt",
    "infiniband.atomicacketh.origremdt",
    "infiniband.invariant.crc",
    "ip.checksum.status",
    "udp.checksum.status",
]


def _int(s: str) -> int | None:
    return int(s, 0) if s else None


def test_tshark_decodes_capture(capture) -> None:
    tshark = shutil.which("tshark")
    if tshark is None:
        pytest.skip("tshark is not installed (CI installs it; apt-get install tshark to run this test)")
    path, written = capture
    cmd = [tshark, "-n", "-r", str(path), "-d", f"udp.port=={OTHER_PORT},infiniband",
           "--disable-heuristic", "rpcrdma_infiniband",
           "-o", "ip.check_checksum:TRUE", "-o", "udp.check_checksum:TRUE",
           "-T", "fields", "-E", "separator=/t", "-E", "occurrence=f"]  # fmt: skip
    for f in TSHARK_FIELDS:
        cmd += ["-e", f]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    rows = [line.split("\t") for line in res.stdout.splitlines()]
    assert len(rows) == len(written)
    for row, (pkt, flow, dgram) in zip(rows, written):
        got = dict(zip(TSHARK_FIELDS, row))
        ctx = f"{pkt!r} on {flow.src}:{flow.sport}->{flow.dst}:{flow.dport}: {got}"
        assert ":udp:infiniband" in got["frame.protocols"], ctx
        assert _int(got["infiniband.bth.opcode"]) == pkt.opcode, ctx
        assert _int(got["infiniband.bth.destqp"]) == pkt.dest_qp, ctx
        assert _int(got["infiniband.bth.psn"]) == pkt.psn, ctx
        assert got["infiniband.bth.a"] in (("1", "True") if pkt.ack_req else ("0", "False")), ctx
        # tshark 4.0 shows the 4 ICRC bytes read big-endian (it does not check them)
        assert _int(got["infiniband.invariant.crc"]) == struct.unpack(">I", dgram[-4:])[0], ctx
        op = pkt.opcode
        if op in (O.RDMA_WRITE_FIRST, O.RDMA_WRITE_ONLY, O.RDMA_WRITE_ONLY_WITH_IMMEDIATE, O.RDMA_READ_REQUEST):
            assert _int(got["infiniband.reth.va"]) == pkt.va, ctx
            assert _int(got["infiniband.reth.r_key"]) == pkt.rkey, ctx
            assert _int(got["infiniband.reth.dmalen"]) == pkt.dma_len, ctx
        elif op in (O.COMPARE_SWAP, O.FETCH_ADD):
            # Wireshark shows the AtomicETH VA / R_Key with the RETH fields
            assert _int(got["infiniband.reth.va"]) == pkt.va, ctx
            assert _int(got["infiniband.reth.r_key"]) == pkt.rkey, ctx
            assert got["infiniband.reth.dmalen"] == "", ctx
            assert _int(got["infiniband.atomiceth.swapdt"]) == pkt.swap_add, ctx
            assert _int(got["infiniband.atomiceth.cmpdt"]) == pkt.compare, ctx
        else:
            assert got["infiniband.reth.va"] == got["infiniband.reth.r_key"] == "", ctx
        if op in (O.ACKNOWLEDGE, O.ATOMIC_ACKNOWLEDGE, O.RDMA_READ_RESPONSE_ONLY):
            assert _int(got["infiniband.aeth.syndrome"]) == pkt.syndrome, ctx
            assert _int(got["infiniband.aeth.msn"]) == pkt.msn, ctx
        if op == O.ATOMIC_ACKNOWLEDGE:
            assert _int(got["infiniband.atomicacketh.origremdt"]) == pkt.orig, ctx
        # checksum status 1 = good; 3 = not present (UDP over IPv4 carries 0)
        if flow.ipv6:
            assert got["udp.checksum.status"] == "1", ctx
        else:
            assert got["ip.checksum.status"] == "1", ctx
            assert got["udp.checksum.status"] == "3", ctx
