"""Tests against a real verbs device through pyverbs (kernel Soft-RoCE in a VM).

Tests marked ``rxe`` need an RDMA device with an active port; without one
(this machine's kernel has no RDMA) they are skipped. Run them in the VM:

    scripts/rxe-vm run -- .venv/bin/python -m pytest tests/rxe -m rxe -q

Inside the VM ``AIORDMA_RXE_DEVICE`` (rxe0), ``AIORDMA_RXE_GID_INDEX``,
``AIORDMA_RXE_IP`` and ``AIORDMA_RXE_NETDEV`` describe the device.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest

from aiordma.errors import DeviceNotFoundError, ProviderUnavailableError
from aiordma.providers.base import QPAttr, QPCap

RUN_HINT = "run them in the VM: scripts/rxe-vm run -- .venv/bin/python -m pytest tests/rxe -m rxe -q"


def pytest_configure(config):
    config.addinivalue_line("markers", "rxe: needs a real RDMA verbs device via pyverbs (run under scripts/rxe-vm)")


_availability: tuple[bool, str] | None = None


def device_availability() -> tuple[bool, str]:
    """(available, reason) for a pyverbs device with an active port."""
    global _availability
    if _availability is None:
        try:
            from aiordma.providers.pyverbs import list_devices, open_device

            names = list_devices()
            if not names:
                _availability = (False, f"no RDMA device in this kernel; {RUN_HINT}")
            else:
                want = os.environ.get("AIORDMA_RXE_DEVICE") or None
                open_device(want).close()
                _availability = (True, "")
        except ProviderUnavailableError as e:
            _availability = (False, f"pyverbs unavailable: {e}")
        except DeviceNotFoundError as e:
            _availability = (False, f"{e}; {RUN_HINT}")
    return _availability


def pytest_collection_modifyitems(config, items):
    marked = [it for it in items if it.get_closest_marker("rxe") is not None]
    if not marked:
        return
    ok, reason = device_availability()
    if ok:
        return
    skip = pytest.mark.skip(reason=reason)
    for it in marked:
        it.add_marker(skip)


# ---------------------------------------------------------------- fixtures ----


@pytest.fixture(scope="session")
def dev():
    from aiordma.providers.pyverbs import open_device

    d = open_device(os.environ.get("AIORDMA_RXE_DEVICE") or None)
    yield d
    d.close()


def _wait_wcs(cq, n: int, timeout: float = 10.0):
    """Poll ``cq`` until ``n`` work completions arrived (busy-poll with short sleeps)."""
    out = []
    deadline = time.monotonic() + timeout
    while True:
        out += cq.poll(n - len(out))
        if len(out) >= n:
            return out
        if time.monotonic() > deadline:
            raise AssertionError(f"only {len(out)} of {n} completions after {timeout}s: {out}")
        time.sleep(0.0002)


def _connect(dev, qp, peer_qpn: int, **rtr) -> None:
    """RESET -> INIT -> RTR -> RTS toward ``peer_qpn`` on this same device (loopback)."""
    gid = dev.query_gid().gid
    qp.to_init(QPAttr())
    qp.to_rtr(QPAttr(dest_qp_num=peer_qpn, dgid=gid, **rtr))
    qp.to_rts(QPAttr())


@pytest.fixture
def wait_wcs():
    """``wait_wcs(cq, n, timeout=10.0)``: poll until n work completions arrived."""
    return _wait_wcs


@pytest.fixture
def connect():
    """``connect(dev, qp, peer_qpn, **rtr_attrs)``: take a QP to RTS (loopback)."""
    return _connect


@dataclass
class Pair:
    """Two RC QPs on one device connected to each other; a is the requester side."""

    dev: object
    pd: object
    cq_a: object
    cq_b: object
    qp_a: object
    qp_b: object


@pytest.fixture(params=["extended", "post_send"])
def pair(dev, request, monkeypatch):
    """Two QPs, posting with the extended verbs (ibv_wr_*, kernel rxe has them) or,
    with AIORDMA_PYVERBS_EXTENDED=0, with ibv_post_send: each test runs both."""
    monkeypatch.setenv("AIORDMA_PYVERBS_EXTENDED", "1" if request.param == "extended" else "0")
    pd = dev.alloc_pd()
    cq_a = dev.create_cq(64)
    cq_b = dev.create_cq(64)
    cap = QPCap(max_send_wr=32, max_recv_wr=32, max_send_sge=4, max_recv_sge=4)
    qp_a = pd.create_qp(cq_a, cq_a, cap)
    qp_b = pd.create_qp(cq_b, cq_b, cap)
    assert qp_a.extended is (request.param == "extended"), "kernel rxe creates extended QPs"
    _connect(dev, qp_a, qp_b.qp_num)
    _connect(dev, qp_b, qp_a.qp_num)
    yield Pair(dev, pd, cq_a, cq_b, qp_a, qp_b)
    pd.close()  # QPs and MRs first
    cq_a.close()
    cq_b.close()
