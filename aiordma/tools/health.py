"""``aiordma health``: is RDMA healthy? Exit status 0 when it is, 1 when it is not.

Two forms, for a supervisor's liveness or readiness probe:

* ``aiordma health --url http://127.0.0.1:9464/health`` asks a running service
  (one that serves :func:`aiordma.prometheus.serve`) for its own check
  (:func:`aiordma.health.check`: its devices, its connections, its receive
  budget), and prints it;
* ``aiordma health`` alone checks this host: it opens the default device (or
  ``--device``), checks it the same way (a soft device's NIC thread runs, a
  kernel device's port is active) and closes it.

``--json`` prints the report as one JSON object. An unreachable service, or an
answer that is not a health report, is unhealthy too (exit status 1, one line).
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from . import ToolError


def _url(text: str) -> str:
    parsed = urllib.parse.urlsplit(text)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise argparse.ArgumentTypeError(f"expected an http:// URL such as http://127.0.0.1:9464/health, got {text!r}")
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", type=_url, help="a running service's /health endpoint (aiordma.prometheus.serve)")
    parser.add_argument("--device", help="the device to check on this host (default: the default device)")
    parser.add_argument("--timeout", type=_seconds, default=5.0, help="seconds to wait for --url (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _ask(url: str, timeout: float) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as e:  # 503: unhealthy, with its report
        body = e.read()
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ToolError(f"{url}: cannot ask it ({reason}): unhealthy") from None
    try:
        report = json.loads(body)
        healthy, checks = report["healthy"], report["checks"]
        if not isinstance(healthy, bool) or not isinstance(checks, list):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise ToolError(
            f"{url}: its answer is not a health report (is it aiordma.prometheus.serve's /health?)"
        ) from None
    return dict(report)


def _local(device_name: str | None) -> dict[str, Any]:
    from .. import providers
    from ..health import HealthReport, check_device

    device = providers.device_for(None, device_name) if device_name else providers.open_device()
    try:
        report = HealthReport([check_device(device)])
    finally:
        if not device_name:
            device.close()
    return report.as_dict()


def run(args: argparse.Namespace) -> int:
    report = _ask(args.url, args.timeout) if args.url else _local(args.device)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        where = args.url or "this host"
        print(f"{where}: {'healthy' if report['healthy'] else 'NOT healthy'}")
        for c in report["checks"]:
            print(f"  {'ok ' if c.get('ok') else 'BAD'} {c.get('name')}: {c.get('detail')}")
    return 0 if report["healthy"] else 1
