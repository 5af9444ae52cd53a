/* RoCEv2 wire format: BTH and its extension headers, and the ICRC.
 *
 * The C twin of aiordma/providers/soft/wire.py: pure functions, no I/O, no
 * Python. The layout is written out in wire.py's module docstring and its
 * per-opcode header table. All fields are
 * big-endian on the wire except the ICRC (little-endian).
 */
#ifndef AIORDMA_WIRE_H
#define AIORDMA_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define BTH_LEN 12
#define RETH_LEN 16
#define AETH_LEN 4
#define IMMDT_LEN 4
#define ATOMIC_ETH_LEN 28
#define ATOMIC_ACK_ETH_LEN 8
#define ICRC_LEN 4
#define MAX_HDR_LEN 48 /* BTH + RETH + ImmDt = 32; BTH + AtomicETH = 40 */

#define DEFAULT_PKEY 0xFFFF
#define PSN_MASK 0xFFFFFFu

enum rc_opcode {
    OP_SEND_FIRST = 0x00,
    OP_SEND_MIDDLE = 0x01,
    OP_SEND_LAST = 0x02,
    OP_SEND_LAST_WITH_IMMEDIATE = 0x03,
    OP_SEND_ONLY = 0x04,
    OP_SEND_ONLY_WITH_IMMEDIATE = 0x05,
    OP_RDMA_WRITE_FIRST = 0x06,
    OP_RDMA_WRITE_MIDDLE = 0x07,
    OP_RDMA_WRITE_LAST = 0x08,
    OP_RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x09,
    OP_RDMA_WRITE_ONLY = 0x0A,
    OP_RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x0B,
    OP_RDMA_READ_REQUEST = 0x0C,
    OP_RDMA_READ_RESPONSE_FIRST = 0x0D,
    OP_RDMA_READ_RESPONSE_MIDDLE = 0x0E,
    OP_RDMA_READ_RESPONSE_LAST = 0x0F,
    OP_RDMA_READ_RESPONSE_ONLY = 0x10,
    OP_ACKNOWLEDGE = 0x11,
    OP_ATOMIC_ACKNOWLEDGE = 0x12,
    OP_COMPARE_SWAP = 0x13,
    OP_FETCH_ADD = 0x14,
    /* aiordma's own, in the IBA's manufacturer-specific range (wire.py's Opcode says
     * why): a same-host READ answered by a grant (rc.c, "cross-memory attach") */
    OP_CMA_READ_GRANT = 0xC0,
};

/* header-presence bits of an opcode's layout */
#define L_RETH 1
#define L_AETH 2
#define L_IMM 4
#define L_ATOMIC 8
#define L_ATOMIC_ACK 16
#define L_PAYLOAD 32
#define L_VALID 64

#define AETH_ACK 0x00
#define AETH_RNR_NAK 0x20
#define AETH_NAK 0x60
#define NAK_PSN_SEQUENCE_ERROR 0
#define NAK_INVALID_REQUEST 1
#define NAK_REMOTE_ACCESS_ERROR 2
#define NAK_REMOTE_OPERATIONAL_ERROR 3
#define NAK_INVALID_RD_REQUEST 4
#define AETH_CREDITS_INVALID 0x1F

/* decode errors (the "reason" of MalformedPacketError) */
enum wire_error {
    WIRE_OK = 0,
    WIRE_TRUNCATED = -1,
    WIRE_BAD_OPCODE = -2,
    WIRE_BAD_TVER = -3,
    WIRE_BAD_LENGTH = -4,
};

extern const uint8_t wire_layout[256];     /* 0 = not an RC opcode */
extern const uint8_t wire_hdr_len[256];    /* BTH + extension headers */
extern const uint32_t wire_rnr_timer_us[32];

static inline int op_valid(int op) { return op >= 0 && op < 256 && (wire_layout[op] & L_VALID); }
static inline int op_is_request(int op) { return (op >= 0 && op <= 0x0C) || op == OP_COMPARE_SWAP || op == OP_FETCH_ADD; }
static inline int op_is_response(int op) { return (op >= 0x0D && op <= 0x12) || op == OP_CMA_READ_GRANT; }
static inline int op_is_first(int op)
{
    return op == OP_SEND_FIRST || op == OP_SEND_ONLY || op == OP_SEND_ONLY_WITH_IMMEDIATE ||
           op == OP_RDMA_WRITE_FIRST || op == OP_RDMA_WRITE_ONLY || op == OP_RDMA_WRITE_ONLY_WITH_IMMEDIATE ||
           op == OP_RDMA_READ_REQUEST || op == OP_COMPARE_SWAP || op == OP_FETCH_ADD;
}
static inline int op_is_last(int op)
{
    return op == OP_SEND_LAST || op == OP_SEND_LAST_WITH_IMMEDIATE || op == OP_SEND_ONLY ||
           op == OP_SEND_ONLY_WITH_IMMEDIATE || op == OP_RDMA_WRITE_LAST || op == OP_RDMA_WRITE_LAST_WITH_IMMEDIATE ||
           op == OP_RDMA_WRITE_ONLY || op == OP_RDMA_WRITE_ONLY_WITH_IMMEDIATE || op == OP_RDMA_READ_REQUEST ||
           op == OP_COMPARE_SWAP || op == OP_FETCH_ADD;
}

/* One RC packet (wire.Packet). Fields of headers the opcode does not carry are
 * ignored by the encoder and left 0 by the decoder. The payload excludes pad
 * and ICRC; on decode it points into the datagram. */
struct pkt {
    uint8_t opcode;
    uint8_t ack_req, solicited, migreq, fecn, becn, tver, has_imm;
    uint16_t pkey;
    uint32_t dest_qp, psn;
    uint64_t va;
    uint32_t rkey, dma_len;
    uint8_t syndrome;
    uint32_t msn;
    uint32_t imm;
    uint64_t swap_add, compare, orig;
    const uint8_t *payload;
    uint32_t plen;
};

static inline void pkt_init(struct pkt *p, int opcode, uint32_t dest_qp, uint32_t psn)
{
    *p = (struct pkt){0};
    p->opcode = (uint8_t)opcode;
    p->dest_qp = dest_qp & PSN_MASK;
    p->psn = psn & PSN_MASK;
    p->pkey = DEFAULT_PKEY;
}

int wire_decode(const uint8_t *d, size_t n, struct pkt *out);
/* A packet handed over in memory (the NIC's delivery to a queue pair of its own
 * process): its headers as wire_pack_headers made them (hlen bytes) and its payload
 * where it lies (plen bytes, the pad and the ICRC left out), checked as wire_decode
 * checks a datagram; out->payload points into payload. */
int wire_decode_parts(const uint8_t *hdr, size_t hlen, const uint8_t *payload, uint32_t plen, struct pkt *out);
/* BTH + extension headers into hdr (>= MAX_HDR_LEN bytes); pad from the payload length. */
size_t wire_pack_headers(const struct pkt *p, uint8_t *hdr);
/* bytes of the UDP payload encode makes for p (headers, payload, pad, ICRC) */
static inline size_t wire_datagram_length(const struct pkt *p)
{
    size_t n = wire_hdr_len[p->opcode] + ICRC_LEN;
    if (wire_layout[p->opcode] & L_PAYLOAD) n += p->plen + ((-p->plen) & 3u);
    return n;
}
const char *wire_error_name(int err);
const char *wire_opcode_name(int op);

/* ------------------------------------------------------------- ICRC ---- */

/* The IP and UDP headers one direction of traffic is carried in (wire.Flow). */
struct flow {
    int ipv6;
    uint8_t src[16], dst[16]; /* IPv4 in the first 4 bytes */
    uint16_t sport, dport;
    uint16_t ip_id;
    /* the IP header's traffic class (IPv4 TOS: DSCP << 2 | ECN) and hop limit (TTL;
     * 0: the system's default) the kernel writes; the ICRC masks both */
    uint8_t tclass, hop_limit;
};

/* the CRC-32 behind the ICRC (zlib's conditioning), by the fastest implementation of crc32.h */
uint32_t wire_crc32(uint32_t crc, const uint8_t *buf, size_t len);
const char *wire_crc32_name(void);

/* The ICRC of a datagram given as iovecs (headers first, ICRC excluded) whose
 * UDP payload length (ICRC included) is udp_len, sent with IPv4 identification
 * ip_id (ignored for IPv6). */
uint32_t wire_icrc(const struct flow *f, uint16_t ip_id, const struct iovec *parts, int nparts, size_t udp_len);
/* the whole datagram for p sent on f with IPv4 ID ip_id into out (>= wire_datagram_length(p)); its length */
size_t wire_encode(const struct pkt *p, const struct flow *f, uint16_t ip_id, uint8_t *out);
/* Whether the last 4 bytes of the datagram are its ICRC for f (with f->ip_id). */
int wire_icrc_ok(const uint8_t *d, size_t n, const struct flow *f);
/* The IPv4 identification for which the datagram's ICRC is right: f->ip_id when
 * that one is, else the unique other ID that makes it match, else -1 (IPv6: -1
 * unless f->ip_id matches). */
int wire_icrc_ip_id(const uint8_t *d, size_t n, const struct flow *f);

static inline uint32_t psn_add(uint32_t psn, int64_t n) { return (uint32_t)((int64_t)psn + n) & PSN_MASK; }
static inline int32_t psn_diff(uint32_t a, uint32_t b)
{
    uint32_t d = (a - b) & PSN_MASK;
    return (d & 0x800000u) ? (int32_t)d - 0x1000000 : (int32_t)d;
}

static inline void put_be16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)(v >> 8); p[1] = (uint8_t)v; }
static inline void put_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16); p[2] = (uint8_t)(v >> 8); p[3] = (uint8_t)v;
}
static inline void put_be64(uint8_t *p, uint64_t v) { put_be32(p, (uint32_t)(v >> 32)); put_be32(p + 4, (uint32_t)v); }
static inline uint16_t get_be16(const uint8_t *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static inline uint32_t get_be32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static inline uint64_t get_be64(const uint8_t *p) { return ((uint64_t)get_be32(p) << 32) | get_be32(p + 4); }
static inline void put_le32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}
static inline uint32_t get_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

#endif
