"""Dask distributed's own comm tests, run on ``rdma://``.

    .venv/bin/python scripts/dask_comm_suite.py [--repo URL|PATH] [--ref REF] [--ucx-ref REF]
                                                [--workdir DIR] [PYTEST ARGS...]

Fetches, with git, into a scratch directory (never into this repository):

* ``distributed/comm/tests/test_comms.py`` at ``--ref`` (default: the tag of the
  distributed installed here), and the TLS test certificates it loads at import
  (the wheel ships neither);
* ``distributed/comm/tests/test_ucx.py`` at ``--ucx-ref`` (default 2025.7.0, the
  last release that had it: UCX moved to distributed-ucxx);

adapts them to ``rdma://`` in their addresses and fixtures only (``ADAPT`` below
says exactly what changes), and runs them with pytest on this interpreter. Tests
of other backends (TLS, inproc, a tornado stream's address, the scheme-less
addresses that ``distributed.comm.listen`` makes ``tcp://``) are deselected; the
differences from ``tcp://`` that docs/howto/dask.md documents are strict xfails,
so the run passes when exactly those fail. Tests that need GPU packages (cudf,
cupy, numba) skip as they do without them; the slow ones run too.

It needs the network (github.com) unless ``--repo`` names a local clone. On a
2-core machine it takes about 5 minutes; ``test_ucx.py::test_stress`` (10
rechunks of an 800 MB array on a LocalCluster within 120 s) needs a machine
that is not busy with anything else.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

UCX_REF = "2025.7.0"
CERTS = (
    "tls-ca-cert.pem",
    "tls-ca-key.pem",
    "tls-cert-chain.pem",
    "tls-cert.pem",
    "tls-key-cert.pem",
    "tls-key.pem",
    "tls-self-signed-cert.pem",
    "tls-self-signed-key.pem",
)

#: other backends' tests, and distributed's own fallback to tcp:// for a scheme-less address
DESELECT_K = "not test_tls_ and not test_inproc_ and not get_stream_address and not test_default_client_server"

#: the documented differences from tcp:// (docs/howto/dask.md, "Differences from tcp://")
EXPECTED_DIFFERENCES = {
    "test_comms.py::test_tcp_specific": "extra_info names the device and queue pairs (tcp://: {})",
    "test_ucx.py::test_ucx_specific": "extra_info names the device and queue pairs (ucx://: {})",
    "test_comms.py::test_comm_closed_on_write_error[BufferError]": (
        "an error in the middle of a write is CommClosedError (from it), not the error itself"
    ),
    **{
        f"test_comms.py::test_share_buffer_with_header[{case}]": (
            "a frame's own buffer: no frame shares the receive buffer of the message's header"
        )
        for case in ("1-0-False", "1-1800-False", "200000-9500-False", "350000-0-False")
    },
}

SHIM = """
import types as _types

import distributed.utils_test as _utils_test

from aiordma.integrations.dask.backend import RDMABackend, RDMAComm, RDMAConnector, RDMAListener

_utils_test.certs_dir = {certs!r}  # (the wheel ships no test certificates)
_RDMA = _types.SimpleNamespace(
    TCPListener=RDMAListener, TCPConnector=RDMAConnector, TCPBackend=RDMABackend, TCP=RDMAComm,
    UCXListener=RDMAListener, UCXConnector=RDMAConnector, UCXBackend=RDMABackend, UCX=RDMAComm,
)
"""

CONFTEST = '''"""Fixtures for distributed's comm tests on rdma:// (written by scripts/dask_comm_suite.py)."""
import dask
import pytest

# before distributed.utils_test snapshots the configuration (gen_test resets to it): a token
# for listeners off loopback (aiordma's protected mode), rdma for scheme-less addresses
dask.config.set({{"distributed.comm.rdma.token": "dask-comm-suite-token", "distributed.comm.default-scheme": "rdma"}})

from distributed.utils_test import *  # noqa: E402,F403  (distributed's fixtures: loop, cleanup, ...)

import aiordma  # noqa: E402

EXPECTED_DIFFERENCES = {expected!r}


@pytest.fixture(scope="session", autouse=True)
def _soft_devices():
    # the soft devices' NIC threads (the Python engine's are Python threads), started before
    # gen_test's thread-leak check looks: loopback's, and the one a wildcard listener's
    # contact address (this host's address) binds
    from aiordma.integrations.dask.config import Settings, device_for
    from distributed.utils import get_ip

    aiordma.get_device("soft")
    device_for(Settings.from_config(), get_ip())
    yield


@pytest.fixture
def ucx_loop():
    yield None


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = EXPECTED_DIFFERENCES.get(item.nodeid)
        if reason:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
'''

PYTEST_INI = """[pytest]
markers =
    slow
    gpu
    workerstate
    ci1
    flaky
    extra_packages
"""


def _sub(text: str, old: str, new: str) -> str:
    if old not in text:
        raise SystemExit(f"dask_comm_suite: {old!r} is not in the test file: a version this script does not know")
    return text.replace(old, new)


def _schemes(text: str, scheme: str) -> str:
    for quote in ('"', "'"):
        text = text.replace(f"{quote}{scheme}://", f"{quote}rdma://")
    return text


def adapt_test_comms(text: str, certs: str) -> str:
    """test_comms.py on rdma://: the ``tcp`` fixture gives the rdma classes under TCP's
    names; addresses say rdma://; the two tests that reach into a tornado stream reach
    into the aiordma connection instead (its ``send``; the server's handler)."""
    fixture = re.compile(
        r'@pytest.fixture\(params=\["tornado"\]\)\ndef tcp\(monkeypatch, request\):.*?return tcp\n', re.S
    )
    if not fixture.search(text):
        raise SystemExit("dask_comm_suite: test_comms.py's tcp fixture is not the one this script knows")
    replacement = (
        SHIM.format(certs=certs) + '\n\n@pytest.fixture\ndef tcp():\n    """rdma:// for tcp://"""\n    return _RDMA\n'
    )
    text = fixture.sub(lambda _: replacement, text)
    text = _schemes(text, "tcp")
    text = _sub(text, 'backends, "tcp"', 'backends, "rdma"')
    text = _sub(text, "writer.stream.write = _write", "writer.connection.send = _write")
    text = _sub(text, "orig_handle_stream = listener._handle_stream", "orig_handle_stream = listener._on_connection")
    text = _sub(text, "async def stop_then_handle_stream(stream, address):", "async def stop_then_handle_stream(conn):")
    text = _sub(text, "await orig_handle_stream(stream, address)", "await orig_handle_stream(conn)")
    return _sub(text, "listener.tcp_server.handle_stream = ", "listener.server._handler = ")


def adapt_test_ucx(text: str, certs: str) -> str:
    """test_ucx.py on rdma://: no ucp; ``ucx`` is the rdma classes under UCX's names; the
    ``ucx_loop`` fixture is a no-op; addresses, protocols and schemes say rdma."""
    text = _sub(text, 'ucp = pytest.importorskip("ucp")\n', "")
    text = _sub(
        text,
        "from distributed.comm import connect, listen, parse_address, ucx\n",
        "from distributed.comm import connect, listen, parse_address\n" + SHIM.format(certs=certs) + "ucx = _RDMA\n",
    )
    text = _sub(
        text, 'try:\n    HOST = ucp.get_address()\nexcept Exception:\n    HOST = "127.0.0.1"\n', 'HOST = "127.0.0.1"\n'
    )
    text = re.sub(
        r'@pytest.mark.skipif\(\n    not hasattr\(ucp.exceptions, "UCXUnreachable"\),\n.*?\n\)\n', "", text, flags=re.S
    )
    text = _sub(
        text,
        "from distributed.comm.tests.test_comms import check_deserialize",
        "from test_comms import check_deserialize",
    )
    text = _sub(text, 'assert "ucx" in backends', 'assert "rdma" in backends')
    text = _sub(text, 'get_backend("ucx")', 'get_backend("rdma")')
    text = _sub(text, 'assert scheme == "ucx"', 'assert scheme == "rdma"')
    text = _sub(text, 'protocol="ucx"', 'protocol="rdma"')
    text = _sub(text, '.startswith("ucx://")', '.startswith("rdma://")')
    text = _schemes(text, "ucx").replace('f"ucx://', 'f"rdma://')
    if "ucp." in text:
        raise SystemExit("dask_comm_suite: test_ucx.py still uses ucp: a version this script does not know")
    return text


def _fetch(repo: str, ref: str, into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q", str(into)], check=True)
    subprocess.run(["git", "-C", str(into), "fetch", "-q", "--depth", "1", repo, ref], check=True)


def _show(clone: Path, path: str) -> bytes:
    return subprocess.run(
        ["git", "-C", str(clone), "show", f"FETCH_HEAD:{path}"], check=True, capture_output=True
    ).stdout


def main(argv: list[str]) -> int:
    import distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", default="https://github.com/dask/distributed.git")
    parser.add_argument("--ref", default=distributed.__version__, help="for test_comms.py (default: %(default)s)")
    parser.add_argument("--ucx-ref", default=UCX_REF, help="for test_ucx.py (default: %(default)s)")
    parser.add_argument("--workdir", help="scratch directory (default: a new temporary one)")
    args, pytest_args = parser.parse_known_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dask-comm-suite-")).resolve()
    run = work / "run"
    certs = work / "certs"
    for d in (run, certs):
        d.mkdir(parents=True, exist_ok=True)

    _fetch(args.repo, args.ref, work / "comms")
    for name in CERTS:
        (certs / name).write_bytes(_show(work / "comms", f"distributed/tests/{name}"))
    comms = _show(work / "comms", "distributed/comm/tests/test_comms.py").decode()
    (run / "test_comms.py").write_text(adapt_test_comms(comms, str(certs)))
    _fetch(args.repo, args.ucx_ref, work / "ucx")
    ucx = _show(work / "ucx", "distributed/comm/tests/test_ucx.py").decode()
    (run / "test_ucx.py").write_text(adapt_test_ucx(ucx, str(certs)))
    (run / "conftest.py").write_text(CONFTEST.format(expected=EXPECTED_DIFFERENCES))
    (run / "pytest.ini").write_text(PYTEST_INI)

    print(
        f"dask_comm_suite: distributed {distributed.__version__}; test_comms.py at {args.ref}, test_ucx.py at {args.ucx_ref}; in {run}"
    )
    command = [sys.executable, "-m", "pytest", "-p", "no:asyncio", "-p", "no:cacheprovider"]
    command += ["-rfEsx", "-k", DESELECT_K, *pytest_args]
    return subprocess.run(command, cwd=run, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
