"""Every reference to curvlib's code in its docstrings, comments and documentation resolves.

Three forms are read:

* dotted names ``curvlib.a.b.c`` (with or without a Sphinx role, ``~`` allowed): the longest
  importable module prefix, then attributes;
* Sphinx roles whose target is not a ``curvlib.`` name (``:func:`_split_rows```,
  ``:meth:`Recorder.open```, ``:func:`torch.func.vjp```), in a module's text: resolved in that
  module's namespace, else imported as an absolute name;
* ``module.name`` in double backticks where ``module`` is the last part of a curvlib module's
  name (``read_off.LOOP_SQRT_COLUMNS``), resolved in the text's module when it imports that
  name, else in a curvlib module of that name (``site.meta``, a record's field, and ``aten.*``,
  torch's op namespace, read as what they name there);
* paths under ``src/curvlib`` (``_plan/support.py``, ``rules/linear.py``) and the path form of a
  name (``_plan/checks.plan_call``, ``_core/family.Family``): the file exists, and the module has
  the name.

A name that does not resolve is a stale reference (a function moved or renamed); the test lists
them all.
"""

from __future__ import annotations

import importlib
import inspect
import io
import re
import tokenize
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "curvlib"
_GENERATED = ("api", "_build", "examples")  # (docs/.gitignore'd build outputs: written by Sphinx)
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md",
        *(p for p in sorted([*(ROOT / "docs").rglob("*.md"), *(ROOT / "docs").rglob("*.rst")])
          if p.relative_to(ROOT / "docs").parts[0] not in _GENERATED)]

_DOTTED = re.compile(r"(?<![\w./])~?(curvlib(?:\.\w+)+)")
_ROLE = re.compile(r":(?:func|meth|class|mod|data|attr|exc|obj):`~?([\w.]+)`")
_LITERAL = re.compile(r"``(\w+)\.(\w+(?:\.\w+)*)``")
_NOT_MODULES = frozenset({"aten", "site"})  # torch.ops.aten; a Site instance
_BASENAMES: dict = {}
for _p in SRC.rglob("*.py"):
    _parts = _p.relative_to(SRC.parent).with_suffix("").parts
    if _parts[-1] not in ("__init__", "__main__"):
        _BASENAMES.setdefault(_parts[-1], []).append(".".join(_parts))
_FOLDERS = "|".join(sorted(p.name for p in SRC.iterdir() if p.is_dir() and not p.name.startswith("__")))
_PATH = re.compile(rf"(?<![\w./-])(?:src/curvlib/)?((?:{_FOLDERS})(?:/\w+)+)(\.py\b|(?:\.(\w+(?:\.\w+)*)))?")


def resolve(name: str, context: Optional[object] = None) -> bool:
    """Whether ``name`` (dotted) names something: an attribute chain from ``context`` (a module),
    or a module prefix that imports and attributes after it."""
    parts = name.split(".")
    if context is not None and (_chain(context, parts) or any(
            _chain(c, parts) for c in vars(context).values()
            if isinstance(c, type) and c.__module__ == context.__name__)):
        return True  # (in a class's docstring, :meth:`read` is the class's)
    for k in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:k]))
        except Exception:  # noqa: BLE001 - not a module: a shorter prefix may be
            continue
        return _chain(module, parts[k:])
    return False


def _chain(obj, parts: List[str]) -> bool:
    for part in parts:
        if part in ("<fact>",):
            return True
        try:
            obj = getattr(obj, part)
        except AttributeError:
            annotations = getattr(obj, "__annotations__", None) or {}
            fields = getattr(obj, "__dataclass_fields__", None) or {}
            if part in annotations or part in fields or part in getattr(obj, "_fields", ()):
                return True  # a field of a record (no class attribute without a default)
            return isinstance(obj, type) and f"self.{part} =" in _source(obj)  # an instance attribute
    return True


def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def _python_texts(path: Path) -> Iterator[Tuple[int, str]]:
    """``(line, text)`` of every string and comment in a Python file."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    for tok in tokens:
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            yield tok.start[0], tok.string


def _module_of(path: Path):
    """The module of a file under ``src/curvlib`` (``None``: ``__main__``, whose import runs the demo)."""
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__main__":
        return None
    return importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))


def _path_reference(folder_path: str, suffix: Optional[str], attrs: Optional[str]) -> Optional[str]:
    """Why a path reference does not resolve (``None``: it does)."""
    target = SRC / folder_path
    if suffix == ".py" or (suffix is None and not attrs):
        if target.with_suffix(".py").exists() or target.is_dir() or target.exists():
            return None
        return "no such file"
    if not target.with_suffix(".py").exists():
        # ``_plan/checks.plan_call``: module ``_plan/checks``; a folder then a module: ``rules/linear``
        return "no such file"
    module = "curvlib." + folder_path.replace("/", ".")
    return None if resolve(f"{module}.{attrs}") else "no such name"


def references(text: str, context=None) -> Iterator[Tuple[str, Optional[str]]]:
    """``(reference, why it does not resolve or None)`` for every reference in ``text``."""
    for m in _DOTTED.finditer(text):
        name = m.group(1).rstrip(".")
        yield name, None if resolve(name) else "does not resolve"
    for m in _ROLE.finditer(text):
        name = m.group(1).rstrip(".")
        if name.startswith("curvlib."):
            continue  # (read above)
        yield name, None if resolve(name, context) else "does not resolve"
    for m in _LITERAL.finditer(text):
        short, rest = m.group(1), m.group(2)
        if short not in _BASENAMES or short in _NOT_MODULES:
            continue
        if context is not None and short in vars(context):
            ok = resolve(f"{short}.{rest}", context)
        else:
            ok = any(resolve(f"{module}.{rest}") for module in _BASENAMES[short])
        yield f"{short}.{rest}", None if ok else "does not resolve"
    for m in _PATH.finditer(text):
        folder_path, suffix, attrs = m.group(1), m.group(2), m.group(3)
        if (suffix and suffix != ".py" and attrs is None) or folder_path.endswith("/foo"):
            continue  # (``rules/foo.py``: the checklist's example family)
        yield m.group(0), _path_reference(folder_path, suffix if suffix == ".py" else None, attrs)


def stale_references() -> List[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        module = _module_of(path)
        for line, text in _python_texts(path):
            for name, why in references(text, module):
                if why:
                    found.append(f"{path.relative_to(ROOT)}:{line}: {name} ({why})")
    for path in DOCS:
        if not path.exists():
            continue
        for line, text in enumerate(path.read_text().splitlines(), 1):
            for name, why in references(text):
                if why:
                    found.append(f"{path.relative_to(ROOT)}:{line}: {name} ({why})")
    return found


def test_every_reference_in_docstrings_comments_and_docs_resolves():
    stale = stale_references()
    assert not stale, f"{len(stale)} stale references:\n" + "\n".join(stale)


@pytest.mark.parametrize("text, stale", [
    ("see :func:`curvlib._evaluate.second_order._no_such_block`", True),
    ("(curvlib._evaluate.linearise.Linearization.no_such_method)", True),
    ("`_plan/no_such_module.py`", True),
    ("`_plan/checks.no_such_function`", True),
    ("``second_order._generic_block``", True),
    ("``read_off.sqrt_columns``", False),
    ("see :func:`curvlib._plan.checks.plan_call`", False),
    (":class:`~curvlib._trace.program.Program`", False),
    ("`_plan/checks.plan_call` and `_trace/program.py`", False),
])
def test_a_planted_stale_name_is_found(text, stale):
    """The resolver itself: a name that does not exist is reported, one that does is not."""
    assert any(why for _, why in references(text)) == stale
