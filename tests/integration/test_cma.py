"""Cross-memory attach: a large RDMA Read between two processes of one host
answered by a grant, the bytes copied straight out of the responder's process
(aiordma.providers.soft.cma). The server is a real second process; the reads go
through the public API; the device counters say which way the bytes went."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgpack
import pytest

import aiordma
from aiordma.providers import open_device
from aiordma.providers.soft.engine import native_status

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not native_status()[0] or os.environ.get("AIORDMA_SOFT_ENGINE", "native") != "native",
    reason="cross-memory attach is the native engine's (the Python engine reads by datagrams only)",
)

# A server process: 16 MiB of random bytes exposed read-only as "mem"; it answers the
# message b"counters" with its device's counters and b"pid" with its process id.
SERVER = textwrap.dedent(
    """
    import asyncio, os, sys, msgpack, aiordma
    async def main():
        mem = bytearray(os.urandom(16 << 20))
        region = aiordma.register(mem)
        async def handler(conn):
            async for m in conn:
                if m == b"counters":
                    await conn.send(msgpack.packb(conn.device.counters))
                elif m == b"mem":
                    await conn.send(bytes(mem))
        server = await aiordma.start_server(handler, "127.0.0.1", 0, expose={"mem": region})
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.sleep(3600)
    asyncio.run(main())
    """
)

LARGE = 64 << 10  # (RC_CMA_MIN_READ: the smallest READ a grant answers)


class ServerProcess:
    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT), **env}
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def server_env() -> dict[str, str]:
    return {}


@pytest.fixture
def server(server_env: dict[str, str]):
    s = ServerProcess(server_env)
    yield s
    s.stop()


async def _counters(conn: aiordma.Connection) -> dict[str, Any]:
    await conn.send(b"counters")
    return dict(msgpack.unpackb(await conn.recv()))


def _cma(counters: dict[str, Any]) -> dict[str, int]:
    return {k: counters.get(k, 0) for k in ("tx_cma_grants", "rx_cma_reads", "rx_cma_bytes")}


async def test_large_reads_from_another_process_move_by_cross_memory_attach(server: ServerProcess) -> None:
    async with await aiordma.connect("127.0.0.1", server.port) as conn:
        await conn.send(b"mem")
        truth = await conn.recv()  # (the server's bytes, by SEND: the reference)
        remote = conn.remote("mem")
        before, peer_before = _cma(conn.device.counters), _cma(await _counters(conn))

        whole = await conn.read(remote[0 : 8 << 20])  # a fresh buffer
        odd = bytearray(100_000 + 7)
        await conn.read(remote[12_345 : 12_345 + len(odd)], into=odd)  # any writable buffer
        dest = bytearray(1 << 20)
        region = aiordma.register(dest)
        await conn.read(remote[(16 << 20) - (1 << 20) :], into=region)  # a registered region
        small = await conn.read(remote[5 : 5 + 1000])  # below the threshold: datagrams

        assert whole == truth[: 8 << 20]
        assert bytes(odd) == truth[12_345 : 12_345 + len(odd)]
        assert bytes(dest) == truth[(16 << 20) - (1 << 20) :]
        assert small == truth[5:1005]
        after, peer_after = _cma(conn.device.counters), _cma(await _counters(conn))
        moved = (8 << 20) + len(odd) + (1 << 20)
        assert after["rx_cma_bytes"] - before["rx_cma_bytes"] == moved  # every large byte, no small one
        assert after["rx_cma_reads"] - before["rx_cma_reads"] == 3  # one grant per READ request
        assert peer_after["tx_cma_grants"] - peer_before["tx_cma_grants"] == 3
        region.close()


async def test_the_responder_still_checks_every_rkey_and_range(server: ServerProcess) -> None:
    async with await aiordma.connect("127.0.0.1", server.port) as conn:
        peer_before = _cma(await _counters(conn))
    async with await aiordma.connect("127.0.0.1", server.port) as conn:
        remote = conn.remote("mem")
        forged = aiordma.RemoteBuffer(remote.addr, 1 << 20, remote.rkey ^ 0x5A5A)
        with pytest.raises(aiordma.RemoteAccessError, match="rkey"):
            await conn.read(forged)
    async with await aiordma.connect("127.0.0.1", server.port) as conn:
        remote = conn.remote("mem")
        past_the_end = aiordma.RemoteBuffer(remote.addr + remote.length - LARGE, 2 * LARGE, remote.rkey)
        with pytest.raises(aiordma.RemoteAccessError):
            await conn.read(past_the_end)
    async with await aiordma.connect("127.0.0.1", server.port) as conn:
        # refused READs were granted nothing: no byte left the server's region
        assert _cma(await _counters(conn))["tx_cma_grants"] == peer_before["tx_cma_grants"]
        assert await conn.read(conn.remote("mem")[0:LARGE]) is not None  # the server lives on


@pytest.mark.parametrize("side", ["client", "server"])
async def test_either_side_turning_it_off_sends_the_bytes_as_datagrams(
    side: str, monkeypatch: pytest.MonkeyPatch, server_env: dict[str, str]
) -> None:
    if side == "client":
        monkeypatch.setenv("AIORDMA_SOFT_CMA", "0")
    else:
        server_env["AIORDMA_SOFT_CMA"] = "0"
    s = ServerProcess(server_env)
    device = open_device("soft")  # (its own: the process's shared device read the setting before)
    try:
        async with await aiordma.connect("127.0.0.1", s.port, device=device) as conn:
            await conn.send(b"mem")
            truth = await conn.recv()
            assert conn.device.cross_memory_attach is (side != "client")
            got = await conn.read(conn.remote("mem")[0 : 4 << 20])
            assert got == truth[: 4 << 20]
            assert _cma(conn.device.counters)["rx_cma_reads"] == 0
            assert _cma(await _counters(conn))["tx_cma_grants"] == 0
    finally:
        s.stop()
        device.close()


async def test_two_connections_of_one_process_keep_to_their_own_path() -> None:
    """A client and a server of one process share the device: no grant (the packets
    are handed over in memory already)."""
    mem = bytearray(os.urandom(1 << 20))
    region = aiordma.register(mem)

    async def handler(conn: aiordma.Connection) -> None:
        await conn.wait_closed()

    server = await aiordma.start_server(handler, "127.0.0.1", 0, expose={"mem": region})
    try:
        async with await aiordma.connect("127.0.0.1", server.sockets[0].getsockname()[1]) as conn:
            before = _cma(conn.device.counters)  # (the process's device: earlier tests count too)
            assert await conn.read(conn.remote("mem")) == bytes(mem)
            assert _cma(conn.device.counters) == before
    finally:
        server.close()
        await server.wait_closed()
        region.close()


async def test_a_grant_from_a_process_that_is_gone_fails_the_read_as_a_vanished_peer(server: ServerProcess) -> None:
    """Fault injection: the QP is told to copy from a process that is gone (the
    responder's grants name addresses there): the READ fails as toward a peer that
    vanished (IBV_WC_RETRY_EXC_ERR), and the connection's error says what the
    cross-memory READ met."""
    conn = await aiordma.connect("127.0.0.1", server.port)
    try:
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        conn._setup.qp.use_cma(gone.pid, True)
        with pytest.raises(aiordma.RetryExceededError, match="IBV_WC_RETRY_EXC_ERR"):
            await asyncio.wait_for(conn.read(conn.remote("mem")[0 : 1 << 20]), 10)
        assert conn.error is not None
        assert "cross-memory READ of 1048576 bytes" in str(conn.error)
        assert f"process {gone.pid} failed (No such process): the peer's process is gone" in str(conn.error)
    finally:
        conn.abort()
