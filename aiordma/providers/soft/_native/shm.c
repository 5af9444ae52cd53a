/* Shared-memory links between soft devices of two processes: see shm.h. */
#define _GNU_SOURCE
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif
#ifndef MFD_ALLOW_SEALING
#define MFD_ALLOW_SEALING 0x0002U
#endif
#ifndef F_ADD_SEALS
#define F_ADD_SEALS 1033
#define F_GET_SEALS 1034
#define F_SEAL_SHRINK 0x0002
#define F_SEAL_GROW 0x0004
#endif

#define SHM_VERSION 1

static uint32_t align8(uint32_t n) { return (n + 7u) & ~7u; }

/* ---------------------------------------------------------------- rings ---- */

int shm_ring_put(struct shm_ring *r, const uint8_t *hdr, uint32_t hlen, const uint8_t *payload, uint32_t plen)
{
    uint32_t len = hlen + plen;
    uint32_t need = SHM_RECORD_HDR + align8(len);
    uint64_t head = atomic_load_explicit(&r->ctl->head, memory_order_acquire);
    uint64_t tail = r->pos;
    uint32_t off = (uint32_t)(tail & (r->size - 1));
    uint32_t to_end = r->size - off;
    uint32_t pad = to_end < need ? to_end : 0;
    /* (a consumer's head beyond our tail can only be a broken peer: no room, then) */
    if (head > tail || need > r->size || (tail - head) + pad + need > r->size) return 0;
    if (pad) { /* the record does not fit before the end: a pad record, then at 0 */
        uint8_t *p = r->data + off;
        uint32_t w = pad - SHM_RECORD_HDR;
        uint16_t kind = SHM_KIND_PAD, zero = 0;
        memcpy(p, &w, 4);
        memcpy(p + 4, &zero, 2);
        memcpy(p + 6, &kind, 2);
        tail += pad;
        off = 0;
    }
    uint8_t *p = r->data + off;
    uint16_t h16 = (uint16_t)hlen, kind = SHM_KIND_PACKET;
    memcpy(p, &len, 4);
    memcpy(p + 4, &h16, 2);
    memcpy(p + 6, &kind, 2);
    memcpy(p + SHM_RECORD_HDR, hdr, hlen);
    if (plen) memcpy(p + SHM_RECORD_HDR + hlen, payload, plen);
    tail += need;
    r->pos = tail;
    atomic_store_explicit(&r->ctl->tail, tail, memory_order_release);
    return 1;
}

int shm_ring_should_kick(struct shm_ring *r)
{
    /* the record's publication before the look at `sleeping` (the consumer orders its
     * `sleeping` store before its second look at the tail the same way) */
    atomic_thread_fence(memory_order_seq_cst);
    if (!atomic_load_explicit(&r->ctl->sleeping, memory_order_relaxed)) return 0;
    return !atomic_exchange_explicit(&r->ctl->kicked, 1, memory_order_relaxed);
}

int shm_ring_pending(const struct shm_ring *r)
{
    return !r->broken && atomic_load_explicit(&r->ctl->tail, memory_order_relaxed) != r->pos;
}

static int broken(struct shm_ring *r)
{
    r->broken = 1;
    return -1;
}

int shm_ring_next(struct shm_ring *r, uint8_t *hbuf, uint32_t max_hlen, uint32_t *hlen, const uint8_t **payload,
                  uint32_t *plen)
{
    if (r->broken) return -1;
    for (;;) {
        if (r->pos == r->limit) {
            uint64_t tail = atomic_load_explicit(&r->ctl->tail, memory_order_acquire);
            if (tail == r->pos) return 0;
            /* what the producer says it published must fit what we have not released */
            uint64_t released = atomic_load_explicit(&r->ctl->head, memory_order_relaxed);
            if (tail < r->pos || tail - released > r->size) return broken(r);
            r->limit = tail;
        }
        uint32_t off = (uint32_t)(r->pos & (r->size - 1));
        uint64_t avail = r->limit - r->pos;
        if (avail < SHM_RECORD_HDR || r->size - off < SHM_RECORD_HDR) return broken(r);
        const uint8_t *p = r->data + off;
        uint32_t len;
        uint16_t h16, kind;
        /* (copied once: the peer may change them while we look) */
        memcpy(&len, p, 4);
        memcpy(&h16, p + 4, 2);
        memcpy(&kind, p + 6, 2);
        if (len > r->size) return broken(r);
        uint64_t need = SHM_RECORD_HDR + (uint64_t)align8(len);
        if (need > avail || need > r->size - off) return broken(r);
        if (kind == SHM_KIND_PAD) {
            if (off + need != r->size) return broken(r); /* a pad runs to the ring's end */
            r->pos += need;
            continue;
        }
        if (kind != SHM_KIND_PACKET || h16 > len || h16 > max_hlen) return broken(r);
        memcpy(hbuf, p + SHM_RECORD_HDR, h16);
        *hlen = h16;
        *payload = p + SHM_RECORD_HDR + h16;
        *plen = len - h16;
        r->pos += need;
        return 1;
    }
}

void shm_ring_release(struct shm_ring *r)
{
    atomic_store_explicit(&r->ctl->head, r->pos, memory_order_release);
}

int shm_ring_set_sleeping(struct shm_ring *r, int sleeping)
{
    atomic_store_explicit(&r->ctl->sleeping, sleeping ? 1u : 0u, memory_order_relaxed);
    if (!sleeping) return 0;
    atomic_thread_fence(memory_order_seq_cst);
    return shm_ring_pending(r);
}

void shm_ring_note_cpu(struct shm_ring *r, unsigned cpu)
{
    if (atomic_load_explicit(&r->ctl->cpu, memory_order_relaxed) != cpu + 1)
        atomic_store_explicit(&r->ctl->cpu, cpu + 1, memory_order_relaxed);
}

int shm_ring_consumer_on(const struct shm_ring *r, unsigned cpu)
{
    /* (a word the peer writes: compared, never used as an index) */
    return atomic_load_explicit(&r->ctl->cpu, memory_order_relaxed) == cpu + 1;
}

/* ---------------------------------------------------------------- links ---- */

uint64_t shm_random_id(void)
{
    uint64_t v = 0;
    while (v == 0) {
        if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v) abort(); /* (cannot fail for 8 bytes) */
    }
    return v;
}

int shm_fetch_fd(pid_t pid, int fd)
{
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (pidfd < 0) return -errno;
    int got = (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
    int err = errno;
    close(pidfd);
    return got < 0 ? -err : got;
}

static int is_eventfd(int fd)
{
    char path[64], target[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n < 0) return 0;
    target[n] = 0;
    /* non-blocking, or a kick could block on a counter at its maximum */
    return strcmp(target, "anon_inode:[eventfd]") == 0 && (fcntl(fd, F_GETFL) & O_NONBLOCK);
}

static void rings_of(struct shm_link *l)
{
    struct shm_header *h = l->map;
    uint32_t size = h->ring_bytes;
    int out = l->made_here ? 0 : 1;
    l->tx = (struct shm_ring){.ctl = &h->ctl[out], .data = (uint8_t *)l->map + SHM_DATA_OFFSET(size, out), .size = size};
    l->rx = (struct shm_ring){
        .ctl = &h->ctl[1 - out], .data = (uint8_t *)l->map + SHM_DATA_OFFSET(size, 1 - out), .size = size};
    l->tx.pos = atomic_load(&l->tx.ctl->tail);
    l->rx.pos = l->rx.limit = atomic_load(&l->rx.ctl->head);
}

static struct shm_link *fail(struct shm_link *l, char *err, size_t errlen, const char *what, int e)
{
    snprintf(err, errlen, "%s: %s", what, strerror(e));
    shm_link_free(l);
    return NULL;
}

struct shm_link *shm_link_make(pid_t peer_pid, uint64_t peer_device, int peer_wakefd, char *err, size_t errlen)
{
    struct shm_link *l = calloc(1, sizeof *l);
    if (!l) return fail(NULL, err, errlen, "out of memory", ENOMEM);
    l->memfd = l->peer_wakefd = -1;
    l->made_here = 1;
    l->peer_pid = peer_pid;
    l->peer_device = peer_device;
    int fd = shm_fetch_fd(peer_pid, peer_wakefd);
    if (fd < 0) return fail(l, err, errlen, "cannot copy the peer's eventfd (pidfd_getfd)", -fd);
    l->peer_wakefd = fd;
    if (!is_eventfd(fd)) return fail(l, err, errlen, "the peer's wake-up descriptor is not a non-blocking eventfd", EINVAL);
    l->memfd = (int)syscall(SYS_memfd_create, "aiordma-link", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (l->memfd < 0) return fail(l, err, errlen, "memfd_create", errno);
    l->map_bytes = SHM_MAP_BYTES(SHM_RING_BYTES);
    if (ftruncate(l->memfd, (off_t)l->map_bytes) < 0) return fail(l, err, errlen, "ftruncate", errno);
    if (fcntl(l->memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) < 0)
        return fail(l, err, errlen, "sealing the memfd", errno);
    void *m = mmap(NULL, l->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, l->memfd, 0);
    if (m == MAP_FAILED) return fail(l, err, errlen, "mmap", errno);
    l->map = m;
    struct shm_header *h = m;
    h->magic = SHM_MAGIC;
    h->link_id = l->link_id = shm_random_id();
    h->ring_bytes = SHM_RING_BYTES;
    h->version = SHM_VERSION;
    for (int i = 0; i < 2; i++) atomic_store(&h->ctl[i].sleeping, 1); /* nobody polls yet */
    rings_of(l);
    return l;
}

struct shm_link *shm_link_attach(pid_t peer_pid, uint64_t peer_device, uint64_t link_id, int memfd_num,
                                 int wakefd_num, char *err, size_t errlen)
{
    struct shm_link *l = calloc(1, sizeof *l);
    if (!l) return fail(NULL, err, errlen, "out of memory", ENOMEM);
    l->memfd = l->peer_wakefd = -1;
    l->peer_pid = peer_pid;
    l->peer_device = peer_device;
    l->link_id = link_id;
    int fd = shm_fetch_fd(peer_pid, memfd_num);
    if (fd < 0) return fail(l, err, errlen, "cannot copy the peer's memfd (pidfd_getfd)", -fd);
    l->memfd = fd;
    struct stat st;
    int seals = fcntl(fd, F_GET_SEALS);
    l->map_bytes = SHM_MAP_BYTES(SHM_RING_BYTES);
    if (fstat(fd, &st) < 0 || seals < 0 || (size_t)st.st_size != l->map_bytes ||
        (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
        return fail(l, err, errlen, "the peer's descriptor is not a sealed link of the expected size", EINVAL);
    void *m = mmap(NULL, l->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) return fail(l, err, errlen, "mmap", errno);
    l->map = m;
    struct shm_header *h = m;
    if (h->magic != SHM_MAGIC || h->link_id != link_id || h->ring_bytes != SHM_RING_BYTES || h->version != SHM_VERSION)
        return fail(l, err, errlen, "the peer's memfd is not the link it named", EINVAL);
    fd = shm_fetch_fd(peer_pid, wakefd_num);
    if (fd < 0) return fail(l, err, errlen, "cannot copy the peer's eventfd (pidfd_getfd)", -fd);
    l->peer_wakefd = fd;
    if (!is_eventfd(fd)) return fail(l, err, errlen, "the peer's wake-up descriptor is not a non-blocking eventfd", EINVAL);
    rings_of(l);
    return l;
}

void shm_link_free(struct shm_link *l)
{
    if (!l) return;
    if (l->map) munmap(l->map, l->map_bytes);
    if (l->memfd >= 0) close(l->memfd);
    if (l->peer_wakefd >= 0) close(l->peer_wakefd);
    free(l);
}

void shm_link_kick(struct shm_link *l)
{
    uint64_t one = 1;
    l->kicks++;
    ssize_t w = write(l->peer_wakefd, &one, sizeof one);
    (void)w; /* (EAGAIN: the counter is at its maximum, so it is readable already) */
}
