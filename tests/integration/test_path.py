"""A connection's path over the soft device: the traffic class and hop limit
its packets carry (seen by a raw capture on the loopback interface, as tcpdump
sees them), the path MTU the rendezvous negotiates, the GID it chooses, and
``conn.path``, which says what was chosen and why. Real UDP, real TCP
rendezvous, both soft-device engines, both event loops."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections import Counter
from typing import NamedTuple

import pytest

import aiordma
from aiordma import GIDError
from aiordma.providers.soft.device import SoftDevice
from aiordma.providers.soft.engine import native_status

from ..support.roce_oracle import PacketCapture
from ..support.waiting import wait_until

ENGINES = ("python", "native") if native_status()[0] else ("python",)
ROCE_PORT = 4791


class Datagram(NamedTuple):
    tos: int
    ttl: int
    sport: int
    dport: int
    src: str
    dst: str


class LoopbackCapture(PacketCapture):
    """Every IPv4/UDP packet on ``lo`` (an AF_PACKET socket, as tcpdump opens
    one), kept as a :class:`Datagram`. Tests pick theirs by address: another
    test's device in this process, or another process's, may still be sending."""

    def __init__(self) -> None:
        super().__init__("lo")

    def _take(self, frame: bytes, addr: tuple) -> None:
        if addr[2] == socket.PACKET_OUTGOING:  # each loopback frame is seen going out and coming in
            return
        if len(frame) < 42 or frame[12:14] != b"\x08\x00" or frame[23] != 17:
            return
        ip = frame[14:]
        ihl = (ip[0] & 0x0F) * 4
        sport, dport = struct.unpack(">HH", ip[ihl : ihl + 4])
        src, dst = socket.inet_ntoa(ip[12:16]), socket.inet_ntoa(ip[16:20])
        self.frames.append(Datagram(ip[1], ip[8], sport, dport, src, dst))


@pytest.fixture
def capture(loopback_turn):
    try:
        cap = LoopbackCapture()
    except PermissionError:
        pytest.skip("a raw capture needs CAP_NET_RAW (CI runs as root)")
    yield cap
    cap.stop()


@pytest.fixture(params=ENGINES)
def engine(request):
    return request.param


@contextlib.asynccontextmanager
async def echo_server(device, **options):
    async def handler(conn):
        async for message in conn:
            await conn.send(message)

    server = await aiordma.start_server(handler, "127.0.0.1", 0, device=device, **options)
    try:
        yield server
    finally:
        server.close()
        await server.wait_closed()


def _roce(packets, *, to_server_port=None):
    return [p for p in packets if ROCE_PORT in (p[2], p[3]) or to_server_port in (p[2], p[3])]


async def test_every_packet_carries_its_connections_traffic_class_and_hop_limit(capture, engine):
    """Two connections with different classes share the client's soft device (one
    UDP socket): each one's packets, both ways, carry its own DSCP/ECN and TTL; the
    server's side takes the class its own options name."""
    server_dev = SoftDevice("127.0.0.41:4791", engine=engine)
    client_dev = SoftDevice("127.0.0.42:4791", engine=engine)
    try:
        mem = bytearray(1 << 16)
        region = aiordma.register(mem, device=server_dev)
        async with echo_server(server_dev, expose={"m": region.exposed("rw")}, traffic_class=26 << 2) as server:
            a = await aiordma.connect("127.0.0.1", server.port, device=client_dev, traffic_class=46 << 2, hop_limit=17)
            b = await aiordma.connect("127.0.0.1", server.port, device=client_dev)
            async with a, b:
                assert (a.path.address_vector.dscp, a.path.address_vector.hop_limit) == (46, 17)
                assert (b.path.traffic_class, b.path.address_vector.hop_limit) == (0, 64)
                for conn, payload in ((a, b"a" * 70000), (b, b"b" * 70000)):
                    await conn.send(payload)
                    assert await conn.recv() == payload
                    await conn.write(payload[:5000], conn.remote("m")[0:5000])
                    assert await conn.read(conn.remote("m")[0:64]) == payload[:64]
        region.close()
    finally:
        packets = capture.stop()
        client_dev.close()
        server_dev.close()
    # datagrams between the two soft devices (ports 4791 on 127.0.0.41/42): by the
    # client's source address we cannot tell a from b, so by their classes
    pair = {"127.0.0.41", "127.0.0.42"}
    roce = [(p.tos, p.ttl) for p in packets if p.sport == p.dport == ROCE_PORT and {p.src, p.dst} == pair]
    seen = Counter(roce)
    assert seen[(46 << 2, 17)] >= 4, seen  # a's requests: message, Write, Read
    assert seen[(26 << 2, 64)] >= 4, seen  # the server's side of a and b: ACKs, Read responses, replies
    assert seen[(0, 64)] >= 4, seen  # b's requests
    assert set(seen) == {(46 << 2, 17), (26 << 2, 64), (0, 64)}, seen


async def test_the_process_default_comes_from_the_environment(monkeypatch, capture):
    monkeypatch.setenv("AIORDMA_TRAFFIC_CLASS", "104")
    monkeypatch.setenv("AIORDMA_HOP_LIMIT", "5")
    dev = SoftDevice("127.0.0.43:4791")
    dev.local_delivery = False  # (both ends on one device: through its socket, where the capture sees them)
    try:
        async with echo_server(dev) as server, await aiordma.connect("127.0.0.1", server.port, device=dev) as conn:
            assert conn.path.traffic_class == 104 and conn.path.address_vector.hop_limit == 5
            await conn.send(b"x" * 10000)
            await conn.recv()
    finally:
        packets = capture.stop()
        dev.close()
    roce = {(p.tos, p.ttl) for p in packets if p.sport == p.dport == ROCE_PORT and p.src == p.dst == "127.0.0.43"}
    assert roce == {(104, 5)}


async def test_the_soft_devices_capture_file_shows_the_traffic_class(tmp_path):
    """AIORDMA_SOFT_PCAP's file (the soft device writes the IP header it sends) carries
    the connection's traffic class and hop limit."""
    pcap = tmp_path / "c.pcap"
    dev = SoftDevice("127.0.0.44:4791", capture=str(pcap))
    try:
        async with echo_server(dev) as server:
            async with await aiordma.connect(
                "127.0.0.1", server.port, device=dev, traffic_class=0x68, hop_limit=3
            ) as c:
                await c.send(b"y" * 3000)
                await c.recv()
    finally:
        dev.close()
    data = pcap.read_bytes()
    offset, fields = 24, Counter()
    while offset + 16 <= len(data):
        incl = struct.unpack_from("<I", data, offset + 8)[0]
        frame = data[offset + 16 : offset + 16 + incl]
        offset += 16 + incl
        fields[(frame[14 + 1], frame[14 + 8])] += 1
    assert fields[(0x68, 3)] >= 2, fields  # the client's requests


@pytest.mark.parametrize(
    "option, value",
    [("traffic_class", 256), ("traffic_class", -1), ("service_level", 16), ("hop_limit", 0), ("flow_label", 1 << 20)],
)
async def test_a_bad_value_is_refused_before_anything_is_made(option, value):
    dev = SoftDevice("127.0.0.45:4791")
    try:
        async with echo_server(dev) as server:
            with pytest.raises(ValueError, match=option):
                await aiordma.connect("127.0.0.1", server.port, device=dev, **{option: value})
    finally:
        dev.close()


async def test_a_bad_environment_value_names_the_variable(monkeypatch):
    dev = SoftDevice("127.0.0.46:4791")
    try:
        async with echo_server(dev) as server:
            monkeypatch.setenv("AIORDMA_TRAFFIC_CLASS", "af31")
            with pytest.raises(aiordma.SettingError, match="AIORDMA_TRAFFIC_CLASS='af31': expected a whole number"):
                await aiordma.connect("127.0.0.1", server.port, device=dev)
    finally:
        dev.close()


async def test_two_soft_devices_with_different_mtus_meet_at_the_smaller(engine):
    small = SoftDevice("127.0.0.47:4791", engine=engine, mtu=2048)
    large = SoftDevice("127.0.0.48:4791", engine=engine, mtu=16384)
    try:
        seen = []

        async def handler(conn):
            seen.append(conn)
            async for message in conn:
                await conn.send(message)

        rounds = 0
        for server_dev, client_dev in ((small, large), (large, small)):
            server = await aiordma.start_server(handler, "127.0.0.1", 0, device=server_dev)
            async with await aiordma.connect("127.0.0.1", server.port, device=client_dev) as conn:
                assert conn.path.mtu == conn.mtu == 2048
                assert "2048" in conn.path.mtu_reason
                payload = os.urandom(50000)  # many 2 KiB packets each way
                await conn.send(payload)
                assert await conn.recv() == payload
                want = rounds + 1
                await wait_until(lambda: len(seen) == want, "the server's handler started")  # noqa: B023
                assert seen[-1].path.mtu == 2048
            rounds += 1
            server.close()
            await server.wait_closed()
        # two large ones: beyond RoCE's 4096, and the path says why
        other = SoftDevice("127.0.0.49:4791", engine=engine, mtu=8192)
        try:
            server = await aiordma.start_server(handler, "127.0.0.1", 0, device=large)
            async with await aiordma.connect("127.0.0.1", server.port, device=other) as conn:
                assert conn.path.mtu == 8192 and "two soft devices" in conn.path.mtu_reason
                await wait_until(lambda: len(seen) == 3, "the server's handler started")
                assert seen[-1].path.mtu == 8192
            server.close()
            await server.wait_closed()
        finally:
            other.close()
    finally:
        small.close()
        large.close()


async def test_a_callers_mtu_cap_holds_on_both_ends(engine):
    dev = SoftDevice("127.0.0.50:4791", engine=engine)
    seen = []

    async def handler(conn):
        seen.append(conn)
        async for message in conn:
            await conn.send(message)

    try:
        server = await aiordma.start_server(handler, "127.0.0.1", 0, device=dev)
        async with await aiordma.connect("127.0.0.1", server.port, device=dev, path_mtu=1024) as conn:
            assert conn.path.mtu == 1024 and "path_mtu=1024" in conn.path.mtu_reason
            payload = os.urandom(20000)
            await conn.send(payload)
            assert await conn.recv() == payload
            await wait_until(lambda: bool(seen), "the server's handler started")
            assert seen[-1].path.mtu == 1024  # the server meets the cap the client announced
        server.close()
        await server.wait_closed()
        async with echo_server(dev) as other:
            with pytest.raises(ValueError, match="path_mtu must be from 256"):
                await aiordma.connect("127.0.0.1", other.port, device=dev, path_mtu=100)
    finally:
        dev.close()


async def test_the_path_names_the_gid_and_why():
    dev = SoftDevice("127.0.0.51:4791")
    try:
        async with echo_server(dev) as server, await aiordma.connect("127.0.0.1", server.port, device=dev) as conn:
            path = conn.path
            assert (path.gid_index, path.gid_type) == (0, "RoCE v2")
            assert path.gid.endswith("7f00:0033") and path.peer_gid.endswith("7f00:0033")
            assert "IPv4" in path.gid_reason
            assert "path MTU" in str(path) and "DSCP 0" in str(path)
            with pytest.raises(GIDError, match=r"no GID at index 3.*use GID index 0 \(RoCE v2, 127\.0\.0\.51"):
                await aiordma.connect("127.0.0.1", server.port, device=dev, gid_index=3)
    finally:
        dev.close()


async def test_a_device_is_named_or_refused():
    """``device=`` takes a device name as well as a device: the soft device by its
    name, and a name no device has is an error that lists what there is, never
    another device."""
    seen = []

    async def handler(conn):
        seen.append(conn)
        async for message in conn:
            await conn.send(message)

    server = await aiordma.start_server(handler, "127.0.0.1", 0, device="soft0")
    try:
        async with await aiordma.connect("127.0.0.1", server.port, device="soft0") as conn:
            assert conn.device.name == "soft0" and conn.device.provider == "soft"
            region = aiordma.register(bytearray(64), device="soft0")
            assert region.length == 64
            region.close()
        with pytest.raises(aiordma.DeviceNotFoundError, match=r"no RDMA device 'mlx5_9'") as refused:
            await aiordma.connect("127.0.0.1", server.port, device="mlx5_9")
        # it lists what there is, or says why pyverbs cannot look (another Python's pyverbs)
        message = str(refused.value)
        assert "this machine has:" in message or "pyverbs cannot be used here" in message, message
        with pytest.raises(aiordma.DeviceNotFoundError, match="no RDMA device 'mlx5_9'"):
            aiordma.register(bytearray(64), device="mlx5_9")
    finally:
        server.close()
        await server.wait_closed()


async def test_a_server_on_several_devices_gives_each_client_the_device_it_reached(engine):
    """A server started with a list of devices picks, for each client, the device
    whose GID is the address the client connected to (RDMA CM binds by address
    the same way), and the first one for any other address; data moves over the
    device chosen (its UDP address is the path's GID)."""
    # (addresses far from the 127.0.0.N a process's default soft device takes)
    first = SoftDevice("127.0.0.212:4791", engine=engine)
    second = SoftDevice("127.0.0.213:4791", engine=engine)
    client = SoftDevice("127.0.0.214:4791", engine=engine)
    seen = []

    async def handler(conn):
        seen.append(conn)
        async for message in conn:
            await conn.send(message)

    # every interface (so the client can reach either address), hence a token
    server = await aiordma.start_server(handler, "0.0.0.0", 0, device=[first, second], token=b"several devices")
    try:
        assert server.devices == (first, second)
        for reached, owner in (("127.0.0.213", second), ("127.0.0.212", first), ("127.0.0.1", first)):
            async with await aiordma.connect(reached, server.port, device=client, token=b"several devices") as conn:
                payload = os.urandom(100_000)
                await conn.send(payload)
                assert await conn.recv() == payload
                await wait_until(lambda: len(seen) == 1, "the server's handler started")
                served = seen.pop()
                assert served.device is owner, (reached, served.device)
                # the client's queue pair talks to the owner's address
                assert conn.path.peer_gid == served.path.gid == str(owner.query_gid(1, 0))
    finally:
        server.close()
        server.abort_clients()
        await server.wait_closed()
        for dev in (first, second, client):
            dev.close()


async def test_a_server_needs_a_device():
    with pytest.raises(ValueError, match="at least one device"):
        await aiordma.start_server(lambda conn: None, "127.0.0.1", 0, device=[])


async def test_a_device_names_its_port_as_nccl_spells_it(monkeypatch):
    """``"NAME:PORT"`` names a port of a device (``mlx5_0:2``, the spelling NCCL
    and UCX use): port 1 of the soft device is the soft device itself; a port it
    does not have, or a port that is not a number, is refused naming the value;
    ``AIORDMA_DEVICE`` takes the same spelling and is checked as every setting is."""
    async with echo_server("soft0") as server:
        async with await aiordma.connect("127.0.0.1", server.port, device="soft0:1") as conn:
            assert conn.device is aiordma.get_device("soft", "soft0")  # the same shared device
            assert conn.path.gid.startswith("0000:")
            await conn.send(b"port one")
            assert await conn.recv() == b"port one"
        with pytest.raises(aiordma.DeviceNotFoundError, match=r"soft0 has one port \(1\), not 2"):
            await aiordma.connect("127.0.0.1", server.port, device="soft0:2")
        with pytest.raises(ValueError, match=r"device 'soft0:x': expected NAME or NAME:PORT"):
            await aiordma.connect("127.0.0.1", server.port, device="soft0:x")
    monkeypatch.setenv("AIORDMA_DEVICE", "soft0:0")
    with pytest.raises(aiordma.SettingError, match=r"AIORDMA_DEVICE='soft0:0': expected a device name, or NAME:PORT"):
        aiordma.settings.check_all()


# ------------------------------------------------------ the ICRC on loopback ----


class FrameCapture(LoopbackCapture):
    """Every RoCEv2 datagram on ``lo`` between two soft devices (UDP 4791 both
    ways), kept whole: (source IP, source port, destination IP, UDP payload, IP ID)."""

    def _take(self, frame: bytes, addr: tuple) -> None:
        if addr[2] == socket.PACKET_OUTGOING or len(frame) < 42 or frame[12:14] != b"\x08\x00" or frame[23] != 17:
            return
        ip = frame[14:]
        ihl = (ip[0] & 0x0F) * 4
        sport, dport, length = struct.unpack(">HHH", ip[ihl : ihl + 6])
        if sport == dport == ROCE_PORT:
            src, dst = socket.inet_ntoa(ip[12:16]), socket.inet_ntoa(ip[16:20])
            ip_id = struct.unpack(">H", ip[4:6])[0]
            self.frames.append((src, sport, dst, bytes(ip[ihl + 8 : ihl + length]), ip_id))


@pytest.fixture
def frames(loopback_turn):
    try:
        cap = FrameCapture()
    except PermissionError:
        pytest.skip("a raw capture needs CAP_NET_RAW (CI runs as root)")
    yield cap
    cap.stop()


ENGINE_PAIRS = [(a, b) for a in ENGINES for b in ENGINES]
#: the datagram lengths of a full 32 KiB packet: READ_RESPONSE_MIDDLE, and with an AETH or RETH
FULL = (12 + 32768 + 4, 16 + 32768 + 4, 28 + 32768 + 4)


@pytest.mark.parametrize("server_engine, client_engine", ENGINE_PAIRS)
async def test_two_native_soft_devices_on_loopback_leave_the_icrc_out(frames, server_engine, client_engine):
    """Two soft devices on loopback whose engines both offer it (the native one) leave
    the ICRC out of their large datagrams and take each other's unchecked: nothing
    crosses a wire. A Python engine at either end computes and checks every ICRC, and
    so does the native one toward it; `conn.path` says which."""
    from aiordma.providers.soft import wire

    server_dev = SoftDevice("127.0.0.53:4791", engine=server_engine)
    client_dev = SoftDevice("127.0.0.54:4791", engine=client_engine)
    skip = server_engine == client_engine == "native"
    try:
        assert server_dev.skips_loopback_icrc == (server_engine == "native")
        payload = os.urandom(300_000)  # by RDMA Read: 32 KiB READ responses; and SEND chunks
        async with echo_server(server_dev) as server:
            async with await aiordma.connect("127.0.0.1", server.port, device=client_dev) as conn:
                assert conn.path.icrc.startswith("left out") == skip, conn.path.icrc
                assert ("ICRC left out" in str(conn.path)) == skip
                for message in (payload, payload[:50_000]):
                    await conn.send(message)
                    assert await conn.recv() == message
    finally:
        packets = frames.stop()
        counters = [server_dev.counters, client_dev.counters]
        client_dev.close()
        server_dev.close()
    assert all(c.get("rx_icrc_errors", 0) == 0 for c in counters)
    assert all((c.get("rx_icrc_skipped", 0) > 0) == skip for c in counters)
    # full 32 KiB packets between these two devices (not other processes' devices; and a
    # GSO batch of a full packet and a shorter last one crosses loopback as one datagram)
    large = [p for p in packets if len(p[3]) in FULL and {p[0], p[2]} == {"127.0.0.53", "127.0.0.54"}]
    assert len(large) >= 10
    for src, sport, dst, datagram, _ in large:
        flow = wire.Flow(src, dst, sport, ROCE_PORT)
        if skip:
            assert datagram[-4:] == bytes(4)  # left out
        else:
            assert wire.icrc_ok(datagram, flow)


async def test_an_end_that_does_not_offer_it_gets_every_icrc(frames, monkeypatch):
    """AIORDMA_SOFT_SKIP_LOOPBACK_ICRC=0 at one end (or a capture there): that end
    does not offer to leave the ICRC out, so neither end does."""
    if "native" not in ENGINES:
        pytest.skip("the native engine is not built")
    from aiordma.providers.soft import wire

    server_dev = SoftDevice("127.0.0.55:4791", engine="native")
    monkeypatch.setenv("AIORDMA_SOFT_SKIP_LOOPBACK_ICRC", "0")
    client_dev = SoftDevice("127.0.0.56:4791", engine="native")
    assert server_dev.skips_loopback_icrc and not client_dev.skips_loopback_icrc
    try:
        async with echo_server(server_dev) as server:
            async with await aiordma.connect("127.0.0.1", server.port, device=client_dev) as conn:
                assert conn.path.icrc == "computed and checked"
                await conn.send(os.urandom(300_000))
                await conn.recv()
    finally:
        packets = frames.stop()
        counters = [server_dev.counters, client_dev.counters]
        client_dev.close()
        server_dev.close()
    assert all(c.get("rx_icrc_skipped", 0) == 0 and c.get("rx_icrc_errors", 0) == 0 for c in counters)
    large = [p for p in packets if len(p[3]) in FULL and {p[0], p[2]} == {"127.0.0.55", "127.0.0.56"}]
    assert large and all(wire.icrc_ok(d, wire.Flow(s, t, p, ROCE_PORT)) for s, p, t, d, _ in large)


def test_a_qp_that_skips_the_icrc_checks_it_for_anyone_but_its_peer():
    """A QP whose peer agreed to leave the ICRC out takes unchecked only the datagrams
    from its peer's own address and port: a zero ICRC from another port of the same
    address (any local process can bind one) is an ICRC error, as before."""
    if "native" not in ENGINES:
        pytest.skip("the native engine is not built")
    from aiordma.errors import QueuePairStateError
    from aiordma.providers.base import ACCESS_ALL, MTU, QPAttr, QPCap
    from aiordma.providers.soft import wire

    d1, d2 = SoftDevice("127.0.0.57:4791", engine="native"), SoftDevice("127.0.0.58:4791", engine="native")
    qps = []
    try:
        for d in (d1, d2):
            pd = d.alloc_pd()
            cq = d.create_cq(16)
            qps.append((pd, cq, pd.create_qp(cq, cq, QPCap())))
        (_, _, a), (pd_b, _, b) = qps
        mem = bytearray(4096)
        mr = pd_b.reg_mr(mem, ACCESS_ALL)
        for x, y, dev in ((a, b, d2), (b, a, d1)):
            x.to_init(QPAttr(qp_access_flags=ACCESS_ALL))
            x.to_rtr(
                QPAttr(
                    dest_qp_num=y.qp_num,
                    rq_psn=0,
                    dgid=dev.query_gid().gid,
                    dport=4791,
                    path_mtu=MTU.IBV_MTU_4096,
                    skip_icrc=True,
                )
            )
            x.to_rts(QPAttr(sq_psn=0))
        # a stranger on the peer's address, another port: a Write with a zero ICRC
        pkt = wire.Packet(
            wire.Opcode.RDMA_WRITE_ONLY, dest_qp=b.qp_num, psn=0, va=mr.addr, rkey=mr.rkey, dma_len=8, payload=b"X" * 8
        )
        datagram = wire.encode_bytes(pkt, wire.Flow("127.0.0.57", "127.0.0.58", 5000))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.57", 0))
            before = d2.counters.get("rx_icrc_errors", 0)
            s.sendto(datagram[:-4] + bytes(4), ("127.0.0.58", 4791))
            deadline = time.monotonic() + 10
            while d2.counters.get("rx_icrc_errors", 0) < before + 1 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert d2.counters.get("rx_icrc_errors", 0) == before + 1
        assert mem[:8] == bytes(8) and d2.counters.get("rx_icrc_skipped", 0) == 0
        # only toward a loopback address, only on the native engine
        with pytest.raises(QueuePairStateError, match="only toward a loopback address"):
            d1.alloc_pd().create_qp(d1.create_cq(4), d1.create_cq(4), QPCap()).to_rtr(
                QPAttr(dest_qp_num=2, rq_psn=0, dgid=wire_gid("10.0.0.1"), dport=4791, skip_icrc=True)
            )
        mr.close()
    finally:
        for _, _, qp in qps:
            qp.close()
        d1.close()
        d2.close()


def wire_gid(ip: str) -> bytes:
    from aiordma.providers.base import gid_from_ipv4

    return gid_from_ipv4(ip)


def test_the_python_engine_refuses_to_skip_the_icrc():
    from aiordma.errors import QueuePairStateError
    from aiordma.providers.base import ACCESS_ALL, QPAttr, QPCap

    d = SoftDevice("127.0.0.59:4791", engine="python")
    try:
        assert not d.skips_loopback_icrc
        qp = d.alloc_pd().create_qp(d.create_cq(4), d.create_cq(4), QPCap())
        qp.to_init(QPAttr(qp_access_flags=ACCESS_ALL))
        with pytest.raises(QueuePairStateError, match="computes and checks every ICRC"):
            qp.to_rtr(QPAttr(dest_qp_num=2, rq_psn=0, dgid=d.query_gid().gid, dport=4791, skip_icrc=True))
        qp.close()
    finally:
        d.close()
