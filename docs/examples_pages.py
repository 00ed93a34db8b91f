"""Writes the example gallery and one page per ``examples/*.py``: its docstring, figure and source.

Run by ``docs/conf.py`` when Sphinx starts, so a new example gets a page without editing the
docs. The examples are not run during the build (several take minutes at full size): each
page shows the committed figure ``docs/_static/examples/<name>.png``, made once with

    python examples/<name>.py --quick --out docs/_static/examples

(``--quick``: the run the CI smoke test makes). A missing figure is a Sphinx warning, so the
warning-free build (``-W``) fails until it is committed; ``tests/project/test_docs_site.py`` checks the
same without Sphinx.
"""

import ast
import html
import os
import re

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
    """The Markdown of one example's page: its docstring rendered once, its figure, its source."""
    doc = _docstring(name)
    title = doc.splitlines()[0] if doc else name
    rest = "\n".join(doc.splitlines()[1:]).strip("\n")
    lines = [f"# `{name}.py`", "", f"*{title}*", "",
             f"Run: `python examples/{name}.py` (add `--quick` for the short run that made the figure, "
             f"`--out DIR` for its folder).", "",
             f"![The figure of {name}.py --quick](../_static/examples/{name}.png)", ""]
    if rest:
        # the docstrings are reStructuredText (``code``, literal blocks): rendered as such, once
        lines += ["## Description", "", "`````{eval-rst}", _rest(rest), "`````", ""]
    # the source without its docstring, which the page has just shown
    lines += ["## Source", "", f"```{{literalinclude}} ../../examples/{name}.py", ":language: python",
              f":lines: {_code_start(name)}-", "```", ""]
    return "\n".join(lines)


def _rest(text):
    """``text`` with every indented block after a blank line made a literal block.

    The docstrings are read in terminals too, where an indented block (commands, an aligned
    formula) shows as written; reStructuredText would join such a block's lines into one quoted
    paragraph unless the paragraph before it ends with ``::``. Indented continuation lines of a
    list item (no blank line before them) stay as they are.
    """
    lines, out, in_block = text.splitlines(), [], False
    for i, line in enumerate(lines):
        if line.strip() and not line.startswith("    "):
            in_block = False
        elif line.startswith("    ") and not in_block and i > 0 and not lines[i - 1].strip():
            in_block = True
            before = next((ln for ln in reversed(out) if ln.strip()), "")
            if not before.rstrip().endswith("::"):
                # a bare "::" paragraph, at the indent of the text it belongs to (a list item's
                # content is indented past its bullet): the block below is literal
                indent = len(before) - len(before.lstrip())
                if before.lstrip().startswith(("* ", "- ")):
                    indent += 2
                out += [" " * indent + "::", ""]
        out.append(line if in_block else _escape_bars(line))
    return "\n".join(out)


def _escape_bars(line):
    """A prose line with its ``|`` outside inline literals escaped (``max |a − b|`` is not a
    reStructuredText substitution reference)."""
    parts = re.split(r"(``.*?``)", line)
    return "".join(p if p.startswith("``") else p.replace("|", "\\|") for p in parts)


def _card(name):
    """One gallery card: the example's committed figure as the thumbnail, its name and title."""
    # the title's ``code`` as <code>, the rest escaped
    title = "".join(f"<code>{html.escape(p[2:-2])}</code>" if p.startswith("``") else html.escape(p)
                    for p in re.split(r"(``.*?``)", _title(name)))
    return (f'<a class="curvlib-card" href="{name}.html">'
            f'<img src="../_static/examples/{name}.png" alt="The figure of {name}.py" loading="lazy">'
            f'<span class="curvlib-card-name">{name}.py</span>'
            f'<span class="curvlib-card-title">{title}</span></a>')


def _index(names):
    lines = ["# Examples", "",
             "Runnable scripts in `examples/` of the repository. Each page gives the script's own",
             "description (its docstring), the figure it draws and its source. Every script takes",
             "`--quick` (under a minute on a 2-core CPU; CI runs each so) and `--out DIR` (default",
             "`figures/`). They need `pip install -e \".[examples]\"` (matplotlib, scikit-learn;",
             "the data sets ship with scikit-learn), `laplace_digits.py` also laplace-torch",
             "(see [Laplace](../laplace.md)). The thumbnails are the committed figures of the",
             "`--quick` runs; the site does not run the examples.", ""]
    lines += ['<div class="curvlib-gallery">', *[_card(name) for name in names], "</div>", ""]
    # hidden: the gallery above is the index; the toctree puts the pages in the sidebar and in
    # the previous/next links
    lines += ["", "```{toctree}", ":hidden:", ":maxdepth: 1", ""]
    return "\n".join(lines + names + ["```", ""])


def _code_start(name):
    """The first line of ``examples/<name>.py`` after its docstring (and the blank lines after it)."""
    source = open(os.path.join(EXAMPLES, f"{name}.py"), encoding="utf-8").read()
    tree = ast.parse(source)
    body = tree.body
    if not (body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)):
        return 1
    start = body[0].end_lineno + 1
    lines = source.splitlines()
    while start <= len(lines) and not lines[start - 1].strip():
        start += 1
    return start


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
