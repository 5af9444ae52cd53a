"""The public value types of registered memory: what slicing builds is what the
constructor builds (``RemoteBuffer.at()`` and slicing take a faster path)."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

import aiordma
from aiordma.memory import RegionSlice, RemoteBuffer

U64 = st.integers(0, (1 << 64) - 1)


def same(a: object, b: object) -> None:
    """Equal, equally hashed, of the same type and fields, alike in repr."""
    assert type(a) is type(b)
    assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
    for f in dataclasses.fields(a):  # type: ignore[arg-type]
        assert getattr(a, f.name) is getattr(b, f.name) or getattr(a, f.name) == getattr(b, f.name)


@given(
    addr=U64,
    length=st.integers(0, 1 << 40),
    rkey=st.integers(0, (1 << 32) - 1),
    name=st.none() | st.text(max_size=8),
    rights=st.sampled_from([None, "r", "rw", "rwa"]),
    offset=st.integers(0, 1 << 20),
    n=st.integers(0, 1 << 20),
)
def test_at_and_slicing_build_what_the_constructor_builds(addr, length, rkey, name, rights, offset, n):
    rb = RemoteBuffer(addr, length, rkey, name, rights)
    same(rb.at(offset, n), RemoteBuffer(addr + offset, n, rkey, name, rights))
    start, stop, _ = slice(offset, offset + n).indices(length)
    same(rb[offset : offset + n], RemoteBuffer(addr + start, max(0, stop - start), rkey, name, rights))


def test_a_remote_buffer_built_by_at_is_frozen_and_pickles():
    part = RemoteBuffer(0x1000, 4096, 0x42, "mem", "rw").at(64, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        part.addr = 0  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(part)) == part
    assert copy.copy(part) == part and dataclasses.replace(part, length=4).length == 4
    assert {part: 1}[RemoteBuffer(0x1040, 8, 0x42, "mem", "rw")] == 1


def test_region_slices_build_what_the_constructor_builds():
    region = aiordma.register(bytearray(4096), provider="soft")
    try:
        for s in (slice(0, 8), slice(100, 50), slice(4000, 9000), slice(None, None), slice(-16, None)):
            start, stop, _ = s.indices(4096)
            part = region[s]
            same(part, RegionSlice(region, start, max(0, stop - start)))
            assert bytes(part.view) == bytes(region.view[s])
            same(
                region.remote(start, max(0, stop - start)),
                RemoteBuffer(region.addr + start, max(0, stop - start), region.rkey),
            )
        with pytest.raises(dataclasses.FrozenInstanceError):
            region[0:8].offset = 1  # type: ignore[misc]
    finally:
        region.close()
