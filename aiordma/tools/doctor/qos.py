"""Does the traffic class aiordma's connections use reach a lossless priority?

On a RoCE fabric with PFC, the NIC puts a packet in one of eight priorities and
pauses (instead of dropping) only the priorities that have PFC on. Which
priority a RoCE packet takes depends on the port's trust mode: with ``dscp``
trust, the packet's DSCP (``traffic_class >> 2``, ``AIORDMA_TRAFFIC_CLASS``)
through the port's DSCP-to-priority map; with ``pcp`` trust, the VLAN priority
(the service level on most NICs). This check reads the port's settings with
iproute2's ``dcb`` (``dcb apptrust``, ``dcb app``, ``dcb pfc``) or, failing
that, NVIDIA's ``mlnx_qos -i NETDEV``, and warns when the class maps to a
priority without PFC. Best effort: where neither tool says anything, it says
so and what to check by hand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ... import settings
from .plan import Context
from .report import OK, SKIP, WARN, Check


@dataclass
class PortQoS:
    """What the tools said about one netdev (None: not known)."""

    tool: str
    trust: str | None = None  # "dscp" or "pcp"
    dscp_prio: dict[int, int] = field(default_factory=dict)
    pfc: set[int] | None = None  # priorities with PFC on


def parse_dcb(apptrust: str | None, app: str | None, pfc: str | None) -> PortQoS | None:
    """``dcb apptrust show dev D``, ``dcb app show dev D dscp-prio`` and
    ``dcb pfc show dev D prio-pfc`` outputs, as iproute2 prints them
    (``order dscp pcp``; ``dscp-prio 0:0 26:3``; ``prio-pfc 0:off ... 3:on ...``)."""
    if pfc is None or "prio-pfc" not in pfc:
        return None
    qos = PortQoS("dcb")
    qos.pfc = {int(p) for p, state in re.findall(r"(\d):(on|off)", pfc) if state == "on"}
    if apptrust:
        m = re.search(r"order\s+(\w+)", apptrust)
        if m:
            qos.trust = m.group(1)
    if app:
        qos.dscp_prio = {int(d): int(p) for d, p in re.findall(r"(\d+):(\d)", app.split("dscp-prio", 1)[-1])}
        if qos.trust is None and qos.dscp_prio:
            qos.trust = "dscp"  # a DSCP map in use (kernels without apptrust report no order)
    return qos


def parse_mlnx_qos(text: str | None) -> PortQoS | None:
    """``mlnx_qos -i NETDEV`` output: ``Priority trust state: dscp``, the
    ``dscp2prio mapping`` lines (``prio:3 dscp:31,30,...,24,``) and the PFC table
    (``enabled 0 0 0 1 0 0 0 0`` under ``priority 0 1 ... 7``)."""
    if not text or "PFC configuration" not in text:
        return None
    qos = PortQoS("mlnx_qos")
    m = re.search(r"Priority trust state:\s*(\w+)", text)
    if m:
        qos.trust = m.group(1)
    for prio, dscps in re.findall(r"prio:(\d)\s+dscp:([\d,]+)", text):
        for d in dscps.strip(",").split(","):
            if d:
                qos.dscp_prio[int(d)] = int(prio)
    pfc = text.split("PFC configuration", 1)[1]
    m = re.search(r"enabled\s+((?:[01]\s+){7}[01])", pfc)
    if m:
        qos.pfc = {i for i, v in enumerate(m.group(1).split()) if v == "1"}
    return qos


def read_port_qos(ctx: Context, netdev: str) -> PortQoS | None:
    p = ctx.probe

    def out(argv: list[str]) -> str | None:
        r = p.run(argv)
        return r[1] if r is not None and r[0] == 0 else None

    if p.which("dcb"):
        qos = parse_dcb(
            out(["dcb", "apptrust", "show", "dev", netdev]),
            out(["dcb", "app", "show", "dev", netdev, "dscp-prio"]),
            out(["dcb", "pfc", "show", "dev", netdev, "prio-pfc"]),
        )
        if qos is not None:
            return qos
    if p.which("mlnx_qos"):
        return parse_mlnx_qos(out(["mlnx_qos", "-i", netdev]))
    return None


def _netdev(ctx: Context) -> str | None:
    """The network device under the device aiordma would use (pyverbs), else None."""
    if not ctx.uses_pyverbs:
        return None
    for d in ctx.devices:
        if d.name == ctx.plan.device:
            for port in d.ports:
                if port.num == 1:
                    return port.netdev
    return None


def check_traffic_class(ctx: Context) -> list[Check]:
    env = ctx.probe.env
    tclass = settings.TRAFFIC_CLASS.get(env) or 0
    sl = settings.SERVICE_LEVEL.get(env) or 0
    dscp = tclass >> 2
    data: dict[str, object] = {"traffic_class": tclass, "dscp": dscp, "service_level": sl}
    uses = f"traffic class {tclass} (DSCP {dscp}), service level {sl}"
    netdev = _netdev(ctx)
    if netdev is None:
        return [
            Check(
                "traffic class",
                SKIP,
                f"{uses}; the soft device and loopback have no PFC priorities to check",
                "",
                data,
            )
        ]
    data["netdev"] = netdev
    qos = read_port_qos(ctx, netdev)
    if qos is None or qos.pfc is None:
        return [
            Check(
                "traffic class",
                SKIP,
                f"{uses} on {netdev}; neither `dcb` (iproute2) nor `mlnx_qos` says which priorities have PFC",
                f"check by hand that DSCP {dscp} maps to a priority with PFC on the NIC and the switch "
                "(or run without PFC: RoCE then relies on retransmission, see the RoCE fabric guide)",
                data,
            )
        ]
    data.update(tool=qos.tool, trust=qos.trust, pfc=sorted(qos.pfc), dscp_prio=qos.dscp_prio)
    if qos.trust == "dscp":
        prio = qos.dscp_prio.get(dscp, 0)
        how = f"DSCP {dscp} -> priority {prio} (trust dscp)"
    else:
        prio = sl & 7
        how = f"service level {sl} -> priority {prio} (trust {qos.trust or 'pcp'})"
    data["priority"] = prio
    pfc_text = ", ".join(map(str, sorted(qos.pfc))) or "none"
    seen = f"{uses} on {netdev}: {how}; PFC on priorities: {pfc_text} ({qos.tool})"
    if not qos.pfc or prio in qos.pfc:
        status = OK if prio in qos.pfc else SKIP
        return [Check("traffic class", status, seen + ("" if qos.pfc else "; no PFC: lossy fabric"), "", data)]
    lossless = sorted(qos.pfc)[0]
    good = sorted(d for d, p in qos.dscp_prio.items() if p == lossless) if qos.trust == "dscp" else []
    if good:
        fix = (
            f"give aiordma's connections a DSCP of priority {lossless}: AIORDMA_TRAFFIC_CLASS={good[0] << 2} "
            f"(DSCP {good[0]}) or traffic_class={good[0] << 2}"
        )
    else:
        fix = f"map this class to priority {lossless} (or enable PFC on priority {prio}) on the NIC and the switch"
    return [Check("traffic class", WARN, seen + f": priority {prio} has no PFC (packets may be dropped)", fix, data)]
