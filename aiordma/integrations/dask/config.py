"""The backend's settings, read from Dask's configuration, and its devices.

Every key lives under ``distributed.comm.rdma`` and can be set the ways
Dask's configuration is set: a YAML file (``~/.config/dask/*.yaml``),
``dask.config.set``, or an environment variable as Dask maps them
(``DASK_DISTRIBUTED__COMM__RDMA__TOKEN=...``; ``-`` and ``_`` are the
same). ``null`` leaves the choice to aiordma's own ``AIORDMA_*`` variable
and then to its default.

==========================  ==============================================
``provider``                ``auto``/``soft``/``pyverbs`` (``AIORDMA_PROVIDER``)
``device``                  a verbs device name, ``rxe0``, ``mlx5_0`` (``AIORDMA_DEVICE``)
``gid-index``               the GID table entry (RoCEv2 address) to use (``AIORDMA_GID_INDEX``)
``soft-address``            the soft device's ``IP[:PORT]`` (``AIORDMA_SOFT_ADDR``); unset:
                            see :func:`device_for`
``token``                   shared secret of the authenticated rendezvous (``AIORDMA_TOKEN``)
``insecure``                let a listener on a non-loopback address start without a token
                            (for aiordma versions that refuse it)
``recv-budget``             bytes a connection buffers for a slow reader before its peer waits
``large-message-threshold`` messages of this size or more are pulled by RDMA Read (zero copy)
``send-window``             bytes of large frames written and not yet pulled by the peer before
                            ``write`` waits (they stay registered until pulled); 256 MiB
``batch-limit``             bytes of small frames sent inline in one message (32 KiB)
``registration-cache``      registrations kept per connection for reuse (0: none)
``buffer-pool``             bytes of released large-frame buffers a process keeps for the next
                            frames it receives (no fresh pages to map and zero; 0: none);
                            256 MiB, see :mod:`.buffers`
``ack-timeout``             the RC transport's ACK timeout, verbs' exponent: 4.096 µs x 2^n
                            (16: 268 ms; aiordma's default is 14, 67 ms), see below
``retry-cnt``               retransmissions before a connection fails (7)
``progress``                ``event``/``thread``/``busy`` (``AIORDMA_PROGRESS``)
``spin-us``                 the poll window: microseconds the event loop keeps polling a
                            connection's completions after traffic before it sleeps
                            (``AIORDMA_SPIN_US``, 200)
``handshake-timeout``       how long a listener waits for a client's rendezvous (10 s)
``close-timeout``           how long ``Comm.close()`` waits for the peer to take what was sent (5 s)
==========================  ==============================================

Transport timers: a queue pair fails with ``IBV_WC_RETRY_EXC_ERR`` when its
peer does not acknowledge within ``ack-timeout`` x (``retry-cnt`` + 1). The
soft device's Python engine needs the GIL for every ACK, and a Dask worker's
GIL is busy (task code, (de)serialization): with aiordma's default (67 ms x 8)
transfers between busy workers failed now and then; 268 ms x 8 did not (the
native engine and hardware NICs ACK without the GIL). A
process that dies is noticed at once anyway (its rendezvous connection
closes), so a long timer costs only the time to notice a frozen peer.

Encryption: the rendezvous is authenticated (HMAC challenge-response with the
token), not encrypted, and RoCEv2 packets are neither; a Dask configuration
that requires encryption (``distributed.comm.require-encryption``) is refused
with :class:`EncryptionRequiredError`.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from dataclasses import dataclass
from typing import Any

import dask
import dask.config
from dask.utils import parse_bytes, parse_timedelta

from ... import settings as env
from ...errors import DeviceNotFoundError
from ...providers import get_device, resolve_provider
from ...providers.base import DeviceContext

#: RoCEv2's UDP port: a soft device takes it when it is free (a kernel rxe peer sends there)
ROCE_PORT = env.ROCE_V2_PORT

DEFAULTS: dict[str, Any] = {
    "provider": None,
    "device": None,
    "gid-index": None,
    "soft-address": None,
    "token": None,
    "insecure": False,
    "recv-budget": None,
    "large-message-threshold": None,
    "send-window": "256 MiB",
    "batch-limit": "32 KiB",
    "registration-cache": 0,
    "buffer-pool": "256 MiB",
    "ack-timeout": 16,
    "retry-cnt": 7,
    "progress": None,
    "spin-us": None,
    "handshake-timeout": "10 s",
    "close-timeout": "5 s",
}
PREFIX = "distributed.comm.rdma"


def register_defaults() -> None:
    """Add the backend's keys to Dask's defaults (``dask config list`` shows them)."""
    dask.config.update_defaults({"distributed": {"comm": {"rdma": dict(DEFAULTS)}}})


class EncryptionRequiredError(RuntimeError):
    """Dask's configuration requires encrypted comms, which ``rdma://`` does not offer."""


def refuse_encryption(address: str, connection_args: dict[str, Any]) -> None:
    """Raise :class:`EncryptionRequiredError` when Dask requires encryption."""
    if connection_args.get("require_encryption"):
        raise EncryptionRequiredError(
            f"encryption required by Dask configuration (distributed.comm.require-encryption), refusing "
            f"rdma://{address}: the rdma:// backend is not encrypted. Its rendezvous is authenticated (an HMAC "
            "challenge-response with distributed.comm.rdma.token), but neither the rendezvous nor the RoCEv2 "
            "packets are encrypted; use tls:// where encryption is required"
        )


def _get(key: str) -> Any:
    # defaults given here, not only registered: distributed.utils_test's reset_config()
    # restores Dask's configuration as it was before this module was imported
    return dask.config.get(f"{PREFIX}.{key}", default=DEFAULTS[key])


def _bytes(key: str, value: Any, minimum: int) -> int:
    try:
        n = parse_bytes(value) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{PREFIX}.{key} must be a number of bytes such as '64 MiB', not {value!r}") from None
    if n < minimum:
        raise ValueError(f"{PREFIX}.{key} must be at least {minimum} bytes, got {value!r}")
    return n


def _seconds(key: str, value: Any) -> float:
    try:
        s = parse_timedelta(value, default="seconds")
    except (TypeError, ValueError, KeyError):
        raise ValueError(f"{PREFIX}.{key} must be a duration such as '5 s', not {value!r}") from None
    if s is None or s <= 0:
        raise ValueError(f"{PREFIX}.{key} must be a positive duration, got {value!r}")
    return float(s)


def _text(key: str, value: Any) -> str | None:
    if value is None or value == "":
        return None
    if isinstance(value, bytes):
        return value.decode()
    return str(value)  # Dask parses DASK_..._TOKEN=123 as the int 123


def _int_in(key: str, value: Any, lo: int, hi: int) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = lo - 1
    if not lo <= n <= hi or isinstance(value, bool):
        raise ValueError(f"{PREFIX}.{key} must be an integer from {lo} to {hi}, not {value!r}")
    return n


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{PREFIX}.{key} must be true or false, not {value!r}")


@dataclass(frozen=True)
class Settings:
    """The backend's settings as read from Dask's configuration (see the module docstring)."""

    provider: str | None = None
    device: str | None = None
    gid_index: int | None = None
    soft_address: str | None = None
    token: str | None = None
    insecure: bool = False
    recv_budget: int | None = None
    large_message_threshold: int | None = None
    send_window: int = 256 << 20
    batch_limit: int = 32 * 1024
    registration_cache: int = 0
    buffer_pool: int = 256 << 20
    ack_timeout: int = 16
    retry_cnt: int = 7
    progress: str | None = None
    spin_us: float | None = None
    handshake_timeout: float = 10.0
    close_timeout: float = 5.0

    @classmethod
    def from_config(cls) -> Settings:
        """Read ``distributed.comm.rdma.*`` now (Dask's configuration may change between comms)."""
        provider = _text("provider", _get("provider"))
        if provider is not None and provider.lower() not in ("auto", "soft", "pyverbs"):
            raise ValueError(f"{PREFIX}.provider must be auto, soft or pyverbs, not {provider!r}")
        gid = _get("gid-index")
        if gid is not None:
            try:
                gid = int(gid)
            except (TypeError, ValueError):
                gid = -1
            if gid < 0:
                raise ValueError(
                    f"{PREFIX}.gid-index must be a GID table index (an integer >= 0), not {_get('gid-index')!r}"
                )
        progress = _text("progress", _get("progress"))
        if progress is not None and progress not in ("event", "thread", "busy"):
            raise ValueError(f"{PREFIX}.progress must be event, thread or busy, not {progress!r}")
        spin = _get("spin-us")
        if spin is not None:
            try:
                spin = float(spin)
            except (TypeError, ValueError):
                spin = -1.0
            if spin < 0:
                raise ValueError(f"{PREFIX}.spin-us must be a number of microseconds >= 0, not {_get('spin-us')!r}")
        budget = _get("recv-budget")
        threshold = _get("large-message-threshold")
        cache = _int_in("registration-cache", _get("registration-cache"), 0, 1 << 20)
        return cls(
            provider=provider.lower() if provider else None,
            device=_text("device", _get("device")),
            gid_index=gid,
            soft_address=_text("soft-address", _get("soft-address")),
            token=_text("token", _get("token")),
            insecure=_bool("insecure", _get("insecure")),
            recv_budget=None if budget is None else _bytes("recv-budget", budget, 64 * 1024),
            large_message_threshold=None if threshold is None else _bytes("large-message-threshold", threshold, 1),
            send_window=_bytes("send-window", _get("send-window"), 1),
            batch_limit=_bytes("batch-limit", _get("batch-limit"), 0),
            registration_cache=cache,
            buffer_pool=_bytes("buffer-pool", _get("buffer-pool"), 0),
            ack_timeout=_int_in("ack-timeout", _get("ack-timeout"), 1, 31),
            retry_cnt=_int_in("retry-cnt", _get("retry-cnt"), 0, 7),
            progress=progress,
            spin_us=spin,
            handshake_timeout=_seconds("handshake-timeout", _get("handshake-timeout")),
            close_timeout=_seconds("close-timeout", _get("close-timeout")),
        )

    def connection_options(self) -> dict[str, Any]:
        """Keyword options for :func:`aiordma.connect` / :func:`aiordma.start_server`."""
        out: dict[str, Any] = {
            "registration_cache": self.registration_cache,
            "large_send_window": self.send_window,
            "ack_timeout": self.ack_timeout,
            "retry_cnt": self.retry_cnt,
        }
        if self.gid_index is not None:
            out["gid_index"] = self.gid_index
        if self.recv_budget is not None:
            out["recv_budget"] = self.recv_budget
        if self.large_message_threshold is not None:
            out["large_message_threshold"] = self.large_message_threshold
        if self.progress is not None:
            out["progress"] = self.progress
        if self.spin_us is not None:
            out["spin_us"] = self.spin_us
        return out


# ----------------------------------------------------------------- devices ----

_lock = threading.Lock()
_resolved: dict[tuple[str | None, ...], tuple[str, str | None]] = {}
#: soft-device address chosen per local IP: "IP:4791" when that was free, else "IP:0"
_soft_addresses: dict[str, str] = {}


def _resolve(settings: Settings) -> tuple[str, str | None]:
    """The provider and device name to use, found once per process (``auto``
    opens pyverbs devices to look for an active port)."""
    key = (
        settings.provider,
        settings.device,
        env.PROVIDER.get(),
        env.DEVICE.get(),
    )
    with _lock:
        hit = _resolved.get(key)
    if hit is None:
        hit = resolve_provider(settings.provider, settings.device)
        with _lock:
            _resolved[key] = hit
    return hit


def _is_loopback(ip: str | None) -> bool:
    if not ip:
        return True
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def _is_ipv4(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).version == 4
    except ValueError:
        return False


def route_source(host: str) -> str | None:
    """The local IPv4 address this host sends from to reach ``host`` (an IP
    address), or None. A UDP ``connect`` sends nothing: it only asks the
    kernel's routing table."""
    if not _is_ipv4(host):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, ROCE_PORT))
            return str(s.getsockname()[0])
        except OSError:
            return None


def device_for(settings: Settings, local_ip: str | None) -> DeviceContext:
    """The device a comm uses, shared by every comm of this process that
    resolves to it.

    For a verbs device (``pyverbs``) that is the configured or first active
    device, whatever ``local_ip``. The soft device is a UDP socket whose
    address is its GID, so it must be bound where peers can reach it: at
    ``soft-address`` or ``AIORDMA_SOFT_ADDR`` when set; otherwise at
    ``local_ip`` (the address a listener is contacted on, or the address
    that routes to the peer a connector reaches), on UDP 4791 when that is
    free (a kernel rxe peer can reach it there) and on a free port else (two
    Dask processes on one host: the rendezvous carries the port). On
    loopback it is aiordma's default soft device (its own 127.0.0.N:4791).
    """
    provider, name = _resolve(settings)
    if provider != "soft":
        return get_device(provider, name)
    explicit = settings.soft_address or env.SOFT_ADDR.get()
    if explicit:
        return get_device("soft", name, address=explicit)
    if _is_loopback(local_ip) or not _is_ipv4(local_ip or ""):
        return get_device("soft", name)
    assert local_ip is not None
    with _lock:
        chosen = _soft_addresses.get(local_ip)
    if chosen is not None:
        try:
            return get_device("soft", name, address=chosen)
        except DeviceNotFoundError:
            pass  # closed since (tests), and the port taken by another process meanwhile
    try:
        dev = get_device("soft", name, address=f"{local_ip}:{ROCE_PORT}")
        chosen = f"{local_ip}:{ROCE_PORT}"
    except DeviceNotFoundError:
        dev = get_device("soft", name, address=f"{local_ip}:0")
        chosen = f"{local_ip}:0"
    with _lock:
        _soft_addresses[local_ip] = chosen
    return dev
