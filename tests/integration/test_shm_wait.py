"""The event loop's wait for a shared-memory link's packet (``NativeEngine._shm_wait``).

While the loop polls the links and has nothing else ready (its ready queue is empty:
asyncio's, or uvloop's), it waits for the next packet in C instead of going round the
loop to look again; a packet that readies nothing (an ACK) is taken and the wait goes
on. Meanwhile the loop still serves its timers, its other sockets and calls from other
threads, and a link freed by another thread stays mapped until the wait ends.

The servers are real child processes (``tests/support/child_server.py``), the traffic
goes through the public API, every byte is checked; the device counter
``shm_wait_hits`` says how many packets a wait found."""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time

import pytest

import aiordma
from aiordma.providers import open_device
from aiordma.providers.soft import shm
from aiordma.providers.soft.engine import native_status
from tests.support.affinity import pinned
from tests.support.child_server import ChildServer

pytestmark = pytest.mark.skipif(
    not native_status()[0] or os.environ.get("AIORDMA_SOFT_ENGINE", "native") != "native",
    reason="shared-memory links are the native engine's (the Python engine keeps UDP and says why)",
)


@pytest.fixture
def device():
    """A soft device of this test's own (its counters are this test's alone)."""
    d = open_device("soft")
    yield d
    d.close()


def message(i: int) -> bytes:
    return i.to_bytes(8, "little") * 8


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs (the two pollers on one yield instead)")
async def test_a_round_trip_finds_its_reply_while_the_loop_waits(device) -> None:
    """A 64 B echo's ACK and reply are found by the loop's wait (or by the loop's look
    before it), not by a turn of the loop per look: on a quiet host about one packet of
    each round trip is found waiting, on a loaded one (a peer descheduled past the poll
    window) still many. The two processes are on two CPUs (on one, a poller yields
    to its peer instead: test_shm.py)."""
    mine, theirs = sorted(os.sched_getaffinity(0))[:2]
    with ChildServer.start(mem_size=1 << 16) as child, pinned(child.proc.pid, {theirs}), pinned(os.getpid(), {mine}):
        async with await aiordma.connect("127.0.0.1", child.port, device=device) as conn:
            assert conn.path.transport == shm.LINK_TRANSPORT
            for i in range(200):
                await conn.send(message(i))
                assert await conn.recv() == message(i)
            hits0 = device.counters.get("shm_wait_hits", 0)
            rounds = 1000
            for i in range(rounds):
                await conn.send(message(i))
                assert await conn.recv() == message(i)
            hits = device.counters.get("shm_wait_hits", 0) - hits0
    assert hits >= rounds // 4, f"{hits} packets of {2 * rounds} found by the wait"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs (the two pollers on one yield instead)")
async def test_a_loop_waiting_for_link_packets_still_serves_timers_sockets_and_threads(device) -> None:
    """With a ping-pong keeping the loop in its wait, a 2 ms timer, a TCP echo on the
    same loop and a thread's call_soon_threadsafe are each served within a few
    milliseconds at the median (the wait looks at the loop's selector every 5 µs and
    ends at asyncio's next timer or after 50 µs; a timer's own resolution is a
    millisecond, uvloop's among them). The two processes are on two CPUs, as above."""
    loop = asyncio.get_running_loop()
    mine, theirs = sorted(os.sched_getaffinity(0))[:2]
    with ChildServer.start(mem_size=1 << 16) as child, pinned(child.proc.pid, {theirs}), pinned(os.getpid(), {mine}):
        async with await aiordma.connect("127.0.0.1", child.port, device=device) as conn:
            assert conn.path.transport == shm.LINK_TRANSPORT
            stop = False
            round_trips = 0

            async def ping_pong() -> None:
                nonlocal round_trips
                while not stop:
                    await conn.send(message(round_trips))
                    assert await conn.recv() == message(round_trips)
                    round_trips += 1

            async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                while data := await reader.read(64):
                    writer.write(data)
                writer.close()

            tcp = await asyncio.start_server(echo, "127.0.0.1", 0)
            reader, writer = await asyncio.open_connection("127.0.0.1", tcp.sockets[0].getsockname()[1])
            pinger = asyncio.create_task(ping_pong())
            try:
                while round_trips < 100:
                    await asyncio.sleep(0.001)
                hits0 = device.counters.get("shm_wait_hits", 0)
                timer_late, tcp_rtt, thread_lag = [], [], []
                for i in range(30):
                    start = loop.time()
                    await asyncio.sleep(0.002)
                    timer_late.append(loop.time() - start - 0.002)

                    start = time.perf_counter()
                    writer.write(b"%04d" % i)
                    assert await reader.readexactly(4) == b"%04d" % i
                    tcp_rtt.append(time.perf_counter() - start)

                    called: asyncio.Future[float] = loop.create_future()
                    caller = threading.Thread(
                        target=lambda f=called: loop.call_soon_threadsafe(f.set_result, time.perf_counter())
                    )
                    caller.start()
                    thread_lag.append(time.perf_counter() - await called)
                    caller.join()
                hits = device.counters.get("shm_wait_hits", 0) - hits0
            finally:
                stop = True
                await pinger
                writer.close()
                tcp.close()
                await tcp.wait_closed()
    assert hits > 100, "the loop did not wait for link packets meanwhile"
    medians = {
        "timer lateness": statistics.median(timer_late),
        "TCP echo": statistics.median(tcp_rtt),
        "thread's call": statistics.median(thread_lag),
    }
    assert all(m < 0.005 for m in medians.values()), medians


async def test_links_made_and_freed_by_another_thread_while_the_loop_waits(device) -> None:
    """Another thread's loop shares the device (its connections run through the NIC
    thread) and makes and frees links to a second server over and over, while this
    loop's ping-pong keeps it waiting for its own link's packets: the wait reads every
    link's ring without the engine lock, so a link freed meanwhile must stay mapped
    until the wait ends (nic_shm.c: the graveyard). Both threads' every byte arrives.
    (The free rarely falls inside a wait: the freeing thread needs the GIL that the
    waiting one holds, so this runs the sharing, not that overlap on demand.)"""
    with ChildServer.start(mem_size=1 << 16) as first, ChildServer.start(mem_size=1 << 16) as second:
        async with await aiordma.connect("127.0.0.1", first.port, device=device) as conn:
            assert conn.path.transport == shm.LINK_TRANSPORT
            done = threading.Event()
            churned: list[int] = []
            failure: list[BaseException] = []

            async def churn() -> None:
                for i in range(40):
                    async with await aiordma.connect("127.0.0.1", second.port, device=device) as other:
                        await other.send(message(i))
                        assert await other.recv() == message(i)
                    churned.append(i)

            def other_thread() -> None:
                try:
                    asyncio.run(churn())
                except BaseException as e:  # (reported by the assertion below)
                    failure.append(e)
                finally:
                    done.set()

            thread = threading.Thread(target=other_thread)
            thread.start()
            i = 0
            while not done.is_set():
                await conn.send(message(i))
                assert await conn.recv() == message(i)
                i += 1
            thread.join()
    assert not failure, failure
    assert len(churned) == 40 and i > 40
