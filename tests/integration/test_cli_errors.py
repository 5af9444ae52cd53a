"""Bad input to the command-line tools, as a user meets it: real processes.

Every bad argument is one line on stderr and exit status 2 (argparse's
convention), an unreachable or unresolvable peer one line and exit status 1,
and nothing ends in a traceback. Long benchmark runs say what they are doing
on stderr while ``--json`` keeps stdout to JSON lines, and ``aiordma bench
TEST --help`` describes TEST.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine_neutral  # the same on every engine and core: CI's reference run leaves it out

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIORDMA_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["AIORDMA_PROVIDER"] = "soft"
    return env


def _run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT
    )


def aiordma(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return _run("-m", "aiordma.cli", *argv, timeout=timeout)


_PROGRESS = re.compile(r"aiordma bench: .* \.\.\. \d+ s$")


def _one_line(cp: subprocess.CompletedProcess, code: int) -> str:
    """The single line on stderr, after checking the exit status and that no traceback came."""
    explain = f"exit {cp.returncode}\nstdout:\n{cp.stdout}\nstderr:\n{cp.stderr}"
    assert cp.returncode == code, explain
    assert "Traceback" not in cp.stderr, explain
    # (a bench phase that lasts over 1 s says so on a line of its own, "aiordma bench: ... 1 s":
    # progress, not part of the error, and shown only on a slow or loaded machine)
    lines = [line for line in cp.stderr.splitlines() if line.strip() and not _PROGRESS.match(line)]
    assert len(lines) == 1, explain
    return lines[0]


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------- bad arguments: 2 ----


@pytest.mark.parametrize(
    "argv, says",
    [
        (["bench", "write_bw", "--server", "-p", "70000"], "argument -p/--port: 70000 is not a port number"),
        (["bench", "write_bw", "-n", "0"], "argument -n/--iters: 0 is less than 1"),
        (["bench", "write_bw", "-s", "1Q"], "argument -s/--size: not a size: '1Q'"),
        (["bench", "write_bw", "-s", "inf"], "argument -s/--size: not a size: 'inf'"),
        (["bench", "read_bw", "-s", "3G"], "the largest RDMA message"),
        (["bench", "send_lat", "-l", "4"], "--post-list applies to write_bw only"),
        (["bench", "write_bw", "-D", "nan"], "argument -D/--duration"),
        (["bench", "write_bw", "--server", "--client", "127.0.0.1"], "--server and --client exclude each other"),
        (["bench", "send_lat", "--persistent"], "--persistent applies to --server only"),
        (["bench", "send_lat", "--client", "127.0.0.1", "--bind", "127.0.0.1"], "--bind applies to --server only"),
        (["bench", "nosuch"], "invalid choice: 'nosuch'"),
        (["doctor", "--peer", "127.0.0.1:99999"], "99999 is not a port number"),
        (["doctor", "--timeout", "-1"], "argument --timeout"),
        (["demo", "--timeout", "0"], "argument --timeout"),
        (["demo", "--size", "2G"], "the demo keeps the data in memory"),
        (["devices", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_arguments_are_one_line_and_status_2(argv: list[str], says: str) -> None:
    line = _one_line(aiordma(*argv), 2)
    assert "error:" in line and says in line, line


@pytest.mark.parametrize(
    "script, argv, says",
    [
        ("echo_client.py", ["--port", "70000"], "70000 is not a port number"),
        ("echo_client.py", ["--timeout", "-1"], "argument --timeout"),
        ("echo_server.py", ["--port", "70000"], "70000 is not a port number"),
        ("rdma_write_demo.py", ["server", "127.0.0.1", "70000"], "70000 is not a port number"),
        ("rdma_write_demo.py", ["client", "127.0.0.1", "1", "--timeout", "-1"], "argument --timeout"),
        ("stream_file.py", ["send", "--port", "70000"], "70000 is not a port number"),
        ("stream_file.py", ["send", "/no/such/file"], "not a readable file"),
        ("stream_file.py", ["serve", "--output-dir", "{file}/sub"], "Not a directory"),
        ("kv_store.py", ["--buckets", "0"], "buckets must be between 1 and"),
        ("kv_store.py", ["--key-size", "big"], "argument --key-size: not an integer: 'big'"),
        ("dask_transpose.py", ["-n", "0"], "-n and --chunk must be positive"),
    ],
)
def test_examples_refuse_bad_arguments(script: str, argv: list[str], says: str, tmp_path: Path) -> None:
    # the examples use plain argparse: its usage line(s), then one error line
    (tmp_path / "file").write_bytes(b"")
    argv = [a.format(file=tmp_path / "file") for a in argv]
    cp = _run(str(EXAMPLES / script), *argv, timeout=30)
    assert cp.returncode == 2, cp.stderr
    assert "Traceback" not in cp.stderr, cp.stderr
    last = cp.stderr.strip().splitlines()[-1]
    assert "error:" in last and says in last, cp.stderr


# -------------------------------------------------- unreachable peers: 1 ----


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--client", "999.1.1.1"], "999.1.1.1: not an IPv4 address"),
        (["--client", "no-such-host.invalid"], "cannot resolve --client 'no-such-host.invalid'"),
        (["--client", "127.0.0.1", "-p", "1"], "cannot reach the aiordma server at 127.0.0.1:1: connection refused"),
    ],
)
def test_bench_unreachable_peer_is_one_line_and_status_1(argv: list[str], says: str) -> None:
    cp = aiordma("bench", "write_bw", *argv)
    line = _one_line(cp, 1)
    assert says in line, line
    assert cp.stdout == ""  # no table header for a run that never started


def test_bench_tcp_baseline_unreachable_is_one_line() -> None:
    """The aiordma server answers, the baseline port does not: still one line."""
    server = subprocess.Popen(
        [sys.executable, "-m", "aiordma.tools.bench", "read_lat", "--server", "--port", "0", "--bind", "127.0.0.1"]
        + ["--baseline", "none", "--provider", "soft"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        ports = json.loads(line.split(" ", 1)[1])
        dead = _unused_port()
        cp = aiordma(
            "bench", "read_lat", "-n", "20", "--client", "127.0.0.1", "-p", str(ports["rdma_port"]),
            "--tcp-port", str(dead), "--json",
        )  # fmt: skip
        msg = _one_line(cp, 1)
        assert f"cannot reach the TCP baseline server at 127.0.0.1:{dead}" in msg, msg
    finally:
        server.kill()
        server.wait()


def test_bench_server_that_cannot_listen_is_one_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cp = aiordma("bench", "write_bw", "--server", "--bind", "127.0.0.1", "-p", str(port), "--baseline", "none")
    line = _one_line(cp, 1)
    assert f"cannot listen on 127.0.0.1:{port}" in line, line


@pytest.mark.skipif(os.path.exists("/sys/class/infiniband"), reason="this machine has kernel RDMA devices")
def test_bench_server_end_that_cannot_start_is_one_line() -> None:
    """The loopback server end (a child process) fails: its reason, in our one line."""
    line = _one_line(aiordma("bench", "write_bw", "--provider", "pyverbs", "-n", "10"), 1)
    assert "the aiordma server end could not start:" in line, line
    assert "DeviceNotFoundError" in line or "ProviderUnavailableError" in line, line  # no device, or no pyverbs


# ----------------------------------------------------------- help, progress ----


def test_bench_test_help_describes_that_test() -> None:
    cp = aiordma("bench", "write_bw", "--help")
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.startswith("usage: aiordma bench write_bw")
    assert "RDMA Write bandwidth" in cp.stdout and "ib_write_bw" in cp.stdout
    assert "--post-list" in cp.stdout and "--tx-depth" in cp.stdout
    cp = aiordma("bench", "send_lat", "--help")
    assert cp.returncode == 0, cp.stderr
    assert "half" in cp.stdout and "round trip" in cp.stdout and "ib_send_lat" in cp.stdout
    assert "--post-list" not in cp.stdout and "--tx-depth" not in cp.stdout  # they do nothing for send_lat
    cp = _run("-m", "aiordma.tools.bench", "atomic_lat", "--help")
    assert cp.returncode == 0, cp.stderr
    assert "fetch-and-add" in cp.stdout and "--size" not in cp.stdout
    top = aiordma("bench", "--help")
    assert top.returncode == 0 and all(t in top.stdout for t in ("write_bw", "atomic_lat", "TEST --help"))


def test_bench_long_run_shows_progress_on_stderr_and_keeps_json_clean() -> None:
    cp = aiordma(
        "bench", "write_bw", "-s", "128M", "-n", "2", "--baseline", "none", "--json", "--status-interval", "0.01",
        timeout=120,
    )  # fmt: skip
    assert cp.returncode == 0, cp.stderr
    [rec] = [json.loads(line) for line in cp.stdout.splitlines()]  # stdout: JSON lines only
    assert rec["size"] == 128 << 20 and rec["iterations"] == 2
    assert "aiordma bench: 128 MiB write_bw: aiordma: measuring, 2 iterations" in cp.stderr, cp.stderr
    # the warm-up moves at most the default byte budget (256 MiB): 2 iterations, not 16
    assert "warm-up, 2 iterations" in cp.stderr, cp.stderr
    assert "Traceback" not in cp.stderr
    quiet = aiordma(
        "bench", "write_bw", "-s", "32M", "-n", "2", "--baseline", "none", "--json", "--status-interval", "0.01",
        "-q", timeout=120,
    )  # fmt: skip
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
