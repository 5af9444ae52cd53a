"""``aiordma doctor`` on this machine, with distributed installed: it finds the
``rdma://`` backend through Dask's registry, and a bad setting is named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _doctor(**env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "aiordma.cli", "doctor", "--json"],
        env=dict(os.environ, PYTHONPATH=str(ROOT), **env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode in (0, 1), out.stderr
    report = json.loads(out.stdout)
    (check,) = [c for c in report["checks"] if c["name"] == "Dask backend"]
    return check


def test_doctor_shows_the_backend() -> None:
    check = _doctor()
    assert check["status"] == "ok"
    assert check["data"]["ours"] is True
    assert "aiordma.integrations.dask:RDMABackend" in check["data"]["entry_points"]


def test_doctor_names_a_bad_setting() -> None:
    check = _doctor(DASK_DISTRIBUTED__COMM__RDMA__GID_INDEX="first")
    assert check["status"] == "warn"
    assert "gid-index" in check["seen"]
