"""The pyverbs provider's work-completion conversion, without a device: it maps
ibv_wc fields to aiordma's enums by table (no Enum call per completion), with
the falsy members (IBV_WC_SUCCESS, IBV_WC_SEND, no flags) found like any other,
and values outside the tables still converted (the Enum's own fallback)."""

from __future__ import annotations

import socket
from types import SimpleNamespace

from aiordma.providers import pyverbs
from aiordma.providers.base import WCFlags, WCOpcode, WCStatus


def wc(**kw):
    base = dict(wr_id=7, status=0, opcode=0, byte_len=64, qp_num=0x11, src_qp=0, imm_data=0, wc_flags=0, vendor_err=0)
    base.update(kw)
    return SimpleNamespace(**base)


def test_the_zero_members_come_from_the_tables():
    out = pyverbs._convert_wc(wc())
    assert out.status is WCStatus.IBV_WC_SUCCESS and out.opcode is WCOpcode.IBV_WC_SEND
    assert out.wc_flags is WCFlags(0) and out.imm_data is None
    assert (out.wr_id, out.byte_len, out.qp_num) == (7, 64, 0x11)


def test_an_immediate_is_host_order_on_receives_only():
    flags = int(WCFlags.IBV_WC_WITH_IMM)
    recv = pyverbs._convert_wc(wc(opcode=int(WCOpcode.IBV_WC_RECV), wc_flags=flags, imm_data=socket.htonl(0x01020304)))
    assert recv.imm_data == 0x01020304 and recv.wc_flags & WCFlags.IBV_WC_WITH_IMM
    assert recv.opcode is WCOpcode.IBV_WC_RECV
    # rxe flags the requester's RDMA_WRITE completion too (with imm 0): not an immediate
    write = pyverbs._convert_wc(wc(opcode=int(WCOpcode.IBV_WC_RDMA_WRITE), wc_flags=flags))
    assert write.imm_data is None


def test_every_status_and_opcode_converts_and_the_flags_are_cached():
    for status in WCStatus:
        assert pyverbs._convert_wc(wc(status=int(status))).status is status
    for opcode in WCOpcode:
        assert pyverbs._convert_wc(wc(opcode=int(opcode))).opcode is opcode
    flags = int(WCFlags.IBV_WC_WITH_IMM | WCFlags.IBV_WC_GRH)
    first = pyverbs._convert_wc(wc(wc_flags=flags)).wc_flags
    assert first == flags and pyverbs._convert_wc(wc(wc_flags=flags)).wc_flags is first


def test_a_status_no_table_knows_is_still_converted():
    out = pyverbs._convert_wc(wc(status=99))
    assert out.status == 99
