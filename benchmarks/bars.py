#!/usr/bin/env python3
"""The issue-14 bars, measured the way the issue asks: aiordma next to asyncio TCP in
the same run, at least 5 alternating rounds, medians and ranges, CPU per operation
beside time, on both event loops.

What runs (every round, in this order, on each loop; then the next round):

* ``aiordma bench send_lat -s 64`` with the default poll window, and again with
  ``AIORDMA_SPIN_US=0`` (the window off). Bars: p50 >= 0.8 x TCP (TCP's p50 /
  aiordma's), both settings; CPU per round trip (both ends) <= 2 x TCP's. The
  difference in aiordma's CPU per round trip between the two settings is what
  the window costs;
* ``aiordma bench write_bw -s 65536`` (bar >= 2 x TCP) and ``read_bw -s 65536``
  (>= 1.5 x);
* ``benchmarks/scaling.py``: 4 KiB RDMA Writes at depth 16 over 1, 8 and 64
  connections, aggregate bandwidth >= 1 x the TCP baseline at each.

Each ``aiordma bench`` invocation measures aiordma and then its TCP baseline on
fresh connections (and ``scaling.py`` TCP then aiordma per connection count), so
the rounds alternate aiordma, TCP, aiordma, TCP ... . Once per loop:

* ``benchmarks/kv.py --rounds N`` (it alternates aiordma/TCP rounds itself):
  server CPU <= 5 µs per one-sided op, 0 Python bytecodes in the server;
* ``benchmarks/cost.py`` (deterministic counts, one run): device level <= 300
  bytecodes per 64 B round trip (the library's part), shared layers <= 600
  per awaited write, 0 bytecodes in a one-sided target.

A bar's verdict is on the median over the rounds (ratios are per round: each
aiordma figure against the TCP figure of the same invocation); the range
(min-max) is shown beside it. Outputs: JSON (``--json``, everything including
every raw record) and a Markdown table (``--markdown``, for the README and
``benchmarks/results/``), both by default under ``benchmarks/results/``.

    python benchmarks/bars.py --quick               # a few minutes on a 2-core machine
    python benchmarks/bars.py                       # longer measurements (-D 2 s each)
    python benchmarks/bars.py --quick --loops uvloop --only send_lat,kv
    AIORDMA_SOFT_ENGINE=python python benchmarks/bars.py --quick --name bars-python
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
LOOPS = ("asyncio", "uvloop")
ITEMS = ("send_lat", "write_bw", "read_bw", "scaling", "kv", "cost")
START, END = "<!-- bars:start -->", "<!-- bars:end -->"
MIN_ROUNDS = 5

#: measurement settings per mode: bench arguments, scaling ops per cell, kv ops, cost counts
MODES: dict[str, dict[str, Any]] = {
    "quick": {
        "lat": ["-n", "3000"],
        "bw": ["-n", "3000"],
        "scaling_ops": 2048,
        "kv_ops": 6000,  # about 10,500 one-sided operations, what the KV bar is stated for
        "kv_count_ops": 500,
        "cost": ["--iters", "100", "--warmup", "100", "--cpu-iters", "300"],
    },
    "full": {
        "lat": ["-D", "2"],
        "bw": ["-D", "2"],
        "scaling_ops": 4096,
        "kv_ops": 6000,
        "kv_count_ops": 1000,
        "cost": [],
    },
}


# ------------------------------------------------------------ running ----


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def _cmdline(argv: list[str], extra_env: dict[str, str] | None) -> str:
    """The command as a user would type it from the repository root."""
    shown = [
        "python" if a == sys.executable else os.path.relpath(a, ROOT) if a.startswith(str(ROOT)) else a for a in argv
    ]
    if shown[:3] == ["python", "-m", "aiordma.cli"]:
        shown = ["aiordma", *shown[3:]]
    prefix = " ".join(f"{k}={v}" for k, v in (extra_env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(shown)


@dataclass
class Runner:
    """Runs the measurements as child processes and keeps the log."""

    timeout: float
    verbose: bool = True
    log: list[dict[str, Any]] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def run(self, what: str, argv: list[str], extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        cmd = _cmdline(argv, extra_env)
        if self.verbose:
            el = int(time.monotonic() - self.t0)
            sys.stderr.write(f"[{el // 60}:{el % 60:02d}] {what}: {cmd}\n")
            sys.stderr.flush()
        t = time.monotonic()
        try:
            cp = subprocess.run(
                argv, capture_output=True, text=True, env=_env(extra_env), cwd=ROOT, timeout=self.timeout
            )
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
            cp = subprocess.CompletedProcess(argv, -9, out, f"timed out after {self.timeout:g} s")
        self.log.append({"what": what, "command": cmd, "rc": cp.returncode, "seconds": round(time.monotonic() - t, 2)})
        if cp.returncode != 0 and self.verbose:
            sys.stderr.write(f"    failed ({cp.returncode}): {cp.stderr.strip()[-600:]}\n")
        return cp


def bench(runner: Runner, test: str, args: list[str], loop: str, provider: str, env: dict[str, str] | None) -> dict:
    """One ``aiordma bench TEST --json`` invocation (aiordma, then its TCP baseline)."""
    argv = [sys.executable, "-m", "aiordma.cli", "bench", test, *args, "--loop", loop, "--provider", provider, "--json"]
    cp = runner.run(f"{test} {loop}", argv, env)
    recs = [json.loads(line) for line in cp.stdout.splitlines() if line.startswith("{")]
    rec = recs[-1] if recs else {"error": (cp.stderr.strip() or f"exit status {cp.returncode}")[-800:]}
    rec["command"] = _cmdline(argv, env)
    if cp.returncode and "error" not in rec:
        rec["error"] = f"exit status {cp.returncode}: {cp.stderr.strip()[-400:]}"
    return rec


def scaling(runner: Runner, loop: str, provider: str, ops: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, str(HERE / "scaling.py"), "--conns", "1,8,64", "--depths", "16", "--size", "4096",
                "--ops", str(ops), "--loop", loop, "--provider", provider, "--out", tmp]  # fmt: skip
        cp = runner.run(f"scaling {loop}", argv)
        path = Path(tmp) / "scaling.json"
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    out = {"command": _cmdline(argv, None), "rows": rows}
    if cp.returncode or not rows:
        out["error"] = (cp.stderr.strip() or f"exit status {cp.returncode}")[-800:]
    return out


def kv(runner: Runner, loop: str, provider: str, rounds: int, ops: int, count_ops: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kv.json"
        argv = [sys.executable, str(HERE / "kv.py"), "--rounds", str(rounds), "--ops", str(ops), "--count-ops",
                str(count_ops), "--loop", loop, "--provider", provider, "--json", str(path)]  # fmt: skip
        cp = runner.run(f"kv {loop}", argv)
        doc = json.loads(path.read_text()) if path.exists() else {}
    doc["command"] = _cmdline(argv, None)
    if cp.returncode or "summary" not in doc:
        doc["error"] = (cp.stderr.strip() or f"exit status {cp.returncode}")[-800:]
    return doc


def cost(runner: Runner, loop: str, args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cost.json"
        levels = "all" if loop == "asyncio" else "write,target"  # device/stack levels do not use the loop
        argv = [sys.executable, str(HERE / "cost.py"), "--level", levels, "--loop", loop, *args, "--json", str(path)]
        cp = runner.run(f"cost {loop}", argv)
        doc = json.loads(path.read_text()) if path.exists() else {}
    keep = ("name", "level", "op", "unit", "engine", "provider", "mode", "iters", "bytecodes_per_op",
            "library_bytecodes_per_op", "calls_per_op", "by_layer", "by_thread", "cpu_us_per_op", "python", "counter")  # fmt: skip
    # the figures and the ten costliest functions (cost.py --json PATH has every file and function)
    results = [{**{k: r.get(k) for k in keep}, "top": r.get("top", [])[:10]} for r in doc.get("results", [])]
    out = {"command": _cmdline(argv, None), "results": results}
    if cp.returncode or not out["results"]:
        out["error"] = (cp.stderr.strip() or f"exit status {cp.returncode}")[-800:]
    return out


# ------------------------------------------------------------- verdicts ----


def _stat(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


@dataclass
class Bar:
    """One bar on one loop: its figure over the rounds and whether the median meets it."""

    name: str
    loop: str
    target: str  # e.g. ">= 0.8"
    value: dict[str, float] | None  # the figure the bar is about (median/min/max over rounds)
    unit: str = "x TCP"
    aiordma: dict[str, float] | None = None  # the raw figures, both sides
    tcp: dict[str, float] | None = None
    cpu_aiordma: dict[str, float] | None = None  # CPU µs per op
    cpu_tcp: dict[str, float] | None = None
    raw_unit: str = ""
    cpu_unit: str = "µs/op"
    notes: list[str] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        op, limit = self.target.split()
        v = self.value["median"]
        return v >= float(limit) if op == ">=" else v <= float(limit) if op == "<=" else v == float(limit)

    def as_dict(self) -> dict[str, Any]:
        return {
            "bar": self.name,
            "loop": self.loop,
            "target": f"{self.target} {self.unit}".strip(),
            "value": self.value,
            "met": self.met,
            "aiordma": self.aiordma,
            "tcp": self.tcp,
            "raw_unit": self.raw_unit,
            "cpu_us_per_op": {"aiordma": self.cpu_aiordma, "tcp": self.cpu_tcp},
            "cpu_unit": self.cpu_unit,
            "notes": self.notes,
            "commands": self.commands,
        }


def _ok(recs: list[dict]) -> list[dict]:
    return [r for r in recs if "error" not in r and r.get("baseline")]


def _errors(recs: list[dict]) -> list[str]:
    return [f"{r.get('command', '?')}: {r['error'][:200]}" for r in recs if "error" in r]


def lat_bars(label: str, loop: str, recs: list[dict]) -> list[Bar]:
    ok = _ok(recs)
    cmds = sorted({r["command"] for r in recs})
    notes = _errors(recs)
    if ok and ok[0].get("poll_window_us") is not None:
        notes.append(f"poll window {ok[0]['poll_window_us']:g} µs")
    if ok and ok[0].get("packet_path"):
        notes.append(f"packets: {ok[0]['packet_path']}")
    p50 = Bar(
        f"send_lat -s 64 p50, {label}",
        loop,
        ">= 0.8",
        _stat([r["baseline"]["lat_us"]["p50"] / r["lat_us"]["p50"] for r in ok]),
        aiordma=_stat([r["lat_us"]["p50"] for r in ok]),
        tcp=_stat([r["baseline"]["lat_us"]["p50"] for r in ok]),
        cpu_aiordma=_stat([r["cpu_us_per_op"]["total"] for r in ok if r.get("cpu_us_per_op")]),
        cpu_tcp=_stat([r["baseline"]["cpu_us_per_op"]["total"] for r in ok if r["baseline"].get("cpu_us_per_op")]),
        raw_unit="µs (half round trip)",
        cpu_unit="µs/RT",
        notes=notes,
        commands=cmds,
    )
    cpu = Bar(
        f"send_lat -s 64 CPU per round trip, {label}",
        loop,
        "<= 2",
        _stat(
            [
                r["cpu_us_per_op"]["total"] / r["baseline"]["cpu_us_per_op"]["total"]
                for r in ok
                if r.get("cpu_us_per_op") and r["baseline"].get("cpu_us_per_op")
            ]
        ),
        unit="x TCP's CPU",
        aiordma=p50.cpu_aiordma,
        tcp=p50.cpu_tcp,
        cpu_aiordma=p50.cpu_aiordma,
        cpu_tcp=p50.cpu_tcp,
        raw_unit="µs CPU per RT, both ends",
        cpu_unit="µs/RT",
        notes=_errors(recs),
        commands=cmds,
    )
    return [p50, cpu]


def bw_bar(test: str, target: str, loop: str, recs: list[dict]) -> Bar:
    ok = _ok(recs)
    return Bar(
        f"{test} -s 65536",
        loop,
        target,
        _stat([r["bw_MBps"] / r["baseline"]["bw_MBps"] for r in ok if r["baseline"]["bw_MBps"]]),
        aiordma=_stat([r["bw_MBps"] for r in ok]),
        tcp=_stat([r["baseline"]["bw_MBps"] for r in ok]),
        cpu_aiordma=_stat([r["cpu_us_per_op"]["total"] for r in ok if r.get("cpu_us_per_op")]),
        cpu_tcp=_stat([r["baseline"]["cpu_us_per_op"]["total"] for r in ok if r["baseline"].get("cpu_us_per_op")]),
        raw_unit="MB/s",
        notes=_errors(recs),
        commands=sorted({r["command"] for r in recs}),
    )


def scaling_bars(loop: str, runs: list[dict]) -> list[Bar]:
    bars = []
    for conns in (1, 8, 64):
        ratios, a_bw, t_bw, a_cpu, t_cpu, notes = [], [], [], [], [], []
        for run in runs:
            rows = run.get("rows", [])
            a = next(
                (r for r in rows if r["transport"] == "aiordma" and r["conns"] == conns and "error" not in r), None
            )
            t = next((r for r in rows if r["transport"] == "tcp" and r["conns"] == conns), None)
            failed = next(
                (r for r in rows if r["transport"] == "aiordma" and r["conns"] == conns and "error" in r), None
            )
            if failed:
                notes.append(f"a round failed: {failed['error'][:160]}")
            if a and t and t["bw_MBps"]:
                ratios.append(a["bw_MBps"] / t["bw_MBps"])
                a_bw.append(a["bw_MBps"])
                t_bw.append(t["bw_MBps"])
                if a.get("cpu_us_per_op"):
                    a_cpu.append(a["cpu_us_per_op"]["total"])
                if t.get("cpu_us_per_op"):
                    t_cpu.append(t["cpu_us_per_op"]["total"])
            if "error" in run and not rows:
                notes.append(run["error"][:200])
        bars.append(
            Bar(
                f"scaling: 4 KiB writes, depth 16, {conns} connection{'s' if conns > 1 else ''}",
                loop,
                ">= 1",
                _stat(ratios),
                aiordma=_stat(a_bw),
                tcp=_stat(t_bw),
                cpu_aiordma=_stat(a_cpu),
                cpu_tcp=_stat(t_cpu),
                raw_unit="MB/s aggregate",
                notes=notes,
                commands=sorted({r["command"] for r in runs}),
            )
        )
    return bars


def kv_bars(loop: str, doc: dict) -> list[Bar]:
    summ = doc.get("summary", {})
    a, t = summ.get("aiordma", {}), summ.get("tcp", {})
    notes = [doc["error"][:300]] if "error" in doc else []
    cfg = doc.get("config", {})
    if a:
        notes.append(
            f"{cfg.get('clients')} clients, {cfg.get('ops')} KV ops per round "
            f"({a['one_sided_ops']['median']:.0f} one-sided ops), {cfg.get('mix')}; KV ops/s aiordma "
            f"{a['kv_ops_per_s']['median']:.0f}, TCP {t.get('kv_ops_per_s', {}).get('median', float('nan')):.0f}"
        )
    for side in (a, t):  # how many rounds each median is over
        for v in side.values():
            if isinstance(v, dict) and "median" in v:
                v.setdefault("n", side.get("rounds", 1))
    cpu = Bar(
        "KV server CPU per one-sided op",
        loop,
        "<= 5",
        a.get("server_cpu_us_per_one_sided_op"),
        unit="µs",
        aiordma=a.get("kv_ops_per_s"),
        tcp=t.get("kv_ops_per_s"),
        cpu_aiordma=a.get("server_cpu_us_per_kv_op"),
        cpu_tcp=t.get("server_cpu_us_per_kv_op"),
        raw_unit="KV ops/s",
        cpu_unit="server µs/KV op",
        notes=notes,
        commands=[doc.get("command", "")],
    )
    counted = doc.get("bytecodes", {})
    bc = counted.get("aiordma")
    tb = counted.get("tcp")
    code = Bar(
        "KV server Python bytecodes per one-sided op",
        loop,
        "== 0",
        None if bc is None else _stat([bc["bytecodes_per_one_sided_op"]]),
        unit="bytecodes",
        aiordma=None if bc is None else {"median": bc["bytecodes_per_kv_op"], "n": 1},
        tcp=None if tb is None else {"median": tb["bytecodes_per_kv_op"], "n": 1},
        raw_unit="server bytecodes per KV op",
        notes=[] if bc is None else [f"counted over {bc['kv_ops']} KV ops ({bc['one_sided_ops']} one-sided)"],
        commands=[doc.get("command", "")],
    )
    return [cpu, code]


def cost_bars(loop: str, doc: dict) -> list[Bar]:
    recs = {r["name"]: r for r in doc.get("results", [])}
    notes = [doc["error"][:300]] if "error" in doc else []
    bars = []

    def one(name: str, target: str, value: float | None, unit: str, note: str) -> None:
        bars.append(
            Bar(
                name,
                loop,
                target,
                None if value is None else {"median": value, "min": value, "max": value, "n": 1},
                unit=unit,
                notes=[*notes, note],
                commands=[doc.get("command", "")],
            )
        )

    if "device" in recs:
        d = recs["device"]
        one(
            "device level, 64 B round trip (the library's Python)",
            "<= 300",
            d["library_bytecodes_per_op"],
            "bytecodes",
            f"engine {d['engine']}, mode {d['mode']}; with the benchmark's own posting/reaping: {d['bytecodes_per_op']:.0f}",
        )
    if "write" in recs:
        w = recs["write"]
        lay = w["by_layer"]
        one(
            "shared layers per awaited write",
            "<= 600",
            lay["shared"],
            "bytecodes",
            f"{w['provider']}, engine {w['engine']}; device {lay['device']:.0f}, event loop {lay['event loop']:.0f}",
        )
    targets = [r for n, r in recs.items() if n.startswith("target.")]
    if targets:
        worst = max(r["bytecodes_per_op"] for r in targets)
        one(
            "one-sided target process, bytecodes per op (worst of write/read/CAS/FAA)",
            "== 0",
            worst,
            "bytecodes",
            ", ".join(f"{r['op']} {r['bytecodes_per_op']:.0f}" for r in targets),
        )
    return bars


# --------------------------------------------------------------- output ----


def _num(v: float | None, digits: int = 1) -> str:
    if v is None:
        return "—"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def _cell(s: dict[str, float] | None, digits: int = 1) -> str:
    if not s:
        return "—"
    if s.get("n", 1) > 1 and "min" in s:
        return f"{_num(s['median'], digits)} ({_num(s['min'], digits)}–{_num(s['max'], digits)})"
    return _num(s["median"], digits)


def machine() -> dict[str, Any]:
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": cpu_model,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "aiordma_commit": commit,
        "loadavg_start": Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None,
    }


_ENGINE_PROBE = (
    "import sys; sys.path.insert(0, 'benchmarks'); import cost, aiordma; "
    "d = aiordma.open_device({provider!r}); print(cost.engine_of(d)); d.close()"
)


def engine(provider: str) -> str:
    cp = subprocess.run(
        [sys.executable, "-c", _ENGINE_PROBE.format(provider=provider)],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=60,
    )
    return cp.stdout.strip() or f"unknown ({cp.stderr.strip()[-200:]})"


def markdown(doc: dict[str, Any]) -> str:
    m, s = doc["machine"], doc["settings"]
    lines = [
        f"Issue-14 bars, {doc['date']}: engine **{doc['engine']}**, provider `{s['provider']}`, {s['mode']} mode, "
        f"{s['rounds']} alternating aiordma/TCP rounds per bar, loops {', '.join(s['loops'])}. Machine: "
        f"{m['cpus']} CPUs ({m['cpu_model'] or 'unknown model'}), Python {m['python']}, Linux {m['kernel']}, "
        f"aiordma {m['aiordma_commit'] or '?'}; load average {' '.join(m['loadavg_start'] or [])} at the start, "
        f"{' '.join(m.get('loadavg_end') or [])} at the end{'; ' + s['note'] if s.get('note') else ''}.",
        "",
        "Figures are medians over the rounds, (min–max) beside them; a ratio is taken within one run "
        "(aiordma against the TCP baseline measured right after it), higher is better for latency "
        "(TCP p50 / aiordma p50) and bandwidth (aiordma / TCP). CPU: process CPU time of both ends per "
        "operation (µs), which a busy machine disturbs less than wall-clock figures. Bytecode figures are "
        "deterministic counts (`benchmarks/cost.py`).",
        "",
        "| bar | loop | figure | target | met | aiordma | asyncio TCP | CPU aiordma | CPU TCP |",
        "|---|---|---:|---|:-:|---:|---:|---:|---:|",
    ]
    for b in doc["bars"]:
        met = {True: "yes", False: "**no**", None: "no data"}[b["met"]]
        digits = 2 if "x" in b["target"] else 1
        raw = f" {b['raw_unit']}" if b["raw_unit"] else ""
        cpu_unit = b["cpu_unit"]
        a = _cell(b["aiordma"])
        t = _cell(b["tcp"])
        lines.append(
            f"| {b['bar']} | {b['loop']} | {_cell(b['value'], digits)} | {b['target']} | {met} | "
            f"{a}{raw if a != '—' else ''} | {t}{raw if t != '—' else ''} | "
            f"{_cell(b['cpu_us_per_op']['aiordma'])} {cpu_unit if b['cpu_us_per_op']['aiordma'] else ''} | "
            f"{_cell(b['cpu_us_per_op']['tcp'])} {cpu_unit if b['cpu_us_per_op']['tcp'] else ''} |"
        )
    lines.append("")
    for w in doc.get("poll_window", []):
        lines.append(
            f"- Poll window ({w['loop']}): aiordma send_lat p50 {_num(w['p50_us_default'])} µs with it, "
            f"{_num(w['p50_us_off'])} µs without; CPU per round trip {_num(w['cpu_us_per_rt_default'])} vs "
            f"{_num(w['cpu_us_per_rt_off'])} µs: the window costs {_num(w['cpu_us_per_rt_cost'])} µs of CPU per "
            "round trip (both ends)."
        )
    notes = [f"{b['bar']} ({b['loop']}): {n}" for b in doc["bars"] for n in b["notes"] if n]
    if notes:
        lines.append("")
        lines += [f"- {n}" for n in notes]
    lines += ["", f"Reproduce: `{doc['command']}` (each measurement's own command is in the JSON)."]
    return "\n".join(lines) + "\n"


def update_readme(readme: Path, body: str) -> bool:
    text = readme.read_text()
    if START not in text or END not in text:
        sys.stderr.write(f"{readme}: no {START} ... {END} markers; left unchanged\n")
        return False
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{body}{END}{tail}")
    return True


# ----------------------------------------------------------------- main ----


def measure(args: argparse.Namespace, runner: Runner) -> tuple[list[Bar], dict[str, Any], list[dict]]:
    mode = MODES["quick" if args.quick else "full"]
    lat, bw = list(mode["lat"]), list(mode["bw"])
    if args.iters:
        lat = bw = ["-n", str(args.iters)]
    bars: list[Bar] = []
    raw: dict[str, Any] = {}
    windows: list[dict] = []
    step: Callable[[str], bool] = lambda item: item in args.only
    for loop in args.loops:
        r = raw.setdefault(loop, {})
        for k in range(args.rounds):
            if args.verbose:
                sys.stderr.write(f"--- {loop}: round {k + 1} of {args.rounds}\n")
            if step("send_lat"):
                r.setdefault("send_lat_default", []).append(
                    bench(runner, "send_lat", ["-s", "64", *lat], loop, args.provider, None)
                )
                r.setdefault("send_lat_window_off", []).append(
                    bench(runner, "send_lat", ["-s", "64", *lat], loop, args.provider, {"AIORDMA_SPIN_US": "0"})
                )
            if step("write_bw"):
                r.setdefault("write_bw", []).append(
                    bench(runner, "write_bw", ["-s", "65536", *bw], loop, args.provider, None)
                )
            if step("read_bw"):
                r.setdefault("read_bw", []).append(
                    bench(runner, "read_bw", ["-s", "65536", *bw], loop, args.provider, None)
                )
            if step("scaling"):
                r.setdefault("scaling", []).append(
                    scaling(runner, loop, args.provider, args.scaling_ops or mode["scaling_ops"])
                )
        if step("kv"):
            r["kv"] = kv(runner, loop, args.provider, args.rounds, args.kv_ops or mode["kv_ops"],
                         mode["kv_count_ops"] if args.kv_count_ops is None else args.kv_count_ops)  # fmt: skip
        if step("cost"):
            r["cost"] = cost(runner, loop, args.cost_args.split() if args.cost_args is not None else mode["cost"])
        if "send_lat_default" in r:
            d = lat_bars("default settings", loop, r["send_lat_default"])
            o = lat_bars("poll window off (AIORDMA_SPIN_US=0)", loop, r["send_lat_window_off"])
            bars += [d[0], o[0], d[1], o[1]]
            if d[0].aiordma and o[0].aiordma and d[0].cpu_aiordma and o[0].cpu_aiordma:
                windows.append(
                    {
                        "loop": loop,
                        "p50_us_default": d[0].aiordma["median"],
                        "p50_us_off": o[0].aiordma["median"],
                        "cpu_us_per_rt_default": d[0].cpu_aiordma["median"],
                        "cpu_us_per_rt_off": o[0].cpu_aiordma["median"],
                        "cpu_us_per_rt_cost": d[0].cpu_aiordma["median"] - o[0].cpu_aiordma["median"],
                    }
                )
        if "write_bw" in r:
            bars.append(bw_bar("write_bw", ">= 2", loop, r["write_bw"]))
        if "read_bw" in r:
            bars.append(bw_bar("read_bw", ">= 1.5", loop, r["read_bw"]))
        if "scaling" in r:
            bars += scaling_bars(loop, r["scaling"])
        if "kv" in r:
            bars += kv_bars(loop, r["kv"])
        if "cost" in r:
            bars += cost_bars(loop, r["cost"])
    return bars, raw, windows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--quick", action="store_true", help="short measurements (a few minutes in all)")
    p.add_argument("--rounds", type=int, default=MIN_ROUNDS, help=f"alternating rounds per bar (default {MIN_ROUNDS})")
    p.add_argument("--loops", default=",".join(LOOPS), help="comma-separated event loops (default asyncio,uvloop)")
    p.add_argument("--only", default=",".join(ITEMS), help=f"comma-separated subset of {','.join(ITEMS)}")
    p.add_argument("--provider", choices=("soft", "pyverbs", "auto"), default="soft", help="provider (default soft)")
    p.add_argument("--engine", choices=("python", "native"), default=None, help="soft engine (AIORDMA_SOFT_ENGINE)")
    p.add_argument("--iters", type=int, default=None, help="aiordma bench -n for every bench test (overrides the mode)")
    p.add_argument("--scaling-ops", type=int, default=None, help="scaling.py --ops (overrides the mode)")
    p.add_argument("--kv-ops", type=int, default=None, help="kv.py --ops (overrides the mode)")
    p.add_argument("--kv-count-ops", type=int, default=None, help="kv.py --count-ops (overrides the mode)")
    p.add_argument("--cost-args", default=None, help="arguments for cost.py (overrides the mode), e.g. '--iters 50'")
    p.add_argument("--name", default=None, help="output name (default bars-quick or bars)")
    p.add_argument("--out", type=Path, default=HERE / "results", help="output directory (default benchmarks/results)")
    p.add_argument("--json", type=Path, default=None, help="JSON output (default OUT/NAME.json)")
    p.add_argument("--markdown", type=Path, default=None, help="Markdown output (default OUT/NAME.md)")
    p.add_argument("--readme", type=Path, default=None, help=f"also replace the text between {START} and {END}")
    p.add_argument("--note", default="", help="a remark for the report (e.g. 'busy shared machine')")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per measurement (default 900)")
    p.add_argument("--check", action="store_true", help="exit with status 3 when a bar is not met")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw_argv)
    args.loops = [x for x in args.loops.split(",") if x]
    args.only = [x for x in args.only.split(",") if x]
    if not args.loops or any(x not in LOOPS for x in args.loops):
        p.error(f"--loops: choose from {', '.join(LOOPS)}")
    if not args.only or any(x not in ITEMS for x in args.only):
        p.error(f"--only: choose from {', '.join(ITEMS)}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    for name in ("iters", "scaling_ops", "kv_ops"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.engine:
        os.environ["AIORDMA_SOFT_ENGINE"] = args.engine
    args.verbose = not args.quiet
    name = args.name or ("bars-quick" if args.quick else "bars")
    json_path = args.json or args.out / f"{name}.json"
    md_path = args.markdown or args.out / f"{name}.md"
    runner = Runner(args.timeout, args.verbose)
    mach = machine()
    eng = engine(args.provider)
    t0 = time.monotonic()
    bars, raw, windows = measure(args, runner)
    mach["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None
    note = args.note
    if args.rounds < MIN_ROUNDS:
        note = (note + "; " if note else "") + f"only {args.rounds} round(s): the issue asks for at least {MIN_ROUNDS}"
    env_prefix = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("AIORDMA_"))
    doc = {
        "benchmark": "aiordma-bars",
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "engine": eng,
        "machine": mach,
        "settings": {
            "mode": "quick" if args.quick else "full",
            "rounds": args.rounds,
            "loops": args.loops,
            "only": args.only,
            "provider": args.provider,
            "note": note,
            "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("AIORDMA_")},
        },
        "elapsed_s": round(time.monotonic() - t0, 1),
        "bars": [b.as_dict() for b in bars],
        "poll_window": windows,
        "command": (env_prefix + " " if env_prefix else "") + "python benchmarks/bars.py " + shlex.join(raw_argv),
        "runs": runner.log,
        "measurements": raw,
    }
    md = markdown(doc)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(md)
    if args.readme:
        update_readme(args.readme, md)
    sys.stdout.write(md)
    if args.verbose:
        sys.stderr.write(f"wrote {json_path} and {md_path} in {doc['elapsed_s']:.0f} s\n")
    missed = [b for b in bars if b.met is not True]
    return 3 if missed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
