"""Byte streams over RDMA, in the spirit of rsockets, with asyncio's stream API.

::

    reader, writer = await aiordma.open_connection("10.0.0.2", 18515)
    writer.write(b"hello\\n")
    await writer.drain()
    line = await reader.readline()
    writer.close()
    await writer.wait_closed()

    # handle(reader, writer); beyond loopback a server needs a token (aiordma.security)
    server = await aiordma.start_stream_server(handle, "0.0.0.0", 18515, token=secret)

How the bytes move
------------------
Each side registers a **receive ring** (``ring_size`` bytes, 1 MiB by
default, ``REMOTE_WRITE``) and gives it to the peer at the rendezvous
(``Endpoint.stream_ring``). A writer keeps a local **staging ring** of the
same size as the peer's ring: ``write()`` appends to a Python buffer, and one
pump task per stream copies bytes into the staging ring and posts
``RDMA_WRITE_WITH_IMM`` into the peer's ring at the same offset (the running
byte count modulo the ring size; a write that would cross the end of the
ring is split in two). The 32-bit immediate is the number of bytes; their
position is implied, because the reliable connection delivers writes in
order. Each write also spends one of the connection's message credits (the
peer's receive completion needs a posted receive), so streams never meet
an RNR NAK.

The reader's handler of :class:`~aiordma.events.ImmediateReceived` only advances the ring's tail; bytes stay
in the ring until the application reads them (``read(n)`` copies them out;
a ``readexactly``/``readuntil`` that has to wait first moves what arrived into
a read buffer, so lines and exact reads may be longer than the ring).
Freed ring space goes back to the writer as **ring credits**: the total
number of bytes consumed so far (a 64-bit running count, so duplicated or
late updates are harmless), sent in a ``stream_credit`` control message
(:meth:`~aiordma.Connection.send_control`) once a quarter of the ring was
consumed. The writer may have at most one ring of
bytes outstanding, so the peer's ring can never overflow, and a reader that
does not read stops the writer: ``drain()`` then blocks once the writer's own
buffer passes the high-water mark (64 KiB by default).

Shutdown follows rsockets: ``write_eof()`` sends a ``stream_eof`` control
message after the last data write (RC keeps the order), the other direction
keeps working (half-close). ``close()`` flushes, sends EOF, waits until every
write was acknowledged and then closes the RDMA connection (the peer reads
what it received, then EOF). If the connection breaks, ``write()`` and
``drain()`` raise :class:`~aiordma.ConnectionLostError`; the reader returns
the bytes that already arrived and then raises it (or returns EOF if the
peer had sent one).

As with asyncio's streams, reading after ``writer.close()`` returns EOF
(``b""``; ``readexactly`` raises ``IncompleteReadError``). Misuse fails
loudly, as in trio's stream conformance checks: writing after ``close()``
raises :class:`~aiordma.ConnectionClosedError`, writing after
``write_eof()`` raises ``RuntimeError``, and two coroutines waiting to read
at once raise ``RuntimeError`` (as asyncio does). A cancelled read consumes
nothing.

The stream is its connection's event handler
(:meth:`~aiordma.Connection.set_event_handler`;
``writer.get_extra_info("connection")`` is still usable for one-sided
operations). It needs ``recv_buffers >= 4``: with
fewer, the connection's credit updates can answer each other forever and
never leave the two message credits a data write needs.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from .connection import Connection
from .errors import ConnectionClosedError, ConnectionLostError, RDMAError, fresh, stored
from .events import ConnectionEvent, ConnectionLost, ControlReceived, ImmediateReceived
from .handshake import connect
from .memory import Region, RemoteBuffer
from .providers.base import Access, WorkCompletion
from .rendezvous import DEFAULT_PORT
from .server import Server, start_server

log = logging.getLogger("aiordma.stream")

__all__ = ["RDMAStreamReader", "RDMAStreamWriter", "open_connection", "start_stream_server"]

#: receive ring size each side registers and offers to the peer
DEFAULT_RING_SIZE = 1 << 20
#: asyncio's StreamReader limit (readline/readuntil)
DEFAULT_LIMIT = 1 << 16
#: asyncio transports' default write-buffer high-water mark
DEFAULT_HIGH_WATER = 64 * 1024
#: largest single RDMA write the pump posts
MAX_WRITE = 256 * 1024
_MIN_RING = 4096
_MAX_RING = 1 << 30  # the immediate (32 bits) carries a write's length
_MIN_RECV_BUFFERS = 4

_streams: weakref.WeakKeyDictionary[Connection, _RDMAStream] = weakref.WeakKeyDictionary()


class _RDMAStream:
    """One byte stream over one :class:`Connection` (both directions).

    This is what ``writer.transport`` returns. Reader and writer are thin
    views of it.
    """

    def __init__(
        self,
        conn: Connection,
        *,
        ring_size: int = DEFAULT_RING_SIZE,
        limit: int = DEFAULT_LIMIT,
        write_buffer_high: int | None = None,
        write_buffer_low: int | None = None,
        close_timeout: float | None = 30.0,
    ) -> None:
        if not _MIN_RING <= ring_size <= _MAX_RING:
            raise ValueError(f"ring_size must be between {_MIN_RING} bytes and 1 GiB")
        if limit <= 0:
            raise ValueError("limit must be positive")
        self.conn = conn
        self.loop = conn.loop
        self.close_timeout = close_timeout
        self._limit = limit
        # receive side: the ring the peer writes into
        self._ring_buf = bytearray(ring_size)
        self._ring = conn.register(self._ring_buf, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        self._ring_mv = memoryview(self._ring_buf)
        self._rx_size = ring_size
        self._rx_tail = 0  # bytes arrived (absolute)
        self._rx_head = 0  # bytes taken out of the ring (absolute)
        self._rx_returned = 0  # ring credits given back to the writer (absolute)
        self._rx_batch = max(1, ring_size // 4)
        self._rx_buf = bytearray()  # bytes taken out of the ring, not yet returned to the application
        self._rx_eof = False
        self._rx_waiter: asyncio.Future[None] | None = None
        self._credit_task: asyncio.Task[None] | None = None
        # send side: staging ring (allocated once the peer's ring is known)
        self._peer_ring: RemoteBuffer | None = None
        self._stage: Region | None = None
        self._stage_buf: bytearray | None = None
        self._stage_mv: memoryview | None = None
        self._max_write = 0
        self._tx_size = 0
        self._wbuf = bytearray()
        self._tx_sent = 0  # bytes handed to RDMA writes (absolute)
        self._tx_completed = 0  # bytes whose write completed (staging space free again)
        self._tx_peer_consumed = 0  # bytes the peer's reader freed (ring credits)
        self._eof_requested = False
        self._eof_sent = False
        self._pump_task: asyncio.Task[None] | None = None
        self._pump_waiter: asyncio.Future[None] | None = None
        self._tx_waiters: list[asyncio.Future[None]] = []
        self._paused = False
        self._high = 0
        self._low = 0
        self.set_write_buffer_limits(write_buffer_high, write_buffer_low)
        # lifecycle
        self._error: BaseException | None = None  # the connection is gone
        self._closing = False  # close()/abort() was called locally
        self._close_task: asyncio.Task[None] | None = None
        self._finalize_task: asyncio.Task[None] | None = None
        self._closed_fut: asyncio.Future[None] = self.loop.create_future()
        self.reader = RDMAStreamReader(self)
        self.writer = RDMAStreamWriter(self, self.reader)
        conn.set_event_handler(self._on_event)

    # ------------------------------------------------------------ set-up --
    @property
    def local_ring(self) -> RemoteBuffer:
        return self._ring.remote()

    def start(self) -> None:
        """The connection is up: allocate the staging ring, start the pump."""
        if self._error is not None:
            return  # lost before the application got it: reads and writes report the error
        peer = self.conn.peer
        ring = peer.stream_ring if peer is not None else None
        if ring is None:
            raise RDMAError("the peer offered no stream ring: it is not an aiordma stream endpoint")
        if not _MIN_RING <= ring.length <= _MAX_RING:
            raise RDMAError(f"the peer's stream ring has an unusable size ({ring.length} bytes)")
        self._peer_ring = ring
        self._tx_size = ring.length
        self._stage_buf = bytearray(ring.length)
        self._stage = self.conn.register(self._stage_buf, Access.LOCAL_WRITE)
        self._stage_mv = memoryview(self._stage_buf)
        self._max_write = min(MAX_WRITE, max(1, ring.length // 4))
        self._pump_task = self.loop.create_task(self._pump_main())

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """Like asyncio transports: ``drain()`` blocks once more than ``high``
        bytes wait to be written, until they are down to ``low``."""
        if high is None:
            high = DEFAULT_HIGH_WATER if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low
        self._update_paused()

    def get_write_buffer_size(self) -> int:
        return len(self._wbuf)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (self._low, self._high)

    # -------------------------------------------------- connection events --
    def _on_event(self, event: ConnectionEvent) -> bool:
        if isinstance(event, ImmediateReceived):
            return self._on_immediate(event.value, event.length)
        if isinstance(event, ControlReceived):
            self._on_control(event.message)
        elif isinstance(event, ConnectionLost):
            self._on_lost(event.error)
        return True

    def _on_immediate(self, imm: int, nbytes: int) -> bool:
        """An RDMA_WRITE_WITH_IMM landed in our ring: ``imm`` bytes at the tail."""
        n = imm
        if n <= 0 or self._rx_tail + n - self._rx_head > self._rx_size:
            free = self._rx_size - (self._rx_tail - self._rx_head)
            self._protocol_error(f"the peer wrote {n} bytes into a ring with {free} free")
            return True
        self._rx_tail += n
        if self._closing:
            # nobody will read: discard, and keep the peer's writer moving until the connection closes
            self._rx_take_ring(n)
            return True
        self._wake_reader()
        return True

    def _on_control(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "stream_credit":
            consumed = msg.get("consumed")
            if isinstance(consumed, int) and not isinstance(consumed, bool):
                self._peer_credit(consumed)
        elif op == "stream_eof":
            written = msg.get("written")
            if written != self._rx_tail:
                log.warning("stream EOF after %s bytes, but %d arrived", written, self._rx_tail)
            self._rx_eof = True
            self._wake_reader()

    def _peer_credit(self, consumed: int) -> None:
        if consumed > self._tx_sent:
            self._protocol_error(f"the peer returned ring credit for {consumed} bytes, only {self._tx_sent} were sent")
            return
        if consumed > self._tx_peer_consumed:
            self._tx_peer_consumed = consumed
            self._wake_pump()

    def _protocol_error(self, what: str) -> None:
        log.error("aiordma stream protocol error: %s", what)
        if self._error is None:
            self.conn.abort(ConnectionLostError(f"stream protocol error: {what}"))

    def _on_lost(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = stored(exc)
        self._wake_reader()
        self._wake_pump()
        self._wake_tx()
        if self._finalize_task is None:
            self._finalize_task = self.loop.create_task(self._finalize())

    async def _finalize(self) -> None:
        """After the connection's teardown (the QP is gone): deregister our memory.
        The bytearrays stay, so bytes that arrived can still be read."""
        await self.conn.wait_closed()
        for region in (self._ring, self._stage):
            if region is not None:
                try:
                    region.close()
                except Exception as e:  # pragma: no cover
                    log.debug("deregistering a stream ring: %s", e)
        if not self._closed_fut.done():
            self._closed_fut.set_result(None)

    # ----------------------------------------------------------- receive --
    def _wake_reader(self) -> None:
        w = self._rx_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _rx_available(self) -> int:
        return len(self._rx_buf) + self._rx_tail - self._rx_head

    def _rx_copy_ring(self, out: bytearray, n: int) -> None:
        """Append ``n`` bytes from the ring's head to ``out`` and free them."""
        pos = self._rx_head % self._rx_size
        first = min(n, self._rx_size - pos)
        out += self._ring_mv[pos : pos + first]
        if first < n:
            out += self._ring_mv[: n - first]
        self._rx_take_ring(n)

    def _rx_take_ring(self, n: int) -> None:
        self._rx_head += n
        if self._rx_head - self._rx_returned >= self._rx_batch:
            self._return_credit()

    def _rx_pull(self) -> None:
        """Move everything that arrived from the ring into the read buffer,
        so the writer may go on (lines and exact reads can exceed the ring)."""
        n = self._rx_tail - self._rx_head
        if n:
            self._rx_copy_ring(self._rx_buf, n)

    def _rx_take(self, n: int) -> bytes:
        """Take ``n`` (<= available) bytes for the application."""
        buf = self._rx_buf
        if not buf:
            pos = self._rx_head % self._rx_size
            if pos + n <= self._rx_size:  # one copy, straight from the ring
                data = bytes(self._ring_mv[pos : pos + n])
                self._rx_take_ring(n)
                return data
            out = bytearray()
            self._rx_copy_ring(out, n)
            return bytes(out)
        if len(buf) < n:
            self._rx_copy_ring(buf, n - len(buf))
        data = bytes(buf[:n])
        del buf[:n]
        return data

    def _return_credit(self) -> None:
        """Tell the writer how much of our ring is free again."""
        if self._error is not None or self.conn.is_closing():
            return
        if self._credit_task is None or self._credit_task.done():
            self._credit_task = self.loop.create_task(self._credit_main())

    async def _credit_main(self) -> None:
        try:
            while self._error is None and self._rx_head - self._rx_returned >= self._rx_batch:
                target = self._rx_head
                await self.conn.send_control({"op": "stream_credit", "consumed": target})
                self._rx_returned = max(self._rx_returned, target)
        except RDMAError as e:
            log.debug("stream credit update failed: %s", e)

    def _rx_raise_if_broken(self) -> None:
        """No more bytes will come and the stream did not end with EOF."""
        if self._error is not None and not self._rx_eof:
            raise fresh(self._error)

    async def _rx_wait(self, func: str) -> None:
        if self._rx_waiter is not None:
            raise RuntimeError(f"{func}() called while another coroutine is already waiting for incoming data")
        self._rx_waiter = fut = self.loop.create_future()
        try:
            await fut
        finally:
            self._rx_waiter = None

    # -------------------------------------------------------------- send --
    def _wake_pump(self) -> None:
        w = self._pump_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _wake_tx(self) -> None:
        waiters, self._tx_waiters = self._tx_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def _tx_wait(self) -> None:
        fut = self.loop.create_future()
        self._tx_waiters.append(fut)
        try:
            await fut
        finally:
            if fut in self._tx_waiters:
                self._tx_waiters.remove(fut)

    def _update_paused(self) -> None:
        size = len(self._wbuf)
        if size > self._high:
            self._paused = True
        elif self._paused and size <= self._low:
            self._paused = False
            self._wake_tx()

    def _check_writable(self) -> None:
        if self._closing:
            raise ConnectionClosedError("the stream writer is closed")
        if self._error is not None:
            raise fresh(self._error)
        if self._eof_requested:
            raise RuntimeError("cannot write after write_eof()")

    def write(self, data: Any) -> None:
        if isinstance(data, str):
            raise TypeError("data must be bytes-like, not str")
        self._check_writable()
        with memoryview(data) as mv:
            if not mv.nbytes:
                return
            self._wbuf += mv if mv.c_contiguous else mv.tobytes()
        self._update_paused()
        self._wake_pump()

    def _on_write_done(self, n: int, fut: asyncio.Future[WorkCompletion]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return  # the connection failed: the ConnectionLost event says so
        self._tx_completed += n
        self._wake_pump()
        self._wake_tx()

    def _tx_credit(self) -> int:
        return self._tx_size - (self._tx_sent - min(self._tx_peer_consumed, self._tx_completed))

    async def _pump_main(self) -> None:
        """Move written bytes into the peer's ring, in order; then send EOF."""
        conn = self.conn
        ring = self._peer_ring
        stage = self._stage
        assert ring is not None and stage is not None and self._stage_mv is not None
        size = self._tx_size
        try:
            while self._error is None:
                n = 0
                pos = self._tx_sent % size
                if self._wbuf:
                    n = min(len(self._wbuf), self._tx_credit(), size - pos, self._max_write)
                if n > 0:
                    with memoryview(self._wbuf) as src:
                        self._stage_mv[pos : pos + n] = src[:n]
                    del self._wbuf[:n]
                    self._tx_sent += n
                    self._update_paused()
                    # waits for a message credit (the peer's receive completion) and a
                    # send-queue slot; the staging bytes stay put until the completion
                    done = await conn.post_write(stage[pos : pos + n], ring.at(pos, n), imm=n)
                    done.add_done_callback(functools.partial(self._on_write_done, n))
                    continue
                if self._eof_requested and not self._wbuf:
                    if not self._eof_sent:
                        await conn.send_control({"op": "stream_eof", "written": self._tx_sent})
                        self._eof_sent = True
                        self._wake_tx()
                    return
                self._pump_waiter = self.loop.create_future()
                try:
                    await self._pump_waiter
                finally:
                    self._pump_waiter = None
        except RDMAError as e:
            if self._error is None:
                # e.g. post_send refused: the stream cannot go on
                log.debug("stream pump stopped: %s", e)
                if not isinstance(e, ConnectionLostError):
                    e = ConnectionLostError(f"stream send failed: {e}", cause=e)
                self._error = stored(e)
                self._wake_tx()
                self._wake_reader()
                if not conn.is_closing():
                    conn.abort()

    def _flushed(self) -> bool:
        return self._eof_sent and not self._wbuf and self._tx_completed >= self._tx_sent

    async def drain(self) -> None:
        while True:
            if self._closing:
                raise ConnectionClosedError("the stream writer is closed")
            if self._error is not None:
                raise fresh(self._error)
            if not self._paused:
                return
            await self._tx_wait()

    def write_eof(self) -> None:
        if self._closing:
            raise ConnectionClosedError("the stream writer is closed")
        if self._eof_requested:
            return
        if self._error is not None:
            raise fresh(self._error)
        self._eof_requested = True
        self._wake_pump()

    # --------------------------------------------------------- lifecycle --
    def is_closing(self) -> bool:
        return self._closing or self._error is not None

    def close(self) -> None:
        """Flush what was written, send EOF, then close the connection (in a task)."""
        if self._closing:
            return
        self._closing = True
        # discard what arrived and was not read; later arrivals too (see _on_immediate);
        # reads now see EOF, as after closing an asyncio stream
        self._rx_eof = True
        self._rx_buf.clear()
        n = self._rx_tail - self._rx_head
        if n and self._error is None:
            self._rx_take_ring(n)
        self._wake_reader()
        self._wake_tx()  # a pending drain() raises ConnectionClosedError
        self._close_task = self.loop.create_task(self._close_main())

    async def _close_main(self) -> None:
        conn = self.conn
        try:
            if self._error is None and self._pump_task is not None:
                self._eof_requested = True
                self._wake_pump()
                try:
                    async with asyncio.timeout(self.close_timeout):
                        while self._error is None and not self._flushed():
                            await self._tx_wait()
                except TimeoutError:
                    log.warning(
                        "stream close: could not flush to the peer within %s s (is it reading?); aborting",
                        self.close_timeout,
                    )
                    conn.abort()
            await conn.close()
        except asyncio.CancelledError:
            conn.abort()
            raise
        except Exception as e:  # pragma: no cover
            log.debug("stream close: %s", e)
            conn.abort()

    def abort(self) -> None:
        """Close at once: buffered data is dropped, the peer sees the connection lost."""
        self._closing = True
        self._rx_eof = True  # reads now see EOF, as after aborting an asyncio transport
        self._rx_buf.clear()
        self._wbuf.clear()
        self._wake_reader()
        self._wake_tx()
        self.conn.abort()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed_fut)
        tasks = [
            t for t in (self._close_task, self._pump_task, self._credit_task, self._finalize_task) if t is not None
        ]
        if tasks:
            await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        conn = self.conn
        if name == "peername":
            return conn.peer_address if conn.peer_address is not None else default
        if name == "sockname":
            return conn.local_address if conn.local_address is not None else default
        if name in ("connection", "rdma_connection"):
            return conn
        if name == "peer_endpoint":
            return conn.peer if conn.peer is not None else default
        if name == "ring_size":
            return self._rx_size
        if name == "peer_ring_size":
            return self._tx_size or default
        return default

    def __repr__(self) -> str:
        state = "closing" if self._closing else ("lost" if self._error else "open")
        return f"<RDMAStream {state} rx={self._rx_tail} tx={self._tx_sent} on {self.conn!r}>"


class RDMAStreamReader:
    """The receiving half of an RDMA byte stream; the methods of
    :class:`asyncio.StreamReader`."""

    def __init__(self, stream: _RDMAStream) -> None:
        self._s = stream

    @property
    def _limit(self) -> int:
        return self._s._limit

    def exception(self) -> BaseException | None:
        s = self._s
        return None if s._rx_eof else s._error

    def at_eof(self) -> bool:
        """True once the peer sent EOF and every byte before it was read."""
        s = self._s
        return s._rx_eof and not s._rx_available()

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (at least one, unless at EOF: then ``b""``);
        with ``n < 0`` everything until EOF."""
        s = self._s
        if n == 0:
            return b""
        if n < 0:
            while True:
                s._rx_pull()
                if s._rx_eof:
                    break
                s._rx_raise_if_broken()
                await s._rx_wait("read")
            data = bytes(s._rx_buf)
            s._rx_buf.clear()
            return data
        while True:
            avail = s._rx_available()
            if avail:
                return s._rx_take(min(n, avail))
            if s._rx_eof:
                return b""
            s._rx_raise_if_broken()
            await s._rx_wait("read")

    async def readexactly(self, n: int) -> bytes:
        """Exactly ``n`` bytes; :class:`asyncio.IncompleteReadError` if EOF comes first."""
        if n < 0:
            raise ValueError("readexactly size can not be less than zero")
        s = self._s
        if n == 0:
            return b""
        while s._rx_available() < n:
            if s._rx_eof:
                s._rx_pull()
                partial = bytes(s._rx_buf)
                s._rx_buf.clear()
                raise asyncio.IncompleteReadError(partial, n)
            s._rx_raise_if_broken()
            s._rx_pull()  # free the ring: n may exceed it
            await s._rx_wait("readexactly")
        return s._rx_take(n)

    async def readuntil(self, separator: bytes | tuple[bytes, ...] = b"\n") -> bytes:
        """Bytes up to and including ``separator`` (or the first of several).

        At EOF without it: :class:`asyncio.IncompleteReadError` carrying the
        rest. If more than ``limit`` bytes come without it:
        :class:`asyncio.LimitOverrunError` (the bytes stay buffered)."""
        seps = (separator,) if isinstance(separator, (bytes, bytearray, memoryview)) else tuple(separator)
        seps = tuple(bytes(x) for x in seps)
        if not seps or not all(seps):
            raise ValueError("Separator should contain at least one element")
        s = self._s
        maxlen = max(len(x) for x in seps)
        offset = 0
        while True:
            s._rx_pull()
            buf = s._rx_buf
            end = -1
            start = -1
            for sep in seps:
                i = buf.find(sep, offset)
                if i >= 0 and (start < 0 or i < start):
                    start, end = i, i + len(sep)
            if start >= 0:
                if start > self._limit:
                    raise asyncio.LimitOverrunError("Separator is found, but chunk is longer than limit", start)
                chunk = bytes(buf[:end])
                del buf[:end]
                return chunk
            offset = max(0, len(buf) + 1 - maxlen)
            if offset > self._limit:
                raise asyncio.LimitOverrunError("Separator is not found, and chunk exceed the limit", offset)
            if s._rx_eof:
                chunk = bytes(buf)
                buf.clear()
                raise asyncio.IncompleteReadError(chunk, None)
            s._rx_raise_if_broken()
            await s._rx_wait("readuntil")

    async def readline(self) -> bytes:
        """One line including ``b"\\n"``; at EOF the rest (possibly ``b""``).
        ``ValueError`` if a line exceeds the limit (as asyncio)."""
        sep = b"\n"
        try:
            return await self.readuntil(sep)
        except asyncio.IncompleteReadError as e:
            return e.partial
        except asyncio.LimitOverrunError as e:
            buf = self._s._rx_buf
            if buf.startswith(sep, e.consumed):
                del buf[: e.consumed + len(sep)]
            else:
                buf.clear()
            raise ValueError(e.args[0]) from None

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        line = await self.readline()
        if line == b"":
            raise StopAsyncIteration
        return line

    def __repr__(self) -> str:
        s = self._s
        info = [f"{s._rx_available()} bytes"]
        if s._rx_eof:
            info.append("eof")
        if s._rx_waiter is not None:
            info.append("waiting")
        return f"<RDMAStreamReader {' '.join(info)}>"


class RDMAStreamWriter:
    """The sending half of an RDMA byte stream; the methods of
    :class:`asyncio.StreamWriter`."""

    def __init__(self, stream: _RDMAStream, reader: RDMAStreamReader) -> None:
        self._s = stream
        self._reader = reader

    @property
    def transport(self) -> _RDMAStream:
        return self._s

    @property
    def connection(self) -> Connection:
        """The underlying RDMA :class:`Connection`."""
        return self._s.conn

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer ``data`` for sending; never blocks (call :meth:`drain`).
        One call's bytes stay contiguous in the stream."""
        self._s.write(data)

    def writelines(self, data: Any) -> None:
        for chunk in data:
            self._s.write(chunk)

    async def drain(self) -> None:
        """Wait until the write buffer is back under its low-water mark if it
        went over the high-water mark. Raises :class:`ConnectionLostError` if
        the connection is gone."""
        await self._s.drain()

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        """Send EOF after the buffered bytes; the peer's reader sees the end,
        this side can still read (half-close)."""
        self._s.write_eof()

    def close(self) -> None:
        self._s.close()

    def abort(self) -> None:
        self._s.abort()

    def is_closing(self) -> bool:
        return self._s.is_closing()

    async def wait_closed(self) -> None:
        await self._s.wait_closed()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """``peername``/``sockname`` (the rendezvous TCP addresses),
        ``connection`` (the :class:`Connection`), ``peer_endpoint``,
        ``ring_size``, ``peer_ring_size``."""
        return self._s.get_extra_info(name, default)

    async def start_tls(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover
        raise NotImplementedError("TLS does not apply to RDMA streams")

    def __repr__(self) -> str:
        return f"<RDMAStreamWriter {self._s!r}>"


def _stream_options(kwargs: dict[str, Any], ring_size: int, limit: int) -> dict[str, Any]:
    """Take the stream's own options out of ``kwargs`` and check them all
    before any connection is made."""
    rb = kwargs.get("recv_buffers", 16)
    if isinstance(rb, int) and rb < _MIN_RECV_BUFFERS:
        # with fewer, both sides' credit updates can chase each other forever and leave
        # neither the two message credits a data write needs
        raise ValueError(f"streams need recv_buffers >= {_MIN_RECV_BUFFERS} (got {rb})")
    if not _MIN_RING <= ring_size <= _MAX_RING:
        raise ValueError(f"ring_size must be between {_MIN_RING} bytes and 1 GiB (got {ring_size})")
    if limit <= 0:
        raise ValueError("limit must be positive")
    out: dict[str, Any] = {}
    for key in ("write_buffer_high", "write_buffer_low", "close_timeout"):
        if key in kwargs:
            out[key] = kwargs.pop(key)
    high, low = out.get("write_buffer_high"), out.get("write_buffer_low")
    if high is None:
        high = DEFAULT_HIGH_WATER if low is None else 4 * low
    if low is None:
        low = high // 4
    if not high >= low >= 0:
        raise ValueError(f"write_buffer_high ({high!r}) must be >= write_buffer_low ({low!r}) must be >= 0")
    return out


async def open_connection(
    host: str,
    port: int = DEFAULT_PORT,
    *,
    limit: int = DEFAULT_LIMIT,
    ring_size: int = DEFAULT_RING_SIZE,
    **kwargs: Any,
) -> tuple[RDMAStreamReader, RDMAStreamWriter]:
    """Open an RDMA byte stream to a :func:`start_stream_server` at ``host:port``.

    Like :func:`asyncio.open_connection`. ``ring_size`` is this side's receive
    ring, ``limit`` the readline/readuntil limit; ``write_buffer_high`` /
    ``write_buffer_low`` and ``close_timeout`` tune the writer. The other
    keywords go to :func:`aiordma.connect` (``provider``, ``token``,
    ``timeout``, ``recv_buffers``, ...).
    """
    opts = _stream_options(kwargs, ring_size, limit)
    holder: list[_RDMAStream] = []

    def factory(conn: Connection) -> RemoteBuffer:
        st = _RDMAStream(conn, limit=limit, ring_size=ring_size, **opts)
        holder.append(st)
        return st.local_ring

    conn = await connect(host, port, stream_ring_factory=factory, **kwargs)
    stream = holder[-1]
    try:
        stream.start()
    except BaseException:
        await conn.close()
        await stream.wait_closed()
        raise
    return stream.reader, stream.writer


async def start_stream_server(
    client_connected_cb: Callable[[RDMAStreamReader, RDMAStreamWriter], Awaitable[Any] | None],
    host: str | None = None,
    port: int = DEFAULT_PORT,
    *,
    limit: int = DEFAULT_LIMIT,
    ring_size: int = DEFAULT_RING_SIZE,
    **kwargs: Any,
) -> Server:
    """Start an RDMA stream server; like :func:`asyncio.start_server`,
    ``client_connected_cb(reader, writer)`` runs for each client (a plain
    function or a coroutine function). The connection stays up until the
    writer is closed or the peer goes away. Returns the :class:`Server`
    (``async with``, ``close()``, ``wait_closed()``, ``port``)."""
    opts = _stream_options(kwargs, ring_size, limit)

    def factory(conn: Connection) -> RemoteBuffer:
        st = _RDMAStream(conn, limit=limit, ring_size=ring_size, **opts)
        _streams[conn] = st
        return st.local_ring

    async def handler(conn: Connection) -> None:
        stream = _streams.pop(conn)
        try:
            stream.start()
        except RDMAError as e:
            log.info("aiordma stream server: refused %r: %s", conn, e)
            await conn.close()
            await stream.wait_closed()
            return
        try:
            res = client_connected_cb(stream.reader, stream.writer)
            if inspect.isawaitable(res):
                await res
            # as with asyncio, the connection lives until the writer is closed or the peer leaves
            await stream.wait_closed()
        except BaseException:
            stream.abort()
            try:
                await stream.wait_closed()
            except BaseException:  # pragma: no cover
                pass
            raise

    return await start_server(handler, host, port, stream_ring_factory=factory, **kwargs)
