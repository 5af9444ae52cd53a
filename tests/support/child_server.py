"""An aiordma echo server in a child process, for tests that kill their peer.

The child (``python -m tests.support.child_server --mem-size N``) opens its own
soft device, registers N bytes exposed to clients as ``"mem"``, echoes every
message back (``conn.send``), prints its TCP port on one line and serves until
it is killed. In the test process::

    with ChildServer.start(mem_size=1 << 20) as child:
        conn = await aiordma.connect("127.0.0.1", child.port, provider="soft")
        ...
        child.kill()   # SIGKILL: the peer vanishes without a word

``start`` waits (bounded) for the port line and fails with the child's stderr
if it does not come; leaving the ``with`` block kills and reaps the child.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ChildServer:
    """A running child echo server: its process and the TCP port it listens on."""

    proc: subprocess.Popen
    port: int
    stderr: IO[str]  # a file, not a pipe: a chatty child never blocks on it

    @classmethod
    def start(cls, mem_size: int = 1 << 20, timeout: float = 30.0) -> ChildServer:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        stderr = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.child_server", "--mem-size", str(mem_size)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        child = cls(proc, 0, stderr)
        try:
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            line = proc.stdout.readline() if ready else ""
            if not line.strip().isdigit():
                proc.kill()
                proc.wait(timeout=10)
                stderr.seek(0)
                raise AssertionError(
                    f"child server did not start within {timeout} s: {line!r}\n{stderr.read()[-3000:]}"
                )
            child.port = int(line)
        except BaseException:
            child.close()
            raise
        return child

    def stop(self, timeout: float = 10.0) -> None:
        """SIGSTOP, and wait until the kernel says the child is stopped (state ``T``):
        from then on no thread of it runs, so nothing is acknowledged any more."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    return
            time.sleep(0.001)
        raise AssertionError(f"the child did not stop within {timeout} s")

    def resume(self) -> None:
        """SIGCONT after :meth:`stop`."""
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: the peer disappears mid-traffic, as a crashed host would."""
        self.proc.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Kill the child if it still runs, reap it, close its pipe and file."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.stderr.close()

    def __enter__(self) -> ChildServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _serve(mem_size: int, host: str = "127.0.0.1") -> None:
    import aiordma

    mem = aiordma.register(bytearray(mem_size), provider="soft")

    async def handler(conn):
        async for m in conn:
            await conn.send(m)

    server = await aiordma.start_server(handler, host, 0, provider="soft", expose={"mem": mem.exposed("rwa")})
    print(server.port, flush=True)
    await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mem-size", type=int, default=1 << 20, help="bytes exposed as 'mem' (default 1 MiB)")
    ap.add_argument("--host", default="127.0.0.1", help="the rendezvous address (default 127.0.0.1)")
    args = ap.parse_args()
    asyncio.run(_serve(args.mem_size, args.host))


if __name__ == "__main__":
    main()
