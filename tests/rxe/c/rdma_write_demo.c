/*
 * rdma_write_demo.c - one RDMA Write with immediate between two processes,
 * written straight against libibverbs.
 *
 * This is aiordma's C reference for the kernel Soft-RoCE interop tests
 * (tests/rxe/test_c_interop.py and tests/rxe/test_soft_rxe.py): they build it
 * with
 *
 *     gcc -O2 -o rdma_write_demo tests/rxe/c/rdma_write_demo.c -libverbs
 *
 * and run it against its Python twin, examples/rdma_write_demo.py, in both
 * directions and against itself:
 *
 *     ./rdma_write_demo server <listen-IPv4> <tcp-port>
 *     ./rdma_write_demo client <server-IPv4> <tcp-port>
 *
 * The wire protocol (the twin speaks exactly the same):
 *
 *   1. The server listens on TCP and accepts one client.
 *   2. Each side sends its 32-byte struct qp_info (below) first, then reads
 *      the peer's.  Host byte order, no padding.
 *   3. Each side moves its RC QP RESET -> INIT -> RTR -> RTS with the peer's
 *      QPN and GID.
 *   4. The server posts one receive WR over its whole buffer, then sends the
 *      single byte 'G'.
 *   5. The client, on 'G', posts one signaled RDMA Write with immediate
 *      (0x52444d41, "RDMA") of "hello from RDMA client" plus its NUL
 *      (23 bytes) to the server's address with the server's rkey.
 *   6. The client waits for its send CQE; the server waits for the receive
 *      CQE the immediate generates (opcode IBV_WC_RECV_RDMA_WITH_IMM) and
 *      prints it and the buffer.
 *
 * The lines printed on stdout are read by the tests and keep the wording of
 * the classic lab program this one replaces: "使用设备：<dev>" (device in use),
 * "收到完成：opcode=.. imm=0x.. 长度=.." (completion received, length),
 * "缓冲区内容：<text>" (buffer contents) and "发送完成..." (send complete).
 * Diagnostics go to stderr; the exit status is 0 on success, 1 on failure,
 * 2 on a usage error.
 *
 * The program opens the first verbs device and uses GID index 1 (the IPv4
 * RoCE v2 GID of a kernel rxe device); tests/rxe/rxe_helpers.py can put
 * another device first with an LD_PRELOAD shim.
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>

enum {
    BUF_BYTES = 4096,      /* the registered buffer: one page */
    IB_PORT = 1,           /* the verbs port (rxe has one) */
    SGID_INDEX = 1,        /* source GID index: rxe's IPv4 RoCE v2 GID */
    CQ_DEPTH = 16,         /* CQEs the completion queue can hold */
    QUEUE_DEPTH = 16,      /* send and receive WRs the QP can hold */
    WAIT_SECONDS = 60,     /* give up on the peer / a CQE after this long */
};

#define DEFAULT_TCP_PORT 18515
#define IMM_VALUE 0x52444d41u          /* "RDMA", the immediate data */
#define GREETING "hello from RDMA client"
#define GO_BYTE 'G'                    /* server -> client: receive posted */

/*
 * What one side tells the other over TCP: everything the peer needs to
 * address our QP and write into our memory.  4 + 4 + 8 + 16 = 32 bytes in
 * host byte order; the field order leaves no padding.
 */
struct qp_info {
    uint32_t qp_num;    /* our QP number: the peer's destination QPN */
    uint32_t rkey;      /* remote key of our MR: lets the peer write to it */
    uint64_t buf_addr;  /* virtual address of our buffer, for the RDMA Write */
    uint8_t gid[16];    /* our GID (an IPv4-mapped address on RoCE v2) */
};

_Static_assert(sizeof(struct qp_info) == 32, "struct qp_info must be 32 bytes");
_Static_assert(offsetof(struct qp_info, buf_addr) == 8, "buf_addr at offset 8");
_Static_assert(offsetof(struct qp_info, gid) == 16, "gid at offset 16");

/* Every verbs resource of one side, created in this order, freed in reverse. */
struct side {
    struct ibv_context *ctx; /* the opened device */
    struct ibv_pd *pd;       /* protection domain: owns the MR and the QP */
    void *buf;               /* the memory the MR covers */
    struct ibv_mr *mr;       /* memory region: lkey for us, rkey for the peer */
    struct ibv_cq *cq;       /* completion queue for both work queues */
    struct ibv_qp *qp;       /* reliable-connected queue pair */
    union ibv_gid gid;       /* our GID at SGID_INDEX */
};

static const char *prog = "rdma_write_demo";

/* A failed call that set errno. */
static int fail_errno(const char *what)
{
    fprintf(stderr, "%s: %s failed: %s\n", prog, what, strerror(errno));
    return -1;
}

/* A failed verbs call that returned an errno value (ibv_modify_qp, ibv_post_*). */
static int fail_code(const char *what, int code)
{
    fprintf(stderr, "%s: %s failed: %s\n", prog, what, strerror(code));
    return -1;
}

static int fail_msg(const char *msg)
{
    fprintf(stderr, "%s: %s\n", prog, msg);
    return -1;
}

/* ------------------------------------------------------------- TCP side -- */

/* Send all n bytes (short writes and EINTR handled; no SIGPIPE). */
static int send_all(int fd, const void *data, size_t n, const char *what)
{
    const char *p = data;
    while (n > 0) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return fail_errno(what);
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Receive exactly n bytes; the peer closing early is an error. */
static int recv_all(int fd, void *data, size_t n, const char *what)
{
    char *p = data;
    while (n > 0) {
        ssize_t k = recv(fd, p, n, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                fprintf(stderr, "%s: %s: no data from the peer within %d s\n", prog, what, WAIT_SECONDS);
            else
                fail_errno(what);
            return -1;
        }
        if (k == 0) {
            fprintf(stderr, "%s: %s: the peer closed the TCP connection\n", prog, what);
            return -1;
        }
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Once connected, a silent peer makes recv() fail instead of hanging. */
static void set_recv_timeout(int fd)
{
    struct timeval tv = { .tv_sec = WAIT_SECONDS, .tv_usec = 0 };
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0)
        fail_errno("setsockopt(SO_RCVTIMEO)");
}

static int make_sockaddr(const char *ip, int port, struct sockaddr_in *sa)
{
    memset(sa, 0, sizeof(*sa));
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, ip, &sa->sin_addr) != 1) {
        fprintf(stderr, "%s: not an IPv4 address: %s\n", prog, ip);
        return -1;
    }
    return 0;
}

/* Listen on ip:port, accept exactly one client; returns its socket or -1. */
static int accept_one(const char *ip, int port)
{
    struct sockaddr_in sa;
    socklen_t len = sizeof(sa);
    int one = 1, lfd, cfd;

    if (make_sockaddr(ip, port, &sa) != 0)
        return -1;
    lfd = socket(AF_INET, SOCK_STREAM, 0);
    if (lfd < 0)
        return fail_errno("socket");
    if (setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0)
        fail_errno("setsockopt(SO_REUSEADDR)");
    if (bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        fail_errno("bind");
        close(lfd);
        return -1;
    }
    if (listen(lfd, 1) != 0) {
        fail_errno("listen");
        close(lfd);
        return -1;
    }
    if (getsockname(lfd, (struct sockaddr *)&sa, &len) == 0)
        port = ntohs(sa.sin_port); /* the real port when asked for port 0 */
    printf("等待客户端连接 %s:%d ...\n", ip, port); /* waiting for a client */
    do
        cfd = accept(lfd, NULL, NULL); /* as long as it takes, like the twin */
    while (cfd < 0 && errno == EINTR);
    if (cfd < 0)
        fail_errno("accept");
    close(lfd);
    return cfd;
}

static int connect_to(const char *ip, int port)
{
    struct sockaddr_in sa;
    int fd;

    if (make_sockaddr(ip, port, &sa) != 0)
        return -1;
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return fail_errno("socket");
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        fprintf(stderr, "%s: connect to %s:%d failed: %s\n", prog, ip, port, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

/* ----------------------------------------------------------- verbs side -- */

static int open_side(struct side *s)
{
    struct ibv_device **devs;
    struct ibv_qp_init_attr init;
    long page = sysconf(_SC_PAGESIZE);
    int ndev = 0, rc;

    memset(s, 0, sizeof(*s));

    /* The device: the first one libibverbs lists. */
    devs = ibv_get_device_list(&ndev);
    if (!devs) {
        fprintf(stderr, "%s: no RDMA device: ibv_get_device_list failed: %s\n", prog, strerror(errno));
        return -1;
    }
    if (ndev == 0) {
        ibv_free_device_list(devs);
        return fail_msg("no RDMA device found (is rdma_rxe loaded and an rxe link added?)");
    }
    s->ctx = ibv_open_device(devs[0]);
    if (!s->ctx) {
        fprintf(stderr, "%s: ibv_open_device(%s) failed: %s\n", prog, ibv_get_device_name(devs[0]),
                strerror(errno));
        ibv_free_device_list(devs);
        return -1;
    }
    ibv_free_device_list(devs);
    printf("使用设备：%s\n", ibv_get_device_name(s->ctx->device)); /* device in use */

    /* PD: the protection domain; an MR and a QP work together only in the same PD. */
    s->pd = ibv_alloc_pd(s->ctx);
    if (!s->pd)
        return fail_errno("ibv_alloc_pd");

    /* MR: pin and register a zeroed page.  The lkey lets our own WRs use it,
     * the rkey (sent to the peer) lets the peer's RDMA Write land in it. */
    rc = posix_memalign(&s->buf, page > 0 ? (size_t)page : 4096, BUF_BYTES);
    if (rc != 0) {
        s->buf = NULL;
        return fail_code("posix_memalign", rc);
    }
    memset(s->buf, 0, BUF_BYTES);
    s->mr = ibv_reg_mr(s->pd, s->buf, BUF_BYTES,
                       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
    if (!s->mr) {
        fprintf(stderr, "%s: ibv_reg_mr failed: %s (is `ulimit -l` too small?)\n", prog, strerror(errno));
        return -1;
    }

    /* CQ: where both work queues report completions (CQEs); polled, no channel. */
    s->cq = ibv_create_cq(s->ctx, CQ_DEPTH, NULL, NULL, 0);
    if (!s->cq)
        return fail_errno("ibv_create_cq");

    /* QP: reliable connected, one SGE per WR, send and receive on the one CQ. */
    memset(&init, 0, sizeof(init));
    init.qp_type = IBV_QPT_RC;
    init.send_cq = s->cq;
    init.recv_cq = s->cq;
    init.cap.max_send_wr = QUEUE_DEPTH;
    init.cap.max_recv_wr = QUEUE_DEPTH;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    s->qp = ibv_create_qp(s->pd, &init);
    if (!s->qp)
        return fail_errno("ibv_create_qp");

    /* GID: on RoCE the port's GID table holds our addresses; index 1 is the
     * IPv4 RoCE v2 one on rxe (index 0 is the link-local IPv6 GID). */
    rc = ibv_query_gid(s->ctx, IB_PORT, SGID_INDEX, &s->gid);
    if (rc != 0) {
        fprintf(stderr, "%s: ibv_query_gid(port %d, index %d) failed: %s\n", prog, IB_PORT, SGID_INDEX,
                strerror(rc > 0 ? rc : errno));
        return -1;
    }

    printf("QPN=%u rkey=0x%x addr=%p\n", s->qp->qp_num, s->mr->rkey, s->buf);
    return 0;
}

static void close_side(struct side *s)
{
    /* Reverse order of creation: the QP before its CQ and the MR, all before the PD. */
    if (s->qp && ibv_destroy_qp(s->qp) != 0)
        fprintf(stderr, "%s: ibv_destroy_qp failed\n", prog);
    if (s->mr && ibv_dereg_mr(s->mr) != 0)
        fprintf(stderr, "%s: ibv_dereg_mr failed\n", prog);
    if (s->cq && ibv_destroy_cq(s->cq) != 0)
        fprintf(stderr, "%s: ibv_destroy_cq failed\n", prog);
    if (s->pd && ibv_dealloc_pd(s->pd) != 0)
        fprintf(stderr, "%s: ibv_dealloc_pd failed\n", prog);
    if (s->ctx && ibv_close_device(s->ctx) != 0)
        fprintf(stderr, "%s: ibv_close_device failed\n", prog);
    free(s->buf);
    memset(s, 0, sizeof(*s));
}

static void describe(const struct side *s, struct qp_info *out)
{
    memset(out, 0, sizeof(*out));
    out->qp_num = s->qp->qp_num;
    out->rkey = s->mr->rkey;
    out->buf_addr = (uint64_t)(uintptr_t)s->buf;
    memcpy(out->gid, s->gid.raw, sizeof(out->gid));
}

/* Our qp_info out first, then the peer's in: both sides do the same. */
static int swap_info(int fd, const struct side *s, struct qp_info *peer)
{
    struct qp_info mine;

    describe(s, &mine);
    if (send_all(fd, &mine, sizeof(mine), "sending our QP info") != 0)
        return -1;
    return recv_all(fd, peer, sizeof(*peer), "reading the peer's QP info");
}

/* The QP state machine, with the same attributes on both sides. */
static int connect_qp(struct side *s, const struct qp_info *peer)
{
    struct ibv_qp_attr a;
    int rc;

    /* RESET -> INIT: bind the QP to the port and partition key 0, and say
     * what the peer may do to our memory through it. */
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_INIT;
    a.port_num = IB_PORT;
    a.pkey_index = 0;
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    rc = ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (rc != 0)
        return fail_code("ibv_modify_qp(RESET -> INIT)", rc);

    /* INIT -> RTR (ready to receive): the peer's QPN, the path MTU, the first
     * PSN (packet sequence number) we expect, and the address vector: on
     * RoCE a global route header to the peer's GID from our SGID_INDEX. */
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = peer->qp_num;
    a.rq_psn = 0;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.is_global = 1;
    a.ah_attr.port_num = IB_PORT;
    memcpy(a.ah_attr.grh.dgid.raw, peer->gid, sizeof(peer->gid));
    a.ah_attr.grh.sgid_index = SGID_INDEX;
    a.ah_attr.grh.hop_limit = 64;
    rc = ibv_modify_qp(s->qp, &a,
                       IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                           IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (rc != 0)
        return fail_code("ibv_modify_qp(INIT -> RTR)", rc);

    /* RTR -> RTS (ready to send): our first PSN, the ACK timeout (14: about
     * 67 ms) and the retry counts (rnr_retry 7: retry forever while the peer
     * has no receive posted). */
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = 0;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = 1;
    rc = ibv_modify_qp(s->qp, &a,
                       IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                           IBV_QP_MAX_QP_RD_ATOMIC);
    if (rc != 0)
        return fail_code("ibv_modify_qp(RTR -> RTS)", rc);
    return 0;
}

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Poll the CQ for one CQE (completion queue entry); it must be a success. */
static int wait_for_cqe(struct side *s, struct ibv_wc *wc)
{
    const struct timespec pause = { .tv_sec = 0, .tv_nsec = 200 * 1000 };
    double deadline = now_seconds() + WAIT_SECONDS;
    int n;

    for (;;) {
        n = ibv_poll_cq(s->cq, 1, wc);
        if (n < 0)
            return fail_msg("ibv_poll_cq failed");
        if (n > 0)
            break;
        if (now_seconds() > deadline) {
            fprintf(stderr, "%s: no completion within %d s\n", prog, WAIT_SECONDS);
            return -1;
        }
        nanosleep(&pause, NULL); /* be gentle with a shared (or emulated) CPU */
    }
    if (wc->status != IBV_WC_SUCCESS) {
        fprintf(stderr, "%s: completion of wr_id %llu failed: %s (status %d, vendor_err 0x%x)\n", prog,
                (unsigned long long)wc->wr_id, ibv_wc_status_str(wc->status), (int)wc->status, wc->vendor_err);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- roles -- */

static int serve(const char *ip, int port)
{
    struct side s;
    struct qp_info peer;
    struct ibv_sge sge;
    struct ibv_recv_wr rwr, *bad_rwr = NULL;
    struct ibv_wc wc;
    const char go = GO_BYTE;
    int fd = -1, rc = -1, err;

    if (open_side(&s) != 0)
        goto out;
    fd = accept_one(ip, port);
    if (fd < 0)
        goto out;
    set_recv_timeout(fd);
    if (swap_info(fd, &s, &peer) != 0 || connect_qp(&s, &peer) != 0)
        goto out;

    /* A receive WR must be waiting before the Write with immediate arrives:
     * the data goes to the address the client names, but the immediate
     * consumes this WR and produces our CQE. */
    memset(&sge, 0, sizeof(sge));
    sge.addr = (uintptr_t)s.buf;
    sge.length = BUF_BYTES;
    sge.lkey = s.mr->lkey;
    memset(&rwr, 0, sizeof(rwr));
    rwr.wr_id = 0;
    rwr.sg_list = &sge;
    rwr.num_sge = 1;
    err = ibv_post_recv(s.qp, &rwr, &bad_rwr);
    if (err != 0) {
        fail_code("ibv_post_recv", err);
        goto out;
    }

    /* Only now may the client write. */
    if (send_all(fd, &go, 1, "sending the go byte") != 0)
        goto out;

    if (wait_for_cqe(&s, &wc) != 0)
        goto out;
    /* completion received: opcode (129 = IBV_WC_RECV_RDMA_WITH_IMM), the
     * immediate (big-endian on the wire), the length written */
    printf("收到完成：opcode=%d imm=0x%x 长度=%u\n", (int)wc.opcode,
           (wc.wc_flags & IBV_WC_WITH_IMM) ? ntohl(wc.imm_data) : 0u, wc.byte_len);
    /* buffer contents (the writer's NUL ends the text) */
    printf("缓冲区内容：%.*s\n", (int)(wc.byte_len < BUF_BYTES ? wc.byte_len : BUF_BYTES), (char *)s.buf);
    rc = 0;
out:
    if (fd >= 0)
        close(fd);
    close_side(&s);
    return rc;
}

static int send_greeting(const char *ip, int port)
{
    struct side s;
    struct qp_info peer;
    struct ibv_sge sge;
    struct ibv_send_wr swr, *bad_swr = NULL;
    struct ibv_wc wc;
    const size_t len = sizeof(GREETING); /* strlen + 1: the NUL travels too */
    char go = 0;
    int fd = -1, rc = -1, err;

    if (open_side(&s) != 0)
        goto out;
    fd = connect_to(ip, port);
    if (fd < 0)
        goto out;
    set_recv_timeout(fd);
    if (swap_info(fd, &s, &peer) != 0 || connect_qp(&s, &peer) != 0)
        goto out;
    if (recv_all(fd, &go, 1, "waiting for the server's go byte") != 0)
        goto out;
    if (go != GO_BYTE) {
        fprintf(stderr, "%s: expected '%c' from the server, got 0x%02x\n", prog, GO_BYTE, (unsigned char)go);
        goto out;
    }

    /* The message goes into our registered buffer: the device reads it from
     * there (by DMA) when it executes the WR. */
    memcpy(s.buf, GREETING, len);

    /* The RDMA Write WR: local SGE (our buffer, our lkey) -> the peer's
     * buf_addr under the peer's rkey, with 32 bits of immediate data, which
     * is what makes a CQE appear on the peer.  Signaled: we get a CQE too,
     * once the peer's RC ACK arrives. */
    memset(&sge, 0, sizeof(sge));
    sge.addr = (uintptr_t)s.buf;
    sge.length = (uint32_t)len;
    sge.lkey = s.mr->lkey;
    memset(&swr, 0, sizeof(swr));
    swr.wr_id = 1;
    swr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    swr.send_flags = IBV_SEND_SIGNALED;
    swr.imm_data = htonl(IMM_VALUE);
    swr.sg_list = &sge;
    swr.num_sge = 1;
    swr.wr.rdma.remote_addr = peer.buf_addr;
    swr.wr.rdma.rkey = peer.rkey;
    err = ibv_post_send(s.qp, &swr, &bad_swr);
    if (err != 0) {
        fail_code("ibv_post_send(RDMA_WRITE_WITH_IMM)", err);
        goto out;
    }

    if (wait_for_cqe(&s, &wc) != 0)
        goto out;
    printf("发送完成，已写入对端 %zu 字节\n", len); /* send complete, bytes written */
    rc = 0;
out:
    if (fd >= 0)
        close(fd);
    close_side(&s);
    return rc;
}

static int parse_port(const char *text, int *port)
{
    char *end;
    long v;

    errno = 0;
    v = strtol(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || v < 0 || v > 65535)
        return -1;
    *port = (int)v;
    return 0;
}

static int usage(void)
{
    fprintf(stderr,
            "usage: %s server <listen-IPv4> [tcp-port]\n"
            "       %s client <server-IPv4> [tcp-port]\n"
            "(default port %d)\n",
            prog, prog, DEFAULT_TCP_PORT);
    return 2;
}

int main(int argc, char **argv)
{
    int port = DEFAULT_TCP_PORT;
    int server;

    if (argc > 0 && argv[0] && argv[0][0])
        prog = argv[0];
    setvbuf(stdout, NULL, _IOLBF, 0); /* lines reach a pipe as they are printed */

    if (argc < 3 || argc > 4)
        return usage();
    if (strcmp(argv[1], "server") == 0)
        server = 1;
    else if (strcmp(argv[1], "client") == 0)
        server = 0;
    else
        return usage();
    if (argc == 4 && parse_port(argv[3], &port) != 0) {
        fprintf(stderr, "%s: not a TCP port number: %s\n", prog, argv[3]);
        return 2;
    }
    if (!server && port == 0) {
        fprintf(stderr, "%s: the client needs the server's port (not 0)\n", prog);
        return 2;
    }
    return (server ? serve(argv[2], port) : send_greeting(argv[2], port)) == 0 ? 0 : 1;
}
