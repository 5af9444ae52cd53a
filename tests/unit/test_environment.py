"""The test suite's own environment: no ``AIORDMA_*`` setting of the shell that
runs pytest reaches a test (the root conftest removes them), except the
variables that size or describe the test suite itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.environment import (
    SUITE_SELECTORS,
    TEST_SUITE_PREFIXES,
    TEST_SUITE_VARIABLES,
    is_test_suite_variable,
)

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bAIORDMA_[A-Z0-9_]*[A-Z0-9]\b")
#: set by test_shell_settings_do_not_reach_tests for the run it starts (no AIORDMA_ prefix: kept)
PROBE = "_AIORDMA_ENVIRONMENT_PROBE"


def names_in(*parts: str, exclude: tuple[Path, ...] = ()) -> set[str]:
    """Every AIORDMA_* name in the .py files under ``parts`` (files or folders of ROOT)."""
    found: set[str] = set()
    for part in parts:
        base = ROOT / part
        for path in [base] if base.is_file() else base.rglob("*.py"):
            if not any(path.is_relative_to(x) for x in exclude):
                found |= set(NAME.findall(path.read_text(errors="replace")))
    return found


def library_variables() -> set[str]:
    """Every AIORDMA_* name in aiordma's code, its examples and its benchmarks."""
    return names_in("aiordma", "examples", "benchmarks")


def test_no_variable_aiordma_reads_is_kept() -> None:
    names = library_variables()
    # the scan works: the well-known settings are among what it found
    assert {"AIORDMA_PROVIDER", "AIORDMA_DEVICE", "AIORDMA_TOKEN", "AIORDMA_SPIN_US", "AIORDMA_SOFT_ADDR"} <= names
    kept = sorted(n for n in names if is_test_suite_variable(n))
    assert not kept, f"aiordma reads {kept}: the root conftest must clear them (tests/support/environment.py)"


def test_every_kept_variable_is_used_by_the_tests() -> None:
    used = names_in("tests", exclude=(ROOT / "tests" / "support", Path(__file__)))
    assert TEST_SUITE_VARIABLES <= used, f"stale entries: {sorted(TEST_SUITE_VARIABLES - used)}"
    for prefix in TEST_SUITE_PREFIXES:
        assert any(n.startswith(prefix) for n in used), prefix


def test_environment_is_clean() -> None:
    """Also the inner half of the next test, which runs it with a polluted shell."""
    leaked = sorted(
        n for n in os.environ if n.startswith("AIORDMA_") and not is_test_suite_variable(n) and n not in SUITE_SELECTORS
    )
    assert not leaked, f"AIORDMA_* variables reached the tests: {leaked}"
    if os.environ.get(PROBE):
        # the test suite's own settings pass through unchanged
        assert os.environ.get("AIORDMA_LEAK_REPS") == "7"
        assert os.environ.get("AIORDMA_RXE_DEVICE") == "rxe9"
        # a run chosen for one engine stays on it
        assert os.environ.get("AIORDMA_SOFT_ENGINE") == "python"
        # and aiordma sees its defaults, not the shell's nonsense
        from aiordma._env import DEFAULT_SPIN_US, spin_us_from_env
        from aiordma.rendezvous import token_from_env

        assert spin_us_from_env() == DEFAULT_SPIN_US
        assert token_from_env(None) is None


def test_shell_settings_do_not_reach_tests() -> None:
    """A shell with every aiordma setting set (to nonsense) runs the tests as a clean one would."""
    env = dict(os.environ)
    for name in library_variables():
        env[name] = "nonsense-from-the-shell"
    env.update({"AIORDMA_LEAK_REPS": "7", "AIORDMA_RXE_DEVICE": "rxe9", "AIORDMA_SOFT_ENGINE": "python", PROBE: "1"})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::test_environment_is_clean"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 passed" in proc.stdout, proc.stdout[-3000:]
