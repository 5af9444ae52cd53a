"""What the kernel says about its RDMA devices: ``/sys/class/infiniband``
(devices, ports, GID tables, netdevs), ``/proc/modules`` and the routing
table, read through a :class:`~.probe.Probe`; and the RoCE rules the checks
apply to those facts (which GID aiordma picks, which MTU fits a netdev)."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass

from ...providers.base import ROCE_V2_UDP_PORT as ROCE_V2_UDP_PORT  # (the doctor's checks take it from here)
from ...providers.base import GIDEntry, gid_problem, parse_gid, preferred_gid
from .probe import Probe

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
    """The GID index aiordma uses and why: the rule of
    :meth:`aiordma.providers.base.DeviceContext.default_gid_index`
    (:data:`~aiordma.providers.base.GID_PREFERENCES`), on the table sysfs shows."""
    if forced is not None:
        return forced, f"AIORDMA_GID_INDEX={forced}"
    entries = [GIDEntry(g.index, parse_gid(g.gid), g.gid_type, g.netdev) for g in gids]
    preferred = preferred_gid([e for e in entries if gid_problem(e) is None]) or preferred_gid(entries)
    if preferred is None:
        return None, "the GID table is empty"
    entry, why = preferred
    return entry.index, why if entry.gid_type == "RoCE v2" else f"{why} ({entry.gid_type}: no RoCE v2 GID)"


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
