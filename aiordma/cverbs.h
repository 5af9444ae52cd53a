/* The verbs as C calls: what a provider offers aiordma's compiled core.
 *
 * libibverbs gives every device a table of function pointers (struct
 * ibv_context_ops: post_send, post_recv, poll_cq, req_notify_cq), and
 * ibv_post_send() is an inline call through it. This is the same idea one level
 * up: a provider whose queue pairs and completion queues can be driven from C
 * (the soft device's native engine; pyverbs over libibverbs) exports one
 * struct cverbs_ops in a PyCapsule named CVERBS_CAPSULE, and its QP and CQ
 * objects name themselves (QueuePair.c_verbs(), CompletionQueue.c_verbs(),
 * SharedReceiveQueue.c_verbs()).
 * aiordma._core then posts work requests and polls completions without building
 * a SendWR, an SGE or a WorkCompletion object per operation.
 *
 * Every call is made with the GIL held, on the thread of the event loop the
 * connection lives on; a provider releases the GIL itself where it blocks. A
 * call returns -1 with a Python exception set when it fails (the same exception
 * the provider's Python method raises), else what it says.
 *
 * The structs are struct ibv_send_wr / ibv_sge / ibv_wc with only the fields
 * aiordma uses, fixed-width, in an order without padding surprises.
 */
#ifndef AIORDMA_CVERBS_H
#define AIORDMA_CVERBS_H

#include <stdint.h>

#define CVERBS_VERSION 2
#define CVERBS_CAPSULE "aiordma.cverbs.v2"

/* the most SGEs a work request of the core carries (QPCap.max_send_sge) */
#define CVERBS_MAX_SGE 4

struct cverbs_sge { /* struct ibv_sge */
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
};

struct cverbs_send_wr { /* struct ibv_send_wr, one request (chains are arrays) */
    uint64_t wr_id;
    uint64_t remote_addr; /* RDMA Write/Read, atomics */
    uint64_t compare_add; /* atomics */
    uint64_t swap;
    uint32_t rkey;
    uint32_t imm_data; /* host order; used when has_imm */
    int32_t opcode;    /* enum ibv_wr_opcode */
    uint32_t send_flags; /* enum ibv_send_flags: IBV_SEND_SIGNALED = 2 */
    int32_t has_imm;
    int32_t num_sge;
    struct cverbs_sge sg_list[CVERBS_MAX_SGE];
};

struct cverbs_wc { /* struct ibv_wc */
    uint64_t wr_id;
    uint32_t byte_len;
    uint32_t qp_num;
    uint32_t src_qp;
    uint32_t imm_data; /* host order; valid when has_imm */
    uint32_t vendor_err;
    uint8_t status; /* enum ibv_wc_status */
    uint8_t has_imm;
    uint16_t opcode; /* enum ibv_wc_opcode (IBV_WC_RECV = 128, ...) */
};

struct cverbs_ops {
    unsigned version; /* CVERBS_VERSION */
    /* ibv_post_send of n linked requests (one doorbell); 0, or -1 with an exception */
    int (*post_send)(void *qp, const struct cverbs_send_wr *wrs, int n);
    /* ibv_post_recv of one request; 0, or -1 with an exception */
    int (*post_recv)(void *qp, uint64_t wr_id, const struct cverbs_sge *sges, int nsge);
    /* ibv_poll_cq: up to n completions into wcs; how many, or -1 with an exception */
    int (*poll_cq)(void *cq, struct cverbs_wc *wcs, int n);
    /* ibv_req_notify_cq(cq, 0); 0, or -1 with an exception */
    int (*req_notify_cq)(void *cq);
    /* traffic is coming on this CQ's device (the soft device receives on the loop's
     * thread for a while): what CompletionChannel.expect_traffic does; may be NULL */
    void (*expect)(void *cq);
    /* ibv_post_srq_recv of one request to a shared receive queue (the handle its
     * c_verbs() gives); 0, or -1 with an exception; may be NULL (no SRQs from C) */
    int (*post_srq_recv)(void *srq, uint64_t wr_id, const struct cverbs_sge *sges, int nsge);
};

#endif
