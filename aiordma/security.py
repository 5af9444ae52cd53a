"""Who may reach a server: protected mode, the token, and the back-off.

RDMA has no access control beyond the rkey: whoever holds a connected queue
pair and an rkey can Write, Read or run atomics on the memory behind it (as
far as the rkey's registration allows). The TCP rendezvous is therefore the
door, and this module keeps it shut by default:

* **Protected mode.** A server that listens on anything but loopback
  (127.0.0.0/8, ``::1``) refuses to start without a token, with a
  :class:`~aiordma.ProtectedModeError` that names both ways out: a token
  (``token=``, ``$AIORDMA_TOKEN``, or a file named by ``$AIORDMA_TOKEN_FILE``)
  or an explicit opt-out (``insecure=True`` or ``AIORDMA_INSECURE=1``), which
  logs one warning per server. ``host=None`` or ``""`` means every interface,
  which is not loopback. The check looks at the addresses the listening
  sockets were actually bound to (before they accept anything), so a host
  name is judged by what it resolved to.
* **The token.** A shared secret; the rendezvous proves knowledge of it with
  HMAC-SHA256 over two fresh nonces, one from each side (see
  :mod:`aiordma.rendezvous`), compared in constant time. It is never logged
  and never put in an error message. A token file is read once, when the
  server starts (or the client connects), its trailing newline stripped.
* **The back-off.** :class:`AuthThrottle` counts failed authentications per
  source address; after ``limit`` failures within ``window`` seconds the
  source is refused for a back-off that doubles with every further failure,
  so the port is not a guessing oracle.

The rendezvous is authenticated, not encrypted: an eavesdropper sees the
queue pair numbers, the rkeys and the nonces, and can test token guesses
offline against a recorded handshake. Use a long random token.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable
from typing import Any

from . import settings
from .errors import ProtectedModeError, TokenError

log = logging.getLogger("aiordma")

__all__ = [
    "INSECURE_ENV",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "AuthThrottle",
    "check_protected_mode",
    "insecure_from_env",
    "is_loopback_address",
    "read_token_file",
    "resolve_token",
    "source_key",
]

TOKEN_ENV = "AIORDMA_TOKEN"
TOKEN_FILE_ENV = "AIORDMA_TOKEN_FILE"
INSECURE_ENV = "AIORDMA_INSECURE"
#: a token file larger than this is not a token file
MAX_TOKEN_FILE = 64 * 1024
#: tokens shorter than this get a warning (an eavesdropper can test guesses offline)
MIN_TOKEN_BYTES = 16

TokenSource = str | bytes | bytearray | memoryview | os.PathLike[str] | None

_warned_files: set[str] = set()
_warned_short = False


def read_token_file(path: str | os.PathLike[str], what: str | None = None) -> bytes:
    """The token in the file at ``path``: its bytes without the trailing
    newline. Raises :class:`~aiordma.TokenError` for a missing, unreadable,
    empty or oversized file; warns (once per file) when other users may read
    it. ``what`` names where the path came from in messages."""
    path = os.fspath(path)
    where = what or f"token file {path}"
    try:
        # O_NONBLOCK: a FIFO or a device in its place must not hang the start
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise TokenError(f"{where}: not a regular file")
            data = f.read(MAX_TOKEN_FILE + 1)
    except FileNotFoundError:
        raise TokenError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise TokenError(f"{where}: is a directory, not a token file") from None
    except PermissionError:
        raise TokenError(f"{where}: cannot be read (permission denied)") from None
    except OSError as e:
        raise TokenError(f"{where}: cannot be read ({e.strerror or type(e).__name__})") from None
    if len(data) > MAX_TOKEN_FILE:
        raise TokenError(f"{where}: larger than {MAX_TOKEN_FILE // 1024} KiB, not a token file")
    token = data.rstrip(b"\r\n")
    if not token:
        raise TokenError(f"{where}: is empty (the token is the file's content, without the trailing newline)")
    if mode & 0o077 and path not in _warned_files:
        _warned_files.add(path)
        log.warning(
            "aiordma: %s can be read by other users (mode %04o): chmod 600 %s",
            where,
            stat.S_IMODE(mode),
            path,
        )
    return token


def resolve_token(token: TokenSource = None) -> bytes | None:
    """The rendezvous secret, from the first of: the argument (a string,
    bytes, or a path-like naming a token file), ``$AIORDMA_TOKEN``, the file
    named by ``$AIORDMA_TOKEN_FILE``. None when there is none.

    Setting both variables is an error (which one was meant?); an empty
    argument is an error, an empty ``$AIORDMA_TOKEN`` counts as unset."""
    if token is None:
        env = settings.TOKEN.get()
        env_file = settings.TOKEN_FILE.get()
        if env is not None and env_file is not None:
            raise TokenError(f"both ${TOKEN_ENV} and ${TOKEN_FILE_ENV} are set: set one of them")
        if env_file is not None:
            secret = read_token_file(env_file, f"${TOKEN_FILE_ENV}={env_file}")
        elif env is not None:
            secret = env.encode()
        else:
            return None
    elif isinstance(token, os.PathLike):
        secret = read_token_file(token)
    elif isinstance(token, str):
        secret = token.encode()
    elif isinstance(token, (bytes, bytearray, memoryview)):
        secret = bytes(token)
    else:
        raise TypeError(f"token must be a str, bytes or a path to a token file, not {type(token).__name__}")
    if not secret:
        raise TokenError("the token is empty: give a non-empty shared secret, or None for no authentication")
    _warn_if_short(secret)
    return secret


def _warn_if_short(secret: bytes) -> None:
    global _warned_short
    if len(secret) < MIN_TOKEN_BYTES and not _warned_short:
        _warned_short = True
        log.warning(
            "aiordma: the rendezvous token is shorter than %d bytes: the rendezvous is not encrypted, so an "
            "eavesdropper can test guesses offline against a recorded handshake; use a long random token "
            "(python -c 'import secrets; print(secrets.token_urlsafe(32))')",
            MIN_TOKEN_BYTES,
        )


def insecure_from_env(insecure: bool | None = None) -> bool:
    """The protected-mode opt-out: the argument if given, else ``$AIORDMA_INSECURE``."""
    if insecure is not None:
        return bool(insecure)
    return settings.INSECURE.get()


def is_loopback_address(address: str) -> bool:
    """Whether ``address`` (an IP address as a socket reports it, or the name
    ``localhost``) is reachable from this host only: 127.0.0.0/8, ``::1``, or
    an IPv4-mapped loopback. The unspecified addresses (``0.0.0.0``, ``::``:
    every interface) and host names other than ``localhost`` are not."""
    if address == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _describe(addresses: Iterable[str], port: int) -> str:
    out = []
    for a in addresses:
        shown = f"[{a}]:{port}" if ":" in a else f"{a}:{port}"
        if a in ("0.0.0.0", "::"):
            shown += " (every interface)"
        out.append(shown)
    return ", ".join(out)


def check_protected_mode(
    addresses: Iterable[str],
    port: int,
    *,
    token: bytes | None,
    insecure: bool,
    what: str = "aiordma server",
) -> None:
    """Protected mode for a server about to serve on ``addresses:port``.

    Loopback-only, or a token: nothing to say. Otherwise raise
    :class:`~aiordma.ProtectedModeError`, unless ``insecure``: then log one
    warning (this call's) and return."""
    addrs = tuple(dict.fromkeys(addresses))
    open_to = tuple(a for a in addrs if not is_loopback_address(a))
    if token is not None or not open_to:
        return
    where = _describe(open_to, port)
    if insecure:
        log.warning(
            "%s on %s runs WITHOUT a token (protected mode turned off: insecure=True or %s=1): any host that can "
            "reach this port can connect and use the memory the server exposes",
            what,
            where,
            INSECURE_ENV,
        )
        return
    raise ProtectedModeError(
        f"refusing to serve on {where} without a token: any host that can reach this port could connect and "
        f"act on the memory the server exposes. Set a shared secret (token=..., ${TOKEN_ENV}, or a file named by "
        f"${TOKEN_FILE_ENV}) and give the clients the same, listen on loopback (127.0.0.1), or opt out "
        f"explicitly with insecure=True or {INSECURE_ENV}=1",
        open_to,
    )


def source_key(address: str) -> str:
    """The unit the back-off counts by: an IPv4 address, or an IPv6 /64
    (what one host usually gets; counting single IPv6 addresses would let one
    host try 2**64 times)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class _Source:
    __slots__ = ("blocked_until", "strikes", "times")

    def __init__(self, limit: int) -> None:
        #: the times of the last ``limit`` failures
        self.times: collections.deque[float] = collections.deque(maxlen=limit)
        #: back-offs imposed since the source was last quiet for a whole window
        self.strikes = 0
        self.blocked_until = 0.0


class AuthThrottle:
    """Back-off for failed rendezvous authentications, per source address.

    A source with ``limit`` failed authentications within ``window`` seconds
    is refused for ``backoff`` seconds; each further failure doubles that
    (``backoff * 2**n``, at most ``max_backoff``), so a guesser gets about one
    try per back-off. Failures older than ``window`` no longer count, and a
    source without a failure for a whole window starts over.
    Successful authentications neither count nor clear the record (a peer
    behind the same address as a guesser cannot reset it for the guesser);
    a source with fewer than ``limit`` recent failures is never slowed down.
    At most ``max_sources`` sources are remembered (``limit`` timestamps
    each): quiet ones are forgotten first, then the least recently failed.
    Sans-IO: ``clock`` is the time source."""

    def __init__(
        self,
        limit: int = 5,
        window: float = 60.0,
        backoff: float = 1.0,
        max_backoff: float = 60.0,
        max_sources: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if limit < 1 or window <= 0 or backoff <= 0 or max_backoff < backoff or max_sources < 1:
            raise ValueError(
                "AuthThrottle needs limit >= 1, window > 0, 0 < backoff <= max_backoff and max_sources >= 1"
            )
        self.limit = limit
        self.window = window
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_sources = max_sources
        self.clock = clock
        self._sources: collections.OrderedDict[str, _Source] = collections.OrderedDict()
        #: failed authentications recorded
        self.failures = 0
        #: handshakes refused because their source was backing off
        self.refusals = 0
        #: the last back-off imposed, seconds (0 before any)
        self.last_backoff = 0.0

    def recent_failures(self, address: str) -> int:
        """Failed authentications from ``address``'s source within the window."""
        src = self._sources.get(source_key(address))
        if src is None:
            return 0
        now = self.clock()
        return sum(1 for t in src.times if now - t <= self.window)

    def retry_after(self, address: str) -> float:
        """Seconds until ``address`` may try again (0: it may now)."""
        src = self._sources.get(source_key(address))
        if src is None:
            return 0.0
        return max(0.0, src.blocked_until - self.clock())

    def lanes(self, address: str) -> int:
        """How many handshakes from ``address``'s source may be at the
        challenge at once: the failures it may still make before it backs off
        (at least 1), and 1 while it is on probation (it backed off and has
        not been quiet for a window since). More wait their turn, so a burst
        of parallel guesses cannot get past the limit before the first
        verdicts are counted."""
        src = self._sources.get(source_key(address))
        if src is None:
            return self.limit
        now = self.clock()
        if src.strikes and src.times and now - src.times[-1] <= self.window:
            return 1
        recent = sum(1 for t in src.times if now - t <= self.window)
        return max(1, self.limit - recent)

    def admit(self, address: str) -> float:
        """Called for each handshake before a challenge is issued: 0 if the
        source may go ahead, else the seconds it must wait (counted as a refusal)."""
        wait = self.retry_after(address)
        if wait > 0:
            self.refusals += 1
        return wait

    def failed(self, address: str) -> float:
        """Record a failed authentication from ``address``; returns the
        back-off it now has (0 if none)."""
        now = self.clock()
        key = source_key(address)
        src = self._sources.get(key)
        if src is None:
            self._make_room(now)
            src = self._sources[key] = _Source(self.limit)
        else:
            self._sources.move_to_end(key)
            if src.times and now - src.times[-1] > self.window:
                src.strikes = 0  # quiet for a whole window: start over
        src.times.append(now)
        self.failures += 1
        recent = sum(1 for t in src.times if now - t <= self.window)
        if recent < self.limit and not src.strikes:
            return 0.0  # a source already backing off stays so until it is quiet for a window
        backoff = min(self.max_backoff, self.backoff * 2.0 ** min(src.strikes, 64))
        src.strikes += 1
        was_blocked = src.blocked_until > now
        src.blocked_until = max(src.blocked_until, now + backoff)
        self.last_backoff = backoff
        if not was_blocked:
            log.warning(
                "aiordma server: failed authentications from %s (%d within %g s): refusing it for %g s",
                key,
                recent,
                self.window,
                backoff,
            )
        return backoff

    def _quiet(self, src: _Source, now: float) -> bool:
        return src.blocked_until <= now and (not src.times or now - src.times[-1] > self.window)

    def _make_room(self, now: float) -> None:
        """Forget quiet sources; if still full, the least recently failed."""
        if len(self._sources) < self.max_sources:
            return
        for key in [k for k, s in self._sources.items() if self._quiet(s, now)]:
            del self._sources[key]
        while len(self._sources) >= self.max_sources:
            self._sources.popitem(last=False)  # an OrderedDict keeps them by last failure

    def __len__(self) -> int:
        return len(self._sources)

    def __repr__(self) -> str:
        return (
            f"<AuthThrottle limit={self.limit} window={self.window:g}s sources={len(self)} "
            f"failures={self.failures} refusals={self.refusals}>"
        )


def peer_host(peername: Any) -> str | None:
    """The address part of a socket's peer name (None when unknown)."""
    if isinstance(peername, (tuple, list)) and peername and isinstance(peername[0], str):
        return peername[0]
    return None
