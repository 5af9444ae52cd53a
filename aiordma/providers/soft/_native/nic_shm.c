/* The NIC's shared-memory links (nic.h, shm.h): which QP uses which link, the
 * transmit into a link and the receive out of every link.
 *
 * A link joins this device to one soft device of another process of this host;
 * every QP between the two uses it. The server's end of a rendezvous makes the
 * link (or finds the one it made for that device), the client maps it; each QP
 * takes its peer's packets from the link as soon as its end knows of it
 * (link_rx), and sends through it once both ends do (link_tx). Until then, and
 * whenever a capture, a tracer or fault injection is on, its packets take the
 * socket: a QP accepts its peer's packets both ways.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nic.h"

/* packets taken from one link per call: the others, and the socket, get their turn */
#define SHM_RX_BUDGET 256
/* how long (s) a producer waits for room in a full ring before it drops the packet */
#define SHM_FULL_WAIT 0.001

static struct shm_link *find_link(struct nic *e, uint64_t link_id)
{
    for (struct shm_link *l = e->links; l; l = l->next)
        if (l->link_id == link_id) return l;
    return NULL;
}

static void add_link(struct nic *e, struct shm_link *l)
{
    /* a new link's consumer sleeps unless the loop polls now */
    shm_ring_set_sleeping(&l->rx, !e->shm_polling);
    l->next = e->links;
    /* (published whole: a waiting loop walks the list without the lock) */
    __atomic_store_n(&e->links, l, __ATOMIC_RELEASE);
    e->nlinks++;
}

/* a link out of the list is freed, or kept mapped while a wait may still read it */
static void retire_link(struct nic *e, struct shm_link *l)
{
    if (e->shm_waiters) {
        l->next = e->shm_graveyard;
        e->shm_graveyard = l;
    } else {
        shm_link_free(l);
    }
}

static void unref_link(struct nic *e, struct shm_link *l)
{
    if (--l->refs > 0) return;
    for (struct shm_link **pp = &e->links; *pp; pp = &(*pp)->next)
        if (*pp == l) {
            __atomic_store_n(pp, l->next, __ATOMIC_RELEASE); /* (a wait may be walking the list) */
            e->nlinks--;
            break;
        }
    retire_link(e, l);
}

int nic_shm_make(struct nic *e, pid_t peer_pid, uint64_t peer_device, int peer_wakefd, uint64_t *link_id,
                 int *memfd_num, char *err, size_t errlen)
{
    for (struct shm_link *l = e->links; l; l = l->next)
        if (l->made_here && l->peer_pid == peer_pid && l->peer_device == peer_device && !l->rx.broken &&
            !l->tx.broken) {
            *link_id = l->link_id;
            *memfd_num = l->memfd;
            return 0;
        }
    struct shm_link *l = shm_link_make(peer_pid, peer_device, peer_wakefd, err, errlen);
    if (!l) return -1;
    add_link(e, l);
    *link_id = l->link_id;
    *memfd_num = l->memfd;
    return 0;
}

int nic_shm_attach(struct nic *e, pid_t peer_pid, uint64_t peer_device, uint64_t link_id, int memfd_num,
                   int wakefd_num, char *err, size_t errlen)
{
    struct shm_link *l = find_link(e, link_id);
    if (l) {
        if (l->peer_pid != peer_pid || l->peer_device != peer_device) {
            snprintf(err, errlen, "link %016llx belongs to another peer", (unsigned long long)link_id);
            return -1;
        }
        return 0;
    }
    l = shm_link_attach(peer_pid, peer_device, link_id, memfd_num, wakefd_num, err, errlen);
    if (!l) return -1;
    add_link(e, l);
    return 0;
}

int nic_qp_use_link(struct nic_qp *q, uint64_t link_id, int tx)
{
    struct nic *e = q->nic;
    struct shm_link *l = find_link(e, link_id);
    if (!l || q->closed) return -1;
    if (q->link_rx != l) {
        if (q->link_rx) unref_link(e, q->link_rx);
        q->link_rx = l;
        l->refs++;
    }
    if (tx && q->link_tx != l) {
        if (q->link_tx) unref_link(e, q->link_tx);
        q->link_tx = l;
        l->refs++;
        /* in flight at most a quarter of the ring (the socket's 2 MiB would be half of
         * it): a few QPs moving bulk at once still find room */
        uint32_t w = (SHM_RING_BYTES / 4) / (q->rc->mtu ? q->rc->mtu : 4096);
        if (w < 16) w = 16;
        if (q->rc->window_pkts > w) q->rc->window_pkts = w;
    }
    return 0;
}

void nic_qp_drop_links(struct nic_qp *q)
{
    struct nic *e = q->nic;
    struct shm_link *rx = q->link_rx, *tx = q->link_tx;
    q->link_rx = q->link_tx = NULL;
    if (rx) unref_link(e, rx);
    if (tx) unref_link(e, tx);
}

void nic_shm_free_all(struct nic *e)
{
    for (struct nic_qp *q = e->all; q; q = q->next) q->link_rx = q->link_tx = NULL;
    while (e->links) {
        struct shm_link *l = e->links;
        __atomic_store_n(&e->links, l->next, __ATOMIC_RELEASE);
        retire_link(e, l);
    }
    e->nlinks = 0;
}

int nic_shm_send(struct nic *e, struct nic_qp *q, struct rc_out *o)
{
    struct shm_link *l = q->link_tx;
    if (l->tx.broken || l->rx.broken) return 0;
    uint64_t *c = e->counters;
    for (size_t i = 0; i < o->n; i++) {
        const struct pkt *p = &o->pkts[i];
        uint8_t hdr[MAX_HDR_LEN];
        uint32_t h = (uint32_t)wire_pack_headers(p, hdr);
        uint32_t plen = (wire_layout[p->opcode] & L_PAYLOAD) ? p->plen : 0;
        if (!shm_ring_put(&l->tx, hdr, h, p->payload, plen)) {
            /* a full ring: the consumer is behind. Wake it if it sleeps and give it a
             * moment, as a socket buffer would have had the room; a drop costs the
             * transport a NAK or a timeout. Bounded: two ends each waiting on the other's
             * full ring, or a consumer that is gone, end in a drop. */
            c[NC_SHM_RING_FULL]++;
            if (shm_ring_should_kick(&l->tx)) {
                c[NC_SHM_KICKS]++;
                shm_link_kick(l);
            }
            double until = nic_now() + SHM_FULL_WAIT;
            int put = 0;
            while (!put && nic_now() < until) {
                sched_yield();
                put = shm_ring_put(&l->tx, hdr, h, p->payload, plen);
            }
            if (!put) {
                c[NC_TX_DROPPED_FULL]++;
                continue;
            }
        }
        l->tx_packets++;
        c[NC_TX_PACKETS]++;
        c[NC_TX_SHM]++;
        c[NC_TX_BYTES] += wire_datagram_length(p);
    }
    if (shm_ring_should_kick(&l->tx)) {
        c[NC_SHM_KICKS]++;
        shm_link_kick(l);
    }
    return 1;
}

/* one packet out of link l, as nic_receive_one takes one off the socket: decoded
 * and checked, handed to its QP only if that QP's peer is on this link */
static void receive_one(struct nic *e, struct shm_link *l, const uint8_t *hdr, uint32_t hlen, const uint8_t *payload,
                        uint32_t plen, double now)
{
    uint64_t *c = e->counters;
    c[NC_RX_PACKETS]++;
    c[NC_RX_SHM]++;
    c[NC_RX_BYTES] += hlen + plen;
    struct pkt p;
    int err = wire_decode_parts(hdr, hlen, payload, plen, &p);
    if (err) {
        c[NC_RX_MALFORMED]++;
        c[NC_RX_MALFORMED_TRUNCATED - 1 - err]++;
        return;
    }
    struct nic_qp *q = nic_qp_find(e, p.dest_qp);
    if (!q) {
        c[NC_RX_UNKNOWN_QP]++;
        return;
    }
    if (q->link_rx != l) { /* a QP whose peer is not behind this link */
        c[NC_RX_WRONG_SOURCE]++;
        return;
    }
    l->rx_packets++;
    rc_receive(q->rc, &p, now);
    if (op_is_request(p.opcode) && ++q->since_flush >= ACK_EVERY && !q->deferred) {
        nic_flush(e, q, now);
        return;
    }
    nic_touch(e, q);
}

int nic_shm_receive(struct nic *e, double now)
{
    int total = 0;
    for (struct shm_link *l = e->links; l; l = l->next) {
        if (l->rx.broken) continue;
        atomic_store_explicit(&l->rx.ctl->kicked, 0, memory_order_relaxed);
        uint8_t hdr[MAX_HDR_LEN];
        uint32_t hlen, plen;
        const uint8_t *payload;
        int r = 0, n = 0;
        while (n < SHM_RX_BUDGET && (r = shm_ring_next(&l->rx, hdr, MAX_HDR_LEN, &hlen, &payload, &plen)) > 0) {
            receive_one(e, l, hdr, hlen, payload, plen, now);
            n++;
        }
        /* (after the packets are placed: until then their payloads lie in the ring) */
        if (n) {
            shm_ring_release(&l->rx);
            /* whoever takes the packets says where it runs, pollers and woken threads
             * alike: a peer spinning for their answer on this CPU then yields it. Every
             * 64th receive (and the first): a thread seldom changes CPU, and where the
             * kernel offers no rseq (valgrind) sched_getcpu is a system call */
            if ((l->rx_batches++ & 63) == 0) {
                int cpu = sched_getcpu();
                if (cpu >= 0) shm_ring_note_cpu(&l->rx, (unsigned)cpu);
            }
        }
        if (r < 0) e->counters[NC_SHM_BROKEN]++;
        total += n;
    }
    return total;
}

int nic_shm_pending(const struct nic *e)
{
    for (const struct shm_link *l = e->links; l; l = l->next)
        if (shm_ring_pending(&l->rx)) return 1;
    return 0;
}

int nic_shm_wait(struct nic *e, double until, int selector_fd, double selector_every)
{
    double next_look = nic_now() + selector_every;
    for (unsigned n = 1;; n++) {
        for (const struct shm_link *l = __atomic_load_n(&e->links, __ATOMIC_ACQUIRE); l;
             l = __atomic_load_n(&l->next, __ATOMIC_ACQUIRE))
            if (shm_ring_pending(&l->rx)) {
                e->counters[NC_SHM_WAIT_HITS]++; /* (the loop's thread: a benign race, statistics) */
                return 1;
            }
        if ((n & 15) == 1) { /* (a clock read costs what a dozen looks at the rings do) */
            double now = nic_now();
            if (now >= until) return 0;
            if (selector_fd >= 0 && now >= next_look) {
                struct pollfd p = {.fd = selector_fd, .events = POLLIN};
                if (poll(&p, 1, 0) != 0) return 2;
                next_look = now + selector_every;
            }
        }
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause(); /* (a sibling hyperthread gets the core meanwhile) */
#elif defined(__aarch64__)
        __asm__ __volatile__("yield");
#endif
    }
}

void nic_shm_waiter(struct nic *e, int enter)
{
    if (enter) {
        e->shm_waiters++;
        return;
    }
    if (--e->shm_waiters > 0) return;
    while (e->shm_graveyard) {
        struct shm_link *l = e->shm_graveyard;
        e->shm_graveyard = l->next;
        shm_link_free(l);
    }
}

int nic_shm_peer_shares_cpu(struct nic *e)
{
    int cpu = sched_getcpu(); /* (no system call where the kernel offers rseq or vgetcpu) */
    if (cpu < 0) return 0;
    int shared = 0;
    for (struct shm_link *l = e->links; l; l = l->next) {
        if (l->rx.broken || l->tx.broken) continue;
        shm_ring_note_cpu(&l->rx, (unsigned)cpu);             /* the peer reads this one */
        shared |= shm_ring_consumer_on(&l->tx, (unsigned)cpu); /* the peer consumes my tx ring */
    }
    if (shared) e->counters[NC_SHM_YIELDS]++; /* (the loop's thread: a benign race, statistics) */
    return shared;
}

int nic_shm_set_polling(struct nic *e, int on)
{
    int pending = 0;
    e->shm_polling = on;
    for (struct shm_link *l = e->links; l; l = l->next)
        if (!l->rx.broken) pending |= shm_ring_set_sleeping(&l->rx, !on);
    return pending;
}

int nic_shm_thread_poll_begin(struct nic *e)
{
    nic_lock(e);
    int on = e->links && !e->loop_owns && !e->shm_polling;
    if (on) {
        e->shm_thread_polling = 1;
        for (struct shm_link *l = e->links; l; l = l->next)
            if (!l->rx.broken) shm_ring_set_sleeping(&l->rx, 0);
    }
    nic_unlock(e);
    return on;
}

int nic_shm_thread_poll_look(struct nic *e)
{
    nic_lock(e); /* (the loop's thread may unmap a link: the list is read under the lock) */
    int pending = e->shm_thread_polling && !e->loop_owns && nic_shm_pending(e);
    nic_unlock(e);
    return pending;
}

void nic_shm_thread_poll_stop(struct nic *e)
{
    if (!e->shm_thread_polling) return;
    e->shm_thread_polling = 0;
    if (e->shm_polling) return; /* (a loop that polls keeps them awake: they are its to mark) */
    int pending = 0;
    for (struct shm_link *l = e->links; l; l = l->next)
        if (!l->rx.broken) pending |= shm_ring_set_sleeping(&l->rx, 1);
    if (pending && e->shm_wakefd >= 0) {
        /* a packet came while the rings were marked awake: nobody kicked for it, so kick
         * now, for whichever thread sleeps on the wake-up */
        uint64_t one = 1;
        ssize_t x = write(e->shm_wakefd, &one, sizeof one);
        (void)x;
    }
}

void nic_shm_thread_poll_end(struct nic *e)
{
    nic_lock(e);
    nic_shm_thread_poll_stop(e);
    nic_unlock(e);
}

void nic_shm_clear_wake(struct nic *e)
{
    uint64_t v;
    if (e->shm_wakefd >= 0) {
        ssize_t x = read(e->shm_wakefd, &v, sizeof v);
        (void)x;
    }
}
