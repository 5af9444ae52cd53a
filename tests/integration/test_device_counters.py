"""Device byte counters: what went over the soft device's wire, on both engines."""

from __future__ import annotations

import asyncio

import pytest

import aiordma
from aiordma.providers import open_device
from aiordma.providers.soft.engine import native_status

from ..support.waiting import wait_until

ENGINES = ["python", "native"] if native_status()[0] else ["python"]


@pytest.mark.parametrize("engine", ENGINES)
async def test_tx_and_rx_bytes_count_every_datagram(engine: str) -> None:
    server_dev, client_dev = open_device("soft", engine=engine), open_device("soft", engine=engine)

    async def echo(conn: aiordma.Connection) -> None:
        async for msg in conn:
            await conn.send(msg)

    server = await aiordma.start_server(echo, "127.0.0.1", 0, device=server_dev)
    try:
        before_c, before_s = client_dev.counters, server_dev.counters
        payload = 200_000
        async with await aiordma.connect("127.0.0.1", server.port, device=client_dev) as conn:
            for _ in range(5):
                await conn.send(b"b" * payload)
                assert await conn.recv() == b"b" * payload

        def delta(dev, before, name):
            return dev.counters.get(name, 0) - before.get(name, 0)

        # loopback loses nothing: once the last ACKs have landed, what one side sent the other received
        await wait_until(
            lambda: (
                delta(server_dev, before_s, "tx_bytes") == delta(client_dev, before_c, "rx_bytes")
                and delta(client_dev, before_c, "tx_bytes") == delta(server_dev, before_s, "rx_bytes")
            ),
            "every datagram sent was counted as received",
        )
        sent = delta(client_dev, before_c, "tx_bytes")
        # every payload byte crossed once each way, inside RoCEv2 datagrams (BTH, ICRC, ...)
        assert sent >= 5 * payload and delta(server_dev, before_s, "rx_bytes") >= 5 * payload
        assert delta(server_dev, before_s, "tx_bytes") >= 5 * payload
        assert sent >= delta(client_dev, before_c, "tx_packets") * 16  # at least a BTH and an ICRC each
    finally:
        server.close()
        await server.wait_closed()
        client_dev.close()
        server_dev.close()


@pytest.mark.skipif(not native_status()[0], reason="the native engine is not built")
async def test_requests_resumed_together_leave_during_the_dispatch_and_a_lone_answer_waits_for_its_ack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When one receive resumes several connections' readers, each one's next request
    to an idle QP leaves at once (``tx_kicks``), so the target starts on it while the
    rest of the dispatch runs; an answer from a dispatch that resumed one QP still
    leaves with that QP's ACK (no kick). Every Read returns what the target holds.
    (The compiled core: the interpreted one resumes its waiters after the dispatch.)"""
    monkeypatch.setenv("AIORDMA_CORE", "compiled")
    server_dev, client_dev = open_device("soft", engine="native"), open_device("soft", engine="native")
    n_conns, rounds = 8, 150
    table = aiordma.register(bytearray(bytes(range(256)) * 16), device=server_dev)  # 4 KiB

    async def echo(conn: aiordma.Connection) -> None:
        async for msg in conn:
            await conn.send(msg)

    server = await aiordma.start_server(echo, "127.0.0.1", 0, device=server_dev, expose={"t": table})
    conns: list[aiordma.Connection] = []
    try:
        for _ in range(n_conns):
            conns.append(await aiordma.connect("127.0.0.1", server.port, device=client_dev))
        before = client_dev.counters.get("tx_kicks", 0)

        async def reader(i: int, conn: aiordma.Connection) -> None:
            into = conn.register(bytearray(64))
            remote = conn.remote("t")
            for r in range(rounds):
                off = (i * 64 + r * 8) % (4096 - 64)
                await conn.read(remote[off : off + 64], into=into)
                assert bytes(into.view) == bytes(table.view[off : off + 64])

        await asyncio.gather(*(reader(i, c) for i, c in enumerate(conns)))
        assert client_dev.counters.get("tx_kicks", 0) > before

        # one connection's round trips: every dispatch on the server resumes one QP
        served = server_dev.counters.get("tx_kicks", 0)
        for k in range(100):
            await conns[0].send(k.to_bytes(4, "little"))
            assert await conns[0].recv() == k.to_bytes(4, "little")
        assert server_dev.counters.get("tx_kicks", 0) == served
    finally:
        for c in conns:
            await c.close()
        server.close()
        await server.wait_closed()
        client_dev.close()
        server_dev.close()
