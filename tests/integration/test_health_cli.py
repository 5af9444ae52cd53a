"""``aiordma health``, as a supervisor runs it: real processes, a real HTTP endpoint.

Exit status 0 when healthy, 1 when not (an unreachable service, or an answer that is
not a health report, counts as not healthy), 2 with one line for a bad argument;
never a traceback. ``--url`` asks a service's ``/health`` (:func:`aiordma.prometheus.serve`):
here this test process's own, made unhealthy by filling the receive budget."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import aiordma
import aiordma.prometheus
from aiordma.window import DEFAULT_PROCESS_RECV_BUDGET, set_process_recv_budget

from ..support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIORDMA_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["AIORDMA_PROVIDER"] = "soft"
    return subprocess.run(
        [sys.executable, "-m", "aiordma.cli", "health", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )


async def _arun(*argv: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.get_running_loop().run_in_executor(None, lambda: _run(*argv))


@pytest.mark.engine_neutral
def test_this_host_is_healthy_and_says_so() -> None:
    proc = _run()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("this host: healthy")
    assert "NIC thread running" in proc.stdout
    report = json.loads(_run("--json").stdout)
    assert report["healthy"] is True and report["checks"][0]["name"].startswith("device soft:")


@pytest.mark.engine_neutral
@pytest.mark.parametrize(
    "argv, message",
    [
        (("--url", "localhost:9464"), "argument --url: expected an http:// URL"),
        (
            ("--timeout", "0", "--url", "http://127.0.0.1:1/health"),
            "argument --timeout: expected a number of seconds > 0",
        ),
        (("--bogus",), "unrecognized arguments: --bogus"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_status_2(argv: tuple[str, ...], message: str) -> None:
    proc = _run(*argv)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.engine_neutral
def test_an_unreachable_service_is_unhealthy() -> None:
    proc = _run("--url", "http://127.0.0.1:1/health")
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        == "aiordma health: http://127.0.0.1:1/health: cannot ask it ([Errno 111] Connection refused): unhealthy"
    )


async def test_a_service_is_healthy_then_not_then_healthy_again() -> None:
    server_conns: list[aiordma.Connection] = []

    async def handler(conn):
        server_conns.append(conn)
        await conn.wait_closed()

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft")
    conn = await aiordma.connect("127.0.0.1", server.port, provider="soft")
    try:
        with aiordma.prometheus.serve(0) as metrics:
            url = f"http://127.0.0.1:{metrics.port}/health"
            healthy = await _arun("--url", url)
            assert healthy.returncode == 0, healthy.stderr
            assert healthy.stdout.startswith(f"{url}: healthy")
            wrong = await _arun("--url", f"http://127.0.0.1:{metrics.port}/metrics")
            assert wrong.returncode == 1 and "is not a health report" in wrong.stderr
            set_process_recv_budget(100)
            await conn.send(bytes(200))
            await wait_until(lambda: server_conns and server_conns[0].stats["recv_queued_messages"] == 1, "queued")
            sick = await _arun("--url", url, "--json")
            assert sick.returncode == 1
            report = json.loads(sick.stdout)
            assert report["healthy"] is False
            assert [c["name"] for c in report["checks"] if not c["ok"]] == ["receive budget"]
            assert await server_conns[0].recv() == bytes(200)
            assert (await _arun("--url", url)).returncode == 0
    finally:
        set_process_recv_budget(DEFAULT_PROCESS_RECV_BUDGET)
        await conn.close()
        server.close()
        await server.wait_closed()
