"""Connections: one RC queue pair, awaited from asyncio.

A :class:`Connection` owns a queue pair, its completion queue (one CQ with
its own completion channel, dispatched on the loop by
:class:`~aiordma.completion.CompletionDispatcher`) and the registered buffers
messages use. It offers:

* one-sided verbs: :meth:`~Connection.write` (optionally with immediate
  data), :meth:`~Connection.read`, :meth:`~Connection.compare_and_swap`,
  :meth:`~Connection.fetch_and_add` against a peer's :class:`RemoteBuffer`;
* two-sided messages: :meth:`~Connection.send` / :meth:`~Connection.recv`
  of any size. Messages travel as SEND_WITH_IMM chunks of at most the peer's
  receive-buffer size; the 32-bit immediate carries the chunk kind and
  returned credits. A sender spends one credit per chunk and never uses its
  last credit for data, which is kept for returning credits, so normal
  traffic never meets an RNR NAK;
* :meth:`~Connection.recv_immediate` for Write-with-immediate notifications.

Cancel safety: cancelling a coroutine awaiting an operation never frees or
reuses a buffer before the device's completion for it arrives — the buffers
are released by the completion, not by the awaiting coroutine.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import os
import struct
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from . import rendezvous as rdv
from .completion import CompletionDispatcher
from .errors import (
    ConnectionClosedError,
    ConnectionLostError,
    RDMAError,
    RemoteBufferNotFoundError,
    RendezvousError,
    error_for_status,
)
from .memory import BufferPool, Region, RegionSlice, RemoteBuffer
from .providers import get_device
from .providers.base import (
    ACCESS_ALL,
    SGE,
    Access,
    DeviceContext,
    ProtectionDomain,
    QPAttr,
    QPCap,
    QPState,
    RecvWR,
    SendFlags,
    SendWR,
    WCOpcode,
    WCStatus,
    WorkCompletion,
    WROpcode,
    mtu_bytes,
    mtu_from_bytes,
)

log = logging.getLogger("aiordma")

DEFAULT_PORT = 18515
_RECV_TAG = 1 << 62
_ATOMIC = struct.Struct("<Q")
# immediate-data header of message chunks: kind in bits 31-30, credits in 23-0
_K_MORE, _K_LAST, _K_CREDIT, _K_CONTROL = 0, 1, 2, 3
_CREDIT_MASK = 0xFFFFFF
_IMM_LAST = _K_LAST << 30
# plain-int forms of the enum values the per-message path compares against
# (an int compare instead of a global load and an attribute lookup each time)
_WC_SUCCESS = int(WCStatus.IBV_WC_SUCCESS)
_SEND_WITH_IMM = WROpcode.IBV_WR_SEND_WITH_IMM
_WC_RECV_RDMA_WITH_IMM = int(WCOpcode.IBV_WC_RECV_RDMA_WITH_IMM)
_LOCAL = (Region, RegionSlice)

_pd_cache: dict[int, ProtectionDomain] = {}


def protection_domain(device: DeviceContext) -> ProtectionDomain:
    """The protection domain shared by every connection on ``device``
    (regions registered once work on all of them)."""
    pd = _pd_cache.get(id(device))
    if pd is None or getattr(pd, "device", device) is not device:
        pd = device.alloc_pd()
        _pd_cache[id(device)] = pd
    return pd


def register(
    buffer: Any,
    access: Access = ACCESS_ALL,
    *,
    provider: str | None = None,
    device: DeviceContext | None = None,
) -> Region:
    """Register ``buffer`` (bytearray, mmap, writable memoryview, numpy array, or
    an int size to allocate) with the default device, zero copy."""
    device = device or get_device(provider)
    pd = protection_domain(device)
    return Region(pd.reg_mr(buffer, access), buffer)


@dataclass(frozen=True, slots=True)
class Immediate:
    """A Write-with-immediate notification: the peer wrote ``length`` bytes
    into memory it had been given, and says ``value`` (32 bits) about it."""

    value: int
    length: int


class _Op:
    __slots__ = ("describe", "fut", "members", "nbytes", "opcode", "release")

    def __init__(
        self,
        fut: asyncio.Future | None,
        release: Callable[[], None] | None,
        describe: str | Callable[[], str],
        opcode: int,
    ):
        self.fut = fut
        self.release = release
        self.describe = describe
        self.opcode = opcode
        #: a chain posted with one doorbell: the wr_ids still without a completion
        #: (only the last is signaled; a failure completes every one of them)
        self.members: set[int] | None = None
        #: the message size of a one-chunk send (the per-slot ops of the send fast path)
        self.nbytes = 0


def _slot_send_op(release: Callable[[], None]) -> _Op:
    """The reusable :class:`_Op` of one send-buffer slot for one-chunk messages.

    A slot carries at most one SEND at a time and its op leaves ``_pending``
    (its completion) before the slot is released, so the fast path of
    :meth:`Connection.send` fills in ``fut`` and ``nbytes`` instead of building
    an op, a release closure and a description per message."""
    op = _Op(None, release, "", _SEND_WITH_IMM)
    op.describe = lambda: f"SEND of a {op.nbytes}-byte message"
    return op


class _Inbox:
    """An unbounded FIFO of received items with the semantics of the
    ``asyncio.Queue`` it replaces (``put`` never blocks; a ``get`` that has to
    wait is woken with the item left in the queue, so a cancelled waiter loses
    nothing, and waiters are woken in order), minus its per-call overhead.

    ``items`` is read directly on the fast paths: a non-empty inbox hands its
    head over without a suspension, as ``Queue.get`` does."""

    __slots__ = ("items", "loop", "waiters")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.items: collections.deque[Any] = collections.deque()
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.loop = loop

    def put(self, item: Any) -> None:
        self.items.append(item)
        if self.waiters:
            self.wake_next()

    def wake_next(self) -> None:
        """Wake the first waiter that is still waiting (if any)."""
        waiters = self.waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    async def get(self) -> Any:
        items = self.items
        while not items:
            waiter = self.loop.create_future()
            self.waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                waiter.cancel()  # in case it is not done yet
                try:
                    self.waiters.remove(waiter)
                except ValueError:  # put() had already taken it off
                    pass
                if items and not waiter.cancelled():
                    # woken by put() but cancelled before taking the item: pass it on
                    self.wake_next()
                raise
        return items.popleft()


_EXPLAIN = {
    WCStatus.IBV_WC_REM_ACCESS_ERR: "the peer's NIC refused it: the rkey is unknown, does not grant the access "
    "(REMOTE_WRITE/REMOTE_READ/REMOTE_ATOMIC), or the range is outside its region",
    WCStatus.IBV_WC_REM_INV_REQ_ERR: "the peer's NIC found the request invalid (too long for the posted receive, "
    "misaligned atomic, or not allowed)",
    WCStatus.IBV_WC_RETRY_EXC_ERR: "no acknowledgement after timeout x retry_cnt: the peer is gone or unreachable",
    WCStatus.IBV_WC_RNR_RETRY_EXC_ERR: "the peer had no receive posted (RNR) too many times",
    WCStatus.IBV_WC_WR_FLUSH_ERR: "the queue pair went to the error state before this request ran",
    WCStatus.IBV_WC_LOC_PROT_ERR: "a local SGE is not inside a registered region (lkey/bounds)",
    WCStatus.IBV_WC_LOC_LEN_ERR: "a message did not fit the posted receive buffer",
}


class Connection:
    """An RDMA connection to one peer (an RC queue pair plus its buffers)."""

    def __init__(
        self,
        device: DeviceContext,
        *,
        progress: str | None = None,
        recv_buffers: int = 16,
        recv_buffer_size: int = 64 * 1024,
        send_queue_depth: int = 256,
        max_rd_atomic: int = 16,
        ack_timeout: int = 14,
        retry_cnt: int = 7,
        gid_index: int | None = None,
        spin_us: float | None = None,
    ) -> None:
        if recv_buffers < 4:
            raise ValueError(
                "recv_buffers must be at least 4: the peer keeps its last credit for credit updates, and "
                "credits are returned in batches of recv_buffers // 2 (at least 2)"
            )
        if not 64 <= recv_buffer_size <= 1 << 30:
            raise ValueError("recv_buffer_size must be between 64 bytes and 1 GiB")
        self.loop = asyncio.get_running_loop()
        self.device = device
        self.pd = protection_domain(device)
        self.progress_requested = progress or os.environ.get("AIORDMA_PROGRESS", "event")
        #: event mode's poll window after a post or a completion (µs; None: AIORDMA_SPIN_US or 200)
        self._spin_us = spin_us
        self.channel = device.create_comp_channel()
        depth = send_queue_depth + 2 * recv_buffers + 16
        self.cq = device.create_cq(depth, self.channel)
        self.qp = self.pd.create_qp(
            self.cq,
            self.cq,
            QPCap(max_send_wr=send_queue_depth + 8, max_recv_wr=recv_buffers, max_send_sge=4, max_recv_sge=1),
        )
        self._max_rd_atomic = max_rd_atomic
        self._ack_timeout = ack_timeout
        self._retry_cnt = retry_cnt
        port = device.query_port(1)
        #: the port's active MTU (what the rendezvous announces) and the path MTU in use
        self.port_mtu = self.mtu = mtu_bytes(port.active_mtu)
        if gid_index is None and os.environ.get("AIORDMA_GID_INDEX"):
            gid_index = int(os.environ["AIORDMA_GID_INDEX"])
        self.gid_index = device.default_gid_index(1) if gid_index is None else gid_index
        self.gid = device.query_gid(1, self.gid_index).gid
        self.psn = int.from_bytes(os.urandom(3), "big")
        self.qp.to_init(QPAttr(port_num=1, qp_access_flags=ACCESS_ALL))
        # receive buffers for messages, posted now (INIT allows post_recv)
        self.recv_buffers = recv_buffers
        self.recv_buffer_size = recv_buffer_size
        self._recv_pool = BufferPool(
            Region(self.pd.reg_mr(recv_buffers * recv_buffer_size, Access.LOCAL_WRITE)), recv_buffer_size
        )
        # one receive WR per slot, built once and reposted as it is (providers
        # read posted WRs, never modify them)
        self._recv_wrs = [RecvWR(_RECV_TAG | i, [self._recv_pool.sge(i)]) for i in range(recv_buffers)]
        self._recv_views = [self._recv_pool.view(i) for i in range(recv_buffers)]
        self.qp.post_recv(self._recv_wrs)
        self._send_pool: BufferPool | None = None
        # per send-buffer slot (set up with the pool in _connect_qp): the free list,
        # the slot's bytes, address and lkey, its release and its fast-path op
        self._send_free: list[int] = []
        self._send_views: list[memoryview] = []
        self._send_addrs: list[int] = []
        self._send_lkey = 0
        self._send_releases: list[Callable[[], None]] = []
        self._send_ops: list[_Op] = []
        self._scratch = BufferPool(Region(self.pd.reg_mr(8 * 64, Access.LOCAL_WRITE)), 8)
        self._sq_free = self._sq_depth = send_queue_depth
        self._drain_waiters: list[asyncio.Future] = []
        self._sq_waiters: list[asyncio.Future] = []
        self._ids = itertools.count(1)
        self._pending: dict[int, _Op] = {}
        self._credits = 0
        self._credits_owed = 0
        self._credit_threshold = 1
        self._credit_waiters: list[asyncio.Future] = []
        self._credit_msg_inflight = False
        self._chunk_size = 0
        self._assembly: list[bytes] = []
        self._messages = _Inbox(self.loop)
        self._immediates = _Inbox(self.loop)
        self._send_lock = asyncio.Lock()
        #: a chunked message holds _send_lock (what _send_lock.locked() says, without the call)
        self._send_busy = False
        self._remote_waiters: dict[str, list[asyncio.Future]] = {}
        self.remote_buffers: dict[str, RemoteBuffer] = {}
        self.peer: rdv.Endpoint | None = None
        self.capabilities: list[str] = []
        self._channel: rdv.Channel | None = None
        self._monitor: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._closing = False
        self._closed = False
        self._on_control: Callable[[dict], None] | None = None
        self._on_immediate: Callable[[int, int], bool] | None = None
        self._on_credit_payload: Callable[[bytes], None] | None = None
        self.dispatcher = CompletionDispatcher(
            self.cq, self.channel, self._on_completion, mode=self.progress_requested, spin_us=self._spin_us
        )
        self._expect = self.dispatcher.expect
        self._detach_loop = device.attach_event_loop(self.loop)

    # --------------------------------------------------------- set-up ----
    def local_endpoint(
        self, buffers: Mapping[str, Any] | None = None, stream_ring: RemoteBuffer | None = None
    ) -> rdv.Endpoint:
        exposed = {}
        for name, b in (buffers or {}).items():
            exposed[name] = b if isinstance(b, RemoteBuffer) else b.remote()
        return rdv.Endpoint(
            qpn=self.qp.qp_num,
            psn=self.psn,
            gid=bytes(self.gid),
            mtu=self.port_mtu,
            port=self.device.udp_port,
            provider=self.device.provider,
            recv_buffers=self.recv_buffers,
            recv_buffer_size=self.recv_buffer_size,
            buffers=exposed,
            stream_ring=stream_ring,
            soft_mtu=int(getattr(self.device, "soft_mtu", 0) or 0),
        )

    def _connect_qp(self, peer: rdv.Endpoint) -> None:
        """INIT → RTR → RTS toward the peer's QP (the verbs connection set-up)."""
        self.peer = peer
        mtu = min(self.port_mtu, peer.mtu)
        jumbo = None
        local_soft_mtu = int(getattr(self.device, "soft_mtu", 0) or 0)
        if local_soft_mtu and peer.soft_mtu and min(local_soft_mtu, peer.soft_mtu) > mtu:
            jumbo = min(local_soft_mtu, peer.soft_mtu)  # two soft devices: jumbo packets
        self.mtu = jumbo or mtu
        self.qp.to_rtr(
            QPAttr(
                port_num=1,
                path_mtu=mtu_from_bytes(mtu),
                dest_qp_num=peer.qpn,
                rq_psn=peer.psn,
                dgid=peer.gid,
                dport=peer.port,
                path_mtu_bytes=jumbo,
                sgid_index=self.gid_index,
                max_dest_rd_atomic=self._max_rd_atomic,
                min_rnr_timer=12,
                qp_access_flags=ACCESS_ALL,
            )
        )
        self.qp.to_rts(
            QPAttr(
                sq_psn=self.psn,
                timeout=self._ack_timeout,
                retry_cnt=self._retry_cnt,
                rnr_retry=7,
                max_rd_atomic=self._max_rd_atomic,
            )
        )
        self.remote_buffers = dict(peer.buffers)
        self._credits = peer.recv_buffers
        # return credits for our receive slots once half of them were consumed (must be <= slots - 1)
        # Return credits once half our slots were consumed. At least 2, so that a
        # lone credit update never triggers one in reply (no credit ping-pong), and
        # at most recv_buffers - 1, the most a blocked peer can have used.
        self._credit_threshold = max(2, self.recv_buffers // 2)
        self._chunk_size = min(peer.recv_buffer_size, self.recv_buffer_size) if peer.recv_buffer_size else 0
        if self._chunk_size:
            nsend = max(2, min(peer.recv_buffers, 64))
            pool = self._send_pool = BufferPool(
                Region(self.pd.reg_mr(nsend * self._chunk_size, Access.LOCAL_WRITE)), self._chunk_size
            )
            slots = range(pool.count)
            self._send_free = pool._free
            self._send_views = [pool.view(i) for i in slots]
            self._send_addrs = [pool.sge(i).addr for i in slots]
            self._send_lkey = pool.region.lkey
            self._send_releases = [functools.partial(pool.release, i) for i in slots]
            self._send_ops = [_slot_send_op(r) for r in self._send_releases]

    def _start_monitor(self, channel: rdv.Channel) -> None:
        self._channel = channel
        self._monitor = self.loop.create_task(self._monitor_main(channel))

    async def _monitor_main(self, channel: rdv.Channel) -> None:
        """Watch the rendezvous TCP connection: ``bye`` or EOF ends the connection."""
        try:
            while True:
                msg = await channel.recv()
                if msg.get("t") == "bye":
                    self.dispatcher.drain_now()
                    self._fail(ConnectionClosedError("the peer closed the connection"), graceful=True)
                    return
        except asyncio.CancelledError:
            raise
        except RendezvousError as e:
            if not self._closed and not self._closing:
                self.dispatcher.drain_now()
                self._fail(
                    ConnectionLostError(
                        f"peer vanished: the rendezvous connection broke without a goodbye ({e}); "
                        "the peer process probably died",
                        cause=e,
                    )
                )
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
    def closed(self) -> bool:
        return self._closed

    def remote(self, name: str) -> RemoteBuffer:
        """A buffer the peer exposed under ``name``."""
        try:
            return self.remote_buffers[name]
        except KeyError:
            raise RemoteBufferNotFoundError(
                f"the peer exposed no buffer named {name!r} (it has: {', '.join(sorted(self.remote_buffers)) or 'none'})"
            ) from None

    async def wait_remote(self, name: str, timeout: float | None = None) -> RemoteBuffer:
        """Wait until the peer exposes (or has exposed) a buffer called ``name``."""
        if name in self.remote_buffers:
            return self.remote_buffers[name]
        self._check_usable()
        fut = self.loop.create_future()
        self._remote_waiters.setdefault(name, []).append(fut)
        return await asyncio.wait_for(fut, timeout)

    def register(self, buffer: Any, access: Access = ACCESS_ALL) -> Region:
        """Register memory with this connection's device (usable by every
        connection on the device). Zero copy for writable buffers."""
        return Region(self.pd.reg_mr(buffer, access), buffer)

    # ------------------------------------------------------- posting ----
    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closing or self._closed:
            raise ConnectionClosedError("the connection is closed")

    async def _sq_slot(self, n: int = 1) -> None:
        """Take ``n`` send-queue slots at once (a chain must not hold some and wait for the rest)."""
        while self._sq_free < n:
            fut = self.loop.create_future()
            self._sq_waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self._sq_waiters:
                    self._sq_waiters.remove(fut)
            self._check_usable()
        self._sq_free -= n

    def _sq_release(self) -> None:
        self._sq_free += 1
        if self._sq_waiters and self._sq_free > 1:
            # a chain waiting for several slots: let every waiter look again
            for fut in self._sq_waiters:
                if not fut.done():
                    fut.set_result(None)
            return
        while self._sq_waiters:
            fut = self._sq_waiters.pop(0)
            if not fut.done():
                fut.set_result(None)
                break

    def _post_nowait(
        self,
        wr: SendWR,
        release: Callable[[], None] | None,
        describe: str | Callable[[], str],
        want_future: bool = True,
    ) -> asyncio.Future | None:
        """Post a send WR now (a send-queue slot must be held)."""
        fut = self.loop.create_future() if want_future else None
        self._post_op(wr, _Op(fut, release, describe, wr.opcode))
        return fut

    def _post_op(self, wr: SendWR, op: _Op) -> None:
        """Post ``wr`` as ``op``'s work request (a send-queue slot must be held).
        If the device refuses it, the slot and ``op``'s buffer are given back."""
        wr.wr_id = wr_id = next(self._ids)
        pending = self._pending
        pending[wr_id] = op
        try:
            self.qp.post_send(wr)
            self._expect()
        except BaseException:
            pending.pop(wr_id, None)
            op.fut = None
            self._sq_release()
            if op.release is not None:
                op.release()
            raise

    async def _post(
        self, wr: SendWR, release: Callable[[], None] | None, describe: str | Callable[[], str]
    ) -> WorkCompletion:
        self._check_usable()
        await self._sq_slot()
        fut = self._post_nowait(wr, release, describe)
        assert fut is not None
        return await fut  # cancelling this leaves the op (and its buffers) pending until its CQE

    def _local(self, local: Any, *, writable: bool) -> tuple[list[SGE], Callable[[], None] | None, Region | None]:
        """SGEs for a local buffer: registered memory is used in place; other
        bytes-like objects are copied into a temporary registered buffer."""
        if isinstance(local, Region):
            return ([local.sge()] if local.length else []), None, None
        if isinstance(local, RegionSlice):
            return ([local.sge()] if local.length else []), None, None
        mv = memoryview(local).cast("B")
        if writable:
            raise TypeError("the destination must be registered memory (conn.register(buffer)) or None")
        if mv.nbytes == 0:
            return [], None, None
        tmp = Region(self.pd.reg_mr(bytearray(mv), Access.LOCAL_WRITE))
        return [tmp.sge()], tmp.close, tmp

    # ------------------------------------------------------ one-sided ----
    async def write(self, local: Any, remote: RemoteBuffer, *, imm: int | None = None) -> None:
        """RDMA Write ``local`` into the peer's memory at ``remote``.

        ``local`` is a registered :class:`Region`/slice (zero copy) or any
        bytes-like object (copied into registered memory first). With
        ``imm`` (a 32-bit int) the peer also gets a receive completion
        carrying it (:meth:`recv_immediate`). Returns when the peer's NIC has
        acknowledged the data (it is in the peer's memory).
        """
        self._check_usable()
        sges, release, _ = self._local(local, writable=False)
        n = sum(s.length for s in sges)
        if n > remote.length:
            if release:
                release()
            raise ValueError(f"write of {n} bytes does not fit the remote buffer of {remote.length} bytes")
        op = WROpcode.IBV_WR_RDMA_WRITE
        if imm is not None:
            if not 0 <= imm <= 0xFFFFFFFF:
                raise ValueError("immediate data is 32 bits")
            op = WROpcode.IBV_WR_RDMA_WRITE_WITH_IMM
            try:
                await self._take_credit(data=True)
            except BaseException:
                if release:
                    release()
                raise
        wr = SendWR(0, op, sges, remote_addr=remote.addr, rkey=remote.rkey, imm_data=imm)
        await self._post(
            wr, release, lambda: f"RDMA_WRITE{'_WITH_IMM' if imm is not None else ''} of {n} bytes to {remote!r}"
        )

    async def write_batch(self, writes: Sequence[tuple[Any, RemoteBuffer]], *, imm: int | None = None) -> None:
        """Several RDMA Writes, ``(local, remote)`` pairs, posted as one chain.

        The work requests are linked and handed to the device with one
        ``ibv_post_send`` (one doorbell), and only the last one is signaled:
        an RC queue pair executes its send queue in order, so the last
        completion says every write before it is in the peer's memory
        (selective signaling, what perftest's ``--cq-mod`` does). That saves
        a completion, a future and a wake-up per write, which is what limits
        small and medium writes in Python. With ``imm`` the last write
        carries it (the peer gets one :meth:`recv_immediate`). Returns when
        all are done; if one fails, raises its error (the queue pair then
        flushes the rest). At most ``send_queue_depth`` writes per call.
        """
        self._check_usable()
        k = len(writes)
        if k == 0:
            return
        if k > self._sq_depth:
            raise ValueError(f"a batch of {k} writes exceeds the send queue depth ({self._sq_depth})")
        if imm is not None and not 0 <= imm <= 0xFFFFFFFF:
            raise ValueError("immediate data is 32 bits")
        wrs: list[SendWR] = []
        releases: list[Callable[[], None]] = []
        total = 0

        def release_all() -> None:
            for r in releases:
                r()

        try:
            for i, (local, remote) in enumerate(writes):
                sges, release, _ = self._local(local, writable=False)
                if release:
                    releases.append(release)
                n = sum(s.length for s in sges)
                if n > remote.length:
                    raise ValueError(
                        f"write {i} of the batch: {n} bytes do not fit the remote buffer of {remote.length} bytes"
                    )
                total += n
                last = i == k - 1
                op = WROpcode.IBV_WR_RDMA_WRITE_WITH_IMM if last and imm is not None else WROpcode.IBV_WR_RDMA_WRITE
                wrs.append(
                    SendWR(
                        0,
                        op,
                        sges,
                        remote_addr=remote.addr,
                        rkey=remote.rkey,
                        imm_data=imm if last else None,
                        send_flags=SendFlags.IBV_SEND_SIGNALED if last else SendFlags(0),
                    )
                )
            if imm is not None:
                await self._take_credit(data=True)
            await self._sq_slot(k)
        except BaseException:
            release_all()
            raise
        fut = self.loop.create_future()
        op = _Op(
            fut, release_all if releases else None, lambda: f"batch of {k} RDMA_WRITEs ({total} bytes)", wrs[-1].opcode
        )
        members: set[int] = set()
        for wr in wrs:
            wr.wr_id = next(self._ids)
            members.add(wr.wr_id)
            self._pending[wr.wr_id] = op
        op.members = members
        try:
            self.qp.post_send(wrs)
            self._expect()
        except BaseException:
            for wr in wrs:
                self._pending.pop(wr.wr_id, None)
            self._sq_free += k - 1
            self._sq_release()
            release_all()
            raise
        await fut  # cancelling this leaves the writes (and their buffers) pending until the last CQE

    async def read(self, remote: RemoteBuffer, into: Region | RegionSlice | None = None) -> bytes | None:
        """RDMA Read ``remote`` from the peer's memory.

        With ``into`` (registered memory of at least ``remote.length`` bytes)
        the data lands there zero copy and None is returned; without it a
        new ``bytes`` is returned.
        """
        self._check_usable()
        n = remote.length
        tmp = None
        if into is None:
            tmp = Region(self.pd.reg_mr(max(n, 1), Access.LOCAL_WRITE))
            sges = [tmp.sge(0, n)] if n else []
            release = tmp.close
        else:
            if len(into) < n:
                raise ValueError(f"read of {n} bytes does not fit the {len(into)}-byte destination")
            sg = into.sge()
            sges = [SGE(sg.addr, n, sg.lkey)] if n else []
            release = None
        wr = SendWR(0, WROpcode.IBV_WR_RDMA_READ, sges, remote_addr=remote.addr, rkey=remote.rkey)
        # keep the temporary region alive until the completion: release() is the completion's job
        data: bytes | None = None
        if tmp is not None:
            view = tmp.view

            def release_tmp() -> None:
                nonlocal data
                data = bytes(view[:n])
                tmp.close()

            release = release_tmp
        await self._post(wr, release, lambda: f"RDMA_READ of {n} bytes from {remote!r}")
        return data

    async def _atomic(self, opcode: WROpcode, remote: RemoteBuffer, compare_add: int, swap: int, name: str) -> int:
        self._check_usable()
        if remote.length < 8:
            raise ValueError(f"{name} needs an 8-byte remote buffer, got {remote.length}")
        if remote.addr & 7:
            log.debug("%s at unaligned address 0x%x: the peer will refuse it", name, remote.addr)
        slot = await self._scratch.acquire()
        result = [0]

        def release() -> None:
            result[0] = _ATOMIC.unpack(self._scratch.view(slot))[0]
            self._scratch.release(slot)

        wr = SendWR(
            0,
            opcode,
            [self._scratch.sge(slot)],
            remote_addr=remote.addr,
            rkey=remote.rkey,
            compare_add=compare_add & 0xFFFFFFFFFFFFFFFF,
            swap=swap & 0xFFFFFFFFFFFFFFFF,
        )
        await self._post(wr, release, lambda: f"{name} on {remote!r}")
        return result[0]

    async def compare_and_swap(self, remote: RemoteBuffer, compare: int, swap: int) -> int:
        """Atomic compare-and-swap on the peer's 8-byte word: if it equals
        ``compare`` it becomes ``swap``. Returns the original value."""
        return await self._atomic(WROpcode.IBV_WR_ATOMIC_CMP_AND_SWP, remote, compare, swap, "ATOMIC_CMP_AND_SWP")

    async def fetch_and_add(self, remote: RemoteBuffer, add: int) -> int:
        """Atomic fetch-and-add on the peer's 8-byte word. Returns the original value."""
        return await self._atomic(WROpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, remote, add, 0, "ATOMIC_FETCH_AND_ADD")

    # ------------------------------------------------------- messages ----
    async def _take_credit(self, data: bool) -> None:
        need = 2 if data else 1
        while self._credits < need:
            self._check_usable()
            fut = self.loop.create_future()
            self._credit_waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self._credit_waiters:
                    self._credit_waiters.remove(fut)
        self._check_usable()
        self._credits -= 1

    def _wake_credit_waiters(self) -> None:
        waiters, self._credit_waiters = self._credit_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    def _take_owed(self) -> int:
        n = min(self._credits_owed, _CREDIT_MASK)
        self._credits_owed -= n
        return n

    async def send(self, data: Any, *, wait_ack: bool = False) -> None:
        """Send a message (bytes-like or registered memory) of any size.

        The peer's :meth:`recv` returns it whole. Like a socket write, this
        returns once the message is handed to the device (copied into
        registered send buffers: ``data`` may be reused at once); with
        ``wait_ack=True`` it returns only when the peer's NIC acknowledged
        every chunk. A delivery failure fails the connection, so later calls
        (and :meth:`close`, which waits for outstanding sends) raise it.
        Credit flow control bounds what is in flight. Cancelling the caller
        does not cut a message in half: the remaining chunks are still sent.
        """
        if self._error is not None or self._closing or self._closed:
            self._check_usable()
        if type(data) is bytes:  # the common case: no memoryview needed to copy it
            mv: Any = data
            n = len(data)
        else:
            if isinstance(data, _LOCAL):
                data = data.view
            mv = memoryview(data).cast("B")
            n = mv.nbytes
        chunk = self._chunk_size
        if not chunk:
            raise RDMAError("the peer accepts no messages (it posted no receive buffers)")
        free = self._send_free
        if n <= chunk and self._credits >= 2 and self._sq_free > 0 and not self._send_busy and free:
            # fast path: one chunk and everything it needs is free now, so it is
            # posted before we yield (atomic w.r.t. other messages; the completion
            # releases the slot, so cancelling the await below is safe)
            slot = free.pop()
            self._credits -= 1
            self._sq_free -= 1
            if n:
                self._send_views[slot][:n] = mv
                sges = [SGE(self._send_addrs[slot], n, self._send_lkey)]
            else:
                sges = []
            wr = SendWR(0, _SEND_WITH_IMM, sges, imm_data=_IMM_LAST | self._take_owed())
            op = self._send_ops[slot]  # the slot's reusable op: its release frees the slot
            op.nbytes = n
            fut = op.fut = self.loop.create_future() if wait_ack else None
            self._post_op(wr, op)
            if fut is not None:
                await fut
            return
        if type(mv) is bytes:
            mv = memoryview(mv)
        task = self.loop.create_task(self._send_message(mv, wait_ack=wait_ack))
        await asyncio.shield(task)

    async def _send_message(self, mv: memoryview, kind_last: int = _K_LAST, wait_ack: bool = True) -> None:
        async with self._send_lock:
            self._send_busy = True
            try:
                pool = self._send_pool
                assert pool is not None
                chunk = self._chunk_size
                n = mv.nbytes
                futs = []
                off = 0
                while True:
                    piece = mv[off : off + chunk]
                    last = off + chunk >= n
                    await self._take_credit(data=True)
                    slot = await pool.acquire()
                    plen = piece.nbytes
                    self._send_views[slot][:plen] = piece
                    await self._sq_slot()
                    imm = ((kind_last if last else _K_MORE) << 30) | self._take_owed()
                    sges = [SGE(self._send_addrs[slot], plen, self._send_lkey)] if plen else []
                    wr = SendWR(0, _SEND_WITH_IMM, sges, imm_data=imm)
                    fut = self._post_nowait(
                        wr, self._send_releases[slot], lambda plen=plen: f"SEND of a {plen}-byte chunk", wait_ack
                    )
                    if fut is not None:
                        futs.append(fut)
                    off += chunk
                    if last:
                        break
            finally:
                self._send_busy = False
        if futs:
            await asyncio.gather(*futs)

    async def _send_control(self, msg: dict[str, Any]) -> None:
        await self._send_message(memoryview(msgpack.packb(msg, use_bin_type=True)), kind_last=_K_CONTROL)

    async def recv(self) -> bytes:
        """The next message from the peer. Raises :class:`ConnectionClosedError`
        once the peer closed and every message sent before was returned."""
        inbox = self._messages
        if inbox.items:
            item = inbox.items.popleft()
        else:
            if self._error is not None or self._closed:
                self._check_usable_for_recv()
            item = await inbox.get()
        if isinstance(item, BaseException):
            inbox.put(item)  # every later recv() fails the same way
            raise item
        return item

    def _check_usable_for_recv(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ConnectionClosedError("the connection is closed")

    async def recv_immediate(self) -> Immediate:
        """The next Write-with-immediate notification from the peer."""
        inbox = self._immediates
        if inbox.items:
            item = inbox.items.popleft()
        else:
            self._check_usable_for_recv()
            item = await inbox.get()
        if isinstance(item, BaseException):
            inbox.put(item)
            raise item
        return item

    def __aiter__(self) -> Connection:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.recv()
        except ConnectionClosedError:
            raise StopAsyncIteration from None

    async def advertise(self, region: Region | RegionSlice | RemoteBuffer, name: str) -> RemoteBuffer:
        """Expose ``region`` to the peer under ``name`` after connecting
        (the peer sees it in ``remote_buffers`` / :meth:`wait_remote`)."""
        rb = region if isinstance(region, RemoteBuffer) else region.remote()
        await self._send_control({"op": "advertise", "name": name, "buf": rb.to_wire()})
        return rb

    # ---------------------------------------------------- completions ----
    def _on_completion(self, wc: WorkCompletion) -> None:
        wr_id = wc.wr_id
        if wr_id & _RECV_TAG:
            self._on_recv(wc, wr_id ^ _RECV_TAG)
            return
        op = self._pending.pop(wr_id, None)
        if op is None:
            return
        if self._sq_waiters:
            self._sq_release()
        else:  # _sq_release() when nobody waits for a slot
            self._sq_free += 1
        status = wc.status
        members = op.members
        if members is not None:
            members.discard(wr_id)
            if status == _WC_SUCCESS:
                # the signaled last of a chain: every write before it is done
                for m in members:
                    if self._pending.pop(m, None) is not None:
                        self._sq_release()
                members.clear()
            else:
                # the queue pair ran the chain in order: the members before the one
                # that failed completed (unsignaled, so silently)
                for m in [m for m in members if m < wr_id]:
                    members.discard(m)
                    if self._pending.pop(m, None) is not None:
                        self._sq_release()
                if members:
                    # fail the caller now; free the buffers once the rest is flushed
                    if op.fut is not None and not op.fut.done():
                        self._fail_op(op, wc)
                    return
        fut = op.fut
        if fut is None and self._drain_waiters:
            waiters, self._drain_waiters = self._drain_waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)
        release = op.release
        if release is not None:
            try:
                release()
            except Exception:  # pragma: no cover
                log.exception("releasing a buffer failed")
        if status == _WC_SUCCESS:
            if fut is not None and not fut.done():
                fut.set_result(wc)
            if self._credits_owed >= self._credit_threshold:
                # credits that came due while a credit update was in flight (or the
                # send queue was full) are returned now: otherwise a peer blocked on
                # credits and this side, with nothing more to send, wait forever
                self._maybe_return_credits()
            return
        exc = self._fail_op(op, wc)
        if self._error is None:
            # a flush while nothing of ours failed the connection: the QP went to
            # IBV_QPS_ERR under us (e.g. the responder refused a request), and every
            # later operation would be flushed too
            reason = getattr(self.qp, "error_reason", None)
            msg = f"queue pair 0x{self.qp.qp_num:06x} went to IBV_QPS_ERR after {exc}"
            if reason:
                msg += f" ({reason})"
            self._fail(ConnectionLostError(msg, cause=exc))

    def _fail_op(self, op: _Op, wc: WorkCompletion) -> BaseException:
        """The error a failed work completion means for ``op``, set on its future."""
        status = WCStatus(wc.status) if wc.status in WCStatus._value2member_map_ else wc.status
        exc: BaseException
        if status == WCStatus.IBV_WC_WR_FLUSH_ERR and self._error is not None:
            exc = self._error
        else:
            name = getattr(status, "name", str(status))
            what = op.describe() if callable(op.describe) else op.describe
            exc = error_for_status(wc.status)(f"{name}: {what}: {_EXPLAIN.get(status, 'failed')}", wc)
        if op.fut is not None and not op.fut.done():
            op.fut.set_exception(exc)
            op.fut.add_done_callback(_consume_exception)
        return exc

    def _on_recv(self, wc: WorkCompletion, slot: int) -> None:
        if wc.status != _WC_SUCCESS:
            if self._error is None:
                # our own close/abort fails the connection before it flushes the QP,
                # so a flushed receive here means the QP went to IBV_QPS_ERR under us:
                # on the responder side (a request it refused, e.g. a forged or bad
                # rkey) nothing else tells the application
                name = getattr(wc.status, "name", str(wc.status))
                exc = error_for_status(wc.status)(f"{name}: receive failed", wc)
                reason = getattr(self.qp, "error_reason", None)
                msg = f"queue pair 0x{self.qp.qp_num:06x} went to IBV_QPS_ERR: {exc}"
                if reason:
                    msg += f" ({reason})"
                self._fail(ConnectionLostError(msg, cause=exc))
            return
        nbytes = wc.byte_len
        imm = wc.imm_data or 0
        if wc.opcode == _WC_RECV_RDMA_WITH_IMM:
            self._repost(slot)
            handler = self._on_immediate
            if handler is None or not handler(imm, nbytes):
                self._immediates.put(Immediate(imm, nbytes))
            if self._credits_owed >= self._credit_threshold:
                self._maybe_return_credits()
            return
        kind = imm >> 30
        returned = imm & _CREDIT_MASK
        data = bytes(self._recv_views[slot][:nbytes]) if nbytes else b""
        self._repost(slot)
        if returned:
            self._credits += returned
            if self._credit_waiters:
                self._wake_credit_waiters()
        if kind == _K_LAST:
            if self._assembly:
                self._assembly.append(data)
                data = b"".join(self._assembly)
                self._assembly = []
            self._messages.put(data)
        elif kind == _K_MORE:
            self._assembly.append(data)
        elif kind == _K_CONTROL:
            if self._assembly:
                self._assembly.append(data)
                data = b"".join(self._assembly)
                self._assembly = []
            self._handle_control(data)
        elif kind == _K_CREDIT and data and self._on_credit_payload is not None:
            self._on_credit_payload(data)
        if self._credits_owed >= self._credit_threshold:  # what _maybe_return_credits() checks first
            self._maybe_return_credits()

    def _repost(self, slot: int) -> None:
        if self._closed or self._error is not None:  # (no ibv_query_qp per message)
            return
        try:
            self.qp.post_recv(self._recv_wrs[slot])
        except RDMAError as e:
            log.debug("repost failed: %s", e)
            return
        self._credits_owed += 1

    def _maybe_return_credits(self, payload: bytes = b"", force: bool = False) -> None:
        """Send a credit update when enough credits are owed and no message is going out."""
        if self._error is not None or self._closed:
            return
        if not force and self._credits_owed < self._credit_threshold:
            return
        if self._credit_msg_inflight or self._credits < 1 or self._sq_free <= 0:
            return
        self._credits -= 1
        self._sq_free -= 1
        self._credit_msg_inflight = True
        imm = (_K_CREDIT << 30) | self._take_owed()
        sges: list[SGE] = []
        release = None
        if payload:
            pool = self._send_pool
            slot = pool.try_acquire() if pool is not None else None
            if slot is None:
                self._credits += 1
                self._sq_free += 1
                self._credit_msg_inflight = False
                return
            pool.view(slot, len(payload))[:] = payload  # type: ignore[union-attr]
            sges = [pool.sge(slot, len(payload))]  # type: ignore[union-attr]
            release = lambda: pool.release(slot)  # type: ignore[union-attr]

        def done() -> None:
            self._credit_msg_inflight = False
            if release is not None:
                release()

        try:
            self._post_nowait(
                SendWR(0, WROpcode.IBV_WR_SEND_WITH_IMM, sges, imm_data=imm), done, "credit update", False
            )
        except RDMAError as e:
            self._credit_msg_inflight = False
            log.debug("credit update failed: %s", e)

    def _handle_control(self, data: bytes) -> None:
        try:
            msg = msgpack.unpackb(data, raw=False)
        except Exception:
            log.warning("peer sent a malformed control message")
            return
        if not isinstance(msg, dict):
            return
        if msg.get("op") == "advertise" and isinstance(msg.get("name"), str):
            try:
                rb = RemoteBuffer.from_wire(msg.get("buf"), msg["name"])
            except ValueError:
                log.warning("peer advertised an invalid buffer")
                return
            self.remote_buffers[rb.name] = rb  # type: ignore[index]
            for fut in self._remote_waiters.pop(rb.name, []):  # type: ignore[arg-type]
                if not fut.done():
                    fut.set_result(rb)
            return
        if self._on_control is not None:
            self._on_control(msg)

    # -------------------------------------------------------- closing ----
    def _fail(self, exc: BaseException, graceful: bool = False) -> None:
        """The connection is over: every pending and future operation fails with ``exc``."""
        if self._error is not None:
            return
        self._error = exc
        for op in list(self._pending.values()):
            if op.fut is not None and not op.fut.done():
                op.fut.set_exception(exc)
                op.fut.add_done_callback(_consume_exception)
        self._messages.put(exc)
        self._immediates.put(exc)
        self._wake_credit_waiters()
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_result(None)
        for fut in self._sq_waiters:
            if not fut.done():
                fut.set_result(None)
        for waiters in self._remote_waiters.values():
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(exc)
                    fut.add_done_callback(_consume_exception)
        self._remote_waiters.clear()
        if self._on_control is not None:
            try:
                self._on_control({"op": "_lost", "error": exc})
            except Exception:
                pass
        if not self._closing:
            self.loop.call_soon(self._teardown)

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until every message sent so far was acknowledged by the peer's NIC."""
        self._check_usable()
        await self._drain_unawaited(timeout)
        if self._error is not None:
            raise self._error

    async def _drain_unawaited(self, timeout: float | None) -> None:
        deadline = None if timeout is None else self.loop.time() + timeout
        while self._error is None and any(
            op.fut is None and op.describe != "credit update" for op in self._pending.values()
        ):
            if deadline is not None and self.loop.time() >= deadline:
                return
            fut = self.loop.create_future()
            self._drain_waiters.append(fut)
            try:
                await asyncio.wait_for(fut, None if deadline is None else max(0.0, deadline - self.loop.time()))
            except TimeoutError:
                return
            finally:
                if fut in self._drain_waiters:
                    self._drain_waiters.remove(fut)

    async def close(self, timeout: float = 5.0) -> None:
        """Wait for outstanding operations (up to ``timeout`` s), tell the peer, release everything."""
        if self._closed or self._closing:
            return
        self._closing = True
        try:
            pending = [op.fut for op in self._pending.values() if op.fut is not None and not op.fut.done()]
            if pending and self._error is None:
                await asyncio.wait(pending, timeout=timeout)
            await self._drain_unawaited(timeout)
            if self._channel is not None and self._error is None:
                try:
                    await asyncio.wait_for(self._channel.send({"t": "bye"}), 1.0)
                except Exception:
                    pass
        finally:
            self._fail(ConnectionClosedError("the connection was closed locally"))
            self._teardown()

    def abort(self) -> None:
        """Close at once: pending operations fail, the QP is destroyed, no goodbye."""
        if self._closed:
            return
        self._closing = True
        self._fail(ConnectionClosedError("the connection was aborted locally"))
        self._teardown()

    def _teardown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._monitor is not None and self._monitor is not asyncio.current_task():
            self._monitor.cancel()
        if self._channel is not None:
            self._channel.close()
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
        for op in list(self._pending.values()):
            if op.release is not None:
                try:
                    op.release()
                except Exception:
                    pass
        self._pending.clear()
        for closer in (self.cq.close, self.channel.close, self._recv_pool.close, self._scratch.close):
            try:
                closer()
            except Exception:
                pass
        if self._send_pool is not None:
            self._send_pool.close()

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("lost" if self._error else "open")
        peer = f" peer_qpn=0x{self.peer.qpn:06x}" if self.peer else ""
        return f"<Connection qpn=0x{self.qp.qp_num:06x}{peer} {self.device.provider}:{self.device.name} {state}>"


def _consume_exception(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


# ------------------------------------------------------------ rendezvous ----


async def connect(
    host: str,
    port: int = DEFAULT_PORT,
    *,
    provider: str | None = None,
    device: DeviceContext | None = None,
    expose: Mapping[str, Region | RegionSlice | RemoteBuffer] | None = None,
    token: str | bytes | None = None,
    timeout: float = 10.0,
    _stream_ring_factory: Callable[[Connection], RemoteBuffer] | None = None,
    **options: Any,
) -> Connection:
    """Connect to an aiordma server: TCP rendezvous at ``host:port``, then an
    RC queue pair between the two devices.

    ``expose`` names the local regions the server may reach with one-sided
    operations; the server's exposed buffers are in ``conn.remote_buffers``.
    ``token`` (or ``$AIORDMA_TOKEN``) enables HMAC authentication. Other
    keyword options go to :class:`Connection` (``progress``, ``spin_us``,
    ``recv_buffers``, ``recv_buffer_size``, ``ack_timeout``, ``retry_cnt``,
    ``gid_index``).
    """
    secret = rdv.token_from_env(token)
    device = device or get_device(provider)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except TimeoutError:
        raise rdv.HandshakeTimeoutError(f"TCP connect to {host}:{port} timed out after {timeout} s") from None
    except OSError as e:
        raise RendezvousError(f"cannot reach the aiordma server at {host}:{port}: {e.strerror or e}") from e
    ch = rdv.Channel(reader, writer)
    conn: Connection | None = None
    try:

        async def handshake() -> Connection:
            nonlocal conn
            caps = await rdv.client_hello(ch, secret)
            conn = Connection(device, **options)
            conn.capabilities = caps
            ring = _stream_ring_factory(conn) if _stream_ring_factory is not None else None
            local = conn.local_endpoint(expose, stream_ring=ring)
            await ch.send(local.to_wire())
            peer = rdv.Endpoint.from_wire(await ch.expect("endpoint"))
            conn._connect_qp(peer)
            await ch.send({"t": "ready"})
            return conn

        conn = await rdv.with_timeout(handshake(), timeout, f"rendezvous with {host}:{port}")
    except BaseException:
        ch.close()
        if conn is not None:
            conn.abort()
        raise
    conn._start_monitor(ch)
    return conn


class Server:
    """An aiordma server: accepts rendezvous connections and runs
    ``handler(conn)`` for each. Use as ``async with``, like asyncio's servers."""

    def __init__(self, handler: Callable[[Connection], Awaitable[Any]], **config: Any) -> None:
        self._handler = handler
        self._config = config
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self.connections: set[Connection] = set()
        self.refused = 0
        self.accepted = 0
        self.last_error: BaseException | None = None

    @property
    def sockets(self) -> tuple:
        return tuple(self._server.sockets) if self._server else ()

    @property
    def port(self) -> int:
        """The TCP port the rendezvous listens on."""
        return self.sockets[0].getsockname()[1]

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ch = rdv.Channel(reader, writer)
        cfg = self._config
        conn: Connection | None = None
        try:

            async def handshake() -> Connection:
                nonlocal conn
                caps = await rdv.server_hello(ch, cfg["token"])
                peer = rdv.Endpoint.from_wire(await ch.expect("endpoint"))
                conn = Connection(cfg["device"], **cfg["options"])
                conn.capabilities = caps
                conn._connect_qp(peer)
                factory = cfg.get("stream_ring_factory")
                ring = factory(conn) if factory is not None else None
                await ch.send(conn.local_endpoint(cfg["expose"], stream_ring=ring).to_wire())
                await ch.expect("ready")
                return conn

            conn = await rdv.with_timeout(handshake(), cfg["handshake_timeout"], f"rendezvous with {ch.peername}")
        except (RDMAError, OSError, ValueError) as e:
            self.refused += 1
            self.last_error = e
            log.info("aiordma server: refused %s: %s", ch.peername, e)
            if not isinstance(e, (rdv.AuthenticationError, rdv.ProtocolVersionError)):
                await ch.fail("refused", str(e))
            ch.close()
            if conn is not None:
                conn.abort()
            return
        except asyncio.CancelledError:
            ch.close()
            if conn is not None:
                conn.abort()
            raise
        self.accepted += 1
        conn._start_monitor(ch)
        self.connections.add(conn)
        try:
            await self._handler(conn)
        except ConnectionLostError as e:
            log.info("aiordma server: connection %r ended: %s", conn, e)
        except Exception:
            log.exception("aiordma server: handler failed for %r", conn)
        finally:
            self.connections.discard(conn)
            await conn.close()

    def _spawn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(self._on_client(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self, host: str | None, port: int) -> None:
        self._server = await asyncio.start_server(self._spawn, host, port)

    async def serve_forever(self) -> None:
        assert self._server is not None
        await self._server.serve_forever()

    def close(self) -> None:
        """Stop accepting; live connections are aborted."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.abort()
        for t in list(self._tasks):
            t.cancel()

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_closed()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await self.wait_closed()


async def start_server(
    handler: Callable[[Connection], Awaitable[Any]],
    host: str | None = None,
    port: int = DEFAULT_PORT,
    *,
    provider: str | None = None,
    device: DeviceContext | None = None,
    expose: Mapping[str, Region | RegionSlice | RemoteBuffer] | None = None,
    token: str | bytes | None = None,
    handshake_timeout: float = 10.0,
    _stream_ring_factory: Callable[[Connection], RemoteBuffer] | None = None,
    **options: Any,
) -> Server:
    """Start an aiordma server on ``host:port`` (TCP rendezvous); each client
    gets its own :class:`Connection`, passed to ``handler``. The connection is
    closed when ``handler`` returns. ``expose`` is offered to every client."""
    device = device or get_device(provider)
    server = Server(
        handler,
        device=device,
        expose=expose,
        token=rdv.token_from_env(token),
        handshake_timeout=handshake_timeout,
        stream_ring_factory=_stream_ring_factory,
        options=options,
    )
    await server.start(host, port)
    return server
