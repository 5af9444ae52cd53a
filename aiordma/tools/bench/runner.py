"""Running a test: the server processes on loopback, and for each size a
fresh connection, warm-up and measurement on aiordma and then the baseline."""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import socket
import subprocess
import sys
import weakref
from typing import Any

from ... import settings
from .. import ToolError, UsageError
from .common import (
    MAX_ITERS,
    PHASE_TIMEOUT,
    READY,
    TESTS,
    _ServerState,
    iters_for,
    rx_depth,
    sizes_for,
    tcp_limit,
    warmup_for,
)
from .rdma import RdmaClient, _rdma_serve
from .report import RULE, _banner, _record, print_rows
from .stats import Measurement
from .status import Status, size_text
from .tcp import TcpClient, _tcp_serve


def _why_unreachable(e: BaseException) -> str:
    """What a failed connect means, in one phrase."""
    cause = e.__cause__ if e.__cause__ is not None else e
    code = getattr(cause, "errno", None)
    if isinstance(cause, ConnectionRefusedError) or code == errno.ECONNREFUSED:
        return "connection refused: nothing listens there"
    if code in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return f"{os.strerror(code).lower()}: no route to the peer"
    if isinstance(e, TimeoutError):
        return "no answer (a firewall dropping TCP, or the wrong address?)"
    return str(e)


async def _open(client: Any, args: argparse.Namespace) -> None:
    """Connect ``client``; a peer that cannot be reached ends the run (one line, exit 1)."""
    from aiordma import RDMAError
    from aiordma.errors import AuthenticationError, RendezvousError

    transport = "aiordma" if isinstance(client, RdmaClient) else "TCP baseline"
    where = f"{client.host}:{client.port}"
    hint = (
        f"start `aiordma bench {args.test} --server` there with the same options, or check --client/--port"
        + ("/--tcp-port" if transport != "aiordma" else "")
        if args.client
        else "the server end on loopback did not answer"
    )
    try:
        await client.open()
    except AuthenticationError as e:
        raise ToolError(f"the {transport} server at {where} refused the rendezvous: {e}") from None
    except (RendezvousError, OSError) as e:  # RendezvousError: TCP connect or handshake failed
        raise ToolError(f"cannot reach the {transport} server at {where}: {_why_unreachable(e)}; {hint}") from None
    except RDMAError as e:  # the local device (provider, registration, queue pair)
        raise ToolError(f"cannot set up the {transport} connection to {where}: {type(e).__name__}: {e}") from None


async def _measure(
    client: Any, args: argparse.Namespace, size: int, iters: int, last: bool, status: Status | None = None
) -> Measurement:
    """One transport, one size: fresh connection, warm-up, (calibration), measurement."""
    test = args.test
    depth = args.tx_depth if TESTS[test][0] == "bw" else 1
    label = f"{size_text(size)} {test}: {'aiordma' if isinstance(client, RdmaClient) else 'TCP baseline'}"
    show = status.set if status is not None else (lambda text: None)
    show(
        f"{label}: connecting to {client.host}:{client.port}"
        + (" (registering memory)" if isinstance(client, RdmaClient) and client.region is None else "")
    )
    await _open(client, args)
    try:
        if args.duration:
            show(f"{label}: calibrating for -D {args.duration:g}")
            # calibrate: probes that grow (at most 8x) until one lasts 0.2 s (they are the
            # warm-up too), then as many iterations as fit the duration at the probe's rate
            probe_n = max(depth, 10) if args.warmup is None else max(1, args.warmup)
            while True:
                probe = await asyncio.wait_for(client.phase(test, size, probe_n, depth), PHASE_TIMEOUT)
                if probe.elapsed_ns >= 0.2e9 or probe_n >= 1 << 22:
                    break
                probe_n = int(probe_n * min(8.0, max(2.0, 0.3e9 / max(probe.elapsed_ns, 1))))
            per_op = max(probe.elapsed_ns, 1) / probe_n / 1e9
            iters = min(MAX_ITERS, max(10, int(args.duration / per_op)))
        else:
            warm = warmup_for(args, iters, size)
            if warm:
                show(f"{label}: warm-up, {warm} iteration{'s' if warm != 1 else ''}")
                await asyncio.wait_for(client.phase(test, size, warm, depth), PHASE_TIMEOUT)
        show(f"{label}: measuring, {iters} iteration{'s' if iters != 1 else ''}")
        m: Measurement = await asyncio.wait_for(
            client.phase(test, size, iters, depth), PHASE_TIMEOUT + (args.duration or 0) * 4
        )
    finally:
        show(None)
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
    prof = settings.BENCH_PROFILE_SERVER.get()
    argv = _child_argv(args, serve)
    if prof:  # cProfile the server end too: AIORDMA_BENCH_PROFILE_SERVER=/path/prefix
        argv = [argv[0], "-m", "cProfile", "-o", f"{prof}.{serve}.prof", "-m", "aiordma.tools.bench"] + argv[3:]
    # stderr is read here: if the child fails to start, its own one-line error becomes
    # ours; once it is ready, whatever it says is passed on to our stderr
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    said: list[str] = []
    collector = asyncio.get_running_loop().create_task(_collect(proc.stderr, said))
    what = "aiordma" if serve == "rdma" else "TCP baseline"
    try:
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            if not line:
                code = await proc.wait()
                await asyncio.wait_for(collector, 5)
                why = _child_error(said) or f"it exited with status {code}"
                raise ToolError(f"the {what} server end could not start: {why}")
            text = line.decode(errors="replace").strip()
            if text.startswith(READY):
                collector.cancel()
                for old in said:
                    sys.stderr.write(old + "\n")
                _forwarders[proc] = asyncio.get_running_loop().create_task(_collect(proc.stderr, None))
                return proc, json.loads(text[len(READY) :])
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise ToolError(f"the {what} server end did not start within 60 s") from None
    finally:
        if not collector.done():
            collector.cancel()


#: the tasks passing each server end's stderr on to ours (awaited by _reap)
_forwarders: weakref.WeakKeyDictionary[asyncio.subprocess.Process, asyncio.Task[None]] = weakref.WeakKeyDictionary()


async def _collect(stream: asyncio.StreamReader, into: list[str] | None) -> None:
    """Keep a child's stderr lines in ``into``, or (None) write them to ours."""
    while line := await stream.readline():
        text = line.decode(errors="replace").rstrip("\n")
        if into is None:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        else:
            into.append(text)


def _child_error(lines: list[str]) -> str:
    """The child's last line, without its program name (``python -m ...: ``)."""
    for text in reversed(lines):
        if text.strip():
            head, sep, tail = text.partition(": ")
            return tail if sep and head.startswith("python -m aiordma.tools.bench") else text.strip()
    return ""


async def _reap(proc: asyncio.subprocess.Process, at_once: bool = False) -> None:
    """Wait for a server end to leave (after the last goodbye); ``at_once``
    when the run failed and no goodbye will come."""
    if at_once and proc.returncode is None:
        proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except TimeoutError:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    fwd = _forwarders.pop(proc, None)
    if fwd is not None:
        try:
            await asyncio.wait_for(fwd, 5)
        except TimeoutError:
            fwd.cancel()


async def _resolve(host: str, port: int) -> None:
    """Fail early, in one line, when ``--client HOST`` names no host."""
    try:
        await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        parts = host.split(".")
        if len(parts) == 4 and all(x.isdigit() for x in parts):
            raise ToolError(f"--client {host}: not an IPv4 address (each of its four numbers is 0-255)") from None
        raise ToolError(f"cannot resolve --client {host!r}: {e.strerror}") from None


async def client_main(args: argparse.Namespace) -> int:
    sizes = sizes_for(args)
    children: list[asyncio.subprocess.Process] = []
    status = Status(
        "aiordma bench: ", getattr(args, "status_interval", None) or 1.0, enabled=not getattr(args, "quiet", False)
    )
    status.start()
    finished = False
    try:
        if args.client:
            host = args.client
            rdma_port = args.port
            tcp_port = args.tcp_port if args.tcp_port is not None else args.port + 1
            await _resolve(host, rdma_port)
        else:
            host = "127.0.0.1"
            status.set("starting the server ends on 127.0.0.1")
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
        status.set(None)
        for idx, size in enumerate(sizes):
            last = idx == len(sizes) - 1
            iters = iters_for(args, size)
            try:
                m_rdma = await _measure(rdma, args, size, iters, last, status)
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
                status.clear()
                if args.json:
                    print(json.dumps(rec), flush=True)
                else:
                    if not printed:
                        print(
                            _banner(
                                args,
                                rdma.device or args.provider,
                                rdma.progress or args.progress,
                                None,
                                rdma.packet_path,
                            )
                        )
                        printed = True
                    print(f" {size:<10d} {iters:<14d} FAILED: {rec['error']}", flush=True)
                if tcp is not None and last:  # the baseline server leaves after its last goodbye
                    await _measure(tcp, args, size, min(iters, 16), last, status)
                continue
            m_tcp = await _measure(tcp, args, size, iters, last, status) if tcp is not None else None
            rec = _record(args, m_rdma, rdma, m_tcp)
            status.clear()
            if args.json:
                print(json.dumps(rec), flush=True)
            else:
                if not printed:
                    print(_banner(args, rdma.device, rdma.progress, rdma.poll_window_us, rdma.packet_path))
                    printed = True
                print_rows(rec)
        if not args.json:
            print(RULE, flush=True)
        finished = True
    finally:
        await status.stop()
        for proc in children:
            await _reap(proc, at_once=not finished)
    return 1 if failures else 0


async def server_main(args: argparse.Namespace) -> int:
    serve = args.serve or ("both" if args.baseline == "tcp" else "rdma")
    args.serve = serve
    state = _ServerState()
    info: dict[str, Any] = {}
    servers = []
    try:
        if serve in ("rdma", "both"):
            s = await _listen_rdma(args, state)
            servers.append(s)
            info["rdma_port"] = s.port
        if serve in ("tcp", "both"):
            tcp_port = args.tcp_port if args.tcp_port is not None else (0 if args.port == 0 else args.port + 1)
            s = await _listen("TCP baseline", args.bind, tcp_port, _tcp_serve(args, state, tcp_port))
            servers.append(s)
            info["tcp_port"] = s.sockets[0].getsockname()[1]
    except BaseException:
        for s in servers:
            s.close()
        raise
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


async def _listen(what: str, host: str, port: int, start: Any) -> Any:
    """Await ``start`` (a server's start); an address that cannot be bound is one line."""
    try:
        return await start
    except OSError as e:
        why = e.strerror or str(e)
        if isinstance(e, socket.gaierror):
            why = f"--bind {host!r}: {why}"
        raise ToolError(f"the {what} server cannot listen on {host}:{port}: {why}") from None


async def _listen_rdma(args: argparse.Namespace, state: _ServerState) -> Any:
    """The aiordma server end; protected mode's refusal is a usage error (one line, exit 2)."""
    from aiordma import ProtectedModeError

    try:
        return await _listen("aiordma", args.bind, args.port, _rdma_serve(args, state, args.port))
    except ProtectedModeError:
        raise UsageError(
            f"--bind {args.bind}: refusing to serve beyond loopback without a token (any host that reaches the port "
            "could use the exposed memory): set $AIORDMA_TOKEN or $AIORDMA_TOKEN_FILE (the client needs the same), "
            "--bind 127.0.0.1, or pass --insecure"
        ) from None


def RDMAErrorType() -> type[Exception]:
    from aiordma import RDMAError

    return RDMAError
