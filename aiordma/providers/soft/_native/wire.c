/* RoCEv2 codec and ICRC: the C twin of wire.py (see wire.h). */
#include "wire.h"

#include "crc32.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

/* the fastest CRC-32 this build and CPU have (crc32.h), its function looked up once
 * (an atomic pointer: threads that race to look it up store the same value) */
static _Atomic(crc32_fn) chosen_fn;

uint32_t wire_crc32(uint32_t crc, const uint8_t *buf, size_t len)
{
    crc32_fn f = atomic_load_explicit(&chosen_fn, memory_order_relaxed);
    if (!f) {
        f = crc32_chosen()->fn;
        atomic_store_explicit(&chosen_fn, f, memory_order_relaxed);
    }
    return f(crc, buf, len);
}
const char *wire_crc32_name(void) { return crc32_chosen()->name; }

#define P_ (L_PAYLOAD | L_VALID)
const uint8_t wire_layout[256] = {
    [OP_SEND_FIRST] = P_,
    [OP_SEND_MIDDLE] = P_,
    [OP_SEND_LAST] = P_,
    [OP_SEND_LAST_WITH_IMMEDIATE] = L_IMM | P_,
    [OP_SEND_ONLY] = P_,
    [OP_SEND_ONLY_WITH_IMMEDIATE] = L_IMM | P_,
    [OP_RDMA_WRITE_FIRST] = L_RETH | P_,
    [OP_RDMA_WRITE_MIDDLE] = P_,
    [OP_RDMA_WRITE_LAST] = P_,
    [OP_RDMA_WRITE_LAST_WITH_IMMEDIATE] = L_IMM | P_,
    [OP_RDMA_WRITE_ONLY] = L_RETH | P_,
    [OP_RDMA_WRITE_ONLY_WITH_IMMEDIATE] = L_RETH | L_IMM | P_,
    [OP_RDMA_READ_REQUEST] = L_RETH | L_VALID,
    [OP_RDMA_READ_RESPONSE_FIRST] = L_AETH | P_,
    [OP_RDMA_READ_RESPONSE_MIDDLE] = P_,
    [OP_RDMA_READ_RESPONSE_LAST] = L_AETH | P_,
    [OP_RDMA_READ_RESPONSE_ONLY] = L_AETH | P_,
    [OP_ACKNOWLEDGE] = L_AETH | L_VALID,
    [OP_ATOMIC_ACKNOWLEDGE] = L_AETH | L_ATOMIC_ACK | L_VALID,
    [OP_COMPARE_SWAP] = L_ATOMIC | L_VALID,
    [OP_FETCH_ADD] = L_ATOMIC | L_VALID,
    [OP_CMA_READ_GRANT] = L_AETH | P_,
};
#undef P_

#define H_(x) (BTH_LEN + (x))
const uint8_t wire_hdr_len[256] = {
    [OP_SEND_FIRST] = H_(0),
    [OP_SEND_MIDDLE] = H_(0),
    [OP_SEND_LAST] = H_(0),
    [OP_SEND_LAST_WITH_IMMEDIATE] = H_(IMMDT_LEN),
    [OP_SEND_ONLY] = H_(0),
    [OP_SEND_ONLY_WITH_IMMEDIATE] = H_(IMMDT_LEN),
    [OP_RDMA_WRITE_FIRST] = H_(RETH_LEN),
    [OP_RDMA_WRITE_MIDDLE] = H_(0),
    [OP_RDMA_WRITE_LAST] = H_(0),
    [OP_RDMA_WRITE_LAST_WITH_IMMEDIATE] = H_(IMMDT_LEN),
    [OP_RDMA_WRITE_ONLY] = H_(RETH_LEN),
    [OP_RDMA_WRITE_ONLY_WITH_IMMEDIATE] = H_(RETH_LEN + IMMDT_LEN),
    [OP_RDMA_READ_REQUEST] = H_(RETH_LEN),
    [OP_RDMA_READ_RESPONSE_FIRST] = H_(AETH_LEN),
    [OP_RDMA_READ_RESPONSE_MIDDLE] = H_(0),
    [OP_RDMA_READ_RESPONSE_LAST] = H_(AETH_LEN),
    [OP_RDMA_READ_RESPONSE_ONLY] = H_(AETH_LEN),
    [OP_ACKNOWLEDGE] = H_(AETH_LEN),
    [OP_ATOMIC_ACKNOWLEDGE] = H_(AETH_LEN + ATOMIC_ACK_ETH_LEN),
    [OP_COMPARE_SWAP] = H_(ATOMIC_ETH_LEN),
    [OP_FETCH_ADD] = H_(ATOMIC_ETH_LEN),
    [OP_CMA_READ_GRANT] = H_(AETH_LEN),
};
#undef H_

const uint32_t wire_rnr_timer_us[32] = {
    655360, 10,    20,    30,    40,    60,    80,     120,    160,    240,    320,
    480,    640,   960,   1280,  1920,  2560,  3840,   5120,   7680,   10240,  15360,
    20480,  30720, 40960, 61440, 81920, 122880, 163840, 245760, 327680, 491520,
};

static const char *const op_names[] = {
    "SEND_FIRST",
    "SEND_MIDDLE",
    "SEND_LAST",
    "SEND_LAST_WITH_IMMEDIATE",
    "SEND_ONLY",
    "SEND_ONLY_WITH_IMMEDIATE",
    "RDMA_WRITE_FIRST",
    "RDMA_WRITE_MIDDLE",
    "RDMA_WRITE_LAST",
    "RDMA_WRITE_LAST_WITH_IMMEDIATE",
    "RDMA_WRITE_ONLY",
    "RDMA_WRITE_ONLY_WITH_IMMEDIATE",
    "RDMA_READ_REQUEST",
    "RDMA_READ_RESPONSE_FIRST",
    "RDMA_READ_RESPONSE_MIDDLE",
    "RDMA_READ_RESPONSE_LAST",
    "RDMA_READ_RESPONSE_ONLY",
    "ACKNOWLEDGE",
    "ATOMIC_ACKNOWLEDGE",
    "COMPARE_SWAP",
    "FETCH_ADD",
};

const char *wire_opcode_name(int op)
{
    if (op >= 0 && op <= OP_FETCH_ADD) return op_names[op];
    if (op == OP_CMA_READ_GRANT) return "CMA_READ_GRANT";
    return "OPCODE_?";
}

const char *wire_error_name(int err)
{
    switch (err) {
    case WIRE_TRUNCATED: return "truncated";
    case WIRE_BAD_OPCODE: return "bad_opcode";
    case WIRE_BAD_TVER: return "bad_tver";
    case WIRE_BAD_LENGTH: return "bad_length";
    default: return "ok";
    }
}

/* the BTH of d into p: 0, or a WIRE_* error (the opcode unknown, a transport version
 * other than 0); *pad is the BTH's pad count */
static int decode_bth(const uint8_t *d, struct pkt *p, uint32_t *pad)
{
    int op = d[0];
    if (!(wire_layout[op] & L_VALID)) return WIRE_BAD_OPCODE;
    uint8_t flags = d[1];
    if (flags & 0x0F) return WIRE_BAD_TVER;
    *pad = (flags >> 4) & 3u;
    uint32_t w1 = get_be32(d + 4), w2 = get_be32(d + 8);
    *p = (struct pkt){0};
    p->opcode = (uint8_t)op;
    p->solicited = (flags & 0x80) != 0;
    p->migreq = (flags & 0x40) != 0;
    p->pkey = get_be16(d + 2);
    p->fecn = (w1 & 0x80000000u) != 0;
    p->becn = (w1 & 0x40000000u) != 0;
    p->dest_qp = w1 & 0xFFFFFFu;
    p->ack_req = (w2 & 0x80000000u) != 0;
    p->psn = w2 & PSN_MASK;
    return WIRE_OK;
}

/* the extension headers after the BTH (d holds wire_hdr_len[opcode] bytes) */
static void decode_ext(const uint8_t *d, struct pkt *p)
{
    uint8_t lay = wire_layout[p->opcode];
    size_t off = BTH_LEN;
    if (lay & L_RETH) {
        p->va = get_be64(d + off);
        p->rkey = get_be32(d + off + 8);
        p->dma_len = get_be32(d + off + 12);
        off += RETH_LEN;
    }
    if (lay & L_AETH) {
        uint32_t w = get_be32(d + off);
        p->syndrome = (uint8_t)(w >> 24);
        p->msn = w & 0xFFFFFFu;
        off += AETH_LEN;
    }
    if (lay & L_ATOMIC_ACK) {
        p->orig = get_be64(d + off);
        off += ATOMIC_ACK_ETH_LEN;
    }
    if (lay & L_IMM) {
        p->imm = get_be32(d + off);
        p->has_imm = 1;
        off += IMMDT_LEN;
    }
    if (lay & L_ATOMIC) {
        p->va = get_be64(d + off);
        p->rkey = get_be32(d + off + 8);
        p->swap_add = get_be64(d + off + 12);
        p->compare = get_be64(d + off + 20);
    }
}

int wire_decode(const uint8_t *d, size_t n, struct pkt *p)
{
    if (n < BTH_LEN + ICRC_LEN) return WIRE_TRUNCATED;
    uint32_t pad;
    int err = decode_bth(d, p, &pad);
    if (err) return err;
    size_t hlen = wire_hdr_len[p->opcode];
    if (n - ICRC_LEN - pad < hlen || n < ICRC_LEN + pad) return WIRE_TRUNCATED;
    size_t end = n - ICRC_LEN - pad;
    decode_ext(d, p);
    if (wire_layout[p->opcode] & L_PAYLOAD) {
        p->payload = d + hlen;
        p->plen = (uint32_t)(end - hlen);
    } else if (end != hlen || pad) {
        return WIRE_BAD_LENGTH;
    }
    return WIRE_OK;
}

int wire_decode_parts(const uint8_t *hdr, size_t hlen, const uint8_t *payload, uint32_t plen, struct pkt *p)
{
    if (hlen < BTH_LEN) return WIRE_TRUNCATED;
    uint32_t pad;
    int err = decode_bth(hdr, p, &pad);
    if (err) return err;
    if (hlen != wire_hdr_len[p->opcode]) return hlen < wire_hdr_len[p->opcode] ? WIRE_TRUNCATED : WIRE_BAD_LENGTH;
    decode_ext(hdr, p);
    if (wire_layout[p->opcode] & L_PAYLOAD) {
        if (pad != ((-plen) & 3u)) return WIRE_BAD_LENGTH;
        p->payload = plen ? payload : hdr + hlen;
        p->plen = plen;
    } else if (plen || pad) {
        return WIRE_BAD_LENGTH;
    }
    return WIRE_OK;
}

size_t wire_pack_headers(const struct pkt *p, uint8_t *h)
{
    int op = p->opcode;
    uint8_t lay = wire_layout[op];
    uint32_t pad = (lay & L_PAYLOAD) ? ((-p->plen) & 3u) : 0;
    h[0] = (uint8_t)op;
    h[1] = (uint8_t)((p->solicited ? 0x80 : 0) | (p->migreq ? 0x40 : 0) | (pad << 4) | (p->tver & 0xF));
    put_be16(h + 2, p->pkey);
    put_be32(h + 4, (p->dest_qp & 0xFFFFFFu) | (p->fecn ? 0x80000000u : 0) | (p->becn ? 0x40000000u : 0));
    put_be32(h + 8, (p->psn & PSN_MASK) | (p->ack_req ? 0x80000000u : 0));
    size_t off = BTH_LEN;
    if (lay & L_RETH) {
        put_be64(h + off, p->va);
        put_be32(h + off + 8, p->rkey);
        put_be32(h + off + 12, p->dma_len);
        off += RETH_LEN;
    }
    if (lay & L_AETH) {
        put_be32(h + off, ((uint32_t)p->syndrome << 24) | (p->msn & 0xFFFFFFu));
        off += AETH_LEN;
    }
    if (lay & L_ATOMIC_ACK) {
        put_be64(h + off, p->orig);
        off += ATOMIC_ACK_ETH_LEN;
    }
    if (lay & L_IMM) {
        put_be32(h + off, p->imm);
        off += IMMDT_LEN;
    }
    if (lay & L_ATOMIC) {
        put_be64(h + off, p->va);
        put_be32(h + off + 8, p->rkey);
        put_be64(h + off + 12, p->swap_add);
        put_be64(h + off + 20, p->compare);
        off += ATOMIC_ETH_LEN;
    }
    return off;
}

/* ---------------------------------------------------------------- ICRC ---- */

static size_t pseudo_header(const struct flow *f, uint16_t ip_id, size_t udp_len, uint8_t *out)
{
    memset(out, 0xFF, 8); /* the masked LRH */
    size_t n = 8;
    size_t udp_total = 8 + udp_len;
    if (f->ipv6) {
        out[n + 0] = 0x6f; /* version 6; traffic class and flow label masked */
        out[n + 1] = out[n + 2] = out[n + 3] = 0xFF;
        put_be16(out + n + 4, (uint16_t)udp_total);
        out[n + 6] = 17;
        out[n + 7] = 0xFF; /* hop limit masked */
        memcpy(out + n + 8, f->src, 16);
        memcpy(out + n + 24, f->dst, 16);
        n += 40;
    } else {
        out[n + 0] = 0x45;
        out[n + 1] = 0xFF; /* TOS masked */
        put_be16(out + n + 2, (uint16_t)(20 + udp_total));
        put_be16(out + n + 4, ip_id);
        put_be16(out + n + 6, 0x4000); /* DF */
        out[n + 8] = 0xFF;             /* TTL masked */
        out[n + 9] = 17;
        out[n + 10] = out[n + 11] = 0xFF; /* header checksum masked */
        memcpy(out + n + 12, f->src, 4);
        memcpy(out + n + 16, f->dst, 4);
        n += 20;
    }
    put_be16(out + n, f->sport);
    put_be16(out + n + 2, f->dport);
    put_be16(out + n + 4, (uint16_t)udp_total);
    out[n + 6] = out[n + 7] = 0xFF; /* UDP checksum masked */
    return n + 8;
}

/* a datagram up to this long has its ICRC computed over one gathered copy: one call
 * of the CRC-32 instead of four or more (a small packet's ICRC is mostly call overhead) */
#define ICRC_GATHER 320

uint32_t wire_icrc(const struct flow *f, uint16_t ip_id, const struct iovec *parts, int nparts, size_t udp_len)
{
    uint8_t head[8 + 40 + 8 + ICRC_GATHER];
    size_t hn = pseudo_header(f, ip_id, udp_len, head);
    size_t total = 0;
    for (int i = 0; i < nparts; i++) total += parts[i].iov_len;
    if (total <= ICRC_GATHER && total > 4) {
        uint8_t *p = head + hn;
        for (int i = 0; i < nparts; i++) {
            memcpy(p, parts[i].iov_base, parts[i].iov_len);
            p += parts[i].iov_len;
        }
        head[hn + 4] = 0xFF; /* BTH byte 4 (FECN, BECN, resv6) is masked */
        return wire_crc32(0, head, hn + total);
    }
    uint32_t crc = wire_crc32(0, head, hn);
    size_t pos = 0; /* offset in the datagram */
    static const uint8_t ff = 0xFF;
    for (int i = 0; i < nparts; i++) {
        const uint8_t *b = parts[i].iov_base;
        size_t len = parts[i].iov_len;
        if (pos <= 4 && pos + len > 4) { /* BTH byte 4 (FECN, BECN, resv6) is masked */
            size_t k = 4 - pos;
            crc = wire_crc32(crc, b, k);
            crc = wire_crc32(crc, &ff, 1);
            crc = wire_crc32(crc, b + k + 1, len - k - 1);
        } else if (len) {
            crc = wire_crc32(crc, b, len);
        }
        pos += len;
    }
    return crc;
}

static uint32_t icrc_of(const uint8_t *d, size_t n, const struct flow *f, uint16_t ip_id)
{
    struct iovec iov = {(void *)d, n - ICRC_LEN};
    return wire_icrc(f, ip_id, &iov, 1, n);
}

int wire_icrc_ok(const uint8_t *d, size_t n, const struct flow *f)
{
    if (n < BTH_LEN + ICRC_LEN) return 0;
    return icrc_of(d, n, f, f->ip_id) == get_le32(d + n - ICRC_LEN);
}

/* ------------------------------------------------- IP identification solver ----
 *
 * As in wire.py: for datagrams of one length the ICRC is affine in the bits of
 * the IPv4 identification, icrc(ID = x) = icrc(ID = 0) ^ M.x, M a 32 x 16 bit
 * matrix of rank 16. Column k is the CRC (without pre/post-conditioning) of
 * bit k of the 16-bit ID field followed by the rest of the pseudo-packet as
 * zeros: a constant times x^(8m) mod P, computed with zlib's crc32_combine
 * arithmetic instead of running the CRC over m zero bytes.
 */
#define CRC_POLY 0xedb88320u

static uint32_t multmodp(uint32_t a, uint32_t b)
{
    uint32_t m = (uint32_t)1 << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ CRC_POLY : b >> 1;
    }
    return p;
}

static uint32_t x2n_table[32];
static pthread_once_t x2n_once = PTHREAD_ONCE_INIT;

static void x2n_init(void)
{
    uint32_t p = (uint32_t)1 << 30; /* x^1 */
    x2n_table[0] = p;
    for (int n = 1; n < 32; n++) x2n_table[n] = p = multmodp(p, p);
}

static uint32_t x2nmodp(uint64_t n, unsigned k)
{
    uint32_t p = (uint32_t)1 << 31; /* x^0 */
    while (n) {
        if (n & 1) p = multmodp(x2n_table[k & 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

struct ip_id_solver {
    size_t total_len; /* pseudo-packet length; 0 = empty slot */
    uint32_t cols[16];
    int npiv;
    uint8_t piv_bit[16];
    uint16_t piv_combo[16];
};

#define SOLVER_SLOTS 64
static struct ip_id_solver solver_cache[SOLVER_SLOTS];
static pthread_mutex_t solver_lock = PTHREAD_MUTEX_INITIALIZER;

static void solver_build(struct ip_id_solver *s, size_t total_len)
{
    pthread_once(&x2n_once, x2n_init);
    /* the ID field is at bytes 12..13 of the pseudo-packet; m bytes follow it */
    size_t m = total_len - 14;
    uint32_t shift = x2nmodp(m, 3);
    static const uint8_t z2[2] = {0, 0};
    uint32_t c0 = wire_crc32(0, z2, 2);
    for (int k = 0; k < 16; k++) {
        uint8_t b[2] = {(uint8_t)((1u << k) >> 8), (uint8_t)(1u << k)};
        uint32_t raw = wire_crc32(0, b, 2) ^ c0; /* the unconditioned CRC of the 2 bytes */
        s->cols[k] = multmodp(shift, raw);
    }
    /* Gaussian elimination on the columns, tracking which ID bits make up each
     * reduced vector, fully reduced (every pivot bit set in exactly one vector) */
    uint32_t vec[16];
    uint16_t combo[16];
    int piv[16];
    int nb = 0;
    for (int k = 0; k < 16; k++) {
        uint32_t v = s->cols[k];
        uint16_t c = (uint16_t)(1u << k);
        for (int i = 0; i < nb; i++)
            if ((v >> piv[i]) & 1) {
                v ^= vec[i];
                c ^= combo[i];
            }
        if (!v) continue;
        int p = 31 - __builtin_clz(v);
        for (int i = 0; i < nb; i++)
            if ((vec[i] >> p) & 1) {
                vec[i] ^= v;
                combo[i] ^= c;
            }
        vec[nb] = v;
        combo[nb] = c;
        piv[nb] = p;
        nb++;
    }
    s->npiv = nb;
    for (int i = 0; i < nb; i++) {
        s->piv_bit[i] = (uint8_t)piv[i];
        s->piv_combo[i] = combo[i];
    }
    s->total_len = total_len;
}

static int solver_solve(const struct ip_id_solver *s, uint32_t d)
{
    uint32_t x = 0;
    for (int i = 0; i < s->npiv; i++)
        if ((d >> s->piv_bit[i]) & 1) x ^= s->piv_combo[i];
    uint32_t check = 0;
    for (int k = 0; k < 16; k++)
        if ((x >> k) & 1) check ^= s->cols[k];
    return check == d ? (int)x : -1;
}

int wire_icrc_ip_id(const uint8_t *d, size_t n, const struct flow *f)
{
    if (n < BTH_LEN + ICRC_LEN) return -1;
    uint32_t diff = icrc_of(d, n, f, f->ip_id) ^ get_le32(d + n - ICRC_LEN);
    if (diff == 0) return f->ip_id;
    if (f->ipv6) return -1;
    size_t total = 36 + n - ICRC_LEN;
    struct ip_id_solver s;
    pthread_mutex_lock(&solver_lock);
    struct ip_id_solver *slot = &solver_cache[total % SOLVER_SLOTS];
    if (slot->total_len != total) solver_build(slot, total);
    s = *slot;
    pthread_mutex_unlock(&solver_lock);
    int x = solver_solve(&s, diff);
    return x < 0 ? -1 : (x ^ f->ip_id);
}

size_t wire_encode(const struct pkt *p, const struct flow *f, uint16_t ip_id, uint8_t *out)
{
    size_t n = wire_pack_headers(p, out);
    if (wire_layout[p->opcode] & L_PAYLOAD) {
        if (p->plen) memcpy(out + n, p->payload, p->plen);
        n += p->plen;
        uint32_t pad = (-p->plen) & 3u;
        memset(out + n, 0, pad);
        n += pad;
    }
    struct iovec iov = {out, n};
    put_le32(out + n, wire_icrc(f, ip_id, &iov, 1, n + ICRC_LEN));
    return n + ICRC_LEN;
}
