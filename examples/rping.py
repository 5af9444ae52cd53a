"""rping in Python: librdmacm's ping-pong over RDMA CM, on the wire the same as ``rping``.

``rping`` (librdmacm/examples/rping.c, Debian's ``rdmacm-utils``) is the
classic "is RDMA working?" test. This example speaks its protocol with
rdma-core's Python bindings (pyverbs: ``pyverbs.cmid`` for the RDMA
Connection Manager, CQ and MR for the verbs), so each end can be the real
``rping`` or this script::

    rping -s -a 10.0.2.15 -v                                  # the C server ...
    python examples/rping.py -c -a 10.0.2.15 -C 10 -S 64 -v -V   # ... this client

    python examples/rping.py -s -a 10.0.2.15 -v               # this server ...
    rping -c -a 10.0.2.15 -C 10 -S 4096 -v -V                 # ... the C client

The options are rping's: ``-s``/``-c``, ``-a ADDR``, ``-I ADDR`` (client
source address), ``-p PORT`` (7174), ``-C COUNT`` (0: ping forever), ``-S
SIZE`` (64, from 23 to 65535), ``-v`` (print each ping), ``-V`` (validate),
``-d`` (debug lines). Two additions: ``--timeout`` (give up on a silent peer)
and, on the server, ``-C``/``-V`` mean something (rping's server ignores
them): ``-C N`` expects exactly N pings before the client disconnects, and
``-V`` checks that each ping read from the client is rping's pattern.

The protocol (rping.c's comment, "ping/pong loop")
--------------------------------------------------
Connection: RDMA CM in the TCP port space (``RDMA_PS_TCP``: a reliable
connected QP), port 7174 by default. The client resolves the server's address
(CM event ``ADDR_RESOLVED``), then a route to it (``ROUTE_RESOLVED``), creates
its QP through the CM and connects with responder_resources = initiator_depth
= 1 (one RDMA Read in flight each way), retry_count = rnr_retry_count = 7
(``ESTABLISHED``). The server binds and listens, gets ``CONNECT_REQUEST``
carrying a new cm_id for this connection, creates the QP on that cm_id and
accepts (``ESTABLISHED``).

Messages: every SEND is one 16-byte ``struct rping_rdma_info { __be64 buf;
__be32 rkey; __be32 size; }`` (big-endian), naming a buffer of the sender's
that the peer may access by RDMA. For each ping:

1. the client writes ``"rdma-ping-%d: "`` and a rotating run of the letters
   A-z (``A`` to ``z``, starting one letter later each ping) into its *start*
   buffer, NUL-terminated, and SENDs the start buffer's {addr, rkey, size};
2. the server RDMA-READs that many bytes from there into its own buffer and
   SENDs a "go ahead" (16 bytes, all zero);
3. the client SENDs its *rdma* (sink) buffer's {addr, rkey, size};
4. the server RDMA-WRITEs the string it read (strlen + 1 bytes) into it and
   SENDs "go ahead" again;
5. the client compares its two buffers (``-V``) and prints the data (``-v``).

After COUNT pings the client disconnects; the server's ``DISCONNECTED`` event
ends its loop. The client's two buffers are registered with REMOTE_READ and
REMOTE_WRITE (the server reads one and writes the other); like rping, nobody
is authenticated, so run it on a network you trust. The server's own buffer
is only the local end of its RDMA Read and Write: rping grants it remote
access too, nothing uses that, and this script does not grant it.

Synchronous, on purpose
-----------------------
This script runs synchronously, no asyncio: in pyverbs 44 (Debian 12) the
blocking calls (``CMEvent()``, i.e. ``rdma_get_cm_event``) hold the GIL, so
``asyncio.to_thread`` would freeze the event loop anyway while one blocks,
and the protocol is strictly one step at a time. Nothing here blocks
blindly: the CM event channel's file descriptor (found in ``/proc/self/fd``:
pyverbs 44 does not expose it) is watched with ``select()`` with a timeout,
and the completion queue is polled with 1 ms naps in between (a real program
would sleep on a completion channel; aiordma's pyverbs provider does).

Requirements: a real RDMA device (mlx5, irdma, kernel Soft-RoCE rxe) with
the ``rdma_ucm`` kernel module, and rdma-core's pyverbs (``apt install
python3-pyverbs``), found through aiordma's loader so a venv works too.
aiordma's soft device has no RDMA CM: without a device this says so and
exits with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import itertools
import os
import select
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from aiordma.tools import ToolError, ToolParser, int_type, invoke, port_number, seconds

DEFAULT_PORT = 7174  # rping's
DEFAULT_SIZE = 64  # rping's -S default
MSG_FMT = "rdma-ping-%d: "  # RPING_MSG_FMT
MIN_SIZE = 23  # RPING_MIN_BUFSIZE: sizeof("INT_MAX") + sizeof(RPING_MSG_FMT)
MAX_SIZE = 64 * 1024 - 1  # RPING_BUFSIZE - 1
SQ_DEPTH = 16  # RPING_SQ_DEPTH: send queue depth; the CQ has room for twice that
RESOLVE_MS = 2000  # rping's timeout for address and route resolution
#: struct rping_rdma_info { __be64 buf; __be32 rkey; __be32 size; }
RDMA_INFO = struct.Struct(">QII")
RDMA_CM_DEV = "/dev/infiniband/rdma_cm"


class Disconnected(Exception):
    """The peer disconnected (CM event DISCONNECTED)."""


def ping_data(ping: int, size: int) -> bytes:
    """The client's start buffer for ping number ``ping``, as rping fills it:
    ``snprintf(buf, size, "rdma-ping-%d: ", ping)``, then from the end of that
    text the letters 65 ('A') .. 122 ('z') in a cycle beginning at
    ``65 + ping % 58``, and a NUL in the last byte."""
    head = (MSG_FMT % ping).encode()
    buf = bytearray(size)
    buf[: min(len(head), size - 1)] = head[: size - 1]
    c = 65 + ping % 58
    for i in range(len(head), size):
        buf[i] = c
        c = c + 1 if c < 122 else 65
    buf[size - 1] = 0
    return bytes(buf)


def c_string(data: bytes) -> bytes:
    """``data`` up to (not including) its first NUL, as printf("%s") shows it."""
    n = data.find(b"\0")
    return data if n < 0 else data[:n]


def load_pyverbs() -> SimpleNamespace:
    """pyverbs, its RDMA CM bindings and the enums; a ToolError when missing.

    Imported here, not at the top, so that ``--help`` works without pyverbs.
    aiordma's loader finds the system package (python3-pyverbs) even from a
    venv, without putting the system's dist-packages on sys.path."""
    import importlib

    from aiordma.errors import ProviderUnavailableError
    from aiordma.providers.pyverbs_loader import load_pyverbs as load

    try:
        pkg = load()
        cmid = importlib.import_module("pyverbs.cmid")
        cm_enums = importlib.import_module("pyverbs.cm_enums")
    except ProviderUnavailableError as e:
        raise ToolError(f"this example needs pyverbs and a real RDMA device: {e}") from None
    except ImportError as e:
        raise ToolError(f"pyverbs has no RDMA CM bindings (pyverbs.cmid): {e}") from None
    if not os.path.exists(RDMA_CM_DEV):
        raise ToolError(
            f"no RDMA device with RDMA CM here ({RDMA_CM_DEV} is missing): this example needs a real "
            "RDMA device (mlx5, irdma, kernel Soft-RoCE rxe) and the rdma_ucm kernel module"
        )
    return SimpleNamespace(
        cmid=cmid, ce=cm_enums, e=pkg.enums, cq=pkg.cq, qp=pkg.qp, mr=pkg.mr, error=pkg.pyverbs_error.PyverbsError
    )


def first_rdma_ipv4() -> str | None:
    """The first IPv4 address of an RDMA device, from the ports' GID tables
    (a RoCE GID ``::ffff:a.b.c.d`` is an address of the port's netdev); ACTIVE
    ports first. Used when the server gets no ``-a``: see Server.listen."""
    found: list[tuple[bool, str]] = []
    for port in sorted(glob.glob("/sys/class/infiniband/*/ports/*")):
        try:
            with open(os.path.join(port, "state")) as f:
                active = "ACTIVE" in f.read()
            gids = sorted(os.listdir(os.path.join(port, "gids")), key=int)
        except (OSError, ValueError):
            continue
        for g in gids:
            try:
                with open(os.path.join(port, "gids", g)) as f:
                    gid = f.read().strip()
            except OSError:
                continue
            if gid.startswith("0000:0000:0000:0000:0000:ffff:") and not gid.endswith("0000:0000"):
                found.append((not active, socket.inet_ntoa(bytes.fromhex(gid[30:].replace(":", "")))))
    return min(found)[1] if found else None


def _rdma_cm_fds() -> set[int]:
    """The file descriptors of this process open on /dev/infiniband/rdma_cm."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == RDMA_CM_DEV:
                out.add(int(name))
        except (OSError, ValueError):
            continue
    return out


class Endpoint:
    """One end of rping: the CM event channel, the cm_id, the CQ, the QP that
    the CM creates on the cm_id, and the memory regions.

    * recv_mr (16 bytes, LOCAL_WRITE): where a peer's SEND of a rping_rdma_info lands;
    * send_mr (16 bytes, no access rights needed to be sent from): our info or "go ahead";
    * the data buffers, per role (see Client and Server).
    """

    role = ""

    def __init__(self, pv: SimpleNamespace, args: argparse.Namespace) -> None:
        self.pv = pv
        self.args = args
        self.size: int = args.size
        self.timeout: float = args.timeout
        self.channel: Any = None
        self.fd = -1  # the event channel's file descriptor
        self.listen_id: Any = None  # the server's listening cm_id
        self.cm_id: Any = None  # the connection's cm_id (the server's child cm_id)
        self.cq: Any = None
        self.mrs: list[Any] = []
        self.done: deque[Any] = deque()  # completions of RECV / RDMA Read / RDMA Write not yet waited for
        self.peer_info: deque[tuple[int, int, int]] = deque()  # (addr, rkey, size) of each RECV, in order

    def run(self) -> int:
        raise NotImplementedError

    # ---------------------------------------------------------------- helpers --

    def debug(self, text: str) -> None:
        if self.args.debug:
            print(text, flush=True)

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        """Turn a pyverbs error inside the ``with`` block into one line: WHAT: why."""
        try:
            yield
        except self.pv.error as e:
            raise ToolError(f"{what}: {e}") from None

    def open_channel(self) -> None:
        """The event channel: the fd on which the kernel's RDMA CM reports
        events (ADDR_RESOLVED, CONNECT_REQUEST, ESTABLISHED, DISCONNECTED...)
        for every cm_id created on it."""
        before = _rdma_cm_fds()
        with self.step(f"rdma_create_event_channel ({RDMA_CM_DEV})"):
            self.channel = self.pv.cmid.CMEventChannel()
        new = _rdma_cm_fds() - before
        if not new:
            raise ToolError("cannot find the RDMA CM event channel's file descriptor in /proc/self/fd")
        self.fd = max(new)
        self.debug(f"created cm event channel, fd {self.fd}")

    def next_event(self, what: str, timeout: float | None) -> Any:
        """The next RDMA CM event (a CMEvent: acknowledge it), waiting at most
        ``timeout`` seconds (None: forever)."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            raise ToolError(f"no answer within {timeout:g} s while waiting for {what}")
        with self.step("rdma_get_cm_event"):
            ev = self.pv.cmid.CMEvent(self.channel)  # the fd is readable: this does not block
        self.debug(f"cma_event type {ev.event_str()}")
        return ev

    def expect_event(self, want: int, what: str, timeout: float | None) -> None:
        """Wait for CM event ``want``; any other event is the failure it names."""
        ev = self.next_event(what, timeout)
        try:
            kind, name = ev.event_type, ev.event_str()
            if kind == want:
                if kind == self.pv.ce.RDMA_CM_EVENT_CONNECT_REQUEST:
                    # A connect request carries a new cm_id, the server's end
                    # of this connection (the listening cm_id keeps listening).
                    with self.step("accepting the connect request"):
                        self.cm_id = self.pv.cmid.CMID(creator=ev, listen_id=self.listen_id)
                return
        finally:
            ev.ack_cm_event()  # every event must be acknowledged, or rdma_destroy_id waits forever
        raise ToolError(self.explain_event(kind, name, what))

    def explain_event(self, kind: int, name: str, what: str) -> str:
        ce = self.pv.ce
        peer = f"{self.args.addr}:{self.args.port}"
        why = {
            ce.RDMA_CM_EVENT_ADDR_ERROR: f"cannot resolve {self.args.addr} to an RDMA device (no route "
            "to it through an RDMA-capable interface?)",
            ce.RDMA_CM_EVENT_ROUTE_ERROR: f"no RDMA route to {self.args.addr}",
            ce.RDMA_CM_EVENT_UNREACHABLE: f"{peer} is unreachable (no answer from its RDMA CM)",
            ce.RDMA_CM_EVENT_REJECTED: f"{peer} rejected the connection (is an rping server listening there?)",
            ce.RDMA_CM_EVENT_CONNECT_ERROR: f"connecting to {peer} failed",
            ce.RDMA_CM_EVENT_DISCONNECTED: "the peer disconnected",
            ce.RDMA_CM_EVENT_DEVICE_REMOVAL: "the RDMA device was removed",
        }.get(kind, f"unexpected CM event while waiting for {what}")
        return f"{why} ({name})"

    def setup_qp(self) -> None:
        """The CQ (our own, 2 x SQ_DEPTH entries, polled) and the RC QP,
        created through the CM on the cm_id (rdma_create_qp: the CM moves it
        to RTR/RTS itself when the connection is established), on the CM's
        protection domain, with rping's sizes: 16 sends, 2 receives, 1 SGE."""
        pv = self.pv
        with self.step("creating the CQ and the QP"):
            self.cq = pv.cq.CQ(self.cm_id.context, SQ_DEPTH * 2, None, None, 0)
            cap = pv.qp.QPCap(max_send_wr=SQ_DEPTH, max_recv_wr=2, max_send_sge=1, max_recv_sge=1)
            init = pv.qp.QPInitAttr(qp_type=pv.e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
            self.cm_id.create_qp(init)
        self.debug(f"created cq and qp {self.cm_id.qpn} on {self.cm_id.dev_name}")

    def reg_mr(self, size: int, access: int) -> Any:
        """Register ``size`` bytes (pyverbs allocates them, page-aligned) on the
        cm_id's protection domain: the MR's lkey is for our own work requests,
        its rkey lets the peer reach it by RDMA (if ``access`` allows)."""
        with self.step(f"registering {size} bytes"):
            mr = self.pv.mr.MR(self.cm_id.pd, size, access)
        self.mrs.append(mr)
        return mr

    def setup_buffers(self) -> None:
        e = self.pv.e
        self.recv_mr = self.reg_mr(RDMA_INFO.size, e.IBV_ACCESS_LOCAL_WRITE)
        self.send_mr = self.reg_mr(RDMA_INFO.size, 0)

    def post_recv(self) -> None:
        """One receive for the next rping_rdma_info (rping keeps one posted)."""
        with self.step("ibv_post_recv"):
            self.cm_id.post_recv(self.recv_mr, RDMA_INFO.size)

    def send_info(self, addr: int, rkey: int, size: int) -> None:
        """SEND a rping_rdma_info {buf, rkey, size}, big-endian (all zero: "go ahead")."""
        self.send_mr.write(RDMA_INFO.pack(addr, rkey, size), RDMA_INFO.size)
        with self.step("ibv_post_send (SEND)"):
            self.cm_id.post_send(self.send_mr, self.pv.e.IBV_SEND_SIGNALED, RDMA_INFO.size)

    def wait_completion(self, opcode: int, what: str) -> Any:
        """Poll the CQ until a work completion of ``opcode`` arrives.

        Our SENDs' completions are consumed on the way; a RECV's info is parsed
        and the receive posted again at once (as rping's CQ handler does); a
        failed completion is an error. Meanwhile the CM channel is watched: a
        DISCONNECTED event raises Disconnected."""
        e = self.pv.e
        deadline = time.monotonic() + self.timeout
        while True:
            for wc in self.done:
                if wc.opcode == opcode:
                    self.done.remove(wc)
                    return wc
            with self.step("ibv_poll_cq"):
                _, wcs = self.cq.poll(SQ_DEPTH * 2)
            for wc in wcs:
                if wc.status != e.IBV_WC_SUCCESS:
                    status = self.pv.cq.cqe_status_to_str(wc.status)
                    raise ToolError(
                        f"{what}: work completion failed: {status} (status {wc.status}, opcode {wc.opcode})"
                    )
                if wc.opcode == e.IBV_WC_SEND:
                    self.debug("send completion")
                    continue
                if wc.opcode == e.IBV_WC_RECV:
                    self.debug("recv completion")
                    if wc.byte_len != RDMA_INFO.size:
                        raise ToolError(f"received bogus data, size {wc.byte_len} (a rping_rdma_info is 16 bytes)")
                    self.peer_info.append(RDMA_INFO.unpack(self.recv_mr.read(RDMA_INFO.size, 0)))
                    self.post_recv()
                self.done.append(wc)
            if wcs:
                continue
            # Nothing completed: nap 1 ms, waking up early for a CM event.
            ready, _, _ = select.select([self.fd], [], [], 0.001)
            if ready:
                ev = self.next_event(what, 0)
                try:
                    kind, name = ev.event_type, ev.event_str()
                finally:
                    ev.ack_cm_event()
                if kind == self.pv.ce.RDMA_CM_EVENT_DISCONNECTED:
                    raise Disconnected()
                if kind == self.pv.ce.RDMA_CM_EVENT_DEVICE_REMOVAL:
                    raise ToolError(self.explain_event(kind, name, what))
                continue  # e.g. TIMEWAIT_EXIT: nothing to do
            if time.monotonic() > deadline:
                raise ToolError(f"no answer within {self.timeout:g} s while waiting for {what}")

    def disconnect(self) -> None:
        """rdma_disconnect: tell the peer (a DREQ) and move our QP to the
        error state; completions still queued are flushed."""
        if self.cm_id is not None:
            try:
                self.cm_id.disconnect()
            except self.pv.error as e:
                self.debug(f"rdma_disconnect: {e}")

    def close(self) -> None:
        """Free in reverse order: MRs, then the QP and the cm_id, the CQ, the
        listening cm_id and the channel. (The PD is the CM's own.)"""
        for mr in reversed(self.mrs):
            mr.close()
        self.mrs.clear()
        for obj in (self.cm_id, self.cq, self.listen_id, self.channel):
            if obj is not None:
                try:
                    obj.close()  # a cm_id's close also destroys the QP the CM created on it
                except self.pv.error as e:
                    self.debug(f"close {type(obj).__name__}: {e}")
        self.cm_id = self.cq = self.listen_id = self.channel = None


class Client(Endpoint):
    role = "client"

    def run(self) -> int:
        pv, args = self.pv, self.args
        ce, e = pv.ce, pv.e
        self.open_channel()
        with self.step("rdma_create_id"):
            self.cm_id = pv.cmid.CMID(creator=self.channel, port_space=ce.RDMA_PS_TCP)
        self.debug("created cm_id")

        # Resolve the server's IP address to an RDMA device and port of ours
        # (ADDR_RESOLVED), then a path to it (ROUTE_RESOLVED).
        peer = f"{args.addr}:{args.port}"
        with self.step(f"resolving {peer}"):
            ai = pv.cmid.AddrInfo(src=args.source, dst=args.addr, dst_service=str(args.port), port_space=ce.RDMA_PS_TCP)
        with self.step(f"rdma_resolve_addr {peer}"):
            self.cm_id.resolve_addr(ai, RESOLVE_MS)
        self.expect_event(ce.RDMA_CM_EVENT_ADDR_RESOLVED, f"address resolution of {args.addr}", self.timeout)
        with self.step(f"rdma_resolve_route {peer}"):
            self.cm_id.resolve_route(RESOLVE_MS)
        self.expect_event(ce.RDMA_CM_EVENT_ROUTE_RESOLVED, f"route resolution to {args.addr}", self.timeout)
        self.debug("rdma_resolve_addr - rdma_resolve_route successful")

        # Now the cm_id knows its device: CQ, QP and memory.
        self.setup_qp()
        self.setup_buffers()
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        self.start_mr = self.reg_mr(self.size, access)  # the server RDMA-READs the ping from here ...
        self.rdma_mr = self.reg_mr(self.size, access)  # ... and RDMA-WRITEs it back here
        self.post_recv()  # before connecting: the server's first "go ahead" must find a receive

        # Connect: the CM exchanges REQ/REP/RTU with the server's CM, moves our
        # QP to RTR and RTS, and reports ESTABLISHED.
        param = pv.cmid.ConnParam(resources=1, depth=1, retry=7, rnr_retry=7)
        with self.step(f"rdma_connect {peer}"):
            self.cm_id.connect(param)
        self.expect_event(ce.RDMA_CM_EVENT_ESTABLISHED, f"the connection to {peer}", self.timeout)
        self.debug("rdma_connect successful")
        try:
            self.ping_loop()
        except Disconnected:
            raise ToolError("the server disconnected in the middle of a ping") from None
        finally:
            self.disconnect()
        return 0

    def ping_loop(self) -> None:
        e, size = self.pv.e, self.size
        for ping in itertools.count() if self.args.count == 0 else range(self.args.count):
            data = ping_data(ping, size)
            self.start_mr.write(data, size)
            self.rdma_mr.write(bytes(size), size)  # clear the sink: -V then proves the Write happened

            # 1. advertise the start buffer; the server RDMA-READs it, then says "go ahead"
            self.debug(f"RDMA addr {self.start_mr.buf:x} rkey {self.start_mr.rkey:x} len {size}")
            self.send_info(self.start_mr.buf, self.start_mr.rkey, size)
            self.wait_completion(e.IBV_WC_RECV, f"ping {ping}: the server's RDMA Read")
            self.peer_info.clear()  # a "go ahead" carries nothing

            # 2. advertise the sink buffer; the server RDMA-WRITEs the data there, then "go ahead"
            self.debug(f"RDMA addr {self.rdma_mr.buf:x} rkey {self.rdma_mr.rkey:x} len {size}")
            self.send_info(self.rdma_mr.buf, self.rdma_mr.rkey, size)
            self.wait_completion(e.IBV_WC_RECV, f"ping {ping}: the server's RDMA Write")
            self.peer_info.clear()

            echo = self.rdma_mr.read(size, 0)
            if self.args.validate and echo != data:
                at = next(i for i in range(size) if echo[i] != data[i])
                raise ToolError(
                    f"data mismatch! ping {ping}: byte {at} is {echo[at]:#04x}, sent {data[at]:#04x} "
                    f"(got {c_string(echo)[:40]!r}...)"
                )
            if self.args.verbose:
                print(f"ping data: {c_string(echo).decode('latin-1')}")


class Server(Endpoint):
    role = "server"

    def run(self) -> int:
        pv, args = self.pv, self.args
        ce = pv.ce
        self.open_channel()
        with self.step("rdma_create_id"):
            self.listen_id = pv.cmid.CMID(creator=self.channel, port_space=ce.RDMA_PS_TCP)
        self.listen()

        # A client connects: CONNECT_REQUEST brings the connection's own cm_id.
        self.expect_event(ce.RDMA_CM_EVENT_CONNECT_REQUEST, "a client", None)
        self.setup_qp()
        self.setup_buffers()
        # The local end of the RDMA Read (its destination) and Write (its source).
        self.rdma_mr = self.reg_mr(self.size, pv.e.IBV_ACCESS_LOCAL_WRITE)
        self.post_recv()  # before accepting: the client SENDs its first info right away

        # Accept (rping passes no conn_param: the CM takes the client's), then ESTABLISHED.
        self.debug("accepting client connection request")
        with self.step("rdma_accept"):
            self.cm_id.accept()
        self.expect_event(ce.RDMA_CM_EVENT_ESTABLISHED, "the connection to be established", self.timeout)
        try:
            served = self.serve()
        finally:
            self.disconnect()
        if args.count and served < args.count:
            raise ToolError(f"the client disconnected after {served} of {args.count} pings")
        return 0

    def listen(self) -> None:
        """Bind the listening cm_id to ADDR:PORT and listen. Without -a rping
        binds the wildcard address; pyverbs 44 cannot (its bind_addr wraps the
        cm_id's device, which a wildcard-bound cm_id does not have yet), so this
        binds the first IPv4 address of an RDMA device instead."""
        pv, args = self.pv, self.args
        if args.addr is None:
            args.addr = first_rdma_ipv4()
            if args.addr is None:
                raise ToolError("no RDMA device has an IPv4 address to listen on: give -a ADDR")
            self.debug(f"no -a: listening on {args.addr}, the first IPv4 address of an RDMA device")
        where = f"{args.addr}:{args.port}"
        with self.step(f"resolving {where}"):
            ai = pv.cmid.AddrInfo(
                src=args.addr, src_service=str(args.port), port_space=pv.ce.RDMA_PS_TCP, flags=pv.ce.RAI_PASSIVE
            )
        with self.step(f"rdma_bind_addr {where}"):
            self.listen_id.bind_addr(ai)
        self.debug("rdma_bind_addr successful")
        with self.step(f"rdma_listen {where}"):
            self.listen_id.listen(3)
        self.debug("rdma_listen")

    def next_info(self, what: str) -> tuple[int, int, int]:
        self.wait_completion(self.pv.e.IBV_WC_RECV, what)
        addr, rkey, size = self.peer_info.popleft()
        self.debug(f"Received rkey {rkey:x} addr {addr:x} len {size} from peer")
        return addr, rkey, size

    def serve(self) -> int:
        """rping_test_server: serve pings until the client disconnects (or,
        with -C N, N pings); returns how many were served."""
        e, args = self.pv.e, self.args
        flags = e.IBV_SEND_SIGNALED
        served = 0
        while args.count == 0 or served < args.count:
            try:
                addr, rkey, size = self.next_info(f"ping {served} from the client")
            except Disconnected:
                return served
            if size > self.size:
                raise ToolError(f"the client's pings are {size} bytes, more than this server's -S {self.size}")

            # RDMA Read: fetch the ping from the client's start buffer.
            with self.step("ibv_post_send (RDMA Read)"):
                self.cm_id.post_read(self.rdma_mr, size, addr, rkey, flags)
            self.debug("server posted rdma read req")
            self.wait_completion(e.IBV_WC_RDMA_READ, f"ping {served}: the RDMA Read")
            data = self.rdma_mr.read(size, 0)
            if args.verbose:
                print(f"server ping data: {c_string(data).decode('latin-1')}")
            if args.validate and data != ping_data(served, size):
                raise ToolError(f"data mismatch! ping {served} is not rping's pattern: {c_string(data)[:40]!r}...")
            self.send_info(0, 0, 0)  # "go ahead"
            self.debug("server posted go ahead")

            # RDMA Write: echo the string (strlen + 1 bytes) into the client's sink buffer.
            waddr, wrkey, wsize = self.next_info(f"ping {served}: the client's sink buffer")
            length = min(len(c_string(data)) + 1, size)
            if length > wsize:
                raise ToolError(f"the client's sink buffer ({wsize} bytes) is smaller than its ping ({length})")
            with self.step("ibv_post_send (RDMA Write)"):
                self.cm_id.post_write(self.rdma_mr, length, waddr, wrkey, flags)
            self.debug(f"rdma write from lkey {self.rdma_mr.lkey:x} laddr {self.rdma_mr.buf:x} len {length}")
            self.wait_completion(e.IBV_WC_RDMA_WRITE, f"ping {served}: the RDMA Write")
            self.send_info(0, 0, 0)  # "go ahead": the next ping may start
            self.debug("server posted go ahead")
            served += 1

        # -C N: N pings served; the client disconnects next.
        try:
            self.wait_completion(e.IBV_WC_RECV, "the client to disconnect")
        except Disconnected:
            return served
        raise ToolError(f"the client sent more than the {args.count} pings of -C")


def build_parser() -> ToolParser:
    p = ToolParser(
        prog="rping.py",
        description="rping over RDMA CM (pyverbs), interoperable with librdmacm's rping.",
        epilog="Needs a real RDMA device and the rdma_ucm kernel module (not aiordma's soft device).",
    )
    role = p.add_mutually_exclusive_group(required=True)
    role.add_argument("-s", dest="server", action="store_true", help="server side")
    role.add_argument("-c", dest="client", action="store_true", help="client side")
    p.add_argument("-a", dest="addr", metavar="ADDR", help="address: the server's (client), to listen on (server)")
    p.add_argument("-I", dest="source", metavar="ADDR", help="client: source address to bind to")
    p.add_argument("-p", dest="port", type=port_number, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument(
        "-C", dest="count", type=int_type(0), default=0, help="ping count times (default 0: until interrupted)"
    )
    p.add_argument(
        "-S",
        dest="size",
        type=int_type(MIN_SIZE, MAX_SIZE),
        default=DEFAULT_SIZE,
        help=f"ping data size (default {DEFAULT_SIZE}, {MIN_SIZE} to {MAX_SIZE})",
    )
    p.add_argument("-v", dest="verbose", action="store_true", help="display ping data to stdout")
    p.add_argument("-V", dest="validate", action="store_true", help="validate ping data (exit 1 on a mismatch)")
    p.add_argument("-d", dest="debug", action="store_true", help="debug printfs")
    p.add_argument(
        "--timeout",
        type=seconds,
        default=30.0,
        help="give up when the peer stays silent this long (default 30; the server waits for its client forever)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    pv = load_pyverbs()
    ep: Endpoint = Server(pv, args) if args.server else Client(pv, args)
    try:
        return ep.run()
    finally:
        sys.stdout.flush()
        ep.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.client and not args.addr:
        parser.error("-c needs -a ADDR, the server's address")
    if args.client and args.port == 0:
        parser.error("-p 0 is no server port")
    if args.server and args.source:
        parser.error("-I is for the client")
    return invoke(run, args, parser)


if __name__ == "__main__":
    sys.exit(main())
