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
