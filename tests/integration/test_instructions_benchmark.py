"""``benchmarks/instructions.py``: instructions per operation under callgrind.

Runs the real script (valgrind around the initiator, a target process beside it)
with small counts, twice, and checks its JSON record: the figures present and
plausible (split by where they ran: the interpreter, the native engine, uvloop;
the packets each operation takes), the two runs agreeing, and every figure within
the budget recorded for this CPython minor version and engine in
``benchmarks/instructions_budget.json``. Without valgrind those tests skip (CI
has it); the parser of callgrind's files, the client requests outside valgrind
and the budget file are tested without it.

Tolerances between two runs, from measurement (the 2-core development VM, under
load): a write served by the target repeats within 0.5 %, a 64 B write on
asyncio within 0.5 % (held to 2 %: a counted process sees the same paths and environment
wherever the checkout is, see ``CountedPaths``); a send round trip on asyncio moved by up to 7 % from run to run (whether
the peer's ACK and its reply arrive in one receive batch or two depends on the
peer's timing).

Only ``write64`` and ``send64`` (and the target's ``write64``) run here, each in a
counted process of its own as the recording counts every operation, with the
recording's phase lengths (5 phases of 100 operations after 100 warm-up), so the
figures are the ones recorded (within 0.5 % from one process to the next, under load
too; the deterministic margin is 2 %): about 17 s per run on the 2-core VM. ``read64`` costs what ``write64`` does; ``write4k_d16`` is
covered by a full ``--check`` run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "instructions.py"
BUDGET = ROOT / "benchmarks" / "instructions_budget.json"
TIMEOUT = 300
#: the recording's phase lengths (instructions.py's defaults): a figure counted with other
#: phase lengths differs (the garbage collector's passes fall differently), so the guard
#: counts under the conditions it compares with
SMALL = ("--iters", "100", "--repeats", "5", "--warmup", "100", "--cpu-iters", "200")
OPS = ("--ops", "write64,send64", "--target-ops", "write64")

needs_valgrind = pytest.mark.skipif(
    shutil.which("valgrind") is None or platform.machine() != "x86_64",
    reason="valgrind is not installed (apt-get install valgrind)"
    if shutil.which("valgrind") is None
    else f"the client requests are x86-64 code, this is {platform.machine()}",
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for var in [k for k in env if k.startswith("AIORDMA_") and k != "AIORDMA_SOFT_ENGINE"]:
        env.pop(var)
    return env


def _run(out: Path, *args: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env(),
        cwd=ROOT,
    )
    assert proc.returncode in (0, 1), f"instructions.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text()), proc


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("instructions") / "first.json"
    return _run(out, "--loop", "asyncio,uvloop", *OPS, *SMALL, "--check")


@pytest.fixture(scope="module")
def second(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("instructions") / "second.json"
    return _run(out, "--loop", "asyncio", *OPS, *SMALL, "--cpu-iters", "0")[0]


def _by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in doc["results"]}


@needs_valgrind
def test_figures_present_and_plausible(first: tuple[dict[str, Any], Any]) -> None:
    doc, proc = first
    results = _by_name(doc)
    assert sorted(results) == sorted(
        ["asyncio.write64", "asyncio.send64", "uvloop.write64", "uvloop.send64", "target.write64"]
    )
    assert doc["python"] == platform.python_version() and doc["valgrind"]
    assert "--tool=callgrind" in doc["command"] and "--instr-atstart=no" in doc["command"]
    assert doc["iters"] == 100 and doc["repeats"] == 5
    native = doc["engine"] == "native"
    for name, r in results.items():
        assert r["recoveries"] == 0 and r["peer_recoveries"] == 0, (name, r)
        assert len(r["phases_per_op"]) == 5
        # the parts add up to the total (the empty phase is subtracted from each)
        assert abs(sum(r["by_part"].values()) - r["instructions_per_op"]) <= 0.01 * r["instructions_per_op"] + 50, r
        if r["side"] == "target":
            continue
        # the whole process: the interpreter most of it, the engine's C, libc
        assert 10_000 < r["instructions_per_op"] < 5_000_000, (name, r["instructions_per_op"])
        assert r["by_part"]["interpreter"] > 0.5 * r["instructions_per_op"], r["by_part"]
        assert r["by_part"]["libc"] > 0
        if native:
            assert r["by_part"]["aiordma native"] > 1000, r["by_part"]
        assert (r["by_part"]["uvloop"] > 0) == (r["loop"] == "uvloop"), r["by_part"]
        assert r["cpu_us_per_op"] > 0 and r["wall_us_per_op"] > 0
    for loop in ("asyncio", "uvloop"):
        assert results[f"{loop}.write64"]["packets_per_op"] == 1.0  # one RDMA Write (its ACK is received)
        assert results[f"{loop}.send64"]["packets_per_op"] == 2.0  # the SEND and the ACK of the reply
        # a round trip does more than a write: two completions, a message each way
        assert results[f"{loop}.send64"]["instructions_per_op"] > results[f"{loop}.write64"]["instructions_per_op"]
    # uvloop's loop is C: less of the interpreter per write than asyncio's
    assert results["uvloop.write64"]["by_part"]["interpreter"] < results["asyncio.write64"]["by_part"]["interpreter"]
    served = results["target.write64"]
    assert served["unit"] == "one-sided op served" and served["packets_per_op"] == 1.0
    assert 200 < served["instructions_per_op"] < 1_000_000
    if native:  # the target's NIC thread serves it in C: no Python runs there
        assert abs(served["by_part"]["interpreter"]) < 0.05 * served["instructions_per_op"], served["by_part"]
        assert served["by_part"]["aiordma native"] > 0.5 * served["instructions_per_op"], served["by_part"]
    assert "Instructions per operation" in proc.stdout and "reproduce: python benchmarks/instructions.py" in proc.stdout


@needs_valgrind
def test_within_budget(first: tuple[dict[str, Any], subprocess.CompletedProcess[str]]) -> None:
    """The regression guard: every figure within the budget recorded for this
    CPython minor version and engine (benchmarks/instructions_budget.json)."""
    doc, proc = first
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "within the budgets of instructions_budget.json" in proc.stdout


@needs_valgrind
def test_two_runs_agree(first: tuple[dict[str, Any], Any], second: dict[str, Any]) -> None:
    a, b = _by_name(first[0]), _by_name(second)
    # a write served: the target's NIC thread wakes as the writes come, so its count moves
    # with the machine's load (the native engine's: 2,041 and 2,064 on 3.12 in a clean-clone
    # CI run with another suite beside it; the Python engine's phases spread by up to 1.4 %
    # within one run): held to the deterministic margin, 2 %
    served = 0.02
    # two processes counting one awaited write agree within 0.5 % now that a counted process
    # sees the same paths and environment in every run (instructions.CountedPaths); before,
    # a clean clone and the working tree counted 3.12's write 2.5 % apart
    for name, rel in (("asyncio.write64", 0.02), ("target.write64", served), ("asyncio.send64", 0.1)):
        x, y = a[name]["instructions_per_op"], b[name]["instructions_per_op"]
        assert y == pytest.approx(x, rel=rel), (name, x, y, a[name]["phases_per_op"], b[name]["phases_per_op"])


@needs_valgrind
def test_the_checkout_path_does_not_move_a_figure(tmp_path: Path) -> None:
    """The same tree reached by a path of another length counts the same: a clean
    clone at /check/work/main counted 3.13's uvloop write 2.3 % above the recording
    made at /work/main, because the checkout's path reached the counted process (an
    editable install's finder, a resolved script path): now nothing of it does."""
    far = tmp_path / "a-checkout-path-of-another-length"
    far.mkdir()
    (far / "main").symlink_to(ROOT, target_is_directory=True)
    figures = []
    for script in (SCRIPT, far / "main" / "benchmarks" / "instructions.py"):
        out = tmp_path / f"{len(figures)}.json"
        proc = subprocess.run(
            [sys.executable, str(script), "--loop", "uvloop", "--ops", "write64", "--target-ops", "", *SMALL,
             "--cpu-iters", "0", "--json", str(out)],
            capture_output=True, text=True, timeout=TIMEOUT, env=_env(), cwd=script.parent,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        figures.append(_by_name(json.loads(out.read_text()))["uvloop.write64"]["instructions_per_op"])
    assert figures[1] == pytest.approx(figures[0], rel=0.005), figures


# ------------------------------------------------- without valgrind ----


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("aiordma_instructions_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def instructions() -> ModuleType:
    return _load()


DUMP = """\
# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 7
part: 3

desc: Trigger: Client Request: write64:1

positions: line
events: Ir
summary: 1000

ob=/usr/lib/libpython3.11.so.1.0
fl=ceval.c
fn=_PyEval_EvalFrameDefault
0 600
cob=/usr/lib/x86_64-linux-gnu/libc.so.6
cfi=memcpy.S
cfn=memcpy
calls=2 0
0 150

ob=/usr/lib/x86_64-linux-gnu/libc.so.6
fl=memcpy.S
fn=memcpy
0 150

ob=/work/aiordma/providers/soft/_native/_engine.cpython-311-x86_64-linux-gnu.so
fl=nic.c
fn=nic_service
0 200
0

ob=/venv/lib/python3.11/site-packages/uvloop/loop.cpython-311-x86_64-linux-gnu.so
fl=loop.c
fn=poll
0 40
ob=/usr/lib/python3.11/lib-dynload/_asyncio.cpython-311-x86_64-linux-gnu.so
fl=x.c
fn=task_step
0 10
"""


def test_parse_dump_splits_by_object(instructions: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "callgrind.out.7.3"
    path.write_text(DUMP)
    d = instructions.parse_dump(path, "/usr/bin/python3.11")
    assert d["label"] == "write64:1" and d["ir"] == 1000
    # a call's inclusive cost (the 150 after calls=) is counted where it ran, once
    assert d["parts"] == {
        "interpreter": 600,
        "aiordma native": 200,
        "cpython modules": 10,
        "uvloop": 40,
        "libc": 150,
        "other": 0,
    }
    assert sum(d["parts"].values()) == d["ir"]


MISSES = """\
# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 7
part: 4

desc: Trigger: Client Request: write64:2

positions: line
events: Ir
summary: 2000

ob=/usr/lib/libpython3.11.so.1.0
fl=typeobject.c
fn=_PyType_Lookup
0 900
cfn=find_name_in_mro
calls=3 0
0 750
cfn=_PyDict_GetItem_KnownHash
calls=1 0
0 100

fn=find_name_in_mro
0 400
cfn=_PyDict_GetItem_KnownHash
calls=6 0
0 350

fn=_PyDict_GetItem_KnownHash
0 450
"""


def test_parse_dump_counts_the_type_caches_misses_apart(instructions: ModuleType, tmp_path: Path) -> None:
    """A call of CPython's MRO walk is a type-cache miss: its calls and inclusive
    cost (callees included) are counted, and nothing else is."""
    path = tmp_path / "callgrind.out.7.4"
    path.write_text(MISSES)
    d = instructions.parse_dump(path, "/usr/bin/python3.11")
    assert d["parts"]["interpreter"] == 1750 and d["ir"] == 2000
    assert d["type_cache_misses"] == 3
    assert d["type_cache_miss_ir"] == 750


def test_figures_leave_the_type_caches_misses_out(instructions: ModuleType) -> None:
    """Two layouts of the same work (one with three misses of 250 a phase) give one figure."""

    def dump(ir: int, misses: int) -> dict[str, Any]:
        return {
            "ir": ir + 250 * misses,
            "parts": dict.fromkeys(instructions.PARTS, 0) | {"interpreter": ir + 250 * misses},
            "type_cache_misses": misses,
            "type_cache_miss_ir": 250 * misses,
        }

    plain = {"w:empty": dump(500, 0), "w:1": dump(10_500, 0), "w:2": dump(10_500, 0), "w:3": dump(10_500, 0)}
    missing = {"w:empty": dump(500, 1), "w:1": dump(10_500, 31), "w:2": dump(10_500, 31), "w:3": dump(10_500, 31)}
    a, b = instructions.figures_of(plain, "w", 10, 3), instructions.figures_of(missing, "w", 10, 3)
    assert a["instructions_per_op"] == b["instructions_per_op"] == 1000
    assert b["by_part"]["interpreter"] == 1000
    assert (a["type_cache_misses_per_op"], b["type_cache_misses_per_op"]) == (0, 3)
    assert b["type_cache_miss_instructions_per_op"] == 750


def test_figures_are_the_median_phase_less_the_empty_one(instructions: ModuleType) -> None:
    def dump(ir: int) -> dict[str, Any]:
        return {"ir": ir, "parts": dict.fromkeys(instructions.PARTS, 0) | {"interpreter": ir}}

    dumps = {"w:empty": dump(500), "w:1": dump(10_500), "w:2": dump(12_500), "w:3": dump(10_700)}
    f = instructions.figures_of(dumps, "w", 10, 3)
    assert f["instructions_per_op"] == 1020  # (10,700 - 500) / 10
    assert f["phases_per_op"] == [1000, 1200, 1020]
    assert f["by_part"]["interpreter"] == 1020
    assert f["boundary_instructions"] == 500


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the client requests are x86-64 code")
def test_client_requests_do_nothing_outside_valgrind(instructions: ModuleType) -> None:
    cr = instructions.ClientRequests()
    assert cr.running_on_valgrind() == 0
    assert cr.request(cr.DUMP_STATS_AT, cr.label("x"), default=12345) == 12345  # the default comes back
    cr.start_instrumentation()
    cr.stop_instrumentation()


def test_budget_file_covers_supported_pythons() -> None:
    doc = json.loads(BUDGET.read_text())
    margins = doc["margins"]
    assert 0 < margins["deterministic"] <= margins["timing"] <= margins["other_machine"] < 1
    for minor in ("3.11", "3.12", "3.13"):
        entry = doc["budgets"][minor]["native"]
        names = set(entry["figures"])
        for loop in ("asyncio", "uvloop"):
            assert {f"{loop}.{op}" for op in ("write64", "read64", "send64", "write4k_d16")} <= names, (minor, names)
        assert {"target.write64", "target.read64"} <= names
        assert entry["machine"]["python_build"].startswith(minor)
        for name, b in entry["figures"].items():
            timing = name.split(".", 1)[1] in doc["timing_ops"]
            margin = margins["timing" if timing else "deterministic"]
            assert b["recorded"] <= b["budget"] <= b["recorded"] * (1 + margin) + 1, (minor, name, b)


def test_check_fails_clearly_without_a_record(instructions: ModuleType, tmp_path: Path) -> None:
    doc = {"engine": "nonexistent", "results": []}
    failures, _ = instructions.check_budgets(doc, BUDGET)
    assert len(failures) == 1 and "no budget recorded for Python" in failures[0] and "--record" in failures[0]
    # a figure the entry lacks fails too, naming itself
    budget = tmp_path / "budget.json"
    budget.write_text(
        json.dumps(
            {
                "margins": {"deterministic": 0.02, "timing": 0.1, "other_machine": 0.25},
                "timing_ops": [],
                "budgets": {instructions.budget_key(): {"native": {"figures": {}, "machine": {}}}},
            }
        )
    )
    rec = {"name": "asyncio.write64", "unit": "write", "instructions_per_op": 1, "recoveries": 0, "peer_recoveries": 0}
    failures, _ = instructions.check_budgets({"engine": "native", "results": [rec]}, budget)
    assert len(failures) == 1 and failures[0].startswith("asyncio.write64: no budget recorded")


def test_a_type_cache_missing_on_every_lookup_fails_the_check(instructions: ModuleType, tmp_path: Path) -> None:
    """Misses are left out of the figure, not let through: more than the cap per
    operation (a type modified on every operation) fails --check."""
    budget = tmp_path / "budget.json"
    figures = {"asyncio.write64": {"recorded": 1000, "budget": 1020}}
    budget.write_text(
        json.dumps(
            {
                "margins": {"deterministic": 0.02, "timing": 0.1, "other_machine": 0.25},
                "timing_ops": [],
                "budgets": {instructions.budget_key(): {"native": {"figures": figures, "machine": {}}}},
            }
        )
    )
    rec = {
        "name": "asyncio.write64",
        "unit": "write",
        "instructions_per_op": 1000,
        "recoveries": 0,
        "peer_recoveries": 0,
    }
    for misses, failed in ((1.0, False), (instructions.MAX_TYPE_CACHE_MISSES_PER_OP + 1, True)):
        failures, _ = instructions.check_budgets(
            {"engine": "native", "results": [rec | {"type_cache_misses_per_op": misses}]}, budget
        )
        assert bool(failures) is failed, failures
        assert not failed or "type-cache misses per write" in failures[0]


def test_without_valgrind_it_says_so(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "git").symlink_to(shutil.which("git") or "/usr/bin/git")
    env = _env()
    env["PATH"] = str(bindir)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--ops", "write64"], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT
    )
    assert proc.returncode == 3, proc.stderr
    assert "valgrind is not installed" in proc.stderr and "Traceback" not in proc.stderr


def test_a_counted_process_sees_only_what_it_imports(instructions: ModuleType, tmp_path: Path) -> None:
    """No site, no script directory, and one directory of links on its path."""
    paths = instructions.CountedPaths(str(tmp_path))
    assert paths.argv[1:3] == ["-S", "-P"] and paths.argv[-1].startswith(str(tmp_path / "s"))
    env = paths.env({"PYTHONPATH": "/elsewhere", "HOME": "/root"})
    assert env["PYTHONPATH"] == str(tmp_path / "p") and env["PATH"] == "/usr/bin:/bin"
    linked = sorted(p.name for p in (tmp_path / "p").iterdir())
    assert linked == sorted(["aiordma", *instructions.COUNTED_PACKAGES])
    assert (tmp_path / "p" / "aiordma" / "__init__.py").exists()
    # what the counted child imports is all there: it runs with that path and nothing else
    probe = subprocess.run(
        [*paths.argv[:3], "-c", "import aiordma, uvloop, msgpack, isal, sys; print(sys.flags.no_site)"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert probe.returncode == 0 and probe.stdout.strip() == "1", probe.stderr
