"""The compiled engine's type stub (``_engine.pyi``) names what the compiled
module exports, and nothing else: a name added to, or dropped from, one of the
two fails here; the compiled per-operation core's (``aiordma/_core.pyi``) too. The members of the engine objects are checked against the
engine protocol by tests/integration/test_engine_conformance.py. The test-only
RC core's stub (tests/native/_testing.pyi) names its classes' members likewise."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

_engine = pytest.importorskip(
    "aiordma.providers.soft._native._engine", reason="the native engine is not built (CI requires it)"
)

ROOT = Path(__file__).resolve().parents[2]
STUB = ROOT / "aiordma/providers/soft/_native/_engine.pyi"
CORE_STUB = ROOT / "aiordma/_core.pyi"
TESTING_STUB = ROOT / "tests/native/_testing.pyi"


def _stub_names(stub: Path = STUB) -> dict[str, set[str] | None]:
    """Top-level names of the stub; for its classes, their members."""
    tree = ast.parse(stub.read_text())
    out: dict[str, set[str] | None] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
            out[node.name] = {m for m in members if not m.startswith("_")}
        elif isinstance(node, ast.FunctionDef):
            out[node.name] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = None
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.asname == alias.name:  # an explicit re-export
                    out[alias.name] = None
    return out


def test_the_stub_names_exactly_what_the_module_exports():
    stub = _stub_names()
    module = {name for name in dir(_engine) if not name.startswith("_")}
    assert set(stub) == module


def test_the_stubs_classes_have_the_compiled_classes_members():
    for name, members in _stub_names().items():
        obj = getattr(_engine, name)
        if members is None or not inspect.isclass(obj) or obj.__module__ != _engine.__name__:
            continue
        compiled = {m for m in vars(obj) if not m.startswith("_")}
        assert members == compiled, name


def test_the_test_only_cores_stub_has_its_classes_and_members():
    # (built with the engine: tests/unit/rc_harness.py fails where only the engine is)
    from tests.native import _testing

    classes = {n: m for n, m in _stub_names(TESTING_STUB).items() if m is not None}
    assert set(classes) == {"RCCore", "SansIOMemory", "SansIOSRQ"}
    for name, members in classes.items():
        assert members == {m for m in vars(getattr(_testing, name)) if not m.startswith("_")}, name


def test_the_cores_stub_names_exactly_its_classes_and_their_members():
    from aiordma import _core

    stub = _stub_names(CORE_STUB)
    assert set(stub) == set(_core.__all__) == {n for n in dir(_core) if not n.startswith("_")}
    for name, members in stub.items():
        if members is None:  # a function (the metrics' readers)
            assert callable(getattr(_core, name)), name
            continue
        assert members == {m for m in vars(getattr(_core, name)) if not m.startswith("_")}, name
