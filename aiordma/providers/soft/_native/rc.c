/* Reliable Connected transport, sans-IO: the port of rc.py (see rc.h).
 *
 * Function names follow rc.py's methods (rc_post_send = post_send, on_ack =
 * _on_ack, ...) and each keeps the order of its checks and side effects, so a
 * reader can hold the two side by side; comments that explain *why* live in
 * rc.py and are not repeated here.
 */
#define _GNU_SOURCE /* process_vm_readv */
#include "rc.h"

#include <errno.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h> /* (streaming stores: copy_streaming) */
#endif

const char *const rc_counter_names[RC_NCOUNTERS] = {
    "sent_pkts",         "rcvd_pkts",           "retransmits",          "timeouts",
    "rnr_naks_sent",     "rnr_naks_rcvd",       "seq_naks_sent",        "seq_naks_rcvd",
    "duplicate_requests", "out_of_sequence",    "remote_access_errors", "invalid_requests",
    "dropped_responses", "dropped_wrong_state", "acks_sent",
};

static const char *const qps_names[] = {"IBV_QPS_RESET", "IBV_QPS_INIT", "IBV_QPS_RTR", "IBV_QPS_RTS",
                                        "IBV_QPS_SQD",   "IBV_QPS_SQE",  "IBV_QPS_ERR"};
const char *rc_qp_state_name(int s) { return (s >= 0 && s <= 6) ? qps_names[s] : "IBV_QPS_UNKNOWN"; }

static const char *const wcs_names[] = {
    "IBV_WC_SUCCESS",          "IBV_WC_LOC_LEN_ERR",        "IBV_WC_LOC_QP_OP_ERR",    "IBV_WC_LOC_EEC_OP_ERR",
    "IBV_WC_LOC_PROT_ERR",     "IBV_WC_WR_FLUSH_ERR",       "IBV_WC_MW_BIND_ERR",      "IBV_WC_BAD_RESP_ERR",
    "IBV_WC_LOC_ACCESS_ERR",   "IBV_WC_REM_INV_REQ_ERR",    "IBV_WC_REM_ACCESS_ERR",   "IBV_WC_REM_OP_ERR",
    "IBV_WC_RETRY_EXC_ERR",    "IBV_WC_RNR_RETRY_EXC_ERR",  "IBV_WC_LOC_RDD_VIOL_ERR", "IBV_WC_REM_INV_RD_REQ_ERR",
    "IBV_WC_REM_ABORT_ERR",    "IBV_WC_INV_EECN_ERR",       "IBV_WC_INV_EEC_STATE_ERR", "IBV_WC_FATAL_ERR",
    "IBV_WC_RESP_TIMEOUT_ERR", "IBV_WC_GENERAL_ERR",
};
const char *rc_wc_status_name(int s) { return (s >= 0 && s <= 21) ? wcs_names[s] : "IBV_WC_?"; }

static const char *const wr_names[] = {
    "IBV_WR_RDMA_WRITE", "IBV_WR_RDMA_WRITE_WITH_IMM", "IBV_WR_SEND",        "IBV_WR_SEND_WITH_IMM",
    "IBV_WR_RDMA_READ",  "IBV_WR_ATOMIC_CMP_AND_SWP",  "IBV_WR_ATOMIC_FETCH_AND_ADD",
};

static const uint8_t wc_opcode_for_wr[7] = {WC_RDMA_WRITE, WC_RDMA_WRITE, WC_SEND,     WC_SEND,
                                            WC_RDMA_READ,  WC_COMP_SWAP,  WC_FETCH_ADD};

/* request opcodes of a SEND/WRITE WR: ONLY, FIRST, MIDDLE, LAST */
static const uint8_t request_codes[4][4] = {
    [WR_SEND] = {OP_SEND_ONLY, OP_SEND_FIRST, OP_SEND_MIDDLE, OP_SEND_LAST},
    [WR_SEND_WITH_IMM] = {OP_SEND_ONLY_WITH_IMMEDIATE, OP_SEND_FIRST, OP_SEND_MIDDLE, OP_SEND_LAST_WITH_IMMEDIATE},
    [WR_RDMA_WRITE] = {OP_RDMA_WRITE_ONLY, OP_RDMA_WRITE_FIRST, OP_RDMA_WRITE_MIDDLE, OP_RDMA_WRITE_LAST},
    [WR_RDMA_WRITE_WITH_IMM] = {OP_RDMA_WRITE_ONLY_WITH_IMMEDIATE, OP_RDMA_WRITE_FIRST, OP_RDMA_WRITE_MIDDLE,
                                OP_RDMA_WRITE_LAST_WITH_IMMEDIATE},
};

double rc_timeout_seconds(int code) { return code == 0 ? -1.0 : 4.096e-6 * (double)(1ULL << code); }

/* ------------------------------------------------------------- memory ---- */

void pd_init(struct pd *pd) { memset(pd, 0, sizeof *pd); }

static inline unsigned key_hash(uint32_t k) { return (k ^ (k >> 8) ^ (k >> 16) ^ (k >> 24)) % PD_BUCKETS; }

struct mr *pd_by_lkey(const struct pd *pd, uint32_t lkey)
{
    for (struct mr *m = pd->by_l[key_hash(lkey)]; m; m = m->next_l)
        if (m->lkey == lkey) return m;
    return NULL;
}

struct mr *pd_by_rkey(const struct pd *pd, uint32_t rkey)
{
    for (struct mr *m = pd->by_r[key_hash(rkey)]; m; m = m->next_r)
        if (m->rkey == rkey) return m;
    return NULL;
}

int pd_add(struct pd *pd, struct mr *mr)
{
    if (pd_by_lkey(pd, mr->lkey) || pd_by_rkey(pd, mr->rkey)) return -1;
    unsigned hl = key_hash(mr->lkey), hr = key_hash(mr->rkey);
    mr->next_l = pd->by_l[hl];
    pd->by_l[hl] = mr;
    mr->next_r = pd->by_r[hr];
    pd->by_r[hr] = mr;
    mr->pd = pd;
    mr->registered = 1;
    mr->refcnt = 1;
    pd->count++;
    return 0;
}

void pd_remove(struct pd *pd, struct mr *mr)
{
    if (!mr->registered) return;
    struct mr **pp;
    for (pp = &pd->by_l[key_hash(mr->lkey)]; *pp; pp = &(*pp)->next_l)
        if (*pp == mr) {
            *pp = mr->next_l;
            break;
        }
    for (pp = &pd->by_r[key_hash(mr->rkey)]; *pp; pp = &(*pp)->next_r)
        if (*pp == mr) {
            *pp = mr->next_r;
            break;
        }
    mr->registered = 0;
    pd->count--;
    mr_unref(mr);
}

void mr_unref(struct mr *mr)
{
    if (--mr->refcnt == 0 && mr->pd && mr->pd->release) mr->pd->release(mr->pd, mr);
}

/* ------------------------------------------------------------ helpers ---- */

static void *grow(void *p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return p;
    size_t c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void *q = realloc(p, c * elem);
    if (!q) abort(); /* out of memory inside the NIC: nothing sensible to do */
    *cap = c;
    return q;
}

/* the message of an RC_EQPSTATE / RC_EINVAL into errmsg (320 bytes: a QP's or an SRQ's) */
static void set_errbuf(char *errmsg, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(errmsg, 320, fmt, ap);
    va_end(ap);
}
#define set_err(qp, ...) set_errbuf((qp)->errmsg, __VA_ARGS__)

static void complete(struct rc_qp *qp, int is_recv, uint64_t wr_id, int status, int opcode, uint32_t byte_len,
                     int has_imm, uint32_t imm)
{
    qp->wcs = grow(qp->wcs, &qp->wcs_cap, qp->nwcs + 1, sizeof *qp->wcs);
    struct rc_wc *w = &qp->wcs[qp->nwcs++];
    w->wr_id = wr_id;
    w->is_recv = (uint8_t)is_recv;
    w->status = (uint8_t)status;
    w->opcode = (uint8_t)opcode;
    w->byte_len = byte_len;
    w->qp_num = qp->qp_num;
    w->src_qp = qp->dest_qp_num;
    w->has_imm = (uint8_t)has_imm;
    w->imm = has_imm ? imm : 0;
}

static void release_segs(struct seg *s, int n)
{
    for (int i = 0; i < n; i++)
        if (s[i].mr) {
            mr_unref(s[i].mr);
            s[i].mr = NULL;
        }
}

static void scatter(const struct seg *segs, int nsegs, uint64_t offset, const uint8_t *data, uint32_t n)
{
    if (!n) return;
    uint32_t pos = 0;
    for (int i = 0; i < nsegs; i++) {
        uint32_t sl = segs[i].len;
        if (offset >= sl) {
            offset -= sl;
            continue;
        }
        uint32_t take = (uint32_t)((sl - offset) < (uint64_t)(n - pos) ? (sl - offset) : (n - pos));
        memcpy(segs[i].p + offset, data + pos, take);
        pos += take;
        offset = 0;
        if (pos >= n) return;
    }
}

/* A READ response's payload into the READ's destination, as a NIC's DMA writes it. Into
 * a registered region larger than NT_REGION_MIN (a transfer's pool of blocks, a tensor:
 * more than a cache holds, so the lines written are seldom in one), pieces of
 * NT_COPY_MIN bytes or more go with non-temporal stores on x86-64: ordinary stores
 * would first read every line into the cache (write-allocate) only to overwrite it
 * whole. A 2-core AMD EPYC VM copies 4 KiB blocks into a 41 MB buffer at 11-14 GB/s with
 * memcpy and 19-22 GB/s streaming; into a 64 KiB buffer the caches hold, memcpy runs at
 * 44-53 GB/s and streaming at 22-25, and the reader would then miss, hence the region's
 * size decides. The caller fences (nt_fence) before it reports the data: streaming
 * stores are weakly ordered. */
#define NT_COPY_MIN 2048u
#define NT_REGION_MIN (16u << 20)
#if defined(__x86_64__) && defined(__SSE2__)
static void copy_streaming(uint8_t *dst, const uint8_t *src, uint32_t n)
{
    if (n < NT_COPY_MIN) {
        memcpy(dst, src, n);
        return;
    }
    uint32_t head = (uint32_t)((16 - ((uintptr_t)dst & 15)) & 15);
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src), b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32)), d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
}
static inline void nt_fence(void) { _mm_sfence(); }
#else
static void copy_streaming(uint8_t *dst, const uint8_t *src, uint32_t n) { memcpy(dst, src, n); }
static inline void nt_fence(void) {}
#endif

/* scatter, for a READ response's payload (copy_streaming into large regions; the caller fences) */
static void place(const struct seg *segs, int nsegs, uint64_t offset, const uint8_t *data, uint32_t n)
{
    uint32_t pos = 0;
    for (int i = 0; i < nsegs && pos < n; i++) {
        uint32_t sl = segs[i].len;
        if (offset >= sl) {
            offset -= sl;
            continue;
        }
        uint32_t take = (uint32_t)((sl - offset) < (uint64_t)(n - pos) ? (sl - offset) : (n - pos));
        if (segs[i].mr && segs[i].mr->length >= NT_REGION_MIN)
            copy_streaming(segs[i].p + offset, data + pos, take);
        else
            memcpy(segs[i].p + offset, data + pos, take);
        pos += take;
        offset = 0;
    }
}

/* length bytes at offset of the concatenated segments: a pointer into one
 * segment, or a malloc'd copy (*owned set) when the range spans segments */
static const uint8_t *gather(const struct seg *segs, int nsegs, uint64_t offset, uint32_t length, uint8_t **owned)
{
    *owned = NULL;
    if (length == 0) return (const uint8_t *)"";
    for (int i = 0; i < nsegs; i++) {
        uint32_t sl = segs[i].len;
        if (offset >= sl) {
            offset -= sl;
            continue;
        }
        if (offset + length <= sl) return segs[i].p + offset;
        uint8_t *buf = malloc(length);
        if (!buf) abort();
        uint32_t need = length, pos = 0;
        for (int j = i; j < nsegs && need; j++) {
            uint32_t avail = (uint32_t)(segs[j].len - offset);
            uint32_t take = avail < need ? avail : need;
            memcpy(buf + pos, segs[j].p + offset, take);
            pos += take;
            need -= take;
            offset = 0;
        }
        *owned = buf;
        return buf;
    }
    return (const uint8_t *)""; /* past the end: cannot happen for a checked WQE */
}

static void out_push(struct rc_out *o, const struct pkt *p, uint8_t *owned)
{
    if (o->n + 1 > o->cap) {
        size_t c = o->cap;
        o->pkts = grow(o->pkts, &c, o->n + 1, sizeof *o->pkts);
        c = o->cap;
        o->owned = grow(o->owned, &c, o->n + 1, sizeof *o->owned);
        o->cap = c;
    }
    o->pkts[o->n] = *p;
    o->owned[o->n] = owned;
    o->n++;
}

void rc_out_clear(struct rc_out *o)
{
    for (size_t i = 0; i < o->n; i++) free(o->owned[i]);
    o->n = 0;
}

void rc_out_free(struct rc_out *o)
{
    rc_out_clear(o);
    free(o->pkts);
    free(o->owned);
    o->pkts = NULL;
    o->owned = NULL;
    o->cap = 0;
}

static void trace(struct rc_qp *qp, int ev, const struct pkt *p, const struct send_wqe *wqe, const struct mr *region,
                  uint32_t offset, uint32_t length, int ok, const char *why)
{
    struct rc_trace t = {ev, p, wqe, region, offset, length, ok, why};
    qp->trace(qp->trace_ctx, qp, &t);
}

/* ------------------------------------------------------- create / reset ---- */

static void init_state(struct rc_qp *qp)
{
    qp->state = QPS_RESET;
    memset(&qp->c, 0, sizeof qp->c);
    qp->port_num = 1;
    qp->access = 0;
    qp->path_mtu = 3; /* IBV_MTU_1024 */
    qp->mtu = 1024;
    qp->dest_qp_num = 0;
    qp->has_dgid = 0;
    qp->has_dport = 0;
    qp->dport = 0;
    qp->sgid_index = 0;
    qp->timeout_code = 14;
    qp->timeout_s = rc_timeout_seconds(14);
    qp->retry_cnt = 7;
    qp->rnr_retry = 7;
    qp->min_rnr_timer = 12;
    qp->max_rd_atomic = 16;
    qp->max_dest_rd_atomic = 16;
    qp->window_pkts = 256;
    qp->ack_req_every = 32;
    if (qp->sq_len && qp->busy_count) --*qp->busy_count;
    qp->sq_head = qp->sq_len = 0;
    qp->next_psn = qp->una_psn = 0;
    qp->cursor = qp->cursor_pkt = 0;
    qp->retries_left = qp->rnr_retries_left = 7;
    qp->retransmit_deadline = qp->rnr_deadline = -1.0;
    qp->has_rnr_psn = 0;
    qp->last_progress = 0.0;
    qp->sent_high = 0;
    qp->has_retry_from = 0;
    qp->retry_until = 0;
    qp->has_deferred_nak = 0;
    qp->rq_head = qp->rq_len = 0;
    qp->epsn = qp->msn = 0;
    qp->nak_sent = 0;
    qp->has_ack_due = 0;
    qp->has_cur_recv = 0;
    qp->cur_recv_offset = 0;
    qp->has_cur_send_opcode = 0;
    qp->has_cur_write = 0;
    qp->cw_region = NULL;
    qp->has_cur_write_opcode = 0;
    qp->res_head = qp->res_len = 0;
    qp->nresp = 0;
    qp->nwcs = 0;
    qp->has_error_reason = 0;
    qp->error_reason[0] = 0;
}

static uint32_t sq_size(const struct rc_qp *qp) { return qp->max_send_wr ? qp->max_send_wr : 1; }
static uint32_t rq_size(const struct rc_qp *qp) { return qp->max_recv_wr ? qp->max_recv_wr : 1; }
static uint32_t sq_sges(const struct rc_qp *qp) { return qp->max_send_sge ? qp->max_send_sge : 1; }
static uint32_t rq_sges(const struct rc_qp *qp) { return qp->max_recv_sge ? qp->max_recv_sge : 1; }

/* The work queues' arrays (a 264-entry send queue with 4 SGEs each: about 50 KiB) are
 * anonymous mappings from a page up: a page costs memory only once a work request
 * lands in it (an idle queue pair touches a few), and freeing gives it back to the
 * system (heap memory freed by thousands of closed connections stays with the process). */
#define QUEUE_MMAP_MIN 16384

static void *queue_alloc(size_t count, size_t elem)
{
    size_t n = count * elem;
    if (n < QUEUE_MMAP_MIN) return calloc(count, elem);
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void queue_free(void *p, size_t count, size_t elem)
{
    size_t n = count * elem;
    if (!p) return;
    if (n < QUEUE_MMAP_MIN)
        free(p);
    else
        munmap(p, n);
}

struct rc_qp *rc_create(uint32_t qp_num, struct pd *pd, uint32_t max_send_wr, uint32_t max_recv_wr,
                        uint32_t max_send_sge, uint32_t max_recv_sge, int sq_sig_all)
{
    return rc_create_ex(qp_num, pd, NULL, max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, sq_sig_all);
}

struct rc_qp *rc_create_ex(uint32_t qp_num, struct pd *pd, struct rc_srq *srq, uint32_t max_send_wr,
                           uint32_t max_recv_wr, uint32_t max_send_sge, uint32_t max_recv_sge, int sq_sig_all)
{
    struct rc_qp *qp = calloc(1, sizeof *qp);
    if (!qp) return NULL;
    qp->qp_num = qp_num;
    qp->pd = pd;
    qp->max_send_wr = max_send_wr;
    /* a QP with an SRQ has no receive queue (verbs ignore max_recv_wr and max_recv_sge) */
    qp->max_recv_wr = srq ? 0 : max_recv_wr;
    qp->max_send_sge = max_send_sge;
    qp->max_recv_sge = srq ? 0 : max_recv_sge;
    qp->sq_sig_all = sq_sig_all;
    uint32_t ss = sq_size(qp), rs = rq_size(qp);
    uint32_t sge_s = sq_sges(qp), sge_r = rq_sges(qp);
    /* the receive in progress has the SGEs of a WQE of the SRQ, or of the rq */
    uint32_t sge_cur = srq ? (srq->max_sge ? srq->max_sge : 1) : sge_r;
    qp->sq = queue_alloc(ss, sizeof *qp->sq);
    qp->sq_segs = queue_alloc((size_t)ss * sge_s, sizeof *qp->sq_segs);
    qp->rq = queue_alloc(rs, sizeof *qp->rq);
    qp->rq_segs = queue_alloc((size_t)rs * sge_r, sizeof *qp->rq_segs);
    qp->cur_recv_segs = calloc(sge_cur, sizeof *qp->cur_recv_segs);
    if (!qp->sq || !qp->sq_segs || !qp->rq || !qp->rq_segs || !qp->cur_recv_segs) {
        rc_destroy(qp);
        return NULL;
    }
    if (srq) {
        qp->srq = srq;
        srq->users++;
    }
    /* (each entry's segs pointer is set when a work request is posted into it, not here:
     * touching every entry now would make every page of the queues resident) */
    qp->cur_recv.segs = qp->cur_recv_segs;
    init_state(qp);
    return qp;
}

/* drop every reference the transport state holds (WQEs, WRITE in progress, READ runs) */
static void release_all(struct rc_qp *qp)
{
    for (uint32_t i = 0; i < qp->sq_len; i++) release_segs(sq_at(qp, i)->segs, sq_at(qp, i)->nsegs);
    for (uint32_t i = 0; i < qp->rq_len; i++) release_segs(rq_at(qp, i)->segs, rq_at(qp, i)->nsegs);
    if (qp->has_cur_recv) release_segs(qp->cur_recv.segs, qp->cur_recv.nsegs);
    if (qp->has_cur_write && qp->cw_region) mr_unref(qp->cw_region);
    qp->cw_region = NULL;
    for (size_t i = 0; i < qp->nresp; i++)
        if (qp->responses[i].is_read && qp->responses[i].mr) mr_unref(qp->responses[i].mr);
    qp->nresp = 0;
}

void rc_destroy(struct rc_qp *qp)
{
    if (!qp) return;
    if (qp->sq_len && qp->busy_count) --*qp->busy_count;
    if (qp->sq && qp->rq) release_all(qp);
    if (qp->srq) qp->srq->users--;
    uint32_t ss = sq_size(qp), rs = rq_size(qp);
    queue_free(qp->sq, ss, sizeof *qp->sq);
    queue_free(qp->sq_segs, (size_t)ss * sq_sges(qp), sizeof *qp->sq_segs);
    queue_free(qp->rq, rs, sizeof *qp->rq);
    queue_free(qp->rq_segs, (size_t)rs * rq_sges(qp), sizeof *qp->rq_segs);
    free(qp->cur_recv_segs);
    free(qp->resources);
    free(qp->responses);
    free(qp->wcs);
    free(qp);
}

/* -------------------------------------------------------------- verbs ---- */

static int transition_ok(int cur, int new)
{
    return (cur == QPS_RESET && new == QPS_INIT) || (cur == QPS_INIT && new == QPS_INIT) ||
           (cur == QPS_INIT && new == QPS_RTR) || (cur == QPS_RTR && new == QPS_RTS) ||
           (cur == QPS_RTS && new == QPS_RTS);
}

int rc_modify(struct rc_qp *qp, const struct rc_attr *a, double now)
{
    (void)now;
    int new = a->qp_state;
    if (new < 0) {
        set_err(qp, "modify_qp needs qp_state");
        return RC_EQPSTATE;
    }
    int cur = qp->state;
    if (new == QPS_ERR) {
        rc_enter_error(qp, "moved to IBV_QPS_ERR by modify_qp");
        return RC_OK;
    }
    if (new == QPS_RESET) {
        release_all(qp);
        init_state(qp); /* the trace hook is not QP state: it stays */
        return RC_OK;
    }
    if (!transition_ok(cur, new)) {
        set_err(qp, "QP 0x%06x: illegal transition %s -> %s (RC QPs go RESET -> INIT -> RTR -> RTS)", qp->qp_num,
                rc_qp_state_name(cur), rc_qp_state_name(new));
        return RC_EQPSTATE;
    }
    if (new == QPS_INIT) {
        if (a->has_access) qp->access = a->access;
        qp->port_num = a->port_num;
    } else if (new == QPS_RTR) {
        char missing[64] = "";
        if (!a->has_dest_qp) strcat(missing, "dest_qp_num");
        if (!a->has_rq_psn) strcat(missing, *missing ? ", rq_psn" : "rq_psn");
        if (!a->has_dgid) strcat(missing, *missing ? ", dgid" : "dgid");
        if (*missing) {
            set_err(qp, "INIT -> RTR needs %s", missing);
            return RC_EQPSTATE;
        }
        qp->dest_qp_num = a->dest_qp_num;
        qp->epsn = a->rq_psn & PSN_MASK;
        memcpy(qp->dgid, a->dgid, 16);
        qp->has_dgid = 1;
        qp->has_dport = a->has_dport;
        qp->dport = a->dport;
        if (a->has_path_mtu) {
            qp->path_mtu = a->path_mtu;
            qp->mtu = 128u << a->path_mtu;
        }
        if (a->has_max_dest_rd_atomic) qp->max_dest_rd_atomic = a->max_dest_rd_atomic;
        if (a->has_min_rnr_timer) qp->min_rnr_timer = a->min_rnr_timer & 0x1F;
        if (a->has_sgid_index) qp->sgid_index = a->sgid_index;
        if (a->has_access) qp->access = a->access;
    } else if (new == QPS_RTS) {
        if (cur == QPS_RTR) {
            if (!a->has_sq_psn) {
                set_err(qp, "RTR -> RTS needs sq_psn");
                return RC_EQPSTATE;
            }
            qp->next_psn = qp->una_psn = qp->sent_high = a->sq_psn & PSN_MASK;
        }
        if (a->has_timeout) qp->timeout_code = a->timeout;
        if (a->has_retry_cnt) qp->retry_cnt = a->retry_cnt;
        if (a->has_rnr_retry) qp->rnr_retry = a->rnr_retry;
        if (a->has_max_rd_atomic) qp->max_rd_atomic = a->max_rd_atomic;
        qp->timeout_s = rc_timeout_seconds(qp->timeout_code);
        qp->retries_left = qp->retry_cnt;
        qp->rnr_retries_left = qp->rnr_retry;
    }
    qp->state = new;
    return RC_OK;
}

/* [va, +length) lies inside [base, +size), without the overflow of va + length
 * (va and length come from the wire or the caller) */
static int range_inside(uint64_t va, uint64_t length, uint64_t base, uint64_t size)
{
    return va >= base && va - base <= size && length <= size - (va - base);
}

/* Resolve SGEs to memory, checking each lkey and range (the NIC's lkey check). */
static int segments_in(struct pd *pd, char *errmsg, const struct sge_in *sges, int nsge, uint32_t need,
                       struct seg *out, int *nout, uint64_t *total, const char *what_fmt, const char *what_name,
                       uint64_t wr_id)
{
    /* the request's name for an error message, formatted only when one is needed
     * (every posted WQE passes here: a snprintf per post was a tenth of a small write) */
    char what[96];
#define WHAT() snprintf(what, sizeof what, what_fmt, what_name, (unsigned long long)wr_id)
    int n = 0;
    uint64_t t = 0;
    for (int i = 0; i < nsge; i++) {
        uint32_t length = sges[i].length;
        if (length == 0) continue;
        struct mr *r = pd_by_lkey(pd, sges[i].lkey);
        if (!r) {
            WHAT();
            set_errbuf(errmsg, "%s: lkey 0x%08x is not a memory region of this PD", what, sges[i].lkey);
            goto fail;
        }
        uint64_t addr = sges[i].addr;
        if (!range_inside(addr, length, r->addr, r->length)) {
            WHAT();
            set_errbuf(errmsg, "%s: SGE [0x%llx, +%u) is outside MR lkey 0x%08x [0x%llx, +%llu)", what,
                    (unsigned long long)addr, length, sges[i].lkey, (unsigned long long)r->addr,
                    (unsigned long long)r->length);
            goto fail;
        }
        if (need && !(r->access & need)) {
            WHAT();
            set_errbuf(errmsg, "%s: MR lkey 0x%08x lacks IBV_ACCESS_LOCAL_WRITE, which a receive/read target needs",
                       what, sges[i].lkey);
            goto fail;
        }
        out[n].p = r->base + (addr - r->addr);
        out[n].len = length;
        out[n].mr = r;
        mr_ref(r);
        n++;
        t += length;
    }
    *nout = n;
    *total = t;
    return RC_OK;
fail:
    release_segs(out, n);
    return RC_EINVAL;
#undef WHAT
}

static int segments(struct rc_qp *qp, const struct sge_in *sges, int nsge, uint32_t need, struct seg *out,
                    int *nout, uint64_t *total, const char *what_fmt, const char *what_name, uint64_t wr_id)
{
    return segments_in(qp->pd, qp->errmsg, sges, nsge, need, out, nout, total, what_fmt, what_name, wr_id);
}

int rc_post_send(struct rc_qp *qp, const struct send_wr_in *wr, double now)
{
    (void)now;
    int op = wr->opcode;
    if (qp->state == QPS_ERR) {
        complete(qp, 0, wr->wr_id, WCS_WR_FLUSH_ERR, (op >= 0 && op <= 6) ? wc_opcode_for_wr[op] : WC_SEND, 0, 0, 0);
        return RC_OK;
    }
    if (qp->state != QPS_RTS) {
        set_err(qp,
                "post_send on QP 0x%06x in state %s: the send queue works only in IBV_QPS_RTS (connect the QP first)",
                qp->qp_num, rc_qp_state_name(qp->state));
        return RC_EQPSTATE;
    }
    if (qp->sq_len >= qp->max_send_wr) {
        set_err(qp, "send queue full (%u WRs outstanding)", qp->max_send_wr);
        return RC_EINVAL;
    }
    if ((uint32_t)wr->nsge > qp->max_send_sge) {
        set_err(qp, "%d SGEs > max_send_sge %u", wr->nsge, qp->max_send_sge);
        return RC_EINVAL;
    }
    if (op < 0 || op > 6) {
        set_err(qp, "unsupported send opcode %d", op);
        return RC_EINVAL;
    }
    int read_atomic = op == WR_RDMA_READ || op == WR_ATOMIC_CMP_AND_SWP || op == WR_ATOMIC_FETCH_AND_ADD;
    struct send_wqe *w = sq_at(qp, qp->sq_len);
    w->segs = qp->sq_segs + (size_t)(w - qp->sq) * sq_sges(qp);
    uint64_t length;
    int nsegs;
    int rc = segments(qp, wr->sges, wr->nsge, read_atomic ? ACC_LOCAL_WRITE : 0, w->segs, &nsegs, &length,
                      "%s wr_id=%llu", wr_names[op], wr->wr_id);
    if (rc) return rc;
    uint64_t npkts;
    if (op == WR_ATOMIC_CMP_AND_SWP || op == WR_ATOMIC_FETCH_AND_ADD) {
        if (length != 8) {
            set_err(qp, "%s needs one 8-byte local SGE for the old value, got %llu", wr_names[op],
                    (unsigned long long)length);
            release_segs(w->segs, nsegs);
            return RC_EINVAL;
        }
        npkts = 1;
    } else if (op == WR_RDMA_READ) {
        npkts = length ? (length + qp->mtu - 1) / qp->mtu : 1;
    } else {
        if (length > (1ULL << 31)) {
            set_err(qp, "message of %llu bytes exceeds the 2 GiB RC maximum", (unsigned long long)length);
            release_segs(w->segs, nsegs);
            return RC_EINVAL;
        }
        npkts = length ? (length + qp->mtu - 1) / qp->mtu : 1;
    }
    uint32_t psn = qp->next_psn;
    w->wr_id = wr->wr_id;
    w->opcode = (uint8_t)op;
    w->length = (uint32_t)length; /* a READ longer than 4 GiB is not representable in RETH either */
    w->nsegs = nsegs;
    w->psn_first = psn;
    w->npkts = (uint32_t)npkts;
    w->signaled = qp->sq_sig_all || (wr->send_flags & SEND_FLAG_SIGNALED);
    w->solicited = (wr->send_flags & SEND_FLAG_SOLICITED) != 0;
    w->send_flags = wr->send_flags;
    w->read_atomic = (uint8_t)read_atomic;
    w->psn_last = (psn + (uint32_t)npkts - 1) & PSN_MASK;
    w->remote_addr = wr->remote_addr;
    w->rkey = wr->rkey;
    w->compare_add = wr->compare_add;
    w->swap = wr->swap;
    w->has_imm = (uint8_t)wr->has_imm;
    w->imm = wr->imm;
    w->resp_offset = w->resp_pkts = w->req_pkts = 0;
    qp->next_psn = (psn + (uint32_t)npkts) & PSN_MASK;
    if (qp->sq_len++ == 0 && qp->busy_count) ++*qp->busy_count;
    return RC_OK;
}

int rc_post_recv(struct rc_qp *qp, uint64_t wr_id, const struct sge_in *sges, int nsge)
{
    if (qp->srq) {
        set_err(qp,
                "post_recv on QP 0x%06x: it takes its receives from a shared receive queue (created with srq=, "
                "IBV_QPT_RC with ibv_qp_init_attr.srq set) and has no receive queue of its own: post them to the SRQ "
                "(ibv_post_srq_recv)",
                qp->qp_num);
        return RC_EINVAL;
    }
    if (qp->state == QPS_RESET) {
        set_err(qp, "post_recv on QP 0x%06x in IBV_QPS_RESET: move it to INIT first", qp->qp_num);
        return RC_EQPSTATE;
    }
    if (qp->state == QPS_ERR) {
        complete(qp, 1, wr_id, WCS_WR_FLUSH_ERR, WC_RECV, 0, 0, 0);
        return RC_OK;
    }
    if (qp->rq_len >= qp->max_recv_wr) {
        set_err(qp, "receive queue full (%u WRs posted)", qp->max_recv_wr);
        return RC_EINVAL;
    }
    if ((uint32_t)nsge > qp->max_recv_sge) {
        set_err(qp, "%d SGEs > max_recv_sge %u", nsge, qp->max_recv_sge);
        return RC_EINVAL;
    }
    struct recv_wqe *r = rq_at(qp, qp->rq_len);
    r->segs = qp->rq_segs + (size_t)(r - qp->rq) * rq_sges(qp);
    uint64_t length;
    int nsegs;
    int rc = segments(qp, sges, nsge, ACC_LOCAL_WRITE, r->segs, &nsegs, &length, "%spost_recv wr_id=%llu", "",
                      wr_id);
    if (rc) return rc;
    r->wr_id = wr_id;
    r->nsegs = nsegs;
    r->length = (uint32_t)(length > 0xFFFFFFFFu ? 0xFFFFFFFFu : length);
    qp->rq_len++;
    return RC_OK;
}

double rc_next_timer(const struct rc_qp *qp)
{
    double t = qp->retransmit_deadline;
    if (qp->rnr_deadline >= 0 && (t < 0 || qp->rnr_deadline < t)) t = qp->rnr_deadline;
    return t;
}

/* ---------------------------------------------------------- requester ---- */

static uint32_t rd_atomic_outstanding(const struct rc_qp *qp)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < qp->cursor; i++)
        if (sq_at(qp, i)->read_atomic) n++;
    if (qp->cursor < qp->sq_len) {
        const struct send_wqe *w = sq_at(qp, qp->cursor);
        if (w->req_pkts > w->resp_pkts) n++;
    }
    return n;
}

static int outstanding(const struct rc_qp *qp)
{
    if (qp->cursor || qp->cursor_pkt) return 1;
    return qp->sq_len && sq_at(qp, 0)->req_pkts > sq_at(qp, 0)->resp_pkts;
}

static void ack_packet(const struct rc_qp *qp, struct pkt *p, int syndrome, uint32_t psn)
{
    pkt_init(p, OP_ACKNOWLEDGE, qp->dest_qp_num, psn);
    p->syndrome = (uint8_t)syndrome;
    p->msn = qp->msn;
}

static void emit_request(struct rc_qp *qp, const struct send_wqe *w, uint32_t idx, uint32_t psn,
                         struct rc_out *out)
{
    int op = w->opcode;
    uint32_t n = w->npkts, mtu = qp->mtu;
    uint64_t off = (uint64_t)idx * mtu;
    uint32_t plen = w->length ? (uint32_t)(w->length - off < mtu ? w->length - off : mtu) : 0;
    uint8_t *owned = NULL;
    const uint8_t *payload;
    if (w->nsegs == 1 && n == 1)
        payload = w->segs[0].p;
    else
        payload = gather(w->segs, w->nsegs, off, plen, &owned);
    int last = idx == n - 1;
    int code;
    if (n == 1)
        code = request_codes[op][0];
    else if (idx == 0)
        code = request_codes[op][1];
    else if (last)
        code = request_codes[op][3];
    else
        code = request_codes[op][2];
    uint32_t every = qp->ack_req_every;
    struct pkt p;
    pkt_init(&p, code, qp->dest_qp_num, psn);
    p.ack_req = (uint8_t)(last || (every && idx % every == every - 1));
    p.solicited = (uint8_t)(last && w->solicited);
    p.payload = payload;
    p.plen = plen;
    if (idx == 0 && (op == WR_RDMA_WRITE || op == WR_RDMA_WRITE_WITH_IMM)) {
        p.va = w->remote_addr;
        p.rkey = w->rkey;
        p.dma_len = w->length;
    }
    if (last && (op == WR_SEND_WITH_IMM || op == WR_RDMA_WRITE_WITH_IMM)) {
        p.imm = w->has_imm ? w->imm : 0;
        p.has_imm = 1;
    }
    if (qp->trace) {
        trace(qp, TR_LKEY_READ, NULL, w, NULL, (uint32_t)off, plen, 1, NULL);
        trace(qp, TR_PACKET_OUT, &p, w, NULL, 0, 0, 1, NULL);
    }
    out_push(out, &p, owned);
}

static void read_atomic_request(struct rc_qp *qp, struct send_wqe *w, uint32_t window, struct rc_out *out)
{
    struct pkt p;
    if (w->opcode == WR_RDMA_READ) {
        uint32_t first = w->resp_pkts;
        /* a peer that grants READs sends no datagrams to overrun this end's socket
         * buffer (what the window is for): ask for the whole rest at once */
        if (qp->cma_peer_pid > 0 && (uint64_t)w->length - w->resp_offset >= RC_CMA_MIN_READ) window = w->npkts;
        if (window < 1) window = 1;
        uint64_t end = ((uint64_t)first / window + 1) * window;
        if (end > w->npkts) end = w->npkts;
        uint32_t n = (uint32_t)(end - first);
        w->req_pkts = first + n;
        uint32_t done = w->resp_offset;
        pkt_init(&p, OP_RDMA_READ_REQUEST, qp->dest_qp_num, w->psn_first + first);
        p.ack_req = 1;
        p.va = w->remote_addr + done;
        p.rkey = w->rkey;
        uint64_t want = (uint64_t)n * qp->mtu, rest = (uint64_t)w->length - done;
        p.dma_len = (uint32_t)(rest < want ? rest : want);
        out_push(out, &p, NULL);
        return;
    }
    w->req_pkts = 1;
    int cas = w->opcode == WR_ATOMIC_CMP_AND_SWP;
    pkt_init(&p, cas ? OP_COMPARE_SWAP : OP_FETCH_ADD, qp->dest_qp_num, w->psn_first);
    p.ack_req = 1;
    p.va = w->remote_addr;
    p.rkey = w->rkey;
    p.swap_add = cas ? w->swap : w->compare_add;
    p.compare = cas ? w->compare_add : 0;
    out_push(out, &p, NULL);
}

static uint32_t cursor_psn(const struct rc_qp *qp)
{
    if (qp->cursor < qp->sq_len) {
        const struct send_wqe *w = sq_at(qp, qp->cursor);
        return psn_add(w->psn_first, w->read_atomic ? w->req_pkts : qp->cursor_pkt);
    }
    return qp->next_psn;
}

static void send_requests(struct rc_qp *qp, double now, struct rc_out *out)
{
    int64_t rd_out = -1;
    int sent_any = 0;
    uint32_t una = qp->una_psn, window = qp->window_pkts;
    while (qp->cursor < qp->sq_len) {
        struct send_wqe *w = sq_at(qp, qp->cursor);
        uint32_t psn = (w->psn_first + qp->cursor_pkt) & PSN_MASK;
        uint32_t ahead = (psn - una) & PSN_MASK;
        if (window <= ahead && ahead < 0x800000u) break;
        if (w->read_atomic) {
            if (w->req_pkts > w->resp_pkts) break;
            if (rd_out < 0) rd_out = rd_atomic_outstanding(qp);
            if (rd_out >= (qp->max_rd_atomic > 1 ? qp->max_rd_atomic : 1)) break;
            read_atomic_request(qp, w, window, out);
            rd_out++;
            if (w->req_pkts >= w->npkts) {
                qp->cursor++;
                qp->cursor_pkt = 0;
            }
        } else {
            emit_request(qp, w, qp->cursor_pkt, psn, out);
            qp->cursor_pkt++;
            if (qp->cursor_pkt >= w->npkts) {
                qp->cursor++;
                qp->cursor_pkt = 0;
            }
        }
        sent_any = 1;
    }
    if (sent_any) {
        uint32_t cur = cursor_psn(qp);
        uint32_t d = (cur - qp->sent_high) & PSN_MASK;
        if (0 < d && d < 0x800000u) qp->sent_high = cur;
        if (qp->retransmit_deadline < 0) {
            qp->retransmit_deadline = qp->timeout_s < 0 ? -1.0 : now + qp->timeout_s;
            qp->last_progress = now;
        }
    }
}

/* expand the responder's output into packets */
static void emit_responses(struct rc_qp *qp, struct rc_out *out)
{
    for (size_t i = 0; i < qp->nresp; i++) {
        struct resp *r = &qp->responses[i];
        if (!r->is_read) {
            out_push(out, &r->pkt, NULL);
            continue;
        }
        uint32_t mtu = qp->mtu, n = r->n;
        const uint8_t *base = r->mr ? r->mr->base + (r->va - r->mr->addr) : NULL;
        if (qp->cma_respond && base && r->length >= RC_CMA_MIN_READ) {
            /* one grant for packets skip .. n-1: the AETH acknowledges the last PSN, the
             * payload says where the first byte lies here and the first PSN it stands for */
            uint64_t at = (uint64_t)(uintptr_t)base;
            uint32_t first = psn_add(r->psn, r->skip);
            for (int i = 0; i < 8; i++) r->grant[i] = (uint8_t)(at >> (8 * i));
            for (int i = 0; i < 4; i++) r->grant[8 + i] = (uint8_t)(first >> (8 * i));
            struct pkt p;
            pkt_init(&p, OP_CMA_READ_GRANT, qp->dest_qp_num, psn_add(r->psn, n - 1));
            p.syndrome = AETH_ACK | AETH_CREDITS_INVALID;
            p.msn = r->msn;
            p.payload = r->grant;
            p.plen = sizeof r->grant;
            out_push(out, &p, NULL);
            if (qp->cma_counters) qp->cma_counters[0]++;
            continue;
        }
        for (uint32_t k = r->skip; k < n; k++) {
            uint64_t pos = (uint64_t)(k - r->skip) * mtu;
            uint32_t plen = r->length ? (uint32_t)(r->length - pos < mtu ? r->length - pos : mtu) : 0;
            int code;
            if (n == 1)
                code = OP_RDMA_READ_RESPONSE_ONLY;
            else if (k == 0)
                code = OP_RDMA_READ_RESPONSE_FIRST;
            else if (k == n - 1)
                code = OP_RDMA_READ_RESPONSE_LAST;
            else
                code = OP_RDMA_READ_RESPONSE_MIDDLE;
            struct pkt p;
            pkt_init(&p, code, qp->dest_qp_num, psn_add(r->psn, k));
            p.syndrome = AETH_ACK | AETH_CREDITS_INVALID;
            p.msn = r->msn;
            p.payload = plen ? base + pos : (const uint8_t *)"";
            p.plen = plen;
            out_push(out, &p, NULL);
        }
    }
}

/* the READ runs' region references go once their packets are encoded: rc_transmit's
 * caller encodes before it calls anything else, so they are dropped at the next transmit
 * (see rc_release_sent) */
static void drop_responses(struct rc_qp *qp)
{
    for (size_t i = 0; i < qp->nresp; i++)
        if (qp->responses[i].is_read && qp->responses[i].mr) mr_unref(qp->responses[i].mr);
    qp->nresp = 0;
}

void rc_transmit(struct rc_qp *qp, double now, struct rc_out *out)
{
    size_t before = out->n;
    if (qp->nresp) {
        emit_responses(qp, out);
        /* keep the runs' references until the packets are encoded: the caller does
         * that before the lock it holds is released, and nothing it calls meanwhile
         * can free a region (freeing needs the lock) */
        drop_responses(qp);
    }
    if (qp->has_ack_due) {
        struct pkt p;
        ack_packet(qp, &p, AETH_ACK | AETH_CREDITS_INVALID, qp->ack_due);
        out_push(out, &p, NULL);
        qp->c.acks_sent++;
        qp->has_ack_due = 0;
    }
    if (qp->state == QPS_RTS && qp->rnr_deadline < 0) send_requests(qp, now, out);
    qp->c.sent_pkts += out->n - before;
}

static void progress(struct rc_qp *qp, double now)
{
    qp->retries_left = qp->retry_cnt;
    qp->rnr_retries_left = qp->rnr_retry;
    qp->has_retry_from = 0;
    qp->last_progress = now;
    if (qp->sq_len && outstanding(qp))
        qp->retransmit_deadline = qp->timeout_s < 0 ? -1.0 : now + qp->timeout_s;
    else
        qp->retransmit_deadline = -1.0;
}

static void sq_pop(struct rc_qp *qp)
{
    struct send_wqe *w = sq_at(qp, 0);
    release_segs(w->segs, w->nsegs);
    qp->sq_head = (qp->sq_head + 1) % sq_size(qp);
    if (--qp->sq_len == 0 && qp->busy_count) --*qp->busy_count;
}

static void retire_acked(struct rc_qp *qp, uint32_t psn, double now)
{
    int progressed = 0;
    while (qp->sq_len) {
        struct send_wqe *w = sq_at(qp, 0);
        uint32_t d = (w->psn_last - psn) & PSN_MASK;
        if (w->read_atomic || (0 < d && d < 0x800000u)) break;
        uint64_t wr_id = w->wr_id;
        int sig = w->signaled, opc = wc_opcode_for_wr[w->opcode];
        uint32_t len = w->length;
        sq_pop(qp);
        if (qp->cursor > 0)
            qp->cursor--;
        else
            qp->cursor_pkt = 0;
        progressed = 1;
        if (sig) complete(qp, 0, wr_id, WCS_SUCCESS, opc, len, 0, 0);
    }
    uint32_t nxt = (psn + 1) & PSN_MASK;
    uint32_t d = (nxt - qp->una_psn) & PSN_MASK;
    if (0 < d && d < 0x800000u) {
        qp->una_psn = nxt;
        if (!(qp->sq_len && sq_at(qp, 0)->read_atomic && psn_diff(psn, sq_at(qp, 0)->psn_first) >= 0))
            progressed = 1;
    }
    if (progressed) progress(qp, now);
}

static int resent_in_round(const struct rc_qp *qp, uint32_t psn)
{
    if (!qp->has_retry_from) return 0;
    return psn_diff(psn, qp->retry_from) >= 0 && psn_diff(psn, cursor_psn(qp)) < 0 &&
           psn_diff(psn, qp->retry_until) < 0;
}

static void rewind_to(struct rc_qp *qp, uint32_t psn, int nak)
{
    if (nak && resent_in_round(qp, psn)) return;
    for (uint32_t i = 0; i < qp->sq_len; i++) {
        struct send_wqe *w = sq_at(qp, i);
        int32_t d = psn_diff(psn, w->psn_first);
        if (d < (int64_t)w->npkts) {
            uint32_t dd = d > 0 ? (uint32_t)d : 0;
            if (i > qp->cursor ||
                (i == qp->cursor && (w->read_atomic ? w->req_pkts <= w->resp_pkts : dd >= qp->cursor_pkt)))
                return;
            qp->cursor = i;
            qp->cursor_pkt = w->read_atomic ? 0 : dd;
            for (uint32_t j = i; j < qp->sq_len; j++) {
                struct send_wqe *x = sq_at(qp, j);
                if (x->read_atomic) x->req_pkts = x->resp_pkts;
            }
            qp->c.retransmits++;
            qp->retry_from = cursor_psn(qp);
            qp->has_retry_from = 1;
            qp->retry_until = qp->sent_high;
            return;
        }
    }
}

static void fail_head(struct rc_qp *qp, int status, const char *why)
{
    if (qp->sq_len) {
        struct send_wqe *w = sq_at(qp, 0);
        uint64_t wr_id = w->wr_id;
        int opc = wc_opcode_for_wr[w->opcode];
        sq_pop(qp);
        if (qp->cursor > 0) qp->cursor--;
        complete(qp, 0, wr_id, status, opc, 0, 0, 0);
    }
    char reason[320];
    snprintf(reason, sizeof reason, "%s: %s", rc_wc_status_name(status), why);
    rc_enter_error(qp, reason);
}

static void apply_deferred_nak(struct rc_qp *qp)
{
    if (!qp->has_deferred_nak || !qp->sq_len) return;
    struct send_wqe *head = sq_at(qp, 0);
    if (head->read_atomic && psn_diff(qp->deferred_psn, head->psn_last) > 0) return;
    qp->has_deferred_nak = 0;
    fail_head(qp, qp->deferred_status, qp->deferred_why);
}

static void on_ack(struct rc_qp *qp, const struct pkt *p, double now)
{
    int kind = p->syndrome & 0x60;
    uint32_t base = qp->una_psn - 1;
    if (((p->psn - base) & PSN_MASK) >= ((qp->next_psn - base) & PSN_MASK)) {
        qp->c.dropped_responses++;
        return;
    }
    if (kind == AETH_ACK) {
        retire_acked(qp, p->psn, now);
        if (qp->sq_len && sq_at(qp, 0)->read_atomic) {
            struct send_wqe *head = sq_at(qp, 0);
            if (qp->cursor > 0 && psn_diff(p->psn, head->psn_first) >= 0)
                rewind_to(qp, psn_add(head->psn_first, head->resp_pkts), 1);
            return;
        }
        if (qp->trace) trace(qp, TR_ACK_IN, p, NULL, NULL, 0, 0, 1, NULL);
        return;
    }
    uint32_t prev = psn_add(p->psn, -1);
    if (kind == AETH_RNR_NAK) {
        if (qp->rnr_deadline >= 0 && qp->has_rnr_psn && qp->rnr_psn == p->psn) return;
        qp->c.rnr_naks_rcvd++;
        retire_acked(qp, prev, now);
        if (qp->rnr_retry != 7) {
            if (qp->rnr_retries_left <= 0) {
                fail_head(qp, WCS_RNR_RETRY_EXC_ERR, "RNR retry count exceeded: the peer posted no receive");
                return;
            }
            qp->rnr_retries_left--;
        }
        /* an RNR NAK is an answer: the responder is there, only short of receives
         * (the transport retry count is for a peer that does not answer; rc.py) */
        qp->retries_left = qp->retry_cnt;
        rewind_to(qp, p->psn, 0);
        qp->rnr_psn = p->psn;
        qp->has_rnr_psn = 1;
        qp->rnr_deadline = now + (double)wire_rnr_timer_us[p->syndrome & 0x1F] * 1e-6;
        qp->retransmit_deadline = -1.0;
        return;
    }
    int code = p->syndrome & 0x1F;
    if (code == NAK_PSN_SEQUENCE_ERROR) {
        qp->c.seq_naks_rcvd++;
        retire_acked(qp, prev, now);
        rewind_to(qp, p->psn, 1);
        return;
    }
    retire_acked(qp, prev, now);
    int status;
    const char *why;
    switch (code) {
    case NAK_INVALID_REQUEST:
        status = WCS_REM_INV_REQ_ERR;
        why = "the responder found the request invalid";
        break;
    case NAK_REMOTE_ACCESS_ERROR:
        status = WCS_REM_ACCESS_ERR;
        why = "the responder refused the rkey, address range or access right";
        break;
    case NAK_REMOTE_OPERATIONAL_ERROR:
        status = WCS_REM_OP_ERR;
        why = "the responder failed the operation";
        break;
    default: {
        static const char *const nak_code_msg[32] = {
            "NAK code 0",  "NAK code 1",  "NAK code 2",  "NAK code 3",  "NAK code 4",  "NAK code 5",  "NAK code 6",
            "NAK code 7",  "NAK code 8",  "NAK code 9",  "NAK code 10", "NAK code 11", "NAK code 12", "NAK code 13",
            "NAK code 14", "NAK code 15", "NAK code 16", "NAK code 17", "NAK code 18", "NAK code 19", "NAK code 20",
            "NAK code 21", "NAK code 22", "NAK code 23", "NAK code 24", "NAK code 25", "NAK code 26", "NAK code 27",
            "NAK code 28", "NAK code 29", "NAK code 30", "NAK code 31"};
        status = WCS_REM_INV_REQ_ERR;
        why = nak_code_msg[code];
    }
    }
    if (qp->sq_len && sq_at(qp, 0)->read_atomic && psn_diff(p->psn, sq_at(qp, 0)->psn_last) > 0) {
        qp->has_deferred_nak = 1;
        qp->deferred_psn = p->psn;
        qp->deferred_status = status;
        qp->deferred_why = why;
        struct send_wqe *head = sq_at(qp, 0);
        rewind_to(qp, psn_add(head->psn_first, head->resp_pkts), 1);
        return;
    }
    fail_head(qp, status, why);
}

static void finish_read_atomic(struct rc_qp *qp, double now)
{
    struct send_wqe *w = sq_at(qp, 0);
    uint64_t wr_id = w->wr_id;
    int sig = w->signaled, opc = wc_opcode_for_wr[w->opcode];
    uint32_t len = w->length, last = w->psn_last;
    sq_pop(qp);
    if (qp->cursor > 0)
        qp->cursor--;
    else
        qp->cursor_pkt = 0;
    if (sig) complete(qp, 0, wr_id, WCS_SUCCESS, opc, len, 0, 0);
    if (psn_diff(psn_add(last, 1), qp->una_psn) > 0) qp->una_psn = psn_add(last, 1);
    retire_acked(qp, psn_add(qp->una_psn, -1), now);
    progress(qp, now);
    if (qp->has_deferred_nak) apply_deferred_nak(qp);
}

/* the head READ took responses up to resp_pkts (and resp_offset bytes): the requester goes
 * on, and a READ whose last response came completes (the tail of rc.py's _on_read_response) */
static void read_responses_taken(struct rc_qp *qp, struct send_wqe *w, double now)
{
    if (w->req_pkts < w->resp_pkts) w->req_pkts = w->resp_pkts;
    progress(qp, now);
    if (w->resp_pkts == w->npkts) {
        if (w->resp_offset != w->length) {
            fail_head(qp, WCS_BAD_RESP_ERR, "read response shorter than requested");
            return;
        }
        finish_read_atomic(qp, now);
    }
}

/* A grant: the responder checked the READ request's rkey and range and answers its
 * packets (from the one the grant names to the grant's PSN) with the bytes where they lie
 * in its process; copy them from there into the READ's segments (one copy, no datagrams). Only a QP
 * whose peer was found readable at the rendezvous takes grants (cma_peer_pid). */
static void on_cma_grant(struct rc_qp *qp, struct send_wqe *w, const struct pkt *p, int32_t d, double now)
{
    uint64_t at = 0;
    uint32_t first = 0;
    if (p->plen == 12) {
        for (int i = 0; i < 8; i++) at |= (uint64_t)p->payload[i] << (8 * i);
        for (int i = 0; i < 4; i++) first |= (uint32_t)p->payload[8 + i] << (8 * i);
    }
    /* the grant starts where the READ's responses so far end (the requester asks for a
     * long READ a window of packets at a time, and each request is granted on its own):
     * anything else is stale (an earlier try's) or garbled */
    if (p->plen != 12 || psn_diff(first & PSN_MASK, w->psn_first) != (int32_t)w->resp_pkts ||
        (uint32_t)d < w->resp_pkts) {
        qp->c.dropped_responses++;
        return;
    }
    uint64_t end = (uint64_t)((uint32_t)d + 1) * qp->mtu;
    if (end > w->length) end = w->length;
    if (end < w->resp_offset) {
        qp->c.dropped_responses++;
        return;
    }
    uint64_t want = end - w->resp_offset, done = 0;
    while (done < want) {
        struct iovec local[64];
        int nl = 0;
        uint64_t off = w->resp_offset + done, room = 0;
        for (int i = 0; i < w->nsegs && nl < 64 && room < want - done; i++) {
            uint32_t sl = w->segs[i].len;
            if (off >= sl) {
                off -= sl;
                continue;
            }
            uint64_t take = sl - off;
            if (take > want - done - room) take = want - done - room;
            local[nl].iov_base = w->segs[i].p + off;
            local[nl].iov_len = (size_t)take;
            nl++;
            room += take;
            off = 0;
        }
        struct iovec remote = {(void *)(uintptr_t)(at + done), (size_t)room};
        ssize_t got = room ? process_vm_readv(qp->cma_peer_pid, local, (unsigned long)nl, &remote, 1, 0) : 0;
        if (got <= 0) {
            /* the peer's memory unmapped behind a live registration: an access error; its
             * process gone: what a wire shows as no answer (the peer vanished); anything else
             * (a permission lost since the probe): the peer could not serve the READ */
            int err = got < 0 ? errno : EFAULT;
            int status = err == EFAULT ? WCS_REM_ACCESS_ERR : err == ESRCH ? WCS_RETRY_EXC_ERR : WCS_REM_OP_ERR;
            char why[240];
            snprintf(why, sizeof why,
                     "cross-memory READ of %llu bytes at 0x%llx in the peer's process %d failed (%s)%s",
                     (unsigned long long)(want - done), (unsigned long long)(at + done), qp->cma_peer_pid,
                     strerror(err),
                     err == EFAULT   ? ": the peer's memory behind the rkey is no longer mapped"
                     : err == ESRCH ? ": the peer's process is gone"
                                     : "");
            fail_head(qp, status, why);
            return;
        }
        done += (uint64_t)got;
    }
    if (qp->cma_counters) {
        qp->cma_counters[1]++;
        qp->cma_counters[2] += want;
    }
    w->resp_offset = (uint32_t)end;
    w->resp_pkts = (uint32_t)d + 1;
    read_responses_taken(qp, w, now);
}

static void on_read_response(struct rc_qp *qp, const struct pkt *p, double now)
{
    uint32_t limit = qp->cursor;
    if (limit < qp->sq_len && sq_at(qp, limit)->req_pkts) limit++;
    uint32_t head_idx = 0;
    while (head_idx < limit && !sq_at(qp, head_idx)->read_atomic) head_idx++;
    if (head_idx >= limit) {
        qp->c.dropped_responses++;
        return;
    }
    struct send_wqe *w = sq_at(qp, head_idx);
    int32_t d = psn_diff(p->psn, w->psn_first);
    if (d < 0 || d >= (int64_t)w->npkts) {
        qp->c.dropped_responses++;
        return;
    }
    if (head_idx) {
        retire_acked(qp, psn_add(w->psn_first, -1), now);
        /* (retiring moved the ring: the READ is now at index 0) */
        w = sq_at(qp, 0);
    }
    int op = p->opcode;
    if (op == OP_CMA_READ_GRANT && w->opcode == WR_RDMA_READ && qp->cma_peer_pid > 0) {
        on_cma_grant(qp, w, p, d, now);
        return;
    }
    if (w->opcode == WR_RDMA_READ) {
        if (op != OP_RDMA_READ_RESPONSE_FIRST && op != OP_RDMA_READ_RESPONSE_MIDDLE &&
            op != OP_RDMA_READ_RESPONSE_LAST && op != OP_RDMA_READ_RESPONSE_ONLY) {
            qp->c.dropped_responses++;
            return;
        }
        if ((uint32_t)d != w->resp_pkts) {
            qp->c.dropped_responses++;
            if ((uint32_t)d > w->resp_pkts) rewind_to(qp, psn_add(w->psn_first, w->resp_pkts), 1);
            return;
        }
        uint32_t plen = p->plen;
        if ((uint64_t)w->resp_offset + plen > w->length) {
            fail_head(qp, WCS_BAD_RESP_ERR, "read response longer than requested");
            return;
        }
        place(w->segs, w->nsegs, w->resp_offset, p->payload, plen);
        nt_fence(); /* (the bytes are visible before anything can report the READ done) */
        w->resp_offset += plen;
        w->resp_pkts++;
        read_responses_taken(qp, w, now);
    } else {
        if (op != OP_ATOMIC_ACKNOWLEDGE) {
            qp->c.dropped_responses++;
            return;
        }
        uint64_t v = p->orig; /* written in host order, like struct "<Q"/">Q" by sys.byteorder */
        uint8_t b[8];
        memcpy(b, &v, 8);
        scatter(w->segs, w->nsegs, 0, b, 8);
        finish_read_atomic(qp, now);
    }
}

void rc_on_timer(struct rc_qp *qp, double now)
{
    if (qp->rnr_deadline >= 0 && now >= qp->rnr_deadline) {
        qp->rnr_deadline = -1.0;
        qp->has_rnr_psn = 0;
        qp->retransmit_deadline = qp->timeout_s < 0 ? -1.0 : now + qp->timeout_s;
    }
    if (qp->retransmit_deadline >= 0 && now >= qp->retransmit_deadline) {
        if (!qp->sq_len || !outstanding(qp)) {
            qp->retransmit_deadline = -1.0;
            return;
        }
        qp->c.timeouts++;
        if (qp->retries_left <= 0) {
            char why[200];
            snprintf(why, sizeof why,
                     "no ACK after %d retries from %.3f s (backing off): the peer is unreachable or its QP is gone",
                     qp->retry_cnt,
                     rc_timeout_seconds(qp->timeout_code));
            fail_head(qp, WCS_RETRY_EXC_ERR, why);
            return;
        }
        qp->retries_left--;
        struct send_wqe *head = sq_at(qp, 0);
        rewind_to(qp, head->read_atomic ? head->psn_first : qp->una_psn, 0);
        /* back off (rc.py's retry_backoff): 1, 2, 4, ... RC_RETRY_BACKOFF_CAP timeouts */
        int shift = qp->retry_cnt - qp->retries_left;
        double backoff = shift >= 5 ? RC_RETRY_BACKOFF_CAP : (double)(1 << (shift < 0 ? 0 : shift));
        qp->retransmit_deadline = qp->timeout_s < 0 ? -1.0 : now + qp->timeout_s * backoff;
    }
}

/* --------------------------------------------------- shared receive queue ---- */

struct rc_srq *rc_srq_create(uint32_t srq_num, struct pd *pd, uint32_t max_wr, uint32_t max_sge)
{
    if (!max_wr || !max_sge) return NULL;
    struct rc_srq *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->srq_num = srq_num;
    s->pd = pd;
    s->max_wr = max_wr;
    s->max_sge = max_sge;
    s->q = queue_alloc(max_wr, sizeof *s->q);
    s->segs = queue_alloc((size_t)max_wr * max_sge, sizeof *s->segs);
    if (!s->q || !s->segs) {
        queue_free(s->q, max_wr, sizeof *s->q);
        queue_free(s->segs, (size_t)max_wr * max_sge, sizeof *s->segs);
        free(s);
        return NULL;
    }
    return s;
}

void rc_srq_destroy(struct rc_srq *s)
{
    if (!s) return;
    for (uint32_t i = 0; i < s->len; i++) {
        struct recv_wqe *r = &s->q[(s->head + i) % s->max_wr];
        release_segs(r->segs, r->nsegs);
    }
    queue_free(s->q, s->max_wr, sizeof *s->q);
    queue_free(s->segs, (size_t)s->max_wr * s->max_sge, sizeof *s->segs);
    free(s);
}

int rc_srq_post_recv(struct rc_srq *s, uint64_t wr_id, const struct sge_in *sges, int nsge)
{
    if (s->len >= s->max_wr) {
        set_errbuf(s->errmsg, "shared receive queue 0x%06x full (%u WRs posted)", s->srq_num, s->max_wr);
        return RC_EINVAL;
    }
    if ((uint32_t)nsge > s->max_sge) {
        set_errbuf(s->errmsg, "%d SGEs > the SRQ's max_sge %u", nsge, s->max_sge);
        return RC_EINVAL;
    }
    uint32_t at = (s->head + s->len) % s->max_wr;
    struct recv_wqe *r = &s->q[at];
    r->segs = s->segs + (size_t)at * s->max_sge;
    uint64_t length;
    int nsegs;
    int rc = segments_in(s->pd, s->errmsg, sges, nsge, ACC_LOCAL_WRITE, r->segs, &nsegs, &length,
                         "%spost_srq_recv wr_id=%llu", "", wr_id);
    if (rc) return rc;
    r->wr_id = wr_id;
    r->nsegs = nsegs;
    r->length = (uint32_t)(length > 0xFFFFFFFFu ? 0xFFFFFFFFu : length);
    s->len++;
    return RC_OK;
}

int rc_srq_arm(struct rc_srq *s, int64_t limit)
{
    if (limit < 0 || limit > (int64_t)s->max_wr) {
        set_errbuf(s->errmsg, "SRQ limit %lld: expected 0 (disarm) .. max_wr %u (IBV_SRQ_LIMIT may not exceed the SRQ)",
                   (long long)limit, s->max_wr);
        return RC_EINVAL;
    }
    s->limit = (uint32_t)limit;
    return RC_OK;
}

/* ---------------------------------------------------------- responder ---- */

static struct resp *resp_push(struct rc_qp *qp)
{
    qp->responses = grow(qp->responses, &qp->resp_cap, qp->nresp + 1, sizeof *qp->responses);
    struct resp *r = &qp->responses[qp->nresp++];
    memset(r, 0, sizeof *r);
    return r;
}

static void push_ack(struct rc_qp *qp, int syndrome, uint32_t psn)
{
    struct resp *r = resp_push(qp);
    ack_packet(qp, &r->pkt, syndrome, psn);
}

static void class_error(struct rc_qp *qp, int nak_code, const char *why)
{
    if (nak_code == NAK_INVALID_REQUEST) qp->c.invalid_requests++;
    push_ack(qp, AETH_NAK | nak_code, qp->epsn);
    char reason[320];
    snprintf(reason, sizeof reason, "responder: %s", why);
    rc_enter_error(qp, reason);
}

static void rnr(struct rc_qp *qp)
{
    qp->c.rnr_naks_sent++;
    push_ack(qp, AETH_RNR_NAK | qp->min_rnr_timer, qp->epsn);
}

/* a receive WQE waits: in the shared receive queue when the QP has one */
static int recv_posted(const struct rc_qp *qp) { return qp->srq ? qp->srq->len != 0 : qp->rq_len != 0; }

/* the SRQ's oldest WQE moves out of its ring into *out (its region references with
 * it); the limit event fires when fewer than the armed limit remain (srq.py's take) */
static void srq_take(struct rc_srq *s, struct recv_wqe *out)
{
    struct recv_wqe *r = &s->q[s->head];
    out->wr_id = r->wr_id;
    out->length = r->length;
    out->nsegs = r->nsegs;
    memcpy(out->segs, r->segs, (size_t)r->nsegs * sizeof *r->segs);
    s->head = (s->head + 1) % s->max_wr;
    s->len--;
    if (s->limit && s->len < s->limit) {
        s->limit = 0;
        s->limit_events++;
        if (s->on_limit) s->on_limit(s->on_limit_ctx, s);
    }
}

/* the oldest receive WQE (the caller checked recv_posted) moves into *out, whose
 * segs has room for the SRQ's or the rq's SGEs */
static void take_recv(struct rc_qp *qp, struct recv_wqe *out)
{
    if (qp->srq) {
        srq_take(qp->srq, out);
        return;
    }
    struct recv_wqe *r = rq_at(qp, 0);
    out->wr_id = r->wr_id;
    out->length = r->length;
    out->nsegs = r->nsegs;
    memcpy(out->segs, r->segs, (size_t)r->nsegs * sizeof *r->segs);
    qp->rq_head = (qp->rq_head + 1) % rq_size(qp);
    qp->rq_len--;
}

static int execute_send(struct rc_qp *qp, const struct pkt *p)
{
    int op = p->opcode;
    char why[200];
    if (op == OP_SEND_FIRST || op == OP_SEND_ONLY || op == OP_SEND_ONLY_WITH_IMMEDIATE) {
        if (!recv_posted(qp)) {
            rnr(qp);
            return 0;
        }
        /* popleft: the WQE moves out of the ring into cur_recv */
        take_recv(qp, &qp->cur_recv);
        qp->has_cur_recv = 1;
        qp->cur_recv_offset = 0;
    }
    struct recv_wqe *rw = &qp->cur_recv;
    uint32_t plen = p->plen;
    if ((op == OP_SEND_FIRST || op == OP_SEND_MIDDLE) && plen != qp->mtu) {
        snprintf(why, sizeof why, "%s payload %u != path MTU %u", wire_opcode_name(op), plen, qp->mtu);
        class_error(qp, NAK_INVALID_REQUEST, why);
        return 0;
    }
    if ((uint64_t)qp->cur_recv_offset + plen > rw->length) {
        complete(qp, 1, rw->wr_id, WCS_LOC_LEN_ERR, WC_RECV, 0, 0, 0);
        release_segs(rw->segs, rw->nsegs);
        qp->has_cur_recv = 0;
        snprintf(why, sizeof why, "SEND of more than %u bytes does not fit the posted receive buffer", rw->length);
        class_error(qp, NAK_INVALID_REQUEST, why);
        return 0;
    }
    scatter(rw->segs, rw->nsegs, qp->cur_recv_offset, p->payload, plen);
    qp->cur_recv_offset += plen;
    if (op_is_last(op)) {
        qp->msn = (qp->msn + 1) & 0xFFFFFF;
        qp->has_cur_send_opcode = 0;
        qp->has_cur_recv = 0;
        uint64_t wr_id = rw->wr_id;
        release_segs(rw->segs, rw->nsegs);
        complete(qp, 1, wr_id, WCS_SUCCESS, WC_RECV, qp->cur_recv_offset, p->has_imm, p->imm);
    } else {
        qp->cur_send_opcode = (uint8_t)op;
        qp->has_cur_send_opcode = 1;
    }
    return 1;
}

static const char *access_name(uint32_t need)
{
    switch (need) {
    case ACC_LOCAL_WRITE: return "IBV_ACCESS_LOCAL_WRITE";
    case ACC_REMOTE_WRITE: return "IBV_ACCESS_REMOTE_WRITE";
    case ACC_REMOTE_READ: return "IBV_ACCESS_REMOTE_READ";
    case ACC_REMOTE_ATOMIC: return "IBV_ACCESS_REMOTE_ATOMIC";
    default: return "?";
    }
}

static struct mr *check_rkey(struct rc_qp *qp, const struct pkt *p, uint64_t length, uint32_t need)
{
    struct mr *region = pd_by_rkey(qp->pd, p->rkey);
    char why[256];
    int bad = 0;
    if (!region) {
        snprintf(why, sizeof why, "rkey 0x%08x is not a memory region of this PD", p->rkey);
        bad = 1;
    } else if (!(region->access & need) || !(qp->access & need)) {
        char owner[32];
        if (!(region->access & need))
            snprintf(owner, sizeof owner, "rkey 0x%08x", p->rkey);
        else
            snprintf(owner, sizeof owner, "QP 0x%06x", qp->qp_num);
        snprintf(why, sizeof why, "%s does not grant %s", owner, access_name(need));
        bad = 1;
    } else if (!range_inside(p->va, length, region->addr, region->length)) {
        snprintf(why, sizeof why, "[0x%llx, +%llu) is outside the region of rkey 0x%08x [0x%llx, +%llu)",
                 (unsigned long long)p->va, (unsigned long long)length, p->rkey, (unsigned long long)region->addr,
                 (unsigned long long)region->length);
        bad = 1;
    }
    if (qp->trace) trace(qp, TR_RKEY_CHECK, p, NULL, bad ? NULL : region, 0, 0, !bad, bad ? why : NULL);
    if (bad) {
        qp->c.remote_access_errors++;
        class_error(qp, NAK_REMOTE_ACCESS_ERROR, why);
        return NULL;
    }
    return region;
}

static int execute_write(struct rc_qp *qp, const struct pkt *p)
{
    int op = p->opcode;
    int with_imm = op == OP_RDMA_WRITE_ONLY_WITH_IMMEDIATE || op == OP_RDMA_WRITE_LAST_WITH_IMMEDIATE;
    char why[200];
    if (with_imm && !recv_posted(qp)) {
        rnr(qp);
        return 0;
    }
    if (op == OP_RDMA_WRITE_FIRST || op == OP_RDMA_WRITE_ONLY || op == OP_RDMA_WRITE_ONLY_WITH_IMMEDIATE) {
        struct mr *region = NULL;
        if (!(p->dma_len == 0 && p->plen == 0)) {
            region = check_rkey(qp, p, p->dma_len, ACC_REMOTE_WRITE);
            if (!region) return 0;
        }
        if (qp->has_cur_write && qp->cw_region) mr_unref(qp->cw_region);
        qp->has_cur_write = 1;
        qp->cw_region = region;
        if (region) mr_ref(region);
        qp->cw_offset = region ? p->va - region->addr : 0;
        qp->cw_remaining = region ? p->dma_len : 0;
        qp->cw_dma_len = region ? p->dma_len : 0;
    }
    struct mr *region = qp->cw_region;
    uint64_t off = qp->cw_offset;
    uint32_t remaining = qp->cw_remaining, dma_len = qp->cw_dma_len;
    uint32_t plen = p->plen;
    if (plen > remaining || ((op == OP_RDMA_WRITE_FIRST || op == OP_RDMA_WRITE_MIDDLE) && plen != qp->mtu)) {
        snprintf(why, sizeof why, "%s payload %u does not match the RETH length", wire_opcode_name(op), plen);
        class_error(qp, NAK_INVALID_REQUEST, why);
        return 0;
    }
    int last = op_is_last(op);
    if (last && remaining - plen != 0) {
        class_error(qp, NAK_INVALID_REQUEST, "RDMA WRITE shorter than its RETH DMA length");
        return 0;
    }
    if (plen) {
        memcpy(region->base + off, p->payload, plen);
        if (qp->trace) trace(qp, TR_DMA_WRITE, p, NULL, region, (uint32_t)off, plen, 1, NULL);
    }
    if (last) {
        if (qp->cw_region) mr_unref(qp->cw_region);
        qp->cw_region = NULL;
        qp->has_cur_write = 0;
        qp->has_cur_write_opcode = 0;
        qp->msn = (qp->msn + 1) & 0xFFFFFF;
        if (with_imm) {
            /* (cur_recv is free: no SEND is in progress inside a WRITE) */
            struct recv_wqe *r = &qp->cur_recv;
            take_recv(qp, r);
            uint64_t wr_id = r->wr_id;
            release_segs(r->segs, r->nsegs);
            complete(qp, 1, wr_id, WCS_SUCCESS, WC_RECV_RDMA_WITH_IMM, dma_len, p->has_imm, p->imm);
        }
    } else {
        qp->cw_offset = off + plen;
        qp->cw_remaining = remaining - plen;
        qp->cur_write_opcode = (uint8_t)op;
        qp->has_cur_write_opcode = 1;
    }
    return 1;
}

static void save_resource(struct rc_qp *qp, const struct read_res *res)
{
    uint32_t cap = qp->max_dest_rd_atomic > 1 ? (uint32_t)qp->max_dest_rd_atomic : 1;
    if (cap > 4096) cap = 4096;
    if (qp->res_cap != cap) { /* (re)size: keep the newest */
        struct read_res *n = calloc(cap, sizeof *n);
        if (!n) abort();
        uint32_t keep = qp->res_len < cap ? qp->res_len : cap;
        for (uint32_t i = 0; i < keep; i++)
            n[i] = qp->resources[(qp->res_head + qp->res_len - keep + i) % qp->res_cap];
        free(qp->resources);
        qp->resources = n;
        qp->res_cap = cap;
        qp->res_head = 0;
        qp->res_len = keep;
    }
    if (qp->res_len == cap) { /* popleft the oldest */
        qp->res_head = (qp->res_head + 1) % cap;
        qp->res_len--;
    }
    qp->resources[(qp->res_head + qp->res_len) % cap] = *res;
    qp->res_len++;
}

static void push_read_run(struct rc_qp *qp, const struct read_res *res, struct mr *region, uint32_t skip,
                          uint64_t va, uint32_t length)
{
    struct resp *r = resp_push(qp);
    r->is_read = 1;
    r->psn = res->psn;
    r->msn = res->msn;
    r->skip = skip;
    if (skip) {
        r->n = skip + (length ? (uint32_t)(((uint64_t)length + qp->mtu - 1) / qp->mtu) : 1);
        r->va = va;
        r->length = length;
    } else {
        r->n = res->npkts;
        r->va = res->va;
        r->length = res->length;
    }
    r->mr = region;
    if (region) mr_ref(region);
}

static int execute_read(struct rc_qp *qp, const struct pkt *p)
{
    struct mr *region = NULL;
    if (p->dma_len) {
        region = check_rkey(qp, p, p->dma_len, ACC_REMOTE_READ);
        if (!region) return 0;
    }
    uint32_t npkts = p->dma_len ? (uint32_t)(((uint64_t)p->dma_len + qp->mtu - 1) / qp->mtu) : 1;
    qp->msn = (qp->msn + 1) & 0xFFFFFF;
    struct read_res res = {p->psn, npkts, p->opcode, p->va, p->rkey, p->dma_len, 0, qp->msn};
    save_resource(qp, &res);
    push_read_run(qp, &res, region, 0, 0, 0);
    qp->epsn = psn_add(qp->epsn, npkts);
    return 1;
}

static void atomic_ack(struct rc_qp *qp, const struct read_res *res)
{
    struct resp *r = resp_push(qp);
    pkt_init(&r->pkt, OP_ATOMIC_ACKNOWLEDGE, qp->dest_qp_num, res->psn);
    r->pkt.syndrome = AETH_ACK | AETH_CREDITS_INVALID;
    r->pkt.msn = res->msn;
    r->pkt.orig = res->orig;
}

static int execute_atomic(struct rc_qp *qp, const struct pkt *p)
{
    struct mr *region = check_rkey(qp, p, 8, ACC_REMOTE_ATOMIC);
    if (!region) return 0;
    if (p->va & 7) {
        char why[96];
        snprintf(why, sizeof why, "atomic address 0x%llx is not 8-byte aligned", (unsigned long long)p->va);
        class_error(qp, NAK_INVALID_REQUEST, why);
        return 0;
    }
    uint8_t *at = region->base + (p->va - region->addr);
    uint64_t orig;
    memcpy(&orig, at, 8); /* host order, as rc.py's _ATOMIC_FMT */
    uint64_t v;
    if (p->opcode == OP_COMPARE_SWAP) {
        if (orig == p->compare) {
            v = p->swap_add;
            memcpy(at, &v, 8);
        }
    } else {
        v = orig + p->swap_add;
        memcpy(at, &v, 8);
    }
    qp->msn = (qp->msn + 1) & 0xFFFFFF;
    struct read_res res = {p->psn, 1, p->opcode, p->va, p->rkey, 8, orig, qp->msn};
    save_resource(qp, &res);
    atomic_ack(qp, &res);
    qp->epsn = psn_add(qp->epsn, 1);
    return 1;
}

static void on_duplicate(struct rc_qp *qp, const struct pkt *p)
{
    int op = p->opcode;
    if (op == OP_RDMA_READ_REQUEST || op == OP_COMPARE_SWAP || op == OP_FETCH_ADD) {
        for (uint32_t i = 0; i < qp->res_len; i++) {
            struct read_res *res = &qp->resources[(qp->res_head + i) % qp->res_cap];
            uint32_t k = (p->psn - res->psn) & PSN_MASK;
            if (k < res->npkts && res->opcode == op) {
                if (op != OP_RDMA_READ_REQUEST) {
                    atomic_ack(qp, res);
                    return;
                }
                struct mr *region = res->length ? pd_by_rkey(qp->pd, res->rkey) : NULL;
                if (res->length && !region) return;
                /* the region behind the rkey may have changed since the READ ran */
                if (region && !range_inside(res->va, res->length, region->addr, region->length)) {
                    qp->c.dropped_responses++;
                    return;
                }
                if (k == 0) {
                    push_read_run(qp, res, region, 0, 0, 0);
                    return;
                }
                /* a READ retried from its k-th packet: the rest of the same range, from where
                 * that packet's bytes begin (rc.py says why the start is checked exactly) */
                if (p->rkey != res->rkey || p->va != res->va + (uint64_t)k * qp->mtu ||
                    !range_inside(p->va, p->dma_len, res->va, res->length)) {
                    qp->c.dropped_responses++;
                    return;
                }
                push_read_run(qp, res, region, k, p->va, p->dma_len);
                return;
            }
        }
        qp->c.dropped_responses++;
        return;
    }
    qp->ack_due = psn_add(qp->epsn, -1);
    qp->has_ack_due = 1;
}

static void on_request(struct rc_qp *qp, const struct pkt *p)
{
    int32_t d = psn_diff(p->psn, qp->epsn);
    char why[96];
    if (d > 0) {
        qp->c.out_of_sequence++;
        if (!qp->nak_sent) {
            qp->nak_sent = 1;
            qp->c.seq_naks_sent++;
            push_ack(qp, AETH_NAK | NAK_PSN_SEQUENCE_ERROR, qp->epsn);
        }
        return;
    }
    if (d < 0) {
        qp->c.duplicate_requests++;
        on_duplicate(qp, p);
        return;
    }
    qp->nak_sent = 0;
    int op = p->opcode;
    if (qp->has_cur_send_opcode) {
        if (op != OP_SEND_MIDDLE && op != OP_SEND_LAST && op != OP_SEND_LAST_WITH_IMMEDIATE) {
            snprintf(why, sizeof why, "%s inside a multi-packet SEND", wire_opcode_name(op));
            class_error(qp, NAK_INVALID_REQUEST, why);
            return;
        }
    } else if (qp->has_cur_write_opcode) {
        if (op != OP_RDMA_WRITE_MIDDLE && op != OP_RDMA_WRITE_LAST && op != OP_RDMA_WRITE_LAST_WITH_IMMEDIATE) {
            snprintf(why, sizeof why, "%s inside a multi-packet RDMA WRITE", wire_opcode_name(op));
            class_error(qp, NAK_INVALID_REQUEST, why);
            return;
        }
    } else if (op == OP_SEND_MIDDLE || op == OP_SEND_LAST || op == OP_SEND_LAST_WITH_IMMEDIATE ||
               op == OP_RDMA_WRITE_MIDDLE || op == OP_RDMA_WRITE_LAST || op == OP_RDMA_WRITE_LAST_WITH_IMMEDIATE) {
        snprintf(why, sizeof why, "%s without a FIRST packet", wire_opcode_name(op));
        class_error(qp, NAK_INVALID_REQUEST, why);
        return;
    }
    int done;
    if (op <= 0x05)
        done = execute_send(qp, p);
    else if (op <= 0x0B)
        done = execute_write(qp, p);
    else if (op == OP_RDMA_READ_REQUEST) {
        execute_read(qp, p);
        return;
    } else {
        execute_atomic(qp, p);
        return;
    }
    if (!done) return;
    qp->epsn = (qp->epsn + 1) & PSN_MASK;
    if (p->ack_req) {
        qp->ack_due = p->psn;
        qp->has_ack_due = 1;
    }
}

void rc_receive(struct rc_qp *qp, const struct pkt *p, double now)
{
    qp->c.rcvd_pkts++;
    if (qp->state != QPS_RTR && qp->state != QPS_RTS) {
        qp->c.dropped_wrong_state++;
        return;
    }
    int op = p->opcode;
    if (op_is_response(op)) {
        if (qp->state != QPS_RTS) {
            qp->c.dropped_wrong_state++;
            return;
        }
        if (op == OP_ACKNOWLEDGE)
            on_ack(qp, p, now);
        else
            on_read_response(qp, p, now);
        return;
    }
    on_request(qp, p);
}

/* ------------------------------------------------------------- errors ---- */

void rc_enter_error(struct rc_qp *qp, const char *reason)
{
    if (qp->state == QPS_ERR) return;
    qp->state = QPS_ERR;
    snprintf(qp->error_reason, sizeof qp->error_reason, "%s", reason);
    qp->has_error_reason = 1;
    while (qp->sq_len) {
        struct send_wqe *w = sq_at(qp, 0);
        uint64_t wr_id = w->wr_id;
        int opc = wc_opcode_for_wr[w->opcode];
        sq_pop(qp);
        complete(qp, 0, wr_id, WCS_WR_FLUSH_ERR, opc, 0, 0, 0);
    }
    qp->cursor = qp->cursor_pkt = 0;
    if (qp->has_cur_recv) {
        complete(qp, 1, qp->cur_recv.wr_id, WCS_WR_FLUSH_ERR, WC_RECV, 0, 0, 0);
        release_segs(qp->cur_recv.segs, qp->cur_recv.nsegs);
        qp->has_cur_recv = 0;
    }
    while (qp->rq_len) {
        struct recv_wqe *r = rq_at(qp, 0);
        complete(qp, 1, r->wr_id, WCS_WR_FLUSH_ERR, WC_RECV, 0, 0, 0);
        release_segs(r->segs, r->nsegs);
        qp->rq_head = (qp->rq_head + 1) % rq_size(qp);
        qp->rq_len--;
    }
    qp->retransmit_deadline = qp->rnr_deadline = -1.0;
    qp->has_deferred_nak = 0;
}
