"""Three Markdown habits of curvlib's docstrings, turned into reStructuredText for autodoc.

The docstrings are written for ``help()`` first, and a few use a Markdown pipe table or a
```` ```python ```` fence, which read well in a terminal but are not reStructuredText (a
``|`` line is a "line block" there), or write a formula as ``$...$`` (TeX, as the Markdown
pages do). Rather than rewrite them for Sphinx, the API build converts these constructs
(``autodoc-process-docstring``): a formula becomes a ``math`` role, which MathJax renders;
the rest is plain RST.
"""

import re

_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
# $...$ in prose: not $$, not inside a ``code`` span, and not a doctest line (>>> / ...)
_CODE = re.compile(r"``.*?``")
_MATH = re.compile(r"(?<![\\$])\$(?!\$)([^$\n]+?)(?<!\\)\$(?!\$)")
_DOCTEST = re.compile(r"^\s*(>>>|\.\.\.)(\s|$)")


def _math(line):
    """``line`` with each ``$formula$`` of its prose as ``:math:`formula```."""
    if _DOCTEST.match(line) or "$" not in line:
        return line
    parts, last = [], 0
    for code in _CODE.finditer(line):
        parts.append(_MATH.sub(lambda m: f":math:`{m.group(1)}`", line[last:code.start()]))
        parts.append(code.group(0))
        last = code.end()
    parts.append(_MATH.sub(lambda m: f":math:`{m.group(1)}`", line[last:]))
    return "".join(parts)
_RULE = re.compile(r"^\s*\|?\s*:?-{3,}")  # the |---|---| line under a table's header


def _cells(line):
    # a cell may hold an escaped pipe, ``"clip"\|"abs"``, as on GitHub
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip().replace("\\|", "|") for c in cells]


def _table(rows, indent):
    """A pipe table (header, rule, body) as a ``list-table`` directive."""
    out = [f"{indent}.. list-table::", f"{indent}   :header-rows: 1", ""]
    for i, row in enumerate(rows):
        if i == 1:  # the rule
            continue
        for j, cell in enumerate(_cells(row)):
            out.append(f"{indent}   {'* -' if j == 0 else '  -'} {cell or '..'}")
    return out + [""]


def convert(lines):
    """Return ``lines`` with pipe tables, fenced code blocks and ``$...$`` formulas in reStructuredText."""
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence:  # ```lang ... ``` -> .. code-block:: lang
            indent, lang = fence.group(1), fence.group(2) or "text"
            out += [f"{indent}.. code-block:: {lang}", ""]
            i += 1
            while i < len(lines) and not _FENCE.match(lines[i]):
                out.append(f"{indent}   {lines[i][len(indent):]}" if lines[i].strip() else "")
                i += 1
            out.append("")
            i += 1
            continue
        if line.lstrip().startswith("|") and i + 1 < len(lines) and _RULE.match(lines[i + 1]):
            indent = line[: len(line) - len(line.lstrip())]
            j = i
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                j += 1
            if out and out[-1].strip():
                out.append("")
            out += _table(lines[i:j], indent)
            i = j
            continue
        out.append(_math(line))
        i += 1
    return out


def process(app, what, name, obj, options, lines):
    """``autodoc-process-docstring`` handler: converts ``lines`` in place."""
    lines[:] = convert(lines)
