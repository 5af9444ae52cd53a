"""Find and import pyverbs (rdma-core's Python bindings) without polluting ``sys.path``.

pyverbs is not on PyPI: Debian/Ubuntu ship it as ``python3-pyverbs`` in
``/usr/lib/python3/dist-packages``, Fedora/RHEL as ``python3-pyverbs`` in
``/usr/lib64/python3.X/site-packages``. A venv or a pyenv interpreter does not
see those directories, and putting a whole system ``dist-packages`` on
``sys.path`` would shadow the venv's own packages. So:

1. ``import pyverbs`` (it is importable: a system interpreter, a venv made with
   ``--system-site-packages``, or ``PYTHONPATH``);
2. otherwise look for the ``pyverbs`` package directory in ``$AIORDMA_PYVERBS_PATH``
   and the distributions' system directories, check that its extension modules
   were built for this interpreter's ABI (``device.cpython-311-x86_64-linux-gnu.so``
   against :data:`importlib.machinery.EXTENSION_SUFFIXES`), and import *only that
   package* from its location (``importlib.util.spec_from_file_location`` with
   ``submodule_search_locations``; ``sys.path`` is never touched, so nothing else
   from the system directory can be imported by accident).

:func:`load_pyverbs` returns the package (with ``device``, ``pd``, ``mr``, ``cq``,
``qp``, ``wr``, ``addr``, ``enums``, ``pyverbs_error`` imported) or raises
:class:`~aiordma.errors.ProviderUnavailableError` saying why;
:func:`pyverbs_info` describes what was loaded (or why nothing was).

Side effect contained: ``pyverbs.base`` calls ``logging.basicConfig()`` at
import time (rdma-core 44), which would install a stderr handler on the root
logger of the application. The loader undoes that.
"""

from __future__ import annotations

import glob
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import re
import sys
import threading
from types import ModuleType
from typing import Any

from .. import settings
from ..errors import ProviderUnavailableError

__all__ = ["INSTALL_HINT", "candidate_dirs", "load_pyverbs", "pyverbs_info"]

#: the submodules the aiordma provider uses (imported eagerly so that a broken
#: install fails here, with a clear message, not in the middle of a test)
SUBMODULES = ("pyverbs_error", "enums", "device", "pd", "mr", "cq", "qp", "wr", "addr", "srq")

INSTALL_HINT = (
    "install rdma-core's Python bindings: `apt install python3-pyverbs` (Debian/Ubuntu) "
    "or `dnf install python3-pyverbs` (Fedora/RHEL)"
)

_lock = threading.Lock()
_module: ModuleType | None = None
_info: dict[str, Any] | None = None
_error: str | None = None


def candidate_dirs() -> list[str]:
    """Directories (each containing a ``pyverbs/`` package) tried when a plain
    ``import pyverbs`` fails, in order: ``$AIORDMA_PYVERBS_PATH`` (a directory
    containing ``pyverbs/`` or the ``pyverbs`` directory itself), then the
    system locations, the running Python version's own directory first."""
    out: list[str] = []
    env = settings.PYVERBS_PATH.get()
    if env:
        for p in env.split(os.pathsep):
            if not p:
                continue
            p = os.path.abspath(p)
            if os.path.basename(p) == "pyverbs" and os.path.isfile(os.path.join(p, "__init__.py")):
                p = os.path.dirname(p)
            out.append(p)
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    out += [
        "/usr/lib/python3/dist-packages",  # Debian, Ubuntu
        f"/usr/lib64/{ver}/site-packages",  # Fedora, RHEL (arch-specific)
        f"/usr/lib/{ver}/site-packages",  # Arch, openSUSE
        f"/usr/local/lib64/{ver}/site-packages",
        f"/usr/local/lib/{ver}/site-packages",
    ]
    out += sorted(glob.glob("/usr/lib64/python3*/site-packages"), reverse=True)
    out += sorted(glob.glob("/usr/lib/python3*/site-packages"), reverse=True)
    return list(dict.fromkeys(out))  # first occurrence of each, in order


_TAG_RE = re.compile(r"^device\.(?P<tag>[^.]+)\.so$")


def _describe_tag(tag: str) -> str:
    m = re.match(r"cpython-(\d)(\d+)", tag)
    return f"CPython {m.group(1)}.{m.group(2)} ({tag})" if m else tag


def _abi_check(pkg_dir: str) -> tuple[str, str]:
    """Whether ``pkg_dir``'s extension modules suit this interpreter:
    ``("ok", filename)``, ``("mismatch", "tag1, tag2")`` or ``("broken", why)``."""
    try:
        names = os.listdir(pkg_dir)
    except OSError as e:
        return "broken", f"cannot list {pkg_dir}: {e.strerror}"
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if "device" + suffix in names:
            return "ok", "device" + suffix
    tags = sorted({m.group("tag") for n in names if (m := _TAG_RE.match(n))})
    if tags:
        return "mismatch", ", ".join(_describe_tag(t) for t in tags)
    return "broken", f"{pkg_dir} has no device extension module (incomplete pyverbs install)"


def _this_python() -> str:
    tag = importlib.machinery.EXTENSION_SUFFIXES[0].strip(".").removesuffix(".so")
    return f"{sys.implementation.name} {sys.version_info.major}.{sys.version_info.minor} ({tag}, {sys.executable})"


class _RootLoggingGuard:
    """Undo ``logging.basicConfig()`` done by ``pyverbs.base`` at import."""

    def __enter__(self) -> _RootLoggingGuard:
        self.handlers = list(logging.root.handlers)
        self.level = logging.root.level
        return self

    def __exit__(self, *exc: object) -> None:
        for h in list(logging.root.handlers):
            if h not in self.handlers:
                logging.root.removeHandler(h)
        logging.root.setLevel(self.level)


def _forget(names: set[str]) -> None:
    for n in names:
        if n == "pyverbs" or n.startswith("pyverbs."):
            sys.modules.pop(n, None)


def _import_submodules(pkg: ModuleType) -> None:
    for sub in SUBMODULES:
        importlib.import_module(f"pyverbs.{sub}")


def _try_plain_import() -> tuple[ModuleType | None, str | None]:
    """``import pyverbs`` the normal way. (module, None), (None, None) if not
    found, or (None, reason) if found but broken."""
    before = set(sys.modules)
    try:
        with _RootLoggingGuard():
            pkg = importlib.import_module("pyverbs")
    except ModuleNotFoundError as e:
        if e.name != "pyverbs":
            _forget(set(sys.modules) - before)
            return None, f"`import pyverbs` failed: {e}"
        return None, None
    except ImportError as e:
        _forget(set(sys.modules) - before)
        return None, f"`import pyverbs` failed: {e}"
    pkg_dir = os.path.dirname(os.path.abspath(getattr(pkg, "__file__", None) or "."))
    try:
        with _RootLoggingGuard():
            _import_submodules(pkg)
    except ImportError as e:
        _forget(set(sys.modules) - before)
        status, desc = _abi_check(pkg_dir)
        if status == "mismatch":
            return None, f"pyverbs at {pkg_dir} is built for {desc}, but this is {_this_python()}: {e}"
        return None, f"pyverbs at {pkg_dir} cannot be imported: {e}"
    return pkg, None


def _load_from(root: str) -> ModuleType:
    """Import ``root/pyverbs`` as the top-level package ``pyverbs`` without
    adding ``root`` to ``sys.path``."""
    pkg_dir = os.path.join(root, "pyverbs")
    init = os.path.join(pkg_dir, "__init__.py")
    before = set(sys.modules)
    spec = importlib.util.spec_from_file_location("pyverbs", init, submodule_search_locations=[pkg_dir])
    if spec is None or spec.loader is None:  # pragma: no cover - defensive
        raise ImportError(f"cannot build an import spec for {init}")
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["pyverbs"] = pkg
    try:
        with _RootLoggingGuard():
            spec.loader.exec_module(pkg)
            _import_submodules(pkg)
    except BaseException:
        _forget(set(sys.modules) - before)
        raise
    # Only pyverbs itself may come from the system directory: anything else
    # imported meanwhile must have come from the interpreter's own path.
    foreign = []
    for name in set(sys.modules) - before:
        if name == "pyverbs" or name.startswith("pyverbs."):
            continue
        f = getattr(sys.modules.get(name), "__file__", None) or ""
        if f.startswith(root + os.sep) and not f.startswith(pkg_dir + os.sep):
            foreign.append(name)
    if foreign:  # pragma: no cover - cannot happen without sys.path changes
        for name in foreign:
            sys.modules.pop(name, None)
        raise ImportError(f"loading pyverbs pulled other modules from {root}: {sorted(foreign)}")
    return pkg


def _load() -> tuple[ModuleType, dict[str, Any]]:
    pkg, reason = _try_plain_import()
    if pkg is not None:
        return pkg, {"how": "import"}
    reasons = [reason] if reason else ["`import pyverbs`: no module named 'pyverbs' on sys.path"]
    mismatches = []
    for root in candidate_dirs():
        pkg_dir = os.path.join(root, "pyverbs")
        if not os.path.isfile(os.path.join(pkg_dir, "__init__.py")):
            continue
        status, desc = _abi_check(pkg_dir)
        if status == "mismatch":
            mismatches.append(f"{pkg_dir} is built for {desc}")
            continue
        if status == "broken":
            reasons.append(desc)
            continue
        try:
            pkg = _load_from(root)
        except ImportError as e:
            reasons.append(f"{pkg_dir}: import failed: {e}")
            continue
        return pkg, {"how": "system", "system_dir": root, "extension": desc}
    if mismatches:
        raise ProviderUnavailableError(
            "pyverbs: no copy matches this interpreter's ABI: "
            + "; ".join(mismatches)
            + f"; this is {_this_python()}. Use that Python version for the venv "
            "(e.g. `python3.X -m venv --system-site-packages`) or build rdma-core's "
            "pyverbs for this interpreter"
        )
    raise ProviderUnavailableError(
        "pyverbs is not installed: "
        + "; ".join(reasons)
        + f"; looked in {', '.join(candidate_dirs()[:3])}, .... {INSTALL_HINT}"
    )


def load_pyverbs() -> ModuleType:
    """The ``pyverbs`` package (``.device``, ``.pd``, ``.mr``, ``.cq``, ``.qp``,
    ``.wr``, ``.addr``, ``.enums``, ``.pyverbs_error`` imported).

    Raises :class:`~aiordma.errors.ProviderUnavailableError` when pyverbs is
    not installed or not usable by this interpreter; the message says which.
    The outcome is cached.
    """
    global _module, _info, _error
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            if _error is not None:
                raise ProviderUnavailableError(_error)
            try:
                pkg, info = _load()
            except ProviderUnavailableError as e:
                _error = str(e)
                raise
            _module, _info = pkg, info
    return _module


def _dpkg_version(pkg_dir: str) -> str | None:
    """Version of the Debian package that owns pyverbs (python3-pyverbs)."""
    if not pkg_dir.startswith("/usr/lib/python3/dist-packages"):
        return None
    try:
        with open("/var/lib/dpkg/status", encoding="utf-8", errors="replace") as f:
            inside = False
            for line in f:
                if line.startswith("Package: "):
                    inside = line.strip() == "Package: python3-pyverbs"
                elif inside and line.startswith("Version: "):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def pyverbs_info() -> dict[str, Any]:
    """What :func:`load_pyverbs` found, without raising.

    Keys: ``available`` (bool), ``error`` (why not, or None), ``path`` (the
    package directory), ``how`` (``"import"``: normal import;
    ``"system"``: loaded from a system directory by path), ``version``
    (package version if known, e.g. ``"44.0-2"``), ``comp_channel_fd``
    (``"native"`` when ``CompChannel.fd`` exists, rdma-core >= 57, else
    ``"discovered"``: found through /proc/self/fd), ``python``.
    """
    try:
        pkg = load_pyverbs()
    except ProviderUnavailableError as e:
        return {
            "available": False,
            "error": str(e),
            "path": None,
            "how": None,
            "version": None,
            "comp_channel_fd": None,
            "python": _this_python(),
        }
    global _info
    info = _info if _info is not None else {}
    if "available" not in info:  # first call: complete it once
        pkg_file = getattr(pkg, "__file__", None)
        path = os.path.dirname(os.path.abspath(pkg_file)) if pkg_file else None
        version = getattr(pkg, "__version__", None)
        if version is None:
            try:
                from importlib import metadata

                version = metadata.version("pyverbs")
            except Exception:
                version = _dpkg_version(path or "")
        info.update(
            available=True,
            error=None,
            path=path,
            version=version,
            comp_channel_fd="native" if hasattr(pkg.cq.CompChannel, "fd") else "discovered",
            python=_this_python(),
        )
        _info = info
    return dict(info)
