"""Descriptor lists (:mod:`aiordma.descriptors`): the rules, the interpreted reference and
the compiled twin (``aiordma._core.prepare_descriptors``) checked against a plain oracle
and against each other, with Hypothesis."""

from __future__ import annotations

import array

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiordma import DescriptorError
from aiordma import descriptors as d
from aiordma.core import core_status

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LOCAL, REMOTE = 0x7F00_0000_0000, 0x5500_0000_0000

IMPLEMENTATIONS = [pytest.param(d.prepare_reference, id="reference")]
INDICES = [pytest.param(d.indices_reference, id="reference")]
if core_status()[0]:
    from aiordma import _core

    IMPLEMENTATIONS.append(pytest.param(_core.prepare_descriptors, id="compiled"))
    INDICES.append(pytest.param(_core.prepare_indices, id="compiled"))


def oracle(rows: list[tuple[int, int, int]], local_len: int, remote_len: int, dest_is_local: bool) -> int | None:
    """The index the rules blame first (None: the list is good), by brute force."""
    for i, (lo, ro, n) in enumerate(rows):
        if n == 0 or n > d.MAX_LENGTH or lo + n > local_len or ro + n > remote_len:
            return i
    column = 0 if dest_is_local else 1
    spans = sorted((row[column], i) for i, row in enumerate(rows))
    reach, holder = 0, -1
    for start, i in spans:
        if holder >= 0 and start < reach:
            return max(i, holder)
        if start + rows[i][2] > reach:
            reach, holder = start + rows[i][2], i
    return None


def _table(rows: list[tuple[int, int, int]]) -> memoryview:
    return d.as_table(np.array(rows, dtype=np.uint64).reshape(-1, 3))


rows_strategy = st.lists(
    st.tuples(st.integers(0, 300), st.integers(0, 300), st.integers(0, 40)).map(
        lambda t: (t[0], t[1], t[2] if t[2] else 0)
    ),
    max_size=24,
)


@pytest.mark.parametrize("prepare", IMPLEMENTATIONS)
@SETTINGS
@given(rows=rows_strategy, local_len=st.integers(0, 320), remote_len=st.integers(0, 320), dest=st.booleans())
def test_the_rules_blame_what_the_oracle_blames(prepare, rows, local_len, remote_len, dest) -> None:
    expected = oracle(rows, local_len, remote_len, dest)
    if expected is None:
        out, total = prepare(_table(rows), LOCAL, local_len, REMOTE, remote_len, dest)
        assert list(out) == [v for lo, ro, n in rows for v in (LOCAL + lo, REMOTE + ro, n)]
        assert total == sum(n for _, _, n in rows)
    else:
        with pytest.raises(DescriptorError) as info:
            prepare(_table(rows), LOCAL, local_len, REMOTE, remote_len, dest)
        assert info.value.index == expected
        assert str(info.value).startswith(f"descriptor {expected}: ")


@SETTINGS
@given(rows=rows_strategy, local_len=st.integers(0, 320), remote_len=st.integers(0, 320), dest=st.booleans())
def test_both_implementations_say_the_same(rows, local_len, remote_len, dest) -> None:
    outcomes = []
    for impl in IMPLEMENTATIONS:
        try:
            out, total = impl.values[0](_table(rows), LOCAL, local_len, REMOTE, remote_len, dest)
            outcomes.append(("ok", list(out), total))
        except DescriptorError as e:
            outcomes.append(("error", str(e), e.index))
    assert all(o == outcomes[0] for o in outcomes), outcomes


@pytest.mark.parametrize("prepare", IMPLEMENTATIONS)
def test_each_rule_names_its_descriptor(prepare) -> None:
    cases = {
        "has length 0": [(0, 0, 8), (8, 8, 0)],
        "local range [96, 104) is outside the 100-byte local region": [(0, 0, 8), (96, 8, 8)],
        "remote range [4000, 4100) is outside the 4096-byte remote buffer": [(0, 0, 8), (0, 4000, 100)],
        "local range overlaps descriptor 0's": [(0, 0, 16), (8, 100, 8)],
    }
    for words, rows in cases.items():
        with pytest.raises(DescriptorError, match=r"^descriptor 1: .*" + words.replace("[", r"\[").replace(")", r"\)")):
            prepare(_table(rows), LOCAL, 100, REMOTE, 4096, True)
    # a Write's destinations are remote: overlapping local sources are fine, remote ones not
    prepare(_table([(0, 0, 16), (8, 100, 8)]), LOCAL, 100, REMOTE, 4096, False)
    with pytest.raises(DescriptorError, match="remote range overlaps descriptor 0's"):
        prepare(_table([(0, 0, 16), (40, 8, 8)]), LOCAL, 100, REMOTE, 4096, False)
    with pytest.raises(DescriptorError, match="more than one work request moves"):
        prepare(_table([(0, 0, d.MAX_LENGTH + 1)]), LOCAL, 1 << 40, REMOTE, 1 << 40, True)
    # offsets near 2**64 do not wrap around the bounds check
    with pytest.raises(DescriptorError, match="local range"):
        prepare(_table([((1 << 64) - 8, 0, 16)]), LOCAL, 100, REMOTE, 4096, True)


def test_input_forms() -> None:
    rows = [(0, 4096, 64), (64, 0, 64)]
    as_numpy = bytes(d.as_table(np.array(rows, dtype=np.uint64)))
    assert bytes(d.as_table(np.array(rows, dtype=np.int64))) == as_numpy
    assert bytes(d.as_table(rows)) == as_numpy
    assert bytes(d.as_table(array.array("Q", [v for r in rows for v in r]))) == as_numpy
    assert len(d.as_table(np.zeros((0, 3), dtype=np.uint64))) == 0
    with pytest.raises(TypeError, match="64-bit integers"):
        d.as_table(np.array(rows, dtype=np.uint32))
    with pytest.raises(ValueError, match=r"shape \(N, 3\)"):
        d.as_table(np.zeros((4, 2), dtype=np.uint64))
    with pytest.raises(ValueError, match="C-contiguous"):
        d.as_table(np.zeros((4, 6), dtype=np.uint64)[:, ::2])
    with pytest.raises(ValueError, match="descriptor 1: expected"):
        d.as_table([(0, 0, 1), (0, 1)])
    with pytest.raises(DescriptorError, match="descriptor 0: offsets and length must be integers") as info:
        d.as_table([(-1, 0, 1)])
    assert info.value.index == 0


@pytest.mark.parametrize("prepare_indices", INDICES)
def test_indices(prepare_indices) -> None:
    assert list(prepare_indices(d.as_indices([3, 0, 2]), 4)) == [3, 0, 2]
    assert list(prepare_indices(d.as_indices(np.array([1, 1], dtype=np.int64)), 2)) == [1, 1]
    assert list(prepare_indices(d.as_indices(np.array([1], dtype=np.uint32)), 2)) == [1]
    for bad in ([4], [-1], np.array([0, 9], dtype=np.uint64)):
        with pytest.raises(IndexError, match="is not a descriptor of a list of 4"):
            prepare_indices(d.as_indices(bad), 4)
    with pytest.raises(TypeError, match="one-dimensional buffer of integers"):
        d.as_indices(np.zeros(3, dtype=np.float64))
