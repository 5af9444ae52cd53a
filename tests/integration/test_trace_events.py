"""The soft device's tracer events are one typed enumeration, the same from
both engines: a traced RDMA Write reports every step of its walk (WQE,
doorbell, lkey read, packet out, UDP send and receive, rkey check, DMA write,
ACK, CQE) as :class:`~aiordma.providers.soft.trace.TraceEvent` members, which
the walk-through (``aiordma demo``) reads."""

from __future__ import annotations

import threading

import pytest

import aiordma
from aiordma.providers.soft.device import SoftDevice
from aiordma.providers.soft.engine import native_status
from aiordma.providers.soft.trace import TraceEvent

from ..support.waiting import wait_until

ENGINES = ("python", "native") if native_status()[0] else ("python",)


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_traced_write_reports_every_step_as_a_trace_event(engine):
    seen: list[tuple[object, dict]] = []
    lock = threading.Lock()

    def tracer(event, **fields):
        with lock:
            seen.append((event, fields))

    server_dev = SoftDevice(engine=engine)
    client_dev = SoftDevice(engine=engine)
    try:
        mem = bytearray(4096)
        region = aiordma.register(mem, device=server_dev)

        async def handler(conn):
            await conn.wait_closed()

        server = await aiordma.start_server(
            handler, "127.0.0.1", 0, device=server_dev, expose={"m": region.exposed("rw")}
        )
        async with await aiordma.connect("127.0.0.1", server.port, device=client_dev) as conn:
            src = conn.register(bytearray(b"traced!" * 8))
            server_dev.set_tracer(tracer)
            client_dev.set_tracer(tracer)
            await conn.write(src, conn.remote("m")[0:56])
            await wait_until(lambda: bytes(mem[:7]) == b"traced!", "the write landed")
            client_dev.set_tracer(None)
            server_dev.set_tracer(None)
        server.close()
        await server.wait_closed()
        region.close()
    finally:
        client_dev.close()
        server_dev.close()
    kinds = [event for event, _ in seen]
    assert all(type(event) is TraceEvent for event in kinds), {type(e) for e in kinds}
    assert set(TraceEvent) <= set(kinds), set(TraceEvent) - set(kinds)
    wqe = next(fields for event, fields in seen if event is TraceEvent.WQE)
    assert wqe["npkts"] == 1 and "psn" in wqe


def test_the_events_are_strings_the_walk_through_can_print():
    assert TraceEvent.UDP_SEND == "udp_send" and str(TraceEvent.CQE) == "cqe"
    assert len({e.value for e in TraceEvent}) == len(TraceEvent) == 10
