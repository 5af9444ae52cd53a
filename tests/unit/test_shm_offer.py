"""Shared-memory links at the rendezvous: the offer each end makes, how a lying
one is refused before anything is copied or mapped, and which peers count as the
same host (aiordma.providers.soft.shm)."""

from __future__ import annotations

import os

import msgpack
import pytest

from aiordma.errors import RendezvousError
from aiordma.providers.soft import shm
from aiordma.rendezvous import Endpoint, shm_reads_flag

GID = bytes(10) + b"\xff\xff" + bytes([127, 0, 0, 1])
HOST = shm.host_key()

pytestmark = pytest.mark.skipif(HOST is None, reason="no boot id or network namespace on this system")


def _endpoint(**extra) -> Endpoint:
    return Endpoint(qpn=0x1234, psn=7, gid=GID, mtu=4096, **extra)


def test_the_host_key_is_the_boot_and_the_network_namespace() -> None:
    assert HOST is not None
    boot, net = HOST.split("/net:")
    assert boot == shm.boot_id()
    assert int(net) == os.stat("/proc/self/ns/net").st_ino


def test_an_offer_round_trips_through_the_endpoint() -> None:
    offer = (HOST, os.getpid(), 0xDEADBEEF, 7, 1 << 63, 9)
    wire = msgpack.unpackb(msgpack.packb(_endpoint(soft_shm=offer).to_wire()))
    assert Endpoint.from_wire(wire).soft_shm == offer
    assert "soft_shm" not in _endpoint().to_wire()  # (an older peer sees nothing new)
    assert Endpoint.from_wire(msgpack.unpackb(msgpack.packb(_endpoint().to_wire()))).soft_shm is None


@pytest.mark.parametrize(
    "bad",
    [
        "yes",
        [],
        ["host", 1, 2, 3, 0],
        ["host", 0, 1, 3, 0, 0],  # pid 0
        ["host", 1 << 31, 1, 3, 0, 0],
        ["host", 12, 0, 3, 0, 0],  # device id 0
        ["host", 12, 1 << 64, 3, 0, 0],
        ["host", 12, 1, -1, 0, 0],  # a negative descriptor
        ["host", 12, 1, 3, 0, 1 << 31],
        ["", 12, 1, 3, 0, 0],
        ["h" * 81, 12, 1, 3, 0, 0],
        [b"host", 12, 1, 3, 0, 0],
        ["host", True, 1, 3, 0, 0],
        ["host", 12, 1.5, 3, 0, 0],
    ],
)
def test_a_malformed_offer_is_a_clear_rendezvous_error(bad) -> None:
    wire = _endpoint().to_wire()
    wire["soft_shm"] = bad
    with pytest.raises(RendezvousError, match="soft_shm"):
        Endpoint.from_wire(wire)


def test_the_ready_flag_must_be_a_bool() -> None:
    assert shm_reads_flag({"t": "ready", "soft_shm": True}) is True
    assert shm_reads_flag({"t": "ready"}) is False
    with pytest.raises(RendezvousError, match="soft_shm"):
        shm_reads_flag({"t": "ready", "soft_shm": 1})


def test_only_another_process_under_this_host_key_is_a_same_host_peer() -> None:
    mine = (HOST, os.getpid(), 1, 3, 0, 0)
    assert shm.same_host_peer(mine, (HOST, os.getpid() + 1, 2, 4, 0, 0))
    assert not shm.same_host_peer(mine, mine)  # this process: its devices deliver in memory
    assert not shm.same_host_peer(mine, (HOST + "x", os.getpid() + 1, 2, 4, 0, 0))  # another namespace
    assert not shm.same_host_peer(mine, None)
    assert not shm.same_host_peer(None, mine)
