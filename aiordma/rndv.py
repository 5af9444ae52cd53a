"""Large messages without bounce copies: the rendezvous ("rndv") protocol.

Small messages travel as SEND chunks through the peer's receive buffers
(:mod:`aiordma.window`): a copy into registered send buffers, a copy out of
the receive buffers. For a large message those copies cost more than the
network, so above ``large_message_threshold`` bytes :meth:`Connection.send`
uses the "get" rendezvous of UCX and MPI implementations instead:

1. the sender registers the message where it lies (``REMOTE_READ`` only,
   exactly its bytes; read-only buffers such as ``bytes`` work) and sends a
   control message ``{"op": "rndv", "id", "buf": [addr, length, rkey]}``, in
   order with its other messages;
2. the receiver's :meth:`~Connection.recv_into` (or :meth:`~Connection.recv`)
   RDMA-Reads the bytes straight into the destination — a registered region,
   or any writable buffer registered for the occasion — with no copy;
3. the receiver answers ``{"op": "rndv_done", "id"}``; the registration goes
   back to the sender's cache.

A ``send`` of a writable buffer returns once the peer has pulled the message
(the buffer may then be reused); a ``send`` of ``bytes``, which cannot change,
returns once it is announced, and at most ``large_send_window`` bytes of such
messages wait to be pulled. Either way a receiver that does not read holds the
sender back without buffering anything itself: the natural flow control of a
pull protocol.
Both sides must offer the ``msg-rndv-v1`` capability (every aiordma of this
version does); otherwise large messages go as chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .memory import RemoteBuffer

#: messages of at least this many bytes are pulled by RDMA Read (connect(..., large_message_threshold=))
DEFAULT_LARGE_THRESHOLD = 256 * 1024
#: bytes of immutable large messages (``bytes``) announced and not yet pulled before send() waits
DEFAULT_SEND_WINDOW = 64 << 20
#: the capability both sides must offer
CAPABILITY = "msg-rndv-v1"
#: the largest RDMA Read the receiver posts for one piece of a large message
READ_PIECE = 8 << 20
#: control operations of the protocol (reserved: not for send_control)
OPS = frozenset({"rndv", "rndv_done"})


@dataclass(frozen=True, slots=True)
class LargeMessage:
    """A large message the peer announced, waiting in the receive queue."""

    msg_id: int
    remote: RemoteBuffer

    @property
    def nbytes(self) -> int:
        return self.remote.length


def announcement(msg_id: int, addr: int, length: int, rkey: int) -> dict[str, Any]:
    return {"op": "rndv", "id": msg_id, "buf": [addr, length, rkey]}


def parse_announcement(msg: dict[str, Any]) -> LargeMessage:
    """Validate the peer's ``rndv`` control message (a lying peer gets a clear ValueError)."""
    msg_id = msg.get("id")
    if not isinstance(msg_id, int) or isinstance(msg_id, bool) or not 0 <= msg_id < 1 << 63:
        raise ValueError(f"invalid large-message id {msg_id!r}")
    remote = RemoteBuffer.from_wire(msg.get("buf"), None)
    if remote.length == 0:
        raise ValueError("a large message of 0 bytes")
    return LargeMessage(msg_id, remote)


def pieces(length: int, piece: int = READ_PIECE) -> list[tuple[int, int]]:
    """``(offset, length)`` of the RDMA Reads that fetch ``length`` bytes."""
    return [(off, min(piece, length - off)) for off in range(0, length, piece)]
