"""Sphinx configuration of curvlib's documentation site.

Build (from the repository root; the README names this command, tests/project/test_docs_site.py runs it):

    python -m sphinx -W --keep-going -b html docs docs/_build/html

The pages are Markdown (MyST), formulas in ``$...$`` / ``$$...$$`` (MathJax); the API
reference comes from the docstrings (autodoc + autosummary, Google style through napoleon). The
example gallery and pages are written at build time from ``examples/*.py`` (docstring,
committed figure, source): see ``examples_pages.py``. The theme is Furo.
"""

import os
import re
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
# the documented curvlib is the one of this checkout, whatever is installed
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, DOCS)

import docstring_md  # noqa: E402  (both need DOCS on sys.path)
import examples_pages  # noqa: E402

project = "curvlib"
author = "the curvlib authors"
copyright = "curvlib authors, MIT license"
# the version shown in the header and the page titles: pyproject.toml's, read rather than copied
with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as _fh:
    release = re.search(r'^version = "([^"]+)"', _fh.read(), re.M).group(1)
version = release

# The repository's address: the header's link, the footer's icon, "Get started"'s `git clone`.
# PLACEHOLDER until the project publishes one: set CURVLIB_REPOSITORY to the real address when
# building the site for readers (no address is recorded in pyproject.toml or the README yet).
REPOSITORY = os.environ.get("CURVLIB_REPOSITORY", "https://github.com/OWNER/curvlib")

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Markdown: `#kronecker-factors-per-layer` style links resolve to headings, as on GitHub
myst_heading_anchors = 4
# formulas are $...$ and $$...$$ (MathJax); {{ repository }} in prose is REPOSITORY
myst_enable_extensions = ["dollarmath", "substitution"]
myst_dmath_double_inline = True
myst_substitutions = {"repository": REPOSITORY, "version": release}

# API reference: one page per public name, members in source order, the signature's
# annotations in the description (they are long: Mapping[str, Tensor], ...)
autosummary_generate = True
autodoc_default_options = {"members": True, "member-order": "bysource", "show-inheritance": True}
autodoc_typehints = "description"
autodoc_mock_imports = ["laplace"]  # laplace-torch is an optional peer
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # "Attributes:" as a field list: no second description of a NamedTuple field

# Furo: previous/next links under every page, a search box, light and dark; the version in the
# title, the repository in the footer and the sidebar (_templates/sidebar/repository.html).
html_theme = "furo"
html_title = f"curvlib {release}"
html_static_path = ["_static"]
templates_path = ["_templates"]
html_css_files = ["curvlib.css"]  # wide tables scroll; the example gallery's grid
html_context = {"repository": REPOSITORY}
html_theme_options = {
    "source_repository": REPOSITORY,
    "source_branch": "main",
    "source_directory": "docs/",
    "top_of_page_buttons": ["view"],
    "footer_icons": [{"name": "Repository", "url": REPOSITORY, "html": "Source code", "class": ""}],
}
html_sidebars = {"**": ["sidebar/brand.html", "sidebar/search.html", "sidebar/scroll-start.html",
                        "sidebar/navigation.html", "sidebar/repository.html", "sidebar/scroll-end.html"]}


def setup(app):
    # before Sphinx reads the sources: write docs/examples/*.md from examples/*.py
    app.connect("builder-inited", examples_pages.write_pages)
    app.connect("autodoc-process-docstring", docstring_md.process)
