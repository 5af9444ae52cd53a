"""The one-sided key-value service (``examples/kv_*.py``) and its benchmark
(``benchmarks/kv.py``), end to end in real processes.

The server process only registers and exposes memory; the clients (other
processes) store, read and count with RDMA Read, compare-and-swap, RDMA Write
and fetch-and-add. What the server holds at the end is read by the server
from its own memory when it stops, so the checks do not trust the clients.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .test_examples import EXAMPLES, PY, ROOT, Child, _env, _explain, free_port, run

BENCH = ROOT / "benchmarks" / "kv.py"


def _client(port: int, *args: str, timeout: float = 40.0) -> subprocess.CompletedProcess:
    return run(str(EXAMPLES / "kv_client.py"), "--port", str(port), "--provider", "soft", *args, timeout=timeout)


def _one_line_error(cp: subprocess.CompletedProcess, code: int, needle: str) -> None:
    assert cp.returncode == code, _explain(cp)
    assert "Traceback" not in cp.stderr, cp.stderr
    last = cp.stderr.strip().splitlines()[-1]
    assert needle in last, cp.stderr


@pytest.mark.parametrize("script", [EXAMPLES / "kv_server.py", EXAMPLES / "kv_client.py", BENCH])
def test_kv_scripts_have_help(script: Path) -> None:
    cp = run(str(script), "--help", timeout=20)
    assert cp.returncode == 0, _explain(cp)
    assert "usage:" in cp.stdout


def test_kv_server_and_client_cli() -> None:
    port = free_port()
    server = Child(str(EXAMPLES / "kv_server.py"), "--port", str(port), "--provider", "soft", "--buckets", "64",
                   "--counters", "8", "-v")  # fmt: skip
    try:
        server.wait_for(rf"kv server listening on 127\.0\.0\.1:{port} .*64 buckets")
        cp = _client(port, "-v", "put", "greeting", "hello, world")
        assert cp.returncode == 0 and cp.stdout.strip() == "OK", _explain(cp, server)
        # a PUT is four one-sided operations: read the slot, lock it, write it, unlock it
        assert "1 RDMA Read, 1 compare-and-swap, 1 RDMA Write, 1 fetch-and-add" in cp.stderr, cp.stderr
        cp = _client(port, "-v", "get", "greeting")
        assert cp.returncode == 0 and cp.stdout.strip() == "hello, world", _explain(cp, server)
        assert "1 RDMA Read, 0 compare-and-swap, 0 RDMA Write, 0 fetch-and-add" in cp.stderr, cp.stderr
        assert _client(port, "put", "greeting", "bonjour").returncode == 0  # overwrite in place
        assert _client(port, "get", "greeting").stdout.strip() == "bonjour"
        _one_line_error(_client(port, "get", "absent"), 1, "'absent' not found")
        assert _client(port, "incr", "3", "--by", "10").stdout.strip() == "10"
        assert _client(port, "incr", "3").stdout.strip() == "11"
        assert _client(port, "incr", "5", "--by", "-1").stdout.strip() == str((1 << 64) - 1)  # 64-bit wrap
        assert _client(port, "counter", "3").stdout.strip() == "11"
        info = _client(port, "info")
        assert re.search(r"64 buckets of \d+ bytes \(32-byte keys, 64-byte values\), 8 counters", info.stdout), info
        # bad input: one line naming the concept, argparse's exit status, no traceback
        _one_line_error(_client(port, "put", "k" * 33, "v"), 2, "does not fit the table's 32-byte key slots")
        _one_line_error(_client(port, "put", "k", "v" * 65), 2, "does not fit the table's 64-byte slots")
        _one_line_error(_client(port, "incr", "8"), 2, "counter 8 does not exist: the server exposes 8 counters")
        _one_line_error(_client(port, "incr", "x"), 2, "a counter is a number")
        _one_line_error(_client(port, "get"), 2, "required: key")
        _one_line_error(_client(port, "get", ""), 2, "the key must not be empty")
        server.wait_for(r"client QP 0x[0-9a-f]+ left")
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.stderr
    # what the server's own memory holds (no client asked)
    assert "kv server stopped: 1 keys stored, 0 slots locked" in server.stdout, server.stdout
    assert f"counters: 3=11 5={(1 << 64) - 1}" in server.stdout, server.stdout


def test_kv_cli_errors_without_a_server() -> None:
    port = free_port()
    _one_line_error(_client(port, "get", "x"), 1, f"cannot reach the aiordma server at 127.0.0.1:{port}")
    for args, needle in (
        (["--buckets", "0"], "must be at least 1"),
        (["--key-size", "70000"], "key and value slots"),
        (["--port", "70000"], "--port must be 0..65535"),
    ):
        cp = run(str(EXAMPLES / "kv_server.py"), *args, timeout=20)
        _one_line_error(cp, 2, needle)


WORKER = textwrap.dedent(
    """
    import asyncio, sys
    sys.path.insert(0, sys.argv[1])
    from kv_store import KVClient

    async def main(port, wid):
        clients = [await KVClient.connect("127.0.0.1", port, provider="soft") for _ in range(3)]
        bad = 0
        async def task(c, t):
            nonlocal bad
            for i in range(40):
                key = b"k%d" % (i % 5)          # 5 keys, every writer and task on all of them
                await c.put(key, b"%s|w%d.%d.%d" % (key, wid, t, i))
                got = await c.get(key)
                # never torn: a value is always whole and belongs to its key
                if got is None or not got.startswith(key + b"|w") or got.count(b"|") != 1:
                    bad += 1
                await c.incr(i % 3, 1)
        await asyncio.gather(*[task(c, t) for t, c in enumerate(clients)])
        stats = [c.stats for c in clients]
        for c in clients:
            await c.close()
        print("done", bad, sum(s.lock_conflicts for s in stats), sum(s.retries for s in stats), flush=True)

    asyncio.run(main(int(sys.argv[2]), int(sys.argv[3])))
    """
)


def test_kv_concurrent_writers_in_several_processes() -> None:
    """3 processes x 3 connections put, get and count on the same 5 keys and 3
    counters at once: values are never torn or lost, and no increment is lost."""
    port = free_port()
    server = Child(str(EXAMPLES / "kv_server.py"), "--port", str(port), "--provider", "soft", "--buckets", "16",
                   "--counters", "3")  # fmt: skip
    workers = []
    try:
        server.wait_for(rf"listening on 127\.0\.0\.1:{port}")
        workers = [
            subprocess.Popen(
                [PY, "-c", WORKER, str(EXAMPLES), str(port), str(w)],
                cwd=ROOT,
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for w in range(3)
        ]
        outs = [w.communicate(timeout=120) for w in workers]
        contention = 0
        for w, (out, err) in zip(workers, outs):
            assert w.returncode == 0, err
            m = re.search(r"done (\d+) (\d+) (\d+)", out)
            assert m and m.group(1) == "0", (out, err)
            contention += int(m.group(2)) + int(m.group(3))
        assert contention > 0  # writers did meet locked slots and lost compare-and-swaps
        counters = [_client(port, "counter", str(i)).stdout.strip() for i in range(3)]
        values = [_client(port, "get", f"k{i}").stdout.strip() for i in range(5)]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        server.stop()
    # 3 processes x 3 tasks x 40 iterations, i % 3 spread over the counters: 14 + 13 + 13 per task
    assert [int(c) for c in counters] == [3 * 3 * 14, 3 * 3 * 13, 3 * 3 * 13], counters
    for i, v in enumerate(values):
        assert re.fullmatch(rf"k{i}\|w[0-2]\.[0-2]\.\d+", v), values
    assert "kv server stopped: 5 keys stored, 0 slots locked" in server.stdout, server.stdout


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_kv_benchmark_tiny(tmp_path: Path, loop: str) -> None:
    out = tmp_path / "kv.json"
    cp = run(str(BENCH), "--clients", "2", "--ops", "40", "--count-ops", "20", "--rounds", "2", "--keys", "30",
             "--buckets", "64", "--loop", loop, "--provider", "soft", "--json", str(out), timeout=180)  # fmt: skip
    assert cp.returncode == 0, _explain(cp)
    doc = json.loads(out.read_text())
    assert [(r["transport"], r["round"]) for r in doc["rounds"]] == [
        ("aiordma", 0),
        ("tcp", 0),
        ("aiordma", 1),
        ("tcp", 1),
    ]
    for r in doc["rounds"]:
        assert r["kv_ops"] == 40 and r["kv_ops_per_s"] > 0, r
        assert r["server_cpu_ms"] >= 0 and r["client_cpu_us_per_kv_op"] > 0, r
        if r["transport"] == "aiordma":
            # a GET is >= 1 read, a PUT 4 operations, an INCR 1 fetch-and-add
            s = r["stats"]
            assert r["one_sided_ops"] >= r["kv_ops"], r
            assert s["compare_and_swaps"] >= s["puts"] and s["rdma_writes"] == s["puts"], s
            assert s["fetch_and_adds"] == s["puts"] + s["incrs"] and s["rdma_reads"] >= s["gets"] + s["puts"], s
    summ = doc["summary"]
    assert summ["aiordma"]["rounds"] == summ["tcp"]["rounds"] == 2
    assert summ["tcp"]["server_cpu_us_per_kv_op"]["median"] > 0  # the TCP server does the work itself
    counted = doc["bytecodes"]
    assert counted["aiordma"]["kv_ops"] == 20 and counted["tcp"]["kv_ops"] == 20
    assert counted["tcp"]["bytecodes_per_kv_op"] > 50  # asyncio streams and the dict work, in Python
    bars = {b["bar"]: b for b in doc["bars"]}
    assert set(bars) == {"server CPU <= 5 us per one-sided op", "0 Python bytecodes in the server per one-sided op"}
    if counted["aiordma"]["engine"] == "native":
        assert counted["aiordma"]["bytecodes"] == 0, counted["aiordma"]
    else:  # the Python engine processes every packet in the server's Python
        assert counted["aiordma"]["bytecodes_per_one_sided_op"] > 500, counted["aiordma"]
        assert not bars["0 Python bytecodes in the server per one-sided op"]["met"]
    assert doc["machine"]["cpus"] >= 1 and doc["config"]["loop"] == loop
    assert "KV ops/s" in cp.stdout and "bar: server CPU <= 5 us per one-sided op" in cp.stdout
    assert "reproduce: python benchmarks/kv.py" in cp.stdout


def test_kv_benchmark_cli_errors() -> None:
    for args, needle in (
        (["--mix", "get=1,delete=2"], "--mix: 'delete=2' is not OP=WEIGHT"),
        (["--keys", "100", "--buckets", "10"], "must not exceed --buckets"),
        (["--clients", "0"], "--clients must be at least 1"),
    ):
        cp = run(str(BENCH), *args, timeout=30)
        _one_line_error(cp, 2, needle)


def test_examples_import_path() -> None:
    # the client module is importable from benchmarks/ and tests without installing anything
    cp = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(EXAMPLES)!r}); import kv_store, kv_server"],
        capture_output=True,
        text=True,
        timeout=30,
        env=_env(),
        cwd=ROOT,
    )
    assert cp.returncode == 0, cp.stderr
