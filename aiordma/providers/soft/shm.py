"""Shared-memory links: the packets between soft devices of two processes of one
host through memory only the two share, not UDP loopback.

Over UDP loopback every packet costs its sender a ``sendmsg`` and its receiver
a ``recvmmsg``, and a receiver that sleeps is woken by the kernel: two system
calls and a wake-up per message each way, most of a small message's round
trip. The native engine can carry the same packets through a *link*: two
single-producer, single-consumer rings in one anonymous, sealed ``memfd``
(``_native/shm.c``), one per direction, between two soft devices. What a ring
carries is what the wire would (the BTH and its extension headers, then the
payload; no ICRC, nothing crosses a wire), and the receiving engine takes it
through the same RC rules, rkey checks and error paths. Every queue pair
between the two devices shares their one link.

Progress: while its application expects traffic (it posted or completed
something within the last ``AIORDMA_SOFT_SHM_POLL_US``, 100 µs) the event
loop's thread polls the links itself, one look per loop iteration, and a
message that arrives meanwhile costs neither end a system call. Otherwise the
ring's consumer is marked asleep and the producer writes the consumer device's
eventfd once, which wakes the NIC thread or the loop as a datagram would.

How two ends decide, at the rendezvous (this module): each end whose device
has links on (:attr:`SoftDevice.shared_memory_links`) offers its host key (this
boot's id and the process's network namespace: processes in two network
namespaces are two hosts to the network, and their packets keep the wire, as
containers' do), its process id, its device's link id and the number of its eventfd
(:func:`offer`). A server that finds the client under the same host key, in another
process, makes the link (or reuses the one it made for that device), copying
the client's eventfd out of the client's process with ``pidfd_getfd(2)``, and
answers with the link's id and memfd number; the client copies the memfd and
the server's eventfd out of the server's process the same way, checks the
memfd (sealed, the expected size, the link id the server named) and says in
its ``ready`` message that it reads the link. Each QP takes its peer's
packets from the link as soon as its end has it, and sends through it once
both ends do. Anything that fails on the way leaves that connection on UDP,
with the reason in ``conn.path.transport``.

Security: the memfd has no name in any file system; only the two processes
hold it. ``pidfd_getfd`` copies a descriptor out of another process only for
a caller that may ptrace it (the same user, and no Yama ``ptrace_scope`` or
seccomp rule against it: what cross-memory attach needs), which could read
that process's memory through ``/proc/PID/mem`` anyway. A link carries only
packets: the rkey, range and access checks stay the target's, and what a
peer writes into a ring is bounds-checked before it is read (a ring that
breaks a rule stops carrying packets; the connection keeps UDP).
"""

from __future__ import annotations

import os
from typing import Any

from .cma import boot_id

#: the offer's fields: host key, process id, device link id, eventfd number, then
#: (the server's answer only) link id and memfd number, 0 when it made none
OFFER_FIELDS = ("host", "pid", "device", "wakefd", "link", "memfd")
#: PathInfo.transport of a connection whose packets go through a link
LINK_TRANSPORT = "shared-memory link (two processes of this host)"
#: the first kernel with pidfd_getfd(2)
MIN_KERNEL = (5, 6)


def kernel_reason() -> str | None:
    """Why this kernel cannot hand a link over (None when it can)."""
    release = os.uname().release
    try:
        version = tuple(int(part) for part in release.split(".")[:2])
    except ValueError:
        return None  # (a release string we do not understand: try, and fall back on failure)
    if version < MIN_KERNEL:
        return f"Linux {release} has no pidfd_getfd (5.6 or later is needed)"
    return None


def host_key() -> str | None:
    """This boot's id and this process's network namespace (``BOOT/net:INODE``):
    equal for two processes whose packets may skip the network. None where the
    kernel says neither."""
    boot = boot_id()
    try:
        netns = os.stat("/proc/self/ns/net").st_ino  # (read each time: a process may setns)
    except OSError:
        return None
    return None if boot is None else f"{boot}/net:{netns}"


def offer(engine: Any) -> tuple[str, int, int, int, int, int] | None:
    """What a device whose engine is ``engine`` offers at the rendezvous (the
    link and memfd fields 0), or None where links cannot work."""
    host = host_key()
    if host is None or getattr(engine, "shm_device", None) is None:
        return None
    return host, os.getpid(), int(engine.shm_device), int(engine.shm_wakefd), 0, 0


def same_host_peer(mine: tuple[Any, ...] | None, peer: tuple[Any, ...] | None) -> bool:
    """Whether the peer's offer comes from another process under this host key
    (this boot, this network namespace)."""
    return bool(mine and peer and peer[0] == mine[0] and peer[1] != mine[1])
