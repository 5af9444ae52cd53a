"""Command-line client of the one-sided key-value server (``kv_server.py``).

Every command is one-sided RDMA on the server's memory; the server runs no
code for it:

    python examples/kv_client.py --port 18520 put greeting "hello, world"   # Read + CAS + Write + FAA
    python examples/kv_client.py --port 18520 get greeting                  # RDMA Read
    python examples/kv_client.py --port 18520 incr 3 --by 10                # fetch-and-add
    python examples/kv_client.py --port 18520 counter 3                     # RDMA Read
    python examples/kv_client.py --port 18520 info                          # the table's layout

``get`` prints the value (exit status 1 when the key is absent); ``-v`` also
prints the one-sided operations each command took.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_server import DEFAULT_PORT
from kv_store import KVClient, KVError

import aiordma


async def run(args: argparse.Namespace) -> int:
    kv = await KVClient.connect(
        args.host, args.port, provider=args.provider, token=args.token_file, timeout=args.timeout
    )
    code = 0
    try:
        if args.command == "get":
            value = await kv.get(args.key.encode())
            if value is None:
                print(f"kv client: {args.key!r} not found", file=sys.stderr)
                code = 1
            else:
                print(value.decode(errors="backslashreplace"))
        elif args.command == "put":
            await kv.put(args.key.encode(), args.value.encode())
            print("OK")
        elif args.command == "incr":
            print(await kv.incr(args.index, args.by))
        elif args.command == "counter":
            print(await kv.counter(args.index))
        elif args.command == "info":
            lay = kv.layout
            dev = kv.conn.device
            print(
                f"{lay.buckets} buckets of {lay.slot_size} bytes ({lay.key_max}-byte keys, {lay.value_max}-byte "
                f"values), {lay.counters} counters; table {kv.table!r}, counters {kv.counters!r}; "
                f"this client on {dev.provider}:{dev.name}"
            )
    finally:
        await kv.close()
    if args.verbose:
        s = kv.stats
        print(
            f"one-sided operations: {s.rdma_reads} RDMA Read, {s.compare_and_swaps} compare-and-swap, "
            f"{s.rdma_writes} RDMA Write, {s.fetch_and_adds} fetch-and-add ({s.retries} retried reads)",
            file=sys.stderr,
        )
    return code


def _counter_index(text: str) -> int:
    try:
        n = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a counter is a number, not {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"counters are numbered from 0, not {n}")
    return n


def _delta(text: str) -> int:
    try:
        n = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not -(1 << 63) <= n < 1 << 64:
        raise argparse.ArgumentTypeError("fetch-and-add adds a 64-bit value")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Client of the one-sided key-value server: every command is RDMA on its memory.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[1],
    )
    p.add_argument("--host", default="127.0.0.1", help="the kv server's address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"its TCP port (default {DEFAULT_PORT})")
    p.add_argument("--provider", choices=("auto", "soft", "pyverbs"), default=None, help="device provider")
    p.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="file holding the server's secret (default $AIORDMA_TOKEN or $AIORDMA_TOKEN_FILE)",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the connection (default 10)")
    p.add_argument("-v", "--verbose", action="store_true", help="print the one-sided operations used")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    g = sub.add_parser("get", help="print the value of KEY (RDMA Read)")
    g.add_argument("key")
    s = sub.add_parser("put", help="store VALUE under KEY (RDMA Read, compare-and-swap, RDMA Write, fetch-and-add)")
    s.add_argument("key")
    s.add_argument("value")
    i = sub.add_parser("incr", help="add to counter INDEX and print its new value (fetch-and-add)")
    i.add_argument("index", type=_counter_index)
    i.add_argument("--by", type=_delta, default=1, help="what to add (default 1)")
    c = sub.add_parser("counter", help="print counter INDEX (RDMA Read)")
    c.add_argument("index", type=_counter_index)
    sub.add_parser("info", help="print the table's layout")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("get", "put") and not args.key:
        parser.error("the key must not be empty")
    try:
        return asyncio.run(run(args))
    except (ValueError, IndexError) as e:  # a key, value or counter the server's table cannot hold
        parser.error(str(e))
    except (aiordma.RDMAError, KVError) as e:
        print(f"kv client: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except TimeoutError:
        print(f"kv client: no answer within {args.timeout:g} s", file=sys.stderr)
        return 1
    return 0  # pragma: no cover (parser.error exits)


if __name__ == "__main__":
    sys.exit(main())
