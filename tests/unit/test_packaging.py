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
