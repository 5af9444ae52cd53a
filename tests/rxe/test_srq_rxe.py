"""Shared receive queues through pyverbs against kernel Soft-RoCE (rxe0 in scripts/rxe-vm).

Two receiving QPs of rxe0 take their receives from one SRQ
(``pd.create_srq``, ``create_qp(..., srq=srq)``), each facing a sending QP of
the same device (rxe loopback). The limit event comes through the context's
async-event fd (``ibv_get_async_event``; pyverbs 44 has no fd attribute: the
provider discovers it) to a handler on the event loop. Every test runs with
the extended posting verbs (``ibv_create_qp_ex``) and with ``ibv_post_send``.
The registered-memory count is compared with the kernel's
(``rdma resource show mr``).
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
from dataclasses import dataclass

import pytest

from aiordma.errors import InvalidWorkRequestError, ResourceBusyError
from aiordma.providers.base import (
    ACCESS_ALL,
    QPAttr,
    QPCap,
    QPState,
    RecvWR,
    SendWR,
    SharedReceiveQueue,
    WCOpcode,
    WCStatus,
    WROpcode,
)

from .rxe_helpers import kernel_registered_memory

pytestmark = pytest.mark.rxe

OK = WCStatus.IBV_WC_SUCCESS
WR = WROpcode


def pattern(n: int, seed: int = 0) -> bytes:
    return bytes((i * 13 + seed) & 0xFF for i in range(n))


@dataclass
class Rig:
    dev: object
    pd: object
    srq: object
    send_cqs: list
    recv_cqs: list
    senders: list
    receivers: list
    src: object
    dst: object

    def post(self, wr_id: int, slot: int, size: int = 1024) -> None:
        self.srq.post_recv(RecvWR(wr_id, [self.dst.sge(slot * size, size)]))

    def send(self, who: int, wr_id: int, n: int, **kw) -> None:
        self.senders[who].post_send(SendWR(wr_id, kw.pop("op", WR.IBV_WR_SEND), [self.src.sge(0, n)], **kw))


def _connect(dev, qp, peer_qpn: int) -> None:
    qp.to_init(QPAttr(qp_access_flags=ACCESS_ALL))
    qp.to_rtr(QPAttr(dest_qp_num=peer_qpn, dgid=dev.query_gid().gid, min_rnr_timer=1))
    qp.to_rts(QPAttr(rnr_retry=7))


@pytest.fixture(params=["extended", "post_send"])
def rig(dev, request, monkeypatch):
    monkeypatch.setenv("AIORDMA_PYVERBS_EXTENDED", "1" if request.param == "extended" else "0")
    pd = dev.alloc_pd()
    srq = pd.create_srq(32, 2)
    send_cqs = [dev.create_cq(64) for _ in range(2)]
    recv_cqs = [dev.create_cq(64) for _ in range(2)]
    cap = QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=2, max_recv_sge=2)
    senders = [pd.create_qp(cq, cq, cap) for cq in send_cqs]
    receivers = [pd.create_qp(cq, cq, cap, srq=srq) for cq in recv_cqs]
    for s, r in zip(senders, receivers):
        _connect(dev, s, r.qp_num)
        _connect(dev, r, s.qp_num)
    src = pd.reg_mr(bytearray(pattern(8192, 3)))
    dst = pd.reg_mr(bytearray(64 * 1024), ACCESS_ALL)
    yield Rig(dev, pd, srq, send_cqs, recv_cqs, senders, receivers, src, dst)
    pd.close()  # QPs, the SRQ and MRs first
    for cq in (*send_cqs, *recv_cqs):
        cq.close()


def test_two_qps_take_the_srqs_receives_in_order(rig, wait_wcs):
    assert rig.srq.query().max_wr >= 32 and rig.srq.max_sge >= 2
    for i in range(5):
        rig.post(100 + i, i)
    assert rig.srq.users == 2
    for k, who in enumerate([0, 1, 1, 0, 1]):
        rig.send(who, k, 200 + k, op=WR.IBV_WR_SEND_WITH_IMM, imm_data=k)
        (swc,) = wait_wcs(rig.send_cqs[who], 1)
        (rwc,) = wait_wcs(rig.recv_cqs[who], 1)  # the CQ of the QP that consumed it
        assert swc.status == OK
        assert (rwc.wr_id, rwc.status, rwc.opcode, rwc.byte_len, rwc.imm_data) == (
            100 + k,
            OK,
            WCOpcode.IBV_WC_RECV,
            200 + k,
            k,
        )
        assert rwc.qp_num == rig.receivers[who].qp_num
        assert bytes(rig.dst.view[k * 1024 : k * 1024 + 200 + k]) == pattern(8192, 3)[: 200 + k]


def test_write_with_immediate_consumes_an_srq_receive(rig, wait_wcs):
    rig.post(7, 0)
    rig.send(
        1,
        1,
        3000,
        op=WR.IBV_WR_RDMA_WRITE_WITH_IMM,
        imm_data=0xABCD,
        remote_addr=rig.dst.addr + 8192,
        rkey=rig.dst.rkey,
    )
    (rwc,) = wait_wcs(rig.recv_cqs[1], 1)
    assert (rwc.wr_id, rwc.opcode, rwc.imm_data, rwc.byte_len) == (7, WCOpcode.IBV_WC_RECV_RDMA_WITH_IMM, 0xABCD, 3000)
    assert bytes(rig.dst.view[8192 : 8192 + 3000]) == pattern(8192, 3)[:3000]


def test_an_empty_srq_rnr_naks_until_a_receive_is_posted(rig, wait_wcs):
    rig.send(0, 1, 500)
    time.sleep(0.3)  # RNR NAKs and retries (rnr_retry=7: for ever) meanwhile
    assert rig.send_cqs[0].poll() == []
    assert rig.receivers[0].state == QPState.IBV_QPS_RTS
    rig.post(9, 3)
    (swc,) = wait_wcs(rig.send_cqs[0], 1)
    (rwc,) = wait_wcs(rig.recv_cqs[0], 1)
    assert swc.status == OK and (rwc.wr_id, rwc.byte_len) == (9, 500)


def test_post_recv_on_a_qp_with_an_srq_is_refused(rig):
    with pytest.raises(InvalidWorkRequestError, match=r"shared receive queue.*ibv_post_srq_recv"):
        rig.receivers[0].post_recv(RecvWR(1, [rig.dst.sge(0, 8)]))


def test_destroying_an_srq_in_use_is_refused(rig):
    rig.post(1, 0)
    with pytest.raises(ResourceBusyError) as e:
        rig.srq.close()
    assert e.value.errno == errno.EBUSY
    assert rig.receivers[0].state == QPState.IBV_QPS_RTS  # pyverbs' own close would have destroyed it
    rig.post(2, 1)  # still usable
    for qp in rig.receivers:
        qp.close()
    rig.srq.close()


def test_a_qp_error_does_not_flush_the_srq(rig, wait_wcs):
    for i in range(3):
        rig.post(i, i)
    rig.receivers[0].to_error()
    time.sleep(0.1)
    assert rig.recv_cqs[0].poll() == []  # the kernel flushed nothing of the SRQ's to it
    rig.send(1, 1, 64)
    (rwc,) = wait_wcs(rig.recv_cqs[1], 1)
    assert (rwc.wr_id, rwc.status) == (0, OK)


def test_srq_limit_is_checked(rig):
    rig.srq.arm_limit(4)
    assert rig.srq.query().srq_limit == 4
    rig.srq.arm_limit(0)
    with pytest.raises(ValueError, match="max_wr"):
        rig.srq.arm_limit(rig.srq.max_wr + 1)


async def _wait_for(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        await asyncio.sleep(0.005)


async def _take_one(cq, got: list) -> None:
    """Wait for one more completion of ``cq``, appended to ``got``. It yields to the
    loop at least once, as an application awaiting its completions does: on rxe the
    completion is often there at once, and a coroutine that never yields lets no
    reader of the loop run (the async-event fd's included)."""
    n = len(got)
    await asyncio.sleep(0)
    await _wait_for(lambda: bool(got.extend(cq.poll(1))) or len(got) > n)


async def test_the_limit_event_reaches_the_loop_once_per_arm(rig):
    """IBV_EVENT_SRQ_LIMIT_REACHED read from the context's async-event fd on the event
    loop (no polling thread): the handler runs on the loop's thread, once per arm."""
    assert rig.dev.async_fd_mode in ("discovered", "native"), rig.dev.async_fd_problem
    loop = asyncio.get_running_loop()
    calls: list[tuple[SharedReceiveQueue, int]] = []

    def handler(srq: SharedReceiveQueue) -> None:
        assert asyncio.get_running_loop() is loop
        calls.append((srq, threading.get_ident()))

    rig.srq.set_limit_handler(handler)
    before = rig.dev.async_event_counts.get("IBV_EVENT_SRQ_LIMIT_REACHED", 0)  # (the device is the session's)
    try:
        for i in range(5):
            rig.post(i, i)
        rig.srq.arm_limit(3)
        assert rig.srq.query().srq_limit == 3
        got: list = []
        for k in range(4):
            rig.send(k % 2, k, 16)
            await _take_one(rig.recv_cqs[k % 2], got)
        # 5 posted: the third take leaves 2 < 3 and fires; the fourth finds it disarmed
        await _wait_for(lambda: bool(calls))
        await asyncio.sleep(0.2)
        assert [(srq, thread) for srq, thread in calls] == [(rig.srq, threading.get_ident())]
        assert rig.srq.query().srq_limit == 0  # the event disarmed it (rxe)
        assert rig.dev.async_event_counts.get("IBV_EVENT_SRQ_LIMIT_REACHED") == before + 1
        # re-armed: once more
        rig.srq.arm_limit(2)  # 1 posted
        for i in range(3):
            rig.post(10 + i, 10 + i)  # 4
        for k in range(4, 7):
            rig.send(k % 2, k, 16)
            await _take_one(rig.recv_cqs[k % 2], got)
        await _wait_for(lambda: len(calls) == 2)
        assert [wc.wr_id for wc in got] == [0, 1, 2, 3, 4, 10, 11]
    finally:
        rig.srq.set_limit_handler(None)


async def test_a_limit_handler_refills_the_srq(rig):
    """The message layer's pattern: the handler posts receives and re-arms."""
    refills: list[int] = []
    posted = [0]

    def post_more(n: int) -> None:
        for _ in range(n):
            rig.post(posted[0], posted[0] % 64)
            posted[0] += 1

    def refill(srq: SharedReceiveQueue) -> None:
        refills.append(1)
        post_more(6 - len_of(srq))
        srq.arm_limit(3)

    # (pyverbs has no count of the WQEs posted: the test keeps it)
    taken = [0]

    def len_of(srq: SharedReceiveQueue) -> int:
        return posted[0] - taken[0]

    rig.srq.set_limit_handler(refill)
    try:
        post_more(6)
        rig.srq.arm_limit(3)
        got: list = []
        for k in range(24):
            rig.send(k % 2, k, 8)
            await _take_one(rig.recv_cqs[k % 2], got)
            taken[0] += 1
        assert [wc.wr_id for wc in got] == list(range(24))
        assert all(wc.status == OK for wc in got)
        assert len(refills) >= 4  # one per 3 or 4 messages
    finally:
        rig.srq.set_limit_handler(None)


def test_registered_memory_matches_the_kernels(dev):
    """aiordma's count of the regions it registered moves as the kernel's does
    (``rdma resource show mr`` of this process on this device)."""
    pid = os.getpid()
    base_ours, base_kernel = dev.registered_memory(), kernel_registered_memory(dev.name, pid)
    pd = dev.alloc_pd()
    try:
        mrs = [pd.reg_mr(bytearray(4096 * (i + 1))) for i in range(3)] + [pd.reg_mr(100_000)]
        ours, kernel = dev.registered_memory(), kernel_registered_memory(dev.name, pid)
        want = {"bytes": 4096 * 6 + 100_000, "regions": 4}
        assert {k: ours[k] - base_ours[k] for k in ours} == want
        assert {k: kernel[k] - base_kernel[k] for k in kernel} == want
        mrs[1].close()
        assert dev.registered_memory()["bytes"] - base_ours["bytes"] == 4096 * 4 + 100_000
        assert kernel_registered_memory(dev.name, pid)["regions"] - base_kernel["regions"] == 3
    finally:
        pd.close()
    assert dev.registered_memory() == base_ours
    assert kernel_registered_memory(dev.name, pid) == base_kernel
