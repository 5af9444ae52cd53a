"""How one Dask message travels as aiordma messages (sans-IO: bytes in, bytes out).

``distributed.protocol.dumps`` turns a message into *frames*: a msgpack
header, small pickled pieces, and out-of-band buffers (numpy data, pickle-5
buffers, each at most ``distributed.comm.shard`` bytes). A Dask message goes
out as:

1. one aiordma message, the *batch*: a frame table followed by the bytes of
   every small frame, in order. The table is ``version`` (1 byte), a reserved
   byte, the frame count (``uint32``) and one ``uint64`` per frame: its size,
   with bit 63 set when the frame travels inline in this batch and bit 62 when
   it is *joined*: a shard of the same frame as the one before it (Dask splits
   a frame larger than ``distributed.comm.shard``);
2. one aiordma message per frame that is not inline, in order, each sent from
   its own memory (:meth:`aiordma.Connection.send`) and received
   (:meth:`aiordma.Connection.recv_into`) into a new writable buffer of exactly
   its size, a joined one into the next slice of its predecessor's buffer (the
   shards of a split frame lie side by side, and Dask joins them without a
   copy): above the connection's large-message threshold the receiver's NIC
   RDMA-Reads it from the sender's buffer, with no copy on either side. Two
   frames (two arrays) never share a buffer, as over Dask's TCP comm: each is
   released on its own.

A version 1 table (the one before bit 62) is read as its sender meant it:
every separate frame of a message in one buffer.

A frame is inline when it still fits the batch's limit (``batch_limit``
bytes of inline frames): a small frame costs less copied than sent on its
own. The receiver does not need the sender's limit: the table says which
frames are inline. Inline frames are handed to Dask as read-only views of the
batch (Dask copies the few it needs writable).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

VERSION = 2
#: the versions :func:`unpack` reads
READS = (1, 2)
INLINE = 1 << 63
JOINED = 1 << 62
_SIZE_MASK = JOINED - 1
_HEAD = struct.Struct("<BBI")
#: a sanity bound on the frame count of one message (Dask sends a handful)
MAX_FRAMES = 1 << 20


class FramingError(ValueError):
    """A batch that is not a valid frame table (a peer speaking another
    version, or a corrupt message): the comm must be aborted."""


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A Dask message ready to send: the batch, then ``separate`` frames, one
    aiordma message each; ``nbytes`` counts every byte of both."""

    batch: bytes
    separate: list[Any]
    nbytes: int


@dataclass(frozen=True, slots=True)
class Incoming:
    """A parsed batch: ``frames`` holds the inline frames (read-only views of
    the batch) and ``None`` where a separate frame is still to be received;
    ``separate`` lists those as ``(index, size)``, in the order they come, and
    ``buffers`` the same grouped by the buffer each is received into."""

    frames: list[Any]
    separate: list[tuple[int, int]]
    buffers: list[list[tuple[int, int]]]


def as_frame(frame: Any) -> Any:
    """``frame`` as a contiguous buffer of bytes: ``bytes`` as it is (aiordma
    sends those without waiting for the peer), anything else as a flat
    ``memoryview`` of the same memory (a copy only if it is not contiguous)."""
    if type(frame) is bytes:
        return frame
    mv = memoryview(frame)
    if not mv.c_contiguous:
        return memoryview(mv.tobytes())
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


def _nbytes(frame: Any) -> int:
    return len(frame) if type(frame) is bytes else frame.nbytes


def _exporter(frame: Any) -> Any:
    """The object whose memory ``frame`` is: the shards of a frame Dask split
    (``frame_split_size``) are slices of one memoryview, so they share it."""
    return frame.obj if isinstance(frame, memoryview) else frame


def pack(frames: Sequence[Any], batch_limit: int) -> Outgoing:
    """Plan the aiordma messages of one Dask message (``frames`` from
    ``distributed.protocol.dumps``)."""
    if len(frames) > MAX_FRAMES:
        raise ValueError(f"a Dask message of {len(frames)} frames: at most {MAX_FRAMES}")
    flat = [as_frame(f) for f in frames]
    sizes = []
    inline: list[Any] = []
    separate: list[Any] = []
    budget = batch_limit
    total = 0
    previous: Any = None  # the exporter of the frame before, when it went separate
    for original, f in zip(frames, flat):
        n = _nbytes(f)
        total += n
        exporter = _exporter(original)
        if previous is not None and exporter is previous:
            # the next shard of a separate frame: separate too (even a small last one),
            # received beside the shard before it
            sizes.append(n | JOINED)
            separate.append(f)
        elif n <= budget:
            budget -= n
            sizes.append(n | INLINE)
            if n:
                inline.append(f)
            exporter = None
        else:
            sizes.append(n)
            separate.append(f)
        previous = exporter
    table = _HEAD.pack(VERSION, 0, len(flat)) + struct.pack(f"<{len(flat)}Q", *sizes)
    batch = b"".join([table, *inline]) if inline else table
    return Outgoing(batch, separate, total + len(table))


def unpack(batch: bytes | memoryview) -> Incoming:
    """Parse a batch; raise :class:`FramingError` if it is not one."""
    mv = memoryview(batch)
    if mv.nbytes < _HEAD.size:
        raise FramingError(f"a Dask batch of {mv.nbytes} bytes is shorter than its {_HEAD.size}-byte head")
    version, _reserved, count = _HEAD.unpack_from(mv)
    if version not in READS:
        raise FramingError(f"frame table version {version}: this aiordma speaks versions {READS}")
    if count > MAX_FRAMES:
        raise FramingError(f"a frame table of {count} frames: at most {MAX_FRAMES}")
    end = _HEAD.size + 8 * count
    if mv.nbytes < end:
        raise FramingError(f"a frame table of {count} frames needs {end} bytes, the batch has {mv.nbytes}")
    frames: list[Any] = []
    separate: list[tuple[int, int]] = []
    buffers: list[list[tuple[int, int]]] = []
    off = end
    for i, word in enumerate(struct.unpack_from(f"<{count}Q", mv, _HEAD.size)):
        size = word & _SIZE_MASK
        if word & INLINE:
            if word & JOINED:
                raise FramingError(f"frame {i} is both inline and joined")
            if off + size > mv.nbytes:
                raise FramingError(f"inline frame {i} of {size} bytes runs past the end of the batch")
            frames.append(mv[off : off + size])
            off += size
            continue
        frames.append(None)
        separate.append((i, size))
        if word & JOINED:
            if version == 1:
                raise FramingError(f"frame {i} of a version 1 table has a size of 2**62 bytes or more")
            if not buffers or buffers[-1][-1][0] != i - 1:
                raise FramingError(f"frame {i} is joined to frame {i - 1}, which is not separate")
            buffers[-1].append((i, size))
        elif version == 1 and buffers:
            buffers[0].append((i, size))  # version 1: one buffer for all
        else:
            buffers.append([(i, size)])
    if off != mv.nbytes:
        raise FramingError(f"{mv.nbytes - off} bytes after the last inline frame of the batch")
    return Incoming(frames, separate, buffers)
