"""Everything the doctor looks at goes through a :class:`Probe`.

sysfs and procfs are read below ``Probe.root`` (``/`` normally; a fake tree
in tests), and commands, pyverbs and the resource limits are methods a test
can replace: that is the doctor's seam for fault injection."""

from __future__ import annotations

import os
import re
import resource
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

CAP_IPC_LOCK = 14


class Probe:
    """Everything the doctor looks at. Paths are read below ``root``;
    tests pass a fake tree, or subclass and replace methods (``memlock``,
    ``pyverbs_info``, ``verbs_port``, ``run``, ...). With a fake root no
    command is run and pyverbs is not asked about devices (those would
    describe the real machine, not the fake tree)."""

    def __init__(self, root: str = "/", env: dict[str, str] | None = None) -> None:
        self.root = os.path.abspath(root)
        self.fake = self.root != "/"
        self.env = dict(os.environ) if env is None else dict(env)

    # -- files
    def path(self, p: str) -> str:
        return os.path.join(self.root, p.lstrip("/"))

    def read(self, p: str) -> str | None:
        try:
            with open(self.path(p), encoding="utf-8", errors="replace") as f:
                return f.read().strip()
        except OSError:
            return None

    def exists(self, p: str) -> bool:
        return os.path.exists(self.path(p))

    def listdir(self, p: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(p)))
        except OSError:
            return []

    def readlink(self, p: str) -> str | None:
        try:
            return os.readlink(self.path(p))
        except OSError:
            return None

    def glob_first(self, base: str, names: Iterable[str]) -> str | None:
        """The first file under ``base`` (recursively) whose name is in ``names``."""
        names = set(names)
        top = self.path(base)
        for dirpath, _dirs, files in os.walk(top):
            for f in files:
                if f in names:
                    return "/" + os.path.relpath(os.path.join(dirpath, f), self.root)
        return None

    # -- the running process
    def python(self) -> dict[str, str]:
        return {
            "version": sys.version.split()[0],
            "implementation": sys.implementation.name,
            "executable": sys.executable,
        }

    def aiordma(self) -> dict[str, str]:
        import aiordma

        return {"version": aiordma.__version__, "path": os.path.dirname(os.path.abspath(aiordma.__file__))}

    def release(self) -> str:
        return os.uname().release

    def memlock(self) -> tuple[int, int]:
        """(soft, hard) RLIMIT_MEMLOCK in bytes; ``resource.RLIM_INFINITY`` = unlimited."""
        return resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def cap_ipc_lock(self) -> bool:
        """Whether this process has CAP_IPC_LOCK (then RLIMIT_MEMLOCK does not
        limit ibv_reg_mr)."""
        status = self.read("/proc/self/status") or ""
        m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", status, re.M)
        return bool(m and int(m.group(1), 16) >> CAP_IPC_LOCK & 1)

    def pyverbs_info(self) -> dict[str, Any]:
        from ...providers.pyverbs_loader import pyverbs_info

        return pyverbs_info()

    # -- commands
    def which(self, name: str) -> str | None:
        dirs = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
        if self.fake:
            for d in dirs:
                if os.access(self.path(f"{d}/{name}"), os.X_OK):
                    return f"{d}/{name}"
            return None
        path = os.pathsep.join([self.env.get("PATH", "")] + dirs)
        return shutil.which(name, path=path)

    def run(self, argv: list[str], timeout: float = 5.0) -> tuple[int, str] | None:
        """(exit status, stdout + stderr), or None when the command cannot run."""
        if self.fake:
            return None
        exe = self.which(argv[0])
        if exe is None:
            return None
        try:
            r = subprocess.run(
                [exe, *argv[1:]],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                text=True,
                errors="replace",
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return r.returncode, r.stdout

    # -- devices
    def verbs_port(self, device: str, port: int) -> dict[str, Any] | None:
        """What ``ibv_query_port`` says (``active_mtu``/``max_mtu`` in bytes,
        ``state``), or None when pyverbs cannot tell."""
        if self.fake:
            return None
        try:
            from ...providers.base import mtu_bytes
            from ...providers.pyverbs import PyverbsDevice

            dev = PyverbsDevice(device, port, None, _require_gid=False)
        except Exception:
            return None
        try:
            p = dev.query_port(port)
            return {
                "state": getattr(p.state, "name", str(p.state)),
                "active_mtu": mtu_bytes(p.active_mtu),
                "max_mtu": mtu_bytes(p.max_mtu),
                "gid_tbl_len": p.gid_tbl_len,
            }
        except Exception:
            return None
        finally:
            dev.close()

    def try_register(self, device: str, nbytes: int) -> tuple[bool, str] | None:
        """Register ``nbytes`` on the pyverbs ``device`` (what ``ulimit -l``
        limits): (True, "") or (False, why); None when it could not be tried."""
        if self.fake:
            return None
        try:
            dev = self.open_pyverbs(device)
        except Exception:
            return None
        try:
            pd = dev.alloc_pd()
            try:
                pd.reg_mr(nbytes).close()
                return True, ""
            except Exception as e:
                return False, str(e)
            finally:
                pd.close()
        except Exception:
            return None
        finally:
            dev.close()

    def open_pyverbs(self, name: str | None) -> Any:
        from ...providers import pyverbs

        return pyverbs.open_device(name)

    def open_soft(self, address: str | None) -> Any:
        from ...providers.soft.device import SoftDevice

        return SoftDevice(address, name="soft0")

    def route_source(self, host: str) -> str | None:
        """The local IPv4 address packets to ``host`` leave from."""
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host, 9))
                return str(s.getsockname()[0])
        except OSError:
            return None

    async def connect(self, host: str, port: int, **kw: Any) -> Any:
        from ...handshake import connect

        return await connect(host, port, **kw)
