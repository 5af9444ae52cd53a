"""The pyverbs provider against kernel Soft-RoCE (rxe0 in scripts/rxe-vm).

Two RC QPs on the same device are connected to each other (rxe loopback);
every data-path test checks the bytes in memory and the work completions the
kernel produced. Skipped when no device is present (see conftest.py).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import resource
import select
import struct
import threading

import pytest

from aiordma.errors import (
    DeviceNotFoundError,
    InvalidWorkRequestError,
    MemoryRegistrationError,
    QueuePairStateError,
    RDMAError,
    RemoteAccessError,
    error_for_status,
)
from aiordma.providers.base import (
    ACCESS_ALL,
    MTU,
    Access,
    PortState,
    QPAttr,
    QPState,
    RecvWR,
    SendWR,
    WCFlags,
    WCOpcode,
    WCStatus,
    WROpcode,
    buffer_address,
    gid_from_ipv4,
    mtu_bytes,
    parse_gid,
)

pytestmark = pytest.mark.rxe

OK = WCStatus.IBV_WC_SUCCESS


def pattern(n: int, seed: int = 0) -> bytes:
    return bytes((i * 7 + seed) & 0xFF for i in range(n))


# ------------------------------------------------------------ device queries ----


def test_device_port_and_gid_table(dev):
    from aiordma.providers.pyverbs import list_devices, open_device

    name = os.environ.get("AIORDMA_RXE_DEVICE", "rxe0")
    assert name in list_devices()
    assert dev.name == name and dev.provider == "pyverbs"

    attr = dev.query_device()
    assert attr.provider == "pyverbs" and attr.name == name
    assert attr.max_qp > 0 and attr.max_qp_wr > 0 and attr.max_sge >= 4 and attr.max_cqe > 0
    assert attr.max_qp_rd_atom >= 1 and attr.atomic_cap != "IBV_ATOMIC_NONE"
    assert len(attr.node_guid) == 19 and attr.node_guid.count(":") == 3

    port = dev.query_port()
    assert port.state == PortState.IBV_PORT_ACTIVE
    assert port.link_layer == "Ethernet"
    assert isinstance(port.active_mtu, MTU) and port.active_mtu <= port.max_mtu
    netdev = os.environ.get("AIORDMA_RXE_NETDEV")
    if netdev:
        with open(f"/sys/class/net/{netdev}/mtu") as f:
            assert mtu_bytes(port.active_mtu) < int(f.read())

    table = dev.query_gid_table()
    assert table, "empty GID table"
    assert all(e.gid != bytes(16) for e in table)
    assert all(e.gid_type == "RoCE v2" for e in table)  # rxe registers RoCE v2 GIDs only
    sysfs = f"/sys/class/infiniband/{name}/ports/1"
    for e in table:  # agrees with the kernel's sysfs view
        with open(f"{sysfs}/gids/{e.index}") as f:
            assert parse_gid(f.read().strip()) == e.gid
        with open(f"{sysfs}/gid_attrs/types/{e.index}") as f:
            assert f.read().strip() == "RoCE v2"
    ip = os.environ.get("AIORDMA_RXE_IP")
    if ip:
        v4 = [e for e in table if e.ipv4 == ip]
        assert len(v4) == 1 and v4[0].gid == gid_from_ipv4(ip)
        if netdev:
            assert v4[0].netdev == netdev
        assert dev.default_gid_index() == v4[0].index == dev.gid_index
    if os.environ.get("AIORDMA_RXE_GID_INDEX"):
        assert dev.default_gid_index() == int(os.environ["AIORDMA_RXE_GID_INDEX"])
    assert dev.query_gid().index == dev.gid_index

    # name=None picks the first device with an ACTIVE port; explicit index kept
    with open_device() as d2:
        assert d2.name in list_devices() and d2.query_port().state == PortState.IBV_PORT_ACTIVE
    idx0 = table[0].index
    with open_device(name, gid_index=idx0) as d3:
        assert d3.gid_index == idx0 and d3.default_gid_index() == idx0
    with pytest.raises(DeviceNotFoundError, match="no RDMA device named"):
        open_device("no-such-dev0")
    with pytest.raises(DeviceNotFoundError, match="no GID at index"):
        open_device(name, gid_index=max(e.index for e in table) + 1)


# ------------------------------------------------------------------ memory ----


def test_mr_over_bytearray_is_zero_copy(pair, wait_wcs):
    pd, a, b = pair.pd, pair.qp_a, pair.qp_b
    buf = bytearray(4096)
    mr = pd.reg_mr(buf, ACCESS_ALL)
    assert mr.addr == buffer_address(buf)[0] and mr.length == 4096
    assert mr.lkey and mr.rkey and mr.access == ACCESS_ALL
    mr.view[0:5] = b"hello"  # the view is the bytearray's memory
    assert buf[0:5] == b"hello"
    buf[100:104] = b"RDMA"  # and writes to the bytearray are what the device reads
    with pytest.raises(BufferError):
        buf.extend(b"x")  # registered memory cannot be reallocated under the device

    own = pd.reg_mr(8192, Access.LOCAL_WRITE)  # provider-allocated: view works the same
    assert own.length == own.view.nbytes == 8192 and bytes(own.view[:16]) == bytes(16)
    own.view[0:3] = b"abc"
    assert bytes(own.view[0:3]) == b"abc"

    with pytest.raises(MemoryRegistrationError, match="read-only"):
        pd.reg_mr(b"immutable", ACCESS_ALL)
    with pytest.raises(MemoryRegistrationError):
        pd.reg_mr(0)

    # B's QP reads A-side memory: RDMA READ of buf (registered by this PD) into `own`
    b.post_send(
        SendWR(wr_id=7, opcode=WROpcode.IBV_WR_RDMA_READ, sg_list=[own.sge(0, 104)], remote_addr=mr.addr, rkey=mr.rkey)
    )
    (wc,) = wait_wcs(pair.cq_b, 1)
    assert wc.status == OK and wc.opcode == WCOpcode.IBV_WC_RDMA_READ and wc.wr_id == 7
    assert wc.byte_len == 104
    assert bytes(own.view[0:5]) == b"hello" and bytes(own.view[100:104]) == b"RDMA"
    assert a.state == QPState.IBV_QPS_RTS
    own.close()
    mr.close()
    mr.close()  # idempotent


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def in_thread_with_memlock_enforced(limit: int, fn):
    """Run ``fn()`` in a new thread whose effective capabilities lack
    CAP_IPC_LOCK (which lifts RLIMIT_MEMLOCK for root), with the process's
    RLIMIT_MEMLOCK lowered to ``limit``; return its result or exception.

    A thread of its own because capabilities and credentials are per thread,
    and the kernel refuses uverbs write() commands (EACCES, ib_safe_file_access)
    from a thread whose credentials differ from the ones that opened the
    device: dropping the capability in the main thread would break every
    later post_send on the session's device.
    """
    out: dict = {}

    def run():
        libc = ctypes.CDLL(None, use_errno=True)
        hdr, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3
        if libc.capget(ctypes.byref(hdr), data) != 0:
            out["error"] = OSError(ctypes.get_errno(), "capget")
            return
        data[0].effective &= ~(1 << 14)  # CAP_IPC_LOCK
        if libc.capset(ctypes.byref(hdr), data) != 0:
            out["error"] = OSError(ctypes.get_errno(), "capset")
            return
        try:
            out["result"] = fn()
        except BaseException as e:
            out["error"] = e

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, hard))
    try:
        t = threading.Thread(target=run)
        t.start()
        t.join(60)
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))
    return out.get("result"), out.get("error")


def test_reg_mr_over_the_memlock_limit_names_ulimit(dev):
    pd = dev.alloc_pd()
    try:
        _, err = in_thread_with_memlock_enforced(64 * 1024, lambda: pd.reg_mr(bytearray(4 << 20), ACCESS_ALL))
        assert isinstance(err, MemoryRegistrationError), err
        msg = str(err)
        assert "ENOMEM" in msg and "ulimit -l: 64 KiB" in msg and "ulimit -l unlimited" in msg, msg
        mr = pd.reg_mr(bytearray(4 << 20), ACCESS_ALL)  # fine again with the limit restored
        assert mr.length == 4 << 20
    finally:
        pd.close()


# ------------------------------------------------------------- data path ----


def test_rdma_write_write_with_imm_and_read(pair, wait_wcs):
    pd, a, b = pair.pd, pair.qp_a, pair.qp_b
    n = 3000  # three packets at MTU 1024
    src = pd.reg_mr(bytearray(pattern(n, 1)), Access.LOCAL_WRITE)
    dst = pd.reg_mr(bytearray(8192), ACCESS_ALL)

    a.post_send(
        SendWR(
            wr_id=1,
            opcode=WROpcode.IBV_WR_RDMA_WRITE,
            sg_list=[src.sge(0, n)],
            remote_addr=dst.addr + 100,
            rkey=dst.rkey,
        )
    )
    (wc,) = wait_wcs(pair.cq_a, 1)
    assert (wc.wr_id, wc.status, wc.opcode) == (1, OK, WCOpcode.IBV_WC_RDMA_WRITE)
    assert bytes(dst.view[100 : 100 + n]) == pattern(n, 1)
    assert bytes(dst.view[:100]) == bytes(100) and dst.view[100 + n] == 0
    assert pair.cq_b.poll() == []  # a plain RDMA WRITE is invisible to the responder

    # WRITE_WITH_IMM consumes a receive (posted without SGEs) and reports the immediate
    b.post_recv(RecvWR(wr_id=50))
    src.view[0:4] = b"IMM!"
    a.post_send(
        SendWR(
            wr_id=2,
            opcode=WROpcode.IBV_WR_RDMA_WRITE_WITH_IMM,
            sg_list=[src.sge(0, 1500)],
            imm_data=0xDEADBEEF,
            remote_addr=dst.addr + 5000,
            rkey=dst.rkey,
        )
    )
    (wa,) = wait_wcs(pair.cq_a, 1)
    assert (wa.wr_id, wa.status, wa.opcode, wa.imm_data) == (2, OK, WCOpcode.IBV_WC_RDMA_WRITE, None)
    (wb,) = wait_wcs(pair.cq_b, 1)
    assert wb.status == OK and wb.wr_id == 50
    assert wb.opcode == WCOpcode.IBV_WC_RECV_RDMA_WITH_IMM == 129
    assert wb.imm_data == 0xDEADBEEF and wb.wc_flags & WCFlags.IBV_WC_WITH_IMM
    assert wb.byte_len == 1500 and wb.qp_num == b.qp_num  # (src_qp is defined for UD only; rxe: 0)
    assert bytes(dst.view[5000:5004]) == b"IMM!" and bytes(dst.view[5004:6500]) == pattern(n, 1)[4:1500]

    # RDMA READ back into a fresh buffer, scattered over two SGEs
    back = pd.reg_mr(bytearray(4096), Access.LOCAL_WRITE)
    a.post_send(
        SendWR(
            wr_id=3,
            opcode=WROpcode.IBV_WR_RDMA_READ,
            sg_list=[back.sge(0, 1000), back.sge(2000, n - 1000)],
            remote_addr=dst.addr + 100,
            rkey=dst.rkey,
        )
    )
    (wr,) = wait_wcs(pair.cq_a, 1)
    assert (wr.wr_id, wr.status, wr.opcode, wr.byte_len) == (3, OK, WCOpcode.IBV_WC_RDMA_READ, n)
    assert bytes(back.view[0:1000]) + bytes(back.view[2000 : 2000 + n - 1000]) == pattern(n, 1)
    assert bytes(back.view[1000:2000]) == bytes(1000)


def test_send_recv_small_and_multi_mtu_with_two_sges(pair, wait_wcs):
    pd, a, b = pair.pd, pair.qp_a, pair.qp_b
    tx = pd.reg_mr(bytearray(16384), Access.LOCAL_WRITE)
    rx1 = pd.reg_mr(bytearray(8192), Access.LOCAL_WRITE)
    rx2 = pd.reg_mr(bytearray(8192), Access.LOCAL_WRITE)
    n = 10000

    # two receives in one post (a linked list of WRs)
    b.post_recv(
        [RecvWR(wr_id=11, sg_list=[rx1.sge(0, 16)]), RecvWR(wr_id=12, sg_list=[rx1.sge(100, 4000), rx2.sge(0, 8000)])]
    )

    tx.view[0] = 0x5A
    tx.view[1000 : 1000 + n] = pattern(n, 3)
    a.post_send(
        [
            SendWR(wr_id=21, opcode=WROpcode.IBV_WR_SEND, sg_list=[tx.sge(0, 1)]),
            SendWR(wr_id=22, opcode=WROpcode.IBV_WR_SEND, sg_list=[tx.sge(1000, 3000), tx.sge(4000, n - 3000)]),
        ]
    )
    wa = wait_wcs(pair.cq_a, 2)
    assert [(w.wr_id, w.status, w.opcode) for w in wa] == [
        (21, OK, WCOpcode.IBV_WC_SEND),
        (22, OK, WCOpcode.IBV_WC_SEND),
    ]
    wb = wait_wcs(pair.cq_b, 2)
    assert [(w.wr_id, w.status, w.opcode, w.byte_len) for w in wb] == [
        (11, OK, WCOpcode.IBV_WC_RECV, 1),
        (12, OK, WCOpcode.IBV_WC_RECV, n),
    ]
    assert all(w.imm_data is None and not w.wc_flags & WCFlags.IBV_WC_WITH_IMM for w in wb)
    assert rx1.view[0] == 0x5A and rx1.view[1] == 0
    got = bytes(rx1.view[100:4100]) + bytes(rx2.view[0 : n - 4000])
    assert got == pattern(n, 3)

    # SEND_WITH_IMM: RECV completion carrying the immediate, host order
    b.post_recv(RecvWR(wr_id=13, sg_list=[rx1.sge(0, 64)]))
    a.post_send(SendWR(wr_id=23, opcode=WROpcode.IBV_WR_SEND_WITH_IMM, sg_list=[tx.sge(1000, 64)], imm_data=0x01020304))
    (w,) = wait_wcs(pair.cq_b, 1)
    assert (w.wr_id, w.status, w.opcode, w.byte_len, w.imm_data) == (13, OK, WCOpcode.IBV_WC_RECV, 64, 0x01020304)
    assert w.wc_flags & WCFlags.IBV_WC_WITH_IMM
    assert wait_wcs(pair.cq_a, 1)[0].wr_id == 23


def test_a_receive_posted_again_lands_where_it_says_now(pair, wait_wcs):
    """The provider keeps the pyverbs RecvWR of a receive posted again; one whose
    buffer or wr_id changed in between is rebuilt: each message lands in the
    buffer its receive named when it was posted."""
    pd, a, b = pair.pd, pair.qp_a, pair.qp_b
    tx = pd.reg_mr(bytearray(64), Access.LOCAL_WRITE)
    rx = pd.reg_mr(bytearray(256), Access.LOCAL_WRITE)
    wr = RecvWR(wr_id=1, sg_list=[rx.sge(0, 64)])
    for i, (wr_id, off) in enumerate([(1, 0), (1, 0), (2, 64), (2, 128), (3, 128)]):
        wr.wr_id = wr_id
        wr.sg_list = [rx.sge(off, 64)]
        b.post_recv(wr)
        tx.view[0:4] = b"m%03d" % i
        a.post_send(SendWR(wr_id=100 + i, opcode=WROpcode.IBV_WR_SEND, sg_list=[tx.sge(0, 4)]))
        (w,) = wait_wcs(pair.cq_b, 1)
        assert (w.wr_id, w.status, w.byte_len) == (wr_id, OK, 4)
        assert bytes(rx.view[off : off + 4]) == b"m%03d" % i
        assert wait_wcs(pair.cq_a, 1)[0].status == OK
    tx.close()
    rx.close()


def test_atomics_cmp_swap_and_fetch_add(pair, wait_wcs):
    pd, a = pair.pd, pair.qp_a
    target = pd.reg_mr(bytearray(64), ACCESS_ALL)
    res = pd.reg_mr(bytearray(64), Access.LOCAL_WRITE)
    off = (-target.addr) % 8  # 8-byte aligned remote address
    struct.pack_into("<Q", target.view, off, 100)
    struct.pack_into("<Q", target.view, off + 8, 0x1122334455667788)
    raddr = target.addr + off

    def atomic(wr_id, op, compare_add, swap=0, slot=0):
        a.post_send(
            SendWR(
                wr_id=wr_id,
                opcode=op,
                sg_list=[res.sge(slot * 8, 8)],
                remote_addr=raddr,
                rkey=target.rkey,
                compare_add=compare_add,
                swap=swap,
            )
        )
        (wc,) = wait_wcs(pair.cq_a, 1)
        assert wc.status == OK and wc.wr_id == wr_id and wc.byte_len == 8
        return wc, struct.unpack_from("<Q", res.view, slot * 8)[0]

    wc, old = atomic(1, WROpcode.IBV_WR_ATOMIC_CMP_AND_SWP, 100, 777, slot=0)
    assert wc.opcode == WCOpcode.IBV_WC_COMP_SWAP and old == 100
    assert struct.unpack_from("<Q", target.view, off)[0] == 777
    wc, old = atomic(2, WROpcode.IBV_WR_ATOMIC_CMP_AND_SWP, 1, 5, slot=1)  # compare fails
    assert old == 777 and struct.unpack_from("<Q", target.view, off)[0] == 777
    wc, old = atomic(3, WROpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, 23, slot=2)
    assert wc.opcode == WCOpcode.IBV_WC_FETCH_ADD and old == 777
    assert struct.unpack_from("<Q", target.view, off)[0] == 800
    wc, old = atomic(4, WROpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, 2**64 - 1, slot=3)  # wraps: adds -1
    assert old == 800 and struct.unpack_from("<Q", target.view, off)[0] == 799
    assert struct.unpack_from("<Q", target.view, off + 8)[0] == 0x1122334455667788  # neighbour untouched

    with pytest.raises(InvalidWorkRequestError):  # rxe refuses an unaligned atomic at post time
        a.post_send(
            SendWR(
                wr_id=5,
                opcode=WROpcode.IBV_WR_ATOMIC_FETCH_AND_ADD,
                sg_list=[res.sge(0, 8)],
                remote_addr=raddr + 4,
                rkey=target.rkey,
                compare_add=1,
            )
        )


# ------------------------------------------------------ completion channel ----


def test_completion_channel_fd(dev, connect, wait_wcs):
    from aiordma.providers.pyverbs import pyverbs_info

    ch = dev.create_comp_channel()
    fd = ch.fileno()
    expected_mode = "native" if pyverbs_info()["comp_channel_fd"] == "native" else "discovered"
    assert ch.fd_mode == expected_mode
    assert os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[infinibandevent]"
    assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK

    pd = dev.alloc_pd()
    rcq = dev.create_cq(16, ch)
    assert rcq.channel is ch
    with pytest.raises(RDMAError, match="one completion channel per CQ"):
        dev.create_cq(16, ch)
    scq = dev.create_cq(16)
    qa = pd.create_qp(scq, scq)
    qb = pd.create_qp(rcq, rcq)
    connect(dev, qa, qb.qp_num)
    connect(dev, qb, qa.qp_num)
    tx = pd.reg_mr(bytearray(b"x" * 64), Access.LOCAL_WRITE)
    rx = pd.reg_mr(bytearray(64), Access.LOCAL_WRITE)

    assert select.select([fd], [], [], 0)[0] == []  # nothing pending
    assert ch.get_cq_event() is None  # EAGAIN, not a block

    qb.post_recv([RecvWR(wr_id=1, sg_list=[rx.sge()]), RecvWR(wr_id=2, sg_list=[rx.sge()])])
    rcq.req_notify()
    qa.post_send(SendWR(wr_id=9, opcode=WROpcode.IBV_WR_SEND, sg_list=[tx.sge(0, 8)]))
    r, _, _ = select.select([fd], [], [], 10.0)
    assert r == [fd], "completion channel did not become readable within 10 s"
    assert ch.get_cq_event() is rcq
    assert rcq.unacked_events == 1
    assert ch.get_cq_event() is None  # one event per arming
    rcq.ack_events(1)
    with pytest.raises(ValueError):
        rcq.ack_events(1)  # more than get_cq_event returned
    (wc,) = rcq.poll()
    assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len) == (1, OK, WCOpcode.IBV_WC_RECV, 8)

    # not re-armed: the next completion raises no event
    qa.post_send(SendWR(wr_id=10, opcode=WROpcode.IBV_WR_SEND, sg_list=[tx.sge(0, 4)]))
    (wc,) = wait_wcs(rcq, 1)
    assert wc.wr_id == 2
    assert select.select([fd], [], [], 0)[0] == [] and ch.get_cq_event() is None
    wait_wcs(scq, 2)

    pd.close()
    ch.close()  # closes rcq (its CQ) first
    with pytest.raises(RDMAError):
        rcq.poll()
    scq.close()


# ------------------------------------------------------------------ errors ----


@pytest.mark.parametrize("case", ["bad_rkey", "out_of_bounds", "no_remote_write"])
def test_remote_access_errors_move_qp_to_error(pair, case, wait_wcs):
    pd, a = pair.pd, pair.qp_a
    src = pd.reg_mr(bytearray(pattern(256)), Access.LOCAL_WRITE)
    if case == "no_remote_write":
        dst = pd.reg_mr(bytearray(4096), Access.LOCAL_WRITE | Access.REMOTE_READ)
    else:
        dst = pd.reg_mr(bytearray(4096), ACCESS_ALL)
    rkey, raddr, n = dst.rkey, dst.addr, 64
    if case == "bad_rkey":
        rkey = (dst.rkey ^ 0x00ABCD00) & 0xFFFFFFFF
    elif case == "out_of_bounds":
        raddr, n = dst.addr + dst.length - 8, 64

    bad = SendWR(wr_id=1, opcode=WROpcode.IBV_WR_RDMA_WRITE, sg_list=[src.sge(0, n)], remote_addr=raddr, rkey=rkey)
    behind = SendWR(
        wr_id=2, opcode=WROpcode.IBV_WR_RDMA_WRITE, sg_list=[src.sge(0, 8)], remote_addr=dst.addr, rkey=dst.rkey
    )
    a.post_send([bad, behind])
    w1, w2 = wait_wcs(pair.cq_a, 2)
    assert (w1.wr_id, w1.status) == (1, WCStatus.IBV_WC_REM_ACCESS_ERR)
    assert error_for_status(w1.status) is RemoteAccessError
    assert (w2.wr_id, w2.status) == (2, WCStatus.IBV_WC_WR_FLUSH_ERR)
    assert bytes(dst.view) == bytes(4096)  # nothing was written
    assert a.state == QPState.IBV_QPS_ERR
    assert a.query().qp_state == QPState.IBV_QPS_ERR

    # a request posted to the QP in ERR is flushed as well
    a.post_send(SendWR(wr_id=3, opcode=WROpcode.IBV_WR_SEND, sg_list=[src.sge(0, 4)]))
    (w3,) = wait_wcs(pair.cq_a, 1)
    assert (w3.wr_id, w3.status) == (3, WCStatus.IBV_WC_WR_FLUSH_ERR)

    # RESET then INIT again is allowed; ERR -> RTS directly is not
    with pytest.raises(QueuePairStateError, match="IBV_QPS_RESET first"):
        a.to_rts(QPAttr())
    a.modify(QPAttr(qp_state=QPState.IBV_QPS_RESET))
    assert a.state == QPState.IBV_QPS_RESET
    a.to_init(QPAttr())
    assert a.state == QPState.IBV_QPS_INIT


def test_post_in_wrong_state_and_transitions(dev):
    pd = dev.alloc_pd()
    cq = dev.create_cq(16)
    qp = pd.create_qp(cq, cq)
    peer = pd.create_qp(cq, cq)
    mr = pd.reg_mr(bytearray(64), ACCESS_ALL)
    send = SendWR(wr_id=1, opcode=WROpcode.IBV_WR_SEND, sg_list=[mr.sge(0, 8)])
    assert qp.state == QPState.IBV_QPS_RESET
    assert qp.cap.max_send_wr >= 128 and qp.cap.max_recv_sge >= 4

    with pytest.raises(QueuePairStateError, match="IBV_QPS_RESET"):
        qp.post_send(send)
    with pytest.raises(QueuePairStateError, match="IBV_QPS_RESET"):
        qp.post_recv(RecvWR(wr_id=2, sg_list=[mr.sge()]))
    with pytest.raises(QueuePairStateError, match="dest_qp_num and dgid"):
        qp.to_rtr(QPAttr())

    qp.to_init(QPAttr())
    assert qp.state == QPState.IBV_QPS_INIT
    with pytest.raises(QueuePairStateError, match="IBV_QPS_INIT"):
        qp.post_send(send)
    qp.post_recv(RecvWR(wr_id=2, sg_list=[mr.sge()]))  # allowed from INIT on

    gid = dev.query_gid().gid
    qp.to_rtr(QPAttr(dest_qp_num=peer.qp_num, dgid=gid, path_mtu=MTU.IBV_MTU_4096, rq_psn=0x123456))
    assert qp.state == QPState.IBV_QPS_RTR
    with pytest.raises(QueuePairStateError, match="IBV_QPS_RTR"):
        qp.post_send(send)
    with pytest.raises(QueuePairStateError, match="illegal QP transition"):
        qp.to_init(QPAttr())

    qp.to_rts(QPAttr(sq_psn=0x654321, timeout=17))
    q = qp.query()
    port = dev.query_port()
    assert q.qp_state == QPState.IBV_QPS_RTS
    assert q.dest_qp_num == peer.qp_num and q.dgid == gid and q.sgid_index == dev.gid_index
    assert q.path_mtu == port.active_mtu  # 4096 requested, capped by the port
    assert (q.rq_psn, q.sq_psn, q.timeout) == (0x123456, 0x654321, 17)
    assert (q.min_rnr_timer, q.retry_cnt, q.rnr_retry) == (12, 7, 7)
    assert 1 <= q.max_rd_atomic <= 16 and 1 <= q.max_dest_rd_atomic <= 16
    assert q.qp_access_flags == ACCESS_ALL

    # RESET -> RTS in one call steps through INIT and RTR
    peer.to_rts(QPAttr(dest_qp_num=qp.qp_num, dgid=gid))
    assert peer.state == QPState.IBV_QPS_RTS

    pd.close()
    with pytest.raises(QueuePairStateError, match="closed"):
        qp.post_send(send)
    cq.close()
