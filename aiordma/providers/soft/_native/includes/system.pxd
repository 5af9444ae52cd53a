# The POSIX socket and thread declarations the engine uses (sockaddr for _inject,
# pthread_mutex_trylock for the engine lock taken with the GIL held).
from libc.stdint cimport uint16_t, uint32_t


cdef extern from "<sys/uio.h>":
    struct iovec:
        void *iov_base
        size_t iov_len

cdef extern from "<sys/socket.h>":
    struct sockaddr_storage:
        unsigned short ss_family

cdef extern from "<arpa/inet.h>" nogil:
    int inet_pton(int af, const char *src, void *dst)
cdef extern from "<netinet/in.h>" nogil:
    ctypedef unsigned int socklen_t
    struct in_addr:
        uint32_t s_addr
    struct sockaddr_in:
        unsigned short sin_family
        uint16_t sin_port
        in_addr sin_addr
    struct in6_addr:
        pass
    struct sockaddr_in6:
        unsigned short sin6_family
        uint16_t sin6_port
        in6_addr sin6_addr
    uint16_t htons(uint16_t)
    int AF_INET, AF_INET6

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_trylock(pthread_mutex_t *m)
