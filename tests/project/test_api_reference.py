"""The API reference describes every public name fully and shows nothing internal.

The reference (docs/api.md) is one autosummary page per public name, written from the
docstrings (Google style, napoleon). For every name it lists, checked on the docstrings
themselves (fast, no Sphinx build):

* docs/api.md lists exactly the ``__all__`` of each of its modules (one page per public name);
* every parameter of the signature (a class's: its ``__init__``'s; and of each method shown
  on a class's page; or the signature a
  docstring's first line gives, as autodoc reads it) has an entry in the ``Args:`` section
  (a record's, a NamedTuple's or dataclass's fields: in ``Args:`` or ``Attributes:``), and every entry names a
  parameter; ``self`` is skipped, ``*args``/``**kwargs`` are not;
* a function's docstring has a ``Returns:`` (or ``Yields:``) section, every docstring an
  ``Examples::`` block;
* no private name (``curvlib._core...``, ``curvlib.losses._structural``, a ``_module``) in the
  docstring of a name or of a member autodoc shows on its page; extensions show no member at
  all (their fields are the constructor's arguments; the rest is the engine's).

``check_api_pages`` checks the built pages (no private name, no Attributes/Methods tables of
internal fields, the laplace backends' real signatures, links to PyTorch's and Python's
documentation, in the signature lines too); tests/project/test_docs_site.py runs it after its build, and the last test
here runs it on an existing build (skipped without one).
"""

from __future__ import annotations

import ast
from dataclasses import is_dataclass
import importlib
import inspect
import os
import re
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
API_MD = os.path.join(ROOT, "docs", "api.md")
HTML = os.path.join(ROOT, "docs", "_build", "html")

# a private module or name in a dotted path: curvlib._core, curvlib.losses._structural, ._plan
PRIVATE = re.compile(r"\bcurvlib(?:\.\w+)*\._[A-Za-z]\w*")
PRIVATE_CLASS = re.compile(r"(?<![\w.])_[a-z]\w*\.[A-Z]\w*")  # a class of a private module: _kronbasis.Layout
SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Keyword Args|Keyword Arguments|Other Parameters):\s*$")
ENTRY = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:(?:\s|$)")
ATTRIBUTES = re.compile(r"^(\s*)(Attributes):\s*$")


def api_names():
    """``[(module, name)]`` as docs/api.md lists them (``currentmodule`` + autosummary entries)."""
    text = open(API_MD, encoding="utf-8").read()
    out, module, in_summary = [], None, False
    for line in text.splitlines():
        m = re.match(r"\.\. currentmodule:: ([\w.]+)", line.strip())
        if m:
            module = m.group(1)
            continue
        if line.strip().startswith(".. autosummary::"):
            in_summary = True
            continue
        if in_summary:
            if line.strip().startswith(":") or not line.strip():
                continue
            if line.startswith("   ") and re.fullmatch(r"~?[\w.]+", line.strip()):
                out.append((module, line.strip().lstrip("~")))
                continue
            in_summary = False
    return out


SOURCES = {}  # module name -> its file, for the mocked modules no longer in sys.modules


def _import(module: str):
    """The module; ``curvlib.laplace`` with laplace-torch mocked as the docs build does
    (``autodoc_mock_imports``) where it cannot be imported."""
    if module != "curvlib.laplace":
        return importlib.import_module(module)
    try:
        return importlib.import_module(module)
    except Exception:  # noqa: BLE001 - laplace-torch missing or broken (its torchvision)
        pass
    mock = pytest.importorskip("sphinx.ext.autodoc.mock")
    saved = {k: v for k, v in sys.modules.items() if k == "curvlib.laplace" or k.startswith("curvlib.laplace.")}
    for k in saved:
        del sys.modules[k]
    with mock.mock(["laplace"]):
        mod = importlib.import_module(module)
    # leave no mocked curvlib.laplace behind for the tests that import the real one
    for k in [k for k in sys.modules if k == "curvlib.laplace" or k.startswith("curvlib.laplace.")]:
        SOURCES[k] = sys.modules.pop(k).__file__
    sys.modules.update(saved)
    return mod


def _public():
    return [(m, n, getattr(_import(m), n)) for m, n in api_names()]


def documented_args(doc: str, section=SECTION):
    """The names the ``Args:`` sections of a Google-style docstring describe."""
    names, lines, i = [], inspect.cleandoc(doc or "").splitlines(), 0
    while i < len(lines):
        head = section.match(lines[i])
        i += 1
        if not head:
            continue
        base, entry = len(head.group(1)), None
        while i < len(lines):
            line = lines[i]
            if line.strip():
                indent = len(line) - len(line.lstrip())
                if indent <= base:
                    break
                entry = indent if entry is None else entry
                m = ENTRY.match(line)
                if indent == entry and m:
                    names.append(m.group(1))
            i += 1
    return names


def _docstring_signature(obj):
    """The parameters a docstring's first line ``Name(a, b=1, *, c)`` gives (autodoc uses it)."""
    first = (inspect.getdoc(obj) or "").splitlines()[:1]
    m = re.fullmatch(rf"{obj.__name__}\((.*)\)", first[0].strip()) if first else None
    if not m:
        return None
    fn = ast.parse(f"def f({m.group(1)}): pass").body[0].args
    params = [a.arg for a in fn.posonlyargs + fn.args]
    params += [f"*{fn.vararg.arg}"] if fn.vararg else []
    params += [a.arg for a in fn.kwonlyargs]
    params += [f"**{fn.kwarg.arg}"] if fn.kwarg else []
    return params


def parameters(obj):
    """The parameter names a reader sees in the signature, ``*args``/``**kwargs`` with their stars."""
    from_doc = _docstring_signature(obj)
    if from_doc is not None:
        return from_doc
    if inspect.isclass(obj):
        owner = next((c for c in obj.__mro__ if "__init__" in vars(c)), object)
        if owner.__module__.startswith("curvlib"):
            sig = inspect.signature(owner.__init__)
            params = list(sig.parameters.values())[1:]
        elif tuple in obj.__mro__ and hasattr(obj, "_fields"):  # a NamedTuple: its fields
            params = list(inspect.signature(obj).parameters.values())
        else:  # an exception or a class with object's constructor
            return []
    else:
        params = list(inspect.signature(obj).parameters.values())
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [stars.get(p.kind, "") + p.name for p in params]


def shown_members(cls):
    """``[(name, docstring)]`` of the members autodoc renders on ``cls``'s page: its own
    public members with a docstring of their own (``members`` without ``undoc-members``),
    attributes documented by ``#:`` comments, less ``:meta private:`` ones."""
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        raw = value.fget if isinstance(value, property) else getattr(value, "func", value)
        doc = getattr(raw, "__doc__", None)
        if isinstance(value, (staticmethod, classmethod)):
            doc = value.__func__.__doc__
        if not doc or doc == getattr(type(value), "__doc__", None):
            continue
        out.append((name, doc))
    try:
        from sphinx.pycode import ModuleAnalyzer
    except ImportError:  # pragma: no cover - Sphinx absent: the comments are not checked
        return out
    source = SOURCES.get(cls.__module__) or inspect.getsourcefile(cls)
    attr_docs = ModuleAnalyzer.for_file(source, cls.__module__).find_attr_docs()
    out += [(name, "\n".join(doc)) for (owner, name), doc in attr_docs.items()
            if owner == cls.__qualname__ and not name.startswith("_")]
    return [(n, d) for n, d in out if ":meta private:" not in d]


def _extension_pages_without_members():
    """docs/_templates/autosummary/class.rst gives the classes of curvlib.extensions no members."""
    path = os.path.join(ROOT, "docs", "_templates", "autosummary", "class.rst")
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    return re.search(r'module == "curvlib.extensions" %}\s*:no-members:', text) is not None


PUBLIC = _public()
IDS = [f"{m}.{n}" for m, n, _ in PUBLIC]


def test_api_lists_every_public_name():
    listed = {}
    for module, name in api_names():
        listed.setdefault(module, []).append(name)
    for module, names in listed.items():
        mod = _import(module)
        public = [n for n in mod.__all__ if not inspect.ismodule(getattr(mod, n))]
        assert sorted(names) == sorted(public), f"docs/api.md lists {module}: {names}, its __all__ is {public}"


def _shown_methods(cls):
    """``[(name, parameters, described)]`` of the methods on a class's page (extensions show none)."""
    from curvlib.extensions import Extension

    if not inspect.isclass(cls) or issubclass(cls, Extension) and _extension_pages_without_members():
        return []
    out = []
    for member, doc in shown_members(cls):
        value = vars(cls).get(member)
        fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if not inspect.isfunction(fn):
            continue
        params = [p for p in parameters(fn) if p not in ("self", "cls")]
        out.append((member, params, documented_args(doc)))
    return out


def test_every_parameter_is_described():
    """One failure message for the whole reference: every undescribed (or stale) parameter."""
    missing, stale = [], []
    for module, name, obj in PUBLIC:
        params = [p for p in parameters(obj) if p != "self"]
        described = documented_args(obj.__doc__)
        if inspect.isclass(obj) and (issubclass(obj, tuple) and hasattr(obj, "_fields") or is_dataclass(obj)):
            described += documented_args(obj.__doc__, ATTRIBUTES)  # a record's fields
        bare = {d.lstrip("*") for d in described}
        missing += [f"{module}.{name}({p})" for p in params if p.lstrip("*") not in bare]
        stale += [f"{module}.{name}: {d}" for d in described if d.lstrip("*") not in {p.lstrip("*") for p in params}]
        for member, params, described in _shown_methods(obj):
            bare = {d.lstrip("*") for d in described}
            missing += [f"{module}.{name}.{member}({p})" for p in params if p.lstrip("*") not in bare]
    assert missing == [], f"{len(missing)} parameters without an Args: entry: {missing}"
    assert stale == [], f"{len(stale)} Args: entries name no parameter: {stale}"


def test_returns_and_examples():
    problems = []
    for module, name, obj in PUBLIC:
        doc = inspect.getdoc(obj) or ""
        if "Examples::" not in doc or ">>> " not in doc:
            problems.append(f"{module}.{name}: no Examples:: block")
        if not inspect.isclass(obj) and not re.search(r"^(Returns|Yields):\s*$", doc, re.M):
            problems.append(f"{module}.{name}: no Returns: section")
    assert problems == [], "\n".join(problems)


def test_no_private_names_or_internal_members():
    from curvlib.extensions import Extension

    problems = []
    for module, name, obj in PUBLIC:
        problems += [f"{module}.{name}: {p}" for p in sorted(set(PRIVATE.findall(obj.__doc__ or "")))]
        if not inspect.isclass(obj):
            continue
        members = shown_members(obj)
        if issubclass(obj, Extension):
            if _extension_pages_without_members():
                continue
            problems += [f"{module}.{name}.{m}: an extension's page shows a member" for m, _ in members]
        for member, doc in members:
            problems += [f"{module}.{name}.{member}: {p}" for p in sorted(set(PRIVATE.findall(doc)))]
    assert problems == [], f"{len(problems)} private names or internal members on public pages:\n" + "\n".join(problems)


def test_parser_reads_google_style():
    def f(a, b, *rest, key=None, **kw):
        """Summary.

        Args:
            a: first.
            b (int): second,
                on two lines: with a colon.
            *rest: more.
            key: a key.
            **kw: others.

        Returns:
            nothing.
        """

    assert documented_args(f.__doc__) == ["a", "b", "*rest", "key", "**kw"]
    assert parameters(f) == ["a", "b", "*rest", "key", "**kw"]

    class C:
        """C(x, *, y=1)

        Args:
            x: one.
        """

        def __init__(self, *args, **kwargs):
            pass

    assert parameters(C) == ["x", "y"]


def check_api_pages(html: str):
    """The built API pages: nothing private or internal, real signatures, links to PyTorch and Python."""
    api = os.path.join(html, "api")
    pages = sorted(f for f in os.listdir(api) if f.endswith(".html"))
    assert len(pages) == len(api_names()), f"{len(pages)} API pages for {len(api_names())} public names"
    problems = []
    for page in pages + [os.path.join("..", "api.html")]:  # and the index, with the modules' docstrings
        text = open(os.path.join(api, page), encoding="utf-8").read()
        body = text[text.find("<article"):text.find("</article>")]
        plain = re.sub(r"<[^>]+>", "", body)
        titles = " ".join(re.findall(r'title="([^"]*)"', body))  # a link's tooltip
        problems += [f"{page}: {p}" for p in sorted(set(PRIVATE.findall(plain + " " + titles)))]
        problems += [f"{page}: {p}" for p in sorted(set(PRIVATE_CLASS.findall(plain)))]
        for rubric in ("Attributes", "Methods"):
            if f'<p class="rubric">{rubric}</p>' in body:
                problems.append(f"{page}: an autosummary table of {rubric}")
        fields = "".join(re.findall(r'<dt class="field-\w+">Parameters.*?</dd>', body, re.S))
        for item in re.findall(r"<p><strong>(.*?)</p>", fields, re.S):  # a parameter's entry
            if "\u2013" not in item:  # "name (type) – description": no dash, no description
                problems.append(f"{page}: a parameter without description: {re.sub(r'<[^>]+>', '', item)}")
        signature = re.search(r'<dt class="sig sig-object py".*?</dt>', body, re.S)
        if signature and "(*args, **kwargs)" in re.sub(r"<[^>]+>", "", signature.group(0)):
            problems.append(f"{page}: (*args, **kwargs) instead of the real signature")
    assert problems == [], "\n".join(problems)
    ggn = open(os.path.join(api, "curvlib.operators.GGN.html"), encoding="utf-8").read()
    assert "https://pytorch.org/docs/stable/" in ggn and "torch.nn.Module" in ggn, "no link to PyTorch's nn.Module"
    signature = re.search(r'<dt class="sig sig-object py".*?</dt>', ggn, re.S).group(0)
    assert "https://pytorch.org/docs/stable/generated/torch.nn.Module.html" in signature, \
        "the signature line's types are not linked (autodoc_typehints)"
    fit = open(os.path.join(api, "curvlib.influence.fit.html"), encoding="utf-8").read()
    assert "https://pytorch.org/docs/stable/tensors.html#torch.Tensor" in fit, "no link to PyTorch's Tensor"
    assert "https://docs.python.org/3/" in open(os.path.join(api, "curvlib.curvature.html"), encoding="utf-8").read()


def test_built_api_pages():
    """The pages of an existing build (tests/project/test_docs_site.py builds them)."""
    if not os.path.isdir(os.path.join(HTML, "api")):
        pytest.skip("no docs build: python -m sphinx -W --keep-going -b html docs docs/_build/html")
    check_api_pages(HTML)
