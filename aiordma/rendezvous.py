"""The TCP rendezvous: how two peers learn each other's queue pair.

RDMA needs out-of-band set-up: each side must know the other's QP number,
starting PSN, GID (on RoCEv2 the IPv4-mapped address), path MTU and, for
one-sided operations, the (addr, length, rkey) of each buffer the peer
exposes. aiordma exchanges them over an ordinary asyncio TCP connection,
the way the classic C demo does with a raw struct, but versioned,
validated and optionally authenticated:

1. client → server ``hello``  {v, caps, nonce}
2. server → client ``hello``  {v, caps, nonce, auth}
3. (if a token is set) client → server ``auth`` {mac}; server → client
   ``auth`` {mac}: HMAC-SHA256 over both nonces, so each side proves it
   knows the shared secret without sending it. Each side draws a fresh
   16-byte nonce per connection, so a recorded handshake replayed against
   either side fails; MACs are compared in constant time
   (:func:`hmac.compare_digest`), and the token itself is never sent,
   logged or put in an error.
4. client → server ``endpoint`` {qpn, psn, gid, port, mtu, buffers, ...}
5. server → client ``endpoint`` (its QP is in RTR/RTS by then)
6. client → server ``ready`` (its QP is in RTS: the server may now send)

Each message is a 4-byte big-endian length and a msgpack map. The TCP
connection stays open afterwards: a ``bye`` message or EOF tells a peer the
other side closed or died, faster than any RDMA timeout.
"""

from __future__ import annotations

import abc
import asyncio
import errno
import hashlib
import hmac
import secrets
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack

from .errors import (
    AuthenticationError,
    CapabilityError,
    ConnectionClosedError,
    ConnectionLostError,
    HandshakeTimeoutError,
    ProtocolVersionError,
    RendezvousError,
)
from .memory import RemoteBuffer
from .providers.soft.cma import PROBE_BYTES
from .rights import parse_rights
from .security import TOKEN_ENV, TOKEN_FILE_ENV, TokenSource, resolve_token
from .settings import ROCE_V2_PORT

#: the TCP port aiordma servers listen on by default
DEFAULT_PORT = 18515
PROTOCOL_VERSION = 1
#: what every aiordma endpoint of this version offers: messages with credits,
#: Write-with-immediate, atomics, large messages pulled by RDMA Read, and credits
#: that grow (the sender marks the chunk that took its last credit STARVED, and
#: takes a receiver's RNR NAKs as "wait": what a receiver whose buffers are a
#: shared receive queue needs of its peer, see aiordma.window)
BASE_CAPABILITIES = ("msg-credits-v1", "write-imm", "atomics", "msg-rndv-v1", "msg-credits-v2")
#: the capability a connection with a shared receive queue needs of its peer
SRQ_CAPABILITY = "msg-credits-v2"
#: offered (and required of the peer) by byte-stream endpoints only (aiordma.stream)
STREAM_CAPABILITY = "stream-ring-v1"
#: every capability this implementation knows
CAPABILITIES = (*BASE_CAPABILITIES, STREAM_CAPABILITY)
MAX_MESSAGE = 64 * 1024
_LEN = struct.Struct(">I")


def capabilities(streams: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What an endpoint offers and what it requires of its peer: every base
    capability, and a byte-stream endpoint also the stream ring, which it
    requires (a message endpoint and a stream endpoint cannot talk)."""
    if streams:
        return (*BASE_CAPABILITIES, STREAM_CAPABILITY), (STREAM_CAPABILITY,)
    return BASE_CAPABILITIES, ()


def token_from_env(token: TokenSource) -> bytes | None:
    """The shared secret: the argument (a path-like: a token file), else
    ``$AIORDMA_TOKEN``, else the file named by ``$AIORDMA_TOKEN_FILE``, else
    None (see :func:`aiordma.security.resolve_token`)."""
    return resolve_token(token)


class TokenMismatchError(AuthenticationError):
    """The client answered the server's challenge with a wrong MAC: it does
    not know the token (what the server's back-off counts)."""


@dataclass
class Endpoint:
    """What one side tells the other about its queue pair."""

    qpn: int
    psn: int
    gid: bytes
    mtu: int
    port: int = ROCE_V2_PORT  # UDP port RoCEv2 packets go to
    provider: str = "soft"
    recv_buffers: int = 0  # receives posted for messages (initial send credits)
    recv_buffer_size: int = 0
    buffers: dict[str, RemoteBuffer] = field(default_factory=dict)
    stream_ring: RemoteBuffer | None = None
    soft_mtu: int = 0  # soft devices only: the largest path MTU toward another soft device
    #: soft devices on loopback only: this end may leave the ICRC out (and takes the peer's
    #: datagrams unchecked) when the peer offers it too (QPAttr.skip_icrc)
    soft_skip_icrc: bool = False
    #: soft devices (native engine) only: this end's cross-memory attach offer
    #: (aiordma.providers.soft.cma): this host's boot id, its process id, and the
    #: address and value of a probe word the peer reads to find it may read this process
    soft_cma: tuple[str, int, int, bytes] | None = None
    #: this end can read the peer's process (it read the peer's probe word): the peer
    #: may answer its large READs with grants
    soft_cma_reads: bool = False
    #: how many RDMA Reads and atomics this end's queue pair accepts in flight from the
    #: peer (its max_dest_rd_atomic; 0: not said, an older peer: 16)
    rd_atomic: int = 0
    #: soft devices (native engine) only: this end's shared-memory link offer
    #: (aiordma.providers.soft.shm): host key, process id, device link id, eventfd
    #: number, and from a server that made the link, its id and memfd number
    soft_shm: tuple[str, int, int, int, int, int] | None = None

    def to_wire(self) -> dict[str, Any]:
        msg: dict[str, Any] = {
            "t": "endpoint",
            "qpn": self.qpn,
            "psn": self.psn,
            "gid": self.gid,
            "mtu": self.mtu,
            "port": self.port,
            "provider": self.provider,
            "recv_buffers": self.recv_buffers,
            "recv_buffer_size": self.recv_buffer_size,
            "buffers": {k: v.to_wire() for k, v in self.buffers.items()},
        }
        rights = {k: v.rights for k, v in self.buffers.items() if v.rights is not None}
        if rights:
            # beside the [addr, length, rkey] triples (which stay as they were): a peer
            # that does not know this key ignores it
            msg["rights"] = rights
        if self.stream_ring is not None:
            msg["stream_ring"] = self.stream_ring.to_wire()
        if self.soft_mtu:
            msg["soft_mtu"] = self.soft_mtu
        if self.soft_skip_icrc:
            msg["soft_skip_icrc"] = True  # (a peer that does not know this key ignores it)
        if self.soft_cma is not None:
            msg["soft_cma"] = list(self.soft_cma)
        if self.soft_cma_reads:
            msg["soft_cma_reads"] = True
        if self.rd_atomic:
            msg["rd_atomic"] = self.rd_atomic  # (a peer that does not know this key ignores it)
        if self.soft_shm is not None:
            msg["soft_shm"] = list(self.soft_shm)  # (a peer that does not know this key ignores it)
        return msg

    @classmethod
    def from_wire(cls, msg: dict[str, Any]) -> Endpoint:
        """Validate a peer's endpoint: a rendezvous that lies gets a clear error."""

        def need_int(key: str, lo: int, hi: int) -> int:
            v = msg.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise RendezvousError(
                    f"peer sent an invalid endpoint: {key}={v!r} (expected an integer in [{lo}, {hi}])"
                )
            return v

        qpn = need_int("qpn", 2, 0xFFFFFF)
        psn = need_int("psn", 0, 0xFFFFFF)
        mtu = need_int("mtu", 256, 4096)
        if mtu not in (256, 512, 1024, 2048, 4096):
            raise RendezvousError(f"peer sent an invalid endpoint: path MTU {mtu} is not 256/512/1024/2048/4096")
        port = need_int("port", 1, 65535)
        recv_buffers = need_int("recv_buffers", 0, 1 << 20)
        recv_buffer_size = need_int("recv_buffer_size", 0, 1 << 30)
        gid = msg.get("gid")
        if not isinstance(gid, bytes) or len(gid) != 16:
            raise RendezvousError("peer sent an invalid endpoint: gid must be 16 bytes")
        provider = msg.get("provider", "unknown")
        if not isinstance(provider, str):
            raise RendezvousError("peer sent an invalid endpoint: provider must be a string")
        raw = msg.get("buffers", {})
        if not isinstance(raw, dict) or len(raw) > 1024:
            raise RendezvousError("peer sent an invalid endpoint: buffers must be a map of at most 1024 names")
        rights = msg.get("rights", {})
        if not isinstance(rights, dict):
            raise RendezvousError("peer sent an invalid endpoint: rights must be a map of buffer names")
        buffers = {}
        for k, v in raw.items():
            if not isinstance(k, str):
                raise RendezvousError("peer sent an invalid endpoint: buffer names must be strings")
            try:
                rb = RemoteBuffer.from_wire(v, k)
                r = rights.get(k)
                if r is not None:
                    if not isinstance(r, str):
                        raise ValueError("its rights are not a string")
                    rb = RemoteBuffer(rb.addr, rb.length, rb.rkey, k, parse_rights(r))
            except ValueError as e:
                raise RendezvousError(f"peer sent an invalid endpoint: buffer {k!r}: {e}") from None
            buffers[k] = rb
        ring = None
        if msg.get("stream_ring") is not None:
            try:
                ring = RemoteBuffer.from_wire(msg["stream_ring"], "stream_ring")
            except ValueError as e:
                raise RendezvousError(f"peer sent an invalid endpoint: stream ring: {e}") from None
        soft_mtu = msg.get("soft_mtu", 0)
        if soft_mtu != 0:
            soft_mtu = need_int("soft_mtu", 256, 65536)
        skip_icrc = msg.get("soft_skip_icrc", False)
        if not isinstance(skip_icrc, bool):
            raise RendezvousError(
                f"peer sent an invalid endpoint: soft_skip_icrc={skip_icrc!r} (expected true or false)"
            )
        return cls(
            qpn,
            psn,
            gid,
            mtu,
            port,
            provider,
            recv_buffers,
            recv_buffer_size,
            buffers,
            ring,
            soft_mtu,
            skip_icrc,
            parse_cma_offer(msg.get("soft_cma")),
            cma_reads_flag(msg),
            need_int("rd_atomic", 1, 1 << 16) if msg.get("rd_atomic") is not None else 0,
            parse_shm_offer(msg.get("soft_shm")),
        )


def parse_cma_offer(value: Any) -> tuple[str, int, int, bytes] | None:
    """A peer's cross-memory attach offer (``[boot id, pid, probe address, probe
    word]``), checked: a malformed one is a :class:`RendezvousError`."""
    if value is None:
        return None
    ok = isinstance(value, list) and len(value) == 4
    if ok:
        boot, pid, addr, probe = value
        ok = (
            isinstance(boot, str)
            and 0 < len(boot) <= 64
            and isinstance(probe, bytes)
            and len(probe) == PROBE_BYTES
            and all(isinstance(n, int) and not isinstance(n, bool) for n in (pid, addr))
            and 0 < pid < 1 << 31
            and 0 < addr < 1 << 64
        )
    if not ok:
        raise RendezvousError(
            f"peer sent an invalid endpoint: soft_cma={value!r} "
            f"(expected [boot id, process id, probe address, {PROBE_BYTES}-byte probe word])"
        )
    return boot, pid, addr, probe


def parse_shm_offer(value: Any) -> tuple[str, int, int, int, int, int] | None:
    """A peer's shared-memory link offer (``[host key, pid, device, eventfd, link,
    memfd]``), checked: a malformed one is a :class:`RendezvousError`."""
    if value is None:
        return None
    ok = isinstance(value, list) and len(value) == 6
    if ok:
        host, pid, device, wakefd, link, memfd = value
        ints = (pid, device, wakefd, link, memfd)
        ok = (
            isinstance(host, str)
            and 0 < len(host) <= 80
            and all(isinstance(n, int) and not isinstance(n, bool) for n in ints)
            and 0 < pid < 1 << 31
            and 0 < device < 1 << 64
            and 0 <= wakefd < 1 << 31
            and 0 <= link < 1 << 64
            and 0 <= memfd < 1 << 31
        )
    if not ok:
        raise RendezvousError(
            f"peer sent an invalid endpoint: soft_shm={value!r} "
            "(expected [host key, process id, device id, eventfd, link id, memfd])"
        )
    return host, pid, device, wakefd, link, memfd


def shm_reads_flag(msg: dict[str, Any]) -> bool:
    """The ``soft_shm`` flag of a ``ready`` message (the client reads the link), checked."""
    reads = msg.get("soft_shm", False)
    if not isinstance(reads, bool):
        raise RendezvousError(f"peer sent an invalid soft_shm={reads!r} (expected true or false)")
    return reads


def cma_reads_flag(msg: dict[str, Any]) -> bool:
    """The ``soft_cma_reads`` flag of an endpoint or ``ready`` message, checked."""
    reads = msg.get("soft_cma_reads", False)
    if not isinstance(reads, bool):
        raise RendezvousError(f"peer sent an invalid soft_cma_reads={reads!r} (expected true or false)")
    return reads


#: seconds of silence on the rendezvous before the kernel starts probing the peer
KEEPALIVE_IDLE = 3.0


def raise_if_refused(msg: dict[str, Any]) -> dict[str, Any]:
    """``msg``, unless it is the peer's ``error`` message: then the error it names."""
    if msg["t"] == "error":
        kind = str(msg.get("code"))
        text = str(msg.get("message", ""))[:500]
        exc: type[RendezvousError] = {
            "version": ProtocolVersionError,
            "auth": AuthenticationError,
            "capability": CapabilityError,
        }.get(kind, RendezvousError)
        raise exc(f"peer refused the rendezvous: {text}")
    return msg


class MessageChannel(Protocol):
    """What the handshake and a connection's watch need of a rendezvous: typed
    msgpack maps to and from the peer, and an end. :class:`Channel` carries them
    over TCP; over RDMA CM (:mod:`aiordma.cm`) they travel on the connected
    queue pair itself."""

    #: messages received so far (a handshake's watchdog reads it: the peer is answering)
    received: int

    async def send(self, msg: dict[str, Any]) -> None: ...
    async def recv(self) -> dict[str, Any]: ...
    async def expect(self, kind: str) -> dict[str, Any]: ...
    async def fail(self, code: str, message: str) -> None: ...
    def send_nowait(self, msg: dict[str, Any]) -> None: ...
    def keep_alive(self) -> bool: ...
    @property
    def peername(self) -> Any: ...
    @property
    def sockname(self) -> Any: ...
    def close(self) -> None: ...


#: steps 1-3 on a server (hello, capabilities, the HMAC proof; the server's back-off
#: wraps :func:`server_hello`): returns the capabilities both sides share. Both
#: handshakes take one: over TCP (:mod:`aiordma.handshake`) and over RDMA CM (:mod:`aiordma.cm`).
Authenticate = Callable[[MessageChannel, tuple[str, ...], tuple[str, ...]], Awaitable[list[str]]]


class ChannelBase(abc.ABC):
    """What every rendezvous channel does the same way, on top of its own
    :meth:`send`, :meth:`recv` and :meth:`close`."""

    @abc.abstractmethod
    async def send(self, msg: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    async def recv(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    async def expect(self, kind: str) -> dict[str, Any]:
        """The next message, which must be of type ``kind``."""
        msg = await self.recv()
        if msg["t"] != kind:
            raise RendezvousError(f"rendezvous out of order: expected {kind!r}, peer sent {msg['t']!r}")
        return msg

    async def fail(self, code: str, message: str) -> None:
        """Tell the peer why, then close (best effort)."""
        try:
            await asyncio.wait_for(self.send({"t": "error", "code": code, "message": message}), 1.0)
        except Exception:
            pass
        self.close()


class Channel(ChannelBase):
    """Length-prefixed msgpack messages over an asyncio TCP stream."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        #: messages received so far (a handshake's watchdog reads it: the peer is answering)
        self.received = 0

    def keep_alive(self, idle: float = KEEPALIVE_IDLE, interval: float = 1.0, count: int = 5) -> bool:
        """Have the kernel probe a silent peer (TCP keepalive, and a timeout for
        unacknowledged data): a peer host that vanishes without closing its
        sockets (powered off, cut off by a firewall) ends this channel after
        about ``idle + interval * count`` seconds. A peer process that is only
        stopped (SIGSTOP, a long GC pause) still answers: its kernel does.
        False where the socket does not take the options."""
        sock = self.writer.get_extra_info("socket")
        if sock is None:
            return False
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, round(idle)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, round(interval)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, round((idle + interval * count) * 1000))
        except (OSError, AttributeError):  # not TCP (a test's socketpair), or no such option here
            return False
        return True

    @property
    def peername(self) -> Any:
        return self.writer.get_extra_info("peername")

    async def send(self, msg: dict[str, Any]) -> None:
        data = msgpack.packb(msg, use_bin_type=True)
        if len(data) > MAX_MESSAGE:
            raise RendezvousError(f"rendezvous message of {len(data)} bytes exceeds {MAX_MESSAGE}")
        self.writer.write(_LEN.pack(len(data)) + data)
        await self.writer.drain()

    async def recv(self) -> dict[str, Any]:
        """One message. Raises RendezvousError on EOF, oversize, garbage or an error message."""
        try:
            head = await self.reader.readexactly(4)
        except asyncio.IncompleteReadError as e:
            if e.partial:
                raise RendezvousError("peer closed the rendezvous in the middle of a message (truncated)") from None
            raise RendezvousError("peer closed the rendezvous connection") from None
        except TimeoutError as e:  # ETIMEDOUT: keepalive probes or sent data went unanswered
            raise RendezvousError(f"the rendezvous connection timed out: {e.strerror or e}") from e
        except OSError as e:  # ECONNRESET and the like
            raise RendezvousError(f"the rendezvous connection failed: {e.strerror or e}") from e
        self.received += 1
        (n,) = _LEN.unpack(head)
        if n > MAX_MESSAGE:
            raise RendezvousError(
                f"peer sent a rendezvous message of {n} bytes (limit {MAX_MESSAGE}): not an aiordma peer?"
            )
        try:
            body = await self.reader.readexactly(n)
        except asyncio.IncompleteReadError:
            raise RendezvousError("peer closed the rendezvous in the middle of a message (truncated)") from None
        try:
            msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except Exception as e:
            raise RendezvousError(f"peer sent a malformed rendezvous message (not msgpack: {e})") from None
        if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
            raise RendezvousError("peer sent a malformed rendezvous message (not a typed map)")
        return raise_if_refused(msg)

    def send_nowait(self, msg: dict[str, Any]) -> None:
        """Queue ``msg`` without waiting for the socket (best effort: for a
        goodbye sent just before the connection is torn down)."""
        data = msgpack.packb(msg, use_bin_type=True)
        if len(data) <= MAX_MESSAGE and not self.writer.is_closing():
            self.writer.write(_LEN.pack(len(data)) + data)

    @property
    def sockname(self) -> Any:
        return self.writer.get_extra_info("sockname")

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:
            pass


# ------------------------------------------------------------- goodbye ----
#: the longest reason a goodbye carries (and a peer's that is kept)
MAX_REASON = 500


def goodbye(reason: str | None = None, *, aborted: bool = False, abandoned: bool = False) -> dict[str, Any]:
    """The ``bye`` message that ends a connection, sent on its rendezvous.

    Plain: a clean close (everything sent was flushed). ``reason``: this side's
    queue pair failed, and why (the requester of a refused request only sees
    ``IBV_WC_REM_*_ERR``; the responder knows which check failed). ``aborted``:
    closed at once, nothing flushed; ``abandoned`` too: the program let the
    connection go without closing it."""
    msg: dict[str, Any] = {"t": "bye"}
    if reason is not None:
        msg["reason"] = reason[:MAX_REASON]
    if aborted or abandoned:
        msg["aborted"] = True
    if abandoned:
        msg["abandoned"] = True
    return msg


def parse_goodbye(msg: dict[str, Any]) -> tuple[str | None, ConnectionClosedError | ConnectionLostError] | None:
    """What a peer's message on the rendezvous after the handshake says: None
    for anything but a ``bye`` (ignored: a later version may send more), else
    the reason it gave for its queue pair's failure (if any) and the error this
    side's connection ends with."""
    if msg.get("t") != "bye":
        return None
    reason = msg.get("reason")
    reason = reason[:MAX_REASON] if isinstance(reason, str) else None
    err: ConnectionClosedError | ConnectionLostError
    if msg.get("abandoned"):
        err = ConnectionLostError(
            "the peer's program ended without closing the connection: what it sent last may not have arrived"
        )
    elif msg.get("aborted"):
        err = ConnectionLostError("the peer aborted the connection")
    elif reason is not None:
        err = ConnectionLostError(f"the peer's queue pair failed: {reason}")
    else:
        err = ConnectionClosedError("the peer closed the connection")
    return reason, err


async def next_goodbye(channel: MessageChannel) -> tuple[str | None, ConnectionClosedError | ConnectionLostError]:
    """Wait for the peer's goodbye on a rendezvous after its handshake (what
    :func:`parse_goodbye` makes of it); anything else it sends is skipped. The
    channel's end without one raises :class:`RendezvousError` (see :func:`vanished`)."""
    while True:
        goodbye = parse_goodbye(await channel.recv())
        if goodbye is not None:
            return goodbye


#: a rendezvous connection that failed so: the peer's host is gone, not (only) its process
_UNREACHABLE = frozenset({errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN})


def vanished(e: RendezvousError) -> ConnectionLostError:
    """The error of a connection whose rendezvous ended without a goodbye (``e``):
    the peer's host stopped answering (the keepalive gave up, the network is
    unreachable), or its process died or closed its sockets."""
    cause = e.__cause__
    if isinstance(cause, OSError) and cause.errno in _UNREACHABLE:
        why = "its host stopped answering or became unreachable (the rendezvous connection's keepalive)"
    else:
        why = "the peer process died or closed its sockets without closing the connection"
    return ConnectionLostError(
        f"the peer vanished: its rendezvous connection ended without a goodbye ({e}); {why}", cause=e
    )


def _mac(token: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(token, label + a + b, hashlib.sha256).digest()


def _check_hello(msg: dict[str, Any]) -> tuple[int, list[str], bytes]:
    v = msg.get("v")
    nonce = msg.get("nonce")
    caps = msg.get("caps", [])
    if not isinstance(v, int) or not isinstance(nonce, bytes) or len(nonce) != 16 or not isinstance(caps, list):
        raise RendezvousError("peer sent a malformed hello")
    return v, [c for c in caps if isinstance(c, str)], nonce


def _negotiate(side: str, peer: str, offer: tuple[str, ...], require: tuple[str, ...], caps: list[str]) -> list[str]:
    missing = [c for c in require if c not in caps]
    if missing:
        what = " and ".join(repr(c) for c in missing)
        hint = ""
        if STREAM_CAPABILITY in missing:
            hint = (
                ": it is not an aiordma stream endpoint (use aiordma.open_connection with "
                "aiordma.start_stream_server, or connect with start_server)"
            )
        raise CapabilityError(f"the {peer} does not offer {what}, which this {side} requires{hint}")
    return [c for c in offer if c in caps]


async def client_hello(
    ch: MessageChannel,
    token: bytes | None,
    offer: tuple[str, ...] = BASE_CAPABILITIES,
    require: tuple[str, ...] = (),
) -> list[str]:
    """Client side of steps 1-3. Returns the negotiated capabilities (what
    both offer); raises :class:`CapabilityError` when the server lacks one in
    ``require``."""
    cnonce = secrets.token_bytes(16)
    await ch.send({"t": "hello", "v": PROTOCOL_VERSION, "caps": list(offer), "nonce": cnonce})
    msg = await ch.expect("hello")
    v, caps, snonce = _check_hello(msg)
    if v != PROTOCOL_VERSION:
        await ch.fail("version", f"client speaks rendezvous v{PROTOCOL_VERSION}, server v{v}")
        raise ProtocolVersionError(f"server speaks rendezvous version {v}, this aiordma speaks {PROTOCOL_VERSION}")
    auth = bool(msg.get("auth"))
    if auth and token is None:
        await ch.fail("auth", "client has no token")
        raise AuthenticationError(
            f"server requires a shared-secret token: pass token=, or set ${TOKEN_ENV} or ${TOKEN_FILE_ENV}"
        )
    if token is not None and not auth:
        await ch.fail("auth", "client requires authentication")
        raise AuthenticationError("a token was given but the server does not authenticate (wrong server?)")
    if token is not None:
        await ch.send({"t": "auth", "mac": _mac(token, b"aiordma-client", snonce, cnonce)})
        reply = await ch.expect("auth")
        if not isinstance(reply.get("mac"), bytes) or not hmac.compare_digest(
            reply["mac"], _mac(token, b"aiordma-server", cnonce, snonce)
        ):
            await ch.fail("auth", "server proof did not verify")
            raise AuthenticationError("the server could not prove it knows the token")
    try:
        return _negotiate("client", "server", offer, require, caps)
    except CapabilityError as e:
        await ch.fail("capability", str(e))
        raise


async def server_hello(
    ch: MessageChannel,
    token: bytes | None,
    offer: tuple[str, ...] = BASE_CAPABILITIES,
    require: tuple[str, ...] = (),
    on_wrong_token: Callable[[], object] | None = None,
) -> list[str]:
    """Server side of steps 1-3. ``on_wrong_token`` is called when the
    client's MAC does not verify, before the client is told (so a back-off
    counts the failure before the guesser can try again)."""
    msg = await ch.expect("hello")
    v, caps, cnonce = _check_hello(msg)
    if v != PROTOCOL_VERSION:
        await ch.fail("version", f"server speaks rendezvous v{PROTOCOL_VERSION}, client v{v}")
        raise ProtocolVersionError(f"client speaks rendezvous version {v}, this aiordma speaks {PROTOCOL_VERSION}")
    snonce = secrets.token_bytes(16)
    await ch.send(
        {"t": "hello", "v": PROTOCOL_VERSION, "caps": list(offer), "nonce": snonce, "auth": token is not None}
    )
    if token is not None:
        reply = await ch.expect("auth")
        if not isinstance(reply.get("mac"), bytes) or not hmac.compare_digest(
            reply["mac"], _mac(token, b"aiordma-client", snonce, cnonce)
        ):
            if on_wrong_token is not None:
                on_wrong_token()
            await ch.fail("auth", "wrong token")
            raise TokenMismatchError("client failed the shared-secret challenge (wrong token)")
        await ch.send({"t": "auth", "mac": _mac(token, b"aiordma-server", cnonce, snonce)})
    try:
        return _negotiate("server", "client", offer, require, caps)
    except CapabilityError as e:
        await ch.fail("capability", str(e))
        raise


#: a handshake whose peer keeps answering is still dropped after this many silence timeouts
HANDSHAKE_TOTAL_FACTOR = 3


async def with_silence_timeout(coro: Any, ch: MessageChannel, timeout: float, what: str) -> Any:
    """Await ``coro``, a handshake on ``ch``: :class:`HandshakeTimeoutError` when the
    peer sends nothing for ``timeout`` s, or after ``HANDSHAKE_TOTAL_FACTOR`` times
    that in all.

    What a server must bound is a peer that stays silent (a slow-loris client
    holding a socket). A handshake that waits because the server is busy (10,000
    clients connecting at once take seconds of CPU) is not stalled: its peer
    answered, and it goes on."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout * HANDSHAKE_TOTAL_FACTOR
    task = asyncio.ensure_future(coro)
    heard = ch.received
    try:
        while True:
            done, _ = await asyncio.wait((task,), timeout=min(timeout, max(0.0, give_up - loop.time())))
            if done:
                return task.result()
            if ch.received == heard:
                raise HandshakeTimeoutError(f"{what}: the peer sent nothing for {timeout} s")
            if loop.time() >= give_up:
                raise HandshakeTimeoutError(f"{what} did not finish within {timeout * HANDSHAKE_TOTAL_FACTOR} s")
            heard = ch.received
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))  # (its CancelledError stays in it; one aimed at us is raised)
        if not task.cancelled():
            # retrieved, whatever ends this wait (its result returned, its error raised, or
            # a cancellation of ours that came as it failed): no "never retrieved" report
            task.exception()


async def with_timeout(coro: Any, timeout: float | None, what: str) -> Any:
    """Await ``coro``; past ``timeout`` s raise :class:`HandshakeTimeoutError` naming ``what``."""
    try:
        return await asyncio.wait_for(coro, timeout)
    except TimeoutError:
        raise HandshakeTimeoutError(f"{what} did not finish within {timeout} s") from None
