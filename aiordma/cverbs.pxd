# The verbs as C calls (cverbs.h): the function table a provider exports for the
# compiled core (aiordma._core). Declarations only: cimported by the core and by
# the providers that implement it (the soft device's native engine).
from libc.stdint cimport int32_t, uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "cverbs.h":
    enum:
        CVERBS_VERSION
        CVERBS_MAX_SGE
    const char *CVERBS_CAPSULE

    struct cverbs_sge:
        uint64_t addr
        uint32_t length
        uint32_t lkey

    struct cverbs_send_wr:
        uint64_t wr_id
        uint64_t remote_addr
        uint64_t compare_add
        uint64_t swap
        uint32_t rkey
        uint32_t imm_data
        int32_t opcode
        uint32_t send_flags
        int32_t has_imm
        int32_t num_sge
        cverbs_sge sg_list[CVERBS_MAX_SGE]

    struct cverbs_wc:
        uint64_t wr_id
        uint32_t byte_len
        uint32_t qp_num
        uint32_t src_qp
        uint32_t imm_data
        uint32_t vendor_err
        uint8_t status
        uint8_t has_imm
        uint16_t opcode

    struct cverbs_ops:
        unsigned version
        int (*post_send)(void *qp, const cverbs_send_wr *wrs, int n) except -1
        int (*post_recv)(void *qp, uint64_t wr_id, const cverbs_sge *sges, int nsge) except -1
        int (*poll_cq)(void *cq, cverbs_wc *wcs, int n) except -1
        int (*req_notify_cq)(void *cq) except -1
        void (*expect)(void *cq) noexcept
        int (*post_srq_recv)(void *srq, uint64_t wr_id, const cverbs_sge *sges, int nsge) except -1
