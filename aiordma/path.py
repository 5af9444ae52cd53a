"""The path of a connection: what its packets carry in their IP header, and
what the rendezvous chose for it.

On RoCEv2 a queue pair's *address vector* (``ibv_ah_attr`` with its global
route header) says how its packets travel: the destination GID (the peer's IP
address), the source GID index (this port's IP address), the **traffic class**
(the IP header's DSCP and ECN bits: the class a RoCE fabric's switches map to a
lossless, PFC-protected priority), the **hop limit** (TTL), the **flow label**
(IPv6) and the **service level** (which NICs map to the Ethernet frame's VLAN
priority). :class:`AddressVector` holds the four a caller chooses, checked once;
:class:`PathInfo` is what a connection reports as ``conn.path`` after the
rendezvous: the path MTU and the GID it chose, and why. :class:`MTUChoice` is
the path-MTU rule itself, sans-IO: what an end announces, and what two
announcements make.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import settings

__all__ = ["ROCE_MTUS", "AddressVector", "MTUChoice", "PathInfo", "roce_mtu_at_most"]

#: the path MTUs RoCE defines (``enum ibv_mtu``: IBV_MTU_256 ... IBV_MTU_4096)
ROCE_MTUS = (256, 512, 1024, 2048, 4096)


def roce_mtu_at_most(nbytes: int) -> int:
    """The largest RoCE path MTU not above ``nbytes`` (256 at least)."""
    return max(m for m in ROCE_MTUS if m <= max(nbytes, 256))


def _checked(
    name: str, value: int | None, setting: settings.Setting[int | None], low: int, high: int, default: int
) -> int:
    if value is None:
        value = setting.get()
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be a whole number from {low} to {high}, not {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class AddressVector:
    """The fields of a queue pair's address vector a caller chooses.

    ``traffic_class``: the IP header's traffic class byte, DSCP << 2 | ECN (DSCP 26,
    the usual RoCE class on priority 3, is 104); ``hop_limit``: the IP TTL;
    ``flow_label``: the IPv6 flow label; ``service_level``: the verbs SL."""

    traffic_class: int = 0
    service_level: int = 0
    hop_limit: int = 64
    flow_label: int = 0

    @property
    def dscp(self) -> int:
        """The DiffServ code point: the traffic class's upper six bits."""
        return self.traffic_class >> 2

    @classmethod
    def of(
        cls,
        traffic_class: int | None = None,
        service_level: int | None = None,
        hop_limit: int | None = None,
        flow_label: int | None = None,
    ) -> AddressVector:
        """The keyword values, else the process defaults (``AIORDMA_TRAFFIC_CLASS``,
        ``AIORDMA_SERVICE_LEVEL``, ``AIORDMA_HOP_LIMIT``, ``AIORDMA_FLOW_LABEL``),
        else the verbs defaults; a bad value raises ``ValueError`` naming it."""
        return cls(
            traffic_class=_checked("traffic_class", traffic_class, settings.TRAFFIC_CLASS, 0, 255, 0),
            service_level=_checked("service_level", service_level, settings.SERVICE_LEVEL, 0, 15, 0),
            hop_limit=_checked("hop_limit", hop_limit, settings.HOP_LIMIT, 1, 255, 64),
            flow_label=_checked("flow_label", flow_label, settings.FLOW_LABEL, 0, 0xFFFFF, 0),
        )


@dataclass(frozen=True, slots=True)
class PathInfo:
    """What a connection's rendezvous chose (``conn.path``).

    ``mtu`` is the path MTU in bytes (payload per packet) and ``mtu_reason`` why:
    the smaller of the two ports' active MTUs, a caller's ``path_mtu`` cap, or,
    between two soft devices, their larger-than-RoCE limit (both ends are software,
    so packets may be as large as a UDP datagram allows). ``gid_index``/``gid``/
    ``gid_type`` are the source GID and ``gid_reason`` why it was chosen;
    ``peer_gid`` the destination. ``address_vector`` holds the IP header fields.
    ``icrc`` says whether the packets carry their ICRC (the invariant CRC RoCEv2
    puts at the end of every packet), and why not when they don't. ``transport``
    says what carries the packets: UDP (with the reason where a shared-memory
    link could not be used), or a shared-memory link between two processes of
    this host (:mod:`aiordma.providers.soft.shm`)."""

    mtu: int
    mtu_reason: str
    port_mtu: int
    peer_port_mtu: int
    gid_index: int
    gid: str
    gid_type: str
    gid_reason: str
    peer_gid: str
    address_vector: AddressVector
    icrc: str = "computed and checked"
    transport: str = "UDP"

    @property
    def traffic_class(self) -> int:
        return self.address_vector.traffic_class

    def __str__(self) -> str:
        av = self.address_vector
        return (
            f"path MTU {self.mtu} ({self.mtu_reason}); GID index {self.gid_index} {self.gid} ({self.gid_type}: "
            f"{self.gid_reason}) -> {self.peer_gid}; traffic class {av.traffic_class} (DSCP {av.dscp}), "
            f"SL {av.service_level}, hop limit {av.hop_limit}, flow label {av.flow_label}; ICRC {self.icrc}; "
            f"transport {self.transport}"
        )


@dataclass(frozen=True, slots=True)
class MTUChoice:
    """One end's part in choosing a connection's path MTU.

    ``port_mtu`` is the port's active MTU, ``cap`` the caller's ``path_mtu`` (or
    None), ``soft_limit`` a soft device's own limit (0 for any other device: a
    soft device may send packets larger than RoCE's 4096 bytes to another soft
    device, both ends being this software). Each end announces
    :attr:`announced` and :attr:`announced_soft` at the rendezvous;
    :meth:`negotiate` is what the two announcements make: the same on both ends."""

    port_mtu: int
    cap: int | None = None
    soft_limit: int = 0

    @property
    def announced(self) -> int:
        """The RoCE path MTU this end announces: its port's, within the caller's cap
        and the soft device's limit."""
        limits = [m for m in (self.soft_limit, self.cap) if m]
        return min([self.port_mtu] + [roce_mtu_at_most(m) for m in limits])

    @property
    def announced_soft(self) -> int:
        """The larger-than-RoCE limit this end announces to another soft device
        (0: none, not a soft device), within the caller's cap."""
        if not self.soft_limit:
            return 0
        return min(m for m in (self.soft_limit, self.cap) if m)

    def negotiate(self, peer_mtu: int, peer_soft: int) -> tuple[int, int | None, str]:
        """The path MTU toward a peer that announced ``peer_mtu`` (and ``peer_soft``):
        ``(roce_mtu, jumbo, why)``: the RoCE MTU both ports take, the larger
        packet size two soft devices use instead (None otherwise), and why, in words."""
        mine = self.announced
        mtu = min(mine, peer_mtu)
        why = f"the smaller of the two ends' MTUs ({mine} here, {peer_mtu} at the peer)"
        if self.cap is not None and mtu == mine < self.port_mtu:
            why = f"the cap path_mtu={self.cap} (the port's MTU is {self.port_mtu}; the peer's {peer_mtu})"
        soft = self.announced_soft
        if not (soft and peer_soft and min(soft, peer_soft) > mtu):
            return mtu, None, why
        why = (
            f"two soft devices: the smaller of their path MTU limits ({soft} here, "
            f"{peer_soft} at the peer), beyond RoCE's 4096 because both ends are this software"
        )
        if self.cap is not None and soft == self.cap:
            why += f"; the limit here is the cap path_mtu={self.cap}"
        return mtu, min(soft, peer_soft), why
