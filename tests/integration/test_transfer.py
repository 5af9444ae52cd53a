"""Descriptor-list transfers (``Connection.prepare_transfer`` / ``transfer``): thousands
of scattered RDMA Reads and Writes as one handle, over the soft device with both
engines and both event loops (and, in CI's reference run, the interpreted core)."""

from __future__ import annotations

import asyncio
import os
import tracemalloc

import numpy as np
import pytest

import aiordma
from aiordma import (
    DescriptorError,
    RemoteAccessError,
    RemoteBuffer,
    TransferAbortedError,
    TransferError,
)
from aiordma.core import select_core
from aiordma.providers.soft.device import SoftDevice
from aiordma.providers.soft.engine import native_status
from aiordma.providers.soft.faults import LinkFaults

ENGINES = ("python", "native") if native_status()[0] else ("python",)
REGION = 4 << 20
BLOCK = 4096


@pytest.fixture(params=ENGINES)
async def pair(request):
    # (the first free 127.0.0.N: a fixed address collides with another suite's running beside)
    dev = SoftDevice(engine=request.param)
    mem = bytearray(os.urandom(REGION))
    region = aiordma.register(mem, device=dev)

    async def handler(conn):
        await conn.wait_closed()

    server = await aiordma.start_server(handler, "127.0.0.1", 0, device=dev, expose={"m": region.exposed("rw")})
    # a small send queue: a list of hundreds is many chunks
    conn = await aiordma.connect("127.0.0.1", server.port, device=dev, send_queue_depth=32)
    yield conn, mem, request.param
    await conn.close()
    server.close()
    await server.wait_closed()
    region.close()
    dev.close()


def scattered(n: int, block: int = BLOCK, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``n`` distinct block-aligned places of the peer's region, read into consecutive
    places of a local buffer: the table, and the remote offsets."""
    rng = np.random.default_rng(seed)
    remote = rng.choice(REGION // block, n, replace=False).astype(np.uint64) * block
    local = np.arange(n, dtype=np.uint64) * block
    return np.stack([local, remote, np.full(n, block, dtype=np.uint64)], axis=1), remote


async def test_scattered_reads_land_in_place(pair):
    conn, mem, _ = pair
    n = 600
    table, offsets = scattered(n)
    local = conn.register(bytearray(n * BLOCK))
    transfer = conn.transfer("read", local, conn.remote("m"), table)
    assert isinstance(transfer, aiordma.Transfer) and transfer.count == n
    await transfer
    assert transfer.done() and transfer.completed == n and transfer.exception() is None
    view = local.view
    for i, o in enumerate(offsets.tolist()):
        assert view[i * BLOCK : (i + 1) * BLOCK] == mem[o : o + BLOCK], i
    stats = conn.stats
    assert stats["operations_outstanding"] == 0 and stats["send_queue_free"] == stats["send_queue_depth"]
    local.close()


async def test_reads_into_a_large_region_land_exactly(pair):
    """A destination region of 16 MiB or more takes READ payloads of 2 KiB or more with
    streaming stores in the native engine (rc.c: place): blocks at odd offsets and of odd
    lengths, around the streaming loop's 16-byte alignment and 64-byte steps, land
    exactly, and the bytes around them stay as they were."""
    conn, mem, _ = pair
    big = bytearray(17 << 20)
    local = conn.register(big)
    rng = np.random.default_rng(5)
    cases = [(1, 0, 2048), (4095 + 3, 8, 4096), (16 << 20, 1000, 9000), (77, 12345, 4096 + 63), (64, 640, 65)]
    cases += [(int(rng.integers(0, 16 << 20)), int(rng.integers(0, REGION - 70000)), int(rng.integers(1, 70000)))
              for _ in range(20)]  # fmt: skip
    for at, src, n in cases:
        table = np.array([[at, src, n]], dtype=np.uint64)
        before = bytes(big[max(at - 64, 0) : at]), bytes(big[at + n : at + n + 64])
        await asyncio.wait_for(conn.transfer("read", local, conn.remote("m"), table), 10)
        assert big[at : at + n] == mem[src : src + n], (at, src, n)
        assert (bytes(big[max(at - 64, 0) : at]), bytes(big[at + n : at + n + 64])) == before, (at, src, n)
        big[at : at + n] = bytes(n)  # (so that the next case's surroundings are known)


async def test_scattered_writes_land_in_the_peers_memory(pair):
    conn, mem, _ = pair
    n = 300
    table, offsets = scattered(n, seed=2)
    data = os.urandom(n * BLOCK)
    local = conn.register(bytearray(data))
    await conn.transfer("write", local, conn.remote("m"), table)
    for i, o in enumerate(offsets.tolist()):
        assert mem[o : o + BLOCK] == data[i * BLOCK : (i + 1) * BLOCK], i
    local.close()


async def test_a_prepared_list_is_posted_again_whole_or_by_indices(pair):
    conn, mem, _ = pair
    n = 200
    table, offsets = scattered(n, block=1024, seed=3)
    table[:, 1] = table[:, 1] // 4  # (1 KiB blocks at 1 KiB-aligned places)
    offsets = table[:, 1].tolist()
    local = conn.register(bytearray(n * 1024))
    prepared = conn.prepare_transfer("read", local, conn.remote("m"), table)
    assert len(prepared) == n and prepared.nbytes == n * 1024 and prepared.op == "read"
    for _ in range(3):
        local.view[:] = bytes(n * 1024)
        await prepared.start()
        assert all(local.view[i * 1024 : (i + 1) * 1024] == mem[o : o + 1024] for i, o in enumerate(offsets))
    # a subset, by a NumPy array or a list: only those move
    for chosen in (np.array([7, 150, 3], dtype=np.int64), [199, 0]):
        local.view[:] = bytes(n * 1024)
        t = prepared.start(chosen)
        assert t.count == len(chosen)
        await t
        for i in range(n):
            got = local.view[i * 1024 : (i + 1) * 1024]
            want = mem[offsets[i] : offsets[i] + 1024] if i in list(chosen) else bytes(1024)
            assert got == want, i
    with pytest.raises(IndexError, match="index 200 .* is not a descriptor of a list of 200"):
        prepared.start([1, 200])
    local.close()


async def test_sequences_and_slices_of_a_region(pair):
    conn, mem, _ = pair
    region = conn.register(bytearray(1 << 16))
    window = region[4096 : 4096 + 3 * 100]  # a slice: offsets count from its start
    rows = [(0, 1000, 100), (200, 50_000, 100), (100, 7, 100)]
    await conn.transfer("read", window, conn.remote("m"), rows)
    assert bytes(region.view[4096 : 4096 + 100]) == mem[1000:1100]
    assert bytes(region.view[4096 + 200 : 4096 + 300]) == mem[50_000:50_100]
    assert bytes(region.view[4096 + 100 : 4096 + 200]) == mem[7:107]
    assert bytes(region.view[:4096]) == bytes(4096)
    with pytest.raises(DescriptorError, match=r"descriptor 0: local range \[250, 350\) is outside the 300-byte"):
        conn.prepare_transfer("read", window, conn.remote("m"), [(250, 0, 100)])
    region.close()


async def test_bad_lists_are_refused_before_anything_is_posted(pair):
    conn, mem, _ = pair
    remote = conn.remote("m")
    before = bytes(mem[:8192])
    local = conn.register(bytearray(os.urandom(8192)))
    cases = [
        ([(0, 0, 4096), (4096, 4096, 0)], 1, "has length 0"),
        ([(0, 0, 4096), (4096, REGION - 100, 4096)], 1, "outside the 4194304-byte remote buffer"),
        ([(0, 0, 4096), (4096, 4096, 4096), (100, 8192, 200)], 2, "overlaps descriptor 0's"),
    ]
    for rows, index, words in cases:
        with pytest.raises(DescriptorError, match=words) as info:
            conn.transfer("read", local, remote, rows)
        assert info.value.index == index and isinstance(info.value, ValueError)
    # a Write's destinations are the peer's: overlapping remote ranges are refused, nothing written
    with pytest.raises(DescriptorError, match="remote range overlaps descriptor 0's") as info:
        conn.transfer("write", local, remote, [(0, 0, 4096), (4096, 4000, 4096)])
    assert info.value.index == 1
    stats = conn.stats
    assert bytes(mem[:8192]) == before and stats["operations_outstanding"] == 0
    assert stats["send_queue_free"] == stats["send_queue_depth"]
    with pytest.raises(ValueError, match="'read' or 'write'"):
        conn.transfer("copy", local, remote, [(0, 0, 1)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="registered memory"):
        conn.transfer("read", bytearray(10), remote, [(0, 0, 1)])
    with pytest.raises(TypeError, match="64-bit integers"):
        conn.transfer("read", local, remote, np.zeros((1, 3), dtype=np.float32))
    # and the connection still works
    await conn.transfer("read", local, remote, [(0, 0, 4096)])
    assert bytes(local.view[:4096]) == bytes(mem[:4096])
    local.close()


async def test_a_failure_names_the_descriptor_and_what_completed(pair):
    """The peer refuses descriptor 150 (past the end of its region, which the remote
    buffer here claims is longer): descriptors 0..149 moved, nothing after did."""
    conn, mem, _ = pair
    real = conn.remote("m")
    lying = RemoteBuffer(real.addr, real.length + (1 << 20), real.rkey)
    n, bad = 300, 150
    table, offsets = scattered(n, seed=4)
    table[bad, 1] = REGION + 8192  # outside what the peer registered
    local = conn.register(bytearray(n * BLOCK))
    transfer = conn.transfer("read", local, lying, table)
    with pytest.raises(TransferError) as info:
        await transfer
    err = info.value
    assert err.index == bad and err.completed == bad and not isinstance(err, ConnectionError)
    assert isinstance(err.error, RemoteAccessError) and err.__cause__ is err.error
    assert f"descriptor {bad} (position {bad} of {n}; the {bad} before it completed)" in str(err)
    assert transfer.done() and isinstance(transfer.exception(), TransferError)
    view = local.view
    for i in range(bad):
        o = int(offsets[i])
        assert view[i * BLOCK : (i + 1) * BLOCK] == mem[o : o + BLOCK], i
    assert view[bad * BLOCK :] == bytes((n - bad) * BLOCK)
    local.close()


async def test_a_failure_by_index_names_the_list_index(pair):
    conn, mem, _ = pair
    real = conn.remote("m")
    lying = RemoteBuffer(real.addr, real.length + (1 << 20), real.rkey)
    rows = [(i * 64, i * 64, 64) for i in range(40)] + [(40 * 64, REGION + 64, 64)]
    local = conn.register(bytearray(41 * 64))
    prepared = conn.prepare_transfer("read", local, lying, rows)
    with pytest.raises(TransferError) as info:
        await prepared.start([3, 5, 40, 7])
    assert info.value.index == 40 and info.value.completed == 2
    local.close()


async def test_several_transfers_in_flight_each_finish_on_their_own(pair):
    conn, mem, _ = pair
    remote = conn.remote("m")
    locals_ = [conn.register(bytearray(100 * BLOCK)) for _ in range(3)]
    tables = [scattered(100, seed=10 + k) for k in range(3)]
    transfers = [conn.transfer("read", loc, remote, t) for loc, (t, _) in zip(locals_, tables)]
    # polled, not awaited
    for _ in range(10_000):
        if all(t.done() for t in transfers):
            break
        await asyncio.sleep(0)
    assert all(t.done() and t.result() is None for t in transfers)
    for loc, (_, offsets) in zip(locals_, tables):
        for i, o in enumerate(offsets.tolist()):
            assert loc.view[i * BLOCK : (i + 1) * BLOCK] == mem[o : o + BLOCK]
        loc.close()


async def test_cancelling_stops_posting_and_settles(pair):
    conn, mem, _ = pair
    n = 2000
    table, offsets = scattered(n, block=1024, seed=5)
    table[:, 1] //= 4
    local = conn.register(bytearray(n * 1024))
    transfer = conn.transfer("read", local, conn.remote("m"), table)
    assert transfer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await transfer
    await transfer.settled()
    assert transfer.in_flight == 0 and transfer.cancelled()
    # what was posted before the cancel moved; far fewer than all
    assert transfer.completed < n
    # cancelling the task that awaits it cancels the transfer too
    second = conn.transfer("read", local, conn.remote("m"), table)

    async def wait() -> None:
        await second

    task = asyncio.ensure_future(wait())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert second.cancelled()
    await second.settled()
    assert second.in_flight == 0
    # and the connection goes on working
    await conn.transfer("read", local, conn.remote("m"), table[:10])
    assert local.view[:1024] == mem[int(table[0, 1]) : int(table[0, 1]) + 1024]
    local.close()


async def test_a_connection_lost_mid_transfer_is_a_connection_error(pair):
    conn, _mem, _ = pair
    n = 2000
    table, _ = scattered(n, block=1024, seed=6)
    table[:, 1] //= 4
    local = conn.register(bytearray(n * 1024))
    transfer = conn.transfer("read", local, conn.remote("m"), table)
    conn.abort()
    with pytest.raises(TransferAbortedError) as info:
        await transfer
    assert isinstance(info.value, ConnectionError) and isinstance(info.value, TransferError)
    assert info.value.completed < n
    with pytest.raises(ConnectionError):
        conn.transfer("read", local, conn.remote("m"), table)
    local.close()


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_write_transfer_notifies_the_peer_after_its_bytes(engine):
    """The peer gets one notification per Write transfer started with ``notify=``: its id
    (distinct for concurrent transfers) and payload, once every byte is in its memory."""
    dev = SoftDevice(engine=engine)
    mem = bytearray(REGION)
    region = aiordma.register(mem, device=dev)
    seen: asyncio.Queue = asyncio.Queue()

    async def handler(peer):
        for _ in range(2):
            note = await peer.recv_notification()
            # by now the bytes of that transfer are in place
            await seen.put((note.id, note.payload, bytes(mem)))
        await peer.wait_closed()

    server = await aiordma.start_server(handler, "127.0.0.1", 0, device=dev, expose={"m": region.exposed("rw")})
    conn = await aiordma.connect("127.0.0.1", server.port, device=dev, send_queue_depth=32)
    try:
        n = 200
        table, offsets = scattered(n, seed=7)
        data = os.urandom(n * BLOCK)
        local = conn.register(bytearray(data))
        prepared = conn.prepare_transfer("write", local, conn.remote("m"), table)
        first = prepared.start(notify=b"layer-0")
        second = prepared.start(np.arange(10), notify=b"")
        assert first.id != second.id
        await first
        await second
        got = {}
        for _ in range(2):
            tid, payload, snapshot = await asyncio.wait_for(seen.get(), 10)
            got[tid] = payload
            done = n if tid == first.id else 10
            for i, o in enumerate(offsets[:done].tolist()):
                assert snapshot[o : o + BLOCK] == data[i * BLOCK : (i + 1) * BLOCK]
        assert got == {first.id: b"layer-0", second.id: b""}
        with pytest.raises(ValueError, match="only a Write transfer notifies"):
            conn.prepare_transfer("read", local, conn.remote("m"), table).start(notify=b"x")
        with pytest.raises(ValueError, match="at most 4096 bytes"):
            prepared.start(notify=bytes(5000))
        local.close()
    finally:
        await conn.close()
        server.close()
        await server.wait_closed()
        region.close()
        dev.close()


async def test_a_million_descriptors(pair):
    """One transfer of 1,000,000 64-byte Reads: every one moves, and the prepared list
    and the transfer's state grow memory by at most 64 bytes per descriptor."""
    conn, mem, engine = pair
    if engine == "python":
        pytest.skip("a million work requests through the interpreted engine take minutes; the native one runs it")
    if select_core().name == "python":
        pytest.skip("the interpreted core builds a SendWR per descriptor (the reference): the compiled one runs it")
    n, size = 1_000_000, 64
    table = np.empty((n, 3), dtype=np.uint64)
    table[:, 0] = np.arange(n, dtype=np.uint64) * size
    table[:, 1] = (np.arange(n, dtype=np.uint64) * size * 7) % (REGION - size)  # (sources may overlap)
    table[:, 2] = size
    local = conn.register(bytearray(n * size))
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        transfer = conn.transfer("read", local, conn.remote("m"), table)
        await transfer
        grown = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert transfer.completed == n
    assert grown <= 64 * n, f"{grown / n:.1f} bytes per descriptor"
    view = local.view
    for i in (0, 1, 65_535, 65_536, 500_001, 999_999):
        o = int(table[i, 1])
        assert view[i * size : (i + 1) * size] == mem[o : o + size], i
    local.close()


@pytest.fixture(params=ENGINES)
async def two_rails(request):
    """Two rails to one peer's memory: two soft devices, a server on each exposing the
    same bytes, a connection over each, the same local buffer registered on both."""
    engine = request.param
    mem = bytearray(os.urandom(REGION))
    devs = [SoftDevice(engine=engine) for _ in range(2)]
    regions = [aiordma.register(mem, device=d) for d in devs]

    async def handler(conn):
        await conn.wait_closed()

    servers = [
        await aiordma.start_server(handler, "127.0.0.1", 0, device=d, expose={"m": r}) for d, r in zip(devs, regions)
    ]
    # a short transport timeout: a rail that stops answering fails within ~0.1 s
    timeout = 10 if engine == "native" else 13
    conns = [
        await aiordma.connect("127.0.0.1", s.port, device=d, ack_timeout=timeout, retry_cnt=2)
        for s, d in zip(servers, devs)
    ]
    yield conns, devs, mem
    for d in devs:
        d.faults = None
    for c in conns:
        c.abort()
    for s in servers:
        s.close()
        await s.wait_closed()
    for r in regions:
        r.close()
    for d in devs:
        d.close()


async def test_a_striped_read_uses_every_rail(two_rails):
    conns, _devs, mem = two_rails
    n = 1000
    table, offsets = scattered(n, seed=8)
    buf = bytearray(n * BLOCK)
    rails = [(c, c.register(buf), c.remote("m")) for c in conns]
    striped = aiordma.striped_transfer("read", rails, table, slice_size=100)
    await striped
    assert striped.completed == n and sum(striped.moved_by_rail) == n
    assert all(m > 0 for m in striped.moved_by_rail), striped.moved_by_rail
    view = memoryview(buf)
    for i, o in enumerate(offsets.tolist()):
        assert view[i * BLOCK : (i + 1) * BLOCK] == mem[o : o + BLOCK], i


async def test_a_rail_that_stops_answering_leaves_the_transfer_complete(two_rails):
    conns, devs, mem = two_rails
    n = 1000
    table, offsets = scattered(n, seed=9)
    buf = bytearray(n * BLOCK)
    rails = [(c, c.register(buf), c.remote("m")) for c in conns]
    striped = aiordma.striped_transfer("read", rails, table, slice_size=20)
    await asyncio.sleep(0)
    devs[1].faults = LinkFaults(drop=1.0)  # rail 1's peer goes silent mid-transfer
    await asyncio.wait_for(striped, 60)
    assert striped.completed == n
    assert isinstance(striped.rail_errors.get(1), TransferError), striped.rail_errors
    view = memoryview(buf)
    for i, o in enumerate(offsets.tolist()):
        assert view[i * BLOCK : (i + 1) * BLOCK] == mem[o : o + BLOCK], i


async def test_a_striped_transfer_fails_when_no_rail_is_left(two_rails):
    conns, devs, _mem = two_rails
    table, _ = scattered(500, seed=10)
    buf = bytearray(500 * BLOCK)
    rails = [(c, c.register(buf), c.remote("m")) for c in conns]
    for d in devs:
        d.faults = LinkFaults(drop=1.0)
    striped = aiordma.striped_transfer("read", rails, table, slice_size=50)
    with pytest.raises(TransferError, match="failed on every rail") as info:
        await asyncio.wait_for(striped, 60)
    assert info.value.completed == striped.completed < 500
    assert set(striped.rail_errors) == {0, 1}
    with pytest.raises(ValueError, match="at least one rail"):
        aiordma.striped_transfer("read", [], table)
