# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
"""The native engine of the soft device: the Cython binding of the C core.

``wire.c`` (codec, ICRC, IP-ID solver), ``rc.c`` (the RC requester and
responder, a port of ``rc.py``) and ``nic.c`` (the NIC thread, the UDP socket,
CQs and completion channels) do the work; this module gives Python the
engine protocol of :mod:`aiordma.providers.soft.engine` (:class:`NativeEngine`
and its PD / MR / CQ / channel / QP objects), the sans-IO :class:`RCCore` the
differential tests drive like :class:`~aiordma.providers.soft.rc.RCQueuePair`,
and the codec functions the wire tests compare with ``wire.py``.

Python sees verbs only: ``post_send`` takes the :class:`SendWR` objects of
``providers/base.py`` (read in C), ``poll`` returns real
:class:`WorkCompletion` objects (built in C, no ``__init__``). The engine lock
is only ever taken with the GIL released.
"""

cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.long cimport PyLong_AsLong, PyLong_AsUnsignedLongLongMask
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset, strlen, strncpy

import ipaddress as _ipaddress
import os as _os
import threading as _threading

from ...base import (
    MTU,
    SGE,
    Access,
    QPAttr,
    QPState,
    RecvWR,
    SendWR,
    WCFlags,
    WCOpcode,
    WCStatus,
    WorkCompletion,
)
from .... import settings as _settings
from ....errors import InvalidWorkRequestError, MemoryRegistrationError, QueuePairStateError
from .. import wire as _wire
from ..faults import LinkFaults
from ..trace import TraceEvent


cdef extern from "<sys/uio.h>":
    struct iovec:
        void *iov_base
        size_t iov_len

cdef extern from "<sys/socket.h>":
    struct sockaddr_storage:
        unsigned short ss_family

cdef extern from "<netinet/in.h>":
    ctypedef unsigned int socklen_t

cdef extern from "wire.h" nogil:
    enum:
        MAX_HDR_LEN
        ICRC_LEN
    struct pkt:
        uint8_t opcode
        uint8_t ack_req, solicited, migreq, fecn, becn, tver, has_imm
        uint16_t pkey
        uint32_t dest_qp, psn
        uint64_t va
        uint32_t rkey, dma_len
        uint8_t syndrome
        uint32_t msn
        uint32_t imm
        uint64_t swap_add, compare, orig
        const uint8_t *payload
        uint32_t plen
    struct flow:
        int ipv6
        uint8_t src[16]
        uint8_t dst[16]
        uint16_t sport, dport
        uint16_t ip_id
    const uint8_t wire_layout[256]
    int wire_decode(const uint8_t *d, size_t n, pkt *out)
    size_t wire_datagram_length(const pkt *p)
    size_t wire_encode(const pkt *p, const flow *f, uint16_t ip_id, uint8_t *out)
    const char *wire_error_name(int err)
    const char *wire_crc32_name()
    int wire_icrc_ok(const uint8_t *d, size_t n, const flow *f)
    int wire_icrc_ip_id(const uint8_t *d, size_t n, const flow *f)

cdef extern from "crc32.h" nogil:
    ctypedef uint32_t (*crc32_fn)(uint32_t crc, const uint8_t *buf, size_t len)
    struct crc32_impl:
        const char *name
        crc32_fn fn
    int c_crc32_implementations "crc32_implementations"(const crc32_impl **out)
    const char *c_crc32_compiled "crc32_compiled"()

cdef extern from "wire.h" nogil:
    # the tables and constants c_tables() reports (compared with wire.py by a test)
    enum:
        BTH_LEN
        RETH_LEN
        AETH_LEN
        IMMDT_LEN
        ATOMIC_ETH_LEN
        ATOMIC_ACK_ETH_LEN
        DEFAULT_PKEY
        PSN_MASK
        L_RETH
        L_AETH
        L_IMM
        L_ATOMIC
        L_ATOMIC_ACK
        L_PAYLOAD
        L_VALID
        AETH_ACK
        AETH_RNR_NAK
        AETH_NAK
        NAK_PSN_SEQUENCE_ERROR
        NAK_INVALID_REQUEST
        NAK_REMOTE_ACCESS_ERROR
        NAK_REMOTE_OPERATIONAL_ERROR
        NAK_INVALID_RD_REQUEST
        AETH_CREDITS_INVALID
    const uint8_t wire_hdr_len[256]
    const uint32_t wire_rnr_timer_us[32]
    const char *wire_opcode_name(int op)
    int op_is_first(int op)
    int op_is_last(int op)
    int op_is_request(int op)
    int op_is_response(int op)

cdef extern from "rc.h" nogil:
    enum:
        ACC_LOCAL_WRITE
        ACC_REMOTE_WRITE
        ACC_REMOTE_READ
        ACC_REMOTE_ATOMIC
        WR_RDMA_WRITE
        WR_RDMA_WRITE_WITH_IMM
        WR_SEND
        WR_SEND_WITH_IMM
        WR_RDMA_READ
        WR_ATOMIC_CMP_AND_SWP
        WR_ATOMIC_FETCH_AND_ADD
        WC_SEND
        WC_RDMA_WRITE
        WC_RDMA_READ
        WC_COMP_SWAP
        WC_FETCH_ADD
        WC_RECV
        WC_RECV_RDMA_WITH_IMM
        WCS_SUCCESS
        WCS_LOC_LEN_ERR
        WCS_LOC_QP_OP_ERR
        WCS_LOC_PROT_ERR
        WCS_WR_FLUSH_ERR
        WCS_BAD_RESP_ERR
        WCS_REM_INV_REQ_ERR
        WCS_REM_ACCESS_ERR
        WCS_REM_OP_ERR
        WCS_RETRY_EXC_ERR
        WCS_RNR_RETRY_EXC_ERR
        QPS_RESET
        QPS_INIT
        QPS_RTS
        QPS_SQD
        QPS_SQE
        QPS_ERR
    const char *rc_qp_state_name(int s)
    const char *rc_wc_status_name(int s)

cdef extern from "rc.h" nogil:
    enum:
        RC_OK
        RC_EQPSTATE
        RC_EINVAL
        RC_NCOUNTERS
        RC_RETRY_BACKOFF_CAP
        QPS_RTR
        TR_LKEY_READ
        TR_PACKET_OUT
        TR_RKEY_CHECK
        TR_DMA_WRITE
        TR_ACK_IN
    struct pd:
        size_t count
        void (*release)(pd *, mr *)
        void *release_ctx
    struct mr:
        uint64_t addr, length
        uint32_t access, lkey, rkey
        uint8_t *base
        int refcnt
        int registered
        pd *pd
        void *owner
    void pd_init(pd *p)
    mr *pd_by_lkey(const pd *p, uint32_t lkey)
    mr *pd_by_rkey(const pd *p, uint32_t rkey)
    int pd_add(pd *p, mr *m)
    void pd_remove(pd *p, mr *m)
    struct rc_counters:
        pass
    const char *rc_counter_names[]
    struct seg:
        uint8_t *p
        uint32_t len
        mr *mr
    struct sge_in:
        uint64_t addr
        uint32_t length, lkey
    struct send_wr_in:
        uint64_t wr_id
        int opcode
        uint32_t send_flags
        int has_imm
        uint32_t imm
        uint64_t remote_addr
        uint32_t rkey
        uint64_t compare_add, swap
        int nsge
        const sge_in *sges
    struct send_wqe:
        uint64_t wr_id
        uint32_t length, psn_first, npkts, psn_last
        uint32_t resp_offset, resp_pkts, req_pkts
        int nsegs
        seg *segs
    struct recv_wqe:
        uint64_t wr_id
    struct rc_wc:
        uint64_t wr_id
        uint8_t is_recv, status, opcode, has_imm
        uint32_t byte_len, qp_num, src_qp, imm
    struct rc_trace:
        int event
        const pkt *pkt
        const send_wqe *wqe
        const mr *region
        uint32_t offset, length
        int ok
        const char *why
    struct rc_out:
        pkt *pkts
        size_t n
    void rc_out_clear(rc_out *o)
    void rc_out_free(rc_out *o)
    struct rc_attr:
        int qp_state
        int port_num
        int has_access, has_path_mtu, has_dest_qp, has_rq_psn, has_sq_psn, has_max_dest_rd_atomic, has_max_rd_atomic
        int has_min_rnr_timer, has_timeout, has_retry_cnt, has_rnr_retry, has_dgid, has_sgid_index, has_dport
        uint32_t access
        int path_mtu
        uint32_t dest_qp_num, rq_psn, sq_psn
        int max_dest_rd_atomic, max_rd_atomic, min_rnr_timer, timeout, retry_cnt, rnr_retry, sgid_index, dport
        uint8_t dgid[16]
    struct rc_qp:
        uint32_t qp_num
        int state
        int port_num
        uint32_t access
        int path_mtu
        uint32_t mtu
        uint32_t dest_qp_num
        int has_dgid
        uint8_t dgid[16]
        int has_dport, dport
        int sgid_index
        int timeout_code
        int retry_cnt, rnr_retry, min_rnr_timer, max_rd_atomic, max_dest_rd_atomic
        uint32_t window_pkts, ack_req_every
        uint32_t sq_len, rq_len
        uint32_t next_psn, una_psn, epsn
        uint32_t cur_recv_offset
        int has_cur_write
        rc_wc *wcs
        size_t nwcs
        char error_reason[320]
        int has_error_reason
        char errmsg[320]
        void (*trace)(void *ctx, rc_qp *qp, const rc_trace *t)
        void *trace_ctx
    rc_qp *rc_create(uint32_t qp_num, pd *p, uint32_t max_send_wr, uint32_t max_recv_wr, uint32_t max_send_sge,
                     uint32_t max_recv_sge, int sq_sig_all)
    void rc_destroy(rc_qp *qp)
    int rc_modify(rc_qp *qp, const rc_attr *a, double now)
    int rc_post_send(rc_qp *qp, const send_wr_in *wr, double now)
    int rc_post_recv(rc_qp *qp, uint64_t wr_id, const sge_in *sges, int nsge)
    void rc_receive(rc_qp *qp, const pkt *p, double now)
    void rc_transmit(rc_qp *qp, double now, rc_out *out)
    double rc_next_timer(const rc_qp *qp)
    void rc_on_timer(rc_qp *qp, double now)
    send_wqe *sq_at(const rc_qp *qp, uint32_t i)

cdef extern from *:
    """
    #include "rc.h"
    static void rc_counter_values(const struct rc_qp *qp, uint64_t *out)
    {
        memcpy(out, &qp->c, sizeof qp->c);
    }
    """
    void rc_counter_values(const rc_qp *qp, uint64_t *out) nogil

cdef extern from "nic.h" nogil:
    enum:
        NC_MAX
        NC_TX_INLINE
        ICRC_STRICT
        ICRC_ANY_IP_ID
        ICRC_OFF
    const char *nic_counter_names[]
    struct nic_channel:
        int fd
        void *pyobj
    struct nic_cq:
        uint64_t overflows
        nic_channel *ch
        void *pyobj
    struct nic_faults:
        int on
        uint64_t dropped, duplicated, reordered
        int nheld
    struct nic_hooks:
        void *ctx
        void (*trace_datagram)(void *ctx, const char *event, uint32_t qpn, const uint8_t *d, size_t n, const flow *f)
        void (*trace_rc)(void *ctx, rc_qp *qp, const rc_trace *t)
        void (*trace_cqe)(void *ctx, const rc_wc *w)
        int (*filter)(void *ctx, const uint8_t *d, size_t n)
    struct nic_qp:
        rc_qp *rc
        int has_peer
        flow txflow
        int closed
    struct nic:
        int sock
        char ip[64]
        uint16_t port
        int icrc_policy
        int gso
        int gro
        uint64_t counters[64]
        size_t nqps, nmrs, ncqs
        nic_faults faults
        int tracing
        nic_hooks hooks
        mr **zombies
        size_t nzombies, zombies_cap
        nic_cq **fire
        size_t nfire
        int loop_owns
        double window_len, window_deadline
    int nic_open(nic *e, const char *ip, int port, int icrc_policy, const char *pcap_path, char *err, size_t errlen)
    int nic_start(nic *e)
    void nic_close(nic *e)
    void nic_free(nic *e)
    void nic_lock(nic *e)
    void nic_unlock(nic *e)
    void nic_fire_events(nic *e)
    nic_channel *nic_channel_new()
    void nic_channel_unref(nic_channel *ch)
    void nic_channel_close(nic_channel *ch)
    nic_cq *nic_channel_get_event(nic_channel *ch)
    nic_cq *nic_cq_new(nic *e, uint32_t cqe, nic_channel *ch)
    void nic_cq_unref(nic_cq *cq)
    size_t nic_cq_poll(nic_cq *cq, rc_wc *out, size_t n)
    void nic_cq_req_notify(nic_cq *cq)
    nic_qp *nic_qp_new(nic *e, uint32_t qpn, pd *p, nic_cq *scq, nic_cq *rcq, uint32_t max_send_wr,
                       uint32_t max_recv_wr, uint32_t max_send_sge, uint32_t max_recv_sge, int sq_sig_all)
    nic_qp *nic_qp_find(nic *e, uint32_t qpn)
    void nic_qp_close(nic_qp *q)
    void nic_qp_destroy(nic_qp *q)
    int nic_qp_set_peer(nic_qp *q, const char *ip, int port)
    void nic_qp_set_path(nic_qp *q, int tclass, int hop_limit)
    void nic_flush(nic *e, nic_qp *q, double now)
    void nic_timer_armed(nic *e, double deadline)
    int nic_service(nic *e, int readable)
    void nic_receive_one(nic *e, const uint8_t *d, size_t n, const sockaddr_storage *src, double now)
    void nic_pd_release(pd *p, mr *m)
    void nic_channel_notify(nic_channel *ch, nic_cq *cq)
    int nic_loop_attach(nic *e)
    void nic_loop_detach(nic *e)
    void nic_expect(nic *e, double now)
    int nic_loop_receive(nic *e, double now)
    void nic_flush_deferred(nic *e, double now)
    int nic_gso_send_probe(nic *e, size_t seg, int count)
    int nic_set_gro(nic *e, int on)
    double nic_now()
    void nic_faults_set(nic *e, int on, double drop, double dup, double reorder, uint64_t seed, int has_filter)

cdef extern from *:
    """
    #include "nic.h"
    static int _sum_qp_counters(struct nic *e, uint64_t *sums)
    {
        int n = 0;
        for (struct nic_qp *q = e->all; q; q = q->next) {
            const uint64_t *c = (const uint64_t *)&q->rc->c;
            for (int i = 0; i < RC_NCOUNTERS; i++) sums[i] += c[i];
            n++;
        }
        return n;
    }
    typedef void (*rc_trace_fn)(void *, struct rc_qp *, const struct rc_trace *);
    static void _set_qp_trace(struct nic *e, rc_trace_fn fn, void *ctx)
    {
        for (struct nic_qp *q = e->all; q; q = q->next) {
            q->rc->trace = fn;
            q->rc->trace_ctx = ctx;
        }
    }
    """
    ctypedef void (*rc_trace_fn)(void *, rc_qp *, const rc_trace *) noexcept nogil
    int _sum_qp_counters(nic *e, uint64_t *sums) nogil
    void _set_qp_trace(nic *e, rc_trace_fn fn, void *ctx) nogil

cdef extern from "pyglue.h":
    int glue_init_wc(object t, object s, object o, object f) except -1
    object glue_make_wc(const rc_wc *w)
    int glue_slot_offsets(object t, const char **names, int n, Py_ssize_t *out) except -1
    PyObject *glue_slot(object o, Py_ssize_t off)
    struct zombie_list:
        mr **v
        size_t n
    void zombie_release(pd *p, mr *m) nogil

cdef extern from "<arpa/inet.h>" nogil:
    int inet_pton(int af, const char *src, void *dst)
cdef extern from "<netinet/in.h>" nogil:
    struct in_addr:
        uint32_t s_addr
    struct sockaddr_in:
        unsigned short sin_family
        uint16_t sin_port
        in_addr sin_addr
    struct in6_addr:
        pass
    struct sockaddr_in6:
        unsigned short sin6_family
        uint16_t sin6_port
        in6_addr sin6_addr
    uint16_t htons(uint16_t)
    int AF_INET, AF_INET6


# ------------------------------------------------------------- set-up ----

glue_init_wc(WorkCompletion, WCStatus, WCOpcode, WCFlags)

cdef const char *_SENDWR_FIELDS[9]
_SENDWR_FIELDS[:] = [b"wr_id", b"opcode", b"sg_list", b"send_flags", b"imm_data", b"remote_addr", b"rkey",
                     b"compare_add", b"swap"]
cdef const char *_RECVWR_FIELDS[2]
_RECVWR_FIELDS[:] = [b"wr_id", b"sg_list"]
cdef const char *_SGE_FIELDS[3]
_SGE_FIELDS[:] = [b"addr", b"length", b"lkey"]
cdef Py_ssize_t _sw_off[9]
cdef Py_ssize_t _rw_off[2]
cdef Py_ssize_t _sge_off[3]
glue_slot_offsets(SendWR, _SENDWR_FIELDS, 9, _sw_off)
glue_slot_offsets(RecvWR, _RECVWR_FIELDS, 2, _rw_off)
glue_slot_offsets(SGE, _SGE_FIELDS, 3, _sge_off)

#: the retransmit back-off's cap (rc.h; tests compare it with rc.py's)
RETRY_BACKOFF_CAP = RC_RETRY_BACKOFF_CAP
_QPSTATE = tuple(QPState(i) for i in range(7))
_MTU = {m.value: m for m in MTU}

cdef int _MAX_INLINE_SGE = 16


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


# ------------------------------------------------------ the wire codec ----

def encode(packet, pyflow, ip_id=None):
    """The datagram for a :class:`wire.Packet` on a :class:`wire.Flow`, encoded in C."""
    cdef pkt p
    cdef flow f
    if packet.opcode not in _wire._LAYOUT:
        raise ValueError(f"cannot encode opcode 0x{packet.opcode:02x}: not an RC opcode")
    _fill_pkt(&p, packet)
    payload = bytes(packet.payload)
    p.payload = <const uint8_t *>PyBytes_AS_STRING(payload)
    p.plen = len(payload)
    _set_flow(&f, pyflow)
    out = PyBytes_FromStringAndSize(NULL, wire_datagram_length(&p))
    wire_encode(&p, &f, f.ip_id if ip_id is None else (ip_id & 0xFFFF), <uint8_t *>PyBytes_AS_STRING(out))
    return out


def decode(datagram):
    """Parse a datagram in C into a :class:`wire.Packet` (raises wire.MalformedPacketError)."""
    cdef pkt p
    data = bytes(datagram)
    cdef int err = wire_decode(<const uint8_t *>PyBytes_AS_STRING(data), len(data), &p)
    if err:
        raise _wire.MalformedPacketError(wire_error_name(err).decode())
    return _packet_obj(&p)


def icrc_ok(datagram, pyflow):
    cdef flow f
    _set_flow(&f, pyflow)
    data = bytes(datagram)
    return bool(wire_icrc_ok(<const uint8_t *>PyBytes_AS_STRING(data), len(data), &f))


def icrc_ip_id(datagram, pyflow):
    """As wire.icrc_ip_id, in C."""
    cdef flow f
    _set_flow(&f, pyflow)
    data = bytes(datagram)
    cdef int r = wire_icrc_ip_id(<const uint8_t *>PyBytes_AS_STRING(data), len(data), &f)
    return None if r < 0 else r


# ------------------------------------------------------ registered memory ----

cdef struct mrbox:
    Py_buffer view
    int has_view
    PyObject *pyobj  # the NativeMR while it lives (borrowed), for the tracer


cdef mr *_make_mr(object buffer, int writable, uint64_t addr_override, int use_override, uint32_t access,
                  uint32_t lkey, uint32_t rkey) except NULL:
    cdef mrbox *box = <mrbox *>calloc(1, sizeof(mrbox))
    cdef mr *m = <mr *>calloc(1, sizeof(mr))
    if box == NULL or m == NULL:
        free(box)
        free(m)
        raise MemoryError()
    try:
        PyObject_GetBuffer(buffer, &box.view, PyBUF_WRITABLE if writable else PyBUF_SIMPLE)
    except BufferError as e:
        free(box)
        free(m)
        raise MemoryRegistrationError(
            f"cannot register a read-only {type(buffer).__name__} with write access: the device must be able to "
            "write into it (use bytearray, mmap or a writable array, or register it without IBV_ACCESS_LOCAL_WRITE, "
            "REMOTE_WRITE and REMOTE_ATOMIC as a send/read source)"
        ) from e
    except TypeError as e:
        free(box)
        free(m)
        raise MemoryRegistrationError(f"cannot register {type(buffer).__name__}: not a buffer") from e
    box.has_view = 1
    m.base = <uint8_t *>box.view.buf
    m.addr = addr_override if use_override else <uint64_t>box.view.buf
    m.length = box.view.len
    m.access = access
    m.lkey = lkey
    m.rkey = rkey
    m.owner = box
    return m


cdef void _free_mr(mr *m) noexcept:
    cdef mrbox *box = <mrbox *>m.owner
    if box != NULL:
        if box.has_view:
            PyBuffer_Release(&box.view)
        free(box)
    free(m)


cdef object _check_buffer(object buffer, bint writable, bint allow_empty=False):
    """The contiguous byte view registration needs, or MemoryRegistrationError."""
    try:
        mv = memoryview(buffer)
    except TypeError as e:
        raise MemoryRegistrationError(f"cannot register {type(buffer).__name__}: not a buffer") from e
    if mv.readonly and writable:
        raise MemoryRegistrationError(
            f"cannot register a read-only {type(buffer).__name__} with write access: the device must be able to "
            "write into it (use bytearray, mmap or a writable array, or register it without IBV_ACCESS_LOCAL_WRITE, "
            "REMOTE_WRITE and REMOTE_ATOMIC as a send/read source)"
        )
    if not mv.c_contiguous:
        raise MemoryRegistrationError("cannot register a non-contiguous buffer")
    mv = mv.cast("B")
    if mv.nbytes == 0 and not allow_empty:
        raise MemoryRegistrationError("cannot register an empty buffer")
    return mv


# =================================================================== sans-IO ====

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
cdef class RCCore:
    """One RC queue pair of the C engine, driven sans-IO like :class:`RCQueuePair`:
    ``post_send``/``post_recv``, ``receive_datagram(data, now)``, ``transmit(now)``
    (datagrams encoded on the flow given to :meth:`set_flow`), ``take_completions``,
    ``next_timer``/``on_timer``. For the differential tests."""

    cdef rc_qp *qp
    cdef SansIOMemory mem
    cdef flow txflow
    cdef rc_out out
    cdef public object tracer

    def __cinit__(self, uint32_t qp_num, SansIOMemory mem, cap, bint sq_sig_all=False):
        self.mem = mem
        self.qp = rc_create(qp_num, &mem.pd, cap.max_send_wr, cap.max_recv_wr, cap.max_send_sge, cap.max_recv_sge,
                            sq_sig_all)
        if self.qp == NULL:
            raise MemoryError()
        memset(&self.out, 0, sizeof(rc_out))
        memset(&self.txflow, 0, sizeof(flow))

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


# ==================================================================== the NIC ====

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_trylock(pthread_mutex_t *m)

cdef extern from *:
    """
    static inline int nic_trylock(struct nic *e) { return pthread_mutex_trylock(&e->lock); }
    """
    int nic_trylock(nic *e) nogil


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
    cdef long _direct_thread
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
        self._direct_thread = _threading.get_ident() if handler is not None else 0
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

    def create_qp(self, uint32_t qp_num, NativeCQ send_cq, NativeCQ recv_cq, cap, bint sq_sig_all):
        return NativeQP(self, qp_num, send_cq, recv_cq, cap, sq_sig_all)

    def close(self):
        for mrobj in list(self._mrs.values()):
            mrobj.close()


# __dealloc__ uses the C objects of the attributes: the GC must not clear them first
@cython.no_gc_clear
cdef class NativeQP:
    """An RC queue pair run by the NIC thread; posting sends its first packets inline."""

    cdef nic_qp *q
    cdef NativeEngine engine
    cdef NativePD pd
    cdef NativeCQ scq, rcq
    cdef readonly uint32_t qp_num
    cdef bint _closed
    cdef int _last_state

    def __cinit__(self, NativePD pd, uint32_t qp_num, NativeCQ send_cq, NativeCQ recv_cq, cap, bint sq_sig_all):
        self.pd = pd
        self.engine = pd.engine
        self.scq = send_cq
        self.rcq = recv_cq
        self.qp_num = qp_num
        cdef nic *e = &self.engine.e
        cdef uint32_t msw = cap.max_send_wr, mrw = cap.max_recv_wr, mss = cap.max_send_sge, mrs = cap.max_recv_sge
        with nogil:
            nic_lock(e)
            self.q = nic_qp_new(e, qp_num, &pd.p, send_cq.cq, recv_cq.cq, msw, mrw, mss, mrs, sq_sig_all)
            if self.q != NULL and e.tracing:
                self.q.rc.trace = _trace_rc_cb
                self.q.rc.trace_ctx = <void *>self.engine
            nic_unlock(e)
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

    def modify(self, attr, peer, mtu_bytes):
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
        cdef int n, i, rc = 0, failed = -1
        cdef nic *e = &self.engine.e
        cdef nic_qp *q
        cdef double now, t
        cdef Py_ssize_t total = 0
        cdef bint closed = False, defer = False
        cdef char err[320]
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
        q = self.q
        tracing = e.tracing
        # Doorbell batching: a post to a QP that already has work in flight, made on the
        # thread of the loop the engine is attached to, is transmitted at the end of this
        # loop iteration with every other such post (one GSO send / sendmmsg for all);
        # a post to an idle QP leaves at once (the latency path).
        try:
            if not tracing and self.engine._loop_thread == _threading.get_ident():
                _lock_gil(e)  # no system call follows if it defers: keep the GIL
                if not q.closed and q.rc.sq_len > 0:
                    defer = True
                    now = nic_now()
                    for i in range(n):
                        rc = rc_post_send(q.rc, &ws[i], now)
                        if rc:
                            _copy_errmsg(err, q.rc)
                            break
                nic_unlock(e)
            if not defer:
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
                                self.engine._trace_posted(self.qp_num, wrs if wrs_seq is None else wrs_seq,
                                                          n if failed < 0 else failed)
                        e.counters[NC_TX_INLINE] += 1
                        nic_flush(e, q, now)
                        t = rc_next_timer(q.rc)
                        nic_timer_armed(e, t)
                    nic_unlock(e)
        finally:
            if ws != &one:
                free(ws)
            if sg != sges1:
                free(sg)
        if closed:
            raise QueuePairStateError("post_send on a destroyed QP")
        if defer:
            self.engine._defer_flush(self.qp_num)
        if e.nfire:
            self.engine._fire()
        if rc:
            _raise_rc(err, rc)

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


# ----------------------------------------------------------- tracer hooks ----

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
    cdef long _loop_thread
    cdef int _loop_fd, _loop_refs
    cdef list _posted
    cdef object __weakref__

    def __cinit__(self, str ip, int port, *, str icrc="strict", capture=None):
        policies = {"strict": ICRC_STRICT, "any-ip-id": ICRC_ANY_IP_ID, "off": ICRC_OFF}
        if icrc not in policies:
            raise ValueError(f"ICRC policy must be one of {tuple(policies)}, not {icrc!r}")
        # the settings first: a bad value is refused before anything is opened
        gso = _settings.SOFT_GSO.get()
        gro = _settings.SOFT_GRO.get()
        window_us = _settings.SOFT_WINDOW_US.get()
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
        if window_us is not None:
            self.e.window_len = window_us * 1e-6
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
    def gro(self):
        """Whether the kernel hands this socket coalesced datagrams (UDP_GRO): a
        sender's GSO batch then arrives with one receive and is split here."""
        return bool(self.e.gro)

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

    def live_objects(self):
        return {"qps": self.e.nqps, "mrs": self.e.nmrs, "cqs": self.e.ncqs}

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
            self._loop_thread = _threading.get_ident()
            self._loop_fd = fd
            self._loop_refs = 0
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
        loop = self._loop
        self._loop = None
        self._loop_thread = 0
        if self._posted:
            self._flush_posted()
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

    def _defer_flush(self, uint32_t qpn):
        """Transmit ``qpn``'s new WQEs at the end of this loop iteration."""
        if not self._posted:
            self._posted = [qpn]
            self._loop.call_soon(self._flush_posted)
        elif qpn not in self._posted:
            self._posted.append(qpn)

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
        if self.e.loop_owns:
            # the loop has the socket already: move the window's end (an aligned double
            # store; the NIC thread reads it under the lock and at worst sees the old one)
            self.e.window_deadline = nic_now() + self.e.window_len
            return
        _lock_gil(&self.e)
        nic_expect(&self.e, nic_now())
        nic_unlock(&self.e)

    def _loop_ready(self):
        """The loop's reader callback: receive, hand completions over, then transmit
        (the ACKs leave with whatever the completion handlers posted)."""
        cdef int n
        with nogil:
            nic_lock(&self.e)
            n = nic_loop_receive(&self.e, nic_now())
            nic_unlock(&self.e)
        if self.e.nfire:
            self._fire()
        if n:
            with nogil:
                nic_lock(&self.e)
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
        with nogil:
            nic_lock(&self.e)
            n = self.e.nfire
            if n > 16:
                lst = <nic_cq **>malloc(n * sizeof(nic_cq *))
            if lst != NULL and n:
                memcpy(lst, self.e.fire, n * sizeof(nic_cq *))
                self.e.nfire = 0
            nic_unlock(&self.e)
        if lst == NULL:
            raise MemoryError()
        me = _threading.get_ident()
        try:
            for i in range(n):
                if lst[i].ch.pyobj != NULL:
                    chobj = <NativeChannel>lst[i].ch.pyobj
                    if chobj._direct is not None and chobj._direct_thread == me and not chobj.closed:
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
            nic_receive_one(&self.e, <const uint8_t *>PyBytes_AS_STRING(data), len(data), &ss, nic_now())
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
