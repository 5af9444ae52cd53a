#!/usr/bin/env python3
"""A Dask computation whose task results move between workers over RDMA.

``(x + x.T).sum()`` of a chunked random array: every off-diagonal chunk meets
its mirror image, so the workers fetch chunks from each other. With an
``rdma://`` cluster those fetches are aiordma connections: the chunk's bytes
are pulled by the receiving worker's RDMA Read straight into a new array.

    # a cluster of its own, in this process's children (LocalCluster(protocol="rdma"))
    python examples/dask_transpose.py

    # or a running cluster (every process with the same token):
    #   export DASK_DISTRIBUTED__COMM__RDMA__TOKEN=change-me
    #   dask scheduler --protocol rdma            -> Scheduler at: rdma://10.0.0.1:8786
    #   dask worker rdma://10.0.0.1:8786          (on each worker host)
    python examples/dask_transpose.py rdma://10.0.0.1:8786

It prints the result, the time, and what each worker's ``rdma://`` comms
moved: the bytes it received from other workers (as Dask logged them, and
as the backend counted them), how many of those came as large frames pulled
by RDMA Read, and the device's packet counters.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed import Client


def fetched_from_workers(dask_worker) -> int:
    """Bytes this worker fetched from other workers (Dask's own log)."""
    return sum(entry["total"] for entry in dask_worker.transfer_incoming_log)


def report(client: Client) -> None:
    from aiordma.integrations.dask import byte_counters

    fetched = client.run(fetched_from_workers)
    counters = client.run(byte_counters)
    for worker, counts in sorted(counters.items()):
        peers = [w for w in counters if w != worker]
        rx = sum(counts["peers"].get(p, {}).get("rx_bytes", 0) for p in peers)
        large = sum(counts["peers"].get(p, {}).get("rx_large_bytes", 0) for p in peers)
        print(f"{worker}: fetched {fetched[worker] / 1e6:,.1f} MB from other workers (Dask's log);")
        print(f"    rdma:// received {rx / 1e6:,.1f} MB from them, {large / 1e6:,.1f} MB as large frames (RDMA Read)")
        for label, dev in counts["devices"].items():
            packets = dev["device"].get("rx_packets", dev["device"].get("rcvd_pkts", "?"))
            print(
                f"    device {label}: {dev['rx_bytes'] / 1e6:,.1f} MB in, {dev['tx_bytes'] / 1e6:,.1f} MB out, "
                f"{packets} packets received"
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scheduler", nargs="?", help="rdma://HOST:PORT of a running scheduler (default: a LocalCluster)")
    ap.add_argument("-n", type=int, default=8000, help="the array is n x n float64 (8000: 512 MB)")
    ap.add_argument("--chunk", type=int, default=2000, help="chunk side (2000: 32 MB chunks)")
    args = ap.parse_args()
    if args.n < 1 or args.chunk < 1:
        ap.error("-n and --chunk must be positive")
    if args.scheduler is not None and not args.scheduler.startswith("rdma://"):
        ap.error(f"the scheduler address must be rdma://HOST:PORT, not {args.scheduler!r}")
    try:  # after the arguments: --help works without Dask
        import dask.array as da
        from distributed import Client, LocalCluster
    except ImportError as e:
        print(f"dask_transpose.py: needs Dask distributed ({e}): pip install 'aiordma[dask]'", file=sys.stderr)
        return 1
    if args.scheduler is None:
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, protocol="rdma", dashboard_address=None)
        client = Client(cluster)
    else:
        cluster = None
        client = Client(args.scheduler)
    try:
        client.wait_for_workers(2, timeout=60)
        x = da.random.RandomState(0).random((args.n, args.n), chunks=(args.chunk, args.chunk))
        t0 = time.perf_counter()
        total = (x + x.T).sum().compute()
        print(f"(x + x.T).sum() = {total:,.4f} over {client.scheduler.address} in {time.perf_counter() - t0:.2f} s")
        report(client)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
