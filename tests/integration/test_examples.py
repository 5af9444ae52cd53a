"""The examples and ``aiordma demo``/``devices``, run end to end as separate processes.

Every process gets its own soft device (each binds the first free
127.0.0.N:4791), TCP ports come from the kernel (bind to port 0), every wait
has a timeout and every child is killed in ``finally``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
PY = sys.executable


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["AIORDMA_PROVIDER"] = "soft"
    env.pop("NO_COLOR", None)  # (the root conftest already removed the shell's AIORDMA_* settings)
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Child:
    """A background process whose stdout/stderr are collected by threads."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            [PY, *args], cwd=ROOT, env=_env(**(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._cond = threading.Condition()
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _pump(self, stream, into: list[str]) -> None:
        for line in stream:
            with self._cond:
                into.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_for(self, pattern: str, timeout: float = 20.0) -> re.Match:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                m = rx.search(self.stdout)
                if m:
                    return m
                if self.proc.poll() is not None and all(not t.is_alive() for t in self._threads):
                    raise AssertionError(
                        f"{self.args[0]} exited ({self.proc.returncode}) before printing {pattern!r}:\n"
                        f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"{self.args[0]}: no {pattern!r} within {timeout} s:\n{self.stdout}\n{self.stderr}"
                    )
                self._cond.wait(min(left, 0.2))

    def wait(self, timeout: float = 20.0) -> int:
        rc = self.proc.wait(timeout)
        for t in self._threads:
            t.join(5)
        return rc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for t in self._threads:
            t.join(5)


def run(*args: str, timeout: float = 40.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, *args], cwd=ROOT, env=_env(**(env or {})), capture_output=True, text=True, timeout=timeout
    )


def _explain(cp: subprocess.CompletedProcess, server: Child | None = None) -> str:
    text = f"exit {cp.returncode}\nstdout:\n{cp.stdout}\nstderr:\n{cp.stderr}"
    if server is not None:
        text += f"\nserver stdout:\n{server.stdout}\nserver stderr:\n{server.stderr}"
    return text


# ------------------------------------------------------------------ examples ----


EXAMPLE_SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))


def test_every_example_is_listed():
    assert "kv_store.py" in EXAMPLE_SCRIPTS and len(EXAMPLE_SCRIPTS) >= 8, EXAMPLE_SCRIPTS


@pytest.mark.parametrize("script", EXAMPLE_SCRIPTS)
def test_examples_have_help(script):
    cp = run(str(EXAMPLES / script), "--help", timeout=20)
    assert cp.returncode == 0, _explain(cp)
    assert cp.stdout.startswith(f"usage: {script} "), _explain(cp)
    assert "-h, --help" in cp.stdout, _explain(cp)
    assert cp.stderr == "", _explain(cp)


# an import of these raises ImportError, as in an install without aiordma[dask]
_NO_DASK = (
    "import runpy, sys; sys.modules['dask'] = sys.modules['dask.array'] = sys.modules['distributed'] = None; "
    "sys.argv = [sys.argv[1], *sys.argv[2:]]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def test_dask_example_without_dask_helps_and_says_what_to_install():
    script = str(EXAMPLES / "dask_transpose.py")
    cp = run("-c", _NO_DASK, script, "--help", timeout=20)
    assert cp.returncode == 0 and cp.stdout.startswith("usage: dask_transpose.py"), _explain(cp)
    cp = run("-c", _NO_DASK, script, timeout=20)
    assert cp.returncode == 1, _explain(cp)
    assert cp.stderr.strip().splitlines() == [cp.stderr.strip()], _explain(cp)
    assert "pip install 'aiordma[dask]'" in cp.stderr, _explain(cp)


def test_kv_store_prints_the_table_layout():
    cp = run(str(EXAMPLES / "kv_store.py"), timeout=20)  # kv_server.py's defaults
    assert cp.returncode == 0, _explain(cp)
    assert "4,096 slots of 112 bytes" in cp.stdout, _explain(cp)
    cp = run(str(EXAMPLES / "kv_store.py"), "--buckets", "8", "--key-size", "8", "--value-size", "0", timeout=20)
    assert "kv.table" in cp.stdout and "8 slots of 24 bytes" in cp.stdout, _explain(cp)


def test_echo_server_and_client(tmp_path):
    port = free_port()
    secret = "example-secret-" + os.urandom(8).hex()
    # the server takes the token from the environment, the client from a file (never the command line)
    server = Child(
        str(EXAMPLES / "echo_server.py"), "--port", str(port), "--provider", "soft", "-v", env={"AIORDMA_TOKEN": secret}
    )
    token_file = tmp_path / "token"
    token_file.write_text(secret + "\n")
    token_file.chmod(0o600)
    try:
        server.wait_for(rf"listening on 127\.0\.0\.1:{port}")
        cp = run(str(EXAMPLES / "echo_client.py"), "--port", str(port), "--provider", "soft",
                 "--token-file", str(token_file), "--count", "30", "--size", "5000")  # fmt: skip
        assert cp.returncode == 0, _explain(cp)
        assert "all 30 echoes verified" in cp.stdout
        assert re.search(r"RTT us min [\d.]+ avg [\d.]+ median [\d.]+ p99 [\d.]+ max [\d.]+", cp.stdout), cp.stdout
        # a client without the secret is refused, with a message and a non-zero status
        bad = run(str(EXAMPLES / "echo_client.py"), "--port", str(port), "--provider", "soft", "--count", "1",
                  env={"AIORDMA_TOKEN": "wrong"})  # fmt: skip
        assert bad.returncode != 0
        assert "AuthenticationError" in bad.stderr
        # a token file that is not there: one line, exit 2 (a bad argument)
        missing = run(str(EXAMPLES / "echo_client.py"), "--port", str(port), "--provider", "soft", "--count", "1",
                      "--token-file", str(tmp_path / "nope"))  # fmt: skip
        assert missing.returncode == 2, _explain(missing)
        assert "no such file" in missing.stderr and "Traceback" not in missing.stderr
        server.wait_for(r"client 1 left after 30 messages")
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.stderr
    assert "echo server stopped" in server.stdout


def test_stream_file_generated_data_with_checksum(tmp_path):
    port = free_port()
    outdir = tmp_path / "received"
    server = Child(str(EXAMPLES / "stream_file.py"), "serve", "--port", str(port), "--provider", "soft",
                   "--once", "--output-dir", str(outdir))  # fmt: skip
    try:
        server.wait_for(rf"listening on 127\.0\.0\.1:{port}")
        cp = run(str(EXAMPLES / "stream_file.py"), "send", "--port", str(port), "--provider", "soft",
                 "--size", "3M", "--chunk", "256K", "--seed", "7")  # fmt: skip
        assert cp.returncode == 0, _explain(cp, server)
        assert "sha256 verified" in cp.stdout
        assert "100%" in cp.stderr  # the progress report
        assert server.wait(20) == 0, server.stderr
    finally:
        server.stop()
    import hashlib
    import random

    rng = random.Random(7)
    expect = hashlib.sha256(b"".join(rng.randbytes(256 << 10) for _ in range(12))).hexdigest()
    assert f"sha256 sender   {expect}" in cp.stdout
    assert f"sha256 {expect}" in server.stdout
    saved = outdir / f"generated-{3 << 20}.bin"
    assert hashlib.sha256(saved.read_bytes()).hexdigest() == expect


@pytest.mark.parametrize("api", ["stream", "messages"])
def test_stream_file_sends_a_file(tmp_path, api):
    src = tmp_path / "payload.bin"
    src.write_bytes(os.urandom(700_001))
    port = free_port()
    flag = ["--messages"] if api == "messages" else []
    server = Child(str(EXAMPLES / "stream_file.py"), "serve", "--port", str(port), "--provider", "soft",
                   "--once", "--output-dir", str(tmp_path / "out"), *flag)  # fmt: skip
    try:
        server.wait_for(rf"listening on 127\.0\.0\.1:{port}")
        cp = run(str(EXAMPLES / "stream_file.py"), "send", str(src), "--port", str(port), "--provider", "soft",
                 "--chunk", "100K", *flag)  # fmt: skip
        assert cp.returncode == 0, _explain(cp, server)
        assert server.wait(20) == 0, server.stderr
    finally:
        server.stop()
    assert (tmp_path / "out" / "payload.bin").read_bytes() == src.read_bytes()
    assert "sha256 verified" in cp.stdout


def test_rdma_write_demo_server_and_client():
    port = free_port()
    server = Child(str(EXAMPLES / "rdma_write_demo.py"), "server", "127.0.0.1", str(port), "--provider", "soft",
                   "--timeout", "20")  # fmt: skip
    try:
        server.wait_for(r"waiting for a client")
        cp = run(str(EXAMPLES / "rdma_write_demo.py"), "client", "127.0.0.1", str(port), "--provider", "soft",
                 "--timeout", "20")  # fmt: skip
        assert cp.returncode == 0, _explain(cp)
        assert "write complete: 23 bytes" in cp.stdout
        assert server.wait(20) == 0, server.stderr
    finally:
        server.stop()
    out = server.stdout
    assert "hello from RDMA client" in out
    assert "0x52444d41" in out
    assert re.search(r"opcode=129 \(IBV_WC_RECV_RDMA_WITH_IMM\) imm=0x52444d41 length=23", out), out
    # both sides printed what they exchanged, and each saw the other's values
    s_qpn = int(re.search(r"^QPN=(\d+) rkey=0x([0-9a-f]+) addr=0x([0-9a-f]+)", out, re.M).group(1))
    assert re.search(rf"peer: QPN={s_qpn} ", cp.stdout), cp.stdout


def test_rdma_write_demo_handshake_layout():
    """The 32-byte struct handshake of the C program: u32 qpn, u32 rkey, u64 addr, u8 gid[16], native order."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import rdma_write_demo as demo
    finally:
        sys.path.remove(str(EXAMPLES))
    gid = bytes(range(16))
    b = demo.HANDSHAKE.pack(0x123456, 0xAABBCCDD, 0x7F0011223344, gid)
    assert len(b) == 32
    order = sys.byteorder
    assert b[0:4] == (0x123456).to_bytes(4, order)
    assert b[4:8] == (0xAABBCCDD).to_bytes(4, order)
    assert b[8:16] == (0x7F0011223344).to_bytes(8, order)
    assert b[16:32] == gid
    assert demo.IMM_MAGIC == 0x52444D41 and demo.BUF_SIZE == 4096


# ---------------------------------------------------------------- aiordma CLI ----


def test_aiordma_demo(tmp_path):
    pcap = tmp_path / "demo.pcap"
    t = time.monotonic()
    cp = run("-m", "aiordma.cli", "demo", "--size", "2M", "--pcap", str(pcap), timeout=60)
    elapsed = time.monotonic() - t
    assert cp.returncode == 0, _explain(cp)
    out = cp.stdout
    for i in range(1, 9):
        assert f"Step {i}/8" in out, out
    for needle in (
        "echoed back intact",
        "SHA-256 matches",
        "IBV_WR_RDMA_WRITE",
        "RDMA_WRITE_ONLY",
        "RETH R_Key",
        "4791",
        "IBV_WC_SUCCESS",
        "IBV_WC_RDMA_WRITE",
        "hello from RDMA client",
        "demo finished",
    ):
        assert needle in out, needle
    assert "\x1b[" not in out  # no colour when stdout is not a terminal
    assert elapsed < 45, f"the demo took {elapsed:.1f} s"
    data = pcap.read_bytes()
    assert data[:4] == bytes.fromhex("d4c3b2a1")  # little-endian classic pcap
    assert len(data) > 24 + 16 + 42
    assert re.search(r"Capture: .*\((\d+) packets", out)


def test_aiordma_demo_fails_cleanly_on_a_bad_provider():
    cp = run("-m", "aiordma.cli", "demo", "--provider", "nonsense", timeout=20)
    assert cp.returncode != 0
    assert "invalid choice" in cp.stderr


def test_aiordma_devices():
    cp = run("-m", "aiordma.cli", "devices", "--json", timeout=30)
    assert cp.returncode == 0, _explain(cp)
    data = json.loads(cp.stdout)
    soft = data["soft"]
    assert soft["error"] is None and soft["udp_port"] == 4791
    port = soft["ports"][0]
    assert port["state"] == "IBV_PORT_ACTIVE" and port["active_mtu"] == 4096
    g = port["gids"][0]
    assert g["aiordma"] is True and g["type"] == "RoCE v2" and g["ipv4"] == soft["ip"]
    assert data["auto"]["provider"] == "soft"  # AIORDMA_PROVIDER=soft in these tests
    assert "AIORDMA_PROVIDER" in data["auto"]["reason"]
    text = run("-m", "aiordma.cli", "devices", timeout=30)
    assert text.returncode == 0, _explain(text)
    assert "provider auto -> soft" in text.stdout
    assert "RoCE v2" in text.stdout and "*" in text.stdout
    # the soft device's larger-than-RoCE path MTU toward another soft device is named and explained
    assert soft["soft_mtu"] > port["active_mtu"]
    assert f"path MTU toward another soft device: up to {soft['soft_mtu']} bytes" in text.stdout
    assert "because both ends are this software" in text.stdout
