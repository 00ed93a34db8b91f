"""Every public name has a docstring that stands alone and renders cleanly.

For each name of the contract's import list (curvature and the 18 extensions)
plus ``curvlib.distributed``'s (and ``curvlib.distributed.sharded``'s), ``curvlib.losses``', ``curvlib.laplace``'s,
``curvlib.operators``', ``curvlib.influence``'s and ``curvlib.precondition``'s public names,
``KFACOptimizer``, ``strategy``, the errors and the extensions' base classes: a docstring
with an ``Examples::`` block of doctest lines (run here, they must pass); extensions name
their result key; ``pydoc``'s plain-text rendering has no raw markup (``!!!``, code fences,
Sphinx roles).
"""

from __future__ import annotations

import doctest
import importlib
import pydoc
import re
import warnings

import pytest
import torch
import torch.distributed

import curvlib
from curvlib import distributed, extensions, influence, losses, operators, precondition
from curvlib.distributed import sharded

CONTRACT_EXTENSIONS = [
    "BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance",
    "DiagGGNExact", "DiagGGNMC", "BatchDiagGGNExact", "BatchDiagGGNMC",
    "DiagHessian", "BatchDiagHessian", "KFAC", "KFLR", "KFRA",
    "SqrtGGNExact", "SqrtGGNMC", "GGNMP", "HMP", "PCHMP",
]
EXTENSIONS = CONTRACT_EXTENSIONS + ["KFACEmpirical"]


def _public():
    names = [("curvlib", "curvature")] + [("curvlib.extensions", n) for n in EXTENSIONS]
    names += [("curvlib.distributed", n) for n in distributed.__all__]
    names += [("curvlib.distributed.sharded", n) for n in sharded.__all__]
    names += [("curvlib.losses", n) for n in losses.__all__]
    names += [("curvlib.laplace", n) for n in ("CurvlibGGN", "CurvlibEF", "CurvlibInterface")]
    names += [("curvlib.operators", n) for n in operators.__all__]
    names += [("curvlib.influence", n) for n in influence.__all__]
    names += [("curvlib.precondition", n) for n in precondition.__all__]
    names += [("curvlib.optim", "KFACOptimizer"), ("curvlib", "strategy"), ("curvlib", "CurvatureError"),
              ("curvlib", "CurvatureTypeError")]
    names += [("curvlib.extensions", "Extension"), ("curvlib.extensions", "SecondOrder")]
    return names


def _get(module: str, name: str):
    if module == "curvlib.laplace":
        pytest.importorskip("laplace")
    return getattr(importlib.import_module(module), name)


ROLES = re.compile(r":(func|mod|class|data|meth|attr):`")


@pytest.mark.parametrize("module, name", _public(), ids=[f"{m}.{n}" for m, n in _public()])
def test_docstring_stands_alone(module, name):
    obj = _get(module, name)
    doc = obj.__doc__ or ""
    assert "Examples::" in doc and ">>> " in doc, f"{module}.{name}: no Examples:: block"
    assert not ROLES.search(doc), f"{module}.{name}: a Sphinx role reads oddly in help()"
    if module == "curvlib.extensions" and name in EXTENSIONS:
        assert f'"{obj.name}"' in doc, f"{name}: the docstring does not name its result key {obj.name!r}"
        assert "Options: none" in doc or "Args:" in doc, f"{name}: the docstring does not list its options"
    rendered = pydoc.render_doc(obj, renderer=pydoc.plaintext)
    assert "!!!" not in rendered and "```" not in doc


@pytest.mark.parametrize("module, name", _public(), ids=[f"{m}.{n}" for m, n in _public()])
def test_docstring_examples_run(module, name):
    obj = _get(module, name)
    tests = doctest.DocTestFinder(recurse=False).find(obj, name, globs={})
    assert tests and tests[0].examples, f"{module}.{name}: no doctest examples found"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    try:
        with warnings.catch_warnings(), torch.device("cpu"):  # the examples are CPU code
            warnings.simplefilter("ignore")
            for test in tests:
                runner.run(test, out=lambda text: pytest.fail(text, pytrace=False))
    finally:  # an example that failed before its destroy_process_group() leaves no group behind
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert runner.failures == 0


@pytest.mark.parametrize("module", [curvlib, extensions, extensions.firstorder, extensions.secondorder, extensions.kronecker, extensions.products, losses, operators, influence])
def test_modules_render_cleanly(module):
    rendered = pydoc.render_doc(module, renderer=pydoc.plaintext)
    assert "!!!" not in rendered
    assert "```" not in (module.__doc__ or "")


def test_doctest_runner_catches_a_wrong_example():
    def wrong():
        """Examples::

            >>> 1 + 1
            3
        """
    test = doctest.DocTestFinder(recurse=False).find(wrong, "wrong", globs={})[0]
    runner = doctest.DocTestRunner()
    runner.run(test, out=lambda text: None)
    assert runner.failures == 1


def test_help_of_curvature_names_no_private_module():
    """``help(curvature)`` is read by newcomers: it points to public names only."""
    import re

    import curvlib

    text = pydoc.render_doc(curvlib.curvature, renderer=pydoc.plaintext)
    assert not re.findall(r"curvlib\._\w+", text), re.findall(r".*curvlib\._\w+.*", text)
