"""Stream conformance: the same checks on aiordma's RDMA streams and on asyncio's TCP streams.

In the spirit of trio's ``check_two_way_stream`` (``trio/testing/_check_streams.py``),
translated to the asyncio stream API (``StreamReader``/``StreamWriter``). Every check
is written once and runs on both implementations, each on both event loops:

* ``tcp``: ``asyncio.start_server``/``asyncio.open_connection`` over loopback TCP,
  with small socket buffers (so that "bigger than every buffer" stays cheap). This is
  the reference: a check that asyncio's streams fail is a wrong check.
* ``rdma``: ``aiordma.start_stream_server``/``aiordma.open_connection`` on the soft
  device.

Covered: byte order (one direction and both at once), writes bigger than every buffer
on the way, half-close (``write_eof``), EOF and what every read returns at EOF, the
argument checks asyncio defines, concurrent reads (refused) and concurrent drains
(allowed), cancelling a read or a drain in the middle, ``close``/``abort``/
``wait_closed``, and reading after close. Where aiordma departs from asyncio the check
stays as asyncio defines it and is marked ``xfail(strict=True)`` for ``rdma`` with the
reason: it fails today and turns into an error (XPASS) the day it is fixed. aiordma's
own stream features (ring sizes, credits, progress modes, its stricter misuse errors)
are tested in ``test_stream.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import socket
from dataclasses import dataclass

import pytest

import aiordma

T = 30  # per-step bound (s): generous, only a hang reaches it

#: TCP socket buffers of the reference pair (the kernel doubles them). Small, so that
#: BIG below exceeds every buffer on the TCP path without moving tens of MiB.
TCP_SOCKET_BUFFER = 128 * 1024
#: a write bigger than every buffer between the two applications, on both paths:
#: TCP (send + receive socket buffers, asyncio's reader buffer of 2 x 64 KiB) and
#: aiordma (the writer's 64 KiB high-water mark, the peer's 1 MiB receive ring)
BIG = 8 << 20

IMPLS = ["tcp", "rdma"]


@dataclass
class Pair:
    """Two connected stream ends: the client's reader/writer and the server's."""

    impl: str
    cr: asyncio.StreamReader
    cw: asyncio.StreamWriter
    sr: asyncio.StreamReader
    sw: asyncio.StreamWriter


def _small_buffers(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, TCP_SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, TCP_SOCKET_BUFFER)


@pytest.fixture(params=IMPLS)
async def pair(request):
    """A connected :class:`Pair`; everything is closed afterwards."""
    impl = request.param
    accepted: asyncio.Queue = asyncio.Queue()

    async def on_client(reader, writer):
        await accepted.put((reader, writer))

    if impl == "tcp":
        listener = socket.socket()
        _small_buffers(listener)  # accepted sockets inherit them
        listener.bind(("127.0.0.1", 0))
        server = await asyncio.start_server(on_client, sock=listener)
        client = socket.socket()
        _small_buffers(client)
        client.setblocking(False)
        await asyncio.get_running_loop().sock_connect(client, listener.getsockname())
        cr, cw = await asyncio.open_connection(sock=client)
    else:
        server = await aiordma.start_stream_server(on_client, "127.0.0.1", 0, provider="soft")
        cr, cw = await aiordma.open_connection("127.0.0.1", server.port, provider="soft")
    sr, sw = await asyncio.wait_for(accepted.get(), T)
    try:
        yield Pair(impl, cr, cw, sr, sw)
    finally:
        for w in (cw, sw):
            w.close()
        for w in (cw, sw):
            with contextlib.suppress(ConnectionError):
                await asyncio.wait_for(w.wait_closed(), T)
        server.close()
        await asyncio.wait_for(server.wait_closed(), T)


def differs_from_asyncio(request, pair: Pair, reason: str, raises: type[BaseException]) -> None:
    """Mark this check as a known aiordma departure from asyncio (strict: it must fail, with ``raises``)."""
    if pair.impl == "rdma":
        request.applymarker(pytest.mark.xfail(strict=True, raises=raises, reason=reason))


def pattern(n: int, seed: int) -> bytes:
    """``n`` bytes in which every position is distinguishable (a shifted chunk shows)."""
    return random.Random(seed).randbytes(n)


def chunks(data: bytes, seed: int, biggest: int = 70_000):
    """``data`` cut into pieces of varying sizes (1 byte up to ``biggest``)."""
    rng = random.Random(seed)
    off = 0
    while off < len(data):
        n = rng.choice([1, 2, 3, 100, 1000, 4096, rng.randrange(1, biggest)])
        yield data[off : off + n]
        off += n


async def send_all(writer: asyncio.StreamWriter, data: bytes, seed: int) -> None:
    for i, piece in enumerate(chunks(data, seed)):
        writer.write(piece)
        if i % 7 == 0:
            await writer.drain()
    await writer.drain()


async def receive_exactly(reader: asyncio.StreamReader, n: int, seed: int) -> bytes:
    """Read ``n`` bytes with a mix of read(k) and readexactly(k) of varying sizes."""
    rng = random.Random(seed)
    out = bytearray()
    while len(out) < n:
        k = min(n - len(out), rng.choice([1, 5, 512, 8192, 65536, 300_000]))
        if rng.randrange(2):
            piece = await reader.read(k)
            assert piece, f"EOF after {len(out)} of {n} bytes"
        else:
            piece = await reader.readexactly(k)
        out += piece
    return bytes(out)


async def yield_to_loop(times: int = 20) -> None:
    for _ in range(times):
        await asyncio.sleep(0)


# ------------------------------------------------------------------ order ----


async def test_bytes_arrive_in_order(pair: Pair) -> None:
    data = pattern(3 << 20, 1)
    got, _ = await asyncio.wait_for(
        asyncio.gather(receive_exactly(pair.sr, len(data), 2), send_all(pair.cw, data, 3)), T
    )
    assert got == data


async def test_both_directions_at_once(pair: Pair) -> None:
    """Each side writes while the other writes too (trio: send_all in both directions
    while receive_some runs): neither direction waits for the other, nothing mixes."""
    up, down = pattern(2 << 20, 4), pattern(2 << 20, 5)
    got_up, got_down, _, _ = await asyncio.wait_for(
        asyncio.gather(
            receive_exactly(pair.sr, len(up), 6),
            receive_exactly(pair.cr, len(down), 7),
            send_all(pair.cw, up, 8),
            send_all(pair.sw, down, 9),
        ),
        T,
    )
    assert got_up == up and got_down == down


async def test_one_write_bigger_than_every_buffer(pair: Pair) -> None:
    data = pattern(BIG, 10)

    async def send() -> None:
        pair.cw.write(data)  # one call: the stream splits it as its buffers allow
        await pair.cw.drain()
        pair.cw.write_eof()

    async def receive() -> bytes:
        h = hashlib.sha256()
        n = 0
        while piece := await pair.sr.read(1 << 20):
            h.update(piece)
            n += len(piece)
        assert n == BIG
        return h.digest()

    digest, _ = await asyncio.wait_for(asyncio.gather(receive(), send()), T)
    assert digest == hashlib.sha256(data).digest()
    assert pair.sr.at_eof()


# ------------------------------------------------------------ half-close ----


async def test_half_close_keeps_the_other_direction(pair: Pair) -> None:
    assert pair.cw.can_write_eof()
    pair.cw.write(b"request")
    pair.cw.write_eof()
    pair.cw.write_eof()  # idempotent
    with pytest.raises(RuntimeError):
        pair.cw.write(b"after eof")
    assert await asyncio.wait_for(pair.sr.read(), T) == b"request"
    assert pair.sr.at_eof()
    assert not pair.cw.is_closing()
    # the other direction still carries data, in both senses of half-open
    reply = pattern(500_000, 11)
    pair.sw.write(reply)
    await asyncio.wait_for(pair.sw.drain(), T)
    assert await asyncio.wait_for(pair.cr.readexactly(len(reply)), T) == reply
    pair.sw.write_eof()
    assert await asyncio.wait_for(pair.cr.read(), T) == b""
    assert pair.cr.at_eof()


# ------------------------------------------------------------------- EOF ----


async def test_eof_after_data(pair: Pair) -> None:
    pair.cw.write(b"line 1\nline 2\nno newline")
    pair.cw.write_eof()
    assert [line async for line in pair.sr] == [b"line 1\n", b"line 2\n", b"no newline"]
    assert pair.sr.at_eof()
    assert pair.sr.exception() is None


async def test_reads_at_eof(pair: Pair) -> None:
    pair.cw.write(b"abc")
    pair.cw.write_eof()
    with pytest.raises(asyncio.IncompleteReadError) as ei:
        await asyncio.wait_for(pair.sr.readexactly(10), T)
    assert ei.value.partial == b"abc" and ei.value.expected == 10
    # EOF is sticky: every read says so, again and again
    for _ in range(3):
        assert pair.sr.at_eof()
        assert await pair.sr.read() == b""
        assert await pair.sr.read(10) == b""
        assert await pair.sr.readline() == b""
        with pytest.raises(asyncio.IncompleteReadError) as ei:
            await pair.sr.readexactly(1)
        assert ei.value.partial == b""
        with pytest.raises(asyncio.IncompleteReadError) as ei:
            await pair.sr.readuntil(b"\n")
        assert ei.value.partial == b""


async def test_readuntil_at_eof_returns_the_rest_in_the_error(pair: Pair) -> None:
    pair.cw.write(b"no separator")
    pair.cw.write_eof()
    with pytest.raises(asyncio.IncompleteReadError) as ei:
        await asyncio.wait_for(pair.sr.readuntil(b"\r\n"), T)
    assert ei.value.partial == b"no separator" and ei.value.expected is None


async def test_peer_close_is_eof_after_every_byte(pair: Pair) -> None:
    data = pattern(300_000, 12)
    pair.sw.write(data)
    pair.sw.close()
    assert await asyncio.wait_for(pair.cr.read(), T) == data
    assert pair.cr.at_eof()
    await asyncio.wait_for(pair.sw.wait_closed(), T)


# ------------------------------------------------------- argument checks ----


async def test_argument_checks(pair: Pair) -> None:
    assert await pair.sr.read(0) == b""
    assert await pair.sr.readexactly(0) == b""
    with pytest.raises(ValueError):
        await pair.sr.readexactly(-1)
    with pytest.raises(ValueError):
        await pair.sr.readuntil(b"")
    pair.cw.write(b"")  # an empty write is no error
    pair.cw.write(b"x")
    assert await asyncio.wait_for(pair.sr.read(5), T) == b"x"


# --------------------------------------------------------- concurrent use ----


async def test_concurrent_reads_are_refused(pair: Pair) -> None:
    first = asyncio.ensure_future(pair.sr.read(10))
    await yield_to_loop()
    assert not first.done()
    with pytest.raises(RuntimeError, match="already waiting"):
        await pair.sr.read(10)
    with pytest.raises(RuntimeError, match="already waiting"):
        await pair.sr.readexactly(1)
    pair.cw.write(b"hi")
    assert await asyncio.wait_for(first, T) == b"hi"  # the first reader is unharmed


async def test_concurrent_drains_all_return(pair: Pair) -> None:
    data = pattern(BIG, 13)
    pair.cw.write(data)  # more than every buffer: drain must wait for the reader
    drains = [asyncio.ensure_future(pair.cw.drain()) for _ in range(3)]
    await yield_to_loop()
    assert not any(d.done() for d in drains)
    got = await asyncio.wait_for(pair.sr.readexactly(BIG), T)
    await asyncio.wait_for(asyncio.gather(*drains), T)
    assert got == data


# ----------------------------------------------------------- cancellation ----


async def test_cancelled_reads_lose_nothing(pair: Pair) -> None:
    """read(n), readexactly(n) and readuntil() cancelled while they wait (some bytes
    already there): the bytes stay in the stream for the next read."""
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(pair.sr.read(100), 0.05)
    pair.cw.write(b"abc")
    await pair.cw.drain()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(pair.sr.readexactly(6), 0.1)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(pair.sr.readuntil(b"\n"), 0.1)
    pair.cw.write(b"def\nghi")
    assert await asyncio.wait_for(pair.sr.readexactly(6), T) == b"abcdef"
    assert await asyncio.wait_for(pair.sr.readline(), T) == b"\n"
    assert await asyncio.wait_for(pair.sr.readexactly(3), T) == b"ghi"


async def test_cancelled_drain_keeps_the_stream_usable(pair: Pair) -> None:
    data = pattern(BIG, 14)
    pair.cw.write(data)
    drain = asyncio.ensure_future(pair.cw.drain())
    await yield_to_loop()
    assert not drain.done()
    drain.cancel()
    with pytest.raises(asyncio.CancelledError):
        await drain
    # nothing written was dropped, and the writer goes on
    reader = asyncio.ensure_future(pair.sr.readexactly(BIG + 4))
    await asyncio.wait_for(pair.cw.drain(), T)
    pair.cw.write(b"more")
    await asyncio.wait_for(pair.cw.drain(), T)
    assert await asyncio.wait_for(reader, T) == data + b"more"


# ----------------------------------------------------------------- close ----


async def test_close_is_idempotent_and_flushes(pair: Pair) -> None:
    data = pattern(BIG, 15)
    pair.cw.write(data)
    pair.cw.close()
    assert pair.cw.is_closing()
    pair.cw.close()
    got = asyncio.ensure_future(pair.sr.read())  # the peer gets every byte, then EOF
    await asyncio.wait_for(pair.cw.wait_closed(), T)
    await asyncio.wait_for(pair.cw.wait_closed(), T)
    assert await asyncio.wait_for(got, T) == data
    assert pair.sr.at_eof()


async def test_drain_after_close_raises_a_connection_error(pair: Pair) -> None:
    pair.cw.close()
    await asyncio.wait_for(pair.cw.wait_closed(), T)
    with pytest.raises(ConnectionError):
        await pair.cw.drain()


async def test_abort(pair: Pair) -> None:
    """abort(): at once, no flush; the writer is closing, wait_closed returns, and the
    peer's pending read ends (EOF or a ConnectionError, as the transport tells it)."""
    pending = asyncio.ensure_future(pair.sr.read())
    pair.cw.transport.abort()
    assert pair.cw.is_closing()
    await asyncio.wait_for(pair.cw.wait_closed(), T)
    try:
        rest = await asyncio.wait_for(pending, T)
    except ConnectionError:
        pass
    else:
        assert rest == b""


@pytest.mark.parametrize("how", ["close", "abort"])
async def test_read_after_own_close_is_eof(request, pair: Pair, how: str) -> None:
    if how == "close":
        pair.cw.close()
    else:
        pair.cw.transport.abort()
    await asyncio.wait_for(pair.cw.wait_closed(), T)
    assert await pair.cr.read() == b""
    assert await pair.cr.read(10) == b""
    assert await pair.cr.readline() == b""
    assert pair.cr.at_eof()


async def test_own_close_wakes_a_pending_read_with_eof(request, pair: Pair) -> None:
    pending = asyncio.ensure_future(pair.cr.read(10))
    await yield_to_loop()
    assert not pending.done()
    pair.cw.close()
    assert await asyncio.wait_for(pending, T) == b""
