"""The native engine's CRC-32 implementations (the ICRC's CRC): every one
computes zlib's CRC-32, whatever the length, the alignment and the CRC it
continues from, and the fastest one the CPU runs is the one the ICRC uses.

Run under AddressSanitizer by ``scripts/asan-fuzz`` (with ``PYTHONMALLOC=malloc``,
so a vector load past the end of a buffer is reported)."""

from __future__ import annotations

import os
import platform
import random
import zlib

import pytest

_engine = pytest.importorskip(
    "aiordma.providers.soft._native._engine", reason="the native engine is not built (CI requires it)"
)

IMPLEMENTATIONS = _engine.crc32_implementations()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_the_portable_table_is_always_there_and_the_fastest_is_chosen() -> None:
    assert IMPLEMENTATIONS[-1] == "table"
    assert _engine.crc32_implementation() == IMPLEMENTATIONS[0]
    assert len(set(IMPLEMENTATIONS)) == len(IMPLEMENTATIONS)
    order = ["isa-l", "vpclmul", "pclmul", "zlib", "table"]
    assert IMPLEMENTATIONS == sorted(IMPLEMENTATIONS, key=order.index)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="carry-less multiply is x86-64 code")
def test_the_cpu_detection_matches_the_cpus_flags() -> None:
    """What runs is what was built and what /proc/cpuinfo says the CPU has (a
    default build has the carry-less-multiply code; AIORDMA_NATIVE_CRC may leave it out)."""
    flags = _cpu_flags()
    built = set(_engine.crc32_compiled())
    assert set(IMPLEMENTATIONS) <= built
    has_pclmul = "pclmulqdq" in flags and "sse4_1" in flags
    assert ("pclmul" in IMPLEMENTATIONS) == (has_pclmul and "pclmul" in built)
    has_vpclmul = has_pclmul and {"avx512f", "avx512vl", "vpclmulqdq"} <= flags
    assert ("vpclmul" in IMPLEMENTATIONS) == (has_vpclmul and "vpclmul" in built)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_every_length_and_alignment(name: str) -> None:
    """Lengths 0..1100 (every path of the folding code: under 64 bytes, under 256,
    tails of 1..15 bytes) at every offset 0..63 from a 64-byte boundary."""
    rng = random.Random(f"crc32-{name}")
    block = bytes(rng.getrandbits(8) for _ in range(1100 + 64))
    for length in range(0, 1101):
        offset = length % 64
        piece = bytearray(block[offset : offset + length])  # exactly `length` bytes: ASan sees an overread
        assert _engine.crc32_with(name, piece) == zlib.crc32(piece), (name, length)
    for offset in range(64):
        view = memoryview(block)[offset : offset + 777]
        assert _engine.crc32_with(name, view) == zlib.crc32(view), (name, offset)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_large_buffers_and_continued_crcs(name: str) -> None:
    """Sizes around the stride boundaries, up to 1 MiB, and a CRC continued over
    pieces (how the ICRC is computed: masked headers, then the payload)."""
    rng = random.Random(f"crc32-large-{name}")
    data = os.urandom(1 << 20)
    for size in (255, 256, 257, 511, 512, 513, 4095, 4096, 4097, 65536 + 15, 1 << 20):
        assert _engine.crc32_with(name, data[:size]) == zlib.crc32(data[:size]), (name, size)
    for _ in range(200):
        a, b = sorted(rng.randrange(0, 20000) for _ in range(2))
        start = rng.getrandbits(32)
        head = _engine.crc32_with(name, data[:a], start)
        assert _engine.crc32_with(name, data[a:b], head) == zlib.crc32(data[:b], start)


def test_all_implementations_agree_on_random_inputs() -> None:
    rng = random.Random(20261201)
    for _ in range(300):
        size = rng.choice((rng.randrange(0, 64), rng.randrange(64, 512), rng.randrange(512, 70000)))
        data = rng.randbytes(size)
        start = rng.getrandbits(32)
        results = {name: _engine.crc32_with(name, data, start) for name in IMPLEMENTATIONS}
        assert len(set(results.values())) == 1, results


def test_an_unknown_implementation_is_refused() -> None:
    with pytest.raises(ValueError, match="no CRC-32 implementation 'crc64'"):
        _engine.crc32_with("crc64", b"x")


def test_throughput_is_measured_for_each() -> None:
    for name in IMPLEMENTATIONS:
        assert _engine.crc32_throughput(name, size=4096, seconds=0.002) > 1e6  # bytes per second
