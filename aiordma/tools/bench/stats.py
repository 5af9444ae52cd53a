"""How a measurement is taken and summarised: the timing loops (a window of
outstanding operations, or one at a time), nearest-rank percentiles, the
best-window bandwidth and the per-operation CPU time."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .common import MB


def percentile(sorted_vals: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_vals:
        return float("nan")
    k = max(0, min(len(sorted_vals) - 1, math.ceil(q * len(sorted_vals)) - 1))
    return sorted_vals[k]


def lat_stats(samples_ns: list[int] | None) -> dict[str, float] | None:
    if not samples_ns:
        return None
    v = sorted(x / 1000.0 for x in samples_ns)
    n = len(v)
    avg = sum(v) / n
    var = sum((x - avg) ** 2 for x in v) / (n - 1) if n > 1 else 0.0
    return {
        "min": v[0],
        "p50": percentile(v, 0.50),
        "p99": percentile(v, 0.99),
        "p999": percentile(v, 0.999),
        "max": v[-1],
        "avg": avg,
        "stdev": math.sqrt(var),
    }


def peak_rate(t0: int, stamps: list[int], cum: list[int], window: int) -> float:
    """Best bytes/s over any stretch of at least ``window`` bytes.

    ``stamps``/``cum``: completion times (ns, ascending) and bytes completed
    by then; ``t0`` is when the first operation was posted."""
    ts = [t0] + stamps
    cs = [0] + cum
    best = 0.0
    i = 0
    for j in range(1, len(ts)):
        while i + 1 < j and cs[j] - cs[i + 1] >= window:
            i += 1
        if cs[j] - cs[i] >= window and ts[j] > ts[i]:
            best = max(best, (cs[j] - cs[i]) * 1e9 / (ts[j] - ts[i]))
    if best == 0.0 and ts[-1] > t0:
        best = cs[-1] * 1e9 / (ts[-1] - t0)
    return best


@dataclass
class Measurement:
    """What one transport measured for one size."""

    transport: str
    test: str
    size: int
    iterations: int
    elapsed_ns: int
    tx_depth: int
    lat_samples_ns: list[int] | None = None
    done_stamps: list[int] | None = None  # completion times, for the peak
    t0_ns: int = 0
    peak_Bps: float | None = None  # when the receiver measured it
    cpu_client_s: float | None = None  # process CPU time (all threads) during the measurement
    cpu_server_s: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, dict[str, int]] = field(default_factory=dict)  # soft-device counter deltas per end

    def summary(self) -> dict[str, Any]:
        secs = self.elapsed_ns / 1e9
        nbytes = self.size * self.iterations
        bw = nbytes / secs / MB if secs > 0 else 0.0
        peak = self.peak_Bps
        if peak is None and self.done_stamps:
            window = self.size * max(self.tx_depth, self.iterations // 20, 1)
            cum = [self.size * (k + 1) for k in range(len(self.done_stamps))]
            peak = peak_rate(self.t0_ns, sorted(self.done_stamps), cum, window)
        return {
            "iterations": self.iterations,
            "elapsed_s": secs,
            "bw_MBps": bw,
            "bw_peak_MBps": max(peak / MB, bw) if peak is not None else bw,
            "msg_rate_Mpps": self.iterations / secs / 1e6 if secs > 0 else 0.0,
            "lat_us": lat_stats(self.lat_samples_ns),
            "cpu_us_per_op": self.cpu_per_op(),
            **({"counters": self.counters} if self.counters else {}),
        }

    def cpu_per_op(self) -> dict[str, float] | None:
        """CPU time (user + system, every thread) per operation, each end: less
        sensitive to a busy machine than wall-clock figures."""
        if self.cpu_client_s is None or self.cpu_server_s is None or not self.iterations:
            return None
        c = self.cpu_client_s * 1e6 / self.iterations
        s = self.cpu_server_s * 1e6 / self.iterations
        return {"client": c, "server": s, "total": c + s}


async def _windowed(m: Measurement, op: Callable[[], Any], iters: int, depth: int) -> None:
    """Keep ``depth`` operations outstanding until ``iters`` completed."""
    post = [0] * iters
    done = [0] * iters
    nxt = 0
    clock = time.perf_counter_ns

    async def worker() -> None:
        nonlocal nxt
        while nxt < iters:
            i = nxt
            nxt += 1
            post[i] = clock()
            await op()
            done[i] = clock()

    m.t0_ns = clock()
    await asyncio.gather(*[worker() for _ in range(max(1, min(depth, iters)))])
    m.elapsed_ns = clock() - m.t0_ns
    m.done_stamps = done
    m.lat_samples_ns = [d - p for d, p in zip(done, post)]


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


async def _pipelined(m: Measurement, post: Callable[[], Any], iters: int, depth: int) -> None:
    """Keep ``depth`` operations outstanding from one coroutine, the way an RDMA
    application (and perftest) keeps a send queue full: ``post()`` puts one work
    request on the send queue and returns its completion's future; the oldest is
    awaited once ``depth`` are in flight. An RC queue pair completes in order, so
    after one wake-up the next futures are usually done already. A completion is
    stamped when this coroutine sees it."""
    post_stamps = [0] * iters
    done = [0] * iters
    clock = time.perf_counter_ns
    window: deque[tuple[int, Any]] = deque()
    m.t0_ns = clock()
    try:
        for i in range(iters):
            if len(window) >= depth:
                k, fut = window.popleft()
                await fut
                done[k] = clock()
            post_stamps[i] = clock()
            window.append((i, await post()))
        while window:
            k, fut = window.popleft()
            await fut
            done[k] = clock()
    except BaseException:
        for _, fut in window:  # their errors are this one's consequence: retrieved, not logged
            fut.add_done_callback(_retrieve)
        raise
    m.elapsed_ns = clock() - m.t0_ns
    m.done_stamps = done
    m.lat_samples_ns = [d - p for d, p in zip(done, post_stamps)]


async def _serial(m: Measurement, op: Callable[[], Any], iters: int, half: bool) -> None:
    samples = [0] * iters
    clock = time.perf_counter_ns
    m.t0_ns = start = clock()
    for i in range(iters):
        t = clock()
        await op()
        samples[i] = clock() - t
    m.elapsed_ns = clock() - start
    if half:  # ping-pong: half the round trip, as perftest reports
        samples = [s // 2 for s in samples]
    m.lat_samples_ns = samples
