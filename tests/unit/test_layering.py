"""No module of aiordma reaches into another module's underscore names.

The layers (the Layout section of docs/architecture.md) talk through public interfaces: a stream uses the
connection's public methods and typed events, the soft device's facade talks
to its engine through the engine protocol, the public API asks the provider
interface for ``soft_mtu``/``error_reason``. This check reads every module's
syntax tree: an attribute ``obj._name`` or an import of ``_name`` is allowed
only when ``_name`` is defined in the same module (its own classes' privates).
The command-line tool packages (``aiordma/tools/bench``, ``aiordma/tools/doctor``)
were single modules split along their seams and count as one module each.
One module is a declared friend of another, for named privates only: the
handshake (``aiordma/handshake.py``) is the connection's set-up in a module of
its own, and calls :class:`~aiordma.Connection`'s three set-up steps, which are
not public API.

The native engine's Cython sources (``.pyx``, the ``.pxi`` files it includes, the
``.pxd`` declarations) are held to the same rules for what they import, cimport
or include (Cython is not Python: their statements are read line by line, their
strings and comments left out); they count as one module, the extension they
are compiled into. Two rules more, for every file: nothing shipped imports from
``tests`` (the test-only RC core, ``tests.native._testing``, stays out of the
package), and every module of aiordma that a Cython file names exists.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine_neutral  # the same on every engine and core: CI's reference run leaves it out

ROOT = Path(__file__).resolve().parents[2] / "aiordma"
#: packages whose files share their private helpers (one module split into several files)
ONE_MODULE_PACKAGES = ("tools/bench", "tools/doctor")
#: module -> the private names of other modules it may use (and only those)
FRIENDS = {
    "handshake.py": frozenset({"_local_endpoint", "_connect_queue_pair", "_peer_ready", "_attach_rendezvous"}),
    # RDMA CM's set-up: the handshake's steps, and its first exchange on the queue pair
    "cm.py": frozenset(
        {
            "_local_endpoint",
            "_connect_queue_pair",
            "_attach_rendezvous",
            "_adopt_peer",
            "_route_rendezvous",
            "_send_control_data",
        }
    ),
}
#: Cython sources, read by the patterns below (ast cannot parse them)
CYTHON_SUFFIXES = (".pyx", ".pxi", ".pxd")
#: folders whose Cython files are compiled into one extension module
CYTHON_MODULES = ("providers/soft/_native",)


def unit_of(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).as_posix()
    for pkg in ONE_MODULE_PACKAGES:
        if rel.startswith(pkg + "/"):
            return pkg
    if path.suffix in CYTHON_SUFFIXES:
        for pkg in CYTHON_MODULES:
            if rel.startswith(pkg + "/"):
                return pkg + " (Cython)"
    return rel


@dataclass(frozen=True)
class CythonImport:
    """One import, cimport or include statement of a Cython file."""

    lineno: int
    kind: str  # "import", "cimport" or "include"
    module: str  # dotted, without the leading dots; the path for an include
    level: int  # leading dots of a relative import
    names: tuple[str, ...]  # what a from-import takes (() for `import x`)


_TRIPLE = re.compile(r'("""|\'\'\')(?:.|\n)*?\1')
_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'')
_FROM = re.compile(r"^[ \t]*from[ \t]+(\.*)([\w.]*)[ \t]+(c?import)[ \t]+(\([^)]*\)|[^\n]*)", re.M)
_IMPORT = re.compile(
    r"^[ \t]*(c?import)[ \t]+([\w.]+(?:[ \t]+as[ \t]+\w+)?(?:[ \t]*,[ \t]*[\w.]+(?:[ \t]+as[ \t]+\w+)?)*)", re.M
)
_INCLUDE = re.compile(r'^[ \t]*include[ \t]+"([^"]+)"', re.M)
_DEFINED = re.compile(
    r"^[ \t]*(?:(?:cp?def|ctypedef)\b[^\n=(:]*?\b(\w+)[ \t]*[(:\[]|(?:async[ \t]+)?def[ \t]+(\w+)|class[ \t]+(\w+)"
    r"|(\w+)[ \t]*(?::[^=\n]*)?=[^=])",
    re.M,
)


def _code_only(text: str) -> str:
    """The text with its strings and comments blanked out (line numbers kept); the
    paths of ``include "..."`` statements are kept."""
    text = _TRIPLE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    lines = []
    for line in text.split("\n"):
        if re.match(r'^[ \t]*include[ \t]+"', line):
            lines.append(line)
            continue
        line = _STRING.sub('""', line)
        lines.append(line.split("#", 1)[0])
    return "\n".join(lines)


def cython_imports(text: str) -> list[CythonImport]:
    code = _code_only(text)
    found = []
    for m in _FROM.finditer(code):
        names = tuple(n.split()[0] for n in m.group(4).strip("()").replace("\n", " ").split(",") if n.strip())
        lineno = code.count("\n", 0, m.start()) + 1
        found.append(CythonImport(lineno, m.group(3), m.group(2), len(m.group(1)), names))
    for m in _IMPORT.finditer(code):
        lineno = code.count("\n", 0, m.start()) + 1
        for part in m.group(2).split(","):
            found.append(CythonImport(lineno, m.group(1), part.split()[0], 0, ()))
    for m in _INCLUDE.finditer(code):
        found.append(CythonImport(code.count("\n", 0, m.start()) + 1, "include", m.group(1), 0, ()))
    return sorted(found, key=lambda i: i.lineno)


def cython_defined_names(text: str, declarations: bool = False) -> set[str]:
    """The names a Cython file defines; for a .pxd (``declarations``), every name it
    declares (the C functions and types of its ``cdef extern`` blocks)."""
    code = _code_only(text)
    if declarations:
        return set(re.findall(r"\b[A-Za-z_]\w*\b", code))
    return {next(g for g in m.groups() if g) for m in _DEFINED.finditer(code)}


def _absolute(path: Path, root: Path, imp: CythonImport) -> str:
    """The dotted name an import of the file at ``path`` names."""
    if not imp.level:
        return imp.module
    package = ["aiordma", *path.relative_to(root).parent.parts]
    base = package[: len(package) - (imp.level - 1)]
    return ".".join(base + ([imp.module] if imp.module else []))


def _exists(dotted: str, root: Path, cimport: bool) -> bool:
    """Whether the aiordma module ``dotted`` (a .pxd for a cimport) is in the tree."""
    where = root.parent.joinpath(*dotted.split("."))
    if cimport:
        return where.with_suffix(".pxd").is_file() or (where / "__init__.pxd").is_file()
    return (
        where.with_suffix(".py").is_file() or (where / "__init__.py").is_file() or where.with_suffix(".pyx").is_file()
    )


def cython_violations(root: Path, own: dict[str, set[str]]) -> list[str]:
    found = []
    for path in sorted(p for suffix in CYTHON_SUFFIXES for p in root.rglob("*" + suffix)):
        text = path.read_text()
        mine = own[unit_of(path, root)]
        where = path.relative_to(root.parent)
        for imp in cython_imports(text):
            if imp.kind == "include":
                if (path.parent / imp.module).resolve().is_relative_to(root.parent / "tests"):
                    found.append(f"{where}:{imp.lineno}: include {imp.module!r} (test code)")
                continue
            dotted = _absolute(path, root, imp)
            if dotted == "tests" or dotted.startswith("tests."):
                found.append(f"{where}:{imp.lineno}: {imp.kind} from {dotted} (test code)")
                continue
            if not (dotted == "aiordma" or dotted.startswith("aiordma.")):
                continue
            parent = dotted if imp.names else dotted.rsplit(".", 1)[0]
            # `from package import module` names a module or a name of the package: the package must exist
            if not _exists(dotted if not imp.names else parent, root, imp.kind == "cimport") and not (
                imp.names and _exists(dotted, root, False)
            ):
                found.append(f"{where}:{imp.lineno}: {imp.kind} of {dotted}, which is not in the tree")
            for name in imp.names:
                if is_private(name) and name not in mine:
                    found.append(f"{where}:{imp.lineno}: from {dotted} {imp.kind} {name}")
    return found


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)  # an attribute of this module's own classes
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)  # argparse's set_defaults(_run=...), dataclass fields by keyword
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and is_private(node.value):
            names.add(node.value)  # __slots__ entries
    return names


def violations(root: Path = ROOT) -> list[str]:
    trees = {p: ast.parse(p.read_text(), str(p)) for p in sorted(root.rglob("*.py"))}
    own: dict[str, set[str]] = defaultdict(set)
    for path, tree in trees.items():
        own[unit_of(path, root)] |= defined_names(tree)
    for suffix in CYTHON_SUFFIXES:
        for path in root.rglob("*" + suffix):
            own[unit_of(path, root)] |= cython_defined_names(path.read_text(), suffix == ".pxd")
    found = cython_violations(root, own)
    for path, tree in trees.items():
        mine = own[unit_of(path, root)] | FRIENDS.get(unit_of(path, root), frozenset())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and is_private(node.attr) and node.attr not in mine:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tests" and not node.level:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: from {node.module} import (test code)")
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("aiordma")):
                if node.module and node.module.lstrip(".").startswith("_native"):
                    continue  # the compiled engine's module (named like a private module, no private names)
                for alias in node.names:
                    if is_private(alias.name) and alias.name not in mine:
                        found.append(
                            f"{path.relative_to(root.parent)}:{node.lineno}: from {node.module} import {alias.name}"
                        )
    return found


def test_no_module_reaches_into_another_modules_privates() -> None:
    found = violations()
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_friends_name_only_privates_that_exist() -> None:
    # a renamed set-up step must not leave a stale permission behind
    for friend, names in FRIENDS.items():
        assert (ROOT / friend).exists(), friend
        connection = defined_names(ast.parse((ROOT / "connection.py").read_text()))
        assert names <= connection, (
            f"{friend} may use {sorted(names - connection)}, which connection.py does not define"
        )


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    pkg = tmp_path / "aiordma"
    (pkg / "tools" / "bench").mkdir(parents=True)
    (pkg / "connection.py").write_text("class Connection:\n    def __init__(self):\n        self._window = 1\n")
    (pkg / "stream.py").write_text(
        "from .connection import _helper\n"
        "def f(conn):\n    conn._window += 1\n    return conn._own\n"
        "class S:\n    def __init__(self):\n        self._own = 0\n"
    )
    (pkg / "tools" / "bench" / "a.py").write_text("def _shared():\n    pass\n")
    (pkg / "tools" / "bench" / "b.py").write_text("from .a import _shared\n")
    found = violations(pkg)
    assert len(found) == 2, found  # conn._window and the import of _helper; _own and _shared are fine
    assert any("conn._window" in f for f in found) and any("_helper" in f for f in found)


def test_the_check_reads_cython_sources(tmp_path: Path) -> None:
    pkg = tmp_path / "aiordma"
    native = pkg / "providers" / "soft" / "_native"
    (native / "includes").mkdir(parents=True)
    for d in (pkg, pkg / "providers", pkg / "providers" / "soft", native):
        (d / "__init__.py").write_text("")
    (pkg / "connection.py").write_text("def _helper():\n    pass\n")
    (native / "includes" / "__init__.pxd").write_text("")
    (native / "includes" / "nic.pxd").write_text('cdef extern from "nic.h":\n    int _sum(int x)\n')
    (native / "_engine.pyx").write_text(
        '''"""Prose is not code: from ....connection import _fake, import tests."""
include "verbs.pxi"
from aiordma.providers.soft._native.includes.nic cimport _sum
from .includes.gone cimport *
from ....connection import (
    _helper,  # another module's private name
)
import tests.native._testing as t  # "#" in a comment
s = "from ....connection import _fake"
'''
    )
    (native / "verbs.pxi").write_text("cdef int _local = 0\nfrom ..missing import x\n")
    found = violations(pkg)
    assert len(found) == 4, found
    assert any("_engine.pyx:5: from aiordma.connection import _helper" in f for f in found)
    assert any("_engine.pyx:4: cimport of aiordma.providers.soft._native.includes.gone" in f for f in found)
    assert any("_engine.pyx:8: import from tests.native._testing (test code)" in f for f in found)
    assert any("verbs.pxi:2: import of aiordma.providers.soft.missing" in f for f in found)
    # the cimport of _sum is the extension's own (includes/*.pxd), _fake is prose and strings


def test_the_check_reads_the_engines_cython_imports() -> None:
    """The reader finds the real imports of _engine.pyx (a check that reads nothing passes)."""
    imports = cython_imports((ROOT / "providers/soft/_native/_engine.pyx").read_text())
    kinds = {(i.kind, i.module) for i in imports}
    assert ("include", "common.pxi") in kinds and ("include", "engine.pxi") in kinds
    assert ("cimport", "aiordma.providers.soft._native.includes.nic") in kinds
    assert ("import", "faults") in kinds and ("import", "os") in kinds


def test_connection_stays_the_public_api_and_the_glue() -> None:
    """``Connection`` delegates to its collaborators (handshake, qp_setup, messages,
    work_requests, control, large_messages): it stays under 1,000 lines, and its
    module imports neither the handshake nor the server (no import cycle to break)."""
    tree = ast.parse((ROOT / "connection.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Connection"]
    assert cls.end_lineno is not None
    lines = cls.end_lineno - cls.lineno + 1
    assert lines < 1000, f"Connection is {lines} lines: move what is not API or glue into a collaborator"
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"handshake", "server"}, imported
    assert not any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)


def test_no_extension_module_shadows_a_source_module() -> None:
    """Python imports an extension module in preference to a ``.py`` file of the same
    name beside it: a leftover build (e.g. of a module compiled in an experiment) would
    silently run instead of the source. The compiled modules (the native engine,
    the per-operation core ``aiordma._core``) have no ``.py`` twin of their name: the
    core's interpreted twin is other modules (aiordma.core says which)."""
    shadowing = [
        str(so.relative_to(ROOT.parent))
        for so in ROOT.rglob("*.so")
        if (so.parent / (so.name.split(".")[0] + ".py")).exists()
    ]
    assert not shadowing, f"remove these stale builds: {shadowing}"
