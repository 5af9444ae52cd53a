"""RDMA CM as a second way to connect: ``connect(..., rdma_cm=True)`` and ``start_server(..., rdma_cm=True)``.

Over the TCP rendezvous (:mod:`aiordma.handshake`), aiordma learns the peer's
queue pair by messages on a TCP connection. Over RDMA CM, the Connection
Manager does what the field's C programs rely on it for: it resolves the
server's IP address to the local RDMA device and port that own a route to it,
resolves the path (GIDs, path MTU) and connects the two queue pairs with its
REQ/REP/RTU exchange, which carries their QP numbers and starting PSNs. The
QP is still the connection's own (created on its protection domain): the CM
runs in manual-QP mode and aiordma moves the QP with the attributes the CM
computed (:meth:`~aiordma.providers.librdmacm.CMId.queue_pair_attributes`).

What aiordma's rendezvous carries besides goes in two places:

====  ==========================================  ==========================================
step  client (:func:`connect`)                     server (:class:`Listener`, :func:`accept`)
====  ==========================================  ==========================================
1     resolve address and route: the device        listen on the port (the CM's TCP port
      and port, the path                           space: the same number as the server's
                                                   TCP rendezvous, another namespace)
2     REQ, private data :class:`CMHello`: the      CONNECT_REQUEST: QP to RTR and RTS with
      protocol version, the MTU cap, the           the CM's attributes; REP with its own
      receive buffers (initial credits)            :class:`CMHello` (or REJ: a reason)
3     CONNECT_RESPONSE: QP to RTR and RTS,         (ESTABLISHED when the RTU arrives)
      RTU (``rdma_establish``)
4     on the queue pair: the rendezvous's hello,   the same, with the server's back-off,
      capabilities and HMAC proof, then the        then its endpoint; waits for ``ready``
      endpoints (exposed buffers, a stream ring)
      and ``ready``
====  ==========================================  ==========================================

Step 4 is the same messages as over TCP, carried on the connected queue pair
as control messages (op ``_rv``).

So every API works the same over either way of connecting, and a server
keeps its authentication and back-off: nothing is exposed (no rkey is sent)
before the client proves it knows the token. Afterwards the goodbye travels
on the queue pair too, and the CM's ``DISCONNECTED`` (the peer's DREQ, or the
CM giving up on it) is the end of the rendezvous, as EOF is over TCP.

Differences a user sees: RDMA CM needs an RDMA device (pyverbs provider:
mlx5, irdma, kernel rxe; the soft device has no CM), the address to connect
to is one an RDMA device's network interface carries (the CM binds the
connection to that device, the way a server on several devices picks one),
and there is no TCP keepalive: an idle connection to a host that vanished is
noticed by its next operation's retries or by the CM. A goodbye sent by
``abort()`` is best effort: the queue pair is destroyed right after.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import rendezvous
from .connection import Connection, StreamRingFactory
from .control import ControlMessages
from .errors import HandshakeTimeoutError, ProtocolVersionError, ProviderUnavailableError, RendezvousError
from .exposure import Exposable, as_exposables
from .path import AddressVector
from .providers import device_for
from .providers.base import DeviceContext
from .providers.librdmacm import CMError, CMEvent, CMId, EventChannel, EventType, QueuePairAttributes
from .rendezvous import DEFAULT_PORT, Authenticate, Endpoint
from .security import TokenSource, is_loopback_address

__all__ = ["CMChannel", "CMHello", "CMRequest", "Listener", "accept", "connect"]

log = logging.getLogger("aiordma")

#: "AIOR", the version, flags, the MTU cap, receive buffers and their size: 16 bytes
_HELLO = struct.Struct(">4sBBHII")
MAGIC = b"AIOR"
#: the version of this private-data layout (and of the first exchange it opens)
CM_VERSION = 1
_FLAG_STREAM = 1
#: a REJ from an aiordma server starts so, then says why
_REJECT_PREFIX = b"aiordma: "
#: how long librdmacm may take to resolve an address or a route, at most (ms)
_RESOLVE_MS = 2000


# ------------------------------------------------------------ private data ----
@dataclass(frozen=True)
class CMHello:
    """What a REQ's or REP's private data says of its sender: that it is an
    aiordma endpoint (magic, version), a byte-stream one or not, the largest path
    MTU it accepts, and its receive buffers for messages (the peer's initial
    send credits, needed before the first exchange can travel)."""

    streams: bool
    mtu: int
    recv_buffers: int
    recv_buffer_size: int

    def pack(self) -> bytes:
        flags = _FLAG_STREAM if self.streams else 0
        return _HELLO.pack(MAGIC, CM_VERSION, flags, self.mtu, self.recv_buffers, self.recv_buffer_size)

    @classmethod
    def parse(cls, data: bytes) -> CMHello:
        """The peer's hello (the CM pads private data with zeros); a peer that
        is not aiordma, or of another version, gets a :class:`RendezvousError`."""
        if len(data) < _HELLO.size:
            raise RendezvousError(
                f"the peer's RDMA CM private data is {len(data)} bytes, not an aiordma hello (rping? another program?)"
            )
        magic, version, flags, mtu, recv_buffers, size = _HELLO.unpack_from(data)
        if magic != MAGIC:
            raise RendezvousError("the peer's RDMA CM private data is not an aiordma hello (another program?)")
        if version != CM_VERSION:
            raise ProtocolVersionError(f"the peer speaks aiordma RDMA CM version {version}, this side {CM_VERSION}")
        if mtu not in (256, 512, 1024, 2048, 4096) or recv_buffers > 1 << 20 or size > 1 << 30:
            raise RendezvousError(
                f"the peer's aiordma hello is invalid (MTU {mtu}, {recv_buffers} receive buffers of {size} bytes)"
            )
        return cls(bool(flags & _FLAG_STREAM), mtu, recv_buffers, size)

    @classmethod
    def of(cls, local: Endpoint, streams: bool) -> CMHello:
        return cls(streams, local.mtu, local.recv_buffers, local.recv_buffer_size)

    def endpoint(self, provider: str) -> Endpoint:
        """The peer as far as the hello tells (the CM's attributes fill in the QP
        number, the PSN and the GID)."""
        return Endpoint(
            qpn=0,
            psn=0,
            gid=bytes(16),
            mtu=self.mtu,
            provider=provider,
            recv_buffers=self.recv_buffers,
            recv_buffer_size=self.recv_buffer_size,
        )


def _cm_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Connection options over RDMA CM: the queue pair exists before the peer's
    hello says what it offers, so receive buffers of its own unless ``srq=True``
    (a peer of this version or later then earns its credits; an older one keeps
    its first few)."""
    return {**options, "srq": bool(options.get("srq"))}


def rejection_reason(private_data: bytes) -> str | None:
    """The reason an aiordma server put in its REJ, or None."""
    if not private_data.startswith(_REJECT_PREFIX):
        return None
    return private_data[len(_REJECT_PREFIX) :].split(b"\0", 1)[0].decode("utf-8", "replace")


# ------------------------------------------------------------------ events ----
class _Events:
    """One CM event channel on the loop: each event goes to the queue of the id it
    is for; a CONNECT_REQUEST to ``on_request``. Closed once it was asked to be
    and no id is left on it (a listener's accepted ids keep their events there)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.channel = EventChannel()
        self.queues: dict[int, asyncio.Queue[CMEvent]] = {}
        self.on_request: Callable[[CMEvent], None] | None = None
        self._closing = False
        loop.add_reader(self.channel.fd, self._readable)

    def watch(self, handle: int) -> asyncio.Queue[CMEvent]:
        q: asyncio.Queue[CMEvent] = asyncio.Queue()
        self.queues[handle] = q
        return q

    def forget(self, handle: int) -> None:
        self.queues.pop(handle, None)
        if self._closing and not self.queues:
            self._close_now()

    def _readable(self) -> None:
        while True:
            try:
                ev = self.channel.get()
            except CMError as e:
                log.warning("aiordma RDMA CM: %s", e)
                return
            if ev is None:
                return
            log.debug("aiordma RDMA CM: %s (status %d) for id 0x%x", ev.name, ev.status, ev.id)
            if ev.type == EventType.CONNECT_REQUEST and ev.id not in self.queues:
                if self.on_request is not None:
                    self.on_request(ev)
                else:  # the listener is closing: refuse, and let the new id go
                    orphan = CMId(self.channel, handle=ev.id)
                    try:
                        orphan.reject(_REJECT_PREFIX + b"the server is closing")
                    except CMError:
                        pass
                    orphan.destroy()
                continue
            q = self.queues.get(ev.id)
            if q is not None:
                q.put_nowait(ev)

    def close(self) -> None:
        self._closing = True
        self.on_request = None
        if not self.queues:
            self._close_now()

    def _close_now(self) -> None:
        if self.channel.fd >= 0:
            try:
                self.loop.remove_reader(self.channel.fd)
            except Exception:  # the loop is closed already
                pass
            self.channel.close()
            self.channel.fd = -1


async def _next_event(queue: asyncio.Queue[CMEvent], timeout: float, what: str) -> CMEvent:
    try:
        return await asyncio.wait_for(queue.get(), timeout)
    except TimeoutError:
        raise HandshakeTimeoutError(f"RDMA CM: {what} timed out after {timeout} s") from None


# ----------------------------------------------------------------- channel ----
class CMChannel(rendezvous.ChannelBase):
    """The rendezvous of an RDMA CM connection (a :class:`~aiordma.rendezvous.MessageChannel`):
    its messages travel on the connected queue pair as control messages, and the
    CM's ``DISCONNECTED`` ends it as EOF ends a TCP one. Owns the cm_id."""

    def __init__(self, events: _Events, cm_id: CMId, queue: asyncio.Queue[CMEvent], *, owns_events: bool) -> None:
        self.received = 0
        self._events = events
        self.cm_id = cm_id
        self._handle = cm_id.handle
        self._owns_events = owns_events
        self._cm_events = queue
        self._inbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._conn: Connection | None = None
        self._closed = False
        self._end = "the peer disconnected (RDMA CM DISCONNECTED)"
        self._peer = cm_id.peer_address
        self._local = cm_id.local_address
        self._watch: asyncio.Task[None] | None = None

    def bind(self, conn: Connection) -> None:
        """Take the rendezvous messages that arrive on ``conn``'s queue pair."""
        self._conn = conn
        conn._route_rendezvous(self._inbox.put_nowait)

    def connected(self) -> None:
        """The CM's part is done (REP sent, or RTU): from now on its events for this
        id are the connection's end."""
        if self._watch is None and not self._closed:
            self._watch = self._events.loop.create_task(self._watch_cm())

    async def _watch_cm(self) -> None:
        while True:
            ev = await self._cm_events.get()
            if ev.type in (EventType.DISCONNECTED, EventType.DEVICE_REMOVAL, EventType.TIMEWAIT_EXIT):
                if ev.type == EventType.DEVICE_REMOVAL:
                    self._end = "the RDMA device was removed (RDMA CM DEVICE_REMOVAL)"
                if self._conn is not None:
                    # what the peer sent before its DREQ (its goodbye above all) is in the CQ
                    # already, acknowledged: deliver it first, as TCP delivers data before EOF
                    self._conn.dispatcher.drain_now()
                self._inbox.put_nowait(None)
                return

    # --------------------------------------------------- MessageChannel ----
    async def send(self, msg: dict[str, Any]) -> None:
        conn = self._conn
        if conn is None or self._closed:
            raise RendezvousError("the RDMA CM connection is closed")
        data = ControlMessages.rendezvous_message(msg)
        if len(data) > rendezvous.MAX_MESSAGE:
            raise RendezvousError(f"rendezvous message of {len(data)} bytes exceeds {rendezvous.MAX_MESSAGE}")
        await conn._send_control_data(data, farewell=msg.get("t") == "bye")

    async def recv(self) -> dict[str, Any]:
        msg = await self._inbox.get()
        if msg is None:
            self._inbox.put_nowait(None)  # (whoever asks again hears the same)
            raise RendezvousError(self._end)
        self.received += 1
        return rendezvous.raise_if_refused(msg)

    def send_nowait(self, msg: dict[str, Any]) -> None:
        """Best effort: the message is posted on the next loop turn (a connection
        torn down at once may flush it unsent)."""
        if self._conn is None or self._closed:
            return
        task = self._events.loop.create_task(self.send(msg))
        task.add_done_callback(_consume)

    def keep_alive(self) -> bool:
        return False  # no TCP connection: the queue pair's retries and the CM notice a dead peer

    @property
    def peername(self) -> Any:
        return self._peer

    @property
    def sockname(self) -> Any:
        return self._local

    def close(self) -> None:
        """Disconnect (a DREQ: the peer sees DISCONNECTED) and destroy the cm_id."""
        if self._closed:
            return
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn._route_rendezvous(None)
        if self._watch is not None:
            self._watch.cancel()
        self._inbox.put_nowait(None)
        try:
            self.cm_id.disconnect()
        except CMError:
            pass  # never connected, or the peer disconnected first
        self.cm_id.destroy()
        self._events.forget(self._handle)
        if self._owns_events:
            self._events.close()


def _consume(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


def _check_endpoint(peer: Endpoint, cm: QueuePairAttributes) -> Endpoint:
    """The peer's endpoint message must name the queue pair the CM connected."""
    if peer.qpn != cm.dest_qp_num:
        raise RendezvousError(
            f"the peer's endpoint names QP 0x{peer.qpn:06x}, but RDMA CM connected QP 0x{cm.dest_qp_num:06x}"
        )
    return peer


# ------------------------------------------------------------------ client ----


def _device_of(cm_id: CMId, provider: str | None, device: DeviceContext | str | None) -> DeviceContext:
    """The device (and port) the CM bound the connection to; a device the caller
    named must be that one."""
    name, port = cm_id.device_name, cm_id.port_num()
    if name is None:
        raise RendezvousError("RDMA CM resolved the address but bound no device to it")
    chosen = f"{name}:{port}"
    if device is not None:
        dev = device_for(provider, device)
        if dev.provider != "pyverbs" or getattr(dev, "name", None) != name or dev.port_num != port:
            asked = device if isinstance(device, str) else getattr(device, "name", repr(device))
            raise RendezvousError(
                f"RDMA CM routes this address through {chosen}, not the device asked for ({asked}): "
                "connect to an address of that device, or leave device= out"
            )
        return dev
    return device_for("pyverbs", chosen)


def _needs_hardware(provider: str | None, device: DeviceContext | str | None) -> None:
    soft = provider == "soft" or (isinstance(device, str) and device.startswith("soft"))
    if isinstance(device, DeviceContext):
        soft = device.provider == "soft"
    if soft:
        raise ProviderUnavailableError(
            "RDMA CM connects RDMA devices (pyverbs: mlx5, irdma, kernel rxe); the soft device has no "
            "connection manager: connect through the TCP rendezvous (rdma_cm=False)"
        )


async def connect(
    host: str,
    port: int = DEFAULT_PORT,
    *,
    provider: str | None = None,
    device: DeviceContext | str | None = None,
    expose: Mapping[str, Exposable] | None = None,
    token: TokenSource = None,
    timeout: float = 10.0,
    stream_ring_factory: StreamRingFactory | None = None,
    **options: Any,
) -> Connection:
    """:func:`aiordma.connect` over RDMA CM (``rdma_cm=True``): resolve
    ``host`` (an address on an RDMA device's interface) and a route to it,
    connect with the CM to the server's CM listener on ``port``, then the first
    exchange on the queue pair. Errors are :func:`aiordma.connect`'s."""
    _needs_hardware(provider, device)
    secret = rendezvous.token_from_env(token)
    as_exposables(expose)
    loop = asyncio.get_running_loop()
    events = _Events(loop)
    try:
        cm_id = CMId(events.channel)
    except BaseException:
        events.close()
        raise
    queue = events.watch(cm_id.handle)
    offer, require = rendezvous.capabilities(stream_ring_factory is not None)
    made: list[Connection] = []
    channels: list[CMChannel] = []

    # the CM's own packets (its MADs) and the route it resolves carry the connection's
    # traffic class too (the QP's address vector gets it from the Connection)
    av = AddressVector.of(options.get("traffic_class"), None, None, None)

    async def steps() -> Connection:
        if av.traffic_class:
            cm_id.set_tos(av.traffic_class)
        cm_id.resolve_addr(host, port, _RESOLVE_MS)
        ev = await _next_event(queue, timeout, f"resolving {host}")
        if ev.type != EventType.ADDR_RESOLVED:
            raise RendezvousError(
                f"RDMA CM cannot resolve {host} to a local RDMA device ({ev.name}, status {ev.status}): "
                "is it reachable through an RDMA device's network interface (`rdma link show`)?"
            )
        try:
            cm_id.resolve_route(_RESOLVE_MS)
        except CMError as e:  # (loopback resolves, then has no device to route through)
            raise RendezvousError(
                f"RDMA CM found no route to {host}: {e}; connect to an address of an RDMA device's network interface"
            ) from e
        ev = await _next_event(queue, timeout, f"resolving a route to {host}")
        if ev.type != EventType.ROUTE_RESOLVED:
            raise RendezvousError(f"RDMA CM found no route to {host} ({ev.name}, status {ev.status})")
        dev = _device_of(cm_id, provider, device)
        conn = Connection(dev, **_cm_options(options))
        made.append(conn)
        ch = CMChannel(events, cm_id, queue, owns_events=True)
        channels.append(ch)
        ch.bind(conn)
        conn.capabilities = list(offer)  # (until the hello says what both share)
        hello = CMHello.of(conn._local_endpoint(), stream_ring_factory is not None)
        depth, retry = int(options.get("max_rd_atomic", 16)), int(options.get("retry_cnt", 7))
        cm_id.connect(conn.qp.qp_num, hello.pack(), depth=depth, retry=retry)
        ev = await _next_event(queue, timeout, f"connecting to {host}:{port}")
        if ev.type == EventType.REJECTED:
            reason = rejection_reason(ev.private_data)
            raise RendezvousError(
                f"the aiordma server at {host}:{port} refused the RDMA CM connection: {reason}"
                if reason
                else f"RDMA CM connection to {host}:{port} rejected (status {ev.status}): "
                "is an aiordma server listening there with rdma_cm=True?"
            )
        if ev.type != EventType.CONNECT_RESPONSE:
            raise RendezvousError(f"RDMA CM connection to {host}:{port} failed ({ev.name}, status {ev.status})")
        peer_hello = CMHello.parse(ev.private_data)
        attrs = cm_id.queue_pair_attributes()
        log.debug("aiordma RDMA CM: client QP 0x%x with %s", conn.qp.qp_num, attrs)
        conn._connect_queue_pair(peer_hello.endpoint(dev.provider), attrs)
        cm_id.establish()
        ch.connected()
        # the first exchange, on the queue pair: the rendezvous's own messages
        caps = await rendezvous.client_hello(ch, secret, offer, require)
        ring = stream_ring_factory(conn) if stream_ring_factory is not None else None
        await ch.send(conn._local_endpoint(expose, stream_ring=ring).to_wire())
        peer = _check_endpoint(Endpoint.from_wire(await ch.expect("endpoint")), attrs)
        conn._adopt_peer(peer, caps)
        await ch.send({"t": "ready"})
        return conn

    try:
        conn: Connection = await rendezvous.with_timeout(steps(), timeout, f"RDMA CM connection to {host}:{port}")
    except BaseException:
        for half_made in made:
            half_made.abort()
        if channels:
            channels[0].close()
        else:
            cm_id.destroy()
            events.forget(cm_id.handle)
            events.close()
        raise
    conn._attach_rendezvous(channels[0])
    return conn


# ------------------------------------------------------------------ server ----
class CMRequest:
    """One client's ``CONNECT_REQUEST``: the new cm_id, what the REQ said."""

    def __init__(self, events: _Events, event: CMEvent) -> None:
        self.events = events
        self.cm_id = CMId(events.channel, handle=event.id)
        self.queue = events.watch(event.id)
        self.private_data = event.private_data
        self.peer_address = self.cm_id.peer_address
        self.device_name = self.cm_id.device_name
        self._answered = False

    @property
    def port_num(self) -> int:
        return self.cm_id.port_num()

    def reject(self, reason: str) -> None:
        """Refuse with a REJ that says why, and let the id go."""
        if self._answered:
            return
        self._answered = True
        try:
            self.cm_id.reject(_REJECT_PREFIX + reason.encode("utf-8", "replace"))
        except CMError as e:
            log.info("aiordma RDMA CM: rdma_reject: %s", e)
        self.cm_id.destroy()
        self.events.forget(self.cm_id.handle or 0)

    def channel(self) -> CMChannel:
        self._answered = True
        return CMChannel(self.events, self.cm_id, self.queue, owns_events=False)


class Listener:
    """An RDMA CM listener on ``host:port`` (the CM's TCP port space): each
    ``CONNECT_REQUEST`` is handed to ``on_request`` as a :class:`CMRequest`."""

    def __init__(self, host: str | None, port: int, on_request: Callable[[CMRequest], None], backlog: int) -> None:
        if host and is_loopback_address(host):
            raise RendezvousError(
                f"RDMA CM cannot listen on {host}: no RDMA device carries a loopback address; "
                "listen on an address of an RDMA device's network interface, or on every address"
            )
        self._events = _Events(asyncio.get_running_loop())
        try:
            self._id = CMId(self._events.channel)
            self._id.bind(host, port)
            self._id.listen(backlog)
        except CMError as e:
            self._events.close()
            where = host or "every address"
            raise RendezvousError(
                f"RDMA CM cannot listen on {where} port {port}: {e} (an address no RDMA device carries, "
                "such as loopback, has no RDMA CM; another listener may hold the port)"
            ) from e
        self.port = self._id.source_port
        self._on_request = on_request
        self._events.on_request = self._request

    def _request(self, event: CMEvent) -> None:
        self._on_request(CMRequest(self._events, event))

    def close(self) -> None:
        """Stop listening; the connections made stay (their events still come here)."""
        self._id.destroy()
        self._events.close()


async def accept(
    request: CMRequest,
    device: DeviceContext,
    authenticate: Authenticate,
    *,
    expose: Mapping[str, Exposable] | None = None,
    stream_ring_factory: StreamRingFactory | None = None,
    options: Mapping[str, Any] | None = None,
    channel_made: Callable[[CMChannel], None] | None = None,
) -> Connection:
    """The server's side of an RDMA CM connection: a :class:`Connection` on
    ``device`` whose QP is moved with the CM's attributes, the REP, then the
    first exchange on the queue pair (``authenticate`` runs the rendezvous's
    hello with the server's back-off). A request refused before the REP gets a
    REJ that says why; ``channel_made`` is told the channel once the REP is
    sent (the caller closes it if this fails afterwards)."""
    offer, require = rendezvous.capabilities(stream_ring_factory is not None)
    conn: Connection | None = None
    try:
        try:
            peer_hello = CMHello.parse(request.private_data)
            conn = Connection(device, **_cm_options(options or {}))
            conn.capabilities = list(offer)
            attrs = request.cm_id.queue_pair_attributes()
            log.debug("aiordma RDMA CM: server QP 0x%x with %s", conn.qp.qp_num, attrs)
            conn._connect_queue_pair(peer_hello.endpoint(device.provider), attrs)
        except BaseException as e:
            request.reject(str(e) if isinstance(e, Exception) else "the server is stopping")
            raise
        ch = request.channel()
        ch.bind(conn)
        if channel_made is not None:
            channel_made(ch)
        hello = CMHello.of(conn._local_endpoint(), stream_ring_factory is not None)
        opts = options or {}
        depth, retry = int(opts.get("max_rd_atomic", 16)), int(opts.get("retry_cnt", 7))
        request.cm_id.accept(conn.qp.qp_num, hello.pack(), depth=depth, retry=retry)
        ch.connected()
        caps = await authenticate(ch, offer, require)
        peer = _check_endpoint(Endpoint.from_wire(await ch.expect("endpoint")), attrs)
        conn._adopt_peer(peer, caps)
        ring = stream_ring_factory(conn) if stream_ring_factory is not None else None
        await ch.send(conn._local_endpoint(expose, stream_ring=ring).to_wire())
        await ch.expect("ready")
        return conn
    except BaseException:
        if conn is not None:
            conn.abort()
        raise
