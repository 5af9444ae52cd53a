"""librdmacm, the RDMA Connection Manager, bound with ctypes: sans-asyncio.

RDMA CM (``rdma_cm``) is how the field's C programs connect a queue pair:
the client resolves the server's IP address to a local RDMA device and port
(``rdma_resolve_addr``: ``ADDR_RESOLVED``), then a path to it
(``rdma_resolve_route``: ``ROUTE_RESOLVED``), and sends a connection request
(``rdma_connect``: an IB CM REQ carrying its QP number, starting PSN and up to
56 bytes of private data); the server, listening on a port of the CM's own
port space (``rdma_listen``), gets ``CONNECT_REQUEST`` with a new id for that
connection and answers (``rdma_accept``: a REP, up to 196 bytes of private
data) or refuses (``rdma_reject``: a REJ, up to 148). On RoCE the CM's
messages travel as MADs to the peer's QP1.

Why not ``pyverbs.cmid``: in pyverbs 44 (Debian 12) an event does not say
which id it is for, an id cannot move to another event channel, the channel's
file descriptor is not exposed and ``rdma_get_cm_event`` holds the GIL, so a
server with many connections cannot run on an event loop. ctypes calls
release the GIL, and this binding exposes exactly what an event loop needs:
the channel's fd (non-blocking), every event's id, and the manual-QP mode
(``conn_param.qp_num``, ``rdma_init_qp_attr``, ``rdma_establish``) in which
the QP is the caller's own, created by the provider on its protection domain.

Everything here is synchronous and never blocks: an event channel's fd is
non-blocking, so :meth:`EventChannel.get` returns None when nothing is there.
The asyncio glue is :mod:`aiordma.cm`.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import struct
from ctypes import POINTER, Structure, byref, c_char_p, c_int, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p
from dataclasses import dataclass
from typing import Any

from ..errors import ProviderUnavailableError, RendezvousError

__all__ = [
    "RDMA_PS_TCP",
    "CMError",
    "CMEvent",
    "CMId",
    "EventChannel",
    "EventType",
    "QueuePairAttributes",
    "load",
]

#: the port space of reliable-connected QPs (what rping and aiordma use)
RDMA_PS_TCP = 0x0106
#: private data room in a REQ, a REP and a REJ in the TCP port space (IB CM's sizes)
REQ_PRIVATE_DATA = 56
REP_PRIVATE_DATA = 196
REJ_PRIVATE_DATA = 148
#: rdma_set_option: level RDMA_OPTION_ID, option RDMA_OPTION_ID_TOS (the IP ToS byte)
_OPTION_ID = 0
_OPTION_ID_TOS = 0
#: rdma_init_qp_attr wants the state asked for in qp_attr.qp_state
_QPS_INIT, _QPS_RTR, _QPS_RTS = 1, 2, 3


class EventType:
    """``enum rdma_cm_event_type``."""

    ADDR_RESOLVED = 0
    ADDR_ERROR = 1
    ROUTE_RESOLVED = 2
    ROUTE_ERROR = 3
    CONNECT_REQUEST = 4
    CONNECT_RESPONSE = 5
    CONNECT_ERROR = 6
    UNREACHABLE = 7
    REJECTED = 8
    ESTABLISHED = 9
    DISCONNECTED = 10
    DEVICE_REMOVAL = 11
    ADDR_CHANGE = 14
    TIMEWAIT_EXIT = 15


class CMError(RendezvousError):
    """An RDMA CM call failed: the call and the errno are in the message, the
    errno in :attr:`errno` (a :class:`ConnectionError`, as every set-up failure)."""

    errno: int = 0


def _cm_error(message: str, err: int) -> CMError:
    e = CMError(message)
    e.errno = err
    return e


# --------------------------------------------------------------- structs ----
class _ConnParam(Structure):
    """``struct rdma_conn_param``."""

    _fields_ = [
        ("private_data", c_void_p),
        ("private_data_len", c_uint8),
        ("responder_resources", c_uint8),
        ("initiator_depth", c_uint8),
        ("flow_control", c_uint8),
        ("retry_count", c_uint8),
        ("rnr_retry_count", c_uint8),
        ("srq", c_uint8),
        ("qp_num", c_uint32),
    ]


class _Event(Structure):
    """``struct rdma_cm_event`` (the UD half of its union is never read)."""

    _fields_ = [
        ("id", c_void_p),
        ("listen_id", c_void_p),
        ("event", c_int),
        ("status", c_int),
        ("conn", _ConnParam),
    ]


class _Channel(Structure):
    """``struct rdma_event_channel``."""

    _fields_ = [("fd", c_int)]


class _GlobalRoute(Structure):
    _fields_ = [
        ("dgid", c_uint64 * 2),  # union ibv_gid: 16 bytes, 8-aligned
        ("flow_label", c_uint32),
        ("sgid_index", c_uint8),
        ("hop_limit", c_uint8),
        ("traffic_class", c_uint8),
    ]


class _AHAttr(Structure):
    _fields_ = [
        ("grh", _GlobalRoute),
        ("dlid", c_uint16),
        ("sl", c_uint8),
        ("src_path_bits", c_uint8),
        ("static_rate", c_uint8),
        ("is_global", c_uint8),
        ("port_num", c_uint8),
    ]


class _QPAttr(Structure):
    """``struct ibv_qp_attr``, as rdma_init_qp_attr fills it."""

    _fields_ = [
        ("qp_state", c_int),
        ("cur_qp_state", c_int),
        ("path_mtu", c_int),
        ("path_mig_state", c_int),
        ("qkey", c_uint32),
        ("rq_psn", c_uint32),
        ("sq_psn", c_uint32),
        ("dest_qp_num", c_uint32),
        ("qp_access_flags", c_int),
        ("cap", c_uint32 * 5),
        ("ah_attr", _AHAttr),
        ("alt_ah_attr", _AHAttr),
        ("pkey_index", c_uint16),
        ("alt_pkey_index", c_uint16),
        ("en_sqd_async_notify", c_uint8),
        ("sq_draining", c_uint8),
        ("max_rd_atomic", c_uint8),
        ("max_dest_rd_atomic", c_uint8),
        ("min_rnr_timer", c_uint8),
        ("port_num", c_uint8),
        ("timeout", c_uint8),
        ("retry_cnt", c_uint8),
        ("rnr_retry", c_uint8),
        ("alt_port_num", c_uint8),
        ("alt_timeout", c_uint8),
        ("rate_limit", c_uint32),
    ]


#: where struct rdma_cm_id keeps route.addr's source and destination sockaddr_storage:
#: after four pointers (verbs, channel, context, qp), 128 bytes each
_SRC_ADDR_OFFSET = 32
_DST_ADDR_OFFSET = _SRC_ADDR_OFFSET + 128


@dataclass(frozen=True)
class QueuePairAttributes:
    """What the CM computed for this connection's queue pair (``rdma_init_qp_attr``
    for RTR and RTS): the peer's QP number and PSN, this end's PSN, the path."""

    port_num: int
    dest_qp_num: int
    rq_psn: int
    sq_psn: int
    path_mtu: int  # enum ibv_mtu: 1..5 for 256..4096
    dgid: bytes
    sgid_index: int
    hop_limit: int
    traffic_class: int
    flow_label: int
    service_level: int
    max_dest_rd_atomic: int
    max_rd_atomic: int
    timeout: int
    retry_cnt: int
    rnr_retry: int
    min_rnr_timer: int


@dataclass(frozen=True)
class CMEvent:
    """One CM event, copied out of librdmacm's (which is acknowledged at once)."""

    type: int
    name: str
    status: int
    id: int  # the rdma_cm_id it is for (a new one for CONNECT_REQUEST)
    listen_id: int  # for CONNECT_REQUEST: the listening id
    private_data: bytes
    qp_num: int
    responder_resources: int
    initiator_depth: int


# ------------------------------------------------------------------ library ----
class _Lib:
    def __init__(self) -> None:
        try:
            cm = ctypes.CDLL("librdmacm.so.1", use_errno=True)
            verbs = ctypes.CDLL("libibverbs.so.1", use_errno=True)
        except OSError as e:
            raise ProviderUnavailableError(f"RDMA CM needs librdmacm (Debian: apt install librdmacm1): {e}") from None
        self.cm = cm
        cm.rdma_create_event_channel.restype = POINTER(_Channel)
        cm.rdma_create_event_channel.argtypes = []
        cm.rdma_destroy_event_channel.argtypes = [POINTER(_Channel)]
        cm.rdma_destroy_event_channel.restype = None
        cm.rdma_create_id.argtypes = [POINTER(_Channel), POINTER(c_void_p), c_void_p, c_int]
        cm.rdma_destroy_id.argtypes = [c_void_p]
        cm.rdma_resolve_addr.argtypes = [c_void_p, c_void_p, c_void_p, c_int]
        cm.rdma_resolve_route.argtypes = [c_void_p, c_int]
        cm.rdma_bind_addr.argtypes = [c_void_p, c_void_p]
        cm.rdma_listen.argtypes = [c_void_p, c_int]
        cm.rdma_connect.argtypes = [c_void_p, POINTER(_ConnParam)]
        cm.rdma_accept.argtypes = [c_void_p, POINTER(_ConnParam)]
        cm.rdma_reject.argtypes = [c_void_p, c_void_p, c_uint8]
        cm.rdma_establish.argtypes = [c_void_p]
        cm.rdma_disconnect.argtypes = [c_void_p]
        cm.rdma_get_cm_event.argtypes = [POINTER(_Channel), POINTER(POINTER(_Event))]
        cm.rdma_ack_cm_event.argtypes = [POINTER(_Event)]
        cm.rdma_init_qp_attr.argtypes = [c_void_p, POINTER(_QPAttr), POINTER(c_int)]
        cm.rdma_set_option.argtypes = [c_void_p, c_int, c_int, c_void_p, ctypes.c_size_t]
        cm.rdma_event_str.argtypes = [c_int]
        cm.rdma_event_str.restype = c_char_p
        cm.rdma_get_src_port.argtypes = [c_void_p]
        cm.rdma_get_src_port.restype = c_uint16
        verbs.ibv_get_device_name.argtypes = [c_void_p]
        verbs.ibv_get_device_name.restype = c_char_p
        self.device_name = verbs.ibv_get_device_name

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise _cm_error(f"{what} failed: {os.strerror(err)} (errno {err})", err)


_lib: _Lib | None = None


def load() -> _Lib:
    """librdmacm, loaded once (:class:`ProviderUnavailableError` where it is missing)."""
    global _lib
    if _lib is None:
        _lib = _Lib()
    return _lib


# ---------------------------------------------------------------- sockaddr ----
def sockaddr(host: str | None, port: int) -> ctypes.Array[ctypes.c_char]:
    """A ``struct sockaddr_in``/``sockaddr_in6`` for ``host:port`` (a name is
    resolved; None or "" is the IPv4 wildcard)."""
    if not host:
        address = "0.0.0.0"
        family = socket.AF_INET
    else:
        try:
            ip = ipaddress.ip_address(host)
            address, family = str(ip), socket.AF_INET if ip.version == 4 else socket.AF_INET6
        except ValueError:
            info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, address = info[0][0], str(info[0][4][0])
    if family == socket.AF_INET:
        raw = struct.pack("=H", socket.AF_INET) + struct.pack(">H", port) + socket.inet_aton(address) + bytes(8)
    else:
        raw = (
            struct.pack("=H", socket.AF_INET6)
            + struct.pack(">HI", port, 0)
            + socket.inet_pton(socket.AF_INET6, address)
            + struct.pack("=I", 0)
        )
    return ctypes.create_string_buffer(raw, 128)


def parse_sockaddr(raw: bytes) -> tuple[str, int] | None:
    """``(host, port)`` of a ``sockaddr_storage`` holding an IPv4 or IPv6 address."""
    (family,) = struct.unpack_from("=H", raw)
    (port,) = struct.unpack_from(">H", raw, 2)
    if family == socket.AF_INET:
        return socket.inet_ntoa(raw[4:8]), port
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, raw[8:24]), port
    return None


# ------------------------------------------------------------ event channel ----
class EventChannel:
    """An RDMA CM event channel: its fd turns readable when an event is there.
    The fd is non-blocking: :meth:`get` never waits."""

    def __init__(self) -> None:
        lib = self._lib = load()
        ch = lib.cm.rdma_create_event_channel()
        if not ch:
            err = ctypes.get_errno()
            raise _cm_error(
                f"rdma_create_event_channel failed: {os.strerror(err)} (is the rdma_ucm kernel module loaded?)",
                err,
            )
        self._ch = ch
        self.fd: int = ch.contents.fd
        os.set_blocking(self.fd, False)

    def get(self) -> CMEvent | None:
        """The next event, acknowledged, or None when there is none now."""
        if not self._ch:
            return None
        ev = POINTER(_Event)()
        if self._lib.cm.rdma_get_cm_event(self._ch, byref(ev)) != 0:
            err = ctypes.get_errno()
            if err in (0, 11):  # EAGAIN: nothing there
                return None
            raise _cm_error(f"rdma_get_cm_event failed: {os.strerror(err)}", err)
        try:
            e = ev.contents
            conn = e.conn
            pdata = b""
            if conn.private_data and conn.private_data_len and e.event in _CARRIES_PRIVATE_DATA:
                pdata = ctypes.string_at(conn.private_data, conn.private_data_len)
            name = (self._lib.cm.rdma_event_str(e.event) or b"?").decode()
            return CMEvent(
                type=e.event,
                name=name,
                status=e.status,
                id=e.id or 0,
                listen_id=e.listen_id or 0,
                private_data=pdata,
                qp_num=conn.qp_num if e.event in _CARRIES_PRIVATE_DATA else 0,
                responder_resources=conn.responder_resources,
                initiator_depth=conn.initiator_depth,
            )
        finally:
            self._lib.cm.rdma_ack_cm_event(ev)

    def close(self) -> None:
        """Destroy the channel (every id on it must be destroyed first)."""
        if self._ch:
            ch, self._ch = self._ch, None
            self._lib.cm.rdma_destroy_event_channel(ch)


#: the events whose conn param (private data, qp_num) means something
_CARRIES_PRIVATE_DATA = frozenset(
    {EventType.CONNECT_REQUEST, EventType.CONNECT_RESPONSE, EventType.REJECTED, EventType.ESTABLISHED}
)


# -------------------------------------------------------------------- cm_id ----
class CMId:
    """An ``rdma_cm_id`` in the TCP port space, its events on ``channel``; or
    (``handle=``) the id a ``CONNECT_REQUEST`` brought."""

    def __init__(self, channel: EventChannel, *, handle: int | None = None) -> None:
        self._lib = load()
        self.channel = channel
        if handle is None:
            out = c_void_p()
            self._lib.check(self._lib.cm.rdma_create_id(channel._ch, byref(out), None, RDMA_PS_TCP), "rdma_create_id")
            handle = out.value
        self.handle: int = handle or 0

    # the id's device: struct rdma_cm_id starts with its ibv_context *, which starts with
    # its ibv_device *
    @property
    def device_name(self) -> str | None:
        """The RDMA device the CM bound this id to (after address resolution)."""
        if not self.handle:
            return None
        verbs = c_void_p.from_address(self.handle).value
        if not verbs:
            return None
        device = c_void_p.from_address(verbs).value
        name = self._lib.device_name(device) if device else None
        return name.decode() if name else None

    def _address(self, offset: int) -> tuple[str, int] | None:
        if not self.handle:
            return None
        return parse_sockaddr(ctypes.string_at(self.handle + offset, 128))

    @property
    def local_address(self) -> tuple[str, int] | None:
        return self._address(_SRC_ADDR_OFFSET)

    @property
    def peer_address(self) -> tuple[str, int] | None:
        return self._address(_DST_ADDR_OFFSET)

    def set_tos(self, tos: int) -> None:
        """The IP ToS byte (DSCP << 2 | ECN) of this connection's packets and of
        the path the CM resolves (set before resolving the route)."""
        value = c_uint8(tos)
        self._lib.check(
            self._lib.cm.rdma_set_option(self.handle, _OPTION_ID, _OPTION_ID_TOS, byref(value), 1),
            "rdma_set_option(TOS)",
        )

    def resolve_addr(self, host: str, port: int, timeout_ms: int) -> None:
        dst = sockaddr(host, port)
        self._lib.check(
            self._lib.cm.rdma_resolve_addr(self.handle, None, dst, timeout_ms), f"rdma_resolve_addr({host})"
        )

    def resolve_route(self, timeout_ms: int) -> None:
        self._lib.check(self._lib.cm.rdma_resolve_route(self.handle, timeout_ms), "rdma_resolve_route")

    def bind(self, host: str | None, port: int) -> None:
        self._lib.check(
            self._lib.cm.rdma_bind_addr(self.handle, sockaddr(host, port)), f"rdma_bind_addr({host}:{port})"
        )

    def listen(self, backlog: int) -> None:
        self._lib.check(self._lib.cm.rdma_listen(self.handle, backlog), "rdma_listen")

    @property
    def source_port(self) -> int:
        return socket.ntohs(self._lib.cm.rdma_get_src_port(self.handle))

    @staticmethod
    def _param(qp_num: int, private_data: bytes, depth: int, retry: int, rnr_retry: int) -> tuple[_ConnParam, Any]:
        buf = ctypes.create_string_buffer(private_data, len(private_data))
        param = _ConnParam(
            private_data=ctypes.cast(buf, c_void_p),
            private_data_len=len(private_data),
            responder_resources=depth,
            initiator_depth=depth,
            flow_control=1,
            retry_count=retry,
            rnr_retry_count=rnr_retry,
            srq=0,
            qp_num=qp_num,
        )
        return param, buf  # (the buffer must outlive the call)

    def connect(self, qp_num: int, private_data: bytes, *, depth: int, retry: int, rnr_retry: int = 7) -> None:
        """Send the REQ for our own QP ``qp_num`` (manual-QP mode: the CM does not
        touch it; the caller moves it to RTR/RTS and calls :meth:`establish`)."""
        if len(private_data) > REQ_PRIVATE_DATA:
            raise ValueError(f"a REQ carries at most {REQ_PRIVATE_DATA} bytes of private data")
        param, _keep = self._param(qp_num, private_data, depth, retry, rnr_retry)
        self._lib.check(self._lib.cm.rdma_connect(self.handle, byref(param)), "rdma_connect")

    def accept(self, qp_num: int, private_data: bytes, *, depth: int, retry: int, rnr_retry: int = 7) -> None:
        """Send the REP (the caller's QP is in RTS already)."""
        if len(private_data) > REP_PRIVATE_DATA:
            raise ValueError(f"a REP carries at most {REP_PRIVATE_DATA} bytes of private data")
        param, _keep = self._param(qp_num, private_data, depth, retry, rnr_retry)
        self._lib.check(self._lib.cm.rdma_accept(self.handle, byref(param)), "rdma_accept")

    def reject(self, private_data: bytes = b"") -> None:
        data = private_data[:REJ_PRIVATE_DATA]
        buf = ctypes.create_string_buffer(data, len(data)) if data else None
        self._lib.check(self._lib.cm.rdma_reject(self.handle, buf, len(data)), "rdma_reject")

    def establish(self) -> None:
        """Send the RTU: the active side's QP is in RTS (manual-QP mode)."""
        self._lib.check(self._lib.cm.rdma_establish(self.handle), "rdma_establish")

    def disconnect(self) -> None:
        self._lib.check(self._lib.cm.rdma_disconnect(self.handle), "rdma_disconnect")

    def _init_qp_attr(self, state: int) -> _QPAttr:
        attr = _QPAttr()
        attr.qp_state = state
        mask = c_int(0)
        self._lib.check(self._lib.cm.rdma_init_qp_attr(self.handle, byref(attr), byref(mask)), "rdma_init_qp_attr")
        return attr

    def port_num(self) -> int:
        """The device port the CM bound this id to."""
        return int(self._init_qp_attr(_QPS_INIT).port_num)

    def queue_pair_attributes(self) -> QueuePairAttributes:
        """The CM's RTR and RTS attributes (once the peer's QP number is known:
        after CONNECT_REQUEST on the server, CONNECT_RESPONSE on the client)."""
        rtr = self._init_qp_attr(_QPS_RTR)
        rts = self._init_qp_attr(_QPS_RTS)
        grh = rtr.ah_attr.grh
        return QueuePairAttributes(
            port_num=rtr.ah_attr.port_num or rtr.port_num,
            dest_qp_num=rtr.dest_qp_num,
            rq_psn=rtr.rq_psn,
            sq_psn=rts.sq_psn,
            path_mtu=rtr.path_mtu,
            dgid=bytes(grh.dgid),
            sgid_index=grh.sgid_index,
            hop_limit=grh.hop_limit,
            traffic_class=grh.traffic_class,
            flow_label=grh.flow_label,
            service_level=rtr.ah_attr.sl,
            max_dest_rd_atomic=rtr.max_dest_rd_atomic,
            max_rd_atomic=rts.max_rd_atomic,
            timeout=rts.timeout,
            retry_cnt=rts.retry_cnt,
            rnr_retry=rts.rnr_retry,
            min_rnr_timer=rtr.min_rnr_timer,
        )

    def destroy(self) -> None:
        """Destroy the id (idempotent; never raises)."""
        if self.handle:
            handle, self.handle = self.handle, 0
            self._lib.cm.rdma_destroy_id(handle)
