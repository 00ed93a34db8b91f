"""Sphinx configuration of curvlib's documentation site.

Build (from the repository root; the README names this command, tests/project/test_docs_site.py runs it):

    python -m sphinx -W --keep-going -b html docs docs/_build/html

The pages are Markdown (MyST); the API reference comes from the docstrings (autodoc +
autosummary, Google style through napoleon). The example pages are written at build time
from ``examples/*.py`` (docstring, committed figure, source): see ``examples_pages.py``.
"""

import os
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
release = "0.1.0"

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
myst_enable_extensions = ["dollarmath"]

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

html_theme = "alabaster"
html_title = "curvlib"
html_static_path = ["_static"]
html_theme_options = {"description": "Per-sample gradients and curvature for PyTorch",
                      "fixed_sidebar": True, "page_width": "1100px"}


def setup(app):
    # before Sphinx reads the sources: write docs/examples/*.md from examples/*.py
    app.connect("builder-inited", examples_pages.write_pages)
    app.connect("autodoc-process-docstring", docstring_md.process)
