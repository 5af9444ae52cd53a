"""The handshake: how two aiordma endpoints turn a TCP connection into an RC queue pair.

Both ends run the same steps (the messages are :mod:`aiordma.rendezvous`'s),
in mirror order; this module is the one place that says them, for
:func:`connect` (the client) and :func:`accept` (what a
:class:`~aiordma.Server` runs for each client):

====  ==========================================  ==========================================
step  client (:func:`connect`)                     server (:func:`accept`)
====  ==========================================  ==========================================
1-3   hello, capabilities, optional HMAC proof    the same, with the server's back-off
4     build the :class:`Connection` (QP in INIT),  read the client's endpoint
      send its endpoint (QPN, PSN, GID, MTU,
      exposed buffers)
5     read the server's endpoint                   build the Connection, INIT → RTR → RTS
                                                   toward the client, send its endpoint
6     INIT → RTR → RTS toward the server, send     wait for ``ready``: the client's QP
      ``ready``                                    is in RTS, the server may send
====  ==========================================  ==========================================

Afterwards the TCP connection stays open, watched by the connection: a
goodbye (:func:`aiordma.rendezvous.goodbye`) or EOF ends it at once.

What each end offers and requires of the other (:func:`capabilities`) depends
only on whether it is a byte-stream endpoint (:mod:`aiordma.stream`). The
steps use :class:`~aiordma.connection.Connection`'s set-up methods, which are
not public API: this module is the connection's set-up, kept apart from the
verbs and messages a connection offers afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from . import cm, rendezvous
from .connection import Connection, StreamRingFactory
from .errors import CapabilityError, HandshakeTimeoutError, RendezvousError
from .exposure import Exposable, as_exposables
from .providers import device_for
from .providers.base import DeviceContext
from .rendezvous import DEFAULT_PORT, Authenticate, capabilities
from .security import TokenSource

# (the hooks both handshakes take, StreamRingFactory and Authenticate, are the
# connection's and the rendezvous's: aiordma.cm takes them too, and this module
# hands connect(rdma_cm=True) to it; they stay importable from here)
__all__ = ["Authenticate", "StreamRingFactory", "accept", "attach", "capabilities", "connect"]


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
    rdma_cm: bool = False,
    **options: Any,
) -> Connection:
    """Connect to an aiordma server: TCP rendezvous at ``host:port``, then an
    RC queue pair between the two devices; with ``rdma_cm=True``, RDMA CM
    resolves ``host`` to the device and path and connects the queue pairs
    (:mod:`aiordma.cm`; an RDMA device is needed, and a server started with
    ``rdma_cm=True``).

    ``device`` is the RDMA device to use: a device context, or a name
    (``"mlx5_1"``, ``"rxe0"``, ``"soft0"``; a name no device has raises
    :class:`DeviceNotFoundError`); by default ``provider``'s (``AIORDMA_DEVICE``,
    else the first device with an active port, else the soft device).

    ``expose`` names the local regions the server may reach with one-sided
    operations: a region is offered read-only, ``region.exposed("rw")`` with
    the rights it names (:mod:`aiordma.exposure`); the server's exposed
    buffers are in ``conn.remote_buffers``. ``token`` (or
    ``$AIORDMA_TOKEN``, or the file named by ``$AIORDMA_TOKEN_FILE``)
    enables HMAC authentication. Other
    keyword options go to :class:`Connection` (``progress``, ``spin_us``,
    ``recv_buffers``, ``recv_buffer_size``, ``recv_budget``,
    ``send_queue_depth``, ``ack_timeout``, ``retry_cnt``, ``gid_index``,
    ``traffic_class``, ``service_level``, ``hop_limit``, ``flow_label``,
    ``path_mtu``, ``large_message_threshold``, ``registration_cache``: how many
    registrations of sent and received large-message buffers are kept for
    reuse; a kept registration keeps its buffer alive. The default is 64 on
    RDMA hardware and kernel rxe (pyverbs), where registering pins pages,
    and 0 on the soft device, where registering costs next to nothing and a
    kept registration would only hold memory the program has let go; 0
    keeps none, so no buffer outlives its message).
    ``stream_ring_factory`` is for :func:`aiordma.open_connection`.

    An unreachable or refusing server raises :class:`RendezvousError` (a
    :class:`ConnectionError`), a slow one :class:`HandshakeTimeoutError`
    (also a :class:`TimeoutError`).
    """
    if rdma_cm:  # (librdmacm itself is loaded only then: aiordma.providers.librdmacm.load)
        return await cm.connect(
            host,
            port,
            provider=provider,
            device=device,
            expose=expose,
            token=token,
            timeout=timeout,
            stream_ring_factory=stream_ring_factory,
            **options,
        )
    secret = rendezvous.token_from_env(token)
    as_exposables(expose)  # a bad expose= fails here, before any connection is made
    device = device_for(provider, device)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except TimeoutError:
        raise HandshakeTimeoutError(f"TCP connect to {host}:{port} timed out after {timeout} s") from None
    except OSError as e:
        raise RendezvousError(f"cannot reach the aiordma server at {host}:{port}: {e.strerror or e}") from e
    ch = rendezvous.Channel(reader, writer)
    offer, require = capabilities(stream_ring_factory is not None)
    made: list[Connection] = []  # (what to abort if the handshake fails half-way)

    async def client_steps() -> Connection:
        caps = await rendezvous.client_hello(ch, secret, offer, require)
        conn = Connection(device, **with_peer(options, caps, stream_ring_factory is not None))
        made.append(conn)
        conn.capabilities = caps
        ring = stream_ring_factory(conn) if stream_ring_factory is not None else None
        await ch.send(conn._local_endpoint(expose, stream_ring=ring).to_wire())
        ready = conn._connect_queue_pair(rendezvous.Endpoint.from_wire(await ch.expect("endpoint")))
        await ch.send(ready)
        return conn

    try:
        conn: Connection = await rendezvous.with_timeout(client_steps(), timeout, f"rendezvous with {host}:{port}")
    except BaseException:
        ch.close()
        for half_made in made:
            half_made.abort()
        raise
    conn._attach_rendezvous(ch)
    return conn


async def accept(
    ch: rendezvous.MessageChannel,
    device: DeviceContext,
    authenticate: Authenticate,
    *,
    expose: Mapping[str, Exposable] | None = None,
    stream_ring_factory: StreamRingFactory | None = None,
    options: Mapping[str, Any] | None = None,
) -> Connection:
    """The server's side of the handshake on the rendezvous channel ``ch``: a
    :class:`Connection` on ``device`` connected to the client's queue pair.
    ``authenticate`` runs steps 1-3 (the server's back-off wraps
    :func:`aiordma.rendezvous.server_hello`); ``options`` go to the
    :class:`Connection`. The caller bounds it in time; if it fails, the
    half-made connection is aborted and the channel is left to the caller.
    Call :func:`attach` once the caller keeps the connection."""
    offer, require = capabilities(stream_ring_factory is not None)
    conn: Connection | None = None
    try:
        caps = await authenticate(ch, offer, require)
        peer = rendezvous.Endpoint.from_wire(await ch.expect("endpoint"))
        conn = Connection(device, **with_peer(options or {}, caps, stream_ring_factory is not None))
        conn.capabilities = caps
        conn._connect_queue_pair(peer)
        ring = stream_ring_factory(conn) if stream_ring_factory is not None else None
        await ch.send(conn._local_endpoint(expose, stream_ring=ring).to_wire())
        conn._peer_ready(await ch.expect("ready"))
        return conn
    except BaseException:
        if conn is not None:
            conn.abort()
        raise


def with_peer(options: Mapping[str, Any], capabilities: Sequence[str], stream: bool = False) -> dict[str, Any]:
    """The connection options for a peer that offered ``capabilities``: a peer
    without ``msg-credits-v2`` (an older aiordma) expects receive buffers of
    its own behind its credits, so the connection keeps per-connection
    buffers; asked for explicitly (``srq=True``), that is refused. A byte
    stream (``stream``) keeps its own too unless asked: its Writes with
    immediate say nothing of a sender short of credits, so a grant that
    starts small would stay small (and its ring is registered per connection
    anyway)."""
    out = dict(options)
    if stream and out.get("srq") is None:
        out["srq"] = False
    if rendezvous.SRQ_CAPABILITY not in capabilities:
        if out.get("srq"):
            raise CapabilityError(
                f"srq=True: the peer does not offer {rendezvous.SRQ_CAPABILITY} (an older aiordma?), so it "
                "cannot send to a shared receive queue; connect without srq=True to use receive buffers of "
                "its own"
            )
        out["srq"] = False
    return out


def attach(conn: Connection, ch: rendezvous.MessageChannel) -> None:
    """After the handshake: ``conn`` watches the rendezvous channel ``ch`` (a
    goodbye or EOF on it ends the connection at once)."""
    conn._attach_rendezvous(ch)
