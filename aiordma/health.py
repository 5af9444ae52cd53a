"""Is this process's RDMA healthy? A check a supervisor can call.

:func:`check` looks at what this process has open and says, for each part,
whether it works:

* **devices**: every device context it opened is open; a soft device's NIC
  thread runs (it receives every packet and runs the transport's timers); a
  kernel device's port is ``IBV_PORT_ACTIVE``;
* **connections**: none has a work request in flight for longer than its
  transport would retry it (:attr:`~aiordma.Connection.transport_timeout`,
  times two, at least ``stuck_after``): by then the transport has completed or
  failed it, so one still in flight is stuck (with ``ack_timeout=0`` the
  transport waits forever: ``stuck_after`` alone decides);
* **receive budget**: the bytes of received messages queued for the
  application are below the process-wide receive budget (past it, every
  receiver holds its credits back and senders wait: the application is not
  reading).

``aiordma health`` is the command-line form (exit status 0: healthy, 1: not;
``--url`` asks a running service's ``/health``, :func:`aiordma.prometheus.serve`).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .providers import open_devices
from .providers.base import DeviceContext, PortState, device_label

__all__ = ["DEFAULT_STUCK_AFTER", "HealthCheck", "HealthReport", "check", "check_device"]

#: the least time (s) a work request may stay in flight before it counts as stuck
DEFAULT_STUCK_AFTER = 10.0


@dataclass(frozen=True)
class HealthCheck:
    """One part checked: its name, whether it is fine, and what was seen."""

    name: str
    ok: bool
    detail: str


@dataclass
class HealthReport:
    """Every part checked; healthy when all are."""

    checks: list[HealthCheck] = field(default_factory=list)
    checked_at: float = field(default_factory=time.time)

    @property
    def healthy(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def problems(self) -> list[HealthCheck]:
        return [c for c in self.checks if not c.ok]

    def as_dict(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "checked_at": self.checked_at, "checks": [asdict(c) for c in self.checks]}

    def __str__(self) -> str:
        lines = [f"{'healthy' if self.healthy else 'NOT healthy'} ({len(self.checks)} checks)"]
        lines += [f"  {'ok ' if c.ok else 'BAD'} {c.name}: {c.detail}" for c in self.checks]
        return "\n".join(lines)


def check_device(device: DeviceContext) -> HealthCheck:
    """Whether ``device`` can serve its connections."""
    name = f"device {device_label(device)}"
    if getattr(device, "_closed", False):
        return HealthCheck(name, False, "closed")
    if device.provider == "soft":
        alive = bool(getattr(device, "nic_thread_alive", False))
        return HealthCheck(
            name, alive, "NIC thread running" if alive else "the NIC thread stopped: no packet is served"
        )
    port = int(getattr(device, "port_num", 1))
    try:
        state = device.query_port(port).state
    except Exception as e:
        return HealthCheck(name, False, f"ibv_query_port({port}) failed: {e}")
    if state != PortState.IBV_PORT_ACTIVE:
        return HealthCheck(name, False, f"port {port} is {getattr(state, 'name', state)}, not IBV_PORT_ACTIVE")
    return HealthCheck(name, True, f"port {port} IBV_PORT_ACTIVE")


def check(stuck_after: float = DEFAULT_STUCK_AFTER) -> HealthReport:
    """Check this process's devices, connections and receive budget (see the module's docstring)."""
    from .connection import open_connections
    from .window import PROCESS_RECV_BUDGET

    report = HealthReport()
    devices = open_devices()
    report.checks.extend(check_device(d) for d in devices)
    if not devices:
        report.checks.append(HealthCheck("devices", True, "none open"))

    stuck = []
    connections = open_connections()
    for conn in connections:
        try:
            age = conn.oldest_operation_age
            give_up = conn.transport_timeout
            limit = stuck_after if math.isinf(give_up) else max(stuck_after, 2 * give_up)
        except Exception:  # torn down under us
            continue
        if age is not None and age > limit:
            stuck.append(f"{conn!r}: a work request in flight for {age:.1f} s (limit {limit:.1f} s)")
    if stuck:
        report.checks.append(HealthCheck("connections", False, "; ".join(stuck)))
    else:
        report.checks.append(HealthCheck("connections", True, f"{len(connections)} open, none stuck"))

    used, limit = PROCESS_RECV_BUDGET.buffered, PROCESS_RECV_BUDGET.limit
    report.checks.append(
        HealthCheck(
            "receive budget",
            used < limit,
            f"{used} of {limit} bytes queued for the application"
            + ("" if used < limit else ": receivers hold their credits back (is the application reading?)"),
        )
    )
    return report
