"""The doctor's options, the :class:`Context` the checks share, and the
:class:`~.report.Plan`: which provider and device aiordma would use here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ... import settings
from .probe import Probe
from .report import FAIL, WARN, Plan
from .sysfs import Device

DEFAULT_PEER_TIMEOUT = 5.0


@dataclass
class Options:
    provider: str | None = None
    device: str | None = None
    peer: str | None = None
    token: str | None = None
    timeout: float = DEFAULT_PEER_TIMEOUT


class Context:
    """What the checks share: options, probe, sysfs facts, the plan."""

    def __init__(self, opts: Options, probe: Probe) -> None:
        self.opts = opts
        self.probe = probe
        self.pyverbs: dict[str, Any] = {}
        self.devices: list[Device] = []
        self.plan = Plan("soft", None, "not decided yet")

    def severity(self, required: bool) -> str:
        """``fail`` for what the chosen device needs, ``warn`` otherwise."""
        return FAIL if required else WARN

    @property
    def uses_pyverbs(self) -> bool:
        return self.plan.provider == "pyverbs"

    def is_chosen(self, dev: str, port: int = 1) -> bool:
        return self.uses_pyverbs and self.plan.device == dev and port == 1


def make_plan(ctx: Context) -> Plan:
    """Which provider/device aiordma would use (mirrors
    :func:`aiordma.providers.resolve_provider`, but from the facts gathered)."""
    env = ctx.probe.env
    requested = (ctx.opts.provider or settings.PROVIDER.get(env)).lower()
    name = ctx.opts.device or settings.DEVICE.get(env)
    if requested not in ("auto", "soft", "pyverbs"):
        raise ValueError(f"unknown provider {requested!r}: expected auto, soft or pyverbs")
    by_name = {d.name: d for d in ctx.devices}
    if requested == "soft":
        return Plan("soft", name or "soft0", "requested (provider soft)", requested)
    if requested == "pyverbs":
        if name is None:
            active = [d.name for d in ctx.devices if d.ports and d.ports[0].active]
            name = next(iter(active or list(by_name)), None)
        return Plan("pyverbs", name, "requested (provider pyverbs)", requested)
    if name and name.startswith("soft"):
        return Plan("soft", name, f"device {name} is the soft device", requested)
    if not ctx.pyverbs.get("available"):
        return Plan("soft", "soft0", "pyverbs is not available", requested)
    if name:
        if name in by_name:
            return Plan("pyverbs", name, f"device {name} requested", requested)
        return Plan("soft", "soft0", f"no RDMA device named {name}", requested)
    for d in ctx.devices:
        if d.ports and d.ports[0].active:
            return Plan("pyverbs", d.name, f"{d.name} port 1 is PORT_ACTIVE", requested)
    if ctx.devices:
        return Plan("soft", "soft0", "no RDMA device has an active port 1", requested)
    return Plan("soft", "soft0", "the kernel has no RDMA device", requested)
