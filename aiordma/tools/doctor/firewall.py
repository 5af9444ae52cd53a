"""Best-effort reading of nft/iptables/firewalld rules for UDP 4791."""

from __future__ import annotations

import re

from .plan import Context
from .report import OK, SKIP, WARN, Check
from .sysfs import ROCE_V2_UDP_PORT


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
