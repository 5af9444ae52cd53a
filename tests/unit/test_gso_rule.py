"""The GSO rule (aiordma/providers/soft/gso.py): what a capture listening looks like in
/proc/net/packet, the netdev features read without privilege, and the rule on lo."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from aiordma.providers.soft import gso

PROC = """\
sk               RefCnt Type Proto  Iface R Rmem   User   Inode
00000000ecd73474 3      3    0003   1     1 0      0      10451
00000000aaaa0001 3      2    0800   2     1 0      0      10452
00000000aaaa0002 3      3    0000   0     1 0      0      10453
00000000aaaa0003 3      2    0003   0     1 0      0      10454
"""


def test_a_capture_is_a_packet_socket_with_a_protocol_on_the_netdev_or_on_all(tmp_path: Path) -> None:
    proc = tmp_path / "packet"
    proc.write_text(PROC)
    # lo (1): the tshark on lo and the tcpdump on "any"; not the one on 2, not the send-only one
    assert gso.capture_listeners(1, str(proc)) == 2
    assert gso.capture_listeners(2, str(proc)) == 2
    assert gso.capture_listeners(3, str(proc)) == 1
    proc.write_text(PROC.splitlines()[0] + "\n")
    assert gso.capture_listeners(1, str(proc)) == 0
    assert gso.capture_listeners(1, str(tmp_path / "absent")) == 0


def test_a_live_packet_socket_is_seen_and_gone_when_closed() -> None:
    lo = socket.if_nametoindex("lo")
    before = gso.capture_listeners(lo)
    try:
        cap = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    except PermissionError:
        pytest.skip("a packet socket needs CAP_NET_RAW (CI runs as root)")
    with cap:
        cap.bind(("lo", 0))
        assert gso.capture_listeners(lo) == before + 1
    assert gso.capture_listeners(lo) == before


def test_netdev_features_of_lo() -> None:
    features = gso.netdev_features("lo")
    assert "tx-udp-segmentation" in features and "tx-tcp-segmentation" in features
    with pytest.raises(OSError):
        gso.netdev_features("no-such-netdev")


def test_the_rule_on_lo_batches_and_pauses_under_a_capture() -> None:
    rule = gso.learn("127.0.0.1", "lo")
    assert rule.netdev == "lo" and rule.ifindex == socket.if_nametoindex("lo")
    assert rule.batches == gso.WHOLE and rule.ip_ids == gso.NUMBERED
    assert rule.batching and rule.pause_under_capture
    assert "lo carries a batch whole" in rule.describe() and "paused while a capture listens" in rule.describe()


def test_no_netdev_no_batches() -> None:
    rule = gso.learn("192.0.2.1", None)
    assert rule.batches == gso.UNKNOWN and not rule.batching and not rule.pause_under_capture
    assert "no batches" in rule.describe()


def test_ipv6_has_no_ip_id_so_its_batches_are_exact_wherever_they_are_cut() -> None:
    assert gso.learn("::1", None).ip_ids == gso.NO_ID and gso.learn("::1", None).batching
    rule = gso.learn("2001:db8::1", None)
    assert rule.ip_ids == gso.NO_ID and rule.batching and not rule.pause_under_capture
