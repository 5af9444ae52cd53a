"""``aiordma.settings``: every ``AIORDMA_*`` variable declared once, parsed and
checked the same way by every reader, documented in the table of
docs/configuration.md, and a bad value reported as one line (exit status 2) by
every ``aiordma`` command."""

from __future__ import annotations

import argparse
import math
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import aiordma
from aiordma import settings
from aiordma.errors import SettingError
from aiordma.settings import SETTINGS, Setting

pytestmark = pytest.mark.engine_neutral  # the same on every engine and core: CI's reference run leaves it out

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bAIORDMA_[A-Z0-9_]*[A-Z0-9]\b")

FLAG_GOOD = [("1", True), ("0", False), ("true", True), ("FALSE", False), ("yes", True), ("no", False)]
FLAG_GOOD += [("on", True), ("off", False), (" 1 ", True)]
FLAG_BAD = ["2", "maybe", "enabled"]

#: every setting: (raw value, parsed value) pairs it accepts, and raw values it refuses
CASES: dict[str, tuple[list[tuple[str, Any]], list[str]]] = {
    "AIORDMA_PROVIDER": ([("auto", "auto"), ("soft", "soft"), ("PyVerbs", "pyverbs")], ["bogus", "soft0", "rxe"]),
    "AIORDMA_DEVICE": ([("rxe0", "rxe0"), ("mlx5_0", "mlx5_0"), ("soft0", "soft0")], []),
    "AIORDMA_GID_INDEX": ([("0", 0), ("3", 3), (" 7 ", 7)], ["-1", "x", "1.5", "0x3"]),
    "AIORDMA_TRAFFIC_CLASS": ([("0", 0), ("104", 104), ("255", 255)], ["-1", "256", "af31", "1.5"]),
    "AIORDMA_SERVICE_LEVEL": ([("0", 0), ("3", 3), ("15", 15)], ["-1", "16", "x"]),
    "AIORDMA_HOP_LIMIT": ([("1", 1), ("64", 64), ("255", 255)], ["0", "256", "x"]),
    "AIORDMA_FLOW_LABEL": ([("0", 0), ("1048575", 0xFFFFF)], ["-1", "1048576", "x"]),
    "AIORDMA_PATH_MTU": ([("256", 256), ("1024", 1024), ("61440", 61440)], ["255", "61441", "4k"]),
    "AIORDMA_SOFT_ADDR": (
        [("127.0.0.2", "127.0.0.2"), ("127.0.0.2:4792", "127.0.0.2:4792"), ("10.0.0.1:0", "10.0.0.1:0")],
        ["127.0.0.1:abc", "127.0.0.1:70000", "127.0.0.1:", "127.0.0.1:-1", "::1", "[::1]:4791", "localhost"],
    ),
    "AIORDMA_SOFT_ENGINE": ([("native", "native"), ("Python", "python")], ["rust", "c"]),
    "AIORDMA_CORE": ([("compiled", "compiled"), (" Python ", "python")], ["native", "cython", "1"]),
    "AIORDMA_SOFT_WINDOW_US": ([("0", 0.0), ("2000", 2000.0), ("12.5", 12.5)], ["-1", "nan", "fast"]),
    "AIORDMA_SOFT_POLL_US": ([("0", 0.0), ("50", 50.0), ("2.5", 2.5)], ["-1", "nan", "busy"]),
    "AIORDMA_SOFT_ICRC": ([("strict", "strict"), ("any-ip-id", "any-ip-id"), ("off", "off")], ["loose", "on"]),
    "AIORDMA_SOFT_MTU": ([("256", 256), ("4096", 4096), ("61440", 61440)], ["255", "61441", "4k", "-4096"]),
    "AIORDMA_SOFT_GSO": (FLAG_GOOD, FLAG_BAD),
    "AIORDMA_SOFT_GRO": (FLAG_GOOD, FLAG_BAD),
    "AIORDMA_SOFT_SKIP_LOOPBACK_ICRC": (FLAG_GOOD, FLAG_BAD),
    "AIORDMA_SOFT_LOCAL": (FLAG_GOOD, FLAG_BAD),
    "AIORDMA_SOFT_CMA": (FLAG_GOOD, FLAG_BAD),
    "AIORDMA_SOFT_SHM": (FLAG_GOOD, FLAG_BAD),
    "AIORDMA_SOFT_SHM_POLL_US": ([("0", 0.0), ("100", 100.0), ("12.5", 12.5)], ["-1", "nan", "spin"]),
    "AIORDMA_SOFT_LOOP_ASSIST": (FLAG_GOOD, FLAG_BAD),
    "AIORDMA_SOFT_PCAP": ([("/tmp/x.pcap", "/tmp/x.pcap")], []),
    "AIORDMA_SRQ": ([("auto", "auto"), ("ON", "on"), ("off", "off")], ["1", "yes"]),
    "AIORDMA_PROGRESS": ([("event", "event"), ("thread", "thread"), ("BUSY", "busy")], ["poll", "events"]),
    "AIORDMA_SPIN_US": ([("0", 0.0), ("75", 75.0), ("1e3", 1000.0), ("inf", math.inf)], ["-5", "fast", "nan"]),
    "AIORDMA_METRICS_LATENCY": (FLAG_GOOD, FLAG_BAD),
    "AIORDMA_TOKEN": ([("s3cret", "s3cret"), (" spaced ", " spaced ")], []),
    "AIORDMA_TOKEN_FILE": ([("/run/aiordma.token", "/run/aiordma.token")], []),
    "AIORDMA_INSECURE": (FLAG_GOOD, FLAG_BAD),
    "AIORDMA_PYVERBS_PATH": ([("/opt/a:/opt/b", "/opt/a:/opt/b")], []),
    "AIORDMA_PYVERBS_EXTENDED": (FLAG_GOOD, FLAG_BAD),
    "AIORDMA_TRACEBACK": (FLAG_GOOD, FLAG_BAD),
    "AIORDMA_BENCH_PROFILE_CLIENT": ([("client.prof", "client.prof")], []),
    "AIORDMA_BENCH_PROFILE_SERVER": ([("/tmp/server", "/tmp/server")], []),
}

GOOD = [(name, raw, value) for name, (good, _) in CASES.items() for raw, value in good]
BAD = [(name, raw) for name, (_, bad) in CASES.items() for raw in bad]


def test_every_setting_has_cases() -> None:
    assert list(CASES) == list(SETTINGS)


@pytest.mark.parametrize("name, raw, value", GOOD)
def test_good_values(name: str, raw: str, value: Any) -> None:
    setting = SETTINGS[name]
    assert setting.get({name: raw}) == value
    assert setting.configured({name: raw}) == value
    settings.check_all({name: raw})


@pytest.mark.parametrize("name, raw", BAD)
def test_bad_values_name_the_variable_the_value_and_what_is_allowed(name: str, raw: str) -> None:
    setting = SETTINGS[name]
    with pytest.raises(SettingError) as e:
        setting.get({name: raw})
    assert str(e.value) == f"{name}={raw!r}: expected {setting.allowed}"
    assert "\n" not in str(e.value)
    assert (e.value.name, e.value.value) == (name, raw)
    assert isinstance(e.value, ValueError)
    with pytest.raises(SettingError, match=re.escape(f"{name}={raw!r}")):
        settings.check_all({name: raw})


@pytest.mark.parametrize("name", list(SETTINGS))
def test_unset_or_empty_is_the_default(name: str) -> None:
    setting = SETTINGS[name]
    assert setting.get({}) == setting.get({name: ""}) == setting.default
    assert setting.configured({}) is None and setting.configured({name: ""}) is None


def test_defaults() -> None:
    defaults = {name: s.default for name, s in SETTINGS.items() if s.default is not None}
    assert defaults == {
        "AIORDMA_PROVIDER": "auto",
        "AIORDMA_SOFT_ICRC": "strict",
        "AIORDMA_SRQ": "auto",
        "AIORDMA_SOFT_GSO": True,
        "AIORDMA_SOFT_GRO": True,
        "AIORDMA_SOFT_SKIP_LOOPBACK_ICRC": True,
        "AIORDMA_SOFT_LOCAL": True,
        "AIORDMA_SOFT_CMA": True,
        "AIORDMA_SOFT_SHM": True,
        "AIORDMA_SOFT_LOOP_ASSIST": True,
        "AIORDMA_PROGRESS": "event",
        "AIORDMA_SPIN_US": 200.0,
        "AIORDMA_METRICS_LATENCY": True,
        "AIORDMA_INSECURE": False,
        "AIORDMA_PYVERBS_EXTENDED": True,
        "AIORDMA_TRACEBACK": False,
    }


def test_reads_os_environ_when_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIORDMA_SPIN_US", "75")
    assert settings.SPIN_US.get() == 75.0
    monkeypatch.setenv("AIORDMA_SPIN_US", "-5")
    with pytest.raises(SettingError, match=r"^AIORDMA_SPIN_US='-5': expected a number of microseconds, 0 or more$"):
        settings.check_all()
    monkeypatch.delenv("AIORDMA_SPIN_US")
    settings.check_all()


def test_check_all_reports_the_first_bad_variable() -> None:
    env = {"AIORDMA_SPIN_US": "-5", "AIORDMA_PROVIDER": "bogus"}
    with pytest.raises(SettingError) as e:
        settings.check_all(env)
    assert str(e.value) == "AIORDMA_PROVIDER='bogus': expected one of auto, soft, pyverbs"


def test_a_secret_is_never_shown() -> None:
    secret = Setting("AIORDMA_EXAMPLE", None, "a whole number", "an example", int, secret=True)
    with pytest.raises(SettingError) as e:
        secret.get({"AIORDMA_EXAMPLE": "hunter2"})
    assert str(e.value) == "AIORDMA_EXAMPLE=<hidden>: expected a whole number"
    assert settings.TOKEN.secret


def test_setting_error_is_exported_and_pickles() -> None:
    assert aiordma.SettingError is SettingError and "SettingError" in aiordma.__all__
    assert issubclass(SettingError, aiordma.RDMAError)
    e = pickle.loads(pickle.dumps(SettingError("AIORDMA_X='y': expected z", "AIORDMA_X", "y")))
    assert (str(e), e.name, e.value) == ("AIORDMA_X='y': expected z", "AIORDMA_X", "y")


def test_choices_match_the_code_that_uses_them() -> None:
    from aiordma import completion, core, providers
    from aiordma.providers.soft import device, engine, nic

    assert settings.PROVIDER.choices == providers.PROVIDERS
    assert settings.SOFT_ENGINE.choices == engine.ENGINES
    assert settings.CORE.choices == core.CORES == ("compiled", "python")
    assert settings.SOFT_ICRC.choices == nic.IcrcPolicy.ALL
    assert settings.PROGRESS.choices == completion.PROGRESS_MODES
    assert settings.MAX_SOFT_MTU == device.MAX_SOFT_MTU


# ------------------------------------------------------- one source of truth ----


def _library_files() -> list[Path]:
    return sorted([*(ROOT / "aiordma").rglob("*.py"), *(ROOT / "aiordma").rglob("*.pyx")])


def test_every_variable_the_library_names_is_declared() -> None:
    named: set[str] = set()
    for path in _library_files():
        named |= set(NAME.findall(path.read_text()))
    assert {"AIORDMA_PROVIDER", "AIORDMA_SPIN_US", "AIORDMA_SOFT_GRO"} <= named  # the scan works
    assert sorted(named - set(SETTINGS)) == []


def test_only_the_settings_module_reads_the_environment() -> None:
    reads = re.compile(r"""(?:environ|env|getenv)\s*(?:\.get\(|\[|\()\s*["']AIORDMA_""")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _library_files()
        if path.name != "settings.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if reads.search(line)
    ]
    assert offenders == []


#: the documentation's table of environment variables
CONFIGURATION = ROOT / "docs" / "configuration.md"


def _docs_table() -> dict[str, str]:
    """The table of environment variables in docs/configuration.md: name -> its row."""
    rows = re.findall(r"^\| `(AIORDMA_[A-Z0-9_]+)` \|(.*)\|$", CONFIGURATION.read_text(), re.M)
    assert len(rows) == len({name for name, _ in rows}), "a variable has two rows"
    return dict(rows)


def _documentation() -> list[Path]:
    """The project's prose: the README and every page of the docs site."""
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)]


def _read_outside_the_library() -> set[str]:
    """Variables read by the build (setup.py), CI (.ci/run) and the scripts, not by aiordma."""
    files = [ROOT / "setup.py", ROOT / ".ci" / "run", *sorted((ROOT / "scripts").iterdir())]
    return {name for f in files if f.is_file() for name in NAME.findall(f.read_text(errors="replace"))}


def test_docs_table_documents_exactly_the_declared_settings() -> None:
    table = _docs_table()
    assert list(table) == list(SETTINGS), (
        "docs/configuration.md's table and aiordma/settings.py disagree (or their order does)"
    )
    for name, row in table.items():
        for choice in SETTINGS[name].choices:
            assert f"`{choice}`" in row, f"{name}: docs/configuration.md does not list `{choice}`"
    for page in _documentation():
        if page != CONFIGURATION:
            rows = re.findall(r"^\| `(AIORDMA_[A-Z0-9_]+)` \|", page.read_text(), re.M)
            assert rows == [], f"{page.relative_to(ROOT)}: a second table of variables ({rows}): keep one"
    known = set(SETTINGS) | _read_outside_the_library()
    for page in _documentation():
        mentioned = set(NAME.findall(page.read_text()))
        assert sorted(mentioned - known) == [], f"{page.relative_to(ROOT)} names variables nothing reads"


# ----------------------------------------------------------- the library ----


def test_library_readers_refuse_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiordma._env import spin_us_from_env
    from aiordma.providers import resolve_provider
    from aiordma.providers.soft.device import SoftDevice
    from aiordma.security import insecure_from_env, resolve_token

    monkeypatch.setenv("AIORDMA_PROVIDER", "bogus")
    with pytest.raises(SettingError, match="AIORDMA_PROVIDER='bogus'"):
        resolve_provider()
    assert resolve_provider("soft") == ("soft", None)  # the argument wins
    monkeypatch.setenv("AIORDMA_PROVIDER", "SOFT")
    assert resolve_provider() == ("soft", None)
    with pytest.raises(ValueError, match="unknown provider 'nope'") as e:
        resolve_provider("nope")  # a bad argument is not a setting
    assert not isinstance(e.value, SettingError)

    monkeypatch.setenv("AIORDMA_SPIN_US", "50")
    assert spin_us_from_env() == spin_us_from_env(0.0) == 50.0
    monkeypatch.delenv("AIORDMA_SPIN_US")
    assert spin_us_from_env() == 200.0 and spin_us_from_env(0.0) == 0.0  # the channel's own default

    monkeypatch.setenv("AIORDMA_INSECURE", "off")
    assert insecure_from_env() is False and insecure_from_env(True) is True
    monkeypatch.setenv("AIORDMA_INSECURE", "maybe")
    with pytest.raises(SettingError, match="AIORDMA_INSECURE='maybe'"):
        insecure_from_env()

    monkeypatch.setenv("AIORDMA_TOKEN", "s3cret-but-long-enough-for-no-warning-0123456789")
    assert resolve_token() == b"s3cret-but-long-enough-for-no-warning-0123456789"

    monkeypatch.setenv("AIORDMA_SOFT_MTU", "100")
    with pytest.raises(SettingError, match=r"AIORDMA_SOFT_MTU='100': expected a whole number from 256 to 61440"):
        SoftDevice(engine="python")


def test_soft_device_reads_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiordma.providers.soft.device import SoftDevice

    monkeypatch.setenv("AIORDMA_SOFT_MTU", "4096")
    monkeypatch.setenv("AIORDMA_SOFT_GSO", "off")
    monkeypatch.setenv("AIORDMA_SOFT_ICRC", "any-ip-id")
    dev = SoftDevice(engine="python")
    try:
        assert dev.soft_mtu == 4096 and not dev.gso and dev.icrc_policy == "any-ip-id"
    finally:
        dev.close()


# ---------------------------------------------------------- the commands ----


def test_invoke_reports_a_setting_error_as_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiordma.tools import ToolParser, invoke

    ran: list[int] = []

    def run(args: argparse.Namespace) -> int:
        ran.append(1)
        return 0

    monkeypatch.setenv("AIORDMA_PROGRESS", "poll")
    assert invoke(run, argparse.Namespace(), ToolParser(prog="aiordma x")) == 2
    assert ran == []  # checked before the tool runs
    assert capsys.readouterr().err == "aiordma: AIORDMA_PROGRESS='poll': expected one of event, thread, busy\n"
    monkeypatch.delenv("AIORDMA_PROGRESS")

    def late(args: argparse.Namespace) -> int:  # a setting refused while the tool runs
        raise SettingError("AIORDMA_X='y': expected z", "AIORDMA_X", "y")

    assert invoke(late, argparse.Namespace(), ToolParser(prog="aiordma x")) == 2
    assert capsys.readouterr().err == "aiordma: AIORDMA_X='y': expected z\n"


def test_the_doctor_refuses_a_bad_variable_in_the_environment_it_examines() -> None:
    from aiordma.tools.doctor.diagnosis import diagnose_sync
    from aiordma.tools.doctor.probe import Probe

    # (before: a non-numeric AIORDMA_GID_INDEX was ignored, a bad provider "a bug in a check")
    for env in ({"AIORDMA_GID_INDEX": "two"}, {"AIORDMA_PROVIDER": "bogus"}, {"AIORDMA_SOFT_ADDR": "127.0.0.1:x"}):
        with pytest.raises(SettingError, match=re.escape(f"{next(iter(env))}={next(iter(env.values()))!r}")):
            diagnose_sync(probe=Probe("/nonexistent", env=env))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIORDMA_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


COMMANDS = [
    ["-m", "aiordma.cli", "devices"],
    ["-m", "aiordma.cli", "bench", "write_lat", "-n", "10"],
    ["-m", "aiordma.cli", "doctor"],
    ["-m", "aiordma.cli", "demo"],
    ["-m", "aiordma.tools.doctor"],
    ["-m", "aiordma.tools.bench", "send_lat", "-n", "10"],
]
BAD_ENV = [
    ("AIORDMA_PROVIDER", "bogus", "expected one of auto, soft, pyverbs"),
    ("AIORDMA_SPIN_US", "-5", "expected a number of microseconds, 0 or more"),
]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[1:]))
@pytest.mark.parametrize("name, value, expected", BAD_ENV, ids=lambda x: x)
def test_every_command_reports_a_bad_variable_in_one_line(
    argv: list[str], name: str, value: str, expected: str
) -> None:
    cp = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=60, env=_env(**{name: value}), cwd=ROOT
    )
    explain = f"exit {cp.returncode}\nstdout:\n{cp.stdout}\nstderr:\n{cp.stderr}"
    assert cp.returncode == 2, explain
    assert "Traceback" not in cp.stderr, explain
    assert cp.stderr.splitlines() == [f"aiordma: {name}={value!r}: {expected}"], explain
    assert cp.stdout == "", explain  # nothing ran


def test_a_good_variable_still_works_in_a_command() -> None:
    cp = subprocess.run(
        [sys.executable, "-m", "aiordma.cli", "devices", "--no-soft", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(AIORDMA_PROVIDER="SOFT", AIORDMA_GID_INDEX="1"),
        cwd=ROOT,
    )
    assert cp.returncode == 0, cp.stderr
    import json

    auto = json.loads(cp.stdout)["auto"]
    assert (auto["provider"], auto["env"]["AIORDMA_PROVIDER"], auto["env"]["AIORDMA_GID_INDEX"]) == ("soft", "soft", 1)
