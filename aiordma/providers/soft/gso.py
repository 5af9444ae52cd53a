"""What the kernel does to a UDP GSO batch, learned at device open (the GSO rule).

A RoCEv2 ICRC covers the IPv4 header, identification (IP ID) included. The soft
device sends with DF set on an unconnected socket, for which Linux writes IP ID 0.
A UDP GSO send (``UDP_SEGMENT``) hands the kernel several datagrams at once, and
what a peer or a capture then sees depends on where the batch is cut into
datagrams:

``whole``
    The netdev offloads UDP segmentation and is a software device (``lo``,
    ``veth``): the batch crosses it as one packet and the *receiving* stack cuts
    it — or hands it whole to a socket that asked for ``UDP_GRO``. Every
    segment header the kernel makes numbers the IDs from the first one (segment
    k carries ID k), and a soft receiver with ``UDP_GRO`` knows each packet's
    index in the batch, so the sender makes segment k's ICRC for ID k and the
    receiver checks it for ID k: nobody infers an ID. A packet capture on the
    netdev, though, sees the batch whole — not a RoCEv2 packet — so batches
    pause while a packet socket listens on it (:func:`capture_listeners`, read
    from ``/proc/net/packet``).
``segmented``
    The kernel cuts the batch when it leaves (no UDP segmentation offload): the
    segments are on the wire with the IDs the kernel's software segmentation
    writes. Only a packet socket watching a batch go out can show that rule,
    and no local burst leaves through such a netdev (traffic to an address of
    this host goes through ``lo``), so it is not learned and batches are not
    used there by default (``SoftDevice.gso = True`` forces them: the suite
    checks the numbering on a veth whose offload is turned off).
``hardware``
    A physical NIC segments (UDP segmentation offload): its IP-ID rule is the
    NIC's and cannot be observed from the host. No batches.
``unknown``
    The netdev or its features could not be read. No batches.

IPv6 has no identification: segments differ only in their payload length, which
the sender covers per segment, so batches are exact wherever they are cut
(except under a capture of a ``whole`` netdev).

Where the process may open a packet socket (``CAP_NET_RAW``) and the device is on
``lo``, a probe confirms the rule: a three-segment burst between two probe
sockets on the device's address, read back as the kernel transmitted it. A
kernel whose loopback segments on transmit is then learned with its numbering.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import functools
import os
import socket
import struct
import time

__all__ = ["GsoRule", "capture_listeners", "learn", "netdev_features"]

#: where the batch is cut (see the module docstring)
WHOLE, SEGMENTED, HARDWARE, UNKNOWN = "whole", "segmented", "hardware", "unknown"
#: the IP IDs of a batch's segments: segment k carries the first's + k, all the
#: first's, none at all (IPv6), or not known
NUMBERED, FIXED, NO_ID = "numbered", "fixed", "none (IPv6)"

#: how often (s) an engine that watches for captures reads /proc/net/packet again
CAPTURE_RECHECK_S = 0.2

_SIOCETHTOOL = 0x8946
_ETHTOOL_GSSET_INFO, _ETHTOOL_GSTRINGS, _ETHTOOL_GFEATURES = 0x37, 0x1B, 0x3A
_ETH_SS_FEATURES = 4
_ETH_GSTRING_LEN = 32
_UDP_SEGMENT = 103
_IP_MTU_DISCOVER, _IP_PMTUDISC_DO = 10, 2
_ETH_P_IP = 0x0800
#: the feature that says the netdev takes a UDP GSO batch whole
_UDP_SEGMENTATION = "tx-udp-segmentation"
_PROBE_SEGMENT = 64
_PROBE_SEGMENTS = 3


@dataclasses.dataclass(frozen=True)
class GsoRule:
    """What the kernel does to a UDP GSO batch on one netdev, and so whether the
    soft device batches there (see the module docstring)."""

    netdev: str | None
    ifindex: int | None
    #: where the batch is cut: "whole", "segmented", "hardware" or "unknown"
    batches: str
    #: the segments' IP IDs: "numbered", "fixed", "none (IPv6)" or "unknown"
    ip_ids: str
    #: how the rule was found
    learned_by: str
    #: whether the device sends UDP GSO batches on this netdev (before AIORDMA_SOFT_GSO)
    batching: bool
    #: whether batches pause while a packet capture listens on the netdev
    pause_under_capture: bool

    def describe(self) -> str:
        """One line for ``aiordma devices``."""
        where = {
            WHOLE: f"{self.netdev} carries a batch whole and the receiver cuts it",
            SEGMENTED: f"the kernel cuts a batch as it leaves {self.netdev}",
            HARDWARE: f"the NIC behind {self.netdev} cuts a batch (UDP segmentation offload)",
            UNKNOWN: f"unknown for {self.netdev or 'this address'}",
        }[self.batches]
        ids = {
            NUMBERED: "segment k gets IP ID k, and its ICRC is made for it",
            FIXED: "every segment keeps the first one's IP ID",
            NO_ID: "IPv6 has no IP ID",
        }.get(self.ip_ids, "the IP IDs are not known")
        verdict = "batches used" if self.batching else "no batches (each packet its own datagram)"
        if self.batching and self.pause_under_capture:
            verdict += f", paused while a capture listens on {self.netdev}"
        return f"{where}; {ids}: {verdict} (learned by {self.learned_by})"

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _ethtool(sock: socket.socket, name: str, buf: ctypes.Array[ctypes.c_char]) -> None:
    # struct ifreq: the name, then (in the union) a pointer to the ethtool command
    ifr = struct.pack("16sP", name.encode()[:15], ctypes.addressof(buf)).ljust(40, b"\0")
    fcntl.ioctl(sock.fileno(), _SIOCETHTOOL, ifr)


def netdev_features(name: str) -> dict[str, bool]:
    """The active features of netdev ``name`` by their ethtool names (``ethtool -k``);
    the ioctls used need no privilege. Raises OSError when they cannot be read."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        info = ctypes.create_string_buffer(struct.pack("IIQI", _ETHTOOL_GSSET_INFO, 0, 1 << _ETH_SS_FEATURES, 0))
        _ethtool(s, name, info)
        count = struct.unpack_from("I", info, 16)[0]
        strings = ctypes.create_string_buffer(
            struct.pack("III", _ETHTOOL_GSTRINGS, _ETH_SS_FEATURES, count) + bytes(_ETH_GSTRING_LEN * count)
        )
        _ethtool(s, name, strings)
        blocks = (count + 31) // 32
        feats = ctypes.create_string_buffer(struct.pack("II", _ETHTOOL_GFEATURES, blocks) + bytes(16 * blocks))
        _ethtool(s, name, feats)
    raw = strings.raw
    out: dict[str, bool] = {}
    for i in range(count):
        label = raw[12 + _ETH_GSTRING_LEN * i : 12 + _ETH_GSTRING_LEN * (i + 1)].split(b"\0", 1)[0].decode()
        # each block: available, requested, active, never_changed (u32 each)
        active = struct.unpack_from("I", feats, 8 + 16 * (i // 32) + 8)[0]
        out[label] = bool(active >> (i % 32) & 1)
    return out


def capture_listeners(ifindex: int | None, path: str = "/proc/net/packet") -> int:
    """How many packet sockets receive what crosses netdev ``ifindex``: bound to it
    or to every netdev, with a protocol (a capture: tcpdump, tshark, a test's
    ``AF_PACKET`` socket). ``/proc/net/packet`` lists this network namespace's
    packet sockets and is readable without privilege; 0 when it cannot be read."""
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return 0
    n = 0
    for line in lines:
        # sk RefCnt Type Proto Iface R Rmem User Inode
        fields = line.split()
        if len(fields) < 5:
            continue
        try:
            proto, iface = int(fields[3], 16), int(fields[4])
        except ValueError:
            continue
        if proto and (iface == 0 or iface == ifindex):
            n += 1
    return n


_RTM_GETLINK, _NLM_F_REQUEST, _IFLA_GSO_MAX_SEGS = 18, 1, 40


def _gso_max_segs(ifindex: int) -> int | None:
    """The most segments netdev ``ifindex`` takes in one packet (``ip -d link``'s
    gso_max_segs), read over rtnetlink (no privilege needed), or None."""
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0) as nl:  # NETLINK_ROUTE
            nl.settimeout(1.0)
            ifinfo = struct.pack("BxHiII", socket.AF_UNSPEC, 0, ifindex, 0, 0)
            nl.send(struct.pack("IHHII", 16 + len(ifinfo), _RTM_GETLINK, _NLM_F_REQUEST, 1, 0) + ifinfo)
            reply = nl.recv(65536)
    except OSError:
        return None
    if len(reply) < 32 or struct.unpack_from("H", reply, 4)[0] != 16:  # RTM_NEWLINK
        return None
    length = min(struct.unpack_from("I", reply, 0)[0], len(reply))
    off = 32  # nlmsghdr (16) + ifinfomsg (16)
    while off + 4 <= length:
        rta_len, rta_type = struct.unpack_from("HH", reply, off)
        if rta_len < 4:
            break
        if rta_type == _IFLA_GSO_MAX_SEGS and rta_len >= 8:
            return int(struct.unpack_from("I", reply, off + 4)[0])
        off += (rta_len + 3) & ~3
    return None


def _is_physical(netdev: str) -> bool:
    return os.path.exists(f"/sys/class/net/{netdev}/device")


def _probe_loopback(ip: str) -> tuple[str, str] | None:
    """(batches, ip_ids) as a packet socket on ``lo`` sees a three-segment burst
    sent from and to ``ip``; None when no packet socket may be opened or nothing
    conclusive came back."""
    try:
        # (bound to ETH_P_IP it gets what lo delivers, which on lo is the frame it sent)
        cap = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(_ETH_P_IP))
    except (OSError, AttributeError):
        return None  # no CAP_NET_RAW
    with (
        cap,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx,
    ):
        try:
            cap.bind(("lo", _ETH_P_IP))
            cap.setblocking(False)
            rx.bind((ip, 0))
            tx.bind((ip, 0))
            tx.setsockopt(socket.IPPROTO_IP, _IP_MTU_DISCOVER, _IP_PMTUDISC_DO)
            sport, dport = tx.getsockname()[1], rx.getsockname()[1]
            seg = struct.pack("H", _PROBE_SEGMENT)
            tx.sendmsg([bytes(_PROBE_SEGMENT * _PROBE_SEGMENTS)], [(socket.SOL_UDP, _UDP_SEGMENT, seg)], 0, (ip, dport))
        except OSError:
            return None
        seen: list[tuple[int, int]] = []  # (IP total length, IP ID) of each frame that left
        deadline = time.monotonic() + 0.2
        want = _PROBE_SEGMENT * _PROBE_SEGMENTS
        while time.monotonic() < deadline and sum(t - 28 for t, _ in seen) < want:
            try:
                frame, addr = cap.recvfrom(65536)
            except BlockingIOError:
                time.sleep(0.001)
                continue
            except OSError:
                return None
            if len(frame) < 28 or frame[9] != socket.IPPROTO_UDP:
                continue
            ihl = (frame[0] & 15) * 4
            if struct.unpack_from("!HH", frame, ihl) != (sport, dport):
                continue
            total, ident = struct.unpack_from("!HH", frame, 2)
            seen.append((total, ident))
    if len(seen) == 1 and seen[0][0] - 28 == want:
        return WHOLE, NUMBERED  # (the receiver cuts it: segment k gets ID k there)
    if len(seen) == _PROBE_SEGMENTS:
        ids = [i for _, i in seen]
        if ids == [(ids[0] + k) & 0xFFFF for k in range(_PROBE_SEGMENTS)]:
            return SEGMENTED, NUMBERED
        if len(set(ids)) == 1:
            return SEGMENTED, FIXED
    return None


@functools.lru_cache(maxsize=64)
def learn(ip: str, netdev: str | None) -> GsoRule:
    """The GSO rule for a soft device bound to ``ip`` on ``netdev`` (cached per
    process: the kernel's rule does not change while it runs)."""
    v6 = ":" in ip
    if netdev is None and ip == "::1":
        netdev = "lo"
    try:
        ifindex: int | None = socket.if_nametoindex(netdev) if netdev else None
    except OSError:
        ifindex = None
    if netdev is None or ifindex is None:
        if v6:  # (no IP ID: a batch is exact wherever it is cut; only a capture is not watched)
            how = "no netdev found for this address; IPv6 has no IP ID"
            return GsoRule(netdev, None, UNKNOWN, NO_ID, how, True, False)
        return GsoRule(netdev, None, UNKNOWN, UNKNOWN, "no netdev owns this address", False, False)
    try:
        offloaded = netdev_features(netdev).get(_UDP_SEGMENTATION, False)
    except OSError as e:
        return GsoRule(netdev, ifindex, UNKNOWN, UNKNOWN, f"netdev features unreadable ({e.strerror})", False, False)
    feature = f"netdev features: {_UDP_SEGMENTATION} {'on' if offloaded else 'off'}"
    if offloaded and _gso_max_segs(ifindex) == 1:
        # (a netdev that takes one segment per packet has every batch cut as it leaves)
        offloaded = False
        feature += ", but gso_max_segs 1"
    if not v6 and netdev == "lo":
        probed = _probe_loopback(ip)
        if probed is not None:
            batches, ids = probed
            how = f"a packet socket on lo watching a {_PROBE_SEGMENTS}-segment burst; {feature}"
            return GsoRule(netdev, ifindex, batches, ids, how, True, batches == WHOLE)
    if offloaded and not _is_physical(netdev):
        # (the receiving stack numbers what it cuts; a soft receiver knows each index)
        how = f"{feature}, a software netdev"
        return GsoRule(netdev, ifindex, WHOLE, NO_ID if v6 else NUMBERED, how, True, True)
    if offloaded:
        return GsoRule(netdev, ifindex, HARDWARE, NO_ID if v6 else UNKNOWN, feature, v6, False)
    if v6:
        return GsoRule(netdev, ifindex, SEGMENTED, NO_ID, feature, True, False)
    how = f"{feature}; the IDs the kernel writes as it cuts are not observable from this host"
    return GsoRule(netdev, ifindex, SEGMENTED, UNKNOWN, how, False, False)
