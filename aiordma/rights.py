"""Remote access rights: what a peer may do to memory, in letters and in verbs flags.

A right is one of the ``REMOTE_*`` access flags of a registration, which the
responder's NIC checks on every request that names its rkey: ``r``
(``REMOTE_READ``: RDMA Read), ``w`` (``REMOTE_WRITE``: RDMA Write, with or
without immediate) and ``a`` (``REMOTE_ATOMIC``: compare-and-swap,
fetch-and-add). This module is the vocabulary, and what a refusal
(``IBV_WC_REM_ACCESS_ERR``) means for a request; what is exposed with which
rights, and the registrations that grant them, are :mod:`aiordma.memory`'s
(:meth:`~aiordma.Region.exposed`) and :mod:`aiordma.exposure`'s. Both of those
and the completions' errors (:mod:`aiordma.ops`) use it, so it sits below them.
"""

from __future__ import annotations

from typing import Any, Union

from .verbs import Access, WROpcode

__all__ = [
    "DEFAULT_RIGHTS",
    "RIGHTS",
    "Rights",
    "access_error_explanation",
    "parse_rights",
    "registration_access",
    "rights_names",
]

#: rights letters and the verbs access flag each grants
RIGHTS: dict[str, Access] = {"r": Access.REMOTE_READ, "w": Access.REMOTE_WRITE, "a": Access.REMOTE_ATOMIC}
#: what ``expose={"name": region}`` grants: the peer may read, nothing more
DEFAULT_RIGHTS = "r"

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
