"""What RoCEv2 does not protect, said where it matters.

RoCEv2 packets carry no authentication on any implementation: the ICRC is a
CRC-32 (a checksum anyone can compute), not a MAC. Whoever can send UDP to
the device's port (4791) and knows a queue pair number, a PSN inside its
window and an rkey can act on that queue pair: RDMA Write into, Read from
and run atomics on the memory it exposes. The rendezvous token authenticates
the TCP handshake only. On loopback only this host can send such packets; on
an interface address every host that reaches it can, so the soft device
bound (or about to be bound) to a non-loopback address gets a warning that
says what to do: a dedicated network or VLAN, and firewall rules that let
only the peers send to UDP 4791.
"""

from __future__ import annotations

import ipaddress
import socket

from ... import settings
from .peer import _is_loopback, _parse_peer, _resolve
from .plan import Context
from .report import WARN, Check
from .sysfs import ROCE_V2_UDP_PORT

EXPOSURE = "RoCE exposure"


def soft_address(text: str) -> tuple[str, int]:
    """``AIORDMA_SOFT_ADDR`` as the soft device reads it: ``IP[:PORT]``, port 4791 by default
    (a value the device would refuse: as it stands, on port 4791; the settings check names it)."""
    try:
        return settings.parse_soft_address(text.strip())
    except ValueError:
        return text.strip(), ROCE_V2_UDP_PORT


def is_loopback_only(host: str) -> bool:
    """Whether ``host`` (an address or a name) is reachable from this host only."""
    if _is_loopback(host):
        return True
    try:
        ipaddress.ip_address(host)
        return False  # an address, not loopback (0.0.0.0 is every interface)
    except ValueError:
        pass
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return False
    return bool(addrs) and all(ipaddress.ip_address(a).is_loopback for a in addrs)


def exposure_check(ip: str, port: int, how: str, peer_ip: str | None = None) -> Check | None:
    """A warning when the soft device at ``ip:port`` can be reached from other
    hosts (None on loopback). ``how`` says why it is (or would be) bound there;
    ``peer_ip`` fills in the firewall example."""
    if is_loopback_only(ip):
        return None
    where = f"every interface ({ip}:{port})" if ip in ("0.0.0.0", "") else f"UDP {ip}:{port}"
    allowed = peer_ip or "PEER_IP"
    seen = (
        f"{how}, the soft device is reachable from the network at {where}. RoCEv2 packets are not authenticated "
        "on any implementation (the ICRC is a checksum, not a MAC): anyone who can send UDP to port "
        f"{port} here and knows a QPN, a PSN window and an rkey can act on a queue pair (RDMA Write, Read and "
        "atomics on the memory it exposes); the rendezvous token authenticates only the TCP handshake"
    )
    fix = (
        f"put RDMA traffic on a dedicated network or VLAN, and let only your peers send to UDP {port}: "
        f"`sudo nft add rule inet filter input udp dport {port} ip saddr != {{ {allowed} }} drop` "
        f"(iptables: `sudo iptables -A INPUT -p udp --dport {port} ! -s {allowed} -j DROP`)"
    )
    return Check(EXPOSURE, WARN, seen, fix, {"address": ip, "port": port, "how": how, "peer_ip": peer_ip})


def check_exposure(ctx: Context) -> list[Check]:
    """Warn when the soft device is, or would be, bound to a non-loopback
    address: ``AIORDMA_SOFT_ADDR``, or the address that routes to ``--peer``."""
    p = ctx.probe
    configured = settings.SOFT_ADDR.get(p.env)
    peer_ip = None
    if ctx.opts.peer:
        try:
            peer_ip = _resolve(_parse_peer(ctx.opts.peer)[0])
        except ValueError:
            peer_ip = None
    if configured:
        ip, port = soft_address(configured)
        check = exposure_check(ip, port, f"with AIORDMA_SOFT_ADDR={configured}", peer_ip)
        return [check] if check else []
    if ctx.plan.provider == "soft" and ctx.opts.peer and peer_ip and not _is_loopback(peer_ip):
        # what check_peer does, and what programs that talk to this peer must do
        src = p.route_source(peer_ip)
        if src:
            check = exposure_check(
                src,
                ROCE_V2_UDP_PORT,
                f"to talk to {ctx.opts.peer} (AIORDMA_SOFT_ADDR={src}, the address that routes there)",
                peer_ip,
            )
            return [check] if check else []
    return []
