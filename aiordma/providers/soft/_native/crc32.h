/* CRC-32 for the ICRC: the gzip/Ethernet polynomial 0x04C11DB7, bit-reflected
 * (0xEDB88320), with zlib's conditioning (crc32(0, "", 0) == 0; pass the last
 * result back in to continue over the next piece).
 *
 * Several implementations compute the same function; wire_crc32() (wire.h)
 * uses the fastest one this build and this CPU have, chosen once at first use:
 *
 *   isa-l   ISA-L's crc32_gzip_refl (built with libisal-dev; it dispatches on
 *           the CPU itself)
 *   pclmul  x86-64 carry-less-multiply folding (PCLMULQDQ + SSE4.1), chosen at
 *           run time when the CPU has both: memory speed without ISA-L
 *   zlib    zlib's crc32 (built with zlib's headers)
 *   table   slice-by-8 tables: portable C, the reference the others are
 *           tested against
 *
 * tests/unit/test_crc32.py compares every implementation with the others and
 * with Python's zlib.crc32 on random data of every length and alignment.
 */
#ifndef AIORDMA_CRC32_H
#define AIORDMA_CRC32_H

#include <stddef.h>
#include <stdint.h>

typedef uint32_t (*crc32_fn)(uint32_t crc, const uint8_t *buf, size_t len);

struct crc32_impl {
    const char *name;
    crc32_fn fn;
};

/* The implementations this build has and this CPU can run, fastest first
 * (the first is the one wire_crc32 uses); returns how many. */
int crc32_implementations(const struct crc32_impl **out);

/* The implementations this build has, whatever the CPU: "isa-l,vpclmul,..." */
const char *crc32_compiled(void);

/* The chosen implementation (the first of crc32_implementations). */
const struct crc32_impl *crc32_chosen(void);

#endif
