"""The ``rdma://`` comm backend: Dask's Backend, Connector, Listener and Comm on aiordma.

An ``rdma://host:port`` address is an aiordma server's rendezvous (TCP)
address; the data moves over the RC queue pair the rendezvous sets up. One
Dask comm is one :class:`aiordma.Connection`; a Dask message is one batch and
its large frames (:mod:`.framing`).

Semantics, as Dask's TCP backend has them:

* ``Connector.connect`` raises an :class:`OSError` (aiordma's
  :class:`~aiordma.RendezvousError` is a :class:`ConnectionError`) for a peer
  that cannot be reached, which Dask's ``connect`` retries until its timeout;
  a peer that refuses the token is a :class:`FatalCommClosedError` (retrying
  cannot help).
* ``Listener.stop`` stops accepting; comms already made live on (each is
  handed off from the aiordma server handler, :meth:`Connection.detach`).
* ``Comm.read``/``write``: anything raised while a message moves aborts the
  comm (half of it may have moved: nothing later on the comm could be
  trusted, distributed#4133) and every later call raises
  :class:`CommClosedError`. An :class:`Exception` is raised as
  :class:`CommClosedError` (``from`` the original; Dask's TCP comm raises
  that for a closed stream and the original for anything else); a cancellation
  and every other :class:`BaseException` (``KeyboardInterrupt``,
  ``SystemExit``, ``GeneratorExit``, a subclass of the application's) go on
  unchanged, as over TCP. What fails before anything moved leaves the comm
  as it was, as over TCP: serializing the message (the error as Dask raised
  it), a cancellation while a concurrent ``write``/``read`` holds the comm, and
  deserializing a message read whole (only an :class:`EOFError` there, a
  truncated message, aborts).
* ``Comm.close`` flushes (the peer takes what was sent, up to
  ``close-timeout``) and says goodbye; ``Comm.abort`` is immediate and
  synchronous; ``Comm.closed()`` turns true once the comm is closed or
  aborted locally, or once the peer closed it and every message it sent
  before has been read.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import logging
import weakref
from typing import Any, ClassVar

import dask
from dask.utils import parse_bytes
from distributed.comm.addressing import parse_host_port, unparse_host_port
from distributed.comm.core import BaseListener, Comm, CommClosedError, Connector, FatalCommClosedError
from distributed.comm.tcp import BaseTCPBackend
from distributed.comm.utils import ensure_concrete_host, from_frames, to_frames

import aiordma

from ... import large_messages
from ...connection import Connection
from ...errors import AuthenticationError, CapabilityError, ProtocolVersionError, RDMAError
from ...events import ConnectionState
from . import framing
from .buffers import pool_for
from .config import Settings, device_for, refuse_encryption, route_source
from .counters import ByteCounts, counts_for

log = logging.getLogger("aiordma.dask")

PREFIX = "rdma://"


def _unparse(address: Any) -> str:
    host, port = address[:2]
    return PREFIX + unparse_host_port(host, port)


def _abort_dangling(conn: Connection, what: str) -> None:
    """Finalizer of a comm nobody closed: abort its connection on its loop."""
    if conn.is_closing():
        return
    log.warning("closing dangling comm %s", what)
    try:
        conn.loop.call_soon_threadsafe(conn.abort)
    except RuntimeError:  # its loop is closed: nothing runs on it any more
        pass


class RDMAComm(Comm):
    """A Dask comm over one aiordma connection (an RC queue pair)."""

    max_shard_size: ClassVar[int] = parse_bytes(dask.config.get("distributed.comm.shard"))

    def __init__(
        self,
        conn: Connection,
        local_addr: str,
        peer_addr: str,
        deserialize: bool = True,
        settings: Settings | None = None,
        *,
        accepted: bool = False,
    ) -> None:
        self._closed = False
        super().__init__(deserialize=deserialize)
        self._conn = conn
        self._local_addr = local_addr
        self._peer_addr = peer_addr
        self._settings = settings or Settings()
        self._large = self._settings.large_message_threshold or large_messages.DEFAULT_LARGE_THRESHOLD
        self._buffers = pool_for(self._settings.buffer_pool)
        self._write_lock = asyncio.Lock()
        self._read_lock = asyncio.Lock()
        # (an accepted comm's peer address is a temporary port: not worth a per-peer entry)
        self._device_counts, self._peer_counts = counts_for(conn.device, None if accepted else peer_addr)
        #: what this comm moved
        self.counts = ByteCounts()
        self._finalizer = weakref.finalize(self, _abort_dangling, conn, f"{local_addr} -> {peer_addr}")
        self._finalizer.atexit = False

    # ------------------------------------------------------- addresses ----
    @property
    def local_address(self) -> str:
        return self._local_addr

    @property
    def peer_address(self) -> str:
        return self._peer_addr

    @property
    def connection(self) -> Connection:
        """The aiordma connection under this comm."""
        return self._conn

    @property
    def extra_info(self) -> dict[str, Any]:
        """The device, the queue pairs and what this comm moved so far."""
        conn = self._conn
        peer = conn.peer
        return {
            "provider": conn.device.provider,
            "device": conn.device.name,
            "qp_num": conn.qp_num,
            "peer_qp_num": peer.qpn if peer is not None else None,
            "mtu": conn.mtu,
            "progress": conn.progress_mode,
            **{k: getattr(self.counts, k) for k in ("tx_bytes", "rx_bytes", "tx_large_bytes", "rx_large_bytes")},
        }

    # ---------------------------------------------------------- state ----
    def closed(self) -> bool:
        if self._closed:
            return True
        conn = self._conn
        if conn.state is ConnectionState.OPEN:
            return False
        # the peer closed (or the QP failed): closed once what it sent before is read
        stats = conn.stats
        return stats["recv_queued_messages"] == 0 and stats["recv_queued_large_messages"] == 0

    def _closed_error(self, where: str) -> CommClosedError:
        why = self._conn.error
        return CommClosedError(f"in {self}: {where}: the comm is closed" + (f" ({why})" if why else ""))

    def abort(self) -> None:
        self._closed = True
        self._finalizer.detach()
        self._conn.abort()

    async def close(self) -> None:
        if self._closed:
            await self._conn.wait_closed()
            return
        self._closed = True
        self._finalizer.detach()
        try:
            await self._conn.close(timeout=self._settings.close_timeout)
        except (RDMAError, OSError) as e:
            # Dask closes comms in finally blocks and cannot act on this; say it
            log.info("closing %s: %s", self, e)

    # ----------------------------------------------------------- write ----
    async def write(self, msg: Any, serializers: Any = None, on_error: str | None = "message") -> int:
        if self._closed or self._conn.is_closing():
            raise self._closed_error("write")
        frames = await to_frames(
            msg,
            allow_offload=self.allow_offload,
            serializers=serializers,
            on_error=on_error,
            context={
                "sender": self.local_info,
                "recipient": self.remote_info,
                **self.handshake_options,
            },
            frame_split_size=self.max_shard_size,
        )
        # (an error up to here, in serializing, sent nothing: the comm lives on, as TCP's does)
        out = framing.pack(frames, self._settings.batch_limit)
        conn = self._conn
        async with self._write_lock:  # (a cancellation while waiting for it sent nothing either)
            if self._closed or conn.is_closing():
                raise self._closed_error("write")
            try:
                await conn.send(out.batch)
                large = 0
                for frame in out.separate:
                    # like TCP's write, return once the frames are queued, in order: the
                    # peer pulls large ones later (within the send window) and Dask
                    # leaves a frame alone once written
                    await conn.send(frame, wait_pulled=False)
                    n = len(frame) if type(frame) is bytes else frame.nbytes
                    if n >= self._large:
                        large += n
            except Exception as e:
                self.abort()  # part of the message may be out: the comm cannot be used any more
                raise CommClosedError(f"in {self}: write failed: {type(e).__name__}: {e}") from e
            except BaseException:
                # a cancellation, KeyboardInterrupt, SystemExit, GeneratorExit, ...: the same
                # (distributed#4133), and it goes on as it is, as over TCP
                self.abort()
                raise
        for counts in (self.counts, self._device_counts, self._peer_counts):
            counts.add_tx(out.nbytes, len(frames), large)
        return out.nbytes

    # ------------------------------------------------------------ read ----
    async def read(self, deserializers: Any = None) -> Any:
        if self._closed:
            raise self._closed_error("read")
        conn = self._conn
        async with self._read_lock:  # (a cancellation while waiting for it took nothing)
            if self._closed:
                raise self._closed_error("read")
            try:
                batch = await conn.recv()
                incoming = framing.unpack(batch)
                frames = incoming.frames
                large = 0
                # a buffer of its own for every separate frame (each array is released on
                # its own, as over Dask's TCP comm), the shards of one split frame side
                # by side in one (Dask joins them without copying); the memory of frames
                # released before when there is some (.buffers: no fresh pages to zero)
                for group in incoming.buffers:
                    whole = self._buffers.take(sum(size for _, size in group))
                    offset = 0
                    for index, size in group:
                        buf = whole[offset : offset + size]
                        offset += size
                        n = await conn.recv_into(buf)
                        if n != size:
                            raise framing.FramingError(f"frame {index} announced {size} bytes, {n} arrived")
                        frames[index] = buf
                        if size >= self._large:
                            large += size
            except Exception as e:
                if isinstance(e, framing.FramingError) or not conn.is_closing():
                    log.warning("%s: aborting after a read error: %s", self, e)
                self.abort()  # part of a message may have been taken: nothing later can be trusted
                raise CommClosedError(f"in {self}: read failed: {type(e).__name__}: {e}") from e
            except BaseException:
                self.abort()  # the same for a cancellation or any other BaseException, re-raised
                raise
        nbytes = len(batch) + sum(size for _, size in incoming.separate)
        for counts in (self.counts, self._device_counts, self._peer_counts):
            counts.add_rx(nbytes, len(frames), large)
        try:
            return await from_frames(
                frames,
                deserialize=self.deserialize,
                deserializers=deserializers,
                allow_offload=self.allow_offload,
            )
        except EOFError:
            # frames garbled or truncated: nothing later on this comm can be trusted
            self.abort()
            raise CommClosedError(f"in {self}: aborted on truncated data") from None


class RDMAConnector(Connector):
    """Connects to an ``rdma://`` listener: the rendezvous, then a queue pair."""

    prefix = PREFIX
    comm_class = RDMAComm
    encrypted = False

    async def connect(self, address: str, deserialize: bool = True, **connection_args: Any) -> RDMAComm:
        refuse_encryption(address, connection_args)
        settings = Settings.from_config()
        host, port = parse_host_port(address)
        ip = host
        if not _looks_like_ip(host):
            ip = await _resolve_ipv4(host)
        device = device_for(settings, route_source(ip))
        timeout = dask.utils.parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "seconds")
        try:
            conn = await aiordma.connect(
                ip,
                port,
                device=device,
                token=settings.token,
                timeout=timeout,
                **settings.connection_options(),
            )
        except (AuthenticationError, ProtocolVersionError, CapabilityError) as e:
            # retrying cannot help: Dask's connect() gives up at once on this one
            raise FatalCommClosedError(f"rdma://{address}: {e}") from e
        return self.comm_class(conn, _unparse(conn.local_address), PREFIX + address, deserialize, settings)


def _looks_like_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


async def _resolve_ipv4(host: str) -> str:
    import socket

    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise OSError(errno.EHOSTUNREACH, f"cannot resolve {host!r}: {e}") from e
    return str(infos[0][4][0])


class RDMAListener(BaseListener):
    """Listens for ``rdma://`` comms: an aiordma server whose handler hands each
    connection (after Dask's handshake) to ``comm_handler`` and lets it live on."""

    prefix = PREFIX
    comm_class = RDMAComm
    encrypted = False

    def __init__(
        self,
        address: str,
        comm_handler: Any,
        deserialize: bool = True,
        allow_offload: bool = True,
        default_host: str | None = None,
        default_port: int = 0,
        **connection_args: Any,
    ) -> None:
        super().__init__()
        refuse_encryption(address, connection_args)
        self.ip, self.port = parse_host_port(address, default_port)
        self.comm_handler = comm_handler
        self.deserialize = deserialize
        self.allow_offload = allow_offload
        self.default_host = default_host
        self.server: aiordma.Server | None = None
        self.bound_address: tuple[str, int] | None = None
        self._settings = Settings()

    async def start(self) -> None:
        self._settings = settings = Settings.from_config()
        # IPv4 for a wildcard: the soft device's GID is an IPv4 address, and one
        # socket keeps one port (asyncio binds port 0 anew per address family)
        host = self.ip if self.ip not in ("", None) else "0.0.0.0"
        contact = ensure_concrete_host(host, default_host=self.default_host)
        device = device_for(settings, contact)
        self.server = await aiordma.start_server(
            self._on_connection,
            host,
            self.port,
            device=device,
            token=settings.token,
            handshake_timeout=settings.handshake_timeout,
            insecure=settings.insecure or None,  # (None: $AIORDMA_INSECURE decides)
            **settings.connection_options(),
        )
        sock = self.server.sockets[0]
        self.bound_address = sock.getsockname()[:2]

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.close()

    async def _on_connection(self, conn: Connection) -> None:
        conn.detach()  # the comm outlives this handler (Dask gives it to a background task)
        if self.server is None:
            # stop() came between the rendezvous and now: nobody would handle it
            conn.abort()
            return
        comm = self.comm_class(
            conn,
            _unparse(conn.local_address),
            _unparse(conn.peer_address),
            self.deserialize,
            self._settings,
            accepted=True,
        )
        comm.allow_offload = self.allow_offload
        try:
            await self.on_connection(comm)
        except CommClosedError:
            log.info("rdma:// connection from %s closed before the handshake completed", comm.peer_address)
            comm.abort()
            return
        except BaseException:
            comm.abort()
            raise
        handled = self.comm_handler(comm)
        if inspect.isawaitable(handled):
            await handled

    def get_host_port(self) -> tuple[str, int]:
        """The listening address as ``(host, port)``."""
        if self.bound_address is None:
            raise ValueError("invalid operation on a non-started RDMAListener")
        return self.bound_address

    @property
    def listen_address(self) -> str:
        return self.prefix + unparse_host_port(*self.get_host_port())

    @property
    def contact_address(self) -> str:
        host, port = self.get_host_port()
        host = ensure_concrete_host(host, default_host=self.default_host)
        return self.prefix + unparse_host_port(host, port)


class RDMABackend(BaseTCPBackend):
    """The ``rdma`` scheme of Dask's comm registry (entry point
    ``distributed.comm.backends: rdma``). Addresses are ``host:port`` of the
    rendezvous, so the address helpers are TCP's."""

    _connector_class = RDMAConnector
    _listener_class = RDMAListener

    def __init__(self) -> None:
        super().__init__()
        export_metrics()


def export_metrics() -> bool:
    """Put aiordma's series on the ``/metrics`` a Dask server already serves (it shows
    ``prometheus_client.REGISTRY``): once per process, when the ``rdma`` backend is
    first loaded. False where ``prometheus_client`` is not installed (Dask's own
    endpoint is absent then too)."""
    try:
        from ... import prometheus
    except ImportError:
        return False
    prometheus.register()
    return True
