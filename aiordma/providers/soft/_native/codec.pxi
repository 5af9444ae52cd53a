# The wire codec in C, for the tests that compare it with wire.py.

# ------------------------------------------------------ the wire codec ----

def encode(packet, pyflow, ip_id=None):
    """The datagram for a :class:`wire.Packet` on a :class:`wire.Flow`, encoded in C."""
    cdef pkt p
    cdef flow f
    if packet.opcode not in _wire._LAYOUT:
        raise ValueError(f"cannot encode opcode 0x{packet.opcode:02x}: not an RC opcode")
    _fill_pkt(&p, packet)
    payload = bytes(packet.payload)
    p.payload = <const uint8_t *>PyBytes_AS_STRING(payload)
    p.plen = len(payload)
    _set_flow(&f, pyflow)
    out = PyBytes_FromStringAndSize(NULL, wire_datagram_length(&p))
    wire_encode(&p, &f, f.ip_id if ip_id is None else (ip_id & 0xFFFF), <uint8_t *>PyBytes_AS_STRING(out))
    return out


def decode(datagram):
    """Parse a datagram in C into a :class:`wire.Packet` (raises wire.MalformedPacketError)."""
    cdef pkt p
    data = bytes(datagram)
    cdef int err = wire_decode(<const uint8_t *>PyBytes_AS_STRING(data), len(data), &p)
    if err:
        raise _wire.MalformedPacketError(wire_error_name(err).decode())
    return _packet_obj(&p)


def icrc_ok(datagram, pyflow):
    cdef flow f
    _set_flow(&f, pyflow)
    data = bytes(datagram)
    return bool(wire_icrc_ok(<const uint8_t *>PyBytes_AS_STRING(data), len(data), &f))


def icrc_ip_id(datagram, pyflow):
    """As wire.icrc_ip_id, in C."""
    cdef flow f
    _set_flow(&f, pyflow)
    data = bytes(datagram)
    cdef int r = wire_icrc_ip_id(<const uint8_t *>PyBytes_AS_STRING(data), len(data), &f)
    return None if r < 0 else r

