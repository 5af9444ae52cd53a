# NativeEngine: one soft device's socket and NIC thread, and what makes the verbs
# objects (verbs.pxi).

# __dealloc__ uses the C objects of the attributes: the GC must not clear them first
@cython.no_gc_clear
cdef class NativeEngine:
    """The native engine of one soft device: a UDP socket bound to ``ip:port`` and
    the NIC thread that runs it (the engine protocol of providers/soft/engine.py)."""

    cdef nic e
    cdef bint _open, _closed
    cdef readonly str ip
    cdef readonly int port
    cdef readonly str icrc_policy
    cdef readonly str crc32
    cdef readonly str name
    cdef object _faults
    cdef public object tracer
    cdef dict _traced_wrs
    cdef object _loop
    cdef unsigned long _loop_thread
    cdef int _loop_fd, _loop_refs
    cdef list _posted
    # shared-memory links (nic_shm.c): the loop's poll of them, and how long it polls
    # after the last packet or post (AIORDMA_SOFT_SHM_POLL_US)
    cdef bint _shm_polling
    cdef double _shm_last, _shm_window
    # the attached loop's ready queue, timer heap and selector fd (_loop_internals:
    # None / -1 where unknown): while it has nothing else ready, the poll waits in C
    cdef object _loop_ready_queue, _loop_timers
    cdef int _loop_selector_fd
    # asyncio's loop: the poll's handle, made by call_soon once and put back on the
    # ready queue each turn after (call_soon's Python costs 0.5 µs a turn)
    cdef object _shm_handle
    cdef object __weakref__

    def __cinit__(self, str ip, int port, *, str icrc="strict", capture=None):
        policies = {"strict": ICRC_STRICT, "any-ip-id": ICRC_ANY_IP_ID, "off": ICRC_OFF}
        if icrc not in policies:
            raise ValueError(f"ICRC policy must be one of {tuple(policies)}, not {icrc!r}")
        # the settings first: a bad value is refused before anything is opened
        gso = _settings.SOFT_GSO.get()
        gro = _settings.SOFT_GRO.get()
        local = _settings.SOFT_LOCAL.get()
        window_us = _settings.SOFT_WINDOW_US.get()
        poll_us = _settings.SOFT_POLL_US.get()
        shm_poll_us = _settings.SOFT_SHM_POLL_US.get()
        cdef char err[256]
        cdef bytes ipb = ip.encode()
        cdef bytes cap = _os.fsencode(capture) if capture else b""
        cdef int r = nic_open(&self.e, ipb, port, policies[icrc], cap, err, 256)
        if r < 0:
            nic_free(&self.e)
            raise OSError(-r, err.decode("utf-8", "replace"))
        self._open = True
        self.ip = self.e.ip.decode()
        self.port = self.e.port
        self.icrc_policy = icrc
        self.crc32 = wire_crc32_name().decode()
        self.name = "native"
        self.e.gso = 1 if gso else 0
        nic_set_gro(&self.e, 1 if gro else 0)
        self.e.local_delivery = 1 if local else 0
        if window_us is not None:
            self.e.window_len = window_us * 1e-6
        if poll_us is not None:
            self.e.poll_window = poll_us * 1e-6
        self._shm_window = (DEFAULT_SHM_POLL_US if shm_poll_us is None else shm_poll_us) * 1e-6
        self.e.hooks.ctx = <void *>self
        self._traced_wrs = {}
        self._posted = []
        if nic_start(&self.e) < 0:
            nic_free(&self.e)
            self._open = False
            raise OSError("cannot start the soft NIC thread")

    def __dealloc__(self):
        if self._open:
            with nogil:
                nic_close(&self.e)
            self._reap()
            nic_free(&self.e)
            self._open = False

    cdef void _reap(self) noexcept:
        """Release the buffers of deregistered regions nothing uses any more."""
        cdef mr **z
        cdef size_t n, i
        if self.e.nzombies == 0:  # (a racy peek: the NIC thread only ever adds)
            return
        with nogil:
            nic_lock(&self.e)
            z = self.e.zombies
            n = self.e.nzombies
            self.e.zombies = NULL
            self.e.nzombies = 0
            self.e.zombies_cap = 0
            nic_unlock(&self.e)
        for i in range(n):
            _free_mr(z[i])
        free(z)

    # ------------------------------------------------------- protocol ----
    @property
    def gso(self):
        return bool(self.e.gso)

    @gso.setter
    def gso(self, on):
        self.e.gso = 1 if on else 0

    @property
    def gso_watch(self):
        """The netdev (ifindex) whose captures pause GSO batches, or None."""
        return None if self.e.gso_watch_ifindex < 0 else self.e.gso_watch_ifindex

    @gso_watch.setter
    def gso_watch(self, ifindex):
        with nogil:
            nic_lock(&self.e)
        self.e.gso_watch_ifindex = -1 if ifindex is None else int(ifindex)
        self.e.gso_paused = 0
        self.e.gso_watch_next = 0.0
        nic_unlock(&self.e)

    @property
    def thread_alive(self):
        """Whether the NIC thread runs (it stops only when the device closes, or when
        its epoll_wait fails: then nothing would serve the device's packets)."""
        return bool(self.e.thread_started and self.e.thread_running)

    @property
    def gso_paused(self):
        """Whether GSO batches are paused now: a capture listens on the watched netdev."""
        return bool(self.e.gso_paused)

    @property
    def gro(self):
        """Whether the kernel hands this socket coalesced datagrams (UDP_GRO): a
        sender's GSO batch then arrives with one receive and is split here."""
        return bool(self.e.gro)

    @property
    def local_delivery(self):
        """Whether the packets between two queue pairs of this device (both in this
        process) are handed over in memory instead of through the UDP socket."""
        return bool(self.e.local_delivery)

    @local_delivery.setter
    def local_delivery(self, on):
        with nogil:
            nic_lock(&self.e)
        self.e.local_delivery = 1 if on else 0
        nic_unlock(&self.e)

    @property
    def faults(self):
        return self._faults

    @faults.setter
    def faults(self, f):
        old = self._faults
        cdef uint64_t seed
        with nogil:
            nic_lock(&self.e)
        try:
            counts = (self.e.faults.dropped, self.e.faults.duplicated, self.e.faults.reordered)
            if f is None:
                nic_faults_set(&self.e, 0, 0.0, 0.0, 0.0, 0, 0)
            else:
                seed = (f.seed if f.seed is not None else int.from_bytes(_os.urandom(8), "little")) & 0xFFFFFFFFFFFFFFFF
                nic_faults_set(&self.e, 1, f.drop, f.duplicate, f.reorder, seed, 1 if f.filter is not None else 0)
                if f.filter is not None:
                    self.e.hooks.filter = _filter_cb
        finally:
            nic_unlock(&self.e)
        if old is not None and old is not f:
            old._freeze(counts)
        self._faults = f
        if f is not None:
            f._live = self._fault_counts

    def _fault_counts(self):
        return (self.e.faults.dropped, self.e.faults.duplicated, self.e.faults.reordered)

    def _filter(self, datagram):
        f = self._faults
        return True if f is None or f.filter is None else bool(f.filter(datagram))

    def counters(self):
        cdef uint64_t dev[64]
        cdef uint64_t sums[16]
        cdef uint64_t v[16]
        cdef size_t k
        cdef int nq = 0
        memset(sums, 0, sizeof(sums))
        with nogil:
            nic_lock(&self.e)
            memcpy(dev, self.e.counters, NC_MAX * sizeof(uint64_t))
            nq = _sum_qp_counters(&self.e, sums)
            nic_unlock(&self.e)
        out = {nic_counter_names[i].decode(): dev[i] for i in range(NC_MAX) if dev[i]}
        if nq:
            for i in range(RC_NCOUNTERS):
                out[rc_counter_names[i].decode()] = sums[i]
        return out

    def transport_totals(self):
        """The transport counters (retransmits, RNR NAKs, ...) of every QP this device has
        had, closed ones included: they only grow (``counters`` sums the live QPs')."""
        cdef uint64_t sums[16]
        cdef int i
        memset(sums, 0, sizeof(sums))
        with nogil:
            nic_lock(&self.e)
            _sum_qp_counters(&self.e, sums)
            for i in range(RC_NCOUNTERS):
                sums[i] += self.e.closed_qp_counters[i]
            nic_unlock(&self.e)
        return {rc_counter_names[i].decode(): sums[i] for i in range(RC_NCOUNTERS)}

    def live_objects(self):
        return {"qps": self.e.nqps, "mrs": self.e.nmrs, "cqs": self.e.ncqs, "srqs": self.e.nsrqs}

    def registered_memory(self):
        """``{"bytes": the registered regions' lengths, "regions": how many}``."""
        cdef uint64_t nbytes
        cdef size_t n
        with nogil:
            nic_lock(&self.e)
            nbytes = self.e.mr_bytes
            n = self.e.nmrs
            nic_unlock(&self.e)
        return {"bytes": nbytes, "regions": n}

    def async_fd(self):
        """The async-event fd (``ibv_context.async_fd``): readable while events are queued."""
        return self.e.async.fd

    def get_async_event(self):
        """``ibv_get_async_event`` without blocking: ``(event type, element number)`` of the
        oldest queued event (its element: an SRQ's srq_num), or None."""
        cdef int t = 0
        cdef uint32_t el = 0
        if nic_async_get(&self.e, &t, &el):
            return t, el
        return None

    def has_qp(self, uint32_t qp_num):
        cdef nic_qp *q
        with nogil:
            nic_lock(&self.e)
            q = nic_qp_find(&self.e, qp_num)
            nic_unlock(&self.e)
        return q != NULL

    def alloc_pd(self):
        return NativePD(self)

    def create_channel(self):
        return NativeChannel(self)

    def create_cq(self, uint32_t cqe, NativeChannel channel=None):
        return NativeCQ(self, cqe, channel)

    def attach_loop(self, loop):
        """Let ``loop`` receive for this device while its application expects traffic.

        The NIC thread does the receive work (without the GIL) except inside an
        *expect window*: after the application posted or completed something
        (the completion dispatcher calls :meth:`expect`), the loop watches the
        socket itself for ``AIORDMA_SOFT_WINDOW_US`` (2 ms) and receives on its
        own thread, handing completions to the dispatcher directly: no NIC-thread
        wake-up and no eventfd on the active side's path. A process that only
        serves one-sided operations posts and completes nothing, so its loop
        never receives: the NIC thread serves them, running no Python. One loop
        at a time (the first attached); returns the detach callable or None.
        """
        cdef int fd
        if self._closed:
            return None
        if self._loop is not None and self._loop is not loop and not self._loop.is_closed():
            return None
        if self._loop is not loop:
            with nogil:
                nic_lock(&self.e)
                fd = nic_loop_attach(&self.e)
                nic_unlock(&self.e)
            if fd < 0:
                return None
            loop.add_reader(fd, self._loop_ready)
            self._loop = loop
            self._loop_ready_queue, self._loop_timers, self._loop_selector_fd = _loop_internals(loop)
            self._shm_handle = None  # (a closed loop's, where that loop went without a detach)
            self._loop_thread = PyThread_get_thread_ident()
            self._loop_fd = fd
            self._loop_refs = 0
            if self._shm_polling:  # (a loop closed while it polled the links: its chain is gone)
                self._shm_stop()
                self._shm_expect()  # (this loop polls now, and takes what waits)
        self._loop_refs += 1
        done = [False]

        def detach():
            if done[0]:
                return
            done[0] = True
            self._loop_refs -= 1
            if self._loop_refs <= 0 and self._loop is loop:
                self._detach_loop()

        return detach

    cdef void _detach_loop(self) noexcept:
        cdef int pending = 0
        loop = self._loop
        self._loop = None
        self._loop_thread = 0
        self._loop_ready_queue, self._loop_timers, self._loop_selector_fd = None, None, -1
        self._shm_handle = None
        if self._posted:
            self._flush_posted()
        if self._shm_polling:
            pending = self._shm_stop()  # (the links' consumer sleeps: producers kick the NIC thread)
        if loop is not None and not loop.is_closed():
            try:
                loop.remove_reader(self._loop_fd)
            except Exception:
                pass
        if self._open:
            with nogil:
                nic_lock(&self.e)
                nic_loop_detach(&self.e)
                nic_unlock(&self.e)
            if pending and self.e.shm_wakefd >= 0:
                # a packet came as the poll stopped and no producer will kick for it:
                # wake the NIC thread, whose the links are now
                try:
                    _os.eventfd_write(self.e.shm_wakefd, 1)
                except OSError:
                    pass

    cdef int _defer_flush(self, uint32_t qpn) except -1:
        """Transmit ``qpn``'s new WQEs at the end of this loop iteration (a C call: it
        runs once per post to a busy QP)."""
        if not self._posted:
            self._posted = [qpn]
            self._loop.call_soon(self._flush_posted)
        elif qpn not in self._posted:
            self._posted.append(qpn)
        return 0

    def _flush_posted(self):
        posted, self._posted = self._posted, []
        if not posted:
            return
        cdef nic_qp *q
        cdef double now, t
        cdef uint32_t qpn
        cdef nic *e = &self.e
        with nogil:
            nic_lock(e)
        try:
            now = nic_now()
            for qpn in posted:
                q = nic_qp_find(e, qpn)
                if q != NULL:
                    e.counters[NC_TX_INLINE] += 1
                    nic_flush(e, q, now)
                    t = rc_next_timer(q.rc)
                    nic_timer_armed(e, t)
        finally:
            nic_unlock(e)
        if e.nfire:
            self._fire()

    def expect(self):
        """Open (or extend) the expect window (see :meth:`attach_loop`)."""
        if self._loop is None:
            return
        if self.e.nlinks:
            self._shm_expect()
        if self.e.loop_owns:
            # the loop has the socket already: move the window's end (an aligned double
            # store; the NIC thread reads it under the lock and at worst sees the old one)
            self.e.window_deadline = nic_now() + self.e.window_len
            return
        _lock_gil(&self.e)
        nic_expect(&self.e, nic_now())
        nic_unlock(&self.e)

    # ------------------------------------------------ shared-memory links ----
    @property
    def shm_device(self):
        """This device's id in shared-memory links (random, per device)."""
        return self.e.shm_device

    @property
    def shm_wakefd(self):
        """The eventfd a link's producer kicks (a peer copies it with pidfd_getfd)."""
        return self.e.shm_wakefd

    @property
    def shm_links(self):
        """How many shared-memory links this device has."""
        return self.e.nlinks

    def shm_make(self, int peer_pid, uint64_t peer_device, int peer_wakefd):
        """The link toward the peer device (made now, or the one made before):
        ``(link_id, memfd number)``; OSError with the reason when it cannot be made."""
        cdef char err[256]
        cdef uint64_t link_id = 0
        cdef int memfd = -1, r
        err[0] = 0
        with nogil:
            nic_lock(&self.e)
            r = nic_shm_make(&self.e, peer_pid, peer_device, peer_wakefd, &link_id, &memfd, err, 256)
            nic_unlock(&self.e)
        if r < 0:
            raise OSError(err.decode("utf-8", "replace"))
        return link_id, memfd

    def shm_attach(self, int peer_pid, uint64_t peer_device, uint64_t link_id, int memfd_num, int wakefd_num):
        """Map the link the peer made (a no-op when it is mapped already); OSError
        with the reason when it cannot be."""
        cdef char err[256]
        cdef int r
        err[0] = 0
        with nogil:
            nic_lock(&self.e)
            r = nic_shm_attach(&self.e, peer_pid, peer_device, link_id, memfd_num, wakefd_num, err, 256)
            nic_unlock(&self.e)
        if r < 0:
            raise OSError(err.decode("utf-8", "replace"))

    cdef void _shm_expect(self) noexcept:
        """Traffic is coming (a post, a completion): poll the links from the loop
        for the poll window, rather than sleep until a producer kicks."""
        self._shm_last = nic_now()
        if self._shm_polling or self._shm_window <= 0 or self._loop is None:
            return
        self._shm_polling = True
        _lock_gil(&self.e)
        self.e.shm_poll_seen = self._shm_last
        nic_shm_set_polling(&self.e, 1)
        nic_unlock(&self.e)
        try:
            self._shm_again(self._loop)
        except Exception:  # (a closed loop: nothing to poll from)
            self._shm_stop()

    cdef int _shm_stop(self) noexcept:
        """Stop polling; 1 when a packet arrived meanwhile (nobody kicks for it)."""
        cdef int pending
        self._shm_polling = False
        _lock_gil(&self.e)
        pending = nic_shm_set_polling(&self.e, 0)
        nic_unlock(&self.e)
        return pending

    def _shm_poll(self):
        """One look at the links, as a ready callback (the loop does not block while
        one is scheduled): take what arrived, else stop once the window has passed."""
        if not self._shm_polling:
            return
        if not self.e.shm_polling:
            # the NIC thread took the links back (the loop had not looked for
            # SHM_POLL_STALL): they are its until the next expect polls again
            self._shm_polling = False
            return
        if self._loop is None or not self.e.nlinks or self._closed:
            self._shm_stop()
            return
        cdef double now = nic_now()
        self.e.shm_poll_seen = now  # (an aligned double store, as window_deadline's)
        if nic_shm_pending(&self.e):
            self._shm_last = now
            self._loop_service(0)
        elif now - self._shm_last > self._shm_window:
            if not self._shm_stop():
                return
            self._loop_service(0)  # (arrived as it stopped: no kick will come for it)
            return
        elif nic_shm_peer_shares_cpu(&self.e):
            # the peer's poller shares this CPU: it cannot answer while this thread spins
            with nogil:
                sched_yield()
        elif self._loop_ready_queue is not None and not self._loop_ready_queue:
            self._shm_wait(now)
        # (what the service handed over may have closed the last connection of this
        # loop, and with it detached the loop, which stopped the poll)
        loop = self._loop
        if self._shm_polling and loop is not None:
            self._shm_again(loop)

    cdef _shm_again(self, loop):
        """Schedule the next look at the links (a ready callback of the loop)."""
        if self._shm_handle is not None:
            self._loop_ready_queue.append(self._shm_handle)
            return
        handle = loop.call_soon(self._shm_poll)
        if self._loop_timers is not None:  # (asyncio's loop: its ready queue takes Handles as they are)
            self._shm_handle = handle

    cdef _shm_wait(self, double now):
        """Wait for a link's packet in C, on a loop that has nothing else ready (its
        ready queue is empty), rather than go round the loop to look again: a turn of
        asyncio's loop costs 2.4 µs on the development VM (uvloop's 0.9), an epoll_wait
        each, and a packet that lands after a look waits for the rest of the turn. The
        wait ends at the window's end, at SHM_SPIN_MAX, at the loop's next timer, or
        when its selector has an event (another fd, a thread's call_soon_threadsafe). A
        packet that readies nothing on the loop (an ACK) is taken and the wait goes on."""
        cdef double until, start = now
        cdef int found
        ready = self._loop_ready_queue
        timers = self._loop_timers
        while True:
            until = min(self._shm_last + self._shm_window, start + SHM_SPIN_MAX)
            if timers:
                until = min(until, now + (timers[0].when() - self._loop.time()))
            _lock_gil(&self.e)
            nic_shm_waiter(&self.e, 1)
            nic_unlock(&self.e)
            found = nic_shm_wait(&self.e, until, self._loop_selector_fd, SHM_SPIN_SELECTOR_EVERY)
            _lock_gil(&self.e)
            nic_shm_waiter(&self.e, 0)
            nic_unlock(&self.e)
            if found != 1:
                return
            now = nic_now()
            self.e.shm_poll_seen = now
            self._shm_last = now
            self._loop_service(0)
            if ready or not self._shm_polling or self._loop is None:
                return

    def _loop_ready(self):
        """The loop's reader callback (the socket, or the links' eventfd)."""
        self._loop_service(1)

    cdef _loop_service(self, bint woken):
        """Receive, hand completions over, then transmit (the ACKs leave with
        whatever the completion handlers posted)."""
        cdef int n
        # The GIL is kept: the socket is non-blocking, and dropping and taking it again
        # cost as much as the receive (the lock is taken as _lock_gil says).
        _lock_gil(&self.e)
        if woken and self.e.nlinks:
            nic_shm_clear_wake(&self.e)  # (the eventfd may be what woke the loop)
        n = nic_loop_receive(&self.e, nic_now(), woken)
        nic_unlock(&self.e)
        if self.e.nfire:
            # what the handlers (and the tasks a completion resumes) post meanwhile leaves
            # with the ACKs below, in one batch: eight connections' next requests are one
            # sendmmsg, not eight sendmsg calls. But where this receive resumed several
            # QPs and no other QP has work in flight, holding every next request to the
            # end would leave the peer idle while the tasks run, then this loop idle
            # while the peer serves them all: the first half leave as soon as they are
            # posted (NativeQP._post), and the peer serves them while the rest are made.
            # Two groups then alternate, each sent in one batch (docs/architecture.md).
            self.e.loop_dispatching = 1
            self.e.dispatch_kick_in = (n + 1) // 2 if n > 1 and self.e.busy_qps == 0 else 0
            try:
                self._fire()
            finally:
                self.e.loop_dispatching = 0
                self.e.dispatch_kick_in = 0
        if n or self.e.ndeferred:
            _lock_gil(&self.e)
            nic_flush_deferred(&self.e, nic_now())
            nic_unlock(&self.e)
            if self.e.nfire:
                self._fire()

    def _fire(self):
        """Raise the collected completion events: a channel whose dispatcher lives on
        this thread gets a direct call, the others their eventfd."""
        cdef nic_cq *local[16]
        cdef nic_cq **lst = local
        cdef size_t n, i
        cdef NativeChannel chobj
        if self.e.nfire == 0:  # (a racy peek: the lock holder only adds)
            return
        _lock_gil(&self.e)  # (nothing blocks under the lock: the GIL is kept)
        n = self.e.nfire
        if n > 16:
            lst = <nic_cq **>malloc(n * sizeof(nic_cq *))
        if lst != NULL and n:
            memcpy(lst, self.e.fire, n * sizeof(nic_cq *))
            self.e.nfire = 0
        nic_unlock(&self.e)
        if lst == NULL:
            raise MemoryError()
        me = PyThread_get_thread_ident()
        try:
            for i in range(n):
                if lst[i].ch.pyobj != NULL:
                    chobj = <NativeChannel>lst[i].ch.pyobj
                    if chobj._direct is not None and chobj._direct_thread == me and not chobj.closed:
                        drain = (<NativeCQ>lst[i].pyobj)._drain if lst[i].pyobj != NULL else None
                        if drain is not None:
                            try:
                                drain()
                            except Exception:
                                pass
                            continue
                        owner = (<NativeCQ>lst[i].pyobj)._facade if lst[i].pyobj != NULL else None
                        if owner is not None:
                            try:
                                chobj._direct(owner)
                            except Exception:
                                pass
                        continue
                nic_channel_notify(lst[i].ch, lst[i])
        finally:
            for i in range(n):
                nic_cq_unref(lst[i])
            if lst != local:
                free(lst)

    def set_tracer(self, tracer):
        cdef int on = tracer is not None
        with nogil:
            nic_lock(&self.e)
        try:
            self.tracer = tracer
            self._traced_wrs.clear()
            self.e.hooks.trace_datagram = _trace_datagram_cb
            self.e.hooks.trace_cqe = _trace_cqe_cb
            self.e.tracing = on
            if on:
                _set_qp_trace(&self.e, _trace_rc_cb, <void *>self)
            else:
                _set_qp_trace(&self.e, <rc_trace_fn>NULL, <void *>self)
        finally:
            nic_unlock(&self.e)

    def close(self):
        if self._closed:
            return
        self._closed = True
        self._detach_loop()  # a watched fd leaves its loop before it is closed
        with nogil:
            nic_close(&self.e)
        f = self._faults
        if f is not None:
            f._freeze((self.e.faults.dropped, self.e.faults.duplicated, self.e.faults.reordered))

    # ------------------------------------------------------- test hooks ----
    def _inject(self, datagram, src):
        """Process ``datagram`` as if it came from ``src`` = (ip, port) (tests)."""
        cdef sockaddr_storage ss
        cdef sockaddr_in *a4
        cdef sockaddr_in6 *a6
        memset(&ss, 0, sizeof(ss))
        ipb = src[0].encode()
        if ":" in src[0]:
            a6 = <sockaddr_in6 *>&ss
            a6.sin6_family = AF_INET6
            a6.sin6_port = htons(src[1])
            inet_pton(AF_INET6, ipb, &a6.sin6_addr)
        else:
            a4 = <sockaddr_in *>&ss
            a4.sin_family = AF_INET
            a4.sin_port = htons(src[1])
            inet_pton(AF_INET, ipb, &a4.sin_addr)
        data = bytes(datagram)
        with nogil:
            nic_lock(&self.e)
        try:
            nic_receive_one(&self.e, <const uint8_t *>PyBytes_AS_STRING(data), len(data), &ss, nic_now(), 0)
        finally:
            nic_unlock(&self.e)

    def _hold(self):
        """Take the engine lock (tests: the NIC thread cannot service meanwhile)."""
        with nogil:
            nic_lock(&self.e)

    def _release(self):
        nic_unlock(&self.e)

    def _service(self, bint readable=True):
        """One round of NIC work on this thread (tests)."""
        with nogil:
            nic_service(&self.e, readable)

    def _gso_probe(self, size_t seg, int count):
        """A GSO send the kernel refuses (oversized segments): whether GSO stayed on (tests)."""
        cdef int r
        with nogil:
            nic_lock(&self.e)
            r = nic_gso_send_probe(&self.e, seg, count)
            nic_unlock(&self.e)
        return bool(r)

    # ---------------------------------------------------------- tracing ----
    def _name_nic_thread(self):
        """Tracer events from the C NIC thread reach Python on a "Dummy-N" thread:
        give it the NIC thread's name (what the walk-through shows)."""
        t = _threading.current_thread()
        if isinstance(t, _threading._DummyThread) and t.name.startswith("Dummy"):
            t.name = f"aiordma-nic-{self.ip}:{self.port}"

    def _trace_posted(self, uint32_t qpn, wrs, int n):
        t = self.tracer
        if t is None:
            return
        seq = [wrs] if type(wrs) is SendWR else list(wrs)
        cdef nic_qp *q = nic_qp_find(&self.e, qpn)
        cdef send_wqe *w
        cdef uint32_t k, base
        if q == NULL:
            return
        base = q.rc.sq_len - <uint32_t>n
        for k in range(<uint32_t>n):
            wr = seq[k]
            w = sq_at(q.rc, base + k)
            self._traced_wrs[(qpn, w.wr_id)] = wr
            t(TraceEvent.WQE, qpn=qpn, wr=wr, psn=w.psn_first, npkts=w.npkts)
        t(TraceEvent.DOORBELL, qpn=qpn, n=len(seq))

    def _trace_datagram(self, str event, uint32_t qpn, bytes data, flow_obj):
        t = self.tracer
        if t is not None:
            self._name_nic_thread()
            t(TraceEvent(event), qpn=qpn, pkt=_wire.decode(data), datagram=data, flow=flow_obj)

    def _trace_cqe(self, wc):
        t = self.tracer
        if t is not None:
            self._name_nic_thread()
            t(TraceEvent.CQE, wc=wc)

    cdef _trace_rc(self, rc_qp *qp, const rc_trace *tr):
        t = self.tracer
        if t is None:
            return
        cdef int ev = tr.event
        cdef uint32_t qpn = qp.qp_num
        cdef int i
        self._name_nic_thread()
        if ev == TR_LKEY_READ:
            wr = self._traced_wrs.get((qpn, tr.wqe.wr_id))
            segs = [PyBytes_FromStringAndSize(<const char *>tr.wqe.segs[i].p, tr.wqe.segs[i].len)
                    for i in range(tr.wqe.nsegs)]
            t(TraceEvent.LKEY_READ, qpn=qpn, wqe=_WqeView(wr, segs), offset=tr.offset, length=tr.length)
        elif ev == TR_PACKET_OUT:
            t(TraceEvent.PACKET_OUT, qpn=qpn, pkt=_packet_obj(tr.pkt))
        elif ev == TR_RKEY_CHECK:
            t(TraceEvent.RKEY_CHECK, qpn=qpn, pkt=_packet_obj(tr.pkt), ok=bool(tr.ok),
              why=tr.why.decode("utf-8", "replace") if tr.why != NULL else None)
        elif ev == TR_DMA_WRITE:
            region = None
            if tr.region != NULL and (<mrbox *>tr.region.owner).pyobj != NULL:
                region = <object>(<mrbox *>tr.region.owner).pyobj
            t(TraceEvent.DMA_WRITE, qpn=qpn, pkt=_packet_obj(tr.pkt), region=region, offset=tr.offset, length=tr.length)
        elif ev == TR_ACK_IN:
            t(TraceEvent.ACK_IN, qpn=qpn, pkt=_packet_obj(tr.pkt))
