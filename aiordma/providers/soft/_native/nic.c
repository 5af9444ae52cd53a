/* The native engine's NIC (see nic.h): the C twin of nic.py. */
#define _GNU_SOURCE
#include "nic.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/udp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#ifndef SOL_UDP
#define SOL_UDP 17
#endif

const char *const nic_counter_names[NC_MAX] = {
    "rx_packets",
    "rx_malformed",
    "rx_malformed_truncated",
    "rx_malformed_bad_opcode",
    "rx_malformed_bad_tver",
    "rx_malformed_bad_length",
    "rx_icrc_unchecked",
    "rx_icrc_errors",
    "rx_icrc_ip_id_out_of_range",
    "rx_icrc_ip_id_inferred",
    "rx_unknown_qp",
    "rx_wrong_source",
    "rx_errors",
    "rx_internal_errors",
    "tx_packets",
    "tx_dropped_full",
    "tx_errors",
    "tx_gso_sends",
    "tx_syscalls",
    "rx_syscalls",
    "nic_wakeups",
    "tx_inline",
    "loop_services",
    "loop_handoffs",
    "tx_bytes",
    "rx_bytes",
    "rx_gro_datagrams",
    "tx_local",
    "rx_icrc_skipped",
    "tx_kicks", /* requests sent in the middle of a dispatch (NativeQP._post) */
    "nic_poll_hits", /* packets the NIC thread found while polling (wake-ups nobody paid for) */
    "tx_cma_grants", /* READs answered by a grant (cross-memory attach, rc.c) */
    "rx_cma_reads",  /* READs whose bytes this process copied from the peer's */
    "rx_cma_bytes",
    "gso_capture_pauses", /* times GSO batches paused because a capture began listening */
    "tx_shm",
    "rx_shm",
    "shm_kicks",
    "shm_ring_full",
    "shm_broken",
    "shm_yields",
    "shm_wait_hits",
};

double nic_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void nic_lock(struct nic *e) { pthread_mutex_lock(&e->lock); }
void nic_unlock(struct nic *e) { pthread_mutex_unlock(&e->lock); }

void nic_wake(struct nic *e)
{
    uint64_t one = 1;
    if (e->wakefd >= 0) {
        ssize_t r = write(e->wakefd, &one, 8);
        (void)r;
    }
}

/* a receive batch's control buffer: room for the UDP_GRO segment size */
#define GRO_CBUF CMSG_SPACE(sizeof(int))

/* the receive batch's message headers (struct nic's rx) */
struct rx_hdrs {
    struct mmsghdr mm[RX_BATCH];
    struct iovec iov[RX_BATCH];
    struct sockaddr_storage src[RX_BATCH];
    union {
        char buf[GRO_CBUF];
        struct cmsghdr align;
    } cbuf[RX_BATCH];
    int ready, gro;
};

static void *grow(void *p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return p;
    size_t c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void *q = realloc(p, c * elem);
    if (!q) abort();
    *cap = c;
    return q;
}

/* ------------------------------------------------------------ channels ---- */

struct nic_channel *nic_channel_new(void)
{
    struct nic_channel *ch = calloc(1, sizeof *ch);
    if (!ch) return NULL;
    ch->fd = eventfd(0, EFD_SEMAPHORE | EFD_NONBLOCK | EFD_CLOEXEC);
    if (ch->fd < 0) {
        free(ch);
        return NULL;
    }
    pthread_mutex_init(&ch->lock, NULL);
    atomic_init(&ch->refcnt, 1);
    return ch;
}

void nic_channel_close(struct nic_channel *ch)
{
    /* the pending events' CQ references go (outside the lock: a CQ's last unref
     * unrefs its channel, and the caller still holds one, so that is not the last) */
    struct nic_cq **events = NULL;
    size_t head = 0, len = 0, cap = 0;
    pthread_mutex_lock(&ch->lock);
    if (!ch->closed) {
        ch->closed = 1;
        close(ch->fd);
        ch->fd = -1;
        events = ch->events;
        head = ch->head;
        len = ch->len;
        cap = ch->cap;
        ch->events = NULL;
        ch->head = ch->len = ch->cap = 0;
    }
    pthread_mutex_unlock(&ch->lock);
    for (size_t i = 0; i < len; i++) nic_cq_unref(events[(head + i) % cap]);
    free(events);
}

void nic_channel_unref(struct nic_channel *ch)
{
    if (atomic_fetch_sub(&ch->refcnt, 1) == 1) {
        nic_channel_close(ch);
        pthread_mutex_destroy(&ch->lock);
        free(ch);
    }
}

void nic_channel_notify(struct nic_channel *ch, struct nic_cq *cq)
{
    pthread_mutex_lock(&ch->lock);
    if (!ch->closed) {
        if (ch->len == ch->cap) {
            size_t nc = ch->cap ? ch->cap * 2 : 8;
            struct nic_cq **r = malloc(nc * sizeof *r);
            if (!r) abort();
            for (size_t i = 0; i < ch->len; i++) r[i] = ch->events[(ch->head + i) % ch->cap];
            free(ch->events);
            ch->events = r;
            ch->cap = nc;
            ch->head = 0;
        }
        uint64_t one = 1;
        /* counted and signalled together: readable <=> an event is queued */
        if (write(ch->fd, &one, 8) == 8) {
            atomic_fetch_add(&cq->refcnt, 1);
            ch->events[(ch->head + ch->len) % ch->cap] = cq;
            ch->len++;
        }
    }
    pthread_mutex_unlock(&ch->lock);
}

struct nic_cq *nic_channel_get_event(struct nic_channel *ch)
{
    struct nic_cq *cq = NULL;
    pthread_mutex_lock(&ch->lock);
    if (ch->len && !ch->closed) {
        uint64_t v;
        cq = ch->events[ch->head];
        ch->head = (ch->head + 1) % ch->cap;
        ch->len--;
        ssize_t r = read(ch->fd, &v, 8);
        (void)r;
    }
    pthread_mutex_unlock(&ch->lock);
    return cq;
}

void nic_fire_events(struct nic *e)
{
    /* the list belongs to the lock holder: take it under the lock, notify outside */
    struct nic_cq *local[16];
    struct nic_cq **list = local;
    size_t n;
    nic_lock(e);
    n = e->nfire;
    if (n) {
        if (n > 16) {
            list = malloc(n * sizeof *list);
            if (!list) abort();
        }
        memcpy(list, e->fire, n * sizeof *list);
        e->nfire = 0;
    }
    nic_unlock(e);
    for (size_t i = 0; i < n; i++) {
        nic_channel_notify(list[i]->ch, list[i]);
        nic_cq_unref(list[i]);
    }
    if (list != local) free(list);
}

/* ------------------------------------------------------------------ CQs ---- */

struct nic_cq *nic_cq_new(struct nic *e, uint32_t cqe, struct nic_channel *ch)
{
    struct nic_cq *cq = calloc(1, sizeof *cq);
    if (!cq) return NULL;
    pthread_mutex_init(&cq->lock, NULL);
    atomic_init(&cq->refcnt, 1);
    cq->cqe = cqe;
    cq->cap = 64;
    cq->ring = malloc(cq->cap * sizeof *cq->ring);
    if (!cq->ring) {
        free(cq);
        return NULL;
    }
    if (ch) {
        atomic_fetch_add(&ch->refcnt, 1);
        cq->ch = ch;
    }
    nic_lock(e);
    e->ncqs++;
    nic_unlock(e);
    return cq;
}

void nic_cq_unref(struct nic_cq *cq)
{
    if (atomic_fetch_sub(&cq->refcnt, 1) == 1) {
        if (cq->ch) nic_channel_unref(cq->ch);
        pthread_mutex_destroy(&cq->lock);
        free(cq->ring);
        free(cq);
    }
}

/* write a CQE; 1 when the CQ was armed (its channel must fire) */
static int cq_push(struct nic_cq *cq, const struct rc_wc *w)
{
    pthread_mutex_lock(&cq->lock);
    if (cq->len >= cq->cqe) cq->overflows++;
    if (cq->len == cq->cap) {
        size_t nc = cq->cap * 2;
        struct rc_wc *r = malloc(nc * sizeof *r);
        if (!r) abort();
        for (size_t i = 0; i < cq->len; i++) r[i] = cq->ring[(cq->head + i) % cq->cap];
        free(cq->ring);
        cq->ring = r;
        cq->cap = nc;
        cq->head = 0;
    }
    cq->ring[(cq->head + cq->len) % cq->cap] = *w;
    cq->len++;
    int fire = cq->armed;
    cq->armed = 0;
    pthread_mutex_unlock(&cq->lock);
    return fire && cq->ch;
}

size_t nic_cq_poll(struct nic_cq *cq, struct rc_wc *out, size_t n)
{
    pthread_mutex_lock(&cq->lock);
    size_t k = cq->len < n ? cq->len : n;
    for (size_t i = 0; i < k; i++) out[i] = cq->ring[(cq->head + i) % cq->cap];
    cq->head = (cq->head + k) % cq->cap;
    cq->len -= k;
    pthread_mutex_unlock(&cq->lock);
    return k;
}

void nic_cq_req_notify(struct nic_cq *cq)
{
    pthread_mutex_lock(&cq->lock);
    cq->armed = 1;
    pthread_mutex_unlock(&cq->lock);
}

/* ------------------------------------------------------------ open/close ---- */

static int parse_ip(const char *ip, struct flow *f)
{
    memset(f->src, 0, 16);
    if (strchr(ip, ':')) {
        f->ipv6 = 1;
        return inet_pton(AF_INET6, ip, f->src) == 1 ? 0 : -1;
    }
    f->ipv6 = 0;
    return inet_pton(AF_INET, ip, f->src) == 1 ? 0 : -1;
}

static int pcap_open(const char *path)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return -1;
    uint8_t h[24];
    uint32_t v[] = {0xA1B2C3D4u, 0, 0, 0, 262144, 1};
    memcpy(h, &v[0], 4);
    uint16_t maj = 2, min = 4;
    memcpy(h + 4, &maj, 2);
    memcpy(h + 6, &min, 2);
    memset(h + 8, 0, 8);
    memcpy(h + 16, &v[4], 4);
    memcpy(h + 20, &v[5], 4);
    if (write(fd, h, 24) != 24) {
        close(fd);
        return -1;
    }
    return fd;
}

int nic_open(struct nic *e, const char *ip, int port, int icrc_policy, const char *pcap_path, char *err,
             size_t errlen)
{
    memset(e, 0, sizeof *e);
    e->sock = e->wakefd = e->pcap_fd = e->nic_ep = e->loop_ep = e->shm_wakefd = -1;
    e->wait_deadline = -1.0;
    e->window_deadline = -1.0;
    e->window_len = DEFAULT_LOOP_WINDOW;
    e->poll_window = DEFAULT_NIC_POLL;
    e->undrained_since = -1.0;
    e->icrc_policy = icrc_policy;
    e->gso = 1;
    e->gso_watch_ifindex = -1;
    e->local_delivery = 1;
    e->rx_batch = RX_BATCH;
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_settype(&ma, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&e->lock, &ma);
    pthread_mutexattr_destroy(&ma);
    pthread_mutex_init(&e->async.lock, NULL);
    e->async.fd = -1;
    atomic_init(&e->closing, 0);
    if (parse_ip(ip, &e->local) < 0) {
        snprintf(err, errlen, "not an IP address: %s", ip);
        return -EINVAL;
    }
    e->ipv6 = e->local.ipv6;
    int s = socket(e->ipv6 ? AF_INET6 : AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s < 0) {
        int r = -errno;
        snprintf(err, errlen, "%s", strerror(errno));
        return r;
    }
    struct sockaddr_storage sa;
    socklen_t salen;
    memset(&sa, 0, sizeof sa);
    if (e->ipv6) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&sa;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons((uint16_t)port);
        memcpy(&a->sin6_addr, e->local.src, 16);
        salen = sizeof *a;
    } else {
        struct sockaddr_in *a = (struct sockaddr_in *)&sa;
        a->sin_family = AF_INET;
        a->sin_port = htons((uint16_t)port);
        memcpy(&a->sin_addr, e->local.src, 4);
        salen = sizeof *a;
    }
    if (bind(s, (struct sockaddr *)&sa, salen) < 0) {
        int r = -errno;
        snprintf(err, errlen, "%s", strerror(errno));
        close(s);
        return r;
    }
    getsockname(s, (struct sockaddr *)&sa, &salen);
    e->port = ntohs(e->ipv6 ? ((struct sockaddr_in6 *)&sa)->sin6_port : ((struct sockaddr_in *)&sa)->sin_port);
    e->local.sport = e->port;
    inet_ntop(e->ipv6 ? AF_INET6 : AF_INET, e->local.src, e->ip, sizeof e->ip);
    if (!e->ipv6) {
        int v = IP_PMTUDISC_DO; /* DF set and IP ID 0: the IP header the ICRC covers */
        setsockopt(s, IPPROTO_IP, IP_MTU_DISCOVER, &v, sizeof v);
    }
    int rcv = 8 << 20, snd = 4 << 20;
    if (setsockopt(s, SOL_SOCKET, SO_RCVBUFFORCE, &rcv, sizeof rcv) < 0)
        setsockopt(s, SOL_SOCKET, SO_RCVBUF, &rcv, sizeof rcv);
    if (setsockopt(s, SOL_SOCKET, SO_SNDBUFFORCE, &snd, sizeof snd) < 0)
        setsockopt(s, SOL_SOCKET, SO_SNDBUF, &snd, sizeof snd);
    e->sock = s;
    e->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    e->shm_wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    e->shm_device = shm_random_id();
    e->async.fd = eventfd(0, EFD_SEMAPHORE | EFD_NONBLOCK | EFD_CLOEXEC);
    e->rxbufs = malloc((size_t)RX_BATCH * RX_BUF);
    e->rx = calloc(1, sizeof *e->rx);
    e->nic_ep = epoll_create1(EPOLL_CLOEXEC);
    e->loop_ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = e->wakefd};
    struct epoll_event shm_ev = {.events = EPOLLIN, .data.fd = e->shm_wakefd};
    if (e->wakefd < 0 || e->shm_wakefd < 0 || e->async.fd < 0 || !e->rxbufs || !e->rx || e->nic_ep < 0 ||
        e->loop_ep < 0 || epoll_ctl(e->nic_ep, EPOLL_CTL_ADD, e->wakefd, &ev) < 0 ||
        epoll_ctl(e->nic_ep, EPOLL_CTL_ADD, e->shm_wakefd, &shm_ev) < 0 ||
        epoll_ctl(e->nic_ep, EPOLL_CTL_ADD, s, &(struct epoll_event){.events = EPOLLIN, .data.fd = s}) < 0) {
        snprintf(err, errlen, "out of resources");
        nic_close(e);
        return -ENOMEM;
    }
    if (pcap_path && *pcap_path) {
        e->pcap_fd = pcap_open(pcap_path);
        if (e->pcap_fd < 0) {
            int r = -errno;
            snprintf(err, errlen, "cannot write the capture %s: %s", pcap_path, strerror(errno));
            nic_close(e);
            return r;
        }
    }
    return 0;
}

static void *nic_thread_main(void *arg);

int nic_start(struct nic *e)
{
    atomic_store(&e->thread_running, 1);
    if (pthread_create(&e->thread, NULL, nic_thread_main, e) != 0) {
        atomic_store(&e->thread_running, 0);
        return -1;
    }
    e->thread_started = 1;
    return 0;
}

void nic_close(struct nic *e)
{
    if (atomic_exchange(&e->closing, 1) && !e->thread_started && e->sock < 0) return;
    nic_wake(e);
    if (e->thread_started && !pthread_equal(pthread_self(), e->thread)) {
        pthread_join(e->thread, NULL);
        e->thread_started = 0;
    }
    nic_lock(e);
    if (e->sock >= 0) close(e->sock);
    e->sock = -1;
    if (e->wakefd >= 0) close(e->wakefd);
    e->wakefd = -1;
    nic_shm_free_all(e);
    if (e->shm_wakefd >= 0) close(e->shm_wakefd);
    e->shm_wakefd = -1;
    if (e->nic_ep >= 0) close(e->nic_ep);
    e->nic_ep = -1;
    if (e->loop_ep >= 0) close(e->loop_ep);
    e->loop_ep = -1;
    e->loop_owns = e->loop_attached = 0;
    if (e->pcap_fd >= 0) close(e->pcap_fd);
    e->pcap_fd = -1;
    for (int i = 0; i < e->faults.nheld; i++) free(e->faults.held[i].data);
    e->faults.nheld = 0;
    nic_unlock(e);
    pthread_mutex_lock(&e->async.lock);
    if (e->async.fd >= 0) close(e->async.fd);
    e->async.fd = -1;
    e->async.len = 0;
    pthread_mutex_unlock(&e->async.lock);
}

void nic_free(struct nic *e)
{
    nic_close(e);
    free(e->rxbufs);
    e->rxbufs = NULL;
    free(e->rx);
    e->rx = NULL;
    free(e->txscratch);
    e->txscratch = NULL;
    free(e->txb);
    e->txb = NULL;
    free(e->fire);
    e->fire = NULL;
    free(e->deferred);
    e->deferred = NULL;
    rc_out_free(&e->out);
    /* zombies are released by the binding before this */
    free(e->zombies);
    e->zombies = NULL;
    free(e->async.ring);
    e->async.ring = NULL;
    pthread_mutex_destroy(&e->async.lock);
    pthread_mutex_destroy(&e->lock);
}

void nic_pd_release(struct pd *pd, struct mr *mr)
{
    struct nic *e = pd->release_ctx;
    e->zombies = grow(e->zombies, &e->zombies_cap, e->nzombies + 1, sizeof *e->zombies);
    e->zombies[e->nzombies++] = mr;
}

/* ------------------------------------------------------- async events ---- */

void nic_async_push(struct nic *e, int type, uint32_t element)
{
    struct nic_async *a = &e->async;
    pthread_mutex_lock(&a->lock);
    if (a->fd < 0) {
        pthread_mutex_unlock(&a->lock);
        return;
    }
    if (a->len >= NIC_ASYNC_MAX) {
        a->dropped++;
        pthread_mutex_unlock(&a->lock);
        return;
    }
    if (a->len == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 8;
        struct nic_async_event *r = malloc(nc * sizeof *r);
        if (!r) abort();
        for (size_t i = 0; i < a->len; i++) r[i] = a->ring[(a->head + i) % a->cap];
        free(a->ring);
        a->ring = r;
        a->cap = nc;
        a->head = 0;
    }
    uint64_t one = 1;
    /* queued and signalled together: readable <=> an event is queued */
    if (write(a->fd, &one, 8) == 8) {
        struct nic_async_event *ev = &a->ring[(a->head + a->len) % a->cap];
        ev->type = type;
        ev->element = element;
        a->len++;
    }
    pthread_mutex_unlock(&a->lock);
}

int nic_async_get(struct nic *e, int *type, uint32_t *element)
{
    struct nic_async *a = &e->async;
    int got = 0;
    pthread_mutex_lock(&a->lock);
    if (a->len && a->fd >= 0) {
        uint64_t v;
        struct nic_async_event *ev = &a->ring[a->head];
        *type = ev->type;
        *element = ev->element;
        a->head = (a->head + 1) % a->cap;
        a->len--;
        ssize_t r = read(a->fd, &v, 8);
        (void)r;
        got = 1;
    }
    pthread_mutex_unlock(&a->lock);
    return got;
}

/* ----------------------------------------------------------------- SRQs ---- */

static void srq_on_limit(void *ctx, struct rc_srq *srq)
{
    nic_async_push(ctx, NIC_EVENT_SRQ_LIMIT_REACHED, srq->srq_num);
}

struct rc_srq *nic_srq_new(struct nic *e, uint32_t srq_num, struct pd *pd, uint32_t max_wr, uint32_t max_sge)
{
    struct rc_srq *srq = rc_srq_create(srq_num, pd, max_wr, max_sge);
    if (!srq) return NULL;
    srq->on_limit = srq_on_limit;
    srq->on_limit_ctx = e;
    e->nsrqs++;
    return srq;
}

void nic_srq_destroy(struct nic *e, struct rc_srq *srq)
{
    rc_srq_destroy(srq);
    e->nsrqs--;
}

/* ----------------------------------------------------------------- QPs ---- */

static unsigned qp_bucket(uint32_t qpn) { return (qpn ^ (qpn >> 10) ^ (qpn >> 20)) % QP_BUCKETS; }

struct nic_qp *nic_qp_find(struct nic *e, uint32_t qpn)
{
    for (struct nic_qp *q = e->qps[qp_bucket(qpn)]; q; q = q->hnext)
        if (q->rc->qp_num == qpn) return q;
    return NULL;
}

struct nic_qp *nic_qp_new(struct nic *e, uint32_t qpn, struct pd *pd, struct rc_srq *srq, struct nic_cq *scq,
                          struct nic_cq *rcq, uint32_t max_send_wr, uint32_t max_recv_wr, uint32_t max_send_sge,
                          uint32_t max_recv_sge, int sq_sig_all)
{
    struct nic_qp *q = calloc(1, sizeof *q);
    if (!q) return NULL;
    q->rc = rc_create_ex(qpn, pd, srq, max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, sq_sig_all);
    if (!q->rc) {
        free(q);
        return NULL;
    }
    q->nic = e;
    q->rc->busy_count = &e->busy_qps;
    q->rc->cma_counters = &e->counters[NC_TX_CMA_GRANTS];
    q->scq = scq;
    q->rcq = rcq;
    atomic_fetch_add(&scq->refcnt, 1);
    atomic_fetch_add(&rcq->refcnt, 1);
    unsigned b = qp_bucket(qpn);
    q->hnext = e->qps[b];
    e->qps[b] = q;
    q->next = e->all;
    if (e->all) e->all->prev = q;
    e->all = q;
    e->nqps++;
    return q;
}

/* Take a QP out of the engine (lock held): no packet, timer or post reaches it any
 * more, and its memory references and CQs are released. The struct itself stays
 * (closed) until nic_qp_destroy: a thread that fetched the pointer before the close
 * finds q->closed set once it holds the lock. */
void nic_qp_close(struct nic_qp *q)
{
    if (q->closed) return;
    struct nic *e = q->nic;
    struct nic_qp **pp;
    for (pp = &e->qps[qp_bucket(q->rc->qp_num)]; *pp; pp = &(*pp)->hnext)
        if (*pp == q) {
            *pp = q->hnext;
            e->nqps--;
            break;
        }
    if (q->prev)
        q->prev->next = q->next;
    else if (e->all == q)
        e->all = q->next;
    if (q->next) q->next->prev = q->prev;
    q->next = q->prev = NULL;
    if (q->local_due) { /* (cannot happen: the list is empty whenever the lock is free) */
        for (pp = &e->local_due; *pp; pp = &(*pp)->next_local)
            if (*pp == q) {
                *pp = q->next_local;
                break;
            }
        q->local_due = 0;
    }
    {   /* the device's totals keep what this QP counted (transport_totals) */
        const uint64_t *c = (const uint64_t *)&q->rc->c;
        for (int i = 0; i < RC_NCOUNTERS; i++) e->closed_qp_counters[i] += c[i];
    }
    nic_qp_drop_links(q);
    rc_destroy(q->rc);
    q->rc = NULL;
    nic_cq_unref(q->scq);
    nic_cq_unref(q->rcq);
    q->scq = q->rcq = NULL;
    q->closed = 1;
}

void nic_qp_destroy(struct nic_qp *q)
{
    nic_qp_close(q);
    free(q);
}

int nic_qp_set_peer(struct nic_qp *q, const char *ip, int port)
{
    struct nic *e = q->nic;
    struct flow f = e->local;
    memset(f.dst, 0, 16);
    int v6 = strchr(ip, ':') != NULL;
    if (v6 != e->ipv6) return -1;
    if (inet_pton(v6 ? AF_INET6 : AF_INET, ip, f.dst) != 1) return -1;
    f.sport = e->port;
    f.dport = (uint16_t)port;
    f.ip_id = 0;
    f.tclass = q->txflow.tclass;
    f.hop_limit = q->txflow.hop_limit;
    q->txflow = f;
    memset(&q->peer, 0, sizeof q->peer);
    if (v6) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&q->peer;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons((uint16_t)port);
        memcpy(&a->sin6_addr, f.dst, 16);
        q->peer_len = sizeof *a;
    } else {
        struct sockaddr_in *a = (struct sockaddr_in *)&q->peer;
        a->sin_family = AF_INET;
        a->sin_port = htons((uint16_t)port);
        memcpy(&a->sin_addr, f.dst, 4);
        q->peer_len = sizeof *a;
    }
    q->has_peer = 1;
    static const uint8_t any[16];
    size_t alen = v6 ? 16 : 4;
    q->local_peer = (uint16_t)port == e->port && memcmp(f.dst, e->local.src, alen) == 0 &&
                    memcmp(e->local.src, any, alen) != 0;
    return 0;
}

/* ---------------------------------------------------------------- pcap ---- */

static uint16_t csum_add(uint32_t s, const uint8_t *d, size_t n)
{
    for (size_t i = 0; i + 1 < n; i += 2) s += (uint32_t)(d[i] << 8 | d[i + 1]);
    if (n & 1) s += (uint32_t)(d[n - 1] << 8);
    while (s >> 16) s = (s & 0xFFFF) + (s >> 16);
    return (uint16_t)s;
}

static void mac_of(const struct flow *f, const uint8_t *ip, uint8_t *mac)
{
    mac[0] = 0x02;
    if (f->ipv6)
        memcpy(mac + 1, ip + 11, 5);
    else {
        mac[1] = 0;
        memcpy(mac + 2, ip, 4);
    }
}

/* the datagram (parts) as an Ethernet frame on f (pcap.py's build_frame) */
static void pcap_write(struct nic *e, const struct iovec *parts, int nparts, const struct flow *f, uint16_t ip_id)
{
    size_t plen = 0;
    for (int i = 0; i < nparts; i++) plen += parts[i].iov_len;
    size_t udp_len = 8 + plen;
    uint8_t hdr[16 + 14 + 40 + 8];
    uint8_t *eth = hdr + 16;
    mac_of(f, f->dst, eth);
    mac_of(f, f->src, eth + 6);
    size_t iplen;
    uint8_t *ip = eth + 14;
    if (f->ipv6) {
        put_be16(eth + 12, 0x86DD);
        put_be32(ip, 0x60000000u | (uint32_t)f->tclass << 20);
        put_be16(ip + 4, (uint16_t)udp_len);
        ip[6] = 17;
        ip[7] = f->hop_limit ? f->hop_limit : 64;
        memcpy(ip + 8, f->src, 16);
        memcpy(ip + 24, f->dst, 16);
        iplen = 40;
    } else {
        put_be16(eth + 12, 0x0800);
        ip[0] = 0x45;
        ip[1] = f->tclass;
        put_be16(ip + 2, (uint16_t)(20 + udp_len));
        put_be16(ip + 4, ip_id);
        put_be16(ip + 6, 0x4000);
        ip[8] = f->hop_limit ? f->hop_limit : 64;
        ip[9] = 17;
        ip[10] = ip[11] = 0;
        memcpy(ip + 12, f->src, 4);
        memcpy(ip + 16, f->dst, 4);
        put_be16(ip + 10, (uint16_t)~csum_add(0, ip, 20));
        iplen = 20;
    }
    uint8_t *udp = ip + iplen;
    put_be16(udp, f->sport);
    put_be16(udp + 2, f->dport);
    put_be16(udp + 4, (uint16_t)udp_len);
    put_be16(udp + 6, 0);
    if (f->ipv6) {
        uint8_t pseudo[40];
        memcpy(pseudo, f->src, 16);
        memcpy(pseudo + 16, f->dst, 16);
        put_be32(pseudo + 32, (uint32_t)udp_len);
        pseudo[36] = pseudo[37] = pseudo[38] = 0;
        pseudo[39] = 17;
        uint32_t s = csum_add(0, pseudo, 40);
        s = csum_add(s, udp, 8);
        /* the payload may be split at odd offsets: sum it from one contiguous copy */
        uint8_t *tmp = malloc(plen ? plen : 1);
        if (!tmp) return;
        size_t o = 0;
        for (int i = 0; i < nparts; i++) {
            memcpy(tmp + o, parts[i].iov_base, parts[i].iov_len);
            o += parts[i].iov_len;
        }
        s = csum_add(s, tmp, plen);
        free(tmp);
        uint16_t c = (uint16_t)~s;
        put_be16(udp + 6, c ? c : 0xFFFF);
    }
    size_t frame = 14 + iplen + 8 + plen;
    size_t caplen = frame < 262144 ? frame : 262144;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint32_t rec[4] = {(uint32_t)ts.tv_sec, (uint32_t)(ts.tv_nsec / 1000), (uint32_t)caplen, (uint32_t)frame};
    memcpy(hdr, rec, 16);
    struct iovec iov[8];
    int n = 0;
    iov[n++] = (struct iovec){hdr, 16 + 14 + iplen + 8};
    size_t left = caplen - (14 + iplen + 8);
    for (int i = 0; i < nparts && n < 8 && left; i++) {
        size_t l = parts[i].iov_len < left ? parts[i].iov_len : left;
        iov[n++] = (struct iovec){parts[i].iov_base, l};
        left -= l;
    }
    ssize_t r = writev(e->pcap_fd, iov, n);
    (void)r;
}

/* -------------------------------------------------------------- faults ---- */

static uint64_t rng_next(uint64_t *s)
{
    /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double rng_double(uint64_t *s) { return (double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0); }

void nic_faults_set(struct nic *e, int on, double drop, double dup, double reorder, uint64_t seed, int has_filter)
{
    for (int i = 0; i < e->faults.nheld; i++) free(e->faults.held[i].data);
    memset(&e->faults, 0, sizeof e->faults);
    e->faults.on = on;
    e->faults.drop = drop;
    e->faults.duplicate = dup;
    e->faults.reorder = reorder;
    e->faults.rng = seed;
    e->faults.has_filter = has_filter;
}

/* --------------------------------------------------------------- send ---- */

static void count_send_error(struct nic *e, int err, size_t n)
{
    if (err == EAGAIN || err == EWOULDBLOCK || err == ENOBUFS)
        e->counters[NC_TX_DROPPED_FULL] += n; /* like a congested link: retransmission recovers */
    else
        e->counters[NC_TX_ERRORS] += n;
}

int nic_capture_listening(int ifindex)
{
    /* as gso.capture_listeners: "sk RefCnt Type Proto Iface ..." per packet socket; one
     * with a protocol, bound to this netdev or to all of them, sees what crosses it */
    FILE *f = fopen("/proc/net/packet", "re");
    if (!f) return 0;
    char line[256];
    int found = 0;
    if (fgets(line, sizeof line, f)) {
        while (!found && fgets(line, sizeof line, f)) {
            unsigned long long sk;
            int refs, type, iface;
            unsigned proto;
            if (sscanf(line, "%llx %d %d %x %d", &sk, &refs, &type, &proto, &iface) == 5)
                found = proto != 0 && (iface == 0 || iface == ifindex);
        }
    }
    fclose(f);
    return found;
}

/* Whether a run of datagrams may leave as one UDP GSO batch now (the lock is held):
 * on, and no capture listening on a netdev that carries batches whole (gso.py), read
 * again every GSO_WATCH_PERIOD seconds */
#define GSO_WATCH_PERIOD 0.2
static int gso_on(struct nic *e)
{
    if (!e->gso) return 0;
    if (e->gso_watch_ifindex < 0) return 1;
    double now = nic_now();
    if (now >= e->gso_watch_next) {
        int paused = nic_capture_listening(e->gso_watch_ifindex);
        if (paused && !e->gso_paused) e->counters[NC_GSO_CAPTURE_PAUSES]++;
        e->gso_paused = paused;
        e->gso_watch_next = now + GSO_WATCH_PERIOD;
    }
    return !e->gso_paused;
}

void nic_qp_set_path(struct nic_qp *q, int tclass, int hop_limit)
{
    q->txflow.tclass = (uint8_t)tclass;
    q->txflow.hop_limit = (uint8_t)hop_limit;
}

/* The socket sends the next datagrams with this traffic class and hop limit: the
 * QPs share one socket, so the IP header's fields are set on it when they change
 * (never, while every QP keeps the defaults); every send is made with the lock held. */
static void use_path(struct nic *e, uint8_t tclass, uint8_t hop_limit)
{
    if (e->sock < 0) return;
    if (tclass != e->sock_tclass) {
        int v = tclass;
        if (e->ipv6)
            setsockopt(e->sock, IPPROTO_IPV6, IPV6_TCLASS, &v, sizeof v);
        else
            setsockopt(e->sock, IPPROTO_IP, IP_TOS, &v, sizeof v);
        e->sock_tclass = tclass;
    }
    if (hop_limit != e->sock_hop_limit) {
        int v = hop_limit ? hop_limit : -1; /* -1: the system's default */
        if (e->ipv6)
            setsockopt(e->sock, IPPROTO_IPV6, IPV6_UNICAST_HOPS, &v, sizeof v);
        else
            setsockopt(e->sock, IPPROTO_IP, IP_TTL, &v, sizeof v);
        e->sock_hop_limit = hop_limit;
    }
}

static void sendto_raw(struct nic *e, const uint8_t *d, size_t n, const struct sockaddr_storage *to, socklen_t tolen)
{
    if (e->sock < 0) return;
    e->counters[NC_TX_SYSCALLS]++;
    if (sendto(e->sock, d, n, 0, (const struct sockaddr *)to, tolen) < 0)
        count_send_error(e, errno, 1);
    else {
        e->counters[NC_TX_PACKETS]++;
        e->counters[NC_TX_BYTES] += n;
    }
}

/* encoded headers and tails of one batch: [hdr MAX_HDR_LEN][tail 8] per packet */
#define SCRATCH_PER_PKT (MAX_HDR_LEN + 8)
#define GSO_MIN_SEGMENT 1024
/* datagrams encoded (their payloads read for the ICRC) before they are sent: well within a
 * core's L2 cache, so the kernel copies them from there */
#define TX_HOT_BYTES (256 * 1024)

struct enc {
    struct iovec iov[3];
    int niov;
    size_t len;
};

/* skip_icrc: the ICRC left out (zero): a QP whose peer agreed (struct nic_qp) */
static void encode_iov(const struct pkt *p, const struct flow *f, uint16_t ip_id, uint8_t *scratch, struct enc *out,
                       int skip_icrc)
{
    uint8_t *hdr = scratch, *tail = scratch + MAX_HDR_LEN;
    size_t h = wire_pack_headers(p, hdr);
    int n = 0;
    out->iov[n++] = (struct iovec){hdr, h};
    size_t len = h, t = 0;
    if (wire_layout[p->opcode] & L_PAYLOAD) {
        if (p->plen) out->iov[n++] = (struct iovec){(void *)p->payload, p->plen};
        len += p->plen;
        uint32_t pad = (-p->plen) & 3u;
        memset(tail, 0, pad);
        t = pad;
        len += pad;
    }
    if (skip_icrc) {
        put_le32(tail + t, 0);
    } else {
        struct iovec tmp[3];
        int nt = n;
        memcpy(tmp, out->iov, sizeof(struct iovec) * (size_t)n);
        if (t) tmp[nt++] = (struct iovec){tail, t};
        put_le32(tail + t, wire_icrc(f, ip_id, tmp, nt, len + ICRC_LEN));
    }
    out->iov[n++] = (struct iovec){tail, t + ICRC_LEN};
    out->niov = n;
    out->len = len + ICRC_LEN;
}

static uint8_t *scratch_for(struct nic *e, size_t npkts)
{
    size_t need = npkts * SCRATCH_PER_PKT;
    if (need > e->txscratch_cap) {
        free(e->txscratch);
        e->txscratch = malloc(need);
        if (!e->txscratch) abort();
        e->txscratch_cap = need;
    }
    return e->txscratch;
}

static void send_held(struct nic *e)
{
    struct nic_faults *F = &e->faults;
    for (int i = 0; i < F->nheld; i++) {
        use_path(e, F->held[i].tclass, F->held[i].hop_limit);
        sendto_raw(e, F->held[i].data, F->held[i].len, &F->held[i].to, F->held[i].tolen);
        free(F->held[i].data);
    }
    F->nheld = 0;
}

static void apply_faults_and_send(struct nic *e, uint8_t *d, size_t n, const struct flow *f,
                                  const struct sockaddr_storage *to, socklen_t tolen)
{
    struct nic_faults *F = &e->faults;
    if (F->has_filter && e->hooks.filter && !e->hooks.filter(e->hooks.ctx, d, n)) {
        F->dropped++;
        return;
    }
    if (rng_double(&F->rng) < F->drop) {
        F->dropped++;
        return;
    }
    int copies = 1;
    if (rng_double(&F->rng) < F->duplicate) {
        F->duplicated++;
        copies = 2;
    }
    if (rng_double(&F->rng) < F->reorder && F->nheld == 0) {
        F->reordered++;
        for (int i = 0; i < copies; i++) {
            uint8_t *c = malloc(n);
            if (!c) return;
            memcpy(c, d, n);
            F->held[i] = (struct held_dgram){c, n, *to, tolen, f->tclass, f->hop_limit};
        }
        F->nheld = copies;
        return;
    }
    use_path(e, f->tclass, f->hop_limit);
    for (int i = 0; i < copies; i++) sendto_raw(e, d, n, to, tolen);
    send_held(e);
}

static void flush_held(struct nic *e) { send_held(e); }

/* one datagram at a time: faults, capture, tracer (the Python engine's slow path) */
static void txb_flush(struct nic *e);

static void send_slow(struct nic *e, struct nic_qp *q, struct rc_out *o)
{
    txb_flush(e); /* (empty: faults, tracing and pcap change only between passes) */
    uint8_t *buf = malloc(RX_BUF + 64);
    if (!buf) return;
    for (size_t i = 0; i < o->n; i++) {
        const struct pkt *p = &o->pkts[i];
        size_t n = wire_encode(p, &q->txflow, q->txflow.ip_id, buf);
        if (e->pcap_fd >= 0) {
            struct iovec v = {buf, n};
            pcap_write(e, &v, 1, &q->txflow, q->txflow.ip_id);
        }
        if (e->tracing && e->hooks.trace_datagram)
            e->hooks.trace_datagram(e->hooks.ctx, "udp_send", q->rc->qp_num, buf, n, &q->txflow);
        if (e->faults.on)
            apply_faults_and_send(e, buf, n, &q->txflow, &q->peer, q->peer_len);
        else {
            use_path(e, q->txflow.tclass, q->txflow.hop_limit);
            sendto_raw(e, buf, n, &q->peer, q->peer_len);
        }
    }
    free(buf);
}

/* 1: sent (or dropped/failed and counted); 0: the kernel refused GSO (turned off) */
static int send_gso(struct nic *e, struct nic_qp *q, struct enc *en, size_t count, size_t seg)
{
    struct iovec iov[GSO_MAX_SEGMENTS * 3];
    int n = 0;
    for (size_t i = 0; i < count; i++)
        for (int k = 0; k < en[i].niov; k++) iov[n++] = en[i].iov[k];
    char cbuf[CMSG_SPACE(sizeof(uint16_t))];
    memset(cbuf, 0, sizeof cbuf);
    struct msghdr m = {0};
    m.msg_name = &q->peer;
    m.msg_namelen = q->peer_len;
    m.msg_iov = iov;
    m.msg_iovlen = (size_t)n;
    m.msg_control = cbuf;
    m.msg_controllen = sizeof cbuf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_UDP;
    c->cmsg_type = UDP_SEGMENT;
    c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
    uint16_t s = (uint16_t)seg;
    memcpy(CMSG_DATA(c), &s, sizeof s);
    e->counters[NC_TX_SYSCALLS]++;
    ssize_t sent = sendmsg(e->sock, &m, 0);
    if (sent < 0) {
        int err = errno;
        if (err == EINVAL || err == EIO || err == ENOPROTOOPT || err == EOPNOTSUPP || err == EMSGSIZE) {
            e->gso = 0;
            return 0;
        }
        count_send_error(e, err, count);
        return 1;
    }
    e->counters[NC_TX_PACKETS] += count;
    e->counters[NC_TX_BYTES] += (uint64_t)sent;
    e->counters[NC_TX_GSO_SENDS]++;
    return 1;
}

static void send_mmsg(struct nic *e, struct nic_qp *q, struct enc *en, size_t count)
{
    struct mmsghdr mm[64];
    size_t i = 0;
    while (i < count) {
        size_t k = count - i < 64 ? count - i : 64;
        for (size_t j = 0; j < k; j++) {
            memset(&mm[j], 0, sizeof mm[j]);
            mm[j].msg_hdr.msg_name = &q->peer;
            mm[j].msg_hdr.msg_namelen = q->peer_len;
            mm[j].msg_hdr.msg_iov = en[i + j].iov;
            mm[j].msg_hdr.msg_iovlen = (size_t)en[i + j].niov;
        }
        e->counters[NC_TX_SYSCALLS]++;
        int r = sendmmsg(e->sock, mm, (unsigned)k, 0);
        if (r < 0) {
            count_send_error(e, errno, 1);
            r = 1; /* skip the datagram that failed */
        } else {
            e->counters[NC_TX_PACKETS] += (uint64_t)r;
            for (int j = 0; j < r; j++) e->counters[NC_TX_BYTES] += mm[j].msg_len;
            if ((size_t)r < k) { /* the next one failed: count it and go on after it */
                e->counters[NC_TX_SYSCALLS]++;
                ssize_t x = sendmsg(e->sock, &mm[r].msg_hdr, 0);
                if (x < 0)
                    count_send_error(e, errno, 1);
                else {
                    e->counters[NC_TX_PACKETS]++;
                    e->counters[NC_TX_BYTES] += (uint64_t)x;
                }
                r++;
            }
        }
        i += (size_t)r;
    }
}

/* ------------------------------------------------ cross-QP small batch ---- */

#define TXB_SLOTS 64
#define TXB_MAX 256 /* datagrams up to this long wait for the end of the pass */

struct txb_slot {
    uint8_t buf[TXB_MAX];
    size_t len;
    struct sockaddr_storage to;
    socklen_t tolen;
    struct flow flow; /* (its ICRC is made again for another IP ID when it leaves in a GSO run) */
};

/* sendmmsg slots [from, to) of the batch, one datagram each */
static void txb_send_mmsg(struct nic *e, int from, int to)
{
    struct mmsghdr mm[TXB_SLOTS];
    struct iovec iov[TXB_SLOTS];
    int n = 0;
    for (int i = from; i < to; i++, n++) {
        iov[n] = (struct iovec){e->txb[i].buf, e->txb[i].len};
        memset(&mm[n], 0, sizeof mm[n]);
        mm[n].msg_hdr.msg_name = &e->txb[i].to;
        mm[n].msg_hdr.msg_namelen = e->txb[i].tolen;
        mm[n].msg_hdr.msg_iov = &iov[n];
        mm[n].msg_hdr.msg_iovlen = 1;
    }
    int i = 0;
    while (i < n && e->sock >= 0) {
        e->counters[NC_TX_SYSCALLS]++;
        int r = sendmmsg(e->sock, mm + i, (unsigned)(n - i), 0);
        if (r < 0) { /* the first one failed: count it and go on after it */
            count_send_error(e, errno, 1);
            i++;
            continue;
        }
        e->counters[NC_TX_PACKETS] += (uint64_t)r;
        for (int j = 0; j < r; j++) e->counters[NC_TX_BYTES] += mm[i + j].msg_len;
        i += r;
    }
    if (i < n) e->counters[NC_TX_ERRORS] += (uint64_t)(n - i); /* the socket was closed */
}

/* slots [from, to), equal-size datagrams to one peer (the last may be shorter), as one
 * UDP GSO send: segment k's ICRC made again for IP ID k (what the kernel gives it, and
 * what a receiver's ICRC check finds); 0 when the kernel refused GSO (turned off) */
static int txb_send_gso(struct nic *e, int from, int to)
{
    struct iovec iov[TXB_SLOTS];
    size_t seg = e->txb[from].len, total = 0;
    int n = 0;
    for (int i = from; i < to; i++, n++) {
        struct txb_slot *s = &e->txb[i];
        if (!s->flow.ipv6) {
            struct iovec body = {s->buf, s->len - ICRC_LEN};
            put_le32(s->buf + s->len - ICRC_LEN, wire_icrc(&s->flow, (uint16_t)n, &body, 1, s->len));
        }
        iov[n] = (struct iovec){s->buf, s->len};
        total += s->len;
    }
    char cbuf[CMSG_SPACE(sizeof(uint16_t))];
    memset(cbuf, 0, sizeof cbuf);
    struct msghdr m = {0};
    m.msg_name = &e->txb[from].to;
    m.msg_namelen = e->txb[from].tolen;
    m.msg_iov = iov;
    m.msg_iovlen = (size_t)n;
    m.msg_control = cbuf;
    m.msg_controllen = sizeof cbuf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_UDP;
    c->cmsg_type = UDP_SEGMENT;
    c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
    uint16_t sz = (uint16_t)seg;
    memcpy(CMSG_DATA(c), &sz, sizeof sz);
    e->counters[NC_TX_SYSCALLS]++;
    ssize_t sent = sendmsg(e->sock, &m, 0);
    if (sent < 0) {
        int err = errno;
        if (err == EINVAL || err == EIO || err == ENOPROTOOPT || err == EOPNOTSUPP || err == EMSGSIZE) {
            e->gso = 0;
            /* (their ICRCs back to the plain IP ID for the datagrams that follow) */
            for (int i = from; i < to; i++) {
                struct txb_slot *s = &e->txb[i];
                struct iovec body = {s->buf, s->len - ICRC_LEN};
                put_le32(s->buf + s->len - ICRC_LEN, wire_icrc(&s->flow, s->flow.ip_id, &body, 1, s->len));
            }
            return 0;
        }
        count_send_error(e, err, (size_t)n);
        return 1;
    }
    e->counters[NC_TX_PACKETS] += (uint64_t)n;
    e->counters[NC_TX_BYTES] += (uint64_t)sent;
    e->counters[NC_TX_GSO_SENDS]++;
    (void)total;
    return 1;
}

/* send what the pass batched, in the order it was batched: runs of equal-size datagrams
 * to one peer (a pass's requests or responses to the connections of one peer device)
 * as one UDP GSO send each, so the kernel takes them through its stack once, not once
 * per datagram; the rest with sendmmsg */
static void txb_flush(struct nic *e)
{
    int n = e->ntxb;
    if (!n) return;
    e->ntxb = 0;
    use_path(e, e->txb_tclass, e->txb_hop_limit);
    int i = 0, plain = 0; /* slots [plain, i) wait for one sendmmsg */
    int gso = n > 1 && gso_on(e); /* (a lone datagram needs no look at captures) */
    while (i < n) {
        int j = i + 1;
        if (gso) {
            const struct txb_slot *a = &e->txb[i];
            size_t total = a->len;
            while (j < n && j - i < GSO_MAX_SEGMENTS) {
                const struct txb_slot *b = &e->txb[j];
                if (b->len > a->len || total + b->len > GSO_MAX_BYTES || b->tolen != a->tolen ||
                    memcmp(&b->to, &a->to, a->tolen) != 0 || b->flow.ipv6 != a->flow.ipv6)
                    break;
                total += b->len;
                j++;
                if (b->len < a->len) break; /* a shorter datagram ends the run */
            }
        }
        if (j - i > 1) {
            if (plain < i) txb_send_mmsg(e, plain, i);
            if (!txb_send_gso(e, i, j)) txb_send_mmsg(e, i, j);
            plain = j;
        }
        i = j;
    }
    if (plain < n) txb_send_mmsg(e, plain, n);
}

/* 1: every packet of o was small and is batched */
static int txb_add(struct nic *e, struct nic_qp *q, struct rc_out *o)
{
    for (size_t i = 0; i < o->n; i++)
        if (wire_datagram_length(&o->pkts[i]) > TXB_MAX) return 0;
    if (!e->txb) {
        e->txb = malloc(TXB_SLOTS * sizeof *e->txb);
        if (!e->txb) abort();
    }
    /* one sendmmsg carries one traffic class and hop limit */
    if (e->ntxb && (q->txflow.tclass != e->txb_tclass || q->txflow.hop_limit != e->txb_hop_limit)) txb_flush(e);
    e->txb_tclass = q->txflow.tclass;
    e->txb_hop_limit = q->txflow.hop_limit;
    /* The QP's plain ACKs (its responder's) go after its requests: the two are separate
     * streams at the peer (its requester takes the ACKs, its responder the requests), and
     * a SEND followed by the shorter ACK makes a GSO run of two (txb_flush): a ping-pong's
     * reply and the ACK of the request it answers leave as one datagram for the kernel. */
    for (int pass = 0; pass < 2; pass++) {
        for (size_t i = 0; i < o->n; i++) {
            if ((o->pkts[i].opcode == OP_ACKNOWLEDGE) != (pass == 1)) continue;
            if (e->ntxb == TXB_SLOTS) txb_flush(e);
            struct txb_slot *s = &e->txb[e->ntxb++];
            s->len = wire_encode(&o->pkts[i], &q->txflow, q->txflow.ip_id, s->buf);
            s->flow = q->txflow;
            memcpy(&s->to, &q->peer, q->peer_len);
            s->tolen = q->peer_len;
        }
    }
    return 1;
}

/* from here to txb_end, small datagrams wait for one sendmmsg (lock held) */
static void txb_begin(struct nic *e)
{
    e->tx_batching = 1;
}

static void txb_end(struct nic *e)
{
    e->tx_batching = 0;
    txb_flush(e);
}

/* ------------------------------------------- delivery within the process ---- */

static void local_due(struct nic *e, struct nic_qp *q)
{
    if (!q->local_due) {
        q->local_due = 1;
        q->next_local = e->local_due;
        e->local_due = q;
    }
}

/* Hand q's packets to their queue pair on this NIC, in memory: what the peer's
 * receive would do with them (headers decoded as from the wire, the QP found, its
 * source checked, the RC receive, which places the payload straight from where it
 * lies: one copy, no socket, no ICRC: nothing crosses a wire or a process), without
 * the copies into and out of the kernel. The receiving QPs transmit (ACKs, READ
 * responses) before nic_flush returns (local_drain). */
static void deliver_local(struct nic *e, struct nic_qp *q, struct rc_out *o, double now)
{
    uint64_t *c = e->counters;
    for (size_t i = 0; i < o->n; i++) {
        const struct pkt *p = &o->pkts[i];
        uint8_t hdr[MAX_HDR_LEN];
        size_t h = wire_pack_headers(p, hdr);
        size_t n = wire_datagram_length(p);
        uint32_t plen = (wire_layout[p->opcode] & L_PAYLOAD) ? p->plen : 0;
        c[NC_TX_PACKETS]++;
        c[NC_TX_BYTES] += n;
        c[NC_TX_LOCAL]++;
        c[NC_RX_PACKETS]++;
        c[NC_RX_BYTES] += n;
        struct pkt r;
        int err = wire_decode_parts(hdr, h, p->payload, plen, &r);
        if (err) { /* (cannot happen: the headers are this engine's own) */
            c[NC_RX_MALFORMED]++;
            c[NC_RX_MALFORMED_TRUNCATED - 1 - err]++;
            continue;
        }
        struct nic_qp *d = nic_qp_find(e, r.dest_qp);
        if (!d) {
            c[NC_RX_UNKNOWN_QP]++;
            continue;
        }
        if (!d->has_peer || !d->local_peer) { /* its peer is elsewhere: not from us */
            c[NC_RX_WRONG_SOURCE]++;
            continue;
        }
        rc_receive(d->rc, &r, now);
        local_due(e, d);
    }
}

static void send_packets(struct nic *e, struct nic_qp *q, struct rc_out *o, double now)
{
    if (!o->n || !q->has_peer || e->sock < 0) return;
    if (e->faults.on || e->pcap_fd >= 0 || e->tracing) {
        send_slow(e, q, o);
        return;
    }
    if (q->local_peer && e->local_delivery) {
        deliver_local(e, q, o, now);
        return;
    }
    if (q->link_tx && nic_shm_send(e, q, o)) return;
    if (e->tx_batching && txb_add(e, q, o)) return;
    txb_flush(e); /* what was batched leaves first: the wire keeps the order of the pass */
    use_path(e, q->txflow.tclass, q->txflow.hop_limit);
    uint8_t *scratch = scratch_for(e, o->n);
    struct enc *en = malloc(o->n * sizeof *en);
    if (!en) abort();
    const struct flow *f = &q->txflow;
    if (o->n == 1) {
        encode_iov(&o->pkts[0], f, f->ip_id, scratch, &en[0], q->skip_icrc);
        send_mmsg(e, q, en, 1);
        free(en);
        return;
    }
    /* runs of equal-size datagrams (the last of a run may be shorter) go in one UDP
     * GSO send each, segment i encoded for IP ID i (IPv6: no ID); the others are
     * sent together with one sendmmsg, in order */
    size_t i = 0, n = o->n, npend = 0, pend_bytes = 0;
    int gso = -1; /* looked up once, when a run could use it */
    struct enc *pend = malloc(n * sizeof *pend);
    if (!pend) abort();
    while (i < n) {
        size_t seg = wire_datagram_length(&o->pkts[i]);
        size_t j = i + 1, total = seg;
        /* GSO pays off for runs of full-size packets; small ones (ACKs, atomic and
         * short READ responses, small messages) all go in the one sendmmsg */
        if (seg >= GSO_MIN_SEGMENT && (gso < 0 ? (gso = gso_on(e)) : gso)) {
            while (j < n && j - i < GSO_MAX_SEGMENTS) {
                size_t sz = wire_datagram_length(&o->pkts[j]);
                if (sz > seg || total + sz > GSO_MAX_BYTES) break;
                total += sz;
                j++;
                if (sz < seg) break; /* a shorter datagram ends the run */
            }
        }
        if (j - i > 1) {
            if (npend) {
                send_mmsg(e, q, pend, npend);
                npend = 0;
            }
            for (size_t k = i; k < j; k++)
                encode_iov(&o->pkts[k], f, f->ipv6 ? f->ip_id : (uint16_t)(k - i), scratch + k * SCRATCH_PER_PKT,
                           &en[k], q->skip_icrc);
            if (!send_gso(e, q, en + i, j - i, seg)) { /* refused: one datagram each, with the plain IP ID */
                for (size_t k = i; k < j; k++)
                    encode_iov(&o->pkts[k], f, f->ip_id, scratch + k * SCRATCH_PER_PKT, &en[k], q->skip_icrc);
                send_mmsg(e, q, en + i, j - i);
            }
        } else {
            encode_iov(&o->pkts[i], f, f->ip_id, scratch + i * SCRATCH_PER_PKT, &pend[npend], q->skip_icrc);
            pend_bytes += pend[npend++].len;
            if (pend_bytes >= TX_HOT_BYTES) {
                /* the payloads just read for their ICRCs leave while they are still in the
                 * cache: the kernel's copy then reads them from there, not from memory again
                 * (a READ response of megabytes, from a region the CPU has not touched lately) */
                send_mmsg(e, q, pend, npend);
                npend = 0;
                pend_bytes = 0;
            }
        }
        i = j;
    }
    if (npend) send_mmsg(e, q, pend, npend);
    free(pend);
    free(en);
}

static void deliver(struct nic *e, struct nic_qp *q)
{
    struct rc_qp *rc = q->rc;
    for (size_t i = 0; i < rc->nwcs; i++) {
        struct rc_wc *w = &rc->wcs[i];
        struct nic_cq *cq = w->is_recv ? q->rcq : q->scq;
        if (e->tracing && e->hooks.trace_cqe) e->hooks.trace_cqe(e->hooks.ctx, w);
        if (cq_push(cq, w)) {
            e->fire = grow(e->fire, &e->fire_cap, e->nfire + 1, sizeof *e->fire);
            atomic_fetch_add(&cq->refcnt, 1);
            e->fire[e->nfire++] = cq;
        }
    }
    rc->nwcs = 0;
}

static void flush_one(struct nic *e, struct nic_qp *q, double now)
{
    struct rc_out *o = &e->out;
    q->since_flush = 0;
    o->n = 0;
    rc_transmit(q->rc, now, o);
    /* CQEs first: once the peer sees our ACK it may tell the application and the
     * completion must already be in the CQ */
    deliver(e, q);
    send_packets(e, q, o, now);
    rc_out_clear(o);
}

/* the QPs that received in memory transmit in turn (their answers may make others
 * due), until none is due: the list is empty again before the lock is released */
static void local_drain(struct nic *e)
{
    e->local_draining = 1;
    while (e->local_due) {
        struct nic_qp *q = e->local_due;
        e->local_due = q->next_local;
        q->next_local = NULL;
        q->local_due = 0;
        /* (the time read again: moving a long message takes a while, and the
         * transport's timers count from now) */
        double now = nic_now();
        flush_one(e, q, now);
        nic_timer_armed(e, rc_next_timer(q->rc));
    }
    e->local_draining = 0;
}

void nic_flush(struct nic *e, struct nic_qp *q, double now)
{
    flush_one(e, q, now);
    if (e->local_due && !e->local_draining) local_drain(e);
}

void nic_timer_armed(struct nic *e, double deadline)
{
    if (deadline >= 0 && (e->wait_deadline < 0 || deadline < e->wait_deadline)) nic_wake(e);
}

int nic_set_gro(struct nic *e, int on)
{
    int v = on ? 1 : 0;
    if (e->sock < 0) return 0;
    if (setsockopt(e->sock, SOL_UDP, UDP_GRO, &v, sizeof v) < 0) v = 0; /* an old kernel: plain datagrams */
    e->gro = v;
    return v;
}

int nic_gso_send_probe(struct nic *e, size_t seg, int count)
{
    /* two oversized segments to a discard port: the kernel refuses the GSO send */
    struct nic_qp fake;
    memset(&fake, 0, sizeof fake);
    struct sockaddr_in *a = (struct sockaddr_in *)&fake.peer;
    a->sin_family = AF_INET;
    a->sin_port = htons(9);
    a->sin_addr.s_addr = htonl(0x7F000001);
    fake.peer_len = sizeof *a;
    uint8_t *buf = calloc(1, seg);
    struct enc en[2];
    for (int i = 0; i < count && i < 2; i++) {
        en[i].iov[0] = (struct iovec){buf, seg};
        en[i].niov = 1;
        en[i].len = seg;
    }
    int r = send_gso(e, &fake, en, (size_t)(count < 2 ? count : 2), seg);
    free(buf);
    return r;
}

/* ------------------------------------------------------- loop hand-off ---- */

/* the socket, and the shared-memory links' eventfd with it, go to the loop's epoll
 * set (to_loop) or back to the NIC thread's */
static void give_socket(struct nic *e, int to_loop)
{
    int fds[2] = {e->sock, e->shm_wakefd};
    for (int i = 0; i < 2; i++) {
        if (fds[i] < 0) continue;
        struct epoll_event ev = {.events = EPOLLIN, .data.fd = fds[i]};
        epoll_ctl(to_loop ? e->nic_ep : e->loop_ep, EPOLL_CTL_DEL, fds[i], NULL);
        epoll_ctl(to_loop ? e->loop_ep : e->nic_ep, EPOLL_CTL_ADD, fds[i], &ev);
    }
    if (to_loop) {
        e->counters[NC_LOOP_HANDOFFS]++;
        nic_shm_thread_poll_stop(e); /* (the links' wake-ups are the loop's now) */
    }
    e->loop_owns = to_loop;
}

int nic_loop_attach(struct nic *e)
{
    if (e->sock < 0 || e->loop_ep < 0) return -1;
    e->loop_attached = 1;
    return e->loop_ep;
}

void nic_loop_detach(struct nic *e)
{
    if (e->loop_owns && e->sock >= 0) give_socket(e, 0);
    e->loop_attached = 0;
    e->window_deadline = -1.0;
}

void nic_expect(struct nic *e, double now)
{
    if (!e->loop_attached || e->sock < 0) return;
    e->window_deadline = now + e->window_len;
    if (!e->loop_owns) {
        give_socket(e, 1);
        /* the NIC thread must wake up at the window's end to take the socket back */
        if (e->wait_deadline < 0 || e->window_deadline < e->wait_deadline) nic_wake(e);
    }
}

void nic_defer_flush(struct nic *e, struct nic_qp *q)
{
    if (q->deferred) return;
    q->deferred = 1; /* (cleared by nic_flush_deferred) */
    e->deferred = grow(e->deferred, &e->deferred_cap, e->ndeferred + 1, sizeof *e->deferred);
    e->deferred[e->ndeferred++] = q->rc->qp_num;
}

static void deliver(struct nic *e, struct nic_qp *q);

/* ------------------------------------------------------------- receive ---- */

void nic_touch(struct nic *e, struct nic_qp *q)
{
    if (!q->touched) {
        q->touched = 1;
        q->next_touched = e->touched;
        e->touched = q;
    }
}

/* Two IP addresses as a flow holds them (4 bytes, or 16 with IPv6), compared inline:
 * libc's memcmp takes a longer path where an operand lies near a page's end, so the
 * instructions a received datagram costs moved with where the stack and the QP
 * happened to lie (the target's count of a 64 B Write by 0.8 %, from one run to the
 * next: the callgrind budgets are 2 %). */
static inline int same_addr(const uint8_t *a, const uint8_t *b, int ipv6)
{
    if (!ipv6) {
        uint32_t x, y;
        memcpy(&x, a, 4);
        memcpy(&y, b, 4);
        return x == y;
    }
    uint64_t x0, x1, y0, y1;
    memcpy(&x0, a, 8);
    memcpy(&x1, a + 8, 8);
    memcpy(&y0, b, 8);
    memcpy(&y1, b + 8, 8);
    return x0 == y0 && x1 == y1;
}

void nic_receive_one(struct nic *e, const uint8_t *d, size_t n, const struct sockaddr_storage *src, double now,
                     unsigned index)
{
    uint64_t *c = e->counters;
    c[NC_RX_PACKETS]++;
    c[NC_RX_BYTES] += n;
    struct pkt p;
    int err = wire_decode(d, n, &p);
    if (err) {
        c[NC_RX_MALFORMED]++;
        c[NC_RX_MALFORMED_TRUNCATED - 1 - err]++; /* -1 .. -4 -> truncated .. bad_length */
        return;
    }
    struct flow f = e->local;
    memcpy(f.dst, e->local.src, 16);
    f.dport = e->port;
    memset(f.src, 0, 16);
    if (src->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)src;
        memcpy(f.src, &a->sin6_addr, 16);
        f.sport = ntohs(a->sin6_port);
    } else {
        const struct sockaddr_in *a = (const struct sockaddr_in *)src;
        memcpy(f.src, &a->sin_addr, 4);
        f.sport = ntohs(a->sin_port);
    }
    /* the ID the sender's ICRC was made for: a soft sender numbers a GSO batch's
     * segments 0, 1, 2, ... as the kernel does when it cuts one (gso.py) */
    f.ip_id = (uint16_t)index;
    int ip_id = f.ip_id;
    /* the queue pair first: one whose peer agreed to leave the ICRC out (two soft
     * devices on loopback) takes that peer's datagrams unchecked */
    struct nic_qp *q = nic_qp_find(e, p.dest_qp);
    int from_peer = q && q->has_peer && same_addr(f.src, q->txflow.dst, e->ipv6) &&
                    f.sport == q->txflow.dport;
    if (q && q->skip_icrc && from_peer) {
        c[NC_RX_ICRC_SKIPPED]++;
    } else if (e->icrc_policy == ICRC_OFF) {
        c[NC_RX_ICRC_UNCHECKED]++;
    } else {
        ip_id = wire_icrc_ip_id(d, n, &f);
        if (ip_id < 0) {
            c[NC_RX_ICRC_ERRORS]++;
            return;
        }
        if (ip_id != f.ip_id) {
            if (e->icrc_policy == ICRC_STRICT && ip_id > STRICT_MAX_IP_ID) {
                c[NC_RX_ICRC_ERRORS]++;
                c[NC_RX_ICRC_IP_ID_OUT_OF_RANGE]++;
                return;
            }
            c[NC_RX_ICRC_IP_ID_INFERRED]++;
        }
    }
    if (e->pcap_fd >= 0) {
        struct iovec v = {(void *)d, n};
        pcap_write(e, &v, 1, &f, (uint16_t)ip_id);
    }
    if (!q) {
        c[NC_RX_UNKNOWN_QP]++;
        return;
    }
    if (q->has_peer && !same_addr(f.src, q->txflow.dst, e->ipv6)) {
        c[NC_RX_WRONG_SOURCE]++;
        return;
    }
    if (e->tracing && e->hooks.trace_datagram) {
        struct flow tf = f;
        tf.ip_id = (uint16_t)ip_id;
        e->hooks.trace_datagram(e->hooks.ctx, "udp_recv", q->rc->qp_num, d, n, &tf);
    }
    rc_receive(q->rc, &p, now);
    if (op_is_request(p.opcode) && ++q->since_flush >= ACK_EVERY && !q->deferred) {
        /* a long batch of requests: acknowledge part of it now, so the requester can
         * post more while the rest is being placed */
        nic_flush(e, q, now);
        return;
    }
    nic_touch(e, q);
}

/* the segment size of a coalesced datagram (UDP_GRO), 0 for a plain one */
static size_t gro_segment(const struct msghdr *h)
{
    for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c; c = CMSG_NXTHDR((struct msghdr *)h, c)) {
        if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO && c->cmsg_len >= CMSG_LEN(sizeof(int))) {
            int seg;
            memcpy(&seg, CMSG_DATA(c), sizeof seg);
            return seg > 0 ? (size_t)seg : 0;
        }
    }
    return 0;
}


/* a coalesced datagram is at most one UDP payload (the kernel coalesces no more) */
_Static_assert(RX_BUF >= 65535, "RX_BUF must hold the largest UDP datagram");

/* receive up to max datagrams; 1 when the socket's queue was emptied */
/* (the engine lock is held) make the message headers of every entry, once, or again
 * when GRO was switched: a recvmmsg call writes only msg_len, msg_namelen,
 * msg_controllen and msg_flags, and only in the entries it filled */
static void rx_prepare(struct nic *e)
{
    struct rx_hdrs *h = e->rx;
    for (int i = 0; i < RX_BATCH; i++) {
        h->iov[i] = (struct iovec){e->rxbufs + (size_t)i * RX_BUF, RX_BUF};
        memset(&h->mm[i], 0, sizeof h->mm[i]);
        h->mm[i].msg_hdr.msg_name = &h->src[i];
        h->mm[i].msg_hdr.msg_namelen = sizeof h->src[i];
        h->mm[i].msg_hdr.msg_iov = &h->iov[i];
        h->mm[i].msg_hdr.msg_iovlen = 1;
        if (e->gro) {
            h->mm[i].msg_hdr.msg_control = h->cbuf[i].buf;
            h->mm[i].msg_hdr.msg_controllen = sizeof h->cbuf[i].buf;
        }
    }
    h->ready = 1;
    h->gro = e->gro;
}

static int receive_batch(struct nic *e, double now, int max)
{
    int drained = 0;
    {
        struct rx_hdrs *h = e->rx;
        if (!h->ready || h->gro != e->gro) rx_prepare(e);
        struct mmsghdr *mm = h->mm;
        struct iovec *iov = h->iov;
        struct sockaddr_storage *src = h->src;
        int total = 0;
        while (total < max) {
            int want = e->rx_batch < max - total ? e->rx_batch : max - total;
            e->counters[NC_RX_SYSCALLS]++;
            int r = recvmmsg(e->sock, mm, (unsigned)want, MSG_DONTWAIT, NULL);
            if (r < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                    drained = 1;
                else
                    e->counters[NC_RX_ERRORS]++;
                break;
            }
            for (int i = 0; i < r; i++) {
                if (mm[i].msg_hdr.msg_flags & MSG_TRUNC) { /* longer than any RoCEv2 datagram we accept */
                    e->counters[NC_RX_PACKETS]++;
                    e->counters[NC_RX_MALFORMED]++;
                    e->counters[NC_RX_MALFORMED_BAD_LENGTH]++;
                    continue;
                }
                if (e->gro && (mm[i].msg_hdr.msg_flags & MSG_CTRUNC)) {
                    /* the segment size may be lost: it cannot be split safely */
                    e->counters[NC_RX_ERRORS]++;
                    continue;
                }
                const uint8_t *d = iov[i].iov_base;
                size_t n = mm[i].msg_len;
                size_t seg = e->gro ? gro_segment(&mm[i].msg_hdr) : 0;
                if (seg && seg < n) {
                    /* coalesced by the kernel: equal-size datagrams of one sender, the
                     * last may be shorter; each is a packet of its own (and counts
                     * against this call's budget) */
                    e->counters[NC_RX_GRO_DATAGRAMS]++;
                    unsigned k = 0;
                    for (size_t off = 0; off < n; off += seg)
                        nic_receive_one(e, d + off, n - off < seg ? n - off : seg, &src[i], now, k++);
                    total += (int)((n + seg - 1) / seg) - 1;
                } else {
                    nic_receive_one(e, d, n, &src[i], now, 0);
                }
            }
            /* the entries this call wrote back as rx_prepare made them */
            for (int i = 0; i < r; i++) {
                mm[i].msg_hdr.msg_namelen = sizeof src[i];
                mm[i].msg_hdr.msg_flags = 0;
                if (h->gro) mm[i].msg_hdr.msg_controllen = sizeof h->cbuf[i].buf;
            }
            total += r;
            /* Large datagrams (READ responses, long messages): fewer per system call, so
             * what the kernel just copied in is still in the cache when its ICRC is checked
             * and its payload placed, rather than read back from memory */
            size_t got = 0;
            for (int i = 0; i < r; i++) got += mm[i].msg_len;
            e->rx_batch = r && got / (size_t)r > RX_HOT_BYTES / RX_HOT_DGRAMS ? RX_HOT_DGRAMS : RX_BATCH;
            if (r < want) { /* the queue is empty (a short batch) */
                drained = 1;
                break;
            }
        }
    }
    return drained;
}

int nic_loop_receive(struct nic *e, double now, int socket)
{
    if (atomic_load(&e->closing) || e->sock < 0) return 0;
    e->counters[NC_LOOP_SERVICES]++;
    if (socket) receive_batch(e, now, 256);
    if (e->links) nic_shm_receive(e, now);
    int n = 0;
    while (e->touched) {
        struct nic_qp *q = e->touched;
        e->touched = q->next_touched;
        q->touched = 0;
        deliver(e, q);
        nic_defer_flush(e, q);
        n++;
    }
    return n;
}

void nic_flush_deferred(struct nic *e, double now)
{
    txb_begin(e);
    for (size_t i = 0; i < e->ndeferred; i++) {
        struct nic_qp *q = nic_qp_find(e, e->deferred[i]);
        if (q) {
            q->deferred = 0;
            nic_flush(e, q, now);
            /* an ACK received on the loop may have let more requests out: their
             * retransmit timer must not wait for the NIC thread's tick */
            nic_timer_armed(e, rc_next_timer(q->rc));
        }
    }
    e->ndeferred = 0;
    txb_end(e);
    if (e->faults.nheld) flush_held(e);
}

static int timeout_ms_locked(struct nic *e, double now);

/* what nic_service does; *passive (if not NULL) says whether it received packets and
 * handed nothing to a loop: the NIC thread served a peer's one-sided requests */
static int service(struct nic *e, int readable, int *passive)
{
    nic_lock(e);
    if (passive) *passive = 0;
    if (atomic_load(&e->closing) || e->sock < 0) {
        nic_unlock(e);
        return -1;
    }
    double now = nic_now();
    int drained = 1;
    uint64_t rx_before = e->counters[NC_RX_PACKETS], rxb_before = e->counters[NC_RX_BYTES];
    if (readable) drained = receive_batch(e, now, 256);
    if (e->loop_owns && e->window_deadline >= 0 && now >= e->window_deadline) {
        /* the window passed: the NIC thread takes the socket back (and serves what
         * waits on it: the loop may be busy) */
        give_socket(e, 0);
        if (!readable) drained = receive_batch(e, now, 256);
    }
    if (e->shm_polling && now - e->shm_poll_seen >= SHM_POLL_STALL) {
        /* the loop polls no more (a blocked or stopped loop): its producers kick this
         * thread from now on, so a peer's requests are served whatever the loop does */
        nic_shm_set_polling(e, 0);
    }
    /* the links' packets, as the socket's, are the loop's while it owns the wake-ups
     * (a timer that wakes this thread meanwhile must not take the loop's completions) */
    if (e->links && !e->loop_owns) nic_shm_receive(e, now);
    if (drained)
        e->undrained_since = -1.0;
    else if (e->undrained_since < 0)
        e->undrained_since = now;
    txb_begin(e);
    if (drained || now - e->undrained_since >= MAX_TIMER_LAG) {
        for (struct nic_qp *q = e->all; q; q = q->next) {
            double t = rc_next_timer(q->rc);
            if (t >= 0 && t <= now) {
                rc_on_timer(q->rc, now);
                nic_touch(e, q);
            }
        }
    }
    while (e->touched) {
        struct nic_qp *q = e->touched;
        e->touched = q->next_touched;
        q->touched = 0;
        nic_flush(e, q, now);
    }
    txb_end(e);
    if (e->faults.nheld) flush_held(e);
    int timeout = timeout_ms_locked(e, nic_now());
    if (passive) {
        /* a peer's small requests (READs, atomics, short WRITEs) served, nothing handed to a
         * loop: the poll window opens (see poll_window) */
        uint64_t got = e->counters[NC_RX_PACKETS] - rx_before;
        *passive = got && !e->nfire && !e->loop_owns &&
                   e->counters[NC_RX_BYTES] - rxb_before <= got * NIC_POLL_MAX_DATAGRAM;
    }
    nic_unlock(e);
    nic_fire_events(e);
    return timeout;
}

int nic_service(struct nic *e, int readable)
{
    return service(e, readable, NULL);
}

/* how long the NIC thread may sleep (lock held): until the earliest transport timer,
 * the end of the expect window, or the tick */
static int timeout_ms_locked(struct nic *e, double now)
{
    double earliest = -1.0;
    for (struct nic_qp *q = e->all; q; q = q->next) {
        double t = rc_next_timer(q->rc);
        if (t >= 0 && (earliest < 0 || t < earliest)) earliest = t;
    }
    if (e->loop_owns && e->window_deadline >= 0 && (earliest < 0 || e->window_deadline < earliest))
        earliest = e->window_deadline;
    if (e->nqps && (earliest < 0 || now + NIC_TICK < earliest)) earliest = now + NIC_TICK;
    if (e->shm_polling) {
        double stall = e->shm_poll_seen + SHM_POLL_STALL;
        if (earliest < 0 || stall < earliest) earliest = stall;
    }
    /* published under the lock: a post that arms an earlier timer after this sees
     * the deadline the thread is about to sleep until and wakes it */
    e->wait_deadline = earliest;
    if (e->faults.nheld) return 1;
    if (earliest < 0) return -1;
    double ms = (earliest - now) * 1000.0;
    return ms <= 0 ? 0 : (int)ms + 1;
}

/* 1 if the socket was among the r events (the wake-up eventfd is consumed) */
static int take_events(struct nic *e, const struct epoll_event *evs, int r)
{
    int readable = 0;
    for (int i = 0; i < r; i++) {
        if (evs[i].data.fd == e->wakefd) {
            uint64_t v;
            ssize_t x = read(e->wakefd, &v, 8);
            (void)x;
        } else if (evs[i].data.fd == e->shm_wakefd) {
            nic_shm_clear_wake(e); /* (service takes what the links hold in any case) */
        } else {
            readable = 1;
        }
    }
    return readable;
}

/* The poll window: a NIC thread that just served small one-sided requests (a peer's
 * READs, atomics or short WRITEs: nothing completes here, nothing wakes a loop) keeps
 * polling its socket for e->poll_window before it sleeps. The next request then finds
 * it awake: a sleeping thread is woken by the sender's own system call (on a VM, an
 * inter-processor interrupt), which cost the initiator more CPU per 64 B Read than the
 * target spent serving it. A hardware NIC never sleeps; this one polls while requests
 * keep coming and sleeps within a window of the last. Not after datagrams of more than
 * NIC_POLL_MAX_DATAGRAM bytes on average: a stream of large WRITEs keeps the thread
 * busy by itself, and polling between them only took CPU from their sender (64 KiB
 * write_bw on loopback, 2-core VM: -4 %). Returns the sleep timeout (ms) left of
 * `timeout`. */
static int poll_window(struct nic *e, struct epoll_event *evs, int timeout)
{
    double start = nic_now(), now = start, until = start + e->poll_window;
    /* the links too: their rings marked awake, a peer's requests through them cost it
     * no kick (a system call) while this thread polls */
    int links = nic_shm_thread_poll_begin(e);
    while (now < until && !atomic_load(&e->closing)) {
        int r = epoll_wait(e->nic_ep, evs, 4, 0);
        int linked = links && nic_shm_thread_poll_look(e);
        if (links && r == 0 && !linked) {
            nic_lock(e);
            int shared = nic_shm_peer_shares_cpu(e); /* (the peer's requests cannot come meanwhile) */
            nic_unlock(e);
            if (shared) sched_yield();
        }
        if (r > 0 || linked) {
            int readable = r > 0 ? take_events(e, evs, r) : 0, passive;
            timeout = service(e, readable, &passive);
            start = nic_now();
            if (readable || linked) e->counters[NC_NIC_POLL_HITS]++; /* (statistics: a benign race) */
            if (passive)
                until = start + e->poll_window;
            else if (readable || linked)
                break; /* completions for a loop, or the loop took the socket */
        }
        now = nic_now();
    }
    if (links) nic_shm_thread_poll_end(e); /* (a packet that came as it closed kicks the thread awake) */
    if (timeout > 0) {
        int spent = (int)((now - start) * 1000.0);
        timeout = spent >= timeout ? 0 : timeout - spent;
    }
    return timeout;
}

static void *nic_thread_main(void *arg)
{
    struct nic *e = arg;
    struct epoll_event evs[4];
    int timeout = -1;
    while (!atomic_load(&e->closing)) {
        int r = epoll_wait(e->nic_ep, evs, 4, timeout);
        if (atomic_load(&e->closing)) break;
        if (r < 0 && errno != EINTR) break;
        e->counters[NC_NIC_WAKEUPS]++; /* (a benign race with readers: statistics only) */
        int passive;
        timeout = service(e, take_events(e, evs, r), &passive);
        if (passive && e->poll_window > 0) timeout = poll_window(e, evs, timeout);
    }
    atomic_store(&e->thread_running, 0); /* (a health check reads it: nic_thread_alive) */
    return NULL;
}
