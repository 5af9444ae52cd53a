"""Shared receive queues on the soft device, over real UDP sockets, on both engines.

Verbs objects only (no connection layer): an SRQ (``pd.create_srq``) that two
queue pairs take their receives from (``create_qp(..., srq=srq)``), each
facing its own sender on another soft device. The limit event
(``IBV_EVENT_SRQ_LIMIT_REACHED``) comes through the device's async-event fd to
a handler on the event loop (``srq.set_limit_handler``): these tests check on
which thread it runs, that it fires once per arm, and that a handler can
refill the SRQ and re-arm it.
"""

from __future__ import annotations

import asyncio
import errno
import threading
import time

import pytest

from aiordma.errors import InvalidWorkRequestError, ResourceBusyError
from aiordma.providers.base import (
    ACCESS_ALL,
    MTU,
    QPAttr,
    QPCap,
    QPState,
    RecvWR,
    SendWR,
    SharedReceiveQueue,
    SRQAttr,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from aiordma.providers.soft.device import SoftDevice
from aiordma.providers.soft.engine import native_status

from .test_soft_device import new_device, pattern, wait_cq, wait_until

ENGINES = ("python", "native") if native_status()[0] else ("python",)
S = WCStatus
WR = WROpcode


class Sender:
    """A QP on its own device with one registered source buffer."""

    def __init__(self, dev: SoftDevice, seed: int) -> None:
        self.dev = dev
        self.pd = dev.alloc_pd()
        self.cq = dev.create_cq(256)
        self.qp = self.pd.create_qp(self.cq, self.cq, QPCap(max_send_wr=64, max_recv_wr=1))
        self.buf = bytearray(pattern(8192, seed))
        self.mr = self.pd.reg_mr(self.buf)

    def send(self, wr_id: int, n: int, op: WROpcode = WR.IBV_WR_SEND, **kw) -> None:
        self.qp.post_send(SendWR(wr_id, op, [self.mr.sge(0, n)], **kw))

    def close(self) -> None:
        self.qp.close()
        self.mr.close()
        self.cq.close()


class Receiver:
    """``n`` QPs of one device taking their receives from one SRQ, one CQ each."""

    def __init__(self, dev: SoftDevice, n: int, max_wr: int = 64, max_sge: int = 2) -> None:
        self.dev = dev
        self.pd = dev.alloc_pd()
        self.srq = self.pd.create_srq(max_wr, max_sge)
        self.cqs = [dev.create_cq(256) for _ in range(n)]
        self.qps = [self.pd.create_qp(cq, cq, QPCap(max_send_wr=4), srq=self.srq) for cq in self.cqs]
        self.buf = bytearray(64 * 1024)
        self.mr = self.pd.reg_mr(self.buf, ACCESS_ALL)

    def post(self, wr_id: int, slot: int, size: int = 1024) -> None:
        self.srq.post_recv(RecvWR(wr_id, [self.mr.sge(slot * size, size)]))

    def close(self) -> None:
        for qp in self.qps:
            qp.close()
        self.srq.close()
        self.mr.close()
        for cq in self.cqs:
            cq.close()


def connect(s: Sender, qp, rdev: SoftDevice, *, rnr_retry: int = 7, min_rnr_timer: int = 1) -> None:
    s.qp.to_init(QPAttr(qp_access_flags=ACCESS_ALL))
    qp.to_init(QPAttr(qp_access_flags=ACCESS_ALL))
    for x, y, ydev in ((s.qp, qp, rdev), (qp, s.qp, s.dev)):
        x.to_rtr(
            QPAttr(
                dest_qp_num=y.qp_num,
                rq_psn=0,
                dgid=ydev.query_gid().gid,
                dport=ydev.udp_port,
                path_mtu=MTU.IBV_MTU_1024,
                min_rnr_timer=min_rnr_timer,
            )
        )
        x.to_rts(QPAttr(sq_psn=0, rnr_retry=rnr_retry))


@pytest.fixture(params=ENGINES)
def rig(request):
    """Two senders (two devices) facing two QPs of a third device that share one SRQ."""
    rdev = new_device(engine=request.param)
    sdevs = [new_device(engine=request.param) for _ in range(2)]
    recv = Receiver(rdev, 2)
    senders = [Sender(d, i) for i, d in enumerate(sdevs)]
    for s, qp in zip(senders, recv.qps):
        connect(s, qp, rdev)
    yield recv, senders
    for s in senders:
        s.close()
    recv.close()
    for d in (*sdevs, rdev):
        d.close()


def test_two_qps_take_the_srqs_receives_in_order(rig) -> None:
    recv, senders = rig
    for i in range(6):
        recv.post(100 + i, i)
    assert len(recv.srq) == 6 and recv.srq.users == 2
    script = [0, 1, 1, 0, 1]
    for k, who in enumerate(script):
        senders[who].send(k, 100 + k, WR.IBV_WR_SEND_WITH_IMM, imm_data=k)
        [swc] = wait_cq(senders[who].cq)
        assert swc.status == S.IBV_WC_SUCCESS
        [rwc] = wait_cq(recv.cqs[who])  # on the CQ of the QP that consumed it
        assert (rwc.wr_id, rwc.status, rwc.opcode, rwc.byte_len, rwc.imm_data) == (
            100 + k,
            S.IBV_WC_SUCCESS,
            WCOpcode.IBV_WC_RECV,
            100 + k,
            k,
        )
        assert rwc.qp_num == recv.qps[who].qp_num
        assert recv.buf[k * 1024 : k * 1024 + 100 + k] == senders[who].buf[: 100 + k]
    assert len(recv.srq) == 1
    assert recv.dev.live_objects()["srqs"] == 1


def test_an_empty_srq_rnr_naks_until_a_receive_is_posted(rig) -> None:
    recv, senders = rig
    senders[1].send(1, 3000)
    wait_until(lambda: recv.dev.counters.get("rnr_naks_sent", 0) >= 3)
    assert senders[1].cq.poll() == [] and recv.qps[1].state == QPState.IBV_QPS_RTS
    assert senders[1].dev.counters.get("rnr_naks_rcvd", 0) >= 1
    recv.post(7, 0, 4096)
    [swc] = wait_cq(senders[1].cq)
    [rwc] = wait_cq(recv.cqs[1])
    assert swc.status == S.IBV_WC_SUCCESS and (rwc.wr_id, rwc.byte_len) == (7, 3000)
    assert recv.buf[:3000] == senders[1].buf[:3000]


def test_destroying_an_srq_in_use_is_refused(rig) -> None:
    recv, senders = rig
    with pytest.raises(ResourceBusyError, match="2 queue pair") as e:
        recv.srq.close()
    assert e.value.errno == errno.EBUSY
    recv.post(1, 0)  # still usable
    recv.qps[0].close()
    with pytest.raises(ResourceBusyError, match="1 queue pair"):
        recv.srq.close()
    assert len(recv.srq) == 1


def test_a_qp_error_does_not_flush_the_srq(rig) -> None:
    recv, senders = rig
    for i in range(4):
        recv.post(i, i)
    recv.qps[0].to_error()
    assert len(recv.srq) == 4
    time.sleep(0.01)
    assert recv.cqs[0].poll() == []  # nothing of the SRQ's was flushed to it
    senders[1].send(9, 64)
    [rwc] = wait_cq(recv.cqs[1])
    assert (rwc.wr_id, rwc.status) == (0, S.IBV_WC_SUCCESS)
    assert len(recv.srq) == 3


def test_post_recv_on_a_qp_with_an_srq_is_refused(rig) -> None:
    recv, _ = rig
    with pytest.raises(InvalidWorkRequestError, match=r"shared receive queue.*ibv_post_srq_recv"):
        recv.qps[0].post_recv(RecvWR(1, [recv.mr.sge(0, 64)]))
    assert recv.qps[0].srq is recv.srq


@pytest.mark.parametrize("engine", ENGINES)
def test_srq_attributes_and_checks(engine) -> None:
    dev = new_device(engine=engine)
    try:
        pd, other = dev.alloc_pd(), dev.alloc_pd()
        srq = pd.create_srq(8, 2, srq_limit=3)
        assert isinstance(srq, SharedReceiveQueue)
        assert srq.query() == SRQAttr(8, 2, 3)
        srq.arm_limit(0)
        assert srq.query().srq_limit == 0
        with pytest.raises(ValueError, match="max_wr 8"):
            srq.arm_limit(9)
        for bad in ((0, 1), (8, 0), (1 << 20, 1), (8, 64)):
            with pytest.raises(ValueError, match="ibv_create_srq"):
                pd.create_srq(*bad)
        cq = dev.create_cq(4)
        with pytest.raises(TypeError, match="same protection domain"):
            other.create_qp(cq, cq, srq=srq)
        mr = pd.reg_mr(bytearray(64))
        with pytest.raises(InvalidWorkRequestError, match="SGEs > the SRQ's max_sge 2"):
            srq.post_recv(RecvWR(1, [mr.sge(0, 8)] * 3))
        with pytest.raises(InvalidWorkRequestError, match="lacks IBV_ACCESS_LOCAL_WRITE"):
            srq.post_recv(RecvWR(1, [pd.reg_mr(b"read-only", 0).sge()]))
        srq.post_recv([RecvWR(i, [mr.sge(0, 8)]) for i in range(8)])
        with pytest.raises(InvalidWorkRequestError, match="full"):
            srq.post_recv(RecvWR(9, [mr.sge(0, 8)]))
        assert len(srq) == 8
        srq.close()
        srq.close()  # (once is enough)
        with pytest.raises(InvalidWorkRequestError, match="destroyed"):
            srq.post_recv(RecvWR(1, [mr.sge(0, 8)]))
        assert dev.live_objects()["srqs"] == 0
        assert dev.query_device().max_srq_wr == 16384
    finally:
        dev.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_registered_memory(engine) -> None:
    dev = new_device(engine=engine)
    try:
        assert dev.registered_memory() == {"bytes": 0, "regions": 0}
        pd = dev.alloc_pd()
        a = pd.reg_mr(bytearray(4096))
        b = pd.reg_mr(100_000)
        c = dev.alloc_pd().reg_mr(b"x" * 10, 0)
        assert dev.registered_memory() == {"bytes": 4096 + 100_000 + 10, "regions": 3}
        b.close()
        b.close()
        assert dev.registered_memory() == {"bytes": 4096 + 10, "regions": 2}
        a.close()
        c.close()
        assert dev.registered_memory() == {"bytes": 0, "regions": 0}
    finally:
        dev.close()


# ------------------------------------------------------------- limit event ----


async def wait_for(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        await asyncio.sleep(0.002)


async def take_one(cq, got: list) -> None:
    """Wait for one more completion of ``cq``, appended to ``got``."""
    n = len(got)
    await asyncio.sleep(0)  # (yield at least once, as an application awaiting completions does)
    await wait_for(lambda: bool(got.extend(cq.poll(1))) or len(got) > n)


async def test_the_limit_event_fires_once_per_arm_on_the_loop(rig) -> None:
    recv, senders = rig
    loop = asyncio.get_running_loop()
    calls: list[tuple[SharedReceiveQueue, int, int]] = []

    def handler(srq: SharedReceiveQueue) -> None:
        calls.append((srq, threading.get_ident(), len(srq)))
        assert asyncio.get_running_loop() is loop  # a callback of the loop itself

    recv.srq.set_limit_handler(handler)
    for i in range(6):
        recv.post(i, i)
    recv.srq.arm_limit(3)

    async def send(who: int, k: int) -> None:
        senders[who].send(k, 10)
        await wait_for(lambda: bool(recv.cqs[who].poll(1)) or False)

    await send(0, 1)  # 5
    await send(1, 2)  # 4
    await send(0, 3)  # 3: not below
    await asyncio.sleep(0.05)
    assert calls == []
    await send(1, 4)  # 2 < 3: fires
    await wait_for(lambda: len(calls) == 1)
    srq, thread, left = calls[0]
    assert srq is recv.srq and thread == threading.get_ident() and left == 2
    assert recv.srq.query().srq_limit == 0  # the event disarmed it
    await send(0, 5)  # 1: disarmed, nothing more
    await asyncio.sleep(0.05)
    assert len(calls) == 1
    assert recv.dev.async_event_counts == {"IBV_EVENT_SRQ_LIMIT_REACHED": 1}
    assert recv.srq.limit_events == 1
    recv.srq.set_limit_handler(None)


async def test_a_limit_handler_refills_and_rearms(rig) -> None:
    """The message layer's pattern: when the limit fires, post more receives and re-arm.
    40 messages through an SRQ that never holds more than 8: no RNR NAK is needed."""
    recv, senders = rig
    refills: list[int] = []
    posted = [0]

    def post_more(n: int) -> None:
        for _ in range(n):
            recv.post(posted[0], posted[0] % 64, 1024)
            posted[0] += 1

    def refill(srq: SharedReceiveQueue) -> None:
        refills.append(len(srq))
        post_more(8 - len(srq))
        srq.arm_limit(4)

    recv.srq.set_limit_handler(refill)
    post_more(8)
    recv.srq.arm_limit(4)
    got: list = []
    for k in range(40):
        who = k % 2
        senders[who].send(k, 32)
        await take_one(senders[who].cq, [])
        await take_one(recv.cqs[who], got)
    assert [wc.wr_id for wc in got] == list(range(40))
    assert all(wc.status == S.IBV_WC_SUCCESS for wc in got)
    # 8 receives at first, then each refill adds 8 - n (n < 4 left): the 32 more the 40
    # messages took need 4 refills at least (more when the handler runs at once, with 3 left)
    assert len(refills) >= 4 and all(n < 4 for n in refills), refills
    assert posted[0] >= 40
    assert recv.srq.limit_events == len(refills)


async def test_the_handler_runs_on_its_own_loop_in_another_thread(rig) -> None:
    """A handler registered with a loop that runs in another thread is called there."""
    recv, senders = rig
    other = asyncio.new_event_loop()
    ready = threading.Event()
    ran: list[int] = []

    def run_other() -> None:
        asyncio.set_event_loop(other)
        other.call_soon(ready.set)
        other.run_forever()

    t = threading.Thread(target=run_other, name="other-loop")
    t.start()
    try:
        assert ready.wait(5)
        recv.srq.set_limit_handler(lambda srq: ran.append(threading.get_ident()), loop=other)
        recv.post(1, 0)
        recv.post(2, 1)
        recv.srq.arm_limit(2)
        senders[0].send(1, 8)
        await wait_for(lambda: bool(ran))
        assert ran == [t.ident]
        recv.srq.set_limit_handler(None)
        await asyncio.sleep(0.01)
    finally:
        other.call_soon_threadsafe(other.stop)
        t.join(5)
        other.close()


async def test_a_handler_exception_goes_to_the_loops_exception_handler(rig) -> None:
    recv, senders = rig
    loop = asyncio.get_running_loop()
    seen: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    try:

        def boom(srq: SharedReceiveQueue) -> None:
            raise RuntimeError("refill failed")

        recv.srq.set_limit_handler(boom)
        recv.post(1, 0)
        recv.srq.arm_limit(1)
        senders[0].send(1, 8)
        await wait_for(lambda: bool(seen))
        assert isinstance(seen[0]["exception"], RuntimeError) and "limit handler" in seen[0]["message"]
    finally:
        loop.set_exception_handler(previous)
        recv.srq.set_limit_handler(None)


def test_set_limit_handler_needs_a_loop(rig) -> None:
    recv, _ = rig
    with pytest.raises(RuntimeError, match="needs an event loop"):
        recv.srq.set_limit_handler(lambda srq: None)
