"""``benchmarks/bars.py``: the issue-14 bars runner, with tiny measurements.

It runs the real measurements (``aiordma bench``, ``scaling.py``, ``kv.py``,
``cost.py``) as child processes; this checks the rounds alternate as
promised, that every bar has its figure, range, CPU and verdict, that each
verdict follows from its figure, and the JSON and Markdown outputs.
"""

from __future__ import annotations

import json
import operator
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine_neutral  # the same on every engine and core: CI's reference run leaves it out

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bars.py"
TINY = [
    "--quick",
    "--rounds",
    "2",
    "--iters",
    "100",
    "--scaling-ops",
    "128",
    "--kv-ops",
    "40",
    "--kv-count-ops",
    "20",
    "--cost-args",
    "--iters 20 --warmup 20 --cpu-iters 0",
    "-q",
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for var in [k for k in env if k.startswith("AIORDMA_")]:
        env.pop(var)
    return env


def _bars(tmp_path: Path, *args: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict, str]:
    out = tmp_path / "out"
    cp = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out), "--name", "t"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
        cwd=ROOT,
    )
    doc = json.loads((out / "t.json").read_text()) if (out / "t.json").exists() else {}
    md = (out / "t.md").read_text() if (out / "t.md").exists() else ""
    return cp, doc, md


def _verdict(bar: dict) -> bool:
    op, limit = bar["target"].split()[:2]
    cmp = {">=": operator.ge, "<=": operator.le, "==": operator.eq}[op]
    return cmp(bar["value"]["median"], float(limit))


def test_bars_runner_every_bar(tmp_path: Path) -> None:
    cp, doc, md = _bars(tmp_path, *TINY, "--loops", "asyncio", "--check", "--note", "test run")
    assert doc, cp.stderr[-3000:]
    bars = {b["bar"]: b for b in doc["bars"]}
    expected = [
        "send_lat -s 64 p50, default settings",
        "send_lat -s 64 p50, poll window off (AIORDMA_SPIN_US=0)",
        "send_lat -s 64 CPU per round trip, default settings",
        "send_lat -s 64 CPU per round trip, poll window off (AIORDMA_SPIN_US=0)",
        "write_bw -s 65536",
        "read_bw -s 65536",
        "scaling: 4 KiB writes, depth 16, 1 connection",
        "scaling: 4 KiB writes, depth 16, 8 connections",
        "scaling: 4 KiB writes, depth 16, 64 connections",
        "KV server CPU per one-sided op",
        "KV server Python bytecodes per one-sided op",
        "device level, 64 B round trip (the library's Python)",
        "shared layers per awaited write",
        "one-sided target process, bytecodes per op (worst of write/read/CAS/FAA)",
    ]
    assert list(bars) == expected
    for name, b in bars.items():
        assert b["loop"] == "asyncio"
        assert b["value"] is not None, (name, b["notes"])
        assert b["met"] == _verdict(b), b
        assert b["commands"] and all(c for c in b["commands"]), name
    # timed bars: a figure per round, TCP and aiordma both measured, CPU per op beside time
    for name in expected[:9]:
        b = bars[name]
        assert b["value"]["n"] == 2 and b["value"]["min"] <= b["value"]["median"] <= b["value"]["max"], b
        assert b["aiordma"]["median"] > 0 and b["tcp"]["median"] > 0, b
        assert b["cpu_us_per_op"]["aiordma"]["median"] > 0 and b["cpu_us_per_op"]["tcp"]["median"] > 0, b
    assert bars["KV server CPU per one-sided op"]["value"]["n"] == 2
    assert bars["KV server CPU per one-sided op"]["cpu_us_per_op"]["tcp"]["median"] > 0
    if doc["engine"] == "python":  # the Python engine runs the device's work in Python
        assert not bars["device level, 64 B round trip (the library's Python)"]["met"]
        assert not bars["KV server Python bytecodes per one-sided op"]["met"]
    # the poll window's cost: aiordma's CPU per round trip with and without it
    [w] = doc["poll_window"]
    assert w["cpu_us_per_rt_cost"] == pytest.approx(w["cpu_us_per_rt_default"] - w["cpu_us_per_rt_off"])
    # rounds alternate: each round runs every timed measurement once (each aiordma then TCP)
    order = [r["what"] for r in doc["runs"]]
    one_round = ["send_lat asyncio", "send_lat asyncio", "write_bw asyncio", "read_bw asyncio", "scaling asyncio"]
    assert order == one_round * 2 + ["kv asyncio", "cost asyncio"], order
    assert "AIORDMA_SPIN_US=0 aiordma bench send_lat -s 64 -n 100" in doc["runs"][1]["command"]
    assert all(r["rc"] == 0 for r in doc["runs"]), doc["runs"]
    # the machine and the command to reproduce
    m = doc["machine"]
    assert m["cpus"] >= 1 and m["python"] and m["loadavg_start"] and m["loadavg_end"]
    assert doc["engine"] in ("python", "native")
    assert doc["command"].startswith("python benchmarks/bars.py --quick --rounds 2")
    assert "only 2 round(s): the issue asks for at least 5" in doc["settings"]["note"]
    # Markdown: one row per bar, the verdicts, the poll window, the reproduction
    assert md.count("| asyncio |") == len(expected)
    assert "| bar | loop | figure | target | met |" in md and "Poll window (asyncio)" in md
    assert "Reproduce: `python benchmarks/bars.py" in md and "test run" in md
    assert cp.stdout == md
    # --check: status 3 when a bar is not met
    assert cp.returncode == (0 if all(b["met"] for b in bars.values()) else 3), cp.stderr[-2000:]


def test_bars_runner_on_uvloop(tmp_path: Path) -> None:
    cp, doc, md = _bars(tmp_path, *TINY, "--loops", "uvloop", "--only", "send_lat,cost")
    assert cp.returncode == 0, cp.stderr[-3000:]
    names = [(b["bar"], b["loop"]) for b in doc["bars"]]
    assert ("send_lat -s 64 p50, default settings", "uvloop") in names
    assert ("shared layers per awaited write", "uvloop") in names
    shared = next(b for b in doc["bars"] if b["bar"] == "shared layers per awaited write")
    assert "event loop 0" in " ".join(shared["notes"])  # uvloop's loop runs no Python
    assert all(r["what"].endswith("uvloop") for r in doc["runs"])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--loops", "trio"], "--loops: choose from asyncio, uvloop"),
        (["--only", "send_lat,nope"], "--only: choose from"),
        (["--rounds", "0"], "--rounds must be at least 1"),
    ],
)
def test_bars_cli_errors(args: list[str], needle: str) -> None:
    cp = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT
    )
    assert cp.returncode == 2 and needle in cp.stderr and "Traceback" not in cp.stderr, cp.stderr
