"""The compiled core against its interpreted twin, operation by operation.

:mod:`aiordma._core` (extension types with C fields) and the interpreted classes
it replaces (:mod:`aiordma.window`, :mod:`aiordma.ops`, :mod:`aiordma.messages`)
must agree on everything a caller can see. Hypothesis drives both with the same
random sequence of operations and compares, after every step, the return values
and the whole visible state:

* the message window: credits spent and given back, owed credits taken, chunks of
  every kind arriving with credits in their immediate, messages consumed, the
  per-connection and the process-wide receive budgets;
* the send queue and the table of work requests in flight: single requests and
  chains posted (and refused by the device: a fault injected into the queue
  pair), completions in queue order, successful or failed (a failed chain member
  flushes the rest), ``ops()``, ``outstanding()``, ``release_all()``;
* the received-message queue: put, put back, waiters woken in order;
* the buffer pools (send buffers, atomics' result words): slots taken now and by
  waiting coroutines, released, refused when released twice.

The compiled core is built with the native engine; a build without it fails
these tests (``AIORDMA_CORE`` does not matter here: both are imported directly).
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiordma import memory, messages, ops, window
from aiordma.providers.base import SendFlags, SendWR, WCOpcode, WCStatus, WorkCompletion, WROpcode


def _compiled() -> Any:
    try:
        return importlib.import_module("aiordma._core")
    except ImportError as e:  # pragma: no cover - a broken build
        pytest.fail(f"the compiled core aiordma._core is not built ({e}): `scripts/bootstrap` builds it")


core = _compiled()
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------- the window ----

WINDOW_ATTRS = (
    "credits",
    "owed",
    "held",
    "threshold",
    "chunk_size",
    "budget",
    "buffered",
    "queued",
    "grant",
    "grant_max",
    "signal",
)


def window_state(w: Any) -> tuple:
    return (*(getattr(w, a) for a in WINDOW_ATTRS), w.credit_update_inflight, w.stats(), w.can_send_chunk())


window_ops = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.integers(0, 64), st.integers(0, 1 << 16), st.booleans()),
        st.tuples(st.just("spend")),
        st.tuples(st.just("give_back")),
        st.tuples(st.just("take_owed")),
        st.tuples(st.just("due"), st.booleans()),
        st.tuples(
            st.just("chunk"),
            st.sampled_from([window.K_MORE, window.K_LAST, window.K_CREDIT, window.K_CONTROL]),
            st.one_of(st.just(0), st.integers(0, 8), st.integers(0, window.CREDIT_MASK)),
            st.integers(0, 300),
            st.booleans(),  # STARVED: the peer took its last credit (credits that grow)
        ),
        st.tuples(st.just("consume")),
        st.tuples(st.just("leave")),
    ),
    max_size=60,
)


@SETTINGS
@given(
    slots=st.integers(4, 64),
    budget=st.integers(0, 2000),
    shared_limit=st.one_of(st.none(), st.integers(0, 3000)),
    initial=st.one_of(st.just(0), st.integers(4, 64)),
    steps=window_ops,
)
def test_message_window_matches_the_reference(
    slots: int, budget: int, shared_limit: int | None, initial: int, steps: list
) -> None:
    initial = min(initial, slots)  # (a grant that starts small, or 0: all of it from the start)
    shared = [None, None] if shared_limit is None else [window.ReceiveBudget(shared_limit) for _ in range(2)]
    a = window.MessageWindow(slots, budget, shared[0], initial)
    b = core.MessageWindow(slots, budget, shared[1], initial)
    queued: list[int] = []  # byte lengths of the complete messages queued (what consumed() is told)
    partial = 0
    for step in steps:
        name = step[0]
        if name == "start":
            results = [w.start(step[1], step[2], step[3]) for w in (a, b)]
        elif name == "spend":
            if not a.can_send_chunk():
                continue
            results = [w.spend() for w in (a, b)]
        elif name == "give_back":
            results = [w.give_back() for w in (a, b)]
        elif name == "take_owed":
            results = [w.take_owed() for w in (a, b)]
        elif name == "due":
            for w in (a, b):
                w.credit_update_inflight = step[1]
            results = [w.credit_update_due() for w in (a, b)]
        elif name == "chunk":
            kind, returned, n, starved = step[1], step[2], step[3], step[4]
            imm = (kind << 30) | returned | (window.STARVED if starved else 0)
            data = bytes(range(256)) * (n // 256) + bytes(range(n % 256))
            results = [w.on_chunk(imm, data) for w in (a, b)]
            if kind == window.K_MORE:
                partial += n
            elif kind == window.K_LAST:
                queued.append(partial + n)
                partial = 0
            elif kind == window.K_CONTROL:
                partial = 0
        elif name == "consume":
            if not queued:
                continue
            n = queued.pop(0)
            results = [w.consumed(n) for w in (a, b)]
        else:
            results = [w.leave_shared() for w in (a, b)]
        assert results[0] == results[1], step
        assert window_state(a) == window_state(b), step
    if shared_limit is not None:
        assert shared[0].buffered == shared[1].buffered


def test_message_window_refuses_what_the_reference_refuses() -> None:
    for cls in (window.MessageWindow, core.MessageWindow):
        with pytest.raises(ValueError, match="at least 4"):
            cls(3)
        with pytest.raises(ValueError, match="must not be negative"):
            cls(8, budget=-1)
        with pytest.raises(ValueError, match="initial grant"):
            cls(8, 1 << 20, None, 3)
        with pytest.raises(ValueError, match="initial grant"):
            cls(8, 1 << 20, None, 9)


# -------------------------------------------------------- the buffer table ----


@SETTINGS
@given(
    size=st.integers(1, 1 << 20),
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(0, 1 << 48), st.integers(0, 0xFFFFFFFF), st.integers(-1, 40)),
            st.tuples(st.just("truncate"), st.integers(-1, 200)),
            st.tuples(st.just("active"), st.integers(0, 200)),
            st.tuples(st.just("look"), st.integers(-2, 200)),
        ),
        max_size=40,
    ),
)
def test_buffer_table_matches_the_reference(size: int, steps: list) -> None:
    a, b = memory.BufferTable(size), core.BufferTable(size)
    for step in steps:
        results = []
        for t in (a, b):
            try:
                if step[0] == "add":
                    results.append(t.add(*step[1:]))
                elif step[0] == "truncate":
                    results.append(t.truncate(step[1]))
                elif step[0] == "active":
                    t.active = min(step[1], len(t))
                    results.append(None)
                else:
                    results.append((t.addr(step[1]), t.lkey(step[1])))
            except (ValueError, IndexError) as e:
                results.append(type(e))
        assert results[0] == results[1], step
        assert (len(a), a.active, a.size) == (len(b), b.active, b.size), step
        assert [(a.addr(i), a.lkey(i)) for i in range(len(a))] == [(b.addr(i), b.lkey(i)) for i in range(len(b))]


# ------------------------------------------------- the operation tracker ----


class RecordingQP:
    """The queue pair the trackers post to: it keeps what was posted, and refuses
    the next post when told to (fault injection: the device said no)."""

    def __init__(self) -> None:
        self.posted: list[list[SendWR]] = []
        self.refuse = False

    def post_send(self, wrs: Any) -> None:
        if self.refuse:
            self.refuse = False
            raise OSError("the device refused the work request (injected)")
        self.posted.append([wrs] if isinstance(wrs, SendWR) else list(wrs))


class Side:
    """One implementation: its send queue, tracker, queue pair, and what happened."""

    def __init__(self, mod: Any, tracker_mod: Any, depth: int, loop: asyncio.AbstractEventLoop) -> None:
        self.qp = RecordingQP()
        self.sq = mod.SendQueue(depth, loop)
        self.expects = 0
        self.tracker = tracker_mod.OperationTracker(self.qp, self.sq, self._expect)
        self.released: list[str] = []
        #: label -> the op object, and the wr_ids of each posted label in order
        self.ops: dict[str, ops.Op] = {}
        self.wr_ids: dict[str, list[int]] = {}
        self.label_of: dict[int, str] = {}

    def _expect(self) -> None:
        self.expects += 1

    def make_op(self, label: str, kind: int) -> ops.Op:
        op = ops.Op(None, lambda: self.released.append(label), f"op {label}", int(WROpcode.IBV_WR_RDMA_WRITE), kind)
        self.ops[label] = op
        return op


def _wr() -> SendWR:
    return SendWR(0, WROpcode.IBV_WR_RDMA_WRITE, [], send_flags=SendFlags.IBV_SEND_SIGNALED)


tracker_steps = st.lists(
    st.one_of(
        st.tuples(st.just("post"), st.sampled_from([ops.OP_OTHER, ops.OP_MESSAGE, ops.OP_CREDIT]), st.booleans()),
        st.tuples(st.just("chain"), st.integers(1, 5), st.booleans()),
        st.tuples(st.just("complete"), st.booleans()),
        st.tuples(st.just("unknown")),
        st.tuples(st.just("release_all")),
    ),
    max_size=50,
)


@SETTINGS
@given(depth=st.integers(1, 24), steps=tracker_steps)
def test_operation_tracker_matches_the_reference(depth: int, steps: list) -> None:
    loop = asyncio.new_event_loop()
    try:
        a = Side(ops, ops, depth, loop)
        b = Side(core, core, depth, loop)
        sides = (a, b)
        # what is in flight, oldest first: (label, index of the wr in its chain, chain length)
        in_flight: list[tuple[str, int, int]] = []
        failed_labels: set[str] = set()
        n = 0
        for step in steps:
            name = step[0]
            if name in ("post", "chain"):
                k = 1 if name == "post" else step[1]
                if a.sq.free < k:
                    continue
                n += 1
                label = f"{name}{n}"
                refuse = step[2]
                outcomes = []
                for side in sides:
                    side.sq.free -= k  # (what the caller's acquire does)
                    op = side.make_op(label, step[1] if name == "post" else ops.OP_OTHER)
                    side.qp.refuse = refuse
                    wrs = [_wr() for _ in range(k)]
                    try:
                        if name == "post":
                            side.tracker.post(wrs[0], op)
                        else:
                            side.tracker.post_chain(wrs, op)
                        outcomes.append("posted")
                        side.wr_ids[label] = [w.wr_id for w in wrs]
                        for w in wrs:
                            side.label_of[w.wr_id] = label
                    except OSError:
                        outcomes.append("refused")
                assert outcomes[0] == outcomes[1]
                if outcomes[0] == "posted":
                    in_flight.extend((label, i, k) for i in range(k))
            elif name == "complete":
                if not in_flight:
                    continue
                ok = step[1]
                label, i, k = in_flight[0]
                if ok and i < k - 1:
                    # unsignaled members complete silently: the chain's last one reports
                    continue
                in_flight.pop(0)
                returned = []
                for side in sides:
                    wr_id = side.wr_ids[label][i]
                    status = WCStatus.IBV_WC_SUCCESS if ok else WCStatus.IBV_WC_WR_FLUSH_ERR
                    op = side.tracker.complete(WorkCompletion(wr_id, status, WCOpcode.IBV_WC_RDMA_WRITE))
                    returned.append(
                        None
                        if op is None
                        else (
                            op.kind,
                            op.description(),
                            sorted(side.wr_ids[label].index(m) for m in (op.members or ())),
                        )
                    )
                assert returned[0] == returned[1], step
                if ok:
                    # a chain's signaled last retires every member before it
                    in_flight = [f for f in in_flight if f[0] != label]
                else:
                    failed_labels.add(label)
            elif name == "unknown":
                # a wr_id nobody posted (or one already retired): nothing happens
                for side in sides:
                    assert (
                        side.tracker.complete(
                            WorkCompletion(1 << 40, WCStatus.IBV_WC_SUCCESS, WCOpcode.IBV_WC_RDMA_WRITE)
                        )
                        is None
                    )
            else:
                for side in sides:
                    side.tracker.release_all()
                in_flight.clear()
            # the visible state agrees
            assert len(a.tracker) == len(b.tracker), step
            assert a.sq.free == b.sq.free, step
            assert a.expects == b.expects, step
            assert sorted(a.released) == sorted(b.released), step
            for kind in (ops.OP_OTHER, ops.OP_MESSAGE, ops.OP_CREDIT):
                assert a.tracker.outstanding(kind) == b.tracker.outstanding(kind), (step, kind)
            assert sorted(o.description() for o in a.tracker.ops()) == sorted(
                o.description() for o in b.tracker.ops()
            ), step
    finally:
        loop.close()


# ------------------------------------------------------------- the inbox ----


@pytest.mark.parametrize("impl", ["python", "compiled"])
async def test_inbox_hands_items_over_in_order_and_loses_none_to_cancellation(impl: str) -> None:
    """Waiters are woken in order with the item left in the queue; a waiter
    cancelled after it was woken passes its wake-up on (nothing is lost)."""
    Inbox = messages.Inbox if impl == "python" else core.Inbox
    loop = asyncio.get_running_loop()
    box = Inbox(loop)
    box.put(1)
    assert await box.get() == 1
    first = asyncio.create_task(box.get())
    second = asyncio.create_task(box.get())
    await asyncio.sleep(0)
    box.put("a")
    first.cancel()  # woken, cancelled before it ran: "a" goes to the second waiter
    await asyncio.sleep(0)
    assert await second == "a"
    assert first.cancelled()
    box.put("b")
    box.put_back("c")
    assert [await box.get(), await box.get()] == ["c", "b"]
    assert not box.items and not box.waiters


# ------------------------------------------------------ the buffer pools ----


class _Region:
    """A registered region as the pools see it (length, view, sge, close), over real
    memory registered with the soft device."""

    def __init__(self, nbytes: int) -> None:
        import aiordma

        self.r = aiordma.register(bytearray(nbytes), provider="soft")
        self.length = nbytes
        self.view = self.r.view

    def sge(self, offset: int, length: int) -> Any:
        return self.r.sge(offset, length)

    def close(self) -> None:
        self.r.close()


@pytest.mark.parametrize("seed", range(20))
async def test_buffer_pool_matches_the_reference(seed: int) -> None:
    """Slots taken now and by waiting coroutines, released, double-released: the
    compiled pool hands out the same slots in the same order as the interpreted one,
    wakes the same waiters, and refuses what it refuses."""
    import random

    rng = random.Random(seed)
    size, count = 16, rng.randint(1, 8)
    a = memory.BufferPool(_Region(size * count), size)
    b = core.BufferPool(_Region(size * count), size)
    assert a.count == b.count == count and a.free == b.free
    held: list[int] = []
    waiting: list[tuple[asyncio.Task, asyncio.Task]] = []
    for _ in range(60):
        action = rng.choice(["take", "take", "release", "wait", "bad", "cancel"])
        if action == "take":
            got = a.try_acquire(), b.try_acquire()
            assert got[0] == got[1]
            if got[0] is not None:
                held.append(got[0])
        elif action == "release" and held:
            slot = held.pop(rng.randrange(len(held)))
            a.release(slot)
            b.release(slot)
        elif action == "wait":
            waiting.append((asyncio.create_task(a.acquire()), asyncio.create_task(b.acquire())))
        elif action == "cancel" and waiting:
            for t in waiting.pop(rng.randrange(len(waiting))):
                t.cancel()
        elif action == "bad":
            slot = rng.choice([-1, count, *(s for s in a.free[:1])])
            for pool in (a, b):
                with pytest.raises(ValueError, match="not a taken slot"):
                    pool.release(slot)
        await asyncio.sleep(0)
        for ta, tb in [w for w in waiting if w[0].done() or w[1].done()]:
            await asyncio.sleep(0)
            assert ta.done() and tb.done()
            waiting.remove((ta, tb))
            if not ta.cancelled():
                assert not tb.cancelled() and ta.result() == tb.result()
                held.append(ta.result())
        assert a.free == b.free and a.waiting == b.waiting, action
        assert [bytes(p.view(s, 4)) for s in range(count) for p in (a,)] == [
            bytes(p.view(s, 4)) for s in range(count) for p in (b,)
        ]
    for ta, tb in waiting:
        ta.cancel()
        tb.cancel()
    await asyncio.gather(*(t for w in waiting for t in w), return_exceptions=True)
    a.close()
    b.close()
