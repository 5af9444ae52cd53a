"""One set of rules, two engines: the soft device's tables agree in C and Python.

The native engine's codec and RC state machine are a port of ``wire.py`` and
``rc.py``; their tables (opcodes, which headers each opcode carries and how
long they are, the first/last/request/response sets, the AETH codes, the RNR
timer table, the per-QP counters, the verbs enumerations the engine writes) are
written twice, once in each language. ``_engine.c_tables()`` reports what the C
code has; every entry is compared here with the Python definition, so a
constant changed on one side only fails this test (the differential tests then
say how the behaviour differs).
"""

from __future__ import annotations

import dataclasses

import pytest

from aiordma.providers.base import Access, QPState, WCOpcode, WCStatus, WROpcode
from aiordma.providers.soft import rc, wire
from aiordma.providers.soft.engine import native_status

available, why = native_status()
if not available:  # pragma: no cover - only where the extension did not build (CI requires it)
    pytestmark = pytest.mark.skip(reason=f"native engine not built: {why}")
else:
    from aiordma.providers.soft._native import _engine

    C = _engine.c_tables()


def test_opcodes() -> None:
    assert C["opcode_names"] == {int(op): op.name for op in wire.Opcode}


def test_header_layout_of_every_opcode() -> None:
    bits = {
        "RETH": wire._RETH,
        "AETH": wire._AETH,
        "IMM": wire._IMM,
        "ATOMIC": wire._ATOMIC,
        "ATOMIC_ACK": wire._ATOMIC_ACK,
        "PAYLOAD": wire._PAYLOAD,
    }
    assert C["layout_bits"] == bits
    assert C["layout"] == wire._LAYOUT
    assert C["header_length"] == wire._HEADER_LENGTH


def test_opcode_sets() -> None:
    assert C["first"] == {int(op) for op in wire.FIRST_OPCODES}
    assert C["last"] == {int(op) for op in wire.LAST_OPCODES}
    assert C["request"] == {int(op) for op in wire.REQUEST_OPCODES}
    assert C["response"] == {int(op) for op in wire.RESPONSE_OPCODES}


def test_header_lengths_and_bth_constants() -> None:
    assert C["lengths"] == {name: getattr(wire, name) for name in C["lengths"]}
    assert set(C["lengths"]) >= {"BTH_LEN", "RETH_LEN", "AETH_LEN", "IMMDT_LEN", "ICRC_LEN", "PSN_MASK"}


def test_aeth_codes() -> None:
    assert C["aeth"] == {name: getattr(wire, name) for name in C["aeth"]}
    assert len(C["aeth"]) == 9


def test_rnr_timer_table() -> None:
    assert C["rnr_timer_us"] == wire.RNR_TIMER_US


def test_per_qp_counters() -> None:
    assert C["rc_counters"] == tuple(f.name for f in dataclasses.fields(rc.Counters))


def test_retry_backoff_cap() -> None:
    assert C["retry_backoff_cap"] == rc.RETRY_BACKOFF_CAP


def test_verbs_enumerations() -> None:
    assert C["access"] == {name: int(Access[name]) for name in C["access"]}
    assert C["wr_opcodes"] == {op.name: int(op) for op in WROpcode}
    assert C["wc_opcodes"] == {op.name: int(op) for op in WCOpcode}
    assert C["wc_status_names"] == {int(s): s.name for s in WCStatus}
    assert C["wc_statuses_written"] == {name: int(WCStatus[name]) for name in C["wc_statuses_written"]}
    assert C["qp_state_names"] == {int(s): s.name for s in QPState}
    assert C["qp_states_used"] == {s.name: int(s) for s in QPState}


def test_each_status_raises_the_error_named_for_it() -> None:
    """errors.py keys its table by the status numbers: each maps to the error its
    docstring names."""
    from aiordma import errors

    for status, cls in errors._STATUS_ERRORS.items():
        assert WCStatus(status).name in (cls.__doc__ or ""), (status, cls)
