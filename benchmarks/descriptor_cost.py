#!/usr/bin/env python3
"""Instructions per descriptor of a descriptor-list transfer, counted by callgrind.

One process holds both ends (a server exposing 4 MiB, a client connected to it on
the same device) and, under ``valgrind --tool=callgrind``, moves ``--blocks``
scattered ``--block-size`` blocks with ``await conn.transfer("read", ...)``
``--repeats`` times after a warm-up, with callgrind's client requests around each
transfer (:mod:`instructions`' :class:`ClientRequests`): the figure is the median
transfer, less an empty phase, over the number of descriptors — every instruction
the process retires in user space for them, in every thread: the interpreter,
aiordma's Python and compiled core, the provider (pyverbs' extended verbs and
libibverbs' userspace driver on a verbs device; the soft device's whole NIC on the
soft device, target side included, since it runs in this process), libc. What a
kernel driver does (kernel rxe, a NIC's firmware) is not counted: on a verbs device
the figure is what the initiator's CPU pays per descriptor in user space.

    python benchmarks/descriptor_cost.py                       # the soft device
    scripts/rxe-vm run -- .venv/bin/python benchmarks/descriptor_cost.py --provider pyverbs
    python benchmarks/descriptor_cost.py --json out.json --blocks 2000 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # (numpy's spinning threads: see transfer.py)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import instructions  # noqa: E402

REGION = 4 << 20


def _counted(args: argparse.Namespace) -> int:
    """Under callgrind: warm up, then one empty phase and ``--repeats`` transfers."""
    import numpy as np

    import aiordma

    if args.sendwr:  # the general chain: a SendWR object per descriptor (for comparison)
        from aiordma.providers.pyverbs import PyverbsQP

        PyverbsQP.post_rdma_table = None  # type: ignore[assignment,method-assign]
    cr = instructions._valgrind_requests()
    labels = [cr.label(x) for x in ["empty", *(f"transfer:{k}" for k in range(args.repeats)), "after"]]

    async def main() -> dict[str, Any]:
        device = aiordma.get_device(args.provider, args.device)
        mem = bytearray(REGION)
        region = aiordma.register(mem, device=device)

        async def handler(conn: aiordma.Connection) -> None:
            async for _ in conn:
                pass

        server = await aiordma.start_server(
            handler, "127.0.0.1", 0, device=device, expose={"pool": region.exposed("rw")}, handshake_timeout=600
        )
        conn = await aiordma.connect("127.0.0.1", server.port, device=device, timeout=600, ack_timeout=24)
        n, block = args.blocks, args.block_size
        places = np.random.default_rng(1).choice(REGION // block, n, replace=False).astype(np.uint64) * block
        table = np.stack([np.arange(n, dtype=np.uint64) * block, places, np.full(n, block, np.uint64)], axis=1)
        local = conn.register(bytearray(n * block))
        remote = conn.remote("pool")
        extended = bool(getattr(conn.qp, "extended", False))
        for _ in range(2):
            await conn.transfer("read", local, remote, table)
        cr.start_instrumentation()
        cr.dump(labels[0])
        for k in range(args.repeats):
            await conn.transfer("read", local, remote, table)
            cr.dump(labels[1 + k])
        cr.stop_instrumentation()
        await conn.close()
        server.close()
        await server.wait_closed()
        return {"provider": str(device.provider), "extended_verbs": extended}

    info = asyncio.run(main())
    Path(args.out).write_text(json.dumps(info))
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="descriptor-cost-") as tmp:
        out = Path(tmp) / "info.json"
        argv = [
            *instructions.valgrind_argv(tmp),
            sys.executable,
            str(Path(__file__).resolve()),
            "--counted",
            "--out",
            str(out),
            "--provider",
            args.provider,
            "--blocks",
            str(args.blocks),
            "--block-size",
            str(args.block_size),
            "--repeats",
            str(args.repeats),
        ]
        if args.device:
            argv += ["--device", args.device]
        if args.sendwr:
            argv.append("--sendwr")
        env = {**os.environ, "AIORDMA_SOFT_POLL_US": "0", "AIORDMA_SOFT_SHM_POLL_US": "0"}
        cp = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600)
        if cp.returncode != 0:
            raise SystemExit(f"descriptor_cost.py: the counted process failed ({cp.returncode}):\n{cp.stderr[-3000:]}")
        dumps = instructions.read_dumps(Path(tmp))
        info = json.loads(out.read_text())
    empty = dumps["empty"]
    phases = [dumps[f"transfer:{k}"] for k in range(args.repeats)]
    per = [(d["ir"] - empty["ir"]) / args.blocks for d in phases]
    mid = sorted(phases, key=lambda d: d["ir"])[(len(phases) - 1) // 2]
    return {
        **info,
        "sendwr": args.sendwr,
        "blocks": args.blocks,
        "block_size": args.block_size,
        "instructions_per_descriptor": round(statistics.median(per)),
        "phases_per_descriptor": [round(x) for x in per],
        "by_part": {k: round((mid["parts"][k] - empty["parts"][k]) / args.blocks) for k in instructions.PARTS},
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--provider", default="soft", help="soft (default) or pyverbs")
    ap.add_argument("--device", default=None, help="the device's name (default: the provider's first)")
    ap.add_argument("--blocks", type=int, default=1000, help="descriptors per transfer (default 1000)")
    ap.add_argument("--block-size", type=int, default=512, help="bytes per descriptor (default 512)")
    ap.add_argument("--repeats", type=int, default=3, help="counted transfers (default 3)")
    ap.add_argument(
        "--sendwr",
        action="store_true",
        help="pyverbs: post each chunk as SendWR objects (the general chain) instead of the flat table, to compare",
    )
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    ap.add_argument("--counted", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.blocks < 1 or args.repeats < 1 or not 1 <= args.block_size <= REGION // max(args.blocks, 1):
        ap.error(f"--blocks x --block-size must fit the {REGION >> 20} MiB region, each at least 1")
    if args.counted:
        return _counted(args)
    if instructions.valgrind_version() is None:
        ap.exit(2, "descriptor_cost.py: valgrind is not installed\n")
    r = measure(args)
    print(
        f"{r['provider']} (extended verbs: {r['extended_verbs']}{', SendWRs' if r['sendwr'] else ''}): {r['instructions_per_descriptor']:,} instructions "
        f"per descriptor ({r['blocks']} x {r['block_size']} B Reads per transfer, transfers "
        f"{r['phases_per_descriptor']}); by part {r['by_part']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
