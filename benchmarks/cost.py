#!/usr/bin/env python3
"""Per-operation cost of aiordma, counted in CPython bytecodes (every Python thread).

Why bytecodes: wall-clock and CPU-time figures on a shared 2-vCPU VM move by
tens of percent from one run to the next, which hides the effect of most
optimisations. The number of bytecodes the interpreter executes for one
operation (and the number of Python-level calls) depends only on the code
path, not on the host: two runs of the same tree give the same figures to
within a fraction of a percent, so a change of 1 % is a real change. It is a
proxy, not a time (a bytecode that builds a dict costs more than one that
loads a local, and C functions count as one call instruction however long
they run), but for Python code it tracks CPU time closely, and it says
exactly what moved into compiled code: that costs no bytecode at all.

How it counts: on Python 3.12+ with ``sys.monitoring`` (PEP 669),
``INSTRUCTION`` events for bytecodes and ``PY_START``/``PY_RESUME`` for calls
(a coroutine or generator resumption is a call: it is what each ``await``
that suspends costs); these events are process-wide, every thread. On 3.11
with ``sys.settrace`` and ``frame.f_trace_opcodes``, installed for every
thread with ``threading.settrace`` before the measured threads start, and
switched on for the frames already running when counting starts (so the
first counted operation counts). Work a NIC thread does in Python (the
soft device's Python engine) is counted; work that runs in C without
Python (the native engine, a hardware NIC, C extensions) is not. The
benchmark's own driving loops are left out; what they call is counted. A
counter that sees calls but no bytecodes fails loudly.

Levels (``--level``, comma-separated, or ``all``):

``device``
    verbs only, two soft devices (one RC QP each). A round trip (RT): a 64 B
    SEND_WITH_IMM from A to B and a 64 B reply, each acknowledged: SEND + ACK
    each way, 4 packets. With the Python engine (``--device-mode manual``,
    its default) both NICs are serviced by hand on this thread (each device
    is attached to a stand-in loop that nothing polls; its watchdog pushed
    out), deterministic to the bytecode. With the native engine
    (``--device-mode nic``, its default) the NIC threads do the work, and
    what Python runs is counted: posting, and reaping each completion through
    the completion channel (wait on its fd, get the event, ack, re-arm,
    poll). ``nic`` mode on the Python engine counts its NIC threads' Python.
    Besides the total, the device's own figure (``library_bytecodes_per_op``)
    leaves out the benchmark's posting and reaping code (the application's
    part): the issue-14 bar (<= 300 per round trip) is about that one.
``stack``
    the whole library: ``aiordma.start_server`` (echo) and ``aiordma.connect``
    on two soft devices on one loop, ``progress="event"``, no poll window; one
    RT is ``await conn.send(64 B); await conn.recv()`` (the echo handler's
    work included). Python engine: the loop services the sockets; native:
    the NIC threads.
``write``
    what one ``await conn.write(64 B, remote)`` costs this process (every
    thread), against a target in another process; any provider
    (``--provider pyverbs`` inside the rxe VM counts what a user of real
    hardware pays). Reported by layer: *shared* (aiordma's code but the
    provider implementations: Connection, completion dispatch, memory, and
    the verbs interface types of ``providers/base.py``, with the methods
    ``dataclasses`` generated for them), *device* (the provider's Python:
    ``providers/soft/`` or the pyverbs wrapper), *event loop* (asyncio's and
    ``selectors``' Python; none on uvloop) and *other* (the rest of the
    standard library, e.g. ``enum``).
``target``
    Python bytecodes run in the *target* process (every thread) per one-sided
    operation a peer in another process issues against memory it exposed:
    RDMA Write (64 B), RDMA Read (64 B), compare-and-swap, fetch-and-add. The
    target counts between two control messages on a pipe read by a thread of
    its own (harness, not counted). A NIC does this work: it should be 0.

``--spin-us`` (default 0, the poll window off) is applied through
``AIORDMA_SPIN_US`` in this process and the target: the poll window's
polling depends on time, the operations' work does not. For the same reason
the native engine's expect window is stretched 50x (``AIORDMA_SOFT_WINDOW_US``,
as ``instructions.py`` does) and the event loop's poll of a shared-memory link
is off (``AIORDMA_SOFT_SHM_POLL_US=0``), unless set. Each level warms
up, runs an uncounted pass for CPU time (process time, all threads, per
operation: informative only, noisy on a shared host), then counts ``--iters``
operations with the garbage collector paused.

    python benchmarks/cost.py                              # every level
    python benchmarks/cost.py --level device --top 30
    python benchmarks/cost.py --level write,target --loop uvloop
    AIORDMA_PROVIDER=pyverbs python benchmarks/cost.py --level write,target   # in the rxe VM
    python benchmarks/cost.py --json cost.json             # machine-readable record
    python benchmarks/cost.py --check                      # compare with benchmarks/cost_budget.json
"""

from __future__ import annotations

import _thread
import argparse
import asyncio
import functools
import gc
import json
import os
import platform
import select
import subprocess
import sys
import sysconfig
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiordma  # noqa: E402
from aiordma.providers import open_device  # noqa: E402
from aiordma.providers.base import (  # noqa: E402
    ACCESS_ALL,
    MTU,
    CompletionChannel,
    CompletionQueue,
    QPAttr,
    QPCap,
    QPState,
    RecvWR,
    SendFlags,
    SendWR,
    WCStatus,
    WorkCompletion,
    WROpcode,
)

MSG_SIZE = 64
#: the NIC thread takes over a socket the loop has not serviced for this long (s):
#: far beyond any run, so only this thread ever receives
WATCHDOG_OFF = 3600.0
#: RC local ACK timeout code: 4.096 µs x 2^24 = 69 s (aiordma's default is 14, 67 ms).
#: Nothing is lost on loopback, so it only matters for determinism: a post wakes the
#: NIC thread when its retransmit deadline is earlier than the one the thread sleeps
#: until, which with a short timeout depends on elapsed time (a few wake-ups per
#: second of run, each a handful of bytecodes); with 69 s it happens once, in the warm-up
ACK_TIMEOUT = 24
RECV_DEPTH = 16
LEVELS = ("device", "stack", "write", "target")
TARGET_OPS = ("write", "read", "cas", "faa")
BUDGET_FILE = Path(__file__).resolve().parent / "cost_budget.json"
#: environment variables that change what is measured (recorded in the output)
ENV_PREFIX = "AIORDMA_"
#: a child process that does not answer a control message within this long has failed (s)
CHILD_TIMEOUT = 60.0

LEVEL_TITLES = {
    "device": "two soft devices, verbs only, one RC QP each",
    "stack": "aiordma.connect + start_server (echo) on two soft devices, one event loop",
    "write": "await conn.write(64 B, remote) against a target in another process (this process counted)",
    "target": "one-sided operations from a peer process (the target process counted, every thread)",
}
UNITS = {"device": "round trip", "stack": "round trip", "write": "awaited write", "target": "one-sided op"}
LAYERS = ("shared", "device", "event loop", "application", "other")


# ------------------------------------------------------------- counting ----

#: code objects of this file that count as the measured application (the rest of
#: this file is harness: driving loops, control, counting)
APP_CODES: set[CodeType] = set()


def app(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as application work the benchmark counts (posting, polling)."""
    APP_CODES.add(fn.__code__)
    return fn


_THIS_FILE = os.path.realpath(__file__)
_AIORDMA_DIR = Path(aiordma.__file__).resolve().parent
_PROVIDERS_DIR = _AIORDMA_DIR / "providers"
_STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
_SITE = Path(sysconfig.get_paths()["purelib"]).resolve()
_LOOP_FILES = {"selectors.py", "threading.py"}
#: files under providers/ that are the provider-independent verbs interface (shared), not a provider
_INTERFACE_FILES = {"__init__.py", "base.py"}


class CountingError(RuntimeError):
    """The counter cannot be trusted on this interpreter (it saw calls but no bytecodes)."""


@dataclass
class FunctionCount:
    """Bytecodes and calls of one function over a counted window (not per op)."""

    file: str
    function: str
    line: int
    layer: str
    ops: int
    calls: int


@functools.lru_cache(maxsize=4096)
def _classify(filename: str) -> tuple[str, str]:
    """(short file name, layer) of a code object's file."""
    if filename.startswith("<"):
        return filename, "other"
    if os.path.realpath(filename) == _THIS_FILE:
        return "benchmarks/cost.py", "application"
    path = Path(filename).resolve()
    if path.is_relative_to(_AIORDMA_DIR):
        short = "aiordma/" + path.relative_to(_AIORDMA_DIR).as_posix()
        device = path.is_relative_to(_PROVIDERS_DIR) and path.name not in _INTERFACE_FILES
        return short, "device" if device else "shared"
    for base in (ROOT, _SITE, _STDLIB):
        if path.is_relative_to(base):
            short = path.relative_to(base).as_posix()
            if base == _STDLIB and (short.startswith("asyncio/") or short in _LOOP_FILES):
                return short, "event loop"
            return short, "other"
    return path.name, "other"


def _generated_owners() -> dict[CodeType, tuple[str, str]]:
    """Methods that ``dataclasses`` generated (file ``<string>``) for aiordma's classes:
    the file of the class that owns each, and its name there (``SendWR.__init__``)."""
    owners: dict[CodeType, tuple[str, str]] = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not (name == "aiordma" or name.startswith("aiordma.")) or not path:
            continue
        for obj in list(vars(module).values()):
            if isinstance(obj, type) and hasattr(obj, "__dataclass_fields__") and obj.__module__ == name:
                for attr, fn in vars(obj).items():
                    code = getattr(fn, "__code__", None)
                    if code is not None and code.co_filename.startswith("<"):
                        owners[code] = (path, f"{obj.__qualname__}.{attr}")
    return owners


def _layer_of(code: CodeType, owners: dict[CodeType, tuple[str, str]]) -> tuple[str, str, str]:
    """(short file name, function, layer) of ``code``; generated dataclass methods
    belong to their class's file."""
    owner = owners.get(code)
    if owner is not None:
        short, layer = _classify(owner[0])
        return short, owner[1], layer
    short, layer = _classify(code.co_filename)
    return short, _short_function(code), layer


def _short_function(code: CodeType) -> str:
    name = getattr(code, "co_qualname", code.co_name)
    # dataclass-generated methods (file "<string>"): "__create_fn__.<locals>.__init__"
    return name.rpartition("<locals>.")[2] if name.startswith("__create_fn__") else name


class BytecodeCounter:
    """Counts executed bytecodes and Python calls per code object in every thread.

    ``sys.monitoring`` on 3.12+; ``sys.settrace`` on 3.11, where threads are
    covered only if they start after :meth:`prepare` (call it before opening
    devices). Code of this file not marked :func:`app` is not counted.
    """

    def __init__(self) -> None:
        self.backend = "sys.monitoring" if hasattr(sys, "monitoring") else "sys.settrace"
        #: per thread ident: code -> bytecodes, code -> calls (each dict touched by its thread only)
        self._ops: dict[int, dict[CodeType, int]] = {}
        self._calls: dict[int, dict[CodeType, int]] = {}
        self._names: dict[int, str] = {}
        self._on = False
        self._prepared = False
        self._tool: int | None = None
        self._uncovered: list[str] = []
        self.notes: list[str] = []

    # ---- 3.11: sys.settrace -------------------------------------------------
    def prepare(self) -> None:
        """3.11: install the (idle) trace hook in this thread and in threads started from now on."""
        if self.backend != "sys.settrace" or self._prepared:
            return
        self._prepared = True
        main = threading.current_thread()
        self._uncovered = [t.name for t in threading.enumerate() if t is not main and t.is_alive()]
        threading.settrace(self._global_trace)
        sys.settrace(self._global_trace)

    def _global_trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if not self._on:
            return None
        frame.f_trace_lines = False
        frame.f_trace_opcodes = True
        tid = _thread.get_ident()
        calls = self._calls.get(tid)
        if calls is None:
            calls = self._calls[tid] = {}
        code = frame.f_code
        calls[code] = calls.get(code, 0) + 1
        return self._local_trace

    def _local_trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if not self._on:
            return None
        if event == "opcode":
            tid = _thread.get_ident()
            ops = self._ops.get(tid)
            if ops is None:
                ops = self._ops[tid] = {}
            code = frame.f_code
            ops[code] = ops.get(code, 0) + 1
        return self._local_trace

    def _set_running_frames(self, on: bool) -> None:
        """Turn opcode tracing on (off) for every frame already on a thread's stack:
        they had their ``call`` event before counting started."""
        for frame in sys._current_frames().values():
            f: FrameType | None = frame
            while f is not None:
                if on:
                    f.f_trace = self._local_trace
                    f.f_trace_lines = False
                    f.f_trace_opcodes = True
                else:
                    f.f_trace_opcodes = False
                    f.f_trace = None
                f = f.f_back

    # ---- 3.12+: sys.monitoring ------------------------------------------------
    def _on_instruction(self, code: CodeType, offset: int) -> None:
        tid = _thread.get_ident()
        ops = self._ops.get(tid)
        if ops is None:
            ops = self._ops[tid] = {}
        ops[code] = ops.get(code, 0) + 1

    def _on_start(self, code: CodeType, offset: int) -> None:
        tid = _thread.get_ident()
        calls = self._calls.get(tid)
        if calls is None:
            calls = self._calls[tid] = {}
        calls[code] = calls.get(code, 0) + 1

    def _claim_tool(self) -> int:
        mon = sys.monitoring  # type: ignore[attr-defined]
        for tool in (mon.PROFILER_ID, 3, 4, 0, 1, 5):
            if mon.get_tool(tool) is None:
                mon.use_tool_id(tool, "aiordma-cost")
                return tool
        raise CountingError("sys.monitoring: every tool id is taken")

    # ---- common ---------------------------------------------------------------
    def reset(self) -> None:
        self._ops, self._calls, self._names = {}, {}, {}

    def start(self) -> None:
        """Start counting (every thread). The previous counts are dropped."""
        self.reset()
        gc.collect()
        gc.disable()  # a collection at a random point could run Python finalizers
        if self.backend == "sys.monitoring":
            mon = sys.monitoring  # type: ignore[attr-defined]
            ev = mon.events
            self._tool = tool = self._claim_tool()
            mon.register_callback(tool, ev.INSTRUCTION, self._on_instruction)
            mon.register_callback(tool, ev.PY_START, self._on_start)
            mon.register_callback(tool, ev.PY_RESUME, self._on_start)
            self._on = True
            mon.set_events(tool, ev.INSTRUCTION | ev.PY_START | ev.PY_RESUME)
        else:
            if not self._prepared:
                self.prepare()
            sys.settrace(self._global_trace)  # (again: a debugger or coverage may have replaced it)
            self._on = True
            self._set_running_frames(True)

    def stop(self) -> None:
        """Stop counting; raises :class:`CountingError` if calls were seen but no bytecodes."""
        if self.backend == "sys.monitoring":
            mon = sys.monitoring  # type: ignore[attr-defined]
            tool = self._tool
            assert tool is not None
            mon.set_events(tool, 0)
            self._on = False
            for ev in (mon.events.INSTRUCTION, mon.events.PY_START, mon.events.PY_RESUME):
                mon.register_callback(tool, ev, None)
            mon.free_tool_id(tool)
            self._tool = None
        else:
            self._on = False
            self._set_running_frames(False)
        gc.enable()
        self._names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
        calls = sum(sum(d.values()) for d in self._calls.values())
        ops = sum(sum(d.values()) for d in self._ops.values())
        if calls and not ops:
            raise CountingError(
                f"{self.backend} on Python {platform.python_version()} counted {calls} Python calls but no "
                "bytecodes: opcode events are not delivered, every figure would read 0"
            )

    def close(self) -> None:
        """Remove the 3.11 hooks (threads already started keep an idle one)."""
        if self.backend == "sys.settrace" and self._prepared:
            sys.settrace(None)
            threading.settrace(None)  # type: ignore[arg-type]
            self._prepared = False

    def self_test(self) -> None:
        """Count a known function on this thread and on a new thread; raise if either reads 0."""
        done = threading.Event()

        def spin() -> int:
            return sum(i * i for i in range(50))

        def worker() -> None:
            spin()
            done.set()

        self.start()
        try:
            spin()
            t = threading.Thread(target=worker, name="aiordma-cost-selftest")
            t.start()
            done.wait(10)
            t.join(10)
        finally:
            self.stop()
        here = sum(v for c, v in self._ops.get(_thread.get_ident(), {}).items() if c is spin.__code__)
        there = sum(v for d in self._ops.values() for c, v in d.items() if c is spin.__code__) - here
        self.reset()
        if not here or not there:
            raise CountingError(
                f"{self.backend}: self-test counted {here} bytecodes on this thread and {there} on another: "
                "counting does not cover every thread"
            )

    def functions(self) -> list[FunctionCount]:
        """The counted functions (harness code left out), most bytecodes first."""
        ops: Counter[CodeType] = Counter()
        calls: Counter[CodeType] = Counter()
        for d in self._ops.values():
            ops.update(d)
        for d in self._calls.values():
            calls.update(d)
        merged: dict[tuple[str, str, int], FunctionCount] = {}
        owners = _generated_owners()
        for code in set(ops) | set(calls):
            short, function, layer = _layer_of(code, owners)
            if layer == "application" and code not in APP_CODES:
                continue  # harness
            key = (short, function, code.co_firstlineno)
            fc = merged.get(key)
            if fc is None:
                fc = merged[key] = FunctionCount(short, key[1], key[2], layer, 0, 0)
            fc.ops += ops[code]
            fc.calls += calls[code]
        return sorted(merged.values(), key=lambda f: (-f.ops, -f.calls, f.file, f.line))

    def threads(self) -> list[tuple[str, int, int]]:
        """(thread name, bytecodes, calls) per thread that ran counted code."""
        out = []
        for tid in set(self._ops) | set(self._calls):
            ops = sum(v for c, v in self._ops.get(tid, {}).items() if not _harness(c))
            calls = sum(v for c, v in self._calls.get(tid, {}).items() if not _harness(c))
            if ops or calls:
                out.append((self._names.get(tid, f"thread {tid} (ended)"), ops, calls))
        return sorted(out, key=lambda t: -t[1])

    @property
    def uncovered_threads(self) -> list[str]:
        """3.11: threads that were running before :meth:`prepare` (their work is not counted)."""
        return [n for n in self._uncovered if any(t.name == n and t.is_alive() for t in threading.enumerate())]


def _harness(code: CodeType) -> bool:
    return _classify(code.co_filename)[1] == "application" and code not in APP_CODES


# ------------------------------------------------------------- results ----


@dataclass
class LevelResult:
    level: str
    iters: int
    warmup: int
    functions: list[FunctionCount]  # totals over the counted window
    threads: list[tuple[str, int, int]]
    packets_per_op: float | None  # packets sent by the soft devices per op; None if unknown
    cpu_us_per_op: float | None  # uncounted run, process time (all threads); None if not run
    cpu_iters: int
    recoveries: int  # retransmissions and timeouts during the counted run (should be 0)
    op: str | None = None  # target level: which one-sided operation
    engine: str = "python"
    provider: str = "soft"
    mode: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.level}.{self.op}" if self.op else self.level

    @property
    def bytecodes(self) -> float:
        return sum(f.ops for f in self.functions) / self.iters

    @property
    def calls(self) -> float:
        return sum(f.calls for f in self.functions) / self.iters

    def by_layer(self) -> dict[str, float]:
        out = dict.fromkeys(LAYERS, 0.0)
        for f in self.functions:
            out[f.layer] += f.ops / self.iters
        return out

    def by_file(self) -> list[tuple[str, float, float]]:
        ops: Counter[str] = Counter()
        calls: Counter[str] = Counter()
        for f in self.functions:
            ops[f.file] += f.ops
            calls[f.file] += f.calls
        files = sorted(set(ops) | set(calls), key=lambda k: (-ops[k], -calls[k], k))
        return [(k, ops[k] / self.iters, calls[k] / self.iters) for k in files]


def _device_counts(devices: Iterable[Any]) -> tuple[int, int] | None:
    """(packets sent, retransmissions + timeouts) summed over soft ``devices``; None if unknown."""
    sent = recovered = 0
    for dev in devices:
        c = getattr(dev, "counters", None)
        if not isinstance(c, dict):
            return None
        sent += int(c.get("sent_pkts", c.get("tx_packets", 0)) or 0)
        recovered += int(c.get("retransmits", 0) or 0) + int(c.get("timeouts", 0) or 0)
    return sent, recovered


def _in_flight(devices: list[Any]) -> bool:
    """Whether a packet between the two soft ``devices`` is sent but not yet received."""
    try:
        a, b = (dev.counters for dev in devices)
        return int(a["sent_pkts"]) != int(b["rcvd_pkts"]) or int(b["sent_pkts"]) != int(a["rcvd_pkts"])
    except (AttributeError, KeyError, TypeError, ValueError):
        return False


SETTLE_QUIET_S = 0.02  # no packet for this long, nothing in flight: the last ACK has gone out
SETTLE_LIMIT_S = 2.0


def _settle_step(devices: list[Any], counts: tuple[int, int] | None) -> tuple[bool, tuple[int, int] | None]:
    """One look after a quiet interval: (whether the devices have settled, their counts now)."""
    again = _device_counts(devices)
    return again == counts and not _in_flight(devices), again


def _settled_counts(devices: list[Any]) -> tuple[int, int] | None:
    """:func:`_device_counts` once the devices are quiet.

    A round trip completes for the application when its CQE is written; the
    ACK for that message may still be on its way out of the NIC thread. Counted
    at once, it lands in the next window (one packet too many there, one too
    few here), so the count waits for the last packet to be sent and received."""
    deadline = time.monotonic() + SETTLE_LIMIT_S
    counts = _device_counts(devices)
    while time.monotonic() < deadline:
        time.sleep(SETTLE_QUIET_S)
        settled, counts = _settle_step(devices, counts)
        if settled:
            break
    return counts


async def _settled_counts_async(devices: list[Any]) -> tuple[int, int] | None:
    """:func:`_settled_counts` for a loop that services the devices itself (Python engine)."""
    deadline = time.monotonic() + SETTLE_LIMIT_S
    counts = _device_counts(devices)
    while time.monotonic() < deadline:
        await asyncio.sleep(SETTLE_QUIET_S)
        settled, counts = _settle_step(devices, counts)
        if settled:
            break
    return counts


def engine_of(dev: Any) -> str:
    """``python`` or ``native`` for a soft device (no attribute: python), else the provider."""
    if getattr(dev, "provider", "soft") != "soft":
        return str(dev.provider)
    return str(getattr(dev, "engine", "python"))


# ---------------------------------------------------------- device level ----


class ManualLoop:
    """Stands in for an event loop in ``DeviceContext.attach_event_loop``.

    The soft NIC hands the loop its receive callback (``add_reader``) and
    stops receiving on its own thread; nothing polls here, the benchmark calls
    the callback itself, so every packet is processed on this thread at a
    point the round trip chooses.
    """

    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None

    def add_reader(self, fd: int, callback: Callable[..., None], *args: Any) -> None:
        self.callback = functools.partial(callback, *args) if args else callback

    def remove_reader(self, fd: int) -> bool:
        found, self.callback = self.callback is not None, None
        return found

    def is_closed(self) -> bool:
        return False


class VerbsEnd:
    """One side of the device-level ping-pong: a soft device with a PD, a send
    and a receive CQ, an RC QP and an 8 KiB registered buffer (send from
    [0, 64), receive into [4096, 8192)).

    ``manual``: the CQs are polled and the NIC is serviced by hand (Python
    engine only). ``nic``: the NIC threads work on their own; each CQ has a
    completion channel, armed, and a completion is reaped by waiting on the
    channel's fd (no bytecode while blocked)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.dev = open_device("soft")
        self.detach: Callable[[], None] | None = None
        self.service: Callable[[], None] = lambda: None
        self.channels: list[CompletionChannel] = []
        if mode == "manual":
            nic = getattr(self.dev, "nic", None)
            if nic is None:
                self.dev.close()
                raise SystemExit(f"--device-mode manual needs the Python engine (this is {engine_of(self.dev)!r})")
            nic.watchdog_interval = WATCHDOG_OFF
            nic.poll_window = 0.0  # nothing polls this stand-in loop
            loop = ManualLoop()
            self.detach = self.dev.attach_event_loop(loop)
            if self.detach is None or loop.callback is None:
                self.dev.close()
                raise SystemExit("the soft device refused loop assist (unset AIORDMA_SOFT_LOOP_ASSIST)")
            #: one round of NIC work: receive, timers, transmit (``SoftNIC.service``)
            self.service = loop.callback
            scq_ch = rcq_ch = None
        else:
            scq_ch = self.dev.create_comp_channel()
            rcq_ch = self.dev.create_comp_channel()
            self.channels = [scq_ch, rcq_ch]
        self.pd = self.dev.alloc_pd()
        self.scq = self.dev.create_cq(256, scq_ch)
        self.rcq = self.dev.create_cq(256, rcq_ch)
        self.qp = self.pd.create_qp(
            self.scq, self.rcq, QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)
        )
        self.buf = bytearray(8192)
        self.mr = self.pd.reg_mr(self.buf, ACCESS_ALL)
        # the work requests of a round trip, built once (an application reposts its WRs)
        self.swr = SendWR(
            0,
            WROpcode.IBV_WR_SEND_WITH_IMM,
            [self.mr.sge(0, MSG_SIZE)],
            send_flags=SendFlags.IBV_SEND_SIGNALED,
            imm_data=7,
        )
        self.rwr = RecvWR(0, [self.mr.sge(4096, 4096)])
        if mode == "nic":
            self.scq.req_notify()
            self.rcq.req_notify()

    def connect(self, peer: VerbsEnd, *, sq_psn: int, rq_psn: int) -> None:
        self.qp.to_init(QPAttr(qp_access_flags=ACCESS_ALL))
        self.qp.to_rtr(
            QPAttr(
                dest_qp_num=peer.qp.qp_num,
                rq_psn=rq_psn,
                dgid=peer.dev.query_gid().gid,
                dport=peer.dev.udp_port,
                path_mtu=MTU.IBV_MTU_4096,  # type: ignore[attr-defined]
            )
        )
        self.qp.to_rts(QPAttr(sq_psn=sq_psn, timeout=ACK_TIMEOUT, retry_cnt=7, rnr_retry=7))

    def close(self) -> None:
        self.qp.close()
        self.mr.close()
        self.scq.close()
        self.rcq.close()
        for ch in self.channels:
            ch.close()
        self.pd.close()
        if self.detach is not None:
            self.detach()
        self.dev.close()


@app
def _expect(wcs: list[WorkCompletion], what: str) -> None:
    if len(wcs) != 1 or wcs[0].status != WCStatus.IBV_WC_SUCCESS:
        raise RuntimeError(f"expected one successful {what} completion, got {wcs}")


@app
def _reap(cq: CompletionQueue, channel: CompletionChannel, what: str) -> None:
    """One completion through the channel: wait for the event, ack it, re-arm, poll
    (the CQ was armed before the work that completes it was posted)."""
    if not select.select([channel.fileno()], [], [], 10.0)[0]:
        raise RuntimeError(f"no completion event for the {what} within 10 s")
    if channel.get_cq_event() is None:
        raise RuntimeError(f"the completion channel of the {what} was readable but held no event")
    cq.ack_events(1)
    cq.req_notify()
    _expect(cq.poll(), what)


def _device_round_trip(a: VerbsEnd, b: VerbsEnd, mode: str) -> Callable[[int], None]:
    if mode == "manual":

        @app
        def round_trip(i: int) -> None:
            a.qp.post_send(a.swr)
            b.service()  # B receives the SEND, ACKs it
            _expect(b.rcq.poll(), "receive on B")
            b.qp.post_recv(b.rwr)
            b.qp.post_send(b.swr)
            a.service()  # A receives the ACK and the reply, ACKs the reply
            _expect(a.rcq.poll(), "receive on A")
            _expect(a.scq.poll(), "send on A")
            a.qp.post_recv(a.rwr)
            b.service()  # B receives the ACK
            _expect(b.scq.poll(), "send on B")

        return round_trip

    @app
    def round_trip_nic(i: int) -> None:
        a.qp.post_send(a.swr)
        _reap(b.rcq, b.channels[1], "receive on B")
        b.qp.post_recv(b.rwr)
        b.qp.post_send(b.swr)
        _reap(a.rcq, a.channels[1], "receive on A")
        _reap(a.scq, a.channels[0], "send on A")
        a.qp.post_recv(a.rwr)
        _reap(b.scq, b.channels[0], "send on B")

    return round_trip_nic


def _drive(fn: Callable[[int], None], n: int) -> None:
    for i in range(n):
        fn(i)


def run_device(args: argparse.Namespace, counter: BytecodeCounter) -> LevelResult:
    counter.prepare()  # (3.11) before the devices start their NIC threads
    probe = open_device("soft")
    engine = engine_of(probe)
    probe.close()
    mode = args.device_mode or ("manual" if engine == "python" else "nic")
    a, b = VerbsEnd(mode), VerbsEnd(mode)
    try:
        # PSNs just below the 24-bit wrap: the run crosses it (as the test suite does)
        a.connect(b, sq_psn=0xFFFFF0, rq_psn=0xFFFFFE)
        b.connect(a, sq_psn=0xFFFFFE, rq_psn=0xFFFFF0)
        if not a.qp.state == b.qp.state == QPState.IBV_QPS_RTS:
            raise RuntimeError("the queue pairs did not reach RTS")
        for _ in range(RECV_DEPTH):
            a.qp.post_recv(a.rwr)
            b.qp.post_recv(b.rwr)
        round_trip = _device_round_trip(a, b, mode)
        _drive(round_trip, args.warmup)
        t0 = time.process_time()
        _drive(round_trip, args.cpu_iters)
        cpu = time.process_time() - t0
        before = _settled_counts([a.dev, b.dev])
        counter.start()
        try:
            _drive(round_trip, args.iters)
        finally:
            counter.stop()
        after = _settled_counts([a.dev, b.dev])
    finally:
        a.close()
        b.close()
    notes = []
    if mode == "nic":
        notes.append("the NIC threads do the packet work; their Python (if any) is counted")
    return _result("device", args, counter, before, after, cpu, engine=engine, mode=mode, notes=notes)


def _result(
    level: str,
    args: argparse.Namespace,
    counter: BytecodeCounter,
    before: tuple[int, int] | None,
    after: tuple[int, int] | None,
    cpu_s: float,
    *,
    engine: str,
    mode: str,
    provider: str = "soft",
    notes: Iterable[str] = (),
) -> LevelResult:
    notes = list(notes)
    if counter.uncovered_threads:
        notes.append(f"threads running before counting was prepared are not counted: {counter.uncovered_threads}")
    n = args.iters
    return LevelResult(
        level=level,
        iters=n,
        warmup=args.warmup,
        functions=counter.functions(),
        threads=counter.threads(),
        packets_per_op=(after[0] - before[0]) / n if before and after else None,
        cpu_us_per_op=cpu_s / args.cpu_iters * 1e6 if args.cpu_iters else None,
        cpu_iters=args.cpu_iters,
        recoveries=after[1] - before[1] if before and after else 0,
        engine=engine,
        provider=provider,
        mode=mode,
        notes=notes,
    )


# ----------------------------------------------------------- stack level ----


async def _stack(args: argparse.Namespace, counter: BytecodeCounter) -> LevelResult:
    counter.prepare()
    devices = [open_device("soft"), open_device("soft")]
    engine = engine_of(devices[0])
    for dev in devices:
        nic = getattr(dev, "nic", None) if engine == "python" else None
        if nic is not None:  # Python engine: the loop services the sockets; the NIC threads run the timers only
            nic.watchdog_interval = WATCHDOG_OFF
            nic.poll_window = 0.0  # (its polling depends on time)

    @app
    async def echo(conn: aiordma.Connection) -> None:
        try:
            while True:
                await conn.send(await conn.recv())
        except aiordma.RDMAError:
            pass

    opts: dict[str, Any] = {"progress": "event", "spin_us": 0, "ack_timeout": ACK_TIMEOUT}
    server = await aiordma.start_server(echo, "127.0.0.1", 0, device=devices[1], **opts)
    conn = await aiordma.connect("127.0.0.1", server.port, device=devices[0], **opts)
    notes: list[str] = []
    try:
        if conn.progress_mode != "event":
            notes.append(f"progress mode is {conn.progress_mode!r}, not 'event'")
        data = bytes(MSG_SIZE)
        send, recv = conn.send, conn.recv
        for _ in range(args.warmup):
            await send(data)
            await recv()
        t0 = time.process_time()
        for _ in range(args.cpu_iters):
            await send(data)
            await recv()
        cpu = time.process_time() - t0
        before = await _settled_counts_async(devices)
        counter.start()
        try:
            for _ in range(args.iters):
                await send(data)
                await recv()
        finally:
            counter.stop()
        after = await _settled_counts_async(devices)
    finally:
        await conn.close()
        server.close()
        await server.wait_closed()
        for dev in devices:
            dev.close()
    return _result("stack", args, counter, before, after, cpu, engine=engine, mode="event, no poll window", notes=notes)


def run_stack(args: argparse.Namespace, counter: BytecodeCounter) -> LevelResult:
    with asyncio.Runner(loop_factory=_loop_factory(args.loop)) as runner:
        return runner.run(_stack(args, counter))


# ------------------------------------------- write and target levels ----


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


class CountedProcess:
    """A process that counts its own Python (:func:`counted_child`), controlled by
    lines on its stdin and answering one JSON line each on its stdout:
    ``count-start``/``count-stop`` (the counts), ``cpu-start``/``cpu-stop``
    (process time), ``quit``. The first line is what the child announced."""

    def __init__(self, argv: list[str], what: str = "the counted process") -> None:
        self.what = what
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self.info = self._read(f"{what} did not start")
        if "error" in self.info:
            self.close()
            raise SystemExit(f"{what} failed: {self.info['error']}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self, what: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], CHILD_TIMEOUT)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            code = self.proc.poll()
            raise SystemExit(f"{what} (exit status {code})")
        return json.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read(f"{self.what} did not answer {command!r}")

    def counts(self) -> tuple[list[FunctionCount], list[tuple[str, int, int]], float]:
        """``count-stop``: (functions, threads, CPU seconds) of the counted window."""
        rep = self.ask("count-stop")
        if "error" in rep:
            raise CountingError(f"{self.what}: {rep['error']}")
        threads = [(str(n), int(o), int(c)) for n, o, c in rep["threads"]]
        return [FunctionCount(**f) for f in rep["functions"]], threads, float(rep["cpu_s"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _control(counter: BytecodeCounter, on_quit: Callable[[], None]) -> None:
    """The control thread of a counted child (harness: nothing here is counted)."""
    # binary pipes and replies encoded before counting starts: between "count-start"
    # and "count-stop" this thread runs no code that is counted
    readline, write, flush = sys.stdin.buffer.readline, sys.stdout.buffer.write, sys.stdout.buffer.flush
    ok = b'{"ok": true}\n'
    cpu0 = 0.0
    while True:
        cmd = readline().strip()
        if cmd == b"count-start":
            cpu0 = time.process_time()
            counter.start()
            write(ok)
            flush()
            continue
        if cmd == b"count-stop":
            try:
                counter.stop()
                reply: dict[str, Any] = {
                    "cpu_s": time.process_time() - cpu0,
                    "functions": [vars(f) for f in counter.functions()],
                    "threads": counter.threads(),
                }
            except CountingError as e:
                reply = {"error": str(e)}
        elif cmd == b"cpu-start":
            cpu0 = time.process_time()
            reply = {"ok": True}
        elif cmd == b"cpu-stop":
            reply = {"cpu_s": time.process_time() - cpu0}
        elif cmd in (b"quit", b""):
            break
        else:
            reply = {"error": f"unknown command {cmd!r}"}
        write(json.dumps(reply).encode() + b"\n")
        flush()
    on_quit()


ReadyFn = Callable[[dict[str, Any]], None]


def counted_child(main: Callable[[ReadyFn, asyncio.Event], Awaitable[None]], loop: str = "asyncio") -> int:
    """Run ``main(ready, quit)`` on an event loop in this process, counting its Python
    (every thread) on request of the parent (:class:`CountedProcess`).

    ``main`` sets up what is to be measured, calls ``ready(info)`` (announced to the
    parent as a JSON line; the control thread starts then) and returns once ``quit``
    is set. The counter is prepared before ``main`` runs, so on 3.11 the threads it
    starts are covered, and it is self-tested first."""
    counter = BytecodeCounter()
    counter.prepare()
    try:
        counter.self_test()
    except CountingError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 1

    async def run() -> None:
        ev_loop = asyncio.get_running_loop()
        quit_ = asyncio.Event()

        def ready(info: dict[str, Any]) -> None:
            line = {**info, "backend": counter.backend, "python": platform.python_version()}
            print(json.dumps(line), flush=True)
            threading.Thread(
                target=_control,
                args=(counter, lambda: ev_loop.call_soon_threadsafe(quit_.set)),
                name="aiordma-cost-control",
                daemon=True,
            ).start()

        await main(ready, quit_)

    with asyncio.Runner(loop_factory=_loop_factory(loop)) as runner:
        runner.run(run())
    return 0


def _target_child(args: argparse.Namespace) -> int:
    """The target process: count this process's Python while a peer operates on its memory."""

    async def main(ready: ReadyFn, quit_: asyncio.Event) -> None:
        device = aiordma.get_device(args.provider)
        region = aiordma.register(bytearray(4096), device=device)

        async def handler(conn: aiordma.Connection) -> None:
            try:  # one-sided operations never wake this: it waits for the peer to leave
                await conn.recv()
            except aiordma.RDMAError:
                pass

        server = await aiordma.start_server(
            handler,
            "127.0.0.1",
            0,
            device=device,
            expose={"buf": region.exposed("rwa")},  # the client Writes, Reads, CAS and FAA
        )
        ready({"port": server.port, "engine": engine_of(device), "provider": f"{device.provider}:{device.name}"})
        await quit_.wait()
        server.close()
        await server.wait_closed()
        region.close()

    return counted_child(main, args.loop)


async def _remote_levels(args: argparse.Namespace, counter: BytecodeCounter, levels: list[str]) -> list[LevelResult]:
    counter.prepare()
    argv = [sys.executable, _THIS_FILE, "--target-child", "--loop", args.loop]
    if args.provider:
        argv += ["--provider", args.provider]
    target = CountedProcess(argv, "cost.py: the target process")
    results: list[LevelResult] = []
    conn = None
    try:
        device = aiordma.get_device(args.provider)
        conn = await aiordma.connect("127.0.0.1", target.info["port"], device=device, progress="event")
        engine = engine_of(device)
        provider = f"{device.provider}:{device.name}"
        rb = conn.remote("buf")
        local = conn.register(bytearray(4096))
        src, dst = local[0:MSG_SIZE], rb[0:MSG_SIZE]
        write, read = conn.write, conn.read
        mode = f"event, poll window {args.spin_us:g} us, {args.loop}"
        if "write" in levels:
            for _ in range(args.warmup):
                await write(src, dst)
            t0 = time.process_time()
            for _ in range(args.cpu_iters):
                await write(src, dst)
            cpu = time.process_time() - t0
            before = _device_counts([device])
            counter.start()
            try:
                for _ in range(args.iters):
                    await write(src, dst)
            finally:
                counter.stop()
            after = _device_counts([device])
            results.append(
                _result("write", args, counter, before, after, cpu, engine=engine, mode=mode, provider=provider)
            )
        if "target" in levels:
            word_cas, word_faa = rb.at(128, 8), rb.at(136, 8)
            into = local[64:128]
            state = {"cas": 0}

            async def one(op: str) -> None:
                if op == "write":
                    await write(src, dst)
                elif op == "read":
                    await read(rb[64:128], into=into)
                elif op == "cas":
                    old = await conn.compare_and_swap(word_cas, state["cas"], state["cas"] + 1)
                    if old != state["cas"]:
                        raise RuntimeError(f"compare-and-swap found {old}, expected {state['cas']}")
                    state["cas"] += 1
                else:
                    await conn.fetch_and_add(word_faa, 1)

            for op in TARGET_OPS:
                for _ in range(args.warmup):
                    await one(op)
                await asyncio.sleep(0.05)  # the target's tail work (its last ACK) is over
                target.ask("cpu-start")
                for _ in range(args.cpu_iters):
                    await one(op)
                await asyncio.sleep(0.05)
                cpu = target.ask("cpu-stop")["cpu_s"]
                target.ask("count-start")
                for _ in range(args.iters):
                    await one(op)
                await asyncio.sleep(0.05)
                functions, threads, _cpu = target.counts()
                res = LevelResult(
                    level="target",
                    op=op,
                    iters=args.iters,
                    warmup=args.warmup,
                    functions=functions,
                    threads=threads,
                    packets_per_op=None,
                    cpu_us_per_op=cpu / args.cpu_iters * 1e6 if args.cpu_iters else None,
                    cpu_iters=args.cpu_iters,
                    recoveries=0,
                    engine=target.info["engine"],
                    provider=target.info["provider"],
                    mode=f"target on {args.loop}, poll window {args.spin_us:g} us",
                    notes=[f"counted in the target process ({target.info['backend']}, every thread)"],
                )
                results.append(res)
    finally:
        if conn is not None:
            await conn.close()
        target.close()
    return results


def run_remote(args: argparse.Namespace, counter: BytecodeCounter, levels: list[str]) -> list[LevelResult]:
    with asyncio.Runner(loop_factory=_loop_factory(args.loop)) as runner:
        return runner.run(_remote_levels(args, counter, levels))


# ---------------------------------------------------------------- output ----


def git_commit() -> tuple[str | None, bool | None]:
    """(HEAD of the repository, whether ``aiordma/`` has uncommitted changes)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", "aiordma"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    return head or None, bool(status.strip())


def environment(counter: BytecodeCounter) -> dict[str, Any]:
    commit, dirty = git_commit()
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "counter": counter.backend,
        "aiordma_version": getattr(aiordma, "__version__", None),
        "aiordma_commit": commit,
        "aiordma_dirty": dirty,
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIX)},
    }


RULE = "-" * 96


def print_table(res: LevelResult, env: dict[str, Any], top: int) -> None:
    commit = env["aiordma_commit"]
    tree = "unknown" if commit is None else commit[:12] + (" + local changes" if env["aiordma_dirty"] else "")
    unit = UNITS[res.level]
    u = "op" if res.level in ("write", "target") else "RT"
    print(RULE)
    what = f"{res.level} level" + (f": {res.op}" if res.op else "")
    print(f"                              Per-operation cost: {what}")
    print(f" Setup           : {LEVEL_TITLES[res.level]}")
    if res.level in ("device", "stack"):
        print(f" Round trip      : {MSG_SIZE} B SEND_WITH_IMM each way, acknowledged (SEND + ACK each way)")
    elif res.level == "write":
        print(f" Operation       : await conn.write({MSG_SIZE} B registered, remote)")
    else:
        sizes = {"write": f"RDMA Write of {MSG_SIZE} B", "read": f"RDMA Read of {MSG_SIZE} B"}
        print(f" Operation       : {sizes.get(res.op or '', 'ATOMIC_' + (res.op or '').upper())} by the peer")
    print(f" Device          : {res.provider}, engine {res.engine}; {res.mode}")
    print(f" Iterations      : {res.iters} counted after {res.warmup} warm-up; CPU time over {res.cpu_iters} uncounted")
    print(f" Python          : {env['implementation']} {env['python']} (counted with {env['counter']})")
    print(f" aiordma         : {tree}")
    if env["env"]:
        print(f" Environment     : {' '.join(f'{k}={v}' for k, v in env['env'].items())}")
    print(RULE)
    print(f" #bytes  #iterations   bytecodes/{u}   calls/{u}   packets/{u}   CPU[usec/{u}] (noisy)   per {unit}")
    cpu = "-" if res.cpu_us_per_op is None else f"{res.cpu_us_per_op:.1f}"
    pk = "-" if res.packets_per_op is None else f"{res.packets_per_op:.2f}"
    print(f" {MSG_SIZE:<7} {res.iters:<13} {res.bytecodes:<14.0f} {res.calls:<10.1f} {pk:<12} {cpu}")
    app_ops = res.by_layer()["application"]
    if app_ops:
        print(
            f" of which the benchmark's own code (posting, reaping): {app_ops:.0f}; the library: {res.bytecodes - app_ops:.0f}"
        )
    print(RULE)
    print(" by layer (shared: aiordma but the provider implementations; device: the provider's Python)")
    print(f"  bytecodes/{u}   layer")
    for layer, v in res.by_layer().items():
        print(f"  {v:12.1f}   {layer}")
    if res.threads:
        print(" by thread")
        for name, ops, calls in res.threads:
            print(f"  {ops / res.iters:12.1f}   {calls / res.iters:8.2f} calls   {name}")
    print(RULE)
    print(f" top {min(top, len(res.functions))} functions by bytecodes per {unit}")
    print(f"  bytecodes/{u}   calls/{u}   function")
    for f in res.functions[:top]:
        print(f"  {f.ops / res.iters:12.1f}   {f.calls / res.iters:8.2f}   {f.file}:{f.line} {f.function}")
    print(RULE)
    print(" by file")
    print(f"  bytecodes/{u}   share   calls/{u}   file")
    total = res.bytecodes or 1.0
    for file, file_ops, file_calls in res.by_file():
        print(f"  {file_ops:12.1f}  {file_ops / total:5.1%}   {file_calls:8.2f}   {file}")
    print(RULE)
    print(f" CPU[usec/{u}]: process time (all threads) per {unit} in a separate uncounted run;")
    print(" informative only: on a shared host it varies by tens of percent between runs.")
    if res.recoveries:
        print(f" WARNING: {res.recoveries} retransmissions/timeouts during the counted run: the counts include them")
    for note in res.notes:
        print(f" NOTE: {note}")
    print(RULE)


def record(res: LevelResult, env: dict[str, Any], top: int) -> dict[str, Any]:
    layers = res.by_layer()
    rec: dict[str, Any] = {
        "level": res.level,
        "name": res.name,
        "op": res.op,
        "unit": UNITS[res.level],
        "setup": LEVEL_TITLES[res.level],
        "msg_size": MSG_SIZE,
        "engine": res.engine,
        "provider": res.provider,
        "mode": res.mode,
        "iters": res.iters,
        "warmup": res.warmup,
        "bytecodes_per_op": round(res.bytecodes, 1),
        # the library's part: all but the benchmark's own application code (posting, reaping)
        "library_bytecodes_per_op": round(res.bytecodes - layers["application"], 1),
        "calls_per_op": round(res.calls, 2),
        "by_layer": {k: round(v, 1) for k, v in layers.items()},
        "packets_per_op": None if res.packets_per_op is None else round(res.packets_per_op, 3),
        "cpu_us_per_op": None if res.cpu_us_per_op is None else round(res.cpu_us_per_op, 1),
        "cpu_iters": res.cpu_iters,
        "recoveries": res.recoveries,
        "notes": res.notes,
        "by_thread": [
            {"thread": name, "bytecodes_per_op": round(ops / res.iters, 1), "calls_per_op": round(calls / res.iters, 2)}
            for name, ops, calls in res.threads
        ],
        "by_file": {
            file: {"bytecodes_per_op": round(ops, 1), "calls_per_op": round(calls, 2)}
            for file, ops, calls in res.by_file()
        },
        "top": [
            {
                "file": f.file,
                "function": f.function,
                "line": f.line,
                "layer": f.layer,
                "bytecodes_per_op": round(f.ops / res.iters, 1),
                "calls_per_op": round(f.calls / res.iters, 2),
            }
            for f in res.functions[:top]
        ],
        **env,
    }
    if res.level in ("device", "stack"):  # the names of earlier records (per round trip)
        rec["bytecodes_per_rt"] = rec["bytecodes_per_op"]
        rec["calls_per_rt"] = rec["calls_per_op"]
    return rec


# ---------------------------------------------------------------- budgets ----


def budget_key() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def figures(rec: dict[str, Any]) -> dict[str, float]:
    """The budgeted figures of one JSON record: ``level[.op]`` (all bytecodes per op),
    for the device level ``device.library`` (less the benchmark's own posting and
    reaping code: the device's work, which the issue-14 bar is about), for the stack
    level ``stack.shared``, and for the write level ``write.shared`` and ``write.device``."""
    out = {rec["name"]: rec["bytecodes_per_op"]}
    if rec["level"] == "device":
        out["device.library"] = rec["library_bytecodes_per_op"]
    if rec["level"] == "stack":
        out["stack.shared"] = rec["by_layer"]["shared"]
    if rec["level"] == "write":
        out["write.shared"] = rec["by_layer"]["shared"]
        out["write.device"] = rec["by_layer"]["device"]
    return out


def check_budgets(records: list[dict[str, Any]], path: Path = BUDGET_FILE) -> list[str]:
    """Compare ``records`` with the recorded budgets; the list of failures (empty: all within).

    An engine with no entry for this Python is held to the file's ``bars``; with
    neither, that is a failure too (record one)."""
    doc = json.loads(path.read_text())
    failures: list[str] = []
    for rec in records:
        entry = doc["budgets"].get(budget_key(), {}).get(rec["engine"])
        source = "recorded"
        if entry is None:
            entry = {name: {"budget": bar, "recorded": None} for name, bar in doc.get("bars", {}).items()}
            source = "bar"
        checked = 0
        for name, value in figures(rec).items():
            b = entry.get(name)
            if b is None:
                continue
            checked += 1
            if value > b["budget"]:
                top = [(f["function"], f["bytecodes_per_op"]) for f in rec["top"][:6]]
                failures.append(
                    f"{name}: {value:.1f} bytecodes per {rec['unit']} > {source} budget {b['budget']} "
                    f"(recorded {b.get('recorded')}, Python {budget_key()}, {rec['engine']} engine); top: {top}"
                )
        if not checked and source == "bar" and rec["name"] not in doc.get("bars", {}):
            failures.append(
                f"{rec['name']}: no budget recorded for Python {budget_key()} and the {rec['engine']} engine in "
                f"{path.name}: run `python benchmarks/cost.py --record` and commit the file"
            )
    return failures


def record_budgets(records: list[dict[str, Any]], path: Path = BUDGET_FILE) -> None:
    """Write the figures of ``records`` as this Python's and engine's baseline."""
    doc = json.loads(path.read_text())
    margins = doc["margins"]
    for rec in records:
        entry = doc["budgets"].setdefault(budget_key(), {}).setdefault(rec["engine"], {})
        for name, value in figures(rec).items():
            # Timing decides how often the event loop turns per operation where a NIC
            # thread completes it (the stack figures and the shared layers' share of a
            # write on the native engine, whose Python work is little else: how many
            # completions one wake-up drains moves them; seen in CI under load: 429.5
            # bytecodes per write against 396 recorded), and how the Python engine's
            # target splits its work between threads; elsewhere the shared layers'
            # own path does not vary.
            timing = (
                name in ("write", "write.device")
                or (name.startswith("target") and rec["engine"] == "python")
                or (rec["engine"] == "native" and (name.startswith("stack") or name == "write.shared"))
            )
            margin = margins["timing" if timing else "deterministic"]
            entry[name] = {
                "recorded": round(value, 1),
                "budget": int(value * (1 + margin) + margins["floor"]) if value else 0,
            }
        doc["budgets"][budget_key()][rec["engine"]] = dict(sorted(entry.items()))
    doc["budgets"] = dict(sorted(doc["budgets"].items()))
    path.write_text(json.dumps(doc, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument(
        "--level",
        default="all",
        help="comma-separated levels: device, stack, write, target; 'all' (default) or 'both' (device,stack)",
    )
    ap.add_argument("--iters", type=int, default=300, help="counted operations per level (default: 300)")
    ap.add_argument("--warmup", type=int, default=300, help="uncounted operations before measuring (default: 300)")
    ap.add_argument(
        "--cpu-iters",
        type=int,
        default=2000,
        help="uncounted operations for the CPU-time figure (default: 2000; 0 skips it)",
    )
    ap.add_argument("--device-mode", choices=("manual", "nic"), default=None, help="device level (default: by engine)")
    ap.add_argument(
        "--engine",
        choices=("python", "native"),
        default=None,
        help="soft-device engine (sets AIORDMA_SOFT_ENGINE; default: the library's)",
    )
    ap.add_argument(
        "--provider",
        choices=("auto", "soft", "pyverbs"),
        default=None,
        help="provider of the write and target levels (default: AIORDMA_PROVIDER or auto)",
    )
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio", help="event loop (default asyncio)")
    ap.add_argument("--spin-us", type=float, default=0.0, help="poll window (AIORDMA_SPIN_US) in µs (default 0: off)")
    ap.add_argument("--top", type=int, default=20, help="functions listed (default: 20)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    ap.add_argument("--check", action="store_true", help=f"fail (exit 1) if a level exceeds {BUDGET_FILE.name}")
    ap.add_argument(
        "--record", action="store_true", help=f"record the figures as this Python's baseline in {BUDGET_FILE.name}"
    )
    ap.add_argument("--target-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or args.cpu_iters < 0 or args.top < 0 or args.spin_us < 0:
        ap.error("--iters must be positive; --warmup, --cpu-iters, --top and --spin-us not negative")
    if (args.check or args.record) and (args.loop != "asyncio" or args.spin_us):
        ap.error("--check and --record use the settings the budgets were recorded with: asyncio, --spin-us 0")
    if args.engine:
        os.environ["AIORDMA_SOFT_ENGINE"] = args.engine
    os.environ["AIORDMA_SPIN_US"] = f"{args.spin_us:g}"
    # the event loop's poll of a shared-memory link spins on the ring until the peer
    # answers: what it would count is the peer's speed, not work (instructions.py does
    # the same); the target child inherits it
    os.environ.setdefault("AIORDMA_SOFT_SHM_POLL_US", "0")
    # the native engine's expect window (2 ms by default), stretched as instructions.py
    # stretches it: under tracing and a loaded host a peer's ACK can come after 2 ms, and
    # the completion then takes the NIC thread's hand-over instead of the loop's own
    # receive, a path some dozens of bytecodes longer: what it would count is the host's
    # load (a write's shared layers: 24.0 bytecodes quiet, up to 32.1 under CI's load)
    os.environ.setdefault("AIORDMA_SOFT_WINDOW_US", str(2000 * 50))
    if args.target_child:
        return _target_child(args)
    if args.level == "all":
        levels = list(LEVELS)
    elif args.level == "both":
        levels = ["device", "stack"]
    else:
        levels = [x.strip() for x in args.level.split(",") if x.strip()]
        bad = [x for x in levels if x not in LEVELS]
        if bad or not levels:
            ap.error(f"--level: unknown level {', '.join(bad) or '(none)'}; choose from {', '.join(LEVELS)}, all, both")

    counter = BytecodeCounter()
    env = environment(counter)
    env["loop"], env["spin_us"] = args.loop, args.spin_us
    results: list[LevelResult] = []
    try:
        counter.prepare()
        counter.self_test()
        if "device" in levels:
            results.append(run_device(args, counter))
        if "stack" in levels:
            results.append(run_stack(args, counter))
        remote: list[str] = [lv for lv in ("write", "target") if lv in levels]
        if remote:
            results.extend(run_remote(args, counter, remote))
    except CountingError as e:
        print(f"cost.py: {e}", file=sys.stderr)
        return 2
    finally:
        counter.close()
    for res in results:
        print_table(res, env, args.top)
    names = {r.name: r for r in results}
    if "device" in names and "stack" in names:
        dev, stack = names["device"], names["stack"]
        print(
            f" stack - device: {stack.bytecodes - dev.bytecodes:.0f} bytecodes/RT, "
            f"{stack.calls - dev.calls:.1f} calls/RT (connection, completion dispatch, event loop)"
        )
    if "write" in names:
        lay = names["write"].by_layer()
        print(
            f" per awaited write: shared layers {lay['shared']:.0f}, device {lay['device']:.0f}, "
            f"event loop {lay['event loop']:.0f}, other {lay['other']:.0f} bytecodes"
        )
    targets = [r for r in results if r.level == "target"]
    if targets:
        print(
            " target process per one-sided op: "
            + ", ".join(f"{r.op} {r.bytecodes:.0f}" for r in targets)
            + " bytecodes"
        )
    records = [record(r, env, args.top) for r in results]
    if args.json:
        doc = {"benchmark": "aiordma-cost", "results": records}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    if args.record:
        record_budgets(records)
        print(f" recorded as the baseline for Python {budget_key()} in {BUDGET_FILE}")
    if args.check:
        failures = check_budgets(records)
        for f in failures:
            print(f" OVER BUDGET: {f}", file=sys.stderr)
        if failures:
            return 1
        print(f" within the budgets of {BUDGET_FILE.name} (Python {budget_key()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
