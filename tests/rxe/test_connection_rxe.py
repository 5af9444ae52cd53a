"""aiordma connections on kernel Soft-RoCE (rxe0 in scripts/rxe-vm, pyverbs provider).

Client and server live in this process, both on rxe0 (rxe loopback), and talk
over a real TCP rendezvous. Every Connection operation is exercised, on both
event loops (tests/conftest.py parametrizes async tests over asyncio and
uvloop), in the progress modes "event" (the completion channel's fd on the
loop; the fd is discovered on pyverbs 44) and "thread". The error cases are
answered by the kernel: a bad rkey, an out-of-bounds range and a write into a
read-only region come back as IBV_WC_REM_ACCESS_ERR, a destroyed peer QP as
IBV_WC_RETRY_EXC_ERR.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import struct
import time

import pytest

import aiordma
from aiordma import Access, ConnectionLostError, RemoteAccessError, RemoteBuffer, RetryExceededError, WCStatus
from aiordma.connection import default_registration_cache

pytestmark = pytest.mark.rxe

T = 30  # per-step timeout (s): TCG is slow
DEVICE = os.environ.get("AIORDMA_RXE_DEVICE") or None


def pattern(n: int, seed: int = 0) -> bytes:
    return bytes((i * 7 + seed) & 0xFF for i in range(256)) * (n // 256) + bytes(n % 256)


@pytest.fixture
def device():
    return aiordma.get_device("pyverbs", DEVICE)


@pytest.fixture
async def rxe_server(device):
    """``await start(**connection_options)`` -> (server, mem, ro, accepted connections).

    The server exposes ``mem`` (1 MiB, read/write/atomic) and ``ro`` (read
    only) and echoes every message it receives."""
    servers = []
    regions = []

    async def start(**options):
        mem = bytearray(1 << 20)
        ro = bytearray(b"read-only!" * 10)
        region = aiordma.register(mem, device=device)
        ro_region = aiordma.register(ro, Access.LOCAL_WRITE | Access.REMOTE_READ, device=device)
        regions.extend([region, ro_region])
        seen: list[aiordma.Connection] = []

        async def handler(conn):
            seen.append(conn)
            async for msg in conn:
                await conn.send(msg)

        server = await aiordma.start_server(
            handler, "127.0.0.1", 0, device=device, expose={"mem": region.exposed("rwa"), "ro": ro_region}, **options
        )
        servers.append(server)
        return server, mem, ro, seen

    yield start
    for s in servers:
        s.close()
        await s.wait_closed()
    for r in regions:
        r.close()


async def connect(server, device, **options) -> aiordma.Connection:
    return await aiordma.connect("127.0.0.1", server.port, device=device, timeout=T, **options)


async def wait_for(coro, timeout: float = T):
    return await asyncio.wait_for(coro, timeout)


async def accepted(seen: list, timeout: float = T) -> aiordma.Connection:
    """The server side of the connection (its handler starts after connect() returned)."""
    async with asyncio.timeout(timeout):
        while not seen:
            await asyncio.sleep(0.005)
    return seen[0]


# ------------------------------------------------------------- every operation ----


@pytest.mark.parametrize("progress", ["event", "thread"])
async def test_every_operation(rxe_server, device, progress):
    server, mem, ro, seen = await rxe_server(progress=progress)
    async with await connect(server, device, progress=progress) as conn:
        assert conn.device.provider == "pyverbs" and conn.device.name == (DEVICE or conn.device.name)
        # registering pins pages here: large-message registrations are kept for reuse
        assert default_registration_cache(conn.device) == 64
        assert conn.progress_mode == progress
        assert (await accepted(seen)).progress_mode == progress
        if progress == "event":
            from aiordma.providers.pyverbs import pyverbs_info

            # pyverbs' CompChannel has no fd before rdma-core 57: it is discovered in /proc/self/fd
            mode = conn.channel.fd_mode
            assert mode in ("native", "discovered")
            major = str(pyverbs_info().get("version") or "0").split(".")[0]
            if major.isdigit() and int(major) < 57:
                assert mode == "discovered"
            assert pyverbs_info().get("comp_channel_fd") == mode
            assert conn.dispatcher._fd == conn.channel.fileno()
        mtu = conn.mtu
        assert mtu in (256, 512, 1024, 2048, 4096)
        rb = conn.remote("mem")
        assert rb.length == len(mem)

        # RDMA Write / Read of several MTUs, copied and zero copy
        payload = pattern(16 * mtu + 123, 1)
        await wait_for(conn.write(payload, rb[4096:]))
        assert mem[4096 : 4096 + len(payload)] == payload
        assert await wait_for(conn.read(rb[4096 : 4096 + len(payload)])) == payload
        src = conn.register(bytearray(pattern(100_000, 2)))
        await wait_for(conn.write(src, rb[200_000:300_000]))
        assert mem[200_000:300_000] == bytes(src.view)
        dst = conn.register(bytearray(100_000))
        assert await wait_for(conn.read(rb[200_000:300_000], into=dst)) is None
        assert bytes(dst.view) == bytes(src.view)
        # several in flight at once
        parts = [pattern(3000, i) for i in range(20)]
        await wait_for(asyncio.gather(*[conn.write(p, rb[i * 4096 :]) for i, p in enumerate(parts)]))
        assert all(mem[i * 4096 : i * 4096 + 3000] == p for i, p in enumerate(parts))
        reads = await wait_for(asyncio.gather(*[conn.read(rb[i * 4096 : i * 4096 + 3000]) for i in range(20)]))
        assert reads == parts
        # posted reads, reaped later: into registered memory and into a plain buffer
        dst2 = conn.register(bytearray(20 * 3000))
        plain = bytearray(20 * 3000)
        futures = [
            await conn.post_read(rb[i * 4096 : i * 4096 + 3000], dst2[i * 3000 : (i + 1) * 3000]) for i in range(20)
        ]
        futures += [
            await conn.post_read(rb[i * 4096 : i * 4096 + 3000], memoryview(plain)[i * 3000 :]) for i in range(20)
        ]
        await wait_for(asyncio.gather(*futures))
        assert bytes(dst2.view) == b"".join(parts) == bytes(plain)

        # Write with immediate: the server side gets a receive completion
        await wait_for(conn.write(b"RDMA!", rb[0:5], imm=0x52444D41))
        note = await wait_for(seen[0].recv_immediate())
        assert note == aiordma.Immediate(0x52444D41, 5)
        assert mem[0:5] == b"RDMA!"
        await wait_for(conn.write(b"", rb[0:0], imm=7))  # zero-length write with immediate
        assert await wait_for(seen[0].recv_immediate()) == aiordma.Immediate(7, 0)

        # send / recv: small, empty, multi-MTU and multi-chunk (recv buffers are 64 KiB)
        for msg in (b"hello", b"", pattern(mtu + 1, 3), pattern(100 * 1024, 4), pattern(1 << 20, 5)):
            await wait_for(conn.send(msg))
            assert await wait_for(conn.recv()) == msg
        msgs = [struct.pack(">I", i) * (i % 300 + 1) for i in range(100)]
        got = asyncio.ensure_future(asyncio.gather(*[conn.recv() for _ in msgs]))  # noqa: RUF006 (awaited below)
        await wait_for(asyncio.gather(*[conn.send(m) for m in msgs]))
        assert sorted(await wait_for(got)) == sorted(msgs)

        # atomics on an 8-byte aligned word
        word = rb[64:72]
        struct.pack_into("<Q", mem, 64, 40)
        assert await wait_for(conn.fetch_and_add(word, 2)) == 40
        assert struct.unpack_from("<Q", mem, 64)[0] == 42
        assert await wait_for(conn.compare_and_swap(word, 41, 7)) == 42  # no swap
        assert struct.unpack_from("<Q", mem, 64)[0] == 42
        assert await wait_for(conn.compare_and_swap(word, 42, 7)) == 42
        assert struct.unpack_from("<Q", mem, 64)[0] == 7
        results = await wait_for(asyncio.gather(*[conn.fetch_and_add(word, 1) for _ in range(32)]))
        assert sorted(results) == list(range(7, 39))
        assert struct.unpack_from("<Q", mem, 64)[0] == 39
        assert await wait_for(conn.fetch_and_add(word, -40)) == 39  # wraps modulo 2**64
        assert struct.unpack_from("<Q", mem, 64)[0] == (1 << 64) - 1

        # the read-only region can be read
        assert await wait_for(conn.read(conn.remote("ro"))) == bytes(ro)
        assert conn.dispatcher.completions > 0
    assert conn.closed


async def test_server_writes_into_client_exposed_memory(rxe_server, device):
    """One-sided operations work in both directions (the client exposes memory too)."""
    server, mem, _, seen = await rxe_server()
    local = bytearray(64 * 1024)
    region = aiordma.register(local, device=device)
    try:
        async with await connect(server, device, expose={"cmem": region.exposed("rwa")}) as conn:
            sconn = await accepted(seen)
            crb = sconn.remote("cmem")
            data = pattern(50_000, 9)
            await wait_for(sconn.write(data, crb[100:], imm=0xFFFFFFFF))
            assert await wait_for(conn.recv_immediate()) == aiordma.Immediate(0xFFFFFFFF, len(data))
            assert local[100 : 100 + len(data)] == data
            assert await wait_for(sconn.read(crb[100 : 100 + len(data)])) == data
    finally:
        region.close()


# ------------------------------------------------------------------ streams ----


@pytest.mark.parametrize("progress", ["event", "thread"])
async def test_stream_few_mib_with_checksum(device, progress):
    total = 4 << 20
    data = os.urandom(1 << 20) * 4
    digest = hashlib.sha256(data).hexdigest().encode()
    done = asyncio.get_running_loop().create_future()

    async def handle(reader, writer):
        try:
            h = hashlib.sha256()
            n = 0
            while n < total:
                chunk = await reader.read(1 << 20)
                if not chunk:
                    break
                h.update(chunk)
                n += len(chunk)
            writer.write(h.hexdigest().encode() + b"\n")
            writer.write(data[:300_000])  # and some bytes the other way
            await writer.drain()
            assert await reader.read() == b""  # the client's EOF
            writer.close()
            await writer.wait_closed()
            done.set_result(n)
        except BaseException as e:
            if not done.done():
                done.set_exception(e)
            raise

    server = await aiordma.start_stream_server(handle, "127.0.0.1", 0, device=device, progress=progress)
    try:
        reader, writer = await aiordma.open_connection(
            "127.0.0.1", server.port, device=device, progress=progress, timeout=T
        )
        assert writer.get_extra_info("connection").progress_mode == progress
        t0 = time.monotonic()
        for off, size in zip(range(0, total, 700_001), [700_001] * 10):
            writer.write(data[off : off + size])
            await wait_for(writer.drain())
        assert await wait_for(reader.readline()) == digest + b"\n"
        assert await wait_for(reader.readexactly(300_000)) == data[:300_000]
        writer.write_eof()
        assert await wait_for(reader.read()) == b""
        assert await wait_for(done) == total
        writer.close()
        await wait_for(writer.wait_closed())
        print(f"stream: {total >> 20} MiB in {time.monotonic() - t0:.2f} s ({progress})")
    finally:
        server.close()
        await server.wait_closed()


# ------------------------------------------------------- errors from the kernel ----


@pytest.mark.parametrize("case", ["bad_rkey", "out_of_bounds", "read_only_written"])
async def test_remote_access_errors(rxe_server, device, case):
    server, mem, ro, _ = await rxe_server()
    before_ro = bytes(ro)
    conn = await connect(server, device)
    try:
        rb, rro = conn.remote("mem"), conn.remote("ro")
        target = {
            "bad_rkey": RemoteBuffer(rb.addr, 8, rb.rkey ^ 0x5A5A5A5A),
            "out_of_bounds": RemoteBuffer(rb.addr + rb.length - 4, 8, rb.rkey),
            "read_only_written": rro[0:8],
        }[case]
        with pytest.raises(RemoteAccessError, match="IBV_WC_REM_ACCESS_ERR") as ei:
            await wait_for(conn.write(b"12345678", target))
        assert ei.value.status == WCStatus.IBV_WC_REM_ACCESS_ERR
        assert ei.value.wc is not None and ei.value.wc.status == WCStatus.IBV_WC_REM_ACCESS_ERR
        # the QP went to the error state: the connection is lost, and says why
        with pytest.raises(ConnectionLostError, match="IBV_QPS_ERR"):
            await wait_for(conn.send(b"after"))
        with pytest.raises(ConnectionLostError):
            await wait_for(conn.read(rb[0:8]))
        with pytest.raises(ConnectionLostError):
            await wait_for(conn.recv())
    finally:
        await conn.close()
    assert bytes(ro) == before_ro
    assert bytes(mem[-8:]) == bytes(8) and bytes(mem[:8]) == bytes(8)


async def test_read_and_atomic_errors(rxe_server, device):
    """RDMA Read with a bad rkey and an atomic on a read-only region are refused as well."""
    server, _, _, _ = await rxe_server()
    for op in ("read", "atomic"):
        conn = await connect(server, device)
        try:
            rb = conn.remote("mem")
            with pytest.raises(RemoteAccessError):
                if op == "read":
                    await wait_for(conn.read(RemoteBuffer(rb.addr, 16, rb.rkey + 1)))
                else:
                    await wait_for(conn.fetch_and_add(conn.remote("ro")[0:8], 1))
            with pytest.raises(ConnectionLostError):
                await wait_for(conn.write(b"x", rb[0:1]))
        finally:
            await conn.close()


async def test_peer_qp_destroyed_gives_retry_exceeded(rxe_server, device):
    """The server's QP disappears (its TCP rendezvous stays up): the kernel
    retransmits retry_cnt times, then completes the write with
    IBV_WC_RETRY_EXC_ERR."""
    server, _, _, seen = await rxe_server()
    conn = await connect(server, device, ack_timeout=12, retry_cnt=2)  # 4.096 us * 2**12 = 16.8 ms
    try:
        rb = conn.remote("mem")
        await wait_for(conn.write(b"alive", rb[0:5]))
        sconn = await accepted(seen)
        sconn.qp.close()  # ibv_destroy_qp: rxe drops packets for an unknown QPN, no NAK
        t0 = time.monotonic()
        with pytest.raises(RetryExceededError, match="IBV_WC_RETRY_EXC_ERR") as ei:
            await wait_for(conn.write(b"lost", rb[0:4]), 20)
        elapsed = time.monotonic() - t0
        assert ei.value.status == WCStatus.IBV_WC_RETRY_EXC_ERR
        assert elapsed < 10, f"RETRY_EXC_ERR took {elapsed:.1f} s"
        with pytest.raises(ConnectionLostError):
            await wait_for(conn.send(b"after"))
        sconn.abort()
    finally:
        await conn.close()


async def test_peer_abort_fails_client_promptly(rxe_server, device):
    """Server side conn.abort() destroys its QP and drops the rendezvous:
    the client's next write fails promptly (retry exceeded, or the lost rendezvous)."""
    server, _, _, seen = await rxe_server()
    conn = await connect(server, device, ack_timeout=12, retry_cnt=2)
    try:
        rb = conn.remote("mem")
        await wait_for(conn.write(b"alive", rb[0:5]))
        (await accepted(seen)).abort()
        t0 = time.monotonic()
        with pytest.raises((RetryExceededError, ConnectionLostError)):
            await wait_for(conn.write(b"lost", rb[0:4]), 20)
            await wait_for(conn.write(b"lost", rb[0:4]), 20)  # the first may be acked before the abort lands
        assert time.monotonic() - t0 < 10
        with pytest.raises(ConnectionLostError):
            await wait_for(conn.send(b"after"))
    finally:
        await conn.close()


async def test_a_device_port_named_as_nccl_spells_it(rxe_server, device):
    """``"rxe0:1"`` is port 1 of rxe0 (the device the rest of these tests use);
    a port rxe0 does not have is refused, naming the ports it has."""
    server, _, _, _ = await rxe_server()
    name = device.name
    async with await aiordma.connect("127.0.0.1", server.port, device=f"{name}:1", timeout=T) as conn:
        assert conn.device.name == name and conn.device.port_num == 1
        await conn.send(b"port one")
        assert await asyncio.wait_for(conn.recv(), T) == b"port one"
    with pytest.raises(aiordma.DeviceNotFoundError, match=rf"{name} has no port 2 \(ports 1\.\.1\)"):
        await aiordma.connect("127.0.0.1", server.port, device=f"{name}:2", timeout=T)
