"""``aiordma bench``: the output users read and scripts parse (not a speed test).

Each test runs the real command in a subprocess (which starts its own server
processes on loopback), so these check the whole path: JSON fields, sane
values, perftest's table headers, the two-machine flags. No thresholds on
speed: the machine may be busy.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aiordma.tools import bench

pytestmark = pytest.mark.engine_neutral  # the same on every engine and core: CI's reference run leaves it out

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 50


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for var in ("AIORDMA_PROVIDER", "AIORDMA_PROGRESS", "AIORDMA_TOKEN"):
        env.pop(var, None)
    return env


def _bench(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "aiordma.cli", "bench", *args, "--provider", "soft"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"aiordma bench {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def _check_common(rec: dict, test: str, size: int, iters: int) -> None:
    for key in (
        "test",
        "provider",
        "loop",
        "progress",
        "size",
        "iterations",
        "bw_MBps",
        "msg_rate_Mpps",
        "lat_us",
        "baseline",
        "ratio",
    ):
        assert key in rec, f"missing {key!r} in {sorted(rec)}"
    assert rec["test"] == test
    assert rec["provider"].startswith("soft")
    assert rec["loop"] == "asyncio"
    assert rec["progress"] in ("event", "thread", "busy")
    assert rec["size"] == size
    assert rec["iterations"] == iters
    assert rec["bw_MBps"] > 0 and rec["msg_rate_Mpps"] > 0
    assert rec["ratio"] is not None and rec["ratio"] > 0 and math.isfinite(rec["ratio"])
    base = rec["baseline"]
    assert base is not None and base["iterations"] == iters and base["size"] == size
    assert base["bw_MBps"] > 0 and base["msg_rate_Mpps"] > 0


def _check_lat(lat: dict) -> None:
    for key in ("min", "p50", "p99", "p999", "max", "avg", "stdev"):
        assert key in lat and math.isfinite(lat[key]), key
    assert 0 < lat["min"] <= lat["p50"] <= lat["p99"] <= lat["p999"] <= lat["max"]
    assert lat["min"] <= lat["avg"] <= lat["max"]
    assert lat["stdev"] >= 0


def test_send_lat_json() -> None:
    recs = _json_lines(_bench("send_lat", "-n", "200", "--json").stdout)
    assert len(recs) == 1
    rec = recs[0]
    _check_common(rec, "send_lat", 2, 200)  # perftest's default latency size
    _check_lat(rec["lat_us"])
    _check_lat(rec["baseline"]["lat_us"])
    # latency ratio: baseline / aiordma on the median (higher is better)
    assert rec["ratio"] == pytest.approx(rec["baseline"]["lat_us"]["p50"] / rec["lat_us"]["p50"])
    assert "half round trip" in rec["latency"]
    assert rec["cpu_us_per_op"]["client"] > 0 and rec["cpu_us_per_op"]["server"] > 0


def test_write_bw_json() -> None:
    recs = _json_lines(_bench("write_bw", "-s", "65536", "-n", "200", "--json").stdout)
    assert len(recs) == 1
    rec = recs[0]
    _check_common(rec, "write_bw", 65536, 200)
    assert rec["tx_depth"] == 16
    assert rec["bw_peak_MBps"] >= rec["bw_MBps"] * 0.99
    # bandwidth ratio: aiordma / baseline (higher is better)
    assert rec["ratio"] == pytest.approx(rec["bw_MBps"] / rec["baseline"]["bw_MBps"])
    _check_lat(rec["lat_us"])  # per-operation completion times
    # the transfer really happened: 200 x 64 KiB of RDMA Write packets left the client
    # (at least 2 packets each: even the soft devices' jumbo path MTU is below 64 KiB)
    from aiordma.providers.soft.device import MAX_SOFT_MTU

    packets = rec["counters"]["client"].get("sent_pkts", 0)
    assert packets >= 200 * -(-65536 // MAX_SOFT_MTU)


def test_write_bw_post_list() -> None:
    """-l 8: chains of 8 writes per doorbell, one completion per chain, same bytes moved."""
    recs = _json_lines(
        _bench("write_bw", "-s", "16384", "-n", "160", "-t", "32", "-l", "8", "--baseline", "none", "--json").stdout
    )
    [rec] = recs
    assert rec["post_list"] == 8 and rec["iterations"] == 160 and rec["baseline"] is None
    assert rec["latency"].startswith("per chain")
    client = rec["counters"]["client"]
    assert client.get("sent_pkts", 0) >= 160  # every write left (at least one packet each)
    out = _bench("write_bw", "-s", "4096", "-n", "64", "-l", "4", "--baseline", "none").stdout
    assert "Post list       : 4 writes per doorbell" in out
    bad = subprocess.run(
        [sys.executable, "-m", "aiordma.cli", "bench", "send_lat", "-l", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "--post-list" in bad.stderr


def test_tables_have_perftest_headers() -> None:
    out = _bench("write_bw", "-s", "4096", "-n", "100").stdout
    assert "RDMA_Write BW Test" in out
    assert " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]" in out
    rows = [line for line in out.splitlines() if line.startswith(" 4096 ")]
    assert len(rows) == 2 and "aiordma" in rows[0] and "tcp (baseline)" in rows[1]
    out = _bench("atomic_lat", "-n", "100").stdout
    for header in (
        "#bytes",
        "#iterations",
        "t_min[usec]",
        "t_max[usec]",
        "t_typical[usec]",
        "t_avg[usec]",
        "t_stdev[usec]",
        "99% percentile[usec]",
        "99.9% percentile[usec]",
    ):
        assert header in out, header
    rows = [line.split() for line in out.splitlines() if line.startswith(" 8 ")]
    assert len(rows) == 2 and rows[0][1] == "100"


def test_two_machine_flags_on_loopback() -> None:
    """``--server`` prints a ready line with its ports; ``--client HOST`` runs against it."""
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aiordma.tools.bench",
            "read_lat",
            "--server",
            "--port",
            "0",
            "--tcp-port",
            "0",
            "--bind",
            "127.0.0.1",
            "--provider",
            "soft",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line.startswith(bench.READY), line
        ports = json.loads(line[len(bench.READY) :])
        out = _bench(
            "read_lat",
            "-n",
            "50",
            "-s",
            "1024",
            "--json",
            "--client",
            "127.0.0.1",
            "--port",
            str(ports["rdma_port"]),
            "--tcp-port",
            str(ports["tcp_port"]),
        ).stdout
        rec = _json_lines(out)[0]
        _check_common(rec, "read_lat", 1024, 50)
        _check_lat(rec["lat_us"])
        assert server.wait(timeout=15) == 0  # the server leaves after its client's last goodbye
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


# ---------------------------------------------------------------- pure ----


def test_percentiles_are_nearest_rank() -> None:
    vals = [float(v) for v in range(1, 101)]
    assert bench.percentile(vals, 0.5) == 50
    assert bench.percentile(vals, 0.99) == 99
    assert bench.percentile(vals, 0.999) == 100
    stats = bench.lat_stats([1000 * v for v in range(1, 1001)])
    assert stats is not None and stats["p50"] == 500 and stats["p99"] == 990 and stats["max"] == 1000


def test_peak_rate_finds_the_best_window() -> None:
    # 10 completions of 100 bytes: the first 5 take 1 s each, the last 5 come 0.1 s apart
    stamps, t = [], 0
    for k in range(10):
        t += 1_000_000_000 if k < 5 else 100_000_000
        stamps.append(t)
    cum = [100 * (k + 1) for k in range(10)]
    assert bench.peak_rate(0, stamps, cum, 300) == pytest.approx(1000.0)  # 300 B in 0.3 s
    assert bench.peak_rate(0, stamps, cum, 10_000) == pytest.approx(1000 / 5.5)  # window > total: the average


@pytest.mark.parametrize("text,value", [("65536", 65536), ("64K", 65536), ("64KiB", 65536), ("8M", 8 << 20), ("2", 2)])
def test_sizes_parse(text: str, value: int) -> None:
    assert bench.parse_size(text) == value
