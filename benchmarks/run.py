#!/usr/bin/env python3
"""The benchmark suite behind the project's published figures.

Every figure is measured next to its baseline (asyncio TCP streams doing the
same pattern, same sizes, same event-loop kind) in the same ``aiordma bench``
invocation, and reported as a ratio, because absolute timings on a shared
machine are noise. Each invocation is a fresh process (plus its two server
processes), so one test cannot warm or pollute the next. ``--quick`` runs the
suite three times (``--repeat``) and shows the run with the median ratio and the
range over the runs; the JSON file keeps every run.

    python benchmarks/run.py --quick                    # < 2 minutes
    python benchmarks/run.py --full                     # every size, every test
    python benchmarks/run.py --quick --readme docs/benchmarks.md # also refresh the benchmark page

Outputs (``--out``, default ``benchmarks/results``):

* ``<name>.json``: the JSON lines of ``aiordma bench --json`` (one per test,
  size and loop; ``<name>`` is ``quick``/``full`` or ``--name``);
* ``<name>-bw.png`` (bandwidth vs message size, with the TCP baseline) and
  ``<name>-lat.png`` (latency percentiles), when matplotlib is installed;
* ``summary.md``: a Markdown table, also pasted between
  ``<!-- bench:start -->`` and ``<!-- bench:end -->`` in ``--readme``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- bench:start -->", "<!-- bench:end -->"

# the project's bars (from the issues): (test, size) -> minimum ratio (higher is better)
BARS = {
    ("write_bw", 65536): (0.5, "write_bw 64 KiB >= 0.5 x asyncio TCP"),
    ("send_lat", 64): (0.5, "send_lat 64 B <= 2 x asyncio TCP"),
}

LOOPS = ("asyncio", "uvloop")

# (test, extra bench arguments, number of sizes it reports)
# each transport runs for about one second per measurement (-D), so aiordma and
# its baseline are exposed to the machine's hiccups for the same time
QUICK = [
    ("write_bw", ["-s", "65536", "-D", "1"], 1),
    ("send_lat", ["-s", "64", "-D", "1"], 1),
    ("read_bw", ["-s", "65536", "-D", "1"], 1),
    ("atomic_lat", ["-D", "1"], 1),
]


def _all(max_size: int) -> int:
    n, s = 0, 2
    while s <= max_size:
        n, s = n + 1, s * 2
    return n


# every size; iterations capped by bytes per measurement so the big sizes stay bounded (~10 minutes)
FULL = [
    ("write_bw", ["-a", "--max-size", "8M", "-n", "2000", "--budget", "64M"], _all(8 << 20)),
    ("read_bw", ["-a", "--max-size", "8M", "-n", "2000", "--budget", "64M"], _all(8 << 20)),
    ("send_bw", ["-a", "--max-size", "8M", "-n", "2000", "--budget", "64M"], _all(8 << 20)),
    ("write_lat", ["-a", "--max-size", "1M", "-n", "500", "--budget", "32M"], _all(1 << 20)),
    ("send_lat", ["-a", "--max-size", "1M", "-n", "500", "--budget", "32M"], _all(1 << 20)),
    ("read_lat", ["-a", "--max-size", "1M", "-n", "500", "--budget", "32M"], _all(1 << 20)),
    ("atomic_lat", ["-n", "1000"], 1),
]


# ---------------------------------------------------------- process CPU ----


def process_cpu_ns(pid: int) -> int:
    """CPU time of process ``pid`` (every live thread), nanoseconds: the sum of
    ``/proc/PID/task/*/schedstat``; ``/proc/PID/stat`` utime + stime (clock
    ticks) where schedstat is not available."""
    total, found = 0, False
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        tasks = []
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[0])
            found = True
        except (OSError, ValueError, IndexError):
            continue
    if found:
        return total
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int((int(fields[11]) + int(fields[12])) * 1e9 / os.sysconf("SC_CLK_TCK"))


# ------------------------------------------------------------ progress ----


class Progress:
    """A text progress bar on stderr (one line, redrawn; plain lines when not a tty)."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total = max(1, total)
        self.done = 0
        self.width = width
        self.label = ""
        self.t0 = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._last_plain = ""
        self._lock = threading.Lock()

    def draw(self) -> None:
        with self._lock:
            frac = min(1.0, self.done / self.total)
            fill = int(frac * self.width)
            el = int(time.monotonic() - self.t0)
            line = f"[{'#' * fill}{'.' * (self.width - fill)}] {self.done}/{self.total} {el // 60}:{el % 60:02d} {self.label}"
            if self.tty:
                sys.stderr.write("\r" + line[:150].ljust(150))
                sys.stderr.flush()
            elif line.split(" ", 2)[1] != self._last_plain:
                self._last_plain = line.split(" ", 2)[1]
                sys.stderr.write(line + "\n")
                sys.stderr.flush()

    def step(self, n: int = 1) -> None:
        self.done += n
        self.draw()

    def finish(self) -> None:
        self.done = self.total
        self.draw()
        if self.tty:
            sys.stderr.write("\n")


# ------------------------------------------------------------- running ----


def run_bench(
    test: str, extra: list[str], loop: str, provider: str, bar: Progress, timeout: float
) -> list[dict[str, Any]]:
    """One ``aiordma bench`` invocation; its JSON lines, advancing ``bar`` per size."""
    argv = [
        sys.executable,
        "-m",
        "aiordma.cli",
        "bench",
        test,
        *extra,
        "--loop",
        loop,
        "--provider",
        provider,
        "--json",
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    records: list[dict[str, Any]] = []
    err: list[str] = []

    def pump_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err.append(line)

    t = threading.Thread(target=pump_err, daemon=True)
    t.start()
    ticker_stop = threading.Event()

    def ticker() -> None:
        while not ticker_stop.wait(0.5):
            bar.draw()

    tk = threading.Thread(target=ticker, daemon=True)
    tk.start()
    deadline = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            rec["command"] = "aiordma bench " + " ".join(argv[5:])
            records.append(rec)
            bar.step()
            if time.monotonic() > deadline:
                proc.kill()
                break
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    finally:
        ticker_stop.set()
    t.join(timeout=2)
    if code != 0:
        sys.stderr.write(f"\n{' '.join(argv)} failed ({code}):\n{''.join(err)[-3000:]}\n")
    return records


# --------------------------------------------------------------- plots ----


def _fmt_size(n: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def make_plots(records: list[dict[str, Any]], out: Path, name: str) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.stderr.write("matplotlib is not installed: no plots (pip install matplotlib)\n")
        return []
    made: list[Path] = []
    bw = [r for r in records if r["test"].endswith("_bw")]
    lat = [r for r in records if r["test"].endswith("_lat")]
    if bw:
        tests = sorted({r["test"] for r in bw})
        fig, axes = plt.subplots(1, len(tests), figsize=(5.5 * len(tests), 4.2), squeeze=False)
        for ax, test in zip(axes[0], tests):
            multi = len({r["size"] for r in bw if r["test"] == test}) > 1
            for li, loop in enumerate(LOOPS):
                rows = sorted((r for r in bw if r["test"] == test and r["loop"] == loop), key=lambda r: r["size"])
                if not rows:
                    continue
                xs = [r["size"] for r in rows]
                ys = [r["bw_MBps"] for r in rows]
                bs = [r["baseline"]["bw_MBps"] if r.get("baseline") else None for r in rows]
                if multi:
                    ax.plot(xs, ys, marker="o", color=f"C{li}", label=f"aiordma ({loop})")
                    if any(b is not None for b in bs):
                        ax.plot(xs, bs, marker="x", linestyle="--", color=f"C{li}", label=f"asyncio TCP ({loop})")
                else:
                    ax.bar([li * 2.5], ys, width=1, color=f"C{li}", label=f"aiordma ({loop})")
                    if bs[0] is not None:
                        ax.bar(
                            [li * 2.5 + 1],
                            bs,
                            width=1,
                            color=f"C{li}",
                            alpha=0.45,
                            hatch="//",
                            label=f"asyncio TCP ({loop})",
                        )
                        ax.annotate(
                            f"ratio {rows[0]['ratio']:.2f}",
                            (li * 2.5 + 0.5, max(ys[0], bs[0])),
                            ha="center",
                            va="bottom",
                            fontsize=8,
                        )
            if multi:
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel("message size [bytes]")
            else:
                size = next(r["size"] for r in bw if r["test"] == test)
                ax.set_xticks([])
                ax.set_xlabel(f"{_fmt_size(size)} messages")
            ax.set_ylabel("BW average [MB/s, 2^20]")
            ax.set_title(test)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"aiordma vs asyncio TCP ({name}; same run, same loop kind)")
        fig.tight_layout()
        path = out / f"{name}-bw.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    multi_lat = [t for t in sorted({r["test"] for r in lat}) if len({r["size"] for r in lat if r["test"] == t}) > 1]
    if multi_lat:
        # --full: latency percentiles vs message size, one panel per test
        fig, axes = plt.subplots(1, len(multi_lat), figsize=(5.5 * len(multi_lat), 4.2), squeeze=False)
        for ax, test in zip(axes[0], multi_lat):
            for li, loop in enumerate(LOOPS):
                rows = sorted((r for r in lat if r["test"] == test and r["loop"] == loop), key=lambda r: r["size"])
                if not rows:
                    continue
                xs = [r["size"] for r in rows]
                for key, style in (("p50", "-"), ("p99", ":")):
                    ax.plot(
                        xs,
                        [r["lat_us"][key] for r in rows],
                        linestyle=style,
                        marker="o",
                        ms=3,
                        color=f"C{li}",
                        label=f"aiordma {key} ({loop})",
                    )
                    if all(r.get("baseline") for r in rows):
                        ax.plot(
                            xs,
                            [r["baseline"]["lat_us"][key] for r in rows],
                            linestyle=style,
                            marker="x",
                            ms=3,
                            color=f"C{li + 2}",
                            label=f"asyncio TCP {key} ({loop})",
                        )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("message size [bytes]")
            ax.set_ylabel("latency [µs]")
            ax.set_title(f"{test} ({'half round trip' if test in ('send_lat', 'write_lat') else 'whole operation'})")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
        fig.suptitle(f"latency percentiles vs size: aiordma vs asyncio TCP ({name}; same run, same loop kind)")
        fig.tight_layout()
        path = out / f"{name}-lat-size.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    if lat:
        # latency percentiles at one size per test (the smallest, and 64 B when present):
        # bars p50 / p99 / p99.9 for aiordma and TCP
        groups = sorted({(r["test"], r["size"], r["loop"]) for r in lat}, key=lambda g: (g[0], g[1], LOOPS.index(g[2])))
        keep = {}
        for t_, s_, _ in groups:
            keep.setdefault(t_, set()).add(s_)
        keep = {t_: {64} if 64 in sizes else {min(sizes)} for t_, sizes in keep.items()}
        groups = [g for g in groups if g[1] in keep[g[0]]]
        fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(groups)), 4.5))
        pcts = (("p50", "t_typical (p50)"), ("p99", "99%"), ("p999", "99.9%"))
        width = 0.12
        for gi, (test, size, loop) in enumerate(groups):
            r = next(x for x in lat if (x["test"], x["size"], x["loop"]) == (test, size, loop))
            for pi, (key, label) in enumerate(pcts):
                ax.bar(
                    gi + (pi - 2.5) * width,
                    r["lat_us"][key],
                    width,
                    color=f"C{pi}",
                    label=f"aiordma {label}" if gi == 0 else None,
                )
                if r.get("baseline") and r["baseline"].get("lat_us"):
                    ax.bar(
                        gi + (pi + 0.5) * width,
                        r["baseline"]["lat_us"][key],
                        width,
                        color=f"C{pi}",
                        alpha=0.4,
                        hatch="//",
                        label=f"asyncio TCP {label}" if gi == 0 else None,
                    )
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{t}\n{_fmt_size(s)}\n{lp}" for t, s, lp in groups], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("latency [µs]")
        ax.set_title(
            f"latency percentiles, aiordma (solid) vs asyncio TCP (hatched), {name}\n"
            "send/write_lat: half round trip; read/atomic_lat: whole operation",
            fontsize=9,
        )
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out / f"{name}-lat.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


# ------------------------------------------------------------- summary ----


def representative(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (test, size, loop): with --repeat, the run whose ratio
    is the median, annotated with the range of ratios over the runs."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["test"], r["size"], r["loop"]), []).append(r)
    out = []
    for rs in groups.values():
        rs = sorted(rs, key=lambda r: (r.get("ratio") is None, r.get("ratio") or 0.0))
        pick = dict(rs[(len(rs) - 1) // 2])
        ratios = [r["ratio"] for r in rs if r.get("ratio") is not None]
        pick["runs"] = len(rs)
        if len(ratios) > 1:
            pick["ratio_range"] = [min(ratios), max(ratios)]
        out.append(pick)
    return out


def _ratio_cell(r: dict[str, Any]) -> str:
    if r.get("ratio") is None:
        return "n/a"
    cell = f"{r['ratio']:.2f}"
    if r.get("ratio_range"):
        lo, hi = r["ratio_range"]
        cell += f" ({lo:.2f}–{hi:.2f}, {r['runs']} runs)"
    return cell


TROUBLE = ("retransmits", "timeouts", "seq_naks_sent", "rnr_naks_sent", "tx_dropped_full")


def _cpu_cell(r: dict[str, Any]) -> str:
    a = r.get("cpu_us_per_op")
    b = (r.get("baseline") or {}).get("cpu_us_per_op")
    if not a:
        return ""
    return f"{a['total']:.0f} / {b['total']:.0f}" if b else f"{a['total']:.0f} / n/a"


def _notes(r: dict[str, Any]) -> str:
    seen: dict[str, int] = {}
    for c in (r.get("counters") or {}).values():
        for k, v in c.items():
            if k in TROUBLE and v:
                seen[k] = seen.get(k, 0) + v
    return ", ".join(f"{k}={v}" for k, v in sorted(seen.items()))


def _bar_cell(r: dict[str, Any]) -> str:
    bar = BARS.get((r["test"], r["size"]))
    if bar is None or r.get("ratio") is None:
        return ""
    ok = r["ratio"] >= bar[0]
    return f"{'met' if ok else 'MISSED'} (≥ {bar[0]})"


def summary_markdown(
    records: list[dict[str, Any]],
    name: str,
    plots: list[Path],
    out: Path,
    elapsed: float,
    failed: list[dict[str, Any]] | None = None,
) -> str:
    if not records:
        return "_no benchmark results_\n"
    r0 = records[0]
    host = r0.get("host", {})
    lines = [
        f"Suite `{name}`, {time.strftime('%Y-%m-%d')}, provider `{r0['provider']}`, progress `{r0['progress']}`, "
        f"Python {host.get('python', platform.python_version())} on {host.get('cpus', os.cpu_count())} CPUs "
        f"({elapsed:.0f} s). Each aiordma figure is measured in the same `aiordma bench` run as its baseline "
        "(asyncio TCP streams, same pattern, same sizes, same loop kind); **ratio** is higher-is-better: "
        "bandwidth aiordma/TCP, latency TCP/aiordma (median). MB = 2^20 bytes. Ping-pong latencies are half "
        "round trips; read/atomic latencies are whole operations. CPU µs/op: process CPU time (every thread, "
        "both ends) per operation, which a busy machine disturbs less than wall-clock figures. "
        "notes: soft-device recoveries (retransmissions) during the measurement.",
        "",
    ]
    bw = [r for r in records if r["test"].endswith("_bw")]
    lat = [r for r in records if r["test"].endswith("_lat")]
    order = {
        t: i
        for i, t in enumerate(["write_bw", "read_bw", "send_bw", "send_lat", "write_lat", "read_lat", "atomic_lat"])
    }

    def key(r: dict[str, Any]) -> tuple:
        return (order.get(r["test"], 99), r["size"], LOOPS.index(r["loop"]) if r["loop"] in LOOPS else 9)

    if bw:
        lines += [
            "| test | size | loop | aiordma BW [MB/s] | asyncio TCP BW [MB/s] | ratio | aiordma MsgRate [Mpps] "
            "| CPU µs/op aiordma / TCP | bar | notes |",
            "|---|---:|---|---:|---:|---:|---:|---:|---|---|",
        ]
        for r in sorted(bw, key=key):
            b = r.get("baseline") or {}
            ratio = _ratio_cell(r)
            lines.append(
                f"| {r['test']} | {_fmt_size(r['size'])} | {r['loop']} | {r['bw_MBps']:.1f} | "
                f"{b.get('bw_MBps', float('nan')):.1f} | {ratio} | {r['msg_rate_Mpps']:.4f} | {_cpu_cell(r)} | "
                f"{_bar_cell(r)} | {_notes(r)} |"
            )
        lines.append("")
    if lat:
        lines += [
            "| test | size | loop | aiordma p50 / p99 [µs] | asyncio TCP p50 / p99 [µs] | ratio "
            "| CPU µs/op aiordma / TCP | bar | notes |",
            "|---|---:|---|---:|---:|---:|---:|---|---|",
        ]
        for r in sorted(lat, key=key):
            a = r["lat_us"]
            b = (r.get("baseline") or {}).get("lat_us") or {}
            ratio = _ratio_cell(r)
            bcell = f"{b['p50']:.1f} / {b['p99']:.1f}" if b else "n/a"
            lines.append(
                f"| {r['test']} | {_fmt_size(r['size'])} | {r['loop']} | {a['p50']:.1f} / {a['p99']:.1f} | {bcell} | {ratio} "
                f"| {_cpu_cell(r)} | {_bar_cell(r)} | {_notes(r)} |"
            )
        lines.append("")
    if failed:
        lines.append("Measurements that failed (the error is the result):")
        lines.append("")
        for r in failed:
            lines.append(
                f"- {r['test']} {_fmt_size(r['size'])} on {r['loop']} (run {r.get('run', 1)}): `{r['error'][:300]}`"
            )
        lines.append("")
    for p in plots:
        rel = os.path.relpath(p, out)
        lines.append(f"![{p.stem}]({rel})")
    if plots:
        lines.append("")
    lines.append(
        f"Reproduce: `python benchmarks/run.py --{name if name in ('quick', 'full') else 'quick'}` "
        "(single tests: `aiordma bench TEST --help`)."
    )
    return "\n".join(lines) + "\n"


def update_readme(readme: Path, body: str, out: Path) -> bool:
    text = readme.read_text()
    if START not in text or END not in text:
        sys.stderr.write(f"{readme}: no {START} ... {END} markers; left unchanged\n")
        return False
    # image links in the README are relative to the README, not to the results directory
    rel = os.path.relpath(out, readme.parent)
    body = body.replace("](", f"]({rel}/") if rel != "." else body
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{body}{END}{tail}")
    return True


# ---------------------------------------------------------------- main ----


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        action="store_true",
        help="write_bw 64K, send_lat 64B, read_bw 64K, atomic_lat on both loops (< 2 min; default)",
    )
    mode.add_argument(
        "--full", action="store_true", help="every test over every size (2 B ... 8 MiB bw, ... 1 MiB lat) on both loops"
    )
    p.add_argument("--name", default=None, help="results name (default: quick/full)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="results directory")
    p.add_argument(
        "--provider", default="soft", choices=("soft", "pyverbs", "auto"), help="RDMA provider (default soft)"
    )
    p.add_argument("--loops", default=",".join(LOOPS), help="comma-separated loops (default asyncio,uvloop)")
    p.add_argument("--tests", default=None, help="comma-separated subset of the suite's tests")
    p.add_argument("--readme", type=Path, default=None, help="replace the text between the bench markers in this file")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="run the suite this many times; tables show the median-ratio run "
        "and the range (default: 3 for --quick, 1 for --full)",
    )
    p.add_argument("--check", action="store_true", help="exit with status 3 when a project bar is missed")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per bench invocation")
    args = p.parse_args(argv)
    suite = FULL if args.full else QUICK
    if args.repeat is None:
        args.repeat = 1 if args.full else 3
    args.repeat = max(1, args.repeat)
    name = args.name or ("full" if args.full else "quick")
    loops = [x for x in args.loops.split(",") if x]
    if args.tests:
        wanted = set(args.tests.split(","))
        suite = [s for s in suite if s[0] in wanted]
    args.out.mkdir(parents=True, exist_ok=True)
    total = sum(n for _, _, n in suite) * len(loops) * args.repeat
    bar = Progress(total)
    t0 = time.monotonic()
    records: list[dict[str, Any]] = []
    # loops interleaved per test, so both loop kinds of a test see similar machine conditions
    for rep in range(args.repeat):
        for test, extra, nsizes in suite:
            for loop in loops:
                bar.label = f"{test} {' '.join(extra)} --loop {loop}" + (
                    f" (run {rep + 1}/{args.repeat})" if args.repeat > 1 else ""
                )
                bar.draw()
                got = run_bench(test, extra, loop, args.provider, bar, args.timeout)
                if len(got) < nsizes:
                    bar.step(nsizes - len(got))
                for r in got:
                    r["run"] = rep + 1
                records.extend(got)
    bar.label = "plots"
    bar.finish()
    elapsed = time.monotonic() - t0
    results = args.out / f"{name}.json"
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    failed = [r for r in records if "error" in r]
    shown = representative([r for r in records if "error" not in r])
    plots = [] if args.no_plots else make_plots(shown, args.out, name)
    md = summary_markdown(shown, name, plots, args.out, elapsed, failed)
    (args.out / "summary.md").write_text(md)
    if args.readme:
        update_readme(args.readme, md, args.out)
    sys.stdout.write(md)
    sys.stderr.write(
        f"wrote {results}, {args.out / 'summary.md'}" + "".join(f", {p}" for p in plots) + f" in {elapsed:.0f} s\n"
    )
    if not records:
        return 1
    missed = [r for r in shown if _bar_cell(r).startswith("MISSED")]
    for r in missed:
        sys.stderr.write(f"bar missed: {BARS[(r['test'], r['size'])][1]} on {r['loop']}: ratio {r['ratio']:.2f}\n")
    return 3 if missed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
