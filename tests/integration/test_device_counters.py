"""Device byte counters: what went over the soft device's wire, on both engines."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

import aiordma
from aiordma.providers import open_device
from aiordma.providers.soft.engine import native_status

from ..support.waiting import wait_until

ENGINES = ["python", "native"] if native_status()[0] else ["python"]


async def _tear_down(conns: list[aiordma.Connection], server: aiordma.Server, *devices: Any) -> None:
    """Close the connections, then the server, then the devices (the order a user would)."""
    for c in conns:
        await c.close()
    server.close()
    await server.wait_closed()
    for d in devices:
        d.close()


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
async def test_a_receive_that_completes_every_connection_sends_half_of_their_next_requests_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight connections each have one Read in flight, and one receive completes all eight:
    nothing else is in flight, so holding the eight next Reads their tasks post to the end of
    that dispatch would leave the target idle while the tasks run. The post that completes the
    first half sends them at once (one ``tx_kicks`` per such dispatch, not one per post); the
    rest leave at the end. Every Read returns what the target holds. A QP that failed (its
    requests flushed) and went does not count as busy afterwards. A dispatch that resumed one
    QP (a send/recv round trip) sends its answer with its ACK: no kick.
    (The compiled core: the interpreted one resumes its waiters after the dispatch.)"""
    monkeypatch.setenv("AIORDMA_CORE", "compiled")
    server_dev = open_device("soft", engine="native")
    # the client's loop keeps receiving for itself while this test holds it (its NIC thread
    # would otherwise take the answers, and no dispatch would run on the loop)
    monkeypatch.setenv("AIORDMA_SOFT_WINDOW_US", "5000000")
    client_dev = open_device("soft", engine="native")
    n_conns, rounds = 8, 12
    table = aiordma.register(bytearray(bytes(range(256)) * 16), device=server_dev)  # 4 KiB

    async def echo(conn: aiordma.Connection) -> None:
        async for msg in conn:
            await conn.send(msg)

    server = await aiordma.start_server(echo, "127.0.0.1", 0, device=server_dev, expose={"t": table})
    conns: list[aiordma.Connection] = []
    try:
        for _ in range(n_conns):
            conns.append(await aiordma.connect("127.0.0.1", server.port, device=client_dev))
        intos = [c.register(bytearray(64)) for c in conns]
        remotes = [c.remote("t") for c in conns]

        async def two_reads(i: int, r: int) -> None:
            for step in range(2):
                off = (i * 64 + r * 16 + step * 8) % (4096 - 64)
                await conns[i].read(remotes[i][off : off + 64], into=intos[i])
                assert bytes(intos[i].view) == bytes(table.view[off : off + 64])

        async def merged_round(r: int) -> None:
            answered = server_dev.counters.get("tx_packets", 0) + n_conns
            tasks = [asyncio.ensure_future(two_reads(i, r)) for i in range(n_conns)]
            await asyncio.sleep(0)  # each task posts its first Read
            # hold the loop until the target has answered all eight: one receive takes them.
            # The target counts a datagram once its send returns, but loopback can leave the
            # delivery to a softirq that a loaded host runs late (CI, with two other suites
            # beside this one, saw a round whose answers came in two receives after a 2 ms
            # pause), hence the longer settling time.
            deadline = time.monotonic() + 10
            while server_dev.counters.get("tx_packets", 0) < answered and time.monotonic() < deadline:
                time.sleep(0.0005)
            time.sleep(0.02)
            await asyncio.gather(*tasks)

        # a first round, then a pause: what connecting left in flight (a message awaiting its
        # ACK keeps its QP busy) is gone before the rounds that count
        await merged_round(0)
        # a ninth connection's Reads fail (a wrong rkey: the QP enters the error state and its
        # other requests are flushed), and it goes: neither leaves a QP counted as busy
        extra = await aiordma.connect("127.0.0.1", server.port, device=client_dev)
        scratch, good = extra.register(bytearray(64)), extra.remote("t")
        bad = aiordma.RemoteBuffer(good.addr, 64, good.rkey ^ 0x5A5A)
        failed = [await extra.post_read(bad, scratch) for _ in range(4)]
        outcomes = await asyncio.gather(*failed, return_exceptions=True)
        assert isinstance(outcomes[0], aiordma.RemoteAccessError)
        assert all(isinstance(o, aiordma.ConnectionLostError) for o in outcomes[1:])  # flushed
        extra.abort()
        await asyncio.sleep(0.1)
        kicks = client_dev.counters.get("tx_kicks", 0)
        for r in range(1, rounds + 1):
            await merged_round(r)
            # that receive's dispatch kicked once (at the fourth of eight posts)
            assert client_dev.counters.get("tx_kicks", 0) - kicks == r

        # one connection's round trips: every dispatch on the server resumes one QP
        served = server_dev.counters.get("tx_kicks", 0)
        for k in range(100):
            await conns[0].send(k.to_bytes(4, "little"))
            assert await conns[0].recv() == k.to_bytes(4, "little")
        assert server_dev.counters.get("tx_kicks", 0) == served
    finally:
        await _tear_down(conns, server, client_dev, server_dev)


@pytest.mark.skipif(not native_status()[0], reason="the native engine is not built")
@pytest.mark.parametrize("poll_us", ["50", "0"])
async def test_the_target_nic_polls_while_reads_keep_coming_and_sleeps_when_they_stop(
    monkeypatch: pytest.MonkeyPatch, poll_us: str
) -> None:
    """The target of one-sided operations runs no code per operation: its NIC thread serves
    them. With a poll window (``AIORDMA_SOFT_POLL_US``, 50 by default) it keeps polling its
    socket after serving small ones, and requests that come meanwhile are found without a
    wake-up (``nic_poll_hits``); with 0 it sleeps at once. Once the requests stop, it sleeps
    either way: the process spends next to no CPU while idle. Large Writes open no window."""
    monkeypatch.setenv("AIORDMA_SOFT_POLL_US", poll_us)
    server_dev = open_device("soft", engine="native")
    monkeypatch.delenv("AIORDMA_SOFT_POLL_US")
    client_dev = open_device("soft", engine="native")
    table = aiordma.register(bytearray(bytes(range(256)) * 16), device=server_dev)
    sink = aiordma.register(bytearray(256 * 1024), device=server_dev)
    server = await aiordma.start_server(
        lambda conn: conn.wait_closed(),
        "127.0.0.1",
        0,
        device=server_dev,
        expose={"t": table, "sink": sink.exposed("w")},
    )
    conns: list[aiordma.Connection] = []
    try:
        for _ in range(4):
            conns.append(await aiordma.connect("127.0.0.1", server.port, device=client_dev))
        hits = server_dev.counters.get("nic_poll_hits", 0)

        async def reader(i: int, conn: aiordma.Connection) -> None:
            into, remote = conn.register(bytearray(64)), conn.remote("t")
            for r in range(300):
                off = (i * 64 + r * 8) % (4096 - 64)
                await conn.read(remote[off : off + 64], into=into)
                assert bytes(into.view) == bytes(table.view[off : off + 64])

        await asyncio.gather(*(reader(i, c) for i, c in enumerate(conns)))
        await asyncio.sleep(0.05)  # (the NIC thread counts a hit after it answered)
        found = server_dev.counters.get("nic_poll_hits", 0) - hits
        if poll_us == "0":
            assert found == 0
        else:
            assert found > 0
        cpu = time.process_time()
        await asyncio.sleep(0.5)
        assert time.process_time() - cpu < 0.2  # nothing polls (a stuck poll would take 0.5 s)
        assert server_dev.counters.get("nic_poll_hits", 0) - hits == found

        # large Writes (32 KiB datagrams on loopback) keep the thread busy by themselves: no window
        big = conns[0].register(bytearray(range(256)) * 1024)
        for _ in range(20):
            await conns[0].write(big, conns[0].remote("sink"))
        assert bytes(sink.view) == bytes(big.view)
        assert server_dev.counters.get("nic_poll_hits", 0) - hits == found
    finally:
        await _tear_down(conns, server, client_dev, server_dev)


@pytest.mark.skipif(not native_status()[0], reason="the native engine is not built")
async def test_closing_a_device_ends_its_nic_threads_poll_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A target whose NIC thread is in a (here, two-second) poll window after serving Reads
    closes at once: the poll checks for the close, it does not run its window out."""
    monkeypatch.setenv("AIORDMA_SOFT_POLL_US", "2000000")
    server_dev = open_device("soft", engine="native")
    monkeypatch.delenv("AIORDMA_SOFT_POLL_US")
    client_dev = open_device("soft", engine="native")
    table = aiordma.register(bytearray(4096), device=server_dev)
    server = await aiordma.start_server(
        lambda conn: conn.wait_closed(), "127.0.0.1", 0, device=server_dev, expose={"t": table}
    )
    conn = await aiordma.connect("127.0.0.1", server.port, device=client_dev)
    try:
        into, remote = conn.register(bytearray(64)), conn.remote("t")
        hits = server_dev.counters.get("nic_poll_hits", 0)
        for _ in range(200):
            await conn.read(remote[0:64], into=into)
        assert server_dev.counters.get("nic_poll_hits", 0) > hits  # the window is open
        conn.abort()
        server.close()
        started = time.monotonic()
        server_dev.close()
        assert time.monotonic() - started < 1.0
    finally:
        conn.abort()
        server.close()
        client_dev.close()
        server_dev.close()
