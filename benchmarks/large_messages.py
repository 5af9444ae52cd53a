#!/usr/bin/env python3
"""Large messages: send/recv, send/recv_into and RDMA Write against TCP, same run.

One message of ``--size`` bytes (64 MiB by default) goes from this process to
a child process, ``--count`` times per round; the child answers each with a
one-byte acknowledgement, so every figure is "the bytes are in the
receiver's buffer". Rounds alternate between the ways (``--rounds``, 5 by
default) and the table gives the median and the range in MiB/s, with the
CPU time of both processes per message:

* ``send/recv``: ``await conn.send(data)`` / ``await conn.recv()`` (a new
  ``bytes`` for each message: one copy on the receiver);
* ``send/recv_into``: ``await conn.recv_into(buffer)`` into a buffer the
  receiver reuses (large messages: pulled by RDMA Read, no copy);
* ``rdma write``: ``await conn.write(region, remote)`` between registered
  buffers (the device's one-sided bandwidth);
* ``tcp streams``: asyncio ``StreamWriter.write`` + ``drain`` /
  ``StreamReader.readexactly`` (what an asyncio program does);
* ``tcp recv_into``: a raw socket with ``loop.sock_recv_into`` into a reused
  buffer (TCP's best case in asyncio).

    python benchmarks/large_messages.py                  # 64 MiB, 5 rounds
    python benchmarks/large_messages.py --size 8M --count 8 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiordma  # noqa: E402
from aiordma.tools import int_type, size_type  # noqa: E402

WAYS = ("send/recv", "send/recv_into", "rdma write", "tcp streams", "tcp recv_into")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ------------------------------------------------------------------ child ----


async def serve(size: int) -> None:
    region = aiordma.register(bytearray(size))
    into = bytearray(size)
    ack = b"k"

    async def rdma_handler(conn: aiordma.Connection) -> None:
        try:
            while True:
                cmd = await conn.recv()
                if cmd == b"recv":
                    await conn.recv()
                elif cmd == b"recv_into":
                    await conn.recv_into(into)
                elif cmd == b"cpu":
                    await conn.send(str(_cpu()).encode())
                    continue
                await conn.send(ack)
        except aiordma.ConnectionClosedError:
            pass

    async def tcp_handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (line := await reader.readline()) != b"":
            if line == b"streams\n":
                await reader.readexactly(size)
            writer.write(ack)
            await writer.drain()
        writer.close()

    rdma = await aiordma.start_server(
        rdma_handler,
        "127.0.0.1",
        0,
        provider="soft",
        expose={"mem": region.exposed("w")},  # the client Writes
    )
    tcp = await asyncio.start_server(tcp_handler, "127.0.0.1", 0)
    raw = socket.create_server(("127.0.0.1", 0))
    raw.setblocking(False)
    print(
        json.dumps({"rdma": rdma.port, "tcp": tcp.sockets[0].getsockname()[1], "raw": raw.getsockname()[1]}), flush=True
    )
    loop = asyncio.get_running_loop()
    sock, _ = await loop.sock_accept(raw)
    sock.setblocking(False)
    view = memoryview(into)
    while True:
        got = 0
        while got < size:
            n = await loop.sock_recv_into(sock, view[got:])
            if n == 0:
                return
            got += n
        await loop.sock_sendall(sock, ack)


# ----------------------------------------------------------------- parent ----


async def measure(args: argparse.Namespace) -> dict:
    size, count = args.size, args.count
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--size", str(size)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert child.stdout is not None
        ports = json.loads(child.stdout.readline())
        data = os.urandom(size)
        conn = await aiordma.connect("127.0.0.1", ports["rdma"], provider="soft")
        src = conn.register(bytearray(data), aiordma.Access.LOCAL_WRITE)
        remote = conn.remote("mem")
        reader, writer = await asyncio.open_connection("127.0.0.1", ports["tcp"])
        loop = asyncio.get_running_loop()
        raw = socket.create_connection(("127.0.0.1", ports["raw"]))
        raw.setblocking(False)
        ackbuf = bytearray(1)

        async def child_cpu() -> float:
            await conn.send(b"cpu")
            return float(await conn.recv())

        async def one(way: str) -> None:
            if way == "send/recv":
                await conn.send(b"recv")
                await conn.send(data)
                await conn.recv()
            elif way == "send/recv_into":
                await conn.send(b"recv_into")
                await conn.send(data)
                await conn.recv()
            elif way == "rdma write":
                await conn.write(src, remote)
            elif way == "tcp streams":
                writer.write(b"streams\n")
                writer.write(data)
                await writer.drain()
                await reader.readexactly(1)
            else:
                await loop.sock_sendall(raw, data)
                await loop.sock_recv_into(raw, ackbuf)

        for way in WAYS:  # warm-up: registrations, caches, socket buffers
            await one(way)
        results: dict[str, list[dict]] = {w: [] for w in WAYS}
        for _ in range(args.rounds):
            for way in WAYS:
                c0, p0 = await child_cpu(), _cpu()
                t0 = time.perf_counter()
                for _ in range(count):
                    await one(way)
                dt = time.perf_counter() - t0
                cpu = (await child_cpu() - c0) + (_cpu() - p0)
                results[way].append({"mib_s": size * count / dt / 2**20, "cpu_ms_per_msg": cpu / count * 1e3})
        writer.close()
        raw.close()
        await conn.close()
    finally:
        child.kill()
        child.wait()
    out = {}
    for way, rows in results.items():
        bw = [r["mib_s"] for r in rows]
        out[way] = {
            "median_mib_s": statistics.median(bw),
            "min_mib_s": min(bw),
            "max_mib_s": max(bw),
            "cpu_ms_per_msg": statistics.median(r["cpu_ms_per_msg"] for r in rows),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=size_type(1), default=64 << 20, help="message size (default 64M)")
    p.add_argument("--count", type=int_type(1), default=4, help="messages per round (default 4)")
    p.add_argument("--rounds", type=int_type(1), default=5, help="alternating rounds (default 5)")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    runner = asyncio.run
    if args.loop == "uvloop":
        import uvloop

        runner = uvloop.run  # type: ignore[assignment]
    if args.serve:
        runner(serve(args.size))
        return
    res = runner(measure(args))
    engine = getattr(aiordma.get_device("soft"), "engine", "python")
    print(
        f"{args.size} B messages, {args.count} per round, {args.rounds} alternating rounds; "
        f"soft device ({engine} engine), {args.loop}, Python {platform.python_version()}, {os.cpu_count()} CPUs"
    )
    print("| way | MiB/s median (min-max) | CPU ms/message (both ends) |\n|---|---:|---:|")
    for way, r in res.items():
        print(
            f"| {way} | {r['median_mib_s']:.0f} ({r['min_mib_s']:.0f}-{r['max_mib_s']:.0f}) | {r['cpu_ms_per_msg']:.1f} |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "size": args.size,
                    "count": args.count,
                    "rounds": args.rounds,
                    "loop": args.loop,
                    "engine": engine,
                    "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                    "results": res,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
