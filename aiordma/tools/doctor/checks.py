"""The host checks: Python, pyverbs, the kernel's RDMA core, its devices,
``ulimit -l`` against what a connection registers, and whether kernel
Soft-RoCE could be added."""

from __future__ import annotations

import inspect
import resource
from dataclasses import asdict
from typing import Any

from ... import settings
from .plan import Context
from .report import FAIL, OK, SKIP, WARN, Check, _mib
from .sysfs import RDMA_MODULES, default_route_iface, modules_loaded


def default_registration_bytes() -> dict[str, int]:
    """What a connection with default options registers (pinned memory for a
    kernel device): its receive buffers, its send pool (sized from a default
    peer's receive buffers) and a small scratch area for atomics."""
    from ...connection import Connection

    p = inspect.signature(Connection.__init__).parameters
    nbuf = int(p["recv_buffers"].default)
    size = int(p["recv_buffer_size"].default)
    out = {"recv": nbuf * size, "send": max(2, min(nbuf, 64)) * size, "scratch": 8 * 64}
    out["total"] = sum(out.values())
    return out


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
        }.get(str(info.get("how")), str(info.get("how")))
        fd = info.get("comp_channel_fd")
        fd_text = {
            "native": "completion-channel fd: native (CompChannel.fd, rdma-core >= 57)",
            "discovered": "completion-channel fd: discovered via /proc/self/fd (rdma-core < 57 has no CompChannel.fd)",
        }.get(str(fd), f"completion-channel fd: {fd}")
        return [
            Check(
                "pyverbs",
                OK,
                f"pyverbs {info.get('version') or '(version unknown)'} at {info.get('path')}, {how}; {fd_text}",
                "",
                dict(info),
            )
        ]
    from ...providers.pyverbs_loader import INSTALL_HINT

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


def check_rdma_cm(ctx: Context) -> list[Check]:
    """Whether RDMA CM can run (``connect(..., rdma_cm=True)``, rping): the
    ``rdma_ucm`` module's ``/dev/infiniband/rdma_cm``. Only where a kernel RDMA
    device exists; a warning at most, since the TCP rendezvous does not need it."""
    p = ctx.probe
    if not ctx.devices:
        return [Check("RDMA CM", SKIP, "no kernel RDMA device: RDMA CM has nothing to connect", "")]
    data = {"rdma_cm": p.exists("/dev/infiniband/rdma_cm")}
    if data["rdma_cm"]:
        return [
            Check(
                "RDMA CM",
                OK,
                "/dev/infiniband/rdma_cm present: connect(..., rdma_cm=True), start_server(..., rdma_cm=True) "
                "and rping can connect through the connection manager",
                "",
                data,
            )
        ]
    return [
        Check(
            "RDMA CM",
            WARN,
            "no /dev/infiniband/rdma_cm: RDMA CM connections (rdma_cm=True, rping) fail; "
            "the TCP rendezvous works without it",
            "sudo modprobe rdma_ucm",
            data,
        )
    ]


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
    want = ctx.opts.device or settings.DEVICE.get(ctx.probe.env)
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


def check_memlock(ctx: Context) -> list[Check]:
    p = ctx.probe
    soft, hard = p.memlock()
    need = default_registration_bytes()
    inf = resource.RLIM_INFINITY

    def fmt(v: int) -> str:
        return "unlimited" if v == inf or v < 0 else f"{v // 1024} KiB" + (f" = {_mib(v)}" if v >= 1 << 20 else "")

    data: dict[str, Any] = {"soft": None if soft == inf else soft, "hard": None if hard == inf else hard, "need": need}
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
