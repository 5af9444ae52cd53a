"""The Python twin of rdma_write_demo.c: one RDMA Write with immediate, through the raw verbs.

The classic libibverbs C program rdma_write_demo.c (the kernel Soft-RoCE
interop tests in tests/rxe build it and run it against this one), step for step,
written against aiordma's verbs interface instead of libibverbs, so it runs on
a real device (pyverbs: mlx5, irdma, kernel Soft-RoCE rxe) or on the soft
device, and talks to the C program itself::

    python examples/rdma_write_demo.py server 127.0.0.1 18515
    python examples/rdma_write_demo.py client 127.0.0.1 18515

    ./rdma_write_demo server 0.0.0.0 18515           # the C program...
    python examples/rdma_write_demo.py client 10.0.2.15 18515   # ...and its twin

The C handshake authenticates nobody, and the buffer it hands out grants
REMOTE_WRITE and REMOTE_READ to whoever connects first: the Python server
listens beyond loopback only with ``--insecure`` (``server 0.0.0.0 18515
--insecure``), on a network you trust. aiordma's own rendezvous has tokens.

What happens (same order, same values as the C code):

1. both sides open the first device, allocate a PD, register a 4096-byte
   zeroed buffer (LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ), create a CQ of
   16 entries and an RC QP (16 send / 16 receive WRs, 1 SGE each), look up
   the GID at GID_INDEX and print ``QPN=.. rkey=0x.. addr=0x..``;
2. TCP: the server listens and accepts one client; each side writes its
   32-byte ``struct handshake`` first and then reads the peer's::

       struct handshake { uint32_t qpn; uint32_t rkey; uint64_t addr; uint8_t gid[16]; };

   in the host's native byte order (little-endian on x86), no padding;
3. both move the QP RESET -> INIT (pkey_index 0, port 1, REMOTE_WRITE |
   REMOTE_READ) -> RTR (path MTU 1024, dest QPN, rq_psn 0,
   max_dest_rd_atomic 1, min_rnr_timer 12, GRH: dgid, sgid_index GID_INDEX,
   hop_limit 64) -> RTS (timeout 14, retry_cnt 7, rnr_retry 7, sq_psn 0,
   max_rd_atomic 1);
4. the server posts one receive (wr_id 0, the whole buffer) and sends the
   single byte ``G``; the client waits for it;
5. the client copies "hello from RDMA client" into its buffer and posts one
   signaled IBV_WR_RDMA_WRITE_WITH_IMM (wr_id 1) of strlen+1 = 23 bytes (the
   NUL included) to the server's addr/rkey, immediate 0x52444d41 ("RDMA");
6. both poll their CQ; the server prints the completion (opcode 129 =
   IBV_WC_RECV_RDMA_WITH_IMM, the immediate, the length) and the buffer.

The GID index: the C program hard-codes 1 (the IPv4 RoCE v2 GID on rxe).
Here it is the device's default (the first RoCE v2 GID with an IPv4
address: 1 on rxe, 0 on the soft device) unless ``--gid-index`` is given.
Unlike the C program, waiting for the peer or a completion gives up after
``--timeout`` seconds once the TCP connection is up, and the resources are
destroyed at the end.
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
import time

from aiordma.errors import RDMAError
from aiordma.providers import open_device
from aiordma.providers.base import (
    MTU,
    SGE,
    Access,
    QPAttr,
    QPCap,
    RecvWR,
    SendFlags,
    SendWR,
    WCOpcode,
    WCStatus,
    WorkCompletion,
    WROpcode,
    gid_str,
)
from aiordma.security import is_loopback_address
from aiordma.tools import int_type, port_number, seconds

BUF_SIZE = 4096
PORT_NUM = 1
TCP_PORT = 18515
IMM_MAGIC = 0x52444D41
MESSAGE = b"hello from RDMA client"

#: struct handshake, native byte order and standard sizes: 4 + 4 + 8 + 16 = 32 bytes, no padding
HANDSHAKE = struct.Struct("=IIQ16s")
assert HANDSHAKE.size == 32


class Endpoint:
    """The C program's ``struct endpoint``: every RDMA resource of one side."""

    def __init__(self, provider: str | None, device: str | None, gid_index: int | None) -> None:
        # 1. the first device (like ibv_get_device_list()[0]); the provider picks it
        self.ctx = open_device(provider, device)
        print(f"device: {self.ctx.name} ({self.ctx.provider})", flush=True)
        # 2. a protection domain for the QP and the MR
        self.pd = self.ctx.alloc_pd()
        # 3. a zeroed buffer, registered: local write + remote write + remote read
        self.buf = bytearray(BUF_SIZE)
        self.mr = self.pd.reg_mr(
            self.buf, Access.IBV_ACCESS_LOCAL_WRITE | Access.IBV_ACCESS_REMOTE_WRITE | Access.IBV_ACCESS_REMOTE_READ
        )
        # 4. a completion queue of 16 entries, polled (no completion channel)
        self.cq = self.ctx.create_cq(16, None)
        # 5. an RC queue pair, both queues on the same CQ
        self.qp = self.pd.create_qp(
            self.cq, self.cq, QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=1, max_recv_sge=1)
        )
        # 6. our GID: the address on RoCE
        self.gid_index = self.ctx.default_gid_index(PORT_NUM) if gid_index is None else gid_index
        self.gid = bytes(self.ctx.query_gid(PORT_NUM, self.gid_index).gid)
        # 7. what the peer needs to know
        self.qpn = self.qp.qp_num
        self.rkey = self.mr.rkey
        self.addr = self.mr.addr
        print(f"QPN={self.qpn} rkey=0x{self.rkey:x} addr=0x{self.addr:x}", flush=True)
        print(f"GID[{self.gid_index}]={gid_str(self.gid)}", flush=True)

    def handshake(self) -> bytes:
        return HANDSHAKE.pack(self.qpn, self.rkey, self.addr, self.gid)

    def qp_to_rts(self, peer_qpn: int, peer_gid: bytes) -> None:
        """RESET -> INIT -> RTR -> RTS with the C program's attributes."""
        # RESET -> INIT: port, partition key, what the peer may do
        self.qp.to_init(
            QPAttr(
                port_num=PORT_NUM,
                pkey_index=0,
                qp_access_flags=Access.IBV_ACCESS_REMOTE_WRITE | Access.IBV_ACCESS_REMOTE_READ,
            )
        )
        # INIT -> RTR: who the peer is and the path MTU
        self.qp.to_rtr(
            QPAttr(
                port_num=PORT_NUM,
                path_mtu=MTU.IBV_MTU_1024,
                dest_qp_num=peer_qpn,
                rq_psn=0,
                max_dest_rd_atomic=1,
                min_rnr_timer=12,
                dgid=peer_gid,
                sgid_index=self.gid_index,
                hop_limit=64,
            )
        )
        # RTR -> RTS: now it may send
        self.qp.to_rts(QPAttr(port_num=PORT_NUM, timeout=14, retry_cnt=7, rnr_retry=7, sq_psn=0, max_rd_atomic=1))

    def wait_cq(self, timeout: float) -> WorkCompletion:
        """Poll the CQ for one completion (the C program spins forever; this gives up)."""
        deadline = time.monotonic() + timeout
        while True:
            wcs = self.cq.poll(1)
            if wcs:
                wc = wcs[0]
                if wc.status != WCStatus.IBV_WC_SUCCESS:
                    raise RDMAError(f"completion with status {_name(WCStatus, wc.status)}: {wc!r}")
                return wc
            if time.monotonic() > deadline:
                raise RDMAError(f"no completion within {timeout:g} s")
            time.sleep(0.0002)

    def close(self) -> None:
        for obj in (self.qp, self.mr, self.cq, self.pd, self.ctx):
            try:
                obj.close()
            except Exception:
                pass


def _name(cls: type, value: int) -> str:
    try:
        return cls(value).name  # type: ignore[call-arg]
    except ValueError:
        return str(value)


def tcp_read(sock: socket.socket, n: int) -> bytes:
    """Read exactly n bytes (short reads handled), like the C program's tcp_read."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the TCP connection")
        buf += chunk
    return bytes(buf)


def run_server(ip: str, port: int, args: argparse.Namespace) -> int:
    ep = Endpoint(args.provider, args.device, args.gid_index)
    lsock = cfd = None
    try:
        # 1. TCP listen, wait for the client
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((ip, port))
        lsock.listen(1)
        print(f"waiting for a client on {ip}:{lsock.getsockname()[1]} ...", flush=True)
        cfd, _ = lsock.accept()  # waits for a client as long as it takes, like the C program
        cfd.settimeout(args.timeout)
        # 2. handshake: ours first, then the peer's
        cfd.sendall(ep.handshake())
        peer_qpn, peer_rkey, peer_addr, peer_gid = HANDSHAKE.unpack(tcp_read(cfd, HANDSHAKE.size))
        print(f"peer: QPN={peer_qpn} rkey=0x{peer_rkey:x} addr=0x{peer_addr:x} GID={gid_str(peer_gid)}", flush=True)
        # 3. QP to RTS
        ep.qp_to_rts(peer_qpn, peer_gid)
        # 4. a receive first: RDMA_WRITE_WITH_IMM consumes it and makes a completion
        ep.qp.post_recv(RecvWR(0, [SGE(ep.mr.addr, BUF_SIZE, ep.mr.lkey)]))
        # 5. tell the client it may go
        cfd.sendall(b"G")
        # 6. wait for the data
        wc = ep.wait_cq(args.timeout)
        print(
            f"completion: opcode={int(wc.opcode)} ({_name(WCOpcode, wc.opcode)}) imm=0x{(wc.imm_data or 0):x} "
            f"length={wc.byte_len}",
            flush=True,
        )
        text = bytes(ep.buf[: wc.byte_len]).split(b"\0", 1)[0]  # printf("%.*s") stops at the NUL
        print(f"buffer: {text.decode(errors='replace')}", flush=True)
        return 0
    except (RDMAError, OSError) as e:
        print(f"server failed: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        for s in (cfd, lsock):
            if s is not None:
                s.close()
        ep.close()


def run_client(ip: str, port: int, args: argparse.Namespace) -> int:
    ep = Endpoint(args.provider, args.device, args.gid_index)
    sock = None
    try:
        # 1. connect to the server
        sock = socket.create_connection((ip, port), timeout=args.timeout)
        # 2. handshake: ours first, then the peer's
        sock.sendall(ep.handshake())
        peer_qpn, peer_rkey, peer_addr, peer_gid = HANDSHAKE.unpack(tcp_read(sock, HANDSHAKE.size))
        print(f"peer: QPN={peer_qpn} rkey=0x{peer_rkey:x} addr=0x{peer_addr:x} GID={gid_str(peer_gid)}", flush=True)
        # 3. QP to RTS
        ep.qp_to_rts(peer_qpn, peer_gid)
        # 4. wait until the server has posted its receive
        if tcp_read(sock, 1) != b"G":
            raise ConnectionError("the server did not say 'G'")
        # 5. the message into our registered buffer: from here the NIC reads it by DMA
        msg = MESSAGE + b"\0"  # strncpy + strlen(msg) + 1: the NUL goes too
        ep.buf[: len(msg)] = msg
        # 6. RDMA Write with immediate, to the address and with the key from the handshake
        ep.qp.post_send(
            SendWR(
                wr_id=1,
                opcode=WROpcode.IBV_WR_RDMA_WRITE_WITH_IMM,
                sg_list=[SGE(ep.mr.addr, len(msg), ep.mr.lkey)],
                send_flags=SendFlags.IBV_SEND_SIGNALED,
                imm_data=IMM_MAGIC,  # host order here; the provider puts it on the wire big-endian (htonl)
                remote_addr=peer_addr,
                rkey=peer_rkey,
            )
        )
        # 7. wait for our own completion (the peer got it: RC acknowledged it)
        ep.wait_cq(args.timeout)
        print(f"write complete: {len(msg)} bytes written to the peer", flush=True)
        return 0
    except (RDMAError, OSError) as e:
        print(f"client failed: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if sock is not None:
            sock.close()
        ep.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="One RDMA_WRITE_WITH_IMM between two processes over raw verbs (twin of rdma_write_demo.c).",
    )
    parser.add_argument("role", choices=("server", "client"))
    parser.add_argument("ip", help="server: address to listen on (0.0.0.0); client: the server's address")
    parser.add_argument(
        "port", type=port_number, nargs="?", default=TCP_PORT, help=f"TCP port of the handshake (default {TCP_PORT})"
    )
    parser.add_argument(
        "--provider", choices=("auto", "soft", "pyverbs"), default=None, help="device provider (default auto)"
    )
    parser.add_argument("--device", default=None, help="device name (e.g. rxe0); default: the provider's first")
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="server: listen beyond loopback, although the C handshake authenticates nobody",
    )
    parser.add_argument(
        "--gid-index",
        type=int_type(0),
        default=None,
        help="source GID index (default: the device's; the C program uses 1)",
    )
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=60.0,
        help="once connected, give up on the peer or a completion after this many seconds (default 60)",
    )
    args = parser.parse_args(argv)
    if args.role == "client" and args.port == 0:
        parser.error("port 0 means any free port, for the server: give the server's port")
    if args.role == "server" and not args.insecure and not is_loopback_address(args.ip):
        parser.error(
            f"server {args.ip}: the C handshake authenticates nobody and its buffer grants REMOTE_WRITE to whoever "
            "connects: listen on 127.0.0.1, or pass --insecure to listen beyond loopback"
        )
    try:
        if args.role == "server":
            return run_server(args.ip, args.port, args)
        return run_client(args.ip, args.port, args)
    except RDMAError as e:
        print(f"{args.role} failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
