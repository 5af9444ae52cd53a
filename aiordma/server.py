"""Servers: accept rendezvous connections and hand each one to a handler.

Lifetimes follow asyncio's :class:`asyncio.Server`:

* :meth:`Server.close` stops accepting; connections already made live on;
* :meth:`Server.close_clients` closes them (flush, goodbye), and
  :meth:`Server.abort_clients` aborts them at once (what Python 3.13 added
  to asyncio's server);
* :meth:`Server.wait_closed` waits until the listener is closed and every
  connection it made is closed (then handlers still running are cancelled:
  their connection is gone);
* ``async with server:`` closes the listener and the clients on exit.

Protected mode (:mod:`aiordma.security`): a server that would listen on
anything but loopback without a token refuses to start
(:class:`~aiordma.ProtectedModeError`), unless ``insecure=True`` (or
``AIORDMA_INSECURE=1``) says so explicitly. ``host=None`` or ``""`` listens
on every interface, which is not loopback. Failed authentications are
rate-limited per source address (:class:`~aiordma.security.AuthThrottle`).

A connection belongs to its handler: it is closed when the handler returns,
unless the handler hands it off with :meth:`~aiordma.Connection.detach`
(a framework that passes each connection to a background task, as Dask's
comm listener does, needs that); a detached connection lives until it is
closed, and the server still counts it among its clients.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from . import cm, handshake, rendezvous
from .connection import Connection
from .errors import (
    AuthenticationError,
    CapabilityError,
    ConnectionLostError,
    ProtocolVersionError,
    RDMAError,
    RendezvousError,
)
from .exposure import Exposable, as_exposables
from .memory import RemoteBuffer
from .providers import device_for
from .providers.base import DeviceContext
from .rendezvous import DEFAULT_PORT
from .security import AuthThrottle, TokenSource, check_protected_mode, insecure_from_env, peer_host, source_key

log = logging.getLogger("aiordma")

__all__ = ["Server", "start_server"]

Handler = Callable[[Connection], Awaitable[Any]]


#: the rendezvous listener's backlog (the kernel caps it at net.core.somaxconn)
LISTEN_BACKLOG = max(socket.SOMAXCONN, 4096)


class _BackingOff(RDMAError):
    """The client's source address is backing off after failed authentications."""

    def __init__(self, wait: float) -> None:
        super().__init__(f"backing off for {wait:.1f} s")
        self.wait = wait


def _address_key(host: str) -> str:
    """An IP address as one spelling: an IPv4-mapped IPv6 address as its IPv4."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def devices_by_address(devices: Sequence[DeviceContext]) -> dict[str, DeviceContext]:
    """Which device owns each IP address its port 1's GIDs carry (a RoCE GID is
    an IP address of the device's network interface); the first device listed
    wins an address two of them carry."""
    owners: dict[str, DeviceContext] = {}
    for device in devices:
        for entry in device.query_gid_table(device.port_num):
            owners.setdefault(_address_key(str(ipaddress.IPv6Address(entry.gid))), device)
    return owners


class Server:
    """An aiordma server: accepts rendezvous connections and runs
    ``handler(conn)`` for each. Use as ``async with``, like asyncio's servers.

    With several devices, each client's connection uses the device whose GID
    is the address the client reached (the rendezvous connection's local
    address), the way RDMA CM binds a connection to the device that owns its
    address; a client that reached another address (loopback, a name the
    devices' GIDs do not carry) gets the first device."""

    def __init__(
        self,
        handler: Handler,
        *,
        device: DeviceContext | Sequence[DeviceContext],
        expose: Mapping[str, Exposable] | None = None,
        token: bytes | None = None,
        insecure: bool = False,
        auth_throttle: AuthThrottle | None = None,
        handshake_timeout: float = 10.0,
        stream_ring_factory: Callable[[Connection], RemoteBuffer] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self._handler = handler
        self._devices = (device,) if isinstance(device, DeviceContext) else tuple(device)
        if not self._devices:
            raise ValueError("a server needs at least one device")
        self._by_address = devices_by_address(self._devices) if len(self._devices) > 1 else {}
        self._expose = as_exposables(expose)
        self._token = token
        self._insecure = insecure
        #: failed authentications per source address, and the back-off they earn
        self.auth_throttle = auth_throttle if auth_throttle is not None else AuthThrottle()
        #: handshakes at the challenge, and those waiting for a turn, per source
        self._lanes: dict[str, int] = {}
        self._lane_waiters: dict[str, collections.deque[asyncio.Future[None]]] = {}
        self._handshake_timeout = handshake_timeout
        self._stream_ring_factory = stream_ring_factory
        self._options = dict(options or {})
        self._server: asyncio.base_events.Server | None = None
        #: the RDMA CM listener (``rdma_cm=True``)
        self._cm: cm.Listener | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._port: int | None = None
        self._sockets: tuple[Any, ...] = ()
        self._connections: set[Connection] = set()
        #: one future per rendezvous still in its handshake, done when it ends (a
        #: client's connect() returns before the server's side has its connection)
        self._handshakes: set[asyncio.Future[None]] = set()
        self.refused = 0
        self.accepted = 0
        self.last_error: BaseException | None = None

    @property
    def devices(self) -> tuple[DeviceContext, ...]:
        """The RDMA devices this server's connections use (the first is the default)."""
        return self._devices

    def device_for(self, local_address: Any) -> DeviceContext:
        """The device for a client that reached this server at ``local_address``
        (the rendezvous socket's own address, ``(host, port, ...)``)."""
        if self._by_address and local_address:
            owner = self._by_address.get(_address_key(str(local_address[0])))
            if owner is not None:
                return owner
        return self._devices[0]

    @property
    def connections(self) -> set[Connection]:
        """The connections this server made that are not closed yet (detached ones too)."""
        live = {c for c in self._connections if not c.closed}
        self._connections = live
        return set(live)

    @property
    def sockets(self) -> tuple[Any, ...]:
        """The listening sockets of the rendezvous (empty once closed)."""
        return tuple(self._server.sockets) if self._server and self._server.is_serving() else ()

    @property
    def port(self) -> int:
        """The TCP port the rendezvous listens on (or listened on, once closed)."""
        if self._port is None:
            raise RuntimeError("the server has not started listening")
        return self._port

    def is_serving(self) -> bool:
        return self._server is not None and self._server.is_serving()

    async def _take_lane(self, host: str) -> float:
        """Before a challenge: wait for one of the source's lanes
        (:meth:`AuthThrottle.lanes`). Returns 0, or the back-off the source
        is in (then it has no lane and is refused)."""
        throttle = self.auth_throttle
        key = source_key(host)
        while True:
            wait = throttle.admit(host)
            if wait > 0:
                return wait
            if self._lanes.get(key, 0) < throttle.lanes(host):
                self._lanes[key] = self._lanes.get(key, 0) + 1
                return 0.0
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._lane_waiters.setdefault(key, collections.deque()).append(fut)
            try:
                await fut
            finally:
                waiters = self._lane_waiters.get(key)
                if waiters is not None:
                    with contextlib.suppress(ValueError):
                        waiters.remove(fut)
                    if not waiters:
                        del self._lane_waiters[key]

    def _release_lane(self, host: str) -> None:
        key = source_key(host)
        n = self._lanes.get(key, 0) - 1
        if n > 0:
            self._lanes[key] = n
        else:
            self._lanes.pop(key, None)
        self._wake_lane(key)

    def _wake_lane(self, key: str) -> None:
        # every waiter of the source looks again: a turn freed may now be refused
        # (the source started backing off) or more than one may fit (lanes changed)
        waiters = self._lane_waiters.pop(key, None)
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)

    async def _authenticate(
        self, ch: rendezvous.MessageChannel, host: str | None, offer: Any, require: Any
    ) -> list[str]:
        """Steps 1-3 of the rendezvous, with the back-off: a source that is
        backing off gets no challenge, at most its lanes' worth of challenges
        are outstanding, and a wrong MAC is counted before the client hears of it."""
        if host is None or self._token is None:
            caps: list[str] = await rendezvous.server_hello(ch, self._token, offer, require)
            return caps
        wait = await self._take_lane(host)
        if wait > 0:
            raise _BackingOff(wait)
        try:
            caps = await rendezvous.server_hello(
                ch, self._token, offer, require, on_wrong_token=lambda: self.auth_throttle.failed(host)
            )
            return caps
        finally:
            self._release_lane(host)

    async def _handshake(self, ch: rendezvous.MessageChannel, host: str | None = None) -> Connection:
        async def authenticate(
            ch: rendezvous.MessageChannel, offer: tuple[str, ...], require: tuple[str, ...]
        ) -> list[str]:
            return await self._authenticate(ch, host, offer, require)

        return await handshake.accept(
            ch,
            self.device_for(ch.sockname),
            authenticate,
            expose=self._expose,
            stream_ring_factory=self._stream_ring_factory,
            options=self._options,
        )

    async def _refuse_backing_off(self, ch: rendezvous.MessageChannel, host: str, wait: float) -> None:
        """Refuse a source that is backing off, before it gets a challenge:
        read its hello (so the error is not lost in a reset), then say when to retry."""
        self.refused += 1
        log.info("aiordma server: refused %s: backing off after failed authentications (%.1f s left)", host, wait)
        try:
            await asyncio.wait_for(ch.recv(), min(1.0, self._handshake_timeout))
        except (RDMAError, OSError, TimeoutError):
            pass
        await ch.fail(
            "auth", f"too many failed authentication attempts from {host}: try again in {max(1, round(wait))} s"
        )

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handshake_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._handshakes.add(handshake_done)
        try:
            await self._serve_client(reader, writer, handshake_done)
        finally:
            self._handshake_ended(handshake_done)

    def _handshake_ended(self, handshake_done: asyncio.Future[None]) -> None:
        self._handshakes.discard(handshake_done)
        if not handshake_done.done():
            handshake_done.set_result(None)

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handshake_done: asyncio.Future[None]
    ) -> None:
        ch = rendezvous.Channel(reader, writer)
        host = peer_host(ch.peername)
        try:
            conn = await rendezvous.with_silence_timeout(
                self._handshake(ch, host), ch, self._handshake_timeout, f"rendezvous with {ch.peername}"
            )
        except _BackingOff as e:
            try:
                await self._refuse_backing_off(ch, host or "?", e.wait)
            finally:
                ch.close()
            return
        except (RDMAError, OSError, ValueError) as e:
            await self._refuse(ch, ch.peername, e)
            return
        except asyncio.CancelledError:
            ch.close()
            raise
        await self._serve(conn, ch, handshake_done)

    def _count_refusal(self, who: Any, e: BaseException) -> None:
        self.refused += 1
        self.last_error = e
        log.info("aiordma server: refused %s: %s", who, e)

    async def _refuse(self, ch: rendezvous.MessageChannel, who: Any, e: BaseException) -> None:
        """A handshake failed: count it, tell the client why (unless the rendezvous
        itself already did: a wrong token, version or capability), close."""
        self._count_refusal(who, e)
        if not isinstance(e, (AuthenticationError, ProtocolVersionError, CapabilityError)):
            await ch.fail("refused", str(e))
        ch.close()

    async def _serve(
        self, conn: Connection, ch: rendezvous.MessageChannel, handshake_done: asyncio.Future[None]
    ) -> None:
        """Run the handler for a connection whose handshake succeeded, then close it."""
        self.accepted += 1
        handshake.attach(conn, ch)
        self._connections.add(conn)
        self._handshake_ended(handshake_done)
        try:
            try:
                await self._handler(conn)
            except ConnectionLostError as e:
                log.info("aiordma server: connection %r ended: %s", conn, e)
            except Exception:
                log.exception("aiordma server: handler failed for %r", conn)
            finally:
                if not conn.detached:
                    try:
                        await conn.close()
                    except RDMAError as e:
                        log.info("aiordma server: closing %r: %s", conn, e)
            if conn.detached:
                await conn.wait_closed()
        finally:
            # a closed connection is forgotten at once: the server keeps no connection
            # (nor its buffers) that its handler and the application let go
            self._connections.discard(conn)

    def _spawn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(self._on_client(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ RDMA CM ----
    def _cm_device(self, request: cm.CMRequest) -> DeviceContext:
        """This server's device for an RDMA CM request: the one the CM bound it to."""
        name, port = request.device_name, request.port_num
        for dev in self._devices:
            if dev.provider == "pyverbs" and getattr(dev, "name", None) == name and dev.port_num == port:
                return dev
        served = ", ".join(f"{getattr(d, 'name', d.provider)}:{d.port_num}" for d in self._devices)
        raise RendezvousError(f"the connection request arrived on {name}:{port}; this server serves {served}")

    def _spawn_cm(self, request: cm.CMRequest) -> None:
        task = asyncio.get_running_loop().create_task(self._on_cm_request(request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_cm_request(self, request: cm.CMRequest) -> None:
        handshake_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._handshakes.add(handshake_done)
        channels: list[cm.CMChannel] = []
        host = peer_host(request.peer_address)

        async def authenticate(
            ch: rendezvous.MessageChannel, offer: tuple[str, ...], require: tuple[str, ...]
        ) -> list[str]:
            return await self._authenticate(ch, host, offer, require)

        async def steps() -> Connection:
            return await cm.accept(
                request,
                self._cm_device(request),
                authenticate,
                expose=self._expose,
                stream_ring_factory=self._stream_ring_factory,
                options=self._options,
                channel_made=channels.append,
            )

        try:
            try:
                conn = await rendezvous.with_timeout(
                    steps(), self._handshake_timeout, f"RDMA CM handshake with {request.peer_address}"
                )
            except _BackingOff as e:  # (raised by the hello, so after the channel was made)
                await self._refuse_backing_off(channels[0], host or "?", e.wait)
                return
            except (RDMAError, OSError, ValueError) as e:
                who = f"RDMA CM client {request.peer_address}"
                if channels:
                    await self._refuse(channels[0], who, e)
                else:  # before the REP: a REJ says why
                    self._count_refusal(who, e)
                    request.reject(str(e))
                return
            except BaseException:
                if channels:
                    channels[0].close()
                else:
                    request.reject("the server is stopping")
                raise
            await self._serve(conn, channels[0], handshake_done)
        finally:
            self._handshake_ended(handshake_done)

    async def start(self, host: str | None, port: int, *, rdma_cm: bool = False) -> None:
        """Listen for rendezvous connections on ``host:port`` (port 0: any
        free port; ``host`` None or ``""``: every interface); with ``rdma_cm``,
        for RDMA CM connections too, on the same port number of the CM's own
        port space (:mod:`aiordma.cm`).

        Protected mode: the sockets are bound first but listen only once the
        addresses they got are known to be loopback, or a token is set, or
        ``insecure`` was given; otherwise :class:`~aiordma.ProtectedModeError`
        and nothing listened."""
        # a backlog as deep as the system allows (asyncio's default is 100): a burst of
        # clients beyond it has its SYNs dropped, and each retries only after a second
        server = await asyncio.start_server(self._spawn, host, port, start_serving=False, backlog=LISTEN_BACKLOG)
        sockets = tuple(server.sockets)
        try:
            port = sockets[0].getsockname()[1]
            check_protected_mode(
                (s.getsockname()[0] for s in sockets), port, token=self._token, insecure=self._insecure
            )
            if rdma_cm:
                self._cm = cm.Listener(host, port, self._spawn_cm, LISTEN_BACKLOG)
            await server.start_serving()
        except BaseException:
            if self._cm is not None:
                self._cm.close()
                self._cm = None
            server.close()
            await server.wait_closed()
            raise
        self._server = server
        self._sockets = sockets
        self._port = port

    async def serve_forever(self) -> None:
        if self._server is None:
            raise RuntimeError("the server has not started listening")
        await self._server.serve_forever()

    def close(self) -> None:
        """Stop accepting new connections. Connections already made stay open
        (see :meth:`close_clients` and :meth:`abort_clients`), as with asyncio."""
        if self._server is not None:
            self._server.close()
        if self._cm is not None:
            self._cm.close()
            self._cm = None

    async def close_clients(self, timeout: float = 5.0) -> None:
        """Close every connection of this server (flush, goodbye, teardown),
        those whose handshake is ending included (their clients' ``connect()``
        may have returned already). Delivery errors of individual connections
        are logged, not raised."""
        if self._handshakes:
            await asyncio.wait(list(self._handshakes), timeout=timeout)
        conns = list(self.connections)
        results = await asyncio.gather(*(c.close(timeout) for c in conns), return_exceptions=True)
        for conn, res in zip(conns, results):
            if isinstance(res, BaseException):
                log.info("aiordma server: closing %r: %s", conn, res)

    def abort_clients(self) -> None:
        """Abort every connection of this server at once (the peers see an abort)."""
        for conn in list(self.connections):
            conn.abort()

    async def wait_closed(self) -> None:
        """Wait until the listener is closed and every connection this server
        made is closed (by its handler, its peer, :meth:`close_clients` or
        :meth:`abort_clients`), as asyncio's ``Server.wait_closed`` does since
        Python 3.12. Handlers still running then are cancelled and awaited."""
        if self._server is not None:
            await self._server.wait_closed()
        while True:
            live = self.connections
            if not live:
                break
            await asyncio.gather(*(c.wait_closed() for c in live), return_exceptions=True)
        while self._tasks:
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # (their done-callbacks drop them from _tasks only on a later loop turn, and a
            # gather of finished tasks does not yield on 3.12+: drop them here)
            self._tasks.difference_update(tasks)

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await self.close_clients()
        await self.wait_closed()

    def __repr__(self) -> str:
        state = "serving" if self.is_serving() else "closed"
        return f"<aiordma.Server port={self._port} {state} connections={len(self.connections)}>"


async def start_server(
    handler: Handler,
    host: str | None = None,
    port: int = DEFAULT_PORT,
    *,
    provider: str | None = None,
    device: DeviceContext | str | Sequence[DeviceContext | str] | None = None,
    expose: Mapping[str, Exposable] | None = None,
    token: TokenSource = None,
    insecure: bool | None = None,
    auth_throttle: AuthThrottle | None = None,
    handshake_timeout: float = 10.0,
    stream_ring_factory: Callable[[Connection], RemoteBuffer] | None = None,
    rdma_cm: bool = False,
    **options: Any,
) -> Server:
    """Start an aiordma server on ``host:port`` (TCP rendezvous); each client
    gets its own :class:`Connection`, passed to ``handler``. The connection is
    closed when ``handler`` returns, unless the handler called
    :meth:`Connection.detach`. Other keyword options go to each
    :class:`Connection`. ``device`` (a device context or a name such as
    ``"mlx5_1"``) is the RDMA device every connection of this server uses; a
    list of them serves on several devices: each client gets the device whose
    GID is the address it connected to (the way RDMA CM picks a device by
    address), else the first one (:attr:`Server.devices`).

    ``expose`` is offered to every client: ``{"name": region}`` read-only,
    ``{"name": region.exposed("rw")}`` with the rights it names; each client
    gets a registration of its own with only those rights
    (:mod:`aiordma.exposure`).

    ``token`` (else ``$AIORDMA_TOKEN``, else the file named by
    ``$AIORDMA_TOKEN_FILE``; a :class:`os.PathLike` is a token file) makes
    clients prove they know the shared secret. ``host`` None or ``""``
    listens on every interface. Without a token the server listens on
    loopback only: any other address raises
    :class:`~aiordma.ProtectedModeError`, unless ``insecure=True`` (else
    ``AIORDMA_INSECURE=1``) turns that off, with a warning.
    ``auth_throttle`` sets the back-off for failed authentications (default
    :class:`~aiordma.security.AuthThrottle`: 5 failures in 60 s from one
    address, then refusals for 1 s, 2 s, 4 s, … up to 60 s).
    ``handshake_timeout`` drops a client that sends nothing for that long
    during its handshake, and any handshake after three times that: a storm of
    clients that keeps the server busy for seconds is served, not dropped.

    ``rdma_cm=True`` also listens for RDMA CM connections (clients that
    ``connect(..., rdma_cm=True)``) on the same port number, in the CM's port
    space: ``host`` must then be an address an RDMA device carries (or every
    address); each connection uses the device the CM bound it to, which must
    be one of ``device``. Authentication, exposure and the handler are the
    same for both (:mod:`aiordma.cm`)."""
    secret = rendezvous.token_from_env(token)
    opt_out = insecure_from_env(insecure)
    if isinstance(device, Sequence) and not isinstance(device, str):
        devices = [device_for(provider, d) for d in device]
    else:
        devices = [device_for(provider, device)]
    server = Server(
        handler,
        device=devices,
        expose=expose,
        token=secret,
        insecure=opt_out,
        auth_throttle=auth_throttle,
        handshake_timeout=handshake_timeout,
        stream_ring_factory=stream_ring_factory,
        options=options,
    )
    await server.start(host, port, rdma_cm=rdma_cm)
    return server
