"""Every ``AIORDMA_*`` environment variable aiordma reads, declared once.

Each :class:`Setting` names its variable, its default, what values it takes
and what it means; :meth:`Setting.get` parses and checks the variable where
the library reads it, so a value means the same thing to every reader and a
bad one is refused the same way everywhere: a :class:`~aiordma.errors.SettingError`
(a ``ValueError``) whose message is one line naming the variable, the value
and what is allowed::

    AIORDMA_PROVIDER='bogus': expected one of auto, soft, pyverbs

An unset or empty variable means its default. The variables are read when
used, not cached (a test or a tool may change them). :func:`check_all`
checks every one at once: the ``aiordma`` commands call it before they run.
"""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .errors import SettingError

__all__ = ["SETTINGS", "Setting", "check_all", "declared"]

T = TypeVar("T")
D = TypeVar("D")

#: what ``AIORDMA_PROVIDER`` (and ``provider=``) takes
PROVIDERS = ("auto", "soft", "pyverbs")
#: the soft device's engines (``aiordma.providers.soft.engine.ENGINES``)
SOFT_ENGINES = ("python", "native")
#: the per-operation core's implementations (``aiordma.core.CORES``)
CORES = ("compiled", "python")
#: the ICRC policies (``aiordma.providers.soft.nic.IcrcPolicy.ALL``)
ICRC_POLICIES = ("strict", "any-ip-id", "off")
#: the progress modes (``aiordma.completion.PROGRESS_MODES``)
PROGRESS_MODES = ("event", "thread", "busy")
#: the soft device's largest path MTU (``aiordma.providers.soft.device.MAX_SOFT_MTU``)
MAX_SOFT_MTU = 61440
#: the poll window's default, microseconds
DEFAULT_SPIN_US = 200.0

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: ``parse`` turns a non-empty value into ``T``
    or raises ``ValueError``; ``allowed`` says in words what it accepts."""

    name: str
    default: T
    allowed: str
    meaning: str
    parse: Callable[[str], T]
    #: the value is a secret: an error message never shows it
    secret: bool = False
    #: the values it takes, for a setting that takes one of a few words
    choices: tuple[str, ...] = ()

    def configured(self, environ: Mapping[str, str] | None = None) -> T | None:
        """The parsed value, or None when the variable is unset or empty."""
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or raw == "":
            return None
        try:
            return self.parse(raw)
        except ValueError:
            shown = "<hidden>" if self.secret else repr(raw)
            raise SettingError(f"{self.name}={shown}: expected {self.allowed}", self.name, raw) from None

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The parsed value, else the default. ``environ`` replaces ``os.environ``."""
        value = self.configured(environ)
        return self.default if value is None else value


#: every setting, by variable name, in the order of the README's table
SETTINGS: dict[str, Setting[Any]] = {}


def _declare(setting: Setting[T]) -> Setting[T]:
    assert setting.name.startswith("AIORDMA_") and setting.name not in SETTINGS, setting.name
    SETTINGS[setting.name] = setting
    return setting


def declared() -> Iterator[Setting[Any]]:
    """Every setting, in declaration order."""
    return iter(SETTINGS.values())


def check_all(environ: Mapping[str, str] | None = None) -> None:
    """Parse every setting; raise the :class:`SettingError` of the first bad one."""
    for setting in SETTINGS.values():
        setting.configured(environ)


# ---------------------------------------------------------------- kinds ----


def _choice(name: str, values: tuple[str, ...], default: D, meaning: str) -> Setting[str | D]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in values:
            raise ValueError(raw)
        return value

    return _declare(Setting[str | D](name, default, f"one of {', '.join(values)}", meaning, parse, choices=values))


def _flag(name: str, default: bool, meaning: str) -> Setting[bool]:
    def parse(raw: str) -> bool:
        value = raw.strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        if value == "":
            return default
        raise ValueError(raw)

    return _declare(Setting(name, default, "1 or 0 (or true/false, yes/no, on/off)", meaning, parse))


def _number(name: str, default: D, unit: str, meaning: str) -> Setting[float | D]:
    def parse(raw: str) -> float:
        value = float(raw)
        if math.isnan(value) or value < 0:
            raise ValueError(raw)
        return value

    return _declare(Setting[float | D](name, default, f"a number of {unit}, 0 or more", meaning, parse))


def _integer(name: str, minimum: int, maximum: int | None, meaning: str) -> Setting[int | None]:
    def parse(raw: str) -> int:
        value = int(raw.strip(), 10)
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(raw)
        return value

    allowed = (
        f"a whole number from {minimum} to {maximum}" if maximum is not None else f"a whole number, {minimum} or more"
    )
    return _declare(Setting[int | None](name, None, allowed, meaning, parse))


def _text(name: str, allowed: str, meaning: str, *, secret: bool = False) -> Setting[str | None]:
    return _declare(Setting[str | None](name, None, allowed, meaning, str, secret))


#: the RoCE v2 UDP port (IANA), where a soft device listens unless told otherwise
ROCE_V2_PORT = 4791


def parse_soft_address(raw: str) -> tuple[str, int]:
    """``IP[:PORT]`` for a soft device: an IPv4 address and a UDP port from 0 to
    65535 (default 4791). ``ValueError`` with the reason otherwise: the soft device's
    GID is the IPv4-mapped RoCE v2 GID of the address it binds, so an IPv6 address
    or a host name is refused here, before anything is bound."""
    host, sep, port_text = raw.rpartition(":")
    if not sep or ":" in host:
        host, sep, port_text = raw, "", ""
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(f"{raw!r}: the soft device binds an IPv4 address (IP[:PORT], e.g. 127.0.0.2:4791)") from None
    if not sep:
        return host, ROCE_V2_PORT
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{raw!r}: the port must be a number from 0 to 65535")
    return host, int(port_text)


def _soft_address(raw: str) -> str:
    """``IP[:PORT]`` as :func:`parse_soft_address` reads it; the value itself is kept."""
    parse_soft_address(raw)
    return raw


def split_device_name(name: str) -> tuple[str, int | None]:
    """A device name and the port it names, if any: ``"mlx5_0:2"`` is port 2 of
    mlx5_0 (the ``HCA:port`` spelling NCCL and UCX use), ``"mlx5_0"`` the
    device's default port. A port that is not a number from 1 is a ``ValueError``."""
    base, sep, port = name.rpartition(":")
    if not sep:
        return name, None
    if not base or not port.isdigit() or int(port) < 1:
        raise ValueError(f"device {name!r}: expected NAME or NAME:PORT with a port number from 1 (mlx5_0:1)")
    return base, int(port)


def _device_name(raw: str) -> str:
    split_device_name(raw)
    return raw


# ---------------------------------------------------------- the settings ----

PROVIDER = _choice(
    "AIORDMA_PROVIDER",
    PROVIDERS,
    "auto",
    "which devices to use: a pyverbs device with an active port if there is one, else the soft device (auto)",
)
DEVICE = _declare(
    Setting[str | None](
        "AIORDMA_DEVICE",
        None,
        "a device name, or NAME:PORT with a port number from 1",
        "the device to use (rxe0, mlx5_0; soft0 is the soft device), and its port after a colon (mlx5_0:2)",
        _device_name,
    )
)
GID_INDEX = _integer(
    "AIORDMA_GID_INDEX", 0, None, "the GID index to use (default: the RoCE v2 GID carrying an IPv4 address)"
)
TRAFFIC_CLASS = _integer(
    "AIORDMA_TRAFFIC_CLASS",
    0,
    255,
    "the IP traffic class of every connection's RoCE packets: DSCP << 2 | ECN (default 0; DSCP 26 is 104)",
)
SERVICE_LEVEL = _integer(
    "AIORDMA_SERVICE_LEVEL", 0, 15, "the service level of every connection's address vector (default 0)"
)
HOP_LIMIT = _integer(
    "AIORDMA_HOP_LIMIT", 1, 255, "the IP hop limit (TTL) of every connection's RoCE packets (default 64)"
)
FLOW_LABEL = _integer(
    "AIORDMA_FLOW_LABEL", 0, 0xFFFFF, "the IPv6 flow label of every connection's address vector (default 0)"
)
PATH_MTU = _integer(
    "AIORDMA_PATH_MTU",
    256,
    MAX_SOFT_MTU,
    "the largest path MTU a connection negotiates, bytes (default: no cap beyond the two ports')",
)
SOFT_ADDR = _declare(
    Setting[str | None](
        "AIORDMA_SOFT_ADDR",
        None,
        "IPv4[:PORT] with a port from 0 to 65535",
        "the address the soft device binds (default: the first free 127.0.0.N:4791)",
        _soft_address,
    )
)
SOFT_ENGINE = _choice(
    "AIORDMA_SOFT_ENGINE",
    SOFT_ENGINES,
    None,
    "what does the soft device's NIC work (default: native when it is built, else python)",
)
CORE = _choice(
    "AIORDMA_CORE",
    CORES,
    None,
    "the per-operation core of connections: compiled (aiordma._core) or python, the reference "
    "(default: compiled when it is built)",
)
SOFT_WINDOW_US = _number(
    "AIORDMA_SOFT_WINDOW_US",
    None,
    "microseconds",
    "native engine: how long the event loop keeps receiving after the last post or completion (default 2000)",
)
SOFT_POLL_US = _number(
    "AIORDMA_SOFT_POLL_US",
    None,
    "microseconds",
    "native engine: how long the NIC thread keeps polling its socket after serving a peer's one-sided "
    "requests, before it sleeps (default 50; 0: sleep at once)",
)
SOFT_ICRC = _choice("AIORDMA_SOFT_ICRC", ICRC_POLICIES, "strict", "how the soft device checks received ICRCs")
SOFT_MTU = _integer(
    "AIORDMA_SOFT_MTU", 256, MAX_SOFT_MTU, "the largest path MTU toward another soft device (default: per interface)"
)
SOFT_GSO = _flag("AIORDMA_SOFT_GSO", True, "send equal-size datagrams to one peer as UDP GSO batches")
SOFT_GRO = _flag(
    "AIORDMA_SOFT_GRO", True, "receive a peer's UDP GSO batch whole (UDP_GRO) and split it into its packets"
)
SOFT_SKIP_LOOPBACK_ICRC = _flag(
    "AIORDMA_SOFT_SKIP_LOOPBACK_ICRC",
    True,
    "native engine on loopback: offer to leave the ICRC out toward another soft device on loopback",
)
SOFT_LOCAL = _flag(
    "AIORDMA_SOFT_LOCAL",
    True,
    "native engine: hand the packets between two queue pairs of one soft device (one process) over in memory",
)
SOFT_CMA = _flag(
    "AIORDMA_SOFT_CMA",
    True,
    "native engine: let a large RDMA Read between two processes of this host copy the bytes straight "
    "out of the responder's memory (cross-memory attach) once the responder's rkey checks pass",
)
SOFT_SHM = _flag(
    "AIORDMA_SOFT_SHM",
    True,
    "native engine: carry the packets between soft devices of two processes of this host through memory "
    "only the two share (a shared-memory link) rather than UDP loopback",
)
SOFT_SHM_POLL_US = _number(
    "AIORDMA_SOFT_SHM_POLL_US",
    None,
    "microseconds",
    "native engine: how long the event loop keeps polling its shared-memory links after the last packet, "
    "post or completion, before it sleeps until a peer wakes it (default 100; 0: never poll)",
)
SOFT_LOOP_ASSIST = _flag(
    "AIORDMA_SOFT_LOOP_ASSIST",
    True,
    "let the soft engine use the event loop's thread (the NIC thread stays the backstop)",
)
SOFT_PCAP = _text("AIORDMA_SOFT_PCAP", "a file name", "write the soft device's traffic to this pcap file")
SRQ = _choice(
    "AIORDMA_SRQ",
    ("auto", "on", "off"),
    "auto",
    "connections take their receives from the device's shared receive queue (auto: on pyverbs devices, "
    "off on the soft device)",
)
PROGRESS = _choice("AIORDMA_PROGRESS", PROGRESS_MODES, "event", "how a connection learns of its completions")
SPIN_US = _number(
    "AIORDMA_SPIN_US",
    DEFAULT_SPIN_US,
    "microseconds",
    "the poll window: how long the event loop polls after traffic before it sleeps (0: not at all)",
)
METRICS_LATENCY = _flag(
    "AIORDMA_METRICS_LATENCY",
    True,
    "time every operation from post to completion for the latency histograms (aiordma.metrics)",
)
TOKEN = _text("AIORDMA_TOKEN", "a shared secret", "the rendezvous's shared secret", secret=True)
TOKEN_FILE = _text("AIORDMA_TOKEN_FILE", "a file name", "a file holding the rendezvous's shared secret")
INSECURE = _flag("AIORDMA_INSECURE", False, "let a server listen beyond loopback without a token")
PYVERBS_PATH = _text(
    "AIORDMA_PYVERBS_PATH",
    "directories separated by ':'",
    "where to look for the system's pyverbs package when `import pyverbs` fails",
)
PYVERBS_EXTENDED = _flag(
    "AIORDMA_PYVERBS_EXTENDED",
    True,
    "pyverbs: post with the extended verbs (ibv_wr_*) where the device has them; 0: ibv_post_send",
)
TRACEBACK = _flag("AIORDMA_TRACEBACK", False, "the commands show the traceback of an unexpected error")
BENCH_PROFILE_CLIENT = _text(
    "AIORDMA_BENCH_PROFILE_CLIENT", "a file name", "aiordma bench: write a cProfile of the client end to this file"
)
BENCH_PROFILE_SERVER = _text(
    "AIORDMA_BENCH_PROFILE_SERVER",
    "a file name prefix",
    "aiordma bench: write a cProfile of each server end to PREFIX.SERVE.prof",
)
