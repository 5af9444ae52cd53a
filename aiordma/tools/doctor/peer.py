"""``--peer HOST:PORT``: a rendezvous with a running aiordma server, a
1-byte RDMA Read and Write (or a send/recv echo), and whether a NAT sits in
between (RoCEv2 cannot cross one)."""

from __future__ import annotations

import argparse
import asyncio
import errno
import ipaddress
import os
import socket
import time
from typing import Any

from ... import settings
from .plan import Context
from .report import FAIL, OK, SKIP, WARN, Check, _ms


def _parse_peer(text: str) -> tuple[str, int]:
    """``--peer``'s ``HOST:PORT`` (checked already by the command line's type)."""
    from .. import host_port

    try:
        return host_port(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--peer {e}") from None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _resolve(host: str) -> str | None:
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])
    except (OSError, IndexError):
        return None


async def check_peer(ctx: Context) -> list[Check]:
    from ...errors import AuthenticationError, HandshakeTimeoutError, RDMAError, RendezvousError
    from ...providers.base import gid_to_ipv4

    if not ctx.opts.peer:
        return [
            Check(
                "NAT",
                SKIP,
                "no --peer given. RoCEv2 cannot cross NAT: the ICRC covers IP header fields NAT rewrites, and the "
                "GID names the real address; keep RDMA peers on one routed network",
                "",
            )
        ]
    p = ctx.probe
    host, port = _parse_peer(ctx.opts.peer)
    timeout = ctx.opts.timeout
    note = ""
    dev = None
    try:
        if ctx.plan.provider == "soft":
            addr = settings.SOFT_ADDR.get(p.env)
            if addr is None and not _is_loopback(host):
                src = p.route_source(_resolve(host) or host)
                if src:
                    addr = src
                    note = (
                        f"; local soft device bound at {src}:4791, the address that routes to the peer "
                        f"(set AIORDMA_SOFT_ADDR={src} for your programs)"
                    )
            dev = p.open_soft(addr)
        else:
            dev = p.open_pyverbs(ctx.plan.device)
    except Exception as e:
        return [Check("peer rendezvous", FAIL, f"cannot open the local device for the peer test: {e}", "see above")]
    checks: list[Check] = []
    conn = None
    try:
        t0 = time.perf_counter()
        try:
            conn = await p.connect(
                host,
                port,
                device=dev,
                token=ctx.opts.token,
                timeout=timeout,
                recv_buffers=4,
                recv_buffer_size=4096,
            )
        except AuthenticationError as e:
            return [
                Check(
                    "peer rendezvous", FAIL, f"{host}:{port}: {e}", "use the server's token: --token T or AIORDMA_TOKEN"
                )
            ]
        except HandshakeTimeoutError as e:
            return [
                Check(
                    "peer rendezvous",
                    FAIL,
                    f"{host}:{port}: {e}",
                    "is it an aiordma server? a firewall dropping TCP, or a server too busy to answer",
                )
            ]
        except RendezvousError as e:
            cause = e.__cause__
            code = getattr(cause, "errno", None)
            if isinstance(cause, ConnectionRefusedError) or code == errno.ECONNREFUSED:
                seen = f"{host}:{port}: connection refused: nothing listens there (is the aiordma server running?)"
            elif code in (errno.EHOSTUNREACH, errno.ENETUNREACH):
                seen = f"{host}:{port}: {os.strerror(code).lower()}: no route to the peer"
            else:
                seen = f"{host}:{port}: {e}"
            return [
                Check(
                    "peer rendezvous",
                    FAIL,
                    seen,
                    f"start the server, or check HOST:PORT (`ss -tlnp 'sport = :{port}'` on the peer) and that a "
                    f"firewall lets TCP {port} through",
                )
            ]
        except (RDMAError, OSError, ValueError) as e:
            return [Check("peer rendezvous", FAIL, f"{host}:{port}: {type(e).__name__}: {e}", "see the checks above")]
        t_rdv = time.perf_counter() - t0
        peer = conn.peer
        peer_ip = gid_to_ipv4(peer.gid)
        local_ip, local_port = dev.address if hasattr(dev, "address") else (gid_to_ipv4(conn.gid), dev.udp_port)
        checks.append(
            Check(
                "peer rendezvous",
                OK,
                f"{host}:{port} in {_ms(t_rdv)}: peer QP 0x{peer.qpn:06x} on {peer.provider} at "
                f"{peer_ip or peer.gid.hex()}:{peer.port}, MTU {peer.mtu}; exposed: "
                f"{', '.join(conn.remote_buffers) or 'no buffers'}; local {getattr(dev, 'name', '?')} at "
                f"{local_ip}:{local_port}{note}",
                "",
                {"seconds": t_rdv, "peer_ip": peer_ip, "peer_port": peer.port, "local": f"{local_ip}:{local_port}"},
            )
        )
        checks.append(await _peer_io(conn, timeout))
        checks.append(_nat_check(host, peer_ip, local_ip))
    finally:
        if conn is not None:
            try:
                await conn.close(timeout=1.0)
            except Exception:
                conn.abort()
        if dev is not None:
            dev.close()
    return checks


async def _peer_io(conn: Any, timeout: float) -> Check:
    from ...errors import RDMAError

    # a buffer the peer lets us read (its rights, when it said them: a read-only
    # exposure must not be written, or its NIC refuses with IBV_WC_REM_ACCESS_ERR)
    readable = [b for b in conn.remote_buffers.values() if b.length > 0 and (b.rights is None or "r" in b.rights)]
    rb = next((b for b in readable if b.rights is None or "w" in b.rights), readable[0] if readable else None)
    if rb is not None:
        name = rb.name or "?"
        one = rb.at(0, 1)
        step = "RDMA Read"
        t_write: float | None = None
        try:
            t0 = time.perf_counter()
            data = await asyncio.wait_for(conn.read(one), timeout)
            t_read = time.perf_counter() - t0
            if rb.rights is None or "w" in rb.rights:
                step = "RDMA Write"
                t0 = time.perf_counter()
                await asyncio.wait_for(conn.write(data, one), timeout)
                t_write = time.perf_counter() - t0
        except TimeoutError:
            return Check(
                "peer RDMA",
                FAIL,
                f"1-byte {step} on buffer {name!r} got no completion within {timeout} s",
                "RoCEv2 packets do not get through: UDP 4791 blocked by a firewall, a GID that does not route, or NAT",
            )
        except RDMAError as e:
            return Check(
                "peer RDMA",
                FAIL,
                f"1-byte {step} on buffer {name!r} failed: {e}",
                "IBV_WC_RETRY_EXC_ERR: UDP 4791 blocked or the GID does not route; IBV_WC_REM_ACCESS_ERR: the peer's "
                "region lacks REMOTE_READ/REMOTE_WRITE",
            )
        written = (
            f"RDMA Write of the same byte back: {_ms(t_write)}"
            if t_write is not None
            else "no RDMA Write (the peer exposes it read-only)"
        )
        return Check(
            "peer RDMA",
            OK,
            f"1-byte RDMA Read of buffer {name!r}: {_ms(t_read)}; {written}",
            "",
            {"buffer": name, "read_seconds": t_read, "write_seconds": t_write},
        )
    msg = b"aiordma doctor ping"
    try:
        t0 = time.perf_counter()
        await asyncio.wait_for(conn.send(msg), timeout)
        reply = await asyncio.wait_for(conn.recv(), timeout)
        dt = time.perf_counter() - t0
    except TimeoutError:
        return Check(
            "peer RDMA",
            WARN,
            f"the peer exposes no buffer and did not echo a message within {timeout} s: the rendezvous and the QP "
            "set-up worked, but no RDMA traffic could be checked",
            "expose a buffer on the server (start_server(..., expose={'name': region}), read-only) or run an echo "
            "handler",
        )
    except RDMAError as e:
        return Check(
            "peer RDMA",
            FAIL,
            f"send/recv round trip failed: {e}",
            "IBV_WC_RETRY_EXC_ERR: RoCEv2 packets do not get through (UDP 4791 firewall, GID not routable, NAT)",
        )
    if reply != msg:
        return Check("peer RDMA", WARN, f"the peer answered {reply[:40]!r} instead of echoing", "")
    return Check(
        "peer RDMA",
        OK,
        f"the peer exposes no buffer; send/recv echo round trip: {_ms(dt)}",
        "",
        {"echo_seconds": dt},
    )


def _nat_check(host: str, peer_ip: str | None, local_ip: str | None) -> Check:
    reached = _resolve(host) or host
    data = {"reached": reached, "peer_gid_ip": peer_ip, "local_ip": local_ip}
    if peer_ip is None:
        return Check("NAT", SKIP, "the peer's GID carries no IPv4 address (IPv6 GID): not checked", "", data)
    if _is_loopback(reached) and _is_loopback(peer_ip):
        return Check("NAT", OK, f"peer on this host ({reached}, RDMA at {peer_ip}): no NAT", "", data)
    if reached != peer_ip:
        return Check(
            "NAT",
            WARN,
            f"reached the rendezvous at {reached} but the peer's RDMA address (its GID) is {peer_ip}: a NAT or port "
            "forward in between? RoCEv2 cannot cross NAT (the ICRC covers the IP header fields NAT rewrites)",
            "put both ends on one routed network (VPN/overlay without NAT) and connect to the address the peer's "
            "RDMA device uses",
            data,
        )

    def private(ip: str | None) -> bool | None:
        try:
            return ipaddress.ip_address(ip).is_private if ip else None
        except ValueError:
            return None

    if local_ip and private(local_ip) != private(peer_ip):
        return Check(
            "NAT",
            WARN,
            f"local RDMA address {local_ip} and peer {peer_ip} are on different sides of private/public addressing: "
            "traffic between them usually crosses NAT, which breaks the RoCEv2 ICRC",
            "use addresses on one routed network without NAT",
            data,
        )
    return Check("NAT", OK, f"peer RDMA address {peer_ip} is the address the rendezvous reached: no NAT seen", "", data)
