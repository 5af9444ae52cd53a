"""Helpers of the rxe tests: building the classic C program, waiting for a
TCP listener, reading captured RoCEv2 frames, and the kernel's view of the
memory registered (``rdma resource show mr``)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: the classic libibverbs C program, part of the test suite (``$AIORDMA_C_DEMO`` overrides it)
C_DEMO_DEFAULT = os.path.join(REPO, "tests", "rxe", "c", "rdma_write_demo.c")
PY_DEMO = os.path.join(REPO, "examples", "rdma_write_demo.py")
IMM_MAGIC = 0x52444D41
MESSAGE = "hello from RDMA client"

# LD_PRELOAD shim: the C program opens ibv_get_device_list()[0]; with
# AIORDMA_IBV_FIRST=<name> that device is moved to the front of the list (the
# program itself is unchanged). Needed when a second rxe device exists.
_SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>

struct ibv_device **ibv_get_device_list(int *num)
{
    static struct ibv_device **(*real)(int *);
    struct ibv_device **list, *t;
    const char *want = getenv("AIORDMA_IBV_FIRST");
    int n = 0, i;
    if (!real)
        real = (struct ibv_device **(*)(int *))dlsym(RTLD_NEXT, "ibv_get_device_list");
    list = real(&n);
    if (list && want)
        for (i = 1; i < n; i++)
            if (strcmp(ibv_get_device_name(list[i]), want) == 0) {
                t = list[0]; list[0] = list[i]; list[i] = t;
                break;
            }
    if (num)
        *num = n;
    return list;
}
"""


@dataclass
class CDemo:
    binary: str
    shim: str
    source: str

    def env(self, device: str | None = None) -> dict[str, str]:
        """Environment for the C program; with ``device`` it opens that one."""
        env = dict(os.environ)
        if device:
            env["LD_PRELOAD"] = self.shim
            env["AIORDMA_IBV_FIRST"] = device
        return env


def c_demo_source() -> str:
    """The C program to build: ``$AIORDMA_C_DEMO`` if set, else :data:`C_DEMO_DEFAULT`."""
    return os.environ.get("AIORDMA_C_DEMO") or C_DEMO_DEFAULT


def build_c_demo(outdir: str) -> CDemo:
    """Compile the classic C program (:func:`c_demo_source`) and the device-choice
    shim into ``outdir``.

    The program is part of the repository, so nothing here skips: a missing
    source, compiler or libibverbs header fails the test with what to install
    (the VM borrows the host's gcc and libibverbs-dev: ``scripts/test-rxe``
    and ``scripts/rxe-vm setup`` install them)."""
    src = c_demo_source()
    if not os.path.isfile(src):
        where = "$AIORDMA_C_DEMO" if os.environ.get("AIORDMA_C_DEMO") else "the repository's copy"
        pytest.fail(f"C program not found: {src} ({where}; unset AIORDMA_C_DEMO to use {C_DEMO_DEFAULT})")
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc is not installed: the C interop tests build rdma_write_demo.c (apt-get install gcc libc6-dev)")
    if not os.path.exists("/usr/include/infiniband/verbs.h"):
        pytest.fail(
            "libibverbs-dev is not installed: no /usr/include/infiniband/verbs.h (apt-get install libibverbs-dev)"
        )
    binary = os.path.join(outdir, "rdma_write_demo")
    shim = os.path.join(outdir, "ibv_first.so")
    shim_src = os.path.join(outdir, "ibv_first.c")
    with open(shim_src, "w") as f:
        f.write(_SHIM_C)
    for cmd in (
        [gcc, "-O2", "-Wall", "-o", binary, src, "-libverbs"],
        [gcc, "-O2", "-shared", "-fPIC", "-o", shim, shim_src, "-libverbs", "-ldl"],
    ):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.fail(f"{' '.join(cmd)} could not run: {exc}")
        if r.returncode != 0:
            hint = ""
            if "verbs.h" in r.stderr or "cannot find -libverbs" in r.stderr:
                hint = " (libibverbs-dev missing? apt-get install libibverbs-dev)"
            pytest.fail(f"{' '.join(cmd)} failed with exit {r.returncode}{hint}:\n{r.stderr}")
    return CDemo(binary, shim, src)


def free_tcp_port(host: str = "0.0.0.0") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        return True
        except OSError:
            continue
    return False


def wait_listening(port: int, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> None:
    """Wait until something in this network namespace listens on TCP ``port``
    (without connecting: the C server accepts exactly one client)."""
    deadline = time.monotonic() + timeout
    while not _listening(port):
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"server exited with {proc.returncode} before listening:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing listens on TCP port {port} after {timeout} s")
        time.sleep(0.05)


def finish(proc: subprocess.Popen, timeout: float, name: str) -> tuple[int, str, str]:
    """Wait for ``proc`` (killed after ``timeout``); returns (rc, stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{name} did not finish within {timeout} s:\n{out}\n{err}") from None
    return proc.returncode, out, err


def py_demo_cmd(role: str, ip: str, port: int, *extra: str) -> list[str]:
    # the demo's server listens beyond loopback only with --insecure (its C handshake has no token)
    insecure = ["--insecure"] if role == "server" else []
    return [sys.executable, PY_DEMO, role, ip, str(port), "--timeout", "60", *insecure, *extra]


def py_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


# ------------------------------------------------------------------ capture ----


@dataclass
class Frame:
    """One captured IPv4/UDP RoCEv2 datagram (the IP header as it was on the wire)."""

    outgoing: bool
    src: str
    dst: str
    sport: int
    dport: int
    ip_id: int
    df: bool
    udp_checksum: int
    datagram: bytes
    tos: int = 0  # the IP header's traffic class (DSCP << 2 | ECN)
    ttl: int = 0

    @classmethod
    def parse(cls, outgoing: bool, ip: bytes) -> Frame | None:
        if len(ip) < 28 or ip[0] >> 4 != 4 or ip[9] != 17:
            return None
        ihl = (ip[0] & 15) * 4
        total = struct.unpack_from(">H", ip, 2)[0]
        ip_id, frag = struct.unpack_from(">HH", ip, 4)
        sport, dport, ulen, csum = struct.unpack_from(">HHHH", ip, ihl)
        if 4791 not in (sport, dport):
            return None
        dgram = bytes(ip[ihl + 8 : min(ihl + ulen, total)])
        return cls(
            outgoing, socket.inet_ntoa(ip[12:16]), socket.inet_ntoa(ip[16:20]), sport, dport,
            ip_id, bool(frag & 0x4000), csum, dgram, ip[1], ip[8],
        )  # fmt: skip


# ------------------------------------------------------ kernel resources ----


def kernel_mrs(device: str | None = None, pid: int | None = None) -> list[dict]:
    """The memory regions the kernel tracks (``rdma -j resource show mr``, iproute2's
    rdma tool; needs root, as in the VM), optionally those of one device (``rxe0``)
    and one process. Each is the tool's JSON object: ``ifname``, ``mrn``, ``rkey``,
    ``lkey``, ``mrlen``, ``pdn``, ``pid``, ``comm``."""
    rdma = shutil.which("rdma") or "/sbin/rdma"
    out = subprocess.run(
        [rdma, "-j", "resource", "show", "mr"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    rows = json.loads(out) if out.strip() else []
    return [r for r in rows if (device is None or r.get("ifname") == device) and (pid is None or r.get("pid") == pid)]


def kernel_registered_memory(device: str | None = None, pid: int | None = None) -> dict[str, int]:
    """What the kernel says is registered, in the shape of
    ``DeviceContext.registered_memory()``: ``{"bytes": sum of mrlen, "regions": count}``."""
    mrs = kernel_mrs(device, pid)
    return {"bytes": sum(int(r.get("mrlen", 0)) for r in mrs), "regions": len(mrs)}
