"""Cross-memory attach (CMA): an RDMA Read between two processes of one host
without the copies of UDP loopback.

Between two soft devices the bytes of a READ normally travel as READ RESPONSE
datagrams: the responder's kernel copies them into socket buffers, the
requester's copies them out, and the requester's engine copies them once more
into the destination. Linux lets a process copy straight out of another's
memory with ``process_vm_readv(2)`` (what MPI's and UCX's "cma" transports
use), where the two are the same user and nothing (Yama's ``ptrace_scope``, a
seccomp filter, a process that is not dumpable) forbids it.

The native engine uses that for READs of at least ``RC_CMA_MIN_READ`` bytes
(64 KiB): the request goes as usual, the responder checks the rkey, the range
and the access right as for any READ, and answers with one ``CMA_READ_GRANT``
packet (:class:`aiordma.providers.soft.wire.Opcode`) that acknowledges the
READ's PSNs and says where the bytes lie in its process; the requester copies
them from there into its scatter list and completes the READ. One copy, two
datagrams, whatever the size. Nothing changes in what the application sees: the
same completion, the same errors (an rkey refused by the responder is the same
remote access error), and the memory the application gives the peer is the
same.

This module is how two ends decide. Each offers, at the rendezvous, this
host's boot id, its process id and the address and value of a random probe
word (:func:`offer`); an end that finds the peer on the same boot, in another
process, reads the probe word out of the peer's process (:func:`can_read`).
Only where that works does it take grants (the QP's ``cma_peer_pid``), and it
tells the peer so, which then answers it with grants (``cma_respond``). The
check runs both ways because permission may not be symmetric (Yama's
``ptrace_scope`` 1 lets a parent read its child, not the child its parent).

Security: a peer that reads this process's memory with ``process_vm_readv``
could read any of it, rkey or not; the kernel allows that only to processes
the same user runs (or a privileged one), which could read it through
``/proc/PID/mem`` anyway. The rkey checks stay the responder's: a grant is
sent only for a READ that passed them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import secrets
from typing import Any

#: the kernel's id of this boot: two processes with the same one share a host
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
#: bytes of the probe word (the rendezvous checks a peer's offer against it)
PROBE_BYTES = 16


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _libc_readv() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):  # not Linux, or a libc without it
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return fn


_process_vm_readv = _libc_readv()
#: the probe word: random, at an address that stays put for the life of the process
_probe = ctypes.create_string_buffer(secrets.token_bytes(PROBE_BYTES), PROBE_BYTES)


@functools.cache
def boot_id() -> str | None:
    """This host's boot id (None where the kernel does not say): read once per
    process (it cannot change while the process runs; a forked child shares it)."""
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def offer() -> tuple[str, int, int, bytes] | None:
    """What this process offers at the rendezvous: ``[boot_id, pid, probe
    address, probe value]``, or None where cross-memory attach cannot work."""
    boot = boot_id()
    if boot is None or _process_vm_readv is None:
        return None
    return boot, os.getpid(), ctypes.addressof(_probe), _probe.raw


def readable_peer(offer: tuple[str, int, int, bytes] | None) -> int:
    """The process id of the peer whose (checked) offer is ``offer`` when this
    process may read its memory: on this boot, another process, and its probe
    word reads back as offered. 0 otherwise."""
    if offer is None:
        return 0
    boot, pid, addr, probe = offer
    if boot != boot_id() or pid == os.getpid():
        return 0
    return pid if can_read(pid, addr, probe) else 0


def can_read(pid: int, addr: int, expected: bytes) -> bool:
    """Whether ``process_vm_readv`` reads ``expected`` at ``addr`` of process ``pid``."""
    if _process_vm_readv is None:
        return False
    buf = ctypes.create_string_buffer(len(expected))
    local = _IOVec(ctypes.cast(buf, ctypes.c_void_p), len(expected))
    remote = _IOVec(addr, len(expected))
    got = _process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return bool(got == len(expected) and buf.raw == expected)
