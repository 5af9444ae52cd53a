"""Settings read from the environment that more than one layer uses."""

from __future__ import annotations

import os

#: the poll window's default length, microseconds
DEFAULT_SPIN_US = 200.0


def spin_us_from_env(default: float = DEFAULT_SPIN_US) -> float:
    """The poll window in microseconds: ``AIORDMA_SPIN_US``, else ``default``.

    After traffic, the event loop keeps polling for this long before it
    sleeps in the selector: the completion dispatcher polls its CQ (``event``
    progress mode) and the Python soft engine's NIC its socket. 0 turns it off."""
    raw = os.environ.get("AIORDMA_SPIN_US")
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"AIORDMA_SPIN_US must be a number of microseconds, not {raw!r}") from None
    if value < 0:
        raise ValueError(f"AIORDMA_SPIN_US must not be negative, got {raw!r}")
    return value
