"""An in-memory link between two sans-IO RC queue pairs, for tests.

Like aioquic's in-memory ``client_and_server`` helpers: two
:class:`~aiordma.providers.soft.rc.RCQueuePair` engines, each with its own
tiny memory table (its own "host"), joined by a simulated link whose clock
(``now``) only moves when the test moves it. Every packet goes through the
real codec (``wire.encode_bytes`` → ``wire.icrc_ok`` → ``wire.decode``), so
what the engines exchange is exactly what would be on the wire, copied at
transmit time like a NIC's DMA read.

Faults come from a seeded :class:`random.Random`: ``drop``, ``duplicate`` and
``reorder`` (a reordered packet is held back by a random extra delay), plus
``filters`` for deterministic surgery on single packets.

:class:`SRQPairs` is several such pairs whose ``b`` sides are one host: one
memory (one protection domain) and one shared receive queue that every ``b``
QP takes its receives from, the pairs stepped on one clock.

Either engine runs behind the same interface: ``Pair(engine="python")`` uses
:class:`RCQueuePair`, ``engine="native"`` the C port (``RCCore`` of the
test-only extension ``tests.native._testing``: rc.c without the NIC, wrapped by
:class:`NativeRC`, which packets reach as datagrams and leave as the datagrams
the C encoder made). The default is ``AIORDMA_SOFT_ENGINE``, else native when
it is built; the differential tests run both on the same script and compare
what they sent, completed and wrote.

setup.py builds ``_testing`` in place whenever it builds the native engine in
place (``build_ext --inplace``, ``pip install -e``): where the engine imports
and ``_testing`` does not, that build failed, and importing this module fails
rather than letting the native half of the tests skip (as CI's check that the
engine imports in every venv keeps its own failure from passing as skips).
"""

from __future__ import annotations

import heapq
import itertools
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from aiordma.providers.base import (
    ACCESS_ALL,
    MTU,
    SGE,
    Access,
    QPAttr,
    QPCap,
    QPState,
    WorkCompletion,
    gid_from_ipv4,
)
from aiordma.providers.soft import wire
from aiordma.providers.soft.engine import native_status
from aiordma.providers.soft.rc import Counters, RCQueuePair
from aiordma.providers.soft.srq import RCSharedReceiveQueue
from aiordma.providers.soft.wire import Packet

try:
    from aiordma.providers.soft._native import _engine
except ImportError:  # the native engine is not built: the Python one only
    _engine = None  # type: ignore[assignment]
try:
    from tests.native import _testing as native
except ImportError as e:
    if _engine is not None:
        raise ImportError(
            "the native engine is built but not its test-only RC core tests.native._testing "
            "(python setup.py build_ext --inplace, or pip install -e ., builds both; its error is in that output)"
        ) from e
    native = None  # type: ignore[assignment]

ENGINES = ("python", "native") if native is not None else ("python",)


def default_engine() -> str:
    """``AIORDMA_SOFT_ENGINE``, else native when it is built."""
    want = os.environ.get("AIORDMA_SOFT_ENGINE")
    if want:
        if want == "native" and native is None:
            raise RuntimeError(f"AIORDMA_SOFT_ENGINE=native: {native_status()[1]}")
        return want
    return "native" if native is not None else "python"


@dataclass(eq=False)
class FakeRegion:
    """A registered region over a bytearray at a made-up virtual address."""

    addr: int
    length: int
    access: Access
    lkey: int
    rkey: int
    buf: bytearray

    @property
    def view(self) -> memoryview:
        return memoryview(self.buf)

    def sge(self, offset: int = 0, length: int | None = None) -> SGE:
        if length is None:
            length = self.length - offset
        assert 0 <= offset and offset + length <= self.length
        return SGE(self.addr + offset, length, self.lkey)


class FakeMemory:
    """The MemoryTable protocol over FakeRegions (one protection domain); with
    ``native``, the same regions registered in a protection domain of the C engine."""

    def __init__(self, base: int, key_base: int, native_pd: bool = False) -> None:
        self._next_addr = base
        self._keys = itertools.count(key_base)
        self.by_l: dict[int, FakeRegion] = {}
        self.by_r: dict[int, FakeRegion] = {}
        self.native = native.SansIOMemory() if native_pd else None

    def add(self, r: FakeRegion) -> FakeRegion:
        """Register a region built by hand (its buffer is used in place)."""
        self.by_l[r.lkey] = r
        self.by_r[r.rkey] = r
        if self.native is not None:
            self.native.register(r.addr, r.buf, int(r.access), r.lkey, r.rkey)
        return r

    def reg(self, size_or_buf: int | bytes | bytearray, access: Access = ACCESS_ALL) -> FakeRegion:
        """Register ``size_or_buf`` (a bytearray is used in place; bytes or a size are copied/allocated)."""
        buf = size_or_buf if isinstance(size_or_buf, bytearray) else bytearray(size_or_buf)
        # leave a gap between regions so an out-of-bounds access cannot land in a neighbour
        addr = self._next_addr
        self._next_addr += (len(buf) + 0x10000) & ~0xFFF
        r = FakeRegion(addr, len(buf), Access(access), next(self._keys), next(self._keys) | 0x80000000, buf)
        return self.add(r)

    def dereg(self, r: FakeRegion) -> None:
        self.by_l.pop(r.lkey, None)
        self.by_r.pop(r.rkey, None)
        if self.native is not None:
            self.native.deregister(r.lkey)

    def by_lkey(self, lkey: int) -> FakeRegion | None:
        return self.by_l.get(lkey)

    def by_rkey(self, rkey: int) -> FakeRegion | None:
        return self.by_r.get(rkey)


class NativeRC:
    """The C engine's RC queue pair (``RCCore`` of ``tests.native._testing``) behind the interface of
    :class:`RCQueuePair` that the harness and the tests use. Packets arrive as
    datagrams (a :class:`Packet` handed to :meth:`receive` is encoded on the
    peer's flow first) and leave as the datagrams the C encoder made."""

    def __init__(
        self,
        qp_num: int,
        memory: FakeMemory,
        cap: QPCap | None,
        sq_sig_all: bool,
        tx: wire.Flow,
        rx: wire.Flow,
        srq: Any = None,
    ) -> None:
        assert memory.native is not None, "a NativeRC needs FakeMemory(native_pd=True)"
        self.core = native.RCCore(qp_num, memory.native, cap or QPCap(), sq_sig_all, srq)
        self.core.set_flow(tx)
        self.tx, self.rx = tx, rx
        self.qp_num = qp_num

    # verbs
    def modify(self, attr: QPAttr, now: float = 0.0) -> None:
        self.core.modify(attr, now)

    def query(self) -> QPAttr:
        return self.core.query()

    def post_send(self, wr: Any, now: float = 0.0) -> None:
        self.core.post_send(wr, now)

    def post_recv(self, wr: Any) -> None:
        self.core.post_recv(wr)

    def close(self) -> None:
        self.core.close()

    # sans-IO
    def receive(self, pkt: Packet, now: float) -> None:
        self.core.receive_datagram(wire.encode_bytes(pkt, self.rx), now)

    def receive_datagram(self, data: bytes, now: float) -> None:
        self.core.receive_datagram(data, now)

    def transmit_datagrams(self, now: float) -> list[bytes]:
        return self.core.transmit(now)  # type: ignore[no-any-return]

    def transmit(self, now: float) -> list[Packet]:
        return [wire.decode(d) for d in self.core.transmit(now)]

    def take_completions(self) -> list:
        return self.core.take_completions()  # type: ignore[no-any-return]

    def next_timer(self) -> float | None:
        return self.core.next_timer()  # type: ignore[no-any-return]

    def on_timer(self, now: float) -> None:
        self.core.on_timer(now)

    # state, read-only (what the tests look at)
    @property
    def state(self) -> QPState:
        return self.core.state  # type: ignore[no-any-return]

    @property
    def error_reason(self) -> str | None:
        return self.core.error_reason  # type: ignore[no-any-return]

    @property
    def counters(self) -> Counters:
        return Counters(**self.core.counters)

    @property
    def sq(self) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(wr_id=w, psn_first=f, npkts=n, resp_pkts=r, req_pkts=q)
            for w, f, n, r, q in self.core.sq_info()
        ]

    @property
    def rq(self) -> list[int]:
        return list(range(self.core.rq_len))

    @property
    def cur_write(self) -> bool | None:
        return True if self.core.has_cur_write else None

    def __getattr__(self, name: str) -> Any:  # epsn, next_psn, una_psn, cur_recv_offset, mtu, window_pkts
        return getattr(self.core, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("window_pkts", "mtu"):
            setattr(self.core, name, value)
        else:
            object.__setattr__(self, name, value)


def make_qp(
    engine: str,
    qp_num: int,
    memory: FakeMemory,
    cap: QPCap | None,
    sq_sig_all: bool,
    tx: wire.Flow,
    rx: wire.Flow,
    srq: Any = None,
) -> Any:
    """An RC queue pair of ``engine`` over ``memory`` (its datagrams on flow ``tx``),
    taking its receives from ``srq`` (one of :func:`make_srq`'s) when given."""
    if engine == "native":
        return NativeRC(qp_num, memory, cap, sq_sig_all, tx, rx, srq)
    return RCQueuePair(qp_num, memory, cap, sq_sig_all, srq)


def make_srq(engine: str, srq_num: int, memory: FakeMemory, max_wr: int, max_sge: int) -> Any:
    """A shared receive queue of ``engine`` over ``memory``: ``post_recv``, ``arm``,
    ``len()``, ``limit``, ``limit_events``, ``users``."""
    if engine == "native":
        assert memory.native is not None, "a native SRQ needs FakeMemory(native_pd=True)"
        return native.SansIOSRQ(srq_num, memory.native, max_wr, max_sge)
    return RCSharedReceiveQueue(srq_num, memory, max_wr, max_sge)


def transmit_datagrams(qp: Any, flow: wire.Flow, now: float) -> list[bytes]:
    """What ``qp`` transmits now, as datagrams on ``flow`` (encoded by its engine)."""
    if isinstance(qp, NativeRC):
        return qp.transmit_datagrams(now)
    return [wire.encode_bytes(pkt, flow) for pkt in qp.transmit(now)]


class LivelockError(AssertionError):
    pass


@dataclass
class Sent:
    t: float
    src: str
    pkt: Packet
    delivered: bool
    data: bytes = b""


class Pair:
    """Two connected RC QPs, ``a`` and ``b``, and the link between them."""

    FLOWS = {
        "a": wire.Flow("10.0.0.1", "10.0.0.2", 49152, 4791),
        "b": wire.Flow("10.0.0.2", "10.0.0.1", 49153, 4791),
    }

    def __init__(
        self,
        *,
        mtu: MTU = MTU.IBV_MTU_1024,
        psn_a: int = 0,
        psn_b: int = 0,
        access_a: Access = ACCESS_ALL,
        access_b: Access = ACCESS_ALL,
        timeout: int = 10,
        retry_cnt: int = 7,
        rnr_retry: int = 7,
        min_rnr_timer: int = 1,
        max_rd_atomic: int = 16,
        cap: QPCap | None = None,
        sq_sig_all: bool = False,
        seed: int = 0,
        drop: float = 0.0,
        duplicate: float = 0.0,
        reorder: float = 0.0,
        latency: float = 5e-6,
        jitter: float = 50e-6,
        connect: bool = True,
        engine: str | None = None,
        qpns: tuple[int, int] = (0xABC123, 0x00D00D),
        mem_b: FakeMemory | None = None,
        srq_b: Any = None,
    ) -> None:
        cap = cap or QPCap(max_send_wr=1024, max_recv_wr=1024, max_send_sge=8, max_recv_sge=8)
        self.engine = engine or default_engine()
        nat = self.engine == "native"
        self.mem = {
            "a": FakeMemory(0x7F0000000000, 0x1000, nat),
            "b": mem_b if mem_b is not None else FakeMemory(0x7E0000000000, 0x2000, nat),
        }
        F = self.FLOWS
        self.qp = {
            "a": make_qp(self.engine, qpns[0], self.mem["a"], cap, sq_sig_all, F["a"], F["b"]),
            "b": make_qp(self.engine, qpns[1], self.mem["b"], cap, sq_sig_all, F["b"], F["a"], srq_b),
        }
        self.a, self.b = self.qp["a"], self.qp["b"]
        self.now = 0.0
        self.rng = random.Random(seed)
        self.drop, self.duplicate, self.reorder = drop, duplicate, reorder
        self.latency, self.jitter = latency, jitter
        #: filter(src_name, packet) -> False drops the packet (applied before random faults)
        self.filters: list[Callable[[str, Packet], bool]] = []
        #: delay(src_name, packet) -> extra seconds on the link for that packet (reordering by hand)
        self.delay: Callable[[str, Packet], float] | None = None
        self.sent: list[Sent] = []
        self.inflight: list[tuple[float, int, str, bytes]] = []
        self._seq = itertools.count()
        self.wcs: dict[str, list[tuple[bool, WorkCompletion]]] = {"a": [], "b": []}
        self.steps = 0
        if connect:
            self.connect(
                mtu=mtu,
                psn_a=psn_a,
                psn_b=psn_b,
                access_a=access_a,
                access_b=access_b,
                timeout=timeout,
                retry_cnt=retry_cnt,
                rnr_retry=rnr_retry,
                min_rnr_timer=min_rnr_timer,
                max_rd_atomic=max_rd_atomic,
            )

    # ---------------------------------------------------------- set-up ----
    def connect(
        self, *, mtu, psn_a, psn_b, access_a, access_b, timeout, retry_cnt, rnr_retry, min_rnr_timer, max_rd_atomic
    ) -> None:
        psn = {"a": psn_a, "b": psn_b}
        access = {"a": access_a, "b": access_b}
        for name in ("a", "b"):
            self.qp[name].modify(QPAttr(qp_state=QPState.IBV_QPS_INIT, qp_access_flags=access[name]))
        for name, peer in (("a", "b"), ("b", "a")):
            qp = self.qp[name]
            qp.modify(
                QPAttr(
                    qp_state=QPState.IBV_QPS_RTR,
                    path_mtu=mtu,
                    dest_qp_num=self.qp[peer].qp_num,
                    rq_psn=psn[peer],
                    dgid=gid_from_ipv4(self.FLOWS[peer].src),
                    max_dest_rd_atomic=max_rd_atomic,
                    min_rnr_timer=min_rnr_timer,
                )
            )
            qp.modify(
                QPAttr(
                    qp_state=QPState.IBV_QPS_RTS,
                    sq_psn=psn[name],
                    timeout=timeout,
                    retry_cnt=retry_cnt,
                    rnr_retry=rnr_retry,
                    max_rd_atomic=max_rd_atomic,
                )
            )

    def peer(self, name: str) -> str:
        return "b" if name == "a" else "a"

    # ------------------------------------------------------- the link ----
    def post_send(self, name: str, wr) -> None:
        self.qp[name].post_send(wr, self.now)

    def post_recv(self, name: str, wr) -> None:
        self.qp[name].post_recv(wr)

    def collect(self) -> None:
        """Move the completions both engines produced into ``wcs``."""
        for name, qp in self.qp.items():
            wcs = qp.take_completions()
            if wcs:
                self.wcs[name].extend(wcs)

    def pump(self) -> None:
        """Move what both engines want to transmit onto the link."""
        for name, qp in self.qp.items():
            for data in transmit_datagrams(qp, self.FLOWS[name], self.now):
                self._send(name, wire.decode(data), data)
        self.collect()

    def _send(self, src: str, pkt: Packet, data: bytes | None = None) -> None:
        peer_qpn = self.qp[self.peer(src)].qp_num
        assert pkt.dest_qp == peer_qpn, f"{src} sent {pkt!r} to QP 0x{pkt.dest_qp:06x}, peer is 0x{peer_qpn:06x}"
        if data is None:
            data = wire.encode_bytes(pkt, self.FLOWS[src])
        ok = all(f(src, pkt) for f in self.filters)
        if ok and self.drop and self.rng.random() < self.drop:
            ok = False
        self.sent.append(Sent(self.now, src, wire.decode(data), ok, data))
        if not ok:
            return
        copies = 2 if self.duplicate and self.rng.random() < self.duplicate else 1
        for _ in range(copies):
            delay = self.latency + (self.delay(src, pkt) if self.delay is not None else 0.0)
            if self.reorder and self.rng.random() < self.reorder:
                delay += self.rng.uniform(0, self.jitter)
            heapq.heappush(self.inflight, (self.now + delay, next(self._seq), self.peer(src), data))

    def inject(self, dst: str, pkt: Packet) -> None:
        """Deliver a hand-made packet to ``dst`` now (through the codec)."""
        data = wire.encode_bytes(pkt, self.FLOWS[self.peer(dst)])
        self._deliver(dst, data)
        self.collect()

    def _deliver(self, dst: str, data: bytes) -> None:
        assert wire.icrc_ok(data, self.FLOWS[self.peer(dst)]), "ICRC mismatch on the simulated link"
        qp = self.qp[dst]
        if isinstance(qp, NativeRC):
            qp.receive_datagram(data, self.now)
        else:
            qp.receive(wire.decode(data), self.now)

    def next_timer(self) -> float | None:
        ts = [t for t in (qp.next_timer() for qp in self.qp.values()) if t is not None]
        return min(ts) if ts else None

    def next_event(self) -> float | None:
        """When :meth:`step` would act next: the next arrival or timer (None: idle)."""
        timer = self.next_timer()
        arrival = self.inflight[0][0] if self.inflight else None
        ts = [t for t in (timer, arrival) if t is not None]
        return min(ts) if ts else None

    def step(self) -> bool:
        """Deliver the next batch of packets or fire the next timer; False when idle."""
        self.steps += 1
        self.pump()
        timer = self.next_timer()
        if self.inflight and (timer is None or self.inflight[0][0] <= timer):
            t = self.inflight[0][0]
            self.now = max(self.now, t)
            # everything that arrives at the same instant is one receive batch (like the NIC thread)
            while self.inflight and self.inflight[0][0] <= t:
                _, _, dst, data = heapq.heappop(self.inflight)
                self._deliver(dst, data)
        elif timer is not None:
            self.now = max(self.now, timer)
            for qp in self.qp.values():
                t = qp.next_timer()
                if t is not None and t <= self.now:
                    qp.on_timer(self.now)
        else:
            self.collect()
            return False
        self.collect()
        return True

    def run(
        self,
        until: Callable[[], bool] | None = None,
        max_steps: int = 200_000,
        max_time: float | None = None,
    ) -> None:
        """Step until idle (or ``until()`` holds); raise LivelockError past ``max_steps``."""
        for _ in range(max_steps):
            if until is not None and until():
                return
            if max_time is not None and self.now > max_time:
                return
            if not self.step():
                return
        raise LivelockError(f"no quiescence after {max_steps} steps (now={self.now:.6f})")

    def advance(self, dt: float) -> None:
        """Run the link up to ``now + dt``, leaving later events pending."""
        end = self.now + dt
        while True:
            self.pump()
            timer = self.next_timer()
            nxt = min(
                [x for x in (timer, self.inflight[0][0] if self.inflight else None) if x is not None], default=None
            )
            if nxt is None or nxt > end:
                break
            self.step()
        self.now = max(self.now, end)
        self.collect()

    # ------------------------------------------------------ completions ----
    def send_wcs(self, name: str) -> list[WorkCompletion]:
        return [wc for is_recv, wc in self.wcs[name] if not is_recv]

    def recv_wcs(self, name: str) -> list[WorkCompletion]:
        return [wc for is_recv, wc in self.wcs[name] if is_recv]

    def sent_by(self, src: str) -> list[Packet]:
        return [s.pkt for s in self.sent if s.src == src]


class SRQPairs:
    """``n`` connected :class:`Pair` s whose ``b`` QPs are on one host: one memory
    (``mem_b``, one protection domain) and one shared receive queue (``srq``) they
    all take their receives from. ``pairs[i].a`` sends to ``pairs[i].b``; every
    pair's link has its own seeded faults; one clock: :meth:`step` acts on the
    pair whose next arrival or timer comes first."""

    def __init__(
        self,
        n: int = 2,
        *,
        engine: str | None = None,
        srq_max_wr: int = 64,
        srq_max_sge: int = 4,
        seed: int = 0,
        **pair_kw: Any,
    ) -> None:
        self.engine = engine or default_engine()
        self.mem_b = FakeMemory(0x7E0000000000, 0x2000, self.engine == "native")
        self.srq = make_srq(self.engine, 0x5A5A5A, self.mem_b, srq_max_wr, srq_max_sge)
        self.pairs = [
            Pair(
                engine=self.engine,
                qpns=(0xA00000 + i, 0xB00000 + i),
                mem_b=self.mem_b,
                srq_b=self.srq,
                seed=seed * 100 + i,
                **pair_kw,
            )
            for i in range(n)
        ]
        self.now = 0.0
        #: the receive completions of the ``b`` QPs in the order they were written,
        #: across pairs: ``(pair index, wc)``
        self.order: list[tuple[int, WorkCompletion]] = []
        self._seen = [0] * n

    def _record(self) -> None:
        for i, p in enumerate(self.pairs):
            wcs = p.wcs["b"]
            for is_recv, wc in wcs[self._seen[i] :]:
                if is_recv:
                    self.order.append((i, wc))
            self._seen[i] = len(wcs)

    def step(self) -> bool:
        """One step of the pair whose next event is earliest; False when all are idle."""
        for p in self.pairs:
            p.pump()
        self._record()
        best: Pair | None = None
        when = 0.0
        for p in self.pairs:
            t = p.next_event()
            if t is not None and (best is None or t < when):
                best, when = p, t
        if best is None:
            for p in self.pairs:
                p.collect()
            self._record()
            return False
        best.step()
        self._record()
        self.now = max(self.now, best.now)
        for p in self.pairs:
            p.now = self.now
        return True

    def run(self, until: Callable[[], bool] | None = None, max_steps: int = 200_000) -> None:
        for _ in range(max_steps):
            if until is not None and until():
                return
            if not self.step():
                return
        raise LivelockError(f"no quiescence after {max_steps} steps (now={self.now:.6f})")

    def recv_wcs(self) -> list[WorkCompletion]:
        """Every receive completion of the ``b`` QPs, in the order they were written."""
        return [wc for _, wc in self.order]


__all__ = [
    "ENGINES",
    "FakeMemory",
    "FakeRegion",
    "LivelockError",
    "NativeRC",
    "Pair",
    "SRQPairs",
    "Sent",
    "default_engine",
    "make_qp",
    "make_srq",
    "transmit_datagrams",
]
