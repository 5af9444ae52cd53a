"""A real Prometheus server scrapes a running aiordma service, and the series come
back exactly through Prometheus's own query API.

The service is a child process (``tests/support/metrics_service.py``): it serves
``/metrics`` and ``/health`` (:func:`aiordma.prometheus.serve`), makes 10,000
awaited 64-byte RDMA Writes and 1,000 64-byte sends on one connection to its own
server on the soft device, and waits. Prometheus (Debian's package; the test skips
with the reason where it is absent, CI installs it) scrapes it every 0.5 s; the
test queries it. Runs on the event loop of the test (asyncio, uvloop) in the child."""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from ..support.prometheus_server import MISSING, PROMETHEUS, PrometheusServer

ROOT = Path(__file__).resolve().parents[2]
WRITES, SENDS = 10_000, 1_000

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason=MISSING)


def _loop_kind() -> str:
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"


def _start_service(loop: str) -> tuple[subprocess.Popen[str], int]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.metrics_service",
            "--loop",
            loop,
            "--writes",
            str(WRITES),
            "--sends",
            str(SENDS),
        ],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the service did not start (exit status {proc.returncode}):\n{err[-3000:]}")
    return proc, int(json.loads(line)["metrics_port"])


def _value(result: list[tuple[dict[str, str], float]]) -> float | None:
    return result[0][1] if len(result) == 1 else None


async def test_prometheus_reads_exact_counts_and_a_matching_histogram_from_a_service() -> None:
    loop = asyncio.get_running_loop()
    proc, port = await loop.run_in_executor(None, _start_service, _loop_kind())
    try:
        with PrometheusServer({"aiordma": [f"127.0.0.1:{port}"]}) as prom:

            def exactly(expr: str, want: float) -> None:
                got = prom.wait_for(expr, lambda r: _value(r) is not None)
                assert _value(got) == want, (expr, got)

            def check() -> None:
                prom.wait_for('aiordma_operations_total{op="write"}', lambda r: _value(r) == WRITES)
                exactly('aiordma_work_requests_total{op="write"}', WRITES)
                exactly('aiordma_operation_bytes_total{op="write"}', WRITES * 64)
                exactly('aiordma_operation_duration_seconds_count{op="write"}', WRITES)
                exactly('aiordma_operation_duration_seconds_bucket{op="write",le="+Inf"}', WRITES)
                exactly('aiordma_operations_total{op="send"}', SENDS)
                exactly('aiordma_operation_bytes_total{op="send"}', SENDS * 64)
                exactly('aiordma_operation_duration_seconds_count{op="send"}', SENDS)
                exactly('aiordma_operations_total{op="receive"}', SENDS)  # (its own server read them)
                exactly('aiordma_operation_bytes_total{op="receive"}', SENDS * 64)
                exactly('aiordma_operations_total{op="read"}', 0)
                exactly("sum(aiordma_work_request_errors_total) or vector(0)", 0)
                exactly('aiordma_connections{state="open"}', 2)
                exactly("aiordma_connections_opened_total", 2)
                # a latency quantile Prometheus computes from the histogram: a positive time under a second
                q = _value(
                    prom.wait_for(
                        'histogram_quantile(0.5, aiordma_operation_duration_seconds_bucket{op="write"})',
                        lambda r: _value(r) is not None,
                    )
                )
                assert q is not None and 0 < q < 1
                sent = prom.wait_for("aiordma_device_sent_bytes_total", lambda r: len(r) == 1)
                assert sent[0][0]["provider"] == "soft" and sent[0][1] > WRITES * 64
                up = prom.wait_for('up{job="aiordma"}', lambda r: _value(r) == 1)
                assert up

            await loop.run_in_executor(None, check)
            health = await loop.run_in_executor(
                None, lambda: json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read())
            )
            assert health["healthy"] is True
    finally:
        assert proc.stdin is not None
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
