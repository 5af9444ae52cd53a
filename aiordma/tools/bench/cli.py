"""``aiordma bench``'s arguments, and running the client or the server end
on the chosen event loop."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable

from .. import positive_size as parse_size
from .common import DEF_ITERS_BW, DEF_ITERS_LAT, DEFAULT_PORT, MAX_ALL_SIZE, TESTS
from .runner import client_main, server_main

DESCRIPTION = "perftest-style benchmarks, each next to an asyncio TCP baseline"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (
        "examples:\n"
        "  aiordma bench write_bw -s 64K            # both ends on loopback, TCP baseline beside\n"
        "  aiordma bench send_lat -a --max-size 64K --loop uvloop --json\n"
        "  aiordma bench read_bw --server           # machine A\n"
        "  aiordma bench read_bw --client A         # machine B (same options on both)\n"
    )
    p.add_argument("test", choices=sorted(TESTS), help="which test (perftest names)")
    p.add_argument(
        "-s",
        "--size",
        type=parse_size,
        default=None,
        help="message size in bytes (default 65536 bw, 2 lat; atomics: 8)",
    )
    p.add_argument("-a", "--all", action="store_true", help="all sizes 2 B ... 8 MiB (powers of two)")
    p.add_argument("--max-size", type=parse_size, default=MAX_ALL_SIZE, help="largest size for --all (default 8M)")
    p.add_argument(
        "-n",
        "--iters",
        type=int,
        default=None,
        help=f"iterations (default {DEF_ITERS_BW} bw, {DEF_ITERS_LAT} lat; fewer for big sizes)",
    )
    p.add_argument(
        "--budget",
        type=parse_size,
        default=None,
        help="cap the bytes moved per measurement (iterations = min(n, budget / size), at least 16); "
        "default 256M bw, 64M lat when -n is not given, no cap when it is",
    )
    p.add_argument(
        "-D", "--duration", type=float, default=None, help="run each measurement for about this many seconds instead"
    )
    p.add_argument("-t", "--tx-depth", type=int, default=16, help="outstanding operations in bw tests (default 16)")
    p.add_argument(
        "-l",
        "--post-list",
        type=int,
        default=1,
        help="write_bw: post this many writes per doorbell as one chain with only the last signaled "
        "(Connection.write_batch; perftest's --post_list with --cq-mod of the same size); default 1",
    )
    p.add_argument(
        "-r",
        "--rx-depth",
        type=int,
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
    p.add_argument("--server", action="store_true", help="be the server end (two machines)")
    p.add_argument("--client", metavar="HOST", default=None, help="be the client end, connecting to HOST")
    p.add_argument(
        "-p",
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help="aiordma port; the TCP baseline uses port+1 (default 18515)",
    )
    p.add_argument("--tcp-port", type=int, default=None, help="TCP baseline port (default port+1)")
    p.add_argument(
        "--tcp-limit",
        type=parse_size,
        default=None,
        help="baseline StreamReader buffer limit (default: the faster one per loop, 1M asyncio, 64K uvloop)",
    )
    p.add_argument("--bind", default="0.0.0.0", help="server: address to listen on (default all)")
    p.add_argument(
        "--warmup", type=int, default=None, help="warm-up iterations per measurement (default ~10%%, at most 200)"
    )
    p.add_argument("--persistent", action="store_true", help="server: keep serving after a client finished")
    p.add_argument("--serve", choices=("rdma", "tcp", "both"), default=None, help=argparse.SUPPRESS)


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(args: argparse.Namespace) -> int:
    if args.server and args.client:
        raise SystemExit("aiordma bench: --server and --client are exclusive")
    if args.post_list < 1 or (args.post_list > 1 and args.test != "write_bw"):
        raise SystemExit("--post-list must be >= 1, and above 1 only for write_bw")
    if args.tx_depth < 1:
        raise SystemExit("aiordma bench: --tx-depth must be at least 1")
    if args.duration is not None and args.duration <= 0:
        raise SystemExit("aiordma bench: --duration must be positive")
    prof = os.environ.get("AIORDMA_BENCH_PROFILE_CLIENT")
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
    p = argparse.ArgumentParser(prog="python -m aiordma.tools.bench", description=DESCRIPTION)
    add_arguments(p)
    return run(p.parse_args(argv))
