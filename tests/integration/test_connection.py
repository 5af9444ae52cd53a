"""Connection API over the soft device: real UDP, real NIC threads, real TCP rendezvous."""

from __future__ import annotations

import asyncio
import contextlib
import struct

import pytest

import aiordma
import aiordma.completion
from aiordma import RemoteBuffer
from aiordma.providers.soft.engine import native_status

from ..support.waiting import wait_until

ENGINES = ("python", "native") if native_status()[0] else ("python",)


async def first_accepted(seen: list):
    """The server's first connection, once its handler has started: a one-sided operation
    needs no code of the server's, so it may complete before the handler ran."""
    await wait_until(lambda: bool(seen), "the server's handler started")
    return seen[0]


@pytest.fixture
async def exposed_server():
    """A server exposing one 1 MiB region (rw + atomics) and one read-only region."""
    mem = bytearray(1 << 20)
    ro = bytearray(b"read-only!" * 10)
    region = aiordma.register(mem, provider="soft")
    ro_region = aiordma.register(ro, aiordma.Access.LOCAL_WRITE | aiordma.Access.REMOTE_READ, provider="soft")
    seen: list[aiordma.Connection] = []

    async def handler(conn):
        seen.append(conn)
        async for msg in conn:
            await conn.send(msg)

    server = await aiordma.start_server(
        handler, "127.0.0.1", 0, provider="soft", expose={"mem": region.exposed("rwa"), "ro": ro_region}
    )
    yield server, mem, ro, seen
    server.close()
    await server.wait_closed()
    region.close()
    ro_region.close()


async def test_send_recv_small_and_large(echo_server):
    async with await aiordma.connect("127.0.0.1", echo_server.port, provider="soft") as conn:
        assert conn.progress_mode == "event"
        await conn.send(b"hello")
        assert await conn.recv() == b"hello"
        await conn.send(b"")
        assert await conn.recv() == b""
        big = bytes(range(256)) * 5000  # 1.28 MB: many chunks of many MTUs
        await conn.send(big)
        assert await conn.recv() == big


async def test_many_concurrent_messages_keep_order(echo_server):
    async with await aiordma.connect("127.0.0.1", echo_server.port, provider="soft", recv_buffers=4) as conn:
        msgs = [i.to_bytes(4, "big") * (i % 50 + 1) for i in range(300)]
        recv_task = asyncio.ensure_future(asyncio.gather(*[conn.recv() for _ in msgs]))  # noqa: RUF006 (awaited below)
        await asyncio.gather(*[conn.send(m) for m in msgs])
        got = await asyncio.wait_for(recv_task, 30)
        assert sorted(got) == sorted(msgs)
        counters = conn.device.counters
        assert counters.get("rnr_naks_sent", 0) == 0, "credit flow control must avoid RNR"


async def test_write_read_atomics(exposed_server):
    server, mem, _, _ = exposed_server
    async with await aiordma.connect("127.0.0.1", server.port, provider="soft") as conn:
        rb = conn.remote("mem")
        assert rb.length == len(mem)
        payload = bytes(range(256)) * 64  # 16 KiB, several MTUs
        await conn.write(payload, rb[4096:])
        assert mem[4096 : 4096 + len(payload)] == payload
        assert await conn.read(rb[4096 : 4096 + len(payload)]) == payload
        # zero-copy registered source and destination
        src = conn.register(bytearray(b"z" * 100_000))
        await conn.write(src, rb[100_000:200_000])
        assert mem[100_000:200_000] == b"z" * 100_000
        dst = conn.register(bytearray(100_000))
        assert await conn.read(rb[100_000:200_000], into=dst) is None
        assert bytes(dst.view) == b"z" * 100_000
        # atomics on an 8-byte word
        word = rb[64:72]
        struct.pack_into("<Q", mem, 64, 40)
        assert await conn.fetch_and_add(word, 2) == 40
        assert struct.unpack_from("<Q", mem, 64)[0] == 42
        assert await conn.compare_and_swap(word, 41, 7) == 42  # no swap
        assert struct.unpack_from("<Q", mem, 64)[0] == 42
        assert await conn.compare_and_swap(word, 42, 7) == 42
        assert struct.unpack_from("<Q", mem, 64)[0] == 7
        results = await asyncio.gather(*[conn.fetch_and_add(word, 1) for _ in range(50)])
        assert sorted(results) == list(range(7, 57))
        assert struct.unpack_from("<Q", mem, 64)[0] == 57


async def test_post_write_keeps_the_send_queue_full(exposed_server):
    """post_write returns once the write is on the send queue; with more posts than
    send-queue slots the later ones wait for a slot, and every write lands."""
    server, mem, _, _ = exposed_server
    async with await aiordma.connect("127.0.0.1", server.port, provider="soft", send_queue_depth=4) as conn:
        rb = conn.remote("mem")
        src = conn.register(bytearray(b"".join(bytes([i]) * 512 for i in range(12))))
        with pytest.raises(ValueError, match="does not fit the remote buffer"):
            await conn.post_write(src[0:512], rb[0:511])  # refused before it takes a slot
        posts = [asyncio.ensure_future(conn.post_write(src[i * 512 : (i + 1) * 512], rb[i * 512 :])) for i in range(12)]
        futures = await asyncio.wait_for(asyncio.gather(*posts), 10)
        assert all(isinstance(f, asyncio.Future) for f in futures)
        completions = await asyncio.wait_for(asyncio.gather(*futures), 10)
        assert [wc.status for wc in completions] == [0] * 12
        assert mem[: 12 * 512] == bytes(src.view)
        # every slot came back: four more writes go out at once
        more = [await conn.post_write(src[0:512], rb[8192 + i * 512 :]) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*more), 10)
        assert mem[8192 : 8192 + 4 * 512] == b"\x00" * 512 * 4


async def test_post_read_keeps_the_send_queue_full(exposed_server):
    """post_read returns once the read is on the send queue, into registered memory or
    a plain writable buffer; with more posts than send-queue slots the later ones wait
    for a slot, and each future completes once its data is in place."""
    server, mem, ro, _ = exposed_server
    mem[: 12 * 512] = b"".join(bytes([i + 1]) * 512 for i in range(12))
    async with await aiordma.connect("127.0.0.1", server.port, provider="soft", send_queue_depth=4) as conn:
        rb = conn.remote("mem")
        dst = conn.register(bytearray(12 * 512))
        plain = bytearray(6 * 512)
        with pytest.raises(ValueError, match="does not fit the 511-byte destination"):
            await conn.post_read(rb[0:512], dst[0:511])  # refused before it takes a slot
        with pytest.raises(ValueError, match="does not fit the 100-byte destination"):
            await conn.post_read(rb[0:512], bytearray(100))
        with pytest.raises(TypeError, match="read-only"):
            await conn.post_read(rb[0:512], b"\0" * 512)
        posts = [
            asyncio.ensure_future(conn.post_read(rb[i * 512 : (i + 1) * 512], dst[i * 512 : (i + 1) * 512]))
            for i in range(12)
        ]
        posts += [
            asyncio.ensure_future(conn.post_read(rb[i * 512 : (i + 1) * 512], memoryview(plain)[i * 512 :]))
            for i in range(6)
        ]
        futures = await asyncio.wait_for(asyncio.gather(*posts), 10)
        assert all(isinstance(f, asyncio.Future) for f in futures)
        completions = await asyncio.wait_for(asyncio.gather(*futures), 10)
        assert [wc.status for wc in completions] == [0] * 18
        assert bytes(dst.view) == bytes(mem[: 12 * 512])
        assert plain == mem[: 6 * 512]
        # a read the responder refuses fails its future, and the error names the cause
        bad = RemoteBuffer(rb.addr, 512, rb.rkey ^ 0x5A5A)
        fut = await conn.post_read(bad, dst[0:512])
        with pytest.raises(aiordma.RemoteAccessError, match="IBV_WC_REM_ACCESS_ERR"):
            await asyncio.wait_for(fut, 10)


async def test_write_with_immediate_notifies_peer(exposed_server):
    server, mem, _, seen = exposed_server
    async with await aiordma.connect("127.0.0.1", server.port, provider="soft") as conn:
        await conn.write(b"abc", conn.remote("mem")[0:3], imm=0x52444D41)
        note = await asyncio.wait_for((await first_accepted(seen)).recv_immediate(), 5)
        assert note == aiordma.Immediate(0x52444D41, 3)
        assert mem[0:3] == b"abc"


async def test_remote_access_errors_name_the_cause(exposed_server):
    server, mem, ro, _ = exposed_server
    conn = await aiordma.connect("127.0.0.1", server.port, provider="soft")
    try:
        rb = conn.remote("mem")
        with pytest.raises(aiordma.RemoteAccessError, match="IBV_WC_REM_ACCESS_ERR") as ei:
            await conn.write(b"x", RemoteBuffer(rb.addr, 1, rb.rkey ^ 0x5A5A))
        assert ei.value.status == aiordma.WCStatus.IBV_WC_REM_ACCESS_ERR
        # the QP is now in the error state: later operations fail promptly, naming the cause
        with pytest.raises(aiordma.ConnectionLostError, match="IBV_QPS_ERR"):
            await conn.send(b"after")
    finally:
        await conn.close()
    assert bytes(mem[:16]) == bytes(16)


@pytest.mark.parametrize("case", ["out_of_bounds", "no_remote_write", "unaligned_atomic"])
async def test_refused_accesses_write_nothing(exposed_server, case):
    server, mem, ro, _ = exposed_server
    before_ro = bytes(ro)
    async with await aiordma.connect("127.0.0.1", server.port, provider="soft") as conn:
        rb, rrb = conn.remote("mem"), conn.remote("ro")
        if case == "out_of_bounds":
            with pytest.raises(aiordma.RemoteAccessError):
                await conn.write(b"y" * 10, rb.at(len(mem) - 4, 10))
            assert bytes(mem[-4:]) == bytes(4)
        elif case == "no_remote_write":
            with pytest.raises(aiordma.RemoteAccessError):
                await conn.write(b"w", rrb[0:1])
            assert bytes(ro) == before_ro
        else:
            with pytest.raises(aiordma.RemoteInvalidRequestError):
                await conn.fetch_and_add(rb.at(3, 8), 1)


async def test_write_batch_one_doorbell_one_completion(exposed_server):
    server, mem, _, seen = exposed_server
    async with await aiordma.connect("127.0.0.1", server.port, provider="soft", send_queue_depth=64) as conn:
        rb = conn.remote("mem")
        src = conn.register(bytearray(bytes(range(256)) * 256))  # 64 KiB, registered (zero copy)
        before = conn.dispatcher.completions
        writes = [(src[i * 1000 : i * 1000 + 1000], rb[i * 5000 : i * 5000 + 1000]) for i in range(40)]
        writes.append((b"bytes-like too", rb[300_000:300_014]))
        await conn.write_batch(writes, imm=77)
        for i in range(40):
            assert mem[i * 5000 : i * 5000 + 1000] == bytes(src.view[i * 1000 : i * 1000 + 1000])
        assert mem[300_000:300_014] == b"bytes-like too"
        # selective signaling: one completion for the 41 writes
        assert conn.dispatcher.completions - before == 1
        note = await asyncio.wait_for((await first_accepted(seen)).recv_immediate(), 5)
        assert note == aiordma.Immediate(77, 14)
        assert (
            conn.stats["send_queue_free"] == 64 and not conn.stats["operations_outstanding"]
        )  # every send-queue slot came back
        # batches from concurrent tasks, more writes in flight than the send queue holds
        await asyncio.gather(
            *[
                conn.write_batch([(src[j : j + 8], rb.at(400_000 + 8 * (t * 32 + j), 8)) for j in range(32)])
                for t in range(6)
            ]
        )
        for t in range(6):
            for j in range(32):
                off = 400_000 + 8 * (t * 32 + j)
                assert mem[off : off + 8] == bytes(src.view[j : j + 8])
        assert conn.stats["send_queue_free"] == 64
        with pytest.raises(ValueError, match="send queue depth"):
            await conn.write_batch([(b"x", rb[0:1])] * 65)
        with pytest.raises(ValueError, match="write 1 of the batch"):
            await conn.write_batch([(b"x", rb[0:1]), (b"xy", rb[0:1])])
        assert conn.stats["send_queue_free"] == 64
        await conn.write_batch([])


async def test_write_batch_failure_in_the_middle(exposed_server):
    """A bad rkey in the middle of a chain: the writes before it land, the error names the
    cause, the rest is flushed, no slot or buffer is lost and nothing lands after it."""
    server, mem, _, _ = exposed_server
    conn = await aiordma.connect("127.0.0.1", server.port, provider="soft", send_queue_depth=32)
    try:
        rb = conn.remote("mem")
        bad = RemoteBuffer(rb.addr, 16, rb.rkey ^ 0x5A5A)
        writes = [(b"A" * 16, rb[0:16]), (b"B" * 16, rb[16:32]), (b"C" * 16, bad), (b"D" * 16, rb[48:64])]
        with pytest.raises(aiordma.RemoteAccessError, match="IBV_WC_REM_ACCESS_ERR.*batch of 4 RDMA_WRITEs"):
            await conn.write_batch(writes)
        assert mem[0:32] == b"A" * 16 + b"B" * 16
        assert mem[48:64] == bytes(16)
        await wait_until(
            lambda: not conn.stats["operations_outstanding"], "the flushed operations of the chain completed"
        )
        assert conn.stats["send_queue_free"] == 32
        with pytest.raises(aiordma.ConnectionLostError):
            await conn.write_batch([(b"E", rb[0:1])])
    finally:
        await conn.close()


async def test_read_only_region_can_be_read(exposed_server):
    server, _, ro, _ = exposed_server
    async with await aiordma.connect("127.0.0.1", server.port, provider="soft") as conn:
        assert await conn.read(conn.remote("ro")) == bytes(ro)


async def test_advertise_after_connect(exposed_server):
    server, _, _, seen = exposed_server
    async with await aiordma.connect("127.0.0.1", server.port, provider="soft") as conn:
        mine = conn.register(bytearray(64))
        await conn.advertise(mine.exposed("w"), "late")
        server_side = await first_accepted(seen)
        rb = await server_side.wait_remote("late", timeout=5)
        await server_side.write(b"from server", rb[0:11])
        assert bytes(mine.view[:11]) == b"from server"
        with pytest.raises(aiordma.RemoteBufferNotFoundError):
            conn.remote("nope")


async def test_32_concurrent_connections(echo_server):
    async def one(i: int) -> bytes:
        async with await aiordma.connect(
            "127.0.0.1", echo_server.port, provider="soft", recv_buffers=4, recv_buffer_size=4096
        ) as conn:
            await conn.send(b"conn %d" % i)
            return await conn.recv()

    got = await asyncio.wait_for(asyncio.gather(*[one(i) for i in range(32)]), 60)
    assert got == [b"conn %d" % i for i in range(32)]


def quiet_watchdog(dev) -> None:
    """A Python-engine soft device's NIC thread without its watchdog.

    With loop assist the NIC thread takes over the socket whenever the loop has not
    serviced it for ``watchdog_interval`` (5 ms), which on a loaded machine happens at
    random. Tests that count which path a packet took push that out of reach; the
    thread still runs the transport timers (``wake()`` makes it see the change now)."""
    dev.nic.watchdog_interval = 3600.0
    dev.nic.wake()


@pytest.mark.parametrize("engine", ["python", "native"])
@pytest.mark.parametrize("loop_assist", ["1", "0"])
async def test_completions_reach_the_loop_directly_when_the_nic_runs_on_it(monkeypatch, engine, loop_assist):
    """With loop assist the soft NIC receives on the loop thread (the Python engine
    always, the native engine inside its expect window, which a ping-pong keeps open)
    and hands completions to the dispatcher directly (no eventfd, no selector round);
    with the NIC thread doing the work, the same completions arrive through the
    completion channel's fd.

    On the Python engine this is counted exactly: the poll window is off
    (``spin_us=0``), so a completion reaches the dispatcher either directly or in an
    fd wake-up, and the NIC threads' watchdogs are out of the way. The native NIC
    thread serves whatever the loop has not taken within the window, so there the
    test asks only that most completions came directly."""
    if engine == "native" and "native" not in ENGINES:
        pytest.skip("the native engine is not built")
    monkeypatch.setenv("AIORDMA_SOFT_LOOP_ASSIST", loop_assist)
    from aiordma.providers import open_device

    server_dev, client_dev = open_device("soft", engine=engine), open_device("soft", engine=engine)
    if engine == "python":
        quiet_watchdog(server_dev)
        quiet_watchdog(client_dev)

    async def handler(conn):
        async for msg in conn:
            await conn.send(msg)

    server = await aiordma.start_server(handler, "127.0.0.1", 0, device=server_dev)
    try:
        async with await aiordma.connect("127.0.0.1", server.port, device=client_dev, spin_us=0) as conn:
            d = conn.dispatcher
            assert d.mode == "event" and d.direct and d.spin_s == 0
            w0, c0 = d.wakeups, d.completions
            rounds = 200
            for i in range(rounds):
                await conn.send(b"%d" % i)
                assert await conn.recv() == b"%d" % i
            # (the echo may come before the ACK of the last send: a completion resumes its
            # task at once, so the ACK's completion is the last one delivered)
            await conn.drain()
            completions, wakeups = d.completions - c0, d.wakeups - w0
            assert completions >= 2 * rounds  # a send and a receive completion per round trip
            if loop_assist == "1":
                if engine == "python":
                    # every packet was received on the loop: the completions were handed
                    # over directly, not through the fd. (CI's reference run on a loaded
                    # 2-core host once saw 1 fd wake-up in 400 completions, with the watchdog
                    # off; what raised it is not pinned down, so one or two are let pass:
                    # without loop assist it is one per round trip, as the else-branch asserts)
                    assert wakeups <= 2, (wakeups, completions)
                else:
                    assert wakeups <= completions // 2
            else:
                # each echo's receive completion needs a wake-up of its own: the next
                # round trip starts only after the previous one's was delivered
                assert wakeups >= rounds
    finally:
        server.close()
        await server.wait_closed()
        client_dev.close()
        server_dev.close()


@pytest.mark.parametrize("spin_us", [0, 5000])
async def test_event_mode_polls_a_window_then_sleeps(echo_server, spin_us):
    """Event mode keeps polling for ``spin_us`` after each post or completion (the loop
    does not block in the selector meanwhile) and stops once the window passes with
    nothing: an idle connection costs no CPU. ``spin_us=0`` never polls."""
    async with await aiordma.connect("127.0.0.1", echo_server.port, provider="soft", spin_us=spin_us) as conn:
        d = conn.dispatcher
        assert d.mode == "event" and d.spin_s == spin_us * 1e-6
        for i in range(50):
            await conn.send(b"%d" % i)
            assert await conn.recv() == b"%d" % i
        if spin_us == 0:
            assert d.spins == 0 and not d._spinning
            return
        assert d.spins > 0
        # idle: the window closes (once spin_us passed without a completion) ...
        await wait_until(lambda: not d._spinning, "the poll window closed")
        # ... and no poll callback runs any more, however long the loop idles
        idle = d.spins
        await asyncio.sleep(0.05)
        assert d.spins == idle
        # the next operation opens the window again (a window polls at least once)
        await conn.send(b"again")
        assert await conn.recv() == b"again"
        assert d.spins > idle


@pytest.mark.parametrize("spin_us", ["0", "200000"])
async def test_soft_nic_polls_its_socket_after_traffic(monkeypatch, spin_us):
    """One-sided operations: nothing is posted or completed on the passive side, so its
    soft NIC opens the poll window itself when packets arrive (the loop polls the socket
    instead of sleeping), and closes it once the window passes with nothing.

    The window is long (200 ms) and the NIC threads' watchdogs are off, so that no count
    depends on how busy the machine is: every packet is received on the loop (which opens
    the window), and a window's first tick, one loop iteration later, comes long before
    the window ends."""
    monkeypatch.setenv("AIORDMA_SPIN_US", spin_us)
    from aiordma.providers import open_device

    # the Python engine: the native engine's NIC thread serves the passive side without
    # the loop (test_native_engine checks that no Python runs there)
    server_dev, client_dev = open_device("soft", engine="python"), open_device("soft", engine="python")
    for dev in (server_dev, client_dev):
        quiet_watchdog(dev)
    try:
        nic = server_dev.nic
        assert nic.poll_window == float(spin_us) * 1e-6
        mem = aiordma.register(bytearray(4096), device=server_dev)

        async def idle(conn):
            with contextlib.suppress(aiordma.RDMAError):
                await conn.recv()

        server = await aiordma.start_server(idle, "127.0.0.1", 0, device=server_dev, expose={"mem": mem.exposed("a")})
        try:
            async with await aiordma.connect("127.0.0.1", server.port, device=client_dev) as conn:
                word = conn.remote("mem")[0:8]
                for i in range(30):
                    assert await conn.fetch_and_add(word, 1) == i
                ticks = nic.counters["poll_window_ticks"]
                if spin_us == "0":
                    assert ticks == 0
                    return
                assert ticks > 0
                # idle: the window closes. While it is open every loop iteration ticks, and
                # wait_until lets at least one iteration pass between two looks: an
                # unchanged count means it is closed.
                prev = [-1]

                def unchanged() -> bool:
                    now = nic.counters["poll_window_ticks"]
                    same, prev[0] = now == prev[0], now
                    return same

                await wait_until(unchanged, "the NIC's poll window closed")
                idle_ticks = nic.counters["poll_window_ticks"]
                await asyncio.sleep(0.05)
                assert nic.counters["poll_window_ticks"] == idle_ticks  # stays closed while idle
                assert await conn.fetch_and_add(word, 1) == 30  # reopens it
                for _ in range(3):
                    await asyncio.sleep(0)
                assert nic.counters["poll_window_ticks"] > idle_ticks
        finally:
            server.close()
            await server.wait_closed()
    finally:
        client_dev.close()
        server_dev.close()


async def test_spin_window_rejects_bad_values(monkeypatch):
    with pytest.raises(ValueError, match="AIORDMA_SPIN_US"):
        monkeypatch.setenv("AIORDMA_SPIN_US", "fast")
        aiordma.completion.default_spin_us()
    monkeypatch.setenv("AIORDMA_SPIN_US", "-1")
    with pytest.raises(ValueError, match=r"AIORDMA_SPIN_US='-1': expected a number of microseconds, 0 or more"):
        aiordma.completion.default_spin_us()
    monkeypatch.setenv("AIORDMA_SPIN_US", "75")
    assert aiordma.completion.default_spin_us() == 75.0


async def test_cancelled_operations_keep_buffers_until_completion(exposed_server):
    server, mem, _, _ = exposed_server
    async with await aiordma.connect("127.0.0.1", server.port, provider="soft") as conn:
        rb = conn.remote("mem")
        tasks = [asyncio.ensure_future(conn.write(bytes([i % 251]) * 50_000, rb[0:50_000])) for i in range(20)]
        await asyncio.sleep(0)
        for t in tasks[::2]:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # the connection is intact and later operations work; no op stayed pending
        await conn.write(b"ok", rb[0:2])
        assert mem[0:2] == b"ok"
        assert not conn.stats["operations_outstanding"]


async def test_close_tells_peer(echo_server):
    conn = await aiordma.connect("127.0.0.1", echo_server.port, provider="soft")
    await conn.send(b"x")
    assert await conn.recv() == b"x"
    await conn.close()
    assert conn.closed
    with pytest.raises(aiordma.ConnectionClosedError):
        await conn.send(b"y")
    with pytest.raises(aiordma.ConnectionClosedError):
        await conn.recv()


async def test_peer_close_ends_recv_iteration():
    done = asyncio.Event()

    async def handler(conn):
        await conn.send(b"one")
        await conn.send(b"two")
        await conn.close()
        done.set()

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft")
    try:
        async with await aiordma.connect("127.0.0.1", server.port, provider="soft") as conn:
            got = [m async for m in conn]
            assert got == [b"one", b"two"]
        await asyncio.wait_for(done.wait(), 5)
    finally:
        server.close()
        await server.wait_closed()


async def test_a_cancelled_iteration_step_loses_no_message():
    """``async for`` takes messages as ``recv()`` does (its fast path included): a
    step cancelled while it waits takes nothing, and the next step gets the next
    message, in order, until the peer closes."""
    go = asyncio.Event()

    async def handler(conn):
        await go.wait()
        for i in range(5):
            await conn.send(b"m%d" % i)
        await conn.close()

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft")
    try:
        async with await aiordma.connect("127.0.0.1", server.port, provider="soft") as conn:
            messages = aiter(conn)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(anext(messages), 0.05)  # cancelled while it waits
            go.set()
            assert [m async for m in messages] == [b"m%d" % i for i in range(5)]
            with pytest.raises(StopAsyncIteration):
                await anext(messages)
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("mode", ["event", "thread", "busy"])
async def test_progress_modes(echo_server, mode):
    async with await aiordma.connect("127.0.0.1", echo_server.port, provider="soft", progress=mode) as conn:
        assert conn.progress_mode == mode
        for i in range(20):
            await conn.send(b"m%d" % i)
            assert await conn.recv() == b"m%d" % i
