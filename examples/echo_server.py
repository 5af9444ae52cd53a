"""An aiordma echo server: every message a client sends comes back to it.

    python examples/echo_server.py --host 127.0.0.1 --port 18515
    python examples/echo_client.py --host 127.0.0.1 --port 18515 --count 100 --size 4096

Each client gets its own RC queue pair (``aiordma.start_server`` runs
``handler(conn)`` per connection); ``async for msg in conn`` ends when the
client closes. Stop with Ctrl-C or SIGTERM. On the soft device each process
binds its own 127.0.0.N:4791.

With a token clients must prove they know the same secret (HMAC in the
rendezvous): ``$AIORDMA_TOKEN``, or a file named by ``$AIORDMA_TOKEN_FILE`` or
``--token-file`` (a secret on the command line would show in ``ps``). On
anything but loopback the server needs one, or ``--insecure``::

    umask 077; python -c 'import secrets; print(secrets.token_urlsafe(32))' > token
    python examples/echo_server.py --host 0.0.0.0 --token-file token
    python examples/echo_client.py --host SERVER --token-file token
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import aiordma
from aiordma.tools import port_number


async def serve(args: argparse.Namespace) -> int:
    clients = 0

    async def handler(conn: aiordma.Connection) -> None:
        nonlocal clients
        clients += 1
        n = 0
        peer = f"QP 0x{conn.peer.qpn:06x}" if conn.peer else "?"
        if args.verbose:
            print(f"client {clients} connected ({peer})", flush=True)
        try:
            async for msg in conn:
                await conn.send(msg)
                n += 1
        except aiordma.ConnectionClosedError:
            pass  # the client closed while its last echo was being acknowledged
        if args.verbose:
            print(f"client {clients} left after {n} messages", flush=True)

    device = aiordma.get_device(args.provider)
    server = await aiordma.start_server(
        handler,
        args.host,
        args.port,
        device=device,
        token=args.token_file,  # None: $AIORDMA_TOKEN or $AIORDMA_TOKEN_FILE
        insecure=True if args.insecure else None,  # None: $AIORDMA_INSECURE
    )
    where = f"{device.provider}:{device.name}"
    if device.provider == "soft":
        ip, udp = device.address
        where += f" at {ip}:{udp}"
    print(f"echo server listening on {args.host}:{server.port} ({where})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        server.close()
        await server.wait_closed()
    print("echo server stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="aiordma echo server (every message is sent back).")
    parser.add_argument("--host", default="127.0.0.1", help="address of the TCP rendezvous (default 127.0.0.1)")
    parser.add_argument(
        "--port",
        type=port_number,
        default=aiordma.DEFAULT_PORT,
        help=f"TCP port (default {aiordma.DEFAULT_PORT}; 0: any)",
    )
    parser.add_argument(
        "--provider", choices=("auto", "soft", "pyverbs"), default=None, help="device provider (default auto)"
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="file holding the secret clients must know (default $AIORDMA_TOKEN or $AIORDMA_TOKEN_FILE)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="listen beyond loopback without a token (any host that reaches the port can connect)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print connects and disconnects")
    args = parser.parse_args(argv)
    try:
        return asyncio.run(serve(args))
    except aiordma.ProtectedModeError:
        parser.error(
            f"--host {args.host}: refusing to serve beyond loopback without a token: set $AIORDMA_TOKEN or "
            "$AIORDMA_TOKEN_FILE or give --token-file (the clients need the same), or pass --insecure"
        )
    except aiordma.TokenError as e:
        parser.error(str(e))
    except aiordma.RDMAError as e:
        print(f"echo server: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"echo server: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
