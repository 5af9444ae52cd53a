/* Reliable Connected transport, sans-IO: the C port of rc.py.
 *
 * One struct rc_qp is the requester and responder of one RC queue pair. Like
 * RCQueuePair it does no I/O, owns no thread and reads no clock: the caller
 * posts work requests, feeds decoded packets with the time, and collects the
 * packets to send (rc_transmit), the completions (qp->wcs) and the next timer
 * (rc_next_timer). Every transition follows rc.py line by line, so that the
 * differential tests can demand identical packets, completions and memory.
 *
 * Memory regions are struct mr, found through a struct pd (hash tables by lkey
 * and rkey). A WQE, a multi-packet WRITE in progress and a READ response in
 * the output hold a reference on the region they use, so a region
 * deregistered meanwhile stays alive (as the Python engine's memoryviews keep
 * it) until the last reference goes; pd->release then hands it back to its
 * owner.
 *
 * A shared receive queue (struct rc_srq, srq.py's RCSharedReceiveQueue) holds
 * receive WQEs that every QP created with it takes from instead of its own
 * receive queue; its limit event is raised through its on_limit hook.
 */
#ifndef AIORDMA_RC_H
#define AIORDMA_RC_H

#include <stddef.h>
#include <stdint.h>

#include "wire.h"

/* verbs values (providers/base.py) */
enum { ACC_LOCAL_WRITE = 1, ACC_REMOTE_WRITE = 2, ACC_REMOTE_READ = 4, ACC_REMOTE_ATOMIC = 8 };
enum {
    WR_RDMA_WRITE = 0,
    WR_RDMA_WRITE_WITH_IMM = 1,
    WR_SEND = 2,
    WR_SEND_WITH_IMM = 3,
    WR_RDMA_READ = 4,
    WR_ATOMIC_CMP_AND_SWP = 5,
    WR_ATOMIC_FETCH_AND_ADD = 6,
};
enum {
    WC_SEND = 0,
    WC_RDMA_WRITE = 1,
    WC_RDMA_READ = 2,
    WC_COMP_SWAP = 3,
    WC_FETCH_ADD = 4,
    WC_RECV = 128,
    WC_RECV_RDMA_WITH_IMM = 129,
};
enum {
    WCS_SUCCESS = 0,
    WCS_LOC_LEN_ERR = 1,
    WCS_LOC_QP_OP_ERR = 2,
    WCS_LOC_PROT_ERR = 4,
    WCS_WR_FLUSH_ERR = 5,
    WCS_BAD_RESP_ERR = 7,
    WCS_REM_INV_REQ_ERR = 9,
    WCS_REM_ACCESS_ERR = 10,
    WCS_REM_OP_ERR = 11,
    WCS_RETRY_EXC_ERR = 12,
    WCS_RNR_RETRY_EXC_ERR = 13,
};
enum { QPS_RESET = 0, QPS_INIT = 1, QPS_RTR = 2, QPS_RTS = 3, QPS_SQD = 4, QPS_SQE = 5, QPS_ERR = 6 };
enum { SEND_FLAG_SIGNALED = 2, SEND_FLAG_SOLICITED = 4 };

/* return codes of the verbs calls: the binding raises the matching exception with qp->errmsg */
enum { RC_OK = 0, RC_EQPSTATE = -1, RC_EINVAL = -2 };

/* ------------------------------------------------------------- memory ---- */

struct pd;

struct mr {
    uint64_t addr, length; /* the virtual address SGEs and rkeys name, and the size */
    uint32_t access, lkey, rkey;
    uint8_t *base; /* where the bytes are (= addr for real registrations) */
    int refcnt;    /* 1 while registered, +1 per user inside the engine */
    int registered;
    struct pd *pd;
    struct mr *next_l, *next_r; /* hash chains */
    void *owner;                /* the binding's (a Py_buffer holder) */
};

#define PD_BUCKETS 256

struct pd {
    struct mr *by_l[PD_BUCKETS], *by_r[PD_BUCKETS];
    size_t count;
    /* called when a deregistered region's last reference goes */
    void (*release)(struct pd *pd, struct mr *mr);
    void *release_ctx;
};

void pd_init(struct pd *pd);
struct mr *pd_by_lkey(const struct pd *pd, uint32_t lkey);
struct mr *pd_by_rkey(const struct pd *pd, uint32_t rkey);
int pd_add(struct pd *pd, struct mr *mr);      /* -1 when a key is taken */
void pd_remove(struct pd *pd, struct mr *mr);  /* deregister: drops the registration's reference */
static inline void mr_ref(struct mr *mr) { mr->refcnt++; }
void mr_unref(struct mr *mr);

/* --------------------------------------------------------- queue pair ---- */

struct rc_counters {
    uint64_t sent_pkts, rcvd_pkts, retransmits, timeouts, rnr_naks_sent, rnr_naks_rcvd, seq_naks_sent,
        seq_naks_rcvd, duplicate_requests, out_of_sequence, remote_access_errors, invalid_requests,
        dropped_responses, dropped_wrong_state, acks_sent;
};
#define RC_NCOUNTERS 15
extern const char *const rc_counter_names[RC_NCOUNTERS];

struct seg {
    uint8_t *p;
    uint32_t len;
    struct mr *mr;
};

/* a work request as the binding reads it from SendWR / RecvWR */
struct sge_in {
    uint64_t addr;
    uint32_t length, lkey;
};
struct send_wr_in {
    uint64_t wr_id;
    int opcode;
    uint32_t send_flags;
    int has_imm;
    uint32_t imm;
    uint64_t remote_addr;
    uint32_t rkey;
    uint64_t compare_add, swap;
    int nsge;
    const struct sge_in *sges;
};

struct send_wqe {
    uint64_t wr_id;
    uint8_t opcode, signaled, read_atomic, solicited, has_imm;
    uint32_t imm;
    uint32_t length, psn_first, npkts, psn_last;
    uint64_t remote_addr;
    uint32_t rkey;
    uint64_t compare_add, swap;
    uint32_t resp_offset, resp_pkts, req_pkts;
    uint32_t send_flags;
    int nsegs;
    struct seg *segs;
};

struct recv_wqe {
    uint64_t wr_id;
    uint32_t length;
    int nsegs;
    struct seg *segs;
};

struct read_res {
    uint32_t psn, npkts;
    uint8_t opcode;
    uint64_t va;
    uint32_t rkey, length;
    uint64_t orig;
    uint32_t msn;
};

/* one entry of the responder's output: a packet, or a run of READ responses */
struct resp {
    int is_read;
    union {
        struct pkt pkt;    /* header-only packets (ACK, NAK, ATOMIC_ACKNOWLEDGE) */
        uint8_t grant[12]; /* a READ run's CMA_READ_GRANT payload (see rc.c): no bigger per ACK */
    };
    /* READ responses: packets skip .. n-1 of the response to res (psn, msn), bytes of mr at va */
    uint32_t psn, msn, skip, n, length;
    uint64_t va;
    struct mr *mr;
};

struct rc_wc {
    uint64_t wr_id;
    uint8_t is_recv, status, opcode, has_imm;
    uint32_t byte_len, qp_num, src_qp, imm;
};

/* events of the RDMA Write walk-through (rc.py's tracer) */
enum { TR_LKEY_READ = 1, TR_PACKET_OUT, TR_RKEY_CHECK, TR_DMA_WRITE, TR_ACK_IN };
struct rc_trace {
    int event;
    const struct pkt *pkt;
    const struct send_wqe *wqe;
    const struct mr *region;
    uint32_t offset, length;
    int ok;
    const char *why;
};

struct rc_out {
    struct pkt *pkts;
    uint8_t **owned; /* gathered payloads (freed by rc_out_clear) */
    size_t n, cap;
};
void rc_out_clear(struct rc_out *o);
void rc_out_free(struct rc_out *o);

/* --------------------------------------------------- shared receive queue ---- */

/* ibv_srq (srq.py): receive WQEs that the QPs created with it take from. The
 * engine lock guards it like a QP. When a take leaves fewer than an armed
 * limit posted, the limit event fires once (on_limit, lock held: it only
 * queues the event) and the SRQ disarms. */
struct rc_srq {
    uint32_t srq_num;
    struct pd *pd;
    uint32_t max_wr, max_sge;
    struct recv_wqe *q; /* ring of max_wr */
    struct seg *segs;   /* max_sge per entry */
    uint32_t head, len;
    uint32_t limit; /* armed limit; 0: not armed */
    uint64_t limit_events;
    int users; /* QPs that take from it: destroy is refused while > 0 */
    void (*on_limit)(void *ctx, struct rc_srq *srq);
    void *on_limit_ctx;
    char errmsg[320]; /* the message of the last RC_EINVAL */
};

/* NULL on allocation failure */
struct rc_srq *rc_srq_create(uint32_t srq_num, struct pd *pd, uint32_t max_wr, uint32_t max_sge);
/* drop the posted WQEs (their region references) and free it; users must be 0 */
void rc_srq_destroy(struct rc_srq *srq);
int rc_srq_post_recv(struct rc_srq *srq, uint64_t wr_id, const struct sge_in *sges, int nsge);
int rc_srq_arm(struct rc_srq *srq, int64_t limit); /* RC_EINVAL outside 0 .. max_wr */

struct rc_attr { /* QPAttr: has_* = not None */
    int qp_state;
    int port_num;
    int has_access, has_path_mtu, has_dest_qp, has_rq_psn, has_sq_psn, has_max_dest_rd_atomic, has_max_rd_atomic,
        has_min_rnr_timer, has_timeout, has_retry_cnt, has_rnr_retry, has_dgid, has_sgid_index, has_dport;
    uint32_t access;
    int path_mtu;
    uint32_t dest_qp_num, rq_psn, sq_psn;
    int max_dest_rd_atomic, max_rd_atomic, min_rnr_timer, timeout, retry_cnt, rnr_retry, sgid_index, dport;
    uint8_t dgid[16];
};

struct rc_qp {
    uint32_t qp_num;
    struct pd *pd;
    struct rc_srq *srq; /* where the responder takes its receives from (NULL: rq) */
    /* QPCap */
    uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge;
    int sq_sig_all;
    int state;
    struct rc_counters c;
    /* attributes */
    int port_num;
    uint32_t access;
    int path_mtu;
    uint32_t mtu;
    uint32_t dest_qp_num;
    int has_dgid;
    uint8_t dgid[16];
    int has_dport, dport;
    int sgid_index;
    int timeout_code;
    double timeout_s; /* < 0: infinite */
    int retry_cnt, rnr_retry, min_rnr_timer, max_rd_atomic, max_dest_rd_atomic;
    uint32_t window_pkts, ack_req_every;
    /* requester */
    struct send_wqe *sq; /* ring of max_send_wr */
    struct seg *sq_segs;
    uint32_t sq_head, sq_len;
    /* the NIC's count of QPs whose send queue holds work requests (NULL: none kept):
     * this QP adds itself while its sq_len is non-zero */
    int *busy_count;
    uint32_t next_psn, una_psn;
    uint32_t cursor, cursor_pkt;
    int retries_left, rnr_retries_left;
    double retransmit_deadline, rnr_deadline; /* < 0: not armed */
    int has_rnr_psn;
    uint32_t rnr_psn;
    double last_progress;
    uint32_t sent_high;
    int has_retry_from;
    uint32_t retry_from, retry_until;
    int has_deferred_nak;
    uint32_t deferred_psn;
    int deferred_status;
    const char *deferred_why;
    /* responder */
    struct recv_wqe *rq; /* ring of max_recv_wr */
    struct seg *rq_segs;
    uint32_t rq_head, rq_len;
    uint32_t epsn, msn;
    int nak_sent;
    int has_ack_due;
    uint32_t ack_due;
    int has_cur_recv;
    struct recv_wqe cur_recv;
    struct seg *cur_recv_segs;
    uint32_t cur_recv_offset;
    int has_cur_send_opcode;
    uint8_t cur_send_opcode;
    int has_cur_write; /* (region, offset, remaining, dma_len); region NULL for a zero-length WRITE */
    struct mr *cw_region;
    uint64_t cw_offset;
    uint32_t cw_remaining, cw_dma_len;
    int has_cur_write_opcode;
    uint8_t cur_write_opcode;
    struct read_res *resources; /* ring, capacity res_cap */
    uint32_t res_head, res_len, res_cap;
    struct resp *responses;
    size_t nresp, resp_cap;
    /* output */
    struct rc_wc *wcs;
    size_t nwcs, wcs_cap;
    char error_reason[320];
    int has_error_reason;
    char errmsg[320]; /* the message of the last RC_EQPSTATE / RC_EINVAL */
    /* cross-memory attach (the native engine's alone: rc.py has none): between two soft
     * devices of one host, a READ of at least RC_CMA_MIN_READ bytes is answered by one
     * CMA_READ_GRANT once the rkey checks pass, and the requester copies the bytes
     * straight out of the responder's process (process_vm_readv) */
    int cma_peer_pid;       /* > 0: the requester takes grants and reads from this process */
    int cma_respond;        /* the responder answers READs with grants */
    uint64_t *cma_counters; /* the NIC's (NULL: none): grants sent, READs done by grant, bytes */
    /* tracer */
    void (*trace)(void *ctx, struct rc_qp *qp, const struct rc_trace *t);
    void *trace_ctx;
};

/* create in IBV_QPS_RESET; NULL on allocation failure */
struct rc_qp *rc_create(uint32_t qp_num, struct pd *pd, uint32_t max_send_wr, uint32_t max_recv_wr,
                        uint32_t max_send_sge, uint32_t max_recv_sge, int sq_sig_all);
/* with srq: its receives come from that SRQ (max_recv_wr and max_recv_sge are ignored) */
struct rc_qp *rc_create_ex(uint32_t qp_num, struct pd *pd, struct rc_srq *srq, uint32_t max_send_wr,
                           uint32_t max_recv_wr, uint32_t max_send_sge, uint32_t max_recv_sge, int sq_sig_all);
void rc_destroy(struct rc_qp *qp);
int rc_modify(struct rc_qp *qp, const struct rc_attr *a, double now);
int rc_post_send(struct rc_qp *qp, const struct send_wr_in *wr, double now);
int rc_post_recv(struct rc_qp *qp, uint64_t wr_id, const struct sge_in *sges, int nsge);
void rc_receive(struct rc_qp *qp, const struct pkt *p, double now);
void rc_transmit(struct rc_qp *qp, double now, struct rc_out *out);
double rc_next_timer(const struct rc_qp *qp); /* < 0: none */
void rc_on_timer(struct rc_qp *qp, double now);
static inline void rc_take_completions_done(struct rc_qp *qp) { qp->nwcs = 0; }
void rc_enter_error(struct rc_qp *qp, const char *reason);
double rc_timeout_seconds(int code); /* < 0: infinite */
/* the retransmit timer doubles per retry without progress, up to this many ACK
 * timeouts (rc.py's RETRY_BACKOFF_CAP, which says why) */
#define RC_RETRY_BACKOFF_CAP 32
/* the smallest READ a grant answers: below it the system call costs more than the
 * copies it saves (a 64 KiB READ is 16 responses of a 4 KiB MTU) */
#define RC_CMA_MIN_READ (64u << 10)
const char *rc_qp_state_name(int s);
const char *rc_wc_status_name(int s);

static inline struct send_wqe *sq_at(const struct rc_qp *qp, uint32_t i)
{
    return &qp->sq[(qp->sq_head + i) % qp->max_send_wr];
}
static inline struct recv_wqe *rq_at(const struct rc_qp *qp, uint32_t i)
{
    return &qp->rq[(qp->rq_head + i) % qp->max_recv_wr];
}

#endif
