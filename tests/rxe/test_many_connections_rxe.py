"""Many connections over kernel Soft-RoCE (rxe0 in scripts/rxe-vm, pyverbs provider):
what an idle connection pins, measured by the kernel.

A server runs in a child process (an echo handler on rxe0, through the
pyverbs provider, whose connections share the device's shared receive queue
and send pool by default); this process opens connections to it at once,
makes a 64 B round trip on each, and reads the memory regions the kernel
holds for the server's pid (``rdma resource show mr``): registered memory per
idle server connection must stay within 64 KiB. Then rounds of connect →
round trip → close, after which the server's registered memory is back where
it started.

How many: ``AIORDMA_MANY_CONNECTIONS`` (default 200), ``AIORDMA_CHURN_CYCLES``
× ``AIORDMA_CHURN`` (default 4 × 50). The bar is 1,000 connections and
20 × 200 cycles (``AIORDMA_MANY_CONNECTIONS=1000 AIORDMA_CHURN_CYCLES=20
AIORDMA_CHURN=200 scripts/test-rxe -k many_connections``; scripts/rxe-vm passes
no AIORDMA_RXE_* variable into the VM, hence the names). Under TCG (no KVM)
200 connections take about a minute, so CI runs the smaller default, which
holds the same bar: the pools are shared, so the figure per connection only
falls with more connections.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import sys
import time

import pytest
import uvloop

import aiordma

from .rxe_helpers import REPO, kernel_registered_memory, py_env

pytestmark = pytest.mark.rxe

COUNT = int(os.environ.get("AIORDMA_MANY_CONNECTIONS", "200"))
CYCLES = int(os.environ.get("AIORDMA_CHURN_CYCLES", "4"))
CHURN = int(os.environ.get("AIORDMA_CHURN", "50"))
DEVICE = os.environ.get("AIORDMA_RXE_DEVICE") or "rxe0"
#: the bar: registered memory per idle server connection
PER_CONNECTION = 64 << 10
T = 600  # TCG is slow

SERVER = r"""
import asyncio, json, os, sys
import aiordma
from aiordma import pools

async def main():
    device = aiordma.get_device("pyverbs", sys.argv[1])

    async def handler(conn):
        async for m in conn:
            if m == b"stats?":
                reply = {
                    "device": device.registered_memory(),
                    "conn": conn.stats,
                    "pools": [dict(kind=type(p).__name__, **p.stats()) for p in pools.pools_of(device)],
                }
                await conn.send(json.dumps(reply).encode())
            else:
                await conn.send(m)

    server = await aiordma.start_server(handler, "127.0.0.1", 0, device=device, handshake_timeout=600)
    print(json.dumps({"port": server.port, "pid": os.getpid(), "idle": device.registered_memory()}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test closes stdin
    server.close()
    await server.wait_closed()

asyncio.run(main())
"""


@pytest.fixture
def fds():
    """Two fds per connection on each side (its rendezvous socket, its completion channel)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 4 * (COUNT + CHURN) + 256))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def server_proc(fds):
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, DEVICE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=py_env(),
        cwd=REPO,  # (it inherits the fd limit the fixture raised)
    )
    line = proc.stdout.readline() if proc.stdout is not None else ""
    if not line:
        err = proc.stderr.read() if proc.stderr is not None else ""
        pytest.fail(f"the server did not start:\n{err}")
    info = json.loads(line)
    yield proc, info
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def _open(port: int, device, n: int) -> list[aiordma.Connection]:
    async def one(i: int) -> aiordma.Connection:
        conn = await aiordma.connect("127.0.0.1", port, device=device, timeout=T)
        msg = i.to_bytes(8, "little") * 8  # 64 B
        await conn.send(msg)
        assert await asyncio.wait_for(conn.recv(), T) == msg
        return conn

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def _close(conns: list[aiordma.Connection]) -> None:
    await asyncio.gather(*(c.close() for c in conns))


async def _server_stats(port: int, device) -> dict:
    async with await aiordma.connect("127.0.0.1", port, device=device, timeout=T) as conn:
        await conn.send(b"stats?")
        out: dict = json.loads(await asyncio.wait_for(conn.recv(), T))
        return out


def _kernel(pid: int) -> dict[str, int]:
    return kernel_registered_memory(DEVICE, pid)


async def _settled(pid: int, want: int, timeout: float = 60.0) -> dict[str, int]:
    """The server's kernel MR count once it stops changing toward ``want`` bytes or less."""
    deadline = time.monotonic() + timeout
    seen = _kernel(pid)
    while seen["bytes"] > want and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        seen = _kernel(pid)
    return seen


def test_idle_connections_pin_little_by_the_kernels_count(server_proc):
    # (once, on asyncio: what is measured is the kernel's, and under TCG each run takes a minute)
    asyncio.run(_idle_connections(*server_proc))


def test_churn_leaves_registered_memory_where_it_started(server_proc):
    # (once, on uvloop)
    uvloop.run(_churn(*server_proc))


async def _idle_connections(proc: subprocess.Popen, info: dict) -> None:
    port, pid = info["port"], info["pid"]
    device = aiordma.get_device("pyverbs", DEVICE)
    base = _kernel(pid)
    assert base["bytes"] == info["idle"]["bytes"], (base, info["idle"])  # aiordma's count is the kernel's

    t0 = time.monotonic()
    conns = await _open(port, device, COUNT)
    took = time.monotonic() - t0
    try:
        assert all(c.stats["srq"] == 1 for c in conns)  # the pyverbs default: the device's SRQ
        # the send pool's steps beyond the first are retired once idle (2 s unused)
        deadline = time.monotonic() + 30
        while True:
            stats = await _server_stats(port, device)
            send = [p for p in stats["pools"] if p["kind"] == "SendPool"]
            if (send and send[0]["regions"] == 1) or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        kernel = _kernel(pid)
        assert stats["conn"]["srq"] == 1, stats["conn"]
        per_conn = (kernel["bytes"] - base["bytes"]) / COUNT
        print(
            f"\n{COUNT} connections over {DEVICE} in {took:.1f} s; server: kernel MRs {kernel} "
            f"(idle {base}), {per_conn / 1024:.1f} KiB per idle connection; aiordma's count "
            f"{stats['device']}; pools {stats['pools']}"
        )
        assert per_conn <= PER_CONNECTION, (kernel, base, stats)
        # aiordma's own count is the kernel's (but for the stats connection's own half KiB,
        # which may be released by now)
        assert 0 <= stats["device"]["bytes"] - kernel["bytes"] <= 4096, (stats["device"], kernel)
        client = kernel_registered_memory(DEVICE, os.getpid())
        print(f"client: kernel MRs {client}, {client['bytes'] / COUNT / 1024:.1f} KiB per connection")
    finally:
        await _close(conns)
    after = await _settled(pid, base["bytes"])
    assert after == base, (after, base)
    assert proc.poll() is None


async def _churn(proc: subprocess.Popen, info: dict) -> None:
    port, pid = info["port"], info["pid"]
    device = aiordma.get_device("pyverbs", DEVICE)
    before = _kernel(pid)
    peaks = []
    t0 = time.monotonic()
    for _ in range(CYCLES):
        conns = await _open(port, device, CHURN)
        peaks.append(_kernel(pid)["bytes"])
        await _close(conns)
    took = time.monotonic() - t0
    after = await _settled(pid, before["bytes"])
    print(
        f"\n{CYCLES} x {CHURN} connect/round trip/close over {DEVICE} in {took:.1f} s: server kernel MRs "
        f"{before} -> {after}, peaks {[p >> 10 for p in peaks]} KiB"
    )
    assert after == before, (before, after)
    assert proc.poll() is None
