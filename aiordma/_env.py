"""The poll window setting, as the completion dispatcher and the Python soft
engine's NIC read it (declared, parsed and checked in :mod:`aiordma.settings`)."""

from __future__ import annotations

from .settings import DEFAULT_SPIN_US, SPIN_US

__all__ = ["DEFAULT_SPIN_US", "spin_us_from_env"]


def spin_us_from_env(default: float = DEFAULT_SPIN_US) -> float:
    """The poll window in microseconds: ``AIORDMA_SPIN_US``, else ``default``.

    After traffic, the event loop keeps polling for this long before it
    sleeps in the selector: the completion dispatcher polls its CQ (``event``
    progress mode) and the Python soft engine's NIC its socket. 0 turns it off.
    A bad value raises :class:`~aiordma.errors.SettingError`."""
    value = SPIN_US.configured()
    return default if value is None else value
