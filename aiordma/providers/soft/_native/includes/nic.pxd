# nic.h: the NIC (its thread, the UDP socket, CQs, completion channels, faults,
# tracer hooks), plus small C helpers over its structs.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t

from .rc cimport mr, pd, rc_qp, rc_srq, rc_trace, rc_wc
from .system cimport sockaddr_storage
from .wire cimport flow


cdef extern from "nic.h" nogil:
    enum:
        NC_MAX
        NC_TX_INLINE
        NC_TX_KICKS
        NC_NIC_POLL_HITS
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
        int skip_icrc
        flow txflow
        int closed
    struct nic_async:
        int fd
        uint64_t dropped
    struct nic:
        int sock
        char ip[64]
        uint16_t port
        int icrc_policy
        int gso
        int gso_watch_ifindex, gso_paused
        double gso_watch_next
        int gro
        int local_delivery
        uint64_t counters[64]
        uint64_t closed_qp_counters[15]
        int thread_started
        int thread_running
        size_t nqps, nmrs, ncqs, nsrqs
        uint64_t mr_bytes
        nic_async async
        nic_faults faults
        int tracing
        nic_hooks hooks
        mr **zombies
        size_t nzombies, zombies_cap
        nic_cq **fire
        size_t nfire
        int loop_owns
        int loop_dispatching
        int dispatch_kick_in
        int busy_qps
        size_t ndeferred
        double window_len, window_deadline
        double poll_window
        uint64_t shm_device
        int shm_wakefd
        int nlinks
        int shm_polling
        double shm_poll_seen
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
    nic_qp *nic_qp_new(nic *e, uint32_t qpn, pd *p, rc_srq *srq, nic_cq *scq, nic_cq *rcq, uint32_t max_send_wr,
                       uint32_t max_recv_wr, uint32_t max_send_sge, uint32_t max_recv_sge, int sq_sig_all)
    rc_srq *nic_srq_new(nic *e, uint32_t srq_num, pd *p, uint32_t max_wr, uint32_t max_sge)
    void nic_srq_destroy(nic *e, rc_srq *srq)
    int nic_async_get(nic *e, int *type, uint32_t *element)
    nic_qp *nic_qp_find(nic *e, uint32_t qpn)
    void nic_qp_close(nic_qp *q)
    void nic_qp_destroy(nic_qp *q)
    int nic_qp_set_peer(nic_qp *q, const char *ip, int port)
    void nic_qp_set_path(nic_qp *q, int tclass, int hop_limit)
    void nic_flush(nic *e, nic_qp *q, double now)
    void nic_timer_armed(nic *e, double deadline)
    int nic_service(nic *e, int readable)
    void nic_receive_one(nic *e, const uint8_t *d, size_t n, const sockaddr_storage *src, double now, unsigned index)
    int nic_capture_listening(int ifindex)
    void nic_pd_release(pd *p, mr *m)
    void nic_channel_notify(nic_channel *ch, nic_cq *cq)
    int nic_loop_attach(nic *e)
    void nic_loop_detach(nic *e)
    void nic_expect(nic *e, double now)
    int nic_loop_receive(nic *e, double now, int socket)
    void nic_flush_deferred(nic *e, double now)
    void nic_defer_flush(nic *e, nic_qp *q)
    int nic_gso_send_probe(nic *e, size_t seg, int count)
    int nic_set_gro(nic *e, int on)
    double nic_now()
    int nic_shm_make(nic *e, int peer_pid, uint64_t peer_device, int peer_wakefd, uint64_t *link_id,
                     int *memfd_num, char *err, size_t errlen)
    int nic_shm_attach(nic *e, int peer_pid, uint64_t peer_device, uint64_t link_id, int memfd_num,
                       int wakefd_num, char *err, size_t errlen)
    int nic_qp_use_link(nic_qp *q, uint64_t link_id, int tx)
    int nic_shm_receive(nic *e, double now)
    int nic_shm_pending(const nic *e)
    int nic_shm_wait(nic *e, double until, int selector_fd, double selector_every)
    void nic_shm_waiter(nic *e, int enter)
    int nic_shm_peer_shares_cpu(nic *e)
    int nic_shm_set_polling(nic *e, int on)
    void nic_shm_clear_wake(nic *e)
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

cdef extern from *:
    """
    static inline int nic_trylock(struct nic *e) { return pthread_mutex_trylock(&e->lock); }
    """
    int nic_trylock(nic *e) nogil

