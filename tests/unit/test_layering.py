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
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "aiordma"
#: packages whose files share their private helpers (one module split into several files)
ONE_MODULE_PACKAGES = ("tools/bench", "tools/doctor")
#: module -> the private names of other modules it may use (and only those)
FRIENDS = {"handshake.py": frozenset({"_local_endpoint", "_connect_queue_pair", "_attach_rendezvous"})}


def unit_of(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).as_posix()
    for pkg in ONE_MODULE_PACKAGES:
        if rel.startswith(pkg + "/"):
            return pkg
    return rel


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
    found = []
    for path, tree in trees.items():
        mine = own[unit_of(path, root)] | FRIENDS.get(unit_of(path, root), frozenset())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and is_private(node.attr) and node.attr not in mine:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}")
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
