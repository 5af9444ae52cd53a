"""A service's life: connections come and go, and what closed is gone.

A server that clients connect to and leave all day must not keep what they
left behind: a closed connection is dropped by the server at once and freed
by reference counting (its queue pair, completion queue and buffers with
it), not kept in a reference cycle until the cyclic garbage collector runs.
These tests churn real connections over the soft device with the garbage
collector switched off, so anything a cycle keeps stays visible.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import weakref
from collections.abc import AsyncIterator, Iterator

import pytest

import aiordma
from aiordma.providers import get_device

pytestmark = pytest.mark.asyncio

CYCLES = 60


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


async def echo(conn: aiordma.Connection) -> None:
    async for message in conn:
        await conn.send(message)


async def churn(port: int, n: int, client_refs: list, payload: bytes = b"x" * 64) -> None:
    for _ in range(n):
        async with await aiordma.connect("127.0.0.1", port) as conn:
            client_refs.append(weakref.ref(conn))
            await conn.send(payload)
            assert await conn.recv() == payload
        del conn


async def settle(refs: list, timeout: float = 5.0) -> list:
    """The connections among ``refs`` still alive once teardown had its turns."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        for _ in range(5):
            await asyncio.sleep(0)
        alive = [r() for r in refs if r() is not None]
        if not alive or loop.time() > deadline:
            return alive
        del alive
        await asyncio.sleep(0.01)


@contextlib.contextmanager
def gc_off() -> Iterator[None]:
    """The cyclic garbage collector off: what a cycle keeps stays visible."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.asynccontextmanager
async def serving(handler, **options) -> AsyncIterator[aiordma.Server]:
    server = await aiordma.start_server(handler, "127.0.0.1", 0, **options)
    try:
        yield server
    finally:
        server.close()
        await server.close_clients()
        await server.wait_closed()


def eventfds() -> int:
    """The eventfds this process holds (the soft device's completion channels)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[eventfd]"
    return count


async def test_connections_share_one_completion_channel_per_loop() -> None:
    """100 connections (50 each way, in one process) hold one completion-channel fd
    between them, not one each: what lets one process hold 10,000. Every one of them
    still gets its completions, and the fd goes when the last one closes."""
    server = await aiordma.start_server(echo, "127.0.0.1", 0)
    try:
        first = await aiordma.connect("127.0.0.1", server.port)  # the device (its own fds) is open
        await first.close()
        # (its server side registers after connect() returned, and closes after the goodbye)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while (server.accepted < 1 or server.connections) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert server.accepted == 1 and not server.connections
        before = eventfds()  # (no connection open: no completion channel)
        conns = await asyncio.gather(*(aiordma.connect("127.0.0.1", server.port) for _ in range(50)))
        assert eventfds() - before == 1
        for round_ in range(3):
            payloads = [f"{round_}:{i}".encode() * (1 + i) for i in range(len(conns))]
            await asyncio.gather(*(c.send(p) for c, p in zip(conns, payloads)))
            assert await asyncio.gather(*(c.recv() for c in conns)) == payloads
        await asyncio.gather(*(c.close() for c in conns))
        del conns
    finally:
        server.close()
        await server.close_clients()
        await server.wait_closed()
    for _ in range(10):
        await asyncio.sleep(0)
    assert eventfds() == before


async def test_closed_connections_are_freed_by_reference_counting() -> None:
    server_refs: list = []

    async def handler(conn: aiordma.Connection) -> None:
        server_refs.append(weakref.ref(conn))
        await echo(conn)

    client_refs: list = []
    gc.collect()
    async with serving(handler) as server:
        with gc_off():
            await churn(server.port, CYCLES, client_refs)
            server_alive = await settle(server_refs)
            client_alive = await settle(client_refs)
            assert len(server_refs) == len(client_refs) == CYCLES
            assert server_alive == [], f"{len(server_alive)} closed server-side connections alive: {server_alive[:3]}"
            assert client_alive == [], f"{len(client_alive)} closed client connections alive: {client_alive[:3]}"
            assert server.connections == set()
            assert server.accepted == CYCLES


async def test_a_detached_connection_is_forgotten_once_it_closes() -> None:
    handed_off: asyncio.Queue[aiordma.Connection] = asyncio.Queue()

    async def handler(conn: aiordma.Connection) -> None:
        conn.detach()  # a framework keeps it, as Dask's listener does
        await handed_off.put(conn)

    async with serving(handler) as server:
        client = await aiordma.connect("127.0.0.1", server.port)
        served = await asyncio.wait_for(handed_off.get(), 5)
        assert server.connections == {served}
        ref = weakref.ref(served)
        await client.close()
        await asyncio.wait_for(served.wait_closed(), 5)
        del served
        with gc_off():
            assert await settle([ref]) == []
        assert server.connections == set()


async def test_churn_gives_the_memory_back() -> None:
    """Connect, round trip, close, many times: the process ends where it began
    (with the GC off, a kept cycle would hold each connection's buffers)."""
    refs: list = []
    async with serving(echo) as server:
        await churn(server.port, 10, refs, b"y" * 60_000)  # warm-up: pools, caches, code
        await settle(refs)
        gc.collect()
        with gc_off():
            before = rss_kib()
            await churn(server.port, CYCLES, refs, b"y" * 60_000)
            await settle(refs)
            grown = rss_kib() - before
        # each connection is 2 x (16 + 16) x 64 KiB of buffers: kept, 60 cycles would hold 240 MiB
        assert grown < 16 * 1024, f"RSS grew by {grown} KiB over {CYCLES} connect/close cycles"


async def test_closed_connections_leave_no_registration_behind() -> None:
    device = get_device("soft")
    server = await aiordma.start_server(echo, "127.0.0.1", 0, device=device)
    refs: list = []
    try:
        await churn(server.port, 3, refs)
        await settle(refs)
        baseline = device.live_objects()
        await churn(server.port, 20, refs)
        await settle(refs)
        assert device.live_objects() == baseline
    finally:
        server.close()
        await server.close_clients()
        await server.wait_closed()


STALL_S = 5.0


async def test_a_peer_stopped_for_seconds_under_load_is_not_taken_for_dead() -> None:
    """A child server stopped (SIGSTOP) for 5 s while 8 connections keep
    writing to it and sending to it, with default settings: every connection
    survives, and every byte is where it should be once the child goes on."""
    from ..support.child_server import ChildServer

    with ChildServer.start(mem_size=8 * 65536) as child:
        conns = [await aiordma.connect("127.0.0.1", child.port, provider="soft") for _ in range(8)]
        stopped = asyncio.Event()

        async def busy(i: int, conn: aiordma.Connection) -> int:
            remote = conn.remote("mem")[i * 65536 : (i + 1) * 65536]
            rounds = 0
            while True:
                block = bytes([rounds % 251]) * 65536
                await conn.write(block, remote)
                message = f"{i}:{rounds}".encode() * 100
                await conn.send(message)
                assert await conn.recv() == message
                assert await conn.read(remote[0:64]) == block[:64]
                rounds += 1
                if stopped.is_set() and rounds > 3:
                    return rounds

        tasks = [asyncio.create_task(busy(i, c)) for i, c in enumerate(conns)]
        try:
            await asyncio.sleep(0.2)
            child.stop()
            await asyncio.sleep(STALL_S)
            stopped.set()
            child.resume()
            rounds = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert all(r > 3 for r in rounds)
            assert all(not c.is_closing() for c in conns), [c.error for c in conns]
        finally:
            for t in tasks:
                t.cancel()
            child.resume()
            for c in conns:
                c.abort()


async def test_a_peer_host_that_vanishes_fails_every_pending_operation_within_seconds() -> None:
    """Two hosts (network namespaces); the server's host takes its link down,
    as a host that lost power or its cable (nothing it had is closed, no RST,
    no goodbye: every packet, TCP and UDP alike, is lost): the client's pending
    operations all fail within 10 s."""
    import json
    import subprocess
    import sys

    from ..support import netns
    from ..support.child_server import ROOT

    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"two network namespaces cannot be made here: {why}")
    env = {"PYTHONPATH": str(ROOT), "AIORDMA_INSECURE": "1", "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}
    with netns.TwoHosts() as hosts:
        server = hosts.b.popen(
            [sys.executable, "-m", "tests.support.child_server", "--host", hosts.b.ip, "--mem-size", "65536"],
            cwd=ROOT,
            env={**env, "AIORDMA_SOFT_ADDR": hosts.b.ip},
            stdout=subprocess.PIPE,
            text=True,
        )
        port = int(await asyncio.wait_for(asyncio.to_thread(server.stdout.readline), 30))
        client = hosts.a.popen(
            [sys.executable, "-m", "tests.support.vanishing_client", hosts.b.ip, str(port)],
            cwd=ROOT,
            env={**env, "AIORDMA_SOFT_ADDR": hosts.a.ip},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert (await asyncio.wait_for(asyncio.to_thread(client.stdout.readline), 30)).strip() == "ready"
        dev = hosts._veth[1]
        cut = hosts.b.run(["ip", "link", "set", "dev", dev, "down"], capture_output=True)
        assert cut.returncode == 0, cut.stderr
        client.stdin.write("go\n")
        client.stdin.flush()
        line = await asyncio.wait_for(asyncio.to_thread(client.stdout.readline), 40)
        results = json.loads(line)
        assert set(results) == {"write", "fetch_and_add", "send", "recv"}
        for name, r in results.items():
            assert not r["ok"], f"{name} succeeded against a vanished host"
            assert r["s"] < 10.0, f"{name} failed only after {r['s']:.1f} s: {r['error']}"
            # the real cause: the host, not a process that died
            assert "died" not in r["error"], r["error"]
            assert "unreachable" in r["error"] or "stopped answering" in r["error"], r["error"]


LEAVER = """
import asyncio, sys
import aiordma

async def main(port):
    conn = await aiordma.connect("127.0.0.1", port)
    await conn.send(b"hello")
    return conn  # kept open: the program ends with it

how = sys.argv[2]
if how == "asyncio.run":
    conn = asyncio.run(main(int(sys.argv[1])))  # the loop closes with the connection open
else:
    loop = asyncio.new_event_loop()  # never closed: the interpreter exits under it
    conn = loop.run_until_complete(main(int(sys.argv[1])))
"""


@pytest.mark.parametrize("how", ["asyncio.run", "interpreter-exit"])
async def test_a_program_that_ends_with_a_connection_open_says_goodbye(how: str) -> None:
    """The peer hears a goodbye at once, one that says the program ended without
    closing (what it sent last may be lost: nothing was flushed), not an EOF it
    would take for a crash, nor the "closed" that vouches for delivery."""
    import subprocess
    import sys

    from ..support.child_server import ROOT

    ended: asyncio.Queue[BaseException] = asyncio.Queue()

    async def handler(conn: aiordma.Connection) -> None:
        try:
            while True:
                assert await conn.recv() == b"hello"
        except BaseException as e:
            await ended.put(e)
            raise

    server = await aiordma.start_server(handler, "127.0.0.1", 0)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            LEAVER,
            str(server.port),
            how,
            cwd=ROOT,
            env={"PYTHONPATH": str(ROOT)},
            stderr=subprocess.PIPE,
        )
        _, stderr = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, stderr.decode()
        assert b"Traceback" not in stderr, stderr.decode()
        err = await asyncio.wait_for(ended.get(), 5)
        assert type(err) is aiordma.ConnectionLostError, repr(err)
        assert "ended without closing the connection" in str(err)
    finally:
        server.close()
        await server.close_clients()
        await server.wait_closed()


async def test_the_process_wide_receive_budget_holds_senders_back() -> None:
    """Three clients send to handlers that do not read yet. Each connection's own
    budget (32 MiB) would let the server queue everything; the process-wide budget
    (64 KiB here) holds the senders back instead: the server queues at most the
    budget plus, per connection, its first message and what its credits let fly.
    Then the handlers read: every message arrives, in order, and every sender ends."""
    from aiordma.window import DEFAULT_PROCESS_RECV_BUDGET, PROCESS_RECV_BUDGET

    n_conns, n_msgs, size = 3, 50, 16_000
    opts = dict(recv_buffers=4, recv_buffer_size=16 * 1024)
    go = asyncio.Event()
    received: dict[int, list[int]] = {}

    async def handler(conn: aiordma.Connection) -> None:
        await go.wait()
        first = await conn.recv()
        who = first[0]
        got = received.setdefault(who, [])
        got.append(first[1])
        while len(got) < n_msgs:
            message = await conn.recv()
            assert message == bytes([who, len(got)]) * (size // 2)
            got.append(message[1])

    aiordma.set_process_recv_budget(64 * 1024)
    try:
        async with serving(handler, **opts) as server:
            clients = [await aiordma.connect("127.0.0.1", server.port, **opts) for _ in range(n_conns)]
            sent = [0] * n_conns

            async def sender(i: int, conn: aiordma.Connection) -> None:
                for k in range(n_msgs):
                    await conn.send(bytes([i, k]) * (size // 2))
                    sent[i] += 1

            senders = [asyncio.create_task(sender(i, c)) for i, c in enumerate(clients)]
            await asyncio.sleep(0.5)
            queued = PROCESS_RECV_BUDGET.buffered
            bound = 64 * 1024 + n_conns * (size + 4 * 16 * 1024)
            assert queued <= bound, f"{queued} bytes queued, the budget allows {bound}"
            assert sum(sent) < n_conns * n_msgs, "no sender was held back"
            go.set()
            await asyncio.wait_for(asyncio.gather(*senders), 30)
            for c in clients:
                await c.close()
            for _ in range(100):
                if sum(map(len, received.values())) == n_conns * n_msgs:
                    break
                await asyncio.sleep(0.05)
            assert sorted(received) == list(range(n_conns))
            assert all(got == list(range(n_msgs)) for got in received.values())
        assert PROCESS_RECV_BUDGET.buffered == 0
    finally:
        aiordma.set_process_recv_budget(DEFAULT_PROCESS_RECV_BUDGET)
