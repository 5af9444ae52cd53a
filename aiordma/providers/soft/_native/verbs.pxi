# The verbs objects of the engine protocol (providers/soft/engine.py): completion
# channel, CQ, MR, PD, SRQ and QP, over the NIC of nic.c.

cdef inline void _lock_gil(nic *e) noexcept:
    """Take the engine lock from a thread holding the GIL: without releasing the GIL
    when it is free (the common case), else with the GIL released while waiting (the
    NIC thread may need the GIL, for a tracer, while it holds the lock)."""
    if nic_trylock(e) != 0:
        with nogil:
            nic_lock(e)


# __dealloc__ uses the C objects of the attributes: the GC must not clear them first
@cython.no_gc_clear
cdef class NativeChannel:
    """A completion channel: an eventfd readable exactly while events are pending.
    It serves any number of CQs: each event names its CQ (``ibv_get_cq_event``)."""

    cdef nic_channel *ch
    cdef readonly bint closed
    cdef NativeEngine engine
    cdef object _direct
    cdef unsigned long _direct_thread
    #: the application posted or completed something: the event loop receives for this
    #: device for a while (no NIC-thread hop, no eventfd); NativeEngine.expect
    cdef public object expect_traffic

    def __cinit__(self, NativeEngine engine):
        self.engine = engine
        self.expect_traffic = engine.expect
        self.ch = nic_channel_new()
        if self.ch == NULL:
            raise OSError("cannot create a completion-channel eventfd")
        self.ch.pyobj = <void *>self

    def __dealloc__(self):
        if self.ch != NULL:
            self.ch.pyobj = NULL
            # closed first: its pending events hold their CQs, which hold the channel
            nic_channel_close(self.ch)
            nic_channel_unref(self.ch)
            self.ch = NULL

    def fileno(self):
        if self.closed:
            raise ValueError("the completion channel is closed")
        return self.ch.fd

    def get_cq_event(self):
        """The CQ object bound to the oldest pending event's CQ (the event is taken),
        or None when none is pending. Events of CQs gone since are skipped."""
        cdef nic_cq *cq
        while True:
            cq = nic_channel_get_event(self.ch)
            if cq == NULL:
                return None
            owner = (<NativeCQ>cq.pyobj)._facade if cq.pyobj != NULL else None
            nic_cq_unref(cq)
            if owner is not None:
                return owner

    def set_direct_handler(self, handler):
        """Events raised on this thread (the event loop's, where the engine receives
        while the application expects traffic) call ``handler(cq)`` instead of the
        eventfd, ``cq`` being what get_cq_event would have returned. The NIC thread's
        events always go through the eventfd."""
        self._direct = handler
        self._direct_thread = PyThread_get_thread_ident() if handler is not None else 0
        return True

    def close(self):
        if not self.closed:
            self.closed = True
            nic_channel_close(self.ch)


# __dealloc__ uses the C objects of the attributes: the GC must not clear them first
@cython.no_gc_clear
cdef class NativeCQ:
    """A completion queue in C; ``poll`` builds WorkCompletion objects."""

    cdef nic_cq *cq
    cdef NativeEngine engine
    cdef NativeChannel channel
    cdef readonly uint32_t cqe
    cdef bint _closed
    #: what the channel's get_cq_event returns for this CQ's events (the device's CQ)
    cdef object _facade
    #: called instead of the channel's direct handler for this CQ's events (set_drain_handler)
    cdef object _drain

    def __cinit__(self, NativeEngine engine, uint32_t cqe, NativeChannel channel=None):
        self.engine = engine
        self.channel = channel
        self.cqe = cqe
        with nogil:
            self.cq = nic_cq_new(&engine.e, cqe, channel.ch if channel is not None else NULL)
        if self.cq == NULL:
            raise MemoryError()
        self.cq.pyobj = <void *>self

    def __dealloc__(self):
        if self.cq != NULL:
            self.cq.pyobj = NULL
            nic_cq_unref(self.cq)
            self.cq = NULL

    def bind(self, facade):
        """Name what the channel returns for this CQ's events (None: nothing, and
        the two no longer keep each other alive)."""
        self._facade = facade

    @property
    def overflows(self):
        return self.cq.overflows

    def poll(self, int num_entries=16):
        """``ibv_poll_cq``: up to ``num_entries`` WorkCompletions, oldest first."""
        cdef rc_wc local[64]
        cdef rc_wc *buf = local
        cdef size_t n, i
        if num_entries <= 0:
            return []
        if num_entries > 64:
            buf = <rc_wc *>malloc(num_entries * sizeof(rc_wc))
            if buf == NULL:
                raise MemoryError()
        n = nic_cq_poll(self.cq, buf, num_entries)
        if n:
            # the completion may have been a deregistered region's last user (its
            # WQE ended on the NIC thread): let its buffer go now, not at some later close
            self.engine._reap()
        try:
            return [glue_make_wc(&buf[i]) for i in range(n)]
        finally:
            if buf != local:
                free(buf)

    def req_notify(self, solicited_only=False):
        nic_cq_req_notify(self.cq)

    def c_verbs(self):
        """(the cverbs capsule, this CQ): polled from C by the compiled core."""
        return (cverbs, self)

    def set_drain_handler(self, handler):
        """Events of this CQ raised on the thread of its channel's direct handler call
        ``handler()`` (no argument) instead of that handler: the compiled core drains
        it without the channel's dispatch in Python. None undoes it."""
        self._drain = handler
        return True

    def close(self):
        # the C CQ itself lives as long as a QP uses it (verbs forbid destroying it before)
        if not self._closed:
            self._closed = True
            _lock_gil(&self.engine.e)
            self.engine.e.ncqs -= 1
            nic_unlock(&self.engine.e)


# __dealloc__ uses the C objects of the attributes: the GC must not clear them first
@cython.no_gc_clear
cdef class NativeMR:
    """A region registered in place: the engine holds the caller's buffer (Py_buffer)
    while it is registered and while a work request still uses it."""

    cdef mr *m
    cdef NativePD pd
    cdef readonly uint64_t addr, length
    cdef readonly uint32_t lkey, rkey
    cdef readonly object access
    cdef object _view
    cdef bint _closed

    @property
    def view(self):
        return self._view

    def close(self):
        if self._closed:
            return
        self._closed = True
        cdef nic *e = &self.pd.engine.e
        with nogil:
            nic_lock(e)
            # the region may outlive this object (a WR in flight holds it): the tracer
            # must not find it through its owner any more
            (<mrbox *>self.m.owner).pyobj = NULL
            pd_remove(&self.pd.p, self.m)
            e.nmrs -= 1
            e.mr_bytes -= self.length
            nic_unlock(e)
        self.pd._mrs.pop(self.lkey, None)
        self.pd._by_rkey.pop(self.rkey, None)
        self.pd.engine._reap()

    def __dealloc__(self):
        if not self._closed and self.pd is not None and self.m != NULL:
            self.close()


# __dealloc__ uses the C objects of the attributes: the GC must not clear them first
@cython.no_gc_clear
cdef class NativePD:
    cdef pd p
    cdef NativeEngine engine
    cdef dict _mrs, _by_rkey

    def __cinit__(self, NativeEngine engine):
        self.engine = engine
        pd_init(&self.p)
        self.p.release = nic_pd_release
        self.p.release_ctx = &engine.e
        self._mrs = {}
        self._by_rkey = {}

    def reg_mr(self, buffer, access, uint32_t lkey, uint32_t rkey):
        cdef uint32_t acc = int(access)
        writable = bool(acc & 11)
        mv = _check_buffer(buffer, writable)
        cdef mr *m = _make_mr(buffer, writable, 0, 0, acc, lkey, rkey)
        cdef NativeMR obj = NativeMR.__new__(NativeMR)
        obj.m = m
        obj.pd = self
        obj.addr = m.addr
        obj.length = m.length
        obj.lkey = lkey
        obj.rkey = rkey
        obj.access = Access(acc)
        obj._view = mv
        (<mrbox *>m.owner).pyobj = <PyObject *>obj
        cdef nic *e = &self.engine.e
        cdef int r
        with nogil:
            nic_lock(e)
            r = pd_add(&self.p, m)
            if r == 0:
                e.nmrs += 1
                e.mr_bytes += m.length
            nic_unlock(e)
        if r < 0:
            obj._closed = True
            _free_mr(m)
            obj.m = NULL
            raise MemoryRegistrationError("lkey or rkey already in use in this protection domain")
        self._mrs[lkey] = obj
        self._by_rkey[rkey] = obj
        return obj

    def by_lkey(self, uint32_t lkey):
        return self._mrs.get(lkey)

    def by_rkey(self, uint32_t rkey):
        return self._by_rkey.get(rkey)

    def create_qp(self, uint32_t qp_num, NativeCQ send_cq, NativeCQ recv_cq, cap, bint sq_sig_all,
                  NativeSRQ srq=None):
        return NativeQP(self, qp_num, send_cq, recv_cq, cap, sq_sig_all, srq)

    def create_srq(self, uint32_t srq_num, uint32_t max_wr, uint32_t max_sge):
        return NativeSRQ(self, srq_num, max_wr, max_sge)

    def close(self):
        for mrobj in list(self._mrs.values()):
            mrobj.close()


# __dealloc__ uses the C objects of the attributes: the GC must not clear them first
@cython.no_gc_clear
cdef class NativeSRQ:
    """A shared receive queue (``ibv_srq``, rc.c's struct rc_srq): the responders of
    the QPs created with it take their receives from it, under the engine lock. Its
    limit event goes to the engine's async-event queue (NativeEngine.get_async_event)."""

    cdef rc_srq *s
    cdef NativeEngine engine
    cdef NativePD pd
    cdef readonly uint32_t srq_num, max_wr, max_sge

    def __cinit__(self, NativePD pd, uint32_t srq_num, uint32_t max_wr, uint32_t max_sge):
        self.pd = pd
        self.engine = pd.engine
        self.srq_num = srq_num
        self.max_wr = max_wr
        self.max_sge = max_sge
        cdef nic *e = &self.engine.e
        with nogil:
            nic_lock(e)
            self.s = nic_srq_new(e, srq_num, &pd.p, max_wr, max_sge)
            nic_unlock(e)
        if self.s == NULL:
            raise MemoryError()

    def __dealloc__(self):
        # (every QP created with it holds this object: none uses the C SRQ any more; were
        # one still to, the C SRQ is left allocated rather than freed under it)
        cdef nic *e = &self.engine.e
        if self.s == NULL:
            return
        with nogil:
            nic_lock(e)
            if self.s.users == 0:
                nic_srq_destroy(e, self.s)
            self.s = NULL
            nic_unlock(e)
        self.engine._reap()

    def post_recv(self, wrs):
        """``ibv_post_srq_recv``: one RecvWR or a sequence, in order."""
        cdef sge_in sges[16]
        cdef sge_in *sg = sges
        cdef int n, rc = 0, cap
        cdef uint64_t wr_id
        cdef nic *e = &self.engine.e
        cdef bint closed = False
        cdef char err[320]
        seq = (wrs,) if type(wrs) is RecvWR else wrs
        for wr in seq:
            if type(wr) is RecvWR:
                lst = <object>glue_slot(wr, _rw_off[1])
                wr_id = PyLong_AsUnsignedLongLongMask(<object>glue_slot(wr, _rw_off[0]))
            else:
                lst = wr.sg_list
                wr_id = PyLong_AsUnsignedLongLongMask(wr.wr_id)
            n = len(lst)
            if n > 16:
                sg = <sge_in *>malloc(n * sizeof(sge_in))
                if sg == NULL:
                    raise MemoryError()
            try:
                cap = n if n > 16 else 16
                n = _read_sges(lst, sg, cap)
                _sges_fit(n, cap)
                with nogil:
                    nic_lock(e)
                    if self.s == NULL:
                        closed = True
                    else:
                        rc = rc_srq_post_recv(self.s, wr_id, sg, n)
                        if rc:
                            strncpy(err, self.s.errmsg, 319)
                            err[319] = 0
                    nic_unlock(e)
            finally:
                if sg != sges:
                    free(sg)
                    sg = sges
            if closed:
                raise InvalidWorkRequestError("post_srq_recv on a destroyed shared receive queue")
            if rc:
                raise InvalidWorkRequestError(err.decode("utf-8", "replace"))

    def arm_limit(self, limit):
        """``ibv_modify_srq(IBV_SRQ_LIMIT)`` (0 disarms)."""
        cdef int64_t lim = _check_srq_limit(limit, self.max_wr)
        cdef nic *e = &self.engine.e
        cdef bint closed = False
        with nogil:
            nic_lock(e)
            if self.s == NULL:
                closed = True
            else:
                rc_srq_arm(self.s, lim)
            nic_unlock(e)
        if closed:
            raise InvalidWorkRequestError("modify_srq on a destroyed shared receive queue")

    def query(self):
        """``(max_wr, max_sge, srq_limit)``."""
        cdef uint32_t limit = 0
        cdef nic *e = &self.engine.e
        with nogil:
            nic_lock(e)
            if self.s != NULL:
                limit = self.s.limit
            nic_unlock(e)
        return self.max_wr, self.max_sge, limit

    def c_verbs(self):
        """(the cverbs capsule, this SRQ): receives reposted from C by the compiled core."""
        return (cverbs, self)

    @property
    def limit_events(self):
        """How many times the limit event fired."""
        return self.s.limit_events if self.s != NULL else 0

    @property
    def users(self):
        return self.s.users if self.s != NULL else 0

    def __len__(self):
        return self.s.len if self.s != NULL else 0

    def close(self):
        """``ibv_destroy_srq``: ResourceBusyError while QPs take their receives from it."""
        cdef nic *e = &self.engine.e
        cdef int users = 0
        with nogil:
            nic_lock(e)
            if self.s != NULL:
                users = self.s.users
                if users == 0:
                    nic_srq_destroy(e, self.s)
                    self.s = NULL
            nic_unlock(e)
        if users:
            raise _srq_busy_error(self.srq_num, users)
        self.engine._reap()


# __dealloc__ uses the C objects of the attributes: the GC must not clear them first
@cython.no_gc_clear
cdef class NativeQP:
    """An RC queue pair run by the NIC thread; posting sends its first packets inline."""

    cdef nic_qp *q
    cdef NativeEngine engine
    cdef NativePD pd
    cdef NativeCQ scq, rcq
    cdef NativeSRQ srq  # held: the C SRQ outlives every C QP that takes from it
    cdef readonly uint32_t qp_num
    cdef bint _closed
    cdef int _last_state

    def __cinit__(self, NativePD pd, uint32_t qp_num, NativeCQ send_cq, NativeCQ recv_cq, cap, bint sq_sig_all,
                  NativeSRQ srq=None):
        self.pd = pd
        self.engine = pd.engine
        self.scq = send_cq
        self.rcq = recv_cq
        self.srq = srq
        self.qp_num = qp_num
        cdef nic *e = &self.engine.e
        cdef uint32_t msw = cap.max_send_wr, mrw = cap.max_recv_wr, mss = cap.max_send_sge, mrs = cap.max_recv_sge
        cdef bint with_srq = srq is not None
        cdef bint srq_gone = False
        with nogil:
            nic_lock(e)
            if with_srq and srq.s == NULL:
                srq_gone = True
            else:
                self.q = nic_qp_new(e, qp_num, &pd.p, srq.s if with_srq else NULL, send_cq.cq, recv_cq.cq, msw, mrw,
                                    mss, mrs, sq_sig_all)
                if self.q != NULL and e.tracing:
                    self.q.rc.trace = _trace_rc_cb
                    self.q.rc.trace_ctx = <void *>self.engine
            nic_unlock(e)
        if srq_gone:
            raise QueuePairStateError("create_qp with a destroyed shared receive queue")
        if self.q == NULL:
            raise MemoryError()

    def __dealloc__(self):
        # (no method of this object runs any more: the struct can go)
        cdef nic *e = &self.engine.e
        cdef nic_qp *q = self.q
        if q == NULL:
            return
        self.q = NULL
        with nogil:
            nic_lock(e)
            nic_qp_destroy(q)
            nic_unlock(e)
        self.engine._reap()

    cdef void _destroy(self) noexcept:
        # Closed under the lock, freed in __dealloc__: another thread may have fetched
        # self.q and be waiting for the lock (every method checks q.closed once it holds it).
        cdef nic *e = &self.engine.e
        cdef nic_qp *q = self.q
        with nogil:
            nic_lock(e)
            if not q.closed:
                self._last_state = q.rc.state
                nic_qp_close(q)
            nic_unlock(e)
        self._closed = True
        self.engine._reap()

    @property
    def state(self):
        cdef nic *e = &self.engine.e
        cdef int st
        if self._closed:
            return _QPSTATE[self._last_state]
        _lock_gil(e)
        st = self._last_state if self.q.closed else self.q.rc.state
        nic_unlock(e)
        return _QPSTATE[st]

    @property
    def error_reason(self):
        cdef nic *e = &self.engine.e
        if self._closed:
            return None
        _lock_gil(e)
        try:
            if self.q.closed or not self.q.rc.has_error_reason:
                return None
            return self.q.rc.error_reason.decode("utf-8", "replace")
        finally:
            nic_unlock(e)

    @property
    def counters(self):
        cdef nic *e = &self.engine.e
        cdef uint64_t v[16]
        cdef bint closed = self._closed
        if not closed:
            with nogil:
                nic_lock(e)
                closed = self.q.closed
                if not closed:
                    rc_counter_values(self.q.rc, v)
                nic_unlock(e)
        if closed:
            return {}
        return {rc_counter_names[i].decode(): v[i] for i in range(RC_NCOUNTERS)}

    def use_cma(self, int peer_pid, bint respond):
        """Cross-memory attach toward a peer on this host (rc.h): with
        ``peer_pid`` > 0 this requester takes the peer's grants and copies READ
        bytes out of that process; with ``respond`` its responder answers the
        peer's large READs with grants. 0 / False turn either off."""
        if self._closed:
            raise QueuePairStateError("QP is destroyed")
        cdef nic *e = &self.engine.e
        with nogil:
            nic_lock(e)
            if not self.q.closed:
                self.q.rc.cma_peer_pid = peer_pid if peer_pid > 0 else 0
                self.q.rc.cma_respond = 1 if respond else 0
            nic_unlock(e)

    def use_link(self, uint64_t link_id, bint tx):
        """Take the peer's packets from shared-memory link ``link_id`` (nic_shm.c)
        and, with ``tx``, send through it."""
        if self._closed:
            raise QueuePairStateError("QP is destroyed")
        cdef nic *e = &self.engine.e
        cdef int r
        with nogil:
            nic_lock(e)
            r = -1 if self.q.closed else nic_qp_use_link(self.q, link_id, 1 if tx else 0)
            nic_unlock(e)
        if r < 0:
            raise QueuePairStateError(f"no shared-memory link {link_id:#x} on this device")

    def modify(self, attr, peer, mtu_bytes, skip_icrc=False):
        if self._closed:
            raise QueuePairStateError("QP is destroyed")
        cdef rc_attr a
        _read_attr(attr, &a)
        cdef nic *e = &self.engine.e
        cdef nic_qp *q = self.q
        cdef int rc = 0, bad_peer = 0
        cdef uint32_t jumbo = mtu_bytes or 0
        cdef bytes ip = peer[0].encode() if peer is not None else b""
        cdef int port = peer[1] if peer is not None else 0
        cdef const char *ipc = ip
        cdef bint has_peer = peer is not None
        cdef bint skip = bool(skip_icrc)
        # the address vector's IP header fields (the kernel writes them on every datagram)
        cdef int tclass = (attr.traffic_class or 0) & 0xFF
        cdef int hop_limit = (attr.hop_limit or 0) & 0xFF
        cdef uint32_t w
        cdef bint closed = False
        cdef char err[320]
        with nogil:
            nic_lock(e)
            if q.closed:
                closed = True
            elif has_peer and nic_qp_set_peer(q, ipc, port) < 0:
                bad_peer = 1
            else:
                if has_peer:
                    nic_qp_set_path(q, tclass, hop_limit)
                rc = rc_modify(q.rc, &a, nic_now())
                if rc == 0 and a.qp_state == QPS_RTR:
                    q.skip_icrc = 1 if skip else 0
                    if jumbo:
                        q.rc.mtu = jumbo
                    # keep about 2 MiB in flight whatever the MTU (the receiver's socket buffer is 8 MiB)
                    w = (2 << 20) // q.rc.mtu
                    q.rc.window_pkts = 16 if w < 16 else (256 if w > 256 else w)
                if rc:
                    _copy_errmsg(err, q.rc)
                nic_flush(e, q, nic_now())
            nic_unlock(e)
        if closed:
            raise QueuePairStateError("QP is destroyed")
        self.engine._fire()
        self.engine._reap()
        if bad_peer:
            raise QueuePairStateError(f"cannot reach {peer!r} from this soft device ({self.engine.ip})")
        if rc:
            _raise_rc(err, rc)

    def post_send(self, wrs):
        """``ibv_post_send``: the WQEs go to the RC engine and the first packets out
        on this thread (the GIL released), before it returns."""
        cdef send_wr_in one
        cdef sge_in sges1[16]
        cdef send_wr_in *ws = &one
        cdef sge_in *sg = sges1
        cdef int n, i
        cdef Py_ssize_t total = 0
        cdef Py_ssize_t cap
        if self._closed:
            raise QueuePairStateError("post_send on a destroyed QP")
        if type(wrs) is SendWR:
            _read_send_wr(wrs, &one, sges1, 16)
            if one.nsge > 16:
                cap = one.nsge
                sg = <sge_in *>malloc(cap * sizeof(sge_in))
                if sg == NULL:
                    raise MemoryError()
                try:
                    _read_send_wr(wrs, &one, sg, cap)
                    _sges_fit(one.nsge, cap)
                except BaseException:
                    free(sg)
                    raise
            n = 1
            wrs_seq = None
        else:
            wrs_seq = wrs if isinstance(wrs, (list, tuple)) else list(wrs)
            n = len(wrs_seq)
            ws = <send_wr_in *>malloc(max(n, 1) * sizeof(send_wr_in))
            total = 0
            for w in wrs_seq:
                total += len(w.sg_list)
            sg = <sge_in *>malloc(max(total, 1) * sizeof(sge_in))
            if ws == NULL or sg == NULL:
                free(ws)
                free(sg)
                raise MemoryError()
            cap = total
            total = 0
            try:
                for i in range(n):
                    _read_send_wr(wrs_seq[i], &ws[i], sg + total, cap - total)
                    _sges_fit(ws[i].nsge, cap - total)
                    total += ws[i].nsge
            except BaseException:
                free(ws)
                free(sg)
                raise
        try:
            self._post(ws, n, wrs if wrs_seq is None else wrs_seq)
        finally:
            if ws != &one:
                free(ws)
            if sg != sges1:
                free(sg)

    cdef int _post(self, send_wr_in *ws, int n, object traced) except -1:
        """Post ``n`` linked work requests read into ``ws`` (``traced``: the SendWR
        objects the tracer is shown; built from ``ws`` when None and tracing)."""
        cdef int i, rc = 0, failed = -1
        cdef nic *e = &self.engine.e
        cdef nic_qp *q
        cdef double now, t
        cdef bint closed = False, defer = False, dispatching = False, kick = False
        cdef char err[320]
        if self._closed:
            raise QueuePairStateError("post_send on a destroyed QP")
        q = self.q
        tracing = e.tracing
        if tracing and traced is None:
            traced = [_send_wr_object(&ws[i]) for i in range(n)]
        # Doorbell batching: a post to a QP that already has work in flight, made on the
        # thread of the loop the engine is attached to, is transmitted at the end of this
        # loop iteration with every other such post (one GSO send / sendmmsg for all);
        # a post to an idle QP leaves at once (the latency path).
        # A post made while the loop hands out what it received (e.loop_dispatching) leaves
        # with that callback's own flush, right after: an answer goes with its ACK, and
        # requests go together. Where that dispatch split its posts (_loop_ready: it
        # resumed several QPs and nothing else was in flight), the post that completes
        # the first half sends them at once, with every ACK due so far.
        if not tracing and self.engine._loop_thread == PyThread_get_thread_ident():
            _lock_gil(e)  # no system call follows if it defers: keep the GIL
            if not q.closed and (q.rc.sq_len > 0 or e.loop_dispatching):
                if e.dispatch_kick_in:
                    e.dispatch_kick_in -= 1
                    kick = e.dispatch_kick_in == 0
                defer = True
                now = nic_now()
                for i in range(n):
                    rc = rc_post_send(q.rc, &ws[i], now)
                    if rc:
                        _copy_errmsg(err, q.rc)
                        break
                if e.loop_dispatching:
                    nic_defer_flush(e, q)
                    dispatching = True
                    if kick and not rc:
                        e.counters[NC_TX_KICKS] += 1
                        nic_flush_deferred(e, now)
            nic_unlock(e)
        if not defer and not tracing:
            # the latency path keeps the GIL (a non-blocking send; see _loop_ready)
            _lock_gil(e)
            if q.closed:
                closed = True
            else:
                now = nic_now()
                for i in range(n):
                    rc = rc_post_send(q.rc, &ws[i], now)
                    if rc:
                        _copy_errmsg(err, q.rc)
                        break
                e.counters[NC_TX_INLINE] += 1
                nic_flush(e, q, now)
                t = rc_next_timer(q.rc)
                nic_timer_armed(e, t)
            nic_unlock(e)
        elif not defer:
            with nogil:
                nic_lock(e)
                if q.closed:
                    closed = True
                else:
                    now = nic_now()
                    for i in range(n):
                        rc = rc_post_send(q.rc, &ws[i], now)
                        if rc:
                            failed = i
                            _copy_errmsg(err, q.rc)
                            break
                    if tracing:
                        with gil:
                            self.engine._trace_posted(self.qp_num, traced, n if failed < 0 else failed)
                    e.counters[NC_TX_INLINE] += 1
                    nic_flush(e, q, now)
                    t = rc_next_timer(q.rc)
                    nic_timer_armed(e, t)
                nic_unlock(e)
        if closed:
            raise QueuePairStateError("post_send on a destroyed QP")
        if defer and not dispatching:
            self.engine._defer_flush(self.qp_num)
        if e.nfire and not dispatching:  # (a dispatch raises its own after its flush)
            self.engine._fire()
        if rc:
            _raise_rc(err, rc)
        return 0

    def post_recv(self, wrs):
        cdef sge_in sges[16]
        cdef sge_in *sg = sges
        cdef int n, rc = 0
        cdef uint64_t wr_id
        cdef nic *e = &self.engine.e
        cdef nic_qp *q
        cdef bint closed = False
        cdef char err[320]
        cdef int cap
        if self._closed:
            raise QueuePairStateError("post_recv on a destroyed QP")
        seq = (wrs,) if type(wrs) is RecvWR else wrs
        q = self.q
        for wr in seq:
            if type(wr) is RecvWR:
                lst = <object>glue_slot(wr, _rw_off[1])
                wr_id = PyLong_AsUnsignedLongLongMask(<object>glue_slot(wr, _rw_off[0]))
            else:
                lst = wr.sg_list
                wr_id = PyLong_AsUnsignedLongLongMask(wr.wr_id)
            n = len(lst)
            if n > 16:
                sg = <sge_in *>malloc(n * sizeof(sge_in))
                if sg == NULL:
                    raise MemoryError()
            try:
                cap = n if n > 16 else 16
                n = _read_sges(lst, sg, cap)
                _sges_fit(n, cap)
                with nogil:
                    nic_lock(e)
                    if q.closed:
                        closed = True
                    else:
                        rc = rc_post_recv(q.rc, wr_id, sg, n)
                        if rc:
                            _copy_errmsg(err, q.rc)
                        if q.rc.nwcs:  # a receive posted in IBV_QPS_ERR is flushed at once
                            nic_flush(e, q, nic_now())
                    nic_unlock(e)
                if e.nfire:
                    self.engine._fire()
            finally:
                if sg != sges:
                    free(sg)
                    sg = sges
            if closed:
                raise QueuePairStateError("post_recv on a destroyed QP")
            if rc:
                _raise_rc(err, rc)

    def c_verbs(self):
        """(the cverbs capsule, this QP): posted to from C by the compiled core."""
        return (cverbs, self)

    def query(self):
        if self._closed:
            raise QueuePairStateError("QP is destroyed")
        cdef nic *e = &self.engine.e
        _lock_gil(e)
        try:
            if self.q.closed:
                raise QueuePairStateError("QP is destroyed")
            return _query(self.q.rc)
        finally:
            nic_unlock(e)

    def close(self):
        if not self._closed:
            self._destroy()

