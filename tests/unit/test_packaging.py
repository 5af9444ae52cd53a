"""The package metadata: the version is defined once (``aiordma.__version__``) and
pyproject.toml uses the current setuptools forms (an SPDX ``license`` string), so
an install prints no deprecation warnings."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest

import aiordma

pytestmark = pytest.mark.engine_neutral  # the same on every engine and core: CI's reference run leaves it out

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_version_is_read_from_the_package():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "aiordma.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]\d+|rc\d+|\.dev\d+|\.post\d+)?", aiordma.__version__)


def test_the_version_is_written_once():
    """No other file of the package or its build repeats the version string."""
    needle = f'"{aiordma.__version__}"'
    files = [ROOT / "pyproject.toml", ROOT / "setup.py", *sorted((ROOT / "aiordma").rglob("*.py"))]
    holders = [str(p.relative_to(ROOT)) for p in files if needle in p.read_text(encoding="utf-8")]
    assert holders == ["aiordma/__init__.py"], holders


def test_the_installed_metadata_has_the_same_version():
    try:
        installed = importlib.metadata.version("aiordma")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("aiordma is not installed (only on sys.path)")
    assert installed == aiordma.__version__


def test_license_is_an_spdx_expression_for_a_setuptools_that_reads_it():
    assert PYPROJECT["project"]["license"] == "MIT"
    requires = PYPROJECT["build-system"]["requires"]
    [setuptools] = [r for r in requires if r.startswith("setuptools")]
    assert setuptools == "setuptools>=77"  # the first setuptools with SPDX `license` (PEP 639)


def _setup_py() -> dict:
    """setup.py's namespace, run without building anything (setup() is not called)."""
    import runpy
    from unittest import mock

    with mock.patch("setuptools.setup"), mock.patch.dict("os.environ", {"AIORDMA_NO_NATIVE": "1"}):
        return runpy.run_path(str(ROOT / "setup.py"), run_name="setup")


@pytest.mark.parametrize(("inplace", "editable"), [(False, False), (True, False), (False, True)])
def test_the_test_only_rc_core_is_built_in_place_only(inplace, editable):
    """A wheel (a build that is not in place) never carries tests.native._testing; a
    checkout's ``build_ext --inplace`` and ``pip install -e`` build it with the engine."""
    from setuptools import Distribution, Extension

    ns = _setup_py()
    engine = Extension("aiordma.providers.soft._native._engine", ["x.c"])
    testing = Extension(ns["TESTING_MODULE"], ["y.c"])
    dist = Distribution({"ext_modules": [engine, testing], "cmdclass": {"build_ext": ns["OptionalBuildExt"]}})
    cmd = dist.get_command_obj("build_ext")
    cmd.inplace = inplace
    cmd.editable_mode = editable  # what pip install -e sets
    cmd.ensure_finalized()
    assert [e.name for e in cmd.extensions] == [engine.name] + ([testing.name] if inplace or editable else [])


def test_the_sdist_has_no_tests():
    """MANIFEST.in prunes tests/ (the test-only RC core's .pyx, and the C Cython makes
    of it, which setuptools would otherwise ship as an extension's source)."""
    lines = [ln.split("#")[0].strip() for ln in (ROOT / "MANIFEST.in").read_text().splitlines()]
    assert "prune tests" in lines
    assert (ROOT / _setup_py()["TESTING_SRC"]).is_file()


def test_an_in_place_build_leaves_no_test_only_core_for_a_wheel(tmp_path):
    """``build_ext --inplace`` compiles into build_lib, then copies into the tree; a wheel
    built later packs all of build_lib, so the test-only core is removed from there."""
    from setuptools import Distribution

    ns = _setup_py()
    cmd = ns["OptionalBuildExt"](Distribution({"cmdclass": {"build_ext": ns["OptionalBuildExt"]}}))
    cmd.build_lib = str(tmp_path)
    built = tmp_path / cmd.get_ext_filename(ns["TESTING_MODULE"])
    built.parent.mkdir(parents=True)
    built.write_bytes(b"")
    cmd._drop_testing_from_build_lib()
    assert not built.exists() and not (tmp_path / "tests").exists()
