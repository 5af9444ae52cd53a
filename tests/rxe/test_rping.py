"""examples/rping.py against librdmacm's real ``rping`` (rdmacm-utils) over RDMA
CM on kernel Soft-RoCE: rping's server with the example as client, and the
example as server with rping's client; 10 pings each, validated (``-V``) and
printed (``-v``), at 64 and 4096 bytes. Both ends are on rxe0 in scripts/rxe-vm
and meet at its IP address (AIORDMA_RXE_IP).

``rping`` comes from the host (the VM borrows its root filesystem):
``scripts/test-rxe`` installs rdmacm-utils; without it the tests fail, saying so.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from .rxe_helpers import REPO, free_tcp_port, py_env

pytestmark = pytest.mark.rxe

EXAMPLE = os.path.join(REPO, "examples", "rping.py")
COUNT = 10
TIMEOUT = 120  # per process (TCG: python starts in seconds)


@pytest.fixture(scope="module")
def rping() -> str:
    path = shutil.which("rping")
    if path is None:
        pytest.fail(
            "rping is not installed: these tests run librdmacm's rping against examples/rping.py "
            "(apt-get install rdmacm-utils; scripts/test-rxe installs it)"
        )
    return path


@pytest.fixture(scope="module")
def rxe_ip() -> str:
    ip = os.environ.get("AIORDMA_RXE_IP")
    if not ip:
        pytest.skip("AIORDMA_RXE_IP is not set (run under scripts/rxe-vm)")
    if not os.path.exists("/dev/infiniband/rdma_cm"):
        pytest.fail("no /dev/infiniband/rdma_cm: the rdma_ucm kernel module is not loaded (scripts/rxe-vm loads it)")
    return ip


def expected_data(count: int, size: int) -> list[str]:
    """What rping's client puts in ping i (rping.c, rping_test_client), without
    the final NUL: "rdma-ping-%d: ", then the letters 'A'..'z' cycling from
    'A' + i % 58, in a buffer of ``size`` bytes whose last byte is NUL."""
    out = []
    for i in range(count):
        head = f"rdma-ping-{i}: "
        letters = [chr(65 + (i % 58 + k) % 58) for k in range(size - 1 - len(head))]
        out.append((head + "".join(letters))[: size - 1])
    return out


def ping_lines(out: str, prefix: str) -> list[str]:
    return [line[len(prefix) :] for line in out.splitlines() if line.startswith(prefix)]


def wait_cm_listening(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Wait until an RDMA CM id listens on ``port`` (``rdma resource show cm_id``:
    RDMA CM ports are not TCP sockets, /proc/net/tcp does not list them)."""
    rdma = shutil.which("rdma")
    if rdma is None:
        pytest.fail("the `rdma` tool (iproute2) is missing: cannot tell when the rping server listens")
    pat = re.compile(rf"\bLISTEN\b.*(:{port}\b|src-port {port}\b)")  # src-addr 10.0.2.15:7174
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the server exited with {proc.returncode} before listening:\n{out}\n{err}")
        r = subprocess.run([rdma, "resource", "show", "cm_id"], capture_output=True, text=True, timeout=30)
        last = r.stdout + r.stderr
        if any(pat.search(line) for line in r.stdout.splitlines()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"no RDMA CM id listens on port {port} after {timeout} s; rdma res show cm_id:\n{last}"
            )
        time.sleep(0.2)


def run_pair(server_cmd: list[str], client_cmd: list[str], port: int) -> tuple[str, str, str, str]:
    """Start the server, wait until it listens, run the client; both must exit 0.
    Returns (server stdout, server stderr, client stdout, client stderr).

    The server writes into files, not pipes: with ``-v`` at 4 KiB a ping, what it
    prints can outgrow a pipe nobody reads until the client is done, and a server
    blocked in ``write()`` stalls the client (seen once in the VM)."""
    env = py_env(PYTHONUNBUFFERED="1")
    with tempfile.TemporaryFile("w+") as sout, tempfile.TemporaryFile("w+") as serr:

        def server_output() -> tuple[str, str]:
            sout.seek(0)
            serr.seek(0)
            return sout.read(), serr.read()

        server = subprocess.Popen(server_cmd, env=env, stdout=sout, stderr=serr, text=True)
        try:
            wait_cm_listening(port, server, timeout=TIMEOUT)
            try:
                client = subprocess.run(client_cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
            except subprocess.TimeoutExpired as e:
                server.kill()
                server.wait()
                out, err = server_output()
                raise AssertionError(
                    f"the client did not finish within {TIMEOUT} s; its output:\n{e.stdout!r}\n{e.stderr!r}\n"
                    f"the server's (killed):\n{out[-3000:]}\n{err[-3000:]}"
                ) from None
            try:
                rc = server.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
                out, err = server_output()
                raise AssertionError(
                    f"the server did not finish within {TIMEOUT} s:\n{out[-3000:]}\n{err[-3000:]}"
                ) from None
            out, err = server_output()
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
    where = f"\nserver: {' '.join(server_cmd)}\nclient: {' '.join(client_cmd)}"
    assert client.returncode == 0, f"client failed ({client.returncode}):{where}\n{client.stdout}\n{client.stderr}"
    assert rc == 0, f"server failed ({rc}):{where}\n{out}\n{err}\n(client output:\n{client.stdout}\n{client.stderr})"
    return out, err, client.stdout, client.stderr


@pytest.mark.parametrize("size", [64, 4096])
def test_rping_server_example_client(rping, rxe_ip, size):
    port = free_tcp_port()
    out, _, cout, cerr = run_pair(
        [rping, "-s", "-a", rxe_ip, "-p", str(port), "-C", str(COUNT), "-S", str(size), "-v", "-V"],
        [sys.executable, EXAMPLE, "-c", "-a", rxe_ip, "-p", str(port), "-C", str(COUNT), "-S", str(size), "-v", "-V"],
        port,
    )
    want = expected_data(COUNT, size)
    # the example validated each echo (-V) and printed it (-v), as rping's client does
    assert ping_lines(cout, "ping data: ") == want, cout + cerr
    # rping's server printed what it RDMA-Read from the example's start buffer
    assert ping_lines(out, "server ping data: ") == want, out


@pytest.mark.parametrize("size", [64, 4096])
def test_example_server_rping_client(rping, rxe_ip, size):
    port = free_tcp_port()
    out, err, cout, _ = run_pair(
        [sys.executable, EXAMPLE, "-s", "-a", rxe_ip, "-p", str(port), "-C", str(COUNT), "-S", str(size), "-v", "-V"],
        [rping, "-c", "-a", rxe_ip, "-p", str(port), "-C", str(COUNT), "-S", str(size), "-v", "-V"],
        port,
    )
    want = expected_data(COUNT, size)
    # rping's client validated each echo (-V: it exits non-zero on "data mismatch!") and printed it
    assert ping_lines(cout, "ping data: ") == want, cout
    # the example's server checked rping's pattern (-V), counted -C pings and printed each
    assert ping_lines(out, "server ping data: ") == want, out + err
