"""A lossy link: every byte still arrives, intact and in order.

The soft device injects faults on its transmit path (``device.faults =
LinkFaults(...)``). Client and server of these tests share the process's soft
device, so every datagram of both directions (requests, ACKs, NAKs, READ
responses, atomic acknowledgements) crosses the faulty link. The RC
transport (go-back-N, retransmit timers, duplicate detection, saved
responder resources) must hide it all:

* echo of messages of mixed sizes (0 B .. 300 KiB) with 1 %, 5 % and 20 %
  of datagrams dropped, and with duplication and reordering on top;
* a byte stream (``aiordma.open_connection`` / ``start_stream_server``) of a
  few MiB, echoed back and compared by SHA-256;
* RDMA Write / Read / atomics under 5 % loss: a FETCH_ADD counter ends at
  exactly the number of adds (an atomic is never executed twice), and each
  add saw a distinct original value.

``ack_timeout=12`` (4.096 µs × 2**12 ≈ 17 ms) keeps the retransmit timer
short enough for 20 % loss; ``retry_cnt=7``. Throughput figures are printed
(``pytest -s``); ``benchmarks/loss.py`` measures them properly (longer runs,
CPU time, ``--json``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import aiordma
from aiordma.providers.soft.faults import LinkFaults

ROOT = Path(__file__).resolve().parents[2]
OPTS = dict(ack_timeout=12, retry_cnt=7)
SIZES = [0, 1, 7, 100, 1023, 4096, 4097, 20_000, 65_535, 65_536, 65_537, 131_072, 200_000, 300 * 1024]


def device():
    return aiordma.get_device("soft")


class lossy:
    """Install LinkFaults on the shared soft device for the duration of a block."""

    def __init__(self, **kw):
        self.faults = LinkFaults(**kw)

    def __enter__(self) -> LinkFaults:
        self.before = device().counters
        device().faults = self.faults
        return self.faults

    def __exit__(self, *exc) -> None:
        device().faults = None


def counter_delta(before: dict, after: dict, *names: str) -> dict:
    return {n: after.get(n, 0) - before.get(n, 0) for n in names}


async def echo_handler(conn):
    async for msg in conn:
        await conn.send(msg)


async def run_echo(drop: float, duplicate: float, reorder: float, volume: int, seed: int) -> dict:
    server = await aiordma.start_server(echo_handler, "127.0.0.1", 0, provider="soft", **OPTS)
    try:
        conn = await aiordma.connect("127.0.0.1", server.port, provider="soft", **OPTS)
        try:
            rng = random.Random(seed)
            with lossy(drop=drop, duplicate=duplicate, reorder=reorder, seed=seed) as faults:
                t0 = time.monotonic()
                total = n = 0
                # sizes cycle through every class first, then at random
                order = SIZES + [rng.choice(SIZES) for _ in range(10_000)]
                window = []
                while total < volume:
                    size = order[n]
                    msg = rng.randbytes(size)
                    n += 1
                    total += size
                    window.append(msg)
                    await conn.send(msg)
                    if len(window) >= 4:  # a few messages in flight, not just ping-pong
                        for m in window:
                            got = await asyncio.wait_for(conn.recv(), 120)
                            assert got == m, f"message of {len(m)} bytes came back as {len(got)} different bytes"
                        window.clear()
                for m in window:
                    got = await asyncio.wait_for(conn.recv(), 120)
                    assert got == m
                elapsed = time.monotonic() - t0
            assert conn.qp.state.name == "IBV_QPS_RTS"
            await conn.drain(timeout=60)  # every message sent was acknowledged
            stats = {
                "messages": n,
                "bytes": total,
                "seconds": elapsed,
                "MB/s": 2 * total / elapsed / 1e6,  # both directions carry every byte
                "dropped": faults.dropped,
                "duplicated": faults.duplicated,
                "reordered": faults.reordered,
            }
            if drop:
                assert faults.dropped > 0
            if duplicate:
                assert faults.duplicated > 0
            if reorder:
                assert faults.reordered > 0
        finally:
            await conn.close()
    finally:
        server.close()
        await server.wait_closed()
    return stats


@pytest.mark.parametrize(
    "drop, duplicate, reorder, volume",
    [
        (0.01, 0.0, 0.0, 3 << 20),
        (0.05, 0.0, 0.0, 2 << 20),
        (0.20, 0.0, 0.0, 1 << 20),
        (0.05, 0.05, 0.05, 2 << 20),
        (0.0, 0.10, 0.10, 2 << 20),
    ],
    ids=["drop1%", "drop5%", "drop20%", "drop5%+dup5%+reorder5%", "dup10%+reorder10%"],
)
async def test_echo_messages_survive_loss(drop, duplicate, reorder, volume):
    before = device().counters
    stats = await run_echo(drop, duplicate, reorder, volume, seed=int(drop * 1000 + duplicate * 100 + reorder * 10))
    after = device().counters
    print(
        f"\necho drop={drop:.0%} dup={duplicate:.0%} reorder={reorder:.0%}: {stats['messages']} messages, "
        f"{stats['bytes'] / 1e6:.1f} MB each way in {stats['seconds']:.2f} s = {stats['MB/s']:.1f} MB/s "
        f"(dropped {stats['dropped']}, duplicated {stats['duplicated']}, reordered {stats['reordered']} datagrams)"
    )
    d = counter_delta(before, after, "rx_icrc_errors", "rx_malformed", "rx_internal_errors")
    assert d == {"rx_icrc_errors": 0, "rx_malformed": 0, "rx_internal_errors": 0}, d


@pytest.mark.parametrize("drop", [0.01, 0.05, 0.20], ids=["drop1%", "drop5%", "drop20%"])
async def test_stream_survives_loss(drop):
    volume = (1 << 20) if drop >= 0.2 else (3 << 20)

    async def echo(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await aiordma.start_stream_server(echo, "127.0.0.1", 0, provider="soft", ring_size=256 * 1024, **OPTS)
    try:
        reader, writer = await aiordma.open_connection(
            "127.0.0.1", server.port, provider="soft", ring_size=256 * 1024, **OPTS
        )
        with lossy(drop=drop, duplicate=0.01, reorder=0.01, seed=7) as faults:
            rng = random.Random(99)
            sent = hashlib.sha256()
            t0 = time.monotonic()

            async def produce():
                left = volume
                while left:
                    n = min(left, rng.choice([1, 10, 1000, 4096, 65536, 100_000]))
                    chunk = rng.randbytes(n)
                    sent.update(chunk)
                    writer.write(chunk)
                    await writer.drain()
                    left -= n
                writer.write_eof()

            async def consume():
                h = hashlib.sha256()
                got = 0
                while data := await reader.read(1 << 17):
                    h.update(data)
                    got += len(data)
                return got, h.hexdigest()

            _, (got, digest) = await asyncio.wait_for(asyncio.gather(produce(), consume()), 240)
            elapsed = time.monotonic() - t0
        assert got == volume
        assert digest == sent.hexdigest(), "stream bytes differ after the lossy link"
        assert faults.dropped > 0
        print(
            f"\nstream drop={drop:.0%}: {volume / 1e6:.1f} MB each way in {elapsed:.2f} s = "
            f"{2 * volume / elapsed / 1e6:.1f} MB/s (dropped {faults.dropped} datagrams)"
        )
        writer.close()
        await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()


async def test_concurrent_sends_under_loss_return_every_credit():
    """Hundreds of messages sent at once, echoed, under 5 % loss. Credits the
    client owes come due while its previous credit update is still waiting
    for its ACK; they must still be returned once it completes, or the echo
    server (blocked on credits) and the client (waiting for echoes) wait for
    each other forever. (Found by the lossy cancellation storm.)"""
    server = await aiordma.start_server(
        echo_handler, "127.0.0.1", 0, provider="soft", recv_buffer_size=4096, recv_buffers=16, **OPTS
    )
    try:
        conn = await aiordma.connect(
            "127.0.0.1",
            server.port,
            provider="soft",
            recv_buffer_size=4096,
            recv_buffers=16,
            send_queue_depth=128,
            **OPTS,
        )
        try:
            for seed in range(4):
                rng = random.Random(seed)
                msgs = [i.to_bytes(4, "big") + rng.randbytes(rng.randint(0, 12_000)) for i in range(600)]
                with lossy(drop=0.05, duplicate=0.02, reorder=0.02, seed=99 + seed):
                    await asyncio.wait_for(asyncio.gather(*(conn.send(m) for m in msgs)), 120)
                    got = [await asyncio.wait_for(conn.recv(), 30) for _ in msgs]
                assert sorted(got) == sorted(msgs)
        finally:
            await conn.close()
    finally:
        server.close()
        await server.wait_closed()


async def rdma_ops_under_loss(drop: float, rounds: int, seed: int, *, duplicate: float = 0.02, reorder: float = 0.02):
    mem = bytearray(1 << 20)
    region = aiordma.register(mem, provider="soft")
    server = await aiordma.start_server(
        echo_handler, "127.0.0.1", 0, provider="soft", expose={"mem": region.exposed("rwa")}, **OPTS
    )
    try:
        conn = await aiordma.connect("127.0.0.1", server.port, provider="soft", **OPTS)
        try:
            rb = conn.remote("mem")
            counter = rb[0:8]
            cas_word = rb[8:16]
            rng = random.Random(seed)
            adds = 0
            originals: list[int] = []
            written = 0
            with lossy(drop=drop, duplicate=duplicate, reorder=reorder, seed=seed) as faults:
                t0 = time.monotonic()
                for _r in range(rounds):
                    # concurrent writes of distinct patterns to distinct slots, then read back
                    slots = rng.sample(range(1, 16), 4)
                    sizes = [rng.choice([1, 100, 4096, 5000, 16_384, 65_536 - 8]) for _ in slots]
                    datas = [rng.randbytes(s) for s in sizes]
                    await asyncio.gather(*(conn.write(d, rb.at(s * 65536, len(d))) for s, d in zip(slots, datas)))
                    written += sum(sizes)
                    for s, d in zip(slots, datas):
                        assert mem[s * 65536 : s * 65536 + len(d)] == d
                    back = await asyncio.gather(*(conn.read(rb.at(s * 65536, len(d))) for s, d in zip(slots, datas)))
                    assert back == datas
                    written += sum(sizes)
                    # a burst of concurrent fetch-and-adds (more than max_rd_atomic in flight)
                    k = rng.randint(1, 40)
                    originals += await asyncio.gather(*(conn.fetch_and_add(counter, 1) for _ in range(k)))
                    adds += k
                    # compare-and-swap: succeeds exactly once per round
                    old = struct.unpack_from("<Q", mem, 8)[0]
                    results = await asyncio.gather(*(conn.compare_and_swap(cas_word, old, old + 1) for _ in range(3)))
                    assert results.count(old) == 1, results
                elapsed = time.monotonic() - t0
            assert struct.unpack_from("<Q", mem, 0)[0] == adds, "a FETCH_ADD was executed twice or lost"
            assert sorted(originals) == list(range(adds)), "two adds saw the same original value"
            assert struct.unpack_from("<Q", mem, 8)[0] == rounds
            assert conn.qp.state.name == "IBV_QPS_RTS"
            return {
                "seconds": elapsed,
                "bytes": written,
                "adds": adds,
                "dropped": faults.dropped,
                "duplicated": faults.duplicated,
            }
        finally:
            await conn.close()
    finally:
        server.close()
        await server.wait_closed()
        region.close()


async def test_rdma_write_read_atomics_under_5_percent_loss():
    before = device().counters
    stats = await rdma_ops_under_loss(0.05, rounds=30, seed=5)
    after = device().counters
    counter_delta(before, after, "duplicate_requests")
    print(
        f"\nRDMA write/read/atomics drop=5%: {stats['bytes'] / 1e6:.1f} MB moved, {stats['adds']} FETCH_ADDs "
        f"in {stats['seconds']:.2f} s = {stats['bytes'] / stats['seconds'] / 1e6:.1f} MB/s "
        f"(dropped {stats['dropped']}, duplicated {stats['duplicated']})"
    )
    assert stats["dropped"] > 0 and stats["duplicated"] > 0


async def test_atomics_under_heavy_duplication_execute_once():
    """Every atomic request duplicated on the wire half of the time: the
    responder answers duplicates from its saved resources, never re-executes."""
    mem = bytearray(4096)
    region = aiordma.register(mem, provider="soft")
    server = await aiordma.start_server(
        echo_handler, "127.0.0.1", 0, provider="soft", expose={"mem": region.exposed("rwa")}, **OPTS
    )
    try:
        conn = await aiordma.connect("127.0.0.1", server.port, provider="soft", **OPTS)
        try:
            counter = conn.remote("mem")[0:8]
            before = device().counters
            with lossy(drop=0.05, duplicate=0.5, reorder=0.2, seed=3):
                originals = []
                for _ in range(10):
                    originals += await asyncio.gather(*(conn.fetch_and_add(counter, 3) for _ in range(30)))
            after = device().counters
            assert struct.unpack_from("<Q", mem, 0)[0] == 3 * 300
            assert sorted(originals) == [3 * i for i in range(300)]
            assert counter_delta(before, after, "duplicate_requests")["duplicate_requests"] > 0
        finally:
            await conn.close()
    finally:
        server.close()
        await server.wait_closed()
        region.close()


def test_loss_benchmark_runs_and_checks_what_it_moves(tmp_path) -> None:
    """``benchmarks/loss.py`` (the throughput figures under loss) runs, short: its JSON
    record has a row per drop rate and the RDMA rounds, and the lossy rows did lose
    datagrams (the script itself fails on any wrong byte)."""
    out = tmp_path / "loss.json"
    args = ["--seconds", "0", "--drops", "0,0.05", "--volume", "300000", "--rdma-rounds", "3"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "loss.py"), *args, "--loop", "asyncio", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = [(r["kind"], r["drop"]) for r in doc["results"]]
    assert rows == [("echo", 0.0), ("echo", 0.05), ("rdma", 0.05)]
    for r in doc["results"]:
        assert r["bytes"] > 0 and r["seconds"] > 0 and r["MBps"] > 0 and r["cpu_s"] >= 0
        assert (r["dropped"] > 0) == (r["drop"] > 0), r
    assert "MB/s one way" in proc.stdout
