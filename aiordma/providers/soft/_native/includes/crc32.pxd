# crc32.h: the CRC-32 implementations the ICRC chooses from (fastest first).
from libc.stdint cimport uint8_t, uint32_t


cdef extern from "crc32.h" nogil:
    ctypedef uint32_t (*crc32_fn)(uint32_t crc, const uint8_t *buf, size_t len)
    struct crc32_impl:
        const char *name
        crc32_fn fn
    int c_crc32_implementations "crc32_implementations"(const crc32_impl **out)
    const char *c_crc32_compiled "crc32_compiled"()
