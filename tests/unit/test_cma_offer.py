"""Cross-memory attach at the rendezvous: the offer each end makes, how a lying
one is refused, and how an end decides that it may read the peer's process
(aiordma.providers.soft.cma). The probe is read out of a real second process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from aiordma.errors import RendezvousError
from aiordma.providers.soft import cma
from aiordma.rendezvous import Endpoint

ROOT = Path(__file__).resolve().parents[2]
GID = bytes(10) + b"\xff\xff" + bytes([127, 0, 0, 1])

pytestmark = pytest.mark.skipif(cma.offer() is None, reason="no boot id or no process_vm_readv on this system")


def _endpoint(**extra) -> Endpoint:
    return Endpoint(qpn=0x1234, psn=7, gid=GID, mtu=4096, **extra)


def test_an_offer_round_trips_through_the_endpoint() -> None:
    offer = cma.offer()
    assert offer is not None and offer[1] == os.getpid() and len(offer[3]) == cma.PROBE_BYTES
    wire = msgpack.unpackb(msgpack.packb(_endpoint(soft_cma=offer, soft_cma_reads=True).to_wire()))
    back = Endpoint.from_wire(wire)
    assert back.soft_cma == offer and back.soft_cma_reads is True
    plain = Endpoint.from_wire(msgpack.unpackb(msgpack.packb(_endpoint().to_wire())))
    assert plain.soft_cma is None and plain.soft_cma_reads is False
    assert "soft_cma" not in _endpoint().to_wire()  # (an older peer sees nothing new)


@pytest.mark.parametrize(
    "bad",
    [
        "yes",
        [],
        ["boot", 1, 2],
        ["boot", 0, 4096, bytes(16)],  # pid 0
        ["boot", 1 << 31, 4096, bytes(16)],
        ["boot", 12, 0, bytes(16)],  # address 0
        ["boot", 12, 4096, bytes(15)],
        ["", 12, 4096, bytes(16)],
        ["boot", True, 4096, bytes(16)],
        [b"boot", 12, 4096, bytes(16)],
    ],
)
def test_a_malformed_offer_is_a_clear_rendezvous_error(bad) -> None:
    wire = _endpoint().to_wire()
    wire["soft_cma"] = bad
    with pytest.raises(RendezvousError, match="soft_cma"):
        Endpoint.from_wire(wire)


def test_a_reads_flag_that_is_not_a_bool_is_refused() -> None:
    wire = _endpoint().to_wire()
    wire["soft_cma_reads"] = 1
    with pytest.raises(RendezvousError, match="soft_cma_reads"):
        Endpoint.from_wire(wire)


def test_only_another_process_of_this_boot_whose_probe_reads_back_is_readable() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, msgpack; from aiordma.providers.soft import cma;"
            "sys.stdout.buffer.write(msgpack.packb(cma.offer())); sys.stdout.flush(); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert child.stdout is not None
        unpacker = msgpack.Unpacker()
        while True:  # (a blocking read of the pipe would wait for more than the child wrote)
            unpacker.feed(os.read(child.stdout.fileno(), 4096))
            try:
                boot, pid, addr, probe = unpacker.unpack()
                break
            except msgpack.OutOfData:
                continue
        assert pid == child.pid and boot == cma.boot_id()
        assert cma.readable_peer((boot, pid, addr, probe)) == child.pid
        assert cma.readable_peer((boot, pid, addr, bytes(a ^ 1 for a in probe))) == 0  # not what it offered
        assert cma.readable_peer(("another-boot", pid, addr, probe)) == 0
        assert cma.readable_peer(None) == 0
        mine = cma.offer()
        assert mine is not None and cma.readable_peer(mine) == 0  # this process: not a peer
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    assert cma.readable_peer((boot, pid, addr, probe)) == 0  # gone
