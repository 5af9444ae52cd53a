"""What connections cost a service: set-up time, memory per idle connection, churn.

A server runs in a child process (an echo handler); this process opens
``--connections`` connections to it at once, makes one 64 B round trip on
each, and measures:

* the time to establish them all (concurrently) and per connection;
* the RSS the server and this client grew by per connection, idle after
  their round trip;
* after closing them all, what each process gave back;
* ``--cycles`` rounds of connect → round trip → close of ``--churn``
  connections each: RSS at the start and the end, both processes (no
  ``gc.collect()`` anywhere: what a service that never calls it sees).

The same is measured with asyncio TCP streams (``asyncio.start_server`` /
``open_connection``, a 64 B echo) as the baseline, in the same run.

    python benchmarks/connections.py                        # 1,000 at once, 20 x 500 churn
    python benchmarks/connections.py --connections 200 --cycles 3 --churn 100 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAYLOAD = b"x" * 64

SERVER = r"""
import asyncio, os, signal, sys
kind = sys.argv[1]

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

async def main():
    if kind == "aiordma":
        import aiordma

        async def handler(conn):
            async for m in conn:
                await conn.send(m)

        server = await aiordma.start_server(handler, "127.0.0.1", 0)
        port = server.port
    else:
        async def handler(reader, writer):
            try:
                while True:
                    writer.write(await reader.readexactly(64))
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            writer.close()

        server = await asyncio.start_server(handler, "127.0.0.1", 0, backlog=4096)
        port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: print(rss(), flush=True))
    print(port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def rss_kib(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


class Child:
    """The server process; ``rss()`` asks it for its RSS (SIGUSR1, one line back)."""

    def __init__(self, kind: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, kind], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def rss(self) -> int:
        assert self.proc.stdout is not None
        self.proc.send_signal(signal.SIGUSR1)
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


async def open_one(kind: str, port: int) -> Any:
    if kind == "aiordma":
        import aiordma

        return await aiordma.connect("127.0.0.1", port)
    return await asyncio.open_connection("127.0.0.1", port)


async def round_trip(kind: str, conn: Any) -> None:
    if kind == "aiordma":
        await conn.send(PAYLOAD)
        assert await conn.recv() == PAYLOAD
    else:
        reader, writer = conn
        writer.write(PAYLOAD)
        await writer.drain()
        assert await reader.readexactly(64) == PAYLOAD


async def close_one(kind: str, conn: Any) -> None:
    if kind == "aiordma":
        await conn.close()
    else:
        conn[1].close()
        await conn[1].wait_closed()


async def settle() -> None:
    await asyncio.sleep(0.5)


async def measure(kind: str, n: int, cycles: int, churn: int) -> dict[str, Any]:
    child = Child(kind)
    try:
        first = await open_one(kind, child.port)  # the device, the caches, the code: warm
        await round_trip(kind, first)
        await settle()
        server0, client0 = child.rss(), rss_kib()
        t0 = time.perf_counter()
        conns = await asyncio.gather(*(open_one(kind, child.port) for _ in range(n)))
        connect_s = time.perf_counter() - t0
        await asyncio.gather(*(round_trip(kind, c) for c in conns))
        await settle()
        server1, client1 = child.rss(), rss_kib()
        await asyncio.gather(*(close_one(kind, c) for c in conns))
        del conns
        await settle()
        server2, client2 = child.rss(), rss_kib()
        churn_start = (child.rss(), rss_kib())
        for _ in range(cycles):
            batch = await asyncio.gather(*(open_one(kind, child.port) for _ in range(churn)))
            await asyncio.gather(*(round_trip(kind, c) for c in batch))
            await asyncio.gather(*(close_one(kind, c) for c in batch))
            del batch
        await settle()
        churn_end = (child.rss(), rss_kib())
        await close_one(kind, first)
        return {
            "kind": kind,
            "connections": n,
            "connect_all_s": connect_s,
            "connect_each_ms": connect_s / n * 1e3,
            "server_kib_per_idle_connection": (server1 - server0) / n,
            "client_kib_per_idle_connection": (client1 - client0) / n,
            "server_mib_kept_after_close": (server2 - server0) / 1024,
            "client_mib_kept_after_close": (client2 - client0) / 1024,
            "churn_cycles": cycles,
            "churn_connections": churn,
            "server_churn_rss_mib": [churn_start[0] / 1024, churn_end[0] / 1024],
            "client_churn_rss_mib": [churn_start[1] / 1024, churn_end[1] / 1024],
        }
    finally:
        child.close()


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| | connect N at once | per connection | server KiB / idle conn | client KiB / idle conn "
        "| kept after close (server, client) | churn RSS MiB (server, client) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s0, s1 = r["server_churn_rss_mib"]
        c0, c1 = r["client_churn_rss_mib"]
        out.append(
            f"| {r['kind']} ({r['connections']}) | {r['connect_all_s']:.2f} s | {r['connect_each_ms']:.2f} ms "
            f"| {r['server_kib_per_idle_connection']:.1f} | {r['client_kib_per_idle_connection']:.1f} "
            f"| {r['server_mib_kept_after_close']:+.0f} / {r['client_mib_kept_after_close']:+.0f} MiB "
            f"| {s0:.0f} → {s1:.0f} / {c0:.0f} → {c1:.0f} ({r['churn_cycles']} × {r['churn_connections']}) |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=1000, help="connections opened at once (default 1000)")
    ap.add_argument("--cycles", type=int, default=20, help="churn rounds (default 20)")
    ap.add_argument("--churn", type=int, default=500, help="connections per churn round (default 500)")
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    for name in ("connections", "cycles", "churn"):
        if getattr(args, name) < (0 if name == "cycles" else 1):
            ap.error(f"--{name} must be positive")
    runner = asyncio.run
    if args.loop == "uvloop":
        import uvloop

        runner = uvloop.run  # type: ignore[assignment]
    rows = [runner(measure(kind, args.connections, args.cycles, args.churn)) for kind in ("aiordma", "tcp")]
    print(f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, {args.loop}")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"loop": args.loop, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
