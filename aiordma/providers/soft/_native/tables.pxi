# The C core's tables and constants (compared with the Python definitions by
# tests/unit/test_engine_tables.py) and the CRC-32 implementations the ICRC uses.

#: the retransmit back-off's cap (rc.h; tests compare it with rc.py's)
RETRY_BACKOFF_CAP = RC_RETRY_BACKOFF_CAP


def c_tables():
    """The soft device's tables and constants as the C code has them (wire.h, wire.c,
    rc.h, rc.c): what the test that compares them with the Python definitions
    (wire.py, rc.py, providers/base.py) reads, so that the two engines cannot drift
    apart unnoticed."""
    cdef int op, i
    names, layout, header_length = {}, {}, {}
    first, last, request, response = set(), set(), set(), set()
    for op in range(256):
        if not wire_layout[op] & L_VALID:
            continue
        names[op] = wire_opcode_name(op).decode()
        layout[op] = wire_layout[op] & ~L_VALID
        header_length[op] = wire_hdr_len[op]
        for members, test in ((first, op_is_first(op)), (last, op_is_last(op)),
                              (request, op_is_request(op)), (response, op_is_response(op))):
            if test:
                members.add(op)
    return {
        "opcode_names": names,
        "layout": layout,
        "layout_bits": {"RETH": L_RETH, "AETH": L_AETH, "IMM": L_IMM, "ATOMIC": L_ATOMIC,
                        "ATOMIC_ACK": L_ATOMIC_ACK, "PAYLOAD": L_PAYLOAD},
        "header_length": header_length,
        "first": frozenset(first),
        "last": frozenset(last),
        "request": frozenset(request),
        "response": frozenset(response),
        "lengths": {"BTH_LEN": BTH_LEN, "RETH_LEN": RETH_LEN, "AETH_LEN": AETH_LEN, "IMMDT_LEN": IMMDT_LEN,
                    "ATOMIC_ETH_LEN": ATOMIC_ETH_LEN, "ATOMIC_ACK_ETH_LEN": ATOMIC_ACK_ETH_LEN,
                    "ICRC_LEN": ICRC_LEN, "DEFAULT_PKEY": DEFAULT_PKEY, "PSN_MASK": PSN_MASK},
        "aeth": {"AETH_ACK": AETH_ACK, "AETH_RNR_NAK": AETH_RNR_NAK, "AETH_NAK": AETH_NAK,
                 "NAK_PSN_SEQUENCE_ERROR": NAK_PSN_SEQUENCE_ERROR, "NAK_INVALID_REQUEST": NAK_INVALID_REQUEST,
                 "NAK_REMOTE_ACCESS_ERROR": NAK_REMOTE_ACCESS_ERROR,
                 "NAK_REMOTE_OPERATIONAL_ERROR": NAK_REMOTE_OPERATIONAL_ERROR,
                 "NAK_INVALID_RD_REQUEST": NAK_INVALID_RD_REQUEST, "AETH_CREDITS_INVALID": AETH_CREDITS_INVALID},
        "rnr_timer_us": tuple(wire_rnr_timer_us[i] for i in range(32)),
        "rc_counters": tuple(rc_counter_names[i].decode() for i in range(RC_NCOUNTERS)),
        "retry_backoff_cap": RC_RETRY_BACKOFF_CAP,
        "access": {"IBV_ACCESS_LOCAL_WRITE": ACC_LOCAL_WRITE, "IBV_ACCESS_REMOTE_WRITE": ACC_REMOTE_WRITE,
                   "IBV_ACCESS_REMOTE_READ": ACC_REMOTE_READ, "IBV_ACCESS_REMOTE_ATOMIC": ACC_REMOTE_ATOMIC},
        "wr_opcodes": {"IBV_WR_RDMA_WRITE": WR_RDMA_WRITE, "IBV_WR_RDMA_WRITE_WITH_IMM": WR_RDMA_WRITE_WITH_IMM,
                       "IBV_WR_SEND": WR_SEND, "IBV_WR_SEND_WITH_IMM": WR_SEND_WITH_IMM,
                       "IBV_WR_RDMA_READ": WR_RDMA_READ, "IBV_WR_ATOMIC_CMP_AND_SWP": WR_ATOMIC_CMP_AND_SWP,
                       "IBV_WR_ATOMIC_FETCH_AND_ADD": WR_ATOMIC_FETCH_AND_ADD},
        "wc_opcodes": {"IBV_WC_SEND": WC_SEND, "IBV_WC_RDMA_WRITE": WC_RDMA_WRITE, "IBV_WC_RDMA_READ": WC_RDMA_READ,
                       "IBV_WC_COMP_SWAP": WC_COMP_SWAP, "IBV_WC_FETCH_ADD": WC_FETCH_ADD, "IBV_WC_RECV": WC_RECV,
                       "IBV_WC_RECV_RDMA_WITH_IMM": WC_RECV_RDMA_WITH_IMM},
        # the statuses the engine writes, and the names it gives every status value
        "wc_statuses_written": {"IBV_WC_SUCCESS": WCS_SUCCESS, "IBV_WC_LOC_LEN_ERR": WCS_LOC_LEN_ERR,
                                "IBV_WC_LOC_QP_OP_ERR": WCS_LOC_QP_OP_ERR, "IBV_WC_LOC_PROT_ERR": WCS_LOC_PROT_ERR,
                                "IBV_WC_WR_FLUSH_ERR": WCS_WR_FLUSH_ERR, "IBV_WC_BAD_RESP_ERR": WCS_BAD_RESP_ERR,
                                "IBV_WC_REM_INV_REQ_ERR": WCS_REM_INV_REQ_ERR,
                                "IBV_WC_REM_ACCESS_ERR": WCS_REM_ACCESS_ERR, "IBV_WC_REM_OP_ERR": WCS_REM_OP_ERR,
                                "IBV_WC_RETRY_EXC_ERR": WCS_RETRY_EXC_ERR,
                                "IBV_WC_RNR_RETRY_EXC_ERR": WCS_RNR_RETRY_EXC_ERR},
        "wc_status_names": {i: rc_wc_status_name(i).decode() for i in range(22)},
        "qp_state_names": {i: rc_qp_state_name(i).decode() for i in range(7)},
        "qp_states_used": {"IBV_QPS_RESET": QPS_RESET, "IBV_QPS_INIT": QPS_INIT, "IBV_QPS_RTR": QPS_RTR,
                           "IBV_QPS_RTS": QPS_RTS, "IBV_QPS_SQD": QPS_SQD, "IBV_QPS_SQE": QPS_SQE,
                           "IBV_QPS_ERR": QPS_ERR},
    }


def crc32_implementation():
    """The CRC-32 the native ICRC uses: the fastest of :func:`crc32_implementations`
    (``"isa-l"``, ``"pclmul"``, ``"zlib"`` or ``"table"``)."""
    return wire_crc32_name().decode()


def crc32_implementations():
    """Every CRC-32 implementation this build has and this CPU runs, fastest
    first: ``"isa-l"`` (libisal at build time), ``"pclmul"`` (x86-64
    carry-less multiply, when the CPU has it), ``"zlib"``, ``"table"`` (portable)."""
    cdef const crc32_impl *impls
    cdef int n = c_crc32_implementations(&impls)
    return [impls[i].name.decode() for i in range(n)]


def crc32_compiled():
    """The CRC-32 implementations this build has, whatever the CPU can run."""
    return c_crc32_compiled().decode().split(",")


cdef crc32_fn _crc32_fn(str name) except NULL:
    cdef const crc32_impl *impls
    cdef int n = c_crc32_implementations(&impls)
    for i in range(n):
        if impls[i].name.decode() == name:
            return impls[i].fn
    raise ValueError(f"no CRC-32 implementation {name!r} here (there are {crc32_implementations()})")


def crc32_with(str name, data, unsigned int crc=0):
    """``zlib.crc32(data, crc)`` computed by the implementation ``name``."""
    cdef crc32_fn fn = _crc32_fn(name)
    cdef Py_buffer view
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    cdef uint32_t r
    try:
        with nogil:
            r = fn(crc, <const uint8_t *>view.buf, <size_t>view.len)
    finally:
        PyBuffer_Release(&view)
    return r


def crc32_throughput(name=None, Py_ssize_t size=4096, double seconds=0.01):
    """Bytes per second the implementation ``name`` (default: the one the ICRC
    uses) computes over ``size``-byte buffers, measured for about ``seconds``."""
    cdef crc32_fn fn = _crc32_fn(crc32_implementation() if name is None else name)
    buf = bytearray(_os.urandom(size))
    cdef const uint8_t *p = <const uint8_t *><char *>buf
    cdef uint32_t c = 0
    cdef long rounds = 16, i
    cdef double elapsed = 0.0
    import time as _time
    while True:
        t0 = _time.perf_counter()
        with nogil:
            for i in range(rounds):
                c = fn(c, p, <size_t>size)
        elapsed = _time.perf_counter() - t0
        if elapsed >= seconds:
            return rounds * size / elapsed
        rounds *= 4

