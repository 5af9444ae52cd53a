"""examples/dask_transpose.py as a user runs it: its own LocalCluster over
rdma://, the result, and the bytes the workers fetched from each other, as
Dask logged them and as the backend counted them (the same figures)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "dask_transpose.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_the_example_runs_its_own_cluster_and_reports_the_bytes() -> None:
    out = _run("-n", "2000", "--chunk", "500")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"\(x \+ x\.T\)\.sum\(\) = [\d,]+\.\d+ over rdma://127\.0\.0\.1:\d+", out.stdout)
    fetched = [float(m.replace(",", "")) for m in re.findall(r"fetched ([\d,.]+) MB from other workers", out.stdout)]
    received = re.findall(r"rdma:// received ([\d,.]+) MB from them, ([\d,.]+) MB as large frames", out.stdout)
    assert len(fetched) == len(received) == 2
    for log, (rx, large) in zip(fetched, received):
        # the backend saw every byte Dask logged (to the 0.1 MB the report prints)
        assert float(rx.replace(",", "")) >= log and float(large.replace(",", "")) >= log - 0.1
    assert sum(fetched) > 0


def test_bad_arguments_are_one_line_and_exit_2() -> None:
    out = _run("tcp://127.0.0.1:8786")
    assert out.returncode == 2
    assert "must be rdma://HOST:PORT" in out.stderr and "Traceback" not in out.stderr
