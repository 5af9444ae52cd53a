# Python objects to C structs and back: the work requests of providers/base.py,
# QP attributes, the errors of a failed verbs call, wire.Flow and wire.Packet.
# Shared with the test-only RC core (tests/native/_testing.pyx).

# --------------------------------------------------- reading work requests ----

cdef inline object _field(object o, Py_ssize_t off, str name):
    cdef PyObject *v = glue_slot(o, off)
    if v == NULL:
        return getattr(o, name)
    return <object>v


cdef uint32_t _u32(object v, str what) except? 0xFFFFFFFF:
    cdef long long x = v
    if x < 0 or x > 0xFFFFFFFF:
        raise InvalidWorkRequestError(f"{what} {v} does not fit 32 bits")
    return <uint32_t>x


cdef int _read_sges(object sg_list, sge_in *out, int cap) except -1:
    """Fill out[] from a sequence of SGE; returns the count (all of them, even past cap:
    a caller that did not size out[] from this count checks it with _sges_fit)."""
    cdef tuple seq = sg_list if type(sg_list) is tuple else tuple(sg_list)
    cdef int n = len(seq)
    cdef int i = 0
    cdef object s
    for s in seq:
        if i < cap:
            if type(s) is SGE:
                out[i].addr = PyLong_AsUnsignedLongLongMask(_field(s, _sge_off[0], "addr"))
                out[i].length = _u32(_field(s, _sge_off[1], "length"), "SGE length")
                out[i].lkey = <uint32_t>PyLong_AsUnsignedLongLongMask(_field(s, _sge_off[2], "lkey"))
            else:
                out[i].addr = PyLong_AsUnsignedLongLongMask(s.addr)
                out[i].length = _u32(s.length, "SGE length")
                out[i].lkey = <uint32_t>PyLong_AsUnsignedLongLongMask(s.lkey)
        i += 1
    return n


cdef inline int _sges_fit(int count, int cap) except -1:
    if count > cap:  # a duck-typed WR whose sg_list changed between two reads
        raise InvalidWorkRequestError(f"the sg_list changed while it was read ({count} SGEs, {cap} counted before)")
    return 0


cdef int _read_send_wr(object wr, send_wr_in *w, sge_in *sges, int cap) except -1:
    cdef object imm
    if type(wr) is SendWR:
        w.wr_id = PyLong_AsUnsignedLongLongMask(_field(wr, _sw_off[0], "wr_id"))
        w.opcode = <int>PyLong_AsLong(_field(wr, _sw_off[1], "opcode"))
        w.nsge = _read_sges(_field(wr, _sw_off[2], "sg_list"), sges, cap)
        w.send_flags = <uint32_t>PyLong_AsLong(_field(wr, _sw_off[3], "send_flags"))
        imm = _field(wr, _sw_off[4], "imm_data")
        w.remote_addr = PyLong_AsUnsignedLongLongMask(_field(wr, _sw_off[5], "remote_addr"))
        w.rkey = <uint32_t>PyLong_AsUnsignedLongLongMask(_field(wr, _sw_off[6], "rkey"))
        w.compare_add = PyLong_AsUnsignedLongLongMask(_field(wr, _sw_off[7], "compare_add"))
        w.swap = PyLong_AsUnsignedLongLongMask(_field(wr, _sw_off[8], "swap"))
    else:
        w.wr_id = PyLong_AsUnsignedLongLongMask(wr.wr_id)
        w.opcode = <int>PyLong_AsLong(wr.opcode)
        w.nsge = _read_sges(wr.sg_list, sges, cap)
        w.send_flags = <uint32_t>PyLong_AsLong(wr.send_flags)
        imm = wr.imm_data
        w.remote_addr = PyLong_AsUnsignedLongLongMask(wr.remote_addr)
        w.rkey = <uint32_t>PyLong_AsUnsignedLongLongMask(wr.rkey)
        w.compare_add = PyLong_AsUnsignedLongLongMask(wr.compare_add)
        w.swap = PyLong_AsUnsignedLongLongMask(wr.swap)
    if imm is None:
        w.has_imm = 0
        w.imm = 0
    else:
        w.has_imm = 1
        w.imm = <uint32_t>PyLong_AsUnsignedLongLongMask(imm)
    w.sges = sges
    return 0


cdef int _read_attr(object attr, rc_attr *a) except -1:
    memset(a, 0, sizeof(rc_attr))
    a.qp_state = -1 if attr.qp_state is None else int(attr.qp_state)
    a.port_num = attr.port_num
    if attr.qp_access_flags is not None:
        a.has_access = 1
        a.access = int(attr.qp_access_flags)
    if attr.path_mtu is not None:
        a.has_path_mtu = 1
        a.path_mtu = int(MTU(attr.path_mtu))  # ValueError for anything but 1 .. 5, as rc.py
    if attr.dest_qp_num is not None:
        a.has_dest_qp = 1
        a.dest_qp_num = attr.dest_qp_num
    if attr.rq_psn is not None:
        a.has_rq_psn = 1
        a.rq_psn = attr.rq_psn & 0xFFFFFF
    if attr.sq_psn is not None:
        a.has_sq_psn = 1
        a.sq_psn = attr.sq_psn & 0xFFFFFF
    if attr.max_dest_rd_atomic is not None:
        a.has_max_dest_rd_atomic = 1
        a.max_dest_rd_atomic = attr.max_dest_rd_atomic
    if attr.max_rd_atomic is not None:
        a.has_max_rd_atomic = 1
        a.max_rd_atomic = attr.max_rd_atomic
    if attr.min_rnr_timer is not None:
        a.has_min_rnr_timer = 1
        a.min_rnr_timer = attr.min_rnr_timer
    if attr.timeout is not None:
        if not 0 <= attr.timeout <= 31:
            raise ValueError(f"timeout {attr.timeout} is not a 5-bit verbs timeout code")
        a.has_timeout = 1
        a.timeout = attr.timeout
    if attr.retry_cnt is not None:
        a.has_retry_cnt = 1
        a.retry_cnt = attr.retry_cnt
    if attr.rnr_retry is not None:
        a.has_rnr_retry = 1
        a.rnr_retry = attr.rnr_retry
    if attr.dgid is not None:
        g = bytes(attr.dgid)
        if len(g) != 16:
            raise ValueError(f"a GID is 16 bytes, got {len(g)}")
        a.has_dgid = 1
        memcpy(a.dgid, <const char *>g, 16)
    if attr.sgid_index is not None:
        a.has_sgid_index = 1
        a.sgid_index = attr.sgid_index
    if attr.dport is not None:
        a.has_dport = 1
        a.dport = attr.dport
    return 0


cdef object _query(rc_qp *q):
    return QPAttr(
        qp_state=_QPSTATE[q.state],
        port_num=q.port_num,
        qp_access_flags=Access(q.access),
        path_mtu=_MTU[q.path_mtu],
        dest_qp_num=q.dest_qp_num,
        rq_psn=q.epsn,
        sq_psn=q.next_psn,
        max_dest_rd_atomic=q.max_dest_rd_atomic,
        max_rd_atomic=q.max_rd_atomic,
        min_rnr_timer=q.min_rnr_timer,
        timeout=q.timeout_code,
        retry_cnt=q.retry_cnt,
        rnr_retry=q.rnr_retry,
        dgid=PyBytes_FromStringAndSize(<const char *>q.dgid, 16) if q.has_dgid else None,
        sgid_index=q.sgid_index,
        dport=q.dport if q.has_dport else None,
    )


cdef dict _counters_of(rc_qp *q):
    cdef uint64_t v[16]
    rc_counter_values(q, v)
    return {rc_counter_names[i].decode(): v[i] for i in range(RC_NCOUNTERS)}


cdef inline void _copy_errmsg(char *dst, const rc_qp *q) noexcept nogil:
    """The QP's last error message into ``dst`` (320 bytes, the size of ``errmsg``),
    while the engine lock is held: the QP may be closed once it is released."""
    strncpy(dst, q.errmsg, 319)
    dst[319] = 0


cdef object _raise_rc(const char *errmsg, int rc):
    """The exception of a failed verbs call; ``errmsg`` is the QP's message, copied
    while the engine lock was held (the QP may be closed by now)."""
    msg = errmsg.decode("utf-8", "replace")
    if rc == RC_EQPSTATE:
        raise QueuePairStateError(msg)
    raise InvalidWorkRequestError(msg)


cdef int _set_flow(flow *f, object pyflow) except -1:
    memset(f, 0, sizeof(flow))
    f.ipv6 = 1 if pyflow.ipv6 else 0
    s = _ipaddress.ip_address(pyflow.src).packed
    d = _ipaddress.ip_address(pyflow.dst).packed
    memcpy(f.src, <const char *>s, len(s))
    memcpy(f.dst, <const char *>d, len(d))
    f.sport = pyflow.sport
    f.dport = pyflow.dport
    f.ip_id = pyflow.ip_id & 0xFFFF
    return 0


cdef object _flow_obj(const flow *f):
    n = 16 if f.ipv6 else 4
    src = str(_ipaddress.ip_address(PyBytes_FromStringAndSize(<const char *>f.src, n)))
    dst = str(_ipaddress.ip_address(PyBytes_FromStringAndSize(<const char *>f.dst, n)))
    return _wire.Flow(src, dst, f.sport, f.dport, f.ip_id)


cdef object _packet_obj(const pkt *p):
    """A wire.Packet with the fields of p (the payload copied)."""
    return _wire.Packet(
        p.opcode,
        p.dest_qp,
        p.psn,
        bool(p.ack_req),
        bool(p.solicited),
        bool(p.migreq),
        p.pkey,
        bool(p.fecn),
        bool(p.becn),
        p.tver,
        p.va,
        p.rkey,
        p.dma_len,
        p.syndrome,
        p.msn,
        p.imm if p.has_imm else None,
        p.swap_add,
        p.compare,
        p.orig,
        PyBytes_FromStringAndSize(<const char *>p.payload, p.plen) if p.plen else b"",
    )


cdef int _fill_pkt(pkt *p, object P) except -1:
    memset(p, 0, sizeof(pkt))
    p.opcode = P.opcode
    p.dest_qp = P.dest_qp & 0xFFFFFF
    p.psn = P.psn & 0xFFFFFF
    p.ack_req = bool(P.ack_req)
    p.solicited = bool(P.solicited)
    p.migreq = bool(P.migreq)
    p.pkey = P.pkey
    p.fecn = bool(P.fecn)
    p.becn = bool(P.becn)
    p.tver = P.tver
    p.va = P.va & 0xFFFFFFFFFFFFFFFF
    p.rkey = P.rkey & 0xFFFFFFFF
    p.dma_len = P.dma_len & 0xFFFFFFFF
    p.syndrome = P.syndrome & 0xFF
    p.msn = P.msn & 0xFFFFFF
    if P.imm is not None:
        p.imm = P.imm & 0xFFFFFFFF
        p.has_imm = 1
    p.swap_add = P.swap_add & 0xFFFFFFFFFFFFFFFF
    p.compare = P.compare & 0xFFFFFFFFFFFFFFFF
    p.orig = P.orig & 0xFFFFFFFFFFFFFFFF
    return 0

