"""Connections: one RC queue pair, awaited from asyncio.

A :class:`Connection` owns a queue pair, its completion queue (one CQ with
its own completion channel, dispatched on the loop by
:class:`~aiordma.completion.CompletionDispatcher`) and the registered buffers
messages use. It offers:

* one-sided verbs: :meth:`~Connection.write` (optionally with immediate
  data), :meth:`~Connection.read`, :meth:`~Connection.compare_and_swap`,
  :meth:`~Connection.fetch_and_add` against a peer's :class:`RemoteBuffer`;
* two-sided messages: :meth:`~Connection.send` / :meth:`~Connection.recv`
  of any size, flow-controlled by credits and a receive budget
  (:mod:`aiordma.window`);
* :meth:`~Connection.recv_immediate` for Write-with-immediate notifications;
* for protocols built on a connection (streams, framework transports):
  :meth:`~Connection.set_event_handler` (typed events, :mod:`aiordma.events`),
  :meth:`~Connection.send_control`, :meth:`~Connection.post_write`.

A connection is the public API and the glue between its collaborators,
each a module of its own, wired by callbacks where they need the connection:

* :mod:`aiordma.qp_setup`: the queue pair's set-up (GID, PSN, INIT → RTR →
  RTS), which :mod:`aiordma.handshake` drives over the rendezvous;
* :mod:`aiordma.ops`: send-queue slots, work requests in flight, and what a
  failed completion means;
* :mod:`aiordma.work_requests`: SGEs from Python buffers, chains, and the
  one-sided verbs beyond their per-operation fast path (which is here);
* :mod:`aiordma.messages`: the send half (order, chunks, credits, drain) and
  the receive half (receive buffers, the ``recv()`` family) of messages,
  over :mod:`aiordma.window`'s sans-IO rules; the one-chunk send fast path
  is here;
* :mod:`aiordma.large_messages`: messages the peer pulls by RDMA Read;
* :mod:`aiordma.control`: control messages and the peer's advertised buffers;
* :mod:`aiordma.completion`: how completions reach the loop.

Cancel safety: cancelling a coroutine awaiting an operation never frees or
reuses a buffer before the device's completion for it arrives — the buffers
are released by the completion, not by the awaiting coroutine.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from . import large_messages, metrics, rendezvous, settings, work_requests
from .completion import CompletionDispatcher, channel_for
from .completion import check_options as check_progress_options
from .control import ControlMessages
from .core import select_core
from .errors import (
    ConnectionClosedError,
    ConnectionLostError,
    ProviderUnavailableError,
    RDMAError,
    RendezvousError,
    error_for_status,
    fresh,
    may_have_executed,
    stored,
)
from .events import ConnectionEvent, ConnectionLost, ConnectionState, ImmediateReceived
from .exposure import Exposable, ExposedRegions
from .fastpath import FastPath
from .memory import Region, RegionSlice, RemoteBuffer, protection_domain, register
from .messages import Inbound, Outbox
from .ops import (
    NOT_IDEMPOTENT,
    OP_MESSAGE,
    REMOTE_STATUSES,
    Op,
    OperationTracker,
    SendQueue,
    completion_error,
    consume_exception,
)
from .path import AddressVector
from .pools import RECV_TAG, create_queue_pair, registered_memory, send_pool
from .providers import spare_at_exit
from .providers.base import (
    Access,
    DeviceContext,
    QPCap,
    QPState,
    WCStatus,
    WorkCompletion,
    WROpcode,
)
from .qp_setup import QueuePairSetup
from .rendezvous import SRQ_CAPABILITY
from .settings import MAX_SOFT_MTU
from .transfer import PreparedTransfer, Transfer, TransferNotification, TransferPath
from .window import (
    DEFAULT_RECV_BUDGET,
    K_CONTROL,
    PROCESS_RECV_BUDGET,
    MessageWindow,
)
from .work_requests import Requester

if TYPE_CHECKING:
    from .providers.librdmacm import QueuePairAttributes

log = logging.getLogger("aiordma")

__all__ = [
    "Connection",
    "Immediate",
    "protection_domain",
    "register",
]

# plain-int forms of the enum values the per-message path compares against
# (an int compare instead of a global load and an attribute lookup each time)
_WC_SUCCESS = int(WCStatus.IBV_WC_SUCCESS)
_SEND_WITH_IMM = WROpcode.IBV_WR_SEND_WITH_IMM
_RDMA_WRITE = WROpcode.IBV_WR_RDMA_WRITE
_RDMA_READ = WROpcode.IBV_WR_RDMA_READ
_CMP_AND_SWP = WROpcode.IBV_WR_ATOMIC_CMP_AND_SWP
_FETCH_AND_ADD = WROpcode.IBV_WR_ATOMIC_FETCH_AND_ADD
_LOCAL = (Region, RegionSlice)
#: the credits a peer starts with toward a connection whose buffers are a shared receive queue
SRQ_INITIAL_CREDITS = 4
#: how long a remote error waits for the peer's reason over the rendezvous (s)
_PEER_REASON_WAIT = 0.25
#: how long the peer's goodbye waits for the ACKs of messages it may have taken (s).
#: The goodbye comes over TCP, the ACKs over the RDMA path: a goodbye may overtake the
#: ACK of the last message the peer took (it is on the wire, or in our NIC's queue).
_PEER_GOODBYE_GRACE = 0.5
#: control messages (and the end) kept for an event handler set after they came
_MAX_EARLY_EVENTS = 1024


#: what ``recv_immediate()`` returns: the same object an event handler gets
Immediate = ImmediateReceived

#: a byte stream's hook in both handshakes (TCP and RDMA CM): the receive ring a
#: stream endpoint exposes to its peer, made for the connection being set up
StreamRingFactory = Callable[["Connection"], RemoteBuffer]


def default_registration_cache(device: DeviceContext) -> int:
    """How many large-message registrations a connection keeps by default: 64
    where registering memory pins its pages (pyverbs: hardware, kernel rxe), 0
    on the soft device, where a registration is a buffer export and keeping
    one only keeps a buffer alive that the program let go (the measurements
    behind this default are in the tuning guide, docs/howto/tuning.md)."""
    return 0 if getattr(device, "provider", None) == "soft" else 64


def uses_srq(device: DeviceContext, srq: bool | None) -> bool:
    """Whether a connection on ``device`` takes its receives from the device's shared
    receive queue: ``srq`` if given (True on a device without SRQs is refused),
    else ``AIORDMA_SRQ`` (``auto``: on pyverbs devices, where registration pins
    memory; off on the soft device, whose own buffers cost nothing while idle)."""
    if srq is not None and not isinstance(srq, bool):
        raise TypeError(f"srq must be True, False or None, not {srq!r}")
    supported = int(getattr(device.query_device(), "max_srq", 0) or 0) > 0
    if srq:
        if not supported:
            raise ProviderUnavailableError(
                f"srq=True: {device.provider}:{device.name} has no shared receive queues (max_srq 0)"
            )
        return True
    if srq is False or not supported:
        return False
    mode = settings.SRQ.get()
    if mode == "auto":
        return getattr(device, "provider", None) == "pyverbs"
    return mode == "on"


class Connection:
    """An RDMA connection to one peer (an RC queue pair plus its buffers).

    Made by :func:`connect` and :func:`~aiordma.start_server`; use it as an
    async context manager or call :meth:`close`."""

    def __init__(
        self,
        device: DeviceContext,
        *,
        progress: str | None = None,
        recv_buffers: int = 16,
        recv_buffer_size: int = 64 * 1024,
        send_queue_depth: int = 256,
        max_rd_atomic: int | None = None,
        ack_timeout: int = 14,
        retry_cnt: int = 7,
        gid_index: int | None = None,
        traffic_class: int | None = None,
        service_level: int | None = None,
        hop_limit: int | None = None,
        flow_label: int | None = None,
        path_mtu: int | None = None,
        spin_us: float | None = None,
        recv_budget: int = DEFAULT_RECV_BUDGET,
        large_message_threshold: int = large_messages.DEFAULT_LARGE_THRESHOLD,
        large_send_window: int = large_messages.DEFAULT_SEND_WINDOW,
        registration_cache: int | None = None,
        srq: bool | None = None,
    ) -> None:
        # every option is checked before anything is allocated on the device (a bad
        # one must not leave a CQ, a QP or registrations behind)
        if not 64 <= recv_buffer_size <= 1 << 30:
            raise ValueError("recv_buffer_size must be between 64 bytes and 1 GiB")
        progress_requested = progress or settings.PROGRESS.get()
        if gid_index is None:
            gid_index = settings.GID_INDEX.get()
        if path_mtu is None:
            path_mtu = settings.PATH_MTU.get()
        if path_mtu is not None and not 256 <= path_mtu <= MAX_SOFT_MTU:
            raise ValueError(f"path_mtu must be from 256 to {MAX_SOFT_MTU} bytes, not {path_mtu!r}")
        check_progress_options(progress_requested, spin_us)
        large_messages.check_options(large_message_threshold, registration_cache)
        if registration_cache is None:
            registration_cache = default_registration_cache(device)
        self.srq = use_srq = uses_srq(device, srq)  # (the receive buffers are the device's: aiordma.pools)
        #: the per-operation core (compiled or interpreted: aiordma.core)
        core = self._core = select_core()
        initial = SRQ_INITIAL_CREDITS if use_srq and recv_buffers > SRQ_INITIAL_CREDITS else 0  # (credits that grow)
        self._window: MessageWindow = core.MessageWindow(recv_buffers, recv_budget, PROCESS_RECV_BUDGET, initial)
        self.loop = asyncio.get_running_loop()
        self.device = device
        self.pd = protection_domain(device)
        self.progress_requested = progress_requested
        # event mode on the soft device: the loop's channel, shared with the device's
        # other connections (one fd for all of them); else a channel of its own
        self.channel, shared_channel = channel_for(device, self.loop, progress_requested)
        self._owns_channel = shared_channel is None
        depth = send_queue_depth + 2 * recv_buffers + 16
        self.cq = device.create_cq(depth, self.channel)
        cap = QPCap(max_send_wr=send_queue_depth + 8, max_recv_wr=recv_buffers, max_send_sge=4, max_recv_sge=1)
        srq_size = recv_buffer_size if use_srq else 0  # (a QP that takes from the device's SRQ)
        self.qp, self._recv_pool = create_queue_pair(
            device, self.pd, self.loop, self.cq, cap, srq_size, core.BufferTable
        )
        # this end's part in the queue pair's set-up (aiordma.qp_setup): the GID, the PSN,
        # the MTU it announces; the QP goes to INIT
        setup = self._setup = QueuePairSetup(
            device,
            self.qp,
            gid_index=gid_index,
            av=AddressVector.of(traffic_class, service_level, hop_limit, flow_label),
            path_mtu=path_mtu,
            max_rd_atomic=max_rd_atomic,
            ack_timeout=ack_timeout,
            retry_cnt=retry_cnt,
        )
        #: the port's active MTU and the path MTU in use (what the handshake negotiates)
        self.port_mtu = self.mtu = setup.port_mtu
        self.gid_index, self.gid, self.psn = setup.gid_index, setup.gid, setup.psn
        self.recv_buffers, self.recv_buffer_size = recv_buffers, recv_buffer_size
        self._sq: SendQueue = core.SendQueue(send_queue_depth, self.loop)
        messages, immediates = core.Inbox(self.loop), core.Inbox(self.loop)
        self.peer: rendezvous.Endpoint | None = None
        #: capabilities both sides offered in the rendezvous
        self.capabilities: list[str] = []
        self._rendezvous: rendezvous.MessageChannel | None = None
        #: the task posting a closing connection's goodbye on its queue pair (RDMA CM)
        self._farewell: asyncio.Task[Any] | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._local_address: Any = None
        self._peer_address: Any = None
        self._error: BaseException | None = None
        self._closing = self._closed = False
        self._closed_fut: asyncio.Future[None] = self.loop.create_future()
        self._event_handler: Callable[[ConnectionEvent], bool | None] | None = None
        self._detached = False
        #: why our QP failed, when that came before the rendezvous was attached
        self._unsent_reason: str | None = None
        self._early_events: list[ConnectionEvent] = []
        #: fire-and-forget sends that failed, and the first failure (close() reports them)
        self._undelivered = 0
        self._undelivered_error: BaseException | None = None
        #: the peer's goodbye, while the ACKs of our last messages may still come
        self._peer_left: BaseException | None = None
        #: the peer's words for why its queue pair failed (sent over the rendezvous)
        self._peer_reason: asyncio.Future[str] = self.loop.create_future()
        #: completions held back while a remote error waits for the peer's reason
        self._deferred: list[WorkCompletion] | None = None
        # large messages (aiordma.large_messages): pulled by the receiver's RDMA Read
        self._large = large_messages.LargeMessages(
            self.loop, self.pd, threshold=large_message_threshold, send_window=large_send_window,
            cache_entries=registration_cache, post_control=self._post_control, read=self._read_into,
            check_usable=self._check_usable, settled=self._wake_drain_waiters, requeue=self._requeue
        )  # fmt: skip
        # control messages (aiordma.control): the peer's advertised buffers, large-message
        # announcements, a protocol's own control messages for the event handler
        self._control = ControlMessages(
            self.loop, announced=messages.put, pulled=self._large.on_done, emit=self._emit, violation=self.abort
        )
        mode = self.progress_requested
        self.dispatcher = CompletionDispatcher(
            self.cq, self.channel, self._on_completion, mode=mode, spin_us=spin_us, shared=shared_channel
        )
        self._ops: OperationTracker = core.OperationTracker(self.qp, self._sq, self.dispatcher.expect)
        # the send side of messages (aiordma.messages): order, chunks, credits
        self._outbox = Outbox(
            self.loop, self._window, self._sq, self._ops, check_usable=self._check_usable, large=self._large
        )
        # the one-sided verbs beyond their fast path (aiordma.work_requests)
        self._requester = Requester(
            self.loop, self.pd, self._sq, self._ops, self._outbox, self._large.recv_cache,
            check_usable=self._check_usable, pool_class=core.BufferPool,
        )  # fmt: skip
        # the receive half: receive buffers for messages, posted now (INIT allows post_recv)
        self._inbound = Inbound(
            self.pd, self.qp, self._window, self._outbox, self._large,
            recv_buffers=recv_buffers, recv_buffer_size=recv_buffer_size, messages=messages, immediates=immediates,
            control=self._control.receive, emit=self._emit, qp_failed=self._receive_failed,
            table_cls=core.BufferTable, shared=self._recv_pool,
        )  # fmt: skip
        # the per-operation paths (aiordma.fastpath, or its compiled twin, which also
        # finishes successful completions itself where the provider has C verbs)
        self._fast: FastPath = core.FastPath(
            self.loop, self._ops, self._sq, self._window, self.qp, self.cq, self._on_completion, self.dispatcher.expect
        )
        self._fast.bind_inbound(self._inbound)
        self._fast.bind_scratch(self._requester.scratch)
        self.dispatcher.use_fast_path(self._fast)
        self._transfers = TransferPath(
            self.loop, self._fast, self._sq, self._check_usable, core.prepare_descriptors, core.prepare_indices,
            self._post_control,
        )  # fmt: skip
        self._detach_loop = device.attach_event_loop(self.loop)
        _OPEN.add(self)
        metrics.connection_opened()
        #: the registrations made to expose memory to the peer (``expose=``,
        #: :meth:`advertise`), with only the rights declared there; released
        #: when the connection closes (:mod:`aiordma.exposure`)
        self.exposures = ExposedRegions(self.pd)

    # ------------------------------------------ set-up (aiordma.handshake) ----
    def _local_endpoint(
        self, buffers: Mapping[str, Any] | None = None, stream_ring: RemoteBuffer | None = None
    ) -> rendezvous.Endpoint:
        """What the rendezvous tells the peer about this side (QPN, PSN, GID,
        MTU, buffers). Each exposed region is registered for this peer with
        only the rights declared for it (read-only unless it says otherwise)."""
        return self._setup.endpoint(
            recv_buffers=self._window.grant,  # the peer's first credits
            recv_buffer_size=self.recv_buffer_size,
            buffers=self.exposures.grant_all(buffers),
            stream_ring=stream_ring,
        )

    def _connect_queue_pair(self, peer: rendezvous.Endpoint, cm: QueuePairAttributes | None = None) -> dict[str, Any]:
        """INIT → RTR → RTS toward the peer's QP (the verbs connection set-up), then the message
        layer starts toward the peer's receive buffers; returns the ``ready`` message a client
        sends next. ``cm``: the attributes RDMA CM computed (QP numbers, PSNs, GIDs, path MTU)."""
        self.path = self._setup.connect(peer) if cm is None else self._setup.connect_cm(peer, cm)
        self.peer = peer if cm is None else self._setup.peer
        self.mtu = self.path.mtu
        self._control.remote_buffers = dict(peer.buffers)
        self._large.enabled = large_messages.CAPABILITY in self.capabilities
        chunk = min(peer.recv_buffer_size, self.recv_buffer_size) if peer.recv_buffer_size else 0
        self._window.start(peer.recv_buffers, chunk, SRQ_CAPABILITY in self.capabilities)
        if chunk:
            # the device's send buffers of this chunk size (aiordma.pools)
            self._outbox.start(send_pool(self.device, self.pd, self.loop, chunk, self._core.BufferTable))
            self._fast.bind_outbox(self._outbox)
        return self._setup.ready()

    def _peer_ready(self, msg: dict[str, Any]) -> None:
        """(The server) What the client's ``ready`` message says of the queue pair."""
        self.path = self._setup.peer_ready(msg, self.path)

    def _adopt_peer(self, peer: rendezvous.Endpoint, capabilities: list[str]) -> None:
        """(RDMA CM) The first exchange on the queue pair ended: the capabilities
        both ends share, and the buffers and stream ring the peer exposes."""
        self.capabilities = capabilities
        self._large.enabled = large_messages.CAPABILITY in capabilities
        if self.peer is not None:
            self.peer = dataclasses.replace(self.peer, buffers=dict(peer.buffers), stream_ring=peer.stream_ring)
        self._control.remote_buffers = dict(peer.buffers)

    def _route_rendezvous(self, deliver: Callable[[dict[str, Any]], None] | None) -> None:
        """(RDMA CM) Who takes the rendezvous messages that arrive on the queue pair."""
        self._control.on_rendezvous = deliver

    async def _send_control_data(self, data: bytes, *, farewell: bool = False) -> None:
        """Send packed control message ``data`` in order with the messages and
        wait until the peer's NIC acknowledged it. ``farewell``: the goodbye of
        a closing connection (an RDMA CM one's travels on the queue pair)."""
        outbox = self._outbox
        # only the task posting the goodbye gets past "closing" (another task's send fails)
        self._farewell = asyncio.current_task(self.loop) if farewell else None
        try:
            await outbox.send_in_order(memoryview(data), outbox.take_turn(), kind_last=K_CONTROL, wait_ack=True)
        finally:
            self._farewell = None

    def _attach_rendezvous(self, channel: rendezvous.MessageChannel) -> None:
        """Keep watching the rendezvous TCP connection the handshake used:
        a goodbye or EOF on it ends this connection at once."""
        self._rendezvous = channel
        channel.keep_alive()  # a vanished host is noticed in seconds, a stalled process is not taken for dead
        self._local_address = channel.sockname
        self._peer_address = channel.peername
        if self._error is not None:
            # it failed between the handshake and now (a request the peer posted at
            # once was refused): tell the peer why, and end the rendezvous too
            if self._unsent_reason is not None:
                channel.send_nowait(rendezvous.goodbye(self._unsent_reason))
            channel.close()
            return
        self._monitor = self.loop.create_task(self._monitor_main(channel))

    async def _monitor_main(self, channel: rendezvous.MessageChannel) -> None:
        """Watch the rendezvous TCP connection: ``bye`` or EOF ends the connection."""
        try:
            reason, err = await rendezvous.next_goodbye(channel)
            if reason is not None and not self._peer_reason.done():
                self._peer_reason.set_result(reason)
            if (reason is not None or isinstance(err, ConnectionClosedError)) and not self._closing:
                # nothing more is posted; what the goodbye (TCP) may have overtaken on the
                # RDMA path gets a moment (_await_rdma_path; a close() ends it)
                self._peer_left = err
                self._fast.usable = False
                await _await_rdma_path(self, refused=reason is not None)
                if self._error is not None or self._closed:
                    return
            if self._deferred is None:  # (else a remote error is being reported with the peer's reason)
                self.dispatcher.drain_now()
                self._fail(err)
        except asyncio.CancelledError:
            if not self._closed and not self._closing:
                # not our teardown: the event loop is shutting down (asyncio.run() cancels what is
                # left) with this connection open. Say goodbye, so the peer learns it at once
                # rather than from an EOF it would take for a death, or from retry timeouts.
                self._end_abandoned("the event loop shut down before the connection was closed")
            raise
        except RendezvousError as e:
            if not self._closed and not self._closing and self._deferred is None:
                self.dispatcher.drain_now()
                self._fail(rendezvous.vanished(e))
        except Exception as e:  # pragma: no cover
            self._fail(ConnectionLostError(f"rendezvous monitor failed: {e!r}", cause=e))

    # ----------------------------------------------------- properties ----
    @property
    def progress_mode(self) -> str:
        """How completions reach the loop: ``event`` (channel fd on the loop),
        ``thread`` (polling thread) or ``busy`` (busy-polling task)."""
        return self.dispatcher.mode

    @property
    def qp_num(self) -> int:
        return self.qp.qp_num

    @property
    def state(self) -> ConnectionState:
        """``OPEN``; ``CLOSING`` (close() is flushing); ``LOST`` (it ended
        without a local close: the peer closed or died, or the queue pair
        failed; :attr:`error` says why, its resources are released already,
        and messages that arrived before can still be received); ``CLOSED``
        (closed locally with :meth:`close` or :meth:`abort`)."""
        if self._closing:
            return ConnectionState.CLOSED if self._closed else ConnectionState.CLOSING
        if self._error is not None:
            return ConnectionState.LOST
        return ConnectionState.OPEN

    @property
    def error(self) -> BaseException | None:
        """Why the connection ended (what later operations raise), or None while it is usable."""
        return self._error

    @property
    def closed(self) -> bool:
        """True once the connection is torn down: its queue pair and buffers are
        released (after a local close, or once it was lost; see :attr:`state`)."""
        return self._closed

    def detach(self) -> None:
        """Hand this connection off from the server handler that received it:
        it stays open after the handler returns, until it is closed (by you,
        the peer, or :meth:`Server.close_clients`). For frameworks that give
        each connection to a background task and return at once."""
        self._detached = True

    @property
    def detached(self) -> bool:
        """True once :meth:`detach` was called."""
        return self._detached

    def is_closing(self) -> bool:
        """True from the moment the connection stops being usable (closing, lost or closed)."""
        return self._closing or self._closed or self._error is not None

    async def wait_closed(self) -> None:
        """Wait until the connection is torn down and its resources released."""
        await asyncio.shield(self._closed_fut)

    @property
    def local_address(self) -> Any:
        """This side's address of the rendezvous TCP connection, ``(host, port)``."""
        return self._local_address

    @property
    def peer_address(self) -> Any:
        """The peer's address of the rendezvous TCP connection, ``(host, port)``."""
        return self._peer_address

    @property
    def stats(self) -> dict[str, int]:
        """Counters of the message layer (credits, the receive budget, work requests and
        send-queue slots in flight) and registered memory: its own (``registered_bytes``),
        the device's pools it uses (``shared_registered_bytes``), and both with its even
        share of the pools (``registered_bytes_share``; :func:`aiordma.pools.registered_memory`)."""
        out = self._window.stats()
        out.update(
            operations_outstanding=len(self._ops),
            send_queue_free=self._sq.free,
            send_queue_depth=self._sq.depth,
            messages_undelivered=self._undelivered,
            recv_queued_large_messages=self._inbound.queued_large_messages(),
        )
        out.update(self._large.stats())
        own = self._inbound.registered_bytes + self.exposures.registered_bytes + self._requester.scratch.region.length
        out.update(registered_memory(own, *((self._recv_pool, self._outbox.pool) if not self._closed else ())))
        return out

    @property
    def oldest_operation_age(self) -> float | None:
        """Seconds since the oldest work request in the send queue was posted (None: none in
        flight, or ``AIORDMA_METRICS_LATENCY=0``); past :attr:`transport_timeout` it is stuck."""
        posted = self._ops.oldest_posted_ns()
        return max(0.0, (time.monotonic_ns() - posted) / 1e9) if posted else None

    @property
    def transport_timeout(self) -> float:
        """Seconds the transport retries a request before ``IBV_WC_RETRY_EXC_ERR`` (:class:`QueuePairSetup`)."""
        return self._setup.transport_timeout

    @property
    def remote_buffers(self) -> dict[str, RemoteBuffer]:
        """The buffers the peer exposed, by name: at the handshake (its
        ``expose=``) and since (its :meth:`advertise`)."""
        return self._control.remote_buffers

    def remote(self, name: str) -> RemoteBuffer:
        """A buffer the peer exposed under ``name``."""
        return self._control.remote(name)

    async def wait_remote(self, name: str, timeout: float | None = None) -> RemoteBuffer:
        """Wait until the peer exposes (or has exposed) a buffer called ``name``."""
        if name not in self._control.remote_buffers:
            self._check_usable()
        return await self._control.wait_remote(name, timeout)

    def register(self, buffer: Any, access: Access = Access.LOCAL_WRITE) -> Region:
        """Register memory with this connection's device (usable by every
        connection on the device). Zero copy for writable buffers. Grants a
        peer nothing by default, as :func:`aiordma.register`: expose it
        (:meth:`advertise`, ``expose=``) to give a peer rights."""
        return Region(self.pd.reg_mr(buffer, access), buffer)

    def set_event_handler(self, handler: Callable[[ConnectionEvent], bool | None] | None) -> None:
        """Deliver :mod:`aiordma.events` to ``handler`` (one handler per
        connection: the protocol layered on it, e.g. a byte stream).

        ``handler(event)`` runs on the loop, synchronously, in the order the
        events happened. For :class:`~aiordma.events.ImmediateReceived`,
        returning ``True`` consumes it; otherwise it is queued for
        :meth:`recv_immediate`. :class:`~aiordma.events.ControlReceived` and
        :class:`~aiordma.events.ConnectionLost` are only delivered here."""
        self._event_handler = handler
        if handler is not None and self._early_events:
            early, self._early_events = self._early_events, []
            for event in early:
                self._emit(event)

    def _emit(self, event: ConnectionEvent) -> bool:
        handler = self._event_handler
        if handler is None:
            # a handler set later (a server handler starts after the rendezvous)
            # still gets what came before it; immediates go to recv_immediate()
            if not isinstance(event, ImmediateReceived) and len(self._early_events) < _MAX_EARLY_EVENTS:
                self._early_events.append(event)
            return False
        try:
            return bool(handler(event))
        except Exception:
            log.exception("connection event handler failed for %r", event)
            return False

    # ------------------------------------------------------- posting ----
    def _check_usable(self) -> None:
        if self._error is not None:
            raise fresh(self._error)
        if self._peer_left is not None:
            raise fresh(self._peer_left)
        if (self._closing and self._farewell is not asyncio.current_task(self.loop)) or self._closed:
            raise ConnectionClosedError("the connection is closed")

    # ------------------------------------------------------ one-sided ----
    async def post_write(
        self, local: Any, remote: RemoteBuffer, *, imm: int | None = None
    ) -> asyncio.Future[WorkCompletion]:
        """Post an RDMA Write and return once it is on the send queue.

        Waits for a send-queue slot (and, with ``imm``, a message credit: the
        peer's receive completion needs a posted receive). Returns a future
        that completes with the write's work completion (or its error); the
        local buffer must stay untouched until then. :meth:`write` is this
        plus awaiting the future."""
        if imm is None:
            fut = self._fast.one_sided(_RDMA_WRITE, local, remote, False)
            if fut is not None:
                return fut
        self._check_usable()
        return await self._requester.post_write(local, remote, imm)

    async def write(self, local: Any, remote: RemoteBuffer, *, imm: int | None = None) -> None:
        """RDMA Write ``local`` into the peer's memory at ``remote``.

        ``local`` is a registered :class:`Region`/slice (zero copy) or any
        bytes-like object (copied into registered memory first). With
        ``imm`` (a 32-bit int) the peer also gets a receive completion
        carrying it (:meth:`recv_immediate`). Returns when the peer's NIC has
        acknowledged the data (it is in the peer's memory).
        """
        if imm is None:
            fut = self._fast.one_sided(_RDMA_WRITE, local, remote, True)
            if fut is not None:
                await fut  # cancelling this leaves the op pending until its CQE (registered memory: nothing to free)
                return
        await (await self.post_write(local, remote, imm=imm))

    async def write_batch(self, writes: Sequence[tuple[Any, RemoteBuffer]], *, imm: int | None = None) -> None:
        """Several RDMA Writes, ``(local, remote)`` pairs, posted as one chain with one
        doorbell, only the last signaled (an RC queue pair runs its send queue in
        order: its completion says every write is in the peer's memory). That saves a
        completion, a future and a wake-up per write. With ``imm`` the last write
        carries it. Raises the first failure's error. At most ``send_queue_depth``
        writes per call; longer lists: :meth:`transfer`."""
        self._check_usable()
        if self._batch_size(len(writes), "writes"):
            if imm is None:
                fut = self._fast.batch(_RDMA_WRITE, writes)
                if fut is not None:
                    await fut  # cancelling this leaves the chain pending until its last CQE
                    return
            work_requests.check_imm(imm)
            await self._requester.post_chain(work_requests.write_chain(self.pd, writes, imm), credit=imm is not None)

    def _batch_size(self, k: int, what: str) -> int:
        if k > self._sq.depth:
            raise ValueError(f"a batch of {k} {what} exceeds the send queue depth ({self._sq.depth})")
        return k

    async def post_read(self, remote: RemoteBuffer, into: Any) -> asyncio.Future[WorkCompletion]:
        """Post an RDMA Read of ``remote`` into ``into`` (as for :meth:`read`) and
        return once it is on the send queue (waiting for a slot): a future of its
        work completion, done when the data is in ``into`` (leave it untouched until
        then). Several reads posted this way fill the send queue, as perftest does."""
        fut = self._fast.one_sided(_RDMA_READ, into, remote, False)
        if fut is not None:
            return fut
        self._check_usable()
        return await self._requester.post_read(remote, into)

    async def read_batch(self, reads: Sequence[tuple[RemoteBuffer, Any]]) -> None:
        """Several RDMA Reads, ``(remote, into)`` pairs, posted as one chain: the Read
        counterpart of :meth:`write_batch`. Each ``into`` is registered memory or a
        writable buffer of at least ``remote.length`` bytes, as for :meth:`read`.
        Raises the first failure's error (the ``into`` buffers hold what arrived). At
        most ``send_queue_depth`` reads per call; longer lists: :meth:`transfer`."""
        self._check_usable()
        if self._batch_size(len(reads), "reads"):
            fut = self._fast.batch(_RDMA_READ, reads)
            if fut is not None:
                await fut  # cancelling this leaves the chain pending until its last CQE
                return
            await self._requester.post_chain(work_requests.read_chain(self._large.recv_cache, reads))

    def prepare_transfer(
        self, op: Literal["read", "write"], local: Region | RegionSlice, remote: RemoteBuffer, descriptors: Any
    ) -> PreparedTransfer:
        """A list of RDMA Reads (``"read"``: ``remote`` into ``local``) or Writes, rows of
        ``(local offset, remote offset, length)`` (a NumPy ``(N, 3)`` uint64 array or
        triples), checked once (:class:`DescriptorError` names a bad one) and ready to
        :meth:`~PreparedTransfer.start` as often as wanted (:mod:`aiordma.transfer`)."""
        return self._transfers.prepare(op, local, remote, descriptors)

    def transfer(
        self, op: Literal["read", "write"], local: Region | RegionSlice, remote: RemoteBuffer, descriptors: Any
    ) -> Transfer:
        """:meth:`prepare_transfer` and start it: an awaitable, pollable :class:`Transfer`."""
        return self._transfers.prepare(op, local, remote, descriptors).start()

    async def read(self, remote: RemoteBuffer, into: Any = None) -> bytes | None:
        """RDMA Read ``remote`` from the peer's memory.

        With ``into`` — registered memory (:class:`Region`/slice) or any
        writable buffer (bytearray, writable memoryview, numpy array) of at
        least ``remote.length`` bytes — the data lands there without a copy
        (a plain buffer is registered for the read) and None is returned;
        without it a new ``bytes`` is returned.
        """
        if into is not None:
            fut = self._fast.one_sided(_RDMA_READ, into, remote, True)
            if fut is None:
                fut = await self.post_read(remote, into)
            await fut  # cancelling this leaves the op (and its buffers) pending until its CQE
            return None
        self._check_usable()
        return await self._requester.read_bytes(remote)

    async def compare_and_swap(self, remote: RemoteBuffer, compare: int, swap: int) -> int:
        """Atomic compare-and-swap on the peer's 8-byte word: if it equals
        ``compare`` it becomes ``swap``. Returns the original value. Operands
        are 64-bit (negative values as two's complement)."""
        fut = self._fast.atomic(_CMP_AND_SWP, remote, compare, swap)
        if fut is not None:
            return int(await fut)
        operands = work_requests.atomic_operand(compare, "compare"), work_requests.atomic_operand(swap, "swap")
        self._check_usable()
        return await self._requester.atomic(_CMP_AND_SWP, remote, *operands, "ATOMIC_CMP_AND_SWP")

    async def fetch_and_add(self, remote: RemoteBuffer, add: int) -> int:
        """Atomic fetch-and-add on the peer's 8-byte word (modulo 2**64; a
        negative ``add`` subtracts). Returns the original value."""
        fut = self._fast.atomic(_FETCH_AND_ADD, remote, add, 0)
        if fut is not None:
            return int(await fut)
        operand = work_requests.atomic_operand(add, "add")
        self._check_usable()
        return await self._requester.atomic(_FETCH_AND_ADD, remote, operand, 0, "ATOMIC_FETCH_AND_ADD")

    # ------------------------------------------------------- messages ----
    def _wake_drain_waiters(self) -> None:
        self._outbox.wake_drain_waiters()

    async def send(self, data: Any, *, wait_ack: bool = False, wait_pulled: bool | None = None) -> None:
        """Send a message (bytes-like or registered memory) of any size.

        The peer's :meth:`recv` returns it whole, in order. Like a socket
        write, this returns once the message is handed to the device: it was
        copied into registered send buffers, so ``data`` may be reused at
        once. It has not necessarily reached the peer: a delivery failure
        found later fails the connection, and :meth:`drain` and :meth:`close`
        raise it. With ``wait_ack=True`` it returns only when the peer's NIC
        acknowledged every chunk. When the peer's application reads slower
        than this side sends, ``send`` waits (credits, the receive budget).

        A message of ``large_message_threshold`` bytes or more (256 KiB by
        default) is not copied: the peer pulls it from ``data`` with an RDMA
        Read (:mod:`aiordma.large_messages`). If ``data`` is ``bytes`` (immutable),
        ``send`` returns once the message is announced, and at most
        ``large_send_window`` bytes (64 MiB) of such messages wait to be
        pulled; any other buffer (bytearray, numpy array, a registered
        region) may change after ``send`` returns, so ``send`` waits until
        the peer has pulled it. ``wait_pulled=False`` treats any buffer as
        ``bytes`` are treated (return once announced, within the window): the
        caller then promises to leave it unchanged until :meth:`drain` (or
        :meth:`close`) returns, as an ``MPI_Isend`` buffer until its
        completion; ``wait_pulled=True`` waits even for ``bytes``.
        Cancelling the caller does not cut a message in half: the rest is
        still sent.
        """
        # one chunk, posted before this yields when a credit, a send buffer and a
        # send-queue slot are free (the completion releases the buffer: cancelling
        # the await below is safe)
        posted = self._fast.send_small(data, wait_ack)
        if posted is not False:
            if posted is not True:
                await posted
            return
        if self._error is not None or self._closing or self._closed:
            self._check_usable()
        if type(data) is bytes:  # no memoryview needed to copy it
            mv: Any = data
            n = len(data)
        else:
            if isinstance(data, _LOCAL):
                data = data.view
            try:
                mv = memoryview(data).cast("B")
            except TypeError:
                raise TypeError(
                    f"a message must be bytes-like or registered memory, not {type(data).__name__}"
                ) from None
            n = mv.nbytes
        if not self._window.chunk_size:
            raise RDMAError("the peer accepts no messages (it posted no receive buffers)")
        if mv is not data:
            posted = self._fast.send_small(mv, wait_ack)
            if posted is not False:
                if posted is not True:
                    await posted
                return
        await self._outbox.send_queued(mv, n, wait_ack, wait_pulled)

    async def _post_control(self, data: bytes) -> None:
        """Send ``data`` (a packed control message) in order with the messages; returns
        once it is posted (an undelivered one fails drain() and close(), as a send does)."""
        await self._outbox.post_message(memoryview(data), K_CONTROL, wait_ack=False)

    async def _read_into(self, remote: RemoteBuffer, into: Any) -> None:
        await self.read(remote, into=into)

    def _requeue(self, item: large_messages.LargeMessage) -> None:
        """A receive of ``item`` was cancelled: the next receive gets it."""
        if self._error is None:
            self._inbound.messages.put_back(item)

    async def send_control(self, message: Mapping[str, Any]) -> None:
        """Send a control message: a small msgpack-able map with a string
        ``"op"``, delivered to the peer's event handler as
        :class:`~aiordma.events.ControlReceived`, in order with this side's
        messages and writes (it travels on the same queue pair). Protocols
        layered on a connection use it (streams send their EOF and ring
        credits this way); ``"op"`` values ``advertise`` and those starting
        with ``_`` are reserved."""
        self._check_usable()
        data = self._control.encode(message)
        outbox = self._outbox
        await outbox.send_in_order(memoryview(data), outbox.take_turn(), kind_last=K_CONTROL, wait_ack=True)

    async def recv(self) -> bytes:
        """The next message from the peer. Raises :class:`ConnectionClosedError`
        once the peer closed and every message sent before was returned."""
        fast = self._fast
        while True:
            # a plain message queued now, or a wait for the next (the core's own paths;
            # anything else, and the interpreted core: aiordma.messages.Inbound.recv)
            item = fast.recv_message()
            if item is not None:
                return item
            waiter = fast.recv_waiter()
            if waiter is None:
                return await self._inbound.recv()
            try:
                await waiter
            except BaseException:
                fast.recv_cancelled(waiter)
                raise

    async def recv_into(self, buffer: Any) -> int:
        """Receive the next message into ``buffer`` and return its length.

        ``buffer`` is registered memory (:class:`Region`/slice) or any
        writable buffer (bytearray, writable memoryview, numpy array) at least
        as long as the message. A large message (see :meth:`send`) lands there
        by RDMA Read without any copy (a plain buffer is registered for it; a
        buffer used again is registered once, see
        :class:`~aiordma.memory.RegistrationCache`); a small one is copied
        once out of the receive buffers. If the message does not fit,
        ``ValueError`` says how long it is and the message stays queued for
        the next receive."""
        return await self._inbound.recv_into(buffer)

    async def recv_notification(self) -> TransferNotification:
        """The next notification of a Write transfer the peer started with ``notify=``."""
        return await self._control.notification()

    async def recv_immediate(self) -> Immediate:
        """The next Write-with-immediate notification from the peer."""
        return await self._inbound.recv_immediate()

    def __aiter__(self) -> Connection:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.recv()  # (its fast path: a plain message, no Python queue)
        except ConnectionClosedError:
            raise StopAsyncIteration from None

    async def advertise(self, region: Exposable, name: str) -> RemoteBuffer:
        """Expose ``region`` to the peer under ``name`` after connecting
        (the peer sees it in ``remote_buffers`` / :meth:`wait_remote`).

        As with ``expose=``: a region or slice is offered read-only,
        ``region.exposed("rw")`` with the rights it names, each through a
        registration of its own for this peer (released when the connection
        closes; advertising a name again revokes what it named before). A
        :class:`RemoteBuffer` is sent as it is."""
        self._check_usable()
        rb = self.exposures.grant(name, region)
        await self._send_control_data(ControlMessages.advertisement(name, rb))
        return rb

    # ---------------------------------------------------- completions ----
    def _on_completion(self, wc: WorkCompletion) -> None:
        if self._deferred is not None:
            self._deferred.append(wc)
            return
        wr_id = wc.wr_id
        if wr_id & RECV_TAG:
            self._inbound.on_recv(wc, wr_id ^ RECV_TAG)
            return
        if self._fast.completed(wc):  # the success half, finished by the compiled core
            return
        op = self._ops.complete(wc)
        if op is None:
            return
        status = wc.status
        fut = op.fut
        if op.members:
            # a failed chain whose later members are still being flushed: tell the
            # caller now, free the buffers with the last flush
            if fut is not None and not fut.done():
                self._fail_op(op, wc)
            return
        if op.kind == OP_MESSAGE and self._outbox.drain_waiters:
            self._outbox.wake_drain_waiters()
        release = op.release
        if release is not None:
            try:
                release()
            except Exception:  # pragma: no cover
                log.exception("releasing a buffer failed")
        if status == _WC_SUCCESS:
            if fut is not None and not fut.done():
                fut.set_result(wc)
            window = self._window
            if window.owed >= window.threshold:
                # credits that came due while a credit update was in flight (or the
                # send queue was full) are returned now: otherwise a peer blocked on
                # credits and this side, with nothing more to send, wait forever
                self._outbox.return_credits()
            return
        if status in REMOTE_STATUSES and self._error is None and not self._peer_reason.done():
            # the responder knows exactly why it refused (the soft device says which
            # check failed); its connection sends that over the rendezvous as it fails
            self._deferred = []
            self._fast.hold = True
            # a snapshot: a send fast path's per-slot op is reused as soon as its slot
            # is released (above), possibly by a send made while this waits
            failed = Op(fut, None, op.description(), op.opcode, op.kind)
            self.loop.create_task(self._fail_with_peer_reason(failed, wc))
            return
        self._op_failed(op, wc)

    def _op_failed(self, op: Op, wc: WorkCompletion) -> None:
        exc = self._fail_op(op, wc)
        if op.fut is None and op.kind == OP_MESSAGE:
            self._undelivered += 1
            if self._undelivered_error is None:
                self._undelivered_error = exc
        if self._error is None:
            # a flush while nothing of ours failed the connection: the QP went to
            # IBV_QPS_ERR under us (e.g. the responder refused a request), and every
            # later operation would be flushed too
            reason = self.qp.error_reason
            msg = f"queue pair 0x{self.qp.qp_num:06x} went to IBV_QPS_ERR after {exc}"
            if reason:
                msg += f" ({reason})"
            # the peer hears the real cause over the rendezvous (not an EOF it would take for a death)
            self._fail(ConnectionLostError(msg, cause=exc), reason=msg)

    async def _fail_with_peer_reason(self, op: Op, wc: WorkCompletion) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self._peer_reason), _PEER_REASON_WAIT)
        except (TimeoutError, asyncio.CancelledError):
            pass
        deferred, self._deferred = self._deferred or [], None
        self._fast.hold = False
        self._op_failed(op, wc)
        for later in deferred:
            self._on_completion(later)

    def _fail_op(self, op: Op, wc: WorkCompletion) -> BaseException:
        """The error a failed work completion means for ``op``, set on its future."""
        peer_reason = self._peer_reason.result() if self._peer_reason.done() else None
        exc = completion_error(op, wc, self._error, peer_reason, self.qp.error_reason)
        if op.fut is not None and not op.fut.done():
            op.fut.set_exception(exc)
            op.fut.add_done_callback(consume_exception)
        return exc

    def _receive_failed(self, wc: WorkCompletion) -> None:
        """A receive completed in error while the connection was open: the QP
        went to IBV_QPS_ERR under it (on the responder side, e.g. a request it
        refused; nothing else tells the application)."""
        name = getattr(wc.status, "name", str(wc.status))
        exc = error_for_status(wc.status)(f"{name}: receive failed", wc)
        reason = self.qp.error_reason
        msg = f"queue pair 0x{self.qp.qp_num:06x} went to IBV_QPS_ERR: {exc}"
        if reason:
            msg += f" ({reason})"
        self._fail(ConnectionLostError(msg, cause=exc), reason=reason)

    # -------------------------------------------------------- closing ----
    def _fail(self, exc: BaseException, reason: str | None = None) -> None:
        """The connection is over: every pending and future operation fails
        with ``exc``. ``reason``: why our QP failed, for the peer."""
        if self._error is not None:
            return
        # kept without frames, and every waiter gets a copy (errors.stored/fresh):
        # a closed connection must be freed by reference counting, not left in a cycle
        self._error = exc = stored(exc)
        metrics.connection_ended(exc)
        self._fast.usable = False
        for op in self._ops.ops():
            if op.fut is not None and not op.fut.done():
                err = fresh(exc)
                if op.opcode in NOT_IDEMPOTENT:
                    may_have_executed(err)  # it was posted: it may have reached the peer
                op.fut.set_exception(err)
                op.fut.add_done_callback(consume_exception)
        self._inbound.fail(exc)
        self._outbox.fail()
        self._sq.fail(exc)
        self._control.fail(exc)
        self._large.fail(exc)
        self._emit(ConnectionLost(exc))
        if reason is not None:
            # the requester only sees IBV_WC_REM_*_ERR: tell it which check failed (once
            # the rendezvous is attached, if this came before)
            if self._rendezvous is not None:
                self._rendezvous.send_nowait(rendezvous.goodbye(reason))
            else:
                self._unsent_reason = reason
        if not self._closing:
            self.loop.call_soon(self._teardown)

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until every message sent so far was acknowledged by the peer's NIC (or
        ``timeout`` s pass: :class:`TimeoutError`); raises the connection's error, if any."""
        self._check_usable()
        if not await self._outbox.drained(timeout):
            n = self._ops.outstanding(OP_MESSAGE)
            raise TimeoutError(f"drain: {n} sent message chunk(s) still unacknowledged after {timeout} s")
        if self._error is not None:
            raise fresh(self._error)

    async def close(self, timeout: float = 5.0) -> None:
        """Flush, say goodbye, release everything.

        Waits (up to ``timeout`` s) until the operations in flight complete
        and every message sent was acknowledged by the peer's NIC, tells the
        peer over the rendezvous, and tears the queue pair down. Raises
        :class:`ConnectionLostError` when a message sent without
        ``wait_ack`` was not delivered (its failure, or the timeout, says
        why): closing never hides a lost message. Closing twice is harmless."""
        if self._closing:
            await self.wait_closed()
            return
        self._closing = True
        self._fast.usable = False
        flushed = True
        unacked = 0
        failed_before = self._undelivered
        if self._peer_left is not None and self._error is None:
            self._fail(self._peer_left)  # the peer said goodbye: no more waiting for its ACKs
        if not self._closed:
            try:
                pending = [op.fut for op in self._ops.ops() if op.fut is not None and not op.fut.done()]
                if pending and self._error is None:
                    await asyncio.wait(pending, timeout=timeout)
                flushed = await self._outbox.drained(timeout)
                if self._rendezvous is not None and self._error is None:
                    try:
                        await asyncio.wait_for(self._rendezvous.send(rendezvous.goodbye()), 1.0)
                    except Exception:
                        pass
            finally:
                unacked = 0 if flushed else self._outbox.unacknowledged()
                failed_before = self._undelivered
                self._fail(ConnectionClosedError("the connection was closed locally"))
                self._teardown()
        if unacked:
            raise ConnectionLostError(
                f"close: {unacked} sent message chunk(s) were not acknowledged by the peer's NIC within "
                f"{timeout} s; they may not have been delivered"
            )
        if failed_before:
            raise ConnectionLostError(
                f"{failed_before} message(s) sent were not delivered: {self._undelivered_error}",
                cause=self._undelivered_error,
            )

    def abort(self, error: BaseException | None = None) -> None:
        """Close at once: pending operations fail (with ``error`` if given, e.g.
        a protocol violation found by a layer above), the QP is destroyed, the
        peer sees an abort. Synchronous."""
        if self._closed:
            self._closing = True
            return
        if self._rendezvous is not None and self._error is None:
            self._rendezvous.send_nowait(rendezvous.goodbye(aborted=True))
        self._closing = True
        self._fail(error if error is not None else ConnectionClosedError("the connection was aborted locally"))
        self._teardown()

    def _say_goodbye_now(self) -> None:
        """The goodbye of a connection the program let go without closing it, written
        at once (no loop turn needed). Nothing was flushed, so the peer is told so: it
        raises :class:`ConnectionLostError`, not the "closed" that vouches for delivery.
        (``aborted`` too, for a peer of an older version.)"""
        if self._rendezvous is not None and self._error is None:
            try:
                self._rendezvous.send_nowait(rendezvous.goodbye(abandoned=True))
            except Exception:  # the transport or its loop is already gone
                pass

    def _end_abandoned(self, why: str) -> None:
        """The program let this connection go without closing it: goodbye, then teardown."""
        self._say_goodbye_now()
        self._closing = True
        self._fail(ConnectionClosedError(why))
        self._teardown()

    def _teardown(self) -> None:
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        monitor, self._monitor = self._monitor, None  # (a finished task would hold its frames)
        if monitor is not None and monitor is not asyncio.current_task():
            monitor.cancel()
        if self._rendezvous is not None:
            self._rendezvous.close()
        try:
            if self.qp.state != QPState.IBV_QPS_RESET:
                self.qp.to_error()  # flush everything outstanding
        except Exception:
            pass
        self.dispatcher.drain_now()
        self.dispatcher.close()
        if self._detach_loop is not None:
            self._detach_loop()
            self._detach_loop = None
        try:
            self.qp.close()
        except Exception as e:  # pragma: no cover
            log.debug("destroy QP: %s", e)
        # the QP is gone: nothing can touch the buffers any more
        self._ops.release_all()
        error = self._error
        closers = [self.cq.close, self._inbound.close, lambda: self._requester.close(error), self.exposures.close]
        if self._owns_channel:  # a shared channel is not ours: the dispatcher left it above
            closers.insert(1, self.channel.close)
        for closer in closers:
            try:
                closer()
            except Exception:
                pass
        self._outbox.close(error)
        self._transfers.close(error)
        self._fast.close()
        self._control.close()
        self._large.close()
        self._window.leave_shared()  # its queued messages stop counting against the process's budget
        # a layer above that set an event handler (a stream) holds this connection
        self._event_handler = None
        if not self._closed_fut.done():
            self._closed_fut.set_result(None)

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            await self.close()
        except RDMAError as e:
            if exc_type is None:
                raise
            log.warning("closing %r after an error: %s", self, e)  # do not hide the one on its way

    def __repr__(self) -> str:
        peer = f" peer_qpn=0x{self.peer.qpn:06x}" if self.peer else ""
        return (
            f"<Connection qpn=0x{self.qp.qp_num:06x}{peer} {self.device.provider}:{self.device.name} "
            f"{self.state.value}>"
        )


async def _await_rdma_path(conn: Connection, refused: bool) -> None:
    """What the peer's goodbye may have overtaken gets up to ``_PEER_GOODBYE_GRACE``
    to arrive: the goodbye comes over the rendezvous (TCP), the rest over the RDMA
    path, and either can win.

    A plain goodbye (the peer closed): the ACKs of the messages it took last.
    ``refused`` (the goodbye names why the peer's queue pair failed): the NAK of
    the request its responder refused, sent before the goodbye, so that the
    operation fails as itself (a :class:`RemoteAccessError` with the responder's
    reason, which the goodbye has just delivered) rather than as a lost
    connection. The wait ends with the first failure (the connection then has
    its error), when nothing is outstanding, or at the grace's end."""
    if not refused:
        await conn._outbox.drained(_PEER_GOODBYE_GRACE, pulls=False)
        return
    deadline = conn.loop.time() + _PEER_GOODBYE_GRACE
    while conn._error is None and not conn._closed and len(conn._ops) and conn.loop.time() < deadline:
        conn.dispatcher.drain_now()
        if conn._error is None:
            await asyncio.sleep(0.001)


#: connections not torn down yet (for the goodbye at exit)
_OPEN: weakref.WeakSet[Connection] = weakref.WeakSet()


def open_connections() -> list[Connection]:
    """This process's connections not torn down yet (open, closing or lost: not closed).
    Safe from another thread (a metrics scrape): a set changed under the copy is copied again."""
    for _ in range(100):
        try:
            return list(_OPEN)
        except RuntimeError:  # (another thread added or removed one meanwhile)
            continue
    return []


def _goodbye_at_exit() -> None:
    """At interpreter exit, every connection still open says goodbye.

    A connection whose event loop is no longer running (``asyncio.run()`` has
    returned) tells its peer now, so the peer learns it at once, not from
    retry timeouts. A connection whose loop still runs in another thread (a
    framework's IO thread, as Dask's) is left to that framework's own exit
    handlers, and so is its device: closing the device under it would stall
    every clean close still to come."""
    for conn in list(_OPEN):
        try:
            running = conn.loop.is_running()
        except Exception:
            running = False
        if running:
            spare_at_exit(conn.device)
        else:
            conn._say_goodbye_now()


# (registered after aiordma.providers' handler, so it runs before the devices are closed)
atexit.register(_goodbye_at_exit)
