"""``benchmarks/cost.py``: the per-operation cost benchmark (bytecodes, every thread).

Runs the real script in subprocesses with small iteration counts and checks
its JSON record: every level present with plausible figures, the layers and
files the work belongs to, the target process's count, the count repeating
exactly from one run to the next (the point of counting bytecodes instead of
timing), and every level within the budget recorded for this CPython minor
version and engine in ``benchmarks/cost_budget.json``. The counter itself
is tested in-process: it sees the first counted call, covers threads, and
refuses to report zeros when opcode events do not arrive.

Function names are not asserted: the code is being optimised, only file
names and layers are stable.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "cost.py"
TIMEOUT = 120
SMALL = ("--iters", "40", "--warmup", "50", "--cpu-iters", "20", "--top", "60")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for var in [k for k in env if k.startswith("AIORDMA_")]:
        env.pop(var)
    env.update(extra)
    return env


def _cost(tmp_path: Path, name: str, *args: str, env: dict[str, str] | None = None) -> tuple[dict, str, int, str]:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env or _env(),
        cwd=ROOT,
    )
    assert proc.returncode in (0, 1), f"cost.py {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text()), proc.stdout, proc.returncode, proc.stderr


def _engines() -> list[str]:
    """The soft-device engines this build has (the native one only once it is built)."""
    code = (
        "from aiordma.providers import open_device\n"
        "d = open_device('soft')\n"
        "print(getattr(d, 'engine', 'python'))\n"
        "d.close()\n"
    )
    found = ["python"]
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        env=_env(AIORDMA_SOFT_ENGINE="native"),
        cwd=ROOT,
    )
    if proc.returncode == 0 and proc.stdout.strip() == "native":
        found.append("native")
    return found


ENGINES = _engines()


def _by_name(doc: dict) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in doc["results"]}


def test_cost_benchmark_every_level(tmp_path: Path) -> None:
    doc, stdout, code, _ = _cost(tmp_path, "all", "--level", "all", *SMALL)
    assert code == 0
    results = _by_name(doc)
    assert sorted(results) == sorted(
        ["device", "stack", "write", "target.write", "target.read", "target.cas", "target.faa"]
    )
    python_engine = results["device"]["engine"] == "python"
    for name, rec in results.items():
        assert rec["iters"] == 40
        assert rec["python"] and "aiordma_commit" in rec and rec["counter"] in ("sys.monitoring", "sys.settrace")
        assert rec["recoveries"] == 0, (name, rec)
        # the parts add up: per layer, per file, and the top functions are a subset
        assert abs(sum(rec["by_layer"].values()) - rec["bytecodes_per_op"]) < 1, name
        assert abs(sum(v["bytecodes_per_op"] for v in rec["by_file"].values()) - rec["bytecodes_per_op"]) < 1, name
        assert sum(f["bytecodes_per_op"] for f in rec["top"]) <= rec["bytecodes_per_op"] + 1
        # the benchmark's own driving code is not counted; only what it marks as the application
        app = {f["function"].rpartition(".")[2] for f in rec["top"] if f["layer"] == "application"}
        assert app <= {"round_trip", "round_trip_nic", "_expect", "_reap", "echo"}, (name, app)

    for level in ("device", "stack"):
        rec = results[level]
        assert rec["bytecodes_per_rt"] == rec["bytecodes_per_op"]
        assert rec["packets_per_op"] == 4, (level, rec["packets_per_op"])  # SEND + ACK each way
        assert rec["cpu_us_per_op"] > 0
    # the stack runs the device's work plus the connection layer and the event loop
    assert results["stack"]["bytecodes_per_op"] > results["device"]["bytecodes_per_op"]
    assert results["stack"]["by_layer"]["shared"] > results["device"]["by_layer"]["shared"]
    assert results["stack"]["by_layer"]["event loop"] > 0
    assert "aiordma/connection.py" in results["stack"]["by_file"]

    # an awaited write: the shared layers run on every engine and provider
    write = results["write"]
    assert write["unit"] == "awaited write"
    # (the compiled core runs the rest of the per-operation path: no bytecodes, which is
    # why benchmarks/instructions.py counts machine instructions instead)
    assert 10 < write["by_layer"]["shared"] < 5000, write["by_layer"]
    assert "aiordma/connection.py" in write["by_file"]
    if python_engine:
        assert "aiordma/completion.py" in write["by_file"]  # the dispatcher delivers each completion
    assert write["by_layer"]["event loop"] > 0  # asyncio's loop is Python (uvloop's is not)

    for op in ("write", "read", "cas", "faa"):
        rec = results[f"target.{op}"]
        assert rec["unit"] == "one-sided op" and rec["op"] == op
        assert rec["by_layer"]["shared"] == 0  # no connection code runs in a target for a one-sided op
        if rec["engine"] == "native":
            assert rec["bytecodes_per_op"] == 0, rec["top"][:5]
    if python_engine:
        # the Python engine's RC engine and wire codec do the work, on both sides
        for name in ("device", "stack", "write", "target.write", "target.faa"):
            files = {Path(f).name for f in results[name]["by_file"]}
            assert {"rc.py", "wire.py"} <= files, (name, files)
        assert 1000 < results["device"]["bytecodes_per_op"] < 200_000
        assert results["device"]["mode"] == "manual"
        assert [t["thread"] for t in results["device"]["by_thread"]] == ["MainThread"]  # serviced by hand
        for op in ("write", "read", "cas", "faa"):
            assert results[f"target.{op}"]["bytecodes_per_op"] > 500
        # the target's NIC runs on its event loop's thread (loop assist) and on the NIC thread
        threads = {t["thread"] for t in results["target.write"]["by_thread"]}
        assert "MainThread" in threads, threads
        assert not any("control" in t for t in threads), threads  # the harness thread is not counted

    # the human-readable tables
    assert stdout.count("Per-operation cost:") == 7
    assert "stack - device:" in stdout and "per awaited write: shared layers" in stdout
    assert "target process per one-sided op:" in stdout and "by layer" in stdout and "by file" in stdout


def test_cost_counts_repeat_exactly(tmp_path: Path) -> None:
    """Deterministic levels count the same twice (the whole point of counting bytecodes)."""
    first, _, _, _ = _cost(tmp_path, "one", "--level", "device,write", *SMALL)
    again, _, _, _ = _cost(tmp_path, "two", "--level", "device,write", *SMALL)
    a, b = _by_name(first), _by_name(again)
    if a["device"]["mode"] == "manual":
        assert a["device"]["bytecodes_per_op"] == b["device"]["bytecodes_per_op"]
        assert a["device"]["calls_per_op"] == b["device"]["calls_per_op"]
    else:  # NIC threads: an event can find its completion already there
        assert a["device"]["bytecodes_per_op"] == pytest.approx(b["device"]["bytecodes_per_op"], rel=0.02)
    # the shared layers' path per write does not depend on timing: a few dozen bytecodes with the
    # compiled core. (It did while cost.py kept the native engine's 2 ms expect window: on a loaded
    # host a peer's ACK could come after it and the NIC thread handed the completion over, a longer
    # path: 24.0 quiet, 28.2 to 32.1 under CI's load. cost.py stretches the window 50x now, as
    # instructions.py does; 24.0 in 6 runs of 6 beside two CPU-bound processes on the 2-core VM.
    # The absolute slack is one write of the 40 taking the hand-over.)
    assert a["write"]["by_layer"]["shared"] == pytest.approx(b["write"]["by_layer"]["shared"], rel=0.02, abs=2)


@pytest.mark.parametrize("engine", ENGINES)
def test_cost_stays_within_budget(tmp_path: Path, engine: str) -> None:
    """A regression guard that timing cannot give on a noisy host: the work per
    operation, counted, stays within the budget recorded for this CPython minor
    version and engine (benchmarks/cost_budget.json; an engine without a record
    is held to the issue's bars)."""
    doc, stdout, code, stderr = _cost(
        tmp_path, "budget", "--level", "all", *SMALL, "--check", env=_env(AIORDMA_SOFT_ENGINE=engine)
    )
    assert {r["engine"] for r in doc["results"]} == {engine}
    assert code == 0, stderr[-4000:]
    assert "within the budgets of cost_budget.json" in stdout


def test_budget_file_covers_supported_pythons() -> None:
    """Every CPython minor version the project supports has a recorded Python-engine
    baseline, and each budget is its recorded figure plus the stated margin."""
    doc = json.loads((ROOT / "benchmarks" / "cost_budget.json").read_text())
    margins = doc["margins"]
    assert 0 < margins["deterministic"] <= margins["timing"] < 1
    for minor in ("3.11", "3.12", "3.13"):
        entry = doc["budgets"][minor]["python"]
        assert {"device", "device.library", "stack", "write", "write.shared", "target.write", "target.faa"} <= set(
            entry
        )
        for name, b in entry.items():
            assert b["recorded"] <= b["budget"] <= b["recorded"] * (1 + margins["timing"]) + margins["floor"] + 1, (
                minor,
                name,
                b,
            )
    assert (
        doc["bars"]["device.library"] == 300 and doc["bars"]["write.shared"] == 600 and doc["bars"]["target.cas"] == 0
    )


# ------------------------------------------------------------ the counter ----


def _load_cost() -> ModuleType:
    spec = importlib.util.spec_from_file_location("aiordma_cost_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def cost() -> ModuleType:
    return _load_cost()


def _work(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def _ops_of(counter: Any, fn: Any) -> int:
    return sum(f.ops for f in counter.functions() if f.function == fn.__qualname__)


def test_counter_counts_the_first_call_and_every_thread(cost: ModuleType) -> None:
    counter = cost.BytecodeCounter()
    counter.prepare()
    go, done = threading.Event(), threading.Event()

    def worker() -> None:  # started before counting (after prepare) and already running
        go.wait(10)
        _work(100)
        done.set()

    t = threading.Thread(target=worker)
    t.start()
    try:
        counter.start()
        try:
            _work(10)  # the very first traced call counts (3.12's settrace missed it)
            go.set()
            assert done.wait(10)
        finally:
            counter.stop()
        t.join(10)
    finally:
        counter.close()
    per_call = _ops_of(counter, _work)
    assert per_call > 0
    threads = {name: ops for name, ops, _calls in counter.threads()}
    assert len(threads) >= 2, threads  # this thread and the worker
    # _work(100) costs more than _work(10): both were counted, in different threads
    assert sum(f.calls for f in counter.functions() if f.function == "_work") == 2
    counter.self_test()


def test_counter_fails_loudly_without_opcode_events(cost: ModuleType) -> None:
    """Fault injection: opcode events that never arrive must not read as 0 bytecodes."""
    counter = cost.BytecodeCounter()
    if counter.backend == "sys.monitoring":
        counter._on_instruction = lambda code, offset: None
    else:
        original = counter._local_trace

        def no_opcodes(frame, event, arg):  # type: ignore[no-untyped-def]
            return original(frame, "line" if event == "opcode" else event, arg)

        counter._local_trace = no_opcodes
    counter.prepare()
    try:
        counter.start()
        try:
            _work(10)
        finally:
            with pytest.raises(cost.CountingError, match="no bytecodes"):
                counter.stop()
    finally:
        counter.close()


def test_cost_cli_errors(tmp_path: Path) -> None:
    for args, needle in (
        (["--level", "nonsense"], "unknown level nonsense"),
        (["--iters", "0"], "--iters must be positive"),
        (["--check", "--loop", "uvloop"], "--check and --record use the settings"),
    ):
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT
        )
        assert proc.returncode == 2, (args, proc.stderr)
        assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
