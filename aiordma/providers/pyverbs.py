"""The verbs device interface (:mod:`aiordma.providers.base`) over pyverbs.

Real RDMA devices (mlx5, irdma, kernel Soft-RoCE ``rxe``, ``siw``) through
rdma-core's Python bindings. pyverbs is found by
:func:`aiordma.providers.pyverbs_loader.load_pyverbs` (a system package, not on
PyPI).

    names = list_devices()                      # [] when the kernel has no RDMA
    dev = open_device()                         # first device with an ACTIVE port
    pd = dev.alloc_pd()
    mr = pd.reg_mr(bytearray(4096), ACCESS_ALL) # zero copy: mr.view is the bytearray
    ch = dev.create_comp_channel()              # ch.fileno() for loop.add_reader
    cq = dev.create_cq(256, ch)                 # one channel per CQ
    qp = pd.create_qp(cq, cq)
    qp.to_init(QPAttr()); qp.to_rtr(QPAttr(dest_qp_num=..., dgid=...)); qp.to_rts(QPAttr())

Things pyverbs does not do that this module does:

* **Completion-channel fd.** ``CompChannel.fd`` exists only from rdma-core 57.
  Before that the fd is *discovered*: the ``anon_inode:[infinibandevent]`` entry
  that appeared in ``/proc/self/fd`` while the channel was created (compared as
  fd -> link maps, because the device's async-event fd has the same name).
  ``CompletionChannel.fd_mode`` says which (``"native"`` / ``"discovered"``).
  The fd is made non-blocking, so :meth:`get_cq_event` returns None when no
  event is pending.
* **One channel per CQ** is enforced. pyverbs' ``get_cq_event(expected_cq)``
  raises when the event belongs to another CQ, after the event was consumed and
  without counting it; acking it on the wrong CQ then hangs ``ibv_destroy_cq``.
* **State checks before posting.** rxe accepts a post in the wrong state and
  fails later or never; here ``post_send`` before RTS (or ``post_recv`` in
  RESET) raises :class:`~aiordma.errors.QueuePairStateError`.
* **Lifetime.** pyverbs closes children when a parent is closed (context ->
  QPs, CQs, PDs -> MRs), after which touching the child crashes the process
  (NULL dereference). The wrappers here track the same relations, close
  children first and refuse to use a closed object.
* **The extended verbs for posting.** Where the device has them (mlx5, kernel
  rxe), the QP is created with ``ibv_create_qp_ex`` and a send work request of
  one SGE is posted with ``ibv_wr_start``/``ibv_wr_rdma_write`` (and the other
  ``ibv_wr_*``)/``ibv_wr_set_sge``/``ibv_wr_complete`` through pyverbs' QPEx:
  no SendWR or SGE object per operation (each one costs a ``logging.getLogger``
  in pyverbs' constructor). Chains go the same way, one ``ibv_wr_complete``
  (one doorbell) for all; a transfer's chunks of RDMA Reads or Writes come as
  a flat table (``PyverbsQP.post_rdma_table``), with no SendWR even built. Everything else (several SGEs, inline data, a device
  without the extended verbs, ``AIORDMA_PYVERBS_EXTENDED=0``) takes
  ``ibv_post_send``. ``PyverbsQP.extended`` says which the QP has.
* **Receives built once.** A receive work request posted again (each of a
  connection's receive buffers is) keeps its pyverbs ``RecvWR``: reposting it
  creates no object; a changed request is rebuilt.
* **Shared receive queues and the device's async events.** ``pyverbs.srq.SRQ``
  (``SrqInitAttr``/``SrqAttr``, ``SRQ.post_recv``, ``SRQ.modify`` with
  ``IBV_SRQ_LIMIT``, ``SRQ.query``), queue pairs created with
  ``QPInitAttr(srq=...)``. The limit event comes through
  ``Context.get_async_event``, which pyverbs 44 offers without the fd it reads
  (``ibv_context.async_fd``) and without the element an event names. The fd is
  *discovered* like a completion channel's: the ``[infinibandevent]`` fd that
  appeared while the context was opened (``PyverbsDevice.async_fd_mode``),
  made non-blocking, watched on the event loop, and read only when ``poll``
  says it is readable (pyverbs raises the same error for EAGAIN as for any
  other failure, and would block with the GIL held on a blocking fd). Each
  event is acknowledged at once (``ibv_destroy_srq``/``ibv_destroy_qp`` wait
  for the acks of the events read). Which SRQ an ``IBV_EVENT_SRQ_LIMIT_REACHED``
  is for: the armed SRQs whose ``ibv_query_srq`` limit reads 0 (the event
  disarms the SRQ); if none does, every armed SRQ is told. ``pyverbs.srq.SRQ.close``
  destroys the QPs created with it first, so ``close`` here refuses (EBUSY, as
  ``ibv_destroy_srq``) while they live.
* **Leaks / side effects of pyverbs 44.** ``SGE`` and ``SendWR``/``RecvWR``
  never free their C arrays (``__dealloc`` typo, fixed upstream); they are
  closed explicitly after each post.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import logging
import os
import resource
import select
import socket
import struct
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from .. import settings
from ..errors import (
    DeviceNotFoundError,
    InvalidWorkRequestError,
    MemoryRegistrationError,
    ProviderUnavailableError,
    QueuePairStateError,
    RDMAError,
    ResourceBusyError,
)
from . import base
from .async_events import AsyncEventDispatcher
from .base import (
    ACCESS_ALL,
    MTU,
    WRITE_ACCESS,
    Access,
    DeviceAttr,
    GIDEntry,
    PortAttr,
    PortState,
    QPAttr,
    QPCap,
    QPState,
    RecvWR,
    SendFlags,
    SendWR,
    SharedReceiveQueue,
    SRQAttr,
    WCFlags,
    WCOpcode,
    WCStatus,
    WorkCompletion,
    WROpcode,
    buffer_address,
    check_srq_limit,
    gid_str,
    parse_gid,
    srq_qp_post_recv_error,
)
from .pyverbs_loader import load_pyverbs, pyverbs_info

log = logging.getLogger("aiordma")

__all__ = [
    "DEFAULT_MIN_RNR_TIMER",
    "DEFAULT_RETRY_CNT",
    "DEFAULT_RNR_RETRY",
    "DEFAULT_TIMEOUT",
    "MAX_RD_ATOMIC_CAP",
    "PyverbsCQ",
    "PyverbsCompletionChannel",
    "PyverbsDevice",
    "PyverbsMR",
    "PyverbsPD",
    "PyverbsQP",
    "PyverbsSRQ",
    "list_devices",
    "open_device",
    "pyverbs_info",
]

PROVIDER = "pyverbs"

# QP defaults (the values rdma-core's own tests use)
DEFAULT_MIN_RNR_TIMER = 12  # 0.64 ms
DEFAULT_TIMEOUT = 14  # 4.096 us * 2^14 = 67 ms
DEFAULT_RETRY_CNT = 7
DEFAULT_RNR_RETRY = 7  # infinite
MAX_RD_ATOMIC_CAP = 16  # cap for max_rd_atomic / max_dest_rd_atomic from device caps

_IB_EVENT_FD = "anon_inode:[infinibandevent]"
_SYSFS_IB = "/sys/class/infiniband"

# one lock for everything that opens event fds (contexts, channels), so that the
# before/after fd comparison never sees a sibling's new fd
_fd_lock = threading.Lock()


def _pv() -> Any:
    return load_pyverbs()


def _errno_text(code: int | None) -> str:
    if code is None or code < 0:
        return "unknown error"
    name = _errno.errorcode.get(code, f"errno {code}")
    return f"{name} ({os.strerror(code)})"


def _err_code(exc: BaseException) -> int | None:
    code = getattr(exc, "error_code", None)
    return code if isinstance(code, int) and code >= 0 else None


def _enum(cls: Any, value: int) -> Any:
    try:
        return cls(value)
    except ValueError:
        return value


# ----------------------------------------------------------------- devices ----


def list_devices() -> list[str]:
    """Names of the RDMA devices the kernel exposes (``ibv_get_device_list``).

    Returns [] when the kernel has no RDMA support at all (where
    ``ibv_get_device_list`` fails and pyverbs raises) as well as when it has
    RDMA but no device. Raises :class:`~aiordma.errors.ProviderUnavailableError`
    when pyverbs itself is unavailable.
    """
    pv = _pv()
    try:
        devs = pv.device.get_device_list()
    except pv.pyverbs_error.PyverbsError:
        return []
    out = []
    for d in devs:
        n = d.name
        out.append(n.decode() if isinstance(n, bytes) else str(n))
    return out


def open_device(name: str | None = None, port_num: int = 1, gid_index: int | None = None) -> PyverbsDevice:
    """Open ``name`` (``ibv_open_device``), or, when ``name`` is None, the first
    device whose port ``port_num`` is ``IBV_PORT_ACTIVE``.

    ``gid_index`` selects the source GID for QPs; None picks the port's first
    RoCE v2 GID carrying an IPv4 address (see
    :meth:`~aiordma.providers.base.DeviceContext.default_gid_index`).
    """
    pv = _pv()
    names = list_devices()
    if not names:
        raise DeviceNotFoundError(
            "no RDMA device: the kernel exposes none (no RDMA NIC, and no Soft-RoCE: "
            "`modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <netdev>`)"
        )
    if name is not None:
        if name not in names:
            raise DeviceNotFoundError(f"no RDMA device named {name!r}; devices: {', '.join(names)}")
        return PyverbsDevice(name, port_num, gid_index)
    states = []
    for n in names:
        try:
            dev = PyverbsDevice(n, port_num, gid_index, _require_gid=False)
        except (RDMAError, pv.pyverbs_error.PyverbsError) as e:
            states.append(f"{n}: {e}")
            continue
        try:
            st = dev.query_port(port_num).state
        except RDMAError as e:
            dev.close()
            states.append(f"{n}: {e}")
            continue
        if st == PortState.IBV_PORT_ACTIVE:
            try:
                dev._resolve_gid_index()
            except RDMAError as e:
                dev.close()
                states.append(f"{n}: {e}")
                continue
            return dev
        st = _enum(PortState, st)
        states.append(f"{n} port {port_num}: {st.name if isinstance(st, PortState) else st}")
        dev.close()
    raise DeviceNotFoundError(f"no RDMA device with an active port {port_num}: {'; '.join(states)}")


def _sysfs_read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _fmt_guid(raw_be64: int) -> str:
    """A node GUID as ibv_devinfo prints it (``28b5:86ff:fe23:0243``).
    ``ibv_device_attr.node_guid`` is big-endian in memory."""
    h = struct.pack("<Q", raw_be64 & 0xFFFFFFFFFFFFFFFF).hex()
    return ":".join(h[i : i + 4] for i in range(0, 16, 4))


_GID_TYPES = {0: "IB", 1: "RoCE v1", 2: "RoCE v2"}  # enum ibv_gid_type (query_gid_ex)


class PyverbsDevice(base.DeviceContext):
    """An opened device (``ibv_context``) with a default port and GID index."""

    provider = PROVIDER

    def __init__(self, name: str, port_num: int = 1, gid_index: int | None = None, *, _require_gid: bool = True):
        pv = _pv()
        self._pv = pv
        self.name = name
        self.port_num = int(port_num)
        self._explicit_gid_index = gid_index
        self.gid_index: int | None = gid_index
        self._closed = False
        self._pds: weakref.WeakSet[PyverbsPD] = weakref.WeakSet()
        self._cqs: weakref.WeakSet[PyverbsCQ] = weakref.WeakSet()
        self._channels: weakref.WeakSet[PyverbsCompletionChannel] = weakref.WeakSet()
        self._srqs: weakref.WeakSet[PyverbsSRQ] = weakref.WeakSet()
        # registered memory (aiordma's count: registered_memory)
        self._mr_lock = threading.Lock()
        self._mr_bytes = 0
        self._mr_count = 0
        self._dispatcher: AsyncEventDispatcher | None = None
        try:
            with _fd_lock:
                before = _fd_links()
                self._ctx = pv.device.Context(name=name)
                after = _fd_links()
        except pv.pyverbs_error.PyverbsError as e:
            raise DeviceNotFoundError(f"cannot open RDMA device {name!r}: {e}") from e
        #: the context's async-event fd (``ibv_context.async_fd``) and how it was found:
        #: "native" (pyverbs exposes it), "discovered" (the ``[infinibandevent]`` fd the
        #: open created), or None with :attr:`async_fd_problem` saying why not
        self.async_fd: int | None = None
        self.async_fd_mode: str | None = None
        self.async_fd_problem: str | None = None
        native_fd = getattr(self._ctx, "async_fd", None)
        if isinstance(native_fd, int) and native_fd >= 0:
            self.async_fd, self.async_fd_mode = native_fd, "native"
        else:
            new = [fd for fd, link in after.items() if link == _IB_EVENT_FD and before.get(fd) != link]
            if len(new) == 1:
                self.async_fd, self.async_fd_mode = new[0], "discovered"
            else:
                self.async_fd_problem = (
                    f"pyverbs {pyverbs_info().get('version')} exposes no ibv_context.async_fd and opening "
                    f"{name} created {len(new)} [infinibandevent] fds ({new}), not one"
                )
        try:
            self._attr = self._ctx.query_device()
        except pv.pyverbs_error.PyverbsError as e:
            self._ctx.close()
            raise DeviceNotFoundError(f"cannot query RDMA device {name!r}: {e}") from e
        if not 1 <= self.port_num <= self._attr.phys_port_cnt:
            self._ctx.close()
            raise DeviceNotFoundError(f"{name} has no port {port_num} (ports 1..{self._attr.phys_port_cnt})")
        if _require_gid:
            try:
                self._resolve_gid_index()
            except BaseException:
                self.close()
                raise

    def _resolve_gid_index(self) -> int:
        if self.gid_index is None:
            self.gid_index = super().default_gid_index(self.port_num)
        else:
            self.query_gid(self.port_num, self.gid_index)  # raises if the slot is empty
        return self.gid_index

    def _check(self) -> None:
        if self._closed:
            raise RDMAError(f"RDMA device {self.name} is closed")

    # -- queries ---------------------------------------------------------
    def query_device(self) -> DeviceAttr:
        self._check()
        a = self._ctx.query_device()
        atomic = {0: "IBV_ATOMIC_NONE", 1: "IBV_ATOMIC_HCA", 2: "IBV_ATOMIC_GLOB"}.get(
            a.atomic_caps, str(a.atomic_caps)
        )
        return DeviceAttr(
            name=self.name,
            provider=PROVIDER,
            fw_ver=a.fw_version,
            node_guid=_fmt_guid(a.node_guid),
            vendor_id=a.vendor_id,
            vendor_part_id=a.vendor_part_id,
            max_qp=a.max_qp,
            max_qp_wr=a.max_qp_wr,
            max_sge=a.max_sge,
            max_cq=a.max_cq,
            max_cqe=a.max_cqe,
            max_mr=a.max_mr,
            max_mr_size=a.max_mr_size,
            max_qp_rd_atom=a.max_qp_rd_atom,
            max_qp_init_rd_atom=a.max_qp_init_rd_atom,
            max_srq=a.max_srq,
            max_srq_wr=a.max_srq_wr,
            max_srq_sge=a.max_srq_sge,
            atomic_cap=atomic,
            phys_port_cnt=a.phys_port_cnt,
            extra={
                "hw_ver": a.hw_ver,
                "max_pd": a.max_pd,
                "max_sge_rd": a.max_sge_rd,
                "device_cap_flags": a.device_cap_flags,
                "netdev": _sysfs_read(f"{_SYSFS_IB}/{self.name}/parent"),
                "pyverbs": pyverbs_info().get("version"),
            },
        )

    def query_port(self, port_num: int | None = None) -> PortAttr:
        self._check()
        port_num = self.port_num if port_num is None else int(port_num)
        pv = self._pv
        try:
            p = self._ctx.query_port(port_num)
        except pv.pyverbs_error.PyverbsError as e:
            raise DeviceNotFoundError(f"cannot query {self.name} port {port_num}: {e}") from e
        ll = {pv.enums.IBV_LINK_LAYER_ETHERNET: "Ethernet", pv.enums.IBV_LINK_LAYER_INFINIBAND: "InfiniBand"}.get(
            p.link_layer, "InfiniBand"
        )
        return PortAttr(
            state=_enum(PortState, p.state),
            max_mtu=_enum(MTU, p.max_mtu),
            active_mtu=_enum(MTU, p.active_mtu),
            link_layer=ll,
            gid_tbl_len=p.gid_tbl_len,
            port_num=port_num,
        )

    def _gid_type_sysfs(self, port_num: int, index: int, link_layer: str) -> str:
        t = _sysfs_read(f"{_SYSFS_IB}/{self.name}/ports/{port_num}/gid_attrs/types/{index}")
        if t is None:
            return "IB" if link_layer == "InfiniBand" else "RoCE v1"
        if "v2" in t:
            return "RoCE v2"
        return "IB" if link_layer == "InfiniBand" else "RoCE v1"

    def _netdev(self, port_num: int, index: int, ifindex: int | None) -> str | None:
        if ifindex:
            try:
                return socket.if_indextoname(ifindex)
            except OSError:
                pass
        return _sysfs_read(f"{_SYSFS_IB}/{self.name}/ports/{port_num}/gid_attrs/ndevs/{index}") or None

    def query_gid_table(self, port_num: int | None = None) -> list[GIDEntry]:
        """Populated GID entries of the port (all-zero GIDs left out), by index.

        Uses ``ibv_query_gid_table`` (type and netdev included); falls back to
        ``ibv_query_gid_ex`` per index, then to ``ibv_query_gid`` plus sysfs
        (``/sys/class/infiniband/<dev>/ports/N/gid_attrs/{types,ndevs}/I``).
        """
        self._check()
        port_num = self.port_num if port_num is None else int(port_num)
        pv = self._pv
        port = self.query_port(port_num)
        out: dict[int, GIDEntry] = {}
        try:
            total = sum(self._ctx.query_port(p).gid_tbl_len for p in range(1, self._attr.phys_port_cnt + 1))
            for ent in self._ctx.query_gid_table(max(total, 1)):
                if ent.port_num != port_num:
                    continue
                raw = parse_gid(ent.gid_str())
                if raw == bytes(16):
                    continue
                out[ent.gid_index] = GIDEntry(
                    index=ent.gid_index,
                    gid=raw,
                    gid_type=_GID_TYPES.get(ent.gid_type, str(ent.gid_type)),
                    netdev=self._netdev(port_num, ent.gid_index, ent.ndev_ifindex),
                )
            return [out[i] for i in sorted(out)]
        except (pv.pyverbs_error.PyverbsError, AttributeError):
            out.clear()
        for i in range(port.gid_tbl_len):
            try:
                ent = self._ctx.query_gid_ex(port_num, i)
                raw = parse_gid(ent.gid_str())
                gtype = _GID_TYPES.get(ent.gid_type, str(ent.gid_type))
                ifindex = ent.ndev_ifindex
            except (pv.pyverbs_error.PyverbsError, AttributeError):
                try:
                    raw = parse_gid(str(self._ctx.query_gid(port_num, i)))
                except pv.pyverbs_error.PyverbsError:
                    continue
                gtype = self._gid_type_sysfs(port_num, i, port.link_layer)
                ifindex = None
            if raw == bytes(16):
                continue
            out[i] = GIDEntry(index=i, gid=raw, gid_type=gtype, netdev=self._netdev(port_num, i, ifindex))
        return [out[i] for i in sorted(out)]

    def default_gid_index(self, port_num: int = 1) -> int:
        if self._explicit_gid_index is not None and port_num == self.port_num:
            return self._explicit_gid_index
        return super().default_gid_index(port_num)

    def registered_memory(self) -> dict[str, int]:
        with self._mr_lock:
            return {"bytes": self._mr_bytes, "regions": self._mr_count}

    def _count_mr(self, nbytes: int, sign: int) -> None:
        with self._mr_lock:
            self._mr_bytes += sign * nbytes
            self._mr_count += sign

    def _async_events(self) -> AsyncEventDispatcher:
        """The dispatcher of this context's async events (made on first use)."""
        self._check()
        if self._dispatcher is None:
            if self.async_fd is None:
                raise ProviderUnavailableError(
                    f"the async events of {self.name} cannot be read: {self.async_fd_problem} "
                    "(SRQ limit events need them)"
                )
            self._dispatcher = AsyncEventDispatcher(_PyverbsAsyncSource(self, self.async_fd), self.name)
        return self._dispatcher

    @property
    def async_event_counts(self) -> dict[str, int]:
        """The async events read so far, by type."""
        return dict(self._dispatcher.counts) if self._dispatcher is not None else {}

    def _srqs_fired(self) -> list[PyverbsSRQ]:
        """The SRQs an ``IBV_EVENT_SRQ_LIMIT_REACHED`` is for: pyverbs' AsyncEvent does
        not name its SRQ, but the event disarms it (``ibv_query_srq`` reads 0)."""
        armed = [s for s in list(self._srqs) if s._armed and not s._closed]
        fired = []
        for srq in armed:
            try:
                limit = srq._srq.query().srq_limit
            except self._pv.pyverbs_error.PyverbsError:
                continue
            if limit == 0:
                fired.append(srq)
        if not fired:  # none reads disarmed (a device that keeps the limit): tell them all
            fired = armed
        for srq in fired:
            srq._armed = False
        return fired

    # -- objects ---------------------------------------------------------
    def alloc_pd(self) -> PyverbsPD:
        self._check()
        pd = PyverbsPD(self)
        self._pds.add(pd)
        return pd

    def create_comp_channel(self) -> PyverbsCompletionChannel:
        self._check()
        ch = PyverbsCompletionChannel(self)
        self._channels.add(ch)
        return ch

    def create_cq(self, cqe: int, channel: base.CompletionChannel | None = None) -> PyverbsCQ:
        self._check()
        cq = PyverbsCQ(self, cqe, channel)
        self._cqs.add(cq)
        return cq

    def close(self) -> None:
        """Destroy everything created from this device, children first
        (QPs, MRs and PDs, CQs, channels), then ``ibv_close_device``."""
        if self._closed:
            return
        if self._dispatcher is not None:  # (its fd leaves the loops first)
            self._dispatcher.close()
        for pd in list(self._pds):
            pd.close()
        for cq in list(self._cqs):
            cq.close()
        for ch in list(self._channels):
            ch.close()
        self._closed = True
        self._ctx.close()

    def __repr__(self) -> str:
        return f"<PyverbsDevice {self.name} port={self.port_num} gid_index={self.gid_index}{' closed' if self._closed else ''}>"


# ------------------------------------------------------ protection domain ----


class PyverbsPD(base.ProtectionDomain):
    def __init__(self, device: PyverbsDevice):
        pv = device._pv
        self._pv = pv
        self.device = device
        self._closed = False
        self._mrs: weakref.WeakSet[PyverbsMR] = weakref.WeakSet()
        self._qps: weakref.WeakSet[PyverbsQP] = weakref.WeakSet()
        self._srqs: weakref.WeakSet[PyverbsSRQ] = weakref.WeakSet()
        try:
            self._pd = pv.pd.PD(device._ctx)
        except pv.pyverbs_error.PyverbsError as e:
            raise RDMAError(f"ibv_alloc_pd on {device.name} failed: {e}") from e

    def _check(self) -> None:
        if self._closed:
            raise RDMAError("protection domain is closed")
        self.device._check()

    def reg_mr(self, buffer: Any, access: Access = Access.LOCAL_WRITE) -> PyverbsMR:
        """Register ``buffer`` in place (zero copy) or, for an ``int``, a new
        zero-filled bytearray of that many bytes. ``mr.view`` is the memory."""
        self._check()
        if isinstance(buffer, bool) or not isinstance(buffer, int):
            owner = buffer
        else:
            if buffer <= 0:
                raise MemoryRegistrationError(f"cannot register {buffer} bytes: the length must be positive")
            owner = bytearray(buffer)
        addr, view = buffer_address(owner, writable=bool(Access(int(access)) & WRITE_ACCESS))
        mr = PyverbsMR(self, owner, addr, view, Access(int(access)))
        self._mrs.add(mr)
        return mr

    def create_qp(
        self,
        send_cq: base.CompletionQueue,
        recv_cq: base.CompletionQueue,
        cap: QPCap | None = None,
        sq_sig_all: bool = False,
        srq: SharedReceiveQueue | None = None,
    ) -> PyverbsQP:
        self._check()
        if not isinstance(send_cq, PyverbsCQ) or send_cq.device is not self.device:
            raise RDMAError(f"{send_cq!r} is not a CQ of {self.device.name}")
        if not isinstance(recv_cq, PyverbsCQ) or recv_cq.device is not self.device:
            raise RDMAError(f"{recv_cq!r} is not a CQ of {self.device.name}")
        if srq is not None:
            if not isinstance(srq, PyverbsSRQ) or srq.pd is not self:
                raise RDMAError(f"{srq!r} is not an SRQ of this protection domain (ibv_qp_init_attr.srq)")
            srq._check()
        qp = PyverbsQP(self, send_cq, recv_cq, cap or QPCap(), sq_sig_all, srq)
        self._qps.add(qp)
        send_cq._qps.add(qp)
        recv_cq._qps.add(qp)
        if srq is not None:
            srq._qps.add(qp)
        return qp

    def create_srq(self, max_wr: int, max_sge: int = 1, srq_limit: int = 0) -> PyverbsSRQ:
        self._check()
        srq = PyverbsSRQ(self, max_wr, max_sge, srq_limit)
        self._srqs.add(srq)
        self.device._srqs.add(srq)
        return srq

    def close(self) -> None:
        if self._closed:
            return
        for qp in list(self._qps):
            qp.close()
        for srq in list(self._srqs):
            srq.close()
        for mr in list(self._mrs):
            mr.close()
        self._closed = True
        try:
            self._pd.close()
        except self._pv.pyverbs_error.PyverbsError as e:
            raise RDMAError(f"ibv_dealloc_pd failed: {e}") from e


# ----------------------------------------------------------- memory region ----


def _memlock_text() -> str:
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (OSError, ValueError):
        return "unknown"
    if soft == resource.RLIM_INFINITY:
        return "unlimited"
    return f"{soft // 1024} KiB"


class PyverbsMR(base.MemoryRegion):
    """A registered memory region over a Python buffer (kept alive here)."""

    def __init__(self, pd: PyverbsPD, owner: Any, addr: int, view: memoryview, access: Access):
        pv = pd._pv
        self._pv = pv
        self.pd = pd
        self._owner = owner  # keeps the memory alive (and a bytearray un-resizable)
        self._view = view
        self.addr = addr
        self.length = view.nbytes
        self.access = access
        self._closed = False
        try:
            self._mr = pv.mr.MR(pd._pd, self.length, int(access), address=addr)
        except pv.pyverbs_error.PyverbsError as e:
            code = _err_code(e)
            msg = f"ibv_reg_mr of {self.length} bytes at 0x{addr:x} (access {access!s}) failed: {_errno_text(code)}"
            if code in (_errno.ENOMEM, _errno.EPERM, _errno.EAGAIN, None):
                msg += (
                    f"; the locked-memory limit is probably too low (ulimit -l: {_memlock_text()}): "
                    "raise it with `ulimit -l unlimited`, memlock in /etc/security/limits.conf, "
                    "LimitMEMLOCK= for a systemd service or --ulimit memlock=-1 for a container"
                )
            elif code == _errno.EINVAL:
                msg += "; the access flags may be unsupported (REMOTE_WRITE/REMOTE_ATOMIC need LOCAL_WRITE)"
            raise MemoryRegistrationError(msg) from e
        self.lkey = self._mr.lkey
        self.rkey = self._mr.rkey
        self._device = pd.device
        pd.device._count_mr(self.length, 1)

    @property
    def view(self) -> memoryview:
        return self._view

    def __del__(self) -> None:
        # deregister before the buffer can be freed (attribute teardown order
        # would otherwise release the memory while the device may still DMA)
        try:
            if not self._closed:
                self._closed = True
                self._device._count_mr(self.length, -1)
                self._mr.close()
        except Exception:
            pass

    @property
    def buffer(self) -> Any:
        """The object whose memory is registered."""
        return self._owner

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._device._count_mr(self.length, -1)
        try:
            self._mr.close()
        except self._pv.pyverbs_error.PyverbsError as e:
            raise MemoryRegistrationError(f"ibv_dereg_mr failed: {e}") from e


# ------------------------------------------------------ completion channel ----


def _fd_links() -> dict[int, str]:
    """{fd: readlink target} of this process. The directory fd that listdir
    used is already closed when readlink runs, so it drops out."""
    out: dict[int, str] = {}
    for f in os.listdir("/proc/self/fd"):
        try:
            out[int(f)] = os.readlink(f"/proc/self/fd/{f}")
        except (OSError, ValueError):
            pass
    return out


class PyverbsCompletionChannel(base.CompletionChannel):
    """``ibv_comp_channel`` with a non-blocking fd (native or discovered)."""

    def __init__(self, device: PyverbsDevice):
        pv = device._pv
        self._pv = pv
        self.device = device
        self._closed = False
        self._cq: PyverbsCQ | None = None
        CompChannel = pv.cq.CompChannel
        try:
            if hasattr(CompChannel, "fd"):
                self._ch = CompChannel(device._ctx)
                fd = int(self._ch.fd)
                self.fd_mode = "native"
            else:
                self._ch, fd = self._create_discovering(CompChannel, device)
                self.fd_mode = "discovered"
        except pv.pyverbs_error.PyverbsError as e:
            raise RDMAError(f"ibv_create_comp_channel on {device.name} failed: {e}") from e
        self._fd = fd
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)

    @staticmethod
    def _create_discovering(CompChannel: Any, device: PyverbsDevice) -> tuple[Any, int]:
        for _attempt in range(3):
            with _fd_lock:
                before = _fd_links()
                ch = CompChannel(device._ctx)
                after = _fd_links()
            new = [fd for fd, link in after.items() if link == _IB_EVENT_FD and before.get(fd) != link]
            if len(new) == 1:
                return ch, new[0]
            ch.close()
        raise ProviderUnavailableError(
            f"cannot identify the completion channel's fd (pyverbs {pyverbs_info().get('version')} has no "
            f"CompChannel.fd; candidates in /proc/self/fd: {new}); use the polling fallback"
        )

    def fileno(self) -> int:
        if self._closed:
            raise RDMAError("completion channel is closed")
        return self._fd

    def get_cq_event(self) -> PyverbsCQ | None:
        """The CQ that fired, or None if no event is pending (EAGAIN). The
        event must be acknowledged with ``cq.ack_events``."""
        if self._closed:
            raise RDMAError("completion channel is closed")
        cq = self._cq
        if cq is None:
            return None
        try:
            self._ch.get_cq_event(cq._cq)
        except self._pv.pyverbs_error.PyverbsError as e:
            code = _err_code(e)
            if code in (_errno.EAGAIN, _errno.EWOULDBLOCK):
                return None
            raise RDMAError(f"ibv_get_cq_event failed: {e}") from e
        cq._unacked += 1
        return cq

    def close(self) -> None:
        if self._closed:
            return
        if self._cq is not None:
            self._cq.close()
        self._closed = True
        try:
            self._ch.close()
        except self._pv.pyverbs_error.PyverbsError as e:
            raise RDMAError(f"ibv_destroy_comp_channel failed: {e}") from e


# -------------------------------------------------------- completion queue ----


#: the enum members by value (a dict lookup per completion, not an Enum call)
_WC_STATUS: dict[int, WCStatus] = {int(m): m for m in WCStatus}
_WC_OPCODE: dict[int, WCOpcode] = {int(m): m for m in WCOpcode}
_WC_FLAGS: dict[int, WCFlags] = {}
_WITH_IMM = int(WCFlags.IBV_WC_WITH_IMM)
_RECV = int(WCOpcode.IBV_WC_RECV)


def _wc_flags(flags: int) -> WCFlags:
    f = _WC_FLAGS.get(flags)
    if f is None:
        f = _WC_FLAGS[flags] = WCFlags(flags)
    return f


def _convert_wc(wc: Any) -> WorkCompletion:
    flags = wc.wc_flags
    opcode = wc.opcode
    # imm_data is meaningful on receive completions only; rxe also sets
    # IBV_WC_WITH_IMM (with imm_data 0) on the requester's RDMA_WRITE completion
    if flags & _WITH_IMM and opcode & _RECV:
        imm = socket.ntohl(wc.imm_data & 0xFFFFFFFF)
    else:
        imm = None
    # (members such as IBV_WC_SUCCESS are 0, falsy: look up, do not `or`)
    status = wc.status
    try:
        st = _WC_STATUS[status]
    except KeyError:
        st = _enum(WCStatus, status)
    try:
        op = _WC_OPCODE[opcode]
    except KeyError:
        op = _enum(WCOpcode, opcode)
    try:
        wc_flags = _WC_FLAGS[flags]
    except KeyError:
        wc_flags = _wc_flags(flags)
    return WorkCompletion(wc.wr_id, st, op, wc.byte_len, wc.qp_num, wc.src_qp, imm, wc_flags, wc.vendor_err)


class PyverbsCQ(base.CompletionQueue):
    def __init__(self, device: PyverbsDevice, cqe: int, channel: base.CompletionChannel | None):
        pv = device._pv
        self._pv = pv
        self.device = device
        self._closed = False
        self._unacked = 0
        self._qps: weakref.WeakSet[PyverbsQP] = weakref.WeakSet()
        if channel is not None:
            if not isinstance(channel, PyverbsCompletionChannel) or channel.device is not device:
                raise RDMAError(f"{channel!r} is not a completion channel of {device.name}")
            if channel._closed:
                raise RDMAError("completion channel is closed")
            if channel._cq is not None:
                raise RDMAError(
                    "one completion channel per CQ: this channel already serves a CQ "
                    "(pyverbs' get_cq_event cannot tell the CQs of a shared channel apart safely)"
                )
        try:
            self._cq = pv.cq.CQ(device._ctx, int(cqe), None, channel._ch if channel is not None else None, 0)
        except pv.pyverbs_error.PyverbsError as e:
            raise RDMAError(f"ibv_create_cq(cqe={cqe}) on {device.name} failed: {e}") from e
        self.channel = channel
        if channel is not None:
            channel._cq = self
        self.cqe = self._cq.cqe

    def _check(self) -> None:
        if self._closed:
            raise RDMAError("completion queue is closed")

    def poll(self, num_entries: int = 16) -> list[WorkCompletion]:
        self._check()
        try:
            _n, wcs = self._cq.poll(num_entries)
        except self._pv.pyverbs_error.PyverbsError as e:
            raise RDMAError(f"ibv_poll_cq failed: {e}") from e
        return [_convert_wc(wc) for wc in wcs]

    def req_notify(self, solicited_only: bool = False) -> None:
        self._check()
        try:
            self._cq.req_notify(1 if solicited_only else 0)
        except self._pv.pyverbs_error.PyverbsError as e:
            raise RDMAError(f"ibv_req_notify_cq failed: {e}") from e

    def ack_events(self, n: int) -> None:
        """``ibv_ack_cq_events`` for ``n`` events returned by ``get_cq_event``
        (acking more than were returned would hang ``ibv_destroy_cq``)."""
        self._check()
        n = int(n)
        if n < 0 or n > self._unacked:
            raise ValueError(f"cannot ack {n} CQ events: {self._unacked} returned by get_cq_event are unacknowledged")
        if n:
            self._cq.ack_events(n)
            self._unacked -= n

    @property
    def unacked_events(self) -> int:
        return self._unacked

    def close(self) -> None:
        """Destroy the CQ (after its QPs); unacknowledged events are acked first."""
        if self._closed:
            return
        for qp in list(self._qps):
            qp.close()
        self._closed = True
        try:
            self._cq.close()  # pyverbs acks its counted events
        except self._pv.pyverbs_error.PyverbsError as e:
            raise RDMAError(f"ibv_destroy_cq failed: {e}") from e
        finally:
            self._unacked = 0
            channel = self.channel
            if isinstance(channel, PyverbsCompletionChannel) and channel._cq is self:
                channel._cq = None


# ---------------------------------------------------- shared receive queue ----


def _pv_sges(pv: Any, sg_list: Sequence[base.SGE]) -> tuple[list[Any], int]:
    """pyverbs SGEs for ``sg_list`` (at least one: pyverbs insists) and how many are real."""
    SGE = pv.wr.SGE
    sges = [SGE(int(s.addr), int(s.length), int(s.lkey)) for s in sg_list]
    n = len(sges)
    if not sges:  # pyverbs insists on one SGE; num_sge is set to 0 afterwards
        sges = [SGE(0, 0, 0)]
    return sges, n


def _pv_recv_wr(pv: Any, w: RecvWR) -> Any:
    """A pyverbs RecvWR for ``w`` (its SGE array freed by the caller's ``close``)."""
    sges, n = _pv_sges(pv, w.sg_list)
    try:
        wr = pv.wr.RecvWR(wr_id=int(w.wr_id), num_sge=len(sges), sg=sges)
    finally:
        for s in sges:
            s.close()
    if n != len(sges):
        wr.num_sge = n
    return wr


class PyverbsSRQ(base.SharedReceiveQueue):
    """A shared receive queue (``ibv_srq``) through ``pyverbs.srq.SRQ``; see
    :class:`~aiordma.providers.base.SharedReceiveQueue` and the module docstring."""

    def __init__(self, pd: PyverbsPD, max_wr: int, max_sge: int, srq_limit: int) -> None:
        pv = pd._pv
        self._pv = pv
        self.pd = pd
        self.device = pd.device
        self._closed = False
        self._armed = False
        self._qps: weakref.WeakSet[PyverbsQP] = weakref.WeakSet()
        for name, value in (("max_wr", max_wr), ("max_sge", max_sge)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ibv_create_srq: {name} must be a positive int, not {value!r}")
        check_srq_limit(srq_limit, max_wr)
        init = pv.srq.SrqInitAttr(pv.srq.SrqAttr(max_wr=max_wr, max_sge=max_sge))
        try:
            self._srq = pv.srq.SRQ(pd._pd, init)
        except pv.pyverbs_error.PyverbsError as e:
            a = self.device._attr
            raise RDMAError(
                f"ibv_create_srq(max_wr={max_wr}, max_sge={max_sge}) on {self.device.name} failed: {e} "
                f"(the device allows max_srq_wr {a.max_srq_wr}, max_srq_sge {a.max_srq_sge})"
            ) from e
        # ibv_create_srq writes the granted sizes back into the init attributes
        self.max_wr = int(init.max_wr) or max_wr
        self.max_sge = int(init.max_sge) or max_sge
        if srq_limit:
            self.arm_limit(srq_limit)

    def _check(self) -> None:
        if self._closed:
            raise InvalidWorkRequestError("the shared receive queue is destroyed")
        self.pd._check()

    @property
    def users(self) -> int:
        """The queue pairs created with it that are alive."""
        return sum(1 for qp in list(self._qps) if not qp._closed)

    def post_recv(self, wrs: RecvWR | Sequence[RecvWR]) -> None:
        """``ibv_post_srq_recv``."""
        self._check()
        pv = self._pv
        items = PyverbsQP._as_list(wrs, RecvWR)
        built = []
        try:
            for w in items:
                built.append(_pv_recv_wr(pv, w))
            for a, b in zip(built, built[1:]):
                a.next_wr = b  # a raw pointer into b: `built` keeps b alive until the post returns
            try:
                self._srq.post_recv(built[0])
            except pv.pyverbs_error.PyverbsError as e:
                code = _err_code(e)
                ids = ", ".join(str(w.wr_id) for w in items[:8]) + (", ..." if len(items) > 8 else "")
                hint = f": the SRQ is full (max_wr {self.max_wr})" if code == _errno.ENOMEM else ""
                raise InvalidWorkRequestError(
                    f"ibv_post_srq_recv failed for wr_id {ids}: {_errno_text(code)}{hint}"
                ) from e
        finally:
            for w in built:
                w.close()  # frees the SGE array (pyverbs 44 never does)

    def arm_limit(self, limit: int) -> None:
        """``ibv_modify_srq(IBV_SRQ_LIMIT)``."""
        self._check()
        check_srq_limit(limit, self.max_wr)
        pv = self._pv
        attr = pv.srq.SrqAttr(max_wr=self.max_wr, max_sge=self.max_sge, srq_limit=limit)
        try:
            self._srq.modify(attr, pv.enums.IBV_SRQ_LIMIT)
        except pv.pyverbs_error.PyverbsError as e:
            raise RDMAError(f"ibv_modify_srq(IBV_SRQ_LIMIT={limit}) failed: {_errno_text(_err_code(e))}") from e
        self._armed = limit > 0

    def query(self) -> SRQAttr:
        self._check()
        try:
            a = self._srq.query()
        except self._pv.pyverbs_error.PyverbsError as e:
            raise RDMAError(f"ibv_query_srq failed: {e}") from e
        return SRQAttr(int(a.max_wr), int(a.max_sge), int(a.srq_limit))

    def set_limit_handler(self, handler: base.LimitHandler | None, loop: Any = None) -> None:
        if handler is not None:
            self._check()
        self.device._async_events().set_handler(self, handler, loop)

    def close(self) -> None:
        """``ibv_destroy_srq``; ResourceBusyError (EBUSY) while queue pairs created with
        it are alive (pyverbs' own close would destroy them first)."""
        if self._closed:
            return
        users = self.users
        if users:
            raise ResourceBusyError(
                f"ibv_destroy_srq: {users} queue pair(s) still take their receives from this shared receive "
                "queue (EBUSY): destroy them first"
            )
        dispatcher = self.device._dispatcher
        if dispatcher is not None:
            dispatcher.forget(self)
        self._closed = True
        try:
            self._srq.close()
        except self._pv.pyverbs_error.PyverbsError as e:
            if _err_code(e) == _errno.EBUSY:
                self._closed = False
                raise ResourceBusyError(f"ibv_destroy_srq: {e}") from e
            raise RDMAError(f"ibv_destroy_srq failed: {e}") from e

    def __repr__(self) -> str:
        return f"<PyverbsSRQ max_wr={self.max_wr}{' closed' if self._closed else ''}>"


class _PyverbsAsyncSource:
    """The context's async-event fd for the dispatcher: read (only while ``poll``
    says it is readable), acknowledged at once, SRQ limit events resolved."""

    def __init__(self, device: PyverbsDevice, fd: int) -> None:
        self._device = weakref.ref(device)
        self._ctx = device._ctx
        self._pv = device._pv
        self._fd = fd
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def fileno(self) -> int:
        return self._fd

    def read_events(self) -> list[tuple[int, SharedReceiveQueue | None]]:
        out: list[tuple[int, SharedReceiveQueue | None]] = []
        device = self._device()
        if device is None or device._closed:
            return out
        limit_reached = int(self._pv.enums.IBV_EVENT_SRQ_LIMIT_REACHED)
        for _ in range(1024):  # (a bound: the loop comes back while more are queued)
            if not self._poll.poll(0):
                break
            try:
                ev = self._ctx.get_async_event()
            except self._pv.pyverbs_error.PyverbsError as e:
                raise RDMAError(f"ibv_get_async_event on {device.name} failed: {e}") from e
            event_type = int(ev.event_type)
            ev.ack()  # at once: destroying the object waits for the acks of its events
            if event_type == limit_reached:
                out.extend((event_type, srq) for srq in device._srqs_fired())
            else:
                out.append((event_type, None))
        return out


# ------------------------------------------------------------- queue pair ----

_CHAIN = (QPState.IBV_QPS_RESET, QPState.IBV_QPS_INIT, QPState.IBV_QPS_RTR, QPState.IBV_QPS_RTS)
_SEND_OK = frozenset({QPState.IBV_QPS_RTS, QPState.IBV_QPS_SQD, QPState.IBV_QPS_SQE, QPState.IBV_QPS_ERR})
_RECV_OK = frozenset(set(QPState) - {QPState.IBV_QPS_RESET})
_RDMA_OPS = frozenset({WROpcode.IBV_WR_RDMA_WRITE, WROpcode.IBV_WR_RDMA_WRITE_WITH_IMM, WROpcode.IBV_WR_RDMA_READ})
_ATOMIC_OPS = frozenset({WROpcode.IBV_WR_ATOMIC_CMP_AND_SWP, WROpcode.IBV_WR_ATOMIC_FETCH_AND_ADD})
_IMM_OPS = frozenset({WROpcode.IBV_WR_RDMA_WRITE_WITH_IMM, WROpcode.IBV_WR_SEND_WITH_IMM})
#: what the extended path posts (the opcodes the QP is created with), as plain ints
_WR_RDMA_WRITE = int(WROpcode.IBV_WR_RDMA_WRITE)
_WR_RDMA_WRITE_WITH_IMM = int(WROpcode.IBV_WR_RDMA_WRITE_WITH_IMM)
_WR_RDMA_READ = int(WROpcode.IBV_WR_RDMA_READ)
_WR_SEND = int(WROpcode.IBV_WR_SEND)
_WR_SEND_WITH_IMM = int(WROpcode.IBV_WR_SEND_WITH_IMM)
_WR_ATOMIC_FETCH_AND_ADD = int(WROpcode.IBV_WR_ATOMIC_FETCH_AND_ADD)
_SIGNALED = int(SendFlags.IBV_SEND_SIGNALED)
_EXTENDED_OPS = frozenset(
    {
        _WR_RDMA_WRITE,
        _WR_RDMA_WRITE_WITH_IMM,
        _WR_RDMA_READ,
        _WR_SEND,
        _WR_SEND_WITH_IMM,
        _WR_ATOMIC_FETCH_AND_ADD,
        int(WROpcode.IBV_WR_ATOMIC_CMP_AND_SWP),
    }
)
_SEND_INLINE = 8  # IBV_SEND_INLINE
#: at most this many pyverbs RecvWRs kept per QP (and no more than its receive queue holds)
_KEPT_RECVS = 4096


def _imm(w: SendWR) -> int:
    v = 0 if w.imm_data is None else int(w.imm_data)
    if not 0 <= v <= 0xFFFFFFFF:
        raise InvalidWorkRequestError(f"wr_id {w.wr_id}: imm_data {v} does not fit 32 bits")
    return v


def _state_name(s: int) -> str:
    v = _enum(QPState, s)
    return v.name if isinstance(v, QPState) else f"state {s}"


class PyverbsQP(base.QueuePair):
    """An RC queue pair."""

    def __init__(
        self,
        pd: PyverbsPD,
        send_cq: PyverbsCQ,
        recv_cq: PyverbsCQ,
        cap: QPCap,
        sq_sig_all: bool,
        srq: PyverbsSRQ | None = None,
    ):
        pv = pd._pv
        self._pv = pv
        self.pd = pd
        self.device = pd.device
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        #: the shared receive queue it takes its receives from (None: its own receive queue)
        self.srq = srq
        self._closed = False
        qcap = pv.qp.QPCap(
            max_send_wr=cap.max_send_wr,
            max_recv_wr=cap.max_recv_wr,
            max_send_sge=cap.max_send_sge,
            max_recv_sge=cap.max_recv_sge,
            max_inline_data=cap.max_inline_data,
        )
        #: the QP takes the extended posting verbs (``ibv_wr_*``, see the module docstring)
        self.extended = False
        #: pyverbs RecvWRs kept for receives posted again: id(wr) -> (wr, its fields, RecvWR)
        self._kept_recvs: dict[int, tuple[RecvWR, tuple[int, int, int, int], Any]] = {}
        self._sge: Any = None
        init: Any = None
        # (a QP with an SRQ: ibv_qp_init_attr.srq; verbs ignore max_recv_wr/sge then)
        with_srq: dict[str, Any] = {"srq": srq._srq} if srq is not None else {}
        if settings.PYVERBS_EXTENDED.get():
            init = self._create_extended(pd, send_cq, recv_cq, qcap, sq_sig_all, with_srq)
        if init is None:
            init = pv.qp.QPInitAttr(
                qp_type=pv.enums.IBV_QPT_RC,
                scq=send_cq._cq,
                rcq=recv_cq._cq,
                cap=qcap,
                sq_sig_all=1 if sq_sig_all else 0,
                **with_srq,
            )
            try:
                self._qp = pv.qp.QP(pd._pd, init)
            except pv.pyverbs_error.PyverbsError as e:
                raise RDMAError(f"ibv_create_qp(RC, {cap}) on {self.device.name} failed: {e}") from e
        # ibv_create_qp writes the granted sizes back into the init attributes
        self.cap = QPCap(
            max_send_wr=init.max_send_wr,
            max_recv_wr=init.max_recv_wr,
            max_send_sge=init.max_send_sge,
            max_recv_sge=init.max_recv_sge,
            max_inline_data=init.max_inline_data,
        )
        self.qp_num = self._qp.qp_num
        self.sq_sig_all = bool(sq_sig_all)

    def _create_extended(
        self, pd: PyverbsPD, send_cq: PyverbsCQ, recv_cq: PyverbsCQ, qcap: Any, sig_all: bool, with_srq: dict[str, Any]
    ) -> Any:
        """``ibv_create_qp_ex`` with the send opcodes aiordma posts; the init
        attributes, or None where the device or pyverbs has no extended QP."""
        pv = self._pv
        e = pv.enums
        if not hasattr(pv.qp, "QPEx"):
            return None
        ops = (
            e.IBV_QP_EX_WITH_RDMA_WRITE
            | e.IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
            | e.IBV_QP_EX_WITH_SEND
            | e.IBV_QP_EX_WITH_SEND_WITH_IMM
            | e.IBV_QP_EX_WITH_RDMA_READ
            | e.IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
            | e.IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD
        )
        try:
            init = pv.qp.QPInitAttrEx(
                qp_type=e.IBV_QPT_RC,
                scq=send_cq._cq,
                rcq=recv_cq._cq,
                cap=qcap,
                sq_sig_all=1 if sig_all else 0,
                comp_mask=e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
                pd=pd._pd,
                send_ops_flags=ops,
                **with_srq,
            )
            self._qp = pv.qp.QPEx(self.device._ctx, init)
        except (pv.pyverbs_error.PyverbsError, TypeError, AttributeError) as err:
            log.debug("pyverbs: no extended QP on %s (%s): ibv_post_send it is", self.device.name, err)
            return None
        self.extended = True
        self._sge = pv.wr.SGE(0, 0, 0)  # the one SGE object every extended post reuses
        return init

    def _check(self) -> None:
        if self._closed:
            raise QueuePairStateError(f"QP 0x{self.qp_num:06x} is closed (destroyed)")

    @property
    def state(self) -> QPState:
        """The QP state as the device reports it (``ibv_query_qp``), so an
        asynchronous move to IBV_QPS_ERR after a failed request is seen."""
        self._check()
        pv = self._pv
        try:
            attr, _ = self._qp.query(pv.enums.IBV_QP_STATE)
        except pv.pyverbs_error.PyverbsError:
            state: QPState = _enum(QPState, self._qp.qp_state)
            return state
        state = _enum(QPState, attr.qp_state)
        return state

    # -- state transitions ---------------------------------------------
    def modify(self, attr: QPAttr) -> None:
        """``ibv_modify_qp`` to ``attr.qp_state``.

        Forward moves along RESET -> INIT -> RTR -> RTS step through the
        intermediate states (each with its own mask, as pyverbs' ``to_rts``
        does); RTS -> RTS updates ``qp_access_flags``/``min_rnr_timer``; any
        state -> ERR or RESET is allowed. Attributes left None get defaults:
        access flags ``ACCESS_ALL``, path MTU = the port's active MTU (a
        requested MTU is capped by it), PSNs 0, ``min_rnr_timer`` 12,
        ``timeout`` 14, ``retry_cnt`` 7, ``rnr_retry`` 7, rd_atomic depths from
        the device caps (at most 16), ``sgid_index`` = the device's GID index.
        RTR needs ``dest_qp_num`` and ``dgid``.
        """
        self._check()
        target = attr.qp_state
        if target is None:
            raise QueuePairStateError("QPAttr.qp_state is required for modify()")
        target = QPState(target)
        cur = _enum(QPState, self._qp.qp_state)
        pv = self._pv
        e = pv.enums
        if target in (QPState.IBV_QPS_ERR, QPState.IBV_QPS_RESET):
            self._apply(cur, target, pv.qp.QPAttr(qp_state=int(target)), e.IBV_QP_STATE)
            return
        if target not in _CHAIN:
            raise QueuePairStateError(f"modify to {target.name} is not supported by aiordma")
        if cur not in _CHAIN:
            raise QueuePairStateError(
                f"cannot move QP 0x{self.qp_num:06x} from {_state_name(cur)} to {target.name}: "
                "move it to IBV_QPS_RESET first"
            )
        ci, ti = _CHAIN.index(cur), _CHAIN.index(target)
        if ti < ci or (ti == ci and target == QPState.IBV_QPS_RTR):
            raise QueuePairStateError(
                f"illegal QP transition {_state_name(cur)} -> {target.name} for QP 0x{self.qp_num:06x}"
            )
        if ti == ci:  # INIT -> INIT or RTS -> RTS
            if target == QPState.IBV_QPS_INIT:
                pattr, mask = self._init_attr(attr)
            else:
                pattr = pv.qp.QPAttr(qp_state=int(target))
                mask = e.IBV_QP_STATE
                if attr.qp_access_flags is not None:
                    pattr.qp_access_flags = int(attr.qp_access_flags)
                    mask |= e.IBV_QP_ACCESS_FLAGS
                if attr.min_rnr_timer is not None:
                    pattr.min_rnr_timer = int(attr.min_rnr_timer)
                    mask |= e.IBV_QP_MIN_RNR_TIMER
            self._apply(cur, target, pattr, mask)
            return
        for step in _CHAIN[ci + 1 : ti + 1]:
            if step == QPState.IBV_QPS_INIT:
                pattr, mask = self._init_attr(attr)
            elif step == QPState.IBV_QPS_RTR:
                pattr, mask = self._rtr_attr(attr)
            else:
                pattr, mask = self._rts_attr(attr)
            self._apply(_enum(QPState, self._qp.qp_state), step, pattr, mask)

    def _apply(self, cur: Any, target: QPState, pattr: Any, mask: int) -> None:
        pv = self._pv
        try:
            self._qp.modify(pattr, mask)
        except pv.pyverbs_error.PyverbsError as ex:
            raise QueuePairStateError(
                f"ibv_modify_qp {_state_name(cur)} -> {target.name} failed for QP 0x{self.qp_num:06x}: "
                f"{_errno_text(_err_code(ex))} (attr_mask 0x{mask:x})"
            ) from ex

    def _init_attr(self, a: QPAttr) -> tuple[Any, int]:
        pv = self._pv
        e = pv.enums
        p = pv.qp.QPAttr(qp_state=e.IBV_QPS_INIT, port_num=int(a.port_num))
        p.pkey_index = int(a.pkey_index)
        p.qp_access_flags = int(ACCESS_ALL if a.qp_access_flags is None else a.qp_access_flags)
        return p, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS

    def _rd_atomic_cap(self, init: bool) -> int:
        a = self.device._attr
        v = a.max_qp_init_rd_atom if init else a.max_qp_rd_atom
        return max(1, min(int(v), MAX_RD_ATOMIC_CAP))

    def _rtr_attr(self, a: QPAttr) -> tuple[Any, int]:
        pv = self._pv
        e = pv.enums
        missing = [n for n in ("dest_qp_num", "dgid") if getattr(a, n) is None]
        if missing:
            raise QueuePairStateError(f"INIT -> RTR needs {' and '.join(missing)} (the peer's QPN and GID)")
        port_num = int(a.port_num)
        active = int(self.device.query_port(port_num).active_mtu)
        mtu = active if a.path_mtu is None else min(active, int(a.path_mtu))
        sgid_index = a.sgid_index
        if sgid_index is None:
            sgid_index = (
                self.device.gid_index if self.device.gid_index is not None else self.device._resolve_gid_index()
            )
        if a.dgid is None or a.dest_qp_num is None:
            raise QueuePairStateError("modify to IBV_QPS_RTR needs the peer's dgid and dest_qp_num")
        dgid = pv.addr.GID(gid_str(parse_gid(a.dgid)))
        gr = pv.addr.GlobalRoute(
            dgid=dgid,
            flow_label=int(a.flow_label),
            sgid_index=int(sgid_index),
            hop_limit=int(a.hop_limit),
            traffic_class=int(a.traffic_class),
        )
        p = pv.qp.QPAttr(qp_state=e.IBV_QPS_RTR, port_num=port_num, path_mtu=mtu)
        p.dest_qp_num = int(a.dest_qp_num)
        p.rq_psn = int(a.rq_psn or 0) & 0xFFFFFF
        p.max_dest_rd_atomic = (
            int(a.max_dest_rd_atomic) if a.max_dest_rd_atomic is not None else self._rd_atomic_cap(False)
        )
        p.min_rnr_timer = DEFAULT_MIN_RNR_TIMER if a.min_rnr_timer is None else int(a.min_rnr_timer)
        p.ah_attr = pv.addr.AHAttr(gr=gr, is_global=1, sl=int(a.service_level), port_num=port_num)
        mask = (
            e.IBV_QP_STATE
            | e.IBV_QP_AV
            | e.IBV_QP_PATH_MTU
            | e.IBV_QP_DEST_QPN
            | e.IBV_QP_RQ_PSN
            | e.IBV_QP_MAX_DEST_RD_ATOMIC
            | e.IBV_QP_MIN_RNR_TIMER
        )
        return p, mask

    def _rts_attr(self, a: QPAttr) -> tuple[Any, int]:
        pv = self._pv
        e = pv.enums
        p = pv.qp.QPAttr(qp_state=e.IBV_QPS_RTS, port_num=int(a.port_num))
        p.timeout = DEFAULT_TIMEOUT if a.timeout is None else int(a.timeout)
        p.retry_cnt = DEFAULT_RETRY_CNT if a.retry_cnt is None else int(a.retry_cnt)
        p.rnr_retry = DEFAULT_RNR_RETRY if a.rnr_retry is None else int(a.rnr_retry)
        p.sq_psn = int(a.sq_psn or 0) & 0xFFFFFF
        p.max_rd_atomic = int(a.max_rd_atomic) if a.max_rd_atomic is not None else self._rd_atomic_cap(True)
        mask = (
            e.IBV_QP_STATE
            | e.IBV_QP_TIMEOUT
            | e.IBV_QP_RETRY_CNT
            | e.IBV_QP_RNR_RETRY
            | e.IBV_QP_SQ_PSN
            | e.IBV_QP_MAX_QP_RD_ATOMIC
        )
        return p, mask

    # -- posting ---------------------------------------------------------
    def _sges(self, sg_list: Sequence[base.SGE]) -> tuple[list[Any], int]:
        return _pv_sges(self._pv, sg_list)

    def _build_send(self, w: SendWR) -> Any:
        pv = self._pv
        try:
            op = WROpcode(w.opcode)
        except ValueError:
            raise InvalidWorkRequestError(f"wr_id {w.wr_id}: unsupported send opcode {w.opcode!r}") from None
        imm = 0
        if op in _IMM_OPS:
            v = 0 if w.imm_data is None else int(w.imm_data)
            if not 0 <= v <= 0xFFFFFFFF:
                raise InvalidWorkRequestError(f"wr_id {w.wr_id}: imm_data {v} does not fit 32 bits")
            imm = socket.htonl(v)
        sges, n = self._sges(w.sg_list)
        try:
            wr = pv.wr.SendWR(
                wr_id=int(w.wr_id),
                opcode=int(op),
                num_sge=len(sges),
                sg=sges,
                imm_data=imm,
                send_flags=int(w.send_flags),
            )
        finally:
            for s in sges:
                s.close()  # copied into the WR's own array (pyverbs 44 never frees them)
        if n != len(sges):
            wr.num_sge = n
        if op in _RDMA_OPS:
            wr.set_wr_rdma(int(w.rkey), int(w.remote_addr))
        elif op in _ATOMIC_OPS:
            wr.set_wr_atomic(int(w.rkey), int(w.remote_addr), int(w.compare_add), int(w.swap))
        return wr

    def _build_recv(self, w: RecvWR) -> Any:
        return _pv_recv_wr(self._pv, w)

    @staticmethod
    def _as_list(wrs: Any, kind: type) -> list[Any]:
        if isinstance(wrs, kind):
            return [wrs]
        out = list(wrs)
        if not out:
            raise InvalidWorkRequestError("no work requests to post")
        for w in out:
            if not isinstance(w, kind):
                raise InvalidWorkRequestError(f"expected {kind.__name__}, got {type(w).__name__}")
        return out

    def _post_error(self, kind: str, items: Sequence[Any], e: BaseException) -> InvalidWorkRequestError:
        """``items``: the work requests posted, or their wr_ids."""
        code = _err_code(e)
        ids = ", ".join(str(getattr(w, "wr_id", w)) for w in items[:8]) + (", ..." if len(items) > 8 else "")
        hint = ""
        if code == _errno.ENOMEM:
            q = "receive" if kind == "ibv_post_recv" else "send"
            depth = self.cap.max_send_wr if q == "send" else self.cap.max_recv_wr
            hint = f": the {q} queue is full (depth {depth})"
        elif code == _errno.EINVAL:
            hint = ": invalid work request (too many SGEs, bad opcode, unaligned atomic, inline too long?)"
        elif code == _errno.EACCES:
            hint = (
                ": this thread's credentials differ from the ones that opened the device "
                "(setuid/capset after open_device); the kernel refuses uverbs commands then"
            )
        err = InvalidWorkRequestError(
            f"{kind} on QP 0x{self.qp_num:06x} failed for wr_id {ids}: {_errno_text(code)}{hint}"
        )
        err.__cause__ = e
        return err

    def _post(self, kind: str, items: list[Any], built: list[Any], post: Any) -> None:
        pv = self._pv
        for a, b in zip(built, built[1:]):
            a.next_wr = b  # a raw pointer into b: `built` keeps b alive until the post returns
        try:
            post(built[0])
        except pv.pyverbs_error.PyverbsError as e:
            raise self._post_error(kind, items, e) from e
        finally:
            for w in built:
                w.close()  # frees the SGE array (pyverbs 44 never does)

    def _post_extended(self, items: list[SendWR]) -> bool:
        """Post ``items`` with the extended verbs: False (nothing posted) when one
        of them needs ``ibv_post_send`` (several SGEs, none, inline data, an
        opcode the QP was not created with)."""
        qp = self._qp
        sge = self._sge
        qp.wr_start()
        try:
            for w in items:
                sg = w.sg_list
                op = w.opcode
                flags = int(w.send_flags)  # (an IntFlag's `&` runs Python code; an int's does not)
                if len(sg) != 1 or flags & _SEND_INLINE or op not in _EXTENDED_OPS:
                    qp.wr_abort()
                    return False
                qp.wr_id = w.wr_id
                qp.wr_flags = flags
                if op == _WR_RDMA_WRITE:
                    qp.wr_rdma_write(w.rkey, w.remote_addr)
                elif op == _WR_RDMA_READ:
                    qp.wr_rdma_read(w.rkey, w.remote_addr)
                elif op == _WR_SEND_WITH_IMM:
                    qp.wr_send_imm(_imm(w))  # (host order: pyverbs converts)
                elif op == _WR_RDMA_WRITE_WITH_IMM:
                    qp.wr_rdma_write_imm(w.rkey, w.remote_addr, _imm(w))
                elif op == _WR_SEND:
                    qp.wr_send()
                elif w.remote_addr & 7:
                    # an unaligned atomic: ibv_post_send refuses it at once, where the
                    # extended verbs would let it fail the QP later
                    qp.wr_abort()
                    return False
                elif op == _WR_ATOMIC_FETCH_AND_ADD:
                    qp.wr_atomic_fetch_add(w.rkey, w.remote_addr, w.compare_add)
                else:
                    qp.wr_atomic_cmp_swp(w.rkey, w.remote_addr, w.compare_add, w.swap)
                s = sg[0]
                sge.addr = s.addr
                sge.length = s.length
                sge.lkey = s.lkey
                qp.wr_set_sge(sge)
        except BaseException:
            qp.wr_abort()
            raise
        self._wr_complete(items)
        return True

    def _wr_complete(self, posted: Sequence[SendWR] | Sequence[int]) -> None:
        """``ibv_wr_complete``: the doorbell for every request since ``ibv_wr_start``;
        a refusal becomes the error naming ``posted`` (requests or their wr_ids)."""
        try:
            self._qp.wr_complete()
        except self._pv.pyverbs_error.PyverbsError as e:
            raise self._post_error("ibv_wr_complete", posted, e) from e

    def _check_send_state(self) -> None:
        self._check()
        st = self._qp.qp_state
        if st not in _SEND_OK:
            raise QueuePairStateError(
                f"ibv_post_send on QP 0x{self.qp_num:06x} in {_state_name(st)}: "
                "the send queue accepts work requests from IBV_QPS_RTS on"
            )

    def post_rdma_table(self, opcode: int, rkey: int, lkey: int, fields: Sequence[int]) -> bool:
        """Post a chain of one-SGE RDMA Reads or Writes (``opcode``) from a flat
        table, four integers per work request (wr_id, remote address, local
        address, length), every request toward ``rkey`` from ``lkey``, only the
        last one signaled, with one doorbell: the path of a prepared transfer's
        descriptors (:meth:`aiordma.Connection.transfer`). Through the extended
        verbs, so no SendWR or SGE object is made per request. Returns False,
        having posted nothing, where the QP lacks them (the caller then posts
        SendWRs)."""
        if not self.extended or opcode not in (_WR_RDMA_READ, _WR_RDMA_WRITE):
            return False
        self._check_send_state()
        qp = self._qp
        sge = self._sge
        verb = qp.wr_rdma_read if opcode == _WR_RDMA_READ else qp.wr_rdma_write
        last = len(fields) - 4
        qp.wr_start()
        try:
            # (the flags and the lkey stay set from one request to the next: set once)
            qp.wr_flags = 0
            sge.lkey = lkey
            for j in range(0, last + 4, 4):
                if j == last:
                    qp.wr_flags = _SIGNALED
                qp.wr_id = fields[j]
                verb(rkey, fields[j + 1])
                sge.addr = fields[j + 2]
                sge.length = fields[j + 3]
                qp.wr_set_sge(sge)
        except BaseException:
            qp.wr_abort()
            raise
        self._wr_complete(fields[0::4])
        return True

    def post_send(self, wrs: SendWR | Sequence[SendWR]) -> None:
        """``ibv_post_send``; raises QueuePairStateError unless the QP is in
        RTS (or SQD/SQE/ERR, where the requests are flushed)."""
        self._check_send_state()
        items = [wrs] if type(wrs) is SendWR else self._as_list(wrs, SendWR)
        if self.extended and self._post_extended(items):
            return
        built = []
        try:
            for w in items:
                built.append(self._build_send(w))
        except BaseException:
            for b in built:
                b.close()
            raise
        self._post("ibv_post_send", items, built, self._qp.post_send)

    def post_recv(self, wrs: RecvWR | Sequence[RecvWR]) -> None:
        """``ibv_post_recv``; raises QueuePairStateError in IBV_QPS_RESET, and
        InvalidWorkRequestError on a QP with an SRQ (post to the SRQ)."""
        self._check()
        if self.srq is not None:
            raise srq_qp_post_recv_error(self.qp_num)
        st = self._qp.qp_state
        if st not in _RECV_OK:
            raise QueuePairStateError(
                f"ibv_post_recv on QP 0x{self.qp_num:06x} in {_state_name(st)}: "
                "the receive queue accepts work requests from IBV_QPS_INIT on"
            )
        if type(wrs) is RecvWR and len(wrs.sg_list) == 1:
            # a receive posted again and again (a connection's receive buffer): its
            # pyverbs RecvWR is built once and kept, no objects per message
            w = wrs
            s = w.sg_list[0]
            key = (w.wr_id, s.addr, s.length, s.lkey)
            kept = self._kept_recvs.get(id(w))
            if kept is None or kept[0] is not w or kept[1] != key:
                if kept is not None:
                    kept[2].close()
                if len(self._kept_recvs) >= min(_KEPT_RECVS, self.cap.max_recv_wr):
                    self._post("ibv_post_recv", [w], [self._build_recv(w)], self._qp.post_recv)
                    return
                kept = self._kept_recvs[id(w)] = (w, key, self._build_recv(w))
            try:
                self._qp.post_recv(kept[2])
            except self._pv.pyverbs_error.PyverbsError as e:
                raise self._post_error("ibv_post_recv", [w], e) from e
            return
        items = self._as_list(wrs, RecvWR)
        built = []
        try:
            for w in items:
                built.append(self._build_recv(w))
        except BaseException:
            for b in built:
                b.close()
            raise
        self._post("ibv_post_recv", items, built, self._qp.post_recv)

    # -- query / close -----------------------------------------------------
    def query(self) -> QPAttr:
        """``ibv_query_qp`` of the attributes :class:`QPAttr` has."""
        self._check()
        pv = self._pv
        e = pv.enums
        mask = (
            e.IBV_QP_STATE
            | e.IBV_QP_PKEY_INDEX
            | e.IBV_QP_PORT
            | e.IBV_QP_ACCESS_FLAGS
            | e.IBV_QP_PATH_MTU
            | e.IBV_QP_DEST_QPN
            | e.IBV_QP_RQ_PSN
            | e.IBV_QP_SQ_PSN
            | e.IBV_QP_MAX_DEST_RD_ATOMIC
            | e.IBV_QP_MAX_QP_RD_ATOMIC
            | e.IBV_QP_MIN_RNR_TIMER
            | e.IBV_QP_TIMEOUT
            | e.IBV_QP_RETRY_CNT
            | e.IBV_QP_RNR_RETRY
            | e.IBV_QP_AV
        )
        try:
            a, _init = self._qp.query(mask)
        except pv.pyverbs_error.PyverbsError as ex:
            raise RDMAError(f"ibv_query_qp on QP 0x{self.qp_num:06x} failed: {ex}") from ex
        ah = a.ah_attr  # AHAttr exposes the GRH fields directly (no .gr getter)
        is_global = bool(ah.is_global)
        return QPAttr(
            qp_state=_enum(QPState, a.qp_state),
            port_num=a.port_num or ah.port_num or 1,
            pkey_index=a.pkey_index,
            qp_access_flags=Access(a.qp_access_flags),
            path_mtu=_enum(MTU, a.path_mtu),
            dest_qp_num=a.dest_qp_num,
            rq_psn=a.rq_psn,
            sq_psn=a.sq_psn,
            max_dest_rd_atomic=a.max_dest_rd_atomic,
            max_rd_atomic=a.max_rd_atomic,
            min_rnr_timer=a.min_rnr_timer,
            timeout=a.timeout,
            retry_cnt=a.retry_cnt,
            rnr_retry=a.rnr_retry,
            dgid=parse_gid(ah.dgid) if is_global else None,
            sgid_index=ah.sgid_index if is_global else None,
            hop_limit=ah.hop_limit if is_global else 64,
            traffic_class=ah.traffic_class if is_global else 0,
            service_level=ah.sl,
            flow_label=ah.flow_label if is_global else 0,
        )

    def close(self) -> None:
        """``ibv_destroy_qp`` (before its CQs and PD)."""
        if self._closed:
            return
        self._closed = True
        if self.srq is not None:
            self.srq._qps.discard(self)
        kept, self._kept_recvs = self._kept_recvs, {}
        for _, _, wr in kept.values():
            wr.close()
        try:
            self._qp.close()
        except self._pv.pyverbs_error.PyverbsError as e:
            raise RDMAError(f"ibv_destroy_qp failed: {e}") from e

    def __repr__(self) -> str:
        if self._closed:
            return f"<PyverbsQP qpn=0x{self.qp_num:06x} closed>"
        return f"<PyverbsQP qpn=0x{self.qp_num:06x} {_state_name(self._qp.qp_state)}>"
