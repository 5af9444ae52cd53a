"""The frame table of a Dask message (aiordma.integrations.dask.framing): sans-IO,
every decision and every malformed batch, in memory."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from aiordma.integrations.dask import framing
from aiordma.integrations.dask.framing import INLINE, JOINED, FramingError, pack, unpack


def _receive(out: framing.Outgoing) -> list[bytes]:
    """What a receiver rebuilds: the batch parsed, each separate frame 'received'."""
    incoming = unpack(out.batch)
    assert len(incoming.separate) == len(out.separate)
    frames = list(incoming.frames)
    for (index, size), frame in zip(incoming.separate, out.separate):
        data = bytes(frame)
        assert len(data) == size
        frames[index] = data
    return [bytes(f) for f in frames]


def test_small_frames_travel_inline_and_large_ones_alone() -> None:
    big = np.arange(100_000, dtype="f8")  # 800 kB
    frames = [b"header", memoryview(big), b"", b"tail" * 10]
    out = pack(frames, batch_limit=1024)
    assert len(out.separate) == 1
    assert out.separate[0].obj is big  # sent from its own memory, not copied
    assert out.nbytes == len(out.batch) + big.nbytes
    assert _receive(out) == [b"header", big.tobytes(), b"", b"tail" * 10]
    count = struct.unpack_from("<I", out.batch, 2)[0]
    sizes = struct.unpack_from(f"<{count}Q", out.batch, 6)
    assert [s & ~INLINE for s in sizes] == [6, big.nbytes, 0, 40]
    assert [bool(s & INLINE) for s in sizes] == [True, False, True, True]


def test_the_batch_limit_is_a_budget_in_order() -> None:
    frames = [b"a" * 600, b"b" * 600, b"c" * 300]
    out = pack(frames, batch_limit=1000)
    # 600 fits, the next 600 does not (separate), 300 still fits the remaining 400
    assert [bytes(f) for f in out.separate] == [b"b" * 600]
    assert _receive(out) == frames
    assert pack(frames, batch_limit=0).separate == frames
    assert pack(frames, batch_limit=10_000).separate == []


def test_bytes_stay_bytes_and_other_buffers_become_flat_views() -> None:
    payload = b"x" * 5000
    assert pack([payload], 0).separate[0] is payload  # aiordma sends bytes without waiting for the peer
    grid = np.ones((50, 40), dtype="i4")
    (flat,) = pack([grid], 0).separate
    assert isinstance(flat, memoryview) and flat.ndim == 1 and flat.format == "B" and flat.nbytes == grid.nbytes
    strided = np.arange(100, dtype="i8")[::2]  # not contiguous: copied once, the only way to send it
    out = pack([strided], 0)
    assert _receive(out) == [strided.tobytes()]


def test_inline_frames_are_views_of_the_batch() -> None:
    out = pack([b"one", b"two"], 1024)
    incoming = unpack(out.batch)
    assert incoming.separate == []
    assert [f.obj is out.batch for f in incoming.frames] == [True, True]


def test_an_empty_message() -> None:
    out = pack([], 1024)
    assert unpack(out.batch).frames == []


@pytest.mark.parametrize(
    "batch, match",
    [
        (b"", "shorter than its 6-byte head"),
        (struct.pack("<BBI", 3, 0, 0), "version 3"),
        (struct.pack("<BBI", 1, 0, 3) + b"\0" * 8, "needs 30 bytes"),
        (struct.pack("<BBIQ", 1, 0, 1, 10 | INLINE) + b"short", "runs past the end"),
        (struct.pack("<BBIQ", 1, 0, 1, 2 | INLINE) + b"ab" + b"extra", "5 bytes after the last inline frame"),
        (struct.pack("<BBI", 1, 0, framing.MAX_FRAMES + 1), "at most"),
        (struct.pack("<BBIQ", 2, 0, 1, 5 | JOINED), "not separate"),
        (struct.pack("<BBIQQ", 2, 0, 2, 0 | INLINE, 5 | JOINED), "not separate"),
        (struct.pack("<BBIQ", 2, 0, 1, 0 | INLINE | JOINED), "both inline and joined"),
        (struct.pack("<BBIQQ", 1, 0, 2, 5, 5 | JOINED), "version 1 table"),
    ],
)
def test_a_malformed_batch_is_refused(batch: bytes, match: str) -> None:
    with pytest.raises(FramingError, match=match):
        unpack(batch)
    assert issubclass(FramingError, ValueError)


def _table(batch: bytes) -> list[int]:
    count = struct.unpack_from("<I", batch, 2)[0]
    return list(struct.unpack_from(f"<{count}Q", batch, 6))


def test_the_shards_of_a_split_frame_are_joined_and_other_frames_are_not() -> None:
    """Dask's shards of one frame are slices of one memoryview: received side by side in
    one buffer (joined); another frame, even a neighbour, gets a buffer of its own. A
    frame's small last shard goes separate too, beside the others."""
    a = np.arange(1000, dtype="u1")
    b = np.arange(600, dtype="u1")
    shards = [memoryview(a)[i : i + 300] for i in range(0, 1000, 300)]  # 300, 300, 300, 100
    frames = [b"header", *shards, memoryview(b)]
    out = pack(frames, batch_limit=200)
    table = _table(out.batch)
    assert out.batch[0] == framing.VERSION == 2
    assert table == [6 | INLINE, 300, 300 | JOINED, 300 | JOINED, 100 | JOINED, 600]
    incoming = unpack(out.batch)
    assert incoming.buffers == [[(1, 300), (2, 300), (3, 300), (4, 100)], [(5, 600)]]
    assert incoming.separate == [pair for group in incoming.buffers for pair in group]
    assert _receive(out) == [b"header", *(bytes(s) for s in shards), b.tobytes()]


def test_two_frames_of_one_object_in_a_row_that_fit_the_batch_stay_inline() -> None:
    a = np.arange(100, dtype="u1")
    out = pack([memoryview(a)[:50], memoryview(a)[50:]], batch_limit=1024)
    assert out.separate == [] and unpack(out.batch).buffers == []


def test_a_version_1_table_puts_every_separate_frame_in_one_buffer() -> None:
    """What the sender of version 1 meant (it had no joined bit)."""
    batch = struct.pack("<BBIQQQ", 1, 0, 3, 7, 2 | INLINE, 9) + b"hi"
    incoming = unpack(batch)
    assert incoming.buffers == [[(0, 7), (2, 9)]]
    assert incoming.separate == [(0, 7), (2, 9)]
    assert bytes(incoming.frames[1]) == b"hi"
