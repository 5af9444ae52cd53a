"""Command-line tools behind the ``aiordma`` command."""

from __future__ import annotations

import argparse

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str, minimum: int = 0) -> int:
    """A byte count from ``65536``, ``64K``, ``8M``, ``1GiB`` (binary units),
    for argparse ``type=``; raises ArgumentTypeError with an example."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    if t and t[-1] in _UNITS:
        t, mult = t[:-1], _UNITS[t[-1]]
    try:
        n = int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 65536, 64K, 8M)") from None
    if n < minimum:
        raise argparse.ArgumentTypeError(f"sizes are at least {minimum} byte{'s' if minimum != 1 else ''}")
    return n


def positive_size(text: str) -> int:
    """:func:`parse_size` for sizes of at least one byte."""
    return parse_size(text, 1)
