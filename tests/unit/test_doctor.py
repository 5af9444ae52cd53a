"""``aiordma doctor``: the real run on this machine, and every check's failure
path on a fake sysfs/procfs tree (fault injection through ``Probe``)."""

from __future__ import annotations

import functools
import importlib.machinery
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import sysconfig

import pytest

from aiordma.errors import DeviceNotFoundError
from aiordma.providers.soft.engine import explain_native_import_error, native_status, slow_paths
from aiordma.tools import doctor
from aiordma.tools.doctor import FAIL, OK, SKIP, WARN, Options, Probe, diagnose_sync

pytestmark = pytest.mark.engine_neutral  # the same on every engine and core: CI's reference run leaves it out

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_KERNEL_RDMA = not os.path.exists("/sys/class/infiniband")
INF = resource.RLIM_INFINITY

PYVERBS_OK = {
    "available": True,
    "error": None,
    "path": "/usr/lib/python3/dist-packages/pyverbs",
    "how": "system",
    "system_dir": "/usr/lib/python3/dist-packages",
    "version": "44.0-2",
    "comp_channel_fd": "discovered",
}
PYVERBS_MISSING = {
    "available": False,
    "error": "pyverbs is not installed: `import pyverbs`: no module named 'pyverbs' on sys.path",
    "path": None,
    "how": None,
    "version": None,
    "comp_channel_fd": None,
}

LINK_LOCAL = "fe80:0000:0000:0000:5054:00ff:fe12:3456"
IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:0a00:020f"  # ::ffff:10.0.2.15
ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"


# ------------------------------------------------------------ fake machine ----


def _w(root, path, text):
    p = os.path.join(str(root), path.lstrip("/"))
    os.makedirs(os.path.dirname(p), exist_ok=True)
    with open(p, "w") as f:
        f.write(text + "\n")


def make_tree(
    root,
    *,
    dev="rxe0",
    state="4: ACTIVE",
    link_layer="Ethernet",
    gids=((LINK_LOCAL, "RoCE v2"), (IPV4_MAPPED, "RoCE v2")),
    netdev="eth0",
    netdev_mtu=1500,
    uverbs=True,
    rxe=True,
):
    """A sysfs/procfs tree like a kernel with one rxe (or hardware) device."""
    base = f"/sys/class/infiniband/{dev}"
    _w(root, f"{base}/node_type", "1: CA")
    if rxe:
        _w(root, f"{base}/parent", netdev)
    else:
        drv = os.path.join(str(root), "sys/bus/pci/drivers/mlx5_core")
        os.makedirs(drv, exist_ok=True)
        os.makedirs(os.path.join(str(root), f"sys/devices/pci0000:00/0000:3b:00.0/net/{netdev}"), exist_ok=True)
        os.symlink(drv, os.path.join(str(root), "sys/devices/pci0000:00/0000:3b:00.0/driver"))
        os.symlink(
            os.path.join(str(root), "sys/devices/pci0000:00/0000:3b:00.0"),
            os.path.join(str(root), base.lstrip("/"), "device"),
        )
    port = f"{base}/ports/1"
    _w(root, f"{port}/state", state)
    _w(root, f"{port}/phys_state", "5: LinkUp" if "ACTIVE" in state else "3: Disabled")
    _w(root, f"{port}/link_layer", link_layer)
    for i, (gid, gtype) in enumerate(list(gids) + [(ZERO, None)]):
        _w(root, f"{port}/gids/{i}", gid)
        if gtype:
            _w(root, f"{port}/gid_attrs/types/{i}", gtype)
            _w(root, f"{port}/gid_attrs/ndevs/{i}", netdev)
    if uverbs:
        _w(root, "/sys/class/infiniband_verbs/uverbs0/ibdev", dev)
    _w(root, f"/sys/class/net/{netdev}/mtu", str(netdev_mtu))
    mods = ["ib_core 450560 2 rdma_rxe,ib_uverbs, Live 0x0", "ib_uverbs 176128 0 - Live 0x0"]
    if rxe:
        mods.insert(0, "rdma_rxe 126976 0 - Live 0x0")
    _w(root, "/proc/modules", "\n".join(mods))
    _w(root, "/proc/net/route", "Iface\tDestination\tGateway\nens3\t00000000\t0102000A\n")
    return root


class FakeProbe(Probe):
    """A probe over a fake root, with injected pyverbs/limits/verbs facts.
    The loopback check on the 'kernel' device runs on a real soft device."""

    def __init__(
        self,
        root,
        *,
        env=None,
        pyverbs=PYVERBS_OK,
        memlock=(INF, INF),
        cap_ipc_lock=False,
        active_mtu=1024,
        release="6.1.0-test",
        commands=None,
    ):
        super().__init__(str(root), env={} if env is None else env)
        self._pyverbs = pyverbs
        self._memlock = memlock
        self._cap = cap_ipc_lock
        self._active_mtu = active_mtu
        self._release = release
        self.commands = commands or {}

    def pyverbs_info(self):
        return dict(self._pyverbs)

    def memlock(self):
        return self._memlock

    def cap_ipc_lock(self):
        return self._cap

    def release(self):
        return self._release

    def verbs_port(self, device, port):
        return None if self._active_mtu is None else {"active_mtu": self._active_mtu}

    def open_pyverbs(self, name):
        return self.open_soft(None)

    def which(self, name):
        return f"/usr/sbin/{name}" if name in self.commands else super().which(name)

    def run(self, argv, timeout=5.0):
        out = self.commands.get(argv[0])
        return out(argv) if callable(out) else out


def diag(probe, **opts):
    return diagnose_sync(Options(**opts), probe)


@functools.cache
def soft_status(clean_env: bool = False) -> str:
    """The status of the "soft device" check where aiordma uses it and it works: ``ok``
    at full speed, ``warn`` on a slow path (the Python engine, as CI's second run
    chooses, or an ICRC by a slow CRC-32). ``clean_env``: for a process without
    ``AIORDMA_SOFT_ENGINE``."""
    from aiordma.providers.soft.device import SoftDevice
    from aiordma.tools.doctor.loopback import soft_slow_paths

    dev = SoftDevice(engine=("native" if native_status()[0] else "python") if clean_env else None)
    try:
        return WARN if soft_slow_paths(dev) else OK
    finally:
        dev.close()


# ------------------------------------------------------- this very machine ----


@pytest.mark.skipif(not NO_KERNEL_RDMA, reason="this machine has kernel RDMA")
def test_real_machine_without_kernel_rdma():
    report = diag(Probe(env={k: v for k, v in os.environ.items() if not k.startswith("AIORDMA_")}))
    names = [c.name for c in report.checks]
    assert names[:3] == ["python", "pyverbs", "kernel RDMA"]
    kernel = report.get("kernel RDMA")
    assert kernel.status == WARN
    assert "no /sys/class/infiniband" in kernel.seen
    assert "sudo modprobe rdma_rxe && sudo rdma link add rxe0 type rxe netdev" in kernel.fix
    assert report.get("devices").status == SKIP
    soft = report.get("soft device")
    assert soft.status == soft_status(), soft
    assert "loopback RDMA Write" in soft.seen and soft.data["loopback"]["ok"]
    assert soft.data["address"].endswith(":4791")
    assert report.get("Soft-RoCE (rxe)").status in (OK, WARN)
    assert report.plan.provider == "soft"
    assert report.exit_status == 0
    assert report.overall == WARN


@pytest.mark.skipif(not NO_KERNEL_RDMA, reason="this machine has kernel RDMA")
def test_cli_json_parses_and_exit_status():
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIORDMA_")}
    env["PYTHONPATH"] = REPO
    r = subprocess.run(
        [sys.executable, "-m", "aiordma.cli", "doctor", "--json"], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["exit_status"] == 0 and out["overall"] in (OK, WARN)
    assert out["plan"]["provider"] == "soft"
    assert all(set(c) >= {"name", "status", "seen", "fix"} for c in out["checks"])
    by = {c["name"]: c for c in out["checks"]}
    assert by["kernel RDMA"]["status"] == WARN and by["soft device"]["status"] == soft_status(clean_env=True)


def test_table_plain_when_not_a_tty(capsys):
    rc = doctor.main([])
    out = capsys.readouterr().out
    assert "\033[" not in out
    assert "CHECK" in out and "overall:" in out and "aiordma will use:" in out
    assert rc in (0, 1)
    report = doctor.Report(doctor.Plan("soft", "soft0", "x"), [doctor.Check("a", FAIL, "b", "c")])
    coloured = doctor.format_table(report, colour=True)
    assert "\033[31mfail" in coloured and "→ fix: c" in coloured


def test_check_rejects_unknown_status():
    with pytest.raises(ValueError):
        doctor.Check("x", "maybe", "y")


# -------------------------------------------------------- healthy fake rxe ----


def test_fake_rxe_healthy(tmp_path):
    report = diag(FakeProbe(make_tree(tmp_path)), provider="pyverbs")
    assert report.plan.provider == "pyverbs" and report.plan.device == "rxe0"
    assert report.get("kernel RDMA").status == OK
    assert "rdma_rxe" in report.get("kernel RDMA").data["modules"]
    dev = report.get("devices")
    assert dev.status == OK and "rxe0: rdma_rxe (Soft-RoCE) on eth0" in dev.seen and "uverbs0" in dev.seen
    port = report.get("port rxe0/1")
    assert port.status == OK and "PORT_ACTIVE" in port.seen and "Ethernet" in port.seen
    gid = report.get("gid rxe0/1")
    assert gid.status == OK and gid.data["gid_index"] == 1
    assert "::ffff:10.0.2.15" in gid.seen and "first RoCE v2 GID with an IPv4 address" in gid.seen
    assert report.get("mtu rxe0/1").status == OK  # 1500 - 80 -> 1024
    assert report.get("memlock").status == OK
    assert report.get("Soft-RoCE (rxe)").status == SKIP
    assert report.get("loopback rxe0").status == OK
    assert report.exit_status == 0, [c for c in report.checks if c.status == FAIL]


def test_auto_picks_active_kernel_device(tmp_path):
    report = diag(FakeProbe(make_tree(tmp_path)))
    assert (report.plan.provider, report.plan.device) == ("pyverbs", "rxe0")
    assert "PORT_ACTIVE" in report.plan.why


def test_hardware_driver_from_sysfs_link(tmp_path):
    make_tree(tmp_path, dev="mlx5_0", rxe=False, netdev="ens1f0", netdev_mtu=9000)
    report = diag(FakeProbe(tmp_path, active_mtu=4096), provider="pyverbs")
    d = report.get("devices")
    assert "mlx5_0: mlx5_core" in d.seen
    mtu = report.get("mtu mlx5_0/1")
    assert mtu.status == OK and mtu.data["expected"] == 4096  # 9000 - 96


def test_unknown_device_name_fails(tmp_path):
    report = diag(FakeProbe(make_tree(tmp_path)), device="mlx5_7")
    d = report.get("devices")
    assert d.status == FAIL and "no device named mlx5_7" in d.seen and "rxe0" in d.fix
    assert report.exit_status == 1


# ----------------------------------------------------- failure paths: port ----


def test_port_down_fails_for_the_chosen_device(tmp_path):
    make_tree(tmp_path, state="1: DOWN")
    report = diag(FakeProbe(tmp_path), provider="pyverbs", device="rxe0")
    port = report.get("port rxe0/1")
    assert port.status == FAIL
    assert "PORT_DOWN" in port.seen
    assert "ip link set eth0 up" in port.fix
    assert report.exit_status == 1


def test_port_down_is_a_warning_when_auto_falls_back_to_soft(tmp_path):
    make_tree(tmp_path, state="1: DOWN")
    report = diag(FakeProbe(tmp_path))
    assert report.plan.provider == "soft" and "no RDMA device has an active port" in report.plan.why
    assert report.get("port rxe0/1").status == WARN
    assert report.get("soft device").status == soft_status()
    assert report.exit_status == 0


def test_infiniband_port_init_points_at_the_subnet_manager(tmp_path):
    make_tree(tmp_path, state="2: INIT", link_layer="InfiniBand", gids=((LINK_LOCAL, "IB/RoCE v1"),))
    report = diag(FakeProbe(tmp_path), provider="pyverbs", device="rxe0")
    port = report.get("port rxe0/1")
    assert port.status == FAIL and "opensm" in port.fix
    assert report.get("gid rxe0/1").status == OK  # IB GIDs are fine on InfiniBand


# ------------------------------------------------------ failure paths: GID ----


def test_gid_table_without_roce_v2_ipv4(tmp_path):
    make_tree(tmp_path, gids=((LINK_LOCAL, "RoCE v2"),))
    report = diag(FakeProbe(tmp_path), provider="pyverbs")
    gid = report.get("gid rxe0/1")
    assert gid.status == WARN
    assert gid.data["gid_index"] == 0 and "none carries an IPv4 address" in gid.seen
    assert "ip addr add" in gid.fix and "eth0" in gid.fix


def test_gid_table_with_roce_v1_only_fails(tmp_path):
    make_tree(tmp_path, gids=((LINK_LOCAL, "IB/RoCE v1"), (IPV4_MAPPED, "IB/RoCE v1")))
    report = diag(FakeProbe(tmp_path), provider="pyverbs")
    gid = report.get("gid rxe0/1")
    assert gid.status == FAIL and "RoCE v1" in gid.seen and "cma_roce_mode" in gid.fix
    assert report.exit_status == 1


def test_empty_gid_table_fails(tmp_path):
    make_tree(tmp_path, gids=())
    report = diag(FakeProbe(tmp_path), provider="pyverbs")
    gid = report.get("gid rxe0/1")
    assert gid.status == FAIL and "empty" in gid.seen


def test_gid_index_override_to_an_empty_slot_fails(tmp_path):
    make_tree(tmp_path)
    report = diag(FakeProbe(tmp_path, env={"AIORDMA_GID_INDEX": "2"}), provider="pyverbs")
    gid = report.get("gid rxe0/1")
    assert gid.status == FAIL and "AIORDMA_GID_INDEX=2" in gid.seen and "empty slot" in gid.seen


def test_choose_gid_prefers_roce_v2_ipv4_whatever_its_index():
    gids = [
        doctor.Gid(0, "fe80::1", "RoCE v1"),
        doctor.Gid(1, "fe80::1", "RoCE v2"),
        doctor.Gid(2, "::ffff:10.0.0.1", "RoCE v1"),
        doctor.Gid(3, "::ffff:10.0.0.1", "RoCE v2"),
    ]
    assert doctor.choose_gid(gids)[0] == 3  # mlx5 layout: v1+v2 per address
    assert doctor.choose_gid(gids[:2])[0] == 1
    assert doctor.choose_gid(gids[:1])[0] == 0
    assert doctor.choose_gid([]) == (None, "the GID table is empty")


# ------------------------------------------------------ failure paths: MTU ----


def test_mtu_larger_than_the_netdev_allows_fails(tmp_path):
    make_tree(tmp_path, netdev_mtu=1500)
    report = diag(FakeProbe(tmp_path, active_mtu=4096), provider="pyverbs")
    mtu = report.get("mtu rxe0/1")
    assert mtu.status == FAIL
    assert "active MTU 4096" in mtu.seen and "RoCE MTU 1024" in mtu.seen
    assert "mtu 9000" in mtu.fix
    assert report.exit_status == 1


def test_mtu_smaller_than_the_netdev_allows_warns(tmp_path):
    make_tree(tmp_path, netdev_mtu=9000)
    report = diag(FakeProbe(tmp_path, active_mtu=1024), provider="pyverbs")
    mtu = report.get("mtu rxe0/1")
    assert mtu.status == WARN and "4096" in mtu.seen
    assert "rdma link delete rxe0" in mtu.fix


def test_mtu_unknown_without_pyverbs_is_computed_from_the_netdev(tmp_path):
    make_tree(tmp_path, netdev_mtu=1500)
    report = diag(FakeProbe(tmp_path, active_mtu=None), provider="pyverbs")
    mtu = report.get("mtu rxe0/1")
    assert mtu.status == OK and "unknown" in mtu.seen and mtu.data["expected"] == 1024


def test_roce_mtu_table():
    assert doctor.roce_mtu(1500, "rxe") == 1024
    assert doctor.roce_mtu(1500) == 1024
    assert doctor.roce_mtu(9000) == 4096
    assert doctor.roce_mtu(1110, "rxe") == 1024  # 1110 - 80 = 1030
    assert doctor.roce_mtu(1110) == 512  # 1110 - 96 = 1014
    assert doctor.roce_mtu(300) is None


# -------------------------------------------------- failure paths: memlock ----


def test_small_memlock_fails_for_a_kernel_device(tmp_path):
    make_tree(tmp_path)
    report = diag(FakeProbe(tmp_path, memlock=(64 * 1024, INF)), provider="pyverbs")
    m = report.get("memlock")
    assert m.status == FAIL
    assert "64 KiB" in m.seen and "2.0 MiB" in m.seen
    assert "ulimit -l unlimited" in m.fix and "/etc/security/limits.conf" in m.fix
    assert report.exit_status == 1


@pytest.mark.parametrize(
    "outcome, status, text",
    [
        ((False, "ibv_reg_mr failed: ENOMEM (Cannot allocate memory)"), FAIL, "failed: ibv_reg_mr failed: ENOMEM"),
        ((True, ""), WARN, "yet registering 2.0 MiB on rxe0 worked"),
    ],
)
def test_small_memlock_is_confirmed_by_a_real_registration(tmp_path, outcome, status, text):
    make_tree(tmp_path)

    class Registering(FakeProbe):
        def try_register(self, device, nbytes):
            assert device == "rxe0" and nbytes == doctor.default_registration_bytes()["total"]
            return outcome

    report = diag(Registering(tmp_path, memlock=(64 * 1024, INF)), provider="pyverbs")
    m = report.get("memlock")
    assert m.status == status and text in m.seen


def test_small_hard_memlock_says_raise_the_hard_limit(tmp_path):
    make_tree(tmp_path)
    report = diag(FakeProbe(tmp_path, memlock=(64 * 1024, 64 * 1024)), provider="pyverbs")
    assert "raise the hard limit" in report.get("memlock").fix


def test_small_memlock_only_warns_with_cap_ipc_lock_or_the_soft_device(tmp_path):
    make_tree(tmp_path)
    r1 = diag(FakeProbe(tmp_path, memlock=(64 * 1024, INF), cap_ipc_lock=True), provider="pyverbs")
    assert r1.get("memlock").status == WARN and "CAP_IPC_LOCK" in r1.get("memlock").seen
    r2 = diag(FakeProbe(tmp_path, memlock=(64 * 1024, INF)), provider="soft")
    assert r2.get("memlock").status == WARN and "does not pin memory" in r2.get("memlock").seen


def test_default_registration_is_about_two_mib():
    need = doctor.default_registration_bytes()
    assert 2 << 20 <= need["total"] < (2 << 20) + 4096


# -------------------------------------------------- failure paths: pyverbs ----


def test_pyverbs_missing_warns_and_falls_back_to_soft(tmp_path):
    make_tree(tmp_path)
    report = diag(FakeProbe(tmp_path, pyverbs=PYVERBS_MISSING))
    pv = report.get("pyverbs")
    assert pv.status == WARN and "not usable" in pv.seen and "python3-pyverbs" in pv.fix
    assert report.plan.provider == "soft" and "pyverbs is not available" in report.plan.why
    assert report.exit_status == 0


def test_pyverbs_missing_fails_when_requested(tmp_path):
    make_tree(tmp_path)
    report = diag(FakeProbe(tmp_path, pyverbs=PYVERBS_MISSING), provider="pyverbs")
    assert report.get("pyverbs").status == FAIL
    assert report.exit_status == 1


def test_pyverbs_seen_says_how_it_was_loaded(tmp_path):
    report = diag(FakeProbe(tmp_path), provider="soft")
    pv = report.get("pyverbs")
    assert pv.status == OK and "44.0-2" in pv.seen and "discovered" in pv.seen and "loaded by path" in pv.seen


# ------------------------------------------------ failure paths: no kernel ----


def test_no_kernel_rdma_and_rxe_module_available(tmp_path):
    _w(tmp_path, "/proc/net/route", "Iface\tDestination\tGateway\nens3\t00000000\t0102000A\n")
    _w(tmp_path, "/lib/modules/6.1.0-test/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko.xz", "")
    os.makedirs(tmp_path / "usr/bin")
    tool = tmp_path / "usr/bin/rdma"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    report = diag(FakeProbe(tmp_path))
    k = report.get("kernel RDMA")
    assert k.status == WARN and "sudo rdma link add rxe0 type rxe netdev ens3" in k.fix
    rxe = report.get("Soft-RoCE (rxe)")
    assert rxe.status == OK and "rdma_rxe.ko.xz" in rxe.seen and "/usr/bin/rdma" in rxe.seen
    assert rxe.fix == "sudo modprobe rdma_rxe && sudo rdma link add rxe0 type rxe netdev ens3"
    assert report.exit_status == 0


def test_no_kernel_rdma_fails_when_pyverbs_requested(tmp_path):
    report = diag(FakeProbe(tmp_path), provider="pyverbs")
    assert report.get("kernel RDMA").status == FAIL
    rxe = report.get("Soft-RoCE (rxe)")
    assert rxe.status == WARN and "no rdma_rxe module" in rxe.seen and "not installed" in rxe.seen
    assert report.exit_status == 1


def test_missing_uverbs(tmp_path):
    make_tree(tmp_path, uverbs=False)
    report = diag(FakeProbe(tmp_path), provider="pyverbs")
    k = report.get("kernel RDMA")
    assert k.status == FAIL and k.fix == "sudo modprobe ib_uverbs"


# ------------------------------------------------ failure paths: soft device ----


def test_soft_device_cannot_bind_reports_the_holder():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIORDMA_")}
        env["AIORDMA_SOFT_ADDR"] = f"127.0.0.1:{port}"
        report = diag(Probe(env=env), provider="soft")
    finally:
        s.close()
    soft = report.get("soft device")
    assert soft.status == FAIL
    assert f"AIORDMA_SOFT_ADDR=127.0.0.1:{port}" in soft.seen
    assert "Address already in use" in soft.seen
    assert "AIORDMA_SOFT_ADDR" in soft.fix
    if shutil.which("ss"):
        assert "held by:" in soft.seen and f"127.0.0.1:{port}" in soft.seen.split("held by:")[1]
    assert report.exit_status == 1


def test_soft_device_bind_failure_only_warns_when_a_kernel_device_is_used(tmp_path):
    make_tree(tmp_path)

    class Busy(FakeProbe):
        def open_soft(self, address):
            if address == "127.0.0.1:4791":
                raise DeviceNotFoundError("soft device cannot bind UDP 127.0.0.1:4791: Address already in use")
            return super().open_soft(None)

    report = diag(Busy(tmp_path, env={"AIORDMA_SOFT_ADDR": "127.0.0.1:4791"}), provider="pyverbs")
    soft = report.get("soft device")
    assert soft.status == WARN and "kernel rxe owns UDP 4791" in soft.fix
    assert report.exit_status == 0


# ------------------------------------------------------ failure paths: peer ----


def test_peer_connection_refused(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    report = diag(FakeProbe(tmp_path), provider="soft", peer=f"127.0.0.1:{port}", timeout=3.0)
    p = report.get("peer rendezvous")
    assert p.status == FAIL
    assert "connection refused" in p.seen and f"127.0.0.1:{port}" in p.seen
    assert "start the server" in p.fix
    assert report.exit_status == 1


def test_peer_argument_is_checked():
    with pytest.raises(ValueError):
        doctor._parse_peer("no-port")
    assert doctor._parse_peer("[::1]:18515") == ("::1", 18515)


def test_cli_rejects_a_bad_peer(capsys):
    assert doctor.main(["--peer", "nocolon"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err


def test_nat_check():
    assert doctor._nat_check("127.0.0.1", "127.0.0.3", "127.0.0.2").status == OK
    nat = doctor._nat_check("203.0.113.7", "10.0.0.5", "10.1.0.2")
    assert nat.status == WARN and "ICRC" in nat.seen
    assert doctor._nat_check("10.0.0.5", "10.0.0.5", "10.0.0.9").status == OK
    assert doctor._nat_check("10.0.0.5", "10.0.0.5", "1.1.1.1").status == WARN
    assert doctor._nat_check("10.0.0.5", None, "10.0.0.9").status == SKIP


# -------------------------------------------------- failure paths: firewall ----


def _ipt(rules):
    return {"iptables-save": (0, rules)}


@pytest.mark.parametrize(
    "commands, status, text",
    [
        (_ipt("*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -p udp --dport 4791 -j DROP\nCOMMIT\n"), WARN, "rules drop"),
        (_ipt("*filter\n:INPUT DROP [0:0]\n-A INPUT -p tcp --dport 22 -j ACCEPT\nCOMMIT\n"), WARN, "policy drops"),
        (_ipt("*filter\n:INPUT DROP [0:0]\n-A INPUT -p udp --dport 4791 -j ACCEPT\nCOMMIT\n"), OK, "accepted"),
        (_ipt("*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n"), OK, "no rule mentions"),
        ({"iptables-save": (1, "iptables-save: Permission denied (you must be root)")}, SKIP, "could not read"),
        (
            {
                "nft": (
                    0,
                    "table inet filter {\n chain input {\n  type filter hook input priority 0; policy drop;\n }\n}\n",
                )
            },
            WARN,
            "policy drops",
        ),
        ({"firewall-cmd": lambda argv: (0, "running") if argv[1] == "--state" else (1, "no")}, WARN, "firewalld"),
    ],
)
def test_firewall(tmp_path, commands, status, text):
    report = diag(FakeProbe(tmp_path, commands=commands), provider="soft")
    fw = report.get("firewall")
    assert fw.status == status, fw
    assert text in fw.seen
    if status == WARN:
        assert "4791" in fw.fix


def test_firewall_is_never_a_failure(tmp_path):
    report = diag(FakeProbe(tmp_path, commands=_ipt("-A INPUT -p udp --dport 4791 -j DROP\n")), provider="soft")
    assert report.get("firewall").status == WARN and report.exit_status == 0


# ------------------------------------------------------------- robustness ----


def test_a_crashing_check_is_reported_not_raised(tmp_path):
    class Broken(FakeProbe):
        def memlock(self):
            raise RuntimeError("boom")

    report = diag(Broken(tmp_path), provider="soft")
    m = report.get("memlock")
    assert m.status == WARN and "boom" in m.seen
    assert report.get("soft device").status == soft_status()


# ------------------------------------------ RoCE exposure (the soft device) ----


def _local_interface_address() -> str | None:
    """A non-loopback IPv4 address of this host (the one routing to a TEST-NET), if any."""
    probe = Probe(env={})
    for target in ("192.0.2.1", "198.51.100.1", "203.0.113.1", "10.255.255.1"):
        src = probe.route_source(target)
        if src and not src.startswith("127."):
            return src
    return None


def _free_udp_port(ip: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIORDMA_")}
    env.update(extra)
    return env


def test_soft_device_on_an_interface_address_warns_that_roce_is_not_authenticated():
    ip = _local_interface_address()
    if ip is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    port = _free_udp_port(ip)
    report = diag(Probe(env=_clean_env(AIORDMA_SOFT_ADDR=f"{ip}:{port}")), provider="soft")
    assert report.get("soft device").status == soft_status()  # really bound there, and the loopback Write worked
    exp = report.get(doctor.EXPOSURE)
    assert exp.status == WARN
    assert f"UDP {ip}:{port}" in exp.seen and f"AIORDMA_SOFT_ADDR={ip}:{port}" in exp.seen
    assert "not authenticated" in exp.seen and "the ICRC is a checksum, not a MAC" in exp.seen
    assert "QPN" in exp.seen and "PSN" in exp.seen and "rkey" in exp.seen
    assert "dedicated network or VLAN" in exp.fix
    assert f"nft add rule inet filter input udp dport {port}" in exp.fix
    assert f"iptables -A INPUT -p udp --dport {port}" in exp.fix
    assert report.exit_status == 0  # a warning: the set-up works, it is just exposed
    names = [c.name for c in report.checks]
    assert names.index(doctor.EXPOSURE) == names.index("soft device") + 1


def test_exposure_is_warned_about_even_before_the_address_binds():
    """AIORDMA_SOFT_ADDR names an address this host does not have: the bind fails, and the
    warning says what binding it would expose."""
    for addr in ("198.51.100.77", "203.0.113.77", "192.0.2.177"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.bind((addr, 0))
        except OSError:
            break  # not an address of this host: the soft device cannot bind it either
    else:
        pytest.skip("every TEST-NET address tried is local here")
    report = diag(Probe(env=_clean_env(AIORDMA_SOFT_ADDR=addr)), provider="soft")
    assert report.get("soft device").status == FAIL
    exp = report.get(doctor.EXPOSURE)
    assert exp.status == WARN and f"UDP {addr}:4791" in exp.seen and "dport 4791" in exp.fix


@pytest.mark.parametrize("addr", [None, "127.0.0.1:{port}", "127.0.0.9"])
def test_no_exposure_warning_on_loopback(addr):
    env = _clean_env()
    if addr is not None:
        env["AIORDMA_SOFT_ADDR"] = addr.format(port=_free_udp_port("127.0.0.1"))
    report = diag(Probe(env=env), provider="soft")
    assert doctor.EXPOSURE not in [c.name for c in report.checks]


def test_exposure_check_every_interface_and_the_peer_route(tmp_path):
    anywhere = doctor.exposure_check("0.0.0.0", 4791, "with AIORDMA_SOFT_ADDR=0.0.0.0")
    assert anywhere is not None and "every interface (0.0.0.0:4791)" in anywhere.seen
    assert doctor.exposure_check("127.0.0.5", 4791, "x") is None

    class Routed(FakeProbe):
        def route_source(self, host):
            return "10.0.0.9"

    ctx = doctor.Context(Options(provider="soft", peer="10.0.0.2:18515"), Routed(tmp_path))
    ctx.plan = doctor.Plan("soft", "soft0", "requested")
    [exp] = doctor.check_exposure(ctx)
    assert exp.status == WARN and "UDP 10.0.0.9:4791" in exp.seen and "to talk to 10.0.0.2:18515" in exp.seen
    assert "ip saddr != { 10.0.0.2 }" in exp.fix and "! -s 10.0.0.2" in exp.fix  # the peer, filled in
    ctx = doctor.Context(Options(provider="soft", peer="127.0.0.1:18515"), Routed(tmp_path))
    ctx.plan = doctor.Plan("soft", "soft0", "requested")
    assert doctor.check_exposure(ctx) == []  # a peer on this host: the soft device stays on loopback


# ------------------------------------- the soft device's slow paths, said loudly ----

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _copy_of_aiordma(tmp_path, engine_file: str | None = None, engine_bytes: bytes = b"") -> str:
    """A copy of the aiordma package without its compiled engine (as an install without a C
    compiler leaves it), or with ``engine_file`` in its place; returns the PYTHONPATH for it."""
    root = tmp_path / "site"
    shutil.copytree(
        os.path.join(REPO, "aiordma"),
        root / "aiordma",
        ignore=shutil.ignore_patterns("*.so", "*.pyd", "_engine.c", "__pycache__"),
    )
    if engine_file is not None:
        (root / "aiordma/providers/soft/_native" / engine_file).write_bytes(engine_bytes)
    return str(root)


def _cli_json(pythonpath: str, *argv: str, **env_extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIORDMA_")}
    env.update(PYTHONPATH=pythonpath, **env_extra)
    r = subprocess.run(
        [sys.executable, "-m", "aiordma.cli", *argv, "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=pythonpath,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _soft_reports(pythonpath: str, **env_extra: str) -> tuple[dict, dict]:
    """``aiordma devices --json``'s soft device and ``aiordma doctor --json``'s soft device check."""
    soft = _cli_json(pythonpath, "devices", **env_extra)["soft"]
    doc = {c["name"]: c for c in _cli_json(pythonpath, "doctor", "--provider", "soft", **env_extra)["checks"]}
    return soft, doc["soft device"]


def _build_extension_needing_a_missing_library(tmp_path) -> bytes:
    """A real extension module ``_engine`` linked against a shared library that is then
    deleted, as an engine built against libisal is on a machine without libisal."""
    gcc = shutil.which("gcc")
    include = sysconfig.get_paths()["include"]
    if gcc is None or not os.path.exists(os.path.join(include, "Python.h")):
        pytest.skip("needs gcc and the Python headers")
    (tmp_path / "dep.c").write_text("int aiordma_test_dep(void) { return 1; }\n")
    (tmp_path / "m.c").write_text(
        "#include <Python.h>\n"
        "int aiordma_test_dep(void);\n"
        'static struct PyModuleDef d = {PyModuleDef_HEAD_INIT, "_engine", NULL, -1, NULL};\n'
        "PyMODINIT_FUNC PyInit__engine(void) { aiordma_test_dep(); return PyModule_Create(&d); }\n"
    )
    lib = tmp_path / "libaiordmatestdep.so.1"
    subprocess.run([gcc, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "dep.c")], check=True, timeout=120)
    ext = tmp_path / f"_engine{SUFFIX}"
    subprocess.run(
        [gcc, "-shared", "-fPIC", f"-I{include}", "-o", str(ext), str(tmp_path / "m.c"), f"-L{tmp_path}",
         "-l:libaiordmatestdep.so.1"],
        check=True,
        timeout=120,
    )  # fmt: skip
    lib.unlink()
    return ext.read_bytes()


def test_no_compiled_engine_says_not_built_and_warns(tmp_path):
    soft, check = _soft_reports(_copy_of_aiordma(tmp_path))
    assert soft["engine"] == "python"
    [warning] = soft["warnings"]
    assert warning.startswith("warning: the soft device runs its Python engine (about 3x the CPU per message")
    assert "the compiled engine is not built" in warning and "apt-get install gcc python3-dev" in warning
    assert check["status"] == WARN
    assert "warning: the soft device runs its Python engine" in check["seen"] and "not built" in check["seen"]
    assert "apt-get install gcc python3-dev" in check["fix"] and "reinstall aiordma" in check["fix"]


def test_engine_needing_a_missing_library_names_the_library(tmp_path):
    ext = _build_extension_needing_a_missing_library(tmp_path)
    soft, check = _soft_reports(_copy_of_aiordma(tmp_path, f"_engine{SUFFIX}", ext))
    assert soft["engine"] == "python"
    [warning] = soft["warnings"]
    assert "cannot load libaiordmatestdep.so.1, a shared library it links against" in warning, warning
    assert "not built" not in warning and "C compiler" not in warning
    assert check["status"] == WARN and "cannot load libaiordmatestdep.so.1" in check["seen"]
    assert "install it" in check["fix"]


def test_engine_built_for_another_python_says_so(tmp_path):
    other = "_engine.cpython-39-x86_64-linux-gnu.so" if "cpython-39" not in SUFFIX else "_engine.cpython-312-x.so"
    soft, check = _soft_reports(_copy_of_aiordma(tmp_path, other))
    [warning] = soft["warnings"]
    assert f"the compiled engine was built for another Python ({other}; " in warning, warning
    assert f"loads _engine{SUFFIX}" in warning and "reinstall aiordma with this interpreter" in warning
    assert check["status"] == WARN and "reinstall aiordma with this interpreter" in check["fix"]


def test_the_python_engine_chosen_by_the_user_is_reported_as_chosen():
    soft, check = _soft_reports(REPO, AIORDMA_SOFT_ENGINE="python")
    assert soft["engine"] == "python" and soft["engine_reason"] == "AIORDMA_SOFT_ENGINE=python"
    engine = [w for w in soft["slow_paths"] if w["kind"] == "engine"]
    assert len(engine) == 1 and engine[0]["chosen"], soft
    assert "the soft device runs its Python engine, as AIORDMA_SOFT_ENGINE=python asks" in engine[0]["seen"]
    assert "unavailable" not in soft["warnings"][0] and "not built" not in soft["warnings"][0]
    assert check["status"] == WARN and "as AIORDMA_SOFT_ENGINE=python asks" in check["seen"]
    if native_status()[0]:
        assert check["fix"].startswith("unset AIORDMA_SOFT_ENGINE for the native engine"), check


def test_this_machine_at_full_speed_is_plain_ok():
    soft, check = _soft_reports(REPO)
    if soft["engine"] != "native" or soft["crc32"] != "isa-l":
        pytest.skip(f"this machine's soft device runs {soft['engine']} with {soft['crc32']}")
    assert soft["warnings"] == [] and soft["slow_paths"] == []
    assert check["status"] == OK and "warning" not in check["seen"]


# real messages: the first two as Python words them for these files (see the runs above)
MISSING_ISAL = "libisal.so.2: cannot open shared object file: No such file or directory"
NOT_THERE = "cannot import name '_engine' from 'aiordma.providers.soft._native' (/x/_native/__init__.py)"
BUILT = [f"_engine{SUFFIX}", "__init__.py", "_engine.pyx"]


@pytest.mark.parametrize(
    "message, files, cause, fix",
    [
        (NOT_THERE, ["__init__.py", "_engine.pyx", "wire.c"], "is not built", "apt-get install gcc python3-dev"),
        (NOT_THERE, ["__init__.py", "_engine.cpython-99-x.so"], "built for another Python", "with this interpreter"),
        (MISSING_ISAL, BUILT, "cannot load libisal.so.2", "apt-get install libisal2"),
        ("libz.so.1: cannot open shared object file: No such file", BUILT, "cannot load libz.so.1", "zlib1g"),
        ("libfoo.so: cannot open shared object file: No such file", BUILT, "cannot load libfoo.so", "apt-file"),
        (f"/x/_engine{SUFFIX}: undefined symbol: crc32_gzip_refl", BUILT, "does not match the libraries", "reinstall"),
        (f"/x/_engine{SUFFIX}: file too short", BUILT, "does not import (/x/_engine", "reinstall aiordma"),
    ],
)
def test_why_the_compiled_engine_does_not_import(message, files, cause, fix):
    got_cause, got_fix = explain_native_import_error(message, files)
    assert cause in got_cause and fix in got_fix, (got_cause, got_fix)
    if "not built" not in cause:
        assert "C compiler" not in got_cause + got_fix  # the old, wrong advice


@pytest.mark.parametrize(
    "crc32, says",
    [
        ("zlib", "with zlib's CRC-32 (about 15x the CPU per byte of ISA-L"),
        ("table", "with its portable CRC-32 table (about 20x the CPU per byte of ISA-L"),
    ],
)
def test_a_slow_native_crc_is_one_warning_with_its_fix(crc32, says):
    [slow] = slow_paths("native", f"default (compiled, CRC-32 by {crc32})", crc32)
    assert slow.kind == "crc" and says in slow.seen
    assert slow.line() == f"warning: {slow.seen}: install libisal-dev (Debian/Ubuntu) and reinstall aiordma " + (
        "(scripts/bootstrap in a clone)"
    )
    for fast in ("isa-l", "vpclmul", "pclmul"):  # carry-less multiply without ISA-L is not slow
        assert slow_paths("native", f"default (compiled, CRC-32 by {fast})", fast) == []
    [py_crc] = slow_paths("python", "AIORDMA_SOFT_ENGINE=python", "zlib")[1:]
    assert "python-isal" in py_crc.seen and py_crc.fix == "pip install isal"


def test_devices_measures_the_icrcs_crc32():
    """``aiordma devices`` names the CRC-32 behind the ICRC and measures it (and,
    for the native engine, every other implementation the build has) on this machine."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    soft = _cli_json(root, "devices")["soft"]
    speeds = soft["crc32_throughput"]
    assert soft["crc32"] in speeds and all(v > 1e6 for v in speeds.values())
    if soft["engine"] == "native":
        assert list(speeds)[-1] == "table" and next(iter(speeds)) == soft["crc32"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIORDMA_")}
    text = subprocess.run(
        [sys.executable, "-m", "aiordma.cli", "devices"], capture_output=True, text=True, env=env, cwd=root, timeout=60
    ).stdout
    assert f"ICRC: CRC-32 by {soft['crc32']} at " in text and " GB/s on 4 KiB packets" in text


# ------------------------------------------------------------------ RDMA CM ----


def test_rdma_cm_is_ok_with_rdma_ucm_and_a_warning_without(tmp_path):
    make_tree(tmp_path)
    report = diag(FakeProbe(tmp_path), provider="pyverbs", device="rxe0")
    cm = report.get("RDMA CM")
    assert cm.status == WARN and "no /dev/infiniband/rdma_cm" in cm.seen and cm.fix == "sudo modprobe rdma_ucm"
    assert "TCP rendezvous works without it" in cm.seen
    _w(tmp_path, "/dev/infiniband/rdma_cm", "")
    cm = diag(FakeProbe(tmp_path), provider="pyverbs", device="rxe0").get("RDMA CM")
    assert cm.status == OK and "rdma_cm=True" in cm.seen and cm.data == {"rdma_cm": True}


def test_rdma_cm_is_skipped_without_a_kernel_device(tmp_path):
    report = diag(FakeProbe(tmp_path))  # an empty root: no /sys/class/infiniband
    assert report.get("devices").status == SKIP
    assert report.get("RDMA CM").status == SKIP
