"""Run every check, in order, and collect the :class:`~.report.Report`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ... import settings
from .checks import (
    check_devices,
    check_kernel,
    check_memlock,
    check_python,
    check_pyverbs,
    check_rdma_cm,
    check_rxe_available,
)
from .dask import check_dask
from .firewall import check_firewall
from .loopback import check_loopback_pyverbs, check_soft
from .peer import check_peer
from .plan import Context, Options, make_plan
from .ports import check_ports
from .probe import Probe
from .qos import check_traffic_class
from .report import FAIL, WARN, Check, Report
from .security import check_exposure
from .sysfs import read_devices


async def diagnose(opts: Options | None = None, probe: Probe | None = None) -> Report:
    """Run every check; the blocking ones (device queries, loopback Writes)
    run in a worker thread so a caller's event loop stays responsive."""
    opts = opts or Options()
    probe = probe or Probe()
    settings.check_all(probe.env)  # a bad AIORDMA_* value is a SettingError, not a check that failed
    ctx = Context(opts, probe)

    def gather() -> None:
        ctx.pyverbs = probe.pyverbs_info()
        ctx.devices = read_devices(probe)
        ctx.plan = make_plan(ctx)

    await asyncio.to_thread(gather)
    checks: list[Check] = []
    steps: list[Callable[[Context], list[Check]]] = [
        check_python,
        check_pyverbs,
        check_kernel,
        check_devices,
        check_rdma_cm,
        check_ports,
        check_memlock,
        check_rxe_available,
        check_loopback_pyverbs,
        check_soft,
        check_exposure,
    ]
    for step in steps:
        checks += await asyncio.to_thread(_guarded, step, ctx)
    try:
        checks += await check_peer(ctx)
    except Exception as e:  # a bug in a check must not hide the others
        checks.append(Check("peer", FAIL, f"the check itself failed: {type(e).__name__}: {e}", ""))
    checks += await asyncio.to_thread(_guarded, check_firewall, ctx)
    checks += await asyncio.to_thread(_guarded, check_traffic_class, ctx)
    checks += await asyncio.to_thread(_guarded, check_dask, ctx)
    return Report(ctx.plan, checks)


def _guarded(step: Callable[[Context], list[Check]], ctx: Context) -> list[Check]:
    try:
        return step(ctx)
    except Exception as e:
        name = step.__name__.removeprefix("check_")
        return [Check(name, WARN, f"the check itself failed: {type(e).__name__}: {e}", "report this as an aiordma bug")]


def diagnose_sync(opts: Options | None = None, probe: Probe | None = None) -> Report:
    return asyncio.run(diagnose(opts, probe))
