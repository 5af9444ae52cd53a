"""Metrics and the health check on kernel Soft-RoCE (rxe0 in scripts/rxe-vm, pyverbs provider).

The collector reads a kernel device's counters from sysfs (its port counters, in 4-byte
words for the data ones, and its ``hw_counters``): after known traffic over rxe0 the
series must have moved by at least what was sent, and the operation counts of the
per-operation core by exactly what was posted. The health check finds the port active."""

from __future__ import annotations

import os

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import aiordma
import aiordma.prometheus
from aiordma import health, metrics

pytestmark = pytest.mark.rxe

T = 30  # per-step timeout (s): TCG is slow
DEVICE = os.environ.get("AIORDMA_RXE_DEVICE") or None
WRITES = 200


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_kernel_device_series_move_with_traffic_and_the_port_is_healthy() -> None:
    device = aiordma.get_device("pyverbs", DEVICE)
    labels = (("device", f"pyverbs:{device.name}"), ("provider", "pyverbs"))
    registry = CollectorRegistry()
    aiordma.prometheus.register(registry)
    mem = bytearray(1 << 16)
    region = aiordma.register(mem, device=device)

    async def handler(conn):
        async for _ in conn:
            pass

    server = await aiordma.start_server(handler, "127.0.0.1", 0, device=device, expose={"mem": region.exposed("rw")})
    try:
        async with await aiordma.connect("127.0.0.1", server.port, device=device, timeout=T) as conn:
            local = conn.register(bytearray(4096))
            before, counts_before = _samples(registry), metrics.snapshot()
            for i in range(WRITES):
                await conn.write(local, conn.remote("mem")[i * 64 : i * 64 + 4096])
            after, counts_after = _samples(registry), metrics.snapshot()
            assert counts_after["write"].operations - counts_before["write"].operations == WRITES
            assert counts_after["write"].bytes - counts_before["write"].bytes == WRITES * 4096
            assert counts_after["write"].timed - counts_before["write"].timed == WRITES

            def moved(name: str) -> float:
                return after[(name, labels)] - before.get((name, labels), 0)

            # rxe has no port counters (no MAD interface): its packets come from its hw_counters
            # (sent_pkts, rcvd_pkts), and over loopback it sends and receives every request
            # (4 KiB: at least one packet each at any MTU up to 4096) and every ACK
            assert moved("aiordma_device_sent_packets_total") >= WRITES
            assert moved("aiordma_device_received_packets_total") >= WRITES
            hw = {dict(k[1])["counter"] for k in after if k[0] == "aiordma_device_hw_counter_total"}
            assert {"link_downed", "rdma_sends"} <= hw, hw  # rxe's own names, passed on
            assert ("aiordma_device_duplicate_requests_total", labels) in after  # rxe's duplicate_request
            assert after[("aiordma_registered_memory_bytes", labels)] >= len(mem) + 4096
            check = health.check_device(device)
            assert check.ok and "IBV_PORT_ACTIVE" in check.detail
            assert health.check().healthy
    finally:
        server.close()
        await server.wait_closed()
        region.close()
