/* The native engine's NIC: a thread, a UDP socket, CQs and completion channels.
 *
 * The C twin of nic.py's SoftNIC plus the CQ and channel of pyengine.py. The
 * NIC thread never takes the GIL (except to call a Python tracer or fault
 * filter, tests only): it receives with recvmmsg, checks ICRCs, runs the RC
 * engines (rc.c), places data into registered memory, sends with UDP GSO or
 * sendmmsg, runs the transport timers and writes CQEs. A CQE that finds its
 * CQ armed makes the completion channel's eventfd readable, after the engine
 * lock is released. An SRQ's limit event goes into the device's async-event
 * queue (struct nic_async, ibv_get_async_event's fd), which the binding reads
 * on the event loop.
 *
 * Locking: one engine lock (recursive) guards every QP, SRQ, the MR tables,
 * the faults and the counters; each CQ and channel, and the async-event queue,
 * has its own small lock, taken inside the engine lock or alone, never the
 * other way round. Python callers
 * take the engine lock only with the GIL released.
 */
#ifndef AIORDMA_NIC_H
#define AIORDMA_NIC_H

#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "rc.h"
#include "shm.h"
#include "wire.h"

enum {
    NC_RX_PACKETS,
    NC_RX_MALFORMED,
    NC_RX_MALFORMED_TRUNCATED,
    NC_RX_MALFORMED_BAD_OPCODE,
    NC_RX_MALFORMED_BAD_TVER,
    NC_RX_MALFORMED_BAD_LENGTH,
    NC_RX_ICRC_UNCHECKED,
    NC_RX_ICRC_ERRORS,
    NC_RX_ICRC_IP_ID_OUT_OF_RANGE,
    NC_RX_ICRC_IP_ID_INFERRED,
    NC_RX_UNKNOWN_QP,
    NC_RX_WRONG_SOURCE,
    NC_RX_ERRORS,
    NC_RX_INTERNAL_ERRORS,
    NC_TX_PACKETS,
    NC_TX_DROPPED_FULL,
    NC_TX_ERRORS,
    NC_TX_GSO_SENDS,
    NC_TX_SYSCALLS,
    NC_RX_SYSCALLS,
    NC_NIC_WAKEUPS,
    NC_TX_INLINE,
    NC_LOOP_SERVICES,
    NC_LOOP_HANDOFFS,
    NC_TX_BYTES,
    NC_RX_BYTES,
    NC_RX_GRO_DATAGRAMS,
    NC_TX_LOCAL,
    NC_RX_ICRC_SKIPPED,
    NC_TX_KICKS,
    NC_NIC_POLL_HITS,
    NC_TX_CMA_GRANTS, /* rc_qp.cma_counters points here: these three stay in this order */
    NC_RX_CMA_READS,
    NC_RX_CMA_BYTES,
    NC_GSO_CAPTURE_PAUSES,
    NC_TX_SHM,        /* packets sent through shared-memory links (nic_shm.c) */
    NC_RX_SHM,        /* ... and received from them */
    NC_SHM_KICKS,     /* eventfd writes that woke a peer that was not polling */
    NC_SHM_RING_FULL, /* packets dropped on a full ring (the transport retransmits) */
    NC_SHM_BROKEN,    /* rings found breaking the format (their links carry no more) */
    NC_SHM_YIELDS,    /* polls that gave the CPU up to a link's peer polling on the same CPU */
    NC_SHM_WAIT_HITS, /* packets the loop found while it waited for them in C (nic_shm_wait) */
    NC_MAX
};
extern const char *const nic_counter_names[NC_MAX];

enum { ICRC_STRICT = 0, ICRC_ANY_IP_ID = 1, ICRC_OFF = 2 };
#define STRICT_MAX_IP_ID 63

struct nic_cq;

/* One channel serves any number of CQs (ibv_get_cq_event names the CQ that
 * fired), so a process with thousands of connections needs one fd per device and
 * event loop, not one per connection. */
struct nic_channel {
    atomic_int refcnt;
    pthread_mutex_t lock;
    int fd; /* eventfd (semaphore): readable exactly while events are pending */
    /* the CQs whose events are pending, oldest first, each referenced: a ring */
    struct nic_cq **events;
    size_t head, len, cap;
    int closed;
    void *pyobj; /* the binding's channel object (borrowed; read with the GIL only) */
};

struct nic_cq {
    atomic_int refcnt;
    pthread_mutex_t lock;
    struct rc_wc *ring;
    size_t cap, head, len;
    uint32_t cqe;
    uint64_t overflows;
    int armed;
    struct nic_channel *ch; /* referenced */
    void *pyobj;            /* the binding's CQ object (borrowed; read with the GIL only) */
};

/* the device's asynchronous events (ibv_get_async_event): an eventfd (a
 * semaphore) readable exactly while events are queued. An event names its
 * element by number (an SRQ's srq_num), never by pointer: the binding looks
 * the object up, and an event of an object destroyed since is skipped. */
struct nic_async_event {
    int type; /* enum ibv_event_type */
    uint32_t element;
};
struct nic_async {
    pthread_mutex_t lock;
    int fd;
    struct nic_async_event *ring;
    size_t head, len, cap;
    uint64_t dropped; /* events that found NIC_ASYNC_MAX queued (nobody reads them) */
};
#define NIC_ASYNC_MAX 4096
#define NIC_EVENT_SRQ_LIMIT_REACHED 15 /* IBV_EVENT_SRQ_LIMIT_REACHED */

struct nic;

struct nic_qp {
    struct nic *nic;
    struct rc_qp *rc;
    struct nic_cq *scq, *rcq; /* referenced */
    int has_peer;
    struct flow txflow;
    struct sockaddr_storage peer;
    socklen_t peer_len;
    int touched, deferred;
    int since_flush; /* requests received since this QP last transmitted */
    /* its peer is a QP of this NIC (the same device, in this process): its packets are
     * handed over in memory, not through the socket (nic->local_delivery) */
    int local_peer;
    int local_due; /* it received in memory and transmits before the lock is released */
    /* both ends soft devices on loopback that agreed at the rendezvous: its large
     * datagrams leave with a zero ICRC and those from its peer are not checked */
    int skip_icrc;
    /* its peer is a soft device of another process of this host, reached through a
     * shared-memory link (nic_shm.c): packets from link_rx are its peer's; it sends
     * through link_tx once the peer said it reads the link (both referenced) */
    struct shm_link *link_rx, *link_tx;
    struct nic_qp *next_touched, *hnext, *next_local;
    struct nic_qp *next, *prev; /* every QP of the NIC (timers walk this list) */
    int closed;
};

#define QP_BUCKETS 1024
#define RX_BATCH 32
/* after a batch of large datagrams, receive at most this many (of at most RX_HOT_BYTES
 * in all, on average) per system call: the batch stays in the cache while it is placed */
#define RX_HOT_DGRAMS 8
#define RX_HOT_BYTES (256 * 1024)
#define RX_BUF 65536
#define GSO_MAX_SEGMENTS 64
#define GSO_MAX_BYTES 60000
#define MAX_TIMER_LAG 0.5
/* within one receive batch, a QP sends what it owes (a coalesced ACK) after this many requests */
#define ACK_EVERY 8
/* with QPs alive the NIC thread sleeps at most this long (s): a post that arms a
 * retransmit timer further away than that needs not wake it */
#define NIC_TICK 0.05
/* how long (s) an event loop keeps the socket after the application last posted or
 * completed something (the "expect window"; AIORDMA_SOFT_WINDOW_US) */
#define DEFAULT_LOOP_WINDOW 0.002
/* a loop that polls its shared-memory links and has not looked for this long (s) has
 * stopped (blocked, or not running): the NIC thread takes the links back */
#define SHM_POLL_STALL 0.002
/* how long (s) the NIC thread keeps polling its socket after it served requests that
 * needed no application (the passive side of one-sided operations; AIORDMA_SOFT_POLL_US) */
#define DEFAULT_NIC_POLL 50e-6
/* ... but only after datagrams of at most this many bytes on average (small requests) */
#define NIC_POLL_MAX_DATAGRAM 8192

struct held_dgram {
    uint8_t *data;
    size_t len;
    struct sockaddr_storage to;
    socklen_t tolen;
    uint8_t tclass, hop_limit; /* its QP's (struct flow) */
};

struct nic_faults {
    int on;
    double drop, duplicate, reorder;
    uint64_t rng;
    int has_filter;
    uint64_t dropped, duplicated, reordered;
    struct held_dgram held[2];
    int nheld;
};

/* the hooks the binding installs (called with the engine lock held; they take the GIL) */
struct nic_hooks {
    void *ctx;
    /* event: "udp_send" / "udp_recv": the datagram on its flow */
    void (*trace_datagram)(void *ctx, const char *event, uint32_t qpn, const uint8_t *d, size_t n,
                           const struct flow *f);
    void (*trace_rc)(void *ctx, struct rc_qp *qp, const struct rc_trace *t);
    void (*trace_cqe)(void *ctx, const struct rc_wc *w);
    int (*filter)(void *ctx, const uint8_t *d, size_t n); /* 0: drop */
};

struct rx_hdrs;

struct nic {
    pthread_mutex_t lock; /* recursive */
    int sock, wakefd;
    int nic_ep;     /* the NIC thread's epoll set: wakefd, and the socket while it owns it */
    int loop_ep;    /* the attached event loop's epoll set: the socket while the loop owns it */
    int loop_attached, loop_owns;
    /* the loop is handing out what it just received (completion handlers, and the tasks
     * they resume, run): a post made meanwhile waits for the flush that follows */
    int loop_dispatching;
    /* posts of that dispatch still to come before the ones it holds leave at once (0:
     * none leave before its end; see NativeEngine._loop_ready) */
    int dispatch_kick_in;
    /* QPs whose send queue holds work requests (each rc_qp keeps it: busy_count) */
    int busy_qps;
    double window_deadline, window_len;
    /* how long (s) the NIC thread polls after serving a peer's one-sided requests (0: not) */
    double poll_window;
    uint32_t *deferred; /* QPNs whose transmit waits until the loop's callbacks ran */
    size_t ndeferred, deferred_cap;
    int ipv6;
    /* the traffic class and hop limit the socket sends with now (set per QP, only
     * when the next datagram's differ: every QP shares the one socket) */
    uint8_t sock_tclass, sock_hop_limit;
    uint8_t txb_tclass, txb_hop_limit; /* those of the datagrams in txb */
    struct flow local; /* src = our address, sport = our port */
    char ip[64];
    uint16_t port;
    int icrc_policy;
    int gso;
    /* the netdev (ifindex) whose captures pause GSO batches (gso.py: a batch crosses it
     * whole, and a capture would see it so); -1: none. gso_paused is what the last
     * reading of /proc/net/packet found, read again at gso_watch_next */
    int gso_watch_ifindex, gso_paused;
    double gso_watch_next;
    int gro; /* UDP_GRO on the socket: a GSO batch arrives as one datagram */
    /* packets between two QPs of this NIC are handed over in memory (AIORDMA_SOFT_LOCAL) */
    int local_delivery;
    struct nic_qp *local_due; /* QPs that received in memory and have yet to transmit */
    int local_draining;
    int rx_batch; /* datagrams per recvmmsg now: RX_BATCH, or RX_HOT_DGRAMS after large ones */
    atomic_int closing;
    int thread_started;
    atomic_int thread_running; /* set before the NIC thread starts, cleared as it returns */
    pthread_t thread;
    uint64_t counters[NC_MAX];
    uint64_t closed_qp_counters[RC_NCOUNTERS]; /* the transport counters of QPs closed so far */
    struct nic_qp *qps[QP_BUCKETS];
    struct nic_qp *all; /* the same QPs, as a list */
    size_t nqps, nmrs, ncqs, nsrqs;
    uint64_t mr_bytes; /* the lengths of the registered regions (DeviceContext.registered_memory) */
    struct nic_async async;
    struct nic_faults faults;
    int pcap_fd;
    double wait_deadline; /* < 0: sleeps without a deadline */
    double undrained_since;
    int tracing;
    struct nic_hooks hooks;
    /* deregistered regions whose last reference went: the binding releases them */
    struct mr **zombies;
    size_t nzombies, zombies_cap;
    /* CQs (referenced) whose channels must be notified once the lock is released */
    struct nic_cq **fire;
    size_t nfire, fire_cap;
    struct nic_qp *touched;
    /* shared-memory links (nic_shm.c): this device's id in them, the eventfd their
     * producers kick (it follows the socket between the NIC thread and the loop), the
     * links, and whether the loop is polling them (then nobody sleeps on them) */
    uint64_t shm_device;
    int shm_wakefd;
    struct shm_link *links;
    int nlinks;
    int shm_polling;
    /* the NIC thread's poll window looks at the links itself (their rings awake: the
     * producers write, and nobody kicks) */
    int shm_thread_polling;
    /* when the loop last looked at the links while polling: a loop that stops looking
     * for SHM_POLL_STALL (blocked, or stopped) gives them back to the NIC thread */
    double shm_poll_seen;
    /* the loop's thread reads the links without the lock while it waits for a packet
     * (nic_shm_wait): a link unlinked meanwhile waits in the graveyard, mapped, until
     * no such wait is running (counted under the lock) */
    int shm_waiters;
    struct shm_link *shm_graveyard;
    struct rc_out out; /* scratch for rc_transmit */
    uint8_t *rxbufs;
    /* the receive batch's message headers, made once (receive_batch resets only the
     * fields a recvmmsg call wrote, in the entries it filled): RX_BATCH of each */
    struct rx_hdrs *rx;
    uint8_t *txscratch;
    size_t txscratch_cap;
    /* small datagrams (ACKs, atomic and short READ responses) of one service pass,
     * to any peer, kept for one sendmmsg at the end of the pass */
    struct txb_slot *txb;
    int ntxb;
    int tx_batching;
};

/* 0 on success; -errno on failure (the socket could not be bound) */
int nic_open(struct nic *e, const char *ip, int port, int icrc_policy, const char *pcap_path, char *err, size_t errlen);
int nic_start(struct nic *e);
void nic_close(struct nic *e); /* stops the thread, closes the socket (the struct stays usable for teardown) */
void nic_free(struct nic *e);
void nic_lock(struct nic *e);
void nic_unlock(struct nic *e);
void nic_fire_events(struct nic *e); /* after nic_unlock */
void nic_wake(struct nic *e);

struct nic_channel *nic_channel_new(void);
void nic_channel_unref(struct nic_channel *ch);
void nic_channel_close(struct nic_channel *ch);
/* the CQ of the oldest pending event (its reference passes to the caller), or
 * NULL if none is pending */
struct nic_cq *nic_channel_get_event(struct nic_channel *ch);

struct nic_cq *nic_cq_new(struct nic *e, uint32_t cqe, struct nic_channel *ch);
void nic_cq_unref(struct nic_cq *cq);
/* pop up to n completions into out; how many */
size_t nic_cq_poll(struct nic_cq *cq, struct rc_wc *out, size_t n);
void nic_cq_req_notify(struct nic_cq *cq);

/* engine lock held by the caller for these */
struct nic_qp *nic_qp_new(struct nic *e, uint32_t qpn, struct pd *pd, struct rc_srq *srq, struct nic_cq *scq,
                          struct nic_cq *rcq, uint32_t max_send_wr, uint32_t max_recv_wr, uint32_t max_send_sge,
                          uint32_t max_recv_sge, int sq_sig_all);
struct nic_qp *nic_qp_find(struct nic *e, uint32_t qpn);
void nic_qp_close(struct nic_qp *q);
void nic_qp_destroy(struct nic_qp *q);
int nic_qp_set_peer(struct nic_qp *q, const char *ip, int port);
/* the traffic class and hop limit (0: the system's default) of the QP's datagrams */
void nic_qp_set_path(struct nic_qp *q, int tclass, int hop_limit);
/* transmit what the QP's engine produced and deliver its completions */
void nic_flush(struct nic *e, struct nic_qp *q, double now);
void nic_timer_armed(struct nic *e, double deadline);
/* one round of NIC work (lock taken inside): receive, timers, transmit, events;
 * returns how long (ms) the NIC thread may sleep: -1 = until woken */
int nic_service(struct nic *e, int readable);
/* process one datagram from src as if received (lock held) */
/* index: the packet's place in a coalesced (UDP_GRO) datagram, 0 for a datagram of its
 * own: the IP ID its sender's ICRC was made for (segment k of a GSO batch: ID k) */
void nic_receive_one(struct nic *e, const uint8_t *d, size_t n, const struct sockaddr_storage *src, double now,
                     unsigned index);
/* 1 if a packet socket of this network namespace receives what crosses netdev ifindex */
int nic_capture_listening(int ifindex);
void nic_pd_release(struct pd *pd, struct mr *mr); /* pd->release of the engine's PDs (ctx = the nic) */
/* an SRQ of the engine (lock held): its limit event goes to the async-event queue */
struct rc_srq *nic_srq_new(struct nic *e, uint32_t srq_num, struct pd *pd, uint32_t max_wr, uint32_t max_sge);
void nic_srq_destroy(struct nic *e, struct rc_srq *srq); /* lock held; srq->users must be 0 */
/* queue an async event (engine lock held or not) and make the fd readable */
void nic_async_push(struct nic *e, int type, uint32_t element);
/* the oldest queued async event into *type, *element: 1, or 0 when none is queued */
int nic_async_get(struct nic *e, int *type, uint32_t *element);
/* queue cq's event on its channel and make the channel readable */
void nic_channel_notify(struct nic_channel *ch, struct nic_cq *cq);

/* the expect window (lock held): the application on the attached loop posted or
 * completed something, so more traffic for it is coming; the loop watches the
 * socket until the window passes (then the NIC thread takes it back) */
int nic_loop_attach(struct nic *e);
void nic_loop_detach(struct nic *e);
void nic_expect(struct nic *e, double now);
/* the loop's receive path (lock held): receive what is queued, place data, write
 * CQEs; the transmits (ACKs, responses) wait for nic_flush_deferred, after the
 * completions were handed to the application (its reply leaves with the ACK) */
/* socket: receive from the socket too (the loop's reader fired), not only the links */
int nic_loop_receive(struct nic *e, double now, int socket);
void nic_flush_deferred(struct nic *e, double now);
/* transmit q's new packets with the next nic_flush_deferred (lock held) */
void nic_defer_flush(struct nic *e, struct nic_qp *q);
int nic_gso_send_probe(struct nic *e, size_t seg, int count); /* test hook: a GSO send the kernel refuses */
/* ask the kernel to hand over coalesced UDP datagrams (UDP_GRO); 1 when it will */
int nic_set_gro(struct nic *e, int on);

/* ------------------------------------------- shared-memory links (nic_shm.c) ---- */
/* (engine lock held for all but nic_shm_pending and nic_shm_wait) */
/* a link toward the peer device (its shm id, process, eventfd number there) made
 * here, or the one made already: its id and memfd number; 0, or -1 with err */
int nic_shm_make(struct nic *e, pid_t peer_pid, uint64_t peer_device, int peer_wakefd, uint64_t *link_id,
                 int *memfd_num, char *err, size_t errlen);
/* map the link the peer made (or find it mapped already): 0, or -1 with err */
int nic_shm_attach(struct nic *e, pid_t peer_pid, uint64_t peer_device, uint64_t link_id, int memfd_num,
                   int wakefd_num, char *err, size_t errlen);
/* q takes its peer's packets from link link_id, and sends through it when tx: 0, or -1 (no such link) */
int nic_qp_use_link(struct nic_qp *q, uint64_t link_id, int tx);
void nic_qp_drop_links(struct nic_qp *q);
void nic_shm_free_all(struct nic *e);
/* transmit q's packets through its link (1), or 0 when it has none */
int nic_shm_send(struct nic *e, struct nic_qp *q, struct rc_out *o);
/* take what waits in every link: how many packets */
int nic_shm_receive(struct nic *e, double now);
/* a lock-free look (the loop's thread): 1 when a packet waits in a link */
int nic_shm_pending(const struct nic *e);
/* The loop's thread waits for a link's packet inside one callback of its event loop,
 * when the loop has nothing else ready, without the lock (between nic_shm_waiter(e, 1)
 * and nic_shm_waiter(e, 0), called with it: a link another thread frees meanwhile
 * stays mapped until the last waiter leaves). 1 when a packet waits, 2 when the loop's
 * selector (selector_fd, an epoll fd; -1: none) has an event, which it looks for every
 * selector_every seconds, 0 at until (one look when until has passed). */
int nic_shm_wait(struct nic *e, double until, int selector_fd, double selector_every);
void nic_shm_waiter(struct nic *e, int enter);
/* A poll of the links that found nothing (the loop's thread without the lock, as
 * nic_shm_pending; the NIC thread with it): says which CPU this thread polls from,
 * and returns 1 when the peer of a link last polled from the same one. Two pollers
 * on one CPU (a container of one CPU, more busy processes than CPUs) cannot answer
 * each other while either spins: each would wait out its whole poll window before
 * the other ran (230 µs a 64 B round trip instead of 40 over TCP). The caller then
 * yields the CPU (sched_yield), which costs nothing where the peer runs elsewhere,
 * since it is not asked then. */
int nic_shm_peer_shares_cpu(struct nic *e);
/* the loop polls the links (on = 1) or stops (0): after stopping, 1 when a packet
 * arrived meanwhile (take it: nobody kicks for it) */
int nic_shm_set_polling(struct nic *e, int on);
/* the NIC thread's poll window (nic.c: poll_window) looks at the links itself, their
 * rings marked awake meanwhile (a producer writes and nobody kicks): begin (1 if it
 * does: the loop does not own them), look (1: a packet waits), end. Each takes the
 * engine lock. Stop (lock held; the window's end, and a loop taking the wake-ups):
 * the rings sleep again, and a packet that came meanwhile is kicked for. */
int nic_shm_thread_poll_begin(struct nic *e);
int nic_shm_thread_poll_look(struct nic *e);
void nic_shm_thread_poll_end(struct nic *e);
void nic_shm_thread_poll_stop(struct nic *e);
/* consume the device's link eventfd (after a wake-up through it) */
void nic_shm_clear_wake(struct nic *e);
void nic_touch(struct nic *e, struct nic_qp *q);

double nic_now(void);
void nic_faults_set(struct nic *e, int on, double drop, double dup, double reorder, uint64_t seed, int has_filter);

#endif
