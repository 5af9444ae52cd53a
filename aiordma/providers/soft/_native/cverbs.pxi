# The verbs as C calls (aiordma/cverbs.h) over this engine's QPs and CQs: what the
# compiled core (aiordma._core) posts and polls through, with no SendWR, SGE or
# WorkCompletion object per operation. The same work as NativeQP.post_send/post_recv
# and NativeCQ.poll/req_notify, minus the Python objects.

from cpython.pycapsule cimport PyCapsule_New

from aiordma.cverbs cimport (
    CVERBS_CAPSULE,
    CVERBS_MAX_SGE,
    CVERBS_VERSION,
    cverbs_ops,
    cverbs_send_wr,
    cverbs_sge,
    cverbs_wc,
)


cdef object _send_wr_object(const send_wr_in *w):
    """A SendWR equal to ``w`` (what the tracer is shown for a request posted from C)."""
    sges = [SGE(w.sges[i].addr, w.sges[i].length, w.sges[i].lkey) for i in range(w.nsge)]
    return SendWR(w.wr_id, w.opcode, sges, w.send_flags, w.imm if w.has_imm else None,
                  w.remote_addr, w.rkey, w.compare_add, w.swap)


cdef int _cv_post_send(void *qp, const cverbs_send_wr *wrs, int n) except -1:
    cdef NativeQP q = <NativeQP>qp
    cdef send_wr_in local[16]
    cdef send_wr_in *ws = local
    cdef int i
    if n <= 0:
        return 0
    if n > 16:
        ws = <send_wr_in *>malloc(n * sizeof(send_wr_in))
        if ws == NULL:
            raise MemoryError()
    try:
        for i in range(n):
            if wrs[i].num_sge < 0 or wrs[i].num_sge > CVERBS_MAX_SGE:
                raise InvalidWorkRequestError(f"{wrs[i].num_sge} SGEs: a work request carries 0 .. {CVERBS_MAX_SGE}")
            ws[i].wr_id = wrs[i].wr_id
            ws[i].opcode = wrs[i].opcode
            ws[i].send_flags = wrs[i].send_flags
            ws[i].has_imm = wrs[i].has_imm
            ws[i].imm = wrs[i].imm_data
            ws[i].remote_addr = wrs[i].remote_addr
            ws[i].rkey = wrs[i].rkey
            ws[i].compare_add = wrs[i].compare_add
            ws[i].swap = wrs[i].swap
            ws[i].nsge = wrs[i].num_sge
            # (struct cverbs_sge and struct sge_in: one layout, checked at import)
            ws[i].sges = <const sge_in *>wrs[i].sg_list
        q._post(ws, n, None)
    finally:
        if ws != local:
            free(ws)
    return 0


cdef int _cv_post_recv(void *qp, uint64_t wr_id, const cverbs_sge *sges, int nsge) except -1:
    cdef NativeQP q = <NativeQP>qp
    cdef nic *e = &q.engine.e
    cdef nic_qp *c
    cdef int rc = 0
    cdef bint closed = False
    cdef char err[320]
    if q._closed:
        raise QueuePairStateError("post_recv on a destroyed QP")
    if nsge < 0 or nsge > CVERBS_MAX_SGE:
        raise InvalidWorkRequestError(f"{nsge} SGEs: a receive request carries 0 .. {CVERBS_MAX_SGE}")
    c = q.q
    _lock_gil(e)  # (no system call unless the QP is in error: the GIL is kept)
    if c.closed:
        closed = True
    else:
        rc = rc_post_recv(c.rc, wr_id, <const sge_in *>sges, nsge)
        if rc:
            _copy_errmsg(err, c.rc)
        if c.rc.nwcs:  # a receive posted in IBV_QPS_ERR is flushed at once
            nic_flush(e, c, nic_now())
    nic_unlock(e)
    if e.nfire:
        q.engine._fire()
    if closed:
        raise QueuePairStateError("post_recv on a destroyed QP")
    if rc:
        _raise_rc(err, rc)
    return 0


cdef int _cv_post_srq_recv(void *srq, uint64_t wr_id, const cverbs_sge *sges, int nsge) except -1:
    """``ibv_post_srq_recv`` of one request (NativeSRQ.post_recv without the RecvWR)."""
    cdef NativeSRQ q = <NativeSRQ>srq
    cdef nic *e = &q.engine.e
    cdef int rc = 0
    cdef bint closed = False
    cdef char err[320]
    if nsge < 0 or nsge > CVERBS_MAX_SGE:
        raise InvalidWorkRequestError(f"{nsge} SGEs: a receive request carries 0 .. {CVERBS_MAX_SGE}")
    _lock_gil(e)
    if q.s == NULL:
        closed = True
    else:
        rc = rc_srq_post_recv(q.s, wr_id, <const sge_in *>sges, nsge)
        if rc:
            strncpy(err, q.s.errmsg, 319)
            err[319] = 0
    nic_unlock(e)
    if closed:
        raise InvalidWorkRequestError("post_srq_recv on a destroyed shared receive queue")
    if rc:
        raise InvalidWorkRequestError(err.decode("utf-8", "replace"))
    return 0


cdef int _cv_poll_cq(void *cq, cverbs_wc *wcs, int n) except -1:
    cdef NativeCQ c = <NativeCQ>cq
    cdef rc_wc buf[64]
    cdef size_t k, i
    if n <= 0:
        return 0
    if n > 64:
        n = 64
    k = nic_cq_poll(c.cq, buf, n)
    if k:
        # the completion may have been a deregistered region's last user (see NativeCQ.poll)
        c.engine._reap()
    for i in range(k):
        wcs[i].wr_id = buf[i].wr_id
        wcs[i].byte_len = buf[i].byte_len
        wcs[i].qp_num = buf[i].qp_num
        wcs[i].src_qp = buf[i].src_qp
        wcs[i].imm_data = buf[i].imm
        wcs[i].vendor_err = 0
        wcs[i].status = buf[i].status
        wcs[i].has_imm = buf[i].has_imm
        wcs[i].opcode = buf[i].opcode
    return <int>k


cdef int _cv_req_notify_cq(void *cq) except -1:
    nic_cq_req_notify((<NativeCQ>cq).cq)
    return 0


cdef void _cv_expect(void *cq) noexcept:
    """NativeEngine.expect, for the engine of this CQ."""
    cdef NativeEngine engine = (<NativeCQ>cq).engine
    if engine._loop is None:
        return
    if engine.e.nlinks:
        engine._shm_expect()
    if engine.e.loop_owns:
        engine.e.window_deadline = nic_now() + engine.e.window_len
        return
    _lock_gil(&engine.e)
    nic_expect(&engine.e, nic_now())
    nic_unlock(&engine.e)


cdef cverbs_ops _CVERBS_OPS
_CVERBS_OPS.version = CVERBS_VERSION
_CVERBS_OPS.post_send = _cv_post_send
_CVERBS_OPS.post_recv = _cv_post_recv
_CVERBS_OPS.poll_cq = _cv_poll_cq
_CVERBS_OPS.req_notify_cq = _cv_req_notify_cq
_CVERBS_OPS.expect = _cv_expect
_CVERBS_OPS.post_srq_recv = _cv_post_srq_recv

# (the offsets measured on two instances: a member of a null pointer is undefined, UBSan says)
cdef cverbs_sge _cv_sge_probe
cdef sge_in _sge_in_probe
if sizeof(cverbs_sge) != sizeof(sge_in) or (
    (<char *>&_cv_sge_probe.lkey - <char *>&_cv_sge_probe) != (<char *>&_sge_in_probe.lkey - <char *>&_sge_in_probe)
):
    raise ImportError("struct cverbs_sge and struct sge_in differ: rebuild the native engine")

#: the function table (a PyCapsule named aiordma.cverbs.v2) the compiled core calls
cverbs = PyCapsule_New(<void *>&_CVERBS_OPS, CVERBS_CAPSULE, NULL)
