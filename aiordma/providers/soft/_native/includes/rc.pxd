# rc.h: the RC queue pair (requester and responder, a port of rc.py), protection
# domains and memory regions, the verbs enumerations.
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t

from .wire cimport pkt


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
    struct rc_srq:
        uint32_t srq_num
        uint32_t max_wr, max_sge
        uint32_t len
        uint32_t limit
        uint64_t limit_events
        int users
        char errmsg[320]
    rc_srq *rc_srq_create(uint32_t srq_num, pd *p, uint32_t max_wr, uint32_t max_sge)
    void rc_srq_destroy(rc_srq *srq)
    int rc_srq_post_recv(rc_srq *srq, uint64_t wr_id, const sge_in *sges, int nsge)
    int rc_srq_arm(rc_srq *srq, int64_t limit)
    struct rc_qp:
        uint32_t qp_num
        rc_srq *srq
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
        int cma_peer_pid, cma_respond
        void (*trace)(void *ctx, rc_qp *qp, const rc_trace *t)
        void *trace_ctx
    rc_qp *rc_create(uint32_t qp_num, pd *p, uint32_t max_send_wr, uint32_t max_recv_wr, uint32_t max_send_sge,
                     uint32_t max_recv_sge, int sq_sig_all)
    rc_qp *rc_create_ex(uint32_t qp_num, pd *p, rc_srq *srq, uint32_t max_send_wr, uint32_t max_recv_wr,
                        uint32_t max_send_sge, uint32_t max_recv_sge, int sq_sig_all)
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
