"""The baseline: asyncio TCP streams doing the same pattern and sizes.

Control frames are a 4-byte big-endian length + msgpack; the data follows
the "ready" frame."""

from __future__ import annotations

import argparse
import asyncio
import socket
import struct
import time
from typing import Any

from .common import MAX_ALL_SIZE, TCP_READ, _pack, _ServerState, _unpack, tcp_limit
from .stats import Measurement, _serial, peak_rate

_HDR = struct.Struct("!I")
_Q = struct.Struct("!Q")


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def _write_frame(writer: asyncio.StreamWriter, obj: Any) -> None:
    body = _pack(obj)
    writer.write(_HDR.pack(len(body)) + body)


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    try:
        hdr = await reader.readexactly(4)
    except asyncio.IncompleteReadError:
        return None
    return _unpack(await reader.readexactly(_HDR.unpack(hdr)[0]))


async def _tcp_serve(args: argparse.Namespace, state: _ServerState, port: int) -> Any:
    bufsize = max(MAX_ALL_SIZE, args.max_size, args.size or 0)
    payload = bytes(bufsize)

    async def session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _nodelay(writer)
        state.active += 1
        last = False
        counter = 0
        try:
            while True:
                cmd = await _read_frame(reader)
                if cmd is None:
                    return
                if cmd.get("op") == "bye":
                    last = bool(cmd.get("last"))
                    return
                if cmd.get("op") == "cpu":
                    _write_frame(writer, {"op": "cpu", "cpu": time.process_time()})
                    await writer.drain()
                    continue
                test, size, iters, depth = cmd["test"], cmd["size"], cmd["iters"], cmd.get("depth", 1)
                _write_frame(writer, {"op": "ready", "cpu": time.process_time()})
                await writer.drain()
                window = size * max(depth, iters // 20, 1)
                if test == "write_bw":
                    total, got = size * iters, 0
                    stamps, cum = [], []
                    t0 = time.perf_counter_ns()
                    read = reader.read
                    while got < total:
                        data = await read(min(TCP_READ, total - got))
                        if not data:
                            return
                        got += len(data)
                        stamps.append(time.perf_counter_ns())
                        cum.append(got)
                    _write_frame(writer, {"op": "done", "peak": peak_rate(t0, stamps, cum, window)})
                    await writer.drain()
                elif test == "send_bw":
                    stamps = [0] * iters
                    t0 = time.perf_counter_ns()
                    readexactly, unpack = reader.readexactly, _HDR.unpack
                    for i in range(iters):
                        (n,) = unpack(await readexactly(4))
                        await readexactly(n)
                        stamps[i] = time.perf_counter_ns()
                    cum = [size * (k + 1) for k in range(iters)]
                    _write_frame(writer, {"op": "done", "peak": peak_rate(t0, stamps, cum, window)})
                    await writer.drain()
                elif test in ("read_bw", "read_lat"):
                    left = iters
                    data = payload[:size]
                    while left:
                        reqs = await reader.read(left)
                        if not reqs:
                            return
                        for _ in range(len(reqs)):
                            writer.write(data)
                        left -= len(reqs)
                        await writer.drain()
                elif test == "atomic_lat":
                    for _ in range(iters):
                        (add,) = _Q.unpack(await reader.readexactly(8))
                        writer.write(_Q.pack(counter))
                        counter = (counter + add) & 0xFFFFFFFFFFFFFFFF
                        await writer.drain()
                elif test == "send_lat":
                    readexactly, unpack = reader.readexactly, _HDR.unpack
                    for _ in range(iters):
                        hdr = await readexactly(4)
                        body = await readexactly(unpack(hdr)[0])
                        writer.write(hdr + body)
                        await writer.drain()
                elif test == "write_lat":
                    readexactly = reader.readexactly
                    for _ in range(iters):
                        writer.write(await readexactly(size))
                        await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            state.active -= 1
            writer.close()
            if last and not args.persistent:
                state.finished.set()

    return await asyncio.start_server(session, args.bind, port, limit=tcp_limit(args))


class TcpClient:
    def __init__(self, args: argparse.Namespace, host: str, port: int, max_size: int) -> None:
        self.args = args
        self.host = host
        self.port = port
        self.buf = bytearray(max_size)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=tcp_limit(self.args))
        _nodelay(self.writer)

    async def close(self, last: bool) -> None:
        if self.writer is None:
            return
        try:
            _write_frame(self.writer, {"op": "bye", "last": last})
            await self.writer.drain()
        finally:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except ConnectionError:
                pass
            self.reader = self.writer = None

    async def phase(
        self, test: str, size: int, iters: int, depth: int, start: asyncio.Barrier | None = None
    ) -> Measurement:
        """One measured phase; with ``start``, every client sharing it waits after
        the server's ready so that all of them begin moving data at once."""
        reader, writer = self.reader, self.writer
        assert reader is not None and writer is not None
        _write_frame(writer, {"op": "phase", "test": test, "size": size, "iters": iters, "depth": depth})
        await writer.drain()
        ready = await _read_frame(reader)
        assert ready and ready.get("op") == "ready", ready
        if start is not None:
            await start.wait()
        cpu0 = time.process_time()
        m = Measurement("tcp", test, size, iters, 0, depth)
        view = memoryview(self.buf)[:size]
        clock = time.perf_counter_ns
        write, drain = writer.write, writer.drain
        readexactly = reader.readexactly
        if test == "write_bw":
            m.t0_ns = clock()
            for _ in range(iters):
                write(view)
                await drain()
            done = await _read_frame(reader)
            m.elapsed_ns = clock() - m.t0_ns
            m.peak_Bps = done["peak"]
        elif test == "send_bw":
            hdr = _HDR.pack(size)
            m.t0_ns = clock()
            for _ in range(iters):
                write(hdr)
                write(view)
                await drain()
            done = await _read_frame(reader)
            m.elapsed_ns = clock() - m.t0_ns
            m.peak_Bps = done["peak"]
        elif test in ("read_bw", "read_lat"):
            depth = depth if test == "read_bw" else 1
            post = [0] * iters
            stamps = [0] * iters
            first = min(depth, iters)
            m.t0_ns = clock()
            for k in range(first):
                post[k] = m.t0_ns
            write(b"\x01" * first)
            await drain()
            sent = first
            for i in range(iters):
                await readexactly(size)
                stamps[i] = clock()
                if sent < iters:
                    post[sent] = stamps[i]
                    write(b"\x01")
                    sent += 1
                    await drain()
            m.elapsed_ns = clock() - m.t0_ns
            m.lat_samples_ns = [d - p for d, p in zip(stamps, post)]
            if test == "read_bw":
                m.done_stamps = stamps
        elif test == "atomic_lat":
            one = _Q.pack(1)

            async def faa() -> None:
                write(one)
                await drain()
                await readexactly(8)

            await _serial(m, faa, iters, half=False)
        elif test == "send_lat":
            msg = _HDR.pack(size) + bytes(view)
            unpack = _HDR.unpack

            async def pingpong() -> None:
                write(msg)
                await drain()
                await readexactly(unpack(await readexactly(4))[0])

            await _serial(m, pingpong, iters, half=True)
        elif test == "write_lat":

            async def pingpong() -> None:
                write(view)
                await drain()
                await readexactly(size)

            await _serial(m, pingpong, iters, half=True)
        else:  # pragma: no cover
            raise ValueError(test)
        m.cpu_client_s = time.process_time() - cpu0
        _write_frame(writer, {"op": "cpu"})
        await writer.drain()
        m.cpu_server_s = (await _read_frame(reader))["cpu"] - ready["cpu"]
        return m
