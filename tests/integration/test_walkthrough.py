"""The RDMA Write walk-through (``aiordma demo`` part 3) carries the real values.

``trace_one_write`` does one RDMA Write between two soft devices with a
tracer installed; these tests check each of the eight steps against what the
work request asked for and against independent decoders (struct, a hand-made
ICRC, scapy's RoCE dissector).
"""

from __future__ import annotations

import struct
import zlib

import pytest

from aiordma.providers.soft.device import SoftDevice
from aiordma.tools.walkthrough import DEFAULT_PAYLOAD, WalkthroughError, render_steps, trace_one_write


def _icrc_by_hand(datagram: bytes, src: str, dst: str, sport: int, dport: int) -> bytes:
    """The ICRC from the IBA rule, without aiordma's code: masked LRH, IPv4 header (DF, ID 0,
    TOS/TTL/checksum masked), UDP header (checksum masked), BTH with byte 4 masked, the rest."""
    n = len(datagram)
    ip = struct.pack(
        ">BBHHHBBH4s4s", 0x45, 0xFF, 20 + 8 + n, 0, 0x4000, 0xFF, 17, 0xFFFF,
        bytes(map(int, src.split("."))), bytes(map(int, dst.split("."))),
    )  # fmt: skip
    udp = struct.pack(">HHHH", sport, dport, 8 + n, 0xFFFF)
    bth = bytearray(datagram[:12])
    bth[4] = 0xFF
    return struct.pack("<I", zlib.crc32(b"\xff" * 8 + ip + udp + bytes(bth) + datagram[12:-4]))


async def test_eight_steps_carry_the_real_values():
    payload = b"hello from RDMA client"
    steps = await trace_one_write(payload, remote_size=64, remote_offset=16)
    assert [s.number for s in steps] == list(range(1, 9))
    s1, s2, s3, s4, s5, s6, s7, s8 = (s.fields for s in steps)

    # 1: the WQE is an RDMA Write of the payload to the exposed buffer + 16
    assert s1["opcode"] == "IBV_WR_RDMA_WRITE"
    assert s1["length"] == len(payload) and len(s1["sg_list"]) == 1
    sge_addr, sge_len, lkey = s1["sg_list"][0]
    assert sge_len == len(payload)
    assert s1["npkts"] == 1
    assert s1["qpn"] != s1["dest_qpn"]

    # 2: the doorbell for that QP
    assert s2["qpn"] == s1["qpn"] and s2["wqes"] == 1

    # 3: the NIC found the MR by lkey and read the payload from it
    assert s3["lkey"] == lkey and s3["lkey_ok"] is True
    mr_addr, mr_len = s3["mr"][0], s3["mr"][1]
    assert mr_addr <= sge_addr and sge_addr + sge_len <= mr_addr + mr_len
    assert s3["data"] == payload

    # 4: the bytes on the wire, decoded here with struct
    dgram = s4["datagram"]
    opcode, flags, pkey, w1, w2 = struct.unpack(">BBHII", dgram[:12])
    assert opcode == 0x0A and s4["opcode_name"] == "RDMA_WRITE_ONLY"
    assert pkey == 0xFFFF and (flags >> 4) & 3 == (-len(payload)) & 3 and flags & 0xF == 0
    assert w1 & 0xFFFFFF == s1["dest_qpn"] == s4["dest_qp"]
    assert w2 >> 31 == 1 and w2 & 0xFFFFFF == s1["psn"] == s4["psn"]
    va, rkey, dma_len = struct.unpack(">QII", dgram[12:28])
    assert (va, rkey, dma_len) == (s1["remote_addr"], s1["rkey"], len(payload))
    assert (s4["va"], s4["rkey"], s4["dma_len"]) == (va, rkey, dma_len)
    pad = (-len(payload)) & 3
    assert dgram[28 : 28 + len(payload)] == payload == s4["payload"]
    assert dgram[28 + len(payload) : -4] == b"\0" * pad
    assert len(dgram) == 12 + 16 + len(payload) + pad + 4
    assert s4["bth"] == dgram[:12] and s4["reth"] == dgram[12:28] and s4["icrc_bytes"] == dgram[-4:]

    # 5: a UDP datagram to 4791, received unchanged; its ICRC recomputed by hand
    (src_ip, sport), (dst_ip, dport) = s5["src"], s5["dst"]
    assert dport == 4791
    assert src_ip != dst_ip  # two "hosts"
    assert s5["udp_length"] == 8 + len(dgram) and s5["ip_length"] == 28 + len(dgram)
    assert s5["received_datagram"] == dgram
    assert s5["received_at"] == (dst_ip, dport) and s5["received_from"] == (src_ip, sport)
    assert s4["icrc_ok"] is True
    assert dgram[-4:] == _icrc_by_hand(dgram, src_ip, dst_ip, sport, dport)

    # 6: the responder's rkey check passed for the right region
    assert s6["ok"] is True and s6["why"] is None
    assert s6["rkey"] == s1["rkey"] and s6["va"] == s1["remote_addr"] and s6["length"] == len(payload)
    r_addr, r_len = s6["region"][0], s6["region"][1]
    assert r_len == 64 and s1["remote_addr"] == r_addr + 16
    assert s6["qpn"] == s1["dest_qpn"]

    # 7: the DMA into remote memory
    assert s7["address"] == s1["remote_addr"] and s7["offset"] == 16 and s7["length"] == len(payload)
    assert s7["data"] == payload
    assert s7["before"] == bytes(64)
    assert s7["after"] == bytes(16) + payload + bytes(64 - 16 - len(payload))

    # 8: the ACK for that PSN, then a successful CQE for the WR
    ack = s8["ack_datagram"]
    a_op, _, _, a_w1, a_w2 = struct.unpack(">BBHII", ack[:12])
    assert a_op == 0x11 == s8["ack_opcode"]
    assert a_w1 & 0xFFFFFF == s1["qpn"] == s8["ack_dest_qp"]
    assert a_w2 & 0xFFFFFF == s1["psn"] == s8["ack_psn"]
    aeth = struct.unpack(">I", ack[12:16])[0]
    assert aeth >> 24 == s8["syndrome"] and s8["syndrome"] & 0x60 == 0  # an ACK, not a NAK
    assert aeth & 0xFFFFFF == s8["msn"] >= 1
    assert len(ack) == 20 and s8["ack_icrc_ok"] is True
    assert ack[-4:] == _icrc_by_hand(ack, dst_ip, src_ip, dport, sport)
    assert s8["status"] == "IBV_WC_SUCCESS"
    assert s8["wc_opcode"] == "IBV_WC_RDMA_WRITE"
    assert s8["byte_len"] == len(payload)
    assert s8["wr_id"] == s1["wr_id"] and s8["qp_num"] == s1["qpn"]

    # the steps happened in this order
    times = [s.t_us for s in steps]
    assert times == sorted(times)


async def test_scapy_decodes_the_traced_packets():
    scapy_all = pytest.importorskip("scapy.all")
    roce = pytest.importorskip("scapy.contrib.roce")
    IP, UDP, Raw, raw = scapy_all.IP, scapy_all.UDP, scapy_all.Raw, scapy_all.raw
    steps = await trace_one_write(b"0123456789abcdef")  # no pad
    s1, s4, s5 = steps[0].fields, steps[3].fields, steps[4].fields
    (src_ip, sport), (dst_ip, dport) = s5["src"], s5["dst"]
    dgram = s4["datagram"]
    parsed = IP(raw(IP(src=src_ip, dst=dst_ip, id=0, flags="DF") / UDP(sport=sport, dport=dport) / Raw(dgram)))
    bth = parsed[roce.BTH]
    assert bth.opcode == 0x0A and bth.dqpn == s1["dest_qpn"] and bth.psn == s1["psn"] and bth.ackreq == 1
    # scapy computes the ICRC itself when it builds the same packet from its fields
    rebuilt = (
        IP(src=src_ip, dst=dst_ip, id=0, flags="DF")
        / UDP(sport=sport, dport=dport)
        / roce.BTH(opcode=0x0A, padcount=0, pkey=0xFFFF, dqpn=s1["dest_qpn"], ackreq=1, psn=s1["psn"])
        / Raw(dgram[12:-4])
    )
    assert raw(rebuilt)[28:] == dgram


async def test_one_device_talking_to_itself():
    dev = SoftDevice(name="soft-loop")
    try:
        steps = await trace_one_write(DEFAULT_PAYLOAD + b"\0", requester=dev, responder=dev)
    finally:
        dev.close()
    s5, s7, s8 = steps[4].fields, steps[6].fields, steps[7].fields
    assert s5["src"][0] == s5["dst"][0] == dev.address[0]
    assert s7["data"] == DEFAULT_PAYLOAD + b"\0"
    assert s8["status"] == "IBV_WC_SUCCESS"


async def test_render_and_argument_checks():
    steps = await trace_one_write()
    text = render_steps(steps, color=False)
    for i in range(1, 9):
        assert f"Step {i}/8" in text
    for word in ("IBV_WR_RDMA_WRITE", "RDMA_WRITE_ONLY", "R_Key", "4791", "IBV_WC_SUCCESS", "IBV_WC_RDMA_WRITE", "MSN"):
        assert word in text
    assert "\x1b[" not in text
    assert "\x1b[" in render_steps(steps, color=True)
    with pytest.raises(ValueError):
        await trace_one_write(b"")
    with pytest.raises(ValueError):
        await trace_one_write(b"x" * 65, remote_size=64)
    with pytest.raises(ValueError):
        await trace_one_write(b"x" * 40000, remote_size=65536)  # more than one packet, even jumbo
    assert issubclass(WalkthroughError, RuntimeError)
