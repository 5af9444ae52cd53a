"""``rdma://``: aiordma as a comm backend of Dask ``distributed``.

Installed with ``pip install aiordma[dask]``, which registers the entry point
``rdma`` in the ``distributed.comm.backends`` group, so every Dask process
(scheduler, workers, nannies, clients) finds it by the address scheme::

    dask scheduler --protocol rdma
    dask worker rdma://10.0.0.1:8786
    LocalCluster(protocol="rdma")

Task results move between workers over RDMA: on an RDMA NIC or kernel
Soft-RoCE through pyverbs, or on aiordma's soft device (userspace RoCEv2
over UDP) where there is none. Settings are Dask configuration keys under
``distributed.comm.rdma`` (:mod:`.config`); :func:`byte_counters` shows what
went over RDMA.

The pieces: :mod:`.framing` (a Dask message as aiordma messages, sans-IO),
:mod:`.config` (settings and the choice of device), :mod:`.counters` (bytes
per device and peer), :mod:`.buffers` (the receive buffers of large frames,
reused), :mod:`.backend` (Backend, Connector, Listener, Comm).
"""

from __future__ import annotations

from .backend import RDMABackend, RDMAComm, RDMAConnector, RDMAListener
from .config import EncryptionRequiredError, Settings, register_defaults
from .counters import byte_counters, reset_byte_counters

register_defaults()

__all__ = [
    "EncryptionRequiredError",
    "RDMABackend",
    "RDMAComm",
    "RDMAConnector",
    "RDMAListener",
    "Settings",
    "byte_counters",
    "register_defaults",
    "reset_byte_counters",
]
