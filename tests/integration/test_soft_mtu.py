"""The soft device sizes its RoCE packets from its interface's MTU, as kernel rxe does.

A datagram sent with DF set that does not fit the interface is refused by the
kernel (EMSGSIZE), so a soft device on an Ethernet interface of 1500 bytes
must not send 4096-byte payloads. (tests/dask/test_two_hosts.py moves data
across a 1500-byte veth link end to end.)"""

from __future__ import annotations

import socket

import pytest

from aiordma.providers import open_device
from aiordma.providers.base import MTU, mtu_bytes
from aiordma.providers.soft.device import ROCE_HEADROOM, netdev_of, roce_mtu_for


@pytest.mark.parametrize(
    ("netdev_mtu", "roce"),
    [
        (1500, MTU.IBV_MTU_1024),
        (1400, MTU.IBV_MTU_1024),
        (9000, MTU.IBV_MTU_4096),
        (4200, MTU.IBV_MTU_4096),
        (4100, MTU.IBV_MTU_2048),
        (600, MTU.IBV_MTU_512),
        (65536, MTU.IBV_MTU_4096),
        (None, MTU.IBV_MTU_4096),
    ],
)
def test_roce_mtu_leaves_room_for_the_headers(netdev_mtu, roce):
    assert roce_mtu_for(netdev_mtu) == roce
    if netdev_mtu is not None and netdev_mtu >= 256 + ROCE_HEADROOM:
        assert mtu_bytes(roce) + ROCE_HEADROOM <= netdev_mtu


def _non_loopback_ipv4() -> list[str]:
    addrs = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.254", 9))  # no packet is sent: this only picks the route's source address
            addrs.append(s.getsockname()[0])
        except OSError:
            pass
    return [a for a in addrs if not a.startswith("127.")]


def test_loopback_device_keeps_the_jumbo_mtu():
    dev = open_device("soft")
    try:
        assert dev.netdev == "lo"
        assert dev.query_port().active_mtu == MTU.IBV_MTU_4096
        assert dev.soft_mtu == 32768
    finally:
        dev.close()


def test_a_device_on_an_interface_follows_its_mtu():
    addrs = _non_loopback_ipv4()
    if not addrs:
        pytest.skip("this host has no non-loopback IPv4 address")
    ip = addrs[0]
    name, mtu = netdev_of(ip)
    assert name is not None and mtu is not None, f"no interface found for {ip}"
    dev = open_device("soft", address=f"{ip}:0")
    try:
        assert dev.netdev == name and dev.netdev_mtu == mtu
        assert dev.query_port().active_mtu == roce_mtu_for(mtu)
        assert mtu_bytes(dev.query_port().active_mtu) + ROCE_HEADROOM <= mtu
        assert dev.soft_mtu <= max(mtu - ROCE_HEADROOM, mtu_bytes(dev.query_port().active_mtu))
    finally:
        dev.close()
