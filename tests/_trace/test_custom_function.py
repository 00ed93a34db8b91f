"""Custom ``torch.autograd.Function``s in a model: one graph node, run with its own backward.

fx used to trace into ``Fn.forward`` and differentiate its ops, ignoring the
custom backward. A straight-through estimator (forward rounds, backward is the
identity) must give the gradient and GGN of its backward (checked against plain
autograd, which runs it); a ``@once_differentiable`` backward refuses the
extensions that differentiate it again, naming the Function; a Function with
everything torch.func needs gets exact second order.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import (
    GGNMP, HMP, KFLR, PCHMP, BatchDiagHessian, BatchGrad, DiagGGNExact, DiagHessian, Variance,
)

from oracles.first_order import first_order_reference
from oracles.reference import assert_close, assert_matches, exact_extensions, reference
from oracles.second_order import loss_hessian_blocks
from oracles.on_device import seeded

DT = torch.float64


def _data(n=5, d=3, seed=1, classes=2):
    g = seeded(seed)
    return torch.randn(n, d, generator=g, dtype=DT), torch.randint(0, classes, (n,), generator=g)


class RoundSTE(torch.autograd.Function):
    """Straight-through estimator: forward rounds, backward is the identity."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class OnceTanh(torch.autograd.Function):
    """Everything torch.func needs, but a backward that cannot be differentiated again."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (1 - torch.tanh(x) ** 2)

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return t * (1 - torch.tanh(x) ** 2)


class Cube(torch.autograd.Function):
    """Fully functorch-capable: setup_context, a vmap rule, jvp, a differentiable backward."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * t


class WithFunction(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.a, self.b, self.fn = nn.Linear(3, 4), nn.Linear(4, 2), fn

    def forward(self, x):
        return self.b(torch.tanh(self.fn.apply(3 * self.a(x))))


def _ggn_by_autograd(model, lossfn, X, y, name):
    """``[N, P, P]`` per-sample GGN with the Jacobian from plain autograd (which runs the
    Function's own backward; torch.func cannot run an old-style Function)."""
    params = dict(model.named_parameters())
    out = model(X)
    rows = [torch.autograd.grad(o, params[name], retain_graph=True)[0].flatten() for o in out.flatten()]
    J = torch.stack(rows).reshape(X.shape[0], -1, params[name].numel())
    Hb = loss_hessian_blocks(lossfn, out.detach(), y)
    return torch.einsum("ncp,ncd,ndq->npq", J, Hb, J)


def test_straight_through_estimator_uses_the_custom_backward():
    torch.manual_seed(0)
    model, lossfn, (X, y) = WithFunction(RoundSTE).to(DT), nn.CrossEntropyLoss(), _data()
    exts = [BatchGrad(), Variance(), DiagGGNExact(), KFLR()] + exact_extensions()[5:7]  # + batch diag, sqrt
    qs = curvature(model, lossfn, exts)(X, y)
    ref = first_order_reference(model, lossfn, X, y)
    for key in ("grad", "grad_batch", "variance"):
        for name, want in ref[key].items():
            assert_close(qs[key][name], want, f"{key}[{name}]")
    assert qs["grad"]["a.weight"].abs().max() > 0  # round's own derivative would be zero
    for name, p in model.named_parameters():
        Gn = _ggn_by_autograd(model, lossfn, X, y, name)
        assert_close(qs["diag_ggn_exact"][name], Gn.sum(0).diagonal().reshape(p.shape), f"diag_ggn_exact[{name}]")
        assert_close(qs["diag_ggn_exact_batch"][name], Gn.diagonal(dim1=1, dim2=2).reshape((5,) + tuple(p.shape)),
                     f"diag_ggn_exact_batch[{name}]")
        S = qs["sqrt_ggn_exact"][name].flatten(2)
        assert_close(torch.einsum("vnp,vnq->npq", S, S), Gn, f"sqrt_ggn_exact[{name}]")
    for ext in (DiagHessian(), GGNMP(), HMP()):
        with pytest.raises(CurvatureError, match=rf"{type(ext).__name__} runs the custom autograd\.Function RoundSTE "
                                                 r"\(graph node '.*'\) under torch\.func transforms, which needs a "
                                                 r"setup_context staticmethod"):
            curvature(model, lossfn, [ext])
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    with pytest.raises(CurvatureError, match=r"graph node 'round_ste_apply' .*RoundSTE\.apply.*setup_context"):
        curvature(model, lossfn, [BatchGrad()])(X, y, params=params)  # differentiable results: torch.func


@pytest.mark.parametrize("ext", [DiagHessian, BatchDiagHessian, PCHMP, HMP])
def test_once_differentiable_backward_refuses_second_derivatives(ext):
    torch.manual_seed(0)
    model, (X, y) = WithFunction(OnceTanh).to(DT), _data()
    with pytest.raises(CurvatureError, match=rf"{ext.__name__} runs the custom autograd\.Function OnceTanh \(graph node "
                                             r"'.*'\) .*a backward that is not @once_differentiable"):
        curvature(model, nn.CrossEntropyLoss(), [ext()])
    qs = curvature(model, nn.CrossEntropyLoss(), [BatchGrad(), DiagGGNExact(), GGNMP()])(X, y)
    ref = reference(_TanhTwin(model), nn.CrossEntropyLoss(), X, y, hessian=False)
    assert_matches(qs, ref, "once_differentiable: first order and GGN")


class _TanhTwin(nn.Module):
    """``WithFunction(OnceTanh)`` with ``torch.tanh`` (same parameters)."""

    def __init__(self, model):
        super().__init__()
        self.a, self.b = copy.deepcopy(model.a), copy.deepcopy(model.b)

    def forward(self, x):
        return self.b(torch.tanh(torch.tanh(3 * self.a(x))))


def test_functorch_capable_function_gets_exact_second_order():
    """A Function with setup_context, a vmap rule, jvp and a differentiable backward:
    DiagHessian, BatchDiagHessian, GGNMP and HMP (and first order) equal the oracle."""
    torch.manual_seed(0)
    model, (X, _) = WithFunction(Cube).to(DT), _data()
    X, y = X / 2, torch.randn(5, 2, generator=seeded(3), dtype=DT)
    exts = [e for e in exact_extensions() if e.name != "pchmp"]
    qs = curvature(model, nn.MSELoss(), exts)(X, y)
    assert_matches(qs, reference(model, nn.MSELoss(), X, y, pchmp=False), "Cube")
    assert qs["diag_h"]["a.weight"].abs().max() > 0


def test_weight_norm():
    """``weight_norm`` (parametrization or old-style hook): first order and the GGN family
    equal the oracle; torch has no forward-mode derivative for its kernel, so GGNMP, PCHMP and the
    Hessian diagonals are refused with a CurvatureError saying so, and HMP goes reverse over
    reverse where its products pass the symmetry check: ``v``'s block, whose reverse-mode second
    derivative torch gets wrong, fails it and is refused; the hook's ``module.weight`` is left as it was (no torch.func
    wrapper behind)."""
    from torch.nn.utils import weight_norm as hooked_weight_norm
    from torch.nn.utils.parametrizations import weight_norm

    X, y = _data()
    for wn in (weight_norm, hooked_weight_norm):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
        wn(model[0])
        attrs = {k: v for k, v in vars(model[0]).items() if isinstance(v, torch.Tensor)}
        exts = [e for e in exact_extensions(hessian=False) if e.name not in ("ggnmp", "hmp")]
        qs = curvature(model, nn.CrossEntropyLoss(), exts)(X, y)
        v_name, v = [(n, p) for n, p in model.named_parameters() if n != "0.bias"][1]  # (v: g's block is right)
        hmp = curvature(model, nn.CrossEntropyLoss(), [HMP()])(X, y)["hmp"][v_name]
        with pytest.raises(CurvatureError, match=r"_weight_norm_interface.*not reliable here: the products are not symmetric"):
            hmp(torch.ones((1,) + tuple(v.shape), dtype=DT))
        for ext in (GGNMP(), DiagHessian(), PCHMP()):
            with pytest.raises(CurvatureError, match=r"forward-mode derivatives \(torch\.func\.jvp\) .* are needed, but "
                                                     r"torch has none for one of them.*_weight_norm_interface.*not reliable"):
                out = curvature(model, nn.CrossEntropyLoss(), [ext])(X, y)
                name, p = next((n, p) for n, p in model.named_parameters() if n != "0.bias")  # (g or v)
                out[ext.name][name](torch.ones((1,) + tuple(p.shape), dtype=DT))
        assert {k: v for k, v in vars(model[0]).items() if isinstance(v, torch.Tensor)}.keys() == attrs.keys()
        assert all(vars(model[0])[k] is v for k, v in attrs.items()), "a tensor attribute was replaced"
        assert_matches(qs, reference(model, nn.CrossEntropyLoss(), X, y, hessian=False), wn.__module__)
