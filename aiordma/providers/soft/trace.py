"""The soft device's tracer events: what each step of an RDMA operation's walk
reports to a tracer (``SoftDevice.tracer``), one enumeration for both engines
and for the walk-through that reads them (``aiordma demo``).

A tracer is called as ``tracer(event, **fields)``; ``event`` is a
:class:`TraceEvent` (a ``str`` enumeration, so it also compares equal to its
value). In the order of one RDMA Write's walk:

======================  =====================================================
event                   fields
======================  =====================================================
``WQE``                 ``qpn``, ``wr`` (the SendWR), ``psn``, ``npkts``:
                        a work request became a send-queue entry (step 1)
``DOORBELL``            ``qpn``, ``n``: the application rang the doorbell (2)
``LKEY_READ``           ``qpn``, ``wqe``, ``offset``, ``length``: the NIC read
                        local memory through the lkey (3)
``PACKET_OUT``          ``qpn``, ``pkt``: a request packet was built (4)
``UDP_SEND``            ``qpn``, ``pkt``, ``datagram``, ``flow``: a datagram
                        left for UDP port 4791 (5, and 8 for the ACK)
``UDP_RECV``            ``qpn``, ``pkt``, ``datagram``, ``flow``: one arrived (5)
``RKEY_CHECK``          ``qpn``, ``pkt``, ``ok``, ``why``: the responder checked
                        the rkey, range and rights (6)
``DMA_WRITE``           ``qpn``, ``pkt``, ``region``, ``offset``, ``length``:
                        the responder wrote the payload into memory (7)
``ACK_IN``              ``qpn``, ``pkt``: the requester took an ACK (8)
``CQE``                 ``wc``: a work completion was written to a CQ (8)
======================  =====================================================
"""

from __future__ import annotations

import enum

__all__ = ["TraceEvent"]


class TraceEvent(enum.StrEnum):
    """One kind of tracer event (see the module's table for its fields)."""

    WQE = "wqe"
    DOORBELL = "doorbell"
    LKEY_READ = "lkey_read"
    PACKET_OUT = "packet_out"
    UDP_SEND = "udp_send"
    UDP_RECV = "udp_recv"
    RKEY_CHECK = "rkey_check"
    DMA_WRITE = "dma_write"
    ACK_IN = "ack_in"
    CQE = "cqe"
