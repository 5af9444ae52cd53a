"""The pieces of aiordma.security and aiordma.exposure that need no network:
the back-off (with its clock passed in, sans-IO), token sources, the
loopback test, protected mode's decision, rights and their wire form."""

from __future__ import annotations

import logging
import os
import stat

import pytest

import aiordma
from aiordma import rendezvous as rdv
from aiordma import security
from aiordma.exposure import access_error_explanation, parse_rights, registration_access
from aiordma.memory import RemoteBuffer
from aiordma.providers.base import Access, WROpcode
from aiordma.security import AuthThrottle

SECRET = "unit-test-secret-7d1f0c5e9a"


class Clock:
    """Time for the sans-IO throttle: advanced by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------ back-off ----


def test_backoff_starts_at_the_limit_and_doubles():
    clock = Clock()
    t = AuthThrottle(limit=5, window=60, backoff=1, max_backoff=60, clock=clock)
    ip = "192.0.2.7"
    for _ in range(4):
        assert t.failed(ip) == 0
        assert t.admit(ip) == 0
        clock.now += 0.1
    assert t.recent_failures(ip) == 4
    assert t.failed(ip) == 1.0  # the 5th within the window
    assert t.admit(ip) == pytest.approx(1.0)
    assert t.refusals == 1
    delays = [t.last_backoff]
    for _ in range(8):  # a guesser who waits out each back-off and tries again
        clock.now += t.retry_after(ip) + 0.01
        assert t.admit(ip) == 0
        t.failed(ip)
        delays.append(t.last_backoff)
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert t.failures == 13


def test_failures_older_than_the_window_do_not_count():
    clock = Clock()
    t = AuthThrottle(limit=3, window=10, clock=clock)
    ip = "192.0.2.8"
    t.failed(ip)
    t.failed(ip)
    clock.now += 10.5  # both are now older than the window
    assert t.recent_failures(ip) == 0
    assert t.failed(ip) == 0
    assert t.failed(ip) == 0
    assert t.failed(ip) == 1.0  # three within 10 s
    # a source quiet for a whole window starts over at the first back-off
    clock.now += 30
    for _ in range(2):
        assert t.failed(ip) == 0
    assert t.failed(ip) == 1.0


def test_other_sources_are_not_slowed_down():
    clock = Clock()
    t = AuthThrottle(limit=2, clock=clock)
    t.failed("192.0.2.9")
    t.failed("192.0.2.9")
    assert t.admit("192.0.2.9") > 0
    assert t.admit("192.0.2.10") == 0
    assert t.admit("127.0.0.1") == 0


def test_ipv6_sources_count_by_64_prefix():
    clock = Clock()
    t = AuthThrottle(limit=3, clock=clock)
    # one host hopping between addresses of its /64 is one source
    for host in ("2001:db8:1:2::1", "2001:db8:1:2::2", "2001:db8:1:2:ffff::9"):
        t.failed(host)
    assert t.admit("2001:db8:1:2::77") > 0
    assert t.admit("2001:db8:1:3::1") == 0
    # an IPv4-mapped address is the IPv4 source
    assert security.source_key("::ffff:192.0.2.1") == "192.0.2.1"
    assert security.source_key("192.0.2.1") == "192.0.2.1"


def test_state_is_bounded():
    clock = Clock()
    t = AuthThrottle(limit=5, max_sources=100, clock=clock)
    for i in range(10_000):
        t.failed(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}")
        assert len(t) <= 100
    assert t.failures == 10_000
    # a source that is backing off is remembered while fresh ones arrive, as long as it keeps failing
    for _ in range(5):
        t.failed("192.0.2.50")
    assert t.admit("192.0.2.50") > 0


def test_lanes_shrink_with_failures_and_on_probation():
    clock = Clock()
    t = AuthThrottle(limit=4, window=60, backoff=1, clock=clock)
    ip = "192.0.2.11"
    assert t.lanes(ip) == 4  # a clean source: as many handshakes at the challenge as the limit
    t.failed(ip)
    assert t.lanes(ip) == 3
    for _ in range(3):
        t.failed(ip)
    assert t.admit(ip) > 0
    clock.now += 2  # the back-off is over, but the source is on probation: one at a time
    assert t.admit(ip) == 0 and t.lanes(ip) == 1
    clock.now += 61  # quiet for a whole window: a clean slate
    assert t.lanes(ip) == 4


def test_throttle_rejects_nonsense_settings():
    with pytest.raises(ValueError):
        AuthThrottle(limit=0)
    with pytest.raises(ValueError):
        AuthThrottle(backoff=10, max_backoff=1)


# -------------------------------------------------------------- tokens ----


def test_token_sources_and_precedence(tmp_path, monkeypatch):
    f = tmp_path / "token"
    f.write_bytes(SECRET.encode() + b"\n")
    f.chmod(0o600)
    assert security.resolve_token(None) is None
    assert security.resolve_token(SECRET) == SECRET.encode()
    assert security.resolve_token(SECRET.encode()) == SECRET.encode()
    assert security.resolve_token(f) == SECRET.encode()  # a path-like is a token file
    monkeypatch.setenv("AIORDMA_TOKEN", "from-env-0123456789")
    assert security.resolve_token(None) == b"from-env-0123456789"
    assert security.resolve_token("explicit-0123456789") == b"explicit-0123456789"  # the argument wins
    monkeypatch.delenv("AIORDMA_TOKEN")
    monkeypatch.setenv("AIORDMA_TOKEN_FILE", str(f))
    assert security.resolve_token(None) == SECRET.encode()
    assert rdv.token_from_env(None) == SECRET.encode()
    monkeypatch.setenv("AIORDMA_TOKEN", "from-env-0123456789")
    with pytest.raises(aiordma.TokenError, match="both \\$AIORDMA_TOKEN and \\$AIORDMA_TOKEN_FILE"):
        security.resolve_token(None)
    monkeypatch.delenv("AIORDMA_TOKEN_FILE")
    monkeypatch.setenv("AIORDMA_TOKEN", "")
    assert security.resolve_token(None) is None  # empty: unset
    with pytest.raises(aiordma.TokenError, match="empty"):
        security.resolve_token("")
    with pytest.raises(TypeError):
        security.resolve_token(1234)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("content", "expect"),
    [(b"abc-0123456789abcdef\n", b"abc-0123456789abcdef"), (b"abc\r\n", b"abc"), (b"abc", b"abc"),
     (b"a b\tc \n\n", b"a b\tc ")],
)  # fmt: skip
def test_token_file_loses_only_its_trailing_newline(tmp_path, content, expect):
    f = tmp_path / "t"
    f.write_bytes(content)
    f.chmod(0o600)
    assert security.read_token_file(f) == expect


def test_token_file_errors_name_the_file_not_the_secret(tmp_path, monkeypatch):
    def err(path, **kw):
        with pytest.raises(aiordma.TokenError) as ei:
            security.read_token_file(path, **kw)
        assert isinstance(ei.value, aiordma.RDMAError) and isinstance(ei.value, ValueError)
        assert str(path) in str(ei.value)
        return str(ei.value)

    assert "no such file" in err(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.write_bytes(b"\n")
    assert "is empty" in err(empty)
    assert "is a directory" in err(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in err(fifo)  # and it did not hang waiting for a writer
    big = tmp_path / "big"
    big.write_bytes(SECRET.encode() * 10_000)
    msg = err(big)
    assert "larger than" in msg and SECRET not in msg
    # unreadable: root reads any file, so the refusal is injected where the file is opened
    locked = tmp_path / "locked"
    locked.write_bytes(SECRET.encode())
    real_open = os.open

    def refuse(path, *a, **kw):
        if os.fspath(path) == str(locked):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(os, "open", refuse)
    msg = err(locked)
    assert "permission denied" in msg and SECRET not in msg


def test_token_file_readable_by_others_warns_once(tmp_path, caplog):
    f = tmp_path / "shared-token"
    f.write_bytes(SECRET.encode())
    f.chmod(0o644)
    private = tmp_path / "private-token"
    private.write_bytes(SECRET.encode())
    private.chmod(0o600)
    with caplog.at_level(logging.DEBUG, logger="aiordma"):
        security.read_token_file(private)
        assert not [r for r in caplog.records if "other users" in r.getMessage()]
        security.read_token_file(f)
        security.read_token_file(f)
    warned = [r for r in caplog.records if "other users" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "chmod 600" in warned[0].getMessage() and "0644" in warned[0].getMessage()
    assert SECRET not in caplog.text
    assert stat.S_IMODE(f.stat().st_mode) == 0o644  # a warning, not a change behind the user's back


def test_insecure_from_env(monkeypatch):
    assert security.insecure_from_env(None) is False
    assert security.insecure_from_env(True) is True
    monkeypatch.setenv("AIORDMA_INSECURE", "1")
    assert security.insecure_from_env(None) is True
    assert security.insecure_from_env(False) is False  # the argument wins
    monkeypatch.setenv("AIORDMA_INSECURE", "no")
    assert security.insecure_from_env(None) is False
    monkeypatch.setenv("AIORDMA_INSECURE", "maybe")
    with pytest.raises(ValueError, match="AIORDMA_INSECURE"):
        security.insecure_from_env(None)


# ------------------------------------------------------ protected mode ----


@pytest.mark.parametrize(
    ("address", "loopback"),
    [("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("::ffff:127.0.0.1", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("192.0.2.1", False), ("10.0.0.1", False), ("fe80::1%eth0", False),
     ("example.org", False), ("", False)],
)  # fmt: skip
def test_is_loopback_address(address, loopback):
    assert security.is_loopback_address(address) is loopback


def test_protected_mode_decision(caplog):
    check = security.check_protected_mode
    check(["127.0.0.1", "::1"], 1, token=None, insecure=False)  # loopback: fine
    check(["0.0.0.0"], 1, token=b"x" * 32, insecure=False)  # a token: fine
    with pytest.raises(aiordma.ProtectedModeError) as ei:
        check(["127.0.0.1", "0.0.0.0", "::"], 18515, token=None, insecure=False)
    msg = str(ei.value)
    assert ei.value.addresses == ("0.0.0.0", "::")
    assert "0.0.0.0:18515 (every interface)" in msg and "[::]:18515" in msg
    for way_out in ("token=", "$AIORDMA_TOKEN", "$AIORDMA_TOKEN_FILE", "insecure=True", "AIORDMA_INSECURE=1"):
        assert way_out in msg
    assert "\n" not in msg  # one line for a CLI
    with caplog.at_level(logging.WARNING, logger="aiordma"):
        check(["192.0.2.1"], 7, token=None, insecure=True)
    assert len(caplog.records) == 1 and "WITHOUT a token" in caplog.records[0].getMessage()


# -------------------------------------------------------------- rights ----


def test_rights_parse_and_map_to_registration_flags():
    assert parse_rights("r") == "r"
    assert parse_rights("wr") == "rw"
    assert parse_rights("awr") == "rwa"
    assert parse_rights(Access.REMOTE_READ | Access.REMOTE_ATOMIC | Access.LOCAL_WRITE) == "ra"
    for bad in ("", "x", "rwx", "read"):
        with pytest.raises(ValueError, match="REMOTE_READ"):
            parse_rights(bad)
    with pytest.raises(ValueError, match="grants a peer nothing"):
        parse_rights(Access.LOCAL_WRITE)
    assert registration_access("r") == Access.REMOTE_READ  # no LOCAL_WRITE needed to be read
    assert registration_access("w") == Access.REMOTE_WRITE | Access.LOCAL_WRITE  # verbs: REMOTE_WRITE needs it
    assert registration_access("rwa") == aiordma.providers.base.ACCESS_ALL


def test_access_errors_name_the_missing_right():
    w = access_error_explanation(WROpcode.IBV_WR_RDMA_WRITE, None)
    assert "REMOTE_WRITE" in w and 'exposed("rw")' in w
    assert "REMOTE_READ" in access_error_explanation(WROpcode.IBV_WR_RDMA_READ, None)
    assert "REMOTE_ATOMIC" in access_error_explanation(WROpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, None)
    said = access_error_explanation(
        WROpcode.IBV_WR_RDMA_WRITE, "responder: rkey 0x1 does not grant IBV_ACCESS_REMOTE_WRITE"
    )
    assert said.startswith("the peer's NIC refused it: responder: rkey 0x1 does not grant") and "exposed(" in said


def test_rights_travel_beside_the_buffers_and_are_checked():
    ep = rdv.Endpoint(
        qpn=5, psn=1, gid=bytes(16), mtu=1024,
        buffers={"a": RemoteBuffer(1, 2, 3, "a", "rw"), "b": RemoteBuffer(4, 5, 6, "b")},
    )  # fmt: skip
    wire = ep.to_wire()
    assert wire["buffers"] == {"a": [1, 2, 3], "b": [4, 5, 6]}  # the triples stay as they were
    assert wire["rights"] == {"a": "rw"}
    back = rdv.Endpoint.from_wire(wire)
    assert back.buffers["a"].rights == "rw" and back.buffers["b"].rights is None
    assert back.buffers["a"][0:1].rights == "rw"  # slices keep them
    del wire["rights"]
    assert rdv.Endpoint.from_wire(wire).buffers["a"].rights is None  # a peer that does not say
    for bad in ({"a": "rwz"}, {"a": 7}, ["a"]):
        wire["rights"] = bad
        with pytest.raises(aiordma.RendezvousError, match="invalid endpoint"):
            rdv.Endpoint.from_wire(wire)
