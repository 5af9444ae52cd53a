"""The message window: credits, chunks and reassembly of two-sided messages.

Sans-IO: no event loop, no device, no clock. :class:`~aiordma.Connection`
feeds it what its completions say and asks it what may be posted; the unit
tests drive it directly.

How messages travel
-------------------
A message is one or more ``IBV_WR_SEND_WITH_IMM`` chunks of at most
``chunk_size`` bytes (the smaller of both sides' receive buffers), each
landing in one receive buffer the peer posted. The 32-bit immediate carries

* the chunk kind in bits 31-30: ``MORE`` (a message continues), ``LAST`` (a
  message ends here), ``CREDIT`` (a credit update, no payload) and
  ``CONTROL`` (the last chunk of a control message, see
  :meth:`~aiordma.Connection.send_control`), and
* in bits 23-0, how many receive buffers the sender reposted since it last
  said so: the credits it returns;
* bit 29, ``STARVED`` (only toward a peer that offered ``msg-credits-v2``):
  this chunk took the sender's last spendable credit, so its sender would
  send more if it could.

Credits
-------
A sender may only send into a receive buffer the peer posted, or the peer's
NIC answers with an RNR NAK. ``credits`` starts at the peer's number of
receive buffers; a chunk spends one. A data or control chunk never spends
the last credit: that one is kept for a credit update, which is what lets
two sides that have both run dry hand credits back (a credit update itself
needs one credit and returns at least ``threshold``, so credit updates
never answer each other).

Credits that grow (``msg-credits-v2``)
--------------------------------------
Where the receive buffers behind the credits are the device's (a shared
receive queue), a receiver does not hand a peer all it may ever use: it
starts it with ``initial`` credits (its *grant*) and grows the grant with the
peer's traffic, up to ``recv_slots``. A sender marks the chunk that takes its
last spendable credit ``STARVED``; a receiver that sees one, and is not
holding credits back for its application, doubles the grant (at most to
``recv_slots``) and owes the peer the difference at once, so a sender that
keeps its window full reaches the full window after a few round trips and
then sends as fast as with fixed credits. An idle connection, or one that
sends a message at a time, keeps the initial grant. The threshold of credit
returns follows the grant (half of it, at least 2). Nothing else changes:
credits are counted as before, and a peer that never sets ``STARVED``
simply keeps its initial grant. Credits then mean "the peer may send": the
buffers are shared, and a receiver whose device runs short answers with an
RNR NAK, which every aiordma queue pair retries without limit
(``rnr_retry`` 7), so a busy receiver slows its senders and fails none.

Receive budget
--------------
Credits bound what is on the wire, not what a receiver holds: a receiver
copies each chunk out of its receive buffer and reposts the buffer at once.
So a receiver whose application does not call ``recv()`` would queue
messages without limit. The window therefore returns the credit of a data
chunk only while the bytes queued for the application stay within
``budget``; past it, credits are *held* until the application consumes a
message (``consumed``), and a sender facing a slow receiver runs out of
credits and waits, as a TCP writer waits on a full window. The first
message is never held back (a message larger than the budget still
arrives), so memory is bounded by the budget plus one message plus the
chunks in flight.

Beside each connection's budget, every window of the process shares one
:class:`ReceiveBudget` (:data:`PROCESS_RECV_BUDGET`, 1 GiB by default, set
with :func:`aiordma.set_process_recv_budget`): past its limit, credits are
held too, so a thousand slow readers cannot queue a thousand per-connection
budgets. It holds back the same way (the senders wait; nothing fails or is
dropped), and each connection still gets its first queued message.
"""

from __future__ import annotations

from typing import Any

#: chunk kinds (immediate bits 31-30)
K_MORE, K_LAST, K_CREDIT, K_CONTROL = 0, 1, 2, 3
#: credits returned (immediate bits 23-0)
CREDIT_MASK = 0xFFFFFF
#: immediate bit 29: the chunk took its sender's last spendable credit (msg-credits-v2)
STARVED = 1 << 29
IMM_LAST = K_LAST << 30
#: default receive budget: bytes of messages queued for the application
DEFAULT_RECV_BUDGET = 32 << 20
#: default process-wide receive budget (every connection's queued messages together)
DEFAULT_PROCESS_RECV_BUDGET = 1 << 30


class ReceiveBudget:
    """Bytes of messages queued for the application by several windows together,
    and the limit past which they hold their credits back."""

    __slots__ = ("buffered", "limit")

    def __init__(self, limit: int = DEFAULT_PROCESS_RECV_BUDGET) -> None:
        self.limit = check_budget(limit, "the process-wide receive budget")
        self.buffered = 0

    def over(self) -> bool:
        return self.buffered > self.limit


def check_budget(nbytes: int, what: str) -> int:
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"{what} must be a number of bytes >= 0, got {nbytes!r}")
    return nbytes


#: the budget every connection of this process shares
PROCESS_RECV_BUDGET = ReceiveBudget()


def set_process_recv_budget(nbytes: int) -> None:
    """Bound the bytes of small messages (below ``large_message_threshold``;
    large ones are pulled only when read) that all of this process's
    connections together hold queued for the application (default 1 GiB).
    Past it, receivers hold their credits back and senders wait, as they do
    past one connection's ``recv_budget``; nothing fails or is dropped."""
    PROCESS_RECV_BUDGET.limit = check_budget(nbytes, "the process-wide receive budget")


class MessageWindow:
    """Credit and reassembly state of one connection (both directions)."""

    __slots__ = (
        "_parts",
        "_parts_bytes",
        "budget",
        "buffered",
        "chunk_size",
        "credit_update_inflight",
        "credits",
        "grant",
        "grant_max",
        "grants_grown",
        "held",
        "owed",
        "queued",
        "shared",
        "signal",
        "starved_marks",
        "threshold",
    )

    def __init__(
        self,
        recv_slots: int,
        budget: int = DEFAULT_RECV_BUDGET,
        shared: ReceiveBudget | None = None,
        initial: int = 0,
    ) -> None:
        if recv_slots < 4:
            raise ValueError(
                "recv_buffers must be at least 4: the peer keeps its last credit for credit updates, and "
                "credits are returned in batches of recv_buffers // 2 (at least 2)"
            )
        if budget < 0:
            raise ValueError(f"the receive budget must not be negative, got {budget}")
        if initial and not 4 <= initial <= recv_slots:
            raise ValueError(f"the initial grant of credits must be 4 .. recv_buffers ({recv_slots}), got {initial}")
        #: send credits: receive buffers the peer has posted for us
        self.credits = 0
        #: receive buffers reposted whose credits the peer has not been told about
        self.owed = 0
        #: credits of data chunks held back because the application is behind
        self.held = 0
        #: the credits the peer may hold (what it started with plus what we added), and
        #: the most it may grow to (initial 0: all of recv_slots from the start)
        self.grant_max = recv_slots
        self.grant = initial or recv_slots
        # Return credits once half the grant was consumed: at least 2, so that a
        # lone credit update never triggers one in reply (no credit ping-pong), and
        # at most grant - 1, the most a blocked peer can have used.
        self.threshold = max(2, self.grant // 2)
        #: mark the chunk that takes our last spendable credit STARVED (the peer grows grants)
        self.signal = False
        #: chunks this side sent marked STARVED (it ran short of credits), and the times
        #: it doubled the peer's grant on such a mark: the rule, counted
        self.starved_marks = 0
        self.grants_grown = 0
        self.chunk_size = 0
        self.budget = budget
        #: bytes of data chunks received and not yet consumed by the application
        self.buffered = 0
        #: complete messages received and not yet consumed
        self.queued = 0
        #: a credit update is posted and not yet completed (at most one at a time)
        self.credit_update_inflight = False
        self._parts: list[bytes] = []
        self._parts_bytes = 0
        #: the budget shared with the process's other connections (None: this one's alone)
        self.shared = shared

    def start(self, peer_slots: int, chunk_size: int, signal: bool = False) -> None:
        """The peer posted ``peer_slots`` receive buffers (or grants that many credits);
        chunks are at most ``chunk_size`` bytes. ``signal``: the peer grows its grant
        when a chunk says ``STARVED`` (it offered ``msg-credits-v2``)."""
        self.credits = peer_slots
        self.chunk_size = chunk_size
        self.signal = signal

    # ------------------------------------------------------------ send ----
    def can_send_chunk(self) -> bool:
        """A data or control chunk may go out now (it never takes the last credit)."""
        return self.credits >= 2

    def spend(self) -> None:
        """A chunk (data, control or a Write with immediate) takes a credit: call only
        when :meth:`can_send_chunk` said so, and :meth:`give_back` it if the chunk is
        not posted after all."""
        self.credits -= 1

    def give_back(self) -> None:
        """A credit spent for a chunk that was never posted (its sender gave up)."""
        self.credits += 1

    def take_owed(self) -> int:
        """The immediate's credit bits for the next chunk, taken after its credit was
        spent: the credits to return (then forgotten), and ``STARVED`` when that
        credit was the last spendable one and the peer grows grants."""
        n = self.owed
        if n > CREDIT_MASK:
            n = CREDIT_MASK
        self.owed -= n
        if self.signal and self.credits < 2:
            self.starved_marks += 1
            return n | STARVED
        return n

    def credit_update_due(self) -> bool:
        """Enough credits are owed that a credit update should go out now, and one can."""
        return self.owed >= self.threshold and not self.credit_update_inflight and self.credits >= 1

    # --------------------------------------------------------- receive ----
    def on_chunk(self, imm: int, data: bytes) -> tuple[int, Any]:
        """A chunk arrived with immediate ``imm`` and payload ``data``; its
        receive buffer was reposted. Returns ``(kind, item)``: for ``K_LAST``
        the whole message (``bytes``, or a list of ``bytes`` parts when it took
        several chunks), for ``K_CONTROL`` the control payload (``bytes``),
        otherwise ``None``. Returned credits are added to :attr:`credits`."""
        kind = imm >> 30
        returned = imm & CREDIT_MASK
        if returned:
            self.credits += returned
        if kind == K_LAST or kind == K_MORE:
            n = len(data)
            self.buffered += n
            shared = self.shared
            if shared is not None:
                shared.buffered += n
            if self.queued and (self.buffered > self.budget or (shared is not None and shared.buffered > shared.limit)):
                self.held += 1
            else:
                self.owed += 1
                if imm & STARVED and self.grant < self.grant_max and not self.held:
                    self.grow()
            if kind == K_MORE:
                self._parts.append(data)
                self._parts_bytes += n
                return K_MORE, None
            self.queued += 1
            parts = self._parts
            if parts:
                parts.append(data)
                self._parts = []
                self._parts_bytes = 0
                return K_LAST, parts
            return K_LAST, data
        self.owed += 1
        if kind == K_CONTROL:
            if imm & STARVED and self.grant < self.grant_max and not self.held:
                self.grow()
            parts = self._parts
            if parts:
                # the chunks before were counted as message bytes: they were a control message
                self.buffered -= self._parts_bytes
                if self.shared is not None:
                    self.shared.buffered -= self._parts_bytes
                parts.append(data)
                data = b"".join(parts)
                self._parts = []
                self._parts_bytes = 0
            return K_CONTROL, data
        return kind, None

    def grow(self) -> None:
        """The peer ran out of credits: double its grant (at most to ``grant_max``) and
        owe it the difference."""
        extra = min(self.grant, self.grant_max - self.grant)
        self.grant += extra
        self.owed += extra
        self.threshold = max(2, self.grant // 2)
        if extra:
            self.grants_grown += 1

    def consumed(self, nbytes: int) -> None:
        """The application took a message of ``nbytes`` out of the queue."""
        self.buffered -= nbytes
        self.queued -= 1
        shared = self.shared
        if shared is not None:
            shared.buffered -= nbytes
        if self.held and (
            not self.queued or (self.buffered <= self.budget and (shared is None or shared.buffered <= shared.limit))
        ):
            self.owed += self.held
            self.held = 0

    def leave_shared(self) -> None:
        """The connection is over: what it still has queued no longer counts
        against the shared budget (it may still be read, and is then counted here only)."""
        shared, self.shared = self.shared, None
        if shared is not None:
            shared.buffered -= self.buffered

    def stats(self) -> dict[str, int]:
        return {
            "send_credits": self.credits,
            "recv_grant": self.grant,
            "recv_grant_grown": self.grants_grown,
            "send_starved_marks": self.starved_marks,
            "credits_owed": self.owed,
            "credits_held": self.held,
            "recv_buffered_bytes": self.buffered,
            "recv_queued_messages": self.queued,
            "recv_budget": self.budget,
            "process_recv_buffered_bytes": self.shared.buffered if self.shared is not None else 0,
        }
