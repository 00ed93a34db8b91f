"""The documentation site's pages read well: a gallery of the examples, a "Get started" page,
no walls of text. Checked without Sphinx (fast); tests/project/test_docs_site.py builds the site
and checks the built pages.

* The example gallery (``docs/examples_pages.py``): one card per ``examples/*.py`` whose
  thumbnail is its committed ``--quick`` figure; each example page renders the docstring once,
  as reStructuredText (not a raw literal block), and its source listing starts after the
  docstring; the docstrings parse without a docutils warning once their indented blocks are made
  literal.
* ``docs/get-started.md``: the clone, the pinned install (CPU and CUDA), the first call, the
  next pages; the README and the index link it.
* No table cell over ``MAX_CELL_WORDS`` words, no prose paragraph over ``MAX_PARAGRAPH_WORDS``.
"""

import ast
import os
import re
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOCS = os.path.join(ROOT, "docs")
EXAMPLES = os.path.join(ROOT, "examples")
NAMES = sorted(f[:-3] for f in os.listdir(EXAMPLES) if f.endswith(".py") and not f.startswith("_"))
PAGES = sorted(f for f in os.listdir(DOCS) if f.endswith(".md"))

MAX_CELL_WORDS = 40
MAX_PARAGRAPH_WORDS = 150
FENCE = re.compile(r"^(```+|~~~+).*?^\1[ \t]*$", re.S | re.M)


@pytest.fixture(scope="module")
def pages_module():
    pytest.importorskip("sphinx")  # examples_pages logs through sphinx.util
    sys.path.insert(0, DOCS)
    try:
        import examples_pages
    finally:
        sys.path.remove(DOCS)
    return examples_pages


def test_gallery_has_a_thumbnail_per_example(pages_module):
    index = pages_module._index(NAMES)
    cards = re.findall(r'<a class="curvlib-card" href="([\w-]+)\.html"><img src="\.\./_static/examples/([\w-]+)\.png"',
                       index)
    assert [href for href, _ in cards] == NAMES
    assert all(href == img for href, img in cards)
    for name in NAMES:
        assert os.path.exists(os.path.join(DOCS, "_static", "examples", f"{name}.png")), name


@pytest.mark.parametrize("name", NAMES)
def test_example_page_shows_the_docstring_once(pages_module, name):
    page = pages_module._page(name)
    source = open(os.path.join(EXAMPLES, f"{name}.py"), encoding="utf-8").read()
    docstring = ast.get_docstring(ast.parse(source))
    assert "{eval-rst}" in page and "```text" not in page, "the docstring is rendered, not shown raw"
    (start,) = re.findall(r":lines: (\d+)-", page)
    listed = "\n".join(source.splitlines()[int(start) - 1:])
    assert docstring.splitlines()[1:] and docstring.splitlines()[-1] not in listed
    assert listed.lstrip().startswith(("from ", "import ")), listed[:80]
    assert f"../_static/examples/{name}.png" in page


@pytest.mark.parametrize("name", NAMES)
def test_example_docstring_renders_without_warnings(pages_module, name):
    docutils_core = pytest.importorskip("docutils.core")
    from docutils import nodes

    source = open(os.path.join(EXAMPLES, f"{name}.py"), encoding="utf-8").read()
    rest = "\n".join(ast.get_docstring(ast.parse(source)).splitlines()[1:])
    tree = docutils_core.publish_doctree(pages_module._rest(rest), settings_overrides={"report_level": 5})
    problems = [m.astext() for m in tree.findall(nodes.system_message) if m["level"] >= 2]
    assert problems == []
    # the indented blocks (commands, aligned formulas) keep their lines
    assert not list(tree.findall(nodes.block_quote))


def test_rest_makes_indented_blocks_literal(pages_module):
    text = "A formula,\n\n    a = b\n    c = d\n\nmax |a - b| and ``|x|``.\n\n* item,\n\n      y = x\n"
    out = pages_module._rest(text)
    assert "\n::\n\n    a = b\n    c = d" in out and "\n  ::\n\n      y = x" in out
    assert r"max \|a - b\|" in out and "``|x|``" in out


def test_get_started_page():
    text = open(os.path.join(DOCS, "get-started.md"), encoding="utf-8").read()
    assert "git clone {{ repository }}" in text  # conf.py's REPOSITORY
    assert "pip install torch==2.13.0 && pip install -e ." in text
    assert "--index-url https://download.pytorch.org/whl/cpu" in text and "CUDA" in text
    assert "```python" in text and "curvature(" in text  # the first call (run by test_docs.py)
    for page in ("transform.md", "supported-models.md", "conventions.md"):
        assert f"]({page})" in text
    assert "](docs/get-started.md)" in open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    index = open(os.path.join(DOCS, "index.md"), encoding="utf-8").read()
    assert "](get-started.md)" in index and "\nget-started\n" in index


def test_conf_names_the_repository_and_version():
    conf = open(os.path.join(DOCS, "conf.py"), encoding="utf-8").read()
    assert "REPOSITORY = " in conf and '"repository": REPOSITORY' in conf
    assert 'html_theme = "furo"' in conf and "release" in conf


@pytest.mark.parametrize("page", PAGES)
def test_no_walls_of_text(page):
    text = FENCE.sub("", open(os.path.join(DOCS, page), encoding="utf-8").read())
    cells = [cell for line in text.splitlines() if line.lstrip().startswith("|")
             for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
    long_cells = [cell.strip()[:60] for cell in cells if len(cell.split()) > MAX_CELL_WORDS]
    assert long_cells == [], f"docs/{page}: table cells over {MAX_CELL_WORDS} words: {long_cells}"
    paragraphs = [p for p in re.split(r"\n\s*\n", text)
                  if not re.match(r"\s*(\||[*-] |\d+\. )", p)]  # tables and lists aside
    long = [p.strip()[:60] for p in paragraphs if len(p.split()) > MAX_PARAGRAPH_WORDS]
    assert long == [], f"docs/{page}: paragraphs over {MAX_PARAGRAPH_WORDS} words: {long}"
