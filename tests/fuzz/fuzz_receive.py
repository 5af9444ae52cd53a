"""Coverage-guided fuzzing of the soft device's receive path with atheris.

Not part of the test suite (pytest collects only ``test_*.py``). Run::

    pip install atheris
    PYTHONPATH=. python tests/fuzz/fuzz_receive.py -atheris_runs=200000
    PYTHONPATH=. python tests/fuzz/fuzz_receive.py corpus_dir/   # keep a corpus

Each input is a sequence of datagrams (2-byte length prefix each). They are
decoded as the NIC does (``wire.decode``; what the codec rejects is dropped)
and delivered to the responder ``b`` of an in-memory RC pair
(``tests/unit/rc_harness.Pair``) between steps of legitimate traffic
(a WRITE, a READ, a SEND, a FETCH_ADD from ``a``). After every input: no
exception escaped the engine, the guard bytes around ``b``'s regions, its
read-only region and its region without remote access are unchanged, and
the link quiesces.
"""

from __future__ import annotations

import struct
import sys

import atheris

with atheris.instrument_imports():
    from aiordma.providers.base import ACCESS_ALL, MTU, Access, RecvWR, SendWR, WROpcode
    from aiordma.providers.soft import wire
    from tests.unit.rc_harness import FakeRegion, Pair

GUARD = 64


def guarded(mem, size: int, access: Access, fill: int):
    backing = bytearray([0xA5]) * (size + 2 * GUARD)
    backing[GUARD : GUARD + size] = bytes([fill]) * size
    addr = mem._next_addr + GUARD
    mem._next_addr += (size + 2 * GUARD + 0x10000) & ~0xFFF
    r = FakeRegion(
        addr, size, access, next(mem._keys), next(mem._keys) | 0x80000000, memoryview(backing)[GUARD : GUARD + size]
    )
    mem.add(r)
    return r, backing


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    mtu = fdp.PickValueInList([MTU.IBV_MTU_256, MTU.IBV_MTU_1024, MTU.IBV_MTU_4096])
    p = Pair(mtu=mtu, psn_a=fdp.ConsumeIntInRange(0, 2**24 - 1), psn_b=5, timeout=8)
    mb, ma = p.mem["b"], p.mem["a"]
    rw, rw_b = guarded(mb, 16384, ACCESS_ALL, 1)
    ro, ro_b = guarded(mb, 4096, Access.LOCAL_WRITE | Access.REMOTE_READ, 2)
    priv, priv_b = guarded(mb, 4096, Access.LOCAL_WRITE, 3)
    rbuf, rbuf_b = guarded(mb, 8192, Access.LOCAL_WRITE, 0)
    snapshot = {"ro": bytes(ro_b), "priv": bytes(priv_b)}
    src, _ = guarded(ma, 16384, Access.LOCAL_WRITE, 7)
    dst, _ = guarded(ma, 16384, Access.LOCAL_WRITE, 0)
    p.post_recv("b", RecvWR(1, [rbuf.sge(0, 8192)]))
    p.post_send("a", SendWR(1, WROpcode.IBV_WR_RDMA_WRITE, [src.sge(0, 5000)], remote_addr=rw.addr, rkey=rw.rkey))
    p.post_send("a", SendWR(2, WROpcode.IBV_WR_RDMA_READ, [dst.sge(0, 3000)], remote_addr=ro.addr, rkey=ro.rkey))
    p.post_send("a", SendWR(3, WROpcode.IBV_WR_SEND, [src.sge(0, 2000)]))
    p.post_send(
        "a",
        SendWR(
            4,
            WROpcode.IBV_WR_ATOMIC_FETCH_AND_ADD,
            [dst.sge(8192, 8)],
            remote_addr=rw.addr + 64,
            rkey=rw.rkey,
            compare_add=1,
        ),
    )
    steps = 0
    while fdp.remaining_bytes() > 2:
        n = struct.unpack(">H", fdp.ConsumeBytes(2))[0] % 512
        datagram = fdp.ConsumeBytes(n)
        # patch in the live QPN / PSN at times, so packets get past the first checks
        if len(datagram) >= 12 and datagram[0] & 0x80:
            b = bytearray(datagram)
            b[5:8] = p.b.qp_num.to_bytes(3, "big")
            b[9:12] = p.b.epsn.to_bytes(3, "big")
            datagram = bytes(b)
        try:
            pkt = wire.decode(datagram)
        except wire.MalformedPacketError:
            pkt = None
        if (
            pkt is not None
            and pkt.dest_qp == p.b.qp_num
            and (pkt.opcode in wire.REQUEST_OPCODES or pkt.opcode in wire.RESPONSE_OPCODES)
        ):
            p.b.receive(pkt, p.now)
        for _ in range(fdp.ConsumeIntInRange(0, 4)):
            p.step()
            steps += 1
    p.run(max_steps=50_000)
    for name, backing, size in (
        ("rw", rw_b, 16384),
        ("ro", ro_b, 4096),
        ("priv", priv_b, 4096),
        ("recv", rbuf_b, 8192),
    ):
        assert backing[:GUARD] == b"\xa5" * GUARD and backing[GUARD + size :] == b"\xa5" * GUARD, f"{name} guard"
    assert bytes(ro_b) == snapshot["ro"], "read-only region written"
    assert bytes(priv_b) == snapshot["priv"], "region without remote access written"
    assert not p.a.sq, "work requests left on a quiescent link"


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
