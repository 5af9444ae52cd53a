"""``aiordma doctor`` against kernel Soft-RoCE (rxe0 in the VM):

scripts/rxe-vm run -- .venv/bin/python -m pytest tests/rxe/test_doctor_rxe.py -m rxe -q
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from aiordma.tools import doctor
from aiordma.tools.doctor import FAIL, OK, Options, Probe

pytestmark = pytest.mark.rxe

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICE = os.environ.get("AIORDMA_RXE_DEVICE", "rxe0")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIORDMA_") or k.startswith("AIORDMA_RXE")}
    env.update(extra)
    return env


def test_doctor_finds_rxe0_and_the_ipv4_roce_v2_gid():
    report = doctor.diagnose_sync(Options(), Probe(env=_env()))
    assert report.plan.provider == "pyverbs" and report.plan.device == DEVICE, report.plan
    assert report.get("kernel RDMA").status == OK
    assert "rdma_rxe" in report.get("kernel RDMA").data["modules"]
    devices = report.get("devices")
    assert devices.status == OK and f"{DEVICE}: rdma_rxe (Soft-RoCE)" in devices.seen
    port = report.get(f"port {DEVICE}/1")
    assert port.status == OK and "PORT_ACTIVE" in port.seen
    gid = report.get(f"gid {DEVICE}/1")
    assert gid.status == OK, gid
    if os.environ.get("AIORDMA_RXE_GID_INDEX"):
        assert gid.data["gid_index"] == int(os.environ["AIORDMA_RXE_GID_INDEX"])
    assert "first RoCE v2 GID with an IPv4 address" in gid.seen
    if os.environ.get("AIORDMA_RXE_IP"):
        assert f"::ffff:{os.environ['AIORDMA_RXE_IP'].split('/')[0]}" in gid.seen
    mtu = report.get(f"mtu {DEVICE}/1")
    assert mtu.status == OK, mtu
    assert mtu.data["active_mtu"] == doctor.roce_mtu(mtu.data["netdev_mtu"], "rxe")
    loop = report.get(f"loopback {DEVICE}")
    assert loop.status == OK, loop
    assert report.get("pyverbs").status == OK
    assert report.get("RDMA CM").status == OK  # the VM loads rdma_ucm
    assert report.exit_status == 0, [c for c in report.checks if c.status == FAIL]


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux) to drop CAP_IPC_LOCK")
def test_small_memlock_fails_with_the_fix():
    # as root, CAP_IPC_LOCK lifts RLIMIT_MEMLOCK: drop it so the limit applies, like for a normal user
    cmd = (
        "ulimit -l 64 && exec setpriv --inh-caps=-ipc_lock --bounding-set=-ipc_lock "
        f"{sys.executable} -m aiordma.cli doctor --provider pyverbs --device {DEVICE} --json"
    )
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, env=_env(PYTHONPATH=REPO), timeout=300)
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
    out = json.loads(r.stdout)
    by = {c["name"]: c for c in out["checks"]}
    mem = by["memlock"]
    assert mem["status"] == FAIL, mem
    assert "64 KiB" in mem["seen"] and "ulimit -l unlimited" in mem["fix"]
    assert mem["data"]["cap_ipc_lock"] is False
    # the doctor tried the registration for real on the device, and it failed
    assert mem["data"]["registered"][0] is False and f"on {DEVICE} failed" in mem["seen"], mem
    assert by[f"port {DEVICE}/1"]["status"] == OK
