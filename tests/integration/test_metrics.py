"""The process's operation metrics (:mod:`aiordma.metrics`), the Prometheus collector
(:mod:`aiordma.prometheus`) and the health check (:mod:`aiordma.health`), through the
public API, over real connections on the soft device, with the compiled core and the
interpreted one (the reference), on asyncio and uvloop.

Counts are process-wide and only grow, so each test compares a snapshot before its
traffic with one after. Both ends run in this process: a send counts at the sender
(``send``) and at the receiver (``receive``)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import aiordma
import aiordma.prometheus
from aiordma import health, metrics
from aiordma.errors import RemoteAccessError
from aiordma.providers.soft.faults import LinkFaults
from aiordma.window import DEFAULT_PROCESS_RECV_BUDGET, set_process_recv_budget

from ..support.waiting import wait_until

CORES = ["compiled", "python"]


@pytest.fixture(params=CORES)
def core(request, monkeypatch):
    monkeypatch.setenv("AIORDMA_CORE", request.param)
    return request.param


@pytest.fixture
async def pair(core):
    """A connection to a server that reads every message (and answers none), and the server's memory."""
    mem = bytearray(1 << 16)
    region = aiordma.register(mem)
    received: list[bytes] = []

    async def handler(conn):
        async for msg in conn:
            received.append(msg)

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft", expose={"mem": region.exposed("rwa")})
    conn = await aiordma.connect("127.0.0.1", server.port, provider="soft")
    assert conn._core.name == core
    try:
        yield conn, received
    finally:
        await conn.close()
        server.close()
        await server.wait_closed()
        region.close()


def delta(before: dict[str, metrics.Counts], after: dict[str, metrics.Counts], kind: str) -> tuple[int, int, int, int]:
    a, b = after[kind], before[kind]
    return a.operations - b.operations, a.work_requests - b.work_requests, a.bytes - b.bytes, a.timed - b.timed


async def test_every_kind_of_operation_counts_once_with_its_bytes_and_latency(pair) -> None:
    conn, received = pair
    remote = conn.remote("mem")
    local = conn.register(bytearray(4096))
    before = metrics.snapshot()
    for i in range(20):
        await conn.write(local[0:64], remote[i * 64 : (i + 1) * 64])
    await conn.write(b"plain bytes", remote[0:11])  # the general path: a buffer to register
    for _ in range(7):
        await conn.read(remote[0:100])
    await conn.write_batch([(local[i * 8 : i * 8 + 8], remote[i * 8 : i * 8 + 8]) for i in range(16)])
    await conn.read_batch([(remote[0:32], local[0:32]), (remote[32:64], local[32:64])])
    await conn.fetch_and_add(remote[1024:1032], 1)
    await conn.compare_and_swap(remote[1024:1032], 1, 5)
    for i in range(9):
        await conn.send(bytes(50 + i))
    await conn.drain()
    await wait_until(lambda: len(received) == 9, "the server read every message")
    after = metrics.snapshot()
    assert delta(before, after, "write") == (22, 37, 20 * 64 + 11 + 16 * 8, 22)
    assert delta(before, after, "read") == (8, 9, 7 * 100 + 64, 8)
    assert delta(before, after, "atomic") == (2, 2, 16, 2)
    assert delta(before, after, "send") == (9, 9, sum(50 + i for i in range(9)), 9)
    # (receive: messages delivered, chunks, bytes; not timed)
    assert delta(before, after, "receive") == (9, 9, sum(50 + i for i in range(9)), 0)
    for kind in ("write", "read", "atomic", "send"):
        assert after[kind].latency_sum_ns > before[kind].latency_sum_ns
        assert not after[kind].failed or after[kind].failed == before[kind].failed


async def test_a_refused_write_counts_as_a_failed_work_request_named_by_status(pair) -> None:
    conn, _ = pair
    remote = conn.remote("mem")
    local = conn.register(bytearray(64))
    before = metrics.snapshot()
    forged = type(remote)(remote.addr, 64, remote.rkey ^ 0x5A5A)
    with pytest.raises(RemoteAccessError):
        await conn.write(local, forged)
    after = metrics.snapshot()
    failed = after["write"].failed.get(10, 0) - before["write"].failed.get(10, 0)  # IBV_WC_REM_ACCESS_ERR
    assert failed == 1
    assert delta(before, after, "write")[0] == 0  # not a completed operation
    registry = CollectorRegistry()
    aiordma.prometheus.register(registry)
    errors = _samples(registry, "aiordma_work_request_errors_total")
    assert errors[(("error", "RemoteAccessError"), ("op", "write"), ("status", "IBV_WC_REM_ACCESS_ERR"))] >= 1


async def test_timing_off_still_counts_but_leaves_the_histograms_alone(pair) -> None:
    conn, _ = pair
    remote = conn.remote("mem")
    local = conn.register(bytearray(64))
    before = metrics.snapshot()
    metrics.set_latency_timing(False)
    try:
        for _ in range(10):
            await conn.write(local, remote[0:64])
    finally:
        metrics.set_latency_timing(True)
    after = metrics.snapshot()
    assert delta(before, after, "write") == (10, 10, 640, 0)
    await conn.write(local, remote[0:64])
    assert delta(after, metrics.snapshot(), "write") == (1, 1, 64, 1)


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


async def test_the_collector_exposes_the_counts_devices_and_connections(pair) -> None:
    conn, received = pair
    remote = conn.remote("mem")
    local = conn.register(bytearray(64))
    registry = CollectorRegistry()
    assert aiordma.prometheus.register(registry) is aiordma.prometheus.register(registry)  # once per registry
    writes_before = _samples(registry, "aiordma_operations_total")[(("op", "write"),)]
    hist_before = _samples(registry, "aiordma_operation_duration_seconds_count")[(("op", "write"),)]
    for _ in range(25):
        await conn.write(local, remote[0:64])
    assert _samples(registry, "aiordma_operations_total")[(("op", "write"),)] == writes_before + 25
    assert _samples(registry, "aiordma_operation_duration_seconds_count")[(("op", "write"),)] == hist_before + 25
    buckets = _samples(registry, "aiordma_operation_duration_seconds_bucket")
    inf = buckets[(("le", "+Inf"), ("op", "write"))]
    assert inf == hist_before + 25
    write_buckets = sorted((float(dict(k)["le"]), v) for k, v in buckets.items() if dict(k)["op"] == "write")
    assert [v for _, v in write_buckets] == sorted(v for _, v in write_buckets)  # cumulative
    states = _samples(registry, "aiordma_connections")
    assert states[(("state", "open"),)] >= 2  # this connection's two ends
    label = f"soft:{conn.device.name}@{conn.device.address[0]}:{conn.device.address[1]}"
    sent = _samples(registry, "aiordma_device_sent_bytes_total")
    assert sent[(("device", label), ("provider", "soft"))] > 25 * 64
    registered = _samples(registry, "aiordma_registered_memory_bytes")
    assert registered[(("device", label), ("provider", "soft"))] >= 64


async def test_serve_answers_metrics_and_health_over_http(pair) -> None:
    conn, _ = pair
    with aiordma.prometheus.serve(0) as server:
        loop = asyncio.get_running_loop()
        url = f"http://127.0.0.1:{server.port}"
        body = await loop.run_in_executor(None, lambda: urllib.request.urlopen(url + "/metrics").read().decode())
        assert "aiordma_operations_total" in body and "process_cpu_seconds_total" in body
        reply = await loop.run_in_executor(None, lambda: urllib.request.urlopen(url + "/health"))
        report = json.loads(reply.read())
        assert reply.status == 200 and report["healthy"] is True
        assert {c["name"] for c in report["checks"]} >= {"connections", "receive budget"}

        def missing() -> int:
            try:
                urllib.request.urlopen(url + "/nothing")
            except urllib.error.HTTPError as e:
                return e.code
            return 200

        assert await loop.run_in_executor(None, missing) == 404


async def test_health_says_which_connection_is_stuck(core) -> None:
    """With ``ack_timeout=0`` the transport waits for an ACK forever: a write whose packets
    the link drops stays in flight, and the check names the connection."""
    mem = bytearray(4096)
    region = aiordma.register(mem)

    async def handler(conn):
        await conn.wait_closed()

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft", expose={"mem": region.exposed("rw")})
    conn = await aiordma.connect("127.0.0.1", server.port, provider="soft", ack_timeout=0)
    device = conn.device
    try:
        assert conn.transport_timeout == float("inf")
        local = conn.register(bytearray(64))
        await conn.write(local, conn.remote("mem")[0:64])
        assert conn.oldest_operation_age is None
        assert health.check(stuck_after=0.2).healthy
        device.faults = LinkFaults(drop=1.0)
        write = asyncio.ensure_future(conn.write(local, conn.remote("mem")[0:64]))
        await asyncio.sleep(0.4)
        assert not write.done()
        assert conn.oldest_operation_age is not None and conn.oldest_operation_age >= 0.3
        report = health.check(stuck_after=0.2)
        assert not report.healthy
        (problem,) = report.problems
        assert problem.name == "connections" and f"qpn=0x{conn.qp.qp_num:06x}" in problem.detail
        assert health.check(stuck_after=60).healthy  # not past a longer limit
    finally:
        device.faults = None
        conn.abort()
        with pytest.raises(aiordma.ConnectionClosedError):
            await write
        server.close()
        await server.wait_closed()
        region.close()


async def test_health_says_when_the_receive_budget_is_exhausted(core) -> None:
    """Messages nobody reads fill the process-wide receive budget: the check says so,
    and is healthy again once the application reads them."""
    server_conns: list[aiordma.Connection] = []

    async def handler(conn):
        server_conns.append(conn)
        await conn.wait_closed()

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft")
    conn = await aiordma.connect("127.0.0.1", server.port, provider="soft")
    set_process_recv_budget(1000)
    try:
        for _ in range(4):
            await conn.send(bytes(400))
        await wait_until(lambda: not health.check().healthy, "the budget filled")
        (problem,) = health.check().problems
        assert problem.name == "receive budget" and "is the application reading" in problem.detail
        await wait_until(lambda: server_conns, "the server's handler started")
        for _ in range(4):
            assert await server_conns[0].recv() == bytes(400)
        assert health.check().healthy
    finally:
        set_process_recv_budget(DEFAULT_PROCESS_RECV_BUDGET)
        await conn.close()
        server.close()
        await server.wait_closed()
