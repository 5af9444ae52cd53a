"""Dask's own ``/metrics`` shows aiordma's series on a cluster that uses ``rdma://``.

A ``LocalCluster`` over ``rdma://`` (worker processes, their HTTP servers on free
ports) runs a computation whose chunks move between the workers; a real Prometheus
server (Debian's package; skipped with the reason where it is absent, CI installs
it) scrapes every worker's ``/metrics`` (the endpoint ``distributed`` serves from
``prometheus_client.REGISTRY``), and the test reads, through Prometheus's query API,
non-zero aiordma byte series for every worker: the backend's Dask byte counters and
the soft device's own."""

from __future__ import annotations

import dask
import dask.array as da
import pytest
from distributed import Client, LocalCluster

from ..support.prometheus_server import MISSING, PROMETHEUS, PrometheusServer

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason=MISSING)


def _http_port(dask_worker) -> int:  # run on each worker
    return int(dask_worker.http_server.port)


def test_workers_metrics_endpoint_carries_aiordma_series(dask_loop: str) -> None:
    with (
        dask.config.set({"distributed.admin.event-loop": dask_loop}),
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            protocol="rdma",
            dashboard_address=None,
            worker_dashboard_address="127.0.0.1:0",
        ) as cluster,
        Client(cluster) as client,
    ):
        x = da.random.RandomState(0).random((1600, 1600), chunks=(400, 400))
        assert float((x + x.T).sum().compute()) > 0
        ports = client.run(_http_port)
        targets = [f"127.0.0.1:{p}" for p in ports.values()]
        with PrometheusServer({"dask-workers": targets}) as prom:
            for series in (
                "aiordma_dask_sent_bytes_total",
                "aiordma_dask_received_bytes_total",
                "aiordma_device_sent_bytes_total",
            ):
                per_worker = prom.wait_for(
                    f"sum by (instance) ({series})",
                    lambda r: len(r) == len(targets) and all(v > 0 for _, v in r),
                    timeout=60,
                )
                assert {labels["instance"] for labels, _ in per_worker} == set(targets)
            ops = prom.wait_for('sum(aiordma_operations_total{op="send"})', lambda r: r and r[0][1] > 0)
            assert ops[0][1] > 0
            # Dask's own series are on the same endpoint: it is the one distributed serves
            threads = prom.wait_for("dask_worker_threads", lambda r: len(r) == len(targets))
            assert all(v == 1 for _, v in threads)
