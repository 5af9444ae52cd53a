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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from .memory import Region, RegionSlice, RemoteBuffer
from .providers.base import Access, WROpcode

if TYPE_CHECKING:  # pragma: no cover
    from .providers.base import ProtectionDomain

__all__ = [
    "DEFAULT_RIGHTS",
    "ExposedRegions",
    "Exposure",
    "Rights",
    "access_error_explanation",
    "as_exposable",
    "parse_rights",
    "registration_access",
]

#: rights letters and the verbs access flag each grants
RIGHTS: dict[str, Access] = {"r": Access.REMOTE_READ, "w": Access.REMOTE_WRITE, "a": Access.REMOTE_ATOMIC}
#: what ``expose={"name": region}`` grants: the peer may read, nothing more
DEFAULT_RIGHTS = "r"
_REMOTE = Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC

Rights = Union[str, Access]  # noqa: UP007 (a runtime alias: Python 3.11 cannot `|` a str and an enum here)


def parse_rights(rights: Rights) -> str:
    """``rights`` in its canonical form (``"r"``, ``"rw"``, ``"rwa"``, ``"w"``, …).

    A string of the letters ``r`` (REMOTE_READ), ``w`` (REMOTE_WRITE) and
    ``a`` (REMOTE_ATOMIC), or :class:`~aiordma.Access` flags (their
    ``REMOTE_*`` part)."""
    if isinstance(rights, Access):
        letters = "".join(k for k, flag in RIGHTS.items() if rights & flag)
        if not letters:
            raise ValueError(
                f"access {rights!s} grants a peer nothing: give REMOTE_READ, REMOTE_WRITE and/or REMOTE_ATOMIC"
            )
        return letters
    if not isinstance(rights, str):
        raise TypeError(f"rights must be a string such as 'rw', or Access flags, not {type(rights).__name__}")
    bad = sorted(set(rights) - set(RIGHTS))
    if bad or not rights:
        raise ValueError(
            f"rights {rights!r}: use the letters r (REMOTE_READ), w (REMOTE_WRITE) and a (REMOTE_ATOMIC), "
            "e.g. 'r', 'rw' or 'rwa'"
        )
    return "".join(k for k in RIGHTS if k in rights)


def registration_access(rights: Rights) -> Access:
    """The access flags of the registration that grants ``rights``
    (``REMOTE_WRITE``/``REMOTE_ATOMIC`` need ``LOCAL_WRITE`` too: a verbs rule)."""
    access = Access(0)
    for letter in parse_rights(rights):
        access |= RIGHTS[letter]
    if access & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC):
        access |= Access.LOCAL_WRITE
    return access


def rights_names(rights: Rights) -> str:
    """``"rw"`` → ``"REMOTE_READ|REMOTE_WRITE"``."""
    return "|".join(str(RIGHTS[k].name) for k in parse_rights(rights))


@dataclass(frozen=True, slots=True)
class Exposure:
    """A region (or a slice of one) as offered to a peer, with the rights the
    peer gets: made by :meth:`Region.exposed` / :meth:`RegionSlice.exposed`."""

    target: Region | RegionSlice
    #: canonical letters after construction (``"r"``, ``"rw"``, ``"rwa"``, …)
    rights: Rights = DEFAULT_RIGHTS

    def __post_init__(self) -> None:
        if not isinstance(self.target, (Region, RegionSlice)):
            raise TypeError(f"only registered memory can be exposed (a Region or a slice), not {self.target!r}")
        object.__setattr__(self, "rights", parse_rights(self.rights))
        if len(self.target) == 0:
            raise ValueError("cannot expose an empty slice: a peer could reach nothing")

    @property
    def access(self) -> Access:
        """The access flags of the registration a peer is given."""
        return registration_access(self.rights)

    def __len__(self) -> int:
        return len(self.target)

    def __repr__(self) -> str:
        return f"<Exposure rights={self.rights!r} of {self.target!r}>"


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

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={r.mr.access!s}" for k, r in self.regions.items())
        return f"<ExposedRegions {inner or 'none'}>"


_OP_RIGHT = {
    int(WROpcode.IBV_WR_RDMA_WRITE): "REMOTE_WRITE",
    int(WROpcode.IBV_WR_RDMA_WRITE_WITH_IMM): "REMOTE_WRITE",
    int(WROpcode.IBV_WR_RDMA_READ): "REMOTE_READ",
    int(WROpcode.IBV_WR_ATOMIC_CMP_AND_SWP): "REMOTE_ATOMIC",
    int(WROpcode.IBV_WR_ATOMIC_FETCH_AND_ADD): "REMOTE_ATOMIC",
}
_EXAMPLE = {"REMOTE_WRITE": "rw", "REMOTE_READ": "r", "REMOTE_ATOMIC": "rwa"}


def access_error_explanation(opcode: Any, peer_reason: str | None) -> str:
    """Why the peer's NIC answered ``IBV_WC_REM_ACCESS_ERR`` to a request
    with ``opcode``, naming the right it needed: the peer's own words when it
    sent them (the soft device says which check failed), else what the
    operation requires."""
    right = _OP_RIGHT.get(int(opcode)) if opcode is not None else None
    hint = (
        f' (a peer grants {right} only on memory it exposes with that right, e.g. region.exposed("{_EXAMPLE[right]}"))'
        if right
        else ""
    )
    if peer_reason:
        if right and right in peer_reason and "does not grant" in peer_reason:
            return f"the peer's NIC refused it: {peer_reason}{hint}"
        return f"the peer's NIC refused it: {peer_reason}"
    if right:
        return (
            f"the peer's NIC refused it: the rkey does not grant {right}, is not a region of the peer, or the "
            f"range is outside its region{hint}"
        )
    return (
        "the peer's NIC refused it: the rkey is unknown, does not grant the access "
        "(REMOTE_WRITE/REMOTE_READ/REMOTE_ATOMIC), or the range is outside its region"
    )
