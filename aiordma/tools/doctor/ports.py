"""Per-port checks of the kernel devices: port state, MTU (the netdev's
MTU minus the RoCE headers) and the GID table (the entry aiordma uses)."""

from __future__ import annotations

from dataclasses import asdict

from ... import settings
from .plan import Context
from .report import OK, WARN, Check
from .sysfs import ROCE_HEADERS, Device, Port, choose_gid, roce_mtu


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
    forced_i = settings.GID_INDEX.get(ctx.probe.env)
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
