"""Tests of the sans-IO RC transport (``aiordma.providers.soft.rc``).

Two :class:`RCQueuePair` engines talk through the in-memory link of
``rc_harness.Pair`` (simulated clock, every packet through the real codec and
ICRC, seeded drop/duplicate/reorder), packet by packet, like aioquic's
``tests/test_connection.py``.
"""

from __future__ import annotations

import random
import struct
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiordma.errors import InvalidWorkRequestError, QueuePairStateError
from aiordma.providers.base import (
    ACCESS_ALL,
    MTU,
    SGE,
    Access,
    QPAttr,
    QPCap,
    QPState,
    RecvWR,
    SendFlags,
    SendWR,
    WCFlags,
    WCOpcode,
    WCStatus,
    WROpcode,
    gid_from_ipv4,
)
from aiordma.providers.soft import wire
from aiordma.providers.soft.rc import RETRY_BACKOFF_CAP, RCQueuePair, retry_backoff, timeout_seconds
from aiordma.providers.soft.wire import Opcode, Packet

from .rc_harness import FakeMemory, FakeRegion, Pair, default_engine, make_qp

U64 = struct.Struct("<Q" if sys.byteorder == "little" else ">Q")
SIGNALED = SendFlags.IBV_SEND_SIGNALED
UNSIGNALED = SendFlags(0)
WR = WROpcode
S = WCStatus


def pattern(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def only_success(wcs):
    assert all(wc.status == S.IBV_WC_SUCCESS for wc in wcs), wcs
    return wcs


def near_wrap(k: int = 3) -> int:
    return (1 << 24) - k


# ================================================================ basics ====


@pytest.mark.parametrize("size", [0, 1, 1023, 1024, 1025, 3 * 1024, 100 * 1024])
@pytest.mark.parametrize("with_imm", [False, True])
def test_rdma_write(size: int, with_imm: bool) -> None:
    p = Pair(psn_a=near_wrap(), psn_b=near_wrap(7))
    src = p.mem["a"].reg(pattern(size + 16, size))
    dst = p.mem["b"].reg(size + 64)
    if with_imm:
        p.post_recv("b", RecvWR(77))
    op = WR.IBV_WR_RDMA_WRITE_WITH_IMM if with_imm else WR.IBV_WR_RDMA_WRITE
    p.post_send("a", SendWR(5, op, [src.sge(16, size)], remote_addr=dst.addr + 32, rkey=dst.rkey, imm_data=0xDEADBEEF))
    p.run()
    [wc] = p.send_wcs("a")
    assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len) == (5, S.IBV_WC_SUCCESS, WCOpcode.IBV_WC_RDMA_WRITE, size)
    assert dst.buf[32 : 32 + size] == src.buf[16 : 16 + size]
    assert dst.buf[:32] == bytes(32) and dst.buf[32 + size :] == bytes(32)
    npkts = max(1, -(-size // 1024))
    reqs = [pk for pk in p.sent_by("a")]
    assert len(reqs) == npkts
    assert [pk.psn for pk in reqs] == [wire.psn_add(near_wrap(), i) for i in range(npkts)]
    if with_imm:
        [rwc] = p.recv_wcs("b")
        assert rwc.opcode == WCOpcode.IBV_WC_RECV_RDMA_WITH_IMM and rwc.status == S.IBV_WC_SUCCESS
        assert rwc.imm_data == 0xDEADBEEF and rwc.wc_flags & WCFlags.IBV_WC_WITH_IMM
        assert rwc.byte_len == size and rwc.wr_id == 77
        assert reqs[-1].opcode == (
            Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE if npkts == 1 else Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE
        )
    else:
        assert p.recv_wcs("b") == []
    if npkts > 1:
        assert reqs[0].opcode == Opcode.RDMA_WRITE_FIRST and reqs[0].dma_len == size
        assert all(pk.opcode == Opcode.RDMA_WRITE_MIDDLE for pk in reqs[1:-1])
        assert all(len(pk.payload) == 1024 for pk in reqs[:-1])
    assert p.a.state == p.b.state == QPState.IBV_QPS_RTS
    assert not p.a.sq and p.a.next_timer() is None


@pytest.mark.parametrize("size", [0, 1, 1024, 1025, 100 * 1024])
@pytest.mark.parametrize("with_imm", [False, True])
def test_send(size: int, with_imm: bool) -> None:
    p = Pair(psn_a=near_wrap(1), psn_b=near_wrap(2))
    src = p.mem["a"].reg(pattern(size, size))
    dst = p.mem["b"].reg(size + 100)
    p.post_recv("b", RecvWR(9, [dst.sge(50, size + 50)]))
    op = WR.IBV_WR_SEND_WITH_IMM if with_imm else WR.IBV_WR_SEND
    p.post_send("a", SendWR(1, op, [src.sge()] if size else [], imm_data=0x01020304))
    p.run()
    [wc] = p.send_wcs("a")
    assert (wc.status, wc.opcode, wc.byte_len) == (S.IBV_WC_SUCCESS, WCOpcode.IBV_WC_SEND, size)
    [rwc] = p.recv_wcs("b")
    assert (rwc.wr_id, rwc.status, rwc.opcode, rwc.byte_len) == (9, S.IBV_WC_SUCCESS, WCOpcode.IBV_WC_RECV, size)
    assert rwc.qp_num == p.b.qp_num and rwc.src_qp == p.a.qp_num
    assert (rwc.imm_data == 0x01020304) if with_imm else rwc.imm_data is None
    assert bool(rwc.wc_flags & WCFlags.IBV_WC_WITH_IMM) == with_imm
    assert dst.buf[50 : 50 + size] == src.buf
    assert dst.buf[:50] == bytes(50) and dst.buf[50 + size :] == bytes(50)


@pytest.mark.parametrize("size", [0, 1, 1024, 1025, 4096 * 3 + 7, 100 * 1024])
@pytest.mark.parametrize("mtu", [MTU.IBV_MTU_256, MTU.IBV_MTU_1024, MTU.IBV_MTU_4096])
def test_rdma_read(size: int, mtu: MTU) -> None:
    p = Pair(mtu=mtu, psn_a=near_wrap(2))
    local = p.mem["a"].reg(size + 20)
    remote = p.mem["b"].reg(pattern(size + 8, 3), Access.LOCAL_WRITE | Access.REMOTE_READ)
    p.post_send(
        "a", SendWR(3, WR.IBV_WR_RDMA_READ, [local.sge(10, size)], remote_addr=remote.addr + 8, rkey=remote.rkey)
    )
    p.run()
    [wc] = p.send_wcs("a")
    assert (wc.status, wc.opcode, wc.byte_len) == (S.IBV_WC_SUCCESS, WCOpcode.IBV_WC_RDMA_READ, size)
    assert local.buf[10 : 10 + size] == remote.buf[8:]
    assert local.buf[:10] == bytes(10) and local.buf[10 + size :] == bytes(10)
    n = max(1, -(-size // (128 << mtu)))
    resp = p.sent_by("b")
    assert len(resp) == n
    assert [pk.psn for pk in resp] == [wire.psn_add(near_wrap(2), i) for i in range(n)]
    # the read occupies n PSNs: the next request uses the PSN after them
    assert p.a.next_psn == wire.psn_add(near_wrap(2), n)
    assert p.recv_wcs("b") == []


def test_atomics() -> None:
    p = Pair(psn_a=near_wrap(1))
    local = p.mem["a"].reg(32)
    remote = p.mem["b"].reg(64, Access.LOCAL_WRITE | Access.REMOTE_ATOMIC)
    U64.pack_into(remote.buf, 8, 100)
    U64.pack_into(remote.buf, 16, 0xFFFFFFFFFFFFFFFF)
    p.post_send(
        "a",
        SendWR(
            1,
            WR.IBV_WR_ATOMIC_FETCH_AND_ADD,
            [local.sge(0, 8)],
            remote_addr=remote.addr + 8,
            rkey=remote.rkey,
            compare_add=5,
        ),
    )
    # CAS that matches
    p.post_send(
        "a",
        SendWR(
            2,
            WR.IBV_WR_ATOMIC_CMP_AND_SWP,
            [local.sge(8, 8)],
            remote_addr=remote.addr + 8,
            rkey=remote.rkey,
            compare_add=105,
            swap=7,
        ),
    )
    # CAS that does not match: nothing changes, old value returned
    p.post_send(
        "a",
        SendWR(
            3,
            WR.IBV_WR_ATOMIC_CMP_AND_SWP,
            [local.sge(16, 8)],
            remote_addr=remote.addr + 8,
            rkey=remote.rkey,
            compare_add=105,
            swap=9,
        ),
    )
    # FETCH_ADD wraps modulo 2**64
    p.post_send(
        "a",
        SendWR(
            4,
            WR.IBV_WR_ATOMIC_FETCH_AND_ADD,
            [local.sge(24, 8)],
            remote_addr=remote.addr + 16,
            rkey=remote.rkey,
            compare_add=2,
        ),
    )
    p.run()
    wcs = only_success(p.send_wcs("a"))
    assert [wc.wr_id for wc in wcs] == [1, 2, 3, 4]
    assert [wc.opcode for wc in wcs] == [
        WCOpcode.IBV_WC_FETCH_ADD,
        WCOpcode.IBV_WC_COMP_SWAP,
        WCOpcode.IBV_WC_COMP_SWAP,
        WCOpcode.IBV_WC_FETCH_ADD,
    ]
    assert [wc.byte_len for wc in wcs] == [8, 8, 8, 8]
    assert [U64.unpack_from(local.buf, i)[0] for i in (0, 8, 16, 24)] == [100, 105, 7, 0xFFFFFFFFFFFFFFFF]
    assert U64.unpack_from(remote.buf, 8)[0] == 7
    assert U64.unpack_from(remote.buf, 16)[0] == 1
    assert remote.buf[:8] == bytes(8) and remote.buf[24:] == bytes(40)
    ops = [pk.opcode for pk in p.sent_by("a")]
    assert ops == [Opcode.FETCH_ADD, Opcode.COMPARE_SWAP, Opcode.COMPARE_SWAP, Opcode.FETCH_ADD]
    assert [pk.opcode for pk in p.sent_by("b")] == [Opcode.ATOMIC_ACKNOWLEDGE] * 4


def test_scatter_gather() -> None:
    """Multiple SGEs on the send side (gather) and the receive/read side (scatter)."""
    p = Pair(mtu=MTU.IBV_MTU_256)
    a1 = p.mem["a"].reg(pattern(700, 1))
    a2 = p.mem["a"].reg(pattern(300, 2))
    a3 = p.mem["a"].reg(pattern(1, 3))
    gather = [a1.sge(100, 600), a2.sge(0, 0), a2.sge(0, 300), a3.sge(0, 1)]
    expect = bytes(a1.buf[100:700]) + bytes(a2.buf) + bytes(a3.buf)
    b1 = p.mem["b"].reg(500)
    b2 = p.mem["b"].reg(500)
    b3 = p.mem["b"].reg(2000)
    p.post_recv("b", RecvWR(1, [b1.sge(0, 257), b2.sge(10, 3), b3.sge(0, 2000)]))
    p.post_send("a", SendWR(10, WR.IBV_WR_SEND, gather))
    p.post_send("a", SendWR(11, WR.IBV_WR_RDMA_WRITE, gather, remote_addr=b3.addr + 1000, rkey=b3.rkey))
    p.run()
    only_success(p.send_wcs("a"))
    [rwc] = only_success(p.recv_wcs("b"))
    assert rwc.byte_len == len(expect) == 901
    got = bytes(b1.buf[:257]) + bytes(b2.buf[10:13]) + bytes(b3.buf[: 901 - 260])
    assert got == expect
    assert b3.buf[1000:1901] == expect
    # READ scattered into three local SGEs
    c1 = p.mem["a"].reg(100)
    c2 = p.mem["a"].reg(1000)
    p.post_send(
        "a",
        SendWR(
            12,
            WR.IBV_WR_RDMA_READ,
            [c1.sge(0, 1), c2.sge(0, 600), c1.sge(50, 50)],
            remote_addr=b3.addr + 1000,
            rkey=b3.rkey,
        ),
    )
    p.run()
    assert [wc.wr_id for wc in only_success(p.send_wcs("a"))] == [10, 11, 12]
    assert bytes(c1.buf[:1]) + bytes(c2.buf[:600]) + bytes(c1.buf[50:100]) == expect[:651]


def test_every_wire_opcode_is_used() -> None:
    """A mix that makes both engines emit every RC request and response opcode."""
    p = Pair()
    a = p.mem["a"].reg(pattern(5000))
    b = p.mem["b"].reg(5000)
    for i in range(4):
        p.post_recv("b", RecvWR(i, [b.sge()]))
    for op in (WR.IBV_WR_SEND, WR.IBV_WR_SEND_WITH_IMM, WR.IBV_WR_RDMA_WRITE, WR.IBV_WR_RDMA_WRITE_WITH_IMM):
        for n in (100, 3000):
            if op in (WR.IBV_WR_SEND, WR.IBV_WR_SEND_WITH_IMM) or op == WR.IBV_WR_RDMA_WRITE_WITH_IMM:
                p.post_recv("b", RecvWR(100 + n, [b.sge()]))
            p.post_send("a", SendWR(n, op, [a.sge(0, n)], remote_addr=b.addr, rkey=b.rkey, imm_data=n))
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_READ, [a.sge(0, 100)], remote_addr=b.addr, rkey=b.rkey))
    p.post_send("a", SendWR(2, WR.IBV_WR_RDMA_READ, [a.sge(0, 3000)], remote_addr=b.addr, rkey=b.rkey))
    p.post_send("a", SendWR(3, WR.IBV_WR_ATOMIC_CMP_AND_SWP, [a.sge(0, 8)], remote_addr=b.addr, rkey=b.rkey))
    p.post_send("a", SendWR(4, WR.IBV_WR_ATOMIC_FETCH_AND_ADD, [a.sge(0, 8)], remote_addr=b.addr, rkey=b.rkey))
    p.run()
    assert len(only_success(p.send_wcs("a"))) == 12
    seen = {pk.opcode for pk in p.sent_by("a")} | {pk.opcode for pk in p.sent_by("b")}
    # (a grant answers a READ from another process only: tests/integration/test_cma.py)
    rc_opcodes = set(Opcode) - {Opcode.CMA_READ_GRANT}
    assert seen == rc_opcodes, rc_opcodes - seen


def test_unsignaled_and_sq_sig_all() -> None:
    p = Pair()
    a = p.mem["a"].reg(pattern(4096))
    b = p.mem["b"].reg(4096)
    for i in range(10):
        flags = SIGNALED if i % 3 == 2 else UNSIGNALED
        p.post_send(
            "a",
            SendWR(
                i,
                WR.IBV_WR_RDMA_WRITE,
                [a.sge(i * 100, 100)],
                send_flags=flags,
                remote_addr=b.addr + i * 100,
                rkey=b.rkey,
            ),
        )
    r = p.mem["a"].reg(16)
    p.post_send(
        "a", SendWR(50, WR.IBV_WR_RDMA_READ, [r.sge(0, 8)], send_flags=UNSIGNALED, remote_addr=b.addr, rkey=b.rkey)
    )
    p.post_send(
        "a",
        SendWR(
            51,
            WR.IBV_WR_ATOMIC_FETCH_AND_ADD,
            [r.sge(8, 8)],
            send_flags=UNSIGNALED,
            remote_addr=b.addr + 2000,
            rkey=b.rkey,
            compare_add=1,
        ),
    )
    p.run()
    assert [wc.wr_id for wc in only_success(p.send_wcs("a"))] == [2, 5, 8]
    assert b.buf[:1000] == a.buf[:1000]
    assert r.buf[:8] == a.buf[:8]
    assert U64.unpack_from(b.buf, 2000)[0] == 1
    assert not p.a.sq
    # sq_sig_all: every WR completes even without IBV_SEND_SIGNALED
    q = Pair(sq_sig_all=True)
    a = q.mem["a"].reg(64)
    b = q.mem["b"].reg(64)
    for i in range(3):
        q.post_send(
            "a", SendWR(i, WR.IBV_WR_RDMA_WRITE, [a.sge(0, 8)], send_flags=UNSIGNALED, remote_addr=b.addr, rkey=b.rkey)
        )
    q.run()
    assert [wc.wr_id for wc in only_success(q.send_wcs("a"))] == [0, 1, 2]


def test_bidirectional_traffic() -> None:
    """Both QPs are requester and responder at once; ACKs and requests interleave."""
    p = Pair(psn_a=near_wrap(5), psn_b=near_wrap(40), seed=3, drop=0.05, reorder=0.1, duplicate=0.05)
    ma = p.mem["a"].reg(pattern(64 * 1024, 1))
    mb = p.mem["b"].reg(pattern(64 * 1024, 2))
    ra = p.mem["a"].reg(64 * 1024)
    rb = p.mem["b"].reg(64 * 1024)
    for i in range(16):
        p.post_send(
            "a", SendWR(i, WR.IBV_WR_RDMA_WRITE, [ma.sge(i * 4096, 4096)], remote_addr=rb.addr + i * 4096, rkey=rb.rkey)
        )
        p.post_send(
            "b", SendWR(i, WR.IBV_WR_RDMA_WRITE, [mb.sge(i * 4096, 4096)], remote_addr=ra.addr + i * 4096, rkey=ra.rkey)
        )
    p.run()
    assert [wc.wr_id for wc in only_success(p.send_wcs("a"))] == list(range(16))
    assert [wc.wr_id for wc in only_success(p.send_wcs("b"))] == list(range(16))
    assert ra.buf == mb.buf and rb.buf == ma.buf


# ===================================================== lossy, many WRs ====


class Workload:
    """A random mix of WRs from ``a`` to ``b`` with everything needed to check the outcome.

    Writes and sends go to disjoint areas, reads read a fixed pattern, FETCH_ADDs
    hit one counter (their old values must be the prefix sums, in post order) and
    CMP_AND_SWPs form a chain (compare i, swap i+1: all succeed only if each runs
    exactly once, in order).
    """

    OPS = (
        WR.IBV_WR_RDMA_WRITE,
        WR.IBV_WR_RDMA_WRITE_WITH_IMM,
        WR.IBV_WR_SEND,
        WR.IBV_WR_SEND_WITH_IMM,
        WR.IBV_WR_RDMA_READ,
        WR.IBV_WR_ATOMIC_CMP_AND_SWP,
        WR.IBV_WR_ATOMIC_FETCH_AND_ADD,
    )

    def __init__(self, p: Pair, rng: random.Random, n: int, max_len: int = 6000) -> None:
        self.p = p
        self.n = n
        lens = [rng.choice((0, 1, 7, 1024, 1025, 2048, rng.randrange(max_len + 1))) for _ in range(n)]
        ops = [rng.choice(self.OPS) for _ in range(n)]
        self.ops, self.lens = ops, lens
        total = sum(lens) + 16
        self.src = p.mem["a"].reg(pattern(total, rng.randrange(1 << 30)))
        self.read_dst = p.mem["a"].reg(total)
        self.old = p.mem["a"].reg(8 * n + 8)
        self.wdst = p.mem["b"].reg(total)
        self.rdst = p.mem["b"].reg(total)
        self.rsrc = p.mem["b"].reg(pattern(total, rng.randrange(1 << 30)))
        self.ctr = p.mem["b"].reg(16)
        self.signaled: list[int] = []
        self.recvs: list[tuple[int, int, int, int | None]] = []  # wr_id, offset, length, imm
        self.faa_adds: list[tuple[int, int]] = []  # (wr index, add)
        self.cas: list[int] = []
        off = 0
        for i, (op, ln) in enumerate(zip(ops, lens)):
            flags = SIGNALED if rng.random() < 0.7 or i == n - 1 else UNSIGNALED
            if flags:
                self.signaled.append(i)
            imm = rng.randrange(1 << 32)
            if op in (WR.IBV_WR_ATOMIC_CMP_AND_SWP, WR.IBV_WR_ATOMIC_FETCH_AND_ADD):
                sg = [self.old.sge(8 * i, 8)]
                if op == WR.IBV_WR_ATOMIC_FETCH_AND_ADD:
                    add = rng.randrange(1 << 40)
                    self.faa_adds.append((i, add))
                    wr = SendWR(i, op, sg, flags, remote_addr=self.ctr.addr, rkey=self.ctr.rkey, compare_add=add)
                else:
                    k = len(self.cas)
                    self.cas.append(i)
                    wr = SendWR(
                        i, op, sg, flags, remote_addr=self.ctr.addr + 8, rkey=self.ctr.rkey, compare_add=k, swap=k + 1
                    )
            else:
                # split the local buffer into up to 3 SGEs
                cuts = sorted(rng.randrange(ln + 1) for _ in range(rng.randrange(3)))
                bounds = [0, *cuts, ln]
                base = self.read_dst if op == WR.IBV_WR_RDMA_READ else self.src
                sg = [base.sge(off + x, y - x) for x, y in zip(bounds, bounds[1:])]
                if op == WR.IBV_WR_RDMA_READ:
                    wr = SendWR(i, op, sg, flags, remote_addr=self.rsrc.addr + off, rkey=self.rsrc.rkey)
                elif op in (WR.IBV_WR_SEND, WR.IBV_WR_SEND_WITH_IMM):
                    wr = SendWR(i, op, sg, flags, imm_data=imm)
                    self.recvs.append((i, off, ln, imm if op == WR.IBV_WR_SEND_WITH_IMM else None))
                    p.post_recv("b", RecvWR(i, [self.rdst.sge(off, ln)] if ln else []))
                else:
                    wr = SendWR(i, op, sg, flags, imm_data=imm, remote_addr=self.wdst.addr + off, rkey=self.wdst.rkey)
                    if op == WR.IBV_WR_RDMA_WRITE_WITH_IMM:
                        self.recvs.append((i, off, ln, imm))
                        p.post_recv("b", RecvWR(i, []))
            self.wr = wr
            p.post_send("a", wr)
            off += ln

    def check(self, allow_retry_exhaustion: bool = False) -> None:
        """Everything completed exactly once, in order, correctly.

        With ``allow_retry_exhaustion`` (very lossy random links, where running out
        of ``retry_cnt`` is a legitimate outcome) one WR may instead fail with
        IBV_WC_RETRY_EXC_ERR; then every later WR must be flushed and everything
        before it must be correct.
        """
        p = self.p
        wcs = p.send_wcs("a")
        n_ok = self.n
        failed = [k for k, wc in enumerate(wcs) if not wc.ok]
        if failed and allow_retry_exhaustion:
            k = failed[0]
            assert wcs[k].status == S.IBV_WC_RETRY_EXC_ERR, wcs[k]
            n_ok = wcs[k].wr_id
            assert [wc.wr_id for wc in wcs[:k]] == [i for i in self.signaled if i < n_ok]
            assert [(wc.wr_id, wc.status) for wc in wcs[k + 1 :]] == [
                (i, S.IBV_WC_WR_FLUSH_ERR) for i in range(n_ok + 1, self.n)
            ], "after the failure every WR is flushed, signaled or not"
            assert p.a.state == QPState.IBV_QPS_ERR
            wcs = wcs[:k]
        else:
            assert [wc.wr_id for wc in wcs] == self.signaled, "every signaled WR completes exactly once, in order"
        assert all(wc.status == S.IBV_WC_SUCCESS for wc in wcs), [wc for wc in wcs if not wc.ok][:3]
        for wc in wcs:
            assert (
                wc.opcode
                == {
                    WR.IBV_WR_RDMA_WRITE: WCOpcode.IBV_WC_RDMA_WRITE,
                    WR.IBV_WR_RDMA_WRITE_WITH_IMM: WCOpcode.IBV_WC_RDMA_WRITE,
                    WR.IBV_WR_SEND: WCOpcode.IBV_WC_SEND,
                    WR.IBV_WR_SEND_WITH_IMM: WCOpcode.IBV_WC_SEND,
                    WR.IBV_WR_RDMA_READ: WCOpcode.IBV_WC_RDMA_READ,
                    WR.IBV_WR_ATOMIC_CMP_AND_SWP: WCOpcode.IBV_WC_COMP_SWAP,
                    WR.IBV_WR_ATOMIC_FETCH_AND_ADD: WCOpcode.IBV_WC_FETCH_ADD,
                }[self.ops[wc.wr_id]]
            )
            if self.ops[wc.wr_id] not in (WR.IBV_WR_ATOMIC_CMP_AND_SWP, WR.IBV_WR_ATOMIC_FETCH_AND_ADD):
                assert wc.byte_len == self.lens[wc.wr_id]
        done = [r for r in self.recvs if r[0] < n_ok]
        rwcs = p.recv_wcs("b")
        if n_ok < self.n:
            rwcs = [wc for wc in rwcs if wc.ok][: len(done)]
        assert [wc.wr_id for wc in rwcs] == [r[0] for r in done], "receives complete in order, once"
        assert all(wc.status == S.IBV_WC_SUCCESS for wc in rwcs), rwcs
        offs = []
        off = 0
        for ln in self.lens:
            offs.append(off)
            off += ln
        for wc, (i, _off, ln, imm) in zip(rwcs, done):
            assert wc.byte_len == ln and wc.imm_data == imm
            assert wc.opcode == (
                WCOpcode.IBV_WC_RECV_RDMA_WITH_IMM
                if self.ops[i] == WR.IBV_WR_RDMA_WRITE_WITH_IMM
                else WCOpcode.IBV_WC_RECV
            )
        for i, (op, ln) in enumerate(zip(self.ops[:n_ok], self.lens)):
            o = offs[i]
            if op in (WR.IBV_WR_RDMA_WRITE, WR.IBV_WR_RDMA_WRITE_WITH_IMM):
                assert self.wdst.buf[o : o + ln] == self.src.buf[o : o + ln], f"write {i} ({ln} B)"
            elif op in (WR.IBV_WR_SEND, WR.IBV_WR_SEND_WITH_IMM):
                assert self.rdst.buf[o : o + ln] == self.src.buf[o : o + ln], f"send {i} ({ln} B)"
            elif op == WR.IBV_WR_RDMA_READ:
                assert self.read_dst.buf[o : o + ln] == self.rsrc.buf[o : o + ln], f"read {i} ({ln} B)"
        # areas nobody wrote stay zero
        for i, (op, ln) in enumerate(zip(self.ops, self.lens)):
            o = offs[i]
            if op not in (WR.IBV_WR_RDMA_WRITE, WR.IBV_WR_RDMA_WRITE_WITH_IMM):
                assert not any(self.wdst.buf[o : o + ln])
            if op not in (WR.IBV_WR_SEND, WR.IBV_WR_SEND_WITH_IMM):
                assert not any(self.rdst.buf[o : o + ln])
        # atomics: executed exactly once each, in order
        total = 0
        for i, add in self.faa_adds:
            if i >= n_ok:
                break
            assert U64.unpack_from(self.old.buf, 8 * i)[0] == total, f"FETCH_ADD {i} returned a wrong old value"
            total = (total + add) & 0xFFFFFFFFFFFFFFFF
        ncas = sum(1 for i in self.cas if i < n_ok)
        for k, i in enumerate(self.cas[:ncas]):
            assert U64.unpack_from(self.old.buf, 8 * i)[0] == k
        if n_ok == self.n:
            assert U64.unpack_from(self.ctr.buf, 0)[0] == total
            assert U64.unpack_from(self.ctr.buf, 8)[0] == len(self.cas)
            assert p.a.state == p.b.state == QPState.IBV_QPS_RTS
            assert not p.b.rq
        else:
            # the failed WR (and flushed ones the responder had already received) may have run
            fa = [add for i, add in self.faa_adds if i >= n_ok]
            assert U64.unpack_from(self.ctr.buf, 0)[0] in {
                (total + sum(fa[:j])) & (2**64 - 1) for j in range(len(fa) + 1)
            }
            assert ncas <= U64.unpack_from(self.ctr.buf, 8)[0] <= len(self.cas)
        assert not p.a.sq and p.a.next_timer() is None


@pytest.mark.parametrize(
    "drop,duplicate,reorder",
    [(0.0, 0.0, 0.0), (0.05, 0.0, 0.0), (0.2, 0.0, 0.0), (0.05, 0.05, 0.1), (0.2, 0.1, 0.2), (0.0, 0.3, 0.3)],
)
@pytest.mark.parametrize("seed", [1, 2])
def test_many_wrs_lossy_link(drop: float, duplicate: float, reorder: float, seed: int) -> None:
    p = Pair(
        psn_a=near_wrap(100),
        psn_b=near_wrap(3),
        seed=seed,
        drop=drop,
        duplicate=duplicate,
        reorder=reorder,
    )
    w = Workload(p, random.Random(seed), 200)
    p.run()
    w.check()
    c = p.a.counters
    if drop:
        assert c.retransmits > 0
    if duplicate:
        assert p.b.counters.duplicate_requests > 0
    # the PSNs wrapped through 0
    assert wire.psn_diff(p.a.next_psn, near_wrap(100)) > 100 and p.a.next_psn < near_wrap(100)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 80),
    drop=st.sampled_from([0.0, 0.02, 0.1, 0.25]),
    duplicate=st.sampled_from([0.0, 0.05, 0.2]),
    reorder=st.sampled_from([0.0, 0.05, 0.2]),
    mtu=st.sampled_from([MTU.IBV_MTU_256, MTU.IBV_MTU_1024, MTU.IBV_MTU_4096]),
    psn=st.one_of(st.integers(0, 2**24 - 1), st.integers(2**24 - 64, 2**24 - 1)),
    max_rd_atomic=st.sampled_from([1, 2, 16]),
)
def test_random_mix_property(seed, n, drop, duplicate, reorder, mtu, psn, max_rd_atomic) -> None:
    p = Pair(
        mtu=mtu,
        psn_a=psn,
        psn_b=(psn * 7) & 0xFFFFFF,
        seed=seed,
        drop=drop,
        duplicate=duplicate,
        reorder=reorder,
        max_rd_atomic=max_rd_atomic,
    )
    w = Workload(p, random.Random(seed), n, max_len=3 * (128 << mtu) + 5)
    p.run()
    # at 25% loss each way a lone request has a 44% chance per attempt to fail, so
    # running out of retry_cnt=7 is a rare but legitimate outcome there
    w.check(allow_retry_exhaustion=drop >= 0.2)


# ================================================ directed loss recovery ====


def drop_nth(src_name: str, pred, n: int = 1):
    """A link filter dropping the n-th packet from ``src_name`` that matches ``pred``."""
    seen = [0]

    def f(src: str, pkt: Packet) -> bool:
        if src == src_name and pred(pkt):
            seen[0] += 1
            return seen[0] != n
        return True

    return f


def test_lost_middle_packet_go_back_n() -> None:
    """A lost WRITE_MIDDLE: the responder NAKs the sequence error once, the requester goes back."""
    p = Pair(psn_a=near_wrap(2))
    a = p.mem["a"].reg(pattern(8 * 1024))
    b = p.mem["b"].reg(8 * 1024)
    p.filters.append(drop_nth("a", lambda pk: pk.opcode == Opcode.RDMA_WRITE_MIDDLE, 2))
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.sge()], remote_addr=b.addr, rkey=b.rkey))
    p.run()
    [wc] = only_success(p.send_wcs("a"))
    assert b.buf == a.buf
    assert p.b.counters.seq_naks_sent == 1 and p.a.counters.seq_naks_rcvd == 1
    assert p.a.counters.timeouts == 0
    naks = [
        pk for pk in p.sent_by("b") if pk.opcode == Opcode.ACKNOWLEDGE and wire.aeth_kind(pk.syndrome) == wire.AETH_NAK
    ]
    assert len(naks) == 1 and naks[0].psn == wire.psn_add(near_wrap(2), 2)
    # the requester resent from the lost packet, not from the start
    psns = [pk.psn for pk in p.sent_by("a")]
    assert psns.count(near_wrap(2)) == 1 and psns.count(wire.psn_add(near_wrap(2), 2)) == 2


def test_lost_ack_timeout_retransmit() -> None:
    """The only ACK is lost: the requester times out, resends, the responder re-ACKs the duplicate."""
    p = Pair(timeout=12)
    a = p.mem["a"].reg(pattern(3000))
    b = p.mem["b"].reg(3000)
    p.filters.append(drop_nth("b", lambda pk: pk.opcode == Opcode.ACKNOWLEDGE, 1))
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.sge()], remote_addr=b.addr, rkey=b.rkey))
    p.run()
    only_success(p.send_wcs("a"))
    assert p.a.counters.timeouts == 1
    assert p.b.counters.duplicate_requests >= 1
    assert p.now >= timeout_seconds(12)
    assert b.buf == a.buf


def test_lost_atomic_ack_executes_once() -> None:
    """An ATOMIC_ACKNOWLEDGE is lost: the retried atomic is answered from the saved result, not re-executed."""
    for op in (WR.IBV_WR_ATOMIC_FETCH_AND_ADD, WR.IBV_WR_ATOMIC_CMP_AND_SWP):
        p = Pair()
        a = p.mem["a"].reg(8)
        b = p.mem["b"].reg(8)
        U64.pack_into(b.buf, 0, 41)
        p.filters.append(drop_nth("b", lambda pk: pk.opcode == Opcode.ATOMIC_ACKNOWLEDGE, 1))
        p.post_send(
            "a",
            SendWR(
                1,
                op,
                [a.sge()],
                remote_addr=b.addr,
                rkey=b.rkey,
                compare_add=41 if op == WR.IBV_WR_ATOMIC_CMP_AND_SWP else 1,
                swap=42,
            ),
        )
        p.run()
        only_success(p.send_wcs("a"))
        assert U64.unpack_from(b.buf, 0)[0] == 42
        assert U64.unpack_from(a.buf, 0)[0] == 41
        assert p.b.counters.duplicate_requests == 1
        assert [pk.opcode for pk in p.sent_by("b")] == [Opcode.ATOMIC_ACKNOWLEDGE] * 2


def test_duplicated_requests_execute_once() -> None:
    """Every request packet delivered twice: atomics still run once, sends complete once."""
    p = Pair(psn_a=near_wrap(1))
    a = p.mem["a"].reg(pattern(4096))
    old = p.mem["a"].reg(8 * 10)
    b = p.mem["b"].reg(4096)
    p.post_recv("b", RecvWR(1, [b.sge(0, 2048)]))
    orig_send = p._send

    def dup(src, pkt, data=None):
        orig_send(src, pkt, data)
        if src == "a":
            orig_send(src, pkt, data)

    p._send = dup
    for i in range(10):
        p.post_send(
            "a",
            SendWR(
                i,
                WR.IBV_WR_ATOMIC_FETCH_AND_ADD,
                [old.sge(8 * i, 8)],
                remote_addr=b.addr + 4088,
                rkey=b.rkey,
                compare_add=3,
            ),
        )
    p.post_send("a", SendWR(10, WR.IBV_WR_SEND, [a.sge(0, 2048)]))
    p.run()
    assert [wc.wr_id for wc in only_success(p.send_wcs("a"))] == list(range(11))
    assert [U64.unpack_from(old.buf, 8 * i)[0] for i in range(10)] == [3 * i for i in range(10)]
    assert U64.unpack_from(b.buf, 4088)[0] == 30
    assert len(p.recv_wcs("b")) == 1
    assert p.b.counters.duplicate_requests >= 10


@pytest.mark.parametrize("which", [1, 2, 4])
def test_lost_read_response(which: int) -> None:
    """A lost READ response packet (first, middle or last): the read is requested again."""
    p = Pair(psn_a=near_wrap(2))
    local = p.mem["a"].reg(4 * 1024)
    remote = p.mem["b"].reg(pattern(4 * 1024))
    p.filters.append(
        drop_nth("b", lambda pk: pk.opcode in wire.RESPONSE_OPCODES and pk.opcode != Opcode.ACKNOWLEDGE, which)
    )
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_READ, [local.sge()], remote_addr=remote.addr, rkey=remote.rkey))
    # a WRITE behind the read: its ACK may come before the read finishes
    p.post_send("a", SendWR(2, WR.IBV_WR_RDMA_WRITE, [local.sge(0, 10)], remote_addr=remote.addr, rkey=remote.rkey))
    p.run()
    assert [wc.wr_id for wc in only_success(p.send_wcs("a"))] == [1, 2]
    assert local.buf == remote.buf or local.buf[10:] == remote.buf[10:]
    assert local.buf[10:] == pattern(4 * 1024)[10:]
    assert sum(1 for pk in p.sent_by("a") if pk.opcode == Opcode.RDMA_READ_REQUEST) == 2


def test_write_after_read_ack_does_not_complete_read() -> None:
    """An ACK for a WRITE behind an unfinished READ must not complete the READ (responses lost)."""
    p = Pair()
    local = p.mem["a"].reg(2048)
    remote = p.mem["b"].reg(pattern(2048))
    # drop every read response until t > 1 ms
    p.filters.append(lambda src, pk: not (src == "b" and pk.opcode == Opcode.RDMA_READ_RESPONSE_ONLY and p.now < 1e-3))
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_READ, [local.sge(0, 100)], remote_addr=remote.addr, rkey=remote.rkey))
    p.post_send(
        "a", SendWR(2, WR.IBV_WR_RDMA_WRITE, [local.sge(1000, 10)], remote_addr=remote.addr + 1000, rkey=remote.rkey)
    )
    p.advance(100e-6)
    assert p.send_wcs("a") == []
    p.run()
    assert [wc.wr_id for wc in only_success(p.send_wcs("a"))] == [1, 2]
    assert local.buf[:100] == remote.buf[:100]


def test_window_limits_packets_in_flight() -> None:
    p = Pair(mtu=MTU.IBV_MTU_256)
    a = p.mem["a"].reg(pattern(1 << 20))
    b = p.mem["b"].reg(1 << 20)
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.sge()], remote_addr=b.addr, rkey=b.rkey))
    first = p.a.transmit(p.now)
    assert len(first) == p.a.window_pkts
    for pk in first:
        p._send("a", pk)
    p.run()
    only_success(p.send_wcs("a"))
    assert b.buf == a.buf


def test_max_rd_atomic_limits_outstanding_reads() -> None:
    p = Pair(max_rd_atomic=2)
    local = p.mem["a"].reg(80)
    remote = p.mem["b"].reg(pattern(80))
    for i in range(10):
        p.post_send(
            "a",
            SendWR(i, WR.IBV_WR_RDMA_READ, [local.sge(8 * i, 8)], remote_addr=remote.addr + 8 * i, rkey=remote.rkey),
        )
    first = p.a.transmit(p.now)
    assert [pk.opcode for pk in first] == [Opcode.RDMA_READ_REQUEST] * 2
    for pk in first:
        p._send("a", pk)
    outstanding = []

    def count(src, pk):
        if src == "a":
            outstanding.append(pk.psn)
        return True

    p.filters.append(count)
    p.run()
    assert [wc.wr_id for wc in only_success(p.send_wcs("a"))] == list(range(10))
    assert local.buf == remote.buf


# ========================================================= retry and RNR ====


def test_the_retry_budget_rides_out_a_stall() -> None:
    """The default timeout 14 (67 ms) x retry_cnt 7 backs off to span 127 timeouts
    (8.5 s): a peer that stops answering for 5 s and then answers is not given up."""
    assert retry_backoff(7, 7) == 1 and retry_backoff(7, 6) == 2 and retry_backoff(7, 0) == RETRY_BACKOFF_CAP
    p = Pair(timeout=14, retry_cnt=7)
    a = p.mem["a"].reg(pattern(4096))
    b = p.mem["b"].reg(4096)
    stalled_until = 5.0
    p.filters.append(lambda src, pk: p.now >= stalled_until)
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.sge(0, 3000)], remote_addr=b.addr, rkey=b.rkey))
    p.run()
    only_success(p.send_wcs("a"))
    assert b.buf[:3000] == a.buf[:3000]
    assert p.a.counters.timeouts >= 6
    assert stalled_until <= p.now < 8.6


def test_the_native_engine_backs_off_alike() -> None:
    native = pytest.importorskip("aiordma.providers.soft._native._engine")
    assert native.RETRY_BACKOFF_CAP == RETRY_BACKOFF_CAP


@pytest.mark.parametrize("direction", ["requests", "responses", "both"])
def test_retry_exhausted(direction: str) -> None:
    p = Pair(timeout=10, retry_cnt=3)
    a = p.mem["a"].reg(pattern(4096))
    b = p.mem["b"].reg(4096)
    p.post_recv("a", RecvWR(99, [a.sge()]))
    drop_from = {"requests": {"a"}, "responses": {"b"}, "both": {"a", "b"}}[direction]
    p.filters.append(lambda src, pk: src not in drop_from)
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.sge(0, 3000)], remote_addr=b.addr, rkey=b.rkey))
    p.post_send("a", SendWR(2, WR.IBV_WR_RDMA_READ, [a.sge(0, 8)], remote_addr=b.addr, rkey=b.rkey))
    p.post_send(
        "a", SendWR(3, WR.IBV_WR_RDMA_WRITE, [a.sge(0, 8)], send_flags=UNSIGNALED, remote_addr=b.addr, rkey=b.rkey)
    )
    p.run()
    wcs = p.send_wcs("a")
    assert [(wc.wr_id, wc.status) for wc in wcs] == [
        (1, S.IBV_WC_RETRY_EXC_ERR),
        (2, S.IBV_WC_WR_FLUSH_ERR),
        (3, S.IBV_WC_WR_FLUSH_ERR),  # flushed WRs complete even when unsignaled
    ]
    assert [(wc.wr_id, wc.status) for wc in p.recv_wcs("a")] == [(99, S.IBV_WC_WR_FLUSH_ERR)]
    assert p.a.state == QPState.IBV_QPS_ERR
    assert "RETRY_EXC" in (p.a.error_reason or "")
    # the first packet went out once and was retried retry_cnt times
    assert sum(1 for pk in p.sent_by("a") if pk.psn == 0) == 1 + 3
    assert p.a.counters.timeouts == 4
    to = timeout_seconds(10)
    # the retransmit timer backs off: 1 + 2 + 4 + 8 timeouts
    assert 15 * to <= p.now <= 15 * to + 1e-3
    assert p.a.next_timer() is None
    # posting on the QP in ERR flushes at once
    p.post_send("a", SendWR(4, WR.IBV_WR_SEND, []))
    p.post_recv("a", RecvWR(5))
    p.pump()
    assert [(wc.wr_id, wc.status) for wc in p.send_wcs("a")][-1] == (4, S.IBV_WC_WR_FLUSH_ERR)
    assert [(wc.wr_id, wc.status) for wc in p.recv_wcs("a")][-1] == (5, S.IBV_WC_WR_FLUSH_ERR)


def test_retry_counter_resets_on_progress() -> None:
    """Each timeout that is followed by progress restores the retry budget (long lossy transfer)."""
    p = Pair(timeout=8, retry_cnt=1, mtu=MTU.IBV_MTU_256)
    a = p.mem["a"].reg(pattern(64 * 256))
    b = p.mem["b"].reg(64 * 256)
    # drop every 10th request packet's first transmission, and every ACK once
    p.filters.append(drop_nth("b", lambda pk: pk.opcode == Opcode.ACKNOWLEDGE, 1))
    for k in range(1, 6):
        p.filters.append(drop_nth("a", lambda pk, k=k: pk.psn == 10 * k, 1))
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.sge()], remote_addr=b.addr, rkey=b.rkey))
    p.run()
    only_success(p.send_wcs("a"))
    assert b.buf == a.buf


def test_rnr_retry_forever_then_receive_posted() -> None:
    p = Pair(rnr_retry=7, min_rnr_timer=14)  # 1.28 ms between RNR retries
    a = p.mem["a"].reg(pattern(3000))
    b = p.mem["b"].reg(3000)
    p.post_send("a", SendWR(1, WR.IBV_WR_SEND, [a.sge()]))
    p.post_send("a", SendWR(2, WR.IBV_WR_RDMA_WRITE, [a.sge(0, 10)], remote_addr=b.addr + 2990, rkey=b.rkey))
    p.advance(0.1)
    assert p.send_wcs("a") == [] and p.a.state == QPState.IBV_QPS_RTS
    naks = p.a.counters.rnr_naks_rcvd
    assert naks >= 50  # ~78 retries in 100 ms, and still going
    assert p.b.state == QPState.IBV_QPS_RTS  # RNR is not an error at the responder
    # the RNR NAK carries the responder's min_rnr_timer
    rnr = [pk for pk in p.sent_by("b") if wire.aeth_kind(pk.syndrome) == wire.AETH_RNR_NAK]
    assert rnr and all(pk.syndrome & 0x1F == 14 for pk in rnr)
    # the WRITE behind the SEND must not have executed: it waits its turn
    assert b.buf[2990:] == bytes(10)
    p.post_recv("b", RecvWR(7, [b.sge(0, 3000)]))
    p.run()
    assert [wc.wr_id for wc in only_success(p.send_wcs("a"))] == [1, 2]
    [rwc] = only_success(p.recv_wcs("b"))
    assert rwc.byte_len == 3000
    assert b.buf[:2990] == a.buf[:2990] and b.buf[2990:] == a.buf[:10]


def test_rnr_on_write_with_imm() -> None:
    p = Pair(rnr_retry=7)
    a = p.mem["a"].reg(pattern(100))
    b = p.mem["b"].reg(100)
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_WRITE_WITH_IMM, [a.sge()], remote_addr=b.addr, rkey=b.rkey, imm_data=5))
    p.advance(0.01)
    assert p.send_wcs("a") == [] and p.a.counters.rnr_naks_rcvd > 0
    p.post_recv("b", RecvWR(3))
    p.run()
    only_success(p.send_wcs("a"))
    [rwc] = p.recv_wcs("b")
    assert (rwc.wr_id, rwc.opcode, rwc.imm_data, rwc.byte_len) == (3, WCOpcode.IBV_WC_RECV_RDMA_WITH_IMM, 5, 100)
    assert b.buf == a.buf


@pytest.mark.parametrize("rnr_retry", [0, 2])
def test_rnr_retry_exhausted(rnr_retry: int) -> None:
    p = Pair(rnr_retry=rnr_retry)
    a = p.mem["a"].reg(pattern(3000))
    b = p.mem["b"].reg(3000)
    p.post_recv("a", RecvWR(50, [a.sge()]))
    p.post_send("a", SendWR(1, WR.IBV_WR_SEND, [a.sge()]))
    p.post_send("a", SendWR(2, WR.IBV_WR_RDMA_WRITE, [a.sge(0, 8)], remote_addr=b.addr, rkey=b.rkey))
    p.run()
    assert [(wc.wr_id, wc.status) for wc in p.send_wcs("a")] == [
        (1, S.IBV_WC_RNR_RETRY_EXC_ERR),
        (2, S.IBV_WC_WR_FLUSH_ERR),
    ]
    assert [(wc.wr_id, wc.status) for wc in p.recv_wcs("a")] == [(50, S.IBV_WC_WR_FLUSH_ERR)]
    assert p.a.state == QPState.IBV_QPS_ERR
    assert p.b.state == QPState.IBV_QPS_RTS
    assert p.a.counters.rnr_naks_rcvd == rnr_retry + 1
    assert sum(1 for pk in p.sent_by("a") if pk.opcode == Opcode.SEND_FIRST) == rnr_retry + 1
    assert b.buf == bytes(3000)


def test_rnr_in_the_middle_of_a_stream() -> None:
    """Sends beyond the posted receives are RNR NAKed; earlier ones complete, later ones resume."""
    p = Pair(rnr_retry=7, min_rnr_timer=5)
    a = p.mem["a"].reg(pattern(10 * 100))
    b = p.mem["b"].reg(10 * 100)
    for i in range(3):
        p.post_recv("b", RecvWR(i, [b.sge(100 * i, 100)]))
    for i in range(10):
        p.post_send("a", SendWR(i, WR.IBV_WR_SEND, [a.sge(100 * i, 100)]))
    p.advance(0.005)
    assert [wc.wr_id for wc in only_success(p.send_wcs("a"))] == [0, 1, 2]
    for i in range(3, 10):
        p.post_recv("b", RecvWR(i, [b.sge(100 * i, 100)]))
    p.run()
    assert [wc.wr_id for wc in only_success(p.send_wcs("a"))] == list(range(10))
    assert [wc.wr_id for wc in only_success(p.recv_wcs("b"))] == list(range(10))
    assert b.buf == a.buf


# ============================================================ errors ====


def assert_both_in_error_and_flushed(p: Pair, first_status: WCStatus, n_send: int, recv_b: list[int]) -> None:
    wcs = p.send_wcs("a")
    assert [wc.status for wc in wcs] == [first_status] + [S.IBV_WC_WR_FLUSH_ERR] * (n_send - 1), wcs
    assert p.a.state == QPState.IBV_QPS_ERR and p.b.state == QPState.IBV_QPS_ERR
    assert [(wc.wr_id, wc.status) for wc in p.recv_wcs("b")][-len(recv_b) or len(p.recv_wcs("b")) :] == [
        (i, S.IBV_WC_WR_FLUSH_ERR) for i in recv_b
    ]
    assert not p.a.sq and not p.b.rq and p.a.next_timer() is None and p.b.next_timer() is None


def _remote_access_case(case: str):
    """(pair, wr factory, region to watch) for one remote-access violation."""
    b_access = ACCESS_ALL
    region_access = ACCESS_ALL
    op = WR.IBV_WR_RDMA_WRITE
    offset, length = 0, 100
    rkey_delta = 0
    if case == "bad_rkey":
        rkey_delta = 1
    elif case == "past_end":
        offset, length = 4000, 200
    elif case == "before_start":
        offset = -8
    elif case == "past_end_multi_packet":
        offset, length = 1000, 3200
    elif case == "huge_va":
        offset = 1 << 40
    elif case == "no_region_remote_write":
        region_access = Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC
    elif case == "no_region_remote_read":
        region_access = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC
        op = WR.IBV_WR_RDMA_READ
    elif case == "no_region_remote_atomic":
        region_access = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
        op, length = WR.IBV_WR_ATOMIC_FETCH_AND_ADD, 8
    elif case == "no_qp_remote_write":
        b_access = Access.REMOTE_READ | Access.REMOTE_ATOMIC
    elif case == "no_qp_remote_read":
        b_access = Access.REMOTE_WRITE | Access.REMOTE_ATOMIC
        op = WR.IBV_WR_RDMA_READ
    elif case == "no_qp_remote_atomic":
        b_access = Access.REMOTE_WRITE | Access.REMOTE_READ
        op, length = WR.IBV_WR_ATOMIC_CMP_AND_SWP, 8
    elif case == "write_with_imm_bad_rkey":
        op, rkey_delta = WR.IBV_WR_RDMA_WRITE_WITH_IMM, 2
    elif case == "read_past_end":
        op, offset, length = WR.IBV_WR_RDMA_READ, 4000, 100
    elif case == "atomic_past_end":
        op, offset, length = WR.IBV_WR_ATOMIC_FETCH_AND_ADD, 4096, 8
    else:
        raise AssertionError(case)
    return b_access, region_access, op, offset, length, rkey_delta


REMOTE_ACCESS_CASES = [
    "bad_rkey",
    "past_end",
    "before_start",
    "past_end_multi_packet",
    "huge_va",
    "no_region_remote_write",
    "no_region_remote_read",
    "no_region_remote_atomic",
    "no_qp_remote_write",
    "no_qp_remote_read",
    "no_qp_remote_atomic",
    "write_with_imm_bad_rkey",
    "read_past_end",
    "atomic_past_end",
]


@pytest.mark.parametrize("case", REMOTE_ACCESS_CASES)
def test_remote_access_error(case: str) -> None:
    b_access, region_access, op, offset, length, rkey_delta = _remote_access_case(case)
    p = Pair(access_b=b_access)
    a = p.mem["a"].reg(pattern(4096))
    before = p.mem["b"].reg(4096)
    target = p.mem["b"].reg(pattern(4096, 9), region_access)
    after = p.mem["b"].reg(4096)
    snapshot = bytes(target.buf)
    local_before = bytes(a.buf)
    p.post_recv("b", RecvWR(70, [after.sge()]))
    p.post_recv("b", RecvWR(71, [after.sge()]))
    # a good WRITE first: it must complete normally before the bad one
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.sge(0, 16)], remote_addr=before.addr, rkey=before.rkey))
    p.post_send(
        "a",
        SendWR(2, op, [a.sge(0, length)], remote_addr=target.addr + offset, rkey=target.rkey + rkey_delta, imm_data=1),
    )
    p.post_send("a", SendWR(3, WR.IBV_WR_RDMA_WRITE, [a.sge(0, 16)], remote_addr=before.addr + 100, rkey=before.rkey))
    p.post_send("a", SendWR(4, WR.IBV_WR_SEND, [a.sge(0, 16)]))
    p.run()
    wcs = p.send_wcs("a")
    if case == "no_qp_remote_write":
        expect = [(1, S.IBV_WC_REM_ACCESS_ERR)] + [(i, S.IBV_WC_WR_FLUSH_ERR) for i in (2, 3, 4)]
    else:
        expect = [
            (1, S.IBV_WC_SUCCESS),
            (2, S.IBV_WC_REM_ACCESS_ERR),
            (3, S.IBV_WC_WR_FLUSH_ERR),
            (4, S.IBV_WC_WR_FLUSH_ERR),
        ]
        assert before.buf[:16] == a.buf[:16]
    assert [(wc.wr_id, wc.status) for wc in wcs] == expect
    assert p.a.state == QPState.IBV_QPS_ERR and p.b.state == QPState.IBV_QPS_ERR
    assert [(wc.wr_id, wc.status) for wc in p.recv_wcs("b")] == [
        (70, S.IBV_WC_WR_FLUSH_ERR),
        (71, S.IBV_WC_WR_FLUSH_ERR),
    ]
    # nothing written anywhere it should not be
    assert bytes(target.buf) == snapshot
    assert before.buf[16:] == bytes(4080)
    assert after.buf == bytes(4096)
    if op in (WR.IBV_WR_RDMA_READ, WR.IBV_WR_ATOMIC_FETCH_AND_ADD, WR.IBV_WR_ATOMIC_CMP_AND_SWP):
        assert bytes(a.buf) == local_before
    assert p.b.counters.remote_access_errors == 1
    assert "REM_ACCESS" in (p.a.error_reason or "")
    assert p.a.next_timer() is None and p.b.next_timer() is None
    # the responder in ERR drops whatever else arrives
    n = p.b.counters.dropped_wrong_state
    p.inject(
        "b",
        Packet(
            Opcode.RDMA_WRITE_ONLY, p.b.qp_num, p.b.epsn, va=before.addr, rkey=before.rkey, dma_len=4, payload=b"evil"
        ),
    )
    assert p.b.counters.dropped_wrong_state == n + 1 and before.buf[16:] == bytes(4080)
    assert p.b.transmit(p.now) == []


def test_deregistered_region_is_a_remote_access_error() -> None:
    p = Pair()
    a = p.mem["a"].reg(pattern(64))
    b = p.mem["b"].reg(64)
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.sge()], remote_addr=b.addr, rkey=b.rkey))
    p.run()
    p.mem["b"].dereg(b)
    b.buf[:] = bytes(64)
    p.post_send("a", SendWR(2, WR.IBV_WR_RDMA_WRITE, [a.sge()], remote_addr=b.addr, rkey=b.rkey))
    p.run()
    assert [(wc.wr_id, wc.status) for wc in p.send_wcs("a")] == [(1, S.IBV_WC_SUCCESS), (2, S.IBV_WC_REM_ACCESS_ERR)]
    assert b.buf == bytes(64)


@pytest.mark.parametrize("size,recv_len", [(100, 99), (5000, 4096), (5000, 1024), (1, 0)])
def test_send_longer_than_receive(size: int, recv_len: int) -> None:
    p = Pair()
    a = p.mem["a"].reg(pattern(size))
    b = p.mem["b"].reg(8192)
    p.post_recv("b", RecvWR(1, [b.sge(0, recv_len)] if recv_len else []))
    p.post_recv("b", RecvWR(2, [b.sge(4096, 4096)]))
    p.post_send("a", SendWR(10, WR.IBV_WR_SEND, [a.sge()]))
    p.post_send("a", SendWR(11, WR.IBV_WR_SEND, [a.sge(0, 1)]))
    p.run()
    assert [(wc.wr_id, wc.status) for wc in p.send_wcs("a")] == [
        (10, S.IBV_WC_REM_INV_REQ_ERR),
        (11, S.IBV_WC_WR_FLUSH_ERR),
    ]
    assert [(wc.wr_id, wc.status) for wc in p.recv_wcs("b")] == [(1, S.IBV_WC_LOC_LEN_ERR), (2, S.IBV_WC_WR_FLUSH_ERR)]
    assert p.a.state == p.b.state == QPState.IBV_QPS_ERR
    assert b.buf[recv_len:] == bytes(8192 - recv_len)


@pytest.mark.parametrize("op", [WR.IBV_WR_ATOMIC_FETCH_AND_ADD, WR.IBV_WR_ATOMIC_CMP_AND_SWP])
@pytest.mark.parametrize("misalign", [1, 4, 7])
def test_misaligned_atomic(op: WROpcode, misalign: int) -> None:
    p = Pair()
    a = p.mem["a"].reg(8)
    b = p.mem["b"].reg(pattern(64))
    snap = bytes(b.buf)
    p.post_send("a", SendWR(1, op, [a.sge()], remote_addr=b.addr + 8 + misalign, rkey=b.rkey, compare_add=0, swap=5))
    p.post_send("a", SendWR(2, WR.IBV_WR_RDMA_WRITE, [a.sge()], remote_addr=b.addr, rkey=b.rkey))
    p.run()
    assert [(wc.wr_id, wc.status) for wc in p.send_wcs("a")] == [
        (1, S.IBV_WC_REM_INV_REQ_ERR),
        (2, S.IBV_WC_WR_FLUSH_ERR),
    ]
    assert bytes(b.buf) == snap and a.buf == bytes(8)
    assert p.a.state == p.b.state == QPState.IBV_QPS_ERR


def test_error_completion_for_unsignaled_wr() -> None:
    """A failing unsignaled WR still produces a CQE (verbs: errors are always reported)."""
    p = Pair()
    a = p.mem["a"].reg(8)
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.sge()], send_flags=UNSIGNALED, remote_addr=0x1000, rkey=0x1234))
    p.run()
    assert [(wc.wr_id, wc.status) for wc in p.send_wcs("a")] == [(1, S.IBV_WC_REM_ACCESS_ERR)]


def test_local_modify_to_error_flushes() -> None:
    p = Pair()
    a = p.mem["a"].reg(8)
    p.post_recv("a", RecvWR(5, [a.sge()]))
    p.filters.append(lambda src, pk: False)
    for i in range(3):
        p.post_send("a", SendWR(i, WR.IBV_WR_SEND, [a.sge()], send_flags=UNSIGNALED))
    p.pump()
    p.a.modify(QPAttr(qp_state=QPState.IBV_QPS_ERR))
    p.run()
    assert [(wc.wr_id, wc.status) for wc in p.send_wcs("a")] == [(i, S.IBV_WC_WR_FLUSH_ERR) for i in range(3)]
    assert [(wc.wr_id, wc.status) for wc in p.recv_wcs("a")] == [(5, S.IBV_WC_WR_FLUSH_ERR)]
    assert p.a.next_timer() is None


# ==================================================== verbs-level checks ====


def fresh_qp(cap: QPCap | None = None, engine: str | None = None) -> tuple[RCQueuePair, FakeMemory]:
    """One QP of ``engine`` (default: the harness's) that is never connected to anything."""
    engine = engine or default_engine()
    mem = FakeMemory(0x10000, 0x100, engine == "native")
    flow = Pair.FLOWS["a"]
    return make_qp(engine, 0x123, mem, cap, False, flow, flow.reversed()), mem


RTR = dict(qp_state=QPState.IBV_QPS_RTR, dest_qp_num=0x456, rq_psn=0, dgid=gid_from_ipv4("10.0.0.2"))


def to_rts(qp: RCQueuePair) -> None:
    qp.modify(QPAttr(qp_state=QPState.IBV_QPS_INIT, qp_access_flags=ACCESS_ALL))
    qp.modify(QPAttr(**RTR))
    qp.modify(QPAttr(qp_state=QPState.IBV_QPS_RTS, sq_psn=0))


@pytest.mark.parametrize("stop", [QPState.IBV_QPS_RESET, QPState.IBV_QPS_INIT, QPState.IBV_QPS_RTR])
def test_post_send_before_rts(stop: QPState) -> None:
    qp, mem = fresh_qp()
    r = mem.reg(16)
    if stop >= QPState.IBV_QPS_INIT:
        qp.modify(QPAttr(qp_state=QPState.IBV_QPS_INIT, qp_access_flags=ACCESS_ALL))
    if stop >= QPState.IBV_QPS_RTR:
        qp.modify(QPAttr(**RTR))
    assert qp.state == stop
    with pytest.raises(QueuePairStateError, match="RTS"):
        qp.post_send(SendWR(1, WR.IBV_WR_RDMA_WRITE, [r.sge()], remote_addr=1, rkey=1))
    assert not qp.sq and qp.take_completions() == []
    if stop == QPState.IBV_QPS_RESET:
        with pytest.raises(QueuePairStateError):
            qp.post_recv(RecvWR(1, [r.sge()]))
    else:
        qp.post_recv(RecvWR(1, [r.sge()]))  # receives may be posted from INIT on
        assert len(qp.rq) == 1


def test_invalid_work_requests() -> None:
    qp, mem = fresh_qp(QPCap(max_send_wr=4, max_recv_wr=2, max_send_sge=2, max_recv_sge=2))
    to_rts(qp)
    r = mem.reg(64)
    ro = mem.reg(64, Access.REMOTE_READ)  # no LOCAL_WRITE
    bad = [
        SendWR(1, WR.IBV_WR_RDMA_WRITE, [SGE(r.addr, 8, r.lkey + 1000)]),  # unknown lkey
        SendWR(2, WR.IBV_WR_RDMA_WRITE, [SGE(r.addr + 60, 8, r.lkey)]),  # past the end of the MR
        SendWR(3, WR.IBV_WR_RDMA_WRITE, [SGE(r.addr - 1, 8, r.lkey)]),  # before the MR
        SendWR(4, WR.IBV_WR_RDMA_WRITE, [r.sge(0, 1)] * 3),  # more SGEs than max_send_sge
        SendWR(5, WR.IBV_WR_RDMA_READ, [ro.sge(0, 8)]),  # read target without LOCAL_WRITE
        SendWR(6, WR.IBV_WR_ATOMIC_FETCH_AND_ADD, [ro.sge(0, 8)]),  # atomic result without LOCAL_WRITE
        SendWR(7, WR.IBV_WR_ATOMIC_FETCH_AND_ADD, [r.sge(0, 4)]),  # atomic needs 8 bytes
        SendWR(8, WR.IBV_WR_ATOMIC_CMP_AND_SWP, [r.sge(0, 16)]),
        SendWR(9, 42, [r.sge(0, 1)]),  # type: ignore[arg-type]  # not an opcode
    ]
    for wr in bad:
        with pytest.raises(InvalidWorkRequestError):
            qp.post_send(wr)
    assert not qp.sq and qp.next_psn == 0 and qp.transmit(0.0) == [] and qp.take_completions() == []
    # a source buffer without LOCAL_WRITE is fine for WRITE/SEND
    qp.post_send(SendWR(10, WR.IBV_WR_RDMA_WRITE, [ro.sge(0, 8)], remote_addr=1, rkey=2))
    for i in range(3):
        qp.post_send(SendWR(11 + i, WR.IBV_WR_SEND, []))
    with pytest.raises(InvalidWorkRequestError, match="full"):
        qp.post_send(SendWR(20, WR.IBV_WR_SEND, []))
    for wr in (
        RecvWR(1, [SGE(r.addr, 8, 0xBAD)]),
        RecvWR(2, [ro.sge(0, 8)]),
        RecvWR(3, [r.sge(0, 1)] * 3),
    ):
        with pytest.raises(InvalidWorkRequestError):
            qp.post_recv(wr)
    qp.post_recv(RecvWR(4))
    qp.post_recv(RecvWR(5))
    with pytest.raises(InvalidWorkRequestError, match="full"):
        qp.post_recv(RecvWR(6))


ILLEGAL = [
    (QPState.IBV_QPS_RESET, QPState.IBV_QPS_RTR),
    (QPState.IBV_QPS_RESET, QPState.IBV_QPS_RTS),
    (QPState.IBV_QPS_INIT, QPState.IBV_QPS_RTS),
    (QPState.IBV_QPS_RTR, QPState.IBV_QPS_INIT),
    (QPState.IBV_QPS_RTS, QPState.IBV_QPS_RTR),
    (QPState.IBV_QPS_RTS, QPState.IBV_QPS_INIT),
    (QPState.IBV_QPS_ERR, QPState.IBV_QPS_RTS),
    (QPState.IBV_QPS_ERR, QPState.IBV_QPS_INIT),
    (QPState.IBV_QPS_ERR, QPState.IBV_QPS_RTR),
]


def _bring_to(qp: RCQueuePair, state: QPState) -> None:
    if state == QPState.IBV_QPS_ERR:
        qp.modify(QPAttr(qp_state=QPState.IBV_QPS_ERR))
        return
    steps = [
        QPAttr(qp_state=QPState.IBV_QPS_INIT, qp_access_flags=ACCESS_ALL),
        QPAttr(**RTR),
        QPAttr(qp_state=QPState.IBV_QPS_RTS, sq_psn=0),
    ]
    for attr in steps[: int(state)]:
        qp.modify(attr)
    assert qp.state == state


@pytest.mark.parametrize("cur,new", ILLEGAL)
def test_illegal_transitions(cur: QPState, new: QPState) -> None:
    qp, _ = fresh_qp()
    _bring_to(qp, cur)
    attr = {
        QPState.IBV_QPS_INIT: QPAttr(qp_state=QPState.IBV_QPS_INIT, qp_access_flags=ACCESS_ALL),
        QPState.IBV_QPS_RTR: QPAttr(**RTR),
        QPState.IBV_QPS_RTS: QPAttr(qp_state=QPState.IBV_QPS_RTS, sq_psn=0),
    }[new]
    with pytest.raises(QueuePairStateError):
        qp.modify(attr)
    assert qp.state == cur


def test_transitions_need_attributes_and_reset_works() -> None:
    qp, _ = fresh_qp()
    with pytest.raises(QueuePairStateError):
        qp.modify(QPAttr())  # no qp_state
    qp.modify(QPAttr(qp_state=QPState.IBV_QPS_INIT, qp_access_flags=Access.REMOTE_WRITE))
    qp.modify(QPAttr(qp_state=QPState.IBV_QPS_INIT, qp_access_flags=ACCESS_ALL))  # INIT -> INIT
    for missing in ("dest_qp_num", "rq_psn", "dgid"):
        attr = QPAttr(**RTR)
        setattr(attr, missing, None)
        with pytest.raises(QueuePairStateError, match=missing):
            qp.modify(attr)
        assert qp.state == QPState.IBV_QPS_INIT
    qp.modify(QPAttr(**RTR, path_mtu=MTU.IBV_MTU_2048))
    assert qp.mtu == 2048
    with pytest.raises(QueuePairStateError, match="sq_psn"):
        qp.modify(QPAttr(qp_state=QPState.IBV_QPS_RTS))
    qp.modify(QPAttr(qp_state=QPState.IBV_QPS_RTS, sq_psn=0x1234567, timeout=9, retry_cnt=2, rnr_retry=3))
    assert qp.next_psn == 0x234567  # masked to 24 bits
    q = qp.query()
    assert (q.qp_state, q.sq_psn, q.timeout, q.retry_cnt, q.rnr_retry, q.path_mtu) == (
        QPState.IBV_QPS_RTS, 0x234567, 9, 2, 3, MTU.IBV_MTU_2048,
    )  # fmt: skip
    qp.modify(QPAttr(qp_state=QPState.IBV_QPS_RTS, timeout=11))  # RTS -> RTS
    assert qp.query().timeout == 11
    qp.modify(QPAttr(qp_state=QPState.IBV_QPS_ERR))
    assert qp.state == QPState.IBV_QPS_ERR
    qp.modify(QPAttr(qp_state=QPState.IBV_QPS_RESET))
    assert qp.state == QPState.IBV_QPS_RESET and not qp.sq
    _bring_to(qp, QPState.IBV_QPS_RTS)  # usable again after RESET


def test_qp_reset_then_reconnect_works() -> None:
    p = Pair()
    a = p.mem["a"].reg(pattern(64))
    b = p.mem["b"].reg(64)
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.sge()], remote_addr=b.addr + 1, rkey=b.rkey + 5))
    p.run()
    assert p.a.state == p.b.state == QPState.IBV_QPS_ERR
    for qp in (p.a, p.b):
        qp.modify(QPAttr(qp_state=QPState.IBV_QPS_RESET))
    p.connect(mtu=MTU.IBV_MTU_256, psn_a=near_wrap(), psn_b=5, access_a=ACCESS_ALL, access_b=ACCESS_ALL,
              timeout=10, retry_cnt=7, rnr_retry=7, min_rnr_timer=1, max_rd_atomic=4)  # fmt: skip
    p.wcs = {"a": [], "b": []}
    p.post_send("a", SendWR(2, WR.IBV_WR_RDMA_WRITE, [a.sge()], remote_addr=b.addr, rkey=b.rkey))
    p.run()
    only_success(p.send_wcs("a"))
    assert b.buf == a.buf


# ================================================ responder robustness ====


def _responses(p: Pair, name: str = "b") -> list[Packet]:
    out = p.qp[name].transmit(p.now)
    p.collect()
    return out


def _naks(pkts: list[Packet]) -> list[int]:
    return [
        pk.syndrome for pk in pkts if pk.opcode == Opcode.ACKNOWLEDGE and wire.aeth_kind(pk.syndrome) == wire.AETH_NAK
    ]


@pytest.mark.parametrize(
    "first,then",
    [
        (None, Opcode.SEND_MIDDLE),
        (None, Opcode.SEND_LAST),
        (None, Opcode.SEND_LAST_WITH_IMMEDIATE),
        (None, Opcode.RDMA_WRITE_MIDDLE),
        (None, Opcode.RDMA_WRITE_LAST),
        (None, Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE),
        (Opcode.SEND_FIRST, Opcode.SEND_ONLY),
        (Opcode.SEND_FIRST, Opcode.RDMA_WRITE_ONLY),
        (Opcode.SEND_FIRST, Opcode.RDMA_WRITE_MIDDLE),
        (Opcode.SEND_FIRST, Opcode.RDMA_READ_REQUEST),
        (Opcode.SEND_FIRST, Opcode.FETCH_ADD),
        (Opcode.RDMA_WRITE_FIRST, Opcode.SEND_MIDDLE),
        (Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_FIRST),
        (Opcode.RDMA_WRITE_FIRST, Opcode.COMPARE_SWAP),
    ],
)
def test_illegal_opcode_sequence_is_naked(first, then) -> None:
    p = Pair(psn_a=near_wrap(1))  # b expects a's PSNs
    b = p.mem["b"].reg(8192)
    p.post_recv("b", RecvWR(1, [b.sge()]))
    psn = near_wrap(1)
    mtu_payload = b"x" * 1024

    def mk(op: int, psn: int) -> Packet:
        pk = Packet(op, p.b.qp_num, psn, payload=mtu_payload if op in wire.REQUEST_OPCODES and op not in (
            Opcode.RDMA_READ_REQUEST, Opcode.COMPARE_SWAP, Opcode.FETCH_ADD) else b"")  # fmt: skip
        pk.va, pk.rkey, pk.dma_len = b.addr, b.rkey, 4096
        return pk

    if first is not None:
        p.inject("b", mk(first, psn))
        assert _naks(_responses(p)) == []
        psn = wire.psn_add(psn, 1)
    p.inject("b", mk(then, psn))
    naks = _naks(_responses(p))
    assert naks == [wire.AETH_NAK | wire.NAK_INVALID_REQUEST]
    assert p.b.state == QPState.IBV_QPS_ERR
    assert p.b.counters.invalid_requests == 1
    assert [wc.status for wc in p.recv_wcs("b")] == [S.IBV_WC_WR_FLUSH_ERR]
    if (
        then in (Opcode.RDMA_WRITE_MIDDLE, Opcode.RDMA_WRITE_LAST, Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE)
        and first is None
    ):
        assert b.buf == bytes(8192)


@pytest.mark.parametrize(
    "op,plen",
    [
        (Opcode.SEND_FIRST, 1000),
        (Opcode.SEND_FIRST, 1028),
        (Opcode.RDMA_WRITE_FIRST, 512),
        (Opcode.RDMA_WRITE_ONLY, 33),
    ],
)
def test_wrong_payload_length_is_naked(op: int, plen: int) -> None:
    p = Pair()
    b = p.mem["b"].reg(8192)
    p.post_recv("b", RecvWR(1, [b.sge()]))
    p.inject("b", Packet(op, p.b.qp_num, 0, va=b.addr, rkey=b.rkey, dma_len=32, payload=b"y" * plen))
    assert _naks(_responses(p)) == [wire.AETH_NAK | wire.NAK_INVALID_REQUEST]
    assert p.b.state == QPState.IBV_QPS_ERR


def test_write_shorter_than_reth_is_naked() -> None:
    p = Pair()
    b = p.mem["b"].reg(8192)
    p.inject(
        "b", Packet(Opcode.RDMA_WRITE_FIRST, p.b.qp_num, 0, va=b.addr, rkey=b.rkey, dma_len=4096, payload=b"z" * 1024)
    )
    p.inject("b", Packet(Opcode.RDMA_WRITE_LAST, p.b.qp_num, 1, payload=b"z" * 10))
    assert _naks(_responses(p)) == [wire.AETH_NAK | wire.NAK_INVALID_REQUEST]


def test_out_of_sequence_request_naked_once() -> None:
    p = Pair(psn_a=100)
    b = p.mem["b"].reg(64)
    for psn in (102, 103, 104):
        p.inject(
            "b", Packet(Opcode.RDMA_WRITE_ONLY, p.b.qp_num, psn, va=b.addr, rkey=b.rkey, dma_len=4, payload=b"abcd")
        )
    out = _responses(p)
    assert [(pk.psn, pk.syndrome) for pk in out] == [(100, wire.AETH_NAK | wire.NAK_PSN_SEQUENCE_ERROR)]
    assert b.buf == bytes(64) and p.b.state == QPState.IBV_QPS_RTS and p.b.epsn == 100
    # the expected PSN is accepted and clears the NAK state
    p.inject(
        "b",
        Packet(
            Opcode.RDMA_WRITE_ONLY, p.b.qp_num, 100, ack_req=True, va=b.addr, rkey=b.rkey, dma_len=4, payload=b"abcd"
        ),
    )
    out = _responses(p)
    assert [(pk.psn, wire.aeth_kind(pk.syndrome)) for pk in out] == [(100, wire.AETH_ACK)]
    assert b.buf[:4] == b"abcd"


def _served_read() -> tuple[Pair, FakeRegion, FakeRegion]:
    """A 4 KiB READ from a to b, done: b saved it (1024-byte MTU: response PSNs 100-103)."""
    p = Pair(psn_a=100)
    a = p.mem["a"].reg(4096)
    b = p.mem["b"].reg(pattern(4096), Access.REMOTE_READ | Access.LOCAL_WRITE)
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_READ, [a.sge()], remote_addr=b.addr, rkey=b.rkey))
    p.run()
    only_success(p.send_wcs("a"))
    return p, a, b


def test_a_retried_read_whose_range_wraps_is_dropped() -> None:
    """A duplicate READ request (a retry from its k-th packet) must stay inside the range
    of the READ it repeats: a va + length that wraps past 2**64, or a length past the
    end, is dropped; nothing is sent from outside the region."""
    p, a, b = _served_read()
    assert a.buf == b.buf
    dropped = p.b.counters.dropped_responses
    for va, n in (((1 << 64) - 0x100, 0x200), (b.addr + 1024, (1 << 32) - 1), (b.addr + 1024, 3 * 1024 + 1)):
        p.inject("b", Packet(Opcode.RDMA_READ_REQUEST, p.b.qp_num, 101, ack_req=True, va=va, rkey=b.rkey, dma_len=n))
    assert _responses(p) == []
    assert p.b.counters.dropped_responses == dropped + 3
    # the legitimate retry of the same READ from its second packet is still answered
    p.inject(
        "b",
        Packet(Opcode.RDMA_READ_REQUEST, p.b.qp_num, 101, ack_req=True, va=b.addr + 1024, rkey=b.rkey, dma_len=3072),
    )
    out = _responses(p)
    assert [pk.psn for pk in out] == [101, 102, 103]
    assert b"".join(bytes(pk.payload) for pk in out) == bytes(b.buf[1024:])


def test_a_retried_read_must_start_where_its_packet_begins() -> None:
    """A duplicate READ request at the k-th PSN of a saved READ is answered only from
    where that packet's bytes begin: a forged one whose range lies inside the READ's
    but starts elsewhere would have the responder send other bytes under that PSN,
    which the requester, waiting for it, would place as its own (the seeded fuzz
    campaign's world #7028: a hostile duplicate corrupted a legitimate READ)."""
    p, _, b = _served_read()
    dropped = p.b.counters.dropped_responses
    # PSN 103 is the READ's 4th packet, bytes [3072, 4096): each of these asks for others
    for va, n in ((b.addr, 1024), (b.addr + 1024, 1024), (b.addr + 3071, 1), (b.addr + 3073, 1023)):
        p.inject("b", Packet(Opcode.RDMA_READ_REQUEST, p.b.qp_num, 103, ack_req=True, va=va, rkey=b.rkey, dma_len=n))
    assert _responses(p) == []
    assert p.b.counters.dropped_responses == dropped + 4
    # the retry from that packet is answered with its own bytes, and so is a shorter one
    for n in (1024, 512):
        p.inject(
            "b",
            Packet(Opcode.RDMA_READ_REQUEST, p.b.qp_num, 103, ack_req=True, va=b.addr + 3072, rkey=b.rkey, dma_len=n),
        )
        out = _responses(p)
        assert [pk.psn for pk in out] == [103]
        assert bytes(out[0].payload) == bytes(b.buf[3072 : 3072 + n])


def test_an_sge_whose_range_wraps_is_refused() -> None:
    """The lkey check of a posted SGE holds when addr + length wraps past 2**64 (a region
    at a low address): the WR is refused, nothing is read from outside the region."""
    p = Pair()
    low = p.mem["a"].add(FakeRegion(0x10, 4096, ACCESS_ALL, 0x7777, 0x80007777, bytearray(b"A" * 4096)))
    b = p.mem["b"].reg(4096)
    wrap = SGE((1 << 64) - 8, 0x40, low.lkey)
    with pytest.raises(InvalidWorkRequestError, match="outside"):
        p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_WRITE, [wrap], remote_addr=b.addr, rkey=b.rkey))
    with pytest.raises(InvalidWorkRequestError, match="outside"):
        p.post_recv("a", RecvWR(2, [wrap]))
    assert p.a.transmit(p.now) == [] and b.buf == bytes(4096)


def test_stale_and_foreign_responses_are_ignored() -> None:
    """ACKs for PSNs never sent, read responses with no read outstanding: dropped, no state change."""
    p = Pair(psn_a=500)
    a = p.mem["a"].reg(pattern(64))
    b = p.mem["b"].reg(64)
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.sge()], remote_addr=b.addr, rkey=b.rkey))
    p.a.transmit(p.now)  # sent but lost
    for psn in (501, 600, 499 - 5, 0):
        p.inject("a", Packet(Opcode.ACKNOWLEDGE, p.a.qp_num, psn, syndrome=wire.AETH_ACK | 0x1F))
    p.inject("a", Packet(Opcode.RDMA_READ_RESPONSE_ONLY, p.a.qp_num, 500, payload=b"q" * 8))
    p.inject("a", Packet(Opcode.ATOMIC_ACKNOWLEDGE, p.a.qp_num, 500, orig=7))
    p.inject("a", Packet(Opcode.ACKNOWLEDGE, p.a.qp_num, 700, syndrome=wire.AETH_NAK | wire.NAK_REMOTE_ACCESS_ERROR))
    assert p.send_wcs("a") == [] and len(p.a.sq) == 1 and p.a.state == QPState.IBV_QPS_RTS
    assert p.a.counters.dropped_responses >= 6
    p.run()
    only_success(p.send_wcs("a"))
    assert b.buf == a.buf


def test_packets_before_rtr_are_dropped() -> None:
    qp, mem = fresh_qp()
    r = mem.reg(16)
    qp.modify(QPAttr(qp_state=QPState.IBV_QPS_INIT, qp_access_flags=ACCESS_ALL))
    qp.receive(Packet(Opcode.RDMA_WRITE_ONLY, 0x123, 0, va=r.addr, rkey=r.rkey, dma_len=4, payload=b"abcd"), 0.0)
    assert r.buf == bytes(16) and qp.transmit(0.0) == [] and qp.counters.dropped_wrong_state == 1
    # RTR: requests are served, but a response (we never sent anything) is dropped
    qp.modify(QPAttr(**RTR))
    qp.receive(Packet(Opcode.ACKNOWLEDGE, 0x123, 0), 0.0)
    assert qp.counters.dropped_wrong_state == 2
    qp.receive(
        Packet(Opcode.RDMA_WRITE_ONLY, 0x123, 0, ack_req=True, va=r.addr, rkey=r.rkey, dma_len=4, payload=b"abcd"), 0.0
    )
    assert r.buf[:4] == b"abcd"
    assert [pk.opcode for pk in qp.transmit(0.0)] == [Opcode.ACKNOWLEDGE]


def test_timer_values() -> None:
    assert timeout_seconds(0) is None
    assert timeout_seconds(14) == pytest.approx(0.067108864)
    assert timeout_seconds(1) == pytest.approx(8.192e-6)


# ============================ regressions for fixes found by these tests ====


def test_rnr_retry_budget_is_per_message() -> None:
    """rnr_retry counts RNR NAKs per message: it is restored when the QP makes progress
    (rxe's reset_retry_counters), not spent once for the life of the QP."""
    p = Pair(rnr_retry=1, min_rnr_timer=10)  # 320 us
    a = p.mem["a"].reg(pattern(100))
    b = p.mem["b"].reg(100)
    for i in range(3):
        p.post_send("a", SendWR(i, WR.IBV_WR_SEND, [a.sge()]))
        p.advance(50e-6)  # the first attempt is RNR NAKed
        p.post_recv("b", RecvWR(i, [b.sge()]))
        p.run()
    assert [(wc.wr_id, wc.status) for wc in p.send_wcs("a")] == [(i, S.IBV_WC_SUCCESS) for i in range(3)]
    assert p.a.counters.rnr_naks_rcvd == 3


def test_an_rnr_nak_restores_the_transport_retry_count() -> None:
    """A responder short of receives that also loses every other answer (a soft
    device under 100 senders): the RNR NAKs that do arrive show it is there, so
    the timeouts between them do not add up to RETRY_EXC_ERR (retry_cnt 1 would
    be spent by the second timeout); the SEND completes once a receive is posted."""
    p = Pair(timeout=8, retry_cnt=1, rnr_retry=7, min_rnr_timer=10)  # 1 ms ACK timeout, 320 us RNR timer
    a = p.mem["a"].reg(pattern(100))
    b = p.mem["b"].reg(100)
    answers = [0]

    def every_other_rnr_nak(src: str, pk: Packet) -> bool:
        if src == "b" and pk.opcode == Opcode.ACKNOWLEDGE and wire.aeth_kind(pk.syndrome) == wire.AETH_RNR_NAK:
            answers[0] += 1
            return answers[0] % 2 == 1
        return True

    p.filters.append(every_other_rnr_nak)
    p.post_send("a", SendWR(1, WR.IBV_WR_SEND, [a.sge()]))
    p.advance(0.05)
    assert p.send_wcs("a") == [] and p.a.state == QPState.IBV_QPS_RTS
    assert p.a.counters.timeouts >= 5 and p.a.counters.rnr_naks_rcvd >= 5
    p.post_recv("b", RecvWR(1, [b.sge()]))
    p.run()
    assert [(wc.wr_id, wc.status) for wc in p.send_wcs("a")] == [(1, S.IBV_WC_SUCCESS)]
    assert b.buf == a.buf


def test_duplicated_rnr_nak_counts_once() -> None:
    p = Pair(rnr_retry=1, min_rnr_timer=10, duplicate=1.0)  # every packet delivered twice
    a = p.mem["a"].reg(pattern(100))
    b = p.mem["b"].reg(100)
    p.post_send("a", SendWR(1, WR.IBV_WR_SEND, [a.sge()]))
    p.advance(50e-6)
    p.post_recv("b", RecvWR(1, [b.sge()]))
    p.run()
    assert [(wc.wr_id, wc.status) for wc in p.send_wcs("a")] == [(1, S.IBV_WC_SUCCESS)]
    assert b.buf == a.buf


def test_duplicated_seq_nak_starts_one_round() -> None:
    """A duplicated PSN-sequence NAK must not make the requester resend the window twice."""
    p = Pair(duplicate=1.0)
    a = p.mem["a"].reg(pattern(40 * 1024))
    b = p.mem["b"].reg(40 * 1024)
    p.filters.append(drop_nth("a", lambda pk: pk.psn == 3, 1))
    copies = [0]

    def late_second_nak(src: str, pk: Packet) -> float:
        if pk.opcode == Opcode.ACKNOWLEDGE and wire.aeth_kind(pk.syndrome) == wire.AETH_NAK:
            copies[0] += 1
            return 0.0 if copies[0] % 2 else 3e-6  # the duplicate arrives while the resend is under way
        return 0.0

    p.delay = late_second_nak
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_WRITE, [a.sge()], remote_addr=b.addr, rkey=b.rkey))
    p.run()
    only_success(p.send_wcs("a"))
    assert b.buf == a.buf
    assert p.a.counters.seq_naks_rcvd == 2  # the NAK and its duplicate
    assert p.a.counters.retransmits == 1
    assert sum(1 for s in p.sent if s.src == "a" and s.pkt.psn == 20) == 2


def test_acks_past_a_read_rewind_once() -> None:
    """ACKs for WRITEs behind a READ whose response is late: one go-back, not one per ACK."""
    p = Pair()
    local = p.mem["a"].reg(4096)
    remote = p.mem["b"].reg(pattern(4096))
    p.delay = lambda src, pk: 200e-6 if pk.opcode == Opcode.RDMA_READ_RESPONSE_ONLY and p.now < 1e-4 else 0.0
    p.post_send("a", SendWR(0, WR.IBV_WR_RDMA_READ, [local.sge(0, 64)], remote_addr=remote.addr, rkey=remote.rkey))
    for i in range(1, 20):
        p.post_send(
            "a", SendWR(i, WR.IBV_WR_RDMA_WRITE, [local.sge(0, 8)], remote_addr=remote.addr + 100 * i, rkey=remote.rkey)
        )
    p.run()
    assert [wc.wr_id for wc in only_success(p.send_wcs("a"))] == list(range(20))
    assert p.a.counters.retransmits <= 1
    assert local.buf[:64] == remote.buf[:64]


def test_error_nak_overtaking_a_read_response() -> None:
    """READ, then a WRITE with a bad rkey; the NAK overtakes the READ response on the
    link. The READ still completes, the WRITE gets IBV_WC_REM_ACCESS_ERR."""
    for op in (WR.IBV_WR_RDMA_READ, WR.IBV_WR_ATOMIC_FETCH_AND_ADD):
        p = Pair()
        local = p.mem["a"].reg(4096)
        remote = p.mem["b"].reg(pattern(4096))
        p.delay = lambda src, pk: (
            100e-6 if pk.opcode in (Opcode.RDMA_READ_RESPONSE_ONLY, Opcode.ATOMIC_ACKNOWLEDGE) else 0.0
        )
        p.post_send("a", SendWR(1, op, [local.sge(0, 8)], remote_addr=remote.addr, rkey=remote.rkey, compare_add=1))
        p.post_send(
            "a", SendWR(2, WR.IBV_WR_RDMA_WRITE, [local.sge(0, 8)], remote_addr=remote.addr, rkey=remote.rkey ^ 1)
        )
        p.post_send("a", SendWR(3, WR.IBV_WR_RDMA_WRITE, [local.sge(0, 8)], remote_addr=remote.addr, rkey=remote.rkey))
        p.run()
        assert [(wc.wr_id, wc.status) for wc in p.send_wcs("a")] == [
            (1, S.IBV_WC_SUCCESS),
            (2, S.IBV_WC_REM_ACCESS_ERR),
            (3, S.IBV_WC_WR_FLUSH_ERR),
        ], op
        assert bytes(local.buf[:8]) == pattern(4096)[:8]


def test_error_nak_after_a_lost_read_response() -> None:
    """Same, but the READ response is lost: the responder is in ERR and cannot answer the
    retried READ, so the READ fails with IBV_WC_RETRY_EXC_ERR (as on rxe) and is not
    blamed for the WRITE's access error."""
    p = Pair(retry_cnt=2)
    local = p.mem["a"].reg(4096)
    remote = p.mem["b"].reg(pattern(4096))
    p.filters.append(lambda src, pk: pk.opcode != Opcode.RDMA_READ_RESPONSE_ONLY)
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_READ, [local.sge(0, 8)], remote_addr=remote.addr, rkey=remote.rkey))
    p.post_send("a", SendWR(2, WR.IBV_WR_RDMA_WRITE, [local.sge(0, 8)], remote_addr=remote.addr, rkey=remote.rkey ^ 1))
    p.run()
    assert [(wc.wr_id, wc.status) for wc in p.send_wcs("a")] == [
        (1, S.IBV_WC_RETRY_EXC_ERR),
        (2, S.IBV_WC_WR_FLUSH_ERR),
    ]
    assert p.a.state == p.b.state == QPState.IBV_QPS_ERR


def test_multi_packet_write_with_imm_rnr_on_last() -> None:
    """WRITE_WITH_IMM of several packets with no receive posted: the data packets are
    placed, the LAST is RNR NAKed and retried alone until a receive is posted."""
    p = Pair(rnr_retry=7, min_rnr_timer=10)
    a = p.mem["a"].reg(pattern(5000))
    b = p.mem["b"].reg(5000)
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_WRITE_WITH_IMM, [a.sge()], remote_addr=b.addr, rkey=b.rkey, imm_data=9))
    p.advance(5e-3)
    assert p.send_wcs("a") == [] and p.a.counters.rnr_naks_rcvd > 3
    firsts = sum(1 for pk in p.sent_by("a") if pk.opcode == Opcode.RDMA_WRITE_FIRST)
    assert firsts == 1  # only the LAST packet is retried
    p.post_recv("b", RecvWR(4))
    p.run()
    only_success(p.send_wcs("a"))
    [rwc] = only_success(p.recv_wcs("b"))
    assert (rwc.imm_data, rwc.byte_len) == (9, 5000) and b.buf == a.buf


def test_read_response_restream_after_gap() -> None:
    """A READ whose middle response is lost is requested again from the missing packet
    and the resumed response stream accepted (no wasted timeout when the resend arrives)."""
    p = Pair(timeout=14, mtu=MTU.IBV_MTU_256)
    local = p.mem["a"].reg(2048)
    remote = p.mem["b"].reg(pattern(2048))
    p.filters.append(drop_nth("b", lambda pk: pk.opcode == Opcode.RDMA_READ_RESPONSE_MIDDLE, 2))
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_READ, [local.sge()], remote_addr=remote.addr, rkey=remote.rkey))
    p.run()
    only_success(p.send_wcs("a"))
    assert local.buf == remote.buf
    assert p.a.counters.timeouts == 0


@pytest.mark.parametrize("lost", [1, 2, 6, 7])
def test_read_retry_resumes_at_the_first_missing_psn(lost: int) -> None:
    """The IBA read retry (what rxe does): the retried READ request carries the PSN of
    the first response packet still missing, the VA advanced past what arrived and the
    rest of the length; the responder replays from that PSN with the opcodes of the
    packets' places (MIDDLE ... LAST), not the whole response again."""
    psn = near_wrap(3)
    p = Pair(timeout=14, mtu=MTU.IBV_MTU_256, psn_a=psn)
    local = p.mem["a"].reg(2048)
    remote = p.mem["b"].reg(pattern(2048, 3))
    is_resp = lambda pk: pk.opcode in wire.RESPONSE_OPCODES and pk.opcode != Opcode.ACKNOWLEDGE
    p.filters.append(drop_nth("b", is_resp, lost + 1))  # the lost-th packet (0-based) of the 8
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_READ, [local.sge()], remote_addr=remote.addr, rkey=remote.rkey))
    p.run()
    only_success(p.send_wcs("a"))
    assert local.buf == remote.buf
    reqs = [pk for pk in p.sent_by("a") if pk.opcode == Opcode.RDMA_READ_REQUEST]
    assert [(r.psn, r.va, r.dma_len) for r in reqs] == [
        (psn, remote.addr, 2048),
        (wire.psn_add(psn, lost), remote.addr + 256 * lost, 2048 - 256 * lost),
    ]
    resent = [pk for pk in p.sent_by("b") if is_resp(pk)][8:]
    assert [pk.psn for pk in resent] == [wire.psn_add(psn, i) for i in range(lost, 8)]
    assert [pk.opcode for pk in resent] == [Opcode.RDMA_READ_RESPONSE_MIDDLE] * (7 - lost) + [
        Opcode.RDMA_READ_RESPONSE_LAST
    ]
    # a lost LAST leaves no gap to notice: the retransmit timer asks for it
    assert p.a.counters.timeouts == (1 if lost == 7 else 0)


def test_read_retry_resumes_after_timeouts_under_loss() -> None:
    """A long READ over a link that drops every 100th packet completes, and every retry
    asks only for what is missing: about 1.5 responses' worth cross the link (a retry
    that restarted the READ would need 400 packets without a loss: it never completes)."""
    p = Pair(timeout=12, mtu=MTU.IBV_MTU_256, seed=4)
    n = 256 * 400
    local = p.mem["a"].reg(n)
    remote = p.mem["b"].reg(pattern(n, 4))
    count = [0]

    def every_10th(src: str, pk: Packet) -> bool:
        count[0] += 1
        return count[0] % 100 != 0

    p.filters.append(every_10th)
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_READ, [local.sge()], remote_addr=remote.addr, rkey=remote.rkey))
    p.run()
    only_success(p.send_wcs("a"))
    assert local.buf == remote.buf
    responses = sum(1 for pk in p.sent_by("b") if pk.opcode in wire.RESPONSE_OPCODES)
    assert responses < 3 * 400, responses


def test_reset_keeps_device_hooks() -> None:
    """modify(RESET) clears the transport state but not the hooks the device installed
    (the Python engine's RCQueuePair: the native engine's hooks live in its NIC, and
    test_native_engine checks its tracer survives a RESET)."""
    qp, _ = fresh_qp(engine="python")
    events = []
    qp.tracer = lambda ev, **kw: events.append(ev)
    qp.on_error = events.append
    to_rts(qp)
    qp.modify(QPAttr(qp_state=QPState.IBV_QPS_ERR))
    qp.modify(QPAttr(qp_state=QPState.IBV_QPS_RESET))
    assert qp.tracer is not None and qp.on_error is not None
    to_rts(qp)
    qp.modify(QPAttr(qp_state=QPState.IBV_QPS_ERR))
    assert events.count("moved to IBV_QPS_ERR by modify_qp") == 2


def test_duplicating_reordering_link_does_not_storm() -> None:
    """Found by a randomized run: with every 5th packet duplicated and half of them
    reordered, each duplicated NAK and each ACK that overtook a READ response started
    another go-back-N round, whose resends made more duplicates: 500 000 packets
    later the 321 packets of this workload were still not through. A NAK for a PSN
    the current round already resent now starts no new round until progress."""
    psn = 16777159
    p = Pair(mtu=MTU.IBV_MTU_256, psn_a=psn, psn_b=(psn * 7) & 0xFFFFFF, seed=335, duplicate=0.2, reorder=0.5)
    w = Workload(p, random.Random(335), 112, max_len=3 * 256 + 5)
    needed = sum(q.npkts for q in p.a.sq)
    p.run(max_steps=100_000)
    w.check()
    assert len(p.sent) < 100 * needed


def test_a_cma_grant_to_a_qp_that_takes_none_is_dropped_as_a_stray_response() -> None:
    """CMA_READ_GRANT (aiordma's own opcode) answers a READ only where the requester
    said at the rendezvous that it reads the responder's process (the native engine's
    rc.c, cma_peer_pid). A QP of either engine that said nothing drops one as a stray
    response, and its READ completes by the READ responses its retry brings."""
    p = Pair(psn_a=100)  # 1024-byte MTU: 4 response packets, PSNs 100-103
    a = p.mem["a"].reg(4096)
    b = p.mem["b"].reg(pattern(4096), Access.REMOTE_READ | Access.LOCAL_WRITE)
    p.post_send("a", SendWR(1, WR.IBV_WR_RDMA_READ, [a.sge()], remote_addr=b.addr, rkey=b.rkey))
    assert [pk.opcode for pk in p.a.transmit(p.now)] == [Opcode.RDMA_READ_REQUEST]  # (lost)
    dropped = p.a.counters.dropped_responses
    grant = struct.pack("<QI", b.addr, 100)  # the bytes are "at" the region, from PSN 100
    p.inject("a", Packet(Opcode.CMA_READ_GRANT, p.a.qp_num, 103, syndrome=wire.AETH_ACK | 0x1F, payload=grant))
    assert p.send_wcs("a") == [] and p.a.state == QPState.IBV_QPS_RTS
    assert p.a.counters.dropped_responses == dropped + 1
    assert a.buf == bytes(4096)  # nothing was copied from anywhere
    p.run()
    only_success(p.send_wcs("a"))
    assert a.buf == b.buf
