"""A client that measures how long a vanished peer host takes to fail it.

``python -m tests.support.vanishing_client HOST PORT``: connects to the child
echo server (``tests.support.child_server``) at HOST:PORT, checks one round
trip, prints ``ready``, then on a line on stdin (the peer host has just been
cut off) starts a Write, a FETCH_ADD, a SEND and a pending ``recv()``, waits
until all four fail, and prints one JSON line: the seconds each took and its
error.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


async def main(host: str, port: int) -> None:
    import aiordma

    conn = await aiordma.connect(host, port, provider="soft")
    await conn.send(b"ping")
    assert await conn.recv() == b"ping"
    remote = conn.remote("mem")
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    t0 = time.monotonic()
    results: dict[str, object] = {}

    async def one(name: str, coro) -> None:
        try:
            await coro
            results[name] = {"ok": True, "s": time.monotonic() - t0}
        except Exception as e:
            results[name] = {"ok": False, "s": time.monotonic() - t0, "error": f"{type(e).__name__}: {e}"}

    await asyncio.wait_for(
        asyncio.gather(
            one("write", conn.write(b"w" * 4096, remote[0:4096])),
            one("fetch_and_add", conn.fetch_and_add(remote[8192:8200], 1)),
            one("send", conn.send(b"s" * 100, wait_ack=True)),
            one("recv", conn.recv()),
        ),
        60,
    )
    print(json.dumps(results), flush=True)
    conn.abort()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
