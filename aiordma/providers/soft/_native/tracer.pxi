# The tracer: the C NIC thread's hooks that call NativeEngine's tracer (tests and
# the walk-through only: they take the GIL), and what a traced WQE shows.

cdef void _trace_datagram_cb(void *ctx, const char *event, uint32_t qpn, const uint8_t *d, size_t n,
                             const flow *f) noexcept nogil:
    with gil:
        try:
            (<NativeEngine>ctx)._trace_datagram(event.decode(), qpn, PyBytes_FromStringAndSize(<const char *>d, n),
                                                _flow_obj(f))
        except BaseException:
            pass


cdef void _trace_rc_cb(void *ctx, rc_qp *qp, const rc_trace *t) noexcept nogil:
    with gil:
        try:
            (<NativeEngine>ctx)._trace_rc(qp, t)
        except BaseException:
            pass


cdef void _trace_cqe_cb(void *ctx, const rc_wc *w) noexcept nogil:
    with gil:
        try:
            (<NativeEngine>ctx)._trace_cqe(glue_make_wc(w))
        except BaseException:
            pass


cdef int _filter_cb(void *ctx, const uint8_t *d, size_t n) noexcept nogil:
    with gil:
        try:
            return 1 if (<NativeEngine>ctx)._filter(PyBytes_FromStringAndSize(<const char *>d, n)) else 0
        except BaseException:
            return 1


class _WqeView:
    """What the walk-through's tracer reads of a WQE: the work request and the
    bytes its gather list names (copied)."""

    __slots__ = ("segments", "wr")

    def __init__(self, wr, segments):
        self.wr = wr
        self.segments = segments


