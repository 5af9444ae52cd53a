"""No tracked file points at a document or a path outside the repository.

A reader of a clone (or of an installed copy) cannot open a lab machine's
notes directory or a design document that lives beside the clone, so prose
says what it means in place or points at a file inside the repository. The
patterns are spelt in pieces so that this file does not match itself.

The allowlist holds the functional uses only, each a (file, line fragment)
pair with its reason; a new entry needs the same kind of reason. It is empty:
the C program of the kernel Soft-RoCE interop tests lives in tests/rxe/c.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine_neutral  # the same on every engine and core: CI's reference run leaves it out

REPO = Path(__file__).resolve().parents[2]

#: a path into the sibling ``shared`` directory, or the design document beside the clone
OUTSIDE = re.compile(r"(?<![\w.-])" + "shared" + r"/[\w.-]" + "|" + r"\bDESIGN" + r"\.md\b")

#: (file, fragment of the matching line): the uses that make something run
ALLOWED: dict[tuple[str, str], str] = {}


def _tracked_files() -> list[str]:
    try:
        cp = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout ({exc})")
    return [name for name in cp.stdout.decode().split("\0") if name]


def _allowed(name: str, line: str) -> bool:
    return any(name == path and fragment in line for path, fragment in ALLOWED)


def test_no_file_refers_to_a_path_outside_the_repository() -> None:
    found = []
    for name in _tracked_files():
        path = REPO / name
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary data
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line) and not _allowed(name, line):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "references outside the repository:\n" + "\n".join(found)


def test_the_allowlist_is_still_needed() -> None:
    """Every allowlist entry still matches a line (a stale entry would hide a new use)."""
    for path, fragment in ALLOWED:
        lines = (REPO / path).read_text(encoding="utf-8").splitlines()
        assert any(fragment in line and OUTSIDE.search(line) for line in lines), (path, fragment)


@pytest.mark.parametrize(
    ("line", "matches"),
    [
        ("See " + "shared" + "/notes/roce-wire.md", True),
        ("../" + "shared" + "/rxe-lab/x.c", True),
        ("The layers (" + "DESIGN" + ".md) talk", True),
        ("the shared layers per write", False),
        ("LDSHARED=clang -" + "shared", False),
        ("a " + "shared" + "/exclusive lock", True),  # conservative: rephrase such prose
    ],
)
def test_the_pattern(line: str, matches: bool) -> None:
    assert bool(OUTSIDE.search(line)) is matches
