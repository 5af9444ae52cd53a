"""``aiordma doctor``: check the RDMA set-up and say how to fix what is wrong.

It walks the set-up checklist that RDMA guides give (device and port state,
GID index, MTU, ``ulimit -l``, UDP 4791, no NAT) and adds what aiordma itself
needs (pyverbs, the soft device, a peer's rendezvous). Every check is a
:class:`Check`: a name, a status (``ok``, ``warn``, ``fail``, ``skip``), what
was seen and a one-line fix. ``fail`` is used only for what the device
aiordma will use needs; everything else is ``warn``. Exit status: 0 when no
check failed, 1 otherwise.

All the probing goes through a :class:`Probe`: sysfs and procfs are read
below ``Probe.root`` (``/`` normally; a fake tree in tests), and commands,
pyverbs and the resource limits are methods a test can replace.

    aiordma doctor                       # what aiordma would use here, and why
    aiordma doctor --provider pyverbs --device rxe0
    aiordma doctor --peer 10.0.0.2:18515 --token s3cret --json

The package, in the order a check runs through it:

``probe``      the :class:`Probe` (files, commands, pyverbs, limits)
``sysfs``      facts from sysfs/procfs (:class:`Device`, :class:`Port`, :class:`Gid`)
``plan``       :class:`Options`, the shared :class:`Context`, :func:`make_plan`
``checks``     host checks (Python, pyverbs, kernel, devices, memlock, rxe)
``ports``      per-port state, MTU and GID checks
``loopback``   a real RDMA Write between two QPs (soft and kernel device)
``security``   a warning when the soft device can be reached from the network
``peer``       ``--peer``: rendezvous, 1-byte Read/Write, NAT
``firewall``   nft/iptables/firewalld rules for UDP 4791
``dask``       the ``rdma://`` Dask comm backend (when ``distributed`` is installed)
``diagnosis``  :func:`diagnose`: every check in order
``report``     :class:`Check`, :class:`Report` and the table
``cli``        the ``aiordma doctor`` arguments
"""

from __future__ import annotations

from .checks import (
    check_devices,
    check_kernel,
    check_memlock,
    check_python,
    check_pyverbs,
    check_rdma_cm,
    check_rxe_available,
    default_registration_bytes,
)
from .cli import add_arguments, main, run
from .dask import check_dask
from .diagnosis import diagnose, diagnose_sync
from .firewall import check_firewall
from .loopback import LOOPBACK_TIMEOUT, check_loopback_pyverbs, check_soft, loopback_write
from .peer import _is_loopback, _nat_check, _parse_peer, _resolve, check_peer
from .plan import DEFAULT_PEER_TIMEOUT, Context, Options, make_plan
from .ports import check_ports
from .probe import CAP_IPC_LOCK, Probe
from .report import FAIL, OK, SKIP, STATUSES, WARN, Check, Plan, Report, format_table
from .security import EXPOSURE, check_exposure, exposure_check, is_loopback_only, soft_address
from .sysfs import (
    IB_MTUS,
    RDMA_MODULES,
    ROCE_HEADERS,
    ROCE_V2_UDP_PORT,
    Device,
    Gid,
    Port,
    choose_gid,
    default_route_iface,
    modules_loaded,
    read_devices,
    roce_mtu,
)

__all__ = [
    "CAP_IPC_LOCK",
    "DEFAULT_PEER_TIMEOUT",
    "EXPOSURE",
    "FAIL",
    "IB_MTUS",
    "LOOPBACK_TIMEOUT",
    "OK",
    "RDMA_MODULES",
    "ROCE_HEADERS",
    "ROCE_V2_UDP_PORT",
    "SKIP",
    "STATUSES",
    "WARN",
    "Check",
    "Context",
    "Device",
    "Gid",
    "Options",
    "Plan",
    "Port",
    "Probe",
    "Report",
    "_is_loopback",
    "_nat_check",
    "_parse_peer",
    "_resolve",
    "add_arguments",
    "check_dask",
    "check_devices",
    "check_exposure",
    "check_firewall",
    "check_kernel",
    "check_loopback_pyverbs",
    "check_memlock",
    "check_peer",
    "check_ports",
    "check_python",
    "check_pyverbs",
    "check_rdma_cm",
    "check_rxe_available",
    "check_soft",
    "choose_gid",
    "default_registration_bytes",
    "default_route_iface",
    "diagnose",
    "diagnose_sync",
    "exposure_check",
    "format_table",
    "is_loopback_only",
    "loopback_write",
    "main",
    "make_plan",
    "modules_loaded",
    "read_devices",
    "roce_mtu",
    "run",
    "soft_address",
]
