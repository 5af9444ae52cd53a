"""``aiordma doctor``: check the RDMA set-up and say how to fix what is wrong.

It walks the set-up checklist that RDMA guides give (device and port state,
GID index, MTU, ``ulimit -l``, UDP 4791, no NAT) and adds what aiordma itself
needs (pyverbs, the soft device, a peer's rendezvous). Every check is a
:class:`Check`: a name, a status (``ok``, ``warn``, ``fail``, ``skip``), what
was seen and a one-line fix. ``fail`` is used only for what the device
aiordma will use needs; everything else is ``warn``. Exit status: 0 when no
check failed, 1 otherwise.

All the probing goes through a :class:`Probe`: sysfs and procfs are read
below ``Probe.root`` (``/`` normally; a fake tree in tests), and commands,
pyverbs and the resource limits are methods a test can replace.

    aiordma doctor                       # what aiordma would use here, and why
    aiordma doctor --provider pyverbs --device rxe0
    aiordma doctor --peer 10.0.0.2:18515 --token s3cret --json
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import inspect
import ipaddress
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
STATUSES = (OK, WARN, FAIL, SKIP)

#: kernel modules worth reporting (core, user verbs, soft devices, common NIC drivers)
RDMA_MODULES = (
    "ib_core",
    "ib_uverbs",
    "rdma_ucm",
    "rdma_rxe",
    "siw",
    "mlx5_ib",
    "mlx4_ib",
    "irdma",
    "bnxt_re",
    "efa",
    "qedr",
    "hns_roce_hw_v2",
)
IB_MTUS = (256, 512, 1024, 2048, 4096)
#: bytes of RoCE headers a port's active MTU leaves room for inside the netdev MTU:
#: rxe subtracts RXE_MAX_HDR_LENGTH (80), hardware drivers iboe_get_mtu()'s
#: GRH 40 + UDP 8 + BTH 12 + XRC 4 + AtomicETH 28 + ICRC 4 = 96
ROCE_HEADERS = {"rxe": 80, "default": 96}
ROCE_V2_UDP_PORT = 4791
CAP_IPC_LOCK = 14
DEFAULT_PEER_TIMEOUT = 5.0
LOOPBACK_TIMEOUT = 5.0


# ------------------------------------------------------------------ results ----


@dataclass
class Check:
    """One finding: ``seen`` is what was observed, ``fix`` one line saying what
    to do (empty when nothing is to be done); ``data`` holds the same facts for
    machines (``--json``)."""

    name: str
    status: str
    seen: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, not {self.status!r}")


@dataclass
class Plan:
    """What aiordma would use: ``provider`` (soft/pyverbs), ``device`` and why."""

    provider: str
    device: str | None
    why: str
    requested: str = "auto"


@dataclass
class Report:
    plan: Plan
    checks: list[Check]

    @property
    def overall(self) -> str:
        st = {c.status for c in self.checks}
        return FAIL if FAIL in st else WARN if WARN in st else OK

    @property
    def exit_status(self) -> int:
        return 1 if self.overall == FAIL else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "overall": self.overall,
            "exit_status": self.exit_status,
            "plan": asdict(self.plan),
            "checks": [asdict(c) for c in self.checks],
        }

    def get(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}: {[c.name for c in self.checks]}")


@dataclass
class Options:
    provider: str | None = None
    device: str | None = None
    peer: str | None = None
    token: str | None = None
    timeout: float = DEFAULT_PEER_TIMEOUT


# -------------------------------------------------------------------- probe ----


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
        from ..providers.pyverbs_loader import pyverbs_info

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
            from ..providers.base import mtu_bytes
            from ..providers.pyverbs import PyverbsDevice

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

    def open_pyverbs(self, name: str) -> Any:
        from ..providers import pyverbs

        return pyverbs.open_device(name)

    def open_soft(self, address: str | None) -> Any:
        from ..providers.soft.device import SoftDevice

        return SoftDevice(address, name="soft0")

    def route_source(self, host: str) -> str | None:
        """The local IPv4 address packets to ``host`` leave from."""
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host, 9))
                return s.getsockname()[0]
        except OSError:
            return None

    async def connect(self, host: str, port: int, **kw: Any) -> Any:
        from ..connection import connect

        return await connect(host, port, **kw)


# ---------------------------------------------------------------- sysfs facts ----


@dataclass
class Gid:
    index: int
    gid: str  # compressed IPv6 text
    gid_type: str  # "RoCE v2", "RoCE v1", "IB", "?"
    netdev: str | None = None

    @property
    def ipv4(self) -> str | None:
        try:
            m = ipaddress.IPv6Address(self.gid).ipv4_mapped
        except ValueError:
            return None
        return str(m) if m is not None else None


@dataclass
class Port:
    num: int
    state: str  # "PORT_ACTIVE"
    state_code: int
    phys_state: str
    link_layer: str
    gids: list[Gid]
    netdev: str | None
    netdev_mtu: int | None

    @property
    def active(self) -> bool:
        return self.state_code == 4


@dataclass
class Device:
    name: str
    driver: str
    kind: str  # "rxe", "siw" or "hardware"
    node_type: str
    parent: str | None
    uverbs: str | None
    ports: list[Port]


_PORT_STATES = {
    0: "PORT_NOP",
    1: "PORT_DOWN",
    2: "PORT_INIT",
    3: "PORT_ARMED",
    4: "PORT_ACTIVE",
    5: "PORT_ACTIVE_DEFER",
}


def _state(text: str | None) -> tuple[int, str]:
    """``"4: ACTIVE"`` → (4, "PORT_ACTIVE")."""
    if not text:
        return -1, "unknown"
    m = re.match(r"\s*(\d+)", text)
    code = int(m.group(1)) if m else -1
    return code, _PORT_STATES.get(code, text)


def _gid_text(raw: str | None) -> str | None:
    if not raw:
        return None
    try:
        a = ipaddress.IPv6Address(raw.strip())
    except ValueError:
        return None
    if int(a) == 0:
        return None
    return f"::ffff:{a.ipv4_mapped}" if a.ipv4_mapped is not None else str(a)


def read_devices(probe: Probe) -> list[Device]:
    """The RDMA devices in ``/sys/class/infiniband`` with ports, GIDs and netdevs."""
    base = "/sys/class/infiniband"
    uverbs: dict[str, str] = {}
    for u in probe.listdir("/sys/class/infiniband_verbs"):
        ibdev = probe.read(f"/sys/class/infiniband_verbs/{u}/ibdev")
        if ibdev:
            uverbs[ibdev] = u
    out = []
    for name in probe.listdir(base):
        d = f"{base}/{name}"
        node_type = probe.read(f"{d}/node_type") or "?"
        parent = probe.read(f"{d}/parent") or None
        link = probe.readlink(f"{d}/device/driver")
        if parent is not None or link is None:
            kind = "siw" if "RNIC" in node_type or name.startswith("siw") else "rxe"
            if parent is None and not name.startswith(("rxe", "siw")):
                kind = "hardware"
            driver = {"rxe": "rdma_rxe (Soft-RoCE)", "siw": "siw (soft iWARP)"}.get(kind, "?")
        else:
            kind, driver = "hardware", os.path.basename(link)
        ports = []
        for p in sorted(probe.listdir(f"{d}/ports"), key=lambda s: int(s) if s.isdigit() else 0):
            if not p.isdigit():
                continue
            pd = f"{d}/ports/{p}"
            code, st = _state(probe.read(f"{pd}/state"))
            phys = probe.read(f"{pd}/phys_state") or "?"
            ll = probe.read(f"{pd}/link_layer") or "?"
            gids = []
            for i in sorted(int(x) for x in probe.listdir(f"{pd}/gids") if x.isdigit()):
                g = _gid_text(probe.read(f"{pd}/gids/{i}"))
                if g is None:
                    continue
                t = probe.read(f"{pd}/gid_attrs/types/{i}") or ""
                gt = "RoCE v2" if "v2" in t else ("IB" if ll == "InfiniBand" else "RoCE v1") if t else "?"
                gids.append(Gid(i, g, gt, probe.read(f"{pd}/gid_attrs/ndevs/{i}") or None))
            netdev = next((g.netdev for g in gids if g.netdev), None) or parent
            if netdev is None:
                nets = probe.listdir(f"{d}/device/net")
                netdev = nets[0] if nets else None
            mtu_text = probe.read(f"/sys/class/net/{netdev}/mtu") if netdev else None
            ports.append(
                Port(
                    int(p),
                    st,
                    code,
                    phys,
                    ll,
                    gids,
                    netdev,
                    int(mtu_text) if mtu_text and mtu_text.isdigit() else None,
                )
            )
        out.append(Device(name, driver, kind, node_type, parent, uverbs.get(name), ports))
    return out


def choose_gid(gids: list[Gid], forced: int | None = None) -> tuple[int | None, str]:
    """The GID index aiordma uses and why (same rule as
    :meth:`aiordma.providers.base.DeviceContext.default_gid_index`)."""
    if forced is not None:
        return forced, f"AIORDMA_GID_INDEX={forced}"
    for pred, why in (
        (lambda g: g.gid_type == "RoCE v2" and g.ipv4 is not None, "the first RoCE v2 GID with an IPv4 address"),
        (lambda g: g.gid_type == "RoCE v2", "the first RoCE v2 GID (none carries an IPv4 address)"),
        (lambda g: True, "the first GID (no RoCE v2 GID)"),
    ):
        for g in gids:
            if pred(g):
                return g.index, why
    return None, "the GID table is empty"


def roce_mtu(netdev_mtu: int, kind: str = "default") -> int | None:
    """The largest IB MTU that fits ``netdev_mtu`` minus the RoCE headers."""
    room = netdev_mtu - ROCE_HEADERS.get(kind, ROCE_HEADERS["default"])
    fits = [m for m in IB_MTUS if m <= room]
    return fits[-1] if fits else None


def modules_loaded(probe: Probe) -> dict[str, str]:
    """Loaded (or built-in) RDMA modules → how that was seen."""
    found: dict[str, str] = {}
    text = probe.read("/proc/modules")
    if text:
        for line in text.splitlines():
            n = line.split(" ", 1)[0]
            if n in RDMA_MODULES:
                found[n] = "/proc/modules"
    for n in RDMA_MODULES:
        if n not in found and probe.exists(f"/sys/module/{n}"):
            found[n] = "/sys/module"
    builtin = probe.read(f"/lib/modules/{probe.release()}/modules.builtin") or ""
    for line in builtin.splitlines():
        n = os.path.basename(line).split(".ko")[0].replace("-", "_")
        if n in RDMA_MODULES and n not in found:
            found[n] = "built-in"
    return found


def default_route_iface(probe: Probe) -> str | None:
    text = probe.read("/proc/net/route") or ""
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) >= 2 and f[1] == "00000000":
            return f[0]
    return None


def default_registration_bytes() -> dict[str, int]:
    """What a connection with default options registers (pinned memory for a
    kernel device): its receive buffers, its send pool (sized from a default
    peer's receive buffers) and a small scratch area for atomics."""
    from ..connection import Connection

    p = inspect.signature(Connection.__init__).parameters
    nbuf = int(p["recv_buffers"].default)
    size = int(p["recv_buffer_size"].default)
    out = {"recv": nbuf * size, "send": max(2, min(nbuf, 64)) * size, "scratch": 8 * 64}
    out["total"] = sum(out.values())
    return out


def _mib(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n // 1024} KiB" if n >= 1024 else f"{n} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


# -------------------------------------------------------------- the checks ----


class Context:
    """What the checks share: options, probe, sysfs facts, the plan."""

    def __init__(self, opts: Options, probe: Probe) -> None:
        self.opts = opts
        self.probe = probe
        self.pyverbs: dict[str, Any] = {}
        self.devices: list[Device] = []
        self.plan = Plan("soft", None, "not decided yet")

    def severity(self, required: bool) -> str:
        """``fail`` for what the chosen device needs, ``warn`` otherwise."""
        return FAIL if required else WARN

    @property
    def uses_pyverbs(self) -> bool:
        return self.plan.provider == "pyverbs"

    def is_chosen(self, dev: str, port: int = 1) -> bool:
        return self.uses_pyverbs and self.plan.device == dev and port == 1


def make_plan(ctx: Context) -> Plan:
    """Which provider/device aiordma would use (mirrors
    :func:`aiordma.providers.resolve_provider`, but from the facts gathered)."""
    env = ctx.probe.env
    requested = (ctx.opts.provider or env.get("AIORDMA_PROVIDER") or "auto").lower()
    name = ctx.opts.device or env.get("AIORDMA_DEVICE") or None
    if requested not in ("auto", "soft", "pyverbs"):
        raise ValueError(f"unknown provider {requested!r}: expected auto, soft or pyverbs")
    by_name = {d.name: d for d in ctx.devices}
    if requested == "soft":
        return Plan("soft", name or "soft0", "requested (provider soft)", requested)
    if requested == "pyverbs":
        if name is None:
            active = [d.name for d in ctx.devices if d.ports and d.ports[0].active]
            name = (active or list(by_name) or [None])[0]
        return Plan("pyverbs", name, "requested (provider pyverbs)", requested)
    if name and name.startswith("soft"):
        return Plan("soft", name, f"device {name} is the soft device", requested)
    if not ctx.pyverbs.get("available"):
        return Plan("soft", "soft0", "pyverbs is not available", requested)
    if name:
        if name in by_name:
            return Plan("pyverbs", name, f"device {name} requested", requested)
        return Plan("soft", "soft0", f"no RDMA device named {name}", requested)
    for d in ctx.devices:
        if d.ports and d.ports[0].active:
            return Plan("pyverbs", d.name, f"{d.name} port 1 is PORT_ACTIVE", requested)
    if ctx.devices:
        return Plan("soft", "soft0", "no RDMA device has an active port 1", requested)
    return Plan("soft", "soft0", "the kernel has no RDMA device", requested)


def check_python(ctx: Context) -> list[Check]:
    py = ctx.probe.python()
    ai = ctx.probe.aiordma()
    ok = tuple(int(x) for x in py["version"].split(".")[:2]) >= (3, 11)
    return [
        Check(
            "python",
            OK if ok else FAIL,
            f"{py['implementation']} {py['version']} ({py['executable']}); aiordma {ai['version']} ({ai['path']})",
            "" if ok else "aiordma needs Python 3.11 or newer",
            {"python": py, "aiordma": ai},
        )
    ]


def check_pyverbs(ctx: Context) -> list[Check]:
    info = ctx.pyverbs
    if info.get("available"):
        how = {
            "import": "plain `import pyverbs`",
            "system": f"loaded by path from {info.get('system_dir')} (only the pyverbs package; sys.path untouched)",
        }.get(info.get("how"), str(info.get("how")))
        fd = info.get("comp_channel_fd")
        fd_text = {
            "native": "completion-channel fd: native (CompChannel.fd, rdma-core >= 57)",
            "discovered": "completion-channel fd: discovered via /proc/self/fd (rdma-core < 57 has no CompChannel.fd)",
        }.get(fd, f"completion-channel fd: {fd}")
        return [
            Check(
                "pyverbs",
                OK,
                f"pyverbs {info.get('version') or '(version unknown)'} at {info.get('path')}, {how}; {fd_text}",
                "",
                dict(info),
            )
        ]
    from ..providers.pyverbs_loader import INSTALL_HINT

    required = ctx.plan.requested == "pyverbs"
    why = info.get("error") or "not found"
    extra = "" if required else "; aiordma uses its soft device meanwhile"
    return [Check("pyverbs", ctx.severity(required), f"not usable: {why}{extra}", INSTALL_HINT, dict(info))]


def _rxe_fix(ctx: Context) -> str:
    iface = default_route_iface(ctx.probe) or "IFACE"
    return f"sudo modprobe rdma_rxe && sudo rdma link add rxe0 type rxe netdev {iface}"


def check_kernel(ctx: Context) -> list[Check]:
    p = ctx.probe
    mods = modules_loaded(p)
    mods_text = ", ".join(f"{m} ({how})" for m, how in mods.items()) or "none of " + ", ".join(RDMA_MODULES[:6])
    required = ctx.uses_pyverbs or ctx.plan.requested == "pyverbs"
    data = {"sysfs": p.exists("/sys/class/infiniband"), "modules": mods}
    if not data["sysfs"]:
        return [
            Check(
                "kernel RDMA",
                ctx.severity(required),
                f"no /sys/class/infiniband: the kernel has no RDMA core loaded; modules: {mods_text}"
                + ("" if required else "; aiordma uses its soft device (userspace RoCEv2 over UDP) instead"),
                f"for kernel Soft-RoCE: `{_rxe_fix(ctx)}`; for a NIC load its driver (mlx5_ib, irdma)",
                data,
            )
        ]
    uverbs = p.listdir("/sys/class/infiniband_verbs")
    data["uverbs"] = [u for u in uverbs if u.startswith("uverbs")]
    if not data["uverbs"] and ctx.devices:
        return [
            Check(
                "kernel RDMA",
                ctx.severity(required),
                f"/sys/class/infiniband exists but no uverbs device (/dev/infiniband/uverbsN): "
                f"user space cannot open the devices; modules: {mods_text}",
                "sudo modprobe ib_uverbs",
                data,
            )
        ]
    return [Check("kernel RDMA", OK, f"/sys/class/infiniband present; modules: {mods_text}", "", data)]


def check_devices(ctx: Context) -> list[Check]:
    p = ctx.probe
    if not p.exists("/sys/class/infiniband"):
        return [Check("devices", SKIP, "no RDMA devices (no /sys/class/infiniband)", "", {"devices": []})]
    required = ctx.uses_pyverbs or ctx.plan.requested == "pyverbs"
    devs = ctx.devices
    data = {"devices": [asdict(d) for d in devs]}
    if not devs:
        return [
            Check(
                "devices",
                ctx.severity(required),
                "/sys/class/infiniband is empty: RDMA core loaded but no device",
                f"load the NIC's driver (mlx5_ib, irdma), or add Soft-RoCE: `{_rxe_fix(ctx)}`",
                data,
            )
        ]
    parts = []
    for d in devs:
        via = f" on {d.parent}" if d.parent else ""
        uv = d.uverbs or "no uverbs"
        parts.append(f"{d.name}: {d.driver}{via}, {d.node_type}, {len(d.ports)} port(s), {uv}")
    want = ctx.opts.device or ctx.probe.env.get("AIORDMA_DEVICE")
    if want and not want.startswith("soft") and want not in {d.name for d in devs}:
        return [
            Check(
                "devices",
                FAIL,
                f"no device named {want}"
                + ("" if required else " (aiordma would fall back to the soft device)")
                + "; found: "
                + "; ".join(parts),
                f"use one of: {', '.join(d.name for d in devs)} (--device / AIORDMA_DEVICE)",
                data,
            )
        ]
    return [Check("devices", OK, "; ".join(parts), "", data)]


def check_ports(ctx: Context) -> list[Check]:
    out: list[Check] = []
    for d in ctx.devices:
        if not d.ports:
            out.append(Check(f"port {d.name}", ctx.severity(ctx.is_chosen(d.name)), "no ports in sysfs", ""))
            continue
        for port in d.ports:
            out += _port_checks(ctx, d, port)
    return out


def _port_checks(ctx: Context, d: Device, port: Port) -> list[Check]:
    tag = f"{d.name}/{port.num}"
    chosen = ctx.is_chosen(d.name, port.num)
    sev = ctx.severity(chosen)
    role = " (aiordma uses this port)" if chosen else ""
    out: list[Check] = []
    # --- state
    seen = f"{port.state} ({port.state_code}), phys {port.phys_state}, link layer {port.link_layer}{role}"
    if port.active:
        out.append(Check(f"port {tag}", OK, seen, "", {"state": port.state, "link_layer": port.link_layer}))
    else:
        if port.link_layer == "InfiniBand" and port.state_code in (2, 3):
            fix = "no subnet manager has configured the port: start opensm on the fabric"
        elif port.netdev:
            fix = (
                f"bring up {port.netdev}: `sudo ip link set {port.netdev} up` and check its carrier "
                f"(cable/switch port); for rxe the netdev must be up with carrier"
            )
        else:
            fix = "check the cable/switch port and the driver (ibv_devinfo -v)"
        out.append(Check(f"port {tag}", sev, seen, fix, {"state": port.state, "link_layer": port.link_layer}))
    # --- MTU
    out.append(_mtu_check(ctx, d, port, sev))
    # --- GIDs
    out.append(_gid_check(ctx, d, port, sev, chosen))
    return out


def _mtu_check(ctx: Context, d: Device, port: Port, sev: str) -> Check:
    tag = f"{d.name}/{port.num}"
    verbs = ctx.probe.verbs_port(d.name, port.num) or {}
    active = verbs.get("active_mtu")
    data = {"active_mtu": active, "netdev": port.netdev, "netdev_mtu": port.netdev_mtu}
    act_text = f"active MTU {active}" if active else "active MTU unknown (pyverbs cannot query the port)"
    if port.link_layer == "InfiniBand":
        return Check(f"mtu {tag}", OK, f"{act_text} (InfiniBand: no netdev MTU involved)", "", data)
    if port.netdev is None or port.netdev_mtu is None:
        return Check(
            f"mtu {tag}",
            WARN,
            f"{act_text}; no netdev MTU found for this port",
            "check the port's netdev (`rdma link show`)",
            data,
        )
    kind = "rxe" if d.kind == "rxe" else "default"
    hdr = ROCE_HEADERS[kind]
    fits = roce_mtu(port.netdev_mtu, kind)
    data["expected"] = fits
    base = f"netdev {port.netdev} MTU {port.netdev_mtu} − {hdr} header bytes → RoCE MTU {fits}"
    if fits is None:
        return Check(
            f"mtu {tag}",
            sev,
            f"{act_text}; {port.netdev} MTU {port.netdev_mtu} leaves no room for even 256-byte RoCE packets",
            f"raise the MTU: `sudo ip link set {port.netdev} mtu 1500` (9000 for 4096-byte RoCE packets)",
            data,
        )
    if active is None:
        return Check(f"mtu {tag}", OK if fits >= 1024 else WARN, f"{act_text}; {base}", "", data)
    if active > fits:
        return Check(
            f"mtu {tag}",
            sev,
            f"{act_text} but {base}: full-size packets exceed the netdev MTU and are dropped (large transfers hang)",
            f"raise {port.netdev}'s MTU to at least {active + hdr} (`sudo ip link set {port.netdev} mtu 9000`; the "
            "switch too), or lower the device's MTU; both ends use the smaller of their path MTUs",
            data,
        )
    if active < fits:
        recreate = (
            f"rxe takes the MTU when the link is added: `sudo rdma link delete {d.name} && "
            f"sudo rdma link add {d.name} type rxe netdev {port.netdev}`"
            if d.kind == "rxe"
            else "check the port's max MTU (`ibv_devinfo -v`) and the driver's RoCE MTU setting"
        )
        return Check(
            f"mtu {tag}",
            WARN,
            f"{act_text}, smaller than the {fits} that {port.netdev} MTU {port.netdev_mtu} allows: "
            "large transfers use more, smaller packets",
            recreate,
            data,
        )
    return Check(f"mtu {tag}", OK, f"{act_text} = {base}", "", data)


def _gid_check(ctx: Context, d: Device, port: Port, sev: str, chosen: bool) -> Check:
    tag = f"{d.name}/{port.num}"
    forced = ctx.probe.env.get("AIORDMA_GID_INDEX")
    forced_i = int(forced) if forced and forced.strip().isdigit() else None
    idx, why = choose_gid(port.gids, forced_i if chosen else None)
    rows = [f"[{g.index}] {g.gid} {g.gid_type}{' ' + g.netdev if g.netdev else ''}" for g in port.gids]
    data = {"gids": [asdict(g) for g in port.gids], "gid_index": idx, "why": why}
    table = "; ".join(rows) or "empty"
    if not port.gids:
        fix = (
            f"give {port.netdev} an IP address (`sudo ip addr add A.B.C.D/N dev {port.netdev}`): RoCE GIDs follow its addresses"
            if port.netdev
            else "the port has no GIDs: check `ibv_devinfo -v` and the netdev"
        )
        return Check(f"gid {tag}", sev, "GID table empty: modify_qp to RTR would fail", fix, data)
    by_idx = {g.index: g for g in port.gids}
    if idx not in by_idx:
        return Check(
            f"gid {tag}",
            sev,
            f"{why} names an empty slot (an all-zero GID passes ibv_query_gid but modify_qp RTR fails); table: {table}",
            "unset AIORDMA_GID_INDEX or set it to the index of the RoCE v2 IPv4 entry",
            data,
        )
    g = by_idx[idx]
    seen = f"{table}; aiordma uses index {idx}: {why}"
    if port.link_layer == "InfiniBand":
        return Check(f"gid {tag}", OK, seen, "", data)
    if g.gid_type == "RoCE v2" and g.ipv4:
        return Check(f"gid {tag}", OK, seen, "", data)
    addr_fix = (
        f"give {port.netdev} an IPv4 address (`sudo ip addr add A.B.C.D/N dev {port.netdev}`): "
        "the kernel then adds a RoCE v2 GID ::ffff:A.B.C.D"
        if port.netdev
        else "give the port's netdev an IPv4 address"
    )
    if g.gid_type == "RoCE v2":
        return Check(
            f"gid {tag}",
            WARN,
            seen
            + "; no RoCE v2 GID carries an IPv4 address: IPv4-only peers and aiordma's soft device cannot reach it",
            addr_fix,
            data,
        )
    return Check(
        f"gid {tag}",
        sev,
        seen + "; no RoCE v2 GID: RoCE v1 cannot be routed and both ends must use the same GID type",
        addr_fix + "; on mlx5 make RoCE v2 the default: `sudo cma_roce_mode -d DEV -p 1 -m 2`",
        data,
    )


def check_memlock(ctx: Context) -> list[Check]:
    p = ctx.probe
    soft, hard = p.memlock()
    need = default_registration_bytes()
    inf = resource.RLIM_INFINITY

    def fmt(v: int) -> str:
        return "unlimited" if v == inf or v < 0 else f"{v // 1024} KiB" + (f" = {_mib(v)}" if v >= 1 << 20 else "")

    data = {"soft": None if soft == inf else soft, "hard": None if hard == inf else hard, "need": need}
    need_text = (
        f"a default connection registers {_mib(need['total'])} "
        f"({_mib(need['recv'])} receive buffers + {_mib(need['send'])} send pool + {need['scratch']} B scratch)"
    )
    seen = f"ulimit -l {fmt(soft)} (hard {fmt(hard)}); {need_text}"
    data["cap_ipc_lock"] = cap = p.cap_ipc_lock()
    if soft == inf or soft < 0:
        return [Check("memlock", OK, seen, "", data)]
    if soft >= need["total"]:
        n = soft // need["total"]
        extra = " (not enforced anyway: this process has CAP_IPC_LOCK)" if cap else ""
        return [Check("memlock", OK, f"{seen}: room for about {n} such connection(s){extra}", "", data)]
    hard_ok = hard == inf or hard < 0 or hard >= need["total"]
    fix = (
        "`ulimit -l unlimited` in the shell that starts the program; permanently `* - memlock unlimited` "
        "in /etc/security/limits.conf (LimitMEMLOCK=infinity for systemd services)"
    )
    if not hard_ok:
        fix = (
            "raise the hard limit: `* - memlock unlimited` in /etc/security/limits.conf, log in again "
            "(LimitMEMLOCK=infinity for systemd services), then `ulimit -l unlimited`"
        )
    if cap and ctx.uses_pyverbs:
        return [
            Check(
                "memlock",
                WARN,
                seen + ": too small, but not enforced for this process (CAP_IPC_LOCK); "
                "the same program run without it fails in ibv_reg_mr",
                fix,
                data,
            )
        ]
    if not ctx.uses_pyverbs:
        return [
            Check(
                "memlock",
                WARN,
                seen + ": too small for a kernel RDMA device (ibv_reg_mr would fail with ENOMEM); "
                "the soft device does not pin memory, so it is not affected",
                fix,
                data,
            )
        ]
    tried = p.try_register(ctx.plan.device, need["total"]) if ctx.plan.device else None
    data["registered"] = tried
    if tried is None:
        proof = f"ibv_reg_mr on {ctx.plan.device} fails (ENOMEM) once registrations exceed it"
    elif tried[0]:
        return [
            Check(
                "memlock",
                WARN,
                seen + f": smaller than that, yet registering {_mib(need['total'])} on {ctx.plan.device} worked "
                "(the kernel may account pinned memory differently); larger registrations may fail",
                fix,
                data,
            )
        ]
    else:
        proof = f"registering {_mib(need['total'])} on {ctx.plan.device} failed: {tried[1]}"
    return [Check("memlock", FAIL, seen + f": too small: {proof}", fix, data)]


def check_rxe_available(ctx: Context) -> list[Check]:
    p = ctx.probe
    if ctx.devices:
        return [Check("Soft-RoCE (rxe)", SKIP, "not needed: RDMA devices exist", "")]
    rel = p.release()
    how = None
    if "rdma_rxe" in modules_loaded(p):
        how = "loaded"
    else:
        found = p.glob_first(
            f"/lib/modules/{rel}", ("rdma_rxe.ko", "rdma_rxe.ko.xz", "rdma_rxe.ko.zst", "rdma_rxe.ko.gz")
        )
        if found:
            how = found
        else:
            r = p.run(["modinfo", "-n", "rdma_rxe"])
            if r is not None and r[0] == 0 and r[1].strip():
                how = r[1].strip().splitlines()[0]
    rdma_tool = p.which("rdma")
    iface = default_route_iface(p)
    data = {"module": how, "rdma_tool": rdma_tool, "iface": iface, "release": rel}
    tool_text = f"`rdma` tool {rdma_tool}" if rdma_tool else "`rdma` tool not installed (iproute2)"
    iface_text = f"default-route interface {iface}" if iface else "no default route"
    if how:
        fix = _rxe_fix(ctx)
        if not rdma_tool:
            fix = "sudo apt install iproute2 (or dnf install iproute), then " + fix
        return [
            Check(
                "Soft-RoCE (rxe)",
                OK,
                f"rdma_rxe module available ({how}); {tool_text}; {iface_text}",
                fix,
                data,
            )
        ]
    return [
        Check(
            "Soft-RoCE (rxe)",
            WARN,
            f"kernel {rel} has no rdma_rxe module (not loaded, none under /lib/modules/{rel}, modinfo finds none); "
            f"{tool_text}; {iface_text}",
            "aiordma's soft device needs no kernel support; for kernel Soft-RoCE use a kernel built with "
            "CONFIG_RDMA_RXE=m (e.g. a distribution kernel)",
            data,
        )
    ]


def loopback_write(
    dev: Any, payload: bytes = b"aiordma doctor loopback", timeout: float = LOOPBACK_TIMEOUT
) -> dict[str, Any]:
    """A real RDMA Write between two RC queue pairs on ``dev`` (to itself):
    returns ``{"ok", "seconds", "error"}``."""
    from ..providers.base import ACCESS_ALL, Access, QPAttr, QPCap, SendWR, WROpcode

    pd = cq_a = cq_b = None
    try:
        pd = dev.alloc_pd()
        cq_a = dev.create_cq(8)
        cq_b = dev.create_cq(8)
        cap = QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=1, max_recv_sge=1)
        qa = pd.create_qp(cq_a, cq_a, cap)
        qb = pd.create_qp(cq_b, cq_b, cap)
        src = pd.reg_mr(bytearray(payload), Access.LOCAL_WRITE)
        dst = pd.reg_mr(bytearray(len(payload)), Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        gid = dev.query_gid(1).gid
        dport = dev.udp_port if getattr(dev, "provider", "") == "soft" else None
        for qp, peer in ((qa, qb), (qb, qa)):
            qp.to_init(QPAttr(port_num=1, qp_access_flags=ACCESS_ALL))
            qp.to_rtr(QPAttr(dest_qp_num=peer.qp_num, dgid=gid, dport=dport, rq_psn=0, max_dest_rd_atomic=1))
            qp.to_rts(QPAttr(sq_psn=0, timeout=14, retry_cnt=7, rnr_retry=7, max_rd_atomic=1))
        t0 = time.perf_counter()
        qa.post_send(SendWR(1, WROpcode.IBV_WR_RDMA_WRITE, [src.sge()], remote_addr=dst.addr, rkey=dst.rkey))
        deadline = time.monotonic() + timeout
        wcs: list[Any] = []
        while not wcs:
            wcs = cq_a.poll(1)
            if not wcs:
                if time.monotonic() > deadline:
                    return {"ok": False, "seconds": None, "error": f"no completion within {timeout} s"}
                time.sleep(0.0001)
        dt = time.perf_counter() - t0
        wc = wcs[0]
        if not wc.ok:
            return {"ok": False, "seconds": dt, "error": f"completion {wc!r}"}
        if bytes(dst.view) != payload:
            return {"ok": False, "seconds": dt, "error": "completion OK but the target memory does not hold the data"}
        return {"ok": True, "seconds": dt, "error": None}
    except Exception as e:
        return {"ok": False, "seconds": None, "error": f"{type(e).__name__}: {e}"}
    finally:
        for obj in (pd, cq_a, cq_b):
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    pass


def _who_holds_udp(probe: Probe, port: int) -> str:
    r = probe.run(["ss", "-H", "-ulpn", f"sport = :{port}"])
    if r is None or r[0] != 0 or not r[1].strip():
        return ""
    lines = [" ".join(line.split()) for line in r[1].strip().splitlines()[:3]]
    return "; held by: " + " | ".join(lines)


def check_soft(ctx: Context) -> list[Check]:
    p = ctx.probe
    required = ctx.plan.provider == "soft"
    sev = ctx.severity(required)
    configured = p.env.get("AIORDMA_SOFT_ADDR") or None
    where = f"AIORDMA_SOFT_ADDR={configured}" if configured else "the first free 127.0.0.N:4791"
    try:
        dev = p.open_soft(configured)
    except Exception as e:
        port = ROCE_V2_UDP_PORT
        if configured and ":" in configured:
            tail = configured.rsplit(":", 1)[1]
            port = int(tail) if tail.isdigit() else port
        held = _who_holds_udp(p, port)
        kernel_rxe = any(d.kind == "rxe" for d in ctx.devices)
        fix = (
            "pick a free address or port: AIORDMA_SOFT_ADDR=127.0.0.N[:PORT] (or unset it to take the first free "
            "loopback address)"
        )
        if kernel_rxe:
            fix = (
                "kernel rxe owns UDP 4791 on every address: use the kernel device (provider pyverbs), or give the soft "
                "device another port: AIORDMA_SOFT_ADDR=IP:PORT"
            )
        return [
            Check(
                "soft device",
                sev,
                f"cannot bind ({where}): {e}{held}",
                fix,
                {"configured": configured, "error": str(e)},
            )
        ]
    try:
        ip, port = dev.address
        engine = f"{getattr(dev, 'engine', '?')} engine ({getattr(dev, 'engine_reason', '')})"
        res = loopback_write(dev)
    finally:
        dev.close()
    reach = (
        "reachable from this host only (loopback); set AIORDMA_SOFT_ADDR to an interface address to talk to other hosts"
        if ip.startswith("127.")
        else "reachable at this interface address"
    )
    data = {"address": f"{ip}:{port}", "configured": configured, "loopback": res, "engine": engine}
    if res["ok"]:
        return [
            Check(
                "soft device",
                OK,
                f"bound UDP {ip}:{port} ({where}); {engine}; loopback RDMA Write between two QPs: "
                f"{_ms(res['seconds'])}; {reach}",
                "",
                data,
            )
        ]
    return [
        Check(
            "soft device",
            sev,
            f"bound UDP {ip}:{port} ({where}) but the loopback RDMA Write failed: {res['error']}",
            "report this as an aiordma bug, with AIORDMA_SOFT_PCAP=/tmp/doctor.pcap set to capture the packets",
            data,
        )
    ]


def check_loopback_pyverbs(ctx: Context) -> list[Check]:
    if not ctx.uses_pyverbs or not ctx.plan.device:
        return []
    name = ctx.plan.device
    try:
        dev = ctx.probe.open_pyverbs(name)
    except Exception as e:
        return [Check(f"loopback {name}", FAIL, f"cannot open {name}: {e}", "see the port and GID checks above")]
    try:
        res = loopback_write(dev)
    finally:
        dev.close()
    if res["ok"]:
        return [
            Check(
                f"loopback {name}",
                OK,
                f"RDMA Write between two QPs on {name}: {_ms(res['seconds'])}",
                "",
                {"loopback": res},
            )
        ]
    return [
        Check(
            f"loopback {name}",
            FAIL,
            f"RDMA Write between two QPs on {name} failed: {res['error']}",
            "check the port state, the GID index and `ulimit -l` above; `ibv_rc_pingpong -d DEV -g GIDX` tests "
            "the device without aiordma",
            {"loopback": res},
        )
    ]


def _parse_peer(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--peer wants HOST:PORT, got {text!r}")
    host = host.strip("[]")
    return host, int(port)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _resolve(host: str) -> str | None:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError):
        return None


async def check_peer(ctx: Context) -> list[Check]:
    from ..errors import AuthenticationError, HandshakeTimeoutError, RDMAError, RendezvousError
    from ..providers.base import gid_to_ipv4

    if not ctx.opts.peer:
        return [
            Check(
                "NAT",
                SKIP,
                "no --peer given. RoCEv2 cannot cross NAT: the ICRC covers IP header fields NAT rewrites, and the "
                "GID names the real address; keep RDMA peers on one routed network",
                "",
            )
        ]
    p = ctx.probe
    host, port = _parse_peer(ctx.opts.peer)
    timeout = ctx.opts.timeout
    note = ""
    dev = None
    try:
        if ctx.plan.provider == "soft":
            addr = p.env.get("AIORDMA_SOFT_ADDR") or None
            if addr is None and not _is_loopback(host):
                src = p.route_source(_resolve(host) or host)
                if src:
                    addr = src
                    note = (
                        f"; local soft device bound at {src}:4791, the address that routes to the peer "
                        f"(set AIORDMA_SOFT_ADDR={src} for your programs)"
                    )
            dev = p.open_soft(addr)
        else:
            dev = p.open_pyverbs(ctx.plan.device)
    except Exception as e:
        return [Check("peer rendezvous", FAIL, f"cannot open the local device for the peer test: {e}", "see above")]
    checks: list[Check] = []
    conn = None
    try:
        t0 = time.perf_counter()
        try:
            conn = await p.connect(
                host,
                port,
                device=dev,
                token=ctx.opts.token,
                timeout=timeout,
                recv_buffers=4,
                recv_buffer_size=4096,
            )
        except AuthenticationError as e:
            return [
                Check(
                    "peer rendezvous", FAIL, f"{host}:{port}: {e}", "use the server's token: --token T or AIORDMA_TOKEN"
                )
            ]
        except HandshakeTimeoutError as e:
            return [
                Check(
                    "peer rendezvous",
                    FAIL,
                    f"{host}:{port}: {e}",
                    "is it an aiordma server? a firewall dropping TCP, or a server too busy to answer",
                )
            ]
        except RendezvousError as e:
            cause = e.__cause__
            code = getattr(cause, "errno", None)
            if isinstance(cause, ConnectionRefusedError) or code == errno.ECONNREFUSED:
                seen = f"{host}:{port}: connection refused: nothing listens there (is the aiordma server running?)"
            elif code in (errno.EHOSTUNREACH, errno.ENETUNREACH):
                seen = f"{host}:{port}: {os.strerror(code).lower()}: no route to the peer"
            else:
                seen = f"{host}:{port}: {e}"
            return [
                Check(
                    "peer rendezvous",
                    FAIL,
                    seen,
                    f"start the server, or check HOST:PORT (`ss -tlnp 'sport = :{port}'` on the peer) and that a "
                    f"firewall lets TCP {port} through",
                )
            ]
        except (RDMAError, OSError, ValueError) as e:
            return [Check("peer rendezvous", FAIL, f"{host}:{port}: {type(e).__name__}: {e}", "see the checks above")]
        t_rdv = time.perf_counter() - t0
        peer = conn.peer
        peer_ip = gid_to_ipv4(peer.gid)
        local_ip, local_port = dev.address if hasattr(dev, "address") else (gid_to_ipv4(conn.gid), 4791)
        checks.append(
            Check(
                "peer rendezvous",
                OK,
                f"{host}:{port} in {_ms(t_rdv)}: peer QP 0x{peer.qpn:06x} on {peer.provider} at "
                f"{peer_ip or peer.gid.hex()}:{peer.port}, MTU {peer.mtu}; exposed: "
                f"{', '.join(conn.remote_buffers) or 'no buffers'}; local {getattr(dev, 'name', '?')} at "
                f"{local_ip}:{local_port}{note}",
                "",
                {"seconds": t_rdv, "peer_ip": peer_ip, "peer_port": peer.port, "local": f"{local_ip}:{local_port}"},
            )
        )
        checks.append(await _peer_io(conn, timeout))
        checks.append(_nat_check(host, peer_ip, local_ip))
    finally:
        if conn is not None:
            try:
                await conn.close(timeout=1.0)
            except Exception:
                conn.abort()
        if dev is not None:
            dev.close()
    return checks


async def _peer_io(conn: Any, timeout: float) -> Check:
    from ..errors import RDMAError

    rb = next(iter(conn.remote_buffers.values()), None)
    if rb is not None and rb.length > 0:
        name = rb.name or "?"
        one = rb.at(0, 1)
        step = "RDMA Read"
        try:
            t0 = time.perf_counter()
            data = await asyncio.wait_for(conn.read(one), timeout)
            t_read = time.perf_counter() - t0
            step = "RDMA Write"
            t0 = time.perf_counter()
            await asyncio.wait_for(conn.write(data, one), timeout)
            t_write = time.perf_counter() - t0
        except TimeoutError:
            return Check(
                "peer RDMA",
                FAIL,
                f"1-byte {step} on buffer {name!r} got no completion within {timeout} s",
                "RoCEv2 packets do not get through: UDP 4791 blocked by a firewall, a GID that does not route, or NAT",
            )
        except RDMAError as e:
            return Check(
                "peer RDMA",
                FAIL,
                f"1-byte {step} on buffer {name!r} failed: {e}",
                "IBV_WC_RETRY_EXC_ERR: UDP 4791 blocked or the GID does not route; IBV_WC_REM_ACCESS_ERR: the peer's "
                "region lacks REMOTE_READ/REMOTE_WRITE",
            )
        return Check(
            "peer RDMA",
            OK,
            f"1-byte RDMA Read of buffer {name!r}: {_ms(t_read)}; RDMA Write of the same byte back: {_ms(t_write)}",
            "",
            {"buffer": name, "read_seconds": t_read, "write_seconds": t_write},
        )
    msg = b"aiordma doctor ping"
    try:
        t0 = time.perf_counter()
        await asyncio.wait_for(conn.send(msg), timeout)
        reply = await asyncio.wait_for(conn.recv(), timeout)
        dt = time.perf_counter() - t0
    except TimeoutError:
        return Check(
            "peer RDMA",
            WARN,
            f"the peer exposes no buffer and did not echo a message within {timeout} s: the rendezvous and the QP "
            "set-up worked, but no RDMA traffic could be checked",
            "expose a buffer on the server (start_server(..., expose={'name': region})) or run an echo handler",
        )
    except RDMAError as e:
        return Check(
            "peer RDMA",
            FAIL,
            f"send/recv round trip failed: {e}",
            "IBV_WC_RETRY_EXC_ERR: RoCEv2 packets do not get through (UDP 4791 firewall, GID not routable, NAT)",
        )
    if reply != msg:
        return Check("peer RDMA", WARN, f"the peer answered {reply[:40]!r} instead of echoing", "")
    return Check(
        "peer RDMA",
        OK,
        f"the peer exposes no buffer; send/recv echo round trip: {_ms(dt)}",
        "",
        {"echo_seconds": dt},
    )


def _nat_check(host: str, peer_ip: str | None, local_ip: str | None) -> Check:
    reached = _resolve(host) or host
    data = {"reached": reached, "peer_gid_ip": peer_ip, "local_ip": local_ip}
    if peer_ip is None:
        return Check("NAT", SKIP, "the peer's GID carries no IPv4 address (IPv6 GID): not checked", "", data)
    if _is_loopback(reached) and _is_loopback(peer_ip):
        return Check("NAT", OK, f"peer on this host ({reached}, RDMA at {peer_ip}): no NAT", "", data)
    if reached != peer_ip:
        return Check(
            "NAT",
            WARN,
            f"reached the rendezvous at {reached} but the peer's RDMA address (its GID) is {peer_ip}: a NAT or port "
            "forward in between? RoCEv2 cannot cross NAT (the ICRC covers the IP header fields NAT rewrites)",
            "put both ends on one routed network (VPN/overlay without NAT) and connect to the address the peer's "
            "RDMA device uses",
            data,
        )

    def private(ip: str | None) -> bool | None:
        try:
            return ipaddress.ip_address(ip).is_private if ip else None
        except ValueError:
            return None

    if local_ip and private(local_ip) != private(peer_ip):
        return Check(
            "NAT",
            WARN,
            f"local RDMA address {local_ip} and peer {peer_ip} are on different sides of private/public addressing: "
            "traffic between them usually crosses NAT, which breaks the RoCEv2 ICRC",
            "use addresses on one routed network without NAT",
            data,
        )
    return Check("NAT", OK, f"peer RDMA address {peer_ip} is the address the rendezvous reached: no NAT seen", "", data)


def check_firewall(ctx: Context) -> list[Check]:
    """Best effort, warn-only: do nft/iptables/firewalld rules drop UDP 4791?"""
    p = ctx.probe
    port = str(ROCE_V2_UDP_PORT)
    tools = [t for t in ("nft", "iptables-save", "firewall-cmd") if p.which(t)]
    if not tools:
        return [
            Check(
                "firewall",
                SKIP,
                "no nft, iptables or firewall-cmd installed: no firewall rules to read",
                "",
                {"tools": []},
            )
        ]
    mentions: list[str] = []
    policy_drop: list[str] = []
    unreadable: list[str] = []
    firewalld = None
    for t in tools:
        if t == "firewall-cmd":
            r = p.run(["firewall-cmd", "--state"])
            if r is not None and r[1].strip() == "running":
                q = p.run(["firewall-cmd", f"--query-port={port}/udp"])
                firewalld = q is not None and q[1].strip() == "yes"
            continue
        r = p.run(["nft", "list", "ruleset"] if t == "nft" else ["iptables-save"])
        if r is None or r[0] != 0:
            unreadable.append(f"{t}: {(r[1].strip().splitlines() or ['failed'])[0] if r else 'cannot run'}")
            continue
        for line in r[1].splitlines():
            s = line.strip()
            if re.search(rf"\b{port}\b", s):
                mentions.append(s)
            if re.match(r":INPUT (DROP|REJECT)", s) or re.search(r"hook input .*policy drop", s):
                policy_drop.append(s)
    data = {"tools": tools, "mentions": mentions, "policy_drop": policy_drop, "firewalld_open": firewalld}
    fix = (
        f"sudo firewall-cmd --add-port={port}/udp --permanent && sudo firewall-cmd --reload "
        f"(or `sudo iptables -I INPUT -p udp --dport {port} -j ACCEPT`)"
    )
    blocked = [m for m in mentions if re.search(r"\b(drop|reject)\b", m, re.I)]
    accepted = [m for m in mentions if re.search(r"\baccept\b", m, re.I)]
    if firewalld is False:
        return [Check("firewall", WARN, f"firewalld is running and UDP {port} is not open", fix, data)]
    if blocked:
        return [Check("firewall", WARN, f"rules drop UDP {port}: " + " | ".join(blocked[:3]), fix, data)]
    if policy_drop and not accepted:
        return [
            Check(
                "firewall",
                WARN,
                f"input policy drops by default and no rule accepts UDP {port}: " + " | ".join(policy_drop[:2]),
                fix,
                data,
            )
        ]
    if accepted or firewalld:
        shown = " | ".join(accepted[:2]) or f"firewalld: {port}/udp open"
        return [Check("firewall", OK, f"UDP {port} accepted: {shown}", "", data)]
    if unreadable and len(unreadable) == len([t for t in tools if t != "firewall-cmd"]):
        return [
            Check("firewall", SKIP, "could not read the rules (" + "; ".join(unreadable) + "); run as root", "", data)
        ]
    return [
        Check(
            "firewall", OK, f"no rule mentions UDP {port} and the input policy accepts ({', '.join(tools)})", "", data
        )
    ]


# ------------------------------------------------------------------ driver ----


async def diagnose(opts: Options | None = None, probe: Probe | None = None) -> Report:
    """Run every check; the blocking ones (device queries, loopback Writes)
    run in a worker thread so a caller's event loop stays responsive."""
    opts = opts or Options()
    probe = probe or Probe()
    ctx = Context(opts, probe)

    def gather() -> None:
        ctx.pyverbs = probe.pyverbs_info()
        ctx.devices = read_devices(probe)
        ctx.plan = make_plan(ctx)

    await asyncio.to_thread(gather)
    checks: list[Check] = []
    steps: list[Callable[[Context], list[Check]]] = [
        check_python,
        check_pyverbs,
        check_kernel,
        check_devices,
        check_ports,
        check_memlock,
        check_rxe_available,
        check_loopback_pyverbs,
        check_soft,
    ]
    for step in steps:
        checks += await asyncio.to_thread(_guarded, step, ctx)
    try:
        checks += await check_peer(ctx)
    except Exception as e:  # a bug in a check must not hide the others
        checks.append(Check("peer", FAIL, f"the check itself failed: {type(e).__name__}: {e}", ""))
    checks += await asyncio.to_thread(_guarded, check_firewall, ctx)
    return Report(ctx.plan, checks)


def _guarded(step: Callable[[Context], list[Check]], ctx: Context) -> list[Check]:
    try:
        return step(ctx)
    except Exception as e:
        name = step.__name__.removeprefix("check_")
        return [Check(name, WARN, f"the check itself failed: {type(e).__name__}: {e}", "report this as an aiordma bug")]


def diagnose_sync(opts: Options | None = None, probe: Probe | None = None) -> Report:
    return asyncio.run(diagnose(opts, probe))


# ------------------------------------------------------------------ output ----

_COLOURS = {OK: "\033[32m", WARN: "\033[33m", FAIL: "\033[31m", SKIP: "\033[2m"}
_RESET = "\033[0m"


def format_table(report: Report, colour: bool = False, width: int | None = None) -> str:
    width = width or shutil.get_terminal_size((110, 24)).columns
    name_w = min(max(len(c.name) for c in report.checks), 22)
    indent = 2 + 4 + 2 + name_w + 2
    body_w = max(40, width - indent)
    lines = [f"  {'':4}  {'CHECK':<{name_w}}  WHAT WAS SEEN  (→ fix)"]
    for c in report.checks:
        st = f"{c.status:<4}"
        if colour:
            st = _COLOURS[c.status] + st + _RESET
        seen = textwrap.wrap(c.seen, body_w) or [""]
        lines.append(f"  {st}  {c.name:<{name_w}}  {seen[0]}")
        lines += [" " * indent + s for s in seen[1:]]
        if (c.fix and c.status in (WARN, FAIL)) or (c.fix and c.name == "Soft-RoCE (rxe)"):
            for i, s in enumerate(textwrap.wrap("→ fix: " + c.fix, body_w)):
                lines.append(" " * indent + ("" if i == 0 else "       ") + s)
    overall = report.overall
    ov = _COLOURS[overall] + overall + _RESET if colour else overall
    plan = report.plan
    lines.append("")
    lines.append(f"aiordma will use: {plan.provider} device {plan.device or '(none)'} ({plan.why})")
    lines.append(f"overall: {ov} (exit status {report.exit_status})")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", help="RDMA device to check (rxe0, mlx5_0; soft0 for the soft device)")
    parser.add_argument(
        "--provider", choices=("auto", "soft", "pyverbs"), help="provider to check (default: $AIORDMA_PROVIDER or auto)"
    )
    parser.add_argument("--peer", metavar="HOST:PORT", help="also test a rendezvous and RDMA to this aiordma server")
    parser.add_argument("--token", help="the server's shared secret (default $AIORDMA_TOKEN)")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_PEER_TIMEOUT, help="seconds for each peer step (default %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def run(args: argparse.Namespace) -> int:
    opts = Options(provider=args.provider, device=args.device, peer=args.peer, token=args.token, timeout=args.timeout)
    try:
        if opts.peer:
            _parse_peer(opts.peer)
        report = diagnose_sync(opts)
    except ValueError as e:
        print(f"aiordma doctor: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2, default=str))
    else:
        print(format_table(report, colour=sys.stdout.isatty()))
    return report.exit_status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aiordma doctor", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
