"""RDMA CM's sans-IO parts: the hello in the REQ/REP private data, a REJ's reason,
the librdmacm structs, the ``_rv`` control op; and the clear errors where RDMA
CM cannot run (the soft device, a machine without ``rdma_ucm``). The
connections themselves run on kernel rxe: tests/rxe/test_rdma_cm.py."""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket

import msgpack
import pytest

import aiordma
from aiordma.cm import CMHello, rejection_reason
from aiordma.control import RESERVED_OPS, ControlMessages
from aiordma.errors import ProtocolVersionError, ProviderUnavailableError, RendezvousError
from aiordma.providers import librdmacm


def test_the_hello_round_trips_in_padded_private_data():
    hello = CMHello(streams=True, mtu=1024, recv_buffers=64, recv_buffer_size=8192)
    packed = hello.pack()
    assert len(packed) <= librdmacm.REQ_PRIVATE_DATA
    # the CM hands the receiver the whole private-data field, zero padded
    assert CMHello.parse(packed + bytes(librdmacm.REQ_PRIVATE_DATA - len(packed))) == hello
    assert CMHello.parse(CMHello(False, 4096, 0, 0).pack()).streams is False


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "not an aiordma hello"),
        (b"rping", "not an aiordma hello"),
        (bytes(56), "not an aiordma hello"),
        (b"AIOR\x01\x00" + (3000).to_bytes(2, "big") + bytes(8), "invalid"),
        (b"AIOR\x01\x00" + (1024).to_bytes(2, "big") + (1 << 21).to_bytes(4, "big") + bytes(4), "invalid"),
    ],
)
def test_what_is_not_an_aiordma_hello_is_refused(data, match):
    with pytest.raises(RendezvousError, match=match):
        CMHello.parse(data)


def test_another_version_is_a_protocol_version_error():
    data = b"AIOR\x02" + CMHello(False, 1024, 1, 1).pack()[5:]
    with pytest.raises(ProtocolVersionError, match="version 2"):
        CMHello.parse(data)


def test_a_reject_reason_is_read_only_from_an_aiordma_server():
    assert rejection_reason(b"aiordma: the server is closing\0\0\0") == "the server is closing"
    assert rejection_reason(b"") is None
    assert rejection_reason(b"\x00" * 148) is None


def test_the_structs_have_librdmacm_and_libibverbs_layouts():
    """Offsets as in rdma_cma.h and verbs.h on x86-64 and aarch64 (LP64)."""
    assert ctypes.sizeof(librdmacm._ConnParam) == 24
    assert librdmacm._ConnParam.qp_num.offset == 16
    assert librdmacm._Event.conn.offset == 24
    assert ctypes.sizeof(librdmacm._AHAttr) == 32
    assert librdmacm._QPAttr.ah_attr.offset == 56
    assert librdmacm._QPAttr.max_rd_atomic.offset == 126
    assert ctypes.sizeof(librdmacm._QPAttr) == 144


def test_sockaddrs_are_built_and_read_back():
    raw = librdmacm.sockaddr("10.0.2.15", 18515).raw
    assert librdmacm.parse_sockaddr(raw) == ("10.0.2.15", 18515)
    assert librdmacm.parse_sockaddr(librdmacm.sockaddr("fe80::1", 7174).raw) == ("fe80::1", 7174)
    assert librdmacm.parse_sockaddr(librdmacm.sockaddr(None, 1).raw) == ("0.0.0.0", 1)
    assert int.from_bytes(raw[:2], "little") == socket.AF_INET


def test_the_rendezvous_op_is_reserved_and_dispatched_only_when_expected():
    assert "_rv" in RESERVED_OPS
    with pytest.raises(ValueError, match="reserved"):
        ControlMessages.encode({"op": "_rv", "m": {"t": "bye"}})
    got = []
    loop = asyncio.new_event_loop()
    try:
        control = ControlMessages(
            loop, announced=got.append, pulled=got.append, emit=lambda e: got.append(e) or True, violation=got.append
        )
        message = ControlMessages.rendezvous_message({"t": "bye", "reason": "done"})
        control.receive(message)  # nobody takes them: dropped, not given to the event handler
        assert got == []
        control.on_rendezvous = got.append
        control.receive(message)
        control.receive(msgpack.packb({"op": "_rv", "m": "not a map"}))
        assert got == [{"t": "bye", "reason": "done"}]
        control.close()
        assert control.on_rendezvous is None
    finally:
        loop.close()


async def test_the_soft_device_has_no_rdma_cm():
    for kw in ({"provider": "soft"}, {"device": "soft0"}):
        with pytest.raises(ProviderUnavailableError, match="soft device has no connection manager"):
            await aiordma.connect("127.0.0.1", 1, rdma_cm=True, **kw)


@pytest.mark.skipif(os.path.exists("/dev/infiniband/rdma_cm"), reason="this machine has RDMA CM")
async def test_without_rdma_cm_a_connect_is_a_connection_error_that_says_why():
    with pytest.raises(ConnectionError, match="rdma_ucm|librdmacm"):
        await aiordma.connect("127.0.0.1", 1, rdma_cm=True, provider="pyverbs")


@pytest.mark.skipif(os.path.exists("/dev/infiniband/rdma_cm"), reason="this machine has RDMA CM")
async def test_without_rdma_cm_a_server_does_not_start():
    async def nothing(conn):
        pass

    with pytest.raises(ConnectionError, match="rdma_ucm|librdmacm"):
        await aiordma.start_server(nothing, "0.0.0.0", 0, rdma_cm=True, token=b"x" * 32, provider="soft")
