#!/usr/bin/env python3
"""Per-message cost of aiordma on the soft device, counted in CPython bytecodes.

Why bytecodes: wall-clock and CPU-time figures on a shared 2-vCPU VM move by
tens of percent from one run to the next, which hides the effect of most
optimisations. The number of bytecodes the interpreter executes for one
message (and the number of Python-level calls) depends only on the code
path, not on the host: two runs of the same tree give the same figures to
within a fraction of a percent, so a change of 1 % is a real change. It is a
proxy, not a time (a bytecode that builds a dict costs more than one that
loads a local, and C functions count as one call instruction however long
they run), but for the pure-Python soft device and asyncio glue it tracks
CPU time closely. Counting uses ``sys.settrace`` with
``frame.f_trace_opcodes = True`` on the measuring thread only; "calls"
include coroutine and generator resumptions, which is what each ``await``
that suspends costs.

What a round trip (RT) is: a 64-byte message from A to B and a 64-byte reply
from B to A over an RC queue pair, each one a SEND (with immediate) that the
receiver acknowledges: 2 packets each way (SEND + ACK), 4 in all.

``--level device``: verbs only, two soft devices (one RC QP each, polled
CQs, no completion channels). Both NICs are serviced by hand on this thread:
each device is "attached" to a stand-in event loop that nothing polls, and
its watchdog is pushed out, so the NIC threads never touch the sockets (they
still run the transport timers, which never fire unless the host stalls for
longer than the ACK timeout; retransmissions are reported). One RT: post a
SEND_WITH_IMM on A, service B's NIC, poll B's receive CQ, repost the
receive, B replies, service A, poll A's CQs, repost, service B (the ACK).

``--level stack``: the whole library, ``aiordma.start_server`` (echo) and
``aiordma.connect`` on two soft devices, both ends on one default asyncio
loop, ``progress="event"`` without its poll window (``spin_us=0``: the
polling it does depends on time, the message path's work does not); one RT
is ``await conn.send(64 B); await conn.recv()`` (the echo handler's work
included). The stack figure includes the device figure's work plus the
asyncio layer.

Each level warms up, then runs an untraced pass for CPU time (process time,
all threads, per RT: informative only, noisy on a shared host), then traces
``--iters`` round trips with the garbage collector paused.

    python benchmarks/cost.py                         # both levels, 300 traced RTs each
    python benchmarks/cost.py --level device --top 30
    python benchmarks/cost.py --json cost.json        # machine-readable record
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import os
import platform
import subprocess
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Callable, Iterable
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
    DeviceContext,
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
LEVELS = ("device", "stack")
#: environment variables that change what is measured (recorded in the output)
ENV_PREFIX = "AIORDMA_"

LEVEL_TITLES = {
    "device": "two soft devices, verbs only, polled CQs, both NICs serviced on this thread",
    "stack": "aiordma.connect + start_server (echo) on two soft devices, one asyncio loop",
}


# ------------------------------------------------------------- counting ----


class OpcodeCounter:
    """A ``sys.settrace`` hook that counts executed bytecodes and Python calls
    per code object, on the thread that installs it."""

    def __init__(self) -> None:
        self.ops: Counter[CodeType] = Counter()
        self.calls: Counter[CodeType] = Counter()

    def trace(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if event == "opcode":
            self.ops[frame.f_code] += 1
        elif event == "call":
            frame.f_trace_lines = False
            frame.f_trace_opcodes = True
            self.calls[frame.f_code] += 1
        return self.trace

    def start(self) -> None:
        gc.collect()
        gc.disable()  # a collection at a random point could run Python finalizers
        sys.settrace(self.trace)

    def stop(self) -> None:
        sys.settrace(None)
        gc.enable()


_STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
_SITE = Path(sysconfig.get_paths()["purelib"]).resolve()


def _short_file(filename: str) -> str:
    """Repository files relative to the repository, library files relative to their root."""
    if filename.startswith("<"):
        return filename
    path = Path(filename).resolve()
    for base in (ROOT, _SITE, _STDLIB):
        if path.is_relative_to(base):
            return path.relative_to(base).as_posix()
    return path.name


def _short_function(code: CodeType) -> str:
    name = code.co_qualname
    # dataclass-generated methods (file "<string>"): "__create_fn__.<locals>.__init__"
    return name.rpartition("<locals>.")[2] if name.startswith("__create_fn__") else name


@dataclass
class FunctionCost:
    file: str
    function: str
    line: int
    bytecodes_per_rt: float
    calls_per_rt: float


@dataclass
class FileCost:
    file: str
    bytecodes_per_rt: float
    calls_per_rt: float
    share: float  # of all bytecodes


@dataclass
class LevelResult:
    level: str
    iters: int
    warmup: int
    bytecodes_per_rt: float
    calls_per_rt: float
    functions: list[FunctionCost]  # all of them, most bytecodes first
    by_file: list[FileCost]
    packets_per_rt: float  # packets sent by both devices per round trip, traced run
    cpu_us_per_rt: float | None  # untraced run, process time (all threads); None if not run
    cpu_iters: int
    recoveries: int  # retransmissions and timeouts during the traced run (should be 0)
    notes: list[str] = field(default_factory=list)


def summarise(
    level: str,
    counter: OpcodeCounter,
    n: int,
    *,
    warmup: int,
    packets: int,
    cpu_seconds: float,
    cpu_iters: int,
    recoveries: int,
    notes: Iterable[str] = (),
) -> LevelResult:
    ops: Counter[tuple[str, str, int]] = Counter()
    calls: Counter[tuple[str, str, int]] = Counter()
    for code, v in counter.ops.items():
        ops[(_short_file(code.co_filename), _short_function(code), code.co_firstlineno)] += v
    for code, v in counter.calls.items():
        calls[(_short_file(code.co_filename), _short_function(code), code.co_firstlineno)] += v
    total_ops = sum(ops.values())
    total_calls = sum(calls.values())
    functions = [
        FunctionCost(f, fn, line, ops[(f, fn, line)] / n, calls[(f, fn, line)] / n)
        for (f, fn, line) in sorted(set(ops) | set(calls), key=lambda k: (-ops[k], -calls[k], k))
    ]
    file_ops: Counter[str] = Counter()
    file_calls: Counter[str] = Counter()
    for (f, _fn, _line), v in ops.items():
        file_ops[f] += v
    for (f, _fn, _line), v in calls.items():
        file_calls[f] += v
    by_file = [
        FileCost(f, file_ops[f] / n, file_calls[f] / n, file_ops[f] / total_ops if total_ops else 0.0)
        for f in sorted(set(file_ops) | set(file_calls), key=lambda f: (-file_ops[f], -file_calls[f], f))
    ]
    return LevelResult(
        level=level,
        iters=n,
        warmup=warmup,
        bytecodes_per_rt=total_ops / n,
        calls_per_rt=total_calls / n,
        functions=functions,
        by_file=by_file,
        packets_per_rt=packets / n,
        cpu_us_per_rt=cpu_seconds / cpu_iters * 1e6 if cpu_iters else None,
        cpu_iters=cpu_iters,
        recoveries=recoveries,
        notes=list(notes),
    )


def _device_counts(devices: Iterable[DeviceContext]) -> tuple[int, int]:
    """(packets sent, retransmissions + timeouts) summed over ``devices``."""
    sent = recovered = 0
    for dev in devices:
        c = dev.counters  # type: ignore[attr-defined]  # soft devices only
        sent += c.get("sent_pkts", 0)
        recovered += c.get("retransmits", 0) + c.get("timeouts", 0)
    return sent, recovered


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
    """One side of the device-level ping-pong: a soft device with a PD, a
    send and a receive CQ (polled), an RC QP and an 8 KiB registered buffer
    (send from [0, 64), receive into [4096, 8192))."""

    def __init__(self) -> None:
        self.dev = open_device("soft")
        nic = self.dev.nic  # type: ignore[attr-defined]
        nic.watchdog_interval = WATCHDOG_OFF
        nic.poll_window = 0.0  # nothing polls this stand-in loop
        self.loop = ManualLoop()
        self.detach = self.dev.attach_event_loop(self.loop)
        if self.detach is None or self.loop.callback is None:
            self.dev.close()
            raise SystemExit("the soft device refused loop assist (unset AIORDMA_SOFT_LOOP_ASSIST)")
        #: one round of NIC work: receive, timers, transmit (``SoftNIC.service``)
        self.service: Callable[[], None] = self.loop.callback
        self.pd = self.dev.alloc_pd()
        self.scq = self.dev.create_cq(256)
        self.rcq = self.dev.create_cq(256)
        self.qp = self.pd.create_qp(
            self.scq, self.rcq, QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)
        )
        self.buf = bytearray(8192)
        self.mr = self.pd.reg_mr(self.buf, ACCESS_ALL)

    def send_wr(self, wr_id: int) -> SendWR:
        return SendWR(
            wr_id,
            WROpcode.IBV_WR_SEND_WITH_IMM,
            [self.mr.sge(0, MSG_SIZE)],
            send_flags=SendFlags.IBV_SEND_SIGNALED,
            imm_data=7,
        )

    def recv_wr(self, wr_id: int) -> RecvWR:
        return RecvWR(wr_id, [self.mr.sge(4096, 4096)])

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
        self.pd.close()
        self.detach()
        self.dev.close()


def _expect(wcs: list[WorkCompletion], what: str) -> None:
    if len(wcs) != 1 or wcs[0].status != WCStatus.IBV_WC_SUCCESS:
        raise RuntimeError(f"expected one successful {what} completion, got {wcs}")


def run_device(iters: int, warmup: int, cpu_iters: int) -> LevelResult:
    a, b = VerbsEnd(), VerbsEnd()
    try:
        # PSNs just below the 24-bit wrap: the run crosses it (as the test suite does)
        a.connect(b, sq_psn=0xFFFFF0, rq_psn=0xFFFFFE)
        b.connect(a, sq_psn=0xFFFFFE, rq_psn=0xFFFFF0)
        if not a.qp.state == b.qp.state == QPState.IBV_QPS_RTS:
            raise RuntimeError("the queue pairs did not reach RTS")
        for i in range(RECV_DEPTH):
            a.qp.post_recv(a.recv_wr(i))
            b.qp.post_recv(b.recv_wr(i))

        def round_trip(i: int) -> None:
            a.qp.post_send(a.send_wr(i))
            b.service()  # B receives the SEND, ACKs it
            _expect(b.rcq.poll(), "receive on B")
            b.qp.post_recv(b.recv_wr(i))
            b.qp.post_send(b.send_wr(i))
            a.service()  # A receives the ACK and the reply, ACKs the reply
            _expect(a.rcq.poll(), "receive on A")
            _expect(a.scq.poll(), "send on A")
            a.qp.post_recv(a.recv_wr(i))
            b.service()  # B receives the ACK
            _expect(b.scq.poll(), "send on B")

        for i in range(warmup):
            round_trip(i)
        t0 = time.process_time()
        for i in range(cpu_iters):
            round_trip(i)
        cpu = time.process_time() - t0
        sent0, rec0 = _device_counts((a.dev, b.dev))
        counter = OpcodeCounter()
        counter.start()
        try:
            for i in range(iters):
                round_trip(i)
        finally:
            counter.stop()
        sent1, rec1 = _device_counts((a.dev, b.dev))
    finally:
        a.close()
        b.close()
    return summarise(
        "device",
        counter,
        iters,
        warmup=warmup,
        packets=sent1 - sent0,
        cpu_seconds=cpu,
        cpu_iters=cpu_iters,
        recoveries=rec1 - rec0,
    )


# ----------------------------------------------------------- stack level ----


async def _stack(iters: int, warmup: int, cpu_iters: int) -> LevelResult:
    devices = [open_device("soft"), open_device("soft")]
    for dev in devices:
        # the loop services the sockets; the NIC threads only run the transport timers
        dev.nic.watchdog_interval = WATCHDOG_OFF  # type: ignore[attr-defined]
        dev.nic.poll_window = 0.0  # type: ignore[attr-defined]  # (its polling depends on time)

    async def echo(conn: aiordma.Connection) -> None:
        try:
            while True:
                await conn.send(await conn.recv())
        except aiordma.RDMAError:
            pass

    server = await aiordma.start_server(
        echo, "127.0.0.1", 0, device=devices[1], progress="event", spin_us=0, ack_timeout=ACK_TIMEOUT
    )
    conn = await aiordma.connect(
        "127.0.0.1", server.port, device=devices[0], progress="event", spin_us=0, ack_timeout=ACK_TIMEOUT
    )
    notes: list[str] = []
    try:
        if conn.progress_mode != "event":
            notes.append(f"progress mode is {conn.progress_mode!r}, not 'event': work on other threads is not counted")
        data = bytes(MSG_SIZE)
        for _ in range(warmup):
            await conn.send(data)
            await conn.recv()
        t0 = time.process_time()
        for _ in range(cpu_iters):
            await conn.send(data)
            await conn.recv()
        cpu = time.process_time() - t0
        sent0, rec0 = _device_counts(devices)
        counter = OpcodeCounter()
        counter.start()
        try:
            for _ in range(iters):
                await conn.send(data)
                await conn.recv()
        finally:
            counter.stop()
        sent1, rec1 = _device_counts(devices)
    finally:
        await conn.close()
        server.close()
        await server.wait_closed()
        for dev in devices:
            dev.close()
    return summarise(
        "stack",
        counter,
        iters,
        warmup=warmup,
        packets=sent1 - sent0,
        cpu_seconds=cpu,
        cpu_iters=cpu_iters,
        recoveries=rec1 - rec0,
        notes=notes,
    )


def run_stack(iters: int, warmup: int, cpu_iters: int) -> LevelResult:
    return asyncio.run(_stack(iters, warmup, cpu_iters))


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


def environment() -> dict[str, Any]:
    commit, dirty = git_commit()
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "aiordma_version": getattr(aiordma, "__version__", None),
        "aiordma_commit": commit,
        "aiordma_dirty": dirty,
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIX)},
    }


RULE = "-" * 96


def print_table(res: LevelResult, env: dict[str, Any], top: int) -> None:
    commit = env["aiordma_commit"]
    tree = "unknown" if commit is None else commit[:12] + (" + local changes" if env["aiordma_dirty"] else "")
    print(RULE)
    print(f"                              Per-message cost: {res.level} level")
    print(f" Setup           : {LEVEL_TITLES[res.level]}")
    print(f" Round trip      : {MSG_SIZE} B SEND_WITH_IMM each way, acknowledged (SEND + ACK each way)")
    print(f" Iterations      : {res.iters} traced after {res.warmup} warm-up; CPU time over {res.cpu_iters} untraced")
    print(f" Python          : {env['implementation']} {env['python']}")
    print(f" aiordma         : {tree}")
    if env["env"]:
        print(f" Environment     : {' '.join(f'{k}={v}' for k, v in env['env'].items())}")
    print(RULE)
    print(" #bytes  #iterations   bytecodes/RT   calls/RT   packets/RT   CPU[usec/RT] (noisy)")
    cpu = "-" if res.cpu_us_per_rt is None else f"{res.cpu_us_per_rt:.1f}"
    print(
        f" {MSG_SIZE:<7} {res.iters:<13} {res.bytecodes_per_rt:<14.0f} {res.calls_per_rt:<10.1f} "
        f"{res.packets_per_rt:<12.2f} {cpu}"
    )
    print(RULE)
    print(f" top {min(top, len(res.functions))} functions by bytecodes per round trip")
    print("  bytecodes/RT   calls/RT   function")
    for f in res.functions[:top]:
        print(f"  {f.bytecodes_per_rt:12.1f}   {f.calls_per_rt:8.2f}   {f.file}:{f.line} {f.function}")
    print(RULE)
    print(" by file")
    print("  bytecodes/RT   share   calls/RT   file")
    for fc in res.by_file:
        print(f"  {fc.bytecodes_per_rt:12.1f}  {fc.share:5.1%}   {fc.calls_per_rt:8.2f}   {fc.file}")
    print(RULE)
    print(" CPU[usec/RT]: process time (all threads) per round trip in a separate untraced run;")
    print(" informative only: on a shared host it varies by tens of percent between runs.")
    if res.recoveries:
        print(f" WARNING: {res.recoveries} retransmissions/timeouts during the traced run: the counts include them")
    for note in res.notes:
        print(f" NOTE: {note}")
    print(RULE)


def record(res: LevelResult, env: dict[str, Any], top: int) -> dict[str, Any]:
    return {
        "level": res.level,
        "setup": LEVEL_TITLES[res.level],
        "round_trip": f"{MSG_SIZE} B SEND_WITH_IMM each way, each acknowledged: SEND + ACK each way",
        "msg_size": MSG_SIZE,
        "iters": res.iters,
        "warmup": res.warmup,
        "bytecodes_per_rt": round(res.bytecodes_per_rt, 1),
        "calls_per_rt": round(res.calls_per_rt, 2),
        "packets_per_rt": round(res.packets_per_rt, 3),
        "cpu_us_per_rt": None if res.cpu_us_per_rt is None else round(res.cpu_us_per_rt, 1),
        "cpu_iters": res.cpu_iters,
        "recoveries": res.recoveries,
        "notes": res.notes,
        "by_file": {
            fc.file: {"bytecodes_per_rt": round(fc.bytecodes_per_rt, 1), "calls_per_rt": round(fc.calls_per_rt, 2)}
            for fc in res.by_file
        },
        "top": [
            {
                "file": f.file,
                "function": f.function,
                "line": f.line,
                "bytecodes_per_rt": round(f.bytecodes_per_rt, 1),
                "calls_per_rt": round(f.calls_per_rt, 2),
            }
            for f in res.functions[:top]
        ],
        **env,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--level", choices=(*LEVELS, "both"), default="both", help="what to measure (default: both)")
    ap.add_argument("--iters", type=int, default=300, help="traced round trips per level (default: 300)")
    ap.add_argument("--warmup", type=int, default=300, help="untraced round trips before measuring (default: 300)")
    ap.add_argument(
        "--cpu-iters",
        type=int,
        default=2000,
        help="untraced round trips for the CPU-time figure (default: 2000; 0 skips it)",
    )
    ap.add_argument("--top", type=int, default=20, help="functions listed (default: 20)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = ap.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or args.cpu_iters < 0 or args.top < 0:
        ap.error("--iters must be positive; --warmup, --cpu-iters and --top not negative")

    levels = LEVELS if args.level == "both" else (args.level,)
    runners: dict[str, Callable[[int, int, int], LevelResult]] = {"device": run_device, "stack": run_stack}
    env = environment()
    results = []
    for level in levels:
        res = runners[level](args.iters, args.warmup, args.cpu_iters)
        print_table(res, env, args.top)
        results.append(res)
    if len(results) == 2:
        dev, stack = results
        print(
            f" stack - device: {stack.bytecodes_per_rt - dev.bytecodes_per_rt:.0f} bytecodes/RT, "
            f"{stack.calls_per_rt - dev.calls_per_rt:.1f} calls/RT (connection, completion dispatch, asyncio)"
        )
    if args.json:
        doc = {"benchmark": "aiordma-cost", "results": [record(r, env, args.top) for r in results]}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
