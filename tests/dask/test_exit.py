"""A Dask script that ends without closing its client exits as tcp:// does.

``Client(LocalCluster(protocol="rdma"))`` in a ``__main__`` script with no
explicit close: Dask's own exit handlers close the client and the cluster.
aiordma's must not close the soft device under them (its connections belong
to Dask's IO thread, still running then): that stalled every clean close
until its timeout (16.5-17.3 s to exit, 21 tracebacks, where tcp:// took 4.3 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from dask.distributed import Client, LocalCluster

if __name__ == "__main__":
    client = Client(LocalCluster(protocol=sys.argv[1], n_workers=2, threads_per_worker=1, dashboard_address=None))
    assert client.submit(lambda x: x + 1, 1).result() == 2
    print("computed", flush=True)
"""


def run(tmp_path: Path, protocol: str) -> tuple[float, str]:
    script = tmp_path / "unclosed_client.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    env["PYTHONPATH"] = str(ROOT)
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(script), protocol], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "computed", out.stdout
    return took, out.stderr


@pytest.mark.timeout(300)
def test_an_unclosed_client_exits_as_fast_and_as_quietly_as_tcp(tmp_path: Path) -> None:
    tcp, _ = run(tmp_path, "tcp")
    rdma, stderr = run(tmp_path, "rdma")
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "RETRY_EXC" not in stderr, stderr[-3000:]
    # the bar is 1.5x tcp://; the slack keeps a loaded machine's start-up jitter out of it
    assert rdma <= 1.5 * tcp + 2.0, f"rdma:// exited in {rdma:.1f} s, tcp:// in {tcp:.1f} s"
