/* CRC-32 for the ICRC: the implementations and the run-time choice (crc32.h). */
#include "crc32.h"

#include <pthread.h>

#if defined(AIORDMA_HAVE_ISAL)
#include <isa-l/crc.h>
#endif
#if defined(AIORDMA_HAVE_ZLIB)
#include <zlib.h>
#endif

#define CRC32_POLY_REFLECTED 0xedb88320u

/* ------------------------------------------------------------ table ---- */

/* crc_tab[0] is the classic byte-at-a-time table; crc_tab[t][i] is the CRC of
 * byte i followed by t zero bytes, so eight lookups advance eight bytes. */
static uint32_t crc_tab[8][256];
static pthread_once_t crc_tab_once = PTHREAD_ONCE_INIT;

static void crc_tab_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ CRC32_POLY_REFLECTED : c >> 1;
        crc_tab[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) crc_tab[t][i] = (crc_tab[t - 1][i] >> 8) ^ crc_tab[0][crc_tab[t - 1][i] & 0xFF];
}

/* the unconditioned state c advanced over buf (no ~ before or after) */
static uint32_t table_advance(uint32_t c, const uint8_t *buf, size_t len)
{
    pthread_once(&crc_tab_once, crc_tab_init);
    while (len >= 8) {
        uint32_t a = c ^ ((uint32_t)buf[0] | (uint32_t)buf[1] << 8 | (uint32_t)buf[2] << 16 | (uint32_t)buf[3] << 24);
        uint32_t b = (uint32_t)buf[4] | (uint32_t)buf[5] << 8 | (uint32_t)buf[6] << 16 | (uint32_t)buf[7] << 24;
        c = crc_tab[7][a & 0xFF] ^ crc_tab[6][(a >> 8) & 0xFF] ^ crc_tab[5][(a >> 16) & 0xFF] ^ crc_tab[4][a >> 24] ^
            crc_tab[3][b & 0xFF] ^ crc_tab[2][(b >> 8) & 0xFF] ^ crc_tab[1][(b >> 16) & 0xFF] ^ crc_tab[0][b >> 24];
        buf += 8;
        len -= 8;
    }
    while (len--) c = (c >> 8) ^ crc_tab[0][(c ^ *buf++) & 0xFF];
    return c;
}

static uint32_t crc32_table(uint32_t crc, const uint8_t *buf, size_t len) { return ~table_advance(~crc, buf, len); }

/* ----------------------------------------------------------- pclmul ---- */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(AIORDMA_CRC_NO_PCLMUL)
#define HAVE_PCLMUL_CODE 1
#include <immintrin.h>

/*
 * Folding with carry-less multiplication (Gopal et al., "Fast CRC computation
 * for generic polynomials using PCLMULQDQ", Intel, 2009), in the bit-reflected
 * domain. The message is a polynomial over GF(2); the CRC is its remainder mod
 * P. A 128-bit chunk A lying d bits before a chunk B is worth A * x^d mod P
 * added to B, and that product takes two 64x64-bit carry-less multiplications
 * of A's halves by the constants x^(d+32) and x^(d-32) mod P (bit-reflected and
 * shifted one place), giving 128 bits again. So four accumulators run over
 * 64-byte strides, collapse into one, take any remaining
 * 16-byte chunks, and the last 128 bits are reduced to 32 by two more folds and
 * a Barrett reduction. The constants are computed from P at first use rather
 * than copied in as magic numbers.
 */
static uint64_t K_512[2], K_128[2], K_64, BARRETT[2];
static pthread_once_t pclmul_once = PTHREAD_ONCE_INIT;

/* x^k mod P in the bit-reflected form the folds use (bits reversed, shifted one place) */
static uint64_t x_pow_mod_p(unsigned k)
{
    uint64_t r = 1; /* normal bit order, P = x^32 + 0x04C11DB7 */
    while (k--) r = (r << 1) ^ ((r & 0x80000000u) ? 0x104C11DB7ull : 0);
    uint64_t out = 0;
    for (int i = 0; i < 32; i++) out |= ((r >> i) & 1) << (31 - i);
    return out << 1;
}

static void pclmul_init(void)
{
    K_512[0] = x_pow_mod_p(4 * 128 + 32), K_512[1] = x_pow_mod_p(4 * 128 - 32);
    K_128[0] = x_pow_mod_p(128 + 32), K_128[1] = x_pow_mod_p(128 - 32);
    K_64 = x_pow_mod_p(64);
    /* Barrett: P itself and mu = floor(x^64 / P), both 33 bits, bit-reflected */
    /* long division: x^64 - x^32 * P leaves 0x04C11DB7 * x^32 (the quotient's top
     * bit is x^32), then one quotient bit per lower power */
    uint64_t q = 1ull << 32, rem = 0x04C11DB7ull << 32;
    for (int i = 63; i >= 32; i--)
        if ((rem >> i) & 1) rem ^= 0x104C11DB7ull << (i - 32), q |= 1ull << (i - 32);
    uint64_t p_refl = 0, mu_refl = 0;
    for (int i = 0; i < 33; i++) {
        p_refl |= ((0x104C11DB7ull >> i) & 1) << (32 - i);
        mu_refl |= ((q >> i) & 1) << (32 - i);
    }
    BARRETT[0] = p_refl, BARRETT[1] = mu_refl;
}

/* one fold: acc's low half times k's low constant plus acc's high half times
 * k's high one (_mm_clmulepi64_si128's selector: bit 0 picks the first
 * operand's 64-bit half, bit 4 the second's), added to the chunk that follows */
__attribute__((target("pclmul,sse4.1"))) static inline __m128i fold(__m128i acc, __m128i k, __m128i next)
{
    __m128i lo = _mm_clmulepi64_si128(acc, k, 0x00);
    __m128i hi = _mm_clmulepi64_si128(acc, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

#define LOAD(p) _mm_loadu_si128((const __m128i *)(p))
/* The accumulator loops below carry "#pragma GCC unroll 4" (GCC and clang): fully
 * unrolled, the four accumulators stay in registers; at -O2 GCC otherwise kept
 * them in a stack array, which halved the VPCLMULQDQ path (24 -> 48 GB/s here). */

__attribute__((target("pclmul,sse4.1"))) static uint32_t pclmul_finish(__m128i acc, const uint8_t *buf, size_t len);

/* the unconditioned state c advanced over buf; len >= 64 and a multiple of 16 */
__attribute__((target("pclmul,sse4.1"))) static uint32_t pclmul_advance(uint32_t c, const uint8_t *buf, size_t len)
{
    pthread_once(&pclmul_once, pclmul_init);
    __m128i a[4];
    a[0] = _mm_xor_si128(LOAD(buf), _mm_cvtsi32_si128((int)c));
#pragma GCC unroll 4
    for (int i = 1; i < 4; i++) a[i] = LOAD(buf + 16 * i);
    buf += 64;
    len -= 64;
    __m128i k = LOAD(K_512);
    for (; len >= 64; buf += 64, len -= 64)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) a[i] = fold(a[i], k, LOAD(buf + 16 * i));

    k = LOAD(K_128);
    __m128i acc = fold(a[0], k, a[1]);
    acc = fold(acc, k, a[2]);
    acc = fold(acc, k, a[3]);
    return pclmul_finish(acc, buf, len);
}

/* the 128-bit state acc folded over the remaining 16-byte chunks of buf
 * (len a multiple of 16), then reduced to the 32-bit CRC state */
__attribute__((target("pclmul,sse4.1"))) static uint32_t pclmul_finish(__m128i acc, const uint8_t *buf, size_t len)
{
    __m128i k = LOAD(K_128);
    for (; len >= 16; buf += 16, len -= 16) acc = fold(acc, k, LOAD(buf));

    /* 128 -> 96 bits: the low half times x^(128-32) mod P, added to the high half */
    const __m128i low32 = _mm_setr_epi32(-1, 0, -1, 0);
    acc = _mm_xor_si128(_mm_srli_si128(acc, 8), _mm_clmulepi64_si128(acc, k, 0x10));
    /* 96 -> 64 bits: the low 32 bits times x^64 mod P, added to the rest */
    __m128i k64 = _mm_cvtsi64_si128((long long)K_64);
    acc = _mm_xor_si128(_mm_srli_si128(acc, 4), _mm_clmulepi64_si128(_mm_and_si128(acc, low32), k64, 0x00));
    /* Barrett: q = floor(low32 * mu), remainder = acc - q * P; the CRC sits in bits 32..63 */
    __m128i kb = LOAD(BARRETT);
    __m128i q = _mm_and_si128(_mm_clmulepi64_si128(_mm_and_si128(acc, low32), kb, 0x10), low32);
    acc = _mm_xor_si128(acc, _mm_clmulepi64_si128(q, kb, 0x00));
    return (uint32_t)_mm_extract_epi32(acc, 1);
}

static uint32_t crc32_pclmul(uint32_t crc, const uint8_t *buf, size_t len)
{
    uint32_t c = ~crc;
    if (len >= 64) {
        size_t n = len & ~(size_t)15;
        c = pclmul_advance(c, buf, n);
        buf += n;
        len -= n;
    }
    return ~table_advance(c, buf, len);
}

/*
 * The same folds four 128-bit lanes at a time (VPCLMULQDQ on 512-bit registers,
 * AVX-512): four accumulators of 64 bytes each run over 256-byte strides, then
 * collapse into one register, whose four lanes are folded into the 128-bit
 * state that pclmul_advance finishes.
 */
static uint64_t K_2048[2];
static pthread_once_t vpclmul_once = PTHREAD_ONCE_INIT;
static void vpclmul_init(void)
{
    pthread_once(&pclmul_once, pclmul_init);
    K_2048[0] = x_pow_mod_p(4 * 512 + 32), K_2048[1] = x_pow_mod_p(4 * 512 - 32);
}

#define VPCLMUL_TARGET __attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.1")))

VPCLMUL_TARGET static inline __m512i fold4(__m512i acc, __m512i k, __m512i next)
{
    __m512i lo = _mm512_clmulepi64_epi128(acc, k, 0x00);
    __m512i hi = _mm512_clmulepi64_epi128(acc, k, 0x11);
    return _mm512_xor_si512(_mm512_xor_si512(lo, hi), next);
}

#define LOAD4(p) _mm512_loadu_si512((const void *)(p))

/* the unconditioned state c advanced over buf; len >= 256 and a multiple of 16 */
VPCLMUL_TARGET static uint32_t vpclmul_advance(uint32_t c, const uint8_t *buf, size_t len)
{
    pthread_once(&vpclmul_once, vpclmul_init);
    __m512i a[4];
    a[0] = _mm512_xor_si512(LOAD4(buf), _mm512_castsi128_si512(_mm_cvtsi32_si128((int)c)));
#pragma GCC unroll 4
    for (int i = 1; i < 4; i++) a[i] = LOAD4(buf + 64 * i);
    buf += 256;
    len -= 256;
    __m512i k = _mm512_broadcast_i32x4(LOAD(K_2048));
    for (; len >= 256; buf += 256, len -= 256)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) a[i] = fold4(a[i], k, LOAD4(buf + 64 * i));
    k = _mm512_broadcast_i32x4(LOAD(K_512));
    __m512i acc = fold4(a[0], k, a[1]);
    acc = fold4(acc, k, a[2]);
    acc = fold4(acc, k, a[3]);
    for (; len >= 64; buf += 64, len -= 64) acc = fold4(acc, k, LOAD4(buf));
    /* the register's four lanes are 64 consecutive bytes: fold them into one and
     * hand the rest to the 128-bit code as if that were its next chunk */
    __m128i k1 = LOAD(K_128);
    __m128i x = fold(_mm512_extracti32x4_epi32(acc, 0), k1, _mm512_extracti32x4_epi32(acc, 1));
    x = fold(x, k1, _mm512_extracti32x4_epi32(acc, 2));
    x = fold(x, k1, _mm512_extracti32x4_epi32(acc, 3));
    return pclmul_finish(x, buf, len);
}

static uint32_t crc32_vpclmul(uint32_t crc, const uint8_t *buf, size_t len)
{
    if (len < 256) return crc32_pclmul(crc, buf, len); /* too short for four 64-byte lanes */
    size_t n = len & ~(size_t)15;
    return ~table_advance(vpclmul_advance(~crc, buf, n), buf + n, len - n);
}

static int cpu_has_pclmul(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
}

static int cpu_has_vpclmul(void)
{
    __builtin_cpu_init();
    return cpu_has_pclmul() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("vpclmulqdq");
}
#endif

/* ------------------------------------------------------ isa-l, zlib ---- */

#if defined(AIORDMA_HAVE_ISAL)
static uint32_t crc32_isal(uint32_t crc, const uint8_t *buf, size_t len) { return crc32_gzip_refl(crc, buf, len); }
#endif

#if defined(AIORDMA_HAVE_ZLIB)
static uint32_t crc32_zlib(uint32_t crc, const uint8_t *buf, size_t len)
{
    while (len > 0x40000000u) { /* zlib's length is a uInt */
        crc = (uint32_t)crc32(crc, buf, 0x40000000u);
        buf += 0x40000000u;
        len -= 0x40000000u;
    }
    return (uint32_t)crc32(crc, buf, (uInt)len);
}
#endif

/* ----------------------------------------------------------- choice ---- */

static struct crc32_impl impls[5];
static int n_impls;
static pthread_once_t impls_once = PTHREAD_ONCE_INIT;

static void impls_init(void)
{
#if defined(AIORDMA_HAVE_ISAL)
    impls[n_impls++] = (struct crc32_impl){"isa-l", crc32_isal};
#endif
#if defined(HAVE_PCLMUL_CODE)
    if (cpu_has_vpclmul()) impls[n_impls++] = (struct crc32_impl){"vpclmul", crc32_vpclmul};
    if (cpu_has_pclmul()) impls[n_impls++] = (struct crc32_impl){"pclmul", crc32_pclmul};
#endif
#if defined(AIORDMA_HAVE_ZLIB)
    impls[n_impls++] = (struct crc32_impl){"zlib", crc32_zlib};
#endif
    impls[n_impls++] = (struct crc32_impl){"table", crc32_table};
}

const char *crc32_compiled(void)
{
    return ""
#if defined(AIORDMA_HAVE_ISAL)
           "isa-l,"
#endif
#if defined(HAVE_PCLMUL_CODE)
           "vpclmul,pclmul,"
#endif
#if defined(AIORDMA_HAVE_ZLIB)
           "zlib,"
#endif
           "table";
}

int crc32_implementations(const struct crc32_impl **out)
{
    pthread_once(&impls_once, impls_init);
    *out = impls;
    return n_impls;
}

const struct crc32_impl *crc32_chosen(void)
{
    pthread_once(&impls_once, impls_init);
    return &impls[0];
}
