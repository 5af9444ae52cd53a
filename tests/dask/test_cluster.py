"""Dask clusters on ``rdma://``: a scheduler, workers (in this process, in worker
processes, under a Nanny) and a client, built with ``distributed.utils_test``
and ``LocalCluster``, on the soft device. Each test runs on Dask's asyncio
and uvloop event loops (``dask_loop``) and checks which one it got.

Worker-to-worker transfers are checked against the backend's byte counters:
every transfer a worker records in ``transfer_incoming_log`` came through an
``rdma://`` comm, so its bytes are in the counters of that peer."""

from __future__ import annotations

import os
import time
from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster, Nanny
from distributed.utils_test import gen_cluster, gen_test

from aiordma.integrations.dask import byte_counters
from aiordma.providers.soft.engine import native_status

from .conftest import running_loop_kind

RDMA = {"protocol": "rdma"}


#: keys of at least this size travel as large frames (pulled by RDMA Read)
LARGE = 256 * 1024


def _transfers_by_peer(worker: Any) -> dict[str, tuple[int, int]]:
    """Bytes a worker fetched from each other worker, as it logged them: all, and
    those of keys large enough to travel as large frames."""
    out: dict[str, tuple[int, int]] = {}
    for entry in worker.transfer_incoming_log:
        total, large = out.get(entry["who"], (0, 0))
        big = sum(n for n in entry["keys"].values() if n >= LARGE)
        out[entry["who"]] = (total + entry["total"], large + big)
    return out


async def _loop_kind_async() -> str:
    return running_loop_kind()


def _native_engine() -> bool:
    """Whether this run's soft devices use the native engine (cross-memory attach is its)."""
    return native_status()[0] and os.environ.get("AIORDMA_SOFT_ENGINE", "native") == "native"


def _counters() -> dict[str, Any]:
    return byte_counters()


@gen_cluster(client=True, scheduler_kwargs=RDMA, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)])
async def test_gen_cluster_transposes_a_chunked_array(c, s, a, b, dask_loop, soft_device) -> None:
    assert running_loop_kind() == dask_loop
    assert s.address.startswith("rdma://")
    assert a.address.startswith("rdma://") and b.address.startswith("rdma://")
    x = da.random.RandomState(42).random((1200, 1200), chunks=(400, 400))  # 9 chunks of 1.28 MB: large frames
    x_np = await c.compute(x)
    y = x + x.T  # every off-diagonal chunk meets its mirror: transfers between the workers
    result = await c.compute(y)
    np.testing.assert_array_equal(result, x_np + x_np.T)
    total = await c.compute((x + x.T).sum())
    assert total == pytest.approx((x_np + x_np.T).sum())
    fetched = {w.address: _transfers_by_peer(w) for w in (a, b)}
    assert sum(large for v in fetched.values() for _, large in v.values()) > 0, "no large transfer between workers"
    peers = byte_counters()["peers"]
    for worker, by_peer in fetched.items():
        for peer, (nbytes, large) in by_peer.items():
            # (one process: the counts toward a peer also hold the scheduler's comms to it)
            assert peers[peer]["rx_bytes"] >= nbytes, (worker, peer)
            assert peers[peer]["rx_large_bytes"] >= large, (worker, peer)


@gen_cluster(
    client=True,
    scheduler_kwargs=RDMA,
    nthreads=[("127.0.0.1", 1)],
    Worker=Nanny,
    worker_kwargs={"death_timeout": 30},
)
async def test_a_nanny_worker(c, s, n, dask_loop, soft_device) -> None:
    """The Nanny spawns its worker process: the backend is found there through the
    entry point, and the worker runs on the configured loop."""
    assert running_loop_kind() == dask_loop
    assert n.address.startswith("rdma://") and n.worker_address.startswith("rdma://")
    assert await c.submit(lambda v: v + 1, 41) == 42
    arr = await c.submit(np.arange, 500_000)  # 4 MB back from the worker process
    np.testing.assert_array_equal(arr, np.arange(500_000))
    (kind,) = (await c.run(_loop_kind_async)).values()
    assert kind == dask_loop
    (counts,) = (await c.run(_counters)).values()
    (dev,) = counts["devices"].values()
    assert dev["tx_large_bytes"] >= 4_000_000 and dev["device"]["tx_packets"] > 0


@gen_test(timeout=30)
async def test_an_unreachable_scheduler_is_an_oserror_within_the_timeout(dask_loop, soft_device) -> None:
    assert running_loop_kind() == dask_loop
    t0 = time.monotonic()
    with pytest.raises(OSError, match="rdma://127.0.0.1:1"):
        await Client("rdma://127.0.0.1:1", asynchronous=True, timeout="1s")
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_local_cluster(processes: bool, dask_loop: str) -> None:
    with (
        dask.config.set({"distributed.admin.event-loop": dask_loop}),
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=processes,
            protocol="rdma",
            dashboard_address=None,
        ) as cluster,
        Client(cluster) as client,
    ):
        assert cluster.scheduler_address.startswith("rdma://")
        assert client.run_on_scheduler(_loop_kind_async) == dask_loop
        assert set(client.run(_loop_kind_async).values()) == {dask_loop}
        x = da.random.RandomState(0).random((1600, 1600), chunks=(400, 400))
        got = (x + x.T).sum().compute()
        x_np = x.compute()
        assert got == pytest.approx((x_np + x_np.T).sum())
        if processes:
            # one process per worker: its counts toward the other worker are its fetches
            logs = client.run(lambda dask_worker: _transfers_by_peer(dask_worker))
            counts = client.run(_counters)
            fetched = 0
            for worker, by_peer in logs.items():
                for peer, (nbytes, large) in by_peer.items():
                    fetched += large
                    rx = counts[worker]["peers"][peer]
                    # every fetched byte came over rdma://, the large keys as large frames;
                    # the rest of what this worker received from that peer is framing
                    assert rx["rx_bytes"] >= nbytes, (worker, peer)
                    assert rx["rx_large_bytes"] >= large, (worker, peer)
                    assert rx["rx_bytes"] <= nbytes * 1.01 + 64 * 1024, (worker, peer)
            assert fetched > 0, "no large transfer between the workers"
            if _native_engine():
                # two worker processes of one host: the large frames' RDMA Reads moved by
                # cross-memory attach, every byte of them
                cma = sum(d["device"].get("rx_cma_bytes", 0) for c in counts.values() for d in c["devices"].values())
                assert cma >= fetched, (cma, fetched)
