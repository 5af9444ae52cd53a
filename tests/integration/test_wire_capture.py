"""The wire as a capture sees it, checked by an ICRC oracle independent of the engine.

A RoCEv2 packet is right when its ICRC matches the IP header it actually carries:
what kernel rxe, a RoCE NIC or Wireshark check. These tests capture live traffic
between two soft devices (an ``AF_PACKET`` socket, as tcpdump opens; root) and
check every packet with :mod:`tests.support.roce_oracle`, over every packet kind:
sends, Writes, Reads and their responses, atomics and their acknowledgements,
ACKs and a NAK; on both engines and both event loops.

On loopback the kernel hands a UDP GSO batch to the receiving socket whole (lo
offloads UDP segmentation): a capture would see the batch, not its packets, so
the devices pause batching while one listens, and every captured packet is a
datagram of its own with IP ID 0. Without a capture the batches flow, and a
receiver takes each one whole (UDP_GRO) and checks packet k for IP ID k: it never
infers an ID. Where the kernel cuts a batch as it leaves (a veth that takes one
segment per packet, in two network namespaces), the segments of batches of every
length carry IP IDs 0, 1, 2, ... and each ICRC is exact for its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest

import aiordma
from aiordma.providers.soft.device import SoftDevice
from aiordma.providers.soft.engine import native_status

from ..support import netns
from ..support.roce_oracle import PacketCapture, icrc_matches

# captures on lo, and counts of batches there: one test of this host at a time (another
# process's capture would pause the batches; CI runs two suites at once)
pytestmark = pytest.mark.usefixtures("loopback_turn")

ENGINES = ("python", "native") if native_status()[0] else ("python",)
ENGINE_PAIRS = [(a, b) for a in ENGINES for b in ENGINES]
#: what the traffic below puts on the wire
KINDS = {
    "send",
    "write",
    "read request",
    "read response",
    "acknowledge",
    "nak",
    "compare and swap",
    "fetch and add",
    "atomic acknowledge",
}


@pytest.fixture
def live_capture():
    try:
        cap = PacketCapture("lo")
    except PermissionError:
        pytest.skip("a live capture needs CAP_NET_RAW (CI runs as root)")
    yield cap
    cap.stop()


async def every_kind_of_packet(server_dev: SoftDevice, client_dev: SoftDevice) -> None:
    """Sends, Writes, Reads, atomics (one packet and many), then a Write with a wrong
    rkey that the responder NAKs, between a server on ``server_dev`` and a client on
    ``client_dev``."""
    mem = bytearray(4 << 20)
    region = aiordma.register(mem, device=server_dev)

    async def echo(conn: aiordma.Connection) -> None:
        async for message in conn:
            await conn.send(message)

    server = await aiordma.start_server(echo, "127.0.0.1", 0, device=server_dev, expose={"mem": region.exposed("rwa")})
    try:
        async with await aiordma.connect("127.0.0.1", server.port, device=client_dev) as conn:
            remote = conn.remote("mem")
            for message in (b"x" * 64, os.urandom(300_000)):
                await conn.send(message)
                assert await conn.recv() == message
            big = os.urandom(1 << 20)
            await conn.write(b"small write", remote[0:11])
            await conn.write(big, remote[1 << 20 : 2 << 20])
            assert await conn.read(remote[0:11]) == b"small write"
            assert await conn.read(remote[1 << 20 : 2 << 20]) == big
            # many small Writes in one go: one dispatch's packets may leave as one batch
            await conn.write_batch([(bytes([i]) * 256, remote[3 << 20 :][i * 256 : (i + 1) * 256]) for i in range(32)])
            assert mem[3 << 20 : (3 << 20) + 512] == bytes(256) * 0 + bytes([0]) * 256 + bytes([1]) * 256
            word = remote[2 << 20 : (2 << 20) + 8]
            assert await conn.compare_and_swap(word, 0, 41) == 0
            assert await conn.fetch_and_add(word, 1) == 41
        conn = await aiordma.connect("127.0.0.1", server.port, device=client_dev)
        try:
            good = conn.remote("mem")
            with pytest.raises(aiordma.RemoteAccessError):
                await conn.write(b"refused", aiordma.RemoteBuffer(good.addr, 7, good.rkey ^ 0x5A5A))
        finally:
            await conn.close()
    finally:
        server.close()
        await server.wait_closed()
        region.close()


def between(frames, a: SoftDevice, b: SoftDevice):
    ends = {a.address[0], b.address[0]}
    return [f for f in frames if {f.src, f.dst} == ends]


@pytest.mark.parametrize("server_engine, client_engine", ENGINE_PAIRS)
async def test_every_packet_a_capture_sees_is_exact(live_capture, monkeypatch, server_engine, client_engine):
    """Under a live capture on lo, every RoCEv2 packet between two soft devices (ICRCs
    computed: AIORDMA_SOFT_SKIP_LOOPBACK_ICRC=0) is one datagram with IP ID 0 and an
    ICRC that the oracle finds right for the header it carries; no receiver inferred
    an IP ID; batching paused for the capture."""
    monkeypatch.setenv("AIORDMA_SOFT_SKIP_LOOPBACK_ICRC", "0")
    index = 2 * ENGINES.index(server_engine) + ENGINES.index(client_engine)
    server_dev = SoftDevice(f"127.0.0.{71 + 2 * index}:4791", engine=server_engine)
    client_dev = SoftDevice(f"127.0.0.{72 + 2 * index}:4791", engine=client_engine)
    try:
        assert client_dev.gso and client_dev.gso_rule.pause_under_capture
        assert client_dev.capture_listening() and client_dev.gso_paused
        await every_kind_of_packet(server_dev, client_dev)
        counters = [server_dev.counters, client_dev.counters]
    finally:
        frames = between(live_capture.stop(), server_dev, client_dev)
        server_dev.close()
        client_dev.close()
    assert len(frames) > 100  # (32 KiB packets on loopback)
    wrong = [f for f in frames if not icrc_matches(f)]
    assert not wrong, f"{len(wrong)} of {len(frames)} packets carry a wrong ICRC: {Counter(f.kind for f in wrong)}"
    assert {f.ip_id for f in frames} == {0}
    assert all(f.dont_fragment for f in frames)
    assert KINDS <= {f.kind for f in frames}, Counter(f.kind for f in frames)
    for c in counters:
        assert c.get("rx_icrc_ip_id_inferred", 0) == 0, c
        assert c.get("rx_icrc_errors", 0) == 0 and c.get("rx_icrc_skipped", 0) == 0, c
    # the client's large Writes and sends would have left in batches: the capture paused them
    assert sum(c.get("gso_capture_pauses", 0) for c in counters) >= 1
    assert sum(c.get("tx_gso_sends", 0) for c in counters) == 0


@pytest.mark.parametrize("server_engine, client_engine", ENGINE_PAIRS)
async def test_two_soft_devices_never_infer_an_ip_id(monkeypatch, server_engine, client_engine):
    """No capture: the batches flow (UDP GSO, segment k's ICRC made for IP ID k), each
    receiver takes them whole (UDP_GRO) and checks packet k for ID k: every ICRC checks
    and neither end infers an ID."""
    monkeypatch.setenv("AIORDMA_SOFT_SKIP_LOOPBACK_ICRC", "0")
    index = 2 * ENGINES.index(server_engine) + ENGINES.index(client_engine)
    server_dev = SoftDevice(f"127.0.0.{81 + 2 * index}:4791", engine=server_engine)
    client_dev = SoftDevice(f"127.0.0.{82 + 2 * index}:4791", engine=client_engine)
    try:
        if client_dev.capture_listening():
            pytest.skip("another process captures on lo: batches are paused")
        assert client_dev.gro and server_dev.gro
        await every_kind_of_packet(server_dev, client_dev)
        server, client = server_dev.counters, client_dev.counters
    finally:
        server_dev.close()
        client_dev.close()
    assert client.get("tx_gso_sends", 0) > 0 and server.get("rx_gro_datagrams", 0) > 0
    for c in (server, client):
        assert c.get("rx_icrc_ip_id_inferred", 0) == 0, c
        assert c.get("rx_icrc_errors", 0) == 0, c


BATCHES_CLIENT = r"""
import asyncio, json, sys
import aiordma
from aiordma.providers.soft.device import SoftDevice
sys.path.insert(0, sys.argv[4])
from tests.support.roce_oracle import PacketCapture

async def main(ip, server, port, netdev):
    cap = PacketCapture(netdev)
    dev = SoftDevice(f"{ip}:4791")
    rule = dev.gso_rule.as_dict()
    dev.gso = True  # (the rule is not learned on a link that cuts batches: forced, to check it)
    async with await aiordma.connect(server, port, device=dev) as conn:
        remote = conn.remote("mem")
        mtu = conn.path.mtu
        for k in range(1, 60):  # a Write of k full packets: batches of up to k segments
            await conn.write(bytes([k]) * (k * mtu), remote[0 : k * mtu])
    counters = dev.counters
    dev.close()
    frames = cap.stop()
    print(json.dumps({"rule": rule, "mtu": mtu, "counters": counters,
                      "frames": [[f.ip_header.hex(), f.udp.hex()] for f in frames]}))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[5]))
"""


@pytest.mark.parametrize("engine", ENGINES)
async def test_where_the_kernel_cuts_a_batch_each_segment_is_exact(tmp_path, engine):
    """Two hosts (namespaces) on a veth that takes one segment per packet: the kernel cuts
    each batch as it leaves. Batches of every length the engine makes (2 to 40 and more
    segments): segment k leaves with IP ID k, and the oracle finds every ICRC right for it. The device learns
    that this link cuts batches, and does not batch there unless told to."""
    from ..support.child_server import ROOT
    from ..support.roce_oracle import Frame

    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"two network namespaces cannot be made here: {why}")
    env = {"PYTHONPATH": str(ROOT), "AIORDMA_INSECURE": "1", "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}
    script = tmp_path / "batches.py"
    script.write_text(BATCHES_CLIENT)
    with netns.TwoHosts() as hosts:
        veth_a = hosts._veth[0]
        cut = hosts.a.run(["ip", "link", "set", "dev", veth_a, "gso_max_segs", "1"], capture_output=True, text=True)
        assert cut.returncode == 0, cut.stderr
        server = hosts.b.popen(
            [sys.executable, "-m", "tests.support.child_server", "--host", hosts.b.ip, "--mem-size", str(1 << 20)],
            cwd=ROOT,
            env={**env, "AIORDMA_SOFT_ADDR": hosts.b.ip},
            stdout=subprocess.PIPE,
            text=True,
        )
        port = int(await asyncio.wait_for(asyncio.to_thread(server.stdout.readline), 30))
        client = hosts.a.run(
            [sys.executable, str(script), hosts.a.ip, hosts.b.ip, str(port), str(ROOT), veth_a],
            cwd=ROOT,
            env={**env, "AIORDMA_SOFT_ENGINE": engine},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert client.returncode == 0, client.stderr[-3000:]
    report = json.loads(client.stdout)
    assert report["rule"]["batches"] == "segmented" and not report["rule"]["batching"], report["rule"]
    frames = [Frame(bytes.fromhex(ip), bytes.fromhex(udp)) for ip, udp in report["frames"]]
    sent = [f for f in frames if f.src == hosts.a.ip]
    assert report["counters"]["tx_gso_sends"] >= 50
    wrong = [f for f in frames if not icrc_matches(f)]
    assert not wrong, f"{len(wrong)} of {len(frames)} packets carry a wrong ICRC: {Counter(f.kind for f in wrong)}"
    # runs of Write packets: the IP IDs climb 0, 1, ..., k-1 within each batch
    ids = [f.ip_id for f in sent if f.kind == "write"]
    runs, run = [], 0
    for i in ids:
        if i == 0:
            if run:
                runs.append(run)
            run = 1
        else:
            assert i == run, f"segment {run} of a batch left with IP ID {i}"
            run += 1
    runs.append(run)
    # batches of every length up to the longest the engine makes toward this peer
    assert max(runs) >= 32 and set(range(2, max(runs) + 1)) <= set(runs), sorted(Counter(runs).items())


@pytest.mark.parametrize("engine", ENGINES)
def test_the_demo_captured_shows_every_packet_exact(live_capture, engine):
    """`aiordma demo` with default settings, captured on lo as people capture it to learn
    the wire: every RoCEv2 packet it sends is one datagram whose ICRC is right."""
    from ..support.child_server import ROOT

    env = {k: v for k, v in os.environ.items() if not k.startswith("AIORDMA_")}
    env.update(AIORDMA_SOFT_ENGINE=engine, PYTHONPATH=str(ROOT))
    demo = subprocess.run(
        [sys.executable, "-m", "aiordma.cli", "demo"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    frames = live_capture.stop()
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert "ICRC        verified" in demo.stdout
    # the demo's own devices (other processes on this host may be sending on lo too)
    devices = set(re.findall(r"soft RoCEv2 at (127\.[0-9.]+):4791", demo.stdout))
    assert len(devices) == 2, demo.stdout[:2000]
    ours = [f for f in frames if {f.src, f.dst} == devices]
    assert len(ours) > 100
    wrong = [f for f in ours if not icrc_matches(f)]
    assert not wrong, f"{len(wrong)} of {len(ours)} packets carry a wrong ICRC: {Counter(f.kind for f in wrong)}"
    assert {f.ip_id for f in ours} == {0}


def test_aiordma_devices_says_which_gso_rule_it_found_and_how():
    from ..support.child_server import ROOT

    env = {k: v for k, v in os.environ.items() if not k.startswith("AIORDMA_")}
    env["PYTHONPATH"] = str(ROOT)
    text = subprocess.run(
        [sys.executable, "-m", "aiordma.cli", "devices"], capture_output=True, text=True, timeout=60, env=env
    )
    assert text.returncode == 0, text.stderr
    [line] = [x for x in text.stdout.splitlines() if "UDP GSO batches:" in x]
    assert "lo carries a batch whole" in line and "learned by" in line, line
    doc = subprocess.run(
        [sys.executable, "-m", "aiordma.cli", "devices", "--json"], capture_output=True, text=True, timeout=60, env=env
    )
    rule = json.loads(doc.stdout)["soft"]["gso"]
    assert rule["netdev"] == "lo" and rule["batches"] == "whole" and rule["ip_ids"] == "numbered"
    assert rule["batching"] and rule["pause_under_capture"] and rule["learned_by"]
