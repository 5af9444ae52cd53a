"""``benchmarks/large_messages.py`` runs end to end (tiny sizes) and reports every way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_large_messages_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "large.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "large_messages.py"),
            "--size",
            "1M",
            "--count",
            "2",
            "--rounds",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"send/recv", "send/recv_into", "rdma write", "tcp streams", "tcp recv_into"}
    for way, r in doc["results"].items():
        assert r["median_mib_s"] > 0 and r["cpu_ms_per_msg"] > 0, (way, r)
    assert "| send/recv_into |" in proc.stdout


def test_large_messages_benchmark_rejects_bad_arguments() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "large_messages.py"), "--count", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--count" in proc.stderr
