"""Send a file (or generated data) over aiordma and verify its SHA-256 at the other end.

    python examples/stream_file.py serve --port 18516 --output-dir /tmp/received
    python examples/stream_file.py send big.iso --port 18516
    python examples/stream_file.py send --size 64M --port 18516      # generated data

By default it uses aiordma's byte stream (``aiordma.open_connection`` /
``aiordma.start_stream_server``: an asyncio-style reader and writer; the
bytes travel as RDMA Write-with-immediate into the peer's receive ring).
The sender writes a one-line JSON header (name, size), then the bytes in
``--chunk`` pieces (``writer.write()`` + ``await writer.drain()``), then
EOF, and reads back the receiver's one-line JSON answer with its SHA-256,
which must equal its own.

With ``--messages`` (on both sides) it uses ``conn.send()`` / ``conn.recv()``
instead: a header message, one message per chunk (each split by aiordma into
SEND_WITH_IMM chunks under credit flow control) and a reply message.

Progress goes to stderr: a bar that redraws itself on a terminal, a line
every 25 % otherwise. Exit status 0 only if the digests match.

The token (both sides): ``$AIORDMA_TOKEN``, or a file named by
``$AIORDMA_TOKEN_FILE`` or ``--token-file``. A server on anything but
loopback needs one, or ``serve --insecure``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiordma
from aiordma.tools import port_number, seconds, size_type


class Progress:
    """A plain-text progress bar on stderr."""

    def __init__(self, total: int, label: str, stream=sys.stderr) -> None:
        self.total = total
        self.label = label
        self.stream = stream
        self.tty = stream.isatty()
        self.t0 = time.perf_counter()
        self.next_mark = 25
        self.done = 0

    def update(self, n: int) -> None:
        self.done += n
        pct = 100 if self.total == 0 else self.done * 100 // self.total
        if self.tty:
            width = 30
            fill = width * pct // 100
            rate = self.done / max(time.perf_counter() - self.t0, 1e-9) / 1e6
            self.stream.write(
                f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {pct:3d}% "
                f"{self.done / 1048576:.1f}/{self.total / 1048576:.1f} MiB {rate:.1f} MB/s"
            )
            self.stream.flush()
        else:
            while pct >= self.next_mark and self.next_mark <= 100:
                self.stream.write(f"{self.label}: {self.next_mark}% ({self.done} of {self.total} bytes)\n")
                self.stream.flush()
                self.next_mark += 25

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# ----------------------------------------------------------------- receiver ----


async def receive_one(conn: aiordma.Connection, output_dir: str | None) -> bool:
    """Receive one transfer on ``conn``, reply with its SHA-256; True if it was complete."""
    header = json.loads((await conn.recv()).decode())
    name = os.path.basename(str(header.get("name") or "data")) or "data"
    size = int(header["size"])
    out = path = None
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, name)
        out = open(path, "wb")
    h = hashlib.sha256()
    got = 0
    t = time.perf_counter()
    try:
        while got < size:
            chunk = await conn.recv()
            h.update(chunk)
            if out is not None:
                out.write(chunk)
            got += len(chunk)
    finally:
        if out is not None:
            out.close()
    dt = time.perf_counter() - t
    digest = h.hexdigest()
    print(
        f"received {name}: {got} bytes in {dt:.2f} s ({got / max(dt, 1e-9) / 1e6:.1f} MB/s) sha256 {digest}"
        + (f" -> {path}" if path else ""),
        flush=True,
    )
    try:
        await conn.send(json.dumps({"bytes": got, "sha256": digest}).encode())
        # the sender closes once it has the digest: wait for that rather than closing first
        async for _ in conn:
            pass
    except aiordma.ConnectionClosedError:
        pass  # the sender had what it needed and closed
    return got == size


async def receive_stream(reader, writer, output_dir: str | None) -> bool:
    """Receive one transfer on an RDMA byte stream, answer with its SHA-256."""
    header = json.loads(await reader.readline())
    name = os.path.basename(str(header.get("name") or "data")) or "data"
    size = int(header["size"])
    out = path = None
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, name)
        out = open(path, "wb")
    h = hashlib.sha256()
    got = 0
    t = time.perf_counter()
    try:
        while True:
            b = await reader.read(1 << 20)
            if not b:  # EOF: the sender is done
                break
            h.update(b)
            if out is not None:
                out.write(b)
            got += len(b)
    finally:
        if out is not None:
            out.close()
    dt = time.perf_counter() - t
    digest = h.hexdigest()
    print(
        f"received {name}: {got} bytes in {dt:.2f} s ({got / max(dt, 1e-9) / 1e6:.1f} MB/s) sha256 {digest}"
        + (f" -> {path}" if path else ""),
        flush=True,
    )
    writer.write(json.dumps({"bytes": got, "sha256": digest}).encode() + b"\n")
    await writer.drain()
    writer.write_eof()
    await reader.read()  # the sender closes once it has the answer: wait for that rather than closing first
    writer.close()
    await writer.wait_closed()
    return got == size


async def serve(args: argparse.Namespace) -> int:
    done = asyncio.Event()
    failures = 0

    def finished(ok: bool) -> None:
        nonlocal failures
        if not ok:
            failures += 1
        if args.once:
            done.set()

    async def handler(conn: aiordma.Connection) -> None:
        ok = False
        try:
            ok = await receive_one(conn, args.output_dir)
        except aiordma.RDMAError as e:
            print(f"transfer failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            finished(ok)

    async def stream_handler(reader, writer) -> None:
        ok = False
        try:
            ok = await receive_stream(reader, writer, args.output_dir)
        except (aiordma.RDMAError, ValueError) as e:
            print(f"transfer failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            finished(ok)

    device = aiordma.get_device(args.provider)
    if args.messages:
        server = await aiordma.start_server(
            handler, args.host, args.port, device=device, token=args.token_file, insecure=args.insecure or None
        )
    else:
        server = await aiordma.start_stream_server(
            stream_handler, args.host, args.port, device=device, token=args.token_file, insecure=args.insecure or None
        )
    api = "messages" if args.messages else "byte stream"
    print(f"stream server listening on {args.host}:{server.port} ({device.provider}:{device.name}, {api})", flush=True)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    try:
        await done.wait()
    finally:
        server.close()
        await server.wait_closed()
    return 1 if failures else 0


# ------------------------------------------------------------------- sender ----


def _file_chunks(path: str, chunk: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return
            yield b


def _generated_chunks(size: int, chunk: int, seed: int) -> Iterator[bytes]:
    rng = random.Random(seed)
    left = size
    while left > 0:
        n = min(chunk, left)
        yield rng.randbytes(n)
        left -= n


async def send(args: argparse.Namespace) -> int:
    if args.file:
        size = os.path.getsize(args.file)
        name = os.path.basename(args.file)
        chunks = _file_chunks(args.file, args.chunk)
    else:
        size = args.size
        name = f"generated-{size}.bin"
        chunks = _generated_chunks(size, args.chunk, args.seed)
    h = hashlib.sha256()
    bar = Progress(size, f"send {name}")
    header = json.dumps({"name": name, "size": size}).encode()
    sent = 0
    if args.messages:
        conn = await aiordma.connect(
            args.host, args.port, provider=args.provider, token=args.token_file, timeout=args.timeout
        )
        try:
            t = time.perf_counter()
            await conn.send(header)
            for b in chunks:
                h.update(b)
                await conn.send(b)
                sent += len(b)
                bar.update(len(b))
            bar.finish()
            reply = json.loads((await asyncio.wait_for(conn.recv(), args.timeout)).decode())
            dt = time.perf_counter() - t
        finally:
            await conn.close()
    else:
        reader, writer = await aiordma.open_connection(
            args.host, args.port, provider=args.provider, token=args.token_file, timeout=args.timeout
        )
        try:
            t = time.perf_counter()
            writer.write(header + b"\n")
            for b in chunks:
                h.update(b)
                writer.write(b)
                await writer.drain()
                sent += len(b)
                bar.update(len(b))
            bar.finish()
            writer.write_eof()  # the receiver's read() returns b"" after the last byte
            reply = json.loads(await asyncio.wait_for(reader.readline(), args.timeout))
            dt = time.perf_counter() - t
        finally:
            writer.close()
            await writer.wait_closed()
    if sent != size:
        print(f"the file changed while it was sent ({sent} bytes instead of {size})", file=sys.stderr)
        return 1
    mine = h.hexdigest()
    print(f"sent {name}: {size} bytes in {dt:.2f} s ({size / max(dt, 1e-9) / 1e6:.1f} MB/s)", flush=True)
    print(f"sha256 sender   {mine}", flush=True)
    print(f"sha256 receiver {reply.get('sha256')}", flush=True)
    if reply.get("sha256") != mine or reply.get("bytes") != size:
        print("FAILED: the receiver's SHA-256 differs", file=sys.stderr)
        return 1
    print("sha256 verified", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Send a file or generated data over aiordma; verify SHA-256.")
    sub = parser.add_subparsers(dest="mode", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--host", default="127.0.0.1", help="TCP rendezvous address (default 127.0.0.1)")
        p.add_argument("--port", type=port_number, default=18516, help="TCP port (default 18516; serve: 0 = any)")
        p.add_argument(
            "--provider", choices=("auto", "soft", "pyverbs"), default=None, help="device provider (default auto)"
        )
        p.add_argument(
            "--token-file",
            type=Path,
            default=None,
            help="file holding the shared secret (default $AIORDMA_TOKEN or $AIORDMA_TOKEN_FILE)",
        )
        p.add_argument("--timeout", type=seconds, default=30.0, help="seconds to wait for the peer (default 30)")
        p.add_argument(
            "--messages", action="store_true", help="use conn.send()/recv() messages instead of the byte stream"
        )

    ps = sub.add_parser("serve", help="receive transfers, print their SHA-256 (and save them with --output-dir)")
    common(ps)
    ps.add_argument("--output-dir", help="write received files here (default: only hash them)")
    ps.add_argument("--once", action="store_true", help="exit after the first transfer")
    ps.add_argument(
        "--insecure",
        action="store_true",
        help="listen beyond loopback without a token (any host that reaches the port can connect)",
    )
    pc = sub.add_parser("send", help="send FILE, or --size bytes of generated data")
    common(pc)
    pc.add_argument("file", nargs="?", help="the file to send (default: generated data)")
    pc.add_argument("--size", type=size_type(0), default=8 << 20, help="bytes of generated data (default 8M)")
    pc.add_argument("--chunk", type=size_type(1, 1 << 31), default=1 << 20, help="bytes per message (default 1M)")
    pc.add_argument("--seed", type=int, default=0, help="seed of the generated data (default 0)")
    args = parser.parse_args(argv)
    if not args.messages and not hasattr(aiordma, "start_stream_server"):
        args.messages = True  # an aiordma without the byte stream: messages on both sides
    if args.mode == "send":
        if args.port == 0:
            parser.error("--port 0 means any free port, for serve: give the server's port")
        if args.file and not (os.path.isfile(args.file) and os.access(args.file, os.R_OK)):
            parser.error(f"cannot send {args.file!r}: not a readable file")
    if args.mode == "serve" and args.output_dir:
        try:
            os.makedirs(args.output_dir, exist_ok=True)
        except OSError as e:
            parser.error(f"--output-dir {args.output_dir!r}: {e.strerror}")
    try:
        return asyncio.run(serve(args) if args.mode == "serve" else send(args))
    except aiordma.ProtectedModeError:
        parser.error(
            f"--host {args.host}: refusing to serve beyond loopback without a token: set $AIORDMA_TOKEN or "
            "$AIORDMA_TOKEN_FILE or give --token-file (the sender needs the same), or pass --insecure"
        )
    except aiordma.TokenError as e:
        parser.error(str(e))
    except aiordma.RDMAError as e:
        print(f"stream_file {args.mode}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except (TimeoutError, OSError) as e:
        print(f"stream_file {args.mode}: {e!r}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
