"""A device's asynchronous events on asyncio event loops (``ibv_get_async_event``).

Verbs report what belongs to no work request (an SRQ's limit reached, a queue
pair's fatal error, a port going down) through one file descriptor per
device context, ``ibv_context.async_fd``: readable while events are queued,
each read with ``ibv_get_async_event`` and acknowledged with
``ibv_ack_async_event``. aiordma uses it for ``IBV_EVENT_SRQ_LIMIT_REACHED``:
:meth:`~aiordma.providers.base.SharedReceiveQueue.set_limit_handler`.

:class:`AsyncEventDispatcher` does that part for every provider: it watches
the device's fd with ``loop.add_reader`` on each loop that has a handler
(never polling), reads every queued event when it becomes readable (the
provider's :class:`AsyncEventSource` reads and acknowledges them and names
their SRQ), and calls the SRQ's handler on the SRQ's loop: directly when that
is the loop that read the event, else through ``call_soon_threadsafe``.
A handler never runs on a NIC thread nor while a device lock is held.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .base import AsyncEventType, SharedReceiveQueue

__all__ = ["AsyncEventDispatcher", "AsyncEventSource"]

log = logging.getLogger("aiordma")

_SRQ_LIMIT_REACHED = AsyncEventType.IBV_EVENT_SRQ_LIMIT_REACHED


class AsyncEventSource(Protocol):
    """What a provider gives the dispatcher: the device's async-event fd and a
    way to read what is queued on it."""

    def fileno(self) -> int:
        """The fd, non-blocking: readable while events are queued."""

    def read_events(self) -> Sequence[tuple[int, SharedReceiveQueue | None]]:
        """Every event queued now, oldest first, each acknowledged
        (``ibv_ack_async_event``): ``(event type, the SRQ it names or None)``.
        Never blocks."""


Handler = Callable[[SharedReceiveQueue], None]


class AsyncEventDispatcher:
    """The async events of one device, dispatched to its SRQs' limit handlers."""

    def __init__(self, source: AsyncEventSource, name: str) -> None:
        self._source = source
        self.name = name
        self._lock = threading.Lock()
        self._handlers: dict[SharedReceiveQueue, tuple[Handler, asyncio.AbstractEventLoop]] = {}
        self._loops: dict[asyncio.AbstractEventLoop, int] = {}  # loop -> handlers on it (its reader)
        self._closed = False
        #: events read, by type name (what came through, handled or not)
        self.counts: dict[str, int] = {}

    def set_handler(self, srq: SharedReceiveQueue, handler: Handler | None, loop: Any = None) -> None:
        """``handler(srq)`` on ``loop`` (default: the running loop) for each limit
        event of ``srq``; None removes it."""
        if handler is not None and not callable(handler):
            raise TypeError(f"the limit handler must be callable, not {type(handler).__name__}")
        if handler is not None and loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise RuntimeError(
                    "set_limit_handler needs an event loop: call it from a coroutine, or pass loop="
                ) from None
        add: asyncio.AbstractEventLoop | None = None
        remove: asyncio.AbstractEventLoop | None = None
        with self._lock:
            if self._closed and handler is not None:
                raise RuntimeError(f"the async events of {self.name} are closed (the device is closed)")
            old = self._handlers.pop(srq, None)
            if old is not None:
                remove = self._unref(old[1])
            if handler is not None:
                assert loop is not None
                self._handlers[srq] = (handler, loop)
                n = self._loops.get(loop, 0)
                self._loops[loop] = n + 1
                if n == 0:
                    add = loop
                if remove is loop:  # the same loop again: keep its reader
                    add = remove = None
        if remove is not None:
            self._remove_reader(remove)
        if add is not None:
            self._add_reader(add)

    def forget(self, srq: SharedReceiveQueue) -> None:
        """``srq`` is destroyed: its handler goes."""
        self.set_handler(srq, None)

    def _unref(self, loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop | None:
        """Drop one handler of ``loop`` (lock held); the loop whose reader must go, if any."""
        n = self._loops.get(loop, 0) - 1
        if n > 0:
            self._loops[loop] = n
            return None
        self._loops.pop(loop, None)
        return loop

    def _add_reader(self, loop: asyncio.AbstractEventLoop) -> None:
        fd = self._source.fileno()
        if _on_loop_thread(loop):
            loop.add_reader(fd, self._readable, loop)
        else:  # add_reader is not thread-safe: the loop does it itself
            loop.call_soon_threadsafe(self._add_reader_later, loop, fd)

    def _add_reader_later(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        with self._lock:
            wanted = loop in self._loops and not self._closed
        if wanted:
            loop.add_reader(fd, self._readable, loop)

    def _remove_reader(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop.is_closed():
            return
        try:
            fd = self._source.fileno()
        except Exception:  # the device went first
            return
        if _on_loop_thread(loop):
            loop.remove_reader(fd)
        else:
            try:
                loop.call_soon_threadsafe(self._remove_reader_later, loop, fd)
            except RuntimeError:  # closed meanwhile
                pass

    def _remove_reader_later(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        with self._lock:
            wanted = loop in self._loops and not self._closed
        if not wanted:
            loop.remove_reader(fd)

    def _readable(self, loop: asyncio.AbstractEventLoop) -> None:
        """The fd is readable on ``loop``: read every queued event and dispatch it."""
        try:
            events = self._source.read_events()
        except Exception as e:
            loop.call_exception_handler({"message": f"reading the async events of {self.name} failed", "exception": e})
            return
        for event_type, srq in events:
            try:
                kind = AsyncEventType(event_type).name
            except ValueError:
                kind = str(event_type)
            with self._lock:
                self.counts[kind] = self.counts.get(kind, 0) + 1
                entry = self._handlers.get(srq) if event_type == _SRQ_LIMIT_REACHED and srq is not None else None
            if event_type != _SRQ_LIMIT_REACHED or srq is None:
                log.debug("%s: async event %s (not handled)", self.name, kind)
                continue
            if entry is None:
                log.debug("%s: %s of an SRQ without a handler: dropped", self.name, kind)
                continue
            handler, hloop = entry
            if hloop is loop:
                _call(handler, srq, loop)
            elif not hloop.is_closed():
                try:
                    hloop.call_soon_threadsafe(_call, handler, srq, hloop)
                except RuntimeError:  # closed meanwhile
                    pass

    def close(self) -> None:
        """The device closes: every reader leaves its loop (before the fd is closed)."""
        with self._lock:
            self._closed = True
            loops = list(self._loops)
            self._loops.clear()
            self._handlers.clear()
        for loop in loops:
            if loop.is_closed():
                continue
            try:
                fd = self._source.fileno()
            except Exception:
                return
            if _on_loop_thread(loop):
                loop.remove_reader(fd)
            # (from another thread the fd cannot leave that loop safely before it is closed:
            # close the device on the thread of the loops that use its SRQs)


def _on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the calling thread runs ``loop`` (or may act for it: it runs no loop)."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        return not loop.is_running()
    return running is loop


def _call(handler: Handler, srq: SharedReceiveQueue, loop: asyncio.AbstractEventLoop) -> None:
    try:
        handler(srq)
    except Exception as e:
        loop.call_exception_handler({"message": f"the limit handler of {srq!r} raised", "exception": e})
