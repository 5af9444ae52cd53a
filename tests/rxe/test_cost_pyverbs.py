"""``benchmarks/cost.py`` on the pyverbs provider (kernel Soft-RoCE in the VM).

What a user of real hardware pays per awaited ``conn.write`` is the shared
layers' Python plus the pyverbs wrapper's; bytecode counts do not depend on
how fast the emulated machine is, so the figure counted here holds for any
device. And a one-sided operation aimed at a process costs that process no
Python at all when a NIC (here the kernel's rxe) does the work: the target
level must read exactly 0, while the same run counts the initiator's work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.rxe

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "cost.py"


def test_write_and_target_levels_on_pyverbs(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["AIORDMA_PROVIDER"] = "pyverbs"
    cp = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--level",
            "write,target",
            "--provider",
            "pyverbs",
            "--iters",
            "50",
            "--warmup",
            "20",
            "--cpu-iters",
            "0",
            "--top",
            "40",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert cp.returncode == 0, cp.stderr[-4000:]
    results = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    write = results["write"]
    assert write["provider"].startswith("pyverbs:") and write["engine"] == "pyverbs", write["provider"]
    layers = write["by_layer"]
    assert layers["shared"] > 50, layers  # Connection and completion dispatch run in Python on any device
    assert "aiordma/connection.py" in write["by_file"], write["by_file"]
    assert not any(f.startswith("aiordma/providers/soft/") for f in write["by_file"]), write["by_file"]
    # the extended verbs (ibv_wr_*) and the completion tables: the provider's Python and
    # pyverbs' own (its objects' logging.getLogger) stay within their budget; 387 when
    # recorded (they were 795 with a SendWR and an SGE object per write)
    assert layers["device"] + layers["other"] <= 420, (layers, write["top"][:10])
    print(f"pyverbs: shared layers {layers['shared']:.0f}, device {layers['device']:.0f}, "
          f"event loop {layers['event loop']:.0f} bytecodes per awaited write")  # fmt: skip
    for op in ("write", "read", "cas", "faa"):
        rec = results[f"target.{op}"]
        assert rec["provider"].startswith("pyverbs:"), rec
        # the kernel's rxe does the responder's work: the target process runs no Python for it
        assert rec["bytecodes_per_op"] == 0, (op, rec["top"][:5], rec["by_thread"])
