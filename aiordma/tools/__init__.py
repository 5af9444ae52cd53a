"""Command-line tools behind the ``aiordma`` command, and the rules they share.

Every tool (``aiordma devices|demo|bench|doctor`` and the examples) treats
bad input the same way:

* a bad argument is one line on stderr, ``PROG: error: WHAT``, and exit
  status 2 (argparse's convention). Argument types here raise
  :class:`argparse.ArgumentTypeError`; checks that need several arguments
  raise :class:`UsageError`, which :func:`invoke` reports the same way;
* a failure the user can act on (a peer that cannot be resolved or reached,
  an address already in use) is one line and exit status 1: raise
  :class:`ToolError`;
* a bad ``AIORDMA_*`` environment variable is one line on stderr,
  ``aiordma: NAME='VALUE': expected WHAT``, and exit status 2, the same
  from every tool: :func:`invoke` checks them all (:func:`aiordma.settings.check_all`)
  before it runs the tool, and reports a :class:`~aiordma.errors.SettingError`
  raised later the same way;
* nothing ends in a traceback. An unexpected exception is reported as one
  line too (``AIORDMA_TRACEBACK=1`` shows the traceback, for bug reports).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any, NoReturn

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

#: the largest message an RC queue pair carries (InfiniBand Architecture: 2^31 bytes)
MAX_MESSAGE = 1 << 31


class UsageError(ValueError):
    """A bad combination of command-line arguments, found after parsing;
    reported like argparse's own errors (one line, exit status 2)."""


class ToolError(Exception):
    """A failure the user can act on (an unreachable peer, a busy port);
    reported as one line, exit status 1."""


def _size_text(n: int) -> str:
    for unit, m in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def parse_size(text: str, minimum: int = 0, maximum: int | None = None, why_max: str = "") -> int:
    """A byte count from ``65536``, ``64K``, ``8M``, ``1GiB`` (binary units),
    for argparse ``type=``; raises ArgumentTypeError with an example."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    if t and t[-1] in _UNITS:
        t, mult = t[:-1], _UNITS[t[-1]]
    try:
        value = float(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 65536, 64K, 8M)") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 65536, 64K, 8M)")
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number of bytes: {text!r}")
    n = int(value)
    if n < minimum:
        raise argparse.ArgumentTypeError(f"{text} is less than {minimum} byte{'s' if minimum != 1 else ''}")
    if maximum is not None and n > maximum:
        raise argparse.ArgumentTypeError(
            f"{text} is more than {_size_text(maximum)} ({maximum} bytes){': ' + why_max if why_max else ''}"
        )
    return n


def positive_size(text: str) -> int:
    """:func:`parse_size` for sizes of at least one byte."""
    return parse_size(text, 1)


def size_type(minimum: int = 0, maximum: int | None = None, why_max: str = "") -> Callable[[str], int]:
    """An argparse ``type=`` for byte counts from ``minimum`` to ``maximum``."""

    def size(text: str) -> int:
        return parse_size(text, minimum, maximum, why_max)

    return size


def int_type(minimum: int, maximum: int | None = None, why_max: str = "") -> Callable[[str], int]:
    """An argparse ``type=`` for whole numbers from ``minimum`` to ``maximum``."""

    def integer(text: str) -> int:
        try:
            n = int(text.strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"{n} is less than {minimum}")
        if maximum is not None and n > maximum:
            raise argparse.ArgumentTypeError(f"{n} is more than {maximum}{': ' + why_max if why_max else ''}")
        return n

    return integer


def port_number(text: str) -> int:
    """An argparse ``type=`` for a TCP/UDP port, 0-65535 (0: any free port)."""
    try:
        n = int(text.strip(), 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{n} is not a port number (0-65535)")
    return n


def seconds(text: str) -> float:
    """An argparse ``type=`` for a duration: a finite number of seconds above 0."""
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(s) or s <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a duration: give a number of seconds above 0")
    return s


def host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) with a port from 1 to 65535."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"wants HOST:PORT, got {text!r}")
    n = int(port)
    if not 1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: {n} is not a port number (1-65535)")
    return host.strip("[]"), n


class ToolParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose errors are one line:
    ``PROG: error: MESSAGE (see PROG --help)``, exit status 2. Sub-parsers
    made with ``add_subparsers`` are of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _rdma_error() -> type[Exception]:
    from ..errors import RDMAError

    return RDMAError


def _setting_error() -> type[Exception]:
    from ..errors import SettingError

    return SettingError


def _traceback_wanted() -> bool:
    from .. import settings

    return settings.TRACEBACK.get()


def invoke(run: Callable[[argparse.Namespace], Any], args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run a tool's ``run(args)`` under the rules above; returns the exit status.

    ``parser`` is the parser that parsed ``args`` (its ``prog`` names the
    command in messages, and it reports a :class:`UsageError`)."""
    from .. import settings

    prog = parser.prog
    try:
        settings.check_all()
        return int(run(args) or 0)
    except _setting_error() as e:  # before UsageError and RDMAError: it is both a ValueError and an RDMAError
        print(f"aiordma: {e}", file=sys.stderr)  # the same line from every tool, whatever its prog
        return 2
    except UsageError as e:
        parser.error(str(e))
    except ToolError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    except _rdma_error() as e:  # named after the verbs concept already: say it as it is
        print(f"{prog}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if _traceback_wanted():
            raise
        print(
            f"{prog}: {type(e).__name__}: {e} (unexpected; AIORDMA_TRACEBACK=1 shows where, for a bug report)",
            file=sys.stderr,
        )
        return 1
