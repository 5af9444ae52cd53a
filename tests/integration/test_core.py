"""The per-operation core through the public API, compiled and interpreted.

Every test runs with ``AIORDMA_CORE=compiled`` (:mod:`aiordma._core`) and
``AIORDMA_CORE=python`` (the reference), on asyncio and uvloop, over real
connections between two soft devices: the same calls must give the same data,
results and errors. Where the compiled core posts and polls through the native
engine's C verbs, the tests also check that it did (the fast paths ran), and what
happens around them: a cancelled caller, a failure, a task that a completion
resumes raising ``SystemExit``.
"""

from __future__ import annotations

import asyncio
import struct

import pytest

import aiordma
from aiordma.errors import RemoteAccessError
from aiordma.providers import open_device
from aiordma.providers.base import WCOpcode, WCStatus, WorkCompletion

CORES = ["compiled", "python"]


@pytest.fixture(params=CORES)
def core(request, monkeypatch):
    monkeypatch.setenv("AIORDMA_CORE", request.param)
    return request.param


@pytest.fixture
async def pair(core):
    """A connection to a server exposing 64 KiB (read, write, atomics), and that memory."""
    mem = bytearray(1 << 16)
    region = aiordma.register(mem)

    async def handler(conn):
        async for msg in conn:
            await conn.send(msg)

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft", expose={"mem": region.exposed("rwa")})
    conn = await aiordma.connect("127.0.0.1", server.port, provider="soft")
    assert conn._core.name == core
    try:
        yield conn, mem
    finally:
        await conn.close()
        server.close()
        await server.wait_closed()
        region.close()


async def test_one_sided_verbs_give_the_same_results(pair, core) -> None:
    conn, mem = pair
    remote = conn.remote("mem")
    local = conn.register(bytearray(8192))
    local.view[0:64] = bytes(range(64))
    await conn.write(local[0:64], remote[128:192])
    assert mem[128:192] == bytes(range(64))
    await conn.write(local, remote[0:8192])  # a whole region
    assert mem[0:64] == bytes(range(64))
    mem[1000:1010] = b"0123456789"
    assert await conn.read(remote[1000:1010], into=local[4000:4010]) is None
    assert bytes(local.view[4000:4010]) == b"0123456789"
    # post_* futures complete with the work completion
    fut = await conn.post_write(local[0:16], remote[64:80])
    wc = await fut
    assert isinstance(wc, WorkCompletion) and wc.status == WCStatus.IBV_WC_SUCCESS
    assert wc.opcode == WCOpcode.IBV_WC_RDMA_WRITE and wc.imm_data is None
    fut = await conn.post_read(remote[1000:1004], local[0:4])
    assert (await fut).opcode == WCOpcode.IBV_WC_RDMA_READ and bytes(local.view[0:4]) == b"0123"
    # atomics return the word's original value
    mem[2048:2056] = struct.pack("<Q", 41)
    assert await conn.fetch_and_add(remote[2048:2056], 1) == 41
    assert await conn.compare_and_swap(remote[2048:2056], 42, 7) == 42
    assert await conn.compare_and_swap(remote[2048:2056], 42, 9) == 7
    assert await conn.fetch_and_add(remote[2048:2056], -8) == 7
    assert struct.unpack("<Q", mem[2048:2056])[0] == (1 << 64) - 1
    # batches, both ways
    for i in range(16):
        local.view[i * 256 : (i + 1) * 256] = bytes([i]) * 256
    await conn.write_batch([(local[i * 256 : (i + 1) * 256], remote[20000 + i * 512 :]) for i in range(16)])
    assert all(mem[20000 + i * 512 : 20000 + i * 512 + 256] == bytes([i]) * 256 for i in range(16))
    await conn.read_batch([(remote[20000 + i * 512 : 20000 + i * 512 + 4], local[6000 + i * 4 :]) for i in range(16)])
    assert bytes(local.view[6000:6064]) == b"".join(bytes([i]) * 4 for i in range(16))
    assert conn.stats["operations_outstanding"] == 0
    assert conn.stats["send_queue_free"] == conn.stats["send_queue_depth"]
    if core == "compiled" and getattr(conn.device, "engine", None) == "native":
        # the native engine's C verbs carried them: every completion was finished in C
        assert conn._fast.posts_in_c and conn._fast.fast_completions > 0
        assert conn._fast.slow_completions == 0
    elif core == "compiled":
        # (the Python engine: posted through its Python methods; the dispatcher hands the
        # successes to the core, which finishes them)
        assert not conn._fast.posts_in_c and conn._fast.fast_completions > 0
    else:
        assert not conn._fast.posts_in_c


async def test_bad_arguments_are_refused_before_anything_is_posted(pair, core) -> None:
    conn, _ = pair
    remote = conn.remote("mem")
    local = conn.register(bytearray(256))
    with pytest.raises(ValueError, match="does not fit the remote buffer"):
        await conn.write(local, remote[0:16])
    with pytest.raises(ValueError, match="does not fit the 16-byte destination"):
        await conn.read(remote[0:64], into=local[0:16])
    with pytest.raises(ValueError, match="needs an 8-byte remote buffer"):
        await conn.fetch_and_add(remote[0:4], 1)
    with pytest.raises(ValueError, match="write 1 of the batch"):
        await conn.write_batch([(local[0:8], remote[0:8]), (local[0:64], remote[0:8])])
    assert conn.stats["operations_outstanding"] == 0
    assert conn.stats["send_queue_free"] == conn.stats["send_queue_depth"]
    await conn.write(local[0:8], remote[0:8])  # still usable


async def test_messages_one_chunk_and_more(pair, core) -> None:
    conn, _ = pair
    for n in (0, 1, 64, 4096, 64 * 1024 - 1, 200_000):
        data = bytes(i % 251 for i in range(n))
        await conn.send(data)
        assert await conn.recv() == data
    await conn.send(b"ack me", wait_ack=True)
    assert await conn.recv() == b"ack me"
    await conn.send(memoryview(bytearray(b"a view")))
    assert await conn.recv() == b"a view"
    region = conn.register(bytearray(b"registered"))
    await conn.send(region)
    assert await conn.recv() == b"registered"


async def test_a_remote_access_error_names_the_missing_right(core) -> None:
    """A Write to memory exposed read-only: the peer's NIC refuses it, the caller gets
    IBV_WC_REM_ACCESS_ERR naming the right, and the connection is lost."""
    mem = bytearray(4096)
    region = aiordma.register(mem)

    async def idle(conn):
        await conn.wait_closed()

    server = await aiordma.start_server(idle, "127.0.0.1", 0, provider="soft", expose={"ro": region})
    try:
        conn = await aiordma.connect("127.0.0.1", server.port, provider="soft")
        local = conn.register(bytearray(64))
        with pytest.raises(RemoteAccessError, match="REMOTE_WRITE") as info:
            await conn.write(local, conn.remote("ro")[0:64])
        assert info.value.may_have_executed is False or info.value.may_have_executed is True
        assert mem[0:64] == bytes(64)
        await asyncio.wait_for(conn.wait_closed(), 5)
        assert conn.state.value == "lost"
        with pytest.raises(aiordma.ConnectionLostError):
            await conn.write(local, conn.remote("ro")[0:64])
        await conn.close()
    finally:
        server.close()
        await server.wait_closed()
        region.close()


async def test_a_cancelled_caller_leaves_its_operation_to_the_completion(pair, core) -> None:
    """Cancelling the coroutine awaiting a write or a batch cancels nothing on the wire:
    the work requests complete, their slots come back, the connection stays usable."""
    conn, mem = pair
    remote = conn.remote("mem")
    local = conn.register(bytearray(4096))
    local.view[:] = b"c" * 4096
    tasks = [asyncio.create_task(conn.write(local[0:1024], remote[i * 1024 : (i + 1) * 1024])) for i in range(8)]
    tasks.append(asyncio.create_task(conn.write_batch([(local[0:512], remote[9000 + i * 512 :]) for i in range(8)])))
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for _ in range(200):
        if conn.stats["operations_outstanding"] == 0:
            break
        await asyncio.sleep(0.005)
    assert conn.stats["operations_outstanding"] == 0
    assert conn.stats["send_queue_free"] == conn.stats["send_queue_depth"]
    await conn.write(local[0:8], remote[0:8])
    await conn.send(b"still here")
    assert await conn.recv() == b"still here"


async def test_close_with_operations_in_flight(core) -> None:
    """close() waits for what is in flight; abort() fails it with the connection's error."""
    mem = bytearray(1 << 16)
    region = aiordma.register(mem)

    async def idle(conn):
        await conn.wait_closed()

    server = await aiordma.start_server(idle, "127.0.0.1", 0, provider="soft", expose={"mem": region.exposed("rw")})
    try:
        conn = await aiordma.connect("127.0.0.1", server.port, provider="soft")
        local = conn.register(bytearray(4096))
        futs = [await conn.post_write(local, conn.remote("mem")[i * 4096 : (i + 1) * 4096]) for i in range(16)]
        await conn.close()
        assert all(f.done() for f in futs)
        conn = await aiordma.connect("127.0.0.1", server.port, provider="soft")
        local = conn.register(bytearray(4096))
        futs = [await conn.post_write(local, conn.remote("mem")[0:4096]) for _ in range(16)]
        conn.abort()
        results = await asyncio.gather(*futs, return_exceptions=True)
        assert all(isinstance(r, WorkCompletion | aiordma.ConnectionClosedError) for r in results), results
    finally:
        server.close()
        await server.wait_closed()
        region.close()


def test_a_task_resumed_by_a_completion_that_raises_systemexit_loses_no_completion(core) -> None:
    """SystemExit (or KeyboardInterrupt) out of a task that a completion resumed leaves
    the event loop, as asyncio lets it; the completions polled with it are not lost:
    the next turn of the loop delivers them."""
    dev_a, dev_b = open_device("soft"), open_device("soft")
    loop = asyncio.new_event_loop()
    try:

        async def setup():
            mem = bytearray(1 << 16)
            region = aiordma.register(mem, device=dev_a)
            server = await aiordma.start_server(
                lambda c: c.wait_closed(), "127.0.0.1", 0, device=dev_a, expose={"mem": region.exposed("rw")}
            )
            conn = await aiordma.connect("127.0.0.1", server.port, device=dev_b)
            return server, region, conn

        server, region, conn = loop.run_until_complete(setup())
        local = conn.register(bytearray(4096))
        remote = conn.remote("mem")

        gate = asyncio.Event()  # (the Read starts in the run below, not while start() finishes)

        async def quitter():
            await gate.wait()
            await conn.read(remote[0:8], into=local[0:8])
            raise SystemExit(3)

        async def start():
            futs = [await conn.post_write(local[0:64], remote[64 * i : 64 * (i + 1)]) for i in range(32)]
            return asyncio.ensure_future(quitter()), futs

        task, futs = loop.run_until_complete(start())
        everything = asyncio.gather(task, *futs)
        loop.call_soon(gate.set)
        with pytest.raises(SystemExit):
            loop.run_until_complete(everything)
        assert isinstance(task.exception(), SystemExit)
        done = loop.run_until_complete(asyncio.wait_for(asyncio.gather(*futs), 10))
        assert all(wc.status == WCStatus.IBV_WC_SUCCESS for wc in done)
        assert conn.stats["operations_outstanding"] == 0
        assert everything.done() and isinstance(everything.exception(), SystemExit)

        async def teardown():
            await conn.close()
            await server.close_clients()
            server.close()
            await server.wait_closed()

        loop.run_until_complete(teardown())
        region.close()
    finally:
        loop.close()
        dev_b.close()
        dev_a.close()
