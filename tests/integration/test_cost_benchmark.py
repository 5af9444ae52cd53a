"""``benchmarks/cost.py``: the per-message cost benchmark (bytecodes per round trip).

Runs the real script in a subprocess with small iteration counts and checks
its JSON record: both levels present, plausible figures, the stack costing
more than the device it runs on, the soft device's RC engine and wire codec
among the top functions, and the count repeating exactly from one run to
the next (the point of counting bytecodes instead of timing). Function names
are not asserted: the soft device is being optimised, only its file names
are stable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "cost.py"
TIMEOUT = 60
SMALL = ("--iters", "30", "--warmup", "50", "--cpu-iters", "100", "--top", "40")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for var in [k for k in env if k.startswith("AIORDMA_")]:
        env.pop(var)
    # cost.py drives the Python engine's NIC by hand (device.nic); the native engine's
    # level is being added to it separately
    env["AIORDMA_SOFT_ENGINE"] = "python"
    return env


def _cost(tmp_path: Path, name: str, *args: str) -> tuple[dict, str]:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"cost.py {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text()), proc.stdout


def test_cost_benchmark_both_levels(tmp_path: Path) -> None:
    doc, stdout = _cost(tmp_path, "both", "--level", "both", *SMALL)
    results = {r["level"]: r for r in doc["results"]}
    assert sorted(results) == ["device", "stack"]
    for level, rec in results.items():
        assert rec["iters"] == 30
        # a 64-byte round trip through a Python RoCE engine: thousands of bytecodes, not tens of thousands x 10
        assert 1000 < rec["bytecodes_per_rt"] < 200_000, (level, rec["bytecodes_per_rt"])
        assert 10 < rec["calls_per_rt"] < rec["bytecodes_per_rt"], (level, rec["calls_per_rt"])
        assert rec["packets_per_rt"] >= 2, (level, rec["packets_per_rt"])  # at least the two SENDs
        assert rec["recoveries"] == 0, (level, rec)
        assert rec["cpu_us_per_rt"] > 0
        assert rec["python"] and "aiordma_commit" in rec
        top_files = {Path(f["file"]).name for f in rec["top"]}
        assert {"rc.py", "wire.py"} <= top_files, (level, top_files)
        assert sum(f["bytecodes_per_rt"] for f in rec["top"]) <= rec["bytecodes_per_rt"] + 1
        by_file = {Path(f).name: v["bytecodes_per_rt"] for f, v in rec["by_file"].items()}
        assert by_file["rc.py"] > 0 and by_file["wire.py"] > 0
        assert abs(sum(v["bytecodes_per_rt"] for v in rec["by_file"].values()) - rec["bytecodes_per_rt"]) < 1
    # the stack runs the same device work plus the connection layer and asyncio
    assert results["stack"]["bytecodes_per_rt"] > results["device"]["bytecodes_per_rt"]
    assert results["stack"]["calls_per_rt"] > results["device"]["calls_per_rt"]
    assert "connection.py" in {Path(f).name for f in results["stack"]["by_file"]}
    # the human-readable tables
    assert stdout.count("bytecodes/RT") >= 6
    assert "Per-message cost: device level" in stdout and "Per-message cost: stack level" in stdout
    assert "stack - device:" in stdout

    # deterministic: the same run again counts the same (the whole point of counting bytecodes)
    again, _ = _cost(tmp_path, "device", "--level", "device", *SMALL)
    [rec] = again["results"]
    assert rec["level"] == "device"
    assert rec["bytecodes_per_rt"] == results["device"]["bytecodes_per_rt"]
    assert rec["calls_per_rt"] == results["device"]["calls_per_rt"]


#: per-message budgets on CPython 3.11, about 1.14x what it counts today (device 7,368 and
#: stack 8,871 bytecodes per round trip): room for small changes, while the cost before the
#: session-3 savings (device 9,143, stack 11,383 by this benchmark) fails. Other CPython
#: versions compile the same code to other bytecode, so they get 30 % more room.
BUDGET = {"device": 8_500, "stack": 10_000}
if sys.version_info[:2] != (3, 11):
    BUDGET = {level: int(n * 1.3) for level, n in BUDGET.items()}


def test_cost_stays_within_budget(tmp_path: Path) -> None:
    """A regression guard that timing cannot give on a noisy host: the work per 64 B
    round trip, counted, stays within budget at both levels."""
    doc, _ = _cost(tmp_path, "budget", "--level", "both", "--iters", "30", "--warmup", "50", "--cpu-iters", "0")
    for rec in doc["results"]:
        assert rec["bytecodes_per_rt"] <= BUDGET[rec["level"]], (
            f"{rec['level']}: {rec['bytecodes_per_rt']:.0f} bytecodes per round trip > budget {BUDGET[rec['level']]}; "
            f"top: {[(f['function'], round(f['bytecodes_per_rt'])) for f in rec['top'][:8]]}"
        )
