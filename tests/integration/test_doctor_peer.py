"""``aiordma doctor --peer``: rendezvous and 1-byte RDMA Read/Write against a
real aiordma server on the soft device (in this process, and from the CLI)."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

import aiordma
from aiordma.tools import doctor
from aiordma.tools.doctor import FAIL, OK, Options, Probe

pytestmark = pytest.mark.engine_neutral  # the same on every engine and core: CI's reference run leaves it out

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIORDMA_")}
    env.update(extra)
    return env


@pytest.fixture
async def exposing_server():
    mem = bytearray(b"doctor-target" + bytes(51))
    region = aiordma.register(mem, provider="soft")

    async def handler(conn):
        async for _ in conn:
            pass

    server = await aiordma.start_server(
        handler, "127.0.0.1", 0, provider="soft", expose={"mem": region.exposed("rw")}, token="s3cret"
    )
    yield server, mem
    server.close()
    await server.wait_closed()
    region.close()


async def test_peer_read_write_on_exposed_buffer(exposing_server):
    server, mem = exposing_server
    before = bytes(mem)
    report = await doctor.diagnose(
        Options(provider="soft", peer=f"127.0.0.1:{server.port}", token="s3cret"), Probe(env=_env())
    )
    rdv = report.get("peer rendezvous")
    assert rdv.status == OK, rdv
    assert "exposed: mem" in rdv.seen and rdv.data["seconds"] > 0
    io = report.get("peer RDMA")
    assert io.status == OK, io
    assert io.data["buffer"] == "mem" and io.data["read_seconds"] > 0 and io.data["write_seconds"] > 0
    assert "RDMA Read" in io.seen and "RDMA Write" in io.seen
    assert bytes(mem) == before  # the byte read is written back unchanged
    assert report.get("NAT").status == OK
    assert report.exit_status == 0, [c for c in report.checks if c.status == FAIL]


async def test_peer_read_only_buffer_is_only_read():
    """A read-only exposure (the default) is read, not written: a Write would be refused."""
    mem = bytearray(b"read-only" + bytes(55))
    region = aiordma.register(mem, provider="soft")

    async def handler(conn):
        async for _ in conn:
            pass

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft", expose={"ro": region})
    try:
        report = await doctor.diagnose(Options(provider="soft", peer=f"127.0.0.1:{server.port}"), Probe(env=_env()))
        io = report.get("peer RDMA")
        assert io.status == OK, io
        assert io.data["buffer"] == "ro" and io.data["read_seconds"] > 0 and io.data["write_seconds"] is None
        assert "read-only" in io.seen
    finally:
        server.close()
        await server.wait_closed()
        region.close()


async def test_peer_wrong_token(exposing_server):
    server, _ = exposing_server
    report = await doctor.diagnose(
        Options(provider="soft", peer=f"127.0.0.1:{server.port}", token="wrong", timeout=3.0), Probe(env=_env())
    )
    rdv = report.get("peer rendezvous")
    assert rdv.status == FAIL and "token" in rdv.fix
    assert report.exit_status == 1


async def test_peer_without_buffers_echo_round_trip(echo_server):
    report = await doctor.diagnose(Options(provider="soft", peer=f"127.0.0.1:{echo_server.port}"), Probe(env=_env()))
    io = report.get("peer RDMA")
    assert io.status == OK, io
    assert "echo round trip" in io.seen and io.data["echo_seconds"] > 0


async def test_peer_silent_without_buffers_is_a_warning():
    async def handler(conn):
        await asyncio.sleep(3600)

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft")
    try:
        report = await doctor.diagnose(
            Options(provider="soft", peer=f"127.0.0.1:{server.port}", timeout=0.5), Probe(env=_env())
        )
    finally:
        server.close()
        await server.wait_closed()
    assert report.get("peer rendezvous").status == OK
    io = report.get("peer RDMA")
    assert io.status == "warn" and "did not echo" in io.seen


async def test_cli_peer_json(exposing_server):
    server, _ = exposing_server
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aiordma.cli",
        "doctor",
        "--provider",
        "soft",
        "--peer",
        f"127.0.0.1:{server.port}",
        "--token",
        "s3cret",
        "--json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_env(PYTHONPATH=REPO),
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    report = json.loads(out)
    by = {c["name"]: c for c in report["checks"]}
    assert by["peer rendezvous"]["status"] == OK
    assert by["peer RDMA"]["status"] == OK and by["peer RDMA"]["data"]["buffer"] == "mem"
    assert report["exit_status"] == 0


async def test_cli_peer_refused_table():
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aiordma.cli",
        "doctor",
        "--provider",
        "soft",
        "--peer",
        "127.0.0.1:1",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_env(PYTHONPATH=REPO),
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1
    text = out.decode()
    assert "fail  peer rendezvous" in text and "connection refused" in text
