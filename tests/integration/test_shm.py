"""Shared-memory links: the packets between soft devices of two processes of one
host through rings in a memfd only the two share (aiordma.providers.soft.shm).

The server is a real second process; the traffic goes through the public API;
``conn.path.transport`` and the device counters (``tx_shm``/``rx_shm`` beside
``tx_packets``/``rx_packets``) say which way the packets went, and every byte is
checked. A link that cannot be made leaves the connection on UDP with the reason."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

import aiordma
from aiordma.providers import open_device
from aiordma.providers.soft import shm
from aiordma.providers.soft.engine import native_status
from tests.support.affinity import pinned

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not native_status()[0] or os.environ.get("AIORDMA_SOFT_ENGINE", "native") != "native",
    reason="shared-memory links are the native engine's (the Python engine keeps UDP and says why)",
)

# A server process: 1 MiB exposed read-write as "mem"; it echoes every message but
# four: b"counters" (its device's counters), b"path" (its side's conn.path.transport),
# b"links" (how many links its device has) and b"block" (its loop blocks for 1.5 s).
SERVER = textwrap.dedent(
    """
    import asyncio, msgpack, time, aiordma
    async def main():
        region = aiordma.register(bytearray(1 << 20))
        async def handler(conn):
            async for m in conn:
                if m == b"counters":
                    await conn.send(msgpack.packb(conn.device.counters))
                elif m == b"path":
                    await conn.send(conn.path.transport.encode())
                elif m == b"links":
                    await conn.send(str(conn.device._engine.shm_links).encode())
                elif m == b"block":  # the loop blocked (what a CPU-bound handler does)
                    await conn.send(b"blocking")
                    time.sleep(1.5)
                    await conn.send(b"done")
                else:
                    await conn.send(m)
        server = await aiordma.start_server(handler, "127.0.0.1", 0, expose={"mem": region.exposed("rwa")})
        print(server.port, flush=True)
        await asyncio.sleep(3600)
    asyncio.run(main())
    """
)


class ServerProcess:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER],
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process so far."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def server():
    s = ServerProcess()
    yield s
    s.stop()


@pytest.fixture
def device():
    """A soft device of this test's own (its counters are this test's alone)."""
    d = open_device("soft")
    yield d
    d.close()


async def ask(conn: aiordma.Connection, what: bytes) -> Any:
    await conn.send(what)
    reply = await conn.recv()
    return dict(msgpack.unpackb(reply)) if what == b"counters" else reply.decode()


def moved(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    keys = ("tx_packets", "rx_packets", "tx_shm", "rx_shm")
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


async def test_every_kind_of_operation_goes_through_the_link_and_arrives_intact(server, device) -> None:
    assert device.shared_memory_links, device.shared_memory_reason
    async with await aiordma.connect("127.0.0.1", server.port, device=device) as conn:
        assert conn.path.transport == shm.LINK_TRANSPORT
        assert "transport shared-memory link" in str(conn.path)
        assert await ask(conn, b"path") == shm.LINK_TRANSPORT  # the server's side
        before, peer_before = dict(device.counters), await ask(conn, b"counters")
        remote = conn.remote("mem")
        payloads = [os.urandom(n) for n in (1, 64, 4096, 5000, 300_000)]
        for p in payloads:  # sends, one packet to many
            await conn.send(p)
            assert await conn.recv() == p
        for i in range(1200):  # 4.8 MiB each way: each ring (4 MiB) wraps around
            block = i.to_bytes(4, "little") * 1024
            await conn.send(block)
            assert await conn.recv() == block
        data = os.urandom(200_000)
        await conn.write(data, remote[1000 : 1000 + len(data)])
        assert await conn.read(remote[1000 : 1000 + len(data)]) == data
        assert await conn.fetch_and_add(remote[0:8], 5) == 0
        assert await conn.compare_and_swap(remote[0:8], 5, 9) == 5
        after, peer_after = dict(device.counters), await ask(conn, b"counters")
    mine, theirs = moved(before, after), moved(peer_before, peer_after)
    # every packet either end sent went through the link (the counters query's own
    # reply is the only packet counted on one side and not the other)
    assert mine["tx_packets"] == mine["tx_shm"] > 10
    assert mine["rx_packets"] == mine["rx_shm"] > 10
    assert theirs["tx_shm"] == theirs["tx_packets"]
    assert theirs["rx_shm"] == theirs["rx_packets"]
    assert device.counters.get("shm_broken", 0) == 0


async def test_connections_to_one_peer_device_share_one_link(server, device) -> None:
    conns = [await aiordma.connect("127.0.0.1", server.port, device=device) for _ in range(3)]
    try:
        for i, conn in enumerate(conns):
            assert conn.path.transport == shm.LINK_TRANSPORT
            await conn.send(b"%d" % i)
            assert await conn.recv() == b"%d" % i
        assert device._engine.shm_links == 1
        assert await ask(conns[0], b"links") == "1"
    finally:
        for conn in conns:
            await conn.close()
    assert device._engine.shm_links == 0  # the last QP's close unmapped it


@pytest.mark.parametrize("side", ["client", "server"])
async def test_either_side_turning_links_off_keeps_udp_and_says_why(side, monkeypatch) -> None:
    env = {}
    if side == "client":
        monkeypatch.setenv("AIORDMA_SOFT_SHM", "0")
    else:
        env["AIORDMA_SOFT_SHM"] = "0"
    s = ServerProcess(env)
    device = open_device("soft")  # (read the setting now)
    try:
        assert device.shared_memory_links is (side != "client")
        async with await aiordma.connect("127.0.0.1", s.port, device=device) as conn:
            assert conn.path.transport.startswith("UDP ("), conn.path.transport
            if side == "client":
                assert "AIORDMA_SOFT_SHM=0" in conn.path.transport
            else:
                assert "the peer offers no shared-memory link" in conn.path.transport
            await conn.send(b"x" * 3000)
            assert await conn.recv() == b"x" * 3000
            assert device.counters.get("tx_shm", 0) == device.counters.get("rx_shm", 0) == 0
            assert device.counters["tx_packets"] > 0
    finally:
        s.stop()
        device.close()


def test_a_capture_turns_links_off(tmp_path) -> None:
    from aiordma.providers.soft.device import SoftDevice

    dev = SoftDevice(capture=str(tmp_path / "c.pcap"))
    try:
        assert not dev.shared_memory_links
        assert "capture" in (dev.shared_memory_reason or "")
        assert dev.shm_offer() is None
    finally:
        dev.close()


def test_the_python_engine_keeps_udp_and_says_why() -> None:
    from aiordma.providers.soft.device import SoftDevice

    dev = SoftDevice(engine="python")
    try:
        assert not dev.shared_memory_links
        assert "python engine keeps UDP" in (dev.shared_memory_reason or "")
    finally:
        dev.close()


async def test_a_peer_killed_with_sigkill_fails_operations_within_a_second(server, device) -> None:
    conn = await aiordma.connect("127.0.0.1", server.port, device=device)
    try:
        assert conn.path.transport == shm.LINK_TRANSPORT
        await conn.send(b"warm")
        assert await conn.recv() == b"warm"
        recv = asyncio.ensure_future(conn.recv())
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        t0 = time.monotonic()
        with pytest.raises(aiordma.ConnectionLostError):
            await asyncio.wait_for(recv, 5)
        with pytest.raises((aiordma.ConnectionLostError, aiordma.WorkCompletionError)):
            await asyncio.wait_for(conn.write(b"y", conn.remote("mem")[0:1]), 5)
        assert time.monotonic() - t0 < 1.0
    finally:
        conn.abort()


async def test_a_blocked_peer_loop_still_serves_one_sided_operations(server, device) -> None:
    """The server's loop polled its link (it had just sent) and then blocks: within
    SHM_POLL_STALL its NIC thread takes the link back and serves the Reads, as it
    serves them from the socket, whatever the loop does."""
    async with await aiordma.connect("127.0.0.1", server.port, device=device) as conn:
        remote = conn.remote("mem")
        await conn.write(b"served while blocked", remote[0:20])
        await conn.send(b"block")
        assert await conn.recv() == b"blocking"
        await asyncio.sleep(0.05)  # (the server's loop is in time.sleep now)
        t0 = time.monotonic()
        for _ in range(50):
            assert await conn.read(remote[0:20]) == b"served while blocked"
        elapsed = time.monotonic() - t0
        assert elapsed < 0.5, f"50 Reads took {elapsed:.2f} s while the peer's loop was blocked"
        assert await asyncio.wait_for(conn.recv(), 5) == b"done"


async def test_a_polling_target_takes_requests_without_a_kick(device) -> None:
    """The server's NIC thread serves the Reads (its loop is idle) and, between them,
    polls the link with its ring marked awake: this end's requests need no kick (an
    eventfd write, a system call) while they keep coming. Messages in between hand the
    server's wake-ups to its loop and back (the NIC thread stops polling and kicks for
    anything that came meanwhile): nothing waits for a timer. The server's poll window
    is 20 ms here (50 µs by default): on a loaded host this process can be off the CPU
    for longer than 50 µs between two Reads, and a window that closed costs a kick."""
    server = ServerProcess(env={"AIORDMA_SOFT_POLL_US": "20000"})
    try:
        async with await aiordma.connect("127.0.0.1", server.port, device=device) as conn:
            remote = conn.remote("mem")
            await conn.write(b"polled", remote[0:6])
            kicks0 = device.counters["shm_kicks"]
            for _ in range(2000):
                assert await conn.read(remote[0:6]) == b"polled"
            kicks = device.counters["shm_kicks"] - kicks0
            # (one per Read before the NIC thread looked at the link itself)
            assert kicks < 2000 // 4, f"{kicks} kicks for 2000 Reads toward a polling NIC thread"
            t0 = time.monotonic()
            for i in range(200):
                for _ in range(10):
                    assert await conn.read(remote[0:6]) == b"polled"
                await conn.send(i.to_bytes(2, "little"))
                assert await asyncio.wait_for(conn.recv(), 5) == i.to_bytes(2, "little")
            elapsed = time.monotonic() - t0
            assert elapsed < 3.0, f"2,000 Reads and 200 echoes took {elapsed:.2f} s: a packet waited for a timer"
    finally:
        server.stop()


async def test_peers_polling_from_one_cpu_hand_it_to_each_other(server, device) -> None:
    """Both processes on one CPU (a container of one CPU; more busy processes than CPUs):
    a poller that spins while its peer waits for the same CPU delays the answer it waits
    for until the scheduler preempts it (a 64 B round trip took 220 µs there, 40 over
    TCP). Each poller says which CPU it polls from in the link, and one that finds its
    peer's there gives the CPU up (``shm_yields``): the loops for messages, the server's
    NIC thread for the Reads it serves. Every byte arrives; the default settings."""
    cpu = {min(os.sched_getaffinity(0))}
    with pinned(server.proc.pid, cpu), pinned(os.getpid(), cpu):
        async with await aiordma.connect("127.0.0.1", server.port, device=device) as conn:
            assert conn.path.transport == shm.LINK_TRANSPORT
            remote = conn.remote("mem")
            await conn.write(b"pinned", remote[0:6])
            yields0 = device.counters.get("shm_yields", 0)
            served0 = (await ask(conn, b"counters")).get("shm_yields", 0)
            for i in range(200):
                msg = i.to_bytes(2, "little") * 32
                await conn.send(msg)
                assert await conn.recv() == msg
            for _ in range(200):
                assert await conn.read(remote[0:6]) == b"pinned"
            yields = device.counters.get("shm_yields", 0) - yields0
            served = (await ask(conn, b"counters")).get("shm_yields", 0) - served0
            assert yields > 0, "this end never gave the CPU to a peer polling on it"
            assert served > 0, "the server never gave the CPU to a peer polling on it"


async def test_idle_connections_cost_no_cpu(server, device) -> None:
    """100 idle connections over one link: neither process spends 1 % of a core."""
    conns = [await aiordma.connect("127.0.0.1", server.port, device=device) for _ in range(100)]
    try:
        assert {c.path.transport for c in conns} == {shm.LINK_TRANSPORT}
        for conn in conns[:5]:
            await conn.send(b"last word")
            assert await conn.recv() == b"last word"
        await asyncio.sleep(0.3)  # (past the poll window and the NIC thread's spin)
        t0, mine0, theirs0 = time.monotonic(), time.process_time(), server.cpu_seconds()
        await asyncio.sleep(2.0)
        wall = time.monotonic() - t0
        mine, theirs = (time.process_time() - mine0) / wall, (server.cpu_seconds() - theirs0) / wall
        assert mine < 0.01, f"this process used {mine:.1%} of a core with 100 idle connections"
        assert theirs < 0.01, f"the server used {theirs:.1%} of a core with 100 idle connections"
    finally:
        for conn in conns:
            conn.abort()


class TestAttachRefusesWhatIsNotALink:
    """What a lying rendezvous can name: each is refused with the reason, and the
    device goes on (its links, none, are untouched)."""

    @pytest.fixture
    def dev(self):
        from aiordma.providers.soft.device import SoftDevice

        d = SoftDevice(engine="native")
        yield d
        assert d._engine.shm_links == 0
        d.close()

    def test_a_descriptor_the_process_does_not_have(self, dev) -> None:
        with pytest.raises(OSError, match="cannot copy the peer's memfd"):
            dev.shm_attach(os.getpid(), 1, 1, 10_000, 10_001)

    def test_a_process_that_does_not_exist(self, dev) -> None:
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        with pytest.raises(OSError, match="pidfd_getfd"):
            dev.shm_attach(gone.pid, 1, 1, 3, 4)

    def test_an_unsealed_memfd_or_a_file_of_another_size(self, dev) -> None:
        fd = os.memfd_create("not-a-link")
        try:
            os.ftruncate(fd, 4096)
            with pytest.raises(OSError, match="not a sealed link of the expected size"):
                dev.shm_attach(os.getpid(), 1, 1, fd, dev._engine.shm_wakefd)
        finally:
            os.close(fd)

    def test_a_link_with_another_id(self, dev) -> None:
        from aiordma.providers.soft.device import SoftDevice

        maker = SoftDevice(engine="native")
        try:
            link, memfd = maker.shm_make(os.getpid(), dev._engine.shm_device, dev._engine.shm_wakefd)
            with pytest.raises(OSError, match="not the link it named"):
                dev.shm_attach(os.getpid(), maker._engine.shm_device, link ^ 1, memfd, maker._engine.shm_wakefd)
        finally:
            maker.close()

    def test_a_wake_up_descriptor_that_is_not_an_eventfd(self, dev) -> None:
        r, w = os.pipe()
        try:
            with pytest.raises(OSError, match="not a non-blocking eventfd"):
                dev.shm_make(os.getpid(), 1, r)
        finally:
            os.close(r)
            os.close(w)


# ------------------------------------------------------------ a hostile ring ----
# The consumer's rules (shm.c, shm_ring_next) in Python: what a peer writes into a
# ring, checked before it is used. Layout of the memfd (shm.h): a 64-byte header, two
# 128-byte control blocks (tail at +0, head at +64, sleeping at +72), then the rings.
RING_BYTES = 4 << 20  # (shm.h: SHM_RING_BYTES)
CTL0 = 64
DATA0 = 64 + 2 * 128
RECORD_HDR = 8
KIND_PACKET, KIND_PAD = 1, 2
MAX_HDR_LEN = 48  # (wire.h)


def consumer_model(image: bytes, tail: int) -> tuple[int, bool]:
    """Records taken, and whether the ring is broken, for a fresh ring whose
    first ``len(image)`` bytes are ``image`` and whose producer says ``tail``."""
    import struct

    pos = limit = taken = 0
    while True:
        if pos == limit:
            if tail == pos:
                return taken, False
            if tail < pos or tail > RING_BYTES:
                return taken, True
            limit = tail
        off, avail = pos % RING_BYTES, limit - pos
        if avail < RECORD_HDR or RING_BYTES - off < RECORD_HDR:
            return taken, True
        length, hlen, kind = struct.unpack_from("<IHH", image.ljust(off + RECORD_HDR, b"\0"), off)
        if length > RING_BYTES:
            return taken, True
        need = RECORD_HDR + ((length + 7) & ~7)
        if need > avail or need > RING_BYTES - off:
            return taken, True
        if kind == KIND_PAD:
            if off + need != RING_BYTES:
                return taken, True
            pos += need
            continue
        if kind != KIND_PACKET or hlen > length or hlen > MAX_HDR_LEN:
            return taken, True
        taken += 1
        pos += need


class TestAHostileRing:
    """A peer that writes what it likes into a ring and its tail: the consumer
    takes exactly the records the rules allow (each then goes through the packet
    checks: here, no QP takes them), marks the ring broken at the first that
    breaks one, and nothing else happens (the AddressSanitizer build runs this)."""

    @pytest.fixture(scope="class")
    @classmethod
    def pair(cls):
        from aiordma.providers.soft.device import SoftDevice

        maker, taker = SoftDevice(engine="native"), SoftDevice(engine="native")
        yield maker, taker
        maker.close()
        taker.close()

    def _link(self, maker: Any, taker: Any) -> Any:
        """A fresh link from ``maker`` to ``taker`` (each its own: a broken ring stays
        broken) and the memfd's memory as this test writes it."""
        import mmap

        # a new id, so a new link (not `random`: Hypothesis seeds it alike for every example)
        peer_device = int.from_bytes(os.urandom(7), "little") + 1
        link, memfd = maker.shm_make(os.getpid(), peer_device, taker._engine.shm_wakefd)
        taker.shm_attach(os.getpid(), maker._engine.shm_device, link, memfd, maker._engine.shm_wakefd)
        return mmap.mmap(memfd, DATA0 + 2 * RING_BYTES)

    def _run(self, pair: Any, image: bytes, tail: int) -> None:
        import time as _time

        maker, taker = pair
        mem = self._link(maker, taker)
        before = dict(taker.counters)
        mem[DATA0 : DATA0 + len(image)] = image
        mem[CTL0 : CTL0 + 8] = tail.to_bytes(8, "little")  # (publishes: the consumer reads the tail first)
        taken, broken = consumer_model(image, tail)
        os.eventfd_write(taker._engine.shm_wakefd, 1)  # the kick

        def seen() -> tuple[int, int]:
            c = taker.counters
            return c.get("rx_shm", 0) - before.get("rx_shm", 0), c.get("shm_broken", 0) - before.get("shm_broken", 0)

        deadline = _time.monotonic() + 5
        while seen() != (taken, int(broken)) and _time.monotonic() < deadline:
            _time.sleep(0.002)
        _time.sleep(0.01)
        assert seen() == (taken, int(broken)), (taken, broken)
        mem.close()

    def test_honest_records_are_all_taken(self, pair) -> None:
        import struct

        image = b"".join(
            struct.pack("<IHH", n, min(n, 12), KIND_PACKET) + os.urandom(n).ljust((n + 7) & ~7, b"\0")
            for n in (0, 1, 12, 100, 4096, 7)
        )
        self._run(pair, image, len(image))

    def test_a_tail_beyond_the_ring_breaks_it(self, pair) -> None:
        self._run(pair, b"", RING_BYTES + 8)

    def test_a_length_past_the_tail_breaks_it(self, pair) -> None:
        import struct

        self._run(pair, struct.pack("<IHH", 64, 12, KIND_PACKET), 16)

    def test_a_header_longer_than_any_breaks_it(self, pair) -> None:
        import struct

        self._run(pair, struct.pack("<IHH", 100, 60, KIND_PACKET) + bytes(104), 112)

    def test_a_pad_that_does_not_run_to_the_end_breaks_it(self, pair) -> None:
        import struct

        self._run(pair, struct.pack("<IHH", 8, 0, KIND_PAD) + bytes(8), 16)

    def test_random_rings(self, pair) -> None:
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st

        record = st.tuples(
            st.one_of(st.integers(0, 300), st.integers(0, 1 << 32 - 1)),  # length (some hostile)
            st.integers(0, 70),  # header length
            st.sampled_from([KIND_PACKET, KIND_PACKET, KIND_PACKET, KIND_PAD, 0, 7]),
        )

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        @given(records=st.lists(record, max_size=12), tail_shift=st.one_of(st.just(0), st.integers(-64, 64)))
        def check(records: list[tuple[int, int, int]], tail_shift: int) -> None:
            import struct

            image = b""
            for length, hlen, kind in records:
                body = min(length, 300)
                image += struct.pack("<IHH", length, hlen, kind) + os.urandom(body).ljust((body + 7) & ~7, b"\0")
            self._run(pair, image, max(0, len(image) + tail_shift))

        check()
