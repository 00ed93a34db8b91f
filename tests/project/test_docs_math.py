"""The documentation pages write formulas as math (MyST ``$...$`` / ``$$...$$``, MathJax), not code.

A formula in a code span (`` `Σ_n g_nᵀ` ``) renders as monospace pseudo-LaTeX; the pages use
MyST's dollarmath instead. Two checks, both without Sphinx (fast; the full build is
tests/project/test_docs_site.py, which also checks the built pages carry MathJax nodes):

* no inline code span of a page holds formula notation (a sum, a Kronecker product, an inverse,
  a root, a transpose, a gradient, a norm, LaTeX-like sub- or superscripts), nor does its prose.
  Code spans stay for code: names, calls, shapes such as ``[N, *p.shape]``;
* the pages that define quantities parse (MyST's docutils parser, dollarmath on) into math
  nodes, and their formulas are valid enough to close: no ``$`` left over in the text.
"""

import os
import re

import pytest

DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs")
PAGES = sorted(f for f in os.listdir(DOCS) if f.endswith(".md"))

# pages whose formulas are the point: each must render at least one math node
FORMULA_PAGES = ["conventions.md", "preconditioning.md", "operators.md", "laplace.md", "how-it-works.md",
                 "many-devices.md", "transform.md", "influence.md", "supported-models.md", "migrating-from-backpack.md"]

FENCE = re.compile(r"^(```+|~~~+).*?^\1[ \t]*$", re.S | re.M)
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
# formula notation: Unicode operators and super/subscripts, and LaTeX-style _{..} / ^{..}
FORMULA = re.compile(r"[Σ∑⊗⊙√ᵀ∇∂‖≈λσκπθφ²³⁻¹ₙₛᵢⱼ₀₁]|_\{|\^\{|\\(frac|sum|sqrt|top|otimes)\b")


def formula_spans(text: str) -> list:
    """``(line, span)`` for every inline code span of ``text`` (outside fenced blocks) that holds a formula."""
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return [(prose[: m.start()].count("\n") + 1, m.group(1)) for m in SPAN.finditer(prose) if FORMULA.search(m.group(1))]


def test_formula_spans_are_found():
    """The check itself: formula code spans are caught, code is not."""
    text = "A `Σ_n g_n g_nᵀ`, `(B + √λ/π I)⁻¹`, `B = A_{ij}`, `x^{2}`.\n`grad_batch`, `[N, *p.shape]`, `f(X, y)`\n"
    text += "```python\nx = 1  # Σ in a block is fine\n```\n"
    assert [span for _, span in formula_spans(text)] == ["Σ_n g_n g_nᵀ", "(B + √λ/π I)⁻¹", "B = A_{ij}", "x^{2}"]


@pytest.mark.parametrize("page", PAGES)
def test_no_formulas_in_code_spans(page):
    text = open(os.path.join(DOCS, page), encoding="utf-8").read()
    bad = formula_spans(text)
    assert bad == [], f"docs/{page}: formulas in code spans, write them as $...$ math: {bad}"


@pytest.mark.parametrize("page", PAGES)
def test_no_unicode_formulas_in_prose(page):
    """Outside code and math, no formula notation either (a Unicode ``Σ_n g_nᵀ`` in prose)."""
    text = FENCE.sub("", open(os.path.join(DOCS, page), encoding="utf-8").read())
    prose = re.sub(r"\$\$.*?\$\$|\$[^$\n]+\$|`[^`\n]+`", "", text, flags=re.S)
    bad = [line.strip() for line in prose.splitlines() if re.search(r"[Σ∑⊗⊙√ᵀ∇∂‖²⁻]", line)]
    assert bad == [], f"docs/{page}: formulas outside math: {bad}"


def _doctree(page):
    docutils = pytest.importorskip("docutils.core")
    parsers = pytest.importorskip("myst_parser.parsers.docutils_")
    text = open(os.path.join(DOCS, page), encoding="utf-8").read()
    settings = {"myst_enable_extensions": ["dollarmath"], "myst_dmath_double_inline": True, "report_level": 5}
    return docutils.publish_doctree(text, parser=parsers.Parser(), settings_overrides=settings)


@pytest.mark.parametrize("page", FORMULA_PAGES)
def test_formula_pages_render_math(page):
    from docutils import nodes

    tree = _doctree(page)
    inline, display = list(tree.findall(nodes.math)), list(tree.findall(nodes.math_block))
    assert inline or display, f"docs/{page} has no math node"


@pytest.mark.parametrize("page", PAGES)
def test_no_stray_dollar(page):
    from docutils import nodes

    tree = _doctree(page)
    # an unclosed or mis-delimited $ stays in the text as a literal dollar sign
    stray = [t.astext() for t in tree.findall(nodes.Text) if "$" in t.astext()
             and not isinstance(t.parent, (nodes.literal, nodes.literal_block, nodes.math, nodes.math_block))]
    assert stray == [], f"docs/{page}: text with a stray $ (a formula that did not parse): {stray[:3]}"


def test_conventions_defines_its_quantities_in_math():
    """The page that defines each quantity: the GGN, the Kronecker conventions, PCHMP as display math."""
    from docutils import nodes

    tree = _doctree("conventions.md")
    inline = " ".join(n.astext() for n in tree.findall(nodes.math))
    display = " ".join(n.astext() for n in tree.findall(nodes.math_block))
    assert r"G = \sum_n J_n^\top H_n J_n" in inline
    assert r"\otimes" in inline and r"\mathrm{PCH}_p" in display and r"\frac{1}{N S}" in display


def test_no_formulas_in_docstring_code_spans():
    """The API reference's docstrings write formulas as ``$...$`` too (docs/docstring_md.py turns
    them into math for the pages; ``help()`` shows the TeX): no formula in a code span of a public
    name's docstring or of a member its page shows. A span holding a quote is a Python value."""
    import inspect

    from test_api_reference import _public, shown_members  # this folder is on sys.path

    bad = []
    for module, name, obj in _public():
        docs = [("", obj.__doc__ or "")] + (shown_members(obj) if inspect.isclass(obj) else [])
        for member, doc in docs:
            spans = formula_spans(doc.replace("``", "`"))
            bad += [f"{module}.{name}{'.' + member if member else ''}: {span}" for _, span in spans if '"' not in span]
    assert bad == [], f"{len(bad)} formulas in docstring code spans, write them as $...$:\n" + "\n".join(bad)
