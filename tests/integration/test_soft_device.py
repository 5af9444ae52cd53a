"""The soft RoCEv2 device over real UDP sockets on loopback, driven synchronously.

Verbs objects only (no asyncio layer): devices, PDs, MRs, CQs with completion
channels, RC QPs. Every wait has a deadline. Covers one device with two QPs,
two devices on different loopback addresses, and two processes: the parent
does one-sided operations into a child whose Python main thread is blocked
on a pipe, which shows one-sided RDMA needs no code of the remote application.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from aiordma.errors import DeviceNotFoundError, InvalidWorkRequestError, MemoryRegistrationError, QueuePairStateError
from aiordma.providers.base import (
    ACCESS_ALL,
    MTU,
    SGE,
    Access,
    QPAttr,
    QPCap,
    QPState,
    RecvWR,
    SendWR,
    WCFlags,
    WCOpcode,
    WCStatus,
    WROpcode,
    gid_str,
    parse_gid,
)
from aiordma.providers.soft import wire
from aiordma.providers.soft.device import SoftCompletionChannel, SoftDevice
from aiordma.providers.soft.engine import native_status
from aiordma.providers.soft.faults import LinkFaults
from aiordma.providers.soft.rc import timeout_seconds

REPO = Path(__file__).resolve().parents[2]
S = WCStatus
WR = WROpcode
U64 = struct.Struct("=Q")
DEADLINE = 10.0  # seconds any single wait may take before the test fails


# ------------------------------------------------------------------ helpers ----


def new_device(**kw) -> SoftDevice:
    """A soft device on a random 127.x.y.z:4791 (unlikely to collide with parallel runs)."""
    rng = random.Random(os.getpid() * 1_000_003 + time.monotonic_ns())
    for _ in range(100):
        ip = f"127.{rng.randrange(100, 250)}.{rng.randrange(0, 256)}.{rng.randrange(2, 250)}"
        try:
            return SoftDevice(f"{ip}:4791", **kw)
        except DeviceNotFoundError:
            continue
    raise RuntimeError("no free loopback address")


def pattern(n: int, seed: int = 0) -> bytes:
    return (
        random.Random(seed).randbytes(n) if n < 1 << 24 else bytes(random.Random(seed).randbytes(1 << 20)) * (n >> 20)
    )


class End:
    """One side: a PD, separate send/recv CQs (the send CQ on a completion channel),
    an RC QP and one registered buffer."""

    def __init__(
        self,
        dev: SoftDevice,
        size: int = 1 << 20,
        access: Access = ACCESS_ALL,
        fill: int | None = None,
        channel: SoftCompletionChannel | None = None,
    ) -> None:
        self.dev = dev
        self.pd = dev.alloc_pd()
        self.owns_channel = channel is None
        self.channel = dev.create_comp_channel() if channel is None else channel
        self.scq = dev.create_cq(4096, self.channel)
        self.rcq = dev.create_cq(4096)
        self.qp = self.pd.create_qp(
            self.scq, self.rcq, QPCap(max_send_wr=512, max_recv_wr=512, max_send_sge=8, max_recv_sge=8)
        )
        self.buf = bytearray(pattern(size, fill)) if fill is not None else bytearray(size)
        self.mr = self.pd.reg_mr(self.buf, access)

    @property
    def gid(self) -> bytes:
        return self.dev.query_gid().gid

    def close(self) -> None:
        self.qp.close()
        self.mr.close()
        self.scq.close()
        self.rcq.close()
        if self.owns_channel:
            self.channel.close()


def connect(
    a: End, b: End, *, psn_a: int = 0xFFFFF0, psn_b: int = 0xFFFFFE, access_b: Access = ACCESS_ALL, **rts
) -> None:
    """Bring both QPs to RTS facing each other (PSNs near the 24-bit wrap)."""
    for x, acc in ((a, ACCESS_ALL), (b, access_b)):
        x.qp.to_init(QPAttr(qp_access_flags=acc))
    for x, y, rq_psn, sq_psn in ((a, b, psn_b, psn_a), (b, a, psn_a, psn_b)):
        x.qp.to_rtr(
            QPAttr(dest_qp_num=y.qp.qp_num, rq_psn=rq_psn, dgid=y.gid, dport=y.dev.udp_port, path_mtu=MTU.IBV_MTU_4096)
        )
        x.qp.to_rts(QPAttr(sq_psn=sq_psn, **rts))
    assert a.qp.state == b.qp.state == QPState.IBV_QPS_RTS


def wait_cq(cq, n: int = 1, timeout: float = DEADLINE) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        got += cq.poll(n - len(got))
        if len(got) >= n:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"only {len(got)} of {n} completions after {timeout} s: {got}")
        time.sleep(0.0005)
    return got


def wait_until(pred, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        time.sleep(0.001)


@contextlib.contextmanager
def nic_held(dev: SoftDevice):
    """Hold the device's NIC (its thread cannot run meanwhile) and give a function that
    runs one round of its work on this thread: each engine's own test hooks."""
    if dev.engine == "python":
        with dev.nic.lock:
            yield lambda: dev.nic.service(readable=True)
        return
    eng = dev._engine
    eng._hold()
    try:
        yield lambda: eng._service(True)
    finally:
        eng._release()


def ok(wcs) -> list:
    assert all(wc.status == S.IBV_WC_SUCCESS for wc in wcs), wcs
    return wcs


@pytest.fixture(params=["one_device", "one_device_socket", "two_devices"])
def pair(request):
    """Two connected Ends: on one SoftDevice (the native engine hands their packets
    over in memory; ``one_device_socket``: through its UDP socket), or on two devices
    on different loopback addresses."""
    d1 = new_device()
    d2 = d1 if request.param.startswith("one_device") else new_device()
    if request.param == "one_device_socket":
        d1.local_delivery = False
    a, b = End(d1, fill=1), End(d2)
    connect(a, b)
    yield a, b
    for x in (a, b):
        x.close()
    d1.close()
    if d2 is not d1:
        d2.close()


@pytest.fixture
def devices():
    made: list[SoftDevice] = []

    def make(**kw) -> SoftDevice:
        d = new_device(**kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


# ------------------------------------------------------------- operations ----


def test_device_identity(pair) -> None:
    a, b = pair
    ip, port = a.dev.address
    assert ip.startswith("127.") and port == 4791 == a.dev.udp_port
    [entry] = a.dev.query_gid_table()
    assert entry.gid == parse_gid(ip) and entry.gid_type == "RoCE v2" and entry.ipv4 == ip
    assert a.dev.query_port().state.name == "IBV_PORT_ACTIVE"
    assert a.dev.query_device().provider == "soft"
    assert a.qp.qp_num != b.qp.qp_num and 0 < a.qp.qp_num < 1 << 24
    assert a.mr.lkey != a.mr.rkey
    q = a.qp.query()
    assert q.dest_qp_num == b.qp.qp_num and q.dgid == b.gid and q.path_mtu == MTU.IBV_MTU_4096
    assert gid_str(a.gid).startswith("0000:0000:0000:0000:0000:ffff:")


@pytest.mark.parametrize("address", ["::1", "[::1]:4791", "localhost", "127.0.0.1:", "127.0.0.1:70000"])
def test_an_address_the_soft_device_cannot_bind_is_refused_before_binding(address: str) -> None:
    """The soft device's GID is the IPv4-mapped RoCE v2 GID of its address: an IPv6
    address or a host name is refused with the reason (it once bound ``::1`` and then
    failed making the GID, with ipaddress's own error), and so is a bad port."""
    with pytest.raises(ValueError, match=r"the soft device binds an IPv4 address|the port must be") as e:
        SoftDevice(address=address)
    assert repr(address) in str(e.value)


def test_write_and_write_with_imm(pair) -> None:
    a, b = pair
    a.qp.post_send(SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.mr.sge(100, 5000)], remote_addr=b.mr.addr + 7, rkey=b.mr.rkey))
    [wc] = ok(wait_cq(a.scq))
    assert (wc.wr_id, wc.opcode, wc.byte_len) == (1, WCOpcode.IBV_WC_RDMA_WRITE, 5000)
    assert b.buf[7:5007] == a.buf[100:5100] and b.buf[:7] == bytes(7) and b.buf[5007:5100] == bytes(93)
    assert b.rcq.poll() == []  # a plain WRITE leaves no trace at the responder's CQ
    b.qp.post_recv(RecvWR(55))
    a.qp.post_send(
        SendWR(
            2,
            WR.IBV_WR_RDMA_WRITE_WITH_IMM,
            [a.mr.sge(0, 9000)],
            remote_addr=b.mr.addr + 10000,
            rkey=b.mr.rkey,
            imm_data=0xCAFEF00D,
        )
    )
    ok(wait_cq(a.scq))
    [rwc] = ok(wait_cq(b.rcq))
    assert (rwc.wr_id, rwc.opcode, rwc.imm_data, rwc.byte_len) == (
        55,
        WCOpcode.IBV_WC_RECV_RDMA_WITH_IMM,
        0xCAFEF00D,
        9000,
    )
    assert rwc.wc_flags & WCFlags.IBV_WC_WITH_IMM and rwc.src_qp == a.qp.qp_num and rwc.qp_num == b.qp.qp_num
    assert b.buf[10000:19000] == a.buf[:9000]


def test_read(pair) -> None:
    a, b = pair
    b.buf[:] = pattern(len(b.buf), 7)
    a.qp.post_send(SendWR(3, WR.IBV_WR_RDMA_READ, [a.mr.sge(1, 12345)], remote_addr=b.mr.addr + 999, rkey=b.mr.rkey))
    [wc] = ok(wait_cq(a.scq))
    assert (wc.opcode, wc.byte_len) == (WCOpcode.IBV_WC_RDMA_READ, 12345)
    assert a.buf[1:12346] == b.buf[999 : 999 + 12345]
    # a zero-length READ completes too
    a.qp.post_send(SendWR(4, WR.IBV_WR_RDMA_READ, [], remote_addr=b.mr.addr, rkey=b.mr.rkey))
    ok(wait_cq(a.scq))


def test_send_recv(pair) -> None:
    a, b = pair
    for i in range(4):
        b.qp.post_recv(RecvWR(i, [b.mr.sge(i * 20000, 20000)]))
    sizes = [0, 1, 4096, 17000]
    for i, n in enumerate(sizes):
        op = WR.IBV_WR_SEND_WITH_IMM if i % 2 else WR.IBV_WR_SEND
        a.qp.post_send(SendWR(10 + i, op, [a.mr.sge(i, n)] if n else [], imm_data=i))
    assert [wc.wr_id for wc in ok(wait_cq(a.scq, 4))] == [10, 11, 12, 13]
    rwcs = ok(wait_cq(b.rcq, 4))
    assert [(wc.wr_id, wc.byte_len, wc.imm_data) for wc in rwcs] == [
        (0, 0, None),
        (1, 1, 1),
        (2, 4096, None),
        (3, 17000, 3),
    ]
    for i, n in enumerate(sizes):
        assert b.buf[i * 20000 : i * 20000 + n] == a.buf[i : i + n]


def test_atomics(pair) -> None:
    a, b = pair
    U64.pack_into(b.buf, 64, 1000)
    for i in range(10):
        a.qp.post_send(
            SendWR(
                i,
                WR.IBV_WR_ATOMIC_FETCH_AND_ADD,
                [a.mr.sge(8 * i, 8)],
                remote_addr=b.mr.addr + 64,
                rkey=b.mr.rkey,
                compare_add=i + 1,
            )
        )
    ok(wait_cq(a.scq, 10))
    assert [U64.unpack_from(a.buf, 8 * i)[0] for i in range(10)] == [1000 + i * (i + 1) // 2 for i in range(10)]
    assert U64.unpack_from(b.buf, 64)[0] == 1055
    a.qp.post_send(
        SendWR(
            20,
            WR.IBV_WR_ATOMIC_CMP_AND_SWP,
            [a.mr.sge(200, 8)],
            remote_addr=b.mr.addr + 64,
            rkey=b.mr.rkey,
            compare_add=1055,
            swap=7,
        )
    )
    a.qp.post_send(
        SendWR(
            21,
            WR.IBV_WR_ATOMIC_CMP_AND_SWP,
            [a.mr.sge(208, 8)],
            remote_addr=b.mr.addr + 64,
            rkey=b.mr.rkey,
            compare_add=1055,
            swap=9,
        )
    )
    wcs = ok(wait_cq(a.scq, 2))
    assert [wc.opcode for wc in wcs] == [WCOpcode.IBV_WC_COMP_SWAP] * 2
    assert U64.unpack_from(a.buf, 200)[0] == 1055 and U64.unpack_from(a.buf, 208)[0] == 7
    assert U64.unpack_from(b.buf, 64)[0] == 7


def test_read_only_buffers_register_without_write_access(pair) -> None:
    """bytes and read-only views register when the access grants no write right
    (a send / RDMA Write source, a remote-read target); asking for a write right
    on them is refused with a clear error."""
    a, b = pair
    data = pattern(5000, 77)
    for ro in (data, memoryview(bytearray(data)).toreadonly()):
        for access in (Access.LOCAL_WRITE, Access.LOCAL_WRITE | Access.REMOTE_WRITE):
            with pytest.raises(MemoryRegistrationError, match="read-only"):
                a.pd.reg_mr(ro, access)
        src = a.pd.reg_mr(ro, Access(0))
        exposed = b.pd.reg_mr(ro, Access.REMOTE_READ)
        try:
            assert bytes(src.view) == data and src.view.readonly
            b.buf[:5000] = bytes(5000)
            a.qp.post_send(SendWR(1, WR.IBV_WR_RDMA_WRITE, [src.sge()], remote_addr=b.mr.addr, rkey=b.mr.rkey))
            ok(wait_cq(a.scq))
            assert bytes(b.buf[:5000]) == data
            b.qp.post_recv(RecvWR(5, [b.mr.sge(8192, 5000)]))
            a.qp.post_send(SendWR(2, WR.IBV_WR_SEND, [src.sge(0, 3000)]))
            ok(wait_cq(a.scq))
            [rwc] = ok(wait_cq(b.rcq))
            assert rwc.byte_len == 3000 and bytes(b.buf[8192 : 8192 + 3000]) == data[:3000]
            a.qp.post_send(
                SendWR(3, WR.IBV_WR_RDMA_READ, [a.mr.sge(0, 5000)], remote_addr=exposed.addr, rkey=exposed.rkey)
            )
            ok(wait_cq(a.scq))
            assert bytes(a.buf[:5000]) == data
        finally:
            src.close()
            exposed.close()


def test_live_objects_count_what_is_open(devices) -> None:
    """device.live_objects() counts QPs, memory regions and CQs, on either engine: what a
    leak check compares before and after."""
    d = devices()
    base = d.live_objects()
    pd = d.alloc_pd()
    cq = d.create_cq(16)
    qp = pd.create_qp(cq, cq)
    mrs = [pd.reg_mr(bytearray(4096), ACCESS_ALL), pd.reg_mr(b"read-only", Access(0))]
    assert d.live_objects() == {
        "qps": base["qps"] + 1,
        "mrs": base["mrs"] + 2,
        "cqs": base["cqs"] + 1,
        "srqs": base["srqs"],
    }
    qp.close()
    for mr in mrs:
        mr.close()
    cq.close()
    pd.close()
    assert d.live_objects() == base


def test_large_transfers_and_scatter_gather(pair) -> None:
    """1 MiB (256 packets at MTU 4096) each way, with multi-SGE gather/scatter."""
    a, b = pair
    mib = 1 << 20
    src = bytearray(pattern(mib, 5))
    src_mr = a.pd.reg_mr(src, ACCESS_ALL)
    try:
        a.qp.post_send(SendWR(1, WR.IBV_WR_RDMA_WRITE, [src_mr.sge()], remote_addr=b.mr.addr, rkey=b.mr.rkey))
        ok(wait_cq(a.scq))
        assert b.buf == src
        b.buf[:] = pattern(mib, 6)
        a.qp.post_send(SendWR(2, WR.IBV_WR_RDMA_READ, [src_mr.sge()], remote_addr=b.mr.addr, rkey=b.mr.rkey))
        ok(wait_cq(a.scq))
        assert src == b.buf
        # SEND of 1 MiB gathered from 3 SGEs into a receive scattered over 3 SGEs
        gather = [src_mr.sge(0, 300_000), a.mr.sge(0, 700_000), src_mr.sge(500_000, mib - 1_000_000)]
        expect = bytes(src[:300_000]) + bytes(a.buf[:700_000]) + bytes(src[500_000 : 500_000 + mib - 1_000_000])
        b.buf[:] = bytes(mib)
        other = bytearray(mib)
        other_mr = b.pd.reg_mr(other, ACCESS_ALL)
        b.qp.post_recv(RecvWR(9, [b.mr.sge(0, 1000), other_mr.sge(0, 600_000), b.mr.sge(1000, mib - 1000)]))
        a.qp.post_send(SendWR(3, WR.IBV_WR_SEND, gather))
        ok(wait_cq(a.scq))
        [rwc] = ok(wait_cq(b.rcq))
        assert rwc.byte_len == mib
        got = bytes(b.buf[:1000]) + bytes(other[:600_000]) + bytes(b.buf[1000 : 1000 + mib - 601_000])
        assert got == expect
        other_mr.close()
        # many WRs in flight at once
        for i in range(64):
            a.qp.post_send(
                SendWR(
                    100 + i,
                    WR.IBV_WR_RDMA_WRITE,
                    [src_mr.sge(i * 16384, 16384)],
                    remote_addr=b.mr.addr + i * 16384,
                    rkey=b.mr.rkey,
                )
            )
        assert [wc.wr_id for wc in ok(wait_cq(a.scq, 64))] == list(range(100, 164))
        assert b.buf == src
    finally:
        src_mr.close()


def write_and_count(a: End, b: End) -> tuple[dict, dict]:
    """RDMA Write a's whole buffer into b's (the data must arrive intact); the
    counter deltas of a's and b's devices."""
    c1, c2 = a.dev.counters, b.dev.counters
    a.qp.post_send(SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.mr.sge(0, len(a.buf))], remote_addr=b.mr.addr, rkey=b.mr.rkey))
    ok(wait_cq(a.scq))
    assert b.buf == a.buf
    d1, d2 = a.dev.counters, b.dev.counters
    return {k: v - c1.get(k, 0) for k, v in d1.items()}, {k: v - c2.get(k, 0) for k, v in d2.items()}


@pytest.mark.parametrize("gso", [True, False])
def test_udp_gso_batches_equal_size_packets(devices, loopback_turn, gso: bool) -> None:
    """A multi-packet WRITE leaves in UDP GSO sends (segment i encoded for IP ID i); the
    strict receiver takes each batch whole (UDP_GRO) and checks packet i for ID i, so it
    infers no IP ID, and the data is intact. Without GSO: one sendmsg per packet and
    every ICRC matches IP ID 0."""
    d1, d2 = devices(), devices()
    d1.gso = gso
    a, b = End(d1, fill=3), End(d2)
    connect(a, b)
    try:
        tx, rx = write_and_count(a, b)
        sent = tx["tx_packets"]
        gso_sends = tx.get("tx_gso_sends", 0)
        assert d2.counters.get("rx_icrc_errors", 0) == 0
        assert sent >= 256  # 1 MiB at MTU 4096 (plus retransmissions, if any)
        if gso:
            # runs of up to 14 equal 4 KiB datagrams (GSO_MAX_BYTES): far fewer system calls
            assert 0 < gso_sends <= sent // 4
            assert rx.get("rx_gro_datagrams", 0) > 0
        else:
            assert gso_sends == 0
        assert rx.get("rx_icrc_ip_id_inferred", 0) == 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("engine", ["native", "python"])
def test_a_receiver_without_gro_infers_the_ids_of_batch_segments(
    devices, monkeypatch, loopback_turn, engine: str
) -> None:
    """AIORDMA_SOFT_GRO=0: the kernel cuts a batch before the receiver sees it, and a UDP
    socket does not show the IP ID each segment got (1, 2, ...): the strict receiver
    solves for it (rx_icrc_ip_id_inferred) and accepts every segment: the tolerance a
    foreign sender needs, which two soft devices with UDP_GRO never use."""
    if engine == "native" and not native_status()[0]:
        pytest.fail(f"the native engine is not built: {native_status()[1]}")
    monkeypatch.setenv("AIORDMA_SOFT_GRO", "0")
    d1, d2 = devices(), devices(engine=engine)
    assert not d2.gro
    d1.gso = True
    a, b = End(d1, fill=4), End(d2)
    connect(a, b)
    try:
        tx, rx = write_and_count(a, b)
        assert tx.get("tx_gso_sends", 0) > 0
        assert d2.counters.get("rx_icrc_errors", 0) == 0
        assert rx.get("rx_icrc_ip_id_inferred", 0) >= tx["tx_packets"] // 2
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("gro", [True, False])
def test_udp_gro_takes_a_gso_batch_in_one_receive(devices, monkeypatch, loopback_turn, gro: bool) -> None:
    """With UDP_GRO on its socket the native engine receives a peer's GSO batch as one
    coalesced datagram and splits it into its packets: every packet is placed, every
    ICRC checks, the data is intact. AIORDMA_SOFT_GRO=0: one datagram per packet."""
    if not native_status()[0]:
        pytest.fail(f"the native engine is not built: {native_status()[1]}")
    monkeypatch.setenv("AIORDMA_SOFT_GRO", "1" if gro else "0")
    d1, d2 = devices(engine="native"), devices(engine="native")
    assert d2.gro is gro
    d1.gso = True
    a, b = End(d1, fill=5), End(d2)
    connect(a, b)
    try:
        tx, rx = write_and_count(a, b)
        sent, received = tx["tx_packets"], rx["rx_packets"]
        coalesced = rx.get("rx_gro_datagrams", 0)
        assert tx.get("tx_gso_sends", 0) > 0
        assert d2.counters.get("rx_icrc_errors", 0) == 0 and d2.counters.get("rx_malformed", 0) == 0
        assert received >= sent >= 256  # every packet counted, coalesced or not
        if gro:
            assert 0 < coalesced <= sent // 4  # runs of up to 14 packets arrive as one datagram
        else:
            assert coalesced == 0
    finally:
        a.close()
        b.close()


def test_small_responses_of_one_pass_leave_in_one_system_call(devices) -> None:
    """READ requests on eight QPs that one round of the responder's NIC work takes
    together: their eight small responses leave in one sendmmsg, each to its own
    requester, and every requester gets its bytes."""
    if not native_status()[0]:
        pytest.fail(f"the native engine is not built: {native_status()[1]}")
    d1, d2 = devices(engine="native"), devices(engine="native")
    pairs = []
    for i in range(8):
        a, b = End(d1, size=4096), End(d2, size=4096, fill=0x40 + i)
        connect(a, b)
        pairs.append((a, b))
    try:
        before = dict(d2.counters)
        with nic_held(d2) as service:  # the requests wait in d2's socket until service()
            for i, (a, b) in enumerate(pairs):
                a.qp.post_send(SendWR(i, WR.IBV_WR_RDMA_READ, [a.mr.sge(0, 32)], remote_addr=b.mr.addr, rkey=b.mr.rkey))
            wait_until(lambda: d1.counters.get("tx_packets", 0) >= 8)
            service()
        after = d2.counters
        assert after.get("tx_packets", 0) - before.get("tx_packets", 0) == 8
        assert after.get("tx_syscalls", 0) - before.get("tx_syscalls", 0) == 1
        for a, b in pairs:
            ok(wait_cq(a.scq))
            assert bytes(a.buf[:32]) == bytes(b.buf[:32]) != bytes(32)
    finally:
        for a, b in pairs:
            a.close()
            b.close()


@pytest.mark.parametrize(
    "mib, loss",
    [
        (16, False),
        (16, True),
        (64, False),
        (64, True),
        (256, False),
        pytest.param(256, True, marks=pytest.mark.slow),
    ],
)
def test_large_rdma_read(devices, mib: int, loss: bool) -> None:
    """One RDMA Read of 16, 64 or 256 MiB completes, with and without loss (it never did
    at 16 MiB: each retry restarted the whole READ and its response burst overflowed the
    receiving socket again). The READ is asked for in window-sized requests, and a retry
    resumes at the first missing packet, so under loss only a fraction is sent again."""
    size = mib << 20
    d1, d2 = devices(), devices()
    a, b = End(d1, size=size), End(d2, size=size, fill=mib)
    # without loss, a timer long enough that a loaded machine never makes it fire
    connect(a, b, timeout=14 if loss else 18, retry_cnt=7)
    if loss:
        d2.faults = LinkFaults(drop=0.01, duplicate=0.005, reorder=0.005, seed=mib)
    try:
        a.qp.post_send(SendWR(1, WR.IBV_WR_RDMA_READ, [a.mr.sge()], remote_addr=b.mr.addr, rkey=b.mr.rkey))
        [wc] = ok(wait_cq(a.scq, timeout=120))
        assert wc.byte_len == size
        assert a.buf == b.buf
        needed = size // 4096  # response packets at MTU 4096
        sent = d2.counters["tx_packets"]
        if loss:
            assert d2.faults.dropped > 0 and d1.counters["retransmits"] > 0
            # go-back-N within a window-sized request: each loss costs up to a window (256
            # packets) again; a retry that restarted the READ would never complete
            assert sent < 8 * needed, (sent, needed)
        else:
            assert d1.counters["retransmits"] == 0 and sent == needed  # (a READ is answered by responses, no ACK)
    finally:
        d2.faults = None
        a.close()
        b.close()


def test_udp_gso_refused_by_the_kernel_falls_back(devices) -> None:
    """A GSO send the kernel refuses (here: more bytes than one UDP datagram can carry)
    turns GSO off for the device and the datagrams go out one by one instead.
    (The refusal is provoked through each engine's own send path.)"""
    d = devices()
    assert d.gso
    if d.engine == "python":
        with d.nic.lock:
            assert d.nic._sendto_gso([b"x" * 40000, b"y" * 40000], 40000, 2, ("127.0.0.1", 9)) is False
    else:
        assert d._engine._gso_probe(40000, 2) is False
    assert d.gso is False


# ------------------------------------------------------------------- errors ----


@pytest.mark.parametrize("where", ["two_devices", "one_device"])
@pytest.mark.parametrize(
    "case",
    ["bad_rkey", "out_of_bounds", "no_remote_write", "no_remote_read", "no_remote_atomic", "qp_lacks_remote_write"],
)
def test_remote_access_errors(devices, case: str, where: str) -> None:
    """The responder checks every rkey, range and right, also for a queue pair of
    its own device, whose packets the native engine hands over in memory."""
    d1 = devices()
    d2 = d1 if where == "one_device" else devices()
    a = End(d1, size=65536, fill=3)
    region_access = {
        "no_remote_write": Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC,
        "no_remote_read": Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC,
        "no_remote_atomic": Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ,
    }.get(case, ACCESS_ALL)
    b = End(d2, size=65536, access=region_access, fill=4)
    qp_access = Access.REMOTE_READ | Access.REMOTE_ATOMIC if case == "qp_lacks_remote_write" else ACCESS_ALL
    connect(a, b, access_b=qp_access)
    guard = b.pd.reg_mr(bytearray(65536), ACCESS_ALL)  # a neighbouring region that must stay untouched
    before = bytes(b.buf)
    b.qp.post_recv(RecvWR(77, [guard.sge()]))
    op, addr, rkey, n = WR.IBV_WR_RDMA_WRITE, b.mr.addr, b.mr.rkey, 4096
    if case == "bad_rkey":
        rkey ^= 0x5A5A
    elif case == "out_of_bounds":
        addr += 65536 - 100
    elif case == "no_remote_read":
        op = WR.IBV_WR_RDMA_READ
    elif case == "no_remote_atomic":
        op, n = WR.IBV_WR_ATOMIC_FETCH_AND_ADD, 8
    a.qp.post_send(SendWR(1, op, [a.mr.sge(0, n)], remote_addr=addr, rkey=rkey, compare_add=1))
    a.qp.post_send(SendWR(2, WR.IBV_WR_RDMA_WRITE, [a.mr.sge(0, 8)], remote_addr=b.mr.addr, rkey=b.mr.rkey))
    wcs = wait_cq(a.scq, 2)
    assert [(wc.wr_id, wc.status) for wc in wcs] == [(1, S.IBV_WC_REM_ACCESS_ERR), (2, S.IBV_WC_WR_FLUSH_ERR)]
    [rwc] = wait_cq(b.rcq)
    assert (rwc.wr_id, rwc.status) == (77, S.IBV_WC_WR_FLUSH_ERR)
    assert a.qp.state == QPState.IBV_QPS_ERR and b.qp.state == QPState.IBV_QPS_ERR
    assert "REM_ACCESS_ERR" in a.qp.error_reason and b.qp.error_reason
    assert bytes(b.buf) == before and bytes(guard.view) == bytes(65536)
    assert d2.counters["remote_access_errors"] == 1
    guard.close()
    a.close()
    b.close()


# ------------------------------------------------- delivery within the process ----


@pytest.mark.skipif(native_status()[0] is None, reason="the native engine is not built")
def test_one_device_hands_its_own_packets_over_in_memory(devices) -> None:
    """Two QPs of one device (one process): the native engine hands their packets
    over in memory — no datagram through the socket, each payload copied once — with
    the same transport, completions and bytes as through the socket."""
    results = {}
    for local in (True, False):
        d = devices(engine="native")
        d.local_delivery = local
        assert d.local_delivery is local
        a, b = End(d, size=4 << 20, fill=5), End(d, size=4 << 20)
        connect(a, b)
        before = dict(d.counters)
        b.qp.post_recv(RecvWR(9, [b.mr.sge(3 << 20, 1 << 20)]))
        a.qp.post_send(SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.mr.sge(0, 1 << 20)], remote_addr=b.mr.addr, rkey=b.mr.rkey))
        a.qp.post_send(
            SendWR(2, WR.IBV_WR_RDMA_READ, [a.mr.sge(2 << 20, 1 << 20)], remote_addr=b.mr.addr, rkey=b.mr.rkey)
        )
        a.qp.post_send(SendWR(3, WR.IBV_WR_SEND_WITH_IMM, [a.mr.sge(1 << 20, 100000)], imm_data=0x01020304))
        a.qp.post_send(
            SendWR(
                4,
                WR.IBV_WR_ATOMIC_FETCH_AND_ADD,
                [a.mr.sge(3 << 20, 8)],
                remote_addr=b.mr.addr + 4096,
                rkey=b.mr.rkey,
                compare_add=7,
            )
        )
        wcs = ok(wait_cq(a.scq, 4))
        [rwc] = ok(wait_cq(b.rcq))
        assert [wc.wr_id for wc in wcs] == [1, 2, 3, 4]
        assert (rwc.wr_id, rwc.byte_len, rwc.imm_data) == (9, 100000, 0x01020304)
        assert a.buf[2 << 20 : 3 << 20] == a.buf[: 1 << 20]  # written, then read back
        assert b.buf[3 << 20 : (3 << 20) + 100000] == a.buf[1 << 20 : (1 << 20) + 100000]
        orig = U64.unpack_from(a.buf, 4096)[0]
        assert U64.unpack_from(a.buf, 3 << 20)[0] == orig and U64.unpack_from(b.buf, 4096)[0] == (orig + 7) % (1 << 64)
        assert b.buf[:4096] == a.buf[:4096] and b.buf[4104 : 1 << 20] == a.buf[4104 : 1 << 20]
        after = d.counters
        delta = {
            k: after.get(k, 0) - before.get(k, 0) for k in ("tx_local", "tx_packets", "tx_syscalls", "rx_syscalls")
        }
        results[local] = (bytes(b.buf), delta)
        a.close()
        b.close()
    (mem_local, local), (mem_socket, socket_) = results[True], results[False]
    assert mem_local == mem_socket
    # the same packets (write, read request and responses, send, atomic, ACKs), none through the socket
    assert local["tx_local"] == local["tx_packets"] > 32 and local["tx_syscalls"] == 0
    assert socket_["tx_local"] == 0 and socket_["tx_packets"] >= local["tx_packets"] and socket_["tx_syscalls"] > 0


@pytest.mark.skipif(native_status()[0] is None, reason="the native engine is not built")
def test_in_memory_packets_reach_only_a_qp_whose_peer_is_this_device(devices) -> None:
    """A QP of this device aimed at a QP of the same device whose own peer is on
    another device: the packets handed over in memory come from the wrong source
    for it, and are dropped as a datagram from a stranger would be."""
    d1, d2 = devices(engine="native"), devices()
    a, c, x = End(d1, size=65536, fill=6), End(d1, size=65536), End(d2, size=65536)
    connect(c, x)
    a.qp.to_init(QPAttr(qp_access_flags=ACCESS_ALL))
    a.qp.to_rtr(QPAttr(dest_qp_num=c.qp.qp_num, rq_psn=0, dgid=c.gid, dport=d1.udp_port, path_mtu=MTU.IBV_MTU_4096))
    a.qp.to_rts(QPAttr(sq_psn=0xFFFFFE, timeout=8, retry_cnt=1))
    a.qp.post_send(SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.mr.sge(0, 4096)], remote_addr=c.mr.addr, rkey=c.mr.rkey))
    [wc] = wait_cq(a.scq)
    assert wc.status == S.IBV_WC_RETRY_EXC_ERR
    assert bytes(c.buf) == bytes(65536)
    assert d1.counters["rx_wrong_source"] >= 2 and d1.counters["tx_local"] >= 2
    assert c.qp.state == QPState.IBV_QPS_RTS
    for e in (a, c, x):
        e.close()


def test_send_too_long_for_receive(pair) -> None:
    a, b = pair
    b.qp.post_recv(RecvWR(1, [b.mr.sge(0, 100)]))
    a.qp.post_send(SendWR(1, WR.IBV_WR_SEND, [a.mr.sge(0, 101)]))
    [wc] = wait_cq(a.scq)
    assert wc.status == S.IBV_WC_REM_INV_REQ_ERR
    [rwc] = wait_cq(b.rcq)
    assert rwc.status == S.IBV_WC_LOC_LEN_ERR
    assert a.qp.state == b.qp.state == QPState.IBV_QPS_ERR


def test_post_before_rts_and_invalid_wrs(devices) -> None:
    d = devices()
    a, b = End(d, size=4096), End(d, size=4096)
    wr = SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.mr.sge(0, 8)], remote_addr=b.mr.addr, rkey=b.mr.rkey)
    with pytest.raises(QueuePairStateError):
        a.qp.post_send(wr)  # RESET
    with pytest.raises(QueuePairStateError):
        a.qp.post_recv(RecvWR(1, [a.mr.sge()]))  # RESET
    a.qp.to_init(QPAttr(qp_access_flags=ACCESS_ALL))
    with pytest.raises(QueuePairStateError):
        a.qp.post_send(wr)  # INIT
    with pytest.raises(QueuePairStateError):
        a.qp.to_rts(QPAttr(sq_psn=0))  # INIT -> RTS skips RTR
    a.qp.to_rtr(QPAttr(dest_qp_num=b.qp.qp_num, rq_psn=0, dgid=b.gid, dport=d.udp_port))
    with pytest.raises(QueuePairStateError):
        a.qp.post_send(wr)  # RTR
    with pytest.raises(QueuePairStateError):
        a.qp.to_rtr(QPAttr(dest_qp_num=b.qp.qp_num, rq_psn=0))  # no dgid
    with pytest.raises(QueuePairStateError):
        b.qp.to_rtr(QPAttr(dest_qp_num=a.qp.qp_num, rq_psn=0, dgid=bytes(16)))  # not an IPv4-mapped GID
    with pytest.raises(InvalidWorkRequestError):
        a.qp.post_recv(RecvWR(2, [SGE(a.mr.addr, 8, a.mr.lkey ^ 1)]))  # lkey of no MR
    a.qp.close()
    with pytest.raises(QueuePairStateError):
        a.qp.post_send(wr)
    a.close()
    b.close()


def test_closing_a_qp_while_another_thread_uses_it(devices) -> None:
    """close() on one thread while another posts to, queries and reads the same QP:
    every call that comes after the close raises QueuePairStateError (the native engine
    checks for the close once it holds the engine lock, the QP's memory stays until the
    object goes), nothing crashes."""
    d = devices()
    for round_ in range(20):
        a, b = End(d, size=4096), End(d, size=4096)
        connect(a, b)
        wr = SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.mr.sge(0, 64)], remote_addr=b.mr.addr, rkey=b.mr.rkey)
        failures: list[BaseException] = []
        posting = threading.Event()

        def hammer(a: End, wr: SendWR, posting: threading.Event, failures: list[BaseException]) -> None:
            try:
                while True:
                    try:
                        a.qp.post_send(wr)
                    except InvalidWorkRequestError:  # the send queue is full until the ACKs come
                        pass
                    posting.set()
                    a.qp.query()
                    assert a.qp.state in (QPState.IBV_QPS_RTS, QPState.IBV_QPS_RESET, QPState.IBV_QPS_ERR)
                    a.qp.error_reason  # noqa: B018 - read while another thread closes
                    a.qp.counters  # noqa: B018
            except QueuePairStateError:
                return
            except BaseException as e:  # pragma: no cover - what the test is about
                failures.append(e)

        t = threading.Thread(target=hammer, args=(a, wr, posting, failures))
        t.start()
        assert posting.wait(DEADLINE)
        time.sleep(0.0002 * (round_ % 5))
        a.qp.close()
        t.join(DEADLINE)
        assert not t.is_alive() and not failures, failures
        with pytest.raises(QueuePairStateError):
            a.qp.post_send(wr)
        a.close()
        b.close()


def test_peer_qp_destroyed_gives_retry_exceeded(devices) -> None:
    d1, d2 = devices(), devices()
    a, b = End(d1, size=65536), End(d2, size=65536)
    connect(a, b, timeout=10, retry_cnt=2)
    a.qp.post_send(SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.mr.sge(0, 8)], remote_addr=b.mr.addr, rkey=b.mr.rkey))
    ok(wait_cq(a.scq))
    b.qp.close()
    t0 = time.monotonic()
    a.qp.post_send(SendWR(2, WR.IBV_WR_RDMA_WRITE, [a.mr.sge(0, 8)], remote_addr=b.mr.addr, rkey=b.mr.rkey))
    a.qp.post_send(SendWR(3, WR.IBV_WR_RDMA_READ, [a.mr.sge(0, 8)], remote_addr=b.mr.addr, rkey=b.mr.rkey))
    wcs = wait_cq(a.scq, 2, timeout=5)
    elapsed = time.monotonic() - t0
    assert [(wc.wr_id, wc.status) for wc in wcs] == [(2, S.IBV_WC_RETRY_EXC_ERR), (3, S.IBV_WC_WR_FLUSH_ERR)]
    # (1 + retry_cnt) timeouts, each waited for in full: counted, and bounded below
    # (a timer never fires early; a busy machine only makes it later)
    assert a.qp.counters["timeouts"] == 3 and a.qp.counters["retransmits"] == 2, a.qp.counters
    assert elapsed >= 3 * timeout_seconds(10), elapsed
    assert a.qp.state == QPState.IBV_QPS_ERR
    assert d2.counters["rx_unknown_qp"] >= 3
    a.close()
    b.close()


def test_peer_device_closed_gives_retry_exceeded(devices) -> None:
    d1, d2 = devices(), devices()
    a, b = End(d1, size=65536), End(d2, size=65536)
    connect(a, b, timeout=10, retry_cnt=2)
    d2.close()
    t0 = time.monotonic()
    a.qp.post_send(SendWR(1, WR.IBV_WR_SEND, [a.mr.sge(0, 100)]))
    [wc] = wait_cq(a.scq, timeout=5)
    assert wc.status == S.IBV_WC_RETRY_EXC_ERR
    assert a.qp.counters["timeouts"] == 3 and a.qp.counters["retransmits"] == 2, a.qp.counters
    assert time.monotonic() - t0 >= 3 * timeout_seconds(10)
    a.close()


def test_rnr_retry_forever_then_receive(pair) -> None:
    a, b = pair
    for x in (a, b):
        x.qp.modify(QPAttr(qp_state=QPState.IBV_QPS_RTS, rnr_retry=7))
    a.qp.post_send(SendWR(1, WR.IBV_WR_SEND, [a.mr.sge(0, 10)]))
    wait_until(lambda: a.dev.counters["rnr_naks_rcvd"] >= 3)
    assert a.scq.poll() == []
    b.qp.post_recv(RecvWR(5, [b.mr.sge(0, 10)]))
    ok(wait_cq(a.scq))
    ok(wait_cq(b.rcq))
    assert b.buf[:10] == a.buf[:10]


def test_rnr_retry_exceeded(devices) -> None:
    d = devices()
    a, b = End(d, size=4096), End(d, size=4096)
    connect(a, b, rnr_retry=2)
    a.qp.post_send(SendWR(1, WR.IBV_WR_SEND, [a.mr.sge(0, 10)]))
    [wc] = wait_cq(a.scq)
    assert wc.status == S.IBV_WC_RNR_RETRY_EXC_ERR
    assert a.qp.state == QPState.IBV_QPS_ERR and b.qp.state == QPState.IBV_QPS_RTS
    a.close()
    b.close()


# ------------------------------------------------------- completion channel ----


def readable(fd: int, timeout: float) -> bool:
    r, _, _ = select.select([fd], [], [], timeout)
    return bool(r)


def test_completion_channel(pair) -> None:
    a, b = pair
    ch, cq = a.channel, a.scq
    assert ch.fd_mode == "eventfd" and not readable(ch.fileno(), 0)
    assert ch.get_cq_event() is None
    wr = SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.mr.sge(0, 64)], remote_addr=b.mr.addr, rkey=b.mr.rkey)
    # armed: the completion makes the fd readable, and get_cq_event names the CQ
    cq.req_notify()
    assert cq.poll() == []  # drain after arming (nothing yet)
    a.qp.post_send(wr)
    assert readable(ch.fileno(), DEADLINE)
    assert ch.get_cq_event() is cq
    cq.ack_events(1)
    assert not readable(ch.fileno(), 0)
    ok(wait_cq(cq))
    # not re-armed: the next completion fires no event
    a.qp.post_send(wr)
    ok(wait_cq(cq))
    assert not readable(ch.fileno(), 0.05) and ch.get_cq_event() is None
    # one event for several completions while armed; re-arm, poll, wait again
    cq.req_notify()
    for i in range(5):
        a.qp.post_send(SendWR(10 + i, WR.IBV_WR_RDMA_WRITE, [a.mr.sge(0, 64)], remote_addr=b.mr.addr, rkey=b.mr.rkey))
    assert readable(ch.fileno(), DEADLINE)
    assert ch.get_cq_event() is cq and ch.get_cq_event() is None
    cq.ack_events(1)
    assert [wc.wr_id for wc in ok(wait_cq(cq, 5))] == [10, 11, 12, 13, 14]


def test_one_channel_serves_many_cqs() -> None:
    """Verbs let CQs share a completion channel: each event names its CQ, oldest
    first; the event of a CQ destroyed since is skipped."""
    dev = new_device()
    ch = dev.create_comp_channel()
    assert ch.shareable
    a, b = End(dev, fill=1, channel=ch), End(dev, channel=ch)
    connect(a, b)

    def write(x: End, y: End, wr_id: int) -> None:
        x.qp.post_send(SendWR(wr_id, WR.IBV_WR_RDMA_WRITE, [x.mr.sge(0, 64)], remote_addr=y.mr.addr, rkey=y.mr.rkey))

    try:
        a.scq.req_notify()
        b.scq.req_notify()
        write(b, a, 1)
        assert readable(ch.fileno(), DEADLINE)  # b's event is queued ...
        ok(wait_cq(b.scq))
        write(a, b, 2)
        ok(wait_cq(a.scq))  # ... before a's
        assert ch.get_cq_event() is b.scq
        assert readable(ch.fileno(), DEADLINE)
        assert ch.get_cq_event() is a.scq
        assert ch.get_cq_event() is None and not readable(ch.fileno(), 0)
        # a's event queued, then b's; a's CQ destroyed before anyone takes them
        a.scq.req_notify()
        b.scq.req_notify()
        write(a, b, 3)
        assert readable(ch.fileno(), DEADLINE)
        ok(wait_cq(a.scq))
        write(b, a, 4)
        ok(wait_cq(b.scq))
        a.qp.close()
        a.scq.close()
        got: list = []
        wait_until(lambda: got.append(ch.get_cq_event()) or got[-1] is not None)
        assert got[-1] is b.scq and ch.get_cq_event() is None
    finally:
        b.close()
        a.mr.close()
        a.rcq.close()
        ch.close()
    assert ch.get_cq_event() is None


# ----------------------------------------------------------- bad datagrams ----


def _udp_from_localhost() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    return s


def test_device_counts_bad_datagrams_and_keeps_working(devices) -> None:
    d1, d2 = devices(), devices()
    a, b = End(d1, size=65536, fill=9), End(d2, size=65536)
    connect(a, b)
    dev_ip, dev_port = d2.address
    s = _udp_from_localhost()
    src_ip, src_port = s.getsockname()
    flow = wire.Flow(src_ip, dev_ip, src_port, dev_port)
    target = b.qp.qp_num
    unused_qpn = (target + 1) & 0xFFFFFF or 2
    c0 = d2.counters
    bad_icrc = bytearray(wire.encode_bytes(wire.Packet(wire.Opcode.SEND_ONLY, target, 0, payload=b"x" * 20), flow))
    bad_icrc[-1] ^= 0xFF
    datagrams = {
        "rx_icrc_errors": bytes(bad_icrc),
        "rx_malformed_truncated": b"\x04\x00\xff",
        "rx_malformed_bad_opcode": bytes([0x64]) + bytes(15),  # UD SEND_ONLY: not an RC opcode
        "rx_unknown_qp": wire.encode_bytes(wire.Packet(wire.Opcode.SEND_ONLY, unused_qpn, 0, payload=b"hi"), flow),
        # a well-formed WRITE with the right rkey and PSN, but from an address that is not the QP's peer
        "rx_wrong_source": wire.encode_bytes(
            wire.Packet(
                wire.Opcode.RDMA_WRITE_ONLY,
                target,
                b.qp.query().rq_psn,
                va=b.mr.addr,
                rkey=b.mr.rkey,
                dma_len=4,
                payload=b"evil",
            ),
            flow,
        ),
    }
    for data in datagrams.values():
        s.sendto(data, (dev_ip, dev_port))
    wait_until(lambda: all(d2.counters.get(k, 0) > c0.get(k, 0) for k in datagrams))
    assert d2.counters["rx_malformed"] >= c0.get("rx_malformed", 0) + 2
    assert b.buf[:4] == bytes(4)  # the spoofed WRITE was not executed
    s.close()
    # ... and the device still works
    a.qp.post_send(SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.mr.sge(0, 30000)], remote_addr=b.mr.addr, rkey=b.mr.rkey))
    ok(wait_cq(a.scq))
    assert b.buf[:30000] == a.buf[:30000]
    assert a.qp.state == b.qp.state == QPState.IBV_QPS_RTS
    a.close()
    b.close()


def test_timers_wait_for_the_receive_queue(devices) -> None:
    """A retransmit timer that is due while the answer still sits in the socket's
    receive queue must not fire: the NIC drains the queue first. (Found by running
    the lossy-link test three times in parallel: the NIC processed 256 datagrams,
    ran the timers with READ responses still queued, re-requested every READ in
    flight, and the extra traffic ended in IBV_WC_RETRY_EXC_ERR.)"""
    d1, d2 = devices(), devices()
    a, b = End(d1, size=4096, fill=1), End(d2, size=4096)
    connect(a, b, timeout=10, retry_cnt=7)  # 4.2 ms
    junk = _udp_from_localhost()
    acks_before = d2.counters.get("tx_packets", 0)
    with nic_held(d1) as service:  # the NIC thread cannot service the socket meanwhile
        for _ in range(400):
            junk.sendto(b"\x04\x00\xff", d1.address)  # malformed: queued ahead of the ACK
        posted = time.monotonic()
        a.qp.post_send(SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.mr.sge(0, 64)], remote_addr=b.mr.addr, rkey=b.mr.rkey))
        # the ACK is in our socket's queue once d2 sent it (loopback UDP delivers within sendto) ...
        wait_until(lambda: d2.counters.get("tx_packets", 0) > acks_before)
        # ... and the retransmit timer is due
        time.sleep(max(0.0, posted + 3 * timeout_seconds(10) - time.monotonic()))
        service()  # 256 datagrams: the queue is not empty yet
        assert a.qp.counters["timeouts"] == 0
    ok(wait_cq(a.scq))
    assert a.qp.counters["timeouts"] == 0 and a.qp.counters["retransmits"] == 0
    assert d1.counters["rx_malformed"] == 400
    junk.close()
    a.close()
    b.close()


# ------------------------------------------------------------ lossy link ----


def test_lossy_link_1mib_writes_reads_sends(devices) -> None:
    d1, d2 = devices(), devices()
    mib = 1 << 20
    a, b = End(d1, size=mib, fill=11), End(d2, size=mib, fill=12)
    connect(a, b, timeout=14, retry_cnt=7)
    d1.faults = LinkFaults(drop=0.05, duplicate=0.02, reorder=0.02, seed=1)
    d2.faults = LinkFaults(drop=0.05, duplicate=0.02, reorder=0.02, seed=2)
    remote_src = bytes(b.buf)
    # 1 MiB of WRITEs into the second half of nothing: a -> b.buf
    sink = bytearray(mib)
    sink_mr = b.pd.reg_mr(sink, ACCESS_ALL)
    chunk = 64 * 1024
    for i in range(mib // chunk):
        a.qp.post_send(
            SendWR(
                i,
                WR.IBV_WR_RDMA_WRITE,
                [a.mr.sge(i * chunk, chunk)],
                remote_addr=sink_mr.addr + i * chunk,
                rkey=sink_mr.rkey,
            )
        )
    assert [wc.wr_id for wc in ok(wait_cq(a.scq, mib // chunk, timeout=30))] == list(range(mib // chunk))
    assert sink == a.buf
    # 1 MiB of READs: b.buf -> a's second buffer
    dest = bytearray(mib)
    dest_mr = a.pd.reg_mr(dest, ACCESS_ALL)
    for i in range(mib // chunk):
        a.qp.post_send(
            SendWR(
                100 + i,
                WR.IBV_WR_RDMA_READ,
                [dest_mr.sge(i * chunk, chunk)],
                remote_addr=b.mr.addr + i * chunk,
                rkey=b.mr.rkey,
            )
        )
    ok(wait_cq(a.scq, mib // chunk, timeout=30))
    assert dest == remote_src
    # 1 MiB of SENDs
    sink[:] = bytes(mib)
    for i in range(mib // chunk):
        b.qp.post_recv(RecvWR(i, [sink_mr.sge(i * chunk, chunk)]))
    for i in range(mib // chunk):
        a.qp.post_send(SendWR(200 + i, WR.IBV_WR_SEND_WITH_IMM, [a.mr.sge(i * chunk, chunk)], imm_data=i))
    ok(wait_cq(a.scq, mib // chunk, timeout=30))
    rwcs = ok(wait_cq(b.rcq, mib // chunk, timeout=30))
    assert [(wc.wr_id, wc.imm_data, wc.byte_len) for wc in rwcs] == [(i, i, chunk) for i in range(mib // chunk)]
    assert sink == a.buf
    # and atomics executed exactly once despite duplicates and retransmissions
    U64.pack_into(sink, 0, 0)
    for i in range(50):
        a.qp.post_send(
            SendWR(
                300 + i,
                WR.IBV_WR_ATOMIC_FETCH_AND_ADD,
                [dest_mr.sge(8 * i, 8)],
                remote_addr=sink_mr.addr,
                rkey=sink_mr.rkey,
                compare_add=1,
            )
        )
    ok(wait_cq(a.scq, 50, timeout=30))
    assert U64.unpack_from(sink, 0)[0] == 50
    assert sorted(U64.unpack_from(dest, 8 * i)[0] for i in range(50)) == list(range(50))
    faults = d1.faults, d2.faults
    assert sum(f.dropped for f in faults) > 0 and sum(f.duplicated for f in faults) > 0
    assert d1.counters["retransmits"] > 0
    for d in (d1, d2):
        d.faults = None
    sink_mr.close()
    dest_mr.close()
    a.close()
    b.close()


# ------------------------------------------------------------ two processes ----

CHILD = textwrap.dedent(r"""
    import json, os, random, struct, sys, time
    from aiordma.errors import DeviceNotFoundError
    from aiordma.providers.base import ACCESS_ALL, QPAttr, QPCap, RecvWR
    from aiordma.providers.soft.device import SoftCompletionChannel, SoftDevice

    def send(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    rng = random.Random(os.getpid() * 7919 + time.monotonic_ns())
    for _ in range(100):
        ip = f"127.{rng.randrange(100, 250)}.{rng.randrange(0, 256)}.{rng.randrange(2, 250)}"
        try:
            dev = SoftDevice(f"{ip}:4791")
            break
        except DeviceNotFoundError:
            pass
    size = int(sys.argv[1])
    pd = dev.alloc_pd()
    cq = dev.create_cq(64)
    qp = pd.create_qp(cq, cq, QPCap())
    mem = bytearray(random.Random(42).randbytes(size))
    mr = pd.reg_mr(mem, ACCESS_ALL)
    inbox = bytearray(4096)
    inbox_mr = pd.reg_mr(inbox, ACCESS_ALL)
    send({"qpn": qp.qp_num, "gid": dev.query_gid().gid.hex(), "port": dev.udp_port,
          "addr": mr.addr, "rkey": mr.rkey, "psn": 0xFFFF00, "pid": os.getpid()})
    peer = json.loads(sys.stdin.readline())
    qp.to_init(QPAttr(qp_access_flags=ACCESS_ALL))
    qp.post_recv(RecvWR(7, [inbox_mr.sge()]))  # pre-posted: the NIC thread completes it
    qp.to_rtr(QPAttr(dest_qp_num=peer["qpn"], rq_psn=peer["psn"], dgid=bytes.fromhex(peer["gid"]), dport=peer["port"]))
    qp.to_rts(QPAttr(sq_psn=0xFFFF00))
    send({"ready": True})
    # the main thread now blocks in read(2) until the parent is done with our memory
    t0 = time.monotonic()
    cmd = json.loads(sys.stdin.readline())
    blocked = time.monotonic() - t0
    # the SEND's receive completion: the parent saw its ACK, the completion may trail it
    wcs, deadline = [], time.monotonic() + 20
    while not wcs and time.monotonic() < deadline:
        wcs = cq.poll(16)
        time.sleep(0.001)
    send({"blocked": blocked, "mem": mem.hex(), "inbox": inbox[:64].hex(),
          "wcs": [[wc.wr_id, int(wc.status), int(wc.opcode), wc.byte_len, wc.imm_data] for wc in wcs],
          "counters": dev.counters})
    sys.stdin.readline()
    dev.close()
    """)


def test_two_processes_one_sided_into_blocked_child(devices) -> None:
    size = 256 * 1024
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
        bufsize=1,
    )

    def recv() -> dict:
        r, _, _ = select.select([child.stdout], [], [], 30)
        assert r, "child did not answer within 30 s"
        line = child.stdout.readline()
        assert line, f"child exited (rc={child.poll()})"
        return json.loads(line)

    def send(obj) -> None:
        child.stdin.write(json.dumps(obj) + "\n")
        child.stdin.flush()

    try:
        info = recv()
        d = devices()
        a = End(d, size=size, fill=77)
        a.qp.to_init(QPAttr(qp_access_flags=ACCESS_ALL))
        send({"qpn": a.qp.qp_num, "gid": a.gid.hex(), "port": d.udp_port, "psn": 0xFFFFF8})
        a.qp.to_rtr(
            QPAttr(dest_qp_num=info["qpn"], rq_psn=info["psn"], dgid=bytes.fromhex(info["gid"]), dport=info["port"])
        )
        a.qp.to_rts(QPAttr(sq_psn=0xFFFFF8, timeout=14, retry_cnt=7))
        assert recv() == {"ready": True}
        # from here on the child's main thread sits in readline(): only its NIC thread runs
        child_mem = bytearray(random.Random(42).randbytes(size))
        addr, rkey = info["addr"], info["rkey"]
        # WRITE 100 KiB at offset 1000
        a.qp.post_send(SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.mr.sge(0, 100_000)], remote_addr=addr + 1000, rkey=rkey))
        child_mem[1000:101_000] = a.buf[:100_000]
        # READ back 150 KiB spanning written and untouched bytes
        local = bytearray(150_000)
        local_mr = a.pd.reg_mr(local, ACCESS_ALL)
        a.qp.post_send(SendWR(2, WR.IBV_WR_RDMA_READ, [local_mr.sge()], remote_addr=addr + 50_000, rkey=rkey))
        # atomics on offset 200000 (8-byte aligned)
        off = 200_000
        old0 = U64.unpack_from(child_mem, off)[0]
        a.qp.post_send(
            SendWR(
                3,
                WR.IBV_WR_ATOMIC_CMP_AND_SWP,
                [a.mr.sge(size - 8, 8)],
                remote_addr=addr + off,
                rkey=rkey,
                compare_add=old0,
                swap=5,
            )
        )
        for i in range(10):
            a.qp.post_send(
                SendWR(
                    4 + i,
                    WR.IBV_WR_ATOMIC_FETCH_AND_ADD,
                    [a.mr.sge(size - 200 + 8 * i, 8)],
                    remote_addr=addr + off,
                    rkey=rkey,
                    compare_add=100,
                )
            )
        U64.pack_into(child_mem, off, 5 + 1000)
        # a SEND into the receive the child posted before blocking
        a.qp.post_send(SendWR(20, WR.IBV_WR_SEND_WITH_IMM, [a.mr.sge(0, 64)], imm_data=0xABCD))
        wcs = ok(wait_cq(a.scq, 14, timeout=20))
        assert [wc.wr_id for wc in wcs] == [1, 2, 3, *range(4, 14), 20]
        assert local == child_mem[50_000:200_000]
        assert U64.unpack_from(a.buf, size - 8)[0] == old0
        assert [U64.unpack_from(a.buf, size - 200 + 8 * i)[0] for i in range(10)] == [5 + 100 * i for i in range(10)]
        send({"cmd": "dump"})
        report = recv()
        assert report["blocked"] > 0.0
        assert bytes.fromhex(report["mem"]) == bytes(child_mem)
        assert report["wcs"] == [[7, 0, int(WCOpcode.IBV_WC_RECV), 64, 0xABCD]]
        assert bytes.fromhex(report["inbox"]) == bytes(a.buf[:64])
        assert report["counters"]["rx_packets"] > 0
        send({"cmd": "exit"})
        assert child.wait(timeout=20) == 0
        local_mr.close()
        a.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdin.close()
        child.stdout.close()
