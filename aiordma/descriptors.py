"""Descriptor lists: many pieces of one local region and one remote buffer, as a table.

A *descriptor* is one RDMA Read or Write of a transfer: ``(local offset, remote
offset, length)`` between a registered local region (its lkey) and a peer's
remote buffer (its rkey). What NIXL and Mooncake's transfer engine move, and
what a KV-cache page table is, is thousands of them at once. Here a list of N
is a table of N x 3 unsigned 64-bit integers: a NumPy array of shape ``(N, 3)``
(any C-contiguous 64-bit buffer will do) or a sequence of triples, read without a
Python object per descriptor where it is a buffer.

This module holds the rules, once: what makes a list acceptable, the error that
names the first descriptor that breaks them, and the reference implementation of
the check that turns offsets into the engine's form, ``(local address, remote
address, length)`` per descriptor. The compiled core (:mod:`aiordma._core`) has the
same check in C and raises through :func:`problem`, so both say the same words;
tests compare the two.

The rules, in the order they are checked:

1. every descriptor in index order: a length of at least 1 byte and at most
   :data:`MAX_LENGTH` (one work request's message), the local range inside the
   local region, the remote range inside the remote buffer;
2. then the destinations (the local ranges of Reads, the remote ranges of Writes)
   must not overlap: two work requests writing the same bytes would leave them
   to whichever ran last, and once a transfer is striped over several queue
   pairs no order says which. Sources may overlap.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Sequence
from typing import Any

from .errors import DescriptorError

__all__ = ["MAX_LENGTH", "as_table", "indices_reference", "prepare_reference", "problem"]

#: the most bytes one descriptor moves: one work request's message (2^31, the verbs limit)
MAX_LENGTH = 1 << 31

#: what problem() says, by code (the compiled check returns the code)
ZERO_LENGTH, TOO_LONG, LOCAL_RANGE, REMOTE_RANGE, OVERLAP = range(5)

_INTEGER_FORMATS = {"Q", "L", "q", "l", "<Q", "<L", "=Q", "=L", "<q", "=q", "<l", "=l"}


def problem(code: int, index: int, a: int = 0, b: int = 0, c: int = 0, dest_is_local: bool = True) -> DescriptorError:
    """The error for descriptor ``index`` breaking rule ``code`` (see the module's docstring).

    ``a``, ``b``, ``c``: the offset, the length and the bound for a range; the other
    descriptor's index for an overlap."""
    if code == ZERO_LENGTH:
        why = "has length 0 (every descriptor moves at least one byte)"
    elif code == TOO_LONG:
        why = f"is {b} bytes long, more than one work request moves ({MAX_LENGTH})"
    elif code == LOCAL_RANGE:
        why = f"local range [{a}, {a + b}) is outside the {c}-byte local region"
    elif code == REMOTE_RANGE:
        why = f"remote range [{a}, {a + b}) is outside the {c}-byte remote buffer"
    else:
        side = "local" if dest_is_local else "remote"
        why = f"{side} range overlaps descriptor {a}'s (the destinations of one transfer must not overlap)"
    return DescriptorError(f"descriptor {index}: {why}", index)


def as_table(descriptors: Any) -> memoryview:
    """``descriptors`` as a flat memoryview of 3N unsigned 64-bit integers.

    A buffer (NumPy array of shape ``(N, 3)``, ``array('Q')``) is used in place:
    it must hold 64-bit integers, C-contiguous, a multiple of three of them. Any
    other iterable is read as ``(local offset, remote offset, length)`` triples."""
    try:
        view = memoryview(descriptors)
    except TypeError:
        return _from_triples(descriptors)
    if view.format not in _INTEGER_FORMATS or view.itemsize != 8:
        raise TypeError(f"descriptors must be 64-bit integers (numpy uint64, shape (N, 3)), not format {view.format!r}")
    if not view.c_contiguous:
        raise ValueError("descriptors must be C-contiguous (numpy.ascontiguousarray)")
    if view.ndim == 2 and view.shape is not None and view.shape[1] != 3:
        raise ValueError(f"descriptors must have shape (N, 3), not {view.shape}")
    if view.ndim > 2 or view.nbytes % 24:
        raise ValueError("descriptors must be (local offset, remote offset, length) triples: shape (N, 3)")
    if view.nbytes == 0:  # (memoryview cannot cast an empty shape)
        return memoryview(array.array("Q"))
    return view.cast("B").cast("Q")


def _from_triples(descriptors: Iterable[Any]) -> memoryview:
    flat = array.array("Q")
    for i, row in enumerate(descriptors):
        try:
            lo, ro, n = row
        except (TypeError, ValueError):
            raise ValueError(f"descriptor {i}: expected (local offset, remote offset, length), got {row!r}") from None
        try:
            flat.extend((lo, ro, n))
        except (TypeError, OverflowError):
            raise DescriptorError(
                f"descriptor {i}: offsets and length must be integers in [0, 2**64), got {row!r}", i
            ) from None
    return memoryview(flat)


def prepare_reference(
    table: memoryview,
    local_addr: int,
    local_len: int,
    remote_addr: int,
    remote_len: int,
    dest_is_local: bool,
) -> tuple[array.array[int], int]:
    """The rules checked and the engine's form made, interpreted: ``(addresses, total
    bytes)``, where ``addresses`` holds ``(local address, remote address, length)``
    per descriptor. Raises :class:`~aiordma.errors.DescriptorError` naming the first
    descriptor that breaks a rule (the compiled twin: ``aiordma._core.prepare_descriptors``)."""
    n = len(table) // 3
    out = array.array("Q", bytes(24 * n))
    total = 0
    for i in range(n):
        lo, ro, ln = table[3 * i], table[3 * i + 1], table[3 * i + 2]
        if ln == 0:
            raise problem(ZERO_LENGTH, i)
        if ln > MAX_LENGTH:
            raise problem(TOO_LONG, i, 0, ln)
        if lo > local_len or ln > local_len - lo:
            raise problem(LOCAL_RANGE, i, lo, ln, local_len)
        if ro > remote_len or ln > remote_len - ro:
            raise problem(REMOTE_RANGE, i, ro, ln, remote_len)
        out[3 * i] = local_addr + lo
        out[3 * i + 1] = remote_addr + ro
        out[3 * i + 2] = ln
        total += ln
    column = 0 if dest_is_local else 1
    order: Sequence[int] = range(n)
    if any(table[3 * i + column] < table[3 * (i - 1) + column] for i in range(1, n)):  # (sorted: one pass)
        order = sorted(range(n), key=lambda i: (table[3 * i + column], i))
    reach, holder = 0, -1  # the furthest end so far and whose it is
    for i in order:
        start = table[3 * i + column]
        if holder >= 0 and start < reach:
            raise problem(OVERLAP, max(i, holder), min(i, holder), dest_is_local=dest_is_local)
        end = start + table[3 * i + 2]
        if end > reach:
            reach, holder = end, i
    return out, total


def as_indices(indices: Any) -> memoryview:
    """``indices`` (a one-dimensional buffer of integers, or a sequence) as a memoryview."""
    try:
        view = memoryview(indices)
    except TypeError:
        try:
            view = memoryview(array.array("q", indices))
        except (TypeError, OverflowError):
            raise ValueError("indices must be integers") from None
    if view.format.lstrip("<=@") not in ("b", "B", "h", "H", "i", "I", "l", "L", "q", "Q") or view.ndim != 1:
        raise TypeError(f"indices must be a one-dimensional buffer of integers, not format {view.format!r}")
    if not view.c_contiguous:
        raise ValueError("indices must be C-contiguous")
    return view


def indices_reference(view: memoryview, n: int) -> array.array[int]:
    """The checked indices as 32-bit positions into a list of ``n`` descriptors,
    interpreted (the compiled twin: ``aiordma._core.prepare_indices``)."""
    out = array.array("I", bytes(4 * len(view)))
    for pos, i in enumerate(view.tolist()):
        if not 0 <= i < n:
            raise index_problem(pos, i, n)
        out[pos] = i
    return out


def index_problem(pos: int, index: int, n: int) -> IndexError:
    """The error for an index that names no descriptor."""
    return IndexError(f"index {index} (position {pos} of the indices) is not a descriptor of a list of {n}")
