"""``aiordma demo``: what aiordma does, on this machine, in a few seconds.

No RDMA hardware needed: by default it runs on the soft device (a userspace
RoCEv2 device speaking the real wire format over UDP on 127.0.0.N:4791).

1. **echo** — an aiordma echo server and a client (two devices, like two
   hosts), a few messages of growing size, round-trip times;
2. **stream** — ``--size`` bytes (8 MiB by default) sent in messages, and the
   receiver's SHA-256 checked against the sender's;
3. **one RDMA Write, step by step** — the eight steps of one RDMA Write
   (WQE, doorbell, lkey, BTH+RETH+ICRC, UDP 4791, rkey, DMA, ACK → CQE),
   printed from the live trace of the soft device with the real values.

``--pcap FILE`` records the client device's traffic (all three parts) in a
pcap file that Wireshark/tshark decode as RoCEv2.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import struct
import sys
import time
from typing import Any

from .. import settings
from ..errors import SettingError
from ..providers import PROVIDERS, resolve_provider
from . import seconds, size_type

_STREAM_CHUNK = 256 * 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--provider",
        choices=PROVIDERS,
        default=None,
        help="device provider (default: $AIORDMA_PROVIDER or auto: a pyverbs device with an active port, else soft)",
    )
    parser.add_argument(
        "--size",
        type=size_type(0, 1 << 30, "the demo keeps the data in memory"),
        default=8 << 20,
        help="bytes for the stream part (default 8M, at most 1G)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address for the TCP rendezvous (default 127.0.0.1)")
    parser.add_argument("--pcap", metavar="FILE", help="capture the demo's RoCEv2 traffic (soft device) to FILE")
    parser.add_argument("--no-color", action="store_true", help="never use colour (default: only on a terminal)")
    parser.add_argument("--timeout", type=seconds, default=30.0, help="seconds allowed for each part (default 30)")


class _Out:
    def __init__(self, color: bool) -> None:
        self.color = color

    def _w(self, code: str, s: str) -> str:
        return f"\x1b[{code}m{s}\x1b[0m" if self.color else s

    def title(self, s: str) -> None:
        print()
        print(self._w("1", s))
        print(self._w("2", "=" * len(s)))

    def line(self, s: str = "") -> None:
        print(s)

    def kv(self, k: str, v: str, width: int = 12) -> None:
        print(f"  {self._w('33', k.ljust(width))}  {v}")

    def ok(self, s: str) -> str:
        return self._w("32", s)

    def bad(self, s: str) -> str:
        return self._w("31", s)


def _fmt_us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:,.0f} us" if us < 10_000 else f"{us / 1000:,.1f} ms"


def _fmt_bytes(n: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m:
            v = n / m
            return f"{v:g} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def _pcap_packets(path: str) -> int:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return -1
    n, off = 0, 24
    while off + 16 <= len(data):
        incl = struct.unpack_from("<I", data, off + 8)[0]
        off += 16 + incl
        n += 1
    return n


# -------------------------------------------------------------------- parts ----


async def _echo_part(out: _Out, aiordma: Any, server_dev: Any, client_dev: Any, host: str) -> None:
    async def echo(conn: Any) -> None:
        try:
            async for msg in conn:
                await conn.send(msg)
        except aiordma.ConnectionClosedError:
            pass  # the client closed while its last echo was being acknowledged

    server = await aiordma.start_server(echo, host, 0, device=server_dev)
    try:
        conn = await aiordma.connect(host, server.port, device=client_dev)
        try:
            peer = conn.peer
            out.kv("server", f"{_dev_desc(server_dev)}, TCP rendezvous {host}:{server.port}")
            out.kv("client", f"{_dev_desc(client_dev)}")
            out.kv(
                "queue pairs", f"client QP 0x{conn.qp_num:06x} <-> server QP 0x{peer.qpn:06x} (RC), path MTU {conn.mtu}"
            )
            out.kv(
                "completions",
                f"progress mode {conn.progress_mode!r} (completion channel fd on the event loop)"
                if conn.progress_mode == "event"
                else f"progress mode {conn.progress_mode!r}",
            )
            out.line()
            for size in (5, 1024, 4096, 65536, 1 << 20):
                msg = b"hello" if size == 5 else os.urandom(size)
                t = time.perf_counter()
                await conn.send(msg)
                back = await conn.recv()
                rtt = time.perf_counter() - t
                if back != msg:
                    raise RuntimeError(f"the echo of a {size}-byte message came back different ({len(back)} bytes)")
                shown = "b'hello'" if size == 5 else f"{_fmt_bytes(size)} of random bytes"
                out.line(f"  send {shown:<26} -> echoed back intact   round trip {_fmt_us(rtt):>9}")
            rtts = []
            for i in range(200):
                m = i.to_bytes(4, "big") * 16
                t = time.perf_counter()
                await conn.send(m)
                if await conn.recv() != m:
                    raise RuntimeError("a 64-byte ping came back different")
                rtts.append(time.perf_counter() - t)
            rtts.sort()
            out.line(
                f"  200 pings of 64 B: min {_fmt_us(rtts[0])}, median {_fmt_us(statistics.median(rtts))}, "
                f"p99 {_fmt_us(rtts[int(len(rtts) * 0.99) - 1])}, max {_fmt_us(rtts[-1])}"
            )
        finally:
            await conn.close()
    finally:
        server.close()
        await server.wait_closed()


def _stream_module() -> Any:
    try:
        from .. import stream
    except ImportError:
        return None
    if not hasattr(stream, "open_connection") or not hasattr(stream, "start_stream_server"):
        return None
    return stream


async def _stream_part(out: _Out, aiordma: Any, server_dev: Any, client_dev: Any, host: str, size: int) -> None:
    data = os.urandom(size)
    expect = hashlib.sha256(data).hexdigest()
    stream = _stream_module()
    if stream is not None:
        got, digest, dt, how = await _via_stream(stream, server_dev, client_dev, host, data)
    else:
        got, digest, dt, how = await _via_messages(aiordma, server_dev, client_dev, host, data)
    out.kv("api", how)
    out.kv(
        "sent",
        f"{_fmt_bytes(size)} in {dt * 1000:.0f} ms = {size / max(dt, 1e-9) / 1e6:.1f} MB/s "
        "(until the receiver's digest was back)",
    )
    out.kv("sha256", f"sender   {expect}")
    out.kv("", f"receiver {digest}")
    if got != size or digest != expect:
        raise RuntimeError(f"SHA-256 mismatch: {got} bytes arrived with a different digest")
    out.kv("check", out.ok("SHA-256 matches"))


async def _via_stream(stream: Any, server_dev: Any, client_dev: Any, host: str, data: bytes) -> tuple[Any, ...]:
    """aiordma's byte stream: asyncio-style reader/writer over RDMA Write-with-immediate into a ring."""
    received: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def sink(reader: Any, writer: Any) -> None:
        h = hashlib.sha256()
        got = 0
        while True:
            b = await reader.read(1 << 20)
            if not b:
                break
            h.update(b)
            got += len(b)
        if not received.done():
            received.set_result(got)
        writer.write(h.hexdigest().encode() + b"\n")
        await writer.drain()
        writer.write_eof()
        await reader.read()  # the sender closes first, once it has the digest
        writer.close()
        await writer.wait_closed()

    server = await stream.start_stream_server(sink, host, 0, device=server_dev)
    try:
        reader, writer = await stream.open_connection(host, server.port, device=client_dev)
        try:
            mv = memoryview(data)
            t = time.perf_counter()
            for off in range(0, len(data), _STREAM_CHUNK):
                writer.write(mv[off : off + _STREAM_CHUNK])
                await writer.drain()
            writer.write_eof()
            digest = (await reader.readline()).decode().strip()
            dt = time.perf_counter() - t
            got = await received
        finally:
            writer.close()
            await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()
    ring = _fmt_bytes(getattr(stream, "DEFAULT_RING_SIZE", 1 << 20))
    how = (
        f"aiordma.open_connection / start_stream_server: writer.write() + drain(), write_eof(); "
        f"RDMA_WRITE_WITH_IMM into the peer's {ring} receive ring"
    )
    return got, digest, dt, how


async def _via_messages(aiordma: Any, server_dev: Any, client_dev: Any, host: str, data: bytes) -> tuple[Any, ...]:
    """Messages: conn.send()/recv(), each split into SEND_WITH_IMM chunks under credit flow control."""
    result: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def sink(conn: Any) -> None:
        h = hashlib.sha256()
        want = int((await conn.recv()).decode())
        got = 0
        while got < want:
            chunk = await conn.recv()
            h.update(chunk)
            got += len(chunk)
        if not result.done():
            result.set_result(got)
        try:
            await conn.send(h.hexdigest().encode())
            async for _ in conn:  # the client closes first, once it has the digest
                pass
        except aiordma.ConnectionClosedError:
            pass

    server = await aiordma.start_server(sink, host, 0, device=server_dev)
    try:
        conn = await aiordma.connect(host, server.port, device=client_dev)
        try:
            mv = memoryview(data)
            t = time.perf_counter()
            await conn.send(str(len(data)).encode())
            for off in range(0, len(data), _STREAM_CHUNK):
                await conn.send(mv[off : off + _STREAM_CHUNK])
            digest = (await conn.recv()).decode()
            dt = time.perf_counter() - t
            got = await result
        finally:
            await conn.close()
    finally:
        server.close()
        await server.wait_closed()
    n = max(1, -(-len(data) // _STREAM_CHUNK))
    how = (
        f"conn.send()/recv(): {n} messages of up to {_fmt_bytes(_STREAM_CHUNK)}, "
        "SEND_WITH_IMM chunks under credit flow control"
    )
    return got, digest, dt, how


def _dev_desc(dev: Any) -> str:
    if getattr(dev, "provider", None) == "soft":
        ip, port = dev.address
        return f"{dev.name} (soft RoCEv2 at {ip}:{port}, GID ::ffff:{ip})"
    return f"{dev.name} ({dev.provider})"


async def _main(args: argparse.Namespace, out: _Out) -> int:
    import aiordma

    from ..providers import get_device
    from ..providers.soft.device import SoftDevice
    from . import walkthrough
    from .devices import explain_auto

    pcap = args.pcap or settings.SOFT_PCAP.get()
    # every soft device would open $AIORDMA_SOFT_PCAP: only the client device captures
    os.environ.pop("AIORDMA_SOFT_PCAP", None)
    try:
        provider, name = resolve_provider(args.provider)
    except SettingError:
        raise  # reported by invoke(), as every tool reports it
    except ValueError as e:
        print(f"aiordma demo: {e}", file=sys.stderr)
        return 2
    out.title("aiordma demo")
    if args.provider:
        why = f"--provider {args.provider}"
    else:
        why = explain_auto()["reason"]
    out.kv("provider", f"{provider}{' ' + name if name else ''} ({why})")
    owned: list[Any] = []
    part = "set-up"
    try:
        if provider == "soft":
            server_dev = SoftDevice(name="soft0")
            owned.append(server_dev)
            client_dev = SoftDevice(name="soft1", capture=pcap)
            owned.append(client_dev)
            # people capture the demo to learn the wire: every ICRC is computed and checked,
            # loopback included (GSO batches pause by themselves while a capture listens)
            server_dev.skips_loopback_icrc = client_dev.skips_loopback_icrc = False
        else:
            server_dev = client_dev = get_device(provider, name)  # type: ignore[assignment]  # any verbs device
            if pcap:
                out.kv("pcap", "only the soft device can capture; on hardware use tcpdump on the RoCE netdev or ibdump")
        part = "echo"
        out.title("1. Echo: messages over an RC queue pair")
        await asyncio.wait_for(_echo_part(out, aiordma, server_dev, client_dev, args.host), args.timeout)
        part = "stream"
        out.title(f"2. Stream: {_fmt_bytes(args.size)} with a SHA-256 check")
        await asyncio.wait_for(_stream_part(out, aiordma, server_dev, client_dev, args.host, args.size), args.timeout)
        part = "RDMA Write walk-through"
        out.title("3. One RDMA Write, step by step (live trace of the soft device)")
        if provider == "soft":
            req, resp = client_dev, server_dev
        else:
            out.line(f"  (a {provider} device cannot be traced from software: this part uses two soft devices)")
            req = SoftDevice(name="soft-requester")
            owned.append(req)
            resp = SoftDevice(name="soft-responder")
            owned.append(resp)
        out.line(
            f"  The client writes {walkthrough.DEFAULT_PAYLOAD.decode()!r} into a 64-byte buffer the server exposed,\n"
            "  with `await conn.write(local_region, remote_buffer[16:38])`. What each side's NIC did:"
        )
        steps = await asyncio.wait_for(
            walkthrough.trace_one_write(requester=req, responder=resp, remote_offset=16, host=args.host), args.timeout
        )
        print(walkthrough.render_steps(steps, color=out.color))
        out.line()
        out.line(
            "On RDMA hardware the CPU appears only in steps 1, 2 and 8; steps 3-7 are the NICs' work. Here the soft"
        )
        out.line("device plays both NICs in software, on its NIC threads or on the event loop's thread.")
    except TimeoutError:
        print(f"\naiordma demo: FAILED in the {part} part: no result after {args.timeout:g} s", file=sys.stderr)
        return 1
    except Exception as e:
        print(f"\naiordma demo: FAILED in the {part} part: {type(e).__name__}: {e}", file=sys.stderr)
        print("(`aiordma devices` lists what this machine has; `aiordma doctor` checks the set-up)", file=sys.stderr)
        return 1
    finally:
        for dev in owned:
            try:
                dev.close()
            except Exception:
                pass
    if pcap and provider == "soft":
        out.line(
            f"Capture: {pcap} ({_pcap_packets(pcap)} packets of soft1); read it with `tshark -r {pcap}` or Wireshark."
        )
    out.line(out.ok("demo finished: all parts succeeded"))
    return 0


def _protect(host: str) -> None:
    """Both ends run in this process: beyond loopback, give them a one-off
    token (protected mode would refuse a server there without one)."""
    from ..security import TOKEN_ENV, is_loopback_address

    if not is_loopback_address(host) and settings.TOKEN.get() is None and settings.TOKEN_FILE.get() is None:
        import secrets

        os.environ[TOKEN_ENV] = secrets.token_urlsafe(32)


def run(args: argparse.Namespace) -> int:
    _protect(args.host)
    color = sys.stdout.isatty() and not args.no_color and not os.environ.get("NO_COLOR")
    return asyncio.run(_main(args, _Out(color)))
