/* Shared-memory links: RoCEv2 packets between soft devices of two processes of
 * one host through rings in memory only the two share.
 *
 * Between processes of one host a packet that crosses UDP loopback costs each
 * end a system call (sendmsg, recvmmsg) and, when the receiver sleeps, a
 * wake-up. A link carries the same packets (the BTH and its extension headers
 * as wire_pack_headers makes them, then the payload; no ICRC: nothing crosses a
 * wire) through two single-producer, single-consumer rings in one anonymous
 * memfd: ring 0 from the end that made the link, ring 1 back. The receiving
 * engine decodes and checks them as any datagram (the RC rules, the rkey
 * checks, every error path are the ones the wire takes); only the transport
 * below the BTH changes.
 *
 * Wake-ups: a consumer that is not polling sets its ring's `sleeping` word; a
 * producer that publishes a record and then finds it set writes the consumer
 * device's eventfd once (`kicked` keeps it to once until the consumer looks).
 * Publication and the check are ordered by sequentially consistent fences on
 * both sides (the consumer sets `sleeping` and then looks at the ring again),
 * so a record is never left in a ring whose consumer sleeps.
 *
 * The memory is handed over without a name: the maker keeps the memfd open, the
 * peer copies the descriptor out of the maker's process with pidfd_getfd(2),
 * which the kernel allows only to a process that may ptrace the maker (the
 * permission cross-memory attach needs: such a process could read the maker's
 * memory anyway). The memfd is sealed against shrinking and growing, so neither
 * end can make the other's mapping fault.
 *
 * Everything a ring's peer wrote is checked before it is used: the indices
 * against the ring's size, each record's length against what the ring holds;
 * a ring that breaks a rule is marked broken and its link carries no more
 * packets (the QPs keep the wire).
 */
#ifndef AIORDMA_SHM_H
#define AIORDMA_SHM_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define SHM_MAGIC 0x31484d5341524941ull /* "AIRASMH1" */
/* each direction (a power of two): twice what one QP keeps in flight (2 MiB, the RC
 * window), and a link's QPs keep a quarter of it each (nic_qp_use_link) */
#define SHM_RING_BYTES (4u << 20)
#define SHM_RECORD_HDR 8                /* u32 length, u16 header length, u16 kind */
#define SHM_KIND_PACKET 1
#define SHM_KIND_PAD 2 /* the rest of the ring up to its end is unused: go on at 0 */

/* one ring's control words: the producer's and the consumer's on lines of their own */
struct shm_ring_ctl {
    _Atomic uint64_t tail; /* producer: bytes published so far */
    uint8_t pad0[56];
    _Atomic uint64_t head; /* consumer: bytes consumed so far */
    _Atomic uint32_t sleeping; /* consumer: not polling; a producer must kick */
    _Atomic uint32_t kicked;   /* a producer wrote the eventfd since the consumer last looked */
    _Atomic uint32_t cpu;      /* consumer: 1 + the CPU it last polled or took packets on (0: not yet) */
    uint8_t pad1[44];
};

struct shm_header {
    uint64_t magic;
    uint64_t link_id;
    uint32_t ring_bytes;
    uint32_t version;
    uint8_t pad[40];
    struct shm_ring_ctl ctl[2];
};

#define SHM_DATA_OFFSET(ring_bytes, i) (sizeof(struct shm_header) + (size_t)(i) * (ring_bytes))
#define SHM_MAP_BYTES(ring_bytes) (sizeof(struct shm_header) + 2 * (size_t)(ring_bytes))

/* one direction as one end sees it */
struct shm_ring {
    struct shm_ring_ctl *ctl;
    uint8_t *data;
    uint32_t size;
    uint64_t pos;   /* producer: the tail it publishes next; consumer: its head */
    uint64_t limit; /* consumer: the tail it last read (checked) */
    int broken;
};

/* Append one packet (hlen header bytes, then plen payload bytes): 1, or 0 when the
 * ring has no room (the packet is dropped: the transport retransmits). Publishes. */
int shm_ring_put(struct shm_ring *r, const uint8_t *hdr, uint32_t hlen, const uint8_t *payload, uint32_t plen);
/* 1 when the producer must kick the consumer (it sleeps and was not kicked yet) */
int shm_ring_should_kick(struct shm_ring *r);

/* The next packet in the ring (consumer): 1 with *hdr (hlen bytes, copied into hbuf
 * of at least max_hlen bytes: the peer can change the ring under us) and *payload
 * (plen bytes, in the ring until shm_ring_release), 0 when the ring is empty, -1
 * when the peer broke a rule (the ring is marked broken). */
int shm_ring_next(struct shm_ring *r, uint8_t *hbuf, uint32_t max_hlen, uint32_t *hlen, const uint8_t **payload,
                  uint32_t *plen);
/* hand back everything taken with shm_ring_next so far */
void shm_ring_release(struct shm_ring *r);
/* a lock-free look: 1 when a record waits (the loop's poll asks this) */
int shm_ring_pending(const struct shm_ring *r);
/* the consumer stops polling (1) or starts (0); after setting it, 1 when a record
 * arrived meanwhile (it must be taken: no producer will kick for it) */
int shm_ring_set_sleeping(struct shm_ring *r, int sleeping);
/* the consumer polls from, or takes packets on, CPU cpu (stored only when it changed:
 * the producer reads that line) */
void shm_ring_note_cpu(struct shm_ring *r, unsigned cpu);
/* 1 when the ring's consumer last polled from CPU cpu */
int shm_ring_consumer_on(const struct shm_ring *r, unsigned cpu);

struct shm_link {
    uint64_t link_id;
    uint64_t peer_device; /* the peer device's shm id */
    pid_t peer_pid;
    int made_here;  /* this end made the memfd (it sends on ring 0) */
    int memfd;      /* kept open by its maker: the peer copies it from there */
    int peer_wakefd; /* the peer device's eventfd, copied out of its process */
    void *map;
    size_t map_bytes;
    struct shm_ring tx, rx;
    int refs;       /* QPs of this engine that use it */
    uint64_t tx_packets, rx_packets, kicks, full;
    uint32_t rx_batches; /* receives that took packets (the CPU is said every 64th) */
    struct shm_link *next;
};

/* a copy of descriptor fd of process pid (pidfd_getfd): >= 0, or -errno */
int shm_fetch_fd(pid_t pid, int fd);
/* make a link toward the device whose eventfd is peer_wakefd in process peer_pid:
 * NULL with err filled when it cannot be made */
struct shm_link *shm_link_make(pid_t peer_pid, uint64_t peer_device, int peer_wakefd, char *err, size_t errlen);
/* map the peer's link (its memfd and eventfd numbers in its process): NULL with err filled */
struct shm_link *shm_link_attach(pid_t peer_pid, uint64_t peer_device, uint64_t link_id, int memfd_num,
                                 int wakefd_num, char *err, size_t errlen);
void shm_link_free(struct shm_link *l);
/* kick the peer's eventfd (a producer that found its consumer asleep) */
void shm_link_kick(struct shm_link *l);
/* a fresh random 64-bit id (link and device ids) */
uint64_t shm_random_id(void);

#endif
