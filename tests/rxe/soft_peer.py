"""The soft-device end of test_soft_rxe.py, run inside the soft network
namespace (``ip netns exec ... python soft_peer.py``).

It serves one aiordma connection on a SoftDevice bound to ``--address`` and
follows the kernel side's commands (messages on the connection):

``dump OFF LEN``  reply with LEN bytes of the exposed ``mem`` from OFF
``imm``           reply "VALUE LENGTH" of the next Write-with-immediate
``echo DATA``     reply DATA
``drive``         become the requester: write / write-with-imm / read / atomics
                  against the peer's exposed ``cmem``, reply a JSON report
``bye``           finish

Prints a JSON line ``{"ready": ..., "port": ...}`` when listening and a JSON
line ``{"counters": ..., "capture": N}`` at the end. With ``--capture IFACE
FILE`` every RoCEv2 frame crossing IFACE (both directions; AF_PACKET with
ETH_P_ALL, which also sees outgoing frames) is saved to FILE (pickle of
(outgoing, ip_packet_bytes)).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import socket
import struct
import sys
import threading
import time

import aiordma
from aiordma.providers.soft.device import SoftDevice

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4


class Capture(threading.Thread):
    def __init__(self, iface: str, path: str, limit: int = 3000) -> None:
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.bind((iface, 0))
        self.sock.settimeout(0.1)
        self.path = path
        self.limit = limit
        self.frames: list[tuple[bool, bytes]] = []
        self.stopping = False

    def run(self) -> None:
        while not self.stopping:
            try:
                data, addr = self.sock.recvfrom(65535)
            except TimeoutError:
                continue
            except OSError:
                return
            if len(data) < 14 + 28 or data[12:14] != b"\x08\x00":
                continue
            ip = data[14:]
            ihl = (ip[0] & 15) * 4
            if ip[9] != 17 or len(ip) < ihl + 8:
                continue
            sport, dport = struct.unpack_from(">HH", ip, ihl)
            if 4791 in (sport, dport) and len(self.frames) < self.limit:
                self.frames.append((addr[2] == PACKET_OUTGOING, bytes(ip)))

    def stop(self) -> int:
        self.stopping = True
        self.join(2)
        self.sock.close()
        with open(self.path, "wb") as f:
            pickle.dump(self.frames, f)
        return len(self.frames)


def pattern(n: int, seed: int) -> bytes:
    return bytes((i * 13 + seed) & 0xFF for i in range(256)) * (n // 256 + 1)


async def drive(conn: aiordma.Connection) -> dict:
    """The soft device as requester against the kernel's memory."""
    rb = conn.remote("cmem")
    mtu = conn.mtu
    report: dict = {"mtu": mtu}
    data = pattern(3 * mtu + 5, 1)[: 3 * mtu + 5]
    t0 = time.monotonic()
    await conn.write(data, rb[0:])
    await conn.write(b"imm from soft", rb[100_000:], imm=0xC0FFEE)
    report["read_back"] = (await conn.read(rb[0 : len(data)])) == data
    big = pattern(200_000, 2)[:200_000]
    await conn.write(big, rb[200_000:])
    report["read_big"] = (await conn.read(rb[200_000:400_000])) == big
    word = rb[1 << 16 : (1 << 16) + 8]
    report["faa"] = await conn.fetch_and_add(word, 5)
    report["cas"] = await conn.compare_and_swap(word, 105, 7)
    report["cas_miss"] = await conn.compare_and_swap(word, 105, 8)
    report["seconds"] = round(time.monotonic() - t0, 3)
    return report


async def serve(args: argparse.Namespace) -> int:
    cap = Capture(args.capture[0], args.capture[1]) if args.capture else None
    if cap is not None:
        cap.start()
    dev = SoftDevice(args.address, icrc=args.icrc)
    # the link cuts every batch as it leaves (gso_max_segs 1), a rule the device does not
    # learn and so does not batch on by itself: batches forced, to check on the wire that
    # segment k leaves with IP ID k and kernel rxe accepts its ICRC
    assert dev.gso_rule.batches == "segmented", dev.gso_rule
    dev.gso = True
    mem = bytearray(1 << 20)
    region = aiordma.register(mem, device=dev)
    finished: asyncio.Future = asyncio.get_running_loop().create_future()

    async def handler(conn: aiordma.Connection) -> None:
        try:
            async for msg in conn:
                cmd, _, arg = bytes(msg).partition(b" ")
                if cmd == b"dump":
                    off, n = map(int, arg.split())
                    await conn.send(bytes(mem[off : off + n]))
                elif cmd == b"imm":
                    note = await asyncio.wait_for(conn.recv_immediate(), 30)
                    await conn.send(f"{note.value} {note.length}".encode())
                elif cmd == b"echo":
                    await conn.send(arg)
                elif cmd == b"drive":
                    await conn.send(json.dumps(await drive(conn)).encode())
                elif cmd == b"counters":
                    await conn.send(json.dumps(dev.counters).encode())
                elif cmd == b"bye":
                    await conn.send(b"bye", wait_ack=True)
                    break
            if not finished.done():
                finished.set_result(None)
        except BaseException as e:
            if not finished.done():
                finished.set_exception(e)
            raise

    ip = dev.address[0]
    server = await aiordma.start_server(
        handler,
        ip,
        args.port,
        device=dev,
        expose={"mem": region.exposed("rwa")},
        insecure=True,
        traffic_class=args.traffic_class,
    )
    print(json.dumps({"ready": True, "port": server.port, "address": list(dev.address), "icrc": args.icrc}), flush=True)
    rc = 0
    try:
        await asyncio.wait_for(finished, args.timeout)
    except BaseException as e:  # report, do not hang
        print(f"soft_peer: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        rc = 1
    server.close()
    await server.wait_closed()
    n = cap.stop() if cap is not None else 0
    print(json.dumps({"counters": dev.counters, "capture": n}), flush=True)
    region.close()
    dev.close()
    return rc


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True, help="IP[:PORT] of the soft device")
    p.add_argument("--port", type=int, default=0, help="TCP port of the aiordma server")
    p.add_argument("--icrc", default="any-ip-id")
    p.add_argument("--capture", nargs=2, metavar=("IFACE", "FILE"))
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--traffic-class", type=int, default=None, help="the connections' IP traffic class")
    args = p.parse_args()
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
