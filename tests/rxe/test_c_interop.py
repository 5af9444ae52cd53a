"""The classic C program (rdma_write_demo.c, libibverbs) and its Python twin
(examples/rdma_write_demo.py, aiordma's pyverbs provider) talk to each other
over kernel Soft-RoCE: C server + Python client, Python server + C client
(and C with C, the reference). Both ends are on rxe0 in scripts/rxe-vm and
reach each other through its IP address (AIORDMA_RXE_IP).

The C program is the project's own (tests/rxe/c/rdma_write_demo.c; ``$AIORDMA_C_DEMO``
overrides it), built at test time: ``gcc -O2 -Wall -o TMP/rdma_write_demo SRC
-libverbs``; the tests fail, saying what to install, when gcc or libibverbs-dev is missing.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from .rxe_helpers import IMM_MAGIC, MESSAGE, build_c_demo, finish, free_tcp_port, py_demo_cmd, py_env, wait_listening

pytestmark = pytest.mark.rxe

TIMEOUT = 120  # per process (TCG: python starts in seconds)


@pytest.fixture(scope="module")
def c_demo(tmp_path_factory):
    return build_c_demo(str(tmp_path_factory.mktemp("c_demo")))


@pytest.fixture(scope="module")
def rxe_ip():
    ip = os.environ.get("AIORDMA_RXE_IP")
    if not ip:
        pytest.skip("AIORDMA_RXE_IP is not set (run under scripts/rxe-vm)")
    gidx = os.environ.get("AIORDMA_RXE_GID_INDEX")
    if gidx and gidx != "1":
        pytest.skip(
            f"the C program hard-codes GID index 1; {os.environ.get('AIORDMA_RXE_DEVICE')}'s IPv4 GID is {gidx}"
        )
    return ip


def device_name() -> str:
    return os.environ.get("AIORDMA_RXE_DEVICE") or "rxe0"


def check_c_server(out: str) -> None:
    # 收到完成：opcode=129 imm=0x52444d41 长度=23 / 缓冲区内容：hello from RDMA client
    assert f"imm=0x{IMM_MAGIC:x}" in out, out
    assert "opcode=129" in out, out
    assert f"{MESSAGE}" in out, out
    assert f"长度={len(MESSAGE) + 1}" in out, out


def check_py_server(out: str) -> None:
    assert f"imm=0x{IMM_MAGIC:x}" in out, out
    assert "opcode=129 (IBV_WC_RECV_RDMA_WITH_IMM)" in out, out
    assert f"buffer: {MESSAGE}" in out, out
    assert f"length={len(MESSAGE) + 1}" in out, out


def run_pair(server_cmd, server_env, client_cmd, client_env, port):
    server = subprocess.Popen(server_cmd, env=server_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_listening(port, server, timeout=TIMEOUT)
        client = subprocess.run(client_cmd, env=client_env, capture_output=True, text=True, timeout=TIMEOUT)
        rc, out, err = finish(server, TIMEOUT, "server")
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert client.returncode == 0, f"client failed ({client.returncode}):\n{client.stdout}\n{client.stderr}"
    assert rc == 0, f"server failed ({rc}):\n{out}\n{err}"
    return out, client.stdout


def test_c_server_python_client(c_demo, rxe_ip):
    port = free_tcp_port()
    out, cout = run_pair(
        [c_demo.binary, "server", rxe_ip, str(port)],
        c_demo.env(device_name()),
        py_demo_cmd("client", rxe_ip, port, "--provider", "pyverbs", "--device", device_name()),
        py_env(),
        port,
    )
    check_c_server(out)
    assert f"write complete: {len(MESSAGE) + 1} bytes" in cout


def test_python_server_c_client(c_demo, rxe_ip):
    port = free_tcp_port()
    out, cout = run_pair(
        py_demo_cmd("server", rxe_ip, port, "--provider", "pyverbs", "--device", device_name()),
        py_env(),
        [c_demo.binary, "client", rxe_ip, str(port)],
        c_demo.env(device_name()),
        port,
    )
    check_py_server(out)
    assert "发送完成" in cout  # "send complete"


def test_c_server_c_client(c_demo, rxe_ip):
    """The reference pair: the C program with itself."""
    port = free_tcp_port()
    out, _ = run_pair(
        [c_demo.binary, "server", rxe_ip, str(port)],
        c_demo.env(device_name()),
        [c_demo.binary, "client", rxe_ip, str(port)],
        c_demo.env(device_name()),
        port,
    )
    check_c_server(out)
