"""No import circle in aiordma, the deferred imports included.

A deferred import (inside a function, or under ``if TYPE_CHECKING:``) hides a
circle from the interpreter but not from the design: two modules that need each
other are one concept split in two, or share a piece that belongs in a lower
module. So this check reads every module's syntax tree and counts every import
between aiordma's modules as an edge, wherever it stands: at module level, in a
function or method, under ``TYPE_CHECKING``, an ``importlib.import_module`` of
a constant name, and the two dynamic imports the package has (the lazy names of
``aiordma/__init__.py``, the subcommands of ``aiordma/cli.py``), read from their
tables. The native engine's Python-level imports (``_engine.pyx`` and the
``.pxi`` files it includes) are the edges of the extension module.

A package's ``__init__`` is a node of its own. ``from . import x`` is an edge to
the submodule ``x`` when there is one, and to the package when ``x`` is a name
its ``__init__`` defines. Importing ``a.b.c`` runs ``a`` and ``a.b`` first, so
those packages are edges too, except where they are packages the importing
module is inside (they are running already: that is what a package is).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .test_layering import CYTHON_MODULES, CYTHON_SUFFIXES, cython_imports

pytestmark = pytest.mark.engine_neutral  # the same on every engine and core: CI's reference run leaves it out

ROOT = Path(__file__).resolve().parents[2] / "aiordma"


@dataclass(frozen=True)
class Edge:
    """One import of one aiordma module by another, and where it is."""

    source: str
    target: str
    where: str  # path:line

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.where})"


def module_names(root: Path) -> dict[Path, str]:
    """Each source file and the dotted name of the module it is; the Cython files
    of a compiled extension all name the extension's module."""
    names = {}
    package = root.name
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[path] = ".".join((package, *parts))
    for folder in CYTHON_MODULES:
        for pyx in sorted((root / folder).glob("*.pyx")):
            extension = ".".join((package, *pyx.relative_to(root).with_suffix("").parts))
            for suffix in CYTHON_SUFFIXES[:2]:  # .pyx and the .pxi files it includes (a .pxd is compile time)
                for path in sorted((root / folder).glob("*" + suffix)):
                    names[path] = extension
    # an extension of one .pyx file (aiordma._core)
    for pyx in sorted(root.rglob("*.pyx")):
        names.setdefault(pyx, ".".join((package, *pyx.relative_to(root).with_suffix("").parts)))
    return names


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def _resolve(module: str, path: Path, level: int, name: str | None) -> str:
    """The absolute dotted name a (relative) import in ``module`` names."""
    if not level:
        return name or ""
    base = _package_of(module, path).split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


class _Graph:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = module_names(root)
        self.modules = set(self.files.values())
        self.edges: set[Edge] = set()
        self.unresolved: list[str] = []

    def _where(self, path: Path, lineno: int) -> str:
        return f"{path.relative_to(self.root.parent)}:{lineno}"

    def add(self, source: str, target: str, path: Path, lineno: int) -> None:
        """``source`` imports the module ``target``: an edge to it and to each package
        above it that ``source`` is not inside."""
        if not _within(target, self.root.name):
            return
        if target not in self.modules:
            self.unresolved.append(f"{self._where(path, lineno)}: {target} is not a module of the tree")
            return
        where = self._where(path, lineno)
        if target != source:
            self.edges.add(Edge(source, target, where))
        parts = target.split(".")
        for i in range(1, len(parts)):
            package = ".".join(parts[:i])
            if not _within(source, package):
                self.edges.add(Edge(source, package, where))

    def add_from(self, source: str, base: str, names: list[str], path: Path, lineno: int) -> None:
        """``from base import names``: each name a submodule, or a name of ``base``."""
        if not _within(base, self.root.name):
            return
        for name in names:
            if name != "*" and f"{base}.{name}" in self.modules:
                self.add(source, f"{base}.{name}", path, lineno)
            else:
                self.add(source, base, path, lineno)

    def read_python(self, path: Path, module: str) -> None:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self.add(module, alias.name, path, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, path, node.level, node.module)
                self.add_from(module, base, [a.name for a in node.names], path, node.lineno)
            elif isinstance(node, ast.Call) and _is_import_module(node):
                self.read_dynamic_import(tree, node, module, path)

    def read_dynamic_import(self, tree: ast.Module, call: ast.Call, module: str, path: Path) -> None:
        arg = call.args[0] if call.args else None
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            level = len(arg.value) - len(arg.value.lstrip("."))
            self.add(module, _resolve(module, path, level, arg.value.lstrip(".") or None), path, call.lineno)
            return
        if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
            prefix = str(arg.values[0].value)
            if not prefix.startswith(".") and not _within(prefix.split(".")[0], self.root.name):
                return  # another package's modules (pyverbs.*)
        targets = DYNAMIC.get(module)
        if targets is None:
            self.unresolved.append(
                f"{self._where(path, call.lineno)}: import_module({ast.unparse(arg) if arg else ''}) "
                "names no module this check can read: add its table to DYNAMIC"
            )
            return
        for target in targets(tree):
            self.add(module, target, path, call.lineno)

    def read_cython(self, path: Path, module: str) -> None:
        for imp in cython_imports(path.read_text()):
            if imp.kind != "import":
                continue  # cimports and includes are resolved at compile time
            base = _resolve(module, path.parent / "_engine.pyx", imp.level, imp.module or None)
            if imp.names:
                self.add_from(module, base, list(imp.names), path, imp.lineno)
            else:
                self.add(module, base, path, imp.lineno)


def _is_import_module(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id in ("import_module", "__import__")
    )


def _table(tree: ast.Module, name: str) -> dict[str, Any]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, dict), name
            return value
    raise AssertionError(f"no table {name}")


#: module -> the modules its dynamic ``import_module`` calls import, read from the table it reads them from
DYNAMIC = {
    # the lazy public names: ``importlib.import_module(f".{module}", __name__)``
    "aiordma": lambda tree: sorted({f"aiordma.{m}" for m in _table(tree, "_LAZY").values()}),
    # the subcommands, each imported when the parser is built
    "aiordma.cli": lambda tree: sorted({str(v[0]) for v in _table(tree, "SUBCOMMANDS").values()}),
}


def import_graph(root: Path = ROOT) -> tuple[list[Edge], list[str]]:
    """Every import edge between the modules under ``root``, and the imports it could not resolve."""
    graph = _Graph(root)
    for path, module in graph.files.items():
        if path.suffix == ".py":
            graph.read_python(path, module)
        else:
            graph.read_cython(path, module)
    return sorted(graph.edges, key=lambda e: (e.source, e.target, e.where)), graph.unresolved


def cycles(edges: list[Edge]) -> Iterator[list[Edge]]:
    """One circle through each tangle: each strongly connected component of more than
    one module (Tarjan), the circle the shortest through its first module."""
    out: dict[str, list[Edge]] = {}
    for e in edges:
        out.setdefault(e.source, []).append(e)
        out.setdefault(e.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in out[v]:
            if e.target not in index:
                visit(e.target)
                low[v] = min(low[v], low[e.target])
            elif e.target in on_stack:
                low[v] = min(low[v], index[e.target])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(out):
        if v not in index:
            visit(v)
    for component in components:
        yield _circle_in(sorted(component)[0], component, out)


def _circle_in(start: str, component: set[str], out: dict[str, list[Edge]]) -> list[Edge]:
    """The shortest circle from ``start`` back to itself inside ``component`` (breadth first)."""
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for e in out[v]:
                if e.target not in component:
                    continue
                if e.target == start:
                    path = [e]
                    while path[0].source != start:
                        path.insert(0, came[path[0].source])
                    return path
                if e.target not in came:
                    came[e.target] = e
                    following.append(e.target)
        frontier = following
    raise AssertionError(f"{start} is in no circle")


def describe(circle: list[Edge], edges: Sequence[Edge] = ()) -> str:
    """The circle on one line, then each of its imports and where it is; with ``edges``,
    the modules of the tangle the circle is one of the circles of."""
    lines = [" -> ".join([circle[0].source, *(e.target for e in circle)])]
    lines += [f"    {e}" for e in circle]
    tangle = _tangle_of(circle, edges)
    if len(tangle) > len(circle):
        lines.append(f"  in a tangle of {len(tangle)} modules: {', '.join(sorted(tangle))}")
    return "\n".join(lines)


def _tangle_of(circle: list[Edge], edges: Sequence[Edge]) -> set[str]:
    """The modules that reach, and are reached from, the circle's."""
    start = circle[0].source
    forward: dict[str, set[str]] = {}
    backward: dict[str, set[str]] = {}
    for e in edges:
        forward.setdefault(e.source, set()).add(e.target)
        backward.setdefault(e.target, set()).add(e.source)

    def reach(graph: dict[str, set[str]]) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for w in graph.get(todo.pop(), ()):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    return reach(forward) & reach(backward) if edges else {e.source for e in circle}


def test_no_import_circle_in_aiordma() -> None:
    edges, unresolved = import_graph()
    assert not unresolved, "imports the check cannot resolve:\n" + "\n".join(unresolved)
    found = [describe(c, edges) for c in cycles(edges)]
    assert not found, "import circles (deferred imports count: move what both sides need into the lower module):\n" + (
        "\n".join(found)
    )


def test_the_check_reads_the_real_imports() -> None:
    """A check that reads nothing passes: the graph has the edges we know are there."""
    edges, _ = import_graph()
    pairs = {(e.source, e.target) for e in edges}
    assert ("aiordma", "aiordma.errors") in pairs  # module level, in the package's __init__
    assert ("aiordma", "aiordma.connection") in pairs  # a lazy name (and TYPE_CHECKING)
    assert ("aiordma.cli", "aiordma.tools.devices") in pairs  # a subcommand, by import_module
    assert ("aiordma.connection", "aiordma.providers.librdmacm") in pairs  # under TYPE_CHECKING
    assert ("aiordma.providers.soft._native._engine", "aiordma.providers.soft.faults") in pairs  # Cython
    assert ("aiordma.tools.doctor.peer", "aiordma.tools") in pairs  # from .. import host_port (a name of __init__)
    assert ("aiordma.providers", "aiordma.providers.soft.device") in pairs  # in a function (open_device)
    assert ("aiordma.handshake", "aiordma.cm") in pairs  # connect(rdma_cm=True) is cm's
    assert ("aiordma.cm", "aiordma.handshake") not in pairs  # ... and cm takes the hooks from below
    assert ("aiordma.errors", "aiordma.verbs") in pairs and not any(
        e.source == "aiordma.errors" and e.target.startswith("aiordma.providers") for e in edges
    )


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "aiordma"
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_the_check_sees_a_deferred_circle(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {
            "__init__.py": "from .errors import Error\n",
            "errors.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .providers.base import WC\n",
            "providers/__init__.py": "",
            "providers/base.py": "def f():\n    from .. import errors\n",
            "cm.py": "from . import handshake\n",
            "handshake.py": "def connect():\n    import aiordma.cm\n",
            "stream.py": "from . import Error\n",  # a name of __init__: an edge to the package
        },
    )
    edges, unresolved = import_graph(pkg)
    assert not unresolved
    found = sorted(describe(c).splitlines()[0] for c in cycles(edges))
    assert found == [
        "aiordma.cm -> aiordma.handshake -> aiordma.cm",
        "aiordma.errors -> aiordma.providers.base -> aiordma.errors",
    ], found
    pairs = {(e.source, e.target) for e in edges}
    assert ("aiordma.stream", "aiordma") in pairs
    assert ("aiordma.errors", "aiordma.providers") in pairs  # the package runs before its submodule
    assert ("aiordma.providers.base", "aiordma") not in pairs  # ... but not one the importer is inside


def test_a_package_importing_a_module_that_needs_its_names_is_a_circle(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {
            "__init__.py": "def connect(): ...\nfrom .tools import demo\n",
            "tools/__init__.py": "",
            "tools/demo.py": "def run():\n    import aiordma\n    aiordma.connect()\n",
        },
    )
    edges, _ = import_graph(pkg)
    (circle,) = list(cycles(edges))
    assert describe(circle).splitlines()[0] == "aiordma -> aiordma.tools.demo -> aiordma"


def test_an_import_the_check_cannot_read_fails_it(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "import importlib\ndef f(name):\n    return importlib.import_module(name)\n",
            "b.py": "from .gone import x\n",
        },
    )
    _, unresolved = import_graph(pkg)
    assert len(unresolved) == 2, unresolved
