"""``aiordma devices``: the RDMA devices aiordma can use, like ``ibv_devices`` + ``ibv_devinfo``.

For every device pyverbs finds: its ports (state, active/max MTU, link
layer) and the GID table of each port (index, type, GID, IPv4, netdev), with
the index aiordma would use marked, the memory registered on it by every
process (the kernel's count, ``rdma resource show mr``) and what a
connection registers there (its own buffers, and the device's shared send
pool and shared receive queue). Then the soft device (a userspace
RoCEv2 device, opened for the occasion and closed again): its UDP address,
port and GID. Last, which provider ``auto`` picks, and why.

``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import Any

from .. import pools, settings
from ..connection import uses_srq
from ..providers import PROVIDERS, resolve_provider
from ..providers.base import PortState, gid_str, mtu_bytes
from ..work_requests import ATOMIC_SLOTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--no-soft", action="store_true", help="do not open the soft device")


# ------------------------------------------------------------------ probing ----


def _enum_name(v: Any) -> str:
    return getattr(v, "name", str(v))


def _mtu(v: Any) -> int | None:
    try:
        return mtu_bytes(int(v))
    except (ValueError, TypeError):
        return None


def _gid_rows(dev: Any, port_num: int, chosen: int | None) -> list[dict[str, Any]]:
    rows = []
    for e in dev.query_gid_table(port_num):
        rows.append(
            {
                "index": e.index,
                "type": e.gid_type,
                "gid": gid_str(e.gid),
                "ipv4": e.ipv4,
                "netdev": e.netdev,
                "aiordma": e.index == chosen,
            }
        )
    return rows


def _chosen_gid_index(dev: Any, port_num: int) -> tuple[int | None, str | None]:
    forced = settings.GID_INDEX.get()
    if forced is not None and port_num == 1:
        return forced, "AIORDMA_GID_INDEX"
    try:
        return dev.default_gid_index(port_num), None
    except Exception as e:
        return None, str(e)


def kernel_registered_memory(name: str) -> dict[str, Any]:
    """The memory regions the kernel holds on device ``name``, every process's
    (``rdma -j resource show mr``, iproute2; a user who is not root may see
    only their own): ``{"bytes", "regions", "by_process": [{"pid", "comm",
    "bytes", "regions"}]}``, or ``{"error": ...}``."""
    rdma = shutil.which("rdma") or ("/sbin/rdma" if os.path.exists("/sbin/rdma") else None)
    if rdma is None:
        return {"error": "iproute2's rdma tool is not installed (apt-get install iproute2)"}
    try:
        cp = subprocess.run([rdma, "-j", "resource", "show", "mr"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"rdma resource show mr: {e}"}
    if cp.returncode != 0:
        return {"error": f"rdma resource show mr: {cp.stderr.strip() or f'exit {cp.returncode}'}"}
    try:
        rows = json.loads(cp.stdout) if cp.stdout.strip() else []
    except ValueError as e:
        return {"error": f"rdma resource show mr: unreadable JSON ({e})"}
    by_pid: dict[Any, dict[str, Any]] = {}
    total = 0
    count = 0
    for r in rows:
        if not isinstance(r, dict) or r.get("ifname") != name:
            continue
        n = int(r.get("mrlen", 0) or 0)
        total += n
        count += 1
        entry = by_pid.setdefault(r.get("pid"), {"pid": r.get("pid"), "comm": r.get("comm"), "bytes": 0, "regions": 0})
        entry["bytes"] += n
        entry["regions"] += 1
    return {"bytes": total, "regions": count, "by_process": sorted(by_pid.values(), key=lambda e: -e["bytes"])}


def connection_cost(dev: Any, recv_buffers: int = 16, recv_buffer_size: int = 64 << 10) -> dict[str, Any]:
    """What a connection with the default options registers on ``dev``: its own
    registrations, and the device's shared pools (made by its first connection,
    released by its last): the first step of each, and the most they grow to."""
    try:
        srq = uses_srq(dev, None)
        attr = dev.query_device()
    except Exception as e:
        return {"error": str(e)}
    step = pools.step_slots(recv_buffer_size) * recv_buffer_size
    own = 8 * ATOMIC_SLOTS + (0 if srq else recv_buffers * recv_buffer_size)
    return {
        "srq": srq,
        "srq_setting": settings.SRQ.get(),
        "max_srq": int(getattr(attr, "max_srq", 0) or 0),
        "max_srq_wr": int(getattr(attr, "max_srq_wr", 0) or 0),
        # registered by each connection, idle or not
        "own_bytes": own,
        # the device's, shared by all of its connections: when they are idle, and at most
        "shared_idle_bytes": step * (2 if srq else 1),
        "shared_max_bytes": pools.DEFAULT_SEND_POOL_BYTES + (pools.DEFAULT_RECV_POOL_BYTES if srq else 0),
        # what this process has registered on the device now (a fresh process: nothing)
        "this_process": dev.registered_memory(),
    }


def probe_pyverbs() -> dict[str, Any]:
    """What pyverbs sees: ``{"available", "error", "info", "devices": [...]}``."""
    out: dict[str, Any] = {"available": False, "error": None, "info": None, "devices": []}
    try:
        from ..providers import pyverbs as pv
        from ..providers.pyverbs_loader import pyverbs_info

        info = pyverbs_info()
    except Exception as e:  # an ImportError of our own module would be a broken install
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    out["info"] = {k: info.get(k) for k in ("how", "path", "version", "comp_channel_fd", "python")}
    if not info.get("available"):
        out["error"] = info.get("error") or "pyverbs is not available"
        return out
    out["available"] = True
    try:
        names = pv.list_devices()
    except Exception as e:
        out["error"] = f"ibv_get_device_list failed: {e}"
        return out
    if not names:
        out["error"] = "no RDMA device: the kernel exposes none" + (
            " (/sys/class/infiniband is missing: no RDMA driver loaded)"
            if not os.path.isdir("/sys/class/infiniband")
            else ""
        )
    for name in names:
        d: dict[str, Any] = {"name": name, "provider": "pyverbs", "error": None, "ports": []}
        out["devices"].append(d)
        try:
            dev = pv.PyverbsDevice(name, _require_gid=False)
        except Exception as e:
            d["error"] = str(e)
            continue
        try:
            attr = dev.query_device()
            d.update(
                fw_ver=attr.fw_ver,
                node_guid=attr.node_guid,
                vendor_id=attr.vendor_id,
                vendor_part_id=attr.vendor_part_id,
                phys_port_cnt=attr.phys_port_cnt,
                netdev=attr.extra.get("netdev"),
            )
            for p in range(1, max(1, attr.phys_port_cnt) + 1):
                port: dict[str, Any] = {"port": p}
                d["ports"].append(port)
                try:
                    pa = dev.query_port(p)
                except Exception as e:
                    port["error"] = str(e)
                    continue
                chosen, why = _chosen_gid_index(dev, p)
                port.update(
                    state=_enum_name(pa.state),
                    active=pa.state == PortState.IBV_PORT_ACTIVE,
                    active_mtu=_mtu(pa.active_mtu),
                    max_mtu=_mtu(pa.max_mtu),
                    link_layer=pa.link_layer,
                    gid_tbl_len=pa.gid_tbl_len,
                    gid_index=chosen,
                    gid_index_note=why,
                )
                try:
                    port["gids"] = _gid_rows(dev, p, chosen if p == 1 else None)
                except Exception as e:
                    port["gids"] = []
                    port["error"] = f"GID table: {e}"
            d["registered_memory"] = kernel_registered_memory(name)
            d["connection_cost"] = connection_cost(dev)
        except Exception as e:
            d["error"] = str(e)
        finally:
            dev.close()
    return out


def probe_soft() -> dict[str, Any]:
    """Open a soft device, describe it, close it."""
    from ..providers.soft.device import SoftDevice
    from ..providers.soft.engine import crc32_throughputs, slow_paths

    try:
        dev = SoftDevice()
    except Exception as e:
        return {"name": "soft0", "provider": "soft", "error": str(e)}
    try:
        pa = dev.query_port(1)
        gi = dev.default_gid_index(1)
        ip, port = dev.address
        crc32 = str(dev.query_device().extra.get("crc32", ""))
        slow = slow_paths(dev.engine, dev.engine_reason, crc32)
        speeds = crc32_throughputs(dev.engine)
        return {
            "name": dev.name,
            "provider": "soft",
            "error": None,
            "address": f"{ip}:{port}",
            "ip": ip,
            "udp_port": port,
            "icrc": dev.icrc_policy,
            # the path MTU toward another soft device, beyond RoCE's (an aiordma extension)
            "soft_mtu": dev.soft_mtu,
            "engine": dev.engine,
            "engine_reason": dev.engine_reason,
            "crc32": crc32,
            # bytes per second over 4 KiB buffers, measured now: the ICRC's CRC-32 and the others here
            "crc32_throughput": speeds,
            # what the kernel does to a UDP GSO batch on the netdev, how that was learned,
            # and so whether the device batches (each segment's ICRC exact on the wire)
            "gso": {
                **dev.gso_rule.as_dict(),
                "on": dev.gso,
                "paused_by_capture": dev.gso_paused,
                "description": dev.gso_rule.describe(),
            },
            # packets toward soft devices of other processes of this host through
            # shared-memory links (aiordma.providers.soft.shm), and why not
            "shared_memory_links": {"on": dev.shared_memory_links, "reason": dev.shared_memory_reason},
            # slower than it could be: the Python engine, or a slow CRC-32 for the ICRC
            "slow_paths": [{"kind": s.kind, "seen": s.seen, "fix": s.fix, "chosen": s.chosen} for s in slow],
            "warnings": [s.line() for s in slow],
            "ports": [
                {
                    "port": 1,
                    "state": _enum_name(pa.state),
                    "active": pa.state == PortState.IBV_PORT_ACTIVE,
                    "active_mtu": _mtu(pa.active_mtu),
                    "max_mtu": _mtu(pa.max_mtu),
                    "link_layer": pa.link_layer,
                    "gid_tbl_len": pa.gid_tbl_len,
                    "gid_index": gi,
                    "gids": _gid_rows(dev, 1, gi),
                }
            ],
            "note": "opened for this listing: each process's soft device binds the first free 127.0.0.N:4791 "
            "(or AIORDMA_SOFT_ADDR)",
            # a soft device is per process: what it registered is this (fresh) process's count
            "registered_memory": dev.registered_memory(),
            "connection_cost": connection_cost(dev),
        }
    finally:
        dev.close()


def explain_auto(pyverbs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Which provider ``auto`` (or the environment) picks, and why."""
    env_p = settings.PROVIDER.configured()  # (a bad value raises SettingError: never a silent fallback)
    env_d = settings.DEVICE.get()
    provider, name = resolve_provider()
    if pyverbs is None:
        pyverbs = probe_pyverbs()
    requested = (env_p or "auto").lower()
    if requested != "auto":
        reason = f"AIORDMA_PROVIDER={env_p} asks for it"
    elif name and provider == "soft" and name.startswith("soft"):
        reason = f"AIORDMA_DEVICE={env_d} names the soft device"
    elif provider == "pyverbs":
        reason = f"pyverbs device {name} has an active port 1" + (f" (AIORDMA_DEVICE={env_d})" if env_d else "")
    elif not pyverbs.get("available"):
        reason = "pyverbs is not usable here: " + (pyverbs.get("error") or "unknown reason").split(";")[0]
    elif not pyverbs.get("devices"):
        reason = "pyverbs found no RDMA device"
    elif env_d:
        reason = f"AIORDMA_DEVICE={env_d} is not a pyverbs device"
    else:
        states = []
        for d in pyverbs["devices"]:
            p1 = (d.get("ports") or [{}])[0]
            states.append(f"{d['name']} port 1 {p1.get('state', d.get('error') or '?')}")
        reason = "no pyverbs device has an active port 1 (" + "; ".join(states) + ")"
    return {
        "provider": provider,
        "device": name,
        "reason": reason,
        "choices": list(PROVIDERS),
        "env": {
            "AIORDMA_PROVIDER": env_p,
            "AIORDMA_DEVICE": env_d,
            "AIORDMA_GID_INDEX": settings.GID_INDEX.get(),
        },
    }


def collect(with_soft: bool = True) -> dict[str, Any]:
    pv = probe_pyverbs()
    return {"pyverbs": pv, "soft": probe_soft() if with_soft else None, "auto": explain_auto(pv)}


# ---------------------------------------------------------------- rendering ----


def _port_lines(port: dict[str, Any]) -> list[str]:
    out = []
    if port.get("state") is None:
        return [f"    port {port['port']}: {port.get('error', 'cannot be queried')}"]
    mtu = f"{port['active_mtu']}" if port.get("active_mtu") else "?"
    out.append(
        f"    port {port['port']}:  state {port['state']:<17} active_mtu {mtu:<5} (max {port.get('max_mtu')})  "
        f"link_layer {port['link_layer']}"
    )
    gids = port.get("gids") or []
    if gids:
        out.append(f"      {'':2}{'idx':>3}  {'type':<8} {'GID':<39}  {'IPv4':<15} netdev")
        for g in gids:
            mark = "*" if g["aiordma"] else " "
            out.append(
                f"      {mark:2}{g['index']:>3}  {g['type']:<8} {g['gid']:<39}  {g['ipv4'] or '-':<15} {g['netdev'] or '-'}"
            )
        if port.get("gid_index") is not None:
            src = port.get("gid_index_note") or "first RoCE v2 GID with an IPv4 address"
            out.append(f"      * = the GID index aiordma uses ({port['gid_index']}: {src})")
    else:
        out.append("      GID table: empty" + (f" ({port['error']})" if port.get("error") else ""))
    if port.get("gid_index") is None and port.get("gid_index_note"):
        out.append(f"      no usable GID: {port['gid_index_note']}")
    return out


def _kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):,.1f} MiB"


def _memory_lines(d: dict[str, Any], whose: str) -> list[str]:
    out = []
    mem = d.get("registered_memory")
    if mem is not None:
        if mem.get("error"):
            out.append(f"    registered memory: {mem['error']}")
        else:
            out.append(f"    registered memory: {_kib(mem['bytes'])} in {mem['regions']} region(s), {whose}")
    cost = d.get("connection_cost")
    if cost is not None and not cost.get("error"):
        how = "the device's shared receive queue" if cost["srq"] else "16 x 64 KiB receive buffers of its own"
        out.append(
            f"    a connection registers {_kib(cost['own_bytes'])} of its own ({how}; AIORDMA_SRQ="
            f"{cost['srq_setting']}), the device's shared pools {_kib(cost['shared_idle_bytes'])} while its "
            f"connections are idle, at most {_kib(cost['shared_max_bytes'])}"
        )
    return out


def render(data: dict[str, Any]) -> str:
    lines: list[str] = []
    pv = data["pyverbs"]
    info = pv.get("info") or {}
    if pv["available"]:
        lines.append(
            f"pyverbs {info.get('version') or '(version unknown)'} from {info.get('path')} "
            f"({'system package' if info.get('how') == 'system' else 'import'}; completion-channel fd: "
            f"{info.get('comp_channel_fd')})"
        )
    else:
        lines.append("pyverbs: unavailable: " + (pv.get("error") or "unknown reason").splitlines()[0])
    if pv["available"] and not pv["devices"]:
        lines.append(f"  {pv.get('error') or 'no RDMA device'}")
    for d in pv["devices"]:
        lines.append("")
        head = f"hca_id: {d['name']}  (pyverbs)"
        if d.get("netdev"):
            head += f"  netdev {d['netdev']}"
        lines.append(head)
        if d.get("error") and not d.get("ports"):
            lines.append(f"    cannot open: {d['error']}")
            continue
        if d.get("node_guid"):
            lines.append(
                f"    node_guid {d['node_guid']}  fw_ver {d.get('fw_ver') or '-'}  "
                f"vendor 0x{d.get('vendor_id', 0):x}/{d.get('vendor_part_id', 0)}"
            )
        for port in d["ports"]:
            lines.extend(_port_lines(port))
        lines.extend(_memory_lines(d, "registered by every process (the kernel's count)"))
    soft = data.get("soft")
    if soft is not None:
        lines.append("")
        if soft.get("error"):
            lines.append(f"soft device: cannot open: {soft['error']}")
        else:
            lines.append(
                f"hca_id: {soft['name']}  (soft: userspace RoCEv2 over UDP, {soft['address']}, ICRC {soft['icrc']})"
            )
            lines.append(f"    engine: {soft.get('engine')} ({soft.get('engine_reason')})")
            speeds = soft.get("crc32_throughput") or {}
            if speeds:
                used = soft.get("crc32") if soft.get("crc32") in speeds else next(iter(speeds))
                others = ", ".join(f"{n} {v / 1e9:.1f}" for n, v in speeds.items() if n != used)
                lines.append(
                    f"    ICRC: CRC-32 by {used} at {speeds[used] / 1e9:.1f} GB/s on 4 KiB packets"
                    + (f" (also built: {others} GB/s)" if others else "")
                )
            gso_info = soft.get("gso") or {}
            if gso_info:
                state = "on" if gso_info.get("on") else "off"
                if gso_info.get("on") and gso_info.get("paused_by_capture"):
                    state = "paused: a capture listens"
                elif not gso_info.get("on") and gso_info.get("batching"):
                    state = "off (AIORDMA_SOFT_GSO=0, or the kernel refused it)"
                lines.append(f"    UDP GSO batches: {state}. {gso_info.get('description')}")
            links = soft.get("shared_memory_links") or {}
            if links:
                lines.append(
                    "    shared-memory links: "
                    + (
                        "on (toward a soft device of another process of this host and network namespace, "
                        "the packets go through memory the two processes share; off: AIORDMA_SOFT_SHM=0)"
                        if links.get("on")
                        else f"off: {links.get('reason')}"
                    )
                )
            lines.extend(f"    {w}" for w in soft.get("warnings", ()))
            for port in soft["ports"]:
                lines.extend(_port_lines(port))
                active = port.get("active_mtu") or 0
                if soft.get("soft_mtu", 0) > active:
                    lines.append(
                        f"      path MTU toward another soft device: up to {soft['soft_mtu']} bytes, beyond the "
                        f"active_mtu {active} RoCE allows, because both ends are this software (toward kernel "
                        "rxe or a NIC it is the active_mtu; conn.path says which, and why)"
                    )
            lines.extend(_memory_lines(soft, "registered by this process"))
            lines.append(f"    ({soft['note']})")
    auto = data["auto"]
    lines.append("")
    dev = f" {auto['device']}" if auto.get("device") else ""
    lines.append(f"provider auto -> {auto['provider']}{dev}: {auto['reason']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    data = collect(with_soft=not getattr(args, "no_soft", False))
    if args.json:
        json.dump(data, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(render(data))
    return 0
