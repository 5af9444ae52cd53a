"""Finding pyverbs (no device needed: these run on the host too)."""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
import textwrap

import pytest

from aiordma.errors import ProviderUnavailableError
from aiordma.providers import pyverbs_loader

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEBIAN_PYVERBS = "/usr/lib/python3/dist-packages/pyverbs"
SYSTEM_ABI_OK = any(
    os.path.exists(os.path.join(DEBIAN_PYVERBS, "device" + s)) for s in importlib.machinery.EXTENSION_SUFFIXES
)

needs_system_pyverbs = pytest.mark.skipif(
    not SYSTEM_ABI_OK, reason="python3-pyverbs for this interpreter's ABI is not installed"
)

_PROBE = textwrap.dedent(
    """
    import json, logging, os, sys
    path_before = list(sys.path)
    handlers_before = list(logging.root.handlers)
    level_before = logging.root.level
    from aiordma.providers.pyverbs_loader import load_pyverbs, pyverbs_info
    from aiordma.providers.pyverbs import list_devices
    pv = load_pyverbs()
    info = pyverbs_info()
    sysdirs = ("/usr/lib/python3/dist-packages", "/usr/lib64/")
    foreign = sorted(
        n for n, m in list(sys.modules.items())
        if (getattr(m, "__file__", None) or "").startswith(sysdirs)
        and not (n == "pyverbs" or n.startswith("pyverbs."))
    )
    print(json.dumps({
        "path_unchanged": sys.path == path_before,
        "logging_unchanged": logging.root.handlers == handlers_before and logging.root.level == level_before,
        "foreign": foreign,
        "pyverbs_file": pv.__file__,
        "has_device": hasattr(pv, "device") and hasattr(pv.device, "Context"),
        "info": info,
        "devices": list_devices(),
    }))
    """
)


@pytest.fixture(scope="module")
def probe():
    """Load pyverbs in a fresh interpreter (this one may have loaded it already)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("AIORDMA_PYVERBS_PATH", None)
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_system_pyverbs
def test_load_pyverbs_leaves_sys_path_and_logging_alone(probe):
    assert probe["has_device"]
    assert probe["path_unchanged"], "load_pyverbs() changed sys.path"
    assert probe["logging_unchanged"], "pyverbs' logging.basicConfig() leaked into the root logger"
    assert probe["foreign"] == [], f"modules other than pyverbs came from a system dir: {probe['foreign']}"
    info = probe["info"]
    assert info["available"] is True and info["error"] is None
    assert info["path"] == os.path.dirname(probe["pyverbs_file"])
    assert info["how"] in ("import", "system")
    if sys.prefix != sys.base_prefix or not sys.executable.startswith("/usr/bin/"):
        assert info["how"] == "system"  # a venv / pyenv python without system site-packages
        assert info["system_dir"] == os.path.dirname(DEBIAN_PYVERBS)
    assert info["comp_channel_fd"] in ("native", "discovered")
    if info["version"] and info["version"].split(".")[0].isdigit() and int(info["version"].split(".")[0]) < 57:
        assert info["comp_channel_fd"] == "discovered"  # CompChannel.fd arrived in rdma-core 57


@needs_system_pyverbs
def test_list_devices_matches_the_kernel(probe):
    sysfs = "/sys/class/infiniband"
    expected = sorted(os.listdir(sysfs)) if os.path.isdir(sysfs) else []
    # on this host (no RDMA in the kernel) ibv_get_device_list fails: [] rather than an exception
    assert sorted(probe["devices"]) == expected


@needs_system_pyverbs
def test_load_in_process_is_cached():
    pv = pyverbs_loader.load_pyverbs()
    assert pyverbs_loader.load_pyverbs() is pv is sys.modules["pyverbs"]
    for sub in pyverbs_loader.SUBMODULES:
        assert sys.modules[f"pyverbs.{sub}"] is getattr(pv, sub)


def _fake_pyverbs(root, tag: str) -> str:
    d = root / "pyverbs"
    d.mkdir(parents=True)
    (d / "__init__.py").write_text("")
    for mod in ("device", "cq", "qp"):
        (d / f"{mod}.{tag}.so").write_bytes(b"\x7fELF not really")
    return str(root)


def test_abi_mismatch_is_reported(tmp_path, monkeypatch):
    root = _fake_pyverbs(tmp_path / "sys", "cpython-399-x86_64-linux-gnu")
    monkeypatch.setattr(pyverbs_loader, "_try_plain_import", lambda: (None, None))
    monkeypatch.setattr(pyverbs_loader, "candidate_dirs", lambda: [root])
    before = set(sys.modules)
    with pytest.raises(ProviderUnavailableError) as ei:
        pyverbs_loader._load()
    msg = str(ei.value)
    assert "CPython 3.99" in msg and "cpython-399-x86_64-linux-gnu" in msg
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in msg and root in msg
    assert set(sys.modules) == before


def test_not_installed_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(pyverbs_loader, "_try_plain_import", lambda: (None, None))
    monkeypatch.setattr(pyverbs_loader, "candidate_dirs", lambda: [str(tmp_path)])
    with pytest.raises(ProviderUnavailableError, match="apt install python3-pyverbs"):
        pyverbs_loader._load()


def test_broken_system_copy_is_skipped_cleanly(tmp_path, monkeypatch):
    """A copy whose extension modules match the ABI tag but cannot load is
    reported and leaves no half-imported pyverbs behind."""
    tag = importlib.machinery.EXTENSION_SUFFIXES[0][1:-3]
    root = _fake_pyverbs(tmp_path / "sys", tag)
    monkeypatch.setattr(pyverbs_loader, "_try_plain_import", lambda: (None, None))
    monkeypatch.setattr(pyverbs_loader, "candidate_dirs", lambda: [root])
    saved = {k: v for k, v in sys.modules.items() if k == "pyverbs" or k.startswith("pyverbs.")}
    for k in saved:
        del sys.modules[k]
    try:
        with pytest.raises(ProviderUnavailableError, match="import failed"):
            pyverbs_loader._load()
        assert not [k for k in sys.modules if k == "pyverbs" or k.startswith("pyverbs.")]
    finally:
        sys.modules.update(saved)


def test_candidate_dirs_honour_env(tmp_path, monkeypatch):
    root = _fake_pyverbs(tmp_path / "custom", "cpython-399-x86_64-linux-gnu")
    monkeypatch.setenv("AIORDMA_PYVERBS_PATH", os.path.join(root, "pyverbs"))
    dirs = pyverbs_loader.candidate_dirs()
    assert dirs[0] == root and "/usr/lib/python3/dist-packages" in dirs
    assert len(dirs) == len(set(dirs))
