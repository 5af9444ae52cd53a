"""benchmarks/dask_comm.py end to end, small: every bar on one loop, with the
figures and the verdicts a report is made of (the real run is minutes long)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine_neutral  # the same on every engine and core: CI's reference run leaves it out

ROOT = Path(__file__).resolve().parents[2]


def test_every_bar_runs_and_reports(tmp_path: Path) -> None:
    out_json = tmp_path / "bars.json"
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "dask_comm.py"),
            "--quick",
            "--loops",
            "asyncio",
            "--size",
            str(1 << 20),
            "--cluster-size",
            "800",
            "--workload-size",
            "1000",
            "--json",
            str(out_json),
        ],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out_json.read_text())
    assert doc["engine"] in ("python", "native")
    verdicts = {v["bar"]: v for v in doc["verdicts"]}
    assert set(verdicts) == {"comm_bw", "pingpong", "cluster", "workload transpose_sum", "workload rechunk_sum"}
    for v in verdicts.values():
        assert v["rdma"] > 0 and v["tcp"] > 0 and v["ratio"] == v["rdma"] / v["tcp"]
        assert isinstance(v["met"], bool)
    assert verdicts["comm_bw"]["raw_aiordma"] > 0
    assert verdicts["cluster"]["same_result"] is True
    assert verdicts["cluster"]["accounted"] is True
    for name in ("transpose_sum", "rechunk_sum"):
        workload = verdicts[f"workload {name}"]
        assert workload["same_result"] is True
        assert workload["rdma_cpu_s"] > 0 and workload["tcp_cpu_s"] > 0
    assert "| comm_bw | asyncio |" in out.stdout and "Reproduce:" in out.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (["--only", "nope"], "unknown bar 'nope'"),
        (["--size", "0"], "--size: 0 is less than 8 bytes"),
        (["--rounds", "0"], "--rounds: 0 is less than 1"),
        (["--cluster-size", "6"], "--cluster-size must be a multiple of 4"),
        (["--cluster-computes", "0"], "--cluster-computes: 0 is less than 1"),
        (["--workload-size", "150"], "--workload-size must be a multiple of 100"),
    ],
)
def test_bad_arguments_exit_2(args: list[str], says: str) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "dask_comm.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr
