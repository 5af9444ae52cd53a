"""Two simulated hosts: two Linux network namespaces joined by a veth pair.

Each namespace has its own interfaces, addresses, routes and port space, so a
process started in one (``ip netns exec NAME ...``) reaches the other only
over the veth link, as a second machine on a point-to-point network::

    with TwoHosts() as hosts:
        hosts.a.ip, hosts.b.ip                  # 10.251.N.1, 10.251.N.2
        hosts.a.popen([...])                    # a process on host A
        hosts.b.run([...])                      # a command on host B

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; :func:`unavailable`
says why not when they are missing. Everything is removed on exit: the
processes started through it are stopped, the namespaces deleted (which
deletes the veth pair).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why two namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"aiordma-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One namespace: its name, its address on the veth link, and its processes."""

    name: str
    ip: str
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    def argv(self, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def popen(self, cmd: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` on this host (stopped on exit if still running)."""
        proc = subprocess.Popen(self.argv(cmd), start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def run(self, cmd: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        return subprocess.run(self.argv(cmd), **kw)

    def stop(self, timeout: float = 10.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


class TwoHosts:
    """Namespaces ``aiordma-a-PID`` and ``aiordma-b-PID`` on 10.251.N.0/24.

    The link's MTU is Ethernet's 1500 by default: the soft device sizes its RoCE
    packets from its interface's MTU (1024-byte payloads there), as kernel rxe
    does, since a datagram it does not let the kernel fragment must fit."""

    def __init__(self, mtu: int = 1500) -> None:
        self.mtu = mtu
        pid = os.getpid()
        n = pid % 250 + 1
        self.a = Host(f"aiordma-a-{pid}", f"10.251.{n}.1")
        self.b = Host(f"aiordma-b-{pid}", f"10.251.{n}.2")
        # interface names are at most 15 bytes
        self._veth = (f"ardA{pid % 100000}", f"ardB{pid % 100000}")

    def __enter__(self) -> TwoHosts:
        try:
            va, vb = self._veth
            _ip("netns", "add", self.a.name)
            _ip("netns", "add", self.b.name)
            _ip("link", "add", va, "type", "veth", "peer", "name", vb)
            _ip("link", "set", va, "netns", self.a.name)
            _ip("link", "set", vb, "netns", self.b.name)
            for host, dev in ((self.a, va), (self.b, vb)):
                _ip("-n", host.name, "addr", "add", f"{host.ip}/24", "dev", dev)
                _ip("-n", host.name, "link", "set", dev, "mtu", str(self.mtu))
                _ip("-n", host.name, "link", "set", dev, "up")
                _ip("-n", host.name, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for host in (self.a, self.b):
            host.stop()
        for host in (self.a, self.b):
            _ip("netns", "del", host.name, check=False)
        _ip("link", "del", self._veth[0], check=False)  # if it never moved into a namespace
