"""The message window (sans-IO): credits, reassembly and the receive budget."""

from __future__ import annotations

import pytest

from aiordma.window import CREDIT_MASK, K_CONTROL, K_CREDIT, K_LAST, K_MORE, MessageWindow


def imm(kind: int, credits: int = 0) -> int:
    return (kind << 30) | credits


def test_needs_four_receive_buffers():
    with pytest.raises(ValueError, match="at least 4"):
        MessageWindow(3)
    with pytest.raises(ValueError, match="negative"):
        MessageWindow(8, budget=-1)


def test_the_last_credit_is_kept_for_credit_updates():
    w = MessageWindow(8)
    w.start(peer_slots=2, chunk_size=1024)
    assert w.can_send_chunk()
    w.credits -= 1
    assert not w.can_send_chunk()  # one left: only a credit update may use it
    w.owed = w.threshold
    assert w.credit_update_due()
    w.credit_update_inflight = True
    assert not w.credit_update_due()  # one at a time


def test_threshold_never_lets_credit_updates_answer_each_other():
    assert MessageWindow(4).threshold == 2
    assert MessageWindow(16).threshold == 8


def test_returned_credits_and_owed_credits():
    w = MessageWindow(8)
    w.start(4, 1024)
    kind, item = w.on_chunk(imm(K_LAST, 3), b"hi")
    assert (kind, item) == (K_LAST, b"hi")
    assert w.credits == 7 and w.owed == 1
    assert w.on_chunk(imm(K_CREDIT, 2), b"") == (K_CREDIT, None)
    assert w.credits == 9 and w.owed == 2  # a credit update's slot is owed back too
    assert w.take_owed() == 2 and w.owed == 0
    w.owed = CREDIT_MASK + 5
    assert w.take_owed() == CREDIT_MASK and w.owed == 5  # 24 bits per immediate


def test_reassembly_and_control_messages():
    w = MessageWindow(8)
    w.start(4, 4)
    assert w.on_chunk(imm(K_MORE), b"abcd") == (K_MORE, None)
    assert w.on_chunk(imm(K_MORE), b"efgh") == (K_MORE, None)
    kind, parts = w.on_chunk(imm(K_LAST), b"ij")
    assert kind == K_LAST and b"".join(parts) == b"abcdefghij"
    assert w.buffered == 10 and w.queued == 1
    # a control message's chunks are not message bytes
    w.on_chunk(imm(K_MORE), b"\x81\xa2")
    assert w.on_chunk(imm(K_CONTROL), b"op") == (K_CONTROL, b"\x81\xa2op")
    assert w.buffered == 10 and w.queued == 1
    w.consumed(10)
    assert w.buffered == 0 and w.queued == 0


def test_budget_holds_credits_until_the_application_consumes():
    w = MessageWindow(8, budget=100)
    w.start(8, 64)
    w.on_chunk(imm(K_LAST), b"x" * 60)
    assert (w.owed, w.held) == (1, 0)
    w.on_chunk(imm(K_LAST), b"x" * 60)  # 120 queued > 100 with a message waiting: held
    w.on_chunk(imm(K_MORE), b"x" * 60)
    assert (w.owed, w.held, w.buffered, w.queued) == (1, 2, 180, 2)
    w.consumed(60)  # still 120 > 100 and a message queued: keep holding
    assert (w.owed, w.held) == (1, 2)
    w.consumed(60)  # only a partial message left: release
    assert (w.owed, w.held) == (3, 0)


def test_a_message_larger_than_the_budget_still_arrives():
    w = MessageWindow(4, budget=10)
    w.start(4, 8)
    for _ in range(5):
        w.on_chunk(imm(K_MORE), b"y" * 8)
    kind, parts = w.on_chunk(imm(K_LAST), b"y" * 8)
    assert kind == K_LAST and sum(map(len, parts)) == 48
    assert w.held == 0 and w.owed == 6  # nothing was queued ahead of it: never held


def test_a_shared_budget_holds_credits_across_windows() -> None:
    """Two windows share a 100-byte budget: once their queued bytes together pass
    it, a window holds the credits of its later chunks (its first queued message is
    never held), and consuming gives them back."""
    from aiordma.window import ReceiveBudget

    shared = ReceiveBudget(100)
    a, b = MessageWindow(8, budget=10_000, shared=shared), MessageWindow(8, budget=10_000, shared=shared)
    a.on_chunk(K_LAST << 30, b"x" * 80)
    b.on_chunk(K_LAST << 30, b"y" * 80)  # b's first message: never held, though the budget is passed
    assert (a.owed, a.held, b.owed, b.held) == (1, 0, 1, 0)
    assert shared.buffered == 160
    a.on_chunk(K_LAST << 30, b"x" * 10)  # a has a message queued and the process is over budget
    assert (a.owed, a.held) == (1, 1)
    b.consumed(80)
    assert shared.buffered == 90
    a.consumed(80)  # a's queue still holds one message, and the process is under budget again
    assert (a.owed, a.held) == (2, 0)
    a.leave_shared()
    assert shared.buffered == 0
    a.consumed(10)  # read after it left: counted only in its own window
    assert shared.buffered == 0 and a.buffered == 0


def test_a_window_alone_shares_nothing() -> None:
    w = MessageWindow(8, budget=10)
    assert w.shared is None
    w.on_chunk(K_LAST << 30, b"x" * 20)
    w.leave_shared()
    assert w.stats()["process_recv_buffered_bytes"] == 0
