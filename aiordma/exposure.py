"""Exposed memory: what a peer may do to the regions it is given.

RDMA's memory protection is the rkey: a peer that presents one may act on
the registration behind it with exactly the ``REMOTE_*`` rights that
registration was made with, within its bounds, and nothing else (the
responder's NIC checks every request and answers a violation with
``IBV_WC_REM_ACCESS_ERR``). aiordma uses that for least privilege:

* what a peer may do is declared where memory is exposed:
  ``expose={"mem": region}`` offers it read-only; ``region.exposed("rw")``
  read-write, ``"rwa"`` with atomics, ``"w"`` write-only (a mailbox the
  peer fills but cannot read), ``region[a:b].exposed(...)`` only those bytes;
* the rkey a peer gets is not the region's own: each connection registers
  the exposed bytes once more (verbs allows several registrations of the
  same memory) with only the declared rights, and hands out that rkey;
* :func:`aiordma.register` grants no remote right by default, so memory
  that was never exposed cannot be reached with any rkey a peer learned;
* the exposure registrations are released when the connection that made
  them closes (and when the exposed region itself is closed), so a peer
  that has gone cannot use its rkeys through another queue pair.

A :class:`~aiordma.RemoteBuffer` passed in ``expose=`` is handed out as it
is: its rkey carries whatever rights its registration has (aiordma's byte
streams expose their receive ring that way, ``REMOTE_WRITE`` only).

A registration costs a little per connection: nothing to speak of on the
soft device; on hardware an ``ibv_reg_mr`` of the exposed bytes (already
pinned by the region's own registration).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .memory import Exposure, Region, RegionSlice, RemoteBuffer
from .rights import (
    DEFAULT_RIGHTS,
    RIGHTS,
    Rights,
    access_error_explanation,
    parse_rights,
    registration_access,
    rights_names,
)

if TYPE_CHECKING:  # pragma: no cover
    from .providers.base import ProtectionDomain

# Exposure (what Region.exposed() returns) is defined in aiordma.memory and the
# rights in aiordma.rights, below this module (memory and the completions' errors
# need them); they stay importable from here.
__all__ = [
    "DEFAULT_RIGHTS",
    "RIGHTS",
    "Exposable",
    "ExposedRegions",
    "Exposure",
    "Rights",
    "access_error_explanation",
    "as_exposable",
    "as_exposables",
    "parse_rights",
    "registration_access",
    "rights_names",
]

Exposable = Region | RegionSlice | Exposure | RemoteBuffer


def as_exposable(value: Any, name: str) -> Exposure | RemoteBuffer:
    """What ``expose={name: value}`` / ``advertise(value, name)`` offers: an
    :class:`Exposure` (a bare region or slice: read-only) or a
    :class:`RemoteBuffer` handed out as it is."""
    if not isinstance(name, str):
        raise TypeError(f"exposed buffers are named by strings, not {type(name).__name__}")
    if isinstance(value, (Exposure, RemoteBuffer)):
        return value
    if isinstance(value, (Region, RegionSlice)):
        return Exposure(value, DEFAULT_RIGHTS)
    raise TypeError(
        f"expose {name!r}: give a Region, a slice of one, region.exposed('rw') or a RemoteBuffer, "
        f"not {type(value).__name__}"
    )


def as_exposables(expose: Mapping[str, Any] | None) -> dict[str, Exposure | RemoteBuffer]:
    """``expose=`` checked up front (a server checks it when it starts, not at its first client)."""
    if expose is None:
        return {}
    if not isinstance(expose, Mapping):
        raise TypeError(f"expose must be a mapping of names to regions, not {type(expose).__name__}")
    return {name: as_exposable(value, name) for name, value in expose.items()}


class ExposedRegions:
    """The registrations one connection made to expose memory to its peer.

    :meth:`grant` registers the exposed bytes once more in ``pd`` with the
    declared rights and returns the descriptor the peer gets;
    :meth:`close` deregisters them all (the connection does, after its
    queue pair is gone). Granting a name again replaces (and deregisters)
    what was granted under it before."""

    def __init__(self, pd: ProtectionDomain) -> None:
        self.pd = pd
        #: name → the registration the peer's rkey names
        self.regions: dict[str, Region] = {}
        self._closed = False

    def grant(self, name: str, value: Any) -> RemoteBuffer:
        item = as_exposable(value, name)
        if isinstance(item, RemoteBuffer):
            rb = RemoteBuffer(item.addr, item.length, item.rkey, name, item.rights)
            self._replace(name, None)
            return rb
        if self._closed:
            raise RuntimeError("the connection's exposures were released")
        target = item.target
        parent, offset = (target.region, target.offset) if isinstance(target, RegionSlice) else (target, 0)
        if parent.closed:
            raise ValueError(f"expose {name!r}: the region was closed (deregistered)")
        view = parent.view[offset : offset + len(target)]
        region = Region(self.pd.reg_mr(view, item.access), parent)
        parent.add_derived(region)
        self._replace(name, region)
        return RemoteBuffer(region.addr, region.length, region.rkey, name, parse_rights(item.rights))

    def grant_all(self, expose: Mapping[str, Any] | None) -> dict[str, RemoteBuffer]:
        return {name: self.grant(name, value) for name, value in (expose or {}).items()}

    def _replace(self, name: str, region: Region | None) -> None:
        old = self.regions.pop(name, None)
        if region is not None:
            self.regions[name] = region
        if old is not None:
            old.close()

    def close(self) -> None:
        """Deregister every exposure registration (idempotent)."""
        self._closed = True
        regions, self.regions = list(self.regions.values()), {}
        for region in regions:
            try:
                region.close()
            except Exception:  # pragma: no cover - a device already gone
                pass

    def __len__(self) -> int:
        return len(self.regions)

    @property
    def registered_bytes(self) -> int:
        """The bytes these registrations cover."""
        return sum(r.length for r in self.regions.values())

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={r.mr.access!s}" for k, r in self.regions.items())
        return f"<ExposedRegions {inner or 'none'}>"
