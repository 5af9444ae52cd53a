"""The soft device's engines as a user meets them: choosing one, and what the native one
promises that the Python one cannot (no Python on the passive side of one-sided ops)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import aiordma
from aiordma.providers.soft.device import SoftDevice
from aiordma.providers.soft.engine import ENGINES, choose_engine, native_status

NATIVE = native_status()[0]
ROOT = Path(__file__).resolve().parents[2]
needs_native = pytest.mark.skipif(not NATIVE, reason=f"native engine not built: {native_status()[1]}")


def test_engine_choice(monkeypatch) -> None:
    monkeypatch.delenv("AIORDMA_SOFT_ENGINE", raising=False)
    assert choose_engine()[0] == ("native" if NATIVE else "python")
    monkeypatch.setenv("AIORDMA_SOFT_ENGINE", "python")
    assert choose_engine() == ("python", "AIORDMA_SOFT_ENGINE=python")
    assert choose_engine("PYTHON")[0] == "python"  # the keyword wins over the variable
    with pytest.raises(ValueError, match="unknown soft-device engine 'rust'"):
        choose_engine("rust")
    monkeypatch.setenv("AIORDMA_SOFT_ENGINE", "nope")
    with pytest.raises(ValueError, match="python, native"):
        SoftDevice()
    assert ENGINES == ("python", "native")


@pytest.mark.parametrize("engine", ["python", "native"])
def test_device_reports_its_engine(engine: str) -> None:
    if engine == "native" and not NATIVE:
        pytest.skip("native engine not built")
    d = SoftDevice(engine=engine)
    try:
        assert d.engine == engine
        extra = d.query_device().extra
        assert extra["engine"] == engine and extra["crc32"] and d.engine_reason == extra["engine_reason"]
        assert isinstance(d.soft_mtu, int) and d.soft_mtu >= 4096
    finally:
        d.close()


# The server process: records the time of every Python function call on its loop
# thread (the only Python thread it has), and answers how many fell inside a window
# of the client's. CLOCK_MONOTONIC is the same clock in both processes.
SERVER = textwrap.dedent(
    """
    import asyncio, bisect, sys, time, aiordma
    calls = []
    def tracer(frame, event, arg):
        if event == "call":
            calls.append(time.monotonic())
        return None
    async def main():
        mem = aiordma.register(bytearray(1 << 16))
        async def handler(conn):
            try:
                while True:
                    msg = (await conn.recv()).decode().split()
                    if msg[0] == "trace":
                        sys.settrace(tracer)
                        await conn.send(b"ok")
                    else:
                        t0, t1 = float(msg[1]), float(msg[2])
                        sys.settrace(None)
                        n = bisect.bisect_right(calls, t1) - bisect.bisect_left(calls, t0)
                        await conn.send(f"{n} {len(calls)}".encode())
            except aiordma.RDMAError:
                pass
        server = await aiordma.start_server(handler, "127.0.0.1", 0, expose={"mem": mem.exposed("rwa")})
        print(server.port, flush=True)
        await asyncio.sleep(600)
    asyncio.run(main())
    """
)


@pytest.mark.parametrize("engine", ["native", "python"])
async def test_one_sided_ops_run_no_python_in_the_target_process(engine: str) -> None:
    """300 RDMA Reads, Writes, fetch-and-adds and compare-and-swaps aimed at a server
    process call no Python function in it on the native engine: its NIC thread serves
    them in C. (The Python engine's NIC runs Python for each packet: the contrast.)"""
    if engine == "native" and not NATIVE:
        pytest.skip("native engine not built")
    env = dict(os.environ, AIORDMA_SOFT_ENGINE=engine, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, env=env)
    try:
        line = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline), 30)
        port = int(line)
        async with await aiordma.connect("127.0.0.1", port, provider="soft") as conn:
            await conn.send(b"trace")
            assert await conn.recv() == b"ok"
            await asyncio.sleep(0.05)  # the server's own expect window (after its reply) has passed
            rb = conn.remote("mem")
            local = conn.register(bytearray(64))
            t0 = time.monotonic()
            for i in range(75):
                await conn.write(local[0:64], rb[64 * i : 64 * i + 64])
                await conn.read(rb[64 * i : 64 * i + 64], into=local[0:64])
                await conn.fetch_and_add(rb.at(8192, 8), 1)
                await conn.compare_and_swap(rb.at(8200, 8), 0, 0)
            t1 = time.monotonic()
            await asyncio.sleep(0.02)
            await conn.send(f"count {t0} {t1}".encode())
            during, total = map(int, (await conn.recv()).split())
        assert total > 0  # the tracer ran (the reply to "count" itself makes calls)
        if engine == "native":
            assert during == 0, f"{during} Python calls in the server during 300 one-sided operations"
        else:
            assert during > 300
    finally:
        proc.kill()
        proc.wait()
