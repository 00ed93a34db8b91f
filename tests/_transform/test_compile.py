"""``torch.compile`` around curvlib: the call runs eagerly as one opaque step
(one graph break at the call, none inside), so every extension works under a compiled
function and agrees with eager; block products too."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from torch import nn

from curvlib import curvature, extensions

from oracles.reference import assert_same

EXTENSIONS = [getattr(extensions, n)() for n in extensions.__all__
              if n not in ("Extension", "SecondOrder")]


def _problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    X = torch.randn(7, 5, dtype=torch.double)
    y = torch.randint(0, 3, (7,))
    return model, nn.CrossEntropyLoss(), X, y


@pytest.mark.parametrize("ext", EXTENSIONS, ids=lambda e: type(e).__name__)
def test_compiled_call_equals_eager(ext):
    """``torch.compile(f)`` returns eager's result (Monte-Carlo ones from the same random state) and
    Dynamo compiles no frame of curvlib (the old failure: "non-empty donated buffers")."""
    model, lossfn, X, y = _problem()
    f = curvature(model, lossfn, [ext])
    torch._dynamo.reset()  # no cache entries (or recompile limits) from other tests
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(f, backend=counter)
    torch.manual_seed(1)  # Monte-Carlo draws: the same global state for both
    got = compiled(X, y)
    torch.manual_seed(1)
    want = f(X, y)
    assert counter.frame_count == 0
    assert_same(got, want, type(ext).__name__, {n: p.shape for n, p in model.named_parameters()})


def test_compiled_training_step_with_curvature():
    """A user's compiled step (inductor) that calls ``f`` and works with its results: the
    graph breaks at the call only, and the step equals its eager run."""
    model, lossfn, X, y = _problem()
    f = curvature(model, lossfn, [extensions.DiagGGNExact(), extensions.GGNMP()])

    def step(X, y):
        qs = f(X * 1.0, y)
        name, p = "0.weight", dict(model.named_parameters())["0.weight"]
        precond = qs["grad"][name] / (qs["diag_ggn_exact"][name] + 1e-3)
        return precond.square().sum() + qs["ggnmp"][name](precond.unsqueeze(0)).sum()

    torch._dynamo.reset()
    got = torch.compile(step)(X, y)
    assert torch.allclose(got, step(X, y), rtol=1e-10, atol=0)
