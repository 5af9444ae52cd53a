"""What a run reports: one record per size (the JSON line) and perftest's
table (banner, headers, rows)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

from .common import LATENCY_KIND, TESTS
from .rdma import TROUBLE, RdmaClient
from .stats import Measurement


def _record(
    args: argparse.Namespace, rdma: Measurement, rdma_client: RdmaClient, base: Measurement | None
) -> dict[str, Any]:
    kind = TESTS[args.test][0]
    rec: dict[str, Any] = {
        "test": args.test,
        "transport": "aiordma",
        "provider": rdma_client.device,
        "loop": args.loop,
        "progress": rdma_client.progress,
        "packet_path": rdma_client.packet_path,
        "poll_window_us": rdma_client.poll_window_us,
        "size": rdma.size,
        "tx_depth": rdma.tx_depth,
    }
    rec.update(rdma.summary())
    if kind == "lat":
        rec["latency"] = LATENCY_KIND[args.test]
    elif rdma.info.get("post_list"):
        rec["post_list"] = rdma.info["post_list"]
        rec["latency"] = "per chain of post_list writes, post to completion"
    else:
        rec["latency"] = "per operation, post to completion, with tx_depth outstanding"
    if base is not None:
        b: dict[str, Any] = {"transport": f"tcp ({args.loop} streams)", "size": base.size, "tx_depth": base.tx_depth}
        b.update(base.summary())
        rec["baseline"] = b
        if kind == "bw":
            rec["ratio"] = rec["bw_MBps"] / b["bw_MBps"] if b["bw_MBps"] else None
            rec["ratio_basis"] = "bw_MBps aiordma/baseline"
        else:
            rec["ratio"] = b["lat_us"]["p50"] / rec["lat_us"]["p50"] if rec["lat_us"]["p50"] else None
            rec["ratio_basis"] = "lat_us.p50 baseline/aiordma"
    else:
        rec["baseline"] = None
        rec["ratio"] = None
    rec["host"] = {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()}
    rec["time"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return rec


# --------------------------------------------------------------- table ----

BW_HEADER = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"
LAT_HEADER = (
    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]"
    "   99% percentile[usec]   99.9% percentile[usec] "
)
RULE = "-" * 120


def _banner(
    args: argparse.Namespace,
    device: str,
    progress: str,
    poll_window_us: float | None = None,
    packet_path: str = "",
) -> str:
    kind, title = TESTS[args.test]
    if progress == "event" and poll_window_us is not None:
        progress += (
            f" (polls {poll_window_us:g} us after each post/completion, then sleeps)"
            if poll_window_us
            else " (no poll window)"
        )
    lines = [
        RULE,
        f"                    {title}  (aiordma)",
        f" Device          : {device}",
        f" Event loop      : {args.loop}",
        f" Progress mode   : {progress}",
    ]
    if packet_path:
        lines.append(f" Packets         : {packet_path}")
    if kind == "bw":
        lines.append(f" TX depth        : {args.tx_depth}")
        if args.post_list > 1:
            lines.append(f" Post list       : {args.post_list} writes per doorbell, the last signaled")
    else:
        lines.append(f" Latency         : {LATENCY_KIND[args.test]}")
    if args.baseline == "tcp":
        lines.append(
            f" Baseline        : asyncio TCP streams on {args.loop}, same pattern and sizes, measured in this run"
        )
        basis = "aiordma/tcp BW average" if kind == "bw" else "tcp/aiordma t_typical"
        lines.append(f" ratio           : {basis} (higher is better)")
    lines.append(" CPU[usec/op]    : process CPU time (all threads) per operation at each end")
    lines.append(RULE)
    hdr = BW_HEADER if kind == "bw" else LAT_HEADER
    lines.append(hdr + "   transport         ratio  CPU[usec/op] client+server")
    return "\n".join(lines)


def _row(kind: str, size: int, s: dict[str, Any], label: str, ratio: float | None) -> str:
    if kind == "bw":
        core = f" {size:<10d} {s['iterations']:<14d} {s['bw_peak_MBps']:<18.2f} {s['bw_MBps']:<20.2f} {s['msg_rate_Mpps']:<14.6f}"
    else:
        lat = s["lat_us"]
        core = (
            f" {size:<6d} {s['iterations']:<14d} {lat['min']:<14.2f} {lat['max']:<12.2f} {lat['p50']:<18.2f}"
            f" {lat['avg']:<14.2f} {lat['stdev']:<15.2f} {lat['p99']:<22.2f} {lat['p999']:<23.2f}"
        )
    r = f"{ratio:.2f}" if ratio is not None else ""
    cpu = s.get("cpu_us_per_op")
    c = f"{cpu['client']:.1f}+{cpu['server']:.1f}" if cpu else ""
    return f"{core}  {label:<17s} {r:<6s} {c}"


def print_rows(rec: dict[str, Any]) -> None:
    kind = TESTS[rec["test"]][0]
    print(_row(kind, rec["size"], rec, "aiordma", rec.get("ratio")))
    if rec.get("baseline"):
        print(_row(kind, rec["size"], rec["baseline"], "tcp (baseline)", None))
    trouble = []
    for end, c in (rec.get("counters") or {}).items():
        bad = {k: v for k, v in c.items() if k in TROUBLE and v}
        if bad:
            trouble.append(f"{end}: " + ", ".join(f"{k}={v}" for k, v in sorted(bad.items())))
    if trouble:
        print(f"   ^ soft device recovered from loss/overrun during this measurement ({'; '.join(trouble)})")
    sys.stdout.flush()
