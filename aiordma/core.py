"""Which per-operation core a connection runs: compiled or interpreted.

The objects every operation touches — the send queue's slots, the table of work
requests in flight, the message window, the received-message queue and the
per-operation paths — exist twice with one Python API: compiled
(:mod:`aiordma._core`, extension types with C fields, built with the native
engine) and interpreted (:mod:`aiordma.ops`, :mod:`aiordma.window`,
:mod:`aiordma.messages`, :mod:`aiordma.fastpath`, :class:`aiordma.memory.BufferTable`), the reference and the
fallback where nothing could be compiled. ``AIORDMA_CORE`` (``compiled`` or
``python``) chooses; by default the compiled one runs when it is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from . import descriptors, fastpath, memory, messages, ops, settings, window
from .errors import ProviderUnavailableError

__all__ = ["CORES", "Core", "core_status", "select_core"]

#: the implementations, by name (settings.CORES)
CORES = settings.CORES


@dataclass(frozen=True)
class Core:
    """One implementation of the per-operation core: its name and its classes."""

    name: str
    SendQueue: Any
    OperationTracker: Any
    MessageWindow: Any
    Inbox: Any
    FastPath: Any
    BufferTable: Any
    BufferPool: Any
    #: descriptor lists checked and converted (aiordma.descriptors' rules), and transfer indices
    prepare_descriptors: Any
    prepare_indices: Any


PYTHON = Core(
    "python",
    ops.SendQueue,
    ops.OperationTracker,
    window.MessageWindow,
    messages.Inbox,
    fastpath.FastPath,
    memory.BufferTable,
    memory.BufferPool,
    descriptors.prepare_reference,
    descriptors.indices_reference,
)


def _compiled() -> tuple[Core | None, str]:
    try:
        mod = importlib.import_module("aiordma._core")
    except ImportError as e:
        return None, f"aiordma._core is not built ({e})"
    core = Core(
        "compiled",
        mod.SendQueue,
        mod.OperationTracker,
        mod.MessageWindow,
        mod.Inbox,
        mod.FastPath,
        mod.BufferTable,
        mod.BufferPool,
        mod.prepare_descriptors,
        mod.prepare_indices,
    )
    return core, "built"


def core_status() -> tuple[bool, str]:
    """Whether the compiled core can be used, and why not."""
    core, why = _compiled()
    return core is not None, why


def select_core(requested: str | None = None) -> Core:
    """The core a new connection gets: ``requested`` (``"compiled"``, ``"python"``),
    else ``AIORDMA_CORE``, else the compiled one where it is built."""
    if requested is None:
        requested = settings.CORE.get()
    if requested == "python":
        return PYTHON
    core, why = _compiled()
    if core is not None:
        return core
    if requested == "compiled":
        raise ProviderUnavailableError(f"AIORDMA_CORE=compiled: {why}")
    return PYTHON
