"""What a connection tells the protocol layered on it (streams, integrations).

A :class:`~aiordma.Connection` carries messages for the application
(``send``/``recv``) and, for a protocol built on top of it (the byte streams
of :mod:`aiordma.stream`, a framework's transport), three kinds of events,
delivered as small immutable objects to the handler set with
:meth:`Connection.set_event_handler` (the h11 / aioquic shape: typed events,
not hook attributes):

* :class:`ImmediateReceived` — an ``RDMA_WRITE_WITH_IMM`` landed in this
  side's memory (``IBV_WC_RECV_RDMA_WITH_IMM``); the handler may consume it
  (return ``True``), otherwise it is queued for
  :meth:`Connection.recv_immediate`;
* :class:`ControlReceived` — a control message (a small msgpack map) the
  peer sent with :meth:`Connection.send_control`, in order with its messages
  and writes;
* :class:`ConnectionLost` — the connection is over (closed by either side,
  the peer died, or the queue pair went to ``IBV_QPS_ERR``); ``error`` says why.

The connection's lifecycle is :class:`ConnectionState`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ImmediateReceived:
    """A Write-with-immediate notification: the peer RDMA-wrote ``length`` bytes
    into memory it had been given, with 32-bit immediate data ``value``.

    An event handler gets it as an event; ``conn.recv_immediate()`` returns the
    same object (``aiordma.Immediate`` is another name for this class)."""

    value: int
    length: int


@dataclass(frozen=True, slots=True)
class ControlReceived:
    """A control message from the peer (a msgpack map, e.g. ``{"op": "stream_eof"}``)."""

    message: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ConnectionLost:
    """The connection ended; ``error`` is what every later operation raises."""

    error: BaseException


ConnectionEvent = ImmediateReceived | ControlReceived | ConnectionLost


class ConnectionState(enum.Enum):
    """Where a connection is in its life.

    ``OPEN``: usable. ``CLOSING``: :meth:`~aiordma.Connection.close` is
    flushing. ``LOST``: it ended without a local close (the peer closed or
    died, or the queue pair failed); ``Connection.error`` says why, and
    :meth:`~aiordma.Connection.recv` still returns what arrived before.
    ``CLOSED``: torn down, every resource released.
    """

    OPEN = "open"
    CLOSING = "closing"
    LOST = "lost"
    CLOSED = "closed"
