"""``aiordma doctor``'s check of the ``rdma://`` Dask backend, on every path
(the facts it looks at replaced: fault injection through ``backend_facts``).
tests/dask/test_doctor_dask.py runs it for real with distributed installed."""

from __future__ import annotations

import pytest

from aiordma.tools.doctor import OK, SKIP, WARN, Context, Options, Probe, check_dask
from aiordma.tools.doctor import dask as dask_check

OURS = {
    "distributed": "2026.8.0",
    "entry_points": [dask_check.ENTRY_POINT],
    "backend": "aiordma.integrations.dask.backend.RDMABackend",
    "ours": True,
    "provider": "auto",
    "device": None,
    "soft_address": None,
    "token": None,
}


def _run(monkeypatch: pytest.MonkeyPatch, facts: dict, env: dict | None = None):
    monkeypatch.setattr(dask_check, "backend_facts", lambda: dict(facts))
    (check,) = check_dask(Context(Options(), Probe(env=env or {})))
    assert check.name == "Dask backend"
    return check


def test_without_distributed_the_check_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    check = _run(monkeypatch, {"distributed": None})
    assert check.status == SKIP
    assert "not installed" in check.seen and "aiordma[dask]" in check.fix


def test_the_backend_registered_and_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    check = _run(monkeypatch, OURS)
    assert check.status == OK
    assert "rdma:// is aiordma's backend" in check.seen and "no rendezvous token" in check.seen
    assert "distributed.comm.rdma.token" in check.fix
    check = _run(monkeypatch, OURS, env={"AIORDMA_TOKEN": "s3cret"})
    assert "rendezvous token from AIORDMA_TOKEN" in check.seen and "s3cret" not in check.seen
    assert check.fix == ""
    check = _run(monkeypatch, OURS, env={"AIORDMA_TOKEN_FILE": "/run/secrets/aiordma"})
    assert "rendezvous token from AIORDMA_TOKEN_FILE" in check.seen
    check = _run(monkeypatch, {**OURS, "token": "distributed.comm.rdma.token", "soft_address": "10.0.0.1:0"})
    assert "token from distributed.comm.rdma.token" in check.seen and "soft device at 10.0.0.1:0" in check.seen


def test_another_package_owning_rdma_is_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    check = _run(monkeypatch, {**OURS, "ours": False, "backend": "other.Backend", "entry_points": ["other:Backend"]})
    assert check.status == WARN
    assert "other.Backend" in check.seen and "other:Backend" in check.seen


def test_a_bad_setting_is_a_warning_that_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    facts = {"distributed": "2026.8.0", "error": "ValueError: distributed.comm.rdma.gid-index must be ..."}
    check = _run(monkeypatch, facts)
    assert check.status == WARN
    assert "gid-index" in check.seen
