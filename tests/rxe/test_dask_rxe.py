"""A Dask cluster over ``rdma://`` on kernel Soft-RoCE (rxe0 in scripts/rxe-vm):
the scheduler and two workers (``gen_cluster``) each on the pyverbs provider,
task results moving between the workers by the kernel's RDMA Read, on both of
Dask's event loops."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("distributed", reason="Dask distributed is not installed: pip install 'aiordma[dask]'")

import dask.array as da
import distributed.utils_test as dask_utils_test
import numpy as np
from distributed.utils_test import gen_cluster

from aiordma.integrations.dask import byte_counters

pytestmark = pytest.mark.rxe

DEVICE = os.environ.get("AIORDMA_RXE_DEVICE") or "rxe0"
CONFIG = {"distributed.comm.rdma.provider": "pyverbs", "distributed.comm.rdma.device": DEVICE}


@pytest.fixture(params=["asyncio", "uvloop"])
def dask_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    # gen_cluster resets Dask's configuration to this copy before it creates its loop
    monkeypatch.setitem(dask_utils_test.original_config["distributed"]["admin"], "event-loop", request.param)
    return str(request.param)


@gen_cluster(
    client=True,
    scheduler_kwargs={"protocol": "rdma"},
    nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)],
    config=CONFIG,
    timeout=240,
)
async def test_a_dask_cluster_on_kernel_rxe(c, s, a, b, dask_loop) -> None:
    import asyncio

    assert type(asyncio.get_running_loop()).__module__.startswith(dask_loop)
    assert s.address.startswith("rdma://")
    x = da.random.RandomState(0).random((1000, 1000), chunks=(500, 500))  # 4 chunks of 2 MB
    x_np = await c.compute(x)
    got = await c.compute(x + x.T)
    np.testing.assert_array_equal(got, x_np + x_np.T)
    counts = byte_counters()
    assert any(label.startswith(f"pyverbs:{DEVICE}") for label in counts["devices"]), counts["devices"]
    fetched = sum(e["total"] for w in (a, b) for e in w.transfer_incoming_log)
    assert fetched > 0, "the workers exchanged nothing"
    large = sum(p["rx_large_bytes"] for p in counts["peers"].values())
    assert large >= 2_000_000  # chunks moved as large frames: the kernel's RDMA Read
