"""The seam between the soft device and the engine that does a NIC's work.

The soft device (:mod:`.device`) is a verbs facade: it validates what the
verbs rules say (access flags, QP transitions that need a peer address, the
jumbo MTU), hands out keys and queue-pair numbers, and forwards everything
else to an *engine*, which does what a NIC does: registered memory, the RC
requester and responder, the UDP socket, transport timers, completion queues
and completion-channel events. Two engines implement the protocol below:

The engine also keeps the device's async-event queue (``ibv_get_async_event``:
an fd readable while events are queued), where an SRQ's limit event goes.

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

import importlib.machinery
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
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
    "EngineSRQ",
    "SlowPath",
    "SoftEngine",
    "choose_engine",
    "explain_native_import_error",
    "native_status",
    "slow_paths",
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
    are queued (one event per CQE that found its CQ armed). It serves any number
    of CQs; each event names its CQ."""

    def fileno(self) -> int: ...

    def get_cq_event(self) -> Any:
        """The oldest queued event's CQ, as bound with :meth:`EngineCQ.bind`, or
        None when none is queued."""

    def set_direct_handler(self, handler: Callable[[Any], None] | None) -> bool:
        """Events raised on this thread call ``handler(cq)`` instead of the eventfd."""

    def close(self) -> None: ...


class EngineCQ(Protocol):
    """A completion queue. ``poll`` returns :class:`WorkCompletion` objects."""

    overflows: int

    def bind(self, facade: Any) -> None:
        """What the channel's ``get_cq_event`` returns for this CQ's events (the
        device's CQ; None unbinds, so the two do not keep each other alive)."""

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

    def modify(
        self, attr: QPAttr, peer: tuple[str, int] | None, mtu_bytes: int | None, skip_icrc: bool = False
    ) -> None:
        """``ibv_modify_qp``. ``peer`` (IP, UDP port) comes with INIT → RTR, and
        ``mtu_bytes`` when the path MTU exceeds the ``ibv_mtu`` (jumbo); with
        ``skip_icrc`` (INIT → RTR, the native engine only) the QP's datagrams may
        leave their ICRC out and those from its peer are not checked."""

    def post_send(self, wrs: SendWR | Sequence[SendWR]) -> None: ...

    def post_recv(self, wrs: RecvWR | Sequence[RecvWR]) -> None: ...

    def query(self) -> QPAttr: ...

    def close(self) -> None: ...


class EngineSRQ(Protocol):
    """A shared receive queue (``ibv_srq``): the responders of the QPs created
    with it take their receives from it. Its limit event is queued on the
    engine's async-event queue as ``(IBV_EVENT_SRQ_LIMIT_REACHED, srq_num)``."""

    srq_num: int
    max_wr: int
    max_sge: int

    @property
    def limit_events(self) -> int:
        """How many times the limit event fired."""

    @property
    def users(self) -> int:
        """The QPs that take their receives from it."""

    def __len__(self) -> int:
        """The receive WQEs posted now."""

    def post_recv(self, wrs: RecvWR | Sequence[RecvWR]) -> None: ...

    def arm_limit(self, limit: int) -> None:
        """``ibv_modify_srq(IBV_SRQ_LIMIT)``; ``ValueError`` outside 0 .. max_wr."""

    def query(self) -> tuple[int, int, int]:
        """``(max_wr, max_sge, srq_limit)``."""

    def close(self) -> None:
        """``ibv_destroy_srq``; :class:`~aiordma.errors.ResourceBusyError` while QPs use it."""


class EnginePD(Protocol):
    """A protection domain: memory regions, shared receive queues and the QPs that may use them."""

    def reg_mr(self, buffer: Any, access: Access, lkey: int, rkey: int) -> EngineMR: ...

    def by_lkey(self, lkey: int) -> EngineMR | None: ...

    def by_rkey(self, rkey: int) -> EngineMR | None: ...

    def create_qp(
        self,
        qp_num: int,
        send_cq: EngineCQ,
        recv_cq: EngineCQ,
        cap: QPCap,
        sq_sig_all: bool,
        srq: EngineSRQ | None = None,
    ) -> EngineQP: ...

    def create_srq(self, srq_num: int, max_wr: int, max_sge: int) -> EngineSRQ: ...

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
    #: the netdev (ifindex) whose captures pause GSO batches (gso.py), or None
    gso_watch: int | None
    #: whether batches are paused now (a capture listens on that netdev)
    gso_paused: bool
    faults: Any  # LinkFaults | None

    def counters(self) -> dict[str, int]:
        """Device counters plus the transport counters summed over live QPs."""

    def transport_totals(self) -> dict[str, int]:
        """The transport counters of every QP the device has had, closed ones included."""

    @property
    def thread_alive(self) -> bool:
        """Whether the NIC thread runs."""

    def live_objects(self) -> dict[str, int]:
        """How many QPs, memory regions, CQs and SRQs are alive (leak checks)."""

    def registered_memory(self) -> dict[str, int]:
        """``{"bytes": the registered regions' lengths, "regions": how many}``."""

    def async_fd(self) -> int:
        """The async-event fd: readable exactly while events are queued."""

    def get_async_event(self) -> tuple[int, int] | None:
        """The oldest queued ``(event type, element number)``, or None (never blocks)."""

    def has_qp(self, qp_num: int) -> bool: ...

    def alloc_pd(self) -> EnginePD: ...

    def create_channel(self) -> EngineChannel: ...

    def create_cq(self, cqe: int, channel: EngineChannel | None) -> EngineCQ: ...

    def set_tracer(self, tracer: Callable[..., None] | None) -> None: ...

    def attach_loop(self, loop: Any) -> Callable[[], None] | None: ...

    def close(self) -> None: ...


# ------------------------------------------------------------- selection ----

_native_error: tuple[str, str] | None = None  # (cause, fix)
_native_checked = False

#: Debian/Ubuntu packages of the shared libraries the compiled engine links against
_LIBRARY_PACKAGES = {"libisal": "libisal2", "libz": "zlib1g"}
_REINSTALL = "reinstall aiordma (scripts/bootstrap in a clone)"


def explain_native_import_error(
    message: str, files: Iterable[str], suffixes: Sequence[str] | None = None
) -> tuple[str, str]:
    """``(cause, fix)``: why ``from ._native import _engine`` failed with ``message``,
    given the names of the files in the ``_native`` directory and the extension
    suffixes this interpreter loads (default: its own).

    No ``_engine`` extension at all: it was not built (no C compiler, Python headers
    or Cython when aiordma was installed). One for another interpreter only: built
    for another Python. One that imports but fails: a shared library it links
    against is missing (named, with its package), or another loader error."""
    if suffixes is None:
        suffixes = importlib.machinery.EXTENSION_SUFFIXES
    built = sorted(f for f in files if f.startswith("_engine.") and f.endswith((".so", ".pyd")))
    loadable = [f for f in built if any(f == "_engine" + suffix for suffix in suffixes)]
    if not built:
        return (
            "the compiled engine is not built (aiordma was installed without a C compiler, the Python headers or "
            "Cython, or with the native build switched off)",
            "install them (Debian/Ubuntu: apt-get install gcc python3-dev) and " + _REINSTALL,
        )
    if not loadable:
        here = f"{sys.implementation.name} {sys.version_info[0]}.{sys.version_info[1]}"
        return (
            f"the compiled engine was built for another Python ({', '.join(built)}; this is {here}, which loads "
            f"_engine{suffixes[0]})",
            f"reinstall aiordma with this interpreter ({sys.executable} -m pip install ...)",
        )
    missing = re.search(r"([\w.+-]+\.so(?:\.[\w.]+)?): cannot open shared object file", message)
    if missing:
        lib = missing.group(1)
        package = _LIBRARY_PACKAGES.get(lib.split(".so")[0])
        where = f"apt-get install {package}" if package else f"apt-file search {lib}"
        fix = f"install it (Debian/Ubuntu: {where}), or {_REINSTALL} to build against what this machine has"
        return f"the compiled engine is built but cannot load {lib}, a shared library it links against", fix
    if "undefined symbol" in message:
        return (
            f"the compiled engine is built but does not match the libraries here ({message})",
            f"{_REINSTALL} on this machine",
        )
    return f"the compiled engine is built but does not import ({message})", _REINSTALL


def _native_dir_files() -> list[str]:
    try:
        return os.listdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_native"))
    except OSError:
        return []


def native_status() -> tuple[bool, str]:
    """``(available, detail)``: whether the compiled engine imports; ``detail``
    names its CRC-32 implementation, or why it is missing and what to do."""
    global _native_error, _native_checked
    if not _native_checked:
        _native_checked = True
        try:
            from ._native import _engine
        except ImportError as e:
            _native_error = explain_native_import_error(str(e), _native_dir_files())
    if _native_error is not None:
        return False, f"{_native_error[0]}: {_native_error[1]}"
    from ._native import _engine

    return True, f"compiled, CRC-32 by {_engine.crc32_implementation()}"


def crc32_throughputs(engine: str, seconds: float = 0.01) -> dict[str, float]:
    """Bytes per second of each CRC-32 implementation the ``engine`` can use for
    the ICRC, over 4 KiB buffers (a packet), fastest first: for the native engine
    every implementation of its build that this CPU runs, for the Python engine
    the one it uses."""
    if engine == "native" and native_status()[0]:
        from ._native import _engine

        return {name: _engine.crc32_throughput(name, 4096, seconds) for name in _engine.crc32_implementations()}
    import time

    from . import wire

    data = os.urandom(4096)
    rounds, crc = 64, 0
    while True:
        t0 = time.perf_counter()
        for _ in range(rounds):
            crc = wire.crc32(data, crc)
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            from .pyengine import crc32_implementation

            return {crc32_implementation(): rounds * len(data) / elapsed}
        rounds *= 4


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


# ------------------------------------------------------------ slow paths ----


@dataclass(frozen=True)
class SlowPath:
    """A way the soft device runs slower than it could: ``seen`` says what runs
    and what it costs, ``fix`` what to do; ``chosen``: the user asked for it
    (``AIORDMA_SOFT_ENGINE=python``), nothing failed."""

    kind: str  # "engine" or "crc"
    seen: str
    fix: str
    chosen: bool = False

    def line(self) -> str:
        """One line: ``warning: SEEN: FIX``."""
        return f"warning: {self.seen}: {self.fix}"


# What each slow path costs, measured on a 2-core x86-64 VM (AMD EPYC with AVX-512):
# the quick suite's Python engine (benchmarks/results/quick-python.json) against the
# native engine (README's table); crc32.c over a 4 KiB packet (`aiordma devices`
# measures them on the machine it runs on): ISA-L 0.10 µs, vpclmul 0.09 µs, pclmul
# 0.7 µs, zlib 1.6 µs, table 2.0 µs. The carry-less-multiply ones need no warning.
_PYTHON_COST = "about 3x the CPU per message and half the bandwidth of the native engine"
_CRC_COST = {
    "zlib": "zlib's CRC-32 (about 15x the CPU per byte of ISA-L: 1.6 against 0.10 µs per 4 KiB packet)",
    "table": "its portable CRC-32 table (about 20x the CPU per byte of ISA-L: 2.0 against 0.10 µs per 4 KiB packet)",
}
_ISAL_FIX = "install libisal-dev (Debian/Ubuntu) and " + _REINSTALL


def slow_paths(engine: str, engine_reason: str, crc32: str) -> list[SlowPath]:
    """The slow paths of a soft device that runs ``engine`` (its ``engine_reason``)
    with the CRC-32 ``crc32`` (``"isa-l"``, ``"vpclmul"``, ``"pclmul"``, ``"zlib"``, ``"table"``, or the
    Python engine's ``"isa-l (python-isal)"``/``"zlib"``): empty when it runs at full speed."""
    out: list[SlowPath] = []
    if engine == "python":
        if engine_reason.startswith(("engine=", "AIORDMA_SOFT_ENGINE=")):
            how = engine_reason.split(" ", 1)[0]
            ok, detail = native_status()
            undo = "unset AIORDMA_SOFT_ENGINE" if how.startswith("AIORDMA_") else "pass engine='native' (or none)"
            out.append(
                SlowPath(
                    "engine",
                    f"the soft device runs its Python engine, as {how} asks ({_PYTHON_COST})",
                    f"{undo} for the native engine"
                    if ok
                    else f"the native engine is unavailable here anyway: {detail}",
                    chosen=True,
                )
            )
        else:
            cause, fix = _native_error or (engine_reason, _REINSTALL)
            out.append(SlowPath("engine", f"the soft device runs its Python engine ({_PYTHON_COST}): {cause}", fix))
        if not crc32.startswith("isa-l"):
            out.append(
                SlowPath(
                    "crc",
                    "the Python engine computes the ICRC with zlib's CRC-32 (about 5x the CPU per byte of "
                    "python-isal's on 4 KiB packets)",
                    "pip install isal",
                )
            )
    elif crc32 in _CRC_COST:
        out.append(SlowPath("crc", f"the soft device computes the ICRC with {_CRC_COST[crc32]}", _ISAL_FIX))
    return out
