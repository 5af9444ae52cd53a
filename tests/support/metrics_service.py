"""A small aiordma service in a child process, for the tests that scrape it.

``python -m tests.support.metrics_service --loop asyncio|uvloop --writes N --sends M``
serves ``/metrics`` and ``/health`` (:func:`aiordma.prometheus.serve`, port 0),
starts a server on the soft device, connects to it, makes N awaited 64-byte RDMA
Writes and M 64-byte sends on that one connection (the server's handler reads
them all), then prints one JSON line (``{"metrics_port": ...}``) and keeps the
connection open until a line arrives on stdin.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import uvloop

import aiordma
import aiordma.prometheus


async def serve(writes: int, sends: int) -> None:
    metrics = aiordma.prometheus.serve(0)
    memory = bytearray(4096)
    received = 0
    all_received = asyncio.Event()

    async def handler(conn: aiordma.Connection) -> None:
        nonlocal received
        async for _ in conn:
            received += 1
            if received == sends:
                all_received.set()

    server = await aiordma.start_server(handler, "127.0.0.1", 0, expose={"mem": aiordma.register(memory).exposed("rw")})
    port = server.sockets[0].getsockname()[1]
    conn = await aiordma.connect("127.0.0.1", port)
    local = conn.register(bytearray(64))
    remote = conn.remote("mem")[0:64]
    for _ in range(writes):
        await conn.write(local, remote)
    for i in range(sends):
        await conn.send(i.to_bytes(8, "little") * 8)
    if sends:
        await asyncio.wait_for(all_received.wait(), 30)
    print(json.dumps({"metrics_port": metrics.port}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await conn.close()
    server.close()
    await server.wait_closed()
    metrics.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    ap.add_argument("--writes", type=int, default=0)
    ap.add_argument("--sends", type=int, default=0)
    args = ap.parse_args()
    factory = uvloop.new_event_loop if args.loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(args.writes, args.sends))


if __name__ == "__main__":
    main()
