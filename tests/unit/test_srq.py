"""Shared receive queues in the sans-IO RC transport, on both engines.

``rc_harness.SRQPairs``: senders ``a0``, ``a1``, ... each connected to a
receiver ``b0``, ``b1``, ... on one host, whose QPs all take their receives
from one shared receive queue (``aiordma.providers.soft.srq`` and rc.c's
``struct rc_srq``), every packet through the real codec. Each test runs on the
Python engine (the reference) and the native one; tests/unit/test_differential.py
runs them in lockstep and compares every packet.
"""

from __future__ import annotations

import random

import pytest

from aiordma.errors import InvalidWorkRequestError, QueuePairStateError
from aiordma.providers.base import MTU, QPAttr, QPState, RecvWR, SendWR, WCOpcode, WCStatus, WROpcode
from aiordma.providers.soft import wire
from aiordma.providers.soft.wire import Opcode

from .rc_harness import ENGINES, FakeMemory, Pair, SRQPairs, make_qp, make_srq

S = WCStatus
WR = WROpcode

pytestmark = pytest.mark.parametrize("engine", ENGINES)


def pattern(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def rnr_naks(p: Pair) -> int:
    return sum(
        1
        for pk in p.sent_by("b")
        if pk.opcode == Opcode.ACKNOWLEDGE and wire.aeth_kind(pk.syndrome) == wire.AETH_RNR_NAK
    )


def test_two_qps_take_receives_in_order_from_one_srq(engine: str) -> None:
    """Messages arriving at either QP consume the SRQ's WQEs oldest first: each
    completion lands on the consumer's CQ with the wr_id posted to the SRQ and the
    consumer's qp_num, the bytes in that WQE's buffer."""
    sp = SRQPairs(2, engine=engine)
    dst = sp.mem_b.reg(8 * 512)
    for i in range(8):
        sp.srq.post_recv(RecvWR(100 + i, [dst.sge(i * 512, 512)]))
    assert len(sp.srq) == 8 and sp.srq.users == 2
    srcs = [p.mem["a"].reg(pattern(400, i)) for i, p in enumerate(sp.pairs)]
    # a0, a1, a0, a1, a1, a0: each send runs to completion before the next is posted
    script = [0, 1, 0, 1, 1, 0]
    for k, who in enumerate(script):
        p = sp.pairs[who]
        n = 10 + 50 * k
        op = WR.IBV_WR_SEND_WITH_IMM if k % 2 else WR.IBV_WR_SEND
        p.post_send("a", SendWR(k, op, [srcs[who].sge(0, n)], imm_data=k))
        sp.run()
    got = [(i, wc.wr_id, wc.qp_num, wc.byte_len, wc.imm_data) for i, wc in sp.order]
    want = [(who, 100 + k, sp.pairs[who].b.qp_num, 10 + 50 * k, k if k % 2 else None) for k, who in enumerate(script)]
    assert got == want
    assert all(wc.status == S.IBV_WC_SUCCESS and wc.opcode == WCOpcode.IBV_WC_RECV for _, wc in sp.order)
    for k, who in enumerate(script):
        n = 10 + 50 * k
        assert dst.buf[k * 512 : k * 512 + n] == srcs[who].buf[:n]
    assert len(sp.srq) == 2
    for p in sp.pairs:  # nothing went to a QP's own receive queue
        assert list(p.b.rq) == []


def test_write_with_immediate_consumes_an_srq_wqe(engine: str) -> None:
    sp = SRQPairs(2, engine=engine)
    target = sp.mem_b.reg(4096)
    sp.srq.post_recv(RecvWR(7))
    sp.srq.post_recv(RecvWR(8))
    src = sp.pairs[1].mem["a"].reg(pattern(3000, 1))
    sp.pairs[1].post_send(
        "a",
        SendWR(1, WR.IBV_WR_RDMA_WRITE_WITH_IMM, [src.sge()], remote_addr=target.addr, rkey=target.rkey, imm_data=9),
    )
    sp.run()
    [(i, wc)] = sp.order
    assert i == 1 and (wc.wr_id, wc.opcode, wc.byte_len, wc.imm_data) == (
        7,
        WCOpcode.IBV_WC_RECV_RDMA_WITH_IMM,
        3000,
        9,
    )
    assert wc.qp_num == sp.pairs[1].b.qp_num
    assert target.buf[:3000] == src.buf and len(sp.srq) == 1


def test_an_empty_srq_answers_rnr_then_a_post_lets_the_retry_through(engine: str) -> None:
    """With nothing in the SRQ the responder sends RNR NAKs (the sender retries after
    min_rnr_timer, forever with rnr_retry=7, and the responder stays in RTS); a WQE
    posted to the SRQ is taken by the next retry."""
    sp = SRQPairs(2, engine=engine, rnr_retry=7, min_rnr_timer=10)
    dst = sp.mem_b.reg(2048)
    src = sp.pairs[0].mem["a"].reg(pattern(1500, 3))
    sp.pairs[0].post_send("a", SendWR(1, WR.IBV_WR_SEND, [src.sge()]))
    sp.pairs[1].post_send(
        "a", SendWR(2, WR.IBV_WR_RDMA_WRITE_WITH_IMM, [], remote_addr=0, rkey=0, imm_data=4)
    )  # a zero-length write with immediate needs a receive too
    sp.run(until=lambda: all(p.a.counters.rnr_naks_rcvd >= 3 for p in sp.pairs), max_steps=5000)
    for p in sp.pairs:
        assert p.send_wcs("a") == [] and p.b.state == QPState.IBV_QPS_RTS
        assert p.b.counters.rnr_naks_sent >= 3 and rnr_naks(p) >= 3
    assert sp.order == []
    sp.srq.post_recv(RecvWR(50, [dst.sge(0, 1500)]))
    sp.srq.post_recv(RecvWR(51, [dst.sge(1500, 548)]))
    sp.run()
    assert sorted((i, wc.wr_id in (50, 51), wc.status) for i, wc in sp.order) == [
        (0, True, S.IBV_WC_SUCCESS),
        (1, True, S.IBV_WC_SUCCESS),
    ]
    # whichever retried first took 50
    first = sp.order[0]
    assert first[1].wr_id == 50
    for p in sp.pairs:
        assert [wc.status for wc in p.send_wcs("a")] == [S.IBV_WC_SUCCESS]
    by_pair = {i: wc for i, wc in sp.order}
    if by_pair[0].wr_id == 50:
        assert dst.buf[:1500] == src.buf
    assert len(sp.srq) == 0


def test_rnr_retry_exhausted_on_an_empty_srq(engine: str) -> None:
    sp = SRQPairs(1, engine=engine, rnr_retry=2, min_rnr_timer=1)
    src = sp.pairs[0].mem["a"].reg(64)
    sp.pairs[0].post_send("a", SendWR(1, WR.IBV_WR_SEND, [src.sge()]))
    sp.run()
    [wc] = sp.pairs[0].send_wcs("a")
    assert wc.status == S.IBV_WC_RNR_RETRY_EXC_ERR
    assert sp.pairs[0].b.counters.rnr_naks_sent == 3


def test_the_limit_event_fires_once_per_arm(engine: str) -> None:
    """Armed at 3 with 6 posted: the event fires when a take leaves 2 (fewer than 3),
    once; the SRQ disarms (limit 0) and further takes raise nothing until re-armed."""
    sp = SRQPairs(2, engine=engine)
    dst = sp.mem_b.reg(64 * 10)
    for i in range(6):
        sp.srq.post_recv(RecvWR(i, [dst.sge(64 * i, 64)]))
    sp.srq.arm(3)
    assert (sp.srq.limit, sp.srq.limit_events) == (3, 0)
    srcs = [p.mem["a"].reg(16) for p in sp.pairs]

    def send(who: int, k: int) -> None:
        sp.pairs[who].post_send("a", SendWR(k, WR.IBV_WR_SEND, [srcs[who].sge()]))
        sp.run()

    send(0, 1)  # 5 left
    send(1, 2)  # 4
    send(0, 3)  # 3: not below the limit
    assert (len(sp.srq), sp.srq.limit_events, sp.srq.limit) == (3, 0, 3)
    send(1, 4)  # 2 < 3: fires
    assert (len(sp.srq), sp.srq.limit_events, sp.srq.limit) == (2, 1, 0)
    send(0, 5)  # 1: disarmed, nothing
    assert sp.srq.limit_events == 1
    sp.srq.arm(2)  # 1 posted, already below: nothing until a take
    assert sp.srq.limit_events == 1
    for i in range(3):
        sp.srq.post_recv(RecvWR(10 + i, [dst.sge(64 * (6 + i), 64)]))  # 4 posted
    send(1, 6)  # 3
    send(0, 7)  # 2: not below 2
    assert sp.srq.limit_events == 1
    send(1, 8)  # 1 < 2: fires again
    assert (sp.srq.limit_events, sp.srq.limit) == (2, 0)
    assert [wc.wr_id for wc in sp.recv_wcs()] == [0, 1, 2, 3, 4, 5, 10, 11]


def test_disarm_and_limits(engine: str) -> None:
    sp = SRQPairs(1, engine=engine, srq_max_wr=4)
    sp.srq.arm(4)
    sp.srq.arm(0)
    assert sp.srq.limit == 0
    with pytest.raises(ValueError, match="max_wr 4"):
        sp.srq.arm(5)
    with pytest.raises(ValueError):
        sp.srq.arm(-1)


def test_a_qp_error_does_not_flush_the_srq(engine: str) -> None:
    """b0 goes to IBV_QPS_ERR: it flushes only the WQE it had taken for the message in
    progress (a multi-packet SEND cut off), never the SRQ's; b1 goes on taking them."""
    sp = SRQPairs(2, engine=engine, mtu=MTU.IBV_MTU_256)
    dst = sp.mem_b.reg(6 * 1024)
    for i in range(6):
        sp.srq.post_recv(RecvWR(200 + i, [dst.sge(1024 * i, 1024)]))
    p0, p1 = sp.pairs
    src0 = p0.mem["a"].reg(pattern(1000, 5))
    # b0 gets the SEND's first packets, then the link drops the rest: b0 holds WQE 200
    seen = {"n": 0}

    def cut(src: str, pk) -> bool:
        if src == "a" and pk.opcode in (Opcode.SEND_MIDDLE, Opcode.SEND_LAST):
            seen["n"] += 1
            return seen["n"] <= 1  # FIRST and one MIDDLE reach b0
        return True

    p0.filters.append(cut)
    p0.post_send("a", SendWR(1, WR.IBV_WR_SEND, [src0.sge()]))
    for _ in range(4):
        sp.step()
    assert len(sp.srq) == 5  # b0 took one
    p0.b.modify(QPAttr(qp_state=QPState.IBV_QPS_ERR))
    p0.collect()
    flushed = p0.recv_wcs("b")
    assert [(wc.wr_id, wc.status, wc.qp_num) for wc in flushed] == [(200, S.IBV_WC_WR_FLUSH_ERR, p0.b.qp_num)]
    assert len(sp.srq) == 5  # the SRQ keeps the others
    # posting to the SRQ still works and b1 takes the oldest remaining
    src1 = p1.mem["a"].reg(pattern(300, 6))
    p1.post_send("a", SendWR(2, WR.IBV_WR_SEND, [src1.sge()]))
    p0.filters.clear()
    sp.run(until=lambda: bool(p1.recv_wcs("b")), max_steps=20_000)
    [wc] = p1.recv_wcs("b")
    assert (wc.wr_id, wc.status, wc.qp_num) == (201, S.IBV_WC_SUCCESS, p1.b.qp_num)
    assert dst.buf[1024 : 1024 + 300] == src1.buf
    assert len(sp.srq) == 4


def test_a_send_longer_than_the_srq_wqe(engine: str) -> None:
    """A SEND that does not fit the WQE it took: IBV_WC_LOC_LEN_ERR on the consumer
    (and its QP in error), the SRQ keeps the rest for the others."""
    sp = SRQPairs(2, engine=engine)
    dst = sp.mem_b.reg(1024)
    sp.srq.post_recv(RecvWR(1, [dst.sge(0, 100)]))
    sp.srq.post_recv(RecvWR(2, [dst.sge(100, 900)]))
    src = sp.pairs[0].mem["a"].reg(500)
    sp.pairs[0].post_send("a", SendWR(9, WR.IBV_WR_SEND, [src.sge()]))
    sp.run()
    [(i, wc)] = sp.order
    assert (i, wc.wr_id, wc.status) == (0, 1, S.IBV_WC_LOC_LEN_ERR)
    assert sp.pairs[0].b.state == QPState.IBV_QPS_ERR
    assert [w.status for w in sp.pairs[0].send_wcs("a")] == [S.IBV_WC_REM_INV_REQ_ERR]
    assert len(sp.srq) == 1
    sp.pairs[1].post_send("a", SendWR(3, WR.IBV_WR_SEND, [sp.pairs[1].mem["a"].reg(500).sge()]))
    sp.run()
    assert [(i, wc.wr_id, wc.status) for i, wc in sp.order[1:]] == [(1, 2, S.IBV_WC_SUCCESS)]


def test_post_recv_on_a_qp_with_an_srq_is_refused(engine: str) -> None:
    sp = SRQPairs(1, engine=engine)
    buf = sp.mem_b.reg(64)
    with pytest.raises(InvalidWorkRequestError, match=r"shared receive queue.*ibv_post_srq_recv"):
        sp.pairs[0].b.post_recv(RecvWR(1, [buf.sge()]))
    # also in IBV_QPS_ERR (where a receive queue would flush it at once)
    sp.pairs[0].b.modify(QPAttr(qp_state=QPState.IBV_QPS_ERR))
    with pytest.raises(InvalidWorkRequestError, match="srq="):
        sp.pairs[0].b.post_recv(RecvWR(2, [buf.sge()]))
    sp.pairs[0].collect()
    assert sp.pairs[0].recv_wcs("b") == []


def test_srq_post_checks(engine: str) -> None:
    mem = FakeMemory(0x10000, 0x100, engine == "native")
    srq = make_srq(engine, 0x42, mem, 2, 2)
    r = mem.reg(256)
    ro = mem.reg(64, access=0)  # no LOCAL_WRITE
    with pytest.raises(InvalidWorkRequestError, match="SGEs > the SRQ's max_sge 2"):
        srq.post_recv(RecvWR(1, [r.sge(0, 8), r.sge(8, 8), r.sge(16, 8)]))
    with pytest.raises(InvalidWorkRequestError, match="lkey 0x0badf00d is not a memory region"):
        srq.post_recv(RecvWR(1, [type(r.sge())(r.addr, 8, 0x0BADF00D)]))
    with pytest.raises(InvalidWorkRequestError, match="lacks IBV_ACCESS_LOCAL_WRITE"):
        srq.post_recv(RecvWR(1, [ro.sge()]))
    with pytest.raises(InvalidWorkRequestError, match="outside MR"):
        srq.post_recv(RecvWR(1, [type(r.sge())(r.addr + 200, 100, r.lkey)]))
    assert len(srq) == 0
    srq.post_recv(RecvWR(1, [r.sge(0, 128)]))
    srq.post_recv(RecvWR(2, [r.sge(128, 64), r.sge(192, 64)]))
    with pytest.raises(InvalidWorkRequestError, match="shared receive queue 0x000042 full"):
        srq.post_recv(RecvWR(3, [r.sge(0, 8)]))
    assert len(srq) == 2


def test_users_and_reset(engine: str) -> None:
    """The SRQ counts the QPs created with it (what ibv_destroy_srq's EBUSY checks);
    a QP reset to IBV_QPS_RESET keeps its SRQ; destroying the QP lets go."""
    mem = FakeMemory(0x10000, 0x100, engine == "native")
    srq = make_srq(engine, 0x43, mem, 4, 1)
    flow = Pair.FLOWS["a"]
    q1 = make_qp(engine, 0x1, mem, None, False, flow, flow.reversed(), srq)
    q2 = make_qp(engine, 0x2, mem, None, False, flow, flow.reversed(), srq)
    assert srq.users == 2
    q1.modify(QPAttr(qp_state=QPState.IBV_QPS_INIT))
    q1.modify(QPAttr(qp_state=QPState.IBV_QPS_RESET))
    assert srq.users == 2
    with pytest.raises(InvalidWorkRequestError, match="shared receive queue"):
        q1.post_recv(RecvWR(1))
    q1.close()
    q2.close()
    assert srq.users == 0


def test_a_qp_in_reset_cannot_take_from_the_srq(engine: str) -> None:
    """Packets before RTR are dropped: nothing is taken from the SRQ."""
    mem = FakeMemory(0x10000, 0x100, engine == "native")
    srq = make_srq(engine, 0x44, mem, 4, 1)
    srq.post_recv(RecvWR(1))
    flow = Pair.FLOWS["a"]
    qp = make_qp(engine, 0x1, mem, None, False, flow, flow.reversed(), srq)
    qp.receive(wire.Packet(Opcode.SEND_ONLY, 0x1, 0), 0.0)
    assert len(srq) == 1 and qp.counters.dropped_wrong_state == 1
    with pytest.raises(QueuePairStateError):
        qp.modify(QPAttr(qp_state=QPState.IBV_QPS_RTS))
