"""Secure by default (issue 16), against real servers, sockets and soft devices.

* Protected mode: a server on a non-loopback address of this host without a
  token refuses to start (and nothing listens), starts with a token, or with
  the explicit opt-out and one warning; loopback needs nothing. The same for
  the byte-stream server, ``aiordma bench --server`` and the examples.
* Least privilege: a peer gets a registration of its own with exactly the
  declared rights; a read-only exposure refuses a Write and the atomics with
  ``IBV_WC_REM_ACCESS_ERR`` naming the missing right; memory never exposed is
  unreachable; the registrations go away with the connection.
* The token: a recorded handshake replayed against the server (or a client)
  fails; repeated wrong tokens from one address back off (the server's
  recorded delays double); the token never appears in a log record at any
  level, an exception message or a repr.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import logging
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import aiordma
from aiordma import rendezvous as rdv
from aiordma.connection import protection_domain
from aiordma.providers.base import Access
from aiordma.security import AuthThrottle

pytestmark = pytest.mark.engine_neutral  # the same on every engine and core: CI's reference run leaves it out

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TOKEN = "tok-" + secrets.token_hex(16)


def non_loopback_address() -> str:
    """An address of this host that is not loopback (the source address of a
    route; no packet is sent), else 0.0.0.0 (every interface: not loopback either)."""
    for target in ("192.0.2.1", "10.255.255.255", "198.51.100.1"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((target, 9))
                addr = s.getsockname()[0]
        except OSError:
            continue
        if not ipaddress.ip_address(addr).is_loopback and addr != "0.0.0.0":
            return addr
    return "0.0.0.0"


HOST = non_loopback_address()
#: where a client reaches a server listening on HOST
REACH = "127.0.0.1" if HOST == "0.0.0.0" else HOST


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def echo(conn: aiordma.Connection) -> None:
    with contextlib.suppress(aiordma.RDMAError):
        async for msg in conn:
            await conn.send(msg)


async def round_trip(conn: aiordma.Connection) -> None:
    await conn.send(b"ping")
    assert await asyncio.wait_for(conn.recv(), 10) == b"ping"


# ------------------------------------------------------- protected mode ----


async def test_non_loopback_server_without_token_refuses_to_start():
    port = free_port(HOST)
    with pytest.raises(aiordma.ProtectedModeError) as ei:
        await aiordma.start_server(echo, HOST, port, provider="soft")
    msg = str(ei.value)
    assert f"{HOST}:{port}" in msg
    for way_out in ("token=", "$AIORDMA_TOKEN", "$AIORDMA_TOKEN_FILE", "insecure=True", "AIORDMA_INSECURE=1"):
        assert way_out in msg, msg
    assert isinstance(ei.value, aiordma.RDMAError)
    # nothing ever listened, and the port is free again
    with pytest.raises(OSError):
        socket.create_connection((REACH, port), timeout=2).close()
    with socket.socket() as s:
        s.bind((HOST, port))


@pytest.mark.parametrize("host", [None, "", "0.0.0.0"])
async def test_every_interface_is_not_loopback(host):
    with pytest.raises(aiordma.ProtectedModeError, match="every interface"):
        await aiordma.start_server(echo, host, 0, provider="soft")


async def test_stream_server_follows_the_same_rule():
    with pytest.raises(aiordma.ProtectedModeError):
        await aiordma.start_stream_server(lambda r, w: None, HOST, 0, provider="soft")
    server = await aiordma.start_stream_server(lambda r, w: w.close(), HOST, 0, provider="soft", token=TOKEN)
    server.close()
    await server.wait_closed()


async def test_non_loopback_server_with_a_token_serves_clients_that_know_it():
    server = await aiordma.start_server(echo, HOST, 0, provider="soft", token=TOKEN)
    try:
        assert server.sockets[0].getsockname()[0] == HOST
        async with await aiordma.connect(REACH, server.port, provider="soft", token=TOKEN) as conn:
            await round_trip(conn)
        with pytest.raises(aiordma.AuthenticationError, match="requires a shared-secret token"):
            await aiordma.connect(REACH, server.port, provider="soft")
        with pytest.raises(aiordma.AuthenticationError, match="wrong token"):
            await aiordma.connect(REACH, server.port, provider="soft", token="not-" + TOKEN)
    finally:
        server.close()
        await server.wait_closed()


async def test_token_file_from_the_environment(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    monkeypatch.setenv("AIORDMA_TOKEN_FILE", str(token_file))
    server = await aiordma.start_server(echo, HOST, 0, provider="soft")  # protected by the file's token
    try:
        # the file was read once, at the start: changing it now changes nothing for this server
        token_file.write_text("rotated-" + TOKEN + "\n")
        async with await aiordma.connect(REACH, server.port, provider="soft", token=TOKEN) as conn:
            await round_trip(conn)
        with pytest.raises(aiordma.AuthenticationError):
            await aiordma.connect(REACH, server.port, provider="soft", token="rotated-" + TOKEN)
    finally:
        server.close()
        await server.wait_closed()
    monkeypatch.setenv("AIORDMA_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(aiordma.TokenError, match="AIORDMA_TOKEN_FILE=.*missing: no such file"):
        await aiordma.start_server(echo, HOST, 0, provider="soft")


@pytest.mark.parametrize("how", ["argument", "environment"])
async def test_insecure_opt_out_starts_with_one_warning(how, monkeypatch, caplog):
    kwargs = {"insecure": True} if how == "argument" else {}
    if how == "environment":
        monkeypatch.setenv("AIORDMA_INSECURE", "1")
    with caplog.at_level(logging.WARNING, logger="aiordma"):
        server = await aiordma.start_server(echo, HOST, 0, provider="soft", **kwargs)
        try:
            for _ in range(2):
                async with await aiordma.connect(REACH, server.port, provider="soft") as conn:
                    await round_trip(conn)
        finally:
            server.close()
            await server.wait_closed()
    warned = [r for r in caplog.records if "WITHOUT a token" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert f":{server.port}" in warned[0].getMessage() and warned[0].levelno == logging.WARNING


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


async def test_loopback_servers_need_no_token(caplog):
    hosts = ["127.0.0.1", "127.0.0.9", "localhost"] + (["::1"] if _ipv6_loopback() else [])
    with caplog.at_level(logging.DEBUG, logger="aiordma"):
        for host in hosts:
            server = await aiordma.start_server(echo, host, 0, provider="soft")
            try:
                where = "::1" if host == "::1" else ("127.0.0.1" if host == "localhost" else host)
                async with await aiordma.connect(where, server.port, provider="soft") as conn:
                    await round_trip(conn)
            finally:
                server.close()
                await server.wait_closed()
    assert "WITHOUT a token" not in caplog.text


# ---------------------------------------------------- least privilege ----


@pytest.fixture
async def exposing_server():
    """One 4 KiB region exposed under several names with different rights."""
    mem = bytearray(b"M" * 4096)
    region = aiordma.register(mem, provider="soft")
    seen: list[aiordma.Connection] = []

    async def handler(conn):
        seen.append(conn)
        await echo(conn)

    server = await aiordma.start_server(
        handler,
        "127.0.0.1",
        0,
        provider="soft",
        expose={
            "ro": region,  # a bare region: read-only
            "rw": region.exposed("rw"),
            "wo": region[1024:2048].exposed("w"),  # a mailbox: written, not read, and only these bytes
            "all": region.exposed("rwa"),
        },
    )
    yield server, mem, region, seen
    server.close()
    await server.wait_closed()
    region.close()


async def _connect(server, seen=None, *, settle=True, **kw) -> aiordma.Connection:
    conn = await aiordma.connect("127.0.0.1", server.port, provider="soft", **kw)
    if settle:
        await round_trip(conn)  # the server's handler runs: its side is fully attached
    return conn


OPS = {
    "write": ("REMOTE_WRITE", lambda c, rb: c.write(b"pwned", rb[0:5])),
    "write_with_imm": ("REMOTE_WRITE", lambda c, rb: c.write(b"pwned", rb[0:5], imm=1)),
    "fetch_and_add": ("REMOTE_ATOMIC", lambda c, rb: c.fetch_and_add(rb[8:16], 1)),
    "compare_and_swap": ("REMOTE_ATOMIC", lambda c, rb: c.compare_and_swap(rb[8:16], 0x4D4D4D4D4D4D4D4D, 0)),
}


@pytest.mark.parametrize("settle", [True, False], ids=["attached", "at_once"])
@pytest.mark.parametrize("op", list(OPS))
async def test_read_only_exposure_refuses_writes_and_atomics(exposing_server, op, settle):
    server, mem, _, _ = exposing_server
    right, run = OPS[op]
    before = bytes(mem)
    conn = await _connect(server, settle=settle)
    try:
        rb = conn.remote("ro")
        assert rb.rights == "r"
        with pytest.raises(aiordma.RemoteAccessError) as ei:
            await asyncio.wait_for(run(conn, rb), 10)
        assert ei.value.status == aiordma.WCStatus.IBV_WC_REM_ACCESS_ERR
        assert "IBV_WC_REM_ACCESS_ERR" in str(ei.value) and right in str(ei.value), str(ei.value)
    finally:
        with contextlib.suppress(aiordma.RDMAError):
            await conn.close()
    assert bytes(mem) == before, "a refused operation changed the memory"
    # the same memory, read through the read-only exposure, still works
    async with await _connect(server) as conn:
        assert await conn.read(conn.remote("ro")[0:4]) == b"MMMM"


async def test_write_only_slice_refuses_reads_and_bytes_outside_it(exposing_server):
    server, mem, _, _ = exposing_server
    async with await _connect(server) as conn:
        wo = conn.remote("wo")
        assert (wo.length, wo.rights) == (1024, "w")
        await conn.write(b"mail", wo[0:4])
        assert mem[1024:1028] == b"mail"
    for target, right in ((lambda wo: wo[0:4], "REMOTE_READ"), (lambda wo: wo.at(1020, 8), "outside")):
        conn = await _connect(server)
        try:
            with pytest.raises(aiordma.RemoteAccessError) as ei:
                if right == "REMOTE_READ":
                    await asyncio.wait_for(conn.read(target(conn.remote("wo"))), 10)
                else:
                    await asyncio.wait_for(conn.write(b"x" * 8, target(conn.remote("wo"))), 10)
            assert right in str(ei.value), str(ei.value)
        finally:
            with contextlib.suppress(aiordma.RDMAError):
                await conn.close()
    assert bytes(mem[2048:2056]) == b"M" * 8  # just past the slice: untouched


async def test_declared_rights_are_what_the_registration_grants(exposing_server):
    server, mem, region, seen = exposing_server
    async with await _connect(server) as conn:
        mine = seen[-1].exposures.regions
        assert mine["ro"].mr.access == Access.REMOTE_READ
        assert mine["rw"].mr.access == Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE
        assert mine["wo"].mr.access == Access.LOCAL_WRITE | Access.REMOTE_WRITE
        assert mine["all"].mr.access == aiordma.providers.base.ACCESS_ALL
        assert mine["wo"].addr == region.addr + 1024 and mine["wo"].length == 1024
        # the rkeys a peer learns are not the region's own, and each name has its own
        rkeys = {name: conn.remote(name).rkey for name in ("ro", "rw", "wo", "all")}
        assert region.rkey not in rkeys.values() and len(set(rkeys.values())) == 4
        # and everything the rights allow works
        rw, a = conn.remote("rw"), conn.remote("all")
        await conn.write(b"hello", rw[0:5])
        assert await conn.read(rw[0:5]) == b"hello" and mem[:5] == b"hello"
        mem[64:72] = bytes(8)
        assert await conn.fetch_and_add(a[64:72], 5) == 0
        assert await conn.compare_and_swap(a[64:72], 5, 9) == 5
        assert mem[64:72] == (9).to_bytes(8, "little")
        async with await _connect(server) as other:
            # a second client gets registrations (and rkeys) of its own
            assert other.remote("rw").rkey != rw.rkey


async def test_memory_never_exposed_is_unreachable(exposing_server):
    server, mem, region, _ = exposing_server
    # register()'s default grants no remote right: its own rkey reaches nothing
    assert region.access == Access.LOCAL_WRITE
    for op in ("read", "write"):
        conn = await _connect(server)
        try:
            target = aiordma.RemoteBuffer(region.addr, 8, region.rkey)
            with pytest.raises(aiordma.RemoteAccessError, match="REMOTE_READ" if op == "read" else "REMOTE_WRITE"):
                if op == "read":
                    await asyncio.wait_for(conn.read(target), 10)
                else:
                    await asyncio.wait_for(conn.write(b"pwned!!!", target), 10)
        finally:
            with contextlib.suppress(aiordma.RDMAError):
                await conn.close()
    assert bytes(mem[:8]) == b"M" * 8


async def test_advertise_follows_the_same_rule():
    seen: list[aiordma.Connection] = []

    async def handler(conn):
        seen.append(conn)
        await echo(conn)

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft")
    pd = protection_domain(aiordma.get_device("soft"))
    local = bytearray(64)
    try:
        async with await _connect(server) as conn:
            region = conn.register(local)
            rb = await conn.advertise(region, "box")  # read-only by default
            assert rb.rights == "r" and rb.rkey != region.rkey
            theirs = await seen[-1].wait_remote("box", timeout=5)
            assert theirs.rights == "r"
            with pytest.raises(aiordma.RemoteAccessError, match="REMOTE_WRITE"):
                await asyncio.wait_for(seen[-1].write(b"x", theirs[0:1]), 10)
        assert local == bytearray(64)
        async with await _connect(server) as conn:
            region = conn.register(local)
            first = await conn.advertise(region.exposed("rw"), "box")
            theirs = await seen[-1].wait_remote("box", timeout=5)
            await seen[-1].write(b"ok", theirs[0:2])
            assert local[:2] == b"ok"
            # advertising the name again revokes what it named before
            second = await conn.advertise(region[32:].exposed("w"), "box")
            assert pd.by_rkey(first.rkey) is None and pd.by_rkey(second.rkey) is not None
            # a bad value fails before anything is sent
            with pytest.raises(TypeError, match="Region"):
                await conn.advertise(b"bytes", "nope")  # type: ignore[arg-type]
    finally:
        server.close()
        await server.wait_closed()


async def test_exposure_registrations_are_released():
    device = aiordma.get_device("soft")
    pd = protection_domain(device)
    gc.collect()
    baseline = set(pd._by_rkey)
    mem = aiordma.register(bytearray(8192), provider="soft")
    client_mem = aiordma.register(bytearray(4096), provider="soft")
    server = await aiordma.start_server(
        echo, "127.0.0.1", 0, provider="soft", expose={"a": mem, "b": mem[0:4096].exposed("rwa")}
    )
    learned = []
    conn = None
    try:
        for i in range(20):
            conn = await _connect(server, expose={"c": client_mem.exposed("w")})
            first = await conn.advertise(client_mem, "late")
            await conn.advertise(client_mem.exposed("r"), "late")  # replaces (and releases) the first
            assert pd.by_rkey(first.rkey) is None
            assert len(conn.exposures) == 2
            # what each side handed out: the server's two exposures, the client's two
            given = [conn.remote("a").rkey, conn.remote("b").rkey]
            given += [r.rkey for r in conn.exposures.regions.values()]
            assert all(pd.by_rkey(k) is not None for k in given)
            learned += given
            if i % 2:
                await conn.close()
            else:
                conn.abort()
            for _ in range(200):  # the server's side closes when its handler sees the end
                if not server.connections:
                    break
                await asyncio.sleep(0.01)
            assert not server.connections
            assert all(pd.by_rkey(k) is None for k in given), "an exposure outlived its connection"
            # nothing else is left either: only the two regions themselves
            assert set(pd._by_rkey) - baseline == {mem.rkey, client_mem.rkey}
        assert len(set(learned)) == len(learned)
        # closing a region revokes its exposures on live connections too
        conn = await _connect(server)
        rb = conn.remote("b")
        assert await conn.read(rb[0:4]) == bytes(4)
        mem.close()
        with pytest.raises(aiordma.RemoteAccessError):
            await asyncio.wait_for(conn.read(rb[0:4]), 10)
        with contextlib.suppress(aiordma.RDMAError):
            await conn.close()
    finally:
        if conn is not None:
            conn.abort()
        server.close()
        await server.wait_closed()
        mem.close()
        client_mem.close()
    gc.collect()
    assert set(pd._by_rkey) == baseline


# ---------------------------------------------------------- the token ----


class _Recorder:
    """A TCP proxy in front of a server that records both directions."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.to_server = bytearray()
        self.to_client = bytearray()
        self.server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _client(self, reader, writer) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pipe(r, w, into: bytearray) -> None:
            try:
                while data := await r.read(65536):
                    into += data
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        await asyncio.gather(pipe(reader, up_w, self.to_server), pipe(up_r, writer, self.to_client))

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def test_replayed_handshake_fails():
    server = await aiordma.start_server(echo, "127.0.0.1", 0, provider="soft", token=TOKEN)
    recorder = _Recorder(server.port)
    proxy_port = await recorder.start()
    try:
        async with await aiordma.connect("127.0.0.1", proxy_port, provider="soft", token=TOKEN) as conn:
            await round_trip(conn)
        for _ in range(200):
            if not server.connections:
                break
            await asyncio.sleep(0.01)
        assert server.accepted == 1 and server.refused == 0
        assert b"auth" in recorder.to_server and TOKEN.encode() not in recorder.to_server + recorder.to_client

        # the client's bytes, replayed as they were: the server's nonce is new, the MAC is not
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(bytes(recorder.to_server))
        ch = rdv.Channel(reader, writer)
        try:
            assert (await asyncio.wait_for(ch.recv(), 10))["t"] == "hello"
            with pytest.raises(aiordma.AuthenticationError, match="wrong token"):
                await asyncio.wait_for(ch.recv(), 10)
        finally:
            ch.close()
        for _ in range(200):
            if server.refused:
                break
            await asyncio.sleep(0.01)
        assert server.accepted == 1 and server.refused == 1
        assert isinstance(server.last_error, aiordma.AuthenticationError)
        assert server.auth_throttle.failures == 1

        # the server's bytes, replayed to a real client: the client's nonce is new
        async def impostor(r, w) -> None:
            await r.read(1)
            w.write(bytes(recorder.to_client))
            with contextlib.suppress(ConnectionError, OSError):
                await w.drain()
                await r.read()
            w.close()

        fake = await asyncio.start_server(impostor, "127.0.0.1", 0)
        try:
            with pytest.raises(aiordma.AuthenticationError, match="could not prove it knows the token"):
                await aiordma.connect("127.0.0.1", fake.sockets[0].getsockname()[1], provider="soft", token=TOKEN)
        finally:
            fake.close()
            await fake.wait_closed()
    finally:
        await recorder.close()
        server.close()
        await server.wait_closed()


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_repeated_wrong_tokens_from_one_source_back_off():
    clock = ManualClock()
    throttle = AuthThrottle(limit=3, window=60, backoff=5, max_backoff=60, clock=clock)
    server = await aiordma.start_server(echo, "127.0.0.1", 0, provider="soft", token=TOKEN, auth_throttle=throttle)
    try:
        for _ in range(3):
            with pytest.raises(aiordma.AuthenticationError, match="wrong token"):
                await aiordma.connect("127.0.0.1", server.port, provider="soft", token="guess-" + secrets.token_hex(4))
            clock.now += 1
        assert throttle.failures == 3 and throttle.last_backoff == 5
        # backing off: refused before any challenge, even with the right token, and told when to retry
        with pytest.raises(aiordma.AuthenticationError, match=r"too many failed authentication attempts .* in [45] s"):
            await aiordma.connect("127.0.0.1", server.port, provider="soft", token=TOKEN)
        assert throttle.refusals == 1
        # another address is not slowed down: it gets its challenge and passes it
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port, local_addr=("127.0.0.2", 0))
        ch = rdv.Channel(reader, writer)
        try:
            assert "msg-credits-v1" in await asyncio.wait_for(rdv.client_hello(ch, TOKEN.encode()), 10)
        finally:
            ch.close()
        assert throttle.refusals == 1
        # once the back-off has passed, the right token works again
        clock.now += 5.01
        async with await aiordma.connect("127.0.0.1", server.port, provider="soft", token=TOKEN) as conn:
            await round_trip(conn)
        # each further wrong guess doubles the wait: the guesser gets slower and slower
        delays = [throttle.last_backoff]
        for _ in range(4):
            clock.now += throttle.retry_after("127.0.0.1") + 0.01
            with pytest.raises(aiordma.AuthenticationError, match="wrong token"):
                await aiordma.connect("127.0.0.1", server.port, provider="soft", token="guess")
            delays.append(throttle.last_backoff)
        assert delays == [5, 10, 20, 40, 60]
        assert throttle.failures == 7 and throttle.refusals == 1
    finally:
        server.close()
        await server.wait_closed()


async def test_parallel_guesses_cannot_pass_the_limit():
    """Twelve wrong tokens at once from one address: only ``limit`` of them reach
    the challenge before the back-off starts; the rest are refused unanswered."""
    clock = ManualClock()
    throttle = AuthThrottle(limit=3, window=60, backoff=5, clock=clock)
    server = await aiordma.start_server(echo, "127.0.0.1", 0, provider="soft", token=TOKEN, auth_throttle=throttle)
    try:

        async def guess(i: int) -> str:
            try:
                await aiordma.connect("127.0.0.1", server.port, provider="soft", token=f"guess-{i}")
            except aiordma.AuthenticationError as e:
                return "refused" if "too many failed" in str(e) else "wrong"
            return "in?!"

        outcomes = await asyncio.wait_for(asyncio.gather(*(guess(i) for i in range(12))), 60)
        assert sorted(outcomes) == ["refused"] * 9 + ["wrong"] * 3
        assert throttle.failures == 3 and throttle.refusals == 9
    finally:
        server.close()
        await server.wait_closed()


async def test_many_parallel_logins_from_one_address_all_get_in():
    """At most ``limit`` handshakes of one address are at the challenge at once;
    the others wait their turn, none is refused, and no turn is left taken."""
    server = await aiordma.start_server(
        echo, "127.0.0.1", 0, provider="soft", token=TOKEN, recv_buffers=4, recv_buffer_size=4096
    )
    conns: list[aiordma.Connection] = []
    try:

        async def one() -> None:
            conn = await aiordma.connect(
                "127.0.0.1", server.port, provider="soft", token=TOKEN, recv_buffers=4, recv_buffer_size=4096
            )
            conns.append(conn)
            await round_trip(conn)

        await asyncio.wait_for(asyncio.gather(*(one() for _ in range(24))), 60)
        assert server.accepted == 24 and server.refused == 0
        assert server._lanes == {} and server._lane_waiters == {}
        assert server.auth_throttle.failures == 0 and server.auth_throttle.refusals == 0
    finally:
        for conn in conns:
            await conn.close()
        server.close()
        await server.wait_closed()


async def test_the_token_never_appears_in_logs_errors_or_reprs(tmp_path):
    records: list[logging.LogRecord] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    root = logging.getLogger()
    handler = Capture(logging.DEBUG)
    levels = {name: logging.getLogger(name).level for name in ("", "aiordma", "asyncio")}
    root.addHandler(handler)
    for name in levels:
        logging.getLogger(name).setLevel(logging.DEBUG)
    texts: list[str] = []
    wrong = "wrong-" + TOKEN[4:]
    throttle = AuthThrottle(limit=2, backoff=30)  # the two wrong tokens below start a back-off
    try:
        server = await aiordma.start_server(echo, "127.0.0.1", 0, provider="soft", token=TOKEN, auth_throttle=throttle)
        open_server = await aiordma.start_server(echo, "127.0.0.1", 0, provider="soft")
        try:
            texts += [repr(server), str(server.auth_throttle)]
            async with await aiordma.connect("127.0.0.1", server.port, provider="soft", token=TOKEN) as conn:
                await round_trip(conn)
                texts += [repr(conn), repr(conn.peer), repr(conn.remote_buffers)]
            attempts = [
                (server.port, wrong),  # a wrong token
                (server.port, None),  # none
                (open_server.port, TOKEN),  # a token for a server that has none
                (server.port, wrong),
                (server.port, TOKEN),  # backing off now
            ]
            for port, token in attempts:
                with pytest.raises(aiordma.AuthenticationError) as ei:
                    await aiordma.connect("127.0.0.1", port, provider="soft", token=token)
                texts += [str(ei.value), repr(ei.value)]
            for _ in range(200):
                if server.refused >= 4:
                    break
                await asyncio.sleep(0.01)
            texts += [str(server.last_error), repr(server.last_error)]
            # a token file that cannot be used: the errors name the file, not its content
            big = tmp_path / "big-token"
            big.write_text(TOKEN * 5000)
            with pytest.raises(aiordma.TokenError) as ei:
                await aiordma.connect("127.0.0.1", server.port, provider="soft", token=big)
            texts += [str(ei.value), repr(ei.value)]
        finally:
            for s in (server, open_server):
                s.close()
                await s.wait_closed()
    finally:
        root.removeHandler(handler)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    texts += [formatter.format(r) for r in records]
    assert any("refused" in t for t in texts), "the capture saw the refusals"
    assert any(r.levelno == logging.DEBUG for r in records) or any(r.levelno == logging.INFO for r in records)
    whole = "\n".join(texts)
    for secret in (TOKEN, wrong):
        for form in (secret, secret.encode().hex(), repr(secret.encode()), secret[4:]):
            assert form not in whole, f"the token appeared ({form!r})"


# ------------------------------------------------ command-line ends ----


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIORDMA_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["AIORDMA_PROVIDER"] = "soft"
    env.update(extra)
    return env


def _one_line(cp: subprocess.CompletedProcess, code: int) -> str:
    explain = f"exit {cp.returncode}\nstdout:\n{cp.stdout}\nstderr:\n{cp.stderr}"
    assert cp.returncode == code, explain
    assert "Traceback" not in cp.stderr, explain
    lines = [line for line in cp.stderr.splitlines() if line.strip() and not line.startswith("usage:")]
    lines = [line for line in lines if not line.startswith(" ")]  # argparse's wrapped usage
    assert len(lines) == 1, explain
    return lines[0]


def _run(*argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=60, env=_env(**env), cwd=ROOT
    )


def _serves(argv: list[str], ready: str, **env: str) -> tuple[str, str]:
    """Start a server process, wait for ``ready`` on stdout, stop it; its stdout line and stderr."""
    proc = subprocess.Popen(
        [sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(**env), cwd=ROOT
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert ready in line, f"{line!r}\n{proc.stderr.read() if proc.poll() is not None else ''}"
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    return line, err


def test_bench_server_beyond_loopback_needs_a_token_or_insecure():
    argv = ["-m", "aiordma.cli", "bench", "write_bw", "--server", "--bind", HOST, "--port", "0"]
    line = _one_line(_run(*argv), 2)
    for says in (f"--bind {HOST}", "$AIORDMA_TOKEN", "$AIORDMA_TOKEN_FILE", "--insecure"):
        assert says in line, line
    # the default --bind is every interface
    assert "--bind 0.0.0.0" in _one_line(_run(*argv[:5], "--port", "0"), 2)
    _serves(argv, "AIORDMA-BENCH-READY", AIORDMA_TOKEN=TOKEN)
    _, err = _serves([*argv, "--insecure"], "AIORDMA-BENCH-READY")
    assert "WITHOUT a token" in err
    assert "--insecure applies to --server only" in _one_line(_run("-m", "aiordma.cli", "bench", "write_bw",
                                                                   "--insecure"), 2)  # fmt: skip


def test_examples_beyond_loopback_need_a_token_or_insecure(tmp_path):
    echo_server = str(EXAMPLES / "echo_server.py")
    line = _one_line(_run(echo_server, "--host", HOST, "--port", "0"), 2)
    assert "$AIORDMA_TOKEN" in line and "--token-file" in line and "--insecure" in line, line
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    _serves([echo_server, "--host", HOST, "--port", "0", "--token-file", str(token_file)], "listening on")
    _, err = _serves([echo_server, "--host", HOST, "--port", "0", "--insecure"], "listening on")
    assert "WITHOUT a token" in err
    line = _one_line(_run(str(EXAMPLES / "stream_file.py"), "serve", "--host", HOST, "--port", "0"), 2)
    assert "--insecure" in line, line
    line = _one_line(_run(echo_server, "--token-file", str(tmp_path / "missing")), 2)
    assert "no such file" in line, line
    # the C program's twin has no token at all: beyond loopback only with --insecure
    line = _one_line(_run(str(EXAMPLES / "rdma_write_demo.py"), "server", HOST, "0"), 2)
    assert "--insecure" in line, line
