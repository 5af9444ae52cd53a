"""The receive buffers of large frames (``aiordma.integrations.dask.buffers``): a frame's
buffer is reused only once nothing Dask made of the frame refers to it, it is exactly
the frame's size and its own (Dask's ``get_host_array``), and the pool stays within
its bound. The comm tests read real frames through it over real aiordma connections."""

from __future__ import annotations

import gc
import pickle
import threading

import dask
import numpy as np
import pytest
from distributed.protocol import to_serialize
from distributed.protocol.utils_test import get_host_array

from aiordma.integrations.dask import Settings
from aiordma.integrations.dask.buffers import MIN_POOLED, FramePool, pool_for

from .test_comm import get_comm_pair

MB = 1 << 20


def _address(frame: memoryview) -> int:
    return int(np.frombuffer(frame, dtype="u1").ctypes.data)


def test_a_buffer_is_reused_only_when_every_view_of_the_frame_is_gone() -> None:
    pool = FramePool(64 * MB)
    frame = pool.take(3_200_000)
    first = _address(frame)
    arr = np.frombuffer(frame, dtype="f8").reshape(2000, 200)
    arr[:] = 7.0
    kept = [arr[5:9], memoryview(arr), pickle.PickleBuffer(arr)]
    del frame, arr
    gc.collect()
    while kept:
        other = pool.take(3_200_000)  # the first buffer is still in use: another one
        assert _address(other) != first
        del other
        kept.pop()
    again = pool.take(3_200_000)  # nothing refers to the first any more: it comes back
    assert _address(again) == first and pool.reused >= 1
    assert again.nbytes == 3_200_000 and not again.readonly
    assert (np.frombuffer(again, dtype="f8") == 7.0).all()  # (not zeroed: its old bytes)


def test_a_frame_has_its_own_buffer_exactly_its_size() -> None:
    pool = FramePool(64 * MB)
    a, b = pool.take(200_000), pool.take(200_000)
    ha, hb = get_host_array(np.frombuffer(a, "u1")), get_host_array(np.frombuffer(b, "u1"))
    assert ha is not hb and ha.nbytes == hb.nbytes == 200_000 and ha.base is None
    small = pool.take(MIN_POOLED - 1)  # small frames: numpy's allocator, untracked
    assert small.nbytes == MIN_POOLED - 1 and pool.tracked == 2


def test_the_pool_tracks_at_most_its_bound_and_lets_idle_buffers_go_first() -> None:
    pool = FramePool(10 * MB)
    held = [pool.take(4 * MB), pool.take(4 * MB)]
    assert pool.tracked_bytes == 8 * MB
    extra = pool.take(4 * MB)  # no room, none idle: a buffer of its own, untracked
    assert pool.untracked == 1 and pool.tracked_bytes == 8 * MB
    del extra
    held.pop()  # one tracked buffer idle: it makes room for another size
    six = pool.take(6 * MB)
    assert pool.tracked_bytes == 10 * MB and pool.idle_bytes() == 0
    del six
    assert pool.idle_bytes() == 6 * MB
    pool.clear()
    assert pool.tracked_bytes == 0 and pool.idle_bytes() == 0
    assert FramePool(0).take(4 * MB).nbytes == 4 * MB  # a pool of 0 bytes: never tracks


def test_threads_releasing_frames_while_others_take_them() -> None:
    """Frames are released on whichever thread drops them last (Dask's workers and its
    offload thread): no buffer is ever handed out while a frame still uses it."""
    pool = FramePool(32 * MB)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(200):
                frame = pool.take(1 * MB)
                arr = np.frombuffer(frame, dtype="u8")
                arr[:] = seed
                if rng.random() < 0.5:
                    threading.Event().wait(0.0005)
                assert (arr == seed).all(), "a buffer was handed out while in use"
        except BaseException as e:  # pragma: no cover - what the test is about
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert pool.reused > 0 and pool.tracked_bytes <= 32 * MB


async def test_comms_receive_large_frames_into_reused_buffers() -> None:
    """Over real aiordma connections: the arrays of a message read while earlier ones
    are still held get buffers of their own; once released, their buffers take the next
    frames of their size, whose bytes arrive intact."""
    pool = pool_for(Settings.from_config().buffer_pool)
    pool.clear()  # (what earlier tests left idle)
    a, b = await get_comm_pair()
    try:
        rng = np.random.default_rng(4)
        sent = [rng.random(500_000) for _ in range(6)]  # 4 MB each: pulled by RDMA Read
        before = pool.reused
        held = []
        for x in sent[:3]:
            await a.write({"x": to_serialize(x)})
            held.append((await b.read())["x"])
        hosts = [get_host_array(h) for h in held]
        assert len({id(h) for h in hosts}) == 3 and all(h.nbytes == 4_000_000 for h in hosts)
        assert all(np.array_equal(h, x) for h, x in zip(held, sent))
        assert pool.reused == before  # all three still in use
        del held, hosts
        gc.collect()
        got = []
        for x in sent[3:]:
            await a.write({"x": to_serialize(x)})
            got.append((await b.read())["x"])
        assert all(np.array_equal(g, x) for g, x in zip(got, sent[3:]))
        assert pool.reused - before == 3
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("setting", [0, "0 B"])
async def test_buffer_pool_0_receives_into_new_buffers(setting: object) -> None:
    with dask.config.set({"distributed.comm.rdma.buffer-pool": setting}):
        a, b = await get_comm_pair()
    try:
        x = np.arange(300_000, dtype="f8")
        await a.write({"x": to_serialize(x)})
        assert np.array_equal((await b.read())["x"], x)
        assert pool_for(0).tracked == 0
    finally:
        await a.close()
        await b.close()
