"""A custom ``autograd.Function`` in a model that needs the ATen-level front end (src/curvlib/_trace/functions.py).

The model reads a value (``if h.sum().item() > ...``) or takes keyword inputs, so torch.fx
cannot give it whole and it is traced with ``make_fx``; the Function's ``backward`` is not
the derivative of its ``forward`` (``tanh`` forward, half its derivative backward), as in a
straight-through estimator. BatchGrad, DiagGGNExact and KFLR must equal the model's own
autograd (tests/oracles/zoo_reference.py: every sample run alone, ``torch.autograd.grad``,
which runs the Function's backward), wherever the Function sits (hypothesis: before the
first layer, between layers, inside a submodule, returning a tuple) and behind wrappers of
different shapes. The Hessian family needs what torch.func needs of the Function: refused,
naming it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import DiagHessian
from oracles.zoo_checks import check_exact
from oracles.on_device import seeded
from oracles.zoo import Problem

DT = torch.float64


class HalfTanh(torch.autograd.Function):
    """``tanh`` forward; backward ``g · (1 - tanh²) / 2``, not the forward's derivative."""

    @staticmethod
    def forward(ctx, x, half):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        ctx.half = half
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y) * ctx.half, None


class Pair(torch.autograd.Function):
    """Two outputs: ``(tanh x, x²)``, backward halves the first's derivative."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.tanh(x), x * x

    @staticmethod
    def backward(ctx, ga, gb):
        (x,) = ctx.saved_tensors
        return ga * (1 - torch.tanh(x) ** 2) * 0.5 + gb * 2 * x


def _act(h, where):
    if where == "tuple":
        a, b = Pair.apply(h)
        return a + 0.1 * b
    return HalfTanh.apply(h, 0.5)


class Block(nn.Module):
    def __init__(self, where):
        super().__init__()
        self.fc, self.where = nn.Linear(5, 5), where

    def forward(self, h):
        return _act(self.fc(h), "tuple" if self.where == "tuple" else "between")


class Net(nn.Module):
    """``a -> [Function] -> block -> b``; ``where`` places the Function; ``keywords``: inputs
    ``net(inp=..., scale=...)``, else a value read from the input picks a branch."""

    def __init__(self, where, keywords):
        super().__init__()
        self.a, self.block, self.b = nn.Linear(4, 5), Block(where), nn.Linear(5, 3)
        self.where, self.keywords = where, keywords

    def forward(self, inp, scale=None):
        x = _act(inp, "before") if self.where == "before" else inp
        h = self.a(x if scale is None else x * scale)
        if not self.keywords and h.sum().item() > -1e9:  # (a value the Python reads: no torch.fx graph)
            h = h + 0.0
        if self.where == "between":
            h = _act(h, "between")
        return self.b(self.block(h))


class Wrapper(nn.Module):
    """A user's wrapper: returns the net's output in a tuple, a dict or as it is."""

    def __init__(self, net, shape):
        super().__init__()
        self.net, self.shape = net, shape

    def forward(self, inp, scale=None):
        out = self.net(inp, scale)
        return {"logits": out} if self.shape == "dict" else (out, out.detach()) if self.shape == "tuple" else out


def _problem(where, keywords, wrap, seed):
    torch.manual_seed(seed)
    g = seeded(seed)
    net = Net(where, keywords).to(DT)
    x = torch.randn(4, 4, generator=g, dtype=DT)
    X = {"inp": x, "scale": torch.rand(4, 1, generator=g, dtype=DT) + 0.5} if keywords else x
    y = torch.randint(0, 3, (4,), generator=g)
    if wrap == "bare":
        return Problem(net, X, y, nn.CrossEntropyLoss(), None, "")
    return Problem(Wrapper(net, wrap), X, y, nn.CrossEntropyLoss(), 0 if wrap == "tuple" else None, "")


def _run(prob, ext):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return curvature(prob.model, prob.lossfn, [ext], output=prob.output)(prob.X, prob.y)


@settings(max_examples=8, deadline=None)
@given(where=st.sampled_from(["before", "between", "tuple"]), keywords=st.booleans(),
       wrap=st.sampled_from(["bare", "plain", "dict", "tuple"]), seed=st.integers(0, 50))
def test_function_runs_its_backward_on_the_aten_path(where, keywords, wrap, seed):
    check_exact(_problem(where, keywords, wrap, seed))


def test_function_is_one_node_of_the_aten_graph():
    """The Function is one node (``HalfTanh.apply``), not its forward's ``tanh``."""
    from curvlib._trace.aten import trace_aten_program

    prob = _problem("between", False, "bare", 0)
    program = trace_aten_program(prob.model, prob.X)
    targets = [getattr(n.target, "function", None) for n in program.graph.nodes if n.op == "call_function"]
    assert HalfTanh in targets
    assert not any(n.target is torch.tanh for n in program.graph.nodes)


def test_hessian_family_refused_naming_the_function():
    prob = _problem("between", True, "plain", 0)
    with pytest.raises(CurvatureError, match="HalfTanh"):
        _run(prob, DiagHessian())
