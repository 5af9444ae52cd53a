"""Sphinx configuration of the aiordma documentation (``scripts/docs`` builds it).

Markdown sources through MyST-Parser; the API reference by autodoc from the
docstrings, which are reStructuredText. ``sphinx-build -W`` turns every warning
into an error, and MyST reports a link to a missing page or ``#anchor`` as one.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # autodoc documents this checkout, not an installed copy

import aiordma  # noqa: E402

project = "aiordma"
author = "the aiordma authors"
copyright = "the aiordma authors, MIT licence"
release = version = aiordma.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []

# MyST: `#anchor` links to headings down to ####, checked like page links
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]

# autodoc: the docstrings are the reference; types go into the description
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True, "show-inheritance": True}
# docstrings name classes by several paths (aiordma.X, aiordma.module.X, short
# names): an unresolved reference is plain text, not an error
nitpicky = False
suppress_warnings = ["ref.python"]  # "more than one target found": X and aiordma.X are the same object

html_theme = "furo"
html_title = f"aiordma {release}"
html_static_path: list[str] = []
html_show_sourcelink = False


_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.M)
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _slug(title: str) -> str:
    """The GitHub-style anchor of a Markdown heading (MyST makes the same ones)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "")
    try:
        from myst_parser.slugs import github_slugify
    except ImportError:  # older MyST
        return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
    return github_slugify(text)


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8")))}


def _check_readme_links(app: Any, env: Any) -> None:
    """Every relative link of README.md (the landing page, outside the site) resolves:
    the file exists and, for a Markdown file, so does the heading an ``#anchor`` names."""
    from sphinx.util import logging

    log = logging.getLogger(__name__)
    readme = ROOT / "README.md"
    text = _FENCE.sub("", readme.read_text(encoding="utf-8"))
    for target in _LINK.findall(text) + re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (readme.parent / path).resolve() if path else readme
        if not file.exists():
            log.warning("README.md links to %s, which does not exist", target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            log.warning(
                "README.md links to %s: no heading of %s has the anchor #%s", target, path or "README.md", anchor
            )


def _check_public_api(app: Any, env: Any) -> None:
    """Every name of ``aiordma.__all__`` has an entry in the API reference."""
    from sphinx.util import logging

    documented = set(env.get_domain("py").objects)
    missing = [name for name in aiordma.__all__ if f"aiordma.{name}" not in documented]
    if missing:
        logging.getLogger(__name__).warning("the API reference lacks aiordma.%s", ", aiordma.".join(missing))


def setup(app: Any) -> None:
    app.connect("env-check-consistency", _check_public_api)
    app.connect("env-check-consistency", _check_readme_links)
