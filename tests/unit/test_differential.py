"""Differential tests: the Python engine and the native (C) engine, fed the same packets.

The native engine's codec and RC state machine are a port of ``wire.py`` and
``rc.py``. Here both run the same scripts and must agree exactly:

* the codec: the same datagram from the same packet (ICRC included, for any
  IPv4 identification), the same packet (or the same error) from any
  datagram, the same IP ID from the ICRC solver;
* the RC engines, in lockstep on two in-memory links (``rc_harness.Pair``) with
  the same seeded faults (loss, duplication, reordering) and the same hostile
  packets thrown in: after every step the same datagrams on the link (byte for
  byte, at the same simulated time), the same completions; at the end the
  same memory contents, counters, QP states and error reasons.

A divergence fails at the first packet that differs, naming it.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma.providers.base import MTU, QPState, WCStatus
from aiordma.providers.soft import wire
from aiordma.providers.soft.wire import Opcode, Packet

try:
    from .rc_harness import ENGINES, Pair
    from .test_rc import Workload
except ImportError:  # tests/unit is not a package
    from rc_harness import ENGINES, Pair
    from test_rc import Workload

if "native" not in ENGINES:  # pragma: no cover - only where the extension did not build
    from aiordma.providers.soft.engine import native_status

    pytestmark = pytest.mark.skip(reason=f"native engine not built: {native_status()[1]}")
else:
    from aiordma.providers.soft._native import _engine as native

FLOW = wire.Flow("10.1.2.3", "10.4.5.6", 49999, 4791)
OPCODES = sorted(wire._LAYOUT)


# ------------------------------------------------------------------ codec ----


def random_packet(rng: random.Random) -> Packet:
    op = rng.choice(OPCODES)
    n = rng.choice([0, 1, 2, 3, 4, 5, 255, 256, 1023, 1024, 4096, rng.randrange(9000)])
    return Packet(
        op,
        rng.randrange(1 << 24),
        rng.randrange(1 << 24),
        ack_req=rng.random() < 0.5,
        solicited=rng.random() < 0.2,
        migreq=rng.random() < 0.1,
        pkey=rng.choice([0xFFFF, 0x7FFF, rng.randrange(1 << 16)]),
        fecn=rng.random() < 0.1,
        becn=rng.random() < 0.1,
        va=rng.randrange(1 << 64),
        rkey=rng.randrange(1 << 32),
        dma_len=rng.randrange(1 << 32),
        syndrome=rng.randrange(256),
        msn=rng.randrange(1 << 24),
        imm=rng.randrange(1 << 32),
        swap_add=rng.randrange(1 << 64),
        compare=rng.randrange(1 << 64),
        orig=rng.randrange(1 << 64),
        payload=rng.randbytes(n),
    )


def same_decode(data: bytes) -> None:
    try:
        want: Packet | str = wire.decode(data)
    except wire.MalformedPacketError as e:
        want = e.reason
    try:
        got: Packet | str = native.decode(data)
    except wire.MalformedPacketError as e:
        got = e.reason
    if isinstance(want, str) or isinstance(got, str):
        assert got == want, data.hex()
        return
    fields = ("opcode", "dest_qp", "psn", "ack_req", "solicited", "migreq", "pkey", "fecn", "becn", "tver")
    fields += ("va", "rkey", "dma_len", "syndrome", "msn", "imm", "swap_add", "compare", "orig")
    assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields], data.hex()
    assert bytes(got.payload) == bytes(want.payload)


def test_codec_random_packets_both_ways() -> None:
    rng = random.Random(14)
    for _ in range(4000):
        pkt = random_packet(rng)
        flow = wire.Flow("10.0.0.1", "10.0.0.2", rng.randrange(1, 65536), rng.choice([4791, 4792]))
        for ip_id in (None, 0, rng.randrange(64), rng.randrange(1 << 16)):
            data = b"".join(wire.encode(pkt, flow, ip_id))
            assert native.encode(pkt, flow, ip_id) == data, (pkt, ip_id)
            same_decode(data)
            assert native.icrc_ip_id(data, flow) == wire.icrc_ip_id(data, flow)
            assert native.icrc_ok(data, flow) == wire.icrc_ok(data, flow)


def test_codec_ipv6_flows() -> None:
    rng = random.Random(6)
    flow = wire.Flow("fd00::1", "fd00::2", 50000, 4791)
    for _ in range(300):
        pkt = random_packet(rng)
        data = wire.encode_bytes(pkt, flow)
        assert native.encode(pkt, flow) == data
        assert native.icrc_ip_id(data, flow) == wire.icrc_ip_id(data, flow) == 0
        bad = bytearray(data)
        at = rng.choice([i for i in range(len(bad) - 4) if i != 4])  # (BTH byte 4 is masked out of the ICRC)
        bad[at] ^= 1 << rng.randrange(8)
        assert native.icrc_ip_id(bytes(bad), flow) == wire.icrc_ip_id(bytes(bad), flow) is None


@settings(max_examples=600, deadline=None, derandomize=True)
@given(data=st.binary(max_size=200))
def test_codec_any_datagram(data: bytes) -> None:
    """Whatever arrives: the same packet or the same malformation reason, the same IP ID."""
    same_decode(data)
    assert native.icrc_ip_id(data, FLOW) == wire.icrc_ip_id(data, FLOW)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32), cut=st.integers(0, 64), flips=st.lists(st.integers(0, 4000), max_size=4))
def test_codec_mutated_packets(seed: int, cut: int, flips: list[int]) -> None:
    """Real packets, truncated and with flipped bits (headers, pad count, TVer, opcodes)."""
    rng = random.Random(seed)
    data = bytearray(wire.encode_bytes(random_packet(rng), FLOW))
    for f in flips:
        if f // 8 < len(data):
            data[f // 8] ^= 1 << (f % 8)
    if cut:
        del data[-cut:]
    same_decode(bytes(data))
    assert native.icrc_ip_id(bytes(data), FLOW) == wire.icrc_ip_id(bytes(data), FLOW)


# --------------------------------------------------------------- RC engines ----


def wc_tuple(is_recv, wc) -> tuple:
    return (
        is_recv,
        wc.wr_id,
        int(wc.status),
        int(wc.opcode),
        wc.byte_len,
        wc.qp_num,
        wc.src_qp,
        wc.imm_data,
        int(wc.wc_flags),
        wc.vendor_err,
    )


def sent_tuple(s) -> tuple:
    return (s.t, s.src, s.data, s.delivered)


class Lockstep:
    """Two Pairs (python, native) built by ``make(engine)`` and stepped together."""

    def __init__(self, make) -> None:
        self.py = make("python")
        self.nat = make("native")
        assert self.py.engine == "python" and self.nat.engine == "native"

    def compare_sent(self, since: int) -> None:
        a, b = self.py.sent, self.nat.sent
        for i in range(since, max(len(a), len(b))):
            assert i < len(a) and i < len(b), (
                f"packet #{i}: python sent {a[i].pkt if i < len(a) else 'nothing'!r}, "
                f"native {b[i].pkt if i < len(b) else 'nothing'!r}"
            )
            assert sent_tuple(b[i]) == sent_tuple(a[i]), (
                f"packet #{i} differs: python {a[i].src}->{a[i].pkt!r}, native {b[i].src}->{b[i].pkt!r}"
            )

    def compare_state(self) -> None:
        for side in ("a", "b"):
            assert [wc_tuple(*x) for x in self.nat.wcs[side]] == [wc_tuple(*x) for x in self.py.wcs[side]], side
            qa, qb = self.py.qp[side], self.nat.qp[side]
            assert qb.state == qa.state, side
            assert qb.error_reason == qa.error_reason, side
            assert qb.counters == qa.counters, side
            assert qb.next_timer() == qa.next_timer(), side
            for lkey, r in self.py.mem[side].by_l.items():
                assert bytes(self.nat.mem[side].by_l[lkey].view) == bytes(r.view), (side, hex(lkey))

    def step(self, hostile=None) -> bool:
        since = len(self.py.sent)
        if hostile is not None:
            dst, pkt = hostile
            self.py.inject(dst, pkt)
            self.nat.inject(dst, pkt)
        more_a = self.py.step()
        more_b = self.nat.step()
        self.compare_sent(since)
        assert more_a == more_b
        return more_a

    def run(
        self,
        max_steps: int = 100_000,
        hostile_rng: random.Random | None = None,
        rate: float = 0.0,
        at: dict | None = None,
    ) -> int:
        """Step both until idle; ``at[k](pair)`` runs on both pairs before step k."""
        steps = 0
        for steps in range(max_steps):
            if at and steps in at:
                at[steps](self.py)
                at[steps](self.nat)
            hostile = None
            if hostile_rng is not None and self.py.sent and hostile_rng.random() < rate:
                hostile = hostile_packet(hostile_rng, self.py)
            if not self.step(hostile) and hostile is None and not (at and any(k > steps for k in at)):
                break
        self.compare_state()
        return steps


def hostile_packet(rng: random.Random, p: Pair) -> tuple[str, Packet]:
    """A well-formed packet for one of the QPs, made by mutating one that was on the link:
    other PSNs (near, old, future), other opcodes, rkeys, addresses, lengths, AETH codes."""
    base = rng.choice(p.sent[-64:])
    src, pkt = base.src, base.pkt
    dst = p.peer(src) if rng.random() < 0.8 else src
    op = pkt.opcode if rng.random() < 0.6 else rng.choice(OPCODES)
    q = Packet(op, p.qp[dst].qp_num, (pkt.psn + rng.choice([0, 0, 1, -1, 2, -5, 100, -300, 1 << 22])) & 0xFFFFFF)
    q.ack_req = rng.random() < 0.5
    mem = p.mem[dst]
    regions = list(mem.by_r.values())
    r = rng.choice(regions) if regions else None
    q.rkey = r.rkey if r is not None and rng.random() < 0.7 else rng.randrange(1 << 32)
    q.va = (r.addr + rng.choice([0, 8, 64, r.length - 8, r.length, -8])) if r is not None else rng.randrange(1 << 64)
    q.va &= (1 << 64) - 1
    q.dma_len = rng.choice([0, 1, 8, 100, 1024, 4096, 70000, 0xFFFFFFFF, pkt.dma_len])
    q.syndrome = rng.choice([0x1F, 0x00, 0x20 | rng.randrange(32), 0x60, 0x61, 0x62, 0x63, 0x64, rng.randrange(256)])
    q.msn = rng.randrange(1 << 24)
    q.imm = rng.randrange(1 << 32)
    q.swap_add, q.compare, q.orig = rng.randrange(1 << 64), rng.randrange(1 << 64), rng.randrange(1 << 64)
    n = rng.choice([0, 1, 8, len(pkt.payload), 1024, 4096, rng.randrange(5000)])
    q.payload = rng.randbytes(n)
    return dst, q


@pytest.mark.parametrize(
    "seed, mtu, drop, duplicate, reorder",
    [
        (0, MTU.IBV_MTU_256, 0.01, 0.01, 0.05),  # with messages of up to 40 packets (AckReq every 32)
        (1, MTU.IBV_MTU_1024, 0.0, 0.0, 0.0),
        (2, MTU.IBV_MTU_256, 0.05, 0.0, 0.0),
        (3, MTU.IBV_MTU_512, 0.0, 0.1, 0.0),
        (4, MTU.IBV_MTU_1024, 0.0, 0.0, 0.3),
        (5, MTU.IBV_MTU_256, 0.03, 0.03, 0.2),
        (6, MTU.IBV_MTU_4096, 0.1, 0.05, 0.1),
        (7, MTU.IBV_MTU_2048, 0.02, 0.2, 0.5),
    ],
)
def test_rc_engines_agree_on_a_lossy_link(seed: int, mtu: MTU, drop: float, duplicate: float, reorder: float) -> None:
    """The same random workload (WRITE, WRITE_WITH_IMM, SEND, SEND_WITH_IMM, READ,
    CMP_AND_SWP, FETCH_ADD, several SGEs, PSNs across the 24-bit wrap) over the same
    lossy link: the same packets, completions, memory and counters."""
    psn = (1 << 24) - 40 - seed

    def make(engine: str) -> Pair:
        p = Pair(
            mtu=mtu,
            psn_a=psn,
            psn_b=(psn * 7) & 0xFFFFFF,
            seed=seed,
            drop=drop,
            duplicate=duplicate,
            reorder=reorder,
            timeout=8,
            retry_cnt=7,
            engine=engine,
        )
        max_len = 40 * 256 if seed == 0 else 3 * (128 << mtu) + 5
        p.work = Workload(p, random.Random(seed), 60, max_len=max_len)  # type: ignore[attr-defined]
        return p

    ls = Lockstep(make)
    ls.run()
    ls.py.work.check(allow_retry_exhaustion=True)  # type: ignore[attr-defined]
    assert len(ls.py.sent) > 60


def test_rc_engines_agree_on_large_reads_with_loss() -> None:
    """READs longer than the window (several requests each) and their resumption after loss."""

    def make(engine: str) -> Pair:
        p = Pair(mtu=MTU.IBV_MTU_256, seed=9, drop=0.02, reorder=0.1, timeout=10, engine=engine)
        n = 256 * 700
        p.local = p.mem["a"].reg(n)  # type: ignore[attr-defined]
        p.remote = p.mem["b"].reg(random.Random(9).randbytes(n))  # type: ignore[attr-defined]
        from aiordma.providers.base import SendWR, WROpcode

        for i, (off, ln) in enumerate([(0, n // 2), (n // 2, n // 2 - 1000), (n - 1000, 1000)]):
            p.post_send(
                "a",
                SendWR(
                    i,
                    WROpcode.IBV_WR_RDMA_READ,
                    [p.local.sge(off, ln)],
                    remote_addr=p.remote.addr + off,
                    rkey=p.remote.rkey,
                ),  # type: ignore[attr-defined]
            )
        return p

    ls = Lockstep(make)
    ls.run()
    assert [wc.status for _, wc in ls.py.wcs["a"]] == [WCStatus.IBV_WC_SUCCESS] * 3
    assert ls.py.local.buf == ls.py.remote.buf  # type: ignore[attr-defined]
    assert sum(1 for s in ls.py.sent if s.pkt.opcode == Opcode.RDMA_READ_REQUEST) > 3


@pytest.mark.parametrize("seed", range(8))
def test_rc_engines_agree_under_hostile_packets(seed: int) -> None:
    """Legitimate traffic with forged packets thrown at both QPs (stale, future and
    current PSNs, foreign and real rkeys, addresses at and past region edges, huge DMA
    lengths, random AETH syndromes): the same reaction, byte for byte, including the
    errors and the flushes that end a QP."""

    def make(engine: str) -> Pair:
        p = Pair(mtu=MTU.IBV_MTU_512, seed=seed, drop=0.02, duplicate=0.02, reorder=0.1, timeout=8, engine=engine)
        p.work = Workload(p, random.Random(seed), 40, max_len=2000)  # type: ignore[attr-defined]
        return p

    ls = Lockstep(make)
    ls.run(hostile_rng=random.Random(1000 + seed), rate=0.3, max_steps=20_000)
    states = {ls.py.qp[s].state for s in "ab"}
    assert states <= {QPState.IBV_QPS_RTS, QPState.IBV_QPS_ERR}


@pytest.mark.parametrize("rnr_retry", [7, 3])
def test_rc_engines_agree_on_receiver_not_ready(rnr_retry: int) -> None:
    """SENDs and WRITE_WITH_IMMs before the receiver posted anything, over a duplicating
    and reordering link: RNR NAKs (and their duplicates), RNR timers, retries (forever,
    or until IBV_WC_RNR_RETRY_EXC_ERR), then the receives arrive."""
    from aiordma.providers.base import RecvWR, SendWR, WROpcode

    def make(engine: str) -> Pair:
        p = Pair(seed=3, duplicate=0.2, reorder=0.3, rnr_retry=rnr_retry, min_rnr_timer=2, engine=engine)
        src = p.mem["a"].reg(random.Random(3).randbytes(20000))
        p.dst = p.mem["b"].reg(20000)  # type: ignore[attr-defined]
        for i in range(6):
            op = WROpcode.IBV_WR_SEND_WITH_IMM if i % 2 else WROpcode.IBV_WR_RDMA_WRITE_WITH_IMM
            p.post_send(
                "a",
                SendWR(
                    i, op, [src.sge(i * 3000, 2500)], imm_data=i, remote_addr=p.dst.addr + i * 3000, rkey=p.dst.rkey
                ),  # type: ignore[attr-defined]
            )
        return p

    def post_receives(p: Pair) -> None:
        for i in range(6):
            p.post_recv("b", RecvWR(100 + i, [p.dst.sge(i * 3000, 3000)]))  # type: ignore[attr-defined]

    ls = Lockstep(make)
    ls.run(at={40: post_receives})
    assert ls.py.a.counters.rnr_naks_rcvd > 3


def test_rc_engines_agree_on_long_messages() -> None:
    """WRITEs and SENDs of 40 to 100 packets (AckReq inside long messages, the send
    window, go-back-N from the middle of a message) over a lossy, reordering link."""
    from aiordma.providers.base import RecvWR, SendWR, WROpcode

    def make(engine: str) -> Pair:
        p = Pair(mtu=MTU.IBV_MTU_256, seed=11, drop=0.02, reorder=0.2, timeout=9, engine=engine)
        p.a.window_pkts = 64
        size = 100 * 256
        src = p.mem["a"].reg(random.Random(11).randbytes(4 * size))
        dst = p.mem["b"].reg(4 * size)
        for i, n in enumerate((40, 64, 65, 100)):
            off = i * size
            if i % 2:
                p.post_recv("b", RecvWR(i, [dst.sge(off, size)]))
                p.post_send("a", SendWR(i, WROpcode.IBV_WR_SEND, [src.sge(off, n * 256 - 3)]))
            else:
                p.post_send(
                    "a",
                    SendWR(
                        i,
                        WROpcode.IBV_WR_RDMA_WRITE,
                        [src.sge(off, n * 256)],
                        remote_addr=dst.addr + off,
                        rkey=dst.rkey,
                    ),
                )
        return p

    ls = Lockstep(make)
    ls.run()
    assert (
        sum(1 for s in ls.py.sent if s.pkt.ack_req and s.pkt.opcode in (Opcode.RDMA_WRITE_MIDDLE, Opcode.SEND_MIDDLE))
        > 3
    )
    assert [wc.status for _, wc in ls.py.wcs["a"]] == [WCStatus.IBV_WC_SUCCESS] * 4


# ------------------------------------------------------ shared receive queue ----


class LockstepSRQ:
    """Two SRQPairs (python, native) built by ``make(engine)`` and stepped together:
    after every step the same datagrams on every link, at the end the same
    completions (and their order across the QPs), memory, counters, QP states and
    SRQ state (WQEs posted, armed limit, limit events)."""

    def __init__(self, make) -> None:
        self.py = make("python")
        self.nat = make("native")
        assert self.py.engine == "python" and self.nat.engine == "native"

    def step(self) -> bool:
        since = [len(p.sent) for p in self.py.pairs]
        more_a = self.py.step()
        more_b = self.nat.step()
        for i, (a, b) in enumerate(zip(self.py.pairs, self.nat.pairs)):
            for k in range(since[i], max(len(a.sent), len(b.sent))):
                assert k < len(a.sent) and k < len(b.sent), f"pair {i} packet #{k}: one engine sent nothing"
                assert sent_tuple(b.sent[k]) == sent_tuple(a.sent[k]), (
                    f"pair {i} packet #{k} differs: python {a.sent[k].src}->{a.sent[k].pkt!r}, "
                    f"native {b.sent[k].src}->{b.sent[k].pkt!r}"
                )
        assert more_a == more_b
        return more_a

    def compare_state(self) -> None:
        assert [(i, wc_tuple(True, wc)) for i, wc in self.nat.order] == [
            (i, wc_tuple(True, wc)) for i, wc in self.py.order
        ]
        for i, (a, b) in enumerate(zip(self.py.pairs, self.nat.pairs)):
            for side in ("a", "b"):
                assert [wc_tuple(*x) for x in b.wcs[side]] == [wc_tuple(*x) for x in a.wcs[side]], (i, side)
                qa, qb = a.qp[side], b.qp[side]
                assert (qb.state, qb.error_reason, qb.counters) == (qa.state, qa.error_reason, qa.counters), (i, side)
                assert qb.next_timer() == qa.next_timer(), (i, side)
            for lkey, r in a.mem["a"].by_l.items():
                assert bytes(b.mem["a"].by_l[lkey].view) == bytes(r.view), (i, hex(lkey))
        for lkey, r in self.py.mem_b.by_l.items():
            assert bytes(self.nat.mem_b.by_l[lkey].view) == bytes(r.view), hex(lkey)
        s, t = self.py.srq, self.nat.srq
        assert (len(t), t.limit, t.limit_events, t.users) == (len(s), s.limit, s.limit_events, s.users)

    def run(self, at: dict | None = None, max_steps: int = 100_000) -> int:
        """Step both until idle; ``at[k](sp)`` runs on both before step k."""
        steps = 0
        for steps in range(max_steps):
            if at and steps in at:
                at[steps](self.py)
                at[steps](self.nat)
            if not self.step() and not (at and any(k > steps for k in at)):
                break
        self.compare_state()
        return steps


def _srq_workload(sp, rng: random.Random, n_msgs: int, max_len: int) -> dict:
    """Messages from every sender into the shared SRQ (SEND, SEND_WITH_IMM,
    WRITE_WITH_IMM, and plain WRITEs that take nothing), posted up front; receive
    buffers posted to the SRQ in bursts by the returned ``at`` schedule (some
    messages meet an empty SRQ: RNR), the limit armed and re-armed along the way."""
    from aiordma.providers.base import RecvWR, SendWR, WROpcode

    slot = max_len
    target = sp.mem_b.reg(slot * (n_msgs + 8))
    sp.target = target
    for i, p in enumerate(sp.pairs):
        src = p.mem["a"].reg(rng.randbytes(max_len))
        for k in range(n_msgs // len(sp.pairs)):
            n = rng.choice([0, 1, 100, max_len // 2, max_len, rng.randrange(max_len + 1)])
            op = rng.choice(
                [WROpcode.IBV_WR_SEND, WROpcode.IBV_WR_SEND_WITH_IMM, WROpcode.IBV_WR_RDMA_WRITE_WITH_IMM]
                + [WROpcode.IBV_WR_RDMA_WRITE] * (k % 5 == 0)
            )
            at_off = rng.randrange(n_msgs) * slot
            p.post_send(
                "a",
                SendWR(
                    1000 * i + k,
                    op,
                    [src.sge(0, n)],
                    imm_data=k,
                    remote_addr=target.addr + at_off + (slot - n if n <= slot else 0),
                    rkey=target.rkey,
                ),
            )
    sp.posted = 0

    def post(count: int):
        def go(sp2) -> None:  # (on each engine's SRQPairs: each counts its own)
            for _ in range(count):
                if len(sp2.srq) < 16:
                    j = sp2.posted % n_msgs
                    sp2.posted += 1
                    sp2.srq.post_recv(RecvWR(j, [sp2.target.sge(j * slot, slot)]))

        return go

    def arm(limit: int):
        return lambda sp2: sp2.srq.arm(limit)

    at: dict = {0: post(6), 1: arm(3)}
    step = 0
    for _ in range(n_msgs):
        step += rng.randrange(20, 200)
        at[step] = post(rng.randrange(1, 8))
        if rng.random() < 0.3:
            at[step + 1] = arm(rng.randrange(1, 8))
    return at


@pytest.mark.parametrize(
    "seed, mtu, drop, duplicate, reorder",
    [
        (0, MTU.IBV_MTU_1024, 0.0, 0.0, 0.0),
        (1, MTU.IBV_MTU_256, 0.03, 0.02, 0.1),
        (2, MTU.IBV_MTU_512, 0.0, 0.2, 0.3),
        (3, MTU.IBV_MTU_4096, 0.05, 0.0, 0.05),
    ],
)
def test_rc_engines_agree_on_a_shared_receive_queue(
    seed: int, mtu: MTU, drop: float, duplicate: float, reorder: float
) -> None:
    """Three QPs taking their receives from one SRQ over lossy links: messages that
    find the SRQ empty (RNR NAKs, retries), bursts of receives posted meanwhile, the
    limit armed and firing: the same packets, completions (in the same order across
    the QPs), memory and SRQ state."""

    def make(engine: str):
        from .rc_harness import SRQPairs

        sp = SRQPairs(
            3,
            engine=engine,
            srq_max_wr=16,
            srq_max_sge=2,
            seed=seed,
            mtu=mtu,
            drop=drop,
            duplicate=duplicate,
            reorder=reorder,
            timeout=8,
            rnr_retry=7,
            min_rnr_timer=1,
        )
        sp.at = _srq_workload(sp, random.Random(seed), 30, 3000)
        return sp

    ls = LockstepSRQ(make)
    ls.run(at=ls.py.at)
    assert ls.py.srq.limit_events >= 1
    assert sum(p.b.counters.rnr_naks_sent for p in ls.py.pairs) > 0
    assert len(ls.py.order) > 10


def test_rc_engines_agree_when_an_srq_qp_fails() -> None:
    """One of the QPs goes to IBV_QPS_ERR in the middle of a multi-packet SEND (an
    invalid request thrown at it): it flushes the WQE it had taken, the SRQ keeps
    the others for the QPs still running; the same on both engines."""
    from aiordma.providers.base import RecvWR, SendWR, WROpcode

    def make(engine: str):
        from .rc_harness import SRQPairs

        sp = SRQPairs(2, engine=engine, srq_max_wr=8, seed=4, mtu=MTU.IBV_MTU_256, reorder=0.1, timeout=8)
        dst = sp.mem_b.reg(8 * 2048)
        for j in range(8):
            sp.srq.post_recv(RecvWR(j, [dst.sge(2048 * j, 2048)]))
        for i, p in enumerate(sp.pairs):
            src = p.mem["a"].reg(random.Random(i).randbytes(2000))
            for k in range(3):
                p.post_send("a", SendWR(10 * i + k, WROpcode.IBV_WR_SEND, [src.sge(0, 2000 - 300 * k)]))
        return sp

    def hostile(sp) -> None:
        p = sp.pairs[0]
        p.inject("b", Packet(Opcode.RDMA_WRITE_MIDDLE, p.b.qp_num, p.b.epsn, payload=b"x" * 256))

    ls = LockstepSRQ(make)
    ls.run(at={3: hostile})  # (b0 is inside its third SEND then)
    p0, p1 = ls.py.pairs
    assert p0.b.state == QPState.IBV_QPS_ERR and "inside a multi-packet SEND" in p0.b.error_reason
    assert p1.b.state == QPState.IBV_QPS_RTS
    assert [wc.status for wc in p0.recv_wcs("b")] == [WCStatus.IBV_WC_SUCCESS] * 2 + [WCStatus.IBV_WC_WR_FLUSH_ERR]
    assert [wc.status for wc in p1.recv_wcs("b")] == [WCStatus.IBV_WC_SUCCESS] * 3
    assert len(ls.py.srq) == 2  # 8 posted, 6 taken: the failure flushed none of the SRQ's
