"""A one-sided key-value server: it registers a hash table and counters, exposes
them, and then runs no code per operation. Clients (``kv_client.py``,
``benchmarks/kv.py``) GET by RDMA Read, PUT by a compare-and-swap-locked RDMA
Write, and count by fetch-and-add, all against this memory; on a NIC (or the
soft device's native engine) no instruction of this process runs for them.

    python examples/kv_server.py --port 18520 --buckets 4096
    python examples/kv_client.py --port 18520 put greeting hello
    python examples/kv_client.py --port 18520 get greeting
    python examples/kv_client.py --port 18520 incr 3 --by 10

The table format is described in ``examples/kv_store.py``. Stop with Ctrl-C or
SIGTERM: the server then prints what its memory holds (it reads its own memory:
no client was asked). On the soft device each process binds its own
127.0.0.N:4791.

Clients get only the rights they need: the layout read-only, the table
read-write with atomics (its version words are locks), the counters read and
fetch-and-add. A token comes from ``$AIORDMA_TOKEN``, ``$AIORDMA_TOKEN_FILE``
or ``--token-file``; beyond loopback the server needs one, or ``--insecure``.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_store import (
    COUNTERS_NAME,
    META_NAME,
    TABLE_NAME,
    VERSION,
    Layout,
    parse_slot,
)

import aiordma

DEFAULT_PORT = 18520


@dataclass
class KVServer:
    """The registered table and counters, and the aiordma server exposing them."""

    layout: Layout
    server: aiordma.Server
    device: Any
    regions: list[aiordma.Region]
    table: mmap.mmap
    counters: mmap.mmap

    @property
    def port(self) -> int:
        return self.server.port

    def contents(self) -> tuple[dict[bytes, bytes], int, dict[int, int]]:
        """(entries, slots locked or torn right now, non-zero counters), read from local memory."""
        entries: dict[bytes, bytes] = {}
        busy = 0
        size = self.layout.slot_size
        view = memoryview(self.table)
        for i in range(self.layout.buckets):
            slot = parse_slot(self.layout, view[i * size : (i + 1) * size])
            if slot is None:
                busy += 1
            elif slot[1]:
                entries[slot[1]] = slot[2]
        counters = {}
        for i in range(self.layout.counters):
            (n,) = VERSION.unpack_from(self.counters, 8 * i)
            if n:
                counters[i] = n
        view.release()
        return entries, busy, counters

    async def close(self) -> None:
        self.server.close()
        await self.server.wait_closed()
        for r in self.regions:
            r.close()


async def start(
    layout: Layout,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    provider: str | None = None,
    token: str | Path | None = None,
    insecure: bool | None = None,
    on_client: Any = None,
) -> KVServer:
    """Register the table and counters and serve them (one-sided access only)."""
    device = aiordma.get_device(provider)
    # anonymous mmaps: page-aligned, so every slot's version word and every counter is
    # 8-byte aligned in the clients' view too (atomics on unaligned words are refused)
    table = mmap.mmap(-1, layout.table_bytes)
    counters = mmap.mmap(-1, layout.counters_bytes)
    meta = bytearray(layout.pack())
    regions = [aiordma.register(buf, device=device) for buf in (meta, table, counters)]

    async def handler(conn: aiordma.Connection) -> None:
        if on_client is not None:
            on_client(conn, "connected")
        try:
            # clients send no messages: this only waits for the client to leave. Their
            # reads, writes and atomics never wake this process
            await conn.recv()
        except aiordma.RDMAError:
            pass
        if on_client is not None:
            on_client(conn, "left")

    # what a client may do to each: read the layout; read, write and lock (atomics) the
    # table; read and fetch-and-add the counters (and nothing else: its NIC refuses more)
    rights = ("r", "rwa", "ra")
    exposed = {
        name: region.exposed(r) for name, region, r in zip((META_NAME, TABLE_NAME, COUNTERS_NAME), regions, rights)
    }
    server = await aiordma.start_server(
        handler, host, port, device=device, token=token, insecure=insecure, expose=exposed
    )
    return KVServer(layout, server, device, regions, table, counters)


async def serve(args: argparse.Namespace) -> int:
    layout = Layout(args.buckets, args.key_size, args.value_size, args.counters)

    def on_client(conn: aiordma.Connection, what: str) -> None:
        if args.verbose:
            print(f"client QP 0x{conn.qp_num:06x} {what}", flush=True)

    kv = await start(
        layout,
        args.host,
        args.port,
        provider=args.provider,
        token=args.token_file,  # None: $AIORDMA_TOKEN or $AIORDMA_TOKEN_FILE
        insecure=args.insecure or None,  # None: $AIORDMA_INSECURE
        on_client=on_client,
    )
    dev = kv.device
    where = f"{dev.provider}:{dev.name}"
    if dev.provider == "soft":
        ip, udp = dev.address
        where += f" at {ip}:{udp}, engine {getattr(dev, 'engine', 'python')}"
    print(
        f"kv server listening on {args.host}:{kv.port} ({where}): {layout.buckets} buckets of "
        f"{layout.key_max}-byte keys and {layout.value_max}-byte values, {layout.counters} counters, "
        f"{layout.table_bytes + layout.counters_bytes} bytes of registered memory",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        entries, busy, counters = kv.contents()
        await kv.close()
    print(f"kv server stopped: {len(entries)} keys stored, {busy} slots locked", flush=True)
    if counters:
        print("counters: " + " ".join(f"{i}={n}" for i, n in sorted(counters.items())), flush=True)
    return 0


def _positive(text: str) -> int:
    try:
        n = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="One-sided key-value server: a hash table in registered memory, no code per operation.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[1],
    )
    p.add_argument("--host", default="127.0.0.1", help="address of the TCP rendezvous (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0: any)")
    p.add_argument("--provider", choices=("auto", "soft", "pyverbs"), default=None, help="device provider")
    p.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="file holding the secret clients must know (default $AIORDMA_TOKEN or $AIORDMA_TOKEN_FILE)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="listen beyond loopback without a token (any host that reaches the port can connect)",
    )
    p.add_argument("--buckets", type=_positive, default=4096, help="hash-table slots (default 4096)")
    p.add_argument("--key-size", type=_positive, default=32, help="largest key in bytes (default 32)")
    p.add_argument("--value-size", type=_positive, default=64, help="largest value in bytes (default 64)")
    p.add_argument("--counters", type=_positive, default=64, help="fetch-and-add counters (default 64)")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio", help="event loop (default asyncio)")
    p.add_argument("-v", "--verbose", action="store_true", help="print clients connecting and leaving")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be 0..65535, not {args.port}")
    try:
        Layout(args.buckets, args.key_size, args.value_size, args.counters)
    except ValueError as e:
        parser.error(str(e))
    factory = asyncio.new_event_loop
    if args.loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(serve(args))
    except aiordma.ProtectedModeError:
        parser.error(
            f"--host {args.host}: refusing to serve beyond loopback without a token: set $AIORDMA_TOKEN or "
            "$AIORDMA_TOKEN_FILE or give --token-file (the clients need the same), or pass --insecure"
        )
    except aiordma.TokenError as e:
        parser.error(str(e))
    except aiordma.RDMAError as e:
        print(f"kv server: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"kv server: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
