"""The aiordma end of each test: the server's handler and the client's
phases, over one connection with a registered, exposed buffer at each end."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from .. import ToolError
from .common import MAX_ALL_SIZE, _pack, _ServerState, _unpack, rx_depth
from .stats import Measurement, _pipelined, _serial, _windowed


def _counters(conn: Any) -> dict[str, int]:
    """The transport counters of ``conn``'s QP and its device's packet counters
    (soft device; empty where a provider has none)."""
    out: dict[str, int] = {}
    try:
        out.update({k: v for k, v in conn.device.counters.items() if k.startswith(("tx_", "rx_"))})
        out.update(conn.qp.counters)
    except (AttributeError, TypeError):
        pass
    return out


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, int) and v != before.get(k, 0)}


# counters that mean the link or a receiver could not keep up (reported next to the figures)
TROUBLE = (
    "retransmits",
    "timeouts",
    "seq_naks_sent",
    "seq_naks_rcvd",
    "rnr_naks_sent",
    "rnr_naks_rcvd",
    "out_of_sequence",
    "duplicate_requests",
    "tx_dropped_full",
    "rx_icrc_errors",
)


def _rdma_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "progress": args.progress,
        "recv_buffers": rx_depth(args),
        "send_queue_depth": max(256, args.tx_depth + 16),
    }


async def _rdma_serve(args: argparse.Namespace, state: _ServerState, port: int) -> Any:
    import aiordma

    bufsize = max(MAX_ALL_SIZE, args.max_size, args.size or 0)
    region = aiordma.register(bytearray(bufsize + 64), provider=args.provider)

    async def handler(conn: Any) -> None:
        state.active += 1
        last = False
        try:
            client_buf = conn.remote_buffers.get("buf")
            while True:
                try:
                    cmd = _unpack(await conn.recv())
                except aiordma.RDMAError:  # closed, or lost (the client reports why)
                    return
                op = cmd.get("op")
                if op == "bye":
                    last = bool(cmd.get("last")) and not (cmd.get("tcp_follows") and args.serve != "rdma")
                    # let the client close first, so its last send is never cut short by our goodbye
                    try:
                        await asyncio.wait_for(conn.recv(), 10)
                    except (TimeoutError, aiordma.RDMAError):
                        pass
                    return
                if op == "cpu":
                    await conn.send(_pack({"op": "cpu", "cpu": time.process_time(), "counters": _counters(conn)}))
                    continue
                test, size, iters = cmd["test"], cmd["size"], cmd["iters"]
                await conn.send(
                    _pack(
                        {
                            "op": "ready",
                            "device": f"{conn.device.provider}:{conn.device.name}",
                            "progress": conn.progress_mode,
                            "cpu": time.process_time(),
                            "counters": _counters(conn),
                        }
                    )
                )
                if test == "send_bw":
                    recv = conn.recv
                    for _ in range(iters):
                        await recv()
                    await conn.send(b"done")
                elif test == "send_lat":
                    recv, send = conn.recv, conn.send
                    for _ in range(iters):
                        await send(await recv())
                elif test == "write_lat":
                    src = region[0:size]
                    dst = client_buf[0:size]
                    recv_imm, write = conn.recv_immediate, conn.write
                    for _ in range(iters):
                        await recv_imm()
                        await write(src, dst, imm=1)
                # write_bw / read_bw / read_lat / atomic_lat: one-sided, nothing to do here
        finally:
            state.active -= 1
            if last and not args.persistent:
                state.finished.set()

    server = await aiordma.start_server(
        handler,
        args.bind,
        port,
        provider=args.provider,
        # the client Writes, Reads and runs atomics on it (write_bw, read_bw, atomic_lat, ...)
        expose={"buf": region.exposed("rwa")},
        insecure=True if getattr(args, "insecure", False) else None,  # None: $AIORDMA_INSECURE decides
        **_rdma_options(args),
    )
    return server


# -------------------------------------------------------- aiordma: client ----


class RdmaClient:
    def __init__(self, args: argparse.Namespace, host: str, port: int, max_size: int) -> None:
        self.args = args
        self.host = host
        self.port = port
        self.max_size = max_size
        self.conn: Any = None
        self.region: Any = None
        self.device = ""
        self.progress = ""
        #: what carries the connection's packets (conn.path.transport)
        self.packet_path = ""
        self.poll_window_us: float | None = None

    async def open(self) -> None:
        import aiordma

        if self.region is None:  # registered once for the whole run
            self.region = aiordma.register(bytearray(self.max_size + 64), provider=self.args.provider)
        self.conn = await aiordma.connect(
            self.host,
            self.port,
            provider=self.args.provider,
            expose={"buf": self.region.exposed("w")},  # the server only Writes into it (write_lat)
            **_rdma_options(self.args),
        )
        self.device = f"{self.conn.device.provider}:{self.conn.device.name}"
        self.progress = self.conn.progress_mode
        self.packet_path = self.conn.path.transport
        #: event mode's poll window (µs) before the loop sleeps on the completion fd
        self.poll_window_us = self.conn.dispatcher.spin_s * 1e6 if self.progress == "event" else None

    async def close(self, last: bool) -> None:
        if self.conn is None:
            return
        import aiordma

        try:
            await self.conn.send(_pack({"op": "bye", "last": last, "tcp_follows": self.args.baseline == "tcp"}))
        except aiordma.RDMAError:
            pass  # the server said goodbye first, or the connection already failed (reported by the caller)
        finally:
            await self.conn.close()
            self.conn = None

    async def phase(
        self, test: str, size: int, iters: int, depth: int, start: asyncio.Barrier | None = None
    ) -> Measurement:
        """One measured phase; with ``start``, every client sharing it waits after
        the server's ready so that all of them begin moving data at once."""
        conn = self.conn
        rb = conn.remote("buf")
        if size > rb.length - 64:
            raise ToolError(
                f"the server exposes {rb.length - 64} bytes, less than size {size}: give it the same -s/--max-size"
            )
        await conn.send(_pack({"op": "phase", "test": test, "size": size, "iters": iters}))
        ready = _unpack(await conn.recv())
        assert ready.get("op") == "ready", ready
        if start is not None:
            await start.wait()
        cpu0 = time.process_time()
        counters0 = _counters(conn)
        local = self.region[0:size]
        remote = rb[0:size]
        m = Measurement("aiordma", test, size, iters, 0, depth)
        m.info["server_device"] = ready.get("device")
        m.info["server_progress"] = ready.get("progress")
        if test == "write_bw" and self.args.post_list > 1:
            # chains of post_list writes, one completion each; depth counts writes
            chain = [(local, remote)] * self.args.post_list
            write_batch = conn.write_batch
            batches = max(1, iters // len(chain))
            await _windowed(m, lambda: write_batch(chain), batches, max(1, depth // len(chain)))
            m.iterations = batches * len(chain)
            m.done_stamps = [t for t in (m.done_stamps or []) for _ in chain]
            m.info["post_list"] = len(chain)
        elif test == "write_bw":
            post_write = conn.post_write
            await _pipelined(m, lambda: post_write(local, remote), iters, depth)
        elif test == "read_bw":
            post_read = conn.post_read
            await _pipelined(m, lambda: post_read(remote, local), iters, depth)
        elif test == "send_bw":
            send = conn.send
            view = local.view
            await _windowed(m, lambda: send(view), iters, depth)
            reply = await conn.recv()  # the receiver got every message
            assert reply == b"done", reply
            m.elapsed_ns = time.perf_counter_ns() - m.t0_ns
        elif test == "read_lat":
            read = conn.read
            await _serial(m, lambda: read(remote, into=local), iters, half=False)
        elif test == "atomic_lat":
            word = rb[0:8] if rb.addr % 8 == 0 else rb.at(8 - rb.addr % 8, 8)
            faa = conn.fetch_and_add
            await _serial(m, lambda: faa(word, 1), iters, half=False)
        elif test == "send_lat":
            send, recv = conn.send, conn.recv
            view = local.view

            async def pingpong() -> None:
                await send(view)
                await recv()

            await _serial(m, pingpong, iters, half=True)
        elif test == "write_lat":
            write, recv_imm = conn.write, conn.recv_immediate

            async def pingpong() -> None:
                await write(local, remote, imm=1)
                await recv_imm()

            await _serial(m, pingpong, iters, half=True)
        else:  # pragma: no cover
            raise ValueError(test)
        m.cpu_client_s = time.process_time() - cpu0
        m.counters["client"] = _delta(_counters(conn), counters0)
        await conn.send(_pack({"op": "cpu"}))
        reply = _unpack(await conn.recv())
        m.cpu_server_s = reply["cpu"] - ready["cpu"]
        m.counters["server"] = _delta(reply.get("counters") or {}, ready.get("counters") or {})
        return m
