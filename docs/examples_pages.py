"""Writes one documentation page per ``examples/*.py``: its docstring, its figure, its source.

Run by ``docs/conf.py`` when Sphinx starts, so a new example gets a page without editing the
docs. The examples are not run during the build (several take minutes at full size): each
page shows the committed figure ``docs/_static/examples/<name>.png``, made once with

    python examples/<name>.py --quick --out docs/_static/examples

(``--quick``: the run the CI smoke test makes). A missing figure is a Sphinx warning, so the
warning-free build (``-W``) fails until it is committed; ``tests/project/test_docs_site.py`` checks the
same without Sphinx.
"""

import ast
import os

from sphinx.util import logging

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
EXAMPLES = os.path.join(ROOT, "examples")
FIGURES = os.path.join(DOCS, "_static", "examples")
PAGES = os.path.join(DOCS, "examples")  # generated, ignored by git

log = logging.getLogger(__name__)


def example_names():
    """Stems of the runnable examples, sorted."""
    return sorted(f[:-3] for f in os.listdir(EXAMPLES) if f.endswith(".py") and not f.startswith("_"))


def figure_path(name):
    return os.path.join(FIGURES, f"{name}.png")


def _page(name):
    """The Markdown of one example's page."""
    doc = _docstring(name)
    title = doc.splitlines()[0] if doc else name
    rest = "\n".join(doc.splitlines()[1:]).strip("\n")
    # The docstrings are plain text for `help()` and terminals (formulas aligned by spaces):
    # shown as written, in a literal block, rather than re-parsed as reStructuredText.
    lines = [f"# `{name}.py`", "", f"*{title}*", "", f"Run: `python examples/{name}.py` "
             f"(add `--quick` for the short run that made the figure, `--out DIR` for its folder).", ""]
    if rest:
        lines += ["````text", rest, "````", ""]
    lines += ["## Figure", "", f"The figure of `python examples/{name}.py --quick`:", "",
              f"![{name}.png](../_static/examples/{name}.png)", "",
              "## Source", "", f"```{{literalinclude}} ../../examples/{name}.py", ":language: python", "```", ""]
    return "\n".join(lines)


def _index(names):
    lines = ["# Examples", "",
             "Runnable scripts in `examples/` of the repository. Each page gives the script's own",
             "description (its docstring), the figure it draws and its source. Every script takes",
             "`--quick` (under a minute on a 2-core CPU; CI runs each so) and `--out DIR` (default",
             "`figures/`). They need `pip install -e \".[examples]\"` (matplotlib, scikit-learn;",
             "the data sets ship with scikit-learn), `laplace_digits.py` also laplace-torch",
             "(see [Laplace](../laplace.md)).", ""]
    lines += [f"* [`{name}.py`]({name}.md): {_title(name)}" for name in names]
    # hidden: the list above is the index; the toctree only puts the pages in the sidebar
    lines += ["", "```{toctree}", ":hidden:", ":maxdepth: 1", ""]
    return "\n".join(lines + names + ["```", ""])


def _docstring(name):
    source = open(os.path.join(EXAMPLES, f"{name}.py"), encoding="utf-8").read()
    return ast.get_docstring(ast.parse(source)) or ""


def _title(name):
    """The first line of an example's docstring."""
    doc = _docstring(name)
    return doc.splitlines()[0] if doc else ""


def _write(path, text):
    """Write only when changed, so Sphinx's incremental builds stay incremental."""
    if os.path.exists(path) and open(path, encoding="utf-8").read() == text:
        return
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def write_pages(app=None):
    """Generate ``docs/examples/{index,<name>}.md``; warn for an example without a figure."""
    os.makedirs(PAGES, exist_ok=True)
    names = example_names()
    for name in names:
        if not os.path.exists(figure_path(name)):
            log.warning(f"examples/{name}.py has no committed figure {os.path.relpath(figure_path(name), ROOT)}: "
                        f"run python examples/{name}.py --quick --out docs/_static/examples")
        _write(os.path.join(PAGES, f"{name}.md"), _page(name))
    _write(os.path.join(PAGES, "index.md"), _index(names))
    # a page of a removed example would stay in the toctree-less pile and warn: drop it
    for stale in set(os.listdir(PAGES)) - {f"{n}.md" for n in names} - {"index.md"}:
        os.remove(os.path.join(PAGES, stale))
