# wire.h: the RoCEv2 codec (BTH and extension headers, the ICRC, the IP-ID solver)
# and the tables c_tables() reports.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "wire.h" nogil:
    enum:
        MAX_HDR_LEN
        ICRC_LEN
    struct pkt:
        uint8_t opcode
        uint8_t ack_req, solicited, migreq, fecn, becn, tver, has_imm
        uint16_t pkey
        uint32_t dest_qp, psn
        uint64_t va
        uint32_t rkey, dma_len
        uint8_t syndrome
        uint32_t msn
        uint32_t imm
        uint64_t swap_add, compare, orig
        const uint8_t *payload
        uint32_t plen
    struct flow:
        int ipv6
        uint8_t src[16]
        uint8_t dst[16]
        uint16_t sport, dport
        uint16_t ip_id
    const uint8_t wire_layout[256]
    int wire_decode(const uint8_t *d, size_t n, pkt *out)
    size_t wire_datagram_length(const pkt *p)
    size_t wire_encode(const pkt *p, const flow *f, uint16_t ip_id, uint8_t *out)
    const char *wire_error_name(int err)
    const char *wire_crc32_name()
    int wire_icrc_ok(const uint8_t *d, size_t n, const flow *f)
    int wire_icrc_ip_id(const uint8_t *d, size_t n, const flow *f)

cdef extern from "wire.h" nogil:
    # the tables and constants c_tables() reports (compared with wire.py by a test)
    enum:
        BTH_LEN
        RETH_LEN
        AETH_LEN
        IMMDT_LEN
        ATOMIC_ETH_LEN
        ATOMIC_ACK_ETH_LEN
        DEFAULT_PKEY
        PSN_MASK
        L_RETH
        L_AETH
        L_IMM
        L_ATOMIC
        L_ATOMIC_ACK
        L_PAYLOAD
        L_VALID
        AETH_ACK
        AETH_RNR_NAK
        AETH_NAK
        NAK_PSN_SEQUENCE_ERROR
        NAK_INVALID_REQUEST
        NAK_REMOTE_ACCESS_ERROR
        NAK_REMOTE_OPERATIONAL_ERROR
        NAK_INVALID_RD_REQUEST
        AETH_CREDITS_INVALID
    const uint8_t wire_hdr_len[256]
    const uint32_t wire_rnr_timer_us[32]
    const char *wire_opcode_name(int op)
    int op_is_first(int op)
    int op_is_last(int op)
    int op_is_request(int op)
    int op_is_response(int op)
