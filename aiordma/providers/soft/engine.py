"""The seam between the soft device and the engine that does a NIC's work.

The soft device (:mod:`.device`) is a verbs facade: it validates what the
verbs rules say (access flags, QP transitions that need a peer address, the
jumbo MTU), hands out keys and queue-pair numbers, and forwards everything
else to an *engine*, which does what a NIC does: registered memory, the RC
requester and responder, the UDP socket, transport timers, completion queues
and completion-channel events. Two engines implement the protocol below:

``python`` (:mod:`.pyengine`)
    ``wire.py`` + ``rc.py`` + ``nic.py``: the readable reference. A NIC thread
    that holds the GIL while it works, plus an optional receive path on the
    event loop's thread (``attach_loop``).
``native`` (:mod:`._native._engine`, compiled)
    The same state machines in C (a port of ``rc.py``), driven by a NIC
    thread that never takes the GIL: Python posts work requests and polls
    completions, a one-sided operation aimed at this process runs no Python.

Selection: ``SoftDevice(engine=...)``, else ``AIORDMA_SOFT_ENGINE``
(``python``/``native``), else ``native`` when the extension imports and
``python`` otherwise (:func:`native_status` says why).

Nothing above the device sees an engine: the public API and the completion
dispatcher use the verbs objects only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ... import settings
from ..base import Access, QPAttr, QPCap, QPState, RecvWR, SendWR, WorkCompletion

ENGINES = ("python", "native")

__all__ = [
    "ENGINES",
    "EngineCQ",
    "EngineChannel",
    "EngineMR",
    "EnginePD",
    "EngineQP",
    "SoftEngine",
    "choose_engine",
    "native_status",
]


class EngineMR(Protocol):
    """A registered memory region: the engine holds the caller's buffer (the
    buffer protocol) for as long as it is registered."""

    addr: int
    length: int
    lkey: int
    rkey: int
    access: Access

    @property
    def view(self) -> memoryview: ...

    def close(self) -> None:
        """Deregister: returns once the engine no longer touches the memory for
        new work (a WQE posted before keeps its own hold until it completes)."""


class EngineChannel(Protocol):
    """A completion channel: an eventfd that is readable exactly while events
    are queued (one event per CQE that found its CQ armed)."""

    def fileno(self) -> int: ...

    def get_cq_event(self) -> Any:
        """The CQ object bound with :meth:`bind` if an event is queued, else None."""

    def bind(self, cq: Any) -> None:
        """The object :meth:`get_cq_event` returns (the device's CQ facade)."""

    def set_direct_handler(self, handler: Callable[[], None] | None) -> bool: ...

    def close(self) -> None: ...


class EngineCQ(Protocol):
    """A completion queue. ``poll`` returns :class:`WorkCompletion` objects."""

    overflows: int

    def poll(self, num_entries: int = 16) -> list[WorkCompletion]: ...

    def req_notify(self, solicited_only: bool = False) -> None: ...

    def close(self) -> None: ...


class EngineQP(Protocol):
    """An RC queue pair (requester and responder)."""

    qp_num: int

    @property
    def state(self) -> QPState: ...

    @property
    def error_reason(self) -> str | None: ...

    @property
    def counters(self) -> dict[str, int]: ...

    def modify(self, attr: QPAttr, peer: tuple[str, int] | None, mtu_bytes: int | None) -> None:
        """``ibv_modify_qp``. ``peer`` (IP, UDP port) comes with INIT → RTR, and
        ``mtu_bytes`` when the path MTU exceeds the ``ibv_mtu`` (jumbo)."""

    def post_send(self, wrs: SendWR | Sequence[SendWR]) -> None: ...

    def post_recv(self, wrs: RecvWR | Sequence[RecvWR]) -> None: ...

    def query(self) -> QPAttr: ...

    def close(self) -> None: ...


class EnginePD(Protocol):
    """A protection domain: memory regions and the QPs that may use them."""

    def reg_mr(self, buffer: Any, access: Access, lkey: int, rkey: int) -> EngineMR: ...

    def by_lkey(self, lkey: int) -> EngineMR | None: ...

    def by_rkey(self, rkey: int) -> EngineMR | None: ...

    def create_qp(
        self, qp_num: int, send_cq: EngineCQ, recv_cq: EngineCQ, cap: QPCap, sq_sig_all: bool
    ) -> EngineQP: ...

    def close(self) -> None: ...


class SoftEngine(Protocol):
    """One soft device's NIC: a UDP socket bound to ``ip:port`` and what runs it."""

    name: str
    ip: str
    port: int
    icrc_policy: str
    #: the CRC-32 implementation behind the ICRC ("isa-l", "zlib", ...)
    crc32: str
    gso: bool
    faults: Any  # LinkFaults | None

    def counters(self) -> dict[str, int]:
        """Device counters plus the transport counters summed over live QPs."""

    def live_objects(self) -> dict[str, int]:
        """How many QPs, memory regions and CQs are alive (leak checks)."""

    def has_qp(self, qp_num: int) -> bool: ...

    def alloc_pd(self) -> EnginePD: ...

    def create_channel(self) -> EngineChannel: ...

    def create_cq(self, cqe: int, channel: EngineChannel | None) -> EngineCQ: ...

    def set_tracer(self, tracer: Callable[..., None] | None) -> None: ...

    def attach_loop(self, loop: Any) -> Callable[[], None] | None: ...

    def close(self) -> None: ...


# ------------------------------------------------------------- selection ----

_native_error: str | None = None
_native_checked = False


def native_status() -> tuple[bool, str]:
    """``(available, detail)``: whether the compiled engine imports; ``detail``
    names its CRC-32 implementation, or why it is missing."""
    global _native_error, _native_checked
    if not _native_checked:
        _native_checked = True
        try:
            from ._native import _engine
        except ImportError as e:
            why = "" if "cannot import name '_engine'" in str(e) else f" ({e})"
            _native_error = (
                f"the compiled engine is not built{why}: reinstall aiordma with a C compiler, the Python headers "
                "and Cython (scripts/bootstrap installs them)"
            )
    if _native_error is not None:
        return False, _native_error
    from ._native import _engine

    return True, f"compiled, CRC-32 by {_engine.crc32_implementation()}"


def choose_engine(requested: str | None = None) -> tuple[str, str]:
    """``(engine, why)`` for ``SoftDevice(engine=requested)``."""
    source = "engine="
    if requested is None:
        requested = settings.SOFT_ENGINE.get()
        source = "AIORDMA_SOFT_ENGINE="
    if requested is None:
        ok, detail = native_status()
        if ok:
            return "native", f"default ({detail})"
        return "python", f"default: native unavailable: {detail}"
    name = requested.strip().lower()
    if name not in ENGINES:
        raise ValueError(f"unknown soft-device engine {requested!r}: expected one of {', '.join(ENGINES)}")
    if name == "native":
        ok, detail = native_status()
        if not ok:
            from ...errors import ProviderUnavailableError

            raise ProviderUnavailableError(f"{source}native: {detail}")
        return "native", f"{source}native ({detail})"
    return "python", f"{source}python"
