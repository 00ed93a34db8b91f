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
    "sphinx.ext.intersphinx",
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

# API reference: one page per public name, members in source order; the annotations both in
# the signature and with the Args: entries, linked (Tensor, nn.Module, Mapping, ...), written
# without their module (Tensor, not torch.Tensor); a long signature is one parameter a line
autosummary_generate = True
autodoc_default_options = {"members": True, "member-order": "bysource", "show-inheritance": True}
autodoc_typehints = "both"
python_use_unqualified_type_names = True
python_maximum_signature_line_length = 88
autodoc_typehints_description_target = "documented_params"  # the types go with the Args: entries
autodoc_mock_imports = ["laplace"]  # laplace-torch is an optional peer
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # "Attributes:" as a field list: no second description of a NamedTuple field

# Links to PyTorch's and Python's documentation (torch.Tensor, nn.Module, dict, Callable, ...) from
# inventories shipped in docs/_inventories (docs/make_inventories.py writes them): the build needs
# no network, and the machines that build the site have none.
intersphinx_mapping = {
    "torch": ("https://pytorch.org/docs/stable/", os.path.join(DOCS, "_inventories", "torch.inv")),
    "python": ("https://docs.python.org/3/", os.path.join(DOCS, "_inventories", "python.inv")),
}

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


# the modules of the API reference (docs/api.md): a name is public when one of them exports it
PUBLIC_MODULES = ("curvlib", "curvlib.extensions", "curvlib.operators", "curvlib.influence",
                  "curvlib.precondition", "curvlib.optim", "curvlib.losses", "curvlib.distributed",
                  "curvlib.laplace")


def _public_name(obj):
    """``curvlib.extensions.Extension`` for the class defined in ``curvlib.extensions._base``:
    the name under which the reference documents ``obj``, or None."""
    for module in PUBLIC_MODULES:
        mod = sys.modules.get(module)
        for alias in getattr(mod, "__all__", ()):
            if getattr(mod, alias, None) is obj:
                return f"{module}.{alias}"
    return None


def _public_alias(target):
    """The public name of the object a dotted ``target`` in curvlib names, if it has one."""
    import importlib

    if not target.startswith("curvlib."):
        return None
    module, _, name = target.rpartition(".")
    try:
        return _public_name(getattr(importlib.import_module(module), name))
    except (ImportError, AttributeError):
        return None


def _public_bases(app, name, obj, options, bases):
    """``autodoc-process-bases``: a base class that is no public name (``MonteCarlo``, the
    products' ``BlockProduct``) is shown as its nearest public ancestor (``SecondOrder``)."""
    import inspect

    for i, base in enumerate(bases):
        if inspect.isclass(base) and base.__module__.startswith("curvlib") and _public_name(base) is None:
            bases[i] = next((c for c in base.__mro__ if _public_name(c)), base)


def _public_titles(app, doctree, docname):
    """``doctree-resolved``: a link to a name defined in a private module (``Bases: Extension``,
    resolved through autodoc's canonical name ``curvlib.extensions._base.Extension``) shows the
    public name in its tooltip."""
    from docutils import nodes

    for ref in doctree.findall(nodes.reference):
        alias = _public_alias(ref.get("reftitle", "")) if "._" in ref.get("reftitle", "") else None
        if alias:
            ref["reftitle"] = alias


def _mocked_class_signature(app, what, name, obj, options, signature, return_annotation):
    """A class that derives from a mocked import (laplace-torch's interfaces) gets the mock's
    ``(*args, **kwargs)``; sign it with its own ``__init__``, as it would be without the mock."""
    import inspect

    if what != "class" or signature != "(*args, **kwargs)" or "__init__" not in vars(obj):
        return None
    sig = inspect.signature(vars(obj)["__init__"])
    params = [p.replace(annotation=inspect.Parameter.empty) for p in list(sig.parameters.values())[1:]]
    if [p.kind for p in params] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
        return None
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty)), return_annotation


def setup(app):
    # before Sphinx reads the sources: write docs/examples/*.md from examples/*.py
    app.connect("builder-inited", examples_pages.write_pages)
    app.connect("autodoc-process-docstring", docstring_md.process)
    app.connect("autodoc-process-signature", _mocked_class_signature)
    app.connect("doctree-resolved", _public_titles)
    app.connect("autodoc-process-bases", _public_bases)
