"""The ``rdma://`` Dask comm backend: is it installed, registered and configured?

``aiordma[dask]`` registers the backend under the entry point ``rdma`` of the
``distributed.comm.backends`` group; Dask's ``get_backend("rdma")`` must find
it (and not another package's), and ``distributed.comm.rdma.*`` must read
cleanly. Nothing is checked (``skip``) when Dask ``distributed`` is not
installed: the backend is then simply unused.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any

from ... import settings
from .plan import Context
from .report import OK, SKIP, WARN, Check

NAME = "Dask backend"
ENTRY_POINT = "aiordma.integrations.dask:RDMABackend"
INSTALL = "pip install 'aiordma[dask]'"


def _entry_points() -> list[str]:
    return [ep.value for ep in importlib.metadata.entry_points(group="distributed.comm.backends", name="rdma")]


def backend_facts() -> dict[str, Any]:
    """What the check looks at (a test may replace this function)."""
    facts: dict[str, Any] = {"distributed": None}
    if importlib.util.find_spec("distributed") is None:
        return facts
    import distributed

    facts["distributed"] = distributed.__version__
    facts["entry_points"] = _entry_points()
    try:
        from distributed.comm.registry import get_backend

        from ...integrations.dask import RDMABackend, Settings

        backend = get_backend("rdma")
        facts["backend"] = f"{type(backend).__module__}.{type(backend).__qualname__}"
        facts["ours"] = isinstance(backend, RDMABackend)
        settings = Settings.from_config()
    except Exception as e:  # a broken install or a bad setting: say which
        facts["error"] = f"{type(e).__name__}: {e}"
        return facts
    facts["provider"] = settings.provider or "auto"
    facts["device"] = settings.device
    facts["soft_address"] = settings.soft_address
    facts["token"] = "distributed.comm.rdma.token" if settings.token else None
    return facts


def check_dask(ctx: Context) -> list[Check]:
    facts = backend_facts()
    if facts["distributed"] is None:
        return [
            Check(
                NAME,
                SKIP,
                "Dask distributed is not installed: the rdma:// comm backend is unused",
                f"for Dask clusters over RDMA: {INSTALL}",
                facts,
            )
        ]
    version = f"distributed {facts['distributed']}"
    if "error" in facts:
        return [
            Check(
                NAME,
                WARN,
                f"{version}; the rdma:// backend cannot be used: {facts['error']}",
                f"reinstall with {INSTALL}, or fix the setting named above (distributed.comm.rdma.*)",
                facts,
            )
        ]
    if not facts["ours"] or ENTRY_POINT not in facts["entry_points"]:
        return [
            Check(
                NAME,
                WARN,
                f"{version}; rdma:// resolves to {facts['backend']}, not aiordma's backend "
                f"(entry points named rdma: {', '.join(facts['entry_points']) or 'none'})",
                f"reinstall aiordma with {INSTALL} and remove the other package that registers rdma",
                facts,
            )
        ]
    env = ctx.probe.env
    token = (
        facts["token"]
        or ("AIORDMA_TOKEN" if settings.TOKEN.get(env) is not None else None)
        or ("AIORDMA_TOKEN_FILE" if settings.TOKEN_FILE.get(env) is not None else None)
    )
    parts = [
        f"{version}; rdma:// is aiordma's backend ({ENTRY_POINT})",
        f"provider {facts['provider']}" + (f", device {facts['device']}" if facts["device"] else ""),
        f"soft device at {facts['soft_address']}"
        if facts["soft_address"]
        else "soft device bound where each listener is contacted",
        f"rendezvous token from {token}" if token else "no rendezvous token",
    ]
    fix = ""
    if not token:
        fix = (
            "for workers on other hosts set a shared token: distributed.comm.rdma.token "
            "(DASK_DISTRIBUTED__COMM__RDMA__TOKEN), AIORDMA_TOKEN or AIORDMA_TOKEN_FILE, the same in every Dask "
            "process (a listener on a non-loopback address refuses to start without one)"
        )
    facts["token_source"] = token
    return [Check(NAME, OK, "; ".join(parts), fix, facts)]
