"""Send-queue slots and buffer-pool slots: handed to waiters in order, and a
waiter cancelled just after it was woken never strands a free slot."""

from __future__ import annotations

import asyncio

import pytest

from aiordma.memory import BufferPool
from aiordma.ops import SendQueue


class _FakeRegion:
    """Only what BufferPool reads (length); the pool's slot logic is under test."""

    length = 4 * 64

    def close(self) -> None:
        pass


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_send_queue_cancelled_waiter_passes_its_slot_on():
    sq = SendQueue(1, asyncio.get_running_loop())
    await sq.acquire()  # the queue is full
    first = asyncio.ensure_future(sq.acquire())
    second = asyncio.ensure_future(sq.acquire())
    await _settle()
    sq.release()  # a completion: the slot is handed to `first` ...
    first.cancel()  # ... which is cancelled before it ever runs
    await _settle()
    assert first.cancelled()
    # the slot must reach `second`; the old "wake one, let it take the slot" lost it here
    await asyncio.wait_for(second, 1)
    assert sq.free == 0


async def test_send_queue_waiter_cancelled_before_wake_leaves_the_queue():
    sq = SendQueue(1, asyncio.get_running_loop())
    await sq.acquire()
    first = asyncio.ensure_future(sq.acquire())
    second = asyncio.ensure_future(sq.acquire())
    await _settle()
    first.cancel()
    await _settle()
    sq.release()
    await asyncio.wait_for(second, 1)
    assert sq.free == 0 and not sq.waiters


async def test_send_queue_chain_waits_for_all_its_slots_in_order():
    sq = SendQueue(4, asyncio.get_running_loop())
    await sq.acquire(3)
    chain = asyncio.ensure_future(sq.acquire(3))  # needs 3, 1 is free
    single = asyncio.ensure_future(sq.acquire(1))  # would fit, but the chain is first (FIFO)
    await _settle()
    assert not chain.done() and not single.done() and sq.free == 1
    sq.release(2)
    await _settle()
    assert chain.done() and not single.done() and sq.free == 0
    sq.release(1)
    await asyncio.wait_for(single, 1)
    with pytest.raises(ValueError, match="exceed the send queue depth"):
        await sq.acquire(5)


async def test_send_queue_failure_wakes_every_waiter():
    sq = SendQueue(1, asyncio.get_running_loop())
    await sq.acquire()
    waiters = [asyncio.ensure_future(sq.acquire()) for _ in range(3)]
    await _settle()
    sq.fail(ConnectionError("gone"))
    for w in waiters:
        with pytest.raises(ConnectionError, match="gone"):
            await w
    with pytest.raises(ConnectionError, match="gone"):
        await sq.acquire()


async def test_buffer_pool_cancelled_waiter_passes_its_slot_on():
    pool = BufferPool(_FakeRegion(), 64)  # type: ignore[arg-type]
    taken = [await pool.acquire() for _ in range(4)]
    assert pool.try_acquire() is None
    first = asyncio.ensure_future(pool.acquire())
    second = asyncio.ensure_future(pool.acquire())
    await _settle()
    pool.release(taken[0])  # handed to `first` ...
    first.cancel()  # ... cancelled before it runs: the slot goes to `second`
    await _settle()
    assert await asyncio.wait_for(second, 1) == taken[0]
    assert pool.waiting == 0


async def test_buffer_pool_no_overtaking_while_others_wait():
    pool = BufferPool(_FakeRegion(), 64)  # type: ignore[arg-type]
    taken = [await pool.acquire() for _ in range(4)]
    waiter = asyncio.ensure_future(pool.acquire())
    await _settle()
    pool.free.append(taken[1])  # a slot appears without a release() (not handed over yet)
    assert pool.try_acquire() is None  # the waiter is first in line
    pool.release(taken[2])
    assert await asyncio.wait_for(waiter, 1) in (taken[1], taken[2])


def test_a_failure_the_peer_gave_no_reason_for_names_this_ends_reason() -> None:
    """completion_error: with no reason from the peer, a status without an explanation of
    its own takes this end's queue pair reason (its status prefix not repeated); the
    peer's words, when they came, win."""
    from aiordma.ops import Op, completion_error
    from aiordma.verbs import WCOpcode, WCStatus, WorkCompletion, WROpcode

    op = Op(None, None, "RDMA_READ of 1048576 bytes", int(WROpcode.IBV_WR_RDMA_READ))
    wc = WorkCompletion(7, WCStatus.IBV_WC_REM_OP_ERR, WCOpcode.IBV_WC_RDMA_READ)
    local = "IBV_WC_REM_OP_ERR: cross-memory READ of 1048576 bytes at 0x7f00 in the peer's process 42 failed"
    err = completion_error(op, wc, None, None, local)
    assert str(err) == (
        "IBV_WC_REM_OP_ERR: RDMA_READ of 1048576 bytes: "
        "cross-memory READ of 1048576 bytes at 0x7f00 in the peer's process 42 failed"
    )
    assert str(completion_error(op, wc, None, None, None)).endswith(": failed")
    told = completion_error(op, wc, None, "its QP is gone", local)
    assert str(told).endswith("the peer's NIC refused it: its QP is gone")
