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
rendezvous: the path MTU and the GID it chose, and why.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import settings

__all__ = ["AddressVector", "PathInfo"]


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
    ``peer_gid`` the destination. ``address_vector`` holds the IP header fields."""

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

    @property
    def traffic_class(self) -> int:
        return self.address_vector.traffic_class

    def __str__(self) -> str:
        av = self.address_vector
        return (
            f"path MTU {self.mtu} ({self.mtu_reason}); GID index {self.gid_index} {self.gid} ({self.gid_type}: "
            f"{self.gid_reason}) -> {self.peer_gid}; traffic class {av.traffic_class} (DSCP {av.dscp}), "
            f"SL {av.service_level}, hop limit {av.hop_limit}, flow label {av.flow_label}"
        )
