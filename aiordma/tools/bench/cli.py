"""``aiordma bench``'s arguments, and running the client or the server end
on the chosen event loop.

Each test is a sub-command with its own help (``aiordma bench write_bw
--help``): what it measures, its defaults and the flags that matter to it.
Every test accepts the same flags (the client passes its options on to the
server ends it starts); the ones that do not apply are left out of its help,
and refused when they would change nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import textwrap
from collections.abc import Callable

from ... import settings
from .. import (
    MAX_MESSAGE,
    ToolError,
    ToolParser,
    UsageError,
    int_type,
    invoke,
    port_number,
    seconds,
    size_type,
)
from .. import positive_size as parse_size
from .common import (
    DEF_ITERS_BW,
    DEF_ITERS_LAT,
    DEFAULT_PORT,
    MAX_ALL_SIZE,
    MAX_DEPTH,
    MAX_DURATION,
    MAX_ITERS,
    TEST_HELP,
    TESTS,
)
from .runner import client_main, server_main

__all__ = ["DESCRIPTION", "add_arguments", "main", "parse_size", "run", "validate"]

DESCRIPTION = "perftest-style benchmarks, each next to an asyncio TCP baseline"

_EXAMPLES = (
    "examples:\n"
    "  aiordma bench write_bw -s 64K            # both ends on loopback, TCP baseline beside\n"
    "  aiordma bench send_lat -a --max-size 64K --loop uvloop --json\n"
    "  aiordma bench read_bw --server           # machine A\n"
    "  aiordma bench read_bw --client A         # machine B (same options on both)\n"
    "  aiordma bench write_bw --help            # what write_bw measures, and its options\n"
)
_WHY_MAX_MESSAGE = "the largest RDMA message (2^31 bytes)"
_WHY_MAX_ITERS = "each iteration keeps its timestamps in memory; -D runs for a duration instead"
_WHY_MAX_DEPTH = "the send queue must stay within what devices allow (max_qp_wr)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The tests as sub-commands of ``p`` (``aiordma bench`` or ``python -m
    aiordma.tools.bench``); ``args.test`` names the one chosen."""
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = (
        f"{DESCRIPTION}.\n\n"
        "By default one command runs both ends on loopback (the server ends in child processes); for two\n"
        "machines run `aiordma bench TEST --server` on one and `aiordma bench TEST --client HOST` on the other.\n"
        "`aiordma bench TEST --help` says what TEST measures and lists its options."
    )
    p.epilog = _EXAMPLES
    tests = p.add_subparsers(dest="test", metavar="TEST", title="tests (perftest names)", required=True)
    for name in TESTS:
        summary = TEST_HELP[name].split(":", 1)[0]
        t = tests.add_parser(
            name,
            help=summary,
            description=_test_description(name),
            epilog=_test_epilog(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        t.set_defaults(_parser=t)  # a UsageError is reported against this test's usage
        _add_test_arguments(t, name)


def _test_description(test: str) -> str:
    kind = TESTS[test][0]
    text = textwrap.fill(TEST_HELP[test], 100)
    if test == "atomic_lat":
        size = "8 bytes (one 64-bit word)"
    else:
        size = f"{65536 if kind == 'bw' else 2} bytes (-s; -a for 2 B ... --max-size)"
    iters = DEF_ITERS_BW if kind == "bw" else DEF_ITERS_LAT
    return f"{text}\n\nsize: {size}; iterations: {iters} (-n; fewer for big sizes, or -D seconds)"


def _test_epilog(test: str) -> str:
    lines = [(f"aiordma bench {test}", "both ends on loopback, TCP baseline beside")]
    if TESTS[test][0] == "bw":
        lines.append((f"aiordma bench {test} -s 1M -t 32 --json", "1 MiB messages, 32 outstanding"))
        if test == "write_bw":
            lines.append((f"aiordma bench {test} -s 4K -l 8", "chains of 8 writes per doorbell"))
    elif test == "atomic_lat":
        lines.append((f"aiordma bench {test} -n 10000 --progress busy", "busy-polling completions"))
    else:
        lines.append((f"aiordma bench {test} -a --max-size 64K --loop uvloop", "2 B ... 64 KiB on uvloop"))
    lines += [
        (f"aiordma bench {test} --server", "machine A"),
        (f"aiordma bench {test} --client A", "machine B (same options on both)"),
    ]
    width = max(len(cmd) for cmd, _ in lines) + 2
    return "examples:\n" + "".join(f"  {cmd:<{width}}# {why}\n" for cmd, why in lines)


def _add_test_arguments(p: argparse.ArgumentParser, test: str) -> None:
    kind = TESTS[test][0]
    bw = kind == "bw"
    atomic = test == "atomic_lat"
    hidden = argparse.SUPPRESS

    def shown(text: str, applies: bool = True) -> str:
        return text if applies else hidden

    size = size_type(1, MAX_MESSAGE, _WHY_MAX_MESSAGE)
    p.add_argument(
        "-s",
        "--size",
        type=size,
        default=None,
        help=shown(f"message size in bytes: 4096, 64K, 8M (default {65536 if bw else 2})", not atomic),
    )
    p.add_argument(
        "-a", "--all", action="store_true", help=shown("all sizes 2 B ... --max-size (powers of two)", not atomic)
    )
    p.add_argument(
        "--max-size",
        type=size_type(2, MAX_MESSAGE, _WHY_MAX_MESSAGE),
        default=MAX_ALL_SIZE,
        help=shown("largest size for --all (default 8M)", not atomic),
    )
    p.add_argument(
        "-n",
        "--iters",
        type=int_type(1, MAX_ITERS, _WHY_MAX_ITERS),
        default=None,
        help=f"iterations (default {DEF_ITERS_BW if bw else DEF_ITERS_LAT}; fewer for big sizes)",
    )
    p.add_argument(
        "--budget",
        type=size_type(1),
        default=None,
        help="cap the bytes moved per measurement (iterations = min(n, budget / size), at least 16); "
        f"default {'256M' if bw else '64M'} when -n is not given, no cap when it is",
    )
    p.add_argument(
        "-D",
        "--duration",
        type=seconds,
        default=None,
        help="run each measurement for about this many seconds instead",
    )
    p.add_argument(
        "-t",
        "--tx-depth",
        type=int_type(1, MAX_DEPTH, _WHY_MAX_DEPTH),
        default=16,
        help=shown("outstanding operations (default 16)", bw),
    )
    p.add_argument(
        "-l",
        "--post-list",
        type=int_type(1, MAX_DEPTH, _WHY_MAX_DEPTH),
        default=1,
        help=shown(
            "post this many writes per doorbell as one chain with only the last signaled "
            "(Connection.write_batch; perftest's --post_list with --cq-mod of the same size); default 1",
            test == "write_bw",
        ),
    )
    p.add_argument(
        "-r",
        "--rx-depth",
        type=int_type(1, MAX_DEPTH, _WHY_MAX_DEPTH),
        default=None,
        help="receive buffers per connection (default max(16, 2 x tx-depth))",
    )
    p.add_argument(
        "--provider", choices=("auto", "soft", "pyverbs"), default="auto", help="RDMA provider (default auto)"
    )
    p.add_argument(
        "--loop", choices=("asyncio", "uvloop"), default="asyncio", help="event loop for both ends and the baseline"
    )
    p.add_argument("--progress", choices=("event", "thread", "busy"), default="event", help="completion progress mode")
    p.add_argument(
        "--baseline", choices=("tcp", "none"), default="tcp", help="asyncio TCP baseline in the same run (default tcp)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per size on stdout instead of the table")
    p.add_argument(
        "-q", "--quiet", action="store_true", help="no progress lines on stderr (shown when a phase lasts over 1 s)"
    )
    p.add_argument("--server", action="store_true", help="be the server end (two machines)")
    p.add_argument("--client", metavar="HOST", default=None, help="be the client end, connecting to HOST")
    p.add_argument(
        "-p",
        "--port",
        type=port_number,
        default=DEFAULT_PORT,
        help=f"aiordma port; the TCP baseline uses port+1 (default {DEFAULT_PORT}; server: 0 = any)",
    )
    p.add_argument("--tcp-port", type=port_number, default=None, help="TCP baseline port (default port+1)")
    p.add_argument(
        "--tcp-limit",
        type=size_type(1, MAX_MESSAGE),
        default=None,
        help="baseline StreamReader buffer limit (default: the faster one per loop, 1M asyncio, 64K uvloop)",
    )
    p.add_argument(
        "--bind",
        default=None,
        help="server: address to listen on (default all; anything but loopback needs a token: $AIORDMA_TOKEN or "
        "$AIORDMA_TOKEN_FILE, the same on the client, or --insecure)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="server: listen on a non-loopback --bind without a token (any host that reaches the port can connect)",
    )
    p.add_argument(
        "--warmup",
        type=int_type(0, MAX_ITERS, _WHY_MAX_ITERS),
        default=None,
        help="warm-up iterations per measurement (default ~10%%, at most 200)",
    )
    p.add_argument("--persistent", action="store_true", help="server: keep serving after a client finished")
    p.add_argument("--serve", choices=("rdma", "tcp", "both"), default=None, help=hidden)
    p.add_argument("--status-interval", type=seconds, default=None, help=hidden)  # tests: show phases sooner


def validate(args: argparse.Namespace) -> None:
    """What no single argument's type can check; raises :class:`UsageError`."""
    if args.server and args.client:
        raise UsageError("--server and --client exclude each other")
    if args.post_list > 1 and args.test != "write_bw":
        raise UsageError(f"--post-list applies to write_bw only, not {args.test}")
    if args.post_list > args.tx_depth:
        raise UsageError(
            f"--post-list {args.post_list} is more than --tx-depth {args.tx_depth}: a chain must fit the send window"
        )
    if args.test == "atomic_lat" and (args.all or args.size not in (None, 8)):
        raise UsageError("atomic_lat works on one 8-byte word: leave out -s/--size and -a/--all")
    if args.all and args.size is not None:
        raise UsageError("-a/--all runs every size up to --max-size; -s/--size runs one: give one of them")
    if args.duration is not None and args.duration > MAX_DURATION:
        raise UsageError(f"-D/--duration {args.duration:g} is more than a day ({MAX_DURATION:g} s)")
    if args.insecure and not args.server:
        raise UsageError("--insecure applies to --server only (the loopback run needs no token)")
    if not args.server:
        for flag, given in (("--bind", args.bind is not None), ("--persistent", args.persistent)):
            if given:
                raise UsageError(f"{flag} applies to --server only")
    elif args.bind is None:
        args.bind = "0.0.0.0"
    if args.server:
        if args.baseline == "tcp" and args.tcp_port is None and args.port and args.port + 1 > 65535:
            raise UsageError(
                f"the TCP baseline listens on --port + 1 = {args.port + 1}: give --tcp-port, a lower --port, "
                "or --baseline none"
            )
    elif args.client:
        if args.port == 0:
            raise UsageError("--port 0 means any free port, for --server only: give the server's port")
        if args.baseline == "tcp":
            if args.tcp_port == 0:
                raise UsageError("--tcp-port 0 means any free port, for --server only: give the server's")
            if args.tcp_port is None and args.port + 1 > 65535:
                raise UsageError(
                    f"the TCP baseline is on --port + 1 = {args.port + 1}: give --tcp-port, a lower --port, "
                    "or --baseline none"
                )


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if name == "uvloop":
        try:
            import uvloop
        except ImportError:
            raise ToolError("--loop uvloop: uvloop is not installed (pip install uvloop)") from None

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(args: argparse.Namespace) -> int:
    validate(args)
    prof = settings.BENCH_PROFILE_CLIENT.get()
    main = server_main if args.server else client_main
    with asyncio.Runner(loop_factory=_loop_factory(args.loop)) as runner:
        if prof and not args.server:  # cProfile the client end: AIORDMA_BENCH_PROFILE_CLIENT=out.prof
            import cProfile

            pr = cProfile.Profile()
            pr.enable()
            try:
                return runner.run(main(args))
            finally:
                pr.disable()
                pr.dump_stats(prof)
        return runner.run(main(args))


def main(argv: list[str] | None = None) -> int:
    """``python -m aiordma.tools.bench``: the same as ``aiordma bench`` (the
    server ends the client starts run this way)."""
    p = ToolParser(prog="python -m aiordma.tools.bench", description=DESCRIPTION)
    p.set_defaults(_parser=p)
    add_arguments(p)
    args = p.parse_args(argv)
    return invoke(run, args, args._parser)
