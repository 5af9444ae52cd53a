"""Two simulated hosts (network namespaces joined by a veth pair,
tests/support/netns.py): ``dask scheduler --protocol rdma`` and a worker on
host A, a worker and the client on host B, every process a real ``dask``
command as a user would start it, each soft device bound to its host's veth
address (not loopback), the rendezvous authenticated with a token. The loops
are mixed (scheduler and B's worker on uvloop, A's worker and the client on
asyncio), so both loops talk to each other.

The worker-to-worker transfers must have crossed the veth link: the veth's
own byte counters (the kernel's) grow by at least what the workers logged in
``transfer_incoming_log``, and the backend's counters account for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..support import netns

ROOT = Path(__file__).resolve().parents[2]
PORT = 8786  # each namespace has its own port space
TOKEN = "two-hosts-token"


def _env(loop: str) -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        DASK_DISTRIBUTED__COMM__RDMA__TOKEN=TOKEN,
        DASK_DISTRIBUTED__ADMIN__EVENT_LOOP=loop,
        DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT="30s",
        # the two "hosts" share one kernel, where cross-memory attach would move the workers'
        # Reads without the link this test watches
        AIORDMA_SOFT_CMA="0",
    )


def _veth_bytes(host: netns.Host) -> int:
    out = host.run(["cat", "/proc/net/dev"], capture_output=True, text=True, check=True, timeout=30).stdout
    for line in out.splitlines():
        name, _, rest = line.partition(":")
        if name.strip().startswith("ard"):
            fields = rest.split()
            return int(fields[0]) + int(fields[8])  # receive bytes + transmit bytes
    raise AssertionError(f"no veth in {host.name}: {out}")


def test_a_cluster_across_two_hosts(tmp_path: Path) -> None:
    why = netns.unavailable()
    if why:
        pytest.skip(f"two network namespaces cannot be made here: {why}")
    dask = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
    worker = [sys.executable, "-m", "distributed.cli.dask_worker"]
    with netns.TwoHosts() as hosts:
        a, b = hosts.a, hosts.b
        sched = f"rdma://{a.ip}:{PORT}"
        logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("scheduler", "worker-a", "worker-b")}
        try:
            a.popen(
                [*dask, "--protocol", "rdma", "--host", a.ip, "--port", str(PORT), "--no-dashboard"],
                env=_env("uvloop"),
                stdout=logs["scheduler"],
                stderr=subprocess.STDOUT,
            )
            common = ["--nthreads", "1", "--no-dashboard", "--death-timeout", "60"]
            a.popen(
                [*worker, sched, "--host", a.ip, *common],
                env=_env("asyncio"),
                stdout=logs["worker-a"],
                stderr=subprocess.STDOUT,
            )
            b.popen(
                [*worker, sched, "--host", b.ip, *common],
                env=_env("uvloop"),
                stdout=logs["worker-b"],
                stderr=subprocess.STDOUT,
            )
            before = _veth_bytes(b)
            t0 = time.monotonic()
            client = b.run(
                [sys.executable, "-m", "tests.dask.two_hosts_client", sched],
                env=_env("asyncio"),
                capture_output=True,
                text=True,
                timeout=180,
                cwd=ROOT,
            )
            crossed = _veth_bytes(b) - before
        finally:
            for f in logs.values():
                f.close()
        if client.returncode != 0:
            tails = {n: (tmp_path / f"{n}.log").read_text()[-2000:] for n in logs}
            raise AssertionError(f"the client failed ({client.returncode}): {client.stderr[-3000:]}\n{tails}")
    out = json.loads(client.stdout.splitlines()[-1])
    assert out["result_ok"]
    assert out["scheduler"] == sched

    # every process's soft device is bound to its host's veth address, none to loopback
    prefix = {a.ip: "worker on A", b.ip: "worker on B"}
    for addr, counters in out["workers"].items():
        host_ip = addr.removeprefix("rdma://").rsplit(":", 1)[0]
        assert host_ip in prefix, addr
        (label,) = counters["devices"]
        assert label.startswith(f"soft:soft0@{host_ip}:"), (addr, label)
        assert counters["devices"][label]["device"]["tx_packets"] > 0
    (label,) = out["scheduler_counters"]["devices"]
    assert label.startswith(f"soft:soft0@{a.ip}:")
    # several processes on one host: the first soft device takes RoCEv2's port 4791, the others
    # a free port (the rendezvous carries it)
    on_a = [label, *(next(iter(c["devices"])) for w, c in out["workers"].items() if a.ip in w)]
    assert len(set(on_a)) == len(on_a)
    (label,) = out["client_counters"]["devices"]
    assert label.startswith(f"soft:soft0@{b.ip}:")

    # the workers fetched from each other across the link, and the counters account for it
    moved = 0
    for addr, by_peer in out["transfers"].items():
        for peer, nbytes in by_peer.items():
            rx = out["workers"][addr]["peers"][peer]
            assert nbytes <= rx["rx_bytes"] <= nbytes * 1.01 + 64 * 1024, (addr, peer)
            moved += nbytes
    assert moved > 0, "the workers exchanged nothing"
    assert crossed >= moved, f"only {crossed} bytes crossed the veth link, the workers moved {moved}"
    print(
        f"two hosts: {moved / 1e6:.1f} MB between the workers, {crossed / 1e6:.1f} MB over the veth, "
        f"{time.monotonic() - t0:.1f} s"
    )
