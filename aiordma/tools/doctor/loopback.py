"""Loopback checks: a real RDMA Write between two queue pairs on the device
aiordma would use (the soft device, and a kernel device when one is used)."""

from __future__ import annotations

import time
from typing import Any

from ... import settings
from .plan import Context
from .probe import Probe
from .report import FAIL, OK, WARN, Check, _ms
from .sysfs import ROCE_V2_UDP_PORT

LOOPBACK_TIMEOUT = 5.0


def loopback_write(
    dev: Any, payload: bytes = b"aiordma doctor loopback", timeout: float = LOOPBACK_TIMEOUT
) -> dict[str, Any]:
    """A real RDMA Write between two RC queue pairs on ``dev`` (to itself):
    returns ``{"ok", "seconds", "error"}``."""
    from ...providers.base import ACCESS_ALL, Access, QPAttr, QPCap, SendWR, WROpcode

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


def soft_slow_paths(dev: Any) -> list[Any]:
    """The soft device's slow paths (:func:`~aiordma.providers.soft.engine.slow_paths`):
    the Python engine, or an ICRC by a slow CRC-32."""
    from ...providers.soft.engine import slow_paths

    try:
        crc32 = str(dev.query_device().extra.get("crc32", ""))
    except Exception:
        crc32 = ""
    return slow_paths(str(getattr(dev, "engine", "")), str(getattr(dev, "engine_reason", "")), crc32)


def check_soft(ctx: Context) -> list[Check]:
    p = ctx.probe
    required = ctx.plan.provider == "soft"
    sev = ctx.severity(required)
    configured = settings.SOFT_ADDR.get(p.env)
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
        slow = soft_slow_paths(dev)
        res = loopback_write(dev)
    finally:
        dev.close()
    reach = (
        "reachable from this host only (loopback); set AIORDMA_SOFT_ADDR to an interface address to talk to other hosts"
        if ip.startswith("127.")
        else "reachable at this interface address"
    )
    data = {
        "address": f"{ip}:{port}",
        "configured": configured,
        "loopback": res,
        "engine": engine,
        "slow_paths": [{"kind": s.kind, "seen": s.seen, "fix": s.fix, "chosen": s.chosen} for s in slow],
    }
    if res["ok"]:
        seen = f"bound UDP {ip}:{port} ({where}); {engine}; loopback RDMA Write between two QPs: {_ms(res['seconds'])}"
        # slower than it could be: a warning wherever the soft device is what aiordma uses
        return [
            Check(
                "soft device",
                (WARN if required else OK) if slow else OK,
                "; ".join([*(f"warning: {s.seen}" for s in slow), seen, reach]),
                "; ".join(s.fix for s in slow),
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
