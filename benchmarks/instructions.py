#!/usr/bin/env python3
"""Machine instructions per awaited aiordma operation, counted by valgrind's callgrind.

What it counts: every instruction the *initiating* process retires in user space
for one operation — the interpreter, aiordma's Python, the native engine, libc, the
event loop (uvloop's C included) — in every thread (the loop's, the native engine's
NIC thread), per

``write64``
    ``await conn.write(region[0:64], remote[0:64])``
``read64``
    ``await conn.read(remote[64:128], into=region[64:128])``
``send64``
    ``await conn.send(64 B); await conn.recv()`` against an echo server: one round trip
``write4k_d16``
    4 KiB ``post_write`` kept 16 deep (await the oldest future, post the next): per write

through the public API with the default settings, on the soft device, against a
target process on loopback (another interpreter: it exposes the memory and echoes;
it runs at full speed and is not counted). And, unless ``--target-ops ''``, the
other way round: instructions the *target* process (every thread: its NIC thread
does the work, no Python runs) retires per one-sided operation it serves, driven at
full speed by this process.

Why callgrind: CPU time on a shared 2-vCPU VM moves by tens of percent from run to
run, and bytecodes (``benchmarks/cost.py``) see nothing that runs in C: the native
engine, a compiled core, the interpreter's own work per bytecode. Callgrind runs the
process on a synthetic CPU and counts what it executes, which depends on the code
path, not on the load of the host. It is not a time (a cache miss costs more than an
add; the kernel's side of a system call is not counted), but it is the work the
process asks of the CPU, all of it, and it is what a change to the per-operation path
moves.

How: the counted process runs under ``valgrind --tool=callgrind --instr-atstart=no
--separate-threads=no`` (one set of counters for the whole process). It issues
callgrind's client requests itself (:class:`ClientRequests`: a few bytes of x86-64
machine code called through ctypes, no C extension): per operation kind a warm-up
runs uninstrumented, then instrumentation starts and ``CALLGRIND_DUMP_STATS_AT``
ends each phase — an empty one (what the phase boundary costs), then ``--repeats``
phases of ``--iters`` operations — writing every thread's counters and zeroing
them. The figure is the median phase, less the empty one, over ``--iters``; the
phases' range is reported beside it. Each operation is counted in a process of its
own (initiator and target alike), so a figure does not depend on which other
operations a run asks for. Start-up, imports, connecting and warm-up are
outside every phase. The type cache's misses (CPython's walk of a type's MRO when
its method cache misses, :data:`MRO_WALK`) are counted apart and left out of the
figure: which lookups collide in that cache depends on where the interpreter's
strings lie, so an unrelated import, or another uvloop release, moved a figure by
3 % while the code did the same work; the misses per operation are reported beside
it and capped. Each figure is split by the ELF object the instructions ran in
(``by_part``): the interpreter (libpython / the python binary), aiordma's native
engine (and ISA-L), CPython's extension modules (``_asyncio``, ``select``, ...),
uvloop, libc (and the loader), other.

Timers under valgrind's slowdown (about 50x here): the counted process keeps the
library's defaults but for what elapsed time would otherwise change: the RC ACK
timeout (``ack_timeout=24``, 69 s, on both ends: nothing is lost on loopback, and a
retransmission would be counted), the native engine's expect window
(``AIORDMA_SOFT_WINDOW_US`` x 50, so that it lapses no more often than at full
speed) and the Python engine's watchdog (x 50); the poll windows are off, because
they would count waiting, not work: the event loop's (``AIORDMA_SPIN_US=0``: the native
engine's default; the Python engine's 200 µs) and, in the counted process, the native
NIC thread's after it serves requests (``AIORDMA_SOFT_POLL_US=0``; the CPU time
figures below keep it), and in every child the event loop's poll of its
shared-memory link to the other process (``AIORDMA_SOFT_SHM_POLL_US=0``: a loop
that polls spins on the ring until the peer's reply comes, so it would count the
peer's speed; without it each packet costs the kick a sleeping peer gets). Both processes run with ``PYTHONHASHSEED=0``.
Retransmissions and timeouts are counted and fail ``--check``.

Beside the counts, unless ``--cpu-iters 0``: CPU time (process time, every thread)
and wall time per operation for the same operations at full speed, this process
against the same target (informative: noisy on a shared host).

    python benchmarks/instructions.py                        # every op on asyncio and uvloop, + the target
    python benchmarks/instructions.py --ops write64 --loop asyncio --target-ops ''
    python benchmarks/instructions.py --json instr.json      # machine-readable record
    python benchmarks/instructions.py --check                # against benchmarks/instructions_budget.json
    python benchmarks/instructions.py --record               # record this Python's and engine's figures
    python benchmarks/instructions.py --keep /tmp/cg         # keep the dumps: callgrind_annotate /tmp/cg/asyncio-write64/*.3
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import select
import shlex
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

#: not resolved: a counted process runs this file through a symbolic link of a fixed
#: length (CountedPaths), and the checkout's real path must not reach its sys.path
SCRIPT = Path(os.path.abspath(__file__))
HERE = SCRIPT.parent
ROOT = HERE.parent
# run from a checkout without an install; a counted process finds aiordma on its own
# PYTHONPATH (CountedPaths) and must see nothing more
if importlib.util.find_spec("aiordma") is None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OPS = ("write64", "read64", "send64", "write4k_d16")
#: the one-sided operations a target can be counted serving
TARGET_OPS = ("write64", "read64", "write4k_d16")
LOOPS = ("asyncio", "uvloop")
OP_TITLES = {
    "write64": "await conn.write(region[0:64], remote[0:64])",
    "read64": "await conn.read(remote[64:128], into=region[64:128])",
    "send64": "await conn.send(64 B); await conn.recv() (echo)",
    "write4k_d16": "4 KiB post_write, 16 outstanding (await oldest, post next)",
}
UNITS = {"write64": "write", "read64": "read", "send64": "round trip", "write4k_d16": "write"}
BUDGET_FILE = HERE / "instructions_budget.json"
#: RC local ACK timeout code on both ends: 4.096 µs x 2^24 = 69 s (aiordma's default 14: 67 ms)
ACK_TIMEOUT = 24
#: time-based windows of the counted process are stretched by about valgrind's slowdown
SLOWDOWN = 50
DEFAULT_WINDOW_US = 2000
DEPTH = 16
BIG = 4096
MEM = 64 * 1024
#: where an instruction ran, by the ELF object it is in
PARTS = ("interpreter", "aiordma native", "cpython modules", "uvloop", "libc", "other")
#: a child that says nothing for this long has failed (s)
CHILD_TIMEOUT = 180.0
#: the target's NIC finishes an operation's tail (its last ACK) within this (s, under valgrind)
SETTLE = 0.25


# -------------------------------------------------------- the operations ----


class Driver:
    """The operations on one connection to a target: the same code runs counted,
    timed, and against a counted target."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.remote = conn.remote("mem")
        self.local = conn.register(bytearray(MEM))
        self.inflight: deque[asyncio.Future[Any]] = deque()
        self.payload = bytes(range(64))

    def op(self, name: str) -> Callable[[int], Awaitable[None]]:
        """``run(n)``: ``n`` operations ``name`` (each awaited)."""
        conn, local, remote = self.conn, self.local, self.remote
        if name == "write64":
            write, src, dst = conn.write, local[0:64], remote[0:64]

            async def run(n: int) -> None:
                for _ in range(n):
                    await write(src, dst)

        elif name == "read64":
            read, src_r, into = conn.read, remote[64:128], local[64:128]

            async def run(n: int) -> None:
                for _ in range(n):
                    await read(src_r, into=into)

        elif name == "send64":
            send, recv, msg = conn.send, conn.recv, self.payload

            async def run(n: int) -> None:
                for _ in range(n):
                    await send(msg)
                    await recv()

        elif name == "write4k_d16":
            post = conn.post_write
            src4, dst4 = local[BIG : 2 * BIG], remote[BIG : 2 * BIG]
            inflight = self.inflight

            async def run(n: int) -> None:
                while len(inflight) < DEPTH:
                    inflight.append(await post(src4, dst4))
                for _ in range(n):
                    await inflight.popleft()
                    inflight.append(await post(src4, dst4))

        else:
            raise ValueError(f"unknown operation {name!r}")
        return run

    async def drain(self) -> None:
        """Await the writes still outstanding (``write4k_d16`` keeps 16)."""
        while self.inflight:
            await self.inflight.popleft()


def device_counts(device: Any) -> tuple[int, int]:
    """(packets sent, retransmissions + timeouts) of a soft device."""
    c = getattr(device, "counters", None) or {}
    sent = int(c.get("sent_pkts", c.get("tx_packets", 0)) or 0)
    return sent, int(c.get("retransmits", 0) or 0) + int(c.get("timeouts", 0) or 0)


def engine_of(device: Any) -> str:
    """``native`` or ``python`` for a soft device."""
    if getattr(device, "provider", "soft") != "soft":
        return str(device.provider)
    return str(getattr(device, "engine", "python"))


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def _stretch_watchdog(device: Any) -> None:
    """The Python engine's NIC thread takes over the socket when the loop has not
    serviced it for ``watchdog_interval`` (5 ms): under valgrind, x SLOWDOWN."""
    nic = getattr(device, "nic", None)
    if engine_of(device) == "python" and nic is not None and hasattr(nic, "watchdog_interval"):
        nic.watchdog_interval *= SLOWDOWN


# ------------------------------------------------- valgrind client requests ----


class ClientRequests:
    """Valgrind client requests from Python without a C extension.

    ``VALGRIND_DO_CLIENT_REQUEST`` compiles to a preamble that rotates ``%rdi`` by
    3, 13, 61 and 51 bits (128: no change) and ``xchg %rbx,%rbx``: valgrind sees
    the sequence, reads the request and its five arguments from the block ``%rax``
    points at, and puts the answer in ``%rdx`` (left as it was, the default, on a
    real CPU). Those 27 bytes of x86-64 code, as a function ``uint64_t f(uint64_t
    *block, uint64_t default)``, live in an executable page called through ctypes.
    """

    #: uint64_t request(uint64_t block[6], uint64_t default)
    CODE = bytes.fromhex(
        "4889f8"  # mov %rdi,%rax          the request block
        "4889f2"  # mov %rsi,%rdx          the default answer
        "48c1c703"  # rol $3,%rdi          the preamble ...
        "48c1c70d"  # rol $13,%rdi
        "48c1c73d"  # rol $61,%rdi
        "48c1c733"  # rol $51,%rdi
        "4887db"  # xchg %rbx,%rbx         ... and the request
        "4889d0"  # mov %rdx,%rax          the answer
        "c3"  # ret
    )
    RUNNING_ON_VALGRIND = 0x1001
    _CALLGRIND = (ord("C") << 24) | (ord("T") << 16)  # VG_USERREQ_TOOL_BASE('C','T')
    DUMP_STATS_AT = _CALLGRIND + 3
    START_INSTRUMENTATION = _CALLGRIND + 4
    STOP_INSTRUMENTATION = _CALLGRIND + 5

    def __init__(self) -> None:
        import ctypes
        import mmap

        if platform.machine().lower() not in ("x86_64", "amd64"):
            raise OSError(f"valgrind client requests from Python are written for x86-64, not {platform.machine()}")
        self._ctypes = ctypes
        self._page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        self._page.write(self.CODE)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(self._page))
        self._fn = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64)(addr)
        self._block = (ctypes.c_uint64 * 6)()
        self._block_addr = ctypes.addressof(self._block)
        self._labels: dict[str, Any] = {}

    def request(self, code: int, arg1: int = 0, default: int = 0) -> int:
        self._block[0], self._block[1] = code, arg1
        return int(self._fn(self._block_addr, default))

    def running_on_valgrind(self) -> int:
        return self.request(self.RUNNING_ON_VALGRIND)

    def label(self, text: str) -> int:
        """The address of a C string ``text`` (make them before the phases)."""
        buf = self._labels.get(text)
        if buf is None:
            buf = self._labels[text] = self._ctypes.create_string_buffer(text.encode())
        return int(self._ctypes.addressof(buf))

    def dump(self, label: int) -> None:
        """``CALLGRIND_DUMP_STATS_AT(label)``: write the counters since the last dump
        (every thread: ``--separate-threads=no``) to the next file, and zero them."""
        self.request(self.DUMP_STATS_AT, label)

    def start_instrumentation(self) -> None:
        self.request(self.START_INSTRUMENTATION)

    def stop_instrumentation(self) -> None:
        self.request(self.STOP_INSTRUMENTATION)


def _valgrind_requests() -> ClientRequests:
    try:
        cr = ClientRequests()
    except OSError as e:  # another architecture, or no executable memory (SELinux execmem)
        raise SystemExit(f"instructions.py: cannot issue valgrind client requests: {e}") from None
    if not cr.running_on_valgrind():
        raise SystemExit("instructions.py: this process must run under valgrind --tool=callgrind")
    return cr


# ------------------------------------------------------------ the target ----


def _target_child(loop: str, counted: bool) -> int:
    """The target: exposes 64 KiB read-write as ``mem`` and echoes messages; announces
    ``{"port", "engine"}`` on stdout and answers one JSON line per command on stdin:
    ``counters``; under callgrind (``counted``) ``prepare LABEL...`` (the dumps'
    labels, made before the phases), ``start``, ``stop``, ``dump LABEL``; ``quit``."""
    import aiordma

    cr = _valgrind_requests() if counted else None

    async def main() -> None:
        ev_loop = asyncio.get_running_loop()
        device = aiordma.get_device("soft")
        if counted:
            _stretch_watchdog(device)
        region = aiordma.register(bytearray(MEM), device=device)

        async def echo(conn: aiordma.Connection) -> None:
            try:
                async for message in conn:
                    await conn.send(message)
            except aiordma.RDMAError:
                pass

        server = await aiordma.start_server(
            echo,
            "127.0.0.1",
            0,
            device=device,
            expose={"mem": region.exposed("rw")},
            ack_timeout=ACK_TIMEOUT,
            handshake_timeout=CHILD_TIMEOUT,
        )
        quit_ = asyncio.Event()
        readline, write = sys.stdin.buffer.readline, sys.stdout.buffer.write
        ok = b'{"ok": true}\n'

        def control() -> None:  # binary pipes, replies made before a dump: a constant per phase
            while True:
                cmd = readline().strip()
                if cmd.startswith(b"prepare ") and cr is not None:
                    for text in cmd[8:].decode().split():  # (ctypes makes a type per new string length)
                        cr.label(text)
                    reply = ok
                elif cmd.startswith(b"dump ") and cr is not None:
                    cr.dump(cr.label(cmd[5:].decode()))
                    reply = ok
                elif cmd == b"start" and cr is not None:
                    cr.start_instrumentation()
                    reply = ok
                elif cmd == b"stop" and cr is not None:
                    cr.stop_instrumentation()
                    reply = ok
                elif cmd == b"counters":
                    sent, recovered = device_counts(device)
                    reply = json.dumps({"sent": sent, "recoveries": recovered}).encode() + b"\n"
                elif cmd in (b"quit", b""):
                    break
                else:
                    reply = json.dumps({"error": f"unknown command {cmd!r}"}).encode() + b"\n"
                write(reply)
                sys.stdout.buffer.flush()
            ev_loop.call_soon_threadsafe(quit_.set)

        write(json.dumps({"port": server.port, "engine": engine_of(device)}).encode() + b"\n")
        sys.stdout.buffer.flush()
        threading.Thread(target=control, name="instructions-control", daemon=True).start()
        await quit_.wait()
        server.close()
        await server.wait_closed()
        region.close()

    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        runner.run(main())
    return 0


class Target:
    """The target process, controlled by JSON lines (:func:`_target_child`)."""

    def __init__(
        self, loop: str, env: dict[str, str], prefix: list[str] | None = None, paths: CountedPaths | None = None
    ) -> None:
        interpreter = paths.argv if paths is not None else [sys.executable, str(SCRIPT)]
        self.argv = [*(prefix or []), *interpreter, "--target-child", "--loop", loop]
        if prefix:
            self.argv.append("--counted")
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
            cwd=paths.dir if paths is not None else None,
        )
        self.info = self._read("the target process did not start")

    def _read(self, what: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], CHILD_TIMEOUT)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            _, err = self.proc.communicate()
            raise SystemExit(f"instructions.py: {what} (exit status {self.proc.returncode}):\n{err[-3000:]}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise SystemExit(f"instructions.py: the target process: {reply['error']}")
        return reply

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read(f"the target process did not answer {command!r}")

    def close(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.proc.communicate()


# --------------------------------------------------------- the initiator ----


async def _connect(port: int, device: Any) -> Any:
    import aiordma

    return await aiordma.connect("127.0.0.1", port, device=device, ack_timeout=ACK_TIMEOUT, timeout=CHILD_TIMEOUT)


def phase_labels(op: str, repeats: int) -> list[str]:
    """The dumps of one operation kind, in order: what ran before it, the empty
    phase, then the counted ones."""
    return [f"{op}:before", f"{op}:empty", *(f"{op}:{k}" for k in range(1, repeats + 1))]


def _initiator_child(args: argparse.Namespace) -> int:
    """The counted initiator (under callgrind): the phases of every operation kind,
    then a JSON record of the device's counters per kind to ``--out``."""
    import aiordma

    cr = _valgrind_requests()

    async def main() -> dict[str, Any]:
        device = aiordma.get_device("soft")
        _stretch_watchdog(device)
        conn = await _connect(args.port, device)
        driver = Driver(conn)
        ops: dict[str, Any] = {}
        try:
            for name in args.ops.split(","):
                run = driver.op(name)
                labels = [cr.label(text) for text in phase_labels(name, args.repeats)]
                await run(args.warmup)
                gc.collect()
                before = device_counts(device)
                cr.start_instrumentation()
                cr.dump(labels[0])
                cr.dump(labels[1])  # the empty phase
                for k in range(args.repeats):
                    await run(args.iters)
                    cr.dump(labels[2 + k])
                cr.stop_instrumentation()
                after = device_counts(device)
                ops[name] = {"packets": after[0] - before[0], "recoveries": after[1] - before[1]}
            await driver.drain()
        finally:
            await conn.close()
        return {"engine": engine_of(device), "ops": ops}

    with asyncio.Runner(loop_factory=loop_factory(args.loop)) as runner:
        info = runner.run(main())
    Path(args.out).write_text(json.dumps(info))
    return 0


# ------------------------------------------------------ callgrind output ----


def part_of(obj: str, exe: str) -> str:
    """Which of :data:`PARTS` the ELF object ``obj`` (a path) is."""
    name = os.path.basename(obj)
    if name.startswith("libpython") or obj == exe or re.fullmatch(r"python3(\.\d+)?", name):
        return "interpreter"
    if "/aiordma/" in obj or name.startswith("libisal"):
        return "aiordma native"
    if "/lib-dynload/" in obj:
        return "cpython modules"
    if "/uvloop/" in obj:
        return "uvloop"
    if re.match(r"(libc|ld-linux|libm|libpthread|libdl|librt)[.-]", name):
        return "libc"
    return "other"


#: CPython's walk of a type's MRO when its type cache (method cache) misses: the
#: cache is indexed by the attribute name's address and the type's version tag, so
#: an import anywhere, or another release of uvloop, can make two hot lookups evict
#: each other (about 250 instructions a miss; uvloop 0.23.0 made two a Write on
#: 3.11). Counted apart, so a figure moves with the code's work, not with where the
#: interpreter's strings happen to lie; the misses themselves are reported and capped.
MRO_WALK = "find_name_in_mro"
#: misses per operation that --check allows: a type modified on every operation (its
#: version tag invalidated) would miss on every lookup, tens per operation
MAX_TYPE_CACHE_MISSES_PER_OP = 8


def parse_dump(path: Path, exe: str) -> dict[str, Any]:
    """One callgrind dump written with ``--compress-strings=no --compress-pos=no``:
    its trigger (the label), total Ir, and the Ir executed in each object (exclusive:
    a call's inclusive cost line is skipped; it is counted where it ran); and the
    type cache's misses: the calls of :data:`MRO_WALK` and their inclusive Ir."""
    trigger = ""
    summary: int | None = None
    npos = 1
    by_obj: dict[str, int] = {}
    obj = "???"
    skip = False
    callee = ""
    mro_walk = False
    mro_calls = mro_ir = 0
    with path.open() as f:
        for line in f:
            c = line[:1]
            if c.isdigit() or c in "+-*":
                if skip:
                    skip = False
                    if mro_walk:
                        fields = line.split()
                        mro_ir += int(fields[npos]) if len(fields) > npos else 0
                    continue
                fields = line.split()
                if len(fields) > npos:
                    by_obj[obj] = by_obj.get(obj, 0) + int(fields[npos])
                continue
            skip = False
            if line.startswith("ob="):
                obj = line[3:].strip()
            elif line.startswith("cfn="):
                callee = line[4:].strip()
            elif line.startswith("calls="):
                skip = True
                # (a function in a recursion cycle is named NAME'N)
                mro_walk = callee.split("'", 1)[0] == MRO_WALK
                if mro_walk:
                    mro_calls += int(line[6:].split()[0])
            elif line.startswith("summary:"):
                summary = int(line.split()[1])
            elif line.startswith("desc: Trigger:"):
                trigger = line.split(":", 2)[2].strip().removeprefix("Client Request: ")
            elif line.startswith("positions:"):
                npos = len(line.split()) - 1
    if summary is None:
        raise ValueError(f"{path}: no summary line (not a callgrind dump?)")
    parts = dict.fromkeys(PARTS, 0)
    for o, ir in by_obj.items():
        parts[part_of(o, exe)] += ir
    return {
        "label": trigger,
        "ir": summary,
        "by_object": by_obj,
        "parts": parts,
        "type_cache_misses": mro_calls,
        "type_cache_miss_ir": mro_ir,
    }


def read_dumps(out_dir: Path) -> dict[str, dict[str, Any]]:
    """The labelled dumps under ``out_dir``, by label."""
    exe = os.path.realpath(sys.executable)
    dumps = [parse_dump(p, exe) for p in sorted(out_dir.glob("callgrind.out.*"))]
    return {d["label"]: d for d in dumps}


def figures_of(dumps: dict[str, dict[str, Any]], op: str, iters: int, repeats: int) -> dict[str, Any]:
    """Instructions per op of one operation kind: the median phase less the empty one."""
    labels = phase_labels(op, repeats)
    missing = [x for x in labels[1:] if x not in dumps]
    if missing:
        raise SystemExit(f"instructions.py: no callgrind dump labelled {missing} (found {sorted(dumps)})")
    empty = dumps[labels[1]]
    phases = [dumps[x] for x in labels[2:]]

    def work(d: dict[str, Any]) -> int:  # (less the type cache's misses: see MRO_WALK)
        return int(d["ir"]) - int(d.get("type_cache_miss_ir", 0))

    per_op = [(work(d) - work(empty)) / iters for d in phases]
    med = statistics.median(per_op)
    mid = sorted(phases, key=work)[(len(phases) - 1) // 2]
    by_part = {k: round((mid["parts"][k] - empty["parts"][k]) / iters) for k in PARTS}
    miss_ir = (mid.get("type_cache_miss_ir", 0) - empty.get("type_cache_miss_ir", 0)) / iters
    by_part["interpreter"] -= round(miss_ir)  # (the misses ran in libpython)
    return {
        "instructions_per_op": round(med),
        "phases_per_op": [round(x) for x in per_op],
        "spread": round((max(per_op) - min(per_op)) / med, 5) if med else 0.0,
        "boundary_instructions": empty["ir"],
        "by_part": by_part,
        "type_cache_misses_per_op": round(
            (mid.get("type_cache_misses", 0) - empty.get("type_cache_misses", 0)) / iters, 2
        ),
        "type_cache_miss_instructions_per_op": round(miss_ir),
    }


def valgrind_version() -> str | None:
    exe = shutil.which("valgrind")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.removeprefix("valgrind-") or None


def valgrind_argv(out_dir: Path | str) -> list[str]:
    return [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--separate-threads=no",
        "--dump-line=no",
        "--compress-strings=no",
        "--compress-pos=no",
        "--vgdb=no",
        f"--callgrind-out-file={out_dir}/callgrind.out.%p",
    ]


# ------------------------------------------------------------ the harness ----


def child_env(args: argparse.Namespace, *, counted: bool) -> dict[str, str]:
    """The environment of a child: the settings this benchmark fixes (see --help).

    A counted child gets only these and the AIORDMA_* settings of this process, not the
    rest of the caller's environment: the environment's size moves where the process's
    memory lies, and with it how objects hash in sets and dicts keyed by identity, which
    moved a figure by up to 2 % between a shell and a test runner."""
    if counted:
        env = {k: v for k, v in os.environ.items() if k.startswith("AIORDMA_") or k in ("PATH", "PYTHONPATH")}
        env["PATH"] = env.get("PATH", "/usr/bin:/bin")
    else:
        env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONHASHSEED"] = "0"
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["AIORDMA_SPIN_US"] = "0"
    if args.engine:
        env["AIORDMA_SOFT_ENGINE"] = args.engine
    if counted and not os.environ.get("AIORDMA_SOFT_WINDOW_US"):
        env["AIORDMA_SOFT_WINDOW_US"] = str(DEFAULT_WINDOW_US * SLOWDOWN)
    if counted:
        env["AIORDMA_SOFT_POLL_US"] = "0"
    env["AIORDMA_SOFT_SHM_POLL_US"] = "0"  # (see the module's docstring)
    return env


def _apply_env(args: argparse.Namespace) -> None:
    """This process drives the timed run and the counted target: the same settings."""
    os.environ["AIORDMA_SPIN_US"] = "0"
    if args.engine:
        os.environ["AIORDMA_SOFT_ENGINE"] = args.engine


async def _timed(args: argparse.Namespace, port: int, ops: list[str]) -> dict[str, dict[str, Any]]:
    """CPU (process time, every thread) and wall time per op, at full speed."""
    import aiordma

    device = aiordma.open_device("soft")
    out: dict[str, dict[str, Any]] = {}
    try:
        conn = await _connect(port, device)
        driver = Driver(conn)
        try:
            for name in ops:
                run = driver.op(name)
                await run(max(args.warmup, args.cpu_iters // 5))
                c0, w0 = time.process_time(), time.perf_counter()
                await run(args.cpu_iters)
                c1, w1 = time.process_time(), time.perf_counter()
                n = args.cpu_iters
                out[name] = {
                    "cpu_us_per_op": round((c1 - c0) / n * 1e6, 1),
                    "wall_us_per_op": round((w1 - w0) / n * 1e6, 1),
                    "cpu_iters": n,
                }
            await driver.drain()
        finally:
            await conn.close()
    finally:
        device.close()
    return out


#: where a counted process's paths lie: always this directory, whatever the checkout's
#: and the venv's paths and $TMPDIR (see CountedPaths)
COUNTED_TMP_BASE = "/tmp"


#: the packages a counted process imports from the venv's site-packages (the rest of it
#: stays out of sight: see CountedPaths); one missing fails the import at once
COUNTED_PACKAGES = ("isal", "msgpack", "uvloop")


class CountedPaths:
    """The paths a counted process sees, the same length in every run.

    A counted figure moves with the lengths of the strings the interpreter makes
    before the counted phases (the checkout's path, the venv's, the port, the
    environment): they shift where its objects lie, and with that how sets and
    dicts keyed by identity fill; 3.12's awaited write counted 2.5 % apart in a
    clean clone and in the working tree. So the process is started through two
    symbolic links in a fresh directory of a fixed name length (``v``: the venv,
    ``s``: the checkout), with a fixed environment, a 5-digit port and its cwd
    there.

    The interpreter starts with ``-S`` (no ``site``): an editable install's ``.pth``
    file and its import finder name the checkout by its real path, which moved an
    awaited write by 4 % between ``/work/main`` and a clone at ``/check/work/main``.
    Nor does it see the venv's site-packages or the checkout's top directory, whose
    listings (the import system keeps each as a set of names) differ between a
    developer's tree and CI's (``-P``: not the script's directory either): a directory
    ``p`` holds links to ``aiordma`` and to the only packages a counted process
    imports from site-packages (:data:`COUNTED_PACKAGES`), and ``PYTHONPATH`` is
    ``p``. aiordma's modules are byte-compiled first, so no counted process compiles
    one where another read it from its cache.

    What remains moves a figure with the memory layout: CPython's type attribute
    cache is indexed by the attribute name's address, so shifting the heap by a few
    bytes can turn hits into misses; the environment's size alone moved 3.13's
    awaited write by 4.5 %. Hence a fixed environment and fixed lengths."""

    def __init__(self, tmp: str) -> None:
        self.dir = Path(tmp)
        prefix = Path(sys.prefix)
        (self.dir / "v").symlink_to(prefix, target_is_directory=True)
        checkout = SCRIPT.parent.parent
        (self.dir / "s").symlink_to(checkout, target_is_directory=True)
        exe = Path(sys.executable)
        try:
            self.python = str(self.dir / "v" / exe.relative_to(prefix))
        except ValueError:  # an interpreter outside its prefix: as it is
            self.python = str(exe)
        self.script = str(self.dir / "s" / SCRIPT.relative_to(checkout))
        self.packages = str(self.dir / "p")
        os.mkdir(self.packages)
        (self.dir / "p" / "aiordma").symlink_to(checkout / "aiordma", target_is_directory=True)
        for name in COUNTED_PACKAGES:
            spec = importlib.util.find_spec(name)
            if spec is None or not spec.submodule_search_locations:
                raise SystemExit(f"instructions.py: {name} is not installed in this venv (pip install -e '.[test]')")
            (self.dir / "p" / name).symlink_to(next(iter(spec.submodule_search_locations)), target_is_directory=True)

    @property
    def argv(self) -> list[str]:
        """The interpreter and the script, ``site`` skipped (see the class)."""
        return [self.python, "-S", "-P", self.script]

    def env(self, env: dict[str, str]) -> dict[str, str]:
        env = dict(env)
        env["PATH"] = "/usr/bin:/bin"
        env["PYTHONPATH"] = self.packages
        return env


def counted_tmp() -> tempfile.TemporaryDirectory[str]:
    """A fresh directory for one counted process (its name's length is fixed: see CountedPaths)."""
    _byte_compile_once()
    return tempfile.TemporaryDirectory(prefix="aiordma-instructions-", dir=COUNTED_TMP_BASE)


_compiled = False


def _byte_compile_once() -> None:
    """aiordma's byte code cached for this interpreter before anything is counted."""
    global _compiled
    if not _compiled:
        import compileall

        compileall.compile_dir(str(ROOT / "aiordma"), quiet=2)
        _compiled = True


def _out_dir(args: argparse.Namespace, tmp: str, name: str) -> Path:
    if not args.keep:
        return Path(tmp)
    out = Path(args.keep) / name
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("callgrind.out.*"):
        old.unlink()
    return out


def _count_one(
    args: argparse.Namespace, loop: str, op: str, port: int, tmp: str
) -> tuple[dict[str, Any], Any, list[str]]:
    """One counted initiator process that runs ``op`` alone: (its record, its dumps,
    its arguments)."""
    out_dir = _out_dir(args, tmp, f"{loop}-{op}")
    child = ["--initiator-child", "--loop", loop, "--ops", op]
    child += ["--iters", str(args.iters), "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
    paths = CountedPaths(tmp)
    record = paths.dir / "initiator.json"
    argv = [*valgrind_argv(out_dir), *paths.argv, *child]
    argv += ["--port", f"{port:05d}", "--out", str(record)]
    try:
        proc = subprocess.run(
            argv,
            env=paths.env(child_env(args, counted=True)),
            cwd=paths.dir,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
    except subprocess.TimeoutExpired:
        raise SystemExit(f"instructions.py: the counted initiator ran past --timeout {args.timeout:g} s") from None
    if proc.returncode != 0 or not record.exists():
        raise SystemExit(
            f"instructions.py: the counted initiator failed (exit status {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return json.loads(record.read_text()), read_dumps(out_dir), child


def count_initiator(args: argparse.Namespace, loop: str, ops: list[str]) -> tuple[list[dict[str, Any]], str]:
    """The target at full speed, the initiator counted, on ``loop``: one record per op.

    Each operation is counted in a process of its own that runs nothing else: what
    ran before it in the same process (another operation's objects, the garbage
    collector's count) would otherwise move its figure, so a subset of the
    operations (the test's) would not count what the full recording counted."""
    target = Target(loop, child_env(args, counted=False))
    records = []
    try:
        timed: dict[str, dict[str, Any]] = {}
        if args.cpu_iters:
            with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
                timed = runner.run(_timed(args, target.info["port"], ops))
        child: list[str] = []
        for name in ops:
            with counted_tmp() as tmp:
                info, dumps, child = _count_one(args, loop, name, target.info["port"], tmp)
            o = info["ops"][name]
            records.append(
                {
                    "name": f"{loop}.{name}",
                    "side": "initiator",
                    "op": name,
                    "loop": loop,
                    "what": OP_TITLES[name],
                    "unit": UNITS[name],
                    "engine": info["engine"],
                    **figures_of(dumps, name, args.iters, args.repeats),
                    "packets_per_op": round(o["packets"] / (args.iters * args.repeats), 3),
                    "recoveries": o["recoveries"],
                    **timed.get(name, {"cpu_us_per_op": None, "wall_us_per_op": None, "cpu_iters": 0}),
                }
            )
        target_recoveries = int(target.ask("counters")["recoveries"])
    finally:
        target.close()
    for r in records:
        r["peer_recoveries"] = target_recoveries
    child[child.index("--ops") + 1] = "OP"
    command = [*valgrind_argv("DIR"), "python", "benchmarks/instructions.py", *child, "--port", "PORT", "--out", "PATH"]
    return records, shlex.join(command) + "  (one process per OP)"


async def _drive_counted_target(args: argparse.Namespace, target: Target, ops: list[str]) -> dict[str, Any]:
    import aiordma

    device = aiordma.open_device("soft")
    out: dict[str, Any] = {}
    try:
        conn = await _connect(target.info["port"], device)
        driver = Driver(conn)
        try:
            for name in ops:
                run = driver.op(name)
                labels = phase_labels(name, args.repeats)
                await run(args.warmup)
                await asyncio.sleep(SETTLE)
                before = device_counts(device)
                target.ask("prepare " + " ".join(labels))
                target.ask("start")
                await asyncio.sleep(SETTLE)
                target.ask(f"dump {labels[0]}")
                await asyncio.sleep(SETTLE)
                target.ask(f"dump {labels[1]}")
                for k in range(args.repeats):
                    await run(args.iters)
                    await asyncio.sleep(SETTLE)  # the target's tail: its last ACK
                    target.ask(f"dump {labels[2 + k]}")
                target.ask("stop")
                after = device_counts(device)
                out[name] = {"packets": after[0] - before[0], "recoveries": after[1] - before[1]}
            await driver.drain()
        finally:
            await conn.close()
    finally:
        device.close()
    return out


def count_target(args: argparse.Namespace, ops: list[str]) -> tuple[list[dict[str, Any]], str]:
    """The target counted (every thread) while this process drives it at full speed
    on asyncio: instructions per one-sided op served, each op by a target process of
    its own (as :func:`count_initiator`)."""
    records = []
    for name in ops:
        with counted_tmp() as tmp:
            out_dir = _out_dir(args, tmp, f"target-{name}")
            paths = CountedPaths(tmp)
            target = Target(
                "asyncio", paths.env(child_env(args, counted=True)), prefix=valgrind_argv(out_dir), paths=paths
            )
            try:
                with asyncio.Runner() as runner:
                    info = runner.run(_drive_counted_target(args, target, [name]))
                recoveries = int(target.ask("counters")["recoveries"])
            finally:
                target.close(timeout=args.timeout)
            dumps = read_dumps(out_dir)
        records.append(
            {
                "name": f"target.{name}",
                "side": "target",
                "op": name,
                "loop": "asyncio",
                "what": f"served: the peer's {OP_TITLES[name]}",
                "unit": "one-sided op served",
                "engine": target.info["engine"],
                **figures_of(dumps, name, args.iters, args.repeats),
                "packets_per_op": round(info[name]["packets"] / (args.iters * args.repeats), 3),
                "recoveries": recoveries,
                "peer_recoveries": info[name]["recoveries"],
                "cpu_us_per_op": None,
                "wall_us_per_op": None,
                "cpu_iters": 0,
            }
        )
    command = [*valgrind_argv("DIR"), "python", "benchmarks/instructions.py", "--target-child", "--loop", "asyncio"]
    return records, shlex.join(command + ["--counted"]) + "  (one process per op)"


# ---------------------------------------------------------------- output ----


def git_commit() -> tuple[str | None, bool | None]:
    """(HEAD, whether ``aiordma/`` has uncommitted changes)."""
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


def machine() -> dict[str, str]:
    """What the counts depend on besides the code: the interpreter's build (version,
    compiler, optimisation: not its date or prefix), the C library, valgrind, and
    whether the CPU has AVX2 (valgrind passes it through: it picks libc's memcpy
    and ISA-L's CRC), and uvloop's version (its release moves where CPython's type
    cache collides: uvloop 0.23.0 added two type-cache misses to each awaited Write
    and Read on 3.11, +2.8 %, with the same lookups as 0.22.1); the CPU's name is
    for the reader and is not compared."""
    cpu, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line
    except OSError:
        pass
    config = str(sysconfig.get_config_var("CONFIG_ARGS") or "")
    build = [platform.python_version(), platform.python_implementation(), platform.python_compiler()]
    build.append(str(sysconfig.get_config_var("OPT") or "").strip())
    build += [opt for opt in ("--enable-optimizations", "--with-lto", "--enable-shared") if opt in config]
    return {
        "python_build": " ".join(x for x in build if x),
        "libc": " ".join(platform.libc_ver()),
        "valgrind": valgrind_version() or "",
        "cpu_avx2": "yes" if " avx2" in flags else "no",
        "uvloop": _uvloop_version(),
        "cpu": cpu,
    }


def _uvloop_version() -> str:
    try:
        return importlib.metadata.version("uvloop")
    except importlib.metadata.PackageNotFoundError:
        return ""


def budget_key() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


RULE = "-" * 118


def print_table(doc: dict[str, Any]) -> None:
    commit = doc["aiordma_commit"]
    tree = "unknown" if commit is None else commit[:12] + (" + local changes" if doc["aiordma_dirty"] else "")
    print(RULE)
    print(" Instructions per operation, counted by callgrind: the whole process, every thread")
    print(f" Python          : {doc['implementation']} {doc['python']}; soft device, {doc['engine']} engine")
    print(f" valgrind        : {doc['valgrind']}; aiordma {tree}")
    print(
        f" Phases          : median of {doc['repeats']} x {doc['iters']} ops after {doc['warmup']} warm-up, "
        "less the empty phase; CPU/wall: full speed, this process (noisy)"
    )
    print(RULE)
    head = f" {'operation':<13} {'loop':<8} {'instr/op':>9} {'phases':>17}  "
    head += " ".join(f"{p.split()[-1][:7]:>7}" for p in PARTS)
    print(head + f" {'tc miss':>7} {'pkts/op':>7} {'CPU µs':>7} {'wall µs':>7}")
    for side in ("initiator", "target"):
        recs = [r for r in doc["results"] if r["side"] == side]
        if not recs:
            continue
        if side == "target":
            print(" the target process, per one-sided operation it serves (driven at full speed from asyncio):")
        for r in recs:
            lo, hi = min(r["phases_per_op"]), max(r["phases_per_op"])
            cpu = "-" if r["cpu_us_per_op"] is None else f"{r['cpu_us_per_op']:.1f}"
            wall = "-" if r["wall_us_per_op"] is None else f"{r['wall_us_per_op']:.1f}"
            line = f" {r['op']:<13} {r['loop']:<8} {r['instructions_per_op']:>9,} {f'{lo:,}-{hi:,}':>17}  "
            line += " ".join(f"{r['by_part'][p]:>7,}" for p in PARTS)
            misses = r.get("type_cache_misses_per_op", 0.0)
            print(line + f" {misses:>7.2f} {r['packets_per_op']:>7.3f} {cpu:>7} {wall:>7}")
    print(RULE)
    print(" columns by part: interpreter (libpython), native (aiordma's engine, ISA-L), modules (CPython's")
    print(" extension modules), uvloop, libc (and the loader), other; of the median phase, less the empty one;")
    print(" instr/op and interpr leave out the type cache's misses (tc miss: MRO walks per op, ~250 instr each)")
    for r in doc["results"]:
        if r["recoveries"] or r["peer_recoveries"]:
            print(
                f" WARNING: {r['name']}: {r['recoveries']} retransmissions/timeouts here, "
                f"{r['peer_recoveries']} at the peer: the counts include them"
            )
    print(f" command: {doc['command']}")
    print(RULE)


# ---------------------------------------------------------------- budgets ----


def _timing_dependent(name: str, doc: dict[str, Any]) -> bool:
    """Figures that the peer's timing moves: a round trip (the ACK and the reply
    arrive together or apart), writes 16 deep (how many completions one wake-up
    finds, how many writes one ACK covers)."""
    return name.split(".", 1)[1] in doc.get("timing_ops", [])


def check_budgets(doc: dict[str, Any], path: Path = BUDGET_FILE) -> tuple[list[str], list[str]]:
    """(failures, notes) of the results in ``doc`` against the budget file."""
    budget_doc = json.loads(path.read_text())
    margins = budget_doc["margins"]
    failures: list[str] = []
    notes: list[str] = []
    entry = budget_doc["budgets"].get(budget_key(), {}).get(doc["engine"])
    if entry is None:
        return [
            f"no budget recorded for Python {budget_key()} and the {doc['engine']} engine in {path.name}: "
            "run `python benchmarks/instructions.py --record` and commit the file"
        ], notes
    here = machine()
    widen = 0.0
    differs = [k for k, v in entry.get("machine", {}).items() if k != "cpu" and v != here.get(k)]
    if differs:
        widen = margins["other_machine"]
        what = ", ".join(f"{k} {entry['machine'][k]!r}, here {here.get(k)!r}" for k in differs)
        notes.append(f"recorded on another build ({what}): budgets widened to recorded + {widen:.0%}")
    for r in doc["results"]:
        if r["recoveries"] or r["peer_recoveries"]:
            failures.append(
                f"{r['name']}: retransmissions or timeouts during the counted phases: the count is not clean"
            )
        b = entry["figures"].get(r["name"])
        if b is None:
            failures.append(
                f"{r['name']}: no budget recorded for Python {budget_key()} and the {doc['engine']} engine "
                f"in {path.name}: run `python benchmarks/instructions.py --record`"
            )
            continue
        budget = b["budget"] if not widen else round(b["recorded"] * (1 + widen))
        if r["instructions_per_op"] < b["recorded"] * (1 - margins["timing"]):
            notes.append(
                f"{r['name']}: {r['instructions_per_op']:,} is well below the recorded {b['recorded']:,}: "
                "record again (--record) to hold the gain"
            )
        misses = r.get("type_cache_misses_per_op", 0.0)
        if misses > MAX_TYPE_CACHE_MISSES_PER_OP:
            failures.append(
                f"{r['name']}: {misses:g} type-cache misses per {r['unit']} (MRO walks, at most "
                f"{MAX_TYPE_CACHE_MISSES_PER_OP}): is a type modified on every operation?"
            )
        if r["instructions_per_op"] > budget:
            failures.append(
                f"{r['name']}: {r['instructions_per_op']:,} instructions per {r['unit']} > budget {budget:,} "
                f"(recorded {b['recorded']:,}, Python {budget_key()}, {doc['engine']} engine); by part: {r['by_part']}"
            )
    return failures, notes


def record_budgets(doc: dict[str, Any], path: Path = BUDGET_FILE) -> None:
    """Write the results of ``doc`` as this Python's and engine's recorded figures."""
    budget_doc = json.loads(path.read_text())
    margins = budget_doc["margins"]
    entry = budget_doc["budgets"].setdefault(budget_key(), {}).setdefault(doc["engine"], {})
    figures = entry.setdefault("figures", {})
    for r in doc["results"]:
        margin = margins["timing" if _timing_dependent(r["name"], budget_doc) else "deterministic"]
        figures[r["name"]] = {
            "recorded": r["instructions_per_op"],
            "budget": round(r["instructions_per_op"] * (1 + margin)),
        }
    entry["figures"] = dict(sorted(figures.items()))
    entry["machine"] = machine()
    entry["python"] = platform.python_version()
    entry["commit"] = doc["aiordma_commit"]
    entry["settings"] = {"iters": doc["iters"], "repeats": doc["repeats"], "warmup": doc["warmup"]}
    budget_doc["budgets"][budget_key()] = dict(sorted(budget_doc["budgets"][budget_key()].items()))
    budget_doc["budgets"] = dict(sorted(budget_doc["budgets"].items()))
    path.write_text(json.dumps(budget_doc, indent=2) + "\n")


# ---------------------------------------------------------------- main -----


def _list(value: str, allowed: Iterable[str], what: str, ap: argparse.ArgumentParser) -> list[str]:
    items = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad:
        ap.error(f"{what}: unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
    return items


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)} (default: all)")
    ap.add_argument("--loop", default="asyncio,uvloop", help="asyncio, uvloop or both (default: asyncio,uvloop)")
    ap.add_argument(
        "--target-ops",
        default=",".join(TARGET_OPS),
        help=f"one-sided ops to count in the target, of {', '.join(TARGET_OPS)} ('' for none; default: all)",
    )
    ap.add_argument("--iters", type=int, default=100, help="operations per counted phase (default 100)")
    ap.add_argument("--repeats", type=int, default=5, help="counted phases per operation (default 5)")
    ap.add_argument("--warmup", type=int, default=100, help="uncounted operations first (default 100)")
    ap.add_argument(
        "--cpu-iters", type=int, default=2000, help="operations timed at full speed (default 2000; 0: none)"
    )
    ap.add_argument(
        "--engine", choices=("native", "python"), default=None, help="soft-device engine (default: the library's)"
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a counted process may run (default 900)")
    ap.add_argument("--keep", metavar="DIR", help="keep the callgrind dumps in DIR/LOOP-OP and DIR/target")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    ap.add_argument("--check", action="store_true", help=f"fail (exit 1) above the budgets of {BUDGET_FILE.name}")
    ap.add_argument("--record", action="store_true", help=f"record the figures in {BUDGET_FILE.name}")
    ap.add_argument("--target-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--initiator-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--counted", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.target_child:
        return _target_child(args.loop, args.counted)
    if args.initiator_child:
        return _initiator_child(args)
    if args.iters < 1 or args.repeats < 1 or args.warmup < 0 or args.cpu_iters < 0:
        ap.error("--iters and --repeats must be positive, --warmup and --cpu-iters not negative")
    ops = _list(args.ops, OPS, "--ops", ap)
    loops = _list(args.loop.replace("both", "asyncio,uvloop"), LOOPS, "--loop", ap)
    target_ops = _list(args.target_ops, TARGET_OPS, "--target-ops", ap)
    if not (ops and loops) and not target_ops:
        ap.error("nothing to count: give --ops and --loop, or --target-ops")
    version = valgrind_version()
    if version is None:
        print("instructions.py: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 3
    _apply_env(args)
    t0 = time.monotonic()
    results: list[dict[str, Any]] = []
    commands: list[str] = []
    if ops:
        for loop in loops:
            recs, command = count_initiator(args, loop, ops)
            results += recs
            commands.append(command)
    if target_ops:
        recs, command = count_target(args, target_ops)
        results += recs
        commands.append(command)
    commit, dirty = git_commit()
    engines = {r["engine"] for r in results}
    doc: dict[str, Any] = {
        "benchmark": "aiordma-instructions",
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "engine": engines.pop() if len(engines) == 1 else ",".join(sorted(engines)),
        "valgrind": version,
        "machine": machine(),
        "aiordma_commit": commit,
        "aiordma_dirty": dirty,
        "iters": args.iters,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "slowdown_scale": SLOWDOWN,
        "env": {k: v for k, v in sorted(child_env(args, counted=True).items()) if k.startswith("AIORDMA_")},
        "reproduce": shlex.join(["python", "benchmarks/instructions.py", *(sys.argv[1:] if argv is None else argv)]),
        "command": " ; ".join(commands),
        "seconds": round(time.monotonic() - t0, 1),
        "results": results,
    }
    print_table(doc)
    print(f" {len(results)} figures in {doc['seconds']:.0f} s; reproduce: {doc['reproduce']}")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    if args.record:
        record_budgets(doc)
        print(f" recorded as the figures of Python {budget_key()}, {doc['engine']} engine, in {BUDGET_FILE}")
    if args.check:
        failures, notes = check_budgets(doc)
        for n in notes:
            print(f" NOTE: {n}")
        for f in failures:
            print(f" OVER BUDGET: {f}", file=sys.stderr)
        if failures:
            return 1
        print(f" within the budgets of {BUDGET_FILE.name} (Python {budget_key()}, {doc['engine']} engine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
