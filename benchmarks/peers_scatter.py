"""Scattered-blocks benchmark for peer transfer engines (NIXL, Mooncake Transfer Engine), CPU only.

What is measured: one transfer moves N distinct blocks of B bytes between a target's registered region
(--region-mib MiB of seeded random bytes) and one registered local buffer of N*B bytes in the initiator.
The blocks sit at random B-aligned offsets of the region (numpy default_rng(seed).choice without
replacement) and map to consecutive places of the local buffer. --op read pulls region -> local,
--op write pushes local -> region.

How:
- The script spawns the target itself (multiprocessing "spawn", same interpreter) and talks to it over a
  pipe: the target allocates and registers its region, sends what the initiator needs to reach it, then
  waits on the pipe (blocking, no polling of its own) except for the engine's own threads.
- NIXL (UCX backend): metadata exchanged in-band (get_agent_metadata -> add_remote_agent); the local and
  remote descriptor lists are prepared once (prep_xfer_dlist), one prepared transfer is made once
  (make_prepped_xfer), then each transfer is transfer() + polling check_xfer_state() until DONE. That loop
  drives progress, so the initiator's NIXL progress thread is off unless --nixl-progress-thread; the
  target keeps NIXL's default progress thread (the passive side needs one to answer connection set-up),
  which busy-polls: target_idle_cpu_per_s reports what the target burns with no transfer running. With no
  RDMA device, UCX_MODULES defaults to "^ib" (UCX then uses cma for RMA, tcp for its messages here).
- Mooncake: TransferEngine over the "tcp" protocol with the P2PHANDSHAKE metadata mode; each transfer is
  one batch of N (batch_transfer_sync_read / batch_transfer_sync_write); the address lists are built once.
  The tcp transport fails the slices that overflow its per-peer queue (1024 by default), so the initiator
  sets MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER to fit the batch unless it is already set.
- One warm-up transfer (not counted), a 1 s idle probe of the target's CPU, then --rounds timed transfers.
  For each: wall time (time.perf_counter), initiator CPU (time.process_time, all threads) and target CPU
  (utime+stime of /proc/PID/stat, all threads, in clock ticks, so its resolution is 1/SC_CLK_TCK s).
- Verification, never inside the timed part: for read, every byte of every block is compared against the
  target's region, regenerated from its seed, after every transfer (the local buffer is zeroed before each
  one). For write, the local buffer gets fresh random bytes before every transfer and the target returns
  a BLAKE2b digest of its blocks after it; at the end the target also checks that every byte outside the
  blocks still holds its original value.

Run it with an interpreter that has the engine installed (not aiordma's), e.g.:
    PEERS_VENV/bin/python benchmarks/peers_scatter.py --engine nixl --op read \
        --blocks 10000 --block-size 4096 --rounds 5 --json /tmp/nixl.json
Exit status: 0 verified, 1 a verification failed, 3 the engine cannot be imported (one line says why).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import json
import mmap
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import numpy as np

ENGINE_MODULES: dict[str, tuple[str, ...]] = {
    "nixl": ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"),
    "mooncake": ("mooncake.engine",),
}
LOOPBACK = "127.0.0.1"
PIPE_TIMEOUT_S = 120.0
TRANSFER_TIMEOUT_S = 60.0
IDLE_PROBE_S = 1.0
MOONCAKE_TCP_SLICE = 64 << 10
CLK_TCK = os.sysconf("SC_CLK_TCK")


def import_engine(engine: str) -> tuple[ModuleType, str]:
    """Import the engine's Python module; return it with the version of the distribution providing it."""
    if engine == "nixl" and not any(Path("/sys/class/infiniband").glob("*")):
        # No RDMA device: keep UCX from loading its IB modules, whose bundled libnl-route crashes the process
        # at exit (SIGSEGV in rtnl_tc_unregister, nixl-cu12 1.5.1). Set before the import, inherited by the target.
        os.environ.setdefault("UCX_MODULES", "^ib")
    errors = []
    for name in ENGINE_MODULES[engine]:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        top = name.split(".")[0]
        dists = importlib.metadata.packages_distributions().get(top, [])
        version = "/".join(f"{dist} {importlib.metadata.version(dist)}" for dist in sorted(set(dists)))
        return module, version or "unknown"
    raise ImportError("; ".join(errors))


def mapped_buffer(size: int) -> np.ndarray:
    """A page-aligned, writable, pre-faulted uint8 array of anonymous memory."""
    buf = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
    buf.fill(0)
    return buf


def region_data(size: int, seed: int) -> np.ndarray:
    """The target region's contents: random bytes that either side can regenerate from the seed."""
    return np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8)


def address(buf: np.ndarray) -> int:
    return buf.ctypes.data


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all threads, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def receive(conn: Connection) -> tuple[Any, ...]:
    """The next message from the other process, failing rather than hanging if it went away."""
    if not conn.poll(PIPE_TIMEOUT_S):
        raise TimeoutError(f"no message from the peer process in {PIPE_TIMEOUT_S} s")
    message = conn.recv()
    if message[0] == "error":
        raise RuntimeError(f"target: {message[1]}")
    return message


# --- target side -----------------------------------------------------------------------------------------


def nixl_target(module: ModuleType, region: np.ndarray) -> tuple[Any, dict[str, Any]]:
    agent = module.nixl_agent("target", module.nixl_agent_config(backends=["UCX"]))
    agent.register_memory([(address(region), region.nbytes, 0, "")], "DRAM")
    return agent, {"metadata": agent.get_agent_metadata(), "region_addr": address(region)}


def mooncake_target(module: ModuleType, region: np.ndarray) -> tuple[Any, dict[str, Any]]:
    engine = module.TransferEngine()
    if engine.initialize(LOOPBACK, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("TransferEngine.initialize failed")
    if engine.register_memory(address(region), region.nbytes) != 0:
        raise RuntimeError("TransferEngine.register_memory failed")
    return engine, {"session": f"{LOOPBACK}:{engine.get_rpc_port()}", "region_addr": address(region)}


TARGET_SETUPS = {"nixl": nixl_target, "mooncake": mooncake_target}


def target_main(conn: Connection, engine: str, region_bytes: int, region_seed: int) -> None:
    """The target process: register a region of seeded random bytes, then answer the initiator's checks."""
    region = mapped_buffer(region_bytes)
    region[:] = region_data(region_bytes, region_seed)
    try:
        module, _ = import_engine(engine)
        keep_alive, info = TARGET_SETUPS[engine](module, region)
    except Exception as exc:  # reported to the initiator, which raises it
        conn.send(("error", repr(exc)))
        return
    conn.send(("ready", info))
    _, blocks, block_size = conn.recv()
    rows = region.reshape(-1, block_size)
    while (request := conn.recv()[0]) != "stop":
        if request == "digest":
            conn.send(("digest", hashlib.blake2b(rows[blocks].tobytes()).hexdigest()))
        elif request == "untouched":
            others = np.ones(len(rows), dtype=bool)
            others[blocks] = False
            original = region_data(region_bytes, region_seed).reshape(rows.shape)
            conn.send(("untouched", bool(np.array_equal(rows[others], original[others]))))
    del keep_alive


# --- initiator side --------------------------------------------------------------------------------------


class Initiator(Protocol):
    def transfer(self) -> None: ...

    def close(self) -> None: ...


class NixlInitiator:
    """Descriptor lists prepared once, one prepared transfer, reposted with transfer() and polled.

    The polling loop drives UCX progress itself, so NIXL's progress thread is off here unless
    --nixl-progress-thread asks for it (NIXL's default).
    """

    def __init__(
        self, module: ModuleType, info: dict[str, Any], local: np.ndarray, offsets: np.ndarray, args: argparse.Namespace
    ) -> None:
        config = module.nixl_agent_config(enable_prog_thread=args.nixl_progress_thread, backends=["UCX"])
        self._agent = module.nixl_agent("initiator", config)
        self._registration = self._agent.register_memory([(address(local), local.nbytes, 0, "")], "DRAM")
        self._remote = self._agent.add_remote_agent(info["metadata"])
        count = len(offsets)
        local_addrs = address(local) + np.arange(count, dtype=np.uint64) * np.uint64(args.block_size)
        remote_addrs = np.uint64(info["region_addr"]) + offsets.astype(np.uint64)
        lengths = np.full(count, args.block_size, dtype=np.uint64)
        devices = np.zeros(count, dtype=np.uint64)
        self._local_side = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", np.column_stack([local_addrs, lengths, devices]), "DRAM"
        )
        self._remote_side = self._agent.prep_xfer_dlist(
            self._remote, np.column_stack([remote_addrs, lengths, devices]), "DRAM"
        )
        indices = np.arange(count, dtype=np.int32)
        self._handle = self._agent.make_prepped_xfer(
            args.op.upper(), self._local_side, indices, self._remote_side, indices
        )

    def transfer(self) -> None:
        deadline = time.perf_counter() + TRANSFER_TIMEOUT_S
        state = self._agent.transfer(self._handle)
        while state == "PROC" and time.perf_counter() < deadline:
            state = self._agent.check_xfer_state(self._handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended in state {state}")

    def close(self) -> None:
        self._agent.release_xfer_handle(self._handle)
        self._agent.release_dlist_handle(self._local_side)
        self._agent.release_dlist_handle(self._remote_side)
        self._agent.remove_remote_agent(self._remote)
        self._agent.deregister_memory(self._registration)


class MooncakeInitiator:
    """One synchronous batch of N per transfer over the tcp protocol; the address lists are built once."""

    def __init__(
        self, module: ModuleType, info: dict[str, Any], local: np.ndarray, offsets: np.ndarray, args: argparse.Namespace
    ) -> None:
        # The tcp transport fails (rather than queues) the slices of a batch beyond its per-peer queue
        # (1024 by default): make room for the whole batch unless the caller chose a value.
        slices = len(offsets) * -(-args.block_size // int(os.environ.get("MC_TCP_SLICE_SIZE", MOONCAKE_TCP_SLICE)))
        os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", str(max(slices, 1024)))
        self._engine = module.TransferEngine()
        if self._engine.initialize(LOOPBACK, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("TransferEngine.initialize failed")
        self._local_addr = address(local)
        if self._engine.register_memory(self._local_addr, local.nbytes) != 0:
            raise RuntimeError("TransferEngine.register_memory failed")
        count = len(offsets)
        self._batch_args = (
            info["session"],
            [self._local_addr + i * args.block_size for i in range(count)],
            [info["region_addr"] + int(offset) for offset in offsets],
            [args.block_size] * count,
        )
        engine = self._engine
        self._batch = engine.batch_transfer_sync_read if args.op == "read" else engine.batch_transfer_sync_write

    def transfer(self) -> None:
        status = self._batch(*self._batch_args)
        if status != 0:
            raise RuntimeError(f"Mooncake batch transfer returned {status}")

    def close(self) -> None:
        self._engine.unregister_memory(self._local_addr)


INITIATORS: dict[str, Callable[[ModuleType, dict[str, Any], np.ndarray, np.ndarray, argparse.Namespace], Initiator]] = {
    "nixl": NixlInitiator,
    "mooncake": MooncakeInitiator,
}


class Verifier:
    """Checks each transfer outside the timed part (see the module docstring).

    expected: the bytes a read must leave in the local buffer (unused for write).
    """

    def __init__(self, op: str, conn: Connection, local: np.ndarray, expected: np.ndarray, payload_seed: int) -> None:
        self._op, self._conn, self._local, self._expected = op, conn, local, expected
        self._payloads = np.random.default_rng(payload_seed)
        self._digest = ""

    def prepare(self) -> None:
        if self._op == "read":
            self._local.fill(0)
        else:
            self._local[:] = np.frombuffer(self._payloads.bytes(self._local.nbytes), dtype=np.uint8)
            self._digest = hashlib.blake2b(self._local.tobytes()).hexdigest()

    def check(self) -> bool:
        if self._op == "read":
            return bool(np.array_equal(self._local, self._expected))
        self._conn.send(("digest",))
        return receive(self._conn)[1] == self._digest

    def final_check(self) -> bool:
        if self._op == "read":
            return True
        self._conn.send(("untouched",))
        return bool(receive(self._conn)[1])


def run(args: argparse.Namespace, module: ModuleType, version: str) -> dict[str, Any]:
    region_bytes = args.region_mib << 20
    slots = region_bytes // args.block_size
    block_indices = np.random.default_rng(args.seed).choice(slots, size=args.blocks, replace=False)
    offsets = block_indices.astype(np.int64) * args.block_size
    local = mapped_buffer(args.blocks * args.block_size)
    region_seed = args.seed + 1

    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    target = ctx.Process(target=target_main, args=(child_conn, args.engine, region_bytes, region_seed))
    target.start()
    pid = target.pid
    assert pid is not None
    try:
        info = receive(conn)[1]
        conn.send(("blocks", block_indices, args.block_size))
        initiator = INITIATORS[args.engine](module, info, local, offsets, args)
        if args.op == "read":
            rows = region_data(region_bytes, region_seed).reshape(-1, args.block_size)
            expected = rows[block_indices].reshape(-1)
        else:
            expected = np.empty(0, dtype=np.uint8)
        verifier = Verifier(args.op, conn, local, expected, args.seed + 2)
        verifier.prepare()
        initiator.transfer()  # warm-up: connection set-up, first touch; not counted
        verified = verifier.check()
        idle0 = cpu_seconds(pid)
        time.sleep(IDLE_PROBE_S)
        target_idle_cpu_per_s = (cpu_seconds(pid) - idle0) / IDLE_PROBE_S
        transfers = []
        for _ in range(args.rounds):
            verifier.prepare()
            target_cpu0 = cpu_seconds(pid)
            cpu0 = time.process_time()
            wall0 = time.perf_counter()
            initiator.transfer()
            wall1 = time.perf_counter()
            cpu1 = time.process_time()
            target_cpu1 = cpu_seconds(pid)
            transfers.append(
                {"wall_s": wall1 - wall0, "initiator_cpu_s": cpu1 - cpu0, "target_cpu_s": target_cpu1 - target_cpu0}
            )
            verified = verifier.check() and verified
        verified = verifier.final_check() and verified
        initiator.close()
        conn.send(("stop",))
        target.join(PIPE_TIMEOUT_S)
    finally:
        if target.is_alive():
            target.terminate()
            target.join()

    median_wall = statistics.median(t["wall_s"] for t in transfers)
    if args.engine == "nixl":
        engine_notes = [
            "UCX backend",
            "dlists prepped once, make_prepped_xfer once, per transfer transfer() + busy check_xfer_state()",
            f"initiator progress thread {'on' if args.nixl_progress_thread else 'off'}",
            "target progress thread on (NIXL's default; it busy-polls, see target_idle_cpu_per_s)",
            f"UCX_MODULES={os.environ.get('UCX_MODULES', '')}",
        ]
    else:
        queue = os.environ["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"]
        engine_notes = [
            "tcp protocol, P2PHANDSHAKE metadata",
            f"one batch_transfer_sync_{args.op} of {args.blocks} per transfer, address lists built once",
            f"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER={queue} in the initiator",
        ]
    notes = [
        *engine_notes,
        "two processes on one host (loopback), CPU memory only",
        f"target CPU from /proc/PID/stat, resolution {1 / CLK_TCK:g} s",
        "one warm-up transfer not counted, verification outside the timed part",
    ]
    return {
        "engine": args.engine,
        "version": version,
        "op": args.op,
        "blocks": args.blocks,
        "block_size": args.block_size,
        "region_mib": args.region_mib,
        "seed": args.seed,
        "nixl_progress_thread": args.nixl_progress_thread if args.engine == "nixl" else None,
        "transfers": transfers,
        "median_wall_s": median_wall,
        "median_initiator_cpu_s": statistics.median(t["initiator_cpu_s"] for t in transfers),
        "median_target_cpu_s": statistics.median(t["target_cpu_s"] for t in transfers),
        "target_idle_cpu_per_s": target_idle_cpu_per_s,
        "gbps": args.blocks * args.block_size / median_wall / 1e9,
        "verified": verified,
        "target_exitcode": target.exitcode,
        "notes": "; ".join(notes),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=sorted(ENGINE_MODULES), required=True)
    parser.add_argument("--op", choices=("read", "write"), required=True)
    parser.add_argument("--blocks", type=int, required=True, help="N, blocks per transfer")
    parser.add_argument("--block-size", type=int, required=True, help="B, bytes per block")
    parser.add_argument("--region-mib", type=int, default=64, help="target region size in MiB")
    parser.add_argument("--rounds", type=int, default=5, help="timed transfers, after one warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--nixl-progress-thread",
        action="store_true",
        help="also run NIXL's progress thread in the initiator (NIXL's default; off otherwise)",
    )
    parser.add_argument("--json", required=True, help="where to write the results")
    args = parser.parse_args(argv)
    if min(args.blocks, args.block_size, args.region_mib, args.rounds) < 1:
        parser.error("--blocks, --block-size, --region-mib and --rounds must be positive")
    if args.blocks > (args.region_mib << 20) // args.block_size:
        parser.error("the region holds fewer than --blocks blocks of --block-size bytes")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        module, version = import_engine(args.engine)
    except ImportError as exc:
        print(f"peers_scatter: {args.engine} unavailable: {exc}")
        return 3
    result = run(args, module, version)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(
        f"{args.engine} ({version}) {args.op} {args.blocks} x {args.block_size} B: "
        f"median {result['median_wall_s'] * 1e3:.2f} ms, {result['gbps']:.2f} GB/s, "
        f"initiator CPU {result['median_initiator_cpu_s'] * 1e3:.2f} ms, "
        f"target CPU {result['median_target_cpu_s'] * 1e3:.2f} ms, verified={result['verified']}"
    )
    return 0 if result["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
