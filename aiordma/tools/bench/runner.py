"""Running a test: the server processes on loopback, and for each size a
fresh connection, warm-up and measurement on aiordma and then the baseline."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
from typing import Any

from .common import PHASE_TIMEOUT, READY, TESTS, _ServerState, iters_for, rx_depth, sizes_for, tcp_limit, warmup_for
from .rdma import RdmaClient, _rdma_serve
from .report import RULE, _banner, _record, print_rows
from .stats import Measurement
from .tcp import TcpClient, _tcp_serve


async def _measure(client: Any, args: argparse.Namespace, size: int, iters: int, last: bool) -> Measurement:
    """One transport, one size: fresh connection, warm-up, (calibration), measurement."""
    test = args.test
    depth = args.tx_depth if TESTS[test][0] == "bw" else 1
    await client.open()
    try:
        if args.duration:
            # calibrate: probes that grow (at most 8x) until one lasts 0.2 s (they are the
            # warm-up too), then as many iterations as fit the duration at the probe's rate
            probe_n = max(depth, 10) if args.warmup is None else max(1, args.warmup)
            while True:
                probe = await asyncio.wait_for(client.phase(test, size, probe_n, depth), PHASE_TIMEOUT)
                if probe.elapsed_ns >= 0.2e9 or probe_n >= 1 << 22:
                    break
                probe_n = int(probe_n * min(8.0, max(2.0, 0.3e9 / max(probe.elapsed_ns, 1))))
            per_op = max(probe.elapsed_ns, 1) / probe_n / 1e9
            iters = max(10, int(args.duration / per_op))
        else:
            warm = warmup_for(args, iters)
            if warm:
                await asyncio.wait_for(client.phase(test, size, warm, depth), PHASE_TIMEOUT)
        m = await asyncio.wait_for(client.phase(test, size, iters, depth), PHASE_TIMEOUT + (args.duration or 0) * 4)
    finally:
        await client.close(last)
    return m


def _child_argv(args: argparse.Namespace, serve: str) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "aiordma.tools.bench",
        args.test,
        "--server",
        "--serve",
        serve,
        "--port",
        "0",
        "--bind",
        "127.0.0.1",
        "--provider",
        args.provider,
        "--loop",
        args.loop,
        "--progress",
        args.progress,
        "--tx-depth",
        str(args.tx_depth),
        "--rx-depth",
        str(rx_depth(args)),
        "--max-size",
        str(args.max_size),
        "--tcp-limit",
        str(tcp_limit(args)),
    ]
    if args.size:
        argv += ["--size", str(args.size)]
    return argv


async def _spawn(args: argparse.Namespace, serve: str) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # the child must import the same aiordma as this process
    import aiordma

    here = os.path.dirname(os.path.dirname(os.path.abspath(aiordma.__file__)))
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    prof = os.environ.get("AIORDMA_BENCH_PROFILE_SERVER")
    argv = _child_argv(args, serve)
    if prof:  # cProfile the server end too: AIORDMA_BENCH_PROFILE_SERVER=/path/prefix
        argv = [argv[0], "-m", "cProfile", "-o", f"{prof}.{serve}.prof", "-m", "aiordma.tools.bench"] + argv[3:]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    try:
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            if not line:
                code = await proc.wait()
                raise SystemExit(
                    f"aiordma bench: the {serve} server end exited ({code}) before it was ready: {shlex.join(argv)}"
                )
            text = line.decode(errors="replace").strip()
            if text.startswith(READY):
                return proc, json.loads(text[len(READY) :])
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise SystemExit(f"aiordma bench: the {serve} server end did not start within 60 s") from None


async def _reap(proc: asyncio.subprocess.Process) -> None:
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except TimeoutError:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def client_main(args: argparse.Namespace) -> int:
    sizes = sizes_for(args)
    children: list[asyncio.subprocess.Process] = []
    try:
        if args.client:
            host = args.client
            rdma_port = args.port
            tcp_port = args.tcp_port if args.tcp_port is not None else args.port + 1
        else:
            host = "127.0.0.1"
            proc, info = await _spawn(args, "rdma")
            children.append(proc)
            rdma_port = info["rdma_port"]
            tcp_port = 0
            if args.baseline == "tcp":
                proc, info = await _spawn(args, "tcp")
                children.append(proc)
                tcp_port = info["tcp_port"]
        rdma = RdmaClient(args, host, rdma_port, max(sizes))
        tcp = TcpClient(args, host, tcp_port, max(sizes)) if args.baseline == "tcp" else None
        printed = False
        failures = 0
        for idx, size in enumerate(sizes):
            last = idx == len(sizes) - 1
            iters = iters_for(args, size)
            try:
                m_rdma = await _measure(rdma, args, size, iters, last)
            except (TimeoutError, RDMAErrorType()) as e:
                # a failed size is a result too: say so and go on with the next size
                failures += 1
                rdma.conn = None
                rec = {
                    "test": args.test,
                    "transport": "aiordma",
                    "provider": rdma.device,
                    "loop": args.loop,
                    "progress": rdma.progress,
                    "size": size,
                    "iterations": iters,
                    "error": f"{type(e).__name__}: {e}",
                }
                if args.json:
                    print(json.dumps(rec), flush=True)
                else:
                    if not printed:
                        print(_banner(args, rdma.device or args.provider, rdma.progress or args.progress))
                        printed = True
                    print(f" {size:<10d} {iters:<14d} FAILED: {rec['error']}", flush=True)
                if tcp is not None and last:  # the baseline server leaves after its last goodbye
                    await _measure(tcp, args, size, min(iters, 16), last)
                continue
            m_tcp = await _measure(tcp, args, size, iters, last) if tcp is not None else None
            rec = _record(args, m_rdma, rdma, m_tcp)
            if args.json:
                print(json.dumps(rec), flush=True)
            else:
                if not printed:
                    print(_banner(args, rdma.device, rdma.progress, rdma.poll_window_us))
                    printed = True
                print_rows(rec)
        if not args.json:
            print(RULE, flush=True)
    finally:
        for proc in children:
            await _reap(proc)
    return 1 if failures else 0


async def server_main(args: argparse.Namespace) -> int:
    serve = args.serve or ("both" if args.baseline == "tcp" else "rdma")
    args.serve = serve
    state = _ServerState()
    info: dict[str, Any] = {}
    servers = []
    if serve in ("rdma", "both"):
        s = await _rdma_serve(args, state, args.port)
        servers.append(s)
        info["rdma_port"] = s.port
    if serve in ("tcp", "both"):
        tcp_port = args.tcp_port if args.tcp_port is not None else (0 if args.port == 0 else args.port + 1)
        s = await _tcp_serve(args, state, tcp_port)
        servers.append(s)
        info["tcp_port"] = s.sockets[0].getsockname()[1]
    print(f"{READY} {json.dumps(info)}", flush=True)
    if not args.client and serve == "both":
        print(
            f"aiordma bench: serving {args.test} (aiordma on {info['rdma_port']}, TCP baseline on {info['tcp_port']})",
            file=sys.stderr,
        )
    await state.finished.wait()
    while state.active:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)
    for s in servers:
        s.close()
    for s in servers:
        await s.wait_closed()
    return 0


def RDMAErrorType() -> type:
    from aiordma import RDMAError

    return RDMAError
