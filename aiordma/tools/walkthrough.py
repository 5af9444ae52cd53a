"""One RDMA Write, walked through its eight steps from the soft device's live trace.

The classic account of RDMA follows a single Write through eight stations::

    1 the application builds a WQE       5 the network carries a UDP datagram to port 4791
    2 it rings the doorbell               6 the remote NIC checks the rkey
    3 the NIC reads the buffer (lkey)     7 the remote NIC DMAs the data into memory
    4 the NIC builds BTH + RETH + ICRC    8 an ACK comes back and becomes a CQE

:func:`trace_one_write` makes that happen for real: two soft RoCEv2 devices
(two "hosts" on 127.0.0.N:4791), an aiordma server exposing a buffer, a
client that ``await conn.write(...)``\\ s into it. A tracer installed with
:meth:`SoftDevice.set_tracer <aiordma.providers.soft.device.SoftDevice.set_tracer>`
records what the requester's and the responder's NIC engines do, and the
result is a list of :class:`Step` with the values that were actually used:
the WQE, the lkey lookup, the bytes of the BTH/RETH/ICRC that went on the
wire, the UDP flow, the rkey check, the DMA, the ACK and the CQE.

:func:`render_steps` turns the steps into the text ``aiordma demo`` prints.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..providers.base import Access, SendFlags, WCOpcode, WCStatus, WROpcode, gid_str
from ..providers.soft import wire
from ..providers.soft.trace import TraceEvent

__all__ = ["DEFAULT_PAYLOAD", "Step", "WalkthroughError", "hexdump", "render_steps", "trace_one_write"]

#: what the seed's C demo writes (without its NUL)
DEFAULT_PAYLOAD = b"hello from RDMA client"

STEP_TITLES = {
    1: "The application builds a WQE and puts it on the send queue",
    2: "The doorbell: tell the NIC there is new work",
    3: "The NIC reads the local buffer, checked by its lkey",
    4: "The NIC builds the packet: BTH + RETH + payload + ICRC",
    5: "The network carries it: RoCEv2 = a UDP datagram to port 4791",
    6: "The remote NIC finds the QP and checks the rkey",
    7: "The remote NIC DMAs the data straight into remote memory",
    8: "The ACK comes back and becomes a CQE",
}

STEP_WHERE = {
    1: "requester: application (CPU)",
    2: "requester: application -> NIC",
    3: "requester: NIC",
    4: "requester: NIC",
    5: "network",
    6: "responder: NIC",
    7: "responder: NIC -> memory",
    8: "responder NIC -> requester NIC -> CQ",
}

_BTH = struct.Struct(">BBHII")
_RETH = struct.Struct(">QII")
_AETH = struct.Struct(">I")
_ICRC = struct.Struct("<I")


_PROGRESS_TEXT = {
    "event": "the CQ's completion-channel fd woke the event loop, which polled the CQ",
    "thread": "the polling thread found it and handed it to the event loop",
    "busy": "the busy-polling task found it",
}


class WalkthroughError(RuntimeError):
    """The traced RDMA Write did not go through all eight steps."""


@dataclass
class Step:
    """One of the eight steps, with the values the trace recorded.

    ``fields`` holds machine-readable values (ints, bytes, strings) for tests
    and tools; ``rows`` the same for people, as ``(label, text)``;
    ``hexdumps`` labelled raw bytes; ``t_us`` the time since the WQE was
    built (microseconds) when the step's main event happened.
    """

    number: int
    title: str
    where: str
    fields: dict[str, Any]
    rows: list[tuple[str, str]]
    hexdumps: list[tuple[str, bytes]] = field(default_factory=list)
    note: str = ""
    t_us: float | None = None


@dataclass
class _Event:
    name: TraceEvent
    qpn: int
    t_ns: int
    thread: str
    f: dict[str, Any]


def _copy_packet(pkt: wire.Packet) -> wire.Packet:
    # the payload may be a view into the NIC's receive buffer or the sender's memory
    return dataclasses.replace(pkt, payload=bytes(pkt.payload))


class _Recorder:
    """The tracer: copies what it is shown (the NIC reuses its buffers) and
    keeps the events of the two queue pairs under study."""

    def __init__(self, qpns: set[int], pds: dict[int, Any]) -> None:
        self.qpns = qpns
        self.pds = pds  # qpn -> protection domain (to resolve lkeys/rkeys as the NIC does)
        self.events: list[_Event] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()

    def __call__(self, event: TraceEvent, **f: Any) -> None:
        try:
            if event == TraceEvent.CQE:
                qpn = f["wc"].qp_num
            else:
                qpn = f.get("qpn", -1)
            if qpn not in self.qpns:
                return
            g: dict[str, Any] = {}
            for k, v in f.items():
                if isinstance(v, wire.Packet):
                    g[k] = _copy_packet(v)
                elif k == "wc":
                    g[k] = dataclasses.replace(v)
                elif k == "wr":
                    g[k] = dataclasses.replace(v, sg_list=[dataclasses.replace(s) for s in v.sg_list])
                elif k == "wqe":
                    # what the NIC reads: the WQE's gather list (lkey-checked memory views)
                    data = b"".join(bytes(s) for s in v.segments)
                    g["wr"] = dataclasses.replace(v.wr, sg_list=[dataclasses.replace(s) for s in v.wr.sg_list])
                    g["gathered"] = data
                elif k == "region":
                    g["region"] = (v.addr, v.length, int(v.access), getattr(v, "lkey", None), getattr(v, "rkey", None))
                    g["region_bytes"] = bytes(v.view[: 1 << 16])
                elif k == "flow":
                    g["flow"] = (v.src, v.sport, v.dst, v.dport)
                    g["flow_obj"] = v
                else:
                    g[k] = v
            if event == TraceEvent.RKEY_CHECK:
                pd = self.pds.get(qpn)
                mr = pd.by_rkey(f["pkt"].rkey) if pd is not None else None
                g["region"] = None if mr is None else (mr.addr, mr.length, int(mr.access), mr.lkey, mr.rkey)
            elif event == TraceEvent.LKEY_READ:
                pd = self.pds.get(qpn)
                sg = f["wqe"].wr.sg_list
                mr = pd.by_lkey(sg[0].lkey) if (pd is not None and sg) else None
                g["mr"] = None if mr is None else (mr.addr, mr.length, int(mr.access), mr.lkey, mr.rkey)
            ev = _Event(event, qpn, time.perf_counter_ns(), threading.current_thread().name, g)
            with self._lock:
                self.events.append(ev)
        except BaseException as e:  # a tracer must never break the NIC
            self.errors.append(e)


# ------------------------------------------------------------------ helpers ----


def hexdump(data: bytes, base: int | None = None, width: int = 16, limit: int = 256) -> list[str]:
    """``xxd``-like lines: offset (or address), hex bytes, ASCII."""
    out = []
    shown = data[:limit]
    for i in range(0, len(shown), width):
        chunk = shown[i : i + width]
        hx = " ".join(f"{b:02x}" for b in chunk)
        asc = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        where = f"0x{base + i:x}" if base is not None else f"{i:04x}"
        out.append(f"{where}  {hx:<{width * 3 - 1}}  {asc}")
    if len(data) > limit:
        out.append(f"... ({len(data) - limit} more bytes)")
    return out


def _hex_words(b: bytes) -> str:
    return " ".join(b[i : i + 4].hex(" ") for i in range(0, len(b), 4))


def _access_str(access: int) -> str:
    flags = (Access.LOCAL_WRITE, Access.REMOTE_WRITE, Access.REMOTE_READ, Access.REMOTE_ATOMIC)
    return "|".join(str(a.name) for a in flags if access & a) or "0"


def _enum_name(cls: Any, v: int) -> str:
    try:
        return str(cls(v).name)
    except ValueError:
        return str(v)


def _syndrome_text(s: int) -> str:
    kind = wire.aeth_kind(s)
    low = s & 0x1F
    if kind == wire.AETH_ACK:
        return "ACK, " + (
            "credit count invalid (31: no end-to-end credit limit)" if low == 31 else f"credits code {low}"
        )
    if kind == wire.AETH_RNR_NAK:
        return f"RNR NAK, timer code {low}"
    if kind == wire.AETH_NAK:
        return f"NAK code {low}"
    return "reserved"


def decode_bth(b: bytes) -> dict[str, Any]:
    """The BTH fields of 12 bytes (an independent decoder, for display and tests)."""
    opcode, flags, pkey, w1, w2 = _BTH.unpack(b[:12])
    return {
        "opcode": opcode,
        "opcode_name": _enum_name(wire.Opcode, opcode),
        "se": bool(flags & 0x80),
        "migreq": bool(flags & 0x40),
        "pad": (flags >> 4) & 3,
        "tver": flags & 0xF,
        "pkey": pkey,
        "fecn": bool(w1 & 0x80000000),
        "becn": bool(w1 & 0x40000000),
        "dest_qp": w1 & 0xFFFFFF,
        "ack_req": bool(w2 & 0x80000000),
        "psn": w2 & 0xFFFFFF,
    }


# ----------------------------------------------------------------- the walk ----


async def trace_one_write(
    payload: bytes = DEFAULT_PAYLOAD,
    *,
    requester: Any = None,
    responder: Any = None,
    remote_size: int = 64,
    remote_offset: int = 0,
    host: str = "127.0.0.1",
    timeout: float = 10.0,
) -> list[Step]:
    """Do one RDMA Write of ``payload`` between two soft devices and return its eight steps.

    ``requester``/``responder`` are :class:`~aiordma.providers.soft.device.SoftDevice`
    instances to use (each defaults to a new one, closed afterwards; they may
    be the same device). The responder exposes a zero-filled buffer of
    ``remote_size`` bytes; the data lands at ``remote_offset``. The payload
    must fit one packet (the path MTU), so the packet is RDMA_WRITE_ONLY.
    """
    from ..handshake import connect
    from ..memory import register
    from ..providers.soft.device import SoftDevice
    from ..server import start_server

    payload = bytes(payload)
    if not payload:
        raise ValueError("the payload must not be empty (a zero-length write carries no data to follow)")
    if remote_offset < 0 or remote_offset + len(payload) > remote_size:
        raise ValueError(
            f"{len(payload)} bytes at offset {remote_offset} do not fit a {remote_size}-byte remote buffer"
        )
    own: list[Any] = []
    for dev in (requester, responder):
        if dev is not None and not isinstance(dev, SoftDevice):
            raise TypeError("the walk-through traces the soft device; pass SoftDevice instances (or None)")
    if requester is None:
        requester = SoftDevice(name="soft-requester")
        own.append(requester)
    if responder is None:
        responder = SoftDevice(name="soft-responder")
        own.append(responder)
    server = conn = src = target = None
    remote_mem = bytearray(remote_size)
    try:
        target = register(remote_mem, Access.LOCAL_WRITE, device=responder)
        served: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        async def handler(c: Any) -> None:
            if not served.done():
                served.set_result(c)
            async for _ in c:  # the responder application only waits; it never touches the data path
                pass

        server = await start_server(handler, host, 0, device=responder, expose={"target": target.exposed("w")})
        conn = await connect(host, server.port, device=requester, timeout=timeout)
        try:
            peer_conn = await asyncio.wait_for(served, timeout)
        except TimeoutError:
            raise WalkthroughError(
                f"the server did not report its side of the connection within {timeout:g} s"
            ) from None
        if len(payload) > conn.mtu:
            raise ValueError(f"the payload ({len(payload)} bytes) must fit one packet (path MTU {conn.mtu})")
        src = conn.register(bytearray(payload), Access.LOCAL_WRITE)
        remote = conn.remote("target")[remote_offset : remote_offset + len(payload)]
        before = bytes(remote_mem)
        a_qpn, b_qpn = conn.qp_num, peer_conn.qp_num
        rec = _Recorder({a_qpn, b_qpn}, {a_qpn: conn.pd, b_qpn: peer_conn.pd})
        requester.set_tracer(rec)
        if responder is not requester:
            responder.set_tracer(rec)
        t_post = time.perf_counter_ns()
        try:
            await asyncio.wait_for(conn.write(src, remote), timeout)
        finally:
            requester.set_tracer(None)
            responder.set_tracer(None)
        t_done = time.perf_counter_ns()
        after = bytes(remote_mem)
        if rec.errors:
            raise WalkthroughError(f"the tracer failed: {rec.errors[0]!r}")
        ctx = {
            "a_qpn": a_qpn,
            "b_qpn": b_qpn,
            "a_dev": requester,
            "b_dev": responder,
            "a_gid": bytes(conn.gid),
            "b_gid": bytes(peer_conn.gid),
            "mtu": conn.mtu,
            "payload": payload,
            "remote": remote,
            "target_addr": target.addr,
            "before": before,
            "after": after,
            "t_post": t_post,
            "t_done": t_done,
            "progress": conn.progress_mode,
        }
        return _build_steps(rec.events, ctx)
    finally:
        if conn is not None:
            await conn.close()
        if server is not None:
            server.close()
            await server.wait_closed()
        for r in (src, target):
            if r is not None:
                try:
                    r.close()
                except Exception:
                    pass
        for dev in own:
            dev.close()


def _who(thread: str) -> str:
    """Who ran a NIC step: the soft NIC's own thread, or an event loop running its receive path."""
    if thread.startswith("aiordma-nic-"):
        return f"the soft NIC thread {thread!r}"
    return f"the soft NIC's receive path, run by the event loop on thread {thread!r}"


def _find(events: list[_Event], name: TraceEvent, qpn: int, step: int, pred: Any = None) -> _Event:
    for ev in events:
        if ev.name == name and ev.qpn == qpn and (pred is None or pred(ev)):
            return ev
    seen = ", ".join(f"{e.name}@{e.qpn:06x}" for e in events) or "nothing"
    raise WalkthroughError(f"step {step}: no {name!r} event for QP 0x{qpn:06x} in the trace (saw: {seen})")


class _Walk:
    """What the eight step builders share: the trace, the run's facts
    (``ctx``: QPNs, devices, GIDs, the remote buffer before and after, ...),
    and the steps built so far (a later step reads an earlier one's fields,
    e.g. the PSN the WQE was given)."""

    def __init__(self, events: list[_Event], ctx: dict[str, Any]) -> None:
        self.events = events
        self.ctx = ctx
        self.a: int = ctx["a_qpn"]  # the requester's QP
        self.b: int = ctx["b_qpn"]  # the responder's QP
        self.t0 = 0  # when the WQE was built: every step's time is relative to it
        self.steps: list[Step] = []

    def find(self, name: TraceEvent, qpn: int, step: int, pred: Any = None) -> _Event:
        return _find(self.events, name, qpn, step, pred)

    def t_us(self, ev: _Event) -> float:
        return (ev.t_ns - self.t0) / 1000.0

    def fields(self, number: int) -> dict[str, Any]:
        """The fields of step ``number`` (already built)."""
        return self.steps[number - 1].fields


def _build_steps(events: list[_Event], ctx: dict[str, Any]) -> list[Step]:
    walk = _Walk(events, ctx)
    for build in _STEPS:
        walk.steps.append(build(walk))
    return walk.steps


def _step1_wqe(w: _Walk) -> Step:
    """1: the application builds a WQE and puts it on the send queue."""
    a, b = w.a, w.b
    ev_wqe = w.find(TraceEvent.WQE, a, 1)
    w.t0 = ev_wqe.t_ns
    wr = ev_wqe.f["wr"]
    psn = ev_wqe.f["psn"]
    npkts = ev_wqe.f["npkts"]
    sges = [(s.addr, s.length, s.lkey) for s in wr.sg_list]
    flags = SendFlags(wr.send_flags)
    flag_names = (
        "|".join(f"IBV_SEND_{(f.name or '').removeprefix('IBV_SEND_')}" for f in SendFlags if f in flags) or "0"
    )
    rows = [
        ("verb", f"ibv_post_send(QP 0x{a:06x}, wr) -> WQE on the send queue (SQ)"),
        ("opcode", f"{WROpcode(wr.opcode).name} ({int(wr.opcode)})"),
        ("wr_id", str(wr.wr_id)),
        ("send_flags", flag_names),
    ]
    for i, (addr, length, lkey) in enumerate(sges):
        rows.append((f"sg_list[{i}]", f"addr 0x{addr:x}  length {length}  lkey 0x{lkey:08x}"))
    rows += [
        ("wr.rdma", f"remote_addr 0x{wr.remote_addr:x}  rkey 0x{wr.rkey:08x}"),
        ("PSN", f"{psn} (0x{psn:06x}); {npkts} packet{'s' if npkts != 1 else ''} at path MTU {w.ctx['mtu']}"),
        ("QP", f"0x{a:06x} -> dest QP 0x{b:06x}"),
    ]
    return Step(
        1,
        STEP_TITLES[1],
        STEP_WHERE[1],
        {
            "opcode": WROpcode(wr.opcode).name,
            "wr_id": wr.wr_id,
            "send_flags": int(wr.send_flags),
            "sg_list": sges,
            "remote_addr": wr.remote_addr,
            "rkey": wr.rkey,
            "psn": psn,
            "npkts": npkts,
            "qpn": a,
            "dest_qpn": b,
            "length": sum(s[1] for s in sges),
        },
        rows,
        note="No system call: filling in the WQE is a few stores into the send queue in user memory.",
        t_us=0.0,
    )


def _step2_doorbell(w: _Walk) -> Step:
    """2: the doorbell tells the NIC there is new work."""
    a = w.a
    ev_db = w.find(TraceEvent.DOORBELL, a, 2)
    return Step(
        2,
        STEP_TITLES[2],
        STEP_WHERE[2],
        {"qpn": a, "wqes": ev_db.f.get("n", 1), "thread": ev_db.thread},
        [
            ("doorbell", f"QP 0x{a:06x}: {ev_db.f.get('n', 1)} new WQE(s) on the SQ"),
            ("rung from", f"thread {ev_db.thread!r} (the caller of post_send)"),
        ],
        note="A real NIC: one MMIO write of the new SQ tail to its doorbell register. The soft NIC: "
        "post_send hands the WQE to its RC engine under the NIC lock, in the caller's thread.",
        t_us=w.t_us(ev_db),
    )


def _step3_lkey_read(w: _Walk) -> Step:
    """3: the NIC reads the local buffer, checked by its lkey."""
    sges = w.fields(1)["sg_list"]
    ev_rd = w.find(TraceEvent.LKEY_READ, w.a, 3)
    gathered: bytes = ev_rd.f["gathered"]
    off, length = ev_rd.f["offset"], ev_rd.f["length"]
    data = gathered[off : off + length]
    mr = ev_rd.f.get("mr")
    lkey = sges[0][2] if sges else 0
    rows = [("lkey", f"0x{lkey:08x}")]
    inside = False
    if mr is not None:
        m_addr, m_len, m_acc, _, _ = mr
        inside = all(m_addr <= s[0] and s[0] + s[1] <= m_addr + m_len for s in sges)
        rows += [
            ("MR", f"[0x{m_addr:x}, +{m_len})  {_access_str(m_acc)}"),
            ("check", f"SGE inside the MR of this PD: {'yes' if inside else 'NO'}"),
        ]
    rows += [
        ("read", f"{length} bytes at SGE offset {off} (from 0x{sges[0][0] + off:x})" if sges else f"{length} bytes")
    ]
    return Step(
        3,
        STEP_TITLES[3],
        STEP_WHERE[3],
        {
            "lkey": lkey,
            "mr": mr,
            "lkey_ok": inside,
            "offset": off,
            "length": length,
            "data": data,
            "thread": ev_rd.thread,
        },
        rows,
        hexdumps=[("local buffer (read by the NIC)", data)],
        note="Zero copy: the bytes go from the application's buffer to the NIC, no kernel buffer in between.",
        t_us=w.t_us(ev_rd),
    )


def _sent_request(w: _Walk, step: int) -> _Event:
    """The request datagram of the write's PSN as the requester's NIC sent it."""
    psn = w.fields(1)["psn"]
    return w.find(
        TraceEvent.UDP_SEND, w.a, step, lambda e: e.f["pkt"].psn == psn and e.f["pkt"].opcode != wire.Opcode.ACKNOWLEDGE
    )


def _step4_headers(w: _Walk) -> Step:
    """4: the NIC builds the packet: BTH + RETH + payload + ICRC."""
    psn = w.fields(1)["psn"]
    ev_out = w.find(TraceEvent.PACKET_OUT, w.a, 4, lambda e: e.f["pkt"].psn == psn)
    ev_send = _sent_request(w, 4)
    dgram: bytes = ev_send.f["datagram"]
    bth_b, reth_b = dgram[:12], dgram[12:28]
    bth = decode_bth(bth_b)
    va, rkey, dma_len = _RETH.unpack(reth_b)
    body_end = len(dgram) - 4
    pad = bth["pad"]
    pl = dgram[28 : body_end - pad]
    pad_b = dgram[body_end - pad : body_end]
    icrc_b = dgram[-4:]
    icrc = _ICRC.unpack(icrc_b)[0]
    flow = ev_send.f["flow_obj"]
    icrc_ok = wire.icrc_ok(dgram, flow)
    rows = [
        ("opcode", f"0x{bth['opcode']:02x} {bth['opcode_name']}"),
        ("BTH flags", f"SE {int(bth['se'])}  M {int(bth['migreq'])}  PadCnt {pad}  TVer {bth['tver']}"),
        ("P_Key", f"0x{bth['pkey']:04x} (default partition)"),
        ("Dest QP", f"0x{bth['dest_qp']:06x} (the peer's QPN from the rendezvous)"),
        ("AckReq", f"{int(bth['ack_req'])} (last packet of the message: please ACK)"),
        ("PSN", f"{bth['psn']} (0x{bth['psn']:06x})"),
        ("RETH VA", f"0x{va:x}"),
        ("RETH R_Key", f"0x{rkey:08x}"),
        ("RETH DMA len", f"{dma_len}"),
        ("payload", f"{len(pl)} bytes + {pad} pad byte{'s' if pad != 1 else ''} (to a 4-byte boundary)"),
        (
            "ICRC",
            f"0x{icrc:08x} (CRC-32 over masked IP/UDP/BTH + the rest; on the wire little-endian: {icrc_b.hex(' ')}) "
            f"{'verified' if icrc_ok else 'MISMATCH'}",
        ),
        ("layout", f"BTH 12 + RETH 16 + payload {len(pl)} + pad {pad} + ICRC 4 = {len(dgram)} bytes"),
    ]
    return Step(
        4,
        STEP_TITLES[4],
        STEP_WHERE[4],
        {
            "datagram": dgram,
            "bth": bth_b,
            "reth": reth_b,
            "payload": pl,
            "pad": pad_b,
            "icrc": icrc,
            "icrc_bytes": icrc_b,
            "icrc_ok": icrc_ok,
            "opcode": bth["opcode"],
            "opcode_name": bth["opcode_name"],
            "dest_qp": bth["dest_qp"],
            "psn": bth["psn"],
            "ack_req": bth["ack_req"],
            "pkey": bth["pkey"],
            "va": va,
            "rkey": rkey,
            "dma_len": dma_len,
            "packet": ev_out.f["pkt"],
        },
        rows,
        hexdumps=[("BTH", bth_b), ("RETH", reth_b), ("payload", pl + pad_b), ("ICRC", icrc_b)],
        note="On hardware the NIC builds these headers; no CPU takes part in the protocol.",
        t_us=w.t_us(ev_out),
    )


def _step5_udp_4791(w: _Walk) -> Step:
    """5: the network carries it: RoCEv2 is a UDP datagram to port 4791."""
    a_dev, b_dev = w.ctx["a_dev"], w.ctx["b_dev"]
    psn = w.fields(1)["psn"]
    pkt = w.fields(4)
    dgram, pl, pad = pkt["datagram"], pkt["payload"], len(pkt["pad"])
    src_ip, sport, dst_ip, dport = _sent_request(w, 5).f["flow"]
    ev_in = w.find(TraceEvent.UDP_RECV, w.b, 5, lambda e: e.f["pkt"].psn == psn and e.f["pkt"].opcode == pkt["opcode"])
    r_src, r_sport, r_dst, r_dport = ev_in.f["flow"]
    udp_len = 8 + len(dgram)
    ip_len = 20 + udp_len
    rows = [
        ("from", f"{src_ip}:{sport}  (device {a_dev.name}, GID {gid_str(w.ctx['a_gid'])})"),
        ("to", f"{dst_ip}:{dport}  (device {b_dev.name}, GID {gid_str(w.ctx['b_gid'])})"),
        ("UDP", f"length {udp_len} = 8 header + {len(dgram)} RoCEv2; destination port {dport} (RoCEv2, IANA)"),
        ("IPv4", f"total length {ip_len}, DF set, ID 0 (the ICRC covers them)"),
        (
            "frame",
            f"[ Ethernet 14 | IPv4 20 | UDP 8 | BTH 12 | RETH 16 | data {len(pl)}+{pad} | ICRC 4 ] = {14 + ip_len} bytes",
        ),
        (
            "arrived",
            f"at {r_dst}:{r_dport} from {r_src}:{r_sport}, {len(ev_in.f['datagram'])} bytes, ICRC checked "
            f"({b_dev.icrc_policy})",
        ),
    ]
    return Step(
        5,
        STEP_TITLES[5],
        STEP_WHERE[5],
        {
            "src": (src_ip, sport),
            "dst": (dst_ip, dport),
            "udp_length": udp_len,
            "ip_length": ip_len,
            "received_from": (r_src, r_sport),
            "received_at": (r_dst, r_dport),
            "received_datagram": ev_in.f["datagram"],
        },
        rows,
        note="RoCEv2 is routable because it is plain UDP/IP; anything that rewrites the IP header "
        "(NAT) breaks the end-to-end ICRC.",
        t_us=w.t_us(ev_in),
    )


def _step6_rkey_check(w: _Walk) -> Step:
    """6: the remote NIC finds the QP and checks the rkey."""
    b = w.b
    psn = w.fields(1)["psn"]
    ev_ck = w.find(TraceEvent.RKEY_CHECK, b, 6, lambda e: e.f["pkt"].psn == psn)
    ok = bool(ev_ck.f["ok"])
    region = ev_ck.f.get("region")
    rpkt = ev_ck.f["pkt"]
    rows = [
        (
            "QP lookup",
            f"BTH Dest QP 0x{rpkt.dest_qp:06x} -> responder QP 0x{b:06x}, PSN {rpkt.psn} is the expected one",
        ),
        ("R_Key", f"0x{rpkt.rkey:08x}"),
        ("request", f"write [0x{rpkt.va:x}, +{rpkt.dma_len})"),
    ]
    if region is not None:
        r_addr, r_len, r_acc, _, _ = region
        rows.append(("MR", f"[0x{r_addr:x}, +{r_len})  {_access_str(r_acc)}"))
    rows.append(
        (
            "result",
            "OK: the key exists, grants IBV_ACCESS_REMOTE_WRITE, the range is inside"
            if ok
            else f"REFUSED: {ev_ck.f.get('why')}",
        )
    )
    rows.append(("checked by", _who(ev_ck.thread)))
    return Step(
        6,
        STEP_TITLES[6],
        STEP_WHERE[6],
        {
            "ok": ok,
            "why": ev_ck.f.get("why"),
            "rkey": rpkt.rkey,
            "va": rpkt.va,
            "length": rpkt.dma_len,
            "region": region,
            "qpn": b,
            "thread": ev_ck.thread,
        },
        rows,
        note="On hardware all of this is the remote NIC's job; the remote CPU is not involved.",
        t_us=w.t_us(ev_ck),
    )


def _step7_dma(w: _Walk) -> Step:
    """7: the remote NIC DMAs the data straight into remote memory."""
    psn = w.fields(1)["psn"]
    ev_dma = w.find(TraceEvent.DMA_WRITE, w.b, 7, lambda e: e.f["pkt"].psn == psn)
    d_addr, d_len, d_acc, _, _ = ev_dma.f["region"]
    d_off, d_n = ev_dma.f["offset"], ev_dma.f["length"]
    written = ev_dma.f["region_bytes"][d_off : d_off + d_n]
    before, after = w.ctx["before"], w.ctx["after"]
    rows = [
        ("address", f"0x{d_addr + d_off:x} (region 0x{d_addr:x} + offset {d_off})"),
        ("bytes", f"{d_n}, written by {_who(ev_dma.thread)}"),
        (
            "remote app",
            "its handler (waiting in `async for msg in conn`) was not resumed: a plain RDMA Write "
            "consumes no receive and makes no completion on the responder",
        ),
    ]
    return Step(
        7,
        STEP_TITLES[7],
        STEP_WHERE[7],
        {
            "address": d_addr + d_off,
            "offset": d_off,
            "length": d_n,
            "data": written,
            "region_addr": d_addr,
            "region_length": d_len,
            "before": before,
            "after": after,
            "thread": ev_dma.thread,
        },
        rows,
        hexdumps=[("remote buffer before", before), ("remote buffer after", after)],
        note="The data is now in memory the remote application can read.",
        t_us=w.t_us(ev_dma),
    )


def _step8_ack_cqe(w: _Walk) -> Step:
    """8: the ACK comes back and becomes a CQE on the requester's CQ."""
    a, b = w.a, w.b
    psn, wr_id = w.fields(1)["psn"], w.fields(1)["wr_id"]
    ev_ack_out = w.find(
        TraceEvent.UDP_SEND, b, 8, lambda e: e.f["pkt"].opcode == wire.Opcode.ACKNOWLEDGE and e.f["pkt"].psn == psn
    )
    ack_dgram: bytes = ev_ack_out.f["datagram"]
    ack_bth = decode_bth(ack_dgram[:12])
    aeth = _AETH.unpack(ack_dgram[12:16])[0]
    syndrome, msn = aeth >> 24, aeth & 0xFFFFFF
    ack_icrc_ok = wire.icrc_ok(ack_dgram, ev_ack_out.f["flow_obj"])
    ev_ack_in = w.find(TraceEvent.ACK_IN, a, 8, lambda e: e.f["pkt"].psn == psn)
    ev_cqe = w.find(TraceEvent.CQE, a, 8, lambda e: e.f["wc"].wr_id == wr_id)
    wc = ev_cqe.f["wc"]
    a_src, a_sport, a_dst, a_dport = ev_ack_out.f["flow"]
    total_us = (w.ctx["t_done"] - w.ctx["t_post"]) / 1000.0
    rows = [
        ("ACK", f"{a_src}:{a_sport} -> {a_dst}:{a_dport}, {len(ack_dgram)} bytes: BTH 12 + AETH 4 + ICRC 4"),
        (
            "BTH",
            f"0x{ack_bth['opcode']:02x} {ack_bth['opcode_name']}  Dest QP 0x{ack_bth['dest_qp']:06x}  PSN {ack_bth['psn']}",
        ),
        ("AETH", f"syndrome 0x{syndrome:02x} ({_syndrome_text(syndrome)})  MSN {msn}"),
        ("ICRC", f"{'verified' if ack_icrc_ok else 'MISMATCH'}"),
        ("requester", f"ACK for PSN {ev_ack_in.f['pkt'].psn} retires the WQE (wr_id {wr_id})"),
        (
            "CQE",
            f"wr_id {wc.wr_id}  status {_enum_name(WCStatus, wc.status)}  opcode {_enum_name(WCOpcode, wc.opcode)}  "
            f"byte_len {wc.byte_len}  qp_num 0x{wc.qp_num:06x}",
        ),
        (
            "completion",
            f"{_PROGRESS_TEXT.get(w.ctx['progress'], w.ctx['progress'])}; "
            f"`await conn.write()` returned after {total_us:.0f} us",
        ),
    ]
    return Step(
        8,
        STEP_TITLES[8],
        STEP_WHERE[8],
        {
            "ack_datagram": ack_dgram,
            "ack_opcode": ack_bth["opcode"],
            "ack_opcode_name": ack_bth["opcode_name"],
            "ack_dest_qp": ack_bth["dest_qp"],
            "ack_psn": ack_bth["psn"],
            "syndrome": syndrome,
            "msn": msn,
            "ack_icrc_ok": ack_icrc_ok,
            "wr_id": wc.wr_id,
            "status": _enum_name(WCStatus, wc.status),
            "wc_opcode": _enum_name(WCOpcode, wc.opcode),
            "byte_len": wc.byte_len,
            "qp_num": wc.qp_num,
            "total_us": total_us,
        },
        rows,
        hexdumps=[("ACK (BTH + AETH + ICRC)", ack_dgram)],
        note="RC is reliable: the CQE means the responder's NIC has the data. A plain RDMA Write "
        "gives the responder no completion at all (RDMA_WRITE_WITH_IMM would).",
        t_us=w.t_us(ev_cqe),
    )


#: the walk, in the order of the eight stations above: one builder per step
_STEPS = (
    _step1_wqe,
    _step2_doorbell,
    _step3_lkey_read,
    _step4_headers,
    _step5_udp_4791,
    _step6_rkey_check,
    _step7_dma,
    _step8_ack_cqe,
)


# ---------------------------------------------------------------- rendering ----


class _Style:
    def __init__(self, color: bool) -> None:
        self.color = color

    def _w(self, code: str, s: str) -> str:
        return f"\x1b[{code}m{s}\x1b[0m" if self.color else s

    def head(self, s: str) -> str:
        return self._w("1;36", s)

    def label(self, s: str) -> str:
        return self._w("33", s)

    def dim(self, s: str) -> str:
        return self._w("2", s)

    def good(self, s: str) -> str:
        return self._w("32", s)


def render_steps(steps: list[Step], color: bool = False, indent: str = "  ") -> str:
    """The steps as readable text (ANSI colour if ``color``)."""
    st = _Style(color)
    out: list[str] = []
    for s in steps:
        t = f"+{s.t_us:.0f} us" if s.t_us is not None else ""
        out.append("")
        out.append(st.head(f"Step {s.number}/8  {s.title}"))
        out.append(indent + st.dim(f"{s.where}{'  ·  ' + t if t else ''}"))
        width = max([len(k) for k, _ in s.rows] + [8])
        for k, v in s.rows:
            out.append(f"{indent}{st.label(k.ljust(width))}  {v}")
        for label, data in s.hexdumps:
            if label in ("BTH", "RETH", "ICRC"):
                out.append(f"{indent}{st.label(('hex ' + label).ljust(width))}  {_hex_words(data)}")
            else:
                base = None
                if label.startswith("remote buffer"):
                    base = s.fields.get("region_addr")
                out.append(f"{indent}{st.label(label)}:")
                for line in hexdump(data, base=base):
                    out.append(f"{indent}  {line}")
        if s.note:
            out.append(indent + st.dim(s.note))
    return "\n".join(out)
