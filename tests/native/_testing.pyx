# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
"""The RC core of the native engine without its NIC, for the tests (not shipped).

rc.c's queue pair driven sans-IO, like :class:`~aiordma.providers.soft.rc.RCQueuePair`:
the differential tests (tests/unit/test_differential.py, through
tests/unit/rc_harness.py) run it and the Python engine on the same scripts and
compare every datagram, completion and byte of memory. :class:`SansIOMemory` is
its protection domain over caller buffers at made-up virtual addresses,
:class:`RCCore` one queue pair, :class:`SansIOSRQ` a shared receive queue
(rc.c's struct rc_srq, like :class:`~aiordma.providers.soft.srq.RCSharedReceiveQueue`).

A module of its own, not part of ``aiordma.providers.soft._native._engine``:
setup.py builds it only in place (``build_ext --inplace``, ``pip install -e``), so
wheels never carry it, and the sdist carries no tests/. It compiles its own copy of
wire.c, crc32.c and rc.c, and the binding's shared files (the conversions between
Python and C objects, registered memory) are included from the engine's sources:
what it runs is the code the engine runs.
"""

include "aiordma/providers/soft/_native/common.pxi"
include "aiordma/providers/soft/_native/convert.pxi"
include "aiordma/providers/soft/_native/memory.pxi"


# __dealloc__ uses the C objects of the attributes: the GC must not clear them first
@cython.no_gc_clear
cdef class SansIOMemory:
    """A protection domain for :class:`RCCore` over caller buffers at made-up
    virtual addresses (the in-memory harness's FakeMemory, in C)."""

    cdef pd pd
    cdef zombie_list zl
    cdef dict _mrs  # lkey -> capsule-ish int address of the mr

    def __cinit__(self):
        pd_init(&self.pd)
        memset(&self.zl, 0, sizeof(zombie_list))
        self.pd.release = zombie_release
        self.pd.release_ctx = &self.zl
        self._mrs = {}

    def register(self, uint64_t addr, buffer, uint32_t access, uint32_t lkey, uint32_t rkey):
        """Register ``buffer`` (used in place) as ``[addr, addr + len)`` with these keys."""
        writable = bool(access & 11)
        _check_buffer(buffer, writable, True)
        cdef mr *m = _make_mr(buffer, writable, addr, 1, access, lkey, rkey)
        if pd_add(&self.pd, m) < 0:
            _free_mr(m)
            raise ValueError("lkey or rkey already registered")
        self._mrs[lkey] = <size_t>m

    def deregister(self, uint32_t lkey):
        cdef mr *m
        v = self._mrs.pop(lkey, None)
        if v is None:
            return
        m = <mr *><size_t>v
        pd_remove(&self.pd, m)
        self._reap()

    cdef void _reap(self) noexcept:
        cdef size_t i
        for i in range(self.zl.n):
            _free_mr(self.zl.v[i])
        self.zl.n = 0

    def __dealloc__(self):
        for v in self._mrs.values():
            pd_remove(&self.pd, <mr *><size_t>v)
        self._reap()
        free(self.zl.v)


# __dealloc__ uses the C objects of the attributes: the GC must not clear them first
@cython.no_gc_clear
cdef class SansIOSRQ:
    """A shared receive queue of rc.c over a :class:`SansIOMemory`, driven like
    :class:`~aiordma.providers.soft.srq.RCSharedReceiveQueue` (``post_recv``,
    ``arm``; ``limit``, ``limit_events``, ``users``, ``len()``). Its limit event
    is only counted (no NIC queues it)."""

    cdef rc_srq *s
    cdef SansIOMemory mem

    def __cinit__(self, uint32_t srq_num, SansIOMemory mem, uint32_t max_wr, uint32_t max_sge):
        self.mem = mem
        self.s = rc_srq_create(srq_num, &mem.pd, max_wr, max_sge)
        if self.s == NULL:
            raise MemoryError()

    def __dealloc__(self):
        if self.s != NULL:
            rc_srq_destroy(self.s)
            self.s = NULL
        if self.mem is not None:
            self.mem._reap()

    def post_recv(self, wr):
        cdef int n = len(wr.sg_list)
        cdef sge_in *sges = <sge_in *>malloc(max(n, 1) * sizeof(sge_in))
        cdef int rc
        if sges == NULL:
            raise MemoryError()
        try:
            m = _read_sges(wr.sg_list, sges, n)
            _sges_fit(m, n)
            rc = rc_srq_post_recv(self.s, PyLong_AsUnsignedLongLongMask(wr.wr_id), sges, m)
        finally:
            free(sges)
        if rc:
            raise InvalidWorkRequestError(self.s.errmsg.decode("utf-8", "replace"))

    def arm(self, limit):
        rc_srq_arm(self.s, _check_srq_limit(limit, self.s.max_wr))

    @property
    def srq_num(self):
        return self.s.srq_num

    @property
    def limit(self):
        return self.s.limit

    @property
    def limit_events(self):
        return self.s.limit_events

    @property
    def users(self):
        return self.s.users

    def __len__(self):
        return self.s.len


# __dealloc__ uses the C objects of the attributes: the GC must not clear them first
@cython.no_gc_clear
cdef class RCCore:
    """One RC queue pair of the C engine, driven sans-IO like :class:`RCQueuePair`:
    ``post_send``/``post_recv``, ``receive_datagram(data, now)``, ``transmit(now)``
    (datagrams encoded on the flow given to :meth:`set_flow`), ``take_completions``,
    ``next_timer``/``on_timer``. For the differential tests."""

    cdef rc_qp *qp
    cdef SansIOMemory mem
    cdef SansIOSRQ srq  # held: the C SRQ outlives the C QP
    cdef flow txflow
    cdef rc_out out
    cdef public object tracer

    def __cinit__(self, uint32_t qp_num, SansIOMemory mem, cap, bint sq_sig_all=False, SansIOSRQ srq=None):
        self.mem = mem
        self.srq = srq
        self.qp = rc_create_ex(qp_num, &mem.pd, srq.s if srq is not None else NULL, cap.max_send_wr,
                               cap.max_recv_wr, cap.max_send_sge, cap.max_recv_sge, sq_sig_all)
        if self.qp == NULL:
            raise MemoryError()
        memset(&self.out, 0, sizeof(rc_out))
        memset(&self.txflow, 0, sizeof(flow))

    def close(self):
        """``ibv_destroy_qp``: the SRQ may be destroyed after."""
        if self.qp != NULL:
            rc_destroy(self.qp)
            self.qp = NULL
        self.mem._reap()

    def __dealloc__(self):
        if self.qp != NULL:
            rc_destroy(self.qp)
            self.qp = NULL
        rc_out_free(&self.out)
        if self.mem is not None:
            self.mem._reap()

    def set_flow(self, pyflow):
        _set_flow(&self.txflow, pyflow)

    def modify(self, attr, double now=0.0):
        cdef rc_attr a
        _read_attr(attr, &a)
        cdef int rc = rc_modify(self.qp, &a, now)
        self.mem._reap()
        if rc:
            _raise_rc(self.qp.errmsg, rc)

    def post_send(self, wr, double now=0.0):
        cdef send_wr_in w
        cdef int n = len(wr.sg_list)
        cdef sge_in *sges = <sge_in *>malloc(max(n, 1) * sizeof(sge_in))
        cdef int rc
        if sges == NULL:
            raise MemoryError()
        try:
            _read_send_wr(wr, &w, sges, n)
            _sges_fit(w.nsge, n)
            rc = rc_post_send(self.qp, &w, now)
        finally:
            free(sges)
        if rc:
            _raise_rc(self.qp.errmsg, rc)

    def post_recv(self, wr):
        cdef int n = len(wr.sg_list)
        cdef sge_in *sges = <sge_in *>malloc(max(n, 1) * sizeof(sge_in))
        cdef int rc
        if sges == NULL:
            raise MemoryError()
        try:
            m = _read_sges(wr.sg_list, sges, n)
            _sges_fit(m, n)
            rc = rc_post_recv(self.qp, PyLong_AsUnsignedLongLongMask(wr.wr_id), sges, m)
        finally:
            free(sges)
        if rc:
            _raise_rc(self.qp.errmsg, rc)

    def receive_datagram(self, datagram, double now):
        """Decode (C) and receive one datagram; the decode error's reason, or None."""
        cdef pkt p
        data = bytes(datagram)
        cdef int err = wire_decode(<const uint8_t *>PyBytes_AS_STRING(data), len(data), &p)
        if err:
            return wire_error_name(err).decode()
        rc_receive(self.qp, &p, now)
        self.mem._reap()
        return None

    def transmit(self, double now):
        """The datagrams to send now, encoded on the flow (ICRC included)."""
        cdef size_t i
        self.out.n = 0
        rc_transmit(self.qp, now, &self.out)
        out = []
        for i in range(self.out.n):
            b = PyBytes_FromStringAndSize(NULL, wire_datagram_length(&self.out.pkts[i]))
            wire_encode(&self.out.pkts[i], &self.txflow, self.txflow.ip_id, <uint8_t *>PyBytes_AS_STRING(b))
            out.append(b)
        rc_out_clear(&self.out)
        self.mem._reap()
        return out

    def take_completions(self):
        cdef size_t i
        out = []
        for i in range(self.qp.nwcs):
            out.append((bool(self.qp.wcs[i].is_recv), glue_make_wc(&self.qp.wcs[i])))
        self.qp.nwcs = 0
        return out

    def next_timer(self):
        cdef double t = rc_next_timer(self.qp)
        return None if t < 0 else t

    def on_timer(self, double now):
        rc_on_timer(self.qp, now)
        self.mem._reap()

    def query(self):
        return _query(self.qp)

    @property
    def qp_num(self):
        return self.qp.qp_num

    @property
    def state(self):
        return _QPSTATE[self.qp.state]

    @property
    def error_reason(self):
        return self.qp.error_reason.decode("utf-8", "replace") if self.qp.has_error_reason else None

    @property
    def counters(self):
        return _counters_of(self.qp)

    @property
    def window_pkts(self):
        return self.qp.window_pkts

    @window_pkts.setter
    def window_pkts(self, uint32_t v):
        self.qp.window_pkts = v

    @property
    def mtu(self):
        return self.qp.mtu

    @mtu.setter
    def mtu(self, uint32_t v):
        self.qp.mtu = v

    @property
    def sq_len(self):
        return self.qp.sq_len

    @property
    def rq_len(self):
        return self.qp.rq_len

    @property
    def next_psn(self):
        return self.qp.next_psn

    @property
    def una_psn(self):
        return self.qp.una_psn

    @property
    def epsn(self):
        return self.qp.epsn

    @property
    def cur_recv_offset(self):
        return self.qp.cur_recv_offset

    @property
    def has_cur_write(self):
        return bool(self.qp.has_cur_write)

    def sq_info(self):
        """(wr_id, psn_first, npkts, resp_pkts, req_pkts) of each send-queue WQE, oldest first."""
        cdef send_wqe *w
        out = []
        for i in range(self.qp.sq_len):
            w = sq_at(self.qp, i)
            out.append((w.wr_id, w.psn_first, w.npkts, w.resp_pkts, w.req_pkts))
        return out
