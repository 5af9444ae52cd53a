"""Both soft-device engines implement the engine protocol the device facade
talks through (``aiordma.providers.soft.engine``: ``SoftEngine`` and the
``Engine*`` objects it makes), member by member: every attribute, property and
method the protocol declares exists on the real objects of each engine, methods
are callable and take the protocol's parameters. mypy cannot check this (the
native engine is a compiled module, the factory returns ``Any``); this test does,
on live objects of a real device."""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import pytest

from aiordma.providers.base import Access, QPCap
from aiordma.providers.soft import engine as engine_protocol
from aiordma.providers.soft.device import _engine_factory
from aiordma.providers.soft.engine import native_status

ENGINES = ("python", "native") if native_status()[0] else ("python",)
PROTOCOLS = {
    "SoftEngine": engine_protocol.SoftEngine,
    "EnginePD": engine_protocol.EnginePD,
    "EngineMR": engine_protocol.EngineMR,
    "EngineCQ": engine_protocol.EngineCQ,
    "EngineChannel": engine_protocol.EngineChannel,
    "EngineQP": engine_protocol.EngineQP,
    "EngineSRQ": engine_protocol.EngineSRQ,
}


def _members(proto: type) -> dict[str, Any]:
    """The protocol's own members: annotated attributes (None) and methods/properties."""
    out: dict[str, Any] = dict.fromkeys(inspect.get_annotations(proto))
    for name, value in vars(proto).items():
        if name.startswith("_"):
            continue
        if callable(value) or isinstance(value, property):
            out[name] = value
    return out


def _parameters(fn: Any) -> list[str] | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: only callability is checked
    return [p.name for p in sig.parameters.values() if p.name != "self" and p.kind not in (p.VAR_KEYWORD,)]


@pytest.fixture(params=ENGINES)
def objects(request):
    """One live object per protocol, from a real engine bound to a loopback address."""
    make = _engine_factory(request.param)
    eng = make("127.0.0.60", 4791, icrc="strict", capture=None)
    pd = eng.alloc_pd()
    buf = bytearray(4096)
    mr = pd.reg_mr(buf, Access.LOCAL_WRITE, 0x1001, 0x2001)
    channel = eng.create_channel()
    cq = eng.create_cq(16, channel)
    qp = pd.create_qp(0x000123, cq, cq, QPCap(max_send_wr=4, max_recv_wr=4), False)
    srq = pd.create_srq(0x000456, 8, 1)
    srq_qp = pd.create_qp(0x000124, cq, cq, QPCap(max_send_wr=4), False, srq)
    yield (
        request.param,
        {
            "SoftEngine": eng,
            "EnginePD": pd,
            "EngineMR": mr,
            "EngineCQ": cq,
            "EngineChannel": channel,
            "EngineQP": qp,
            "EngineSRQ": srq,
        },
    )
    srq_qp.close()
    srq.close()
    qp.close()
    cq.close()
    channel.close()
    mr.close()
    pd.close()
    eng.close()


def test_every_protocol_member_is_implemented(objects):
    engine, live = objects
    missing, wrong = [], []
    for proto_name, proto in PROTOCOLS.items():
        obj = live[proto_name]
        for name, declared in _members(proto).items():
            if not hasattr(obj, name):
                missing.append(f"{engine} {proto_name}.{name}")
                continue
            if declared is None or isinstance(declared, property):
                continue  # an attribute or property: present is what is checked
            got = getattr(obj, name)
            if not callable(got):
                wrong.append(f"{engine} {proto_name}.{name} is not callable")
                continue
            want, have = _parameters(declared), _parameters(got)
            if want is not None and have is not None and have[: len(want)] != want:
                wrong.append(f"{engine} {proto_name}.{name}{tuple(have)}: the protocol says {tuple(want)}")
    assert missing == [] and wrong == []


def test_the_protocols_are_protocols():
    """The check above covers every protocol engine.py declares (a new one must join it)."""
    declared = {
        name
        for name, obj in vars(engine_protocol).items()
        if isinstance(obj, type)
        and issubclass(obj, Protocol)
        and obj is not Protocol
        and obj.__module__ == engine_protocol.__name__
    }
    assert declared == set(PROTOCOLS)
