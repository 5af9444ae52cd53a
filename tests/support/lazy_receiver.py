"""A child process whose application reads only when told (for receive-budget tests).

``python -m tests.support.lazy_receiver`` starts an aiordma server on the soft
device and prints its TCP port. It accepts one connection and answers commands
on stdin, one per line, with one JSON line on stdout:

* ``rss``: ``{"rss": bytes}`` (VmRSS of this process);
* ``read N``: receives N messages, then ``{"count": N, "bytes": total,
  "sha256": hex, "rss_before": bytes}``.

Until ``read`` comes, nothing calls ``recv()``: messages pile up as far as the
connection lets them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys

import aiordma


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def main() -> None:
    conns: asyncio.Queue[aiordma.Connection] = asyncio.Queue()

    async def handler(conn: aiordma.Connection) -> None:
        conn.detach()
        await conns.put(conn)

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft")
    print(server.port, flush=True)
    conn = await conns.get()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().split():
        if line[0] == "rss":
            print(json.dumps({"rss": rss()}), flush=True)
        elif line[0] == "read":
            before = rss()
            digest = hashlib.sha256()
            total = 0
            for _ in range(int(line[1])):
                msg = await conn.recv()
                digest.update(msg)
                total += len(msg)
            print(
                json.dumps({"count": int(line[1]), "bytes": total, "sha256": digest.hexdigest(), "rss_before": before}),
                flush=True,
            )
    await conn.close()
    server.close()
    await server.wait_closed()


if __name__ == "__main__":
    asyncio.run(main())
