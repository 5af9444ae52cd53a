"""An aiordma echo client: sends N messages of S bytes, checks each echo, prints round-trip times.

    python examples/echo_server.py --port 18515 &
    python examples/echo_client.py --port 18515 --count 1000 --size 64

Each round trip is ``await conn.send(msg)`` (returns once the message is
handed to the device; the echo proves it arrived) plus ``await conn.recv()``
of the echo. ``close()`` at the end raises if any message was not delivered.
The exit status is 0 only if every echo matched.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import aiordma
from aiordma.tools import MAX_MESSAGE, int_type, port_number, seconds, size_type


def _us(s: float) -> str:
    return f"{s * 1e6:.1f}"


async def run(args: argparse.Namespace) -> int:
    conn = await aiordma.connect(
        args.host, args.port, provider=args.provider, token=args.token_file, timeout=args.timeout
    )
    rtts: list[float] = []
    bad = 0
    try:
        dev = conn.device
        print(
            f"connected to {args.host}:{args.port}: QP 0x{conn.qp_num:06x} -> 0x{conn.peer.qpn:06x} "
            f"on {dev.provider}:{dev.name}, path MTU {conn.mtu}",
            flush=True,
        )
        payload = bytearray(os.urandom(args.size))
        for i in range(args.count):
            if args.size >= 4:
                payload[:4] = i.to_bytes(4, "big")  # every message differs
            msg = bytes(payload)
            t = time.perf_counter()
            await conn.send(msg)
            echo = await asyncio.wait_for(conn.recv(), args.timeout)
            rtts.append(time.perf_counter() - t)
            if echo != msg:
                bad += 1
                print(f"message {i}: echo differs ({len(echo)} bytes back for {len(msg)})", file=sys.stderr)
    finally:
        await conn.close()
    if rtts:
        rtts.sort()
        p99 = rtts[max(0, int(len(rtts) * 0.99) - 1)]
        print(
            f"{args.count} messages of {args.size} bytes: RTT us min {_us(rtts[0])} avg {_us(statistics.fmean(rtts))} "
            f"median {_us(statistics.median(rtts))} p99 {_us(p99)} max {_us(rtts[-1])}",
            flush=True,
        )
    if bad:
        print(f"FAILED: {bad} of {args.count} echoes differed", file=sys.stderr)
        return 1
    print(f"all {args.count} echoes verified", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="aiordma echo client: send, check the echo, time the round trip.")
    parser.add_argument("--host", default="127.0.0.1", help="the echo server's address (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=port_number, default=aiordma.DEFAULT_PORT, help=f"its TCP port (default {aiordma.DEFAULT_PORT})"
    )
    parser.add_argument(
        "--provider", choices=("auto", "soft", "pyverbs"), default=None, help="device provider (default auto)"
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="file holding the server's secret (default $AIORDMA_TOKEN or $AIORDMA_TOKEN_FILE)",
    )
    parser.add_argument("-n", "--count", type=int_type(0), default=100, help="messages to send (default 100)")
    parser.add_argument(
        "-s", "--size", type=size_type(0, MAX_MESSAGE), default=64, help="bytes per message: 64, 4K, 1M (default 64)"
    )
    parser.add_argument("--timeout", type=seconds, default=10.0, help="seconds to wait for the connection or an echo")
    args = parser.parse_args(argv)
    if args.port == 0:
        parser.error("--port 0 means any free port, for servers: give the echo server's port")
    try:
        return asyncio.run(run(args))
    except aiordma.TokenError as e:
        parser.error(str(e))
    except aiordma.RDMAError as e:
        print(f"echo client: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except TimeoutError:
        print(f"echo client: no echo within {args.timeout:g} s", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
