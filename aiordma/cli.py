"""The ``aiordma`` command: ``devices``, ``demo``, ``bench``, ``doctor``, ``health``.

Each subcommand lives in its own module exposing ``add_arguments(parser)``
and ``run(args) -> int``; they are imported only when used. Errors follow
:mod:`aiordma.tools`' rules: a bad argument is one line and exit status 2, a
failure the user can act on one line and exit status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .tools import ToolParser, invoke

SUBCOMMANDS = {
    "devices": ("aiordma.tools.devices", "list RDMA devices (pyverbs) and the soft device, with ports and GIDs"),
    "demo": ("aiordma.tools.demo", "echo + stream on the default device, then walk one RDMA Write through its 8 steps"),
    "bench": ("aiordma.tools.bench", "perftest-style benchmarks (write_bw, write_lat, send_lat, ...) with baselines"),
    "doctor": ("aiordma.tools.doctor", "check the RDMA set-up and say how to fix what is wrong"),
    "health": ("aiordma.tools.health", "is RDMA healthy here, or in a running service (--url)? exit status 0 or 1"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = ToolParser(prog="aiordma", description="asyncio RDMA messaging: tools")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # the parser that reports a UsageError: this one, or a sub-command's own (bench TEST)
        p.set_defaults(_parser=p)
        try:
            mod = importlib.import_module(module)
        except Exception as e:  # pragma: no cover - a broken install must not break the other subcommands
            p.set_defaults(_broken=f"{module}: {e}")
            continue
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_broken", None):
        print(f"aiordma {args.command} is unavailable: {args._broken}", file=sys.stderr)
        return 2
    return invoke(args._run, args, args._parser)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
