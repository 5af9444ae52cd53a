"""Nothing leaks when connections die in the middle of traffic.

A hundred times: connect, move some data, then kill the connection while
writes, reads, a SEND and a pending ``recv()`` are in flight (the server
aborts its side, the server's handler returns, the client aborts or closes,
or a stream is aborted), and close. Afterwards the process holds exactly
what it held before: no asyncio tasks, no file descriptors (``/proc/self/fd``),
no threads, no pending operations on any connection, no queue pairs on the
shared soft device (``device.nic.qps``) and no registered regions in the
shared protection domain (``pd._by_lkey``). A few repetitions use a real
child-process server killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import threading

import pytest

import aiordma
from aiordma.connection import protection_domain

from ..support.child_server import ChildServer

REPS = int(os.environ.get("AIORDMA_LEAK_REPS", "100"))
KILLED_CHILDREN = 3
BUF = 64 * 1024


def fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def describe_fds(names: set[str]) -> list[str]:
    out = []
    for n in sorted(names):
        try:
            out.append(f"{n} -> {os.readlink(f'/proc/self/fd/{n}')}")
        except OSError:
            pass
    return out


def snapshot(device) -> dict:
    gc.collect()
    pd = protection_domain(device)
    return {
        "tasks": len([t for t in asyncio.all_tasks() if t is not asyncio.current_task()]),
        "fds": len(fds()),
        "threads": threading.active_count(),
        "qps": device.live_objects()["qps"],
        "regions": len(pd._by_lkey),
        "rkeys": len(pd._by_rkey),
    }


async def settle(device, baseline: dict, timeout: float = 10.0) -> dict:
    """Wait (bounded) for teardown callbacks to finish; return the last snapshot."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        for _ in range(5):
            await asyncio.sleep(0)
        snap = snapshot(device)
        if snap == baseline or loop.time() > deadline:
            return snap
        await asyncio.sleep(0.02)


async def quiesce(device, timeout: float = 10.0) -> dict:
    """The snapshot once teardown has run its course: the same five looks in a row
    (each after a few loop iterations). The baseline is taken so, not after a fixed
    delay, which a busy machine can outlast."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: dict | None = None
    same = 0
    while True:
        for _ in range(5):
            await asyncio.sleep(0)
        snap = snapshot(device)
        same = same + 1 if snap == last else 0
        last = snap
        if same >= 4 or loop.time() > deadline:
            return snap
        await asyncio.sleep(0.02)


async def traffic_then_death(server, server_conns, rng: random.Random, mode: str) -> dict:
    """One repetition; returns what the in-flight operations ended with."""
    kwargs = dict(provider="soft", recv_buffers=8, recv_buffer_size=16 * 1024, ack_timeout=12, retry_cnt=7)
    conn = await aiordma.connect("127.0.0.1", server.port, **kwargs)
    outcome: dict = {}
    try:
        rb = conn.remote("mem")
        # some traffic first
        await conn.send(b"ping")
        assert await conn.recv() == b"ping"
        await conn.write(b"x" * 1000, rb[0:1000])
        assert await conn.read(rb[0:1000]) == b"x" * 1000
        # ops in flight
        src = conn.register(bytearray(BUF))
        dst = conn.register(bytearray(BUF))
        ops = [
            asyncio.ensure_future(conn.write(src, rb[BUF : 2 * BUF])),
            asyncio.ensure_future(conn.read(rb[0:BUF], into=dst)),
            asyncio.ensure_future(conn.read(rb[2 * BUF : 3 * BUF])),
            asyncio.ensure_future(conn.fetch_and_add(rb[8:16], 1)),
            asyncio.ensure_future(conn.send(b"m" * (40 * 1024))),
            asyncio.ensure_future(conn.recv()),
            asyncio.ensure_future(conn.recv()),
        ]
        delay = rng.choice([None, 0, 0.001, 0.003])
        if delay is not None:
            await asyncio.sleep(delay)
        peer = server_conns[-1] if server_conns else None
        if mode == "server_abort":
            peer.abort()
        elif mode == "server_close":
            with contextlib.suppress(aiordma.ConnectionLostError):  # close() reports what was lost
                await peer.close(timeout=1)
        elif mode == "client_abort":
            conn.abort()
        elif mode == "client_close":
            with contextlib.suppress(aiordma.ConnectionLostError):
                await conn.close(timeout=1)
        elif mode == "cancel_then_abort":
            for op in ops:
                op.cancel()
            await asyncio.sleep(0)
            peer.abort()
        done, pending = await asyncio.wait(ops, timeout=15)
        assert not pending, f"operations still pending 15 s after the connection died ({mode}): {pending}"
        for op in ops:
            if op.cancelled():
                outcome.setdefault("cancelled", 0)
                outcome["cancelled"] += 1
            elif op.exception() is not None:
                outcome.setdefault(type(op.exception()).__name__, 0)
                outcome[type(op.exception()).__name__] += 1
            else:
                outcome.setdefault("ok", 0)
                outcome["ok"] += 1
        for op in ops:
            if not op.cancelled() and op.exception() is not None:
                assert isinstance(op.exception(), (aiordma.RDMAError, ConnectionError)), repr(op.exception())
        src.close()
        dst.close()
    finally:
        with contextlib.suppress(aiordma.ConnectionLostError):  # sends lost with the peer are reported
            await conn.close(timeout=2)
    assert conn.closed and not conn.stats["operations_outstanding"], f"pending operations after close: {conn.stats}"
    return outcome


async def stream_then_abort(stream_server, rng: random.Random, who: str) -> None:
    reader, writer = await aiordma.open_connection(
        "127.0.0.1", stream_server.port, provider="soft", ring_size=64 * 1024, ack_timeout=12
    )
    try:
        writer.write(b"hello\n")
        assert await reader.readline() == b"hello\n"
        writer.write(os.urandom(200_000))
        drain = asyncio.ensure_future(writer.drain())
        read = asyncio.ensure_future(reader.read(1 << 20))
        await asyncio.sleep(rng.choice([0, 0.001, 0.003]))
        if who == "client":
            writer.abort()
        else:
            stream_server_conns = list(stream_server.connections)
            for c in stream_server_conns:
                c.abort()
        await asyncio.wait([drain, read], timeout=15)
        for f in (drain, read):
            assert f.done()
            if not f.cancelled():
                f.exception()
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 10)
        except (aiordma.RDMAError, ConnectionError):
            pass


async def test_no_leaks_when_connections_die_mid_traffic():
    device = aiordma.get_device("soft")
    rng = random.Random(2024)
    mem = aiordma.register(bytearray(1 << 20), provider="soft")
    server_conns: list[aiordma.Connection] = []
    all_server_conns: list[aiordma.Connection] = []

    async def handler(conn):
        server_conns.append(conn)
        all_server_conns.append(conn)
        try:
            async for m in conn:
                await conn.send(m)
        finally:
            server_conns.remove(conn)

    async def stream_echo(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await aiordma.start_server(
        handler,
        "127.0.0.1",
        0,
        provider="soft",
        expose={"mem": mem.exposed("rwa")},
        recv_buffers=8,
        recv_buffer_size=16 * 1024,
        ack_timeout=12,
        retry_cnt=7,
    )
    stream_server = await aiordma.start_stream_server(
        stream_echo, "127.0.0.1", 0, provider="soft", ring_size=64 * 1024, ack_timeout=12
    )
    try:
        # warm up (lazily created objects: the loop's reader on the NIC socket, caches)
        await traffic_then_death(server, server_conns, rng, "client_close")
        await stream_then_abort(stream_server, rng, "client")
        baseline = await quiesce(device)
        base_fds = fds()
        modes = ["server_abort"] * 5 + ["server_close", "client_abort", "client_close", "cancel_then_abort"]
        outcomes: dict = {}
        stream_reps = 0
        for i in range(REPS):
            if i % 10 == 9:
                await stream_then_abort(stream_server, rng, rng.choice(["client", "server"]))
                stream_reps += 1
            else:
                mode = modes[i % len(modes)] if i % 2 else "server_abort"
                for k, v in (await traffic_then_death(server, server_conns, rng, mode)).items():
                    outcomes[k] = outcomes.get(k, 0) + v
        after = await settle(device, baseline)
        leaked = fds() - base_fds
        assert after == baseline, (
            f"leak after {REPS} repetitions: {baseline} -> {after}; new fds {describe_fds(leaked)}"
        )
        for c in all_server_conns:
            assert not c.stats["operations_outstanding"], f"server connection {c!r} kept pending operations: {c.stats}"
        print(f"\nleaks: {REPS} repetitions ({stream_reps} streams), outcomes of in-flight ops {outcomes}, {after}")
    finally:
        server.close()
        stream_server.close()
        await server.wait_closed()
        await stream_server.wait_closed()
        mem.close()


async def test_no_leaks_when_child_server_is_killed():
    device = aiordma.get_device("soft")
    rng = random.Random(7)
    baseline = None
    base_fds: set[str] = set()
    loop = asyncio.get_running_loop()
    for i in range(KILLED_CHILDREN + 1):
        with await loop.run_in_executor(None, ChildServer.start) as child:
            conn = await aiordma.connect("127.0.0.1", child.port, provider="soft", ack_timeout=12, retry_cnt=7)
            try:
                rb = conn.remote("mem")
                await conn.write(b"hi", rb[0:2])
                src = conn.register(bytearray(BUF))
                ops = [
                    asyncio.ensure_future(conn.write(src, rb[BUF : 2 * BUF])),
                    asyncio.ensure_future(conn.read(rb[0:BUF])),
                    asyncio.ensure_future(conn.fetch_and_add(rb[8:16], 1)),
                    asyncio.ensure_future(conn.send(b"z" * 100_000)),
                    asyncio.ensure_future(conn.recv()),
                ]
                await asyncio.sleep(rng.choice([0, 0.002]))
                child.kill()
                done, pending = await asyncio.wait(ops, timeout=15)
                assert not pending
                for op in ops:
                    if op.exception() is not None:
                        assert isinstance(op.exception(), aiordma.RDMAError), repr(op.exception())
                src.close()
            finally:
                with contextlib.suppress(aiordma.ConnectionLostError):  # the killed peer lost our sends
                    await conn.close(timeout=2)
            assert not conn.stats["operations_outstanding"]
        if i == 0:  # the first round is the warm-up (executor thread, loop reader)
            baseline = await quiesce(device)
            base_fds = fds()
    after = await settle(device, baseline)
    assert after == baseline, (
        f"leak after killed children: {baseline} -> {after}; new fds {describe_fds(fds() - base_fds)}"
    )


async def test_refused_connection_options_leave_nothing_on_the_device():
    """An option a connection refuses (ValueError) is refused before anything is
    allocated on the device: no CQ, QP or registration is left behind."""
    device = aiordma.get_device("soft")

    async def handler(conn):
        pass

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft")
    try:
        gc.collect()
        before = device.live_objects()
        for bad in (
            {"registration_cache": -1},
            {"large_message_threshold": 0},
            {"progress": "sometimes"},
            {"spin_us": -1.0},
            {"recv_buffer_size": 1},
        ):
            with pytest.raises(ValueError):
                await aiordma.connect("127.0.0.1", server.port, provider="soft", **bad)
        gc.collect()
        assert device.live_objects() == before
    finally:
        server.close()
        await server.wait_closed()
