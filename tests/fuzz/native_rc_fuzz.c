/* libFuzzer harness for the native engine's receive path (wire.c + rc.c), no Python.
 *
 * Built by scripts/asan-fuzz with -fsanitize=fuzzer,address,undefined. Each input
 * is a sequence of datagrams (2-byte big-endian length prefix each, 1 flag byte:
 * which QP gets it). Two RC queue pairs, a and b, are connected through an
 * in-memory link and carry legitimate traffic from a to b (RDMA WRITE, READ,
 * SEND, FETCH_ADD, CMP_SWAP); the fuzzed datagrams are decoded as the NIC does
 * (wire_decode; what it rejects is dropped), their ICRC solved for an IP ID
 * (wire_icrc_ip_id), and what decodes is handed to a QP between steps of the
 * legitimate traffic. In half the inputs (bit 4 of the first byte) b takes its
 * receives from a shared receive queue (struct rc_srq, its limit armed) instead
 * of its own receive queue. In half (bit 5) the two QPs use cross-memory attach
 * toward this very process (a takes grants, b sends them) and a also READs 80 KiB,
 * which b grants: the grant path (rc.c on_cma_grant) runs on real memory, and
 * fuzzed grants name whatever address they like. After each input:
 *
 *   - AddressSanitizer: every region is a malloc'd block of exactly its size,
 *     so any write (or read) outside a registered region is a heap overflow;
 *   - the regions that grant no remote write (b's read-only and private ones,
 *     a's source buffer) still hold their initial bytes;
 *   - the link quiesces within a bounded number of steps.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rc.h"
#include "wire.h"

#define MAX_INFLIGHT 512

struct region {
    struct mr mr;
    uint8_t *buf;
    uint8_t *initial; /* a copy, for regions nothing may write to */
};

struct dgram {
    int to; /* 0: a, 1: b */
    double at;
    size_t len;
    uint8_t data[4096 + 128];
};

static struct dgram link_q[MAX_INFLIGHT];
static int nlink;

static const struct flow FLOW_A = {0, {10, 0, 0, 1}, {10, 0, 0, 2}, 49152, 4791, 0};
static const struct flow FLOW_B = {0, {10, 0, 0, 2}, {10, 0, 0, 1}, 49153, 4791, 0};

static void noop_release(struct pd *pd, struct mr *mr)
{
    (void)pd;
    (void)mr;
}

static void reg(struct pd *pd, struct region *r, uint64_t addr, size_t len, uint32_t access, uint32_t key,
                uint8_t fill, int keep_copy)
{
    memset(r, 0, sizeof *r);
    r->buf = malloc(len);
    memset(r->buf, fill, len);
    if (keep_copy) {
        r->initial = malloc(len);
        memcpy(r->initial, r->buf, len);
    }
    r->mr.addr = addr;
    r->mr.length = len;
    r->mr.access = access;
    r->mr.lkey = key;
    r->mr.rkey = key | 0x80000000u;
    r->mr.base = r->buf;
    if (pd_add(pd, &r->mr) < 0) abort();
}

static void unreg(struct pd *pd, struct region *r)
{
    pd_remove(pd, &r->mr);
    if (r->initial && memcmp(r->initial, r->buf, r->mr.length) != 0) {
        fprintf(stderr, "region lkey 0x%x (access 0x%x) was written to\n", r->mr.lkey, r->mr.access);
        abort();
    }
    free(r->buf);
    free(r->initial);
}

static void connect_qp(struct rc_qp *q, uint32_t dest, uint32_t rq_psn, uint32_t sq_psn, int mtu)
{
    struct rc_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = QPS_INIT;
    a.port_num = 1;
    a.has_access = 1;
    a.access = ACC_LOCAL_WRITE | ACC_REMOTE_WRITE | ACC_REMOTE_READ | ACC_REMOTE_ATOMIC;
    if (rc_modify(q, &a, 0)) abort();
    memset(&a, 0, sizeof a);
    a.qp_state = QPS_RTR;
    a.has_dest_qp = a.has_rq_psn = a.has_dgid = a.has_path_mtu = 1;
    a.dest_qp_num = dest;
    a.rq_psn = rq_psn;
    a.path_mtu = mtu;
    if (rc_modify(q, &a, 0)) abort();
    memset(&a, 0, sizeof a);
    a.qp_state = QPS_RTS;
    a.has_sq_psn = a.has_timeout = a.has_retry_cnt = a.has_rnr_retry = 1;
    a.sq_psn = sq_psn;
    a.timeout = 8;
    a.retry_cnt = 3;
    /* finite: with rnr_retry 7 (the verbs default, "retry forever") a hostile SEND that
     * took b's only receive buffer would have a's SEND retried on RNR NAKs for ever, as
     * the IBA says it must, and the link would legitimately never quiesce */
    a.rnr_retry = 3;
    if (rc_modify(q, &a, 0)) abort();
}

static void enqueue(int to, double at, const uint8_t *d, size_t n)
{
    if (nlink >= MAX_INFLIGHT || n > sizeof link_q[0].data) return; /* the link drops it */
    link_q[nlink].to = to;
    link_q[nlink].at = at;
    link_q[nlink].len = n;
    memcpy(link_q[nlink].data, d, n);
    nlink++;
}

static void pump(struct rc_qp *q, int from, double now)
{
    static struct rc_out out;
    static uint8_t buf[70000];
    out.n = 0;
    rc_transmit(q, now, &out);
    for (size_t i = 0; i < out.n; i++) {
        size_t n = wire_encode(&out.pkts[i], from ? &FLOW_B : &FLOW_A, 0, buf);
        enqueue(!from, now + 5e-6, buf, n);
    }
    rc_out_clear(&out);
    q->nwcs = 0; /* completions: not checked here (the Python suites do) */
}

static void deliver(struct rc_qp *q, const uint8_t *d, size_t n, const struct flow *f, double now)
{
    struct pkt p;
    (void)wire_icrc_ip_id(d, n, f);
    if (wire_decode(d, n, &p) != WIRE_OK) return;
    rc_receive(q, &p, now);
}

/* deliver what is due; returns how many */
static int step_link(struct rc_qp *qa, struct rc_qp *qb, double now)
{
    int moved = 0;
    for (int i = 0; i < nlink;) {
        if (link_q[i].at <= now) {
            struct dgram d = link_q[i];
            link_q[i] = link_q[--nlink];
            deliver(d.to ? qb : qa, d.data, d.len, d.to ? &FLOW_A : &FLOW_B, now);
            moved++;
        } else {
            i++;
        }
    }
    return moved;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct pd pda, pdb;
    pd_init(&pda);
    pd_init(&pdb);
    pda.release = pdb.release = noop_release;
    nlink = 0;
    int mtu = 1 + (size ? data[0] % 5 : 2); /* 256 .. 4096 */
    uint32_t psn_a = size > 3 ? ((uint32_t)data[1] << 16 | (uint32_t)data[2] << 8 | data[3]) : 5;

    struct region rw, ro, priv, rbuf, src, dst, big, bigdst;
    reg(&pdb, &rw, 0x7E0000001000ull, 16384, ACC_LOCAL_WRITE | ACC_REMOTE_WRITE | ACC_REMOTE_READ | ACC_REMOTE_ATOMIC,
        0x2001, 1, 0);
    reg(&pdb, &ro, 0x7E0000010000ull, 4096, ACC_LOCAL_WRITE | ACC_REMOTE_READ, 0x2003, 2, 1);
    reg(&pdb, &priv, 0x7E0000020000ull, 4096, ACC_LOCAL_WRITE, 0x2005, 3, 1);
    reg(&pdb, &rbuf, 0x7E0000030000ull, 8192, ACC_LOCAL_WRITE, 0x2007, 0, 0);
    reg(&pda, &src, 0x7F0000001000ull, 16384, ACC_LOCAL_WRITE, 0x1001, 7, 1);
    reg(&pda, &dst, 0x7F0000010000ull, 16384, ACC_LOCAL_WRITE, 0x1003, 0, 0);
    reg(&pdb, &big, 0x7E0000100000ull, 81920, ACC_LOCAL_WRITE | ACC_REMOTE_READ, 0x2009, 5, 1);
    reg(&pda, &bigdst, 0x7F0000100000ull, 81920, ACC_LOCAL_WRITE, 0x1005, 0, 0);
    int use_cma = size && (data[0] >> 5) & 1;

    int use_srq = size && (data[0] >> 4) & 1;
    struct rc_srq *srq = use_srq ? rc_srq_create(0x5A5A5A, &pdb, 4, 2) : NULL;
    struct rc_qp *qa = rc_create(0xABC123, &pda, 64, 64, 4, 4, 0);
    struct rc_qp *qb = rc_create_ex(0x00D00D, &pdb, srq, 64, 64, 4, 4, 0);
    connect_qp(qa, qb->qp_num, 5, psn_a, mtu);
    connect_qp(qb, qa->qp_num, psn_a, 5, mtu);

    struct sge_in rs = {rbuf.mr.addr, 8192, rbuf.mr.lkey};
    if (srq) {
        /* two receives of two SGEs each over the same buffer, the limit armed at 2 */
        struct sge_in two[2] = {{rbuf.mr.addr, 100, rbuf.mr.lkey}, {rbuf.mr.addr + 100, 8092, rbuf.mr.lkey}};
        if (rc_srq_post_recv(srq, 1, two, 2) || rc_srq_post_recv(srq, 2, &rs, 1) || rc_srq_arm(srq, 2)) abort();
        if (rc_post_recv(qb, 9, &rs, 1) != RC_EINVAL) abort(); /* a QP with an SRQ has no receive queue */
    } else {
        rc_post_recv(qb, 1, &rs, 1);
    }
    struct sge_in s_src = {src.mr.addr, 5000, src.mr.lkey};
    struct send_wr_in w = {1, WR_RDMA_WRITE, SEND_FLAG_SIGNALED, 0, 0, rw.mr.addr, rw.mr.rkey, 0, 0, 1, &s_src};
    rc_post_send(qa, &w, 0);
    struct sge_in s_dst = {dst.mr.addr, 3000, dst.mr.lkey};
    struct send_wr_in r = {2, WR_RDMA_READ, SEND_FLAG_SIGNALED, 0, 0, ro.mr.addr, ro.mr.rkey, 0, 0, 1, &s_dst};
    rc_post_send(qa, &r, 0);
    struct sge_in s_send = {src.mr.addr, 2000, src.mr.lkey};
    struct send_wr_in s = {3, WR_SEND_WITH_IMM, SEND_FLAG_SIGNALED, 1, 7, 0, 0, 0, 0, 1, &s_send};
    rc_post_send(qa, &s, 0);
    struct sge_in s_old = {dst.mr.addr + 8192, 8, dst.mr.lkey};
    struct send_wr_in f = {4, WR_ATOMIC_FETCH_AND_ADD, SEND_FLAG_SIGNALED, 0, 0, rw.mr.addr + 64, rw.mr.rkey, 1, 0, 1,
                           &s_old};
    rc_post_send(qa, &f, 0);
    struct send_wr_in c = {5, WR_ATOMIC_CMP_AND_SWP, SEND_FLAG_SIGNALED, 0, 0, rw.mr.addr + 72, rw.mr.rkey, 0, 9, 1,
                           &s_old};
    rc_post_send(qa, &c, 0);
    if (use_cma) {
        qa->cma_peer_pid = (int)getpid();
        qb->cma_respond = 1;
        struct sge_in s_big = {bigdst.mr.addr, 81920, bigdst.mr.lkey};
        struct send_wr_in g = {6, WR_RDMA_READ, SEND_FLAG_SIGNALED, 0, 0, big.mr.addr, big.mr.rkey, 0, 0, 1, &s_big};
        rc_post_send(qa, &g, 0);
    }

    double now = 0.0;
    int fuzzed = 0; /* datagrams of the input delivered */
    size_t off = size > 4 ? 4 : size;
    while (off + 3 <= size) {
        size_t n = ((size_t)data[off] << 8 | data[off + 1]) % 4200;
        int to = data[off + 2] & 1;
        off += 3;
        if (n > size - off) n = size - off;
        pump(qa, 0, now);
        pump(qb, 1, now);
        deliver(to ? qb : qa, data + off, n, to ? &FLOW_A : &FLOW_B, now);
        fuzzed++;
        off += n;
        now += 1e-5;
        step_link(qa, qb, now);
        double t;
        if ((t = rc_next_timer(qa)) >= 0 && t <= now) rc_on_timer(qa, now);
        if ((t = rc_next_timer(qb)) >= 0 && t <= now) rc_on_timer(qb, now);
    }
    /* let the link quiesce: deliver, fire timers, until nothing moves */
    for (int steps = 0; steps < 20000; steps++) {
        pump(qa, 0, now);
        pump(qb, 1, now);
        if (step_link(qa, qb, now)) {
            now += 5e-6;
            continue;
        }
        double ta = rc_next_timer(qa), tb = rc_next_timer(qb);
        double next = -1;
        if (ta >= 0) next = ta;
        if (tb >= 0 && (next < 0 || tb < next)) next = tb;
        for (int i = 0; i < nlink; i++)
            if (next < 0 || link_q[i].at < next) next = link_q[i].at;
        if (next < 0) break;
        now = next > now ? next : now;
        if (ta >= 0 && ta <= now) rc_on_timer(qa, now);
        if (tb >= 0 && tb <= now) rc_on_timer(qb, now);
        if (steps == 19999) {
            fprintf(stderr, "the link did not quiesce\n");
            abort();
        }
    }
    /* with no fuzzed datagram, the granted READ must have brought big's bytes */
    if (use_cma && !fuzzed && memcmp(bigdst.buf, big.buf, 81920) != 0) {
        fprintf(stderr, "the READ answered by a grant did not bring the region's bytes\n");
        abort();
    }
    rc_destroy(qa);
    rc_destroy(qb);
    if (srq) {
        if (srq->users != 0 || srq->len > 2 || srq->limit_events > 1) abort();
        rc_srq_destroy(srq);
    }
    unreg(&pdb, &rw);
    unreg(&pdb, &ro);
    unreg(&pdb, &priv);
    unreg(&pdb, &rbuf);
    unreg(&pda, &src);
    unreg(&pda, &dst);
    unreg(&pdb, &big);
    unreg(&pda, &bigdst);
    return 0;
}
