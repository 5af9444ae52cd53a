"""Verbs devices: pick and open one.

``provider="auto"`` (the default) uses a pyverbs device that has an active
port when pyverbs and such a device exist, else the soft (userspace RoCEv2)
device. ``AIORDMA_PROVIDER`` (``auto``/``soft``/``pyverbs``) and
``AIORDMA_DEVICE`` (a device name such as ``rxe0`` or ``mlx5_0``) override
the defaults; keyword arguments override both.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any

from .. import settings
from ..errors import DeviceNotFoundError, ProviderUnavailableError
from ..settings import PROVIDERS as PROVIDERS
from .base import DeviceContext

_lock = threading.Lock()
_shared: dict[tuple[Any, ...], DeviceContext] = {}
#: every device context open_device made (for the metrics and the health check)
_opened: weakref.WeakSet[DeviceContext] = weakref.WeakSet()
_opened_lock = threading.Lock()  # (get_device holds _lock while it opens one)


def open_devices() -> list[DeviceContext]:
    """The device contexts this process opened through aiordma (``open_device``,
    ``get_device``, a connection's default device) and has not closed, oldest first."""
    with _opened_lock:
        devices = list(_opened)
    return [d for d in devices if not getattr(d, "_closed", False)]


def _pyverbs_device_names() -> list[str]:
    from . import pyverbs as pv

    return pv.list_devices()


def _has_active_port(name: str) -> bool:
    from . import pyverbs as pv
    from .base import PortState

    try:
        dev = pv.open_device(name)
    except Exception:
        return False
    try:
        return dev.query_port(1).state == PortState.IBV_PORT_ACTIVE
    except Exception:
        return False
    finally:
        dev.close()


def resolve_provider(provider: str | None = None, name: str | None = None) -> tuple[str, str | None]:
    """Which provider and device name ``open_device`` would use, and why not others."""
    provider = (provider or settings.PROVIDER.get()).lower()
    name = name or settings.DEVICE.get()
    if name:
        name = settings.split_device_name(name)[0]
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}: expected one of {', '.join(PROVIDERS)}")
    if provider == "auto":
        if name and name.startswith("soft"):
            return "soft", name
        try:
            names = _pyverbs_device_names()
        except (ProviderUnavailableError, ImportError):
            names = []
        if name:
            return ("pyverbs", name) if name in names else ("soft", None)
        for n in names:
            if _has_active_port(n):
                return "pyverbs", n
        return "soft", None
    return provider, name


def open_device(provider: str | None = None, name: str | None = None, **options: Any) -> DeviceContext:
    """Open a new device context (the caller closes it). ``name`` may name a
    port too (``"mlx5_0:2"``), as ``port_num=`` does: the port its connections use."""
    port = settings.split_device_name(name or settings.DEVICE.get() or "")[1]
    if port is not None:
        options.setdefault("port_num", port)
    provider, name = resolve_provider(provider, name)
    if provider == "soft":
        from .soft.device import SoftDevice

        port = options.pop("port_num", 1)
        if port != 1:
            raise DeviceNotFoundError(f"the soft device {name or 'soft0'} has one port (1), not {port}")
        dev: DeviceContext = SoftDevice(options.pop("address", None), name=name, **options)
    else:
        dev = _open_pyverbs(name, options)
    with _opened_lock:
        _opened.add(dev)
    return dev


def _open_pyverbs(name: str | None, options: dict[str, Any]) -> DeviceContext:
    from . import pyverbs as pv

    if name is None:
        names = pv.list_devices()
        if not names:
            raise DeviceNotFoundError(
                "no RDMA device found by pyverbs (no /sys/class/infiniband entries): load a driver "
                "(mlx5_ib, irdma) or add Soft-RoCE with `rdma link add rxe0 type rxe netdev IFACE`, "
                "or use provider='soft'"
            )
    return pv.open_device(name, **options)


def get_device(provider: str | None = None, name: str | None = None, **options: Any) -> DeviceContext:
    """A device context shared by every connection of this process that asks
    for the same provider/name/options (opened on first use, closed at exit)."""
    port = settings.split_device_name(name or settings.DEVICE.get() or "")[1]
    if port is not None and port != 1:  # (port 1 is the default: the same device as no port)
        options.setdefault("port_num", port)
    key = (resolve_provider(provider, name), tuple(sorted(options.items())))
    with _lock:
        dev = _shared.get(key)
        if dev is None or getattr(dev, "_closed", False):
            dev = open_device(provider, name, **options)
            _shared[key] = dev
        return dev


def device_for(provider: str | None, device: DeviceContext | str | None) -> DeviceContext:
    """The device a call names: a device context as it is, a device name (``"mlx5_1"``,
    ``"rxe0"``, ``"soft0"``) opened and shared like :func:`get_device`'s, or, for None,
    the default device of ``provider`` (``AIORDMA_DEVICE``, else the first one found)."""
    if device is None:
        return get_device(provider)
    if isinstance(device, str):
        name = settings.split_device_name(device)[0]
        if not name.startswith("soft") and (provider or "auto") != "soft":
            # a name asked for by the caller is that device or an error, never another one
            try:
                names = _pyverbs_device_names()
            except (ProviderUnavailableError, ImportError) as e:
                raise DeviceNotFoundError(f"no RDMA device {device!r}: pyverbs cannot be used here ({e})") from e
            if name not in names:
                have = ", ".join(names) if names else "none"
                raise DeviceNotFoundError(
                    f"no RDMA device {device!r} (this machine has: {have}; the soft device is 'soft0'; "
                    "`aiordma devices` lists them)"
                )
            return get_device("pyverbs" if provider in (None, "auto") else provider, device)
        return get_device(provider, device)
    return device


#: devices left open at exit: connections on them belong to an event loop still running
#: in another thread (a framework's IO thread), whose own exit handlers close them later
_spared: list[DeviceContext] = []


def spare_at_exit(device: DeviceContext) -> None:
    """Do not close ``device`` in this process's exit handler (see :data:`_spared`)."""
    with _lock:
        if not any(d is device for d in _spared):
            _spared.append(device)


def close_shared_devices() -> None:
    """Close the shared device contexts (at exit, or between tests)."""
    with _lock:
        devs = [d for d in _shared.values() if not any(d is s for s in _spared)]
        for key in [k for k, d in _shared.items() if any(d is x for x in devs)]:
            del _shared[key]
        _spared.clear()
    for d in devs:
        try:
            d.close()
        except Exception:
            pass


atexit.register(close_shared_devices)
