"""Completion dispatch: CQ entries become asyncio events.

One dispatcher per completion queue, in one of three progress modes:

``event`` (default)
    The CQ's completion channel fd is registered with ``loop.add_reader``.
    The order that never strands a completion: arm (``req_notify``) → poll
    until empty → wait for the fd → get the events → ack them (batched) →
    poll → re-arm → poll again. A completion that lands between the last
    poll and the arm fires no event, which is why we poll after arming.

    Poll, then sleep: while work is in flight the dispatcher keeps polling
    for a short window (``spin_us``; ``AIORDMA_SPIN_US``; 0 turns it off)
    after each completion or post, by keeping a callback ready on the loop,
    so that the loop does not block in the selector. A reply that arrives
    within the window is found without the sleep and wake-up of the thread.
    When the window passes with nothing, the loop sleeps on the fd again.
    This is the hybrid interrupt/poll scheme of RDMA libraries and of Linux's
    ``busy_poll``. The window is adaptive: one that passes without a
    completion halves the next (down to none), and a completion that arrives
    within ``spin_us`` of the last post or completion while windows are off
    turns them on again, so it spends CPU only while replies come fast enough
    to be caught. The default is 200 µs, except on channels that ask for
    another (``CompletionChannel.default_spin_us``: the native soft engine
    asks for none). After each post and completion the dispatcher also calls
    the channel's ``expect_traffic`` hook when the device has one.
``thread``
    A dedicated thread waits on the channel fd (or polls the CQ when no fd
    can be had) and hands batches of completions to the loop with
    ``call_soon_threadsafe``.
``busy``
    A loop task polls the CQ continuously (lowest latency on hardware; it
    burns a core and, with the soft device, competes for the GIL).

``on_completion(wc)`` is called on the loop thread for every work completion.

Sharing a channel
    Verbs let one completion channel serve many CQs: ``ibv_get_cq_event``
    names the CQ that fired. Where the provider can tell them apart (the soft
    device; pyverbs cannot), event-mode dispatchers of one device on one loop
    share one channel (:class:`SharedChannel`, from :func:`channel_for`): a
    process holding 10,000 connections holds one eventfd per device, not one
    per connection, and its loop watches one fd for all of them.
"""

from __future__ import annotations

import asyncio
import logging
import select
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ._env import spin_us_from_env
from .providers.base import CompletionChannel, CompletionQueue, WorkCompletion

log = logging.getLogger("aiordma.completion")

PROGRESS_MODES = ("event", "thread", "busy")
_POLL_BATCH = 64
_ACK_BATCH = 32


def default_spin_us() -> float:
    """The poll window of event mode in microseconds (``AIORDMA_SPIN_US``, default 200)
    on a channel that asks for no other default."""
    return spin_us_from_env()


def check_options(mode: str, spin_us: float | None) -> None:
    """``ValueError`` for a bad progress mode or poll window (a connection checks them
    before it allocates anything on the device)."""
    if mode not in PROGRESS_MODES:
        raise ValueError(f"progress mode must be one of {PROGRESS_MODES}, not {mode!r}")
    if spin_us is not None and spin_us < 0:
        raise ValueError(f"spin_us must not be negative, got {spin_us}")


def _closed_callback(wc: WorkCompletion) -> None:
    """What a closed dispatcher calls for a completion that still comes: nothing."""


def _stop_watching(
    loop: asyncio.AbstractEventLoop, channel: CompletionChannel | None, fd: int | None, direct: bool
) -> None:
    """Undo what watching a channel on a loop did: its direct handler, its reader."""
    if direct and channel is not None:
        channel.set_direct_handler(None)
    if fd is not None:
        try:
            loop.remove_reader(fd)
        except Exception:  # loop already closed
            pass


class SharedChannel:
    """One completion channel on one event loop, serving the CQs of many dispatchers.

    The loop watches the channel's fd; each event names its CQ, whose dispatcher
    then takes it as if it had its own channel (ack, poll window, drain). The fd
    is registered while at least one dispatcher uses the channel; when the last
    leaves, the channel is closed and forgotten (the next connection opens
    another)."""

    def __init__(self, channel: CompletionChannel, device: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.channel = channel
        #: (held: the ids in the registry's key stay those of live objects)
        self.device = device
        self.loop = loop
        self.key = (id(device), id(loop))
        self._by_cq: dict[CompletionQueue, CompletionDispatcher] = {}
        self._fd: int | None = None
        #: events raised on the loop's thread are handed over without the fd
        self.direct = False
        self.closed = False

    def add(self, cq: CompletionQueue, dispatcher: CompletionDispatcher) -> None:
        if self.closed:
            raise RuntimeError("the shared completion channel is closed")
        if not self._by_cq:
            self._fd = self.channel.fileno()
            self.loop.add_reader(self._fd, self._on_readable)
            self.direct = bool(self.channel.set_direct_handler(self._on_direct))
        self._by_cq[cq] = dispatcher

    def remove(self, cq: CompletionQueue) -> None:
        self._by_cq.pop(cq, None)
        if self._by_cq or self.closed:
            return
        # the last one left: close, so that an idle device holds no fd for this loop
        self.closed = True
        _forget_shared(self)
        _stop_watching(self.loop, self.channel, self._fd, self.direct)
        self.direct = False
        self._fd = None
        try:
            self.channel.close()
        except Exception:  # pragma: no cover - device gone
            pass

    def _on_readable(self) -> None:
        # one event per wake-up, as a private channel's dispatcher does: any other
        # pending keeps the fd readable and the loop comes back for it
        try:
            cq = self.channel.get_cq_event()
        except OSError as e:  # pragma: no cover - device gone
            log.warning("get_cq_event failed: %s", e)
            return
        if cq is not None:
            dispatcher = self._by_cq.get(cq)
            if dispatcher is not None:
                dispatcher._on_event(1)

    def _on_direct(self, cq: CompletionQueue) -> None:
        dispatcher = self._by_cq.get(cq)
        if dispatcher is not None:
            dispatcher._drain()


#: the open shared channels, by (device, loop); an entry goes when its channel
#: closes, or with the channel if its loop is dropped without closing it
_shared: weakref.WeakValueDictionary[tuple[int, int], SharedChannel] = weakref.WeakValueDictionary()
_shared_lock = threading.Lock()


def _forget_shared(shared: SharedChannel) -> None:
    with _shared_lock:
        if _shared.get(shared.key) is shared:
            del _shared[shared.key]


def channel_for(
    device: Any, loop: asyncio.AbstractEventLoop, mode: str
) -> tuple[CompletionChannel, SharedChannel | None]:
    """The completion channel for a new CQ of ``device`` dispatched on ``loop`` in
    ``mode``: the loop's shared channel of the device in event mode where the
    provider can share one (a new one if there is none), else a channel of its
    own (returned with None: its owner closes it)."""
    key = (id(device), id(loop))
    if mode == "event":
        with _shared_lock:
            shared = _shared.get(key)
        if shared is not None and not shared.closed:
            return shared.channel, shared
    channel = device.create_comp_channel()
    if mode != "event" or not channel.shareable:
        return channel, None
    shared = SharedChannel(channel, device, loop)
    with _shared_lock:
        _shared[key] = shared
    return channel, shared


class CompletionDispatcher:
    """Delivers the completions of one CQ to ``on_completion`` on the event loop."""

    def __init__(
        self,
        cq: CompletionQueue,
        channel: CompletionChannel | None,
        on_completion: Callable[[WorkCompletion], None],
        *,
        mode: str = "event",
        loop: asyncio.AbstractEventLoop | None = None,
        spin_us: float | None = None,
        shared: SharedChannel | None = None,
    ) -> None:
        """``shared``: the channel is that shared channel's (event mode); the
        dispatcher joins it instead of watching the fd itself."""
        check_options(mode, spin_us)
        if spin_us is None:
            hint = getattr(channel, "default_spin_us", None) if channel is not None else None
            spin_us = spin_us_from_env() if hint is None else spin_us_from_env(hint)
        self.cq = cq
        self.channel = channel
        self.on_completion = on_completion
        self.loop = loop or asyncio.get_running_loop()
        self.requested_mode = mode
        self.mode = mode
        self._unacked = 0
        self._closed = False
        #: completions delivered by a compiled core that has left (close())
        self._fast_delivered = 0
        #: completions polled but not delivered: a handler raised SystemExit or
        #: KeyboardInterrupt before their turn (delivered by the next drain)
        self._backlog: list[WorkCompletion] = []
        self._fd: int | None = None
        self._shared: SharedChannel | None = None
        self._thread: threading.Thread | None = None
        #: set by close(): the polling thread's idle sleeps end at once
        self._stopped = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self._completions = 0
        self.wakeups = 0
        #: completions handed over directly (no fd) by a device on this thread
        self.direct = False
        self._draining = False
        #: event mode: how long (s) to keep polling after a completion or a post
        self.spin_s = spin_us * 1e-6
        #: the adaptive window's current length (s): halved by a window that
        #: caught nothing, back to spin_s when a completion came fast enough
        self._spin_cur = self.spin_s
        self._spin_until = 0.0
        self._spin_hit = False
        self._last_expect = 0.0
        self._spinning = False
        #: loop iterations spent in the poll window
        self.spins = 0
        #: the device's "traffic is coming" hook (the native soft engine's expect window)
        self._watch: Callable[[], None] | None = None
        #: the connection's compiled per-operation core, when it polls this CQ itself
        #: (aiordma._core.FastPath.drain: event mode, a provider with C verbs)
        self._fast: Any = None
        if mode == "event":
            fd = self._channel_fd() if shared is None else -1
            if fd is None:
                log.info("no completion-channel fd: falling back to the polling thread")
                self.mode = "thread"
            else:
                if shared is not None:
                    self._shared = shared
                    shared.add(cq, self)
                    self.direct = shared.direct
                else:
                    self._fd = fd
                    self.loop.add_reader(fd, self._on_readable)
                    # the soft device raises events on this thread when its NIC
                    # receives on the loop: those skip the fd and the selector
                    self.direct = bool(channel is not None and channel.set_direct_handler(self._on_direct))
                self._watch = getattr(channel, "expect_traffic", None)
                if self._watch is not None and not self.spin_s:
                    # nothing to do in Python: callers reach the device's hook directly
                    self.expect = self._watch  # type: ignore[method-assign]
                self.cq.req_notify()
                self.loop.call_soon(self._drain)
        if self.mode == "thread":
            self._thread = threading.Thread(target=self._thread_main, name="aiordma-cq-poller", daemon=True)
            self._thread.start()
        elif self.mode == "busy":
            self._task = self.loop.create_task(self._busy_main())

    @property
    def completions(self) -> int:
        """Completions delivered so far (by this dispatcher, or by the compiled core it hands them to)."""
        fast = self._fast
        n = self._completions + self._fast_delivered
        if fast is not None:
            n += fast.fast_completions + fast.slow_completions
        return n

    def use_fast_path(self, fast: Any) -> None:
        """Hand this dispatcher's event-mode wake-ups to ``fast.drain()`` (a
        connection's compiled core, which polls the CQ through the provider's C verbs
        and finishes what it can itself) when ``fast.can_drain``. It may then also
        open the device's expect window itself, from C, when that is all
        :meth:`expect` does (no poll window)."""
        if self.mode != "event" or not getattr(fast, "can_drain", False):
            return
        self._fast = fast
        fast.expect_in_c = self._watch is not None and not self.spin_s
        fast.expect_py = self.expect
        if self.direct and not self.spin_s:
            # the device raises this CQ's events on the loop's thread: straight to the core
            self.cq.set_drain_handler(fast.drain)

    def _channel_fd(self) -> int | None:
        if self.channel is None:
            return None
        try:
            return self.channel.fileno()
        except (OSError, AttributeError, ValueError):
            return None

    # ----------------------------------------------------------- event ----
    def _on_readable(self) -> None:
        if self._closed:
            return
        n = 0
        channel = self.channel
        assert channel is not None
        try:
            # One event per wake-up: an armed CQ raises at most one, and any other still
            # pending keeps the fd readable, so the loop comes back for it. (Reading on
            # until EAGAIN cost pyverbs an exception on every wake-up.)
            if channel.get_cq_event() is not None:
                n = 1
        except OSError as e:  # pragma: no cover - device gone
            log.warning("get_cq_event failed: %s", e)
        self._on_event(n)

    def _on_direct(self, cq: CompletionQueue) -> None:
        self._drain()

    def _on_event(self, n: int) -> None:
        """``n`` events of this CQ were taken from the channel: ack (batched), drain."""
        if self._closed:
            return
        self.wakeups += 1
        if n:
            self._unacked += n
            if self._unacked >= _ACK_BATCH:
                self.cq.ack_events(self._unacked)
                self._unacked = 0
        if self.spin_s and not self._spin_cur and time.monotonic() - self._last_expect < self.spin_s:
            self._spin_cur = self.spin_s  # a window would have caught this one: poll again
        self._drain()

    def _drain(self, first: list[WorkCompletion] | None = None) -> None:
        """Poll until empty, re-arm, poll again (the drain-after-arm rule).
        ``first``: completions already polled, delivered before the rest.

        Not re-entered: an event raised while a completion handler runs (it
        posted work that completed at once) is covered by the outer loop,
        which polls again after every delivery; delivering from a nested call
        would reorder completions."""
        if self._draining or self._closed:
            return
        fast = self._fast
        if fast is not None and first is None:
            # (the core counts what it delivers and opens the expect window itself)
            if fast.drain():
                self._spin_hit = True
            return
        self._draining = True
        delivered = 0
        cq = self.cq
        poll = cq.poll
        cb = self.on_completion
        try:
            if self._backlog:
                wcs, self._backlog = self._backlog + (first or []), []
            else:
                wcs = first if first is not None else poll(_POLL_BATCH)
            while True:
                if wcs:
                    # the per-completion path: deliver in CQ order
                    n = len(wcs)
                    delivered += n
                    # counted before they are delivered: a task a completion resumes at once
                    # (aiordma._core.OpFuture) runs inside this loop and may look
                    self._completions += n
                    for i, wc in enumerate(wcs):
                        try:
                            cb(wc)
                        except Exception:
                            log.exception("completion handler failed for %r", wc)
                        except BaseException:
                            # SystemExit or KeyboardInterrupt out of a handler (or of a task a
                            # completion resumed, aiordma._core.OpFuture): it leaves the loop,
                            # the rest of this batch is delivered first thing next time
                            self._backlog = wcs[i + 1 :]
                            if self._backlog:
                                self.loop.call_soon(self._drain)
                            raise
                    if self._closed:  # a handler tore the connection down: the CQ is gone
                        return
                    if n == _POLL_BATCH:  # maybe more: poll before arming
                        wcs = poll(_POLL_BATCH)
                        continue
                cq.req_notify()
                wcs = poll(_POLL_BATCH)
                if not wcs:
                    break
        finally:
            self._draining = False
            if delivered:
                self._spin_hit = True
                self.expect()

    def expect(self) -> None:
        """Work was posted, or completed: tell the device traffic is coming, and
        open (or extend) the poll window."""
        watch = self._watch
        if watch is not None:
            watch()
        if self.spin_s and not self._closed and self.mode == "event":
            now = time.monotonic()
            self._last_expect = now
            if self._spin_cur:
                self._spin_until = now + self._spin_cur
                if not self._spinning:
                    self._spinning = True
                    self._spin_hit = False
                    self.loop.call_soon(self._spin)

    def _spin(self) -> None:
        """One poll of the window. Being a ready callback, it keeps the
        selector from blocking in this loop iteration (which still polls the
        fds with a zero timeout: the soft NIC's socket is serviced as usual)."""
        if self._closed:
            self._spinning = False
            return
        self.spins += 1
        if not self._draining:
            # the CQ is armed (every drain ends so): an empty poll needs no re-arm
            wcs = self.cq.poll(_POLL_BATCH)
            if wcs:
                self._drain(wcs)  # extends the window
        if time.monotonic() < self._spin_until:
            self.loop.call_soon(self._spin)
            return
        self._spinning = False
        # adapt: a window that caught nothing halves the next one (to none)
        if self._spin_hit:
            self._spin_cur = self.spin_s
        elif self._spin_cur > self.spin_s / 8:
            self._spin_cur /= 2
        else:
            self._spin_cur = 0.0

    def _deliver(self, wcs: list[WorkCompletion]) -> None:
        self._completions += len(wcs)
        cb = self.on_completion
        for wc in wcs:
            try:
                cb(wc)
            except Exception:
                log.exception("completion handler failed for %r", wc)

    # ---------------------------------------------------------- thread ----
    def _thread_main(self) -> None:
        fd = self._channel_fd()
        channel = self.channel
        if fd is not None:
            self.cq.req_notify()
        idle_sleep = 0.0
        while not self._closed:
            batch: list[WorkCompletion] = []
            while True:
                wcs = self.cq.poll(_POLL_BATCH)
                if not wcs:
                    break
                batch.extend(wcs)
            if fd is not None and not batch:
                self.cq.req_notify()
                batch.extend(self.cq.poll(_POLL_BATCH))
            if batch:
                idle_sleep = 0.0
                try:
                    self.loop.call_soon_threadsafe(self._deliver, batch)
                except RuntimeError:  # loop closed
                    return
                continue
            if fd is not None:
                try:
                    r, _, _ = select.select([fd], [], [], 0.05)
                except (OSError, ValueError):
                    return
                if r and channel is not None:
                    n = 0
                    while channel.get_cq_event() is not None:
                        n += 1
                    if n:
                        self.cq.ack_events(n)
            else:
                idle_sleep = min(0.001, idle_sleep * 2 or 0.00002)
                self._stopped.wait(idle_sleep)

    # ------------------------------------------------------------ busy ----
    async def _busy_main(self) -> None:
        poll = self.cq.poll
        while not self._closed:
            wcs = poll(_POLL_BATCH)
            if wcs:
                self._deliver(wcs)
            await asyncio.sleep(0)

    def drain_now(self) -> None:
        """Deliver whatever is in the CQ right now (used before failing a connection)."""
        if self._closed:
            return
        if self._fast is not None:
            self._fast.drain()
            return
        while True:
            wcs = self.cq.poll(_POLL_BATCH)
            if not wcs:
                return
            self._deliver(wcs)

    # ----------------------------------------------------------- close ----
    def close(self) -> None:
        """Stop dispatching. The fd is removed from the loop before anyone closes it."""
        if self._closed:
            return
        self._closed = True
        self._stopped.set()
        # (a shared channel's handler and fd are the shared channel's to undo)
        _stop_watching(self.loop, self.channel, self._fd, self.direct and self._shared is None)
        self.direct = False
        self._fd = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        if self._task is not None:
            self._task.cancel()
        if self._shared is not None:
            # the channel's other events belong to other CQs (this CQ's own, if any
            # are left, are skipped once the CQ is gone); the last to leave closes it
            self._shared.remove(self.cq)
            self._shared = None
        # ack everything get_cq_event returned, so destroying the CQ cannot hang
        elif self.channel is not None:
            try:
                while self.channel.get_cq_event() is not None:
                    self._unacked += 1
            except OSError:
                pass
        if self._unacked:
            self.cq.ack_events(self._unacked)
            self._unacked = 0
        # the owner's callback is dropped: a closed connection is not kept alive by its dispatcher
        self.on_completion = _closed_callback
        if self._fast is not None:
            self._fast_delivered = self._fast.fast_completions + self._fast.slow_completions
            self.cq.set_drain_handler(None)
            self._fast = None
