"""The client of tests/dask/test_two_hosts.py, run on one of the simulated hosts:
``python -m tests.dask.two_hosts_client rdma://SCHEDULER:PORT``.

Waits for two workers, transposes a chunked array across them, checks the
result against numpy and prints, as JSON, what each process's ``rdma://``
comms moved (byte counters and device labels) and what each worker logged
in ``transfer_incoming_log``."""

from __future__ import annotations

import json
import sys

import dask.array as da
import numpy as np
from distributed import Client

from aiordma.integrations.dask import byte_counters


def _transfers(dask_worker) -> dict[str, int]:
    out: dict[str, int] = {}
    for entry in dask_worker.transfer_incoming_log:
        out[entry["who"]] = out.get(entry["who"], 0) + entry["total"]
    return out


def main(address: str) -> None:
    with Client(address, timeout=60) as client:
        client.wait_for_workers(2, timeout=60)
        x = da.random.RandomState(1).random((2000, 2000), chunks=(500, 500))  # 16 chunks of 2 MB
        x_np = x.compute()
        y = (x + x.T).compute()
        ok = bool(np.array_equal(y, x_np + x_np.T))
        total = float((x + x.T).sum().compute())
        out = {
            "scheduler": client.scheduler.address,
            "result_ok": ok and abs(total - float((x_np + x_np.T).sum())) < 1e-6 * abs(total),
            "workers": client.run(byte_counters),
            "transfers": client.run(_transfers),
            "scheduler_counters": client.run_on_scheduler(byte_counters),
            "client_counters": byte_counters(),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
