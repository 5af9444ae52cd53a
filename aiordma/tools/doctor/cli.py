"""``aiordma doctor``'s arguments and output."""

from __future__ import annotations

import argparse
import json
import sys

from .. import ToolParser, host_port, invoke, seconds
from .diagnosis import diagnose_sync
from .plan import DEFAULT_PEER_TIMEOUT, Options
from .report import format_table

DESCRIPTION = "check the RDMA set-up and say how to fix what is wrong"


def peer_address(text: str) -> str:
    """``--peer HOST:PORT``, checked (port 1-65535) and kept as text."""
    host_port(text)
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", help="RDMA device to check (rxe0, mlx5_0; soft0 for the soft device)")
    parser.add_argument(
        "--provider", choices=("auto", "soft", "pyverbs"), help="provider to check (default: $AIORDMA_PROVIDER or auto)"
    )
    parser.add_argument(
        "--peer",
        metavar="HOST:PORT",
        type=peer_address,
        help="also test a rendezvous and RDMA to this aiordma server",
    )
    parser.add_argument("--token", help="the server's shared secret (default $AIORDMA_TOKEN)")
    parser.add_argument(
        "--timeout", type=seconds, default=DEFAULT_PEER_TIMEOUT, help="seconds for each peer step (default %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def run(args: argparse.Namespace) -> int:
    opts = Options(provider=args.provider, device=args.device, peer=args.peer, token=args.token, timeout=args.timeout)
    report = diagnose_sync(opts)  # (--peer was checked by its type: a ValueError here is a bug)
    if args.json:
        print(json.dumps(report.to_json(), indent=2, default=str))
    else:
        print(format_table(report, colour=sys.stdout.isatty()))
    return report.exit_status


def main(argv: list[str] | None = None) -> int:
    """``python -m aiordma.tools.doctor``; returns the exit status (2 for a bad argument)."""
    parser = ToolParser(prog="aiordma doctor", description=DESCRIPTION)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # a bad argument (2) or --help (0): argparse has said why
        return e.code if isinstance(e.code, int) else 2
    return invoke(run, args, parser)
