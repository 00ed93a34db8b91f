"""``f`` under ``torch.inference_mode()`` / ``torch.no_grad()``, and autograd through its results.

Inside inference mode autograd records nothing (gradients and diagonals would be all
zeros); curvlib leaves it for the call and copies inference tensors. Every exact extension is compared
with the brute-force oracle (:mod:`oracles.reference`) and bit for bit with the plain
call; Monte-Carlo extensions with the plain call under the same generator.

Results are differentiable w.r.t. ``params`` values and ``X`` that require grad:
``torch.autograd.grad`` of a scalar of the results equals ``torch.func.grad`` of
the same function and, for ``batch_l2`` and the MSE GGN diagonal, a
double-differentiation oracle written here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from curvlib import curvature
from curvlib.extensions import GGNMP, HMP, KFAC, KFLR, KFRA, BatchDiagGGNMC, DiagGGNMC, DiagHessian, SqrtGGNExact, SqrtGGNMC

from oracles.first_order import first_order_reference, functional_call
from oracles.reference import assert_close, assert_matches, assert_same, exact_extensions, kflr_map, reference
from oracles.on_device import seeded

DT = torch.float64
MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


def _mlp(seed=0, act=nn.Tanh):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), act(), nn.Linear(4, 2)).to(DT)


def _data(n=5, seed=1):
    g = seeded(seed)
    return torch.randn(n, 3, generator=g, dtype=DT), torch.randint(0, 2, (n,), generator=g)


def _mc_extensions():
    """Monte-Carlo extensions, each with a freshly seeded generator."""
    return [DiagGGNMC(mc_samples=3, generator=seeded(5)),
            BatchDiagGGNMC(generator=seeded(6)),
            KFAC(mc_samples=2, generator=seeded(7)),
            SqrtGGNMC(mc_samples=2, generator=seeded(8))]


def _shapes(model):
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def mlp_reference():
    model, (X, y) = _mlp(), _data()
    return reference(model, nn.CrossEntropyLoss(), X, y, kflr=kflr_map(model), kfra=True)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_extension_inside_a_no_autograd_mode(mode, mlp_reference):
    model, (X, y) = _mlp(), _data()
    lossfn = nn.CrossEntropyLoss()
    exts = exact_extensions(kflr=True, kfra=True)
    plain = curvature(model, lossfn, exts + _mc_extensions())(X, y)
    f = curvature(model, lossfn, exts + _mc_extensions())
    with MODES[mode]():
        qs = f(X, y)
        assert_matches(qs, mlp_reference, f"inside {mode}")  # products evaluated inside too
        assert_same(qs, plain, f"inside {mode} vs plain", _shapes(model))
    assert not qs["diag_ggn_exact"]["0.weight"].requires_grad


def test_products_evaluated_inside_inference_mode_on_inference_tensors(mlp_reference):
    model, (X, y) = _mlp(), _data()
    qs = curvature(model, nn.CrossEntropyLoss(), exact_extensions())(X, y)
    with torch.inference_mode():
        V = torch.randn(3, 4, 3, dtype=DT)
        for key in ("ggnmp", "hmp", "pchmp"):
            assert_close(qs[key]["0.weight"](V), (V.reshape(3, 12) @ mlp_reference[key]["0.weight"]).reshape(V.shape),
                         f"{key} inside inference mode")


@pytest.mark.parametrize("call_inside", [True, False])
def test_model_and_data_created_under_inference_mode(call_inside, mlp_reference):
    """Parameters, X, y and params made under inference mode (inference tensors),
    used inside or after it (outside it autograd refuses inference tensors unless they are copied)."""
    X0, y0 = _data()
    with torch.inference_mode():
        model = _mlp()
        X, y = X0.clone(), y0.clone()
        params = {k: v.clone() for k, v in _mlp().named_parameters()}
        V = torch.randn(2, 4, 3, dtype=DT)
    assert model[0].weight.is_inference() and X.is_inference() and params["2.bias"].is_inference()
    f = curvature(model, nn.CrossEntropyLoss(), exact_extensions(kflr=True, kfra=True))
    with torch.inference_mode(call_inside):
        qs, qp = f(X, y), f(X, y, params=params)
        assert_matches(qs, mlp_reference, "inference-mode model")
        assert_matches(qp, mlp_reference, "inference-mode params")
        ref_hmp = (V.clone().reshape(2, 12) @ mlp_reference["hmp"]["0.weight"]).reshape(2, 4, 3)
        assert_close(qs["hmp"]["0.weight"](V), ref_hmp, "hmp on an inference V")


# ----------------------------------------------------------------------------- autograd through results


def _scalars(qs):
    """A scalar of each result family (weighted, so that every entry matters)."""
    out = {}
    for key in ("batch_l2", "diag_ggn_exact", "sqrt_ggn_exact", "diag_h", "variance", "grad_batch"):
        if key in qs:
            out[key] = sum((v * torch.linspace(0.5, 1.5, v.numel(), dtype=DT).reshape(v.shape)).sum()
                           for v in qs[key].values())
    for key in ("kflr", "kfra"):
        if key in qs:
            out[key] = sum(f.sin().sum() for fs in qs[key].values() for f in fs)
    for key in ("ggnmp", "hmp"):
        if key in qs:
            out[key] = sum(prod(torch.ones((2,) + tuple(w.shape), dtype=DT)).sin().sum()
                           for prod, w in zip(qs[key].values(), qs["grad"].values()))
    out["loss"] = qs["loss"]
    return out


@pytest.mark.parametrize("loss", ["mse", "ce"])
def test_autograd_through_results_equals_torch_func_grad(loss):
    model = _mlp(act=nn.Sigmoid)
    X, _ = _data()
    y = torch.randn(5, 2, dtype=DT) if loss == "mse" else torch.randint(0, 2, (5,))
    lossfn = nn.MSELoss() if loss == "mse" else nn.CrossEntropyLoss()
    exts = [e for e in exact_extensions() if e.name in ("batch_l2", "grad_batch", "variance", "diag_ggn_exact")]
    f = curvature(model, lossfn, exts + [SqrtGGNExact(), DiagHessian(), KFLR(), KFRA(), GGNMP(), HMP()])
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = {n: p.clone().requires_grad_(True) for n, p in base.items()}
    Xg = X.clone().requires_grad_(True)
    qs = f(Xg, y, params=params)
    names = list(base)
    for key, s in _scalars(qs).items():
        assert s.requires_grad, f"{key} came back detached"
        got = torch.autograd.grad(s, [params[n] for n in names] + [Xg], retain_graph=True, allow_unused=True)
        want = torch.func.grad(lambda p, x: _scalars(f(x, y, params=p))[key], argnums=(0, 1))(base, X)
        for n, g in zip(names + ["X"], got):
            w = want[1] if n == "X" else want[0][n]
            assert_close(torch.zeros_like(w) if g is None else g, w, f"d {key} / d {n}")
    # the loss's gradient w.r.t. params is curvlib's own gradient (and the oracle's)
    got = torch.autograd.grad(qs["loss"], [params[n] for n in names])
    ref = first_order_reference(model, lossfn, X, y)["grad"]
    for n, g in zip(names, got):
        assert_close(g, ref[n], f"d loss / d {n}")


def _individual_gradients_graph(model, lossfn, params, X, y):
    """``[g_n]`` as a differentiable function of ``params`` and ``X``: ``g_n = ∂L/∂δ_n`` at
    ``δ = 0`` for ``θ_n = θ + δ_n`` (per-sample copies, as in :mod:`oracles.first_order`)."""
    deltas = [{n: torch.zeros_like(p, requires_grad=True) for n, p in params.items()} for _ in range(X.shape[0])]
    outs = [functional_call(model, {n: params[n] + d[n] for n in params}, (X[i:i + 1],)) for i, d in enumerate(deltas)]
    flat = [d[n] for d in deltas for n in params]
    grads = torch.autograd.grad(lossfn(torch.cat(outs), y), flat, create_graph=True)
    k = len(params)
    return [dict(zip(params, grads[i * k:(i + 1) * k])) for i in range(X.shape[0])]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_autograd_through_batch_l2_equals_double_differentiation(reduction):
    model, (X, y) = _mlp(act=nn.Tanh), _data()
    lossfn = nn.CrossEntropyLoss(reduction=reduction)
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    Xg = X.clone().requires_grad_(True)
    weights = torch.linspace(1, 2, X.shape[0], dtype=DT)
    gs = _individual_gradients_graph(model, lossfn, params, Xg, y)
    oracle = sum(w * sum((g ** 2).sum() for g in gn.values()) for w, gn in zip(weights, gs))
    want = torch.autograd.grad(oracle, list(params.values()) + [Xg])
    qs = curvature(model, lossfn, exact_extensions(hessian=False)[:2])(Xg, y, params=params)
    got = torch.autograd.grad(sum((weights * v).sum() for v in qs["batch_l2"].values()), list(params.values()) + [Xg])
    for n, a, b in zip(list(params) + ["X"], got, want):
        assert_close(a, b, f"d Σ w_n batch_l2_n / d {n}")


def test_autograd_through_ggn_diagonal_equals_double_differentiation():
    """MSE ``sum``: ``diag G = 2 Σ_{n,o} (∂f_{n,o}/∂θ)²``; its gradient by double differentiation."""
    model, (X, _) = _mlp(act=nn.Tanh), _data()
    y = torch.randn(5, 2, dtype=DT)
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    names = list(params)
    out_of = lambda *ps: functional_call(model, dict(zip(names, ps)), (X,))  # noqa: E731
    J = torch.autograd.functional.jacobian(out_of, tuple(params.values()), create_graph=True)
    weights = {n: torch.rand(p.shape, generator=seeded(2), dtype=DT) for n, p in params.items()}
    oracle = sum((weights[n] * 2 * (Jn ** 2).sum((0, 1))).sum() for n, Jn in zip(names, J))
    want = torch.autograd.grad(oracle, list(params.values()), allow_unused=True)
    qs = curvature(model, nn.MSELoss(reduction="sum"), exact_extensions()[4:5])(X, y, params=params)
    got = torch.autograd.grad(sum((weights[n] * v).sum() for n, v in qs["diag_ggn_exact"].items()),
                              list(params.values()), allow_unused=True)
    assert want[-1] is None  # the output bias's Jacobian is constant
    for n, a, b in zip(names, got, want):
        b = torch.zeros_like(params[n]) if b is None else b
        assert_close(torch.zeros_like(b) if a is None else a, b, f"d diag_ggn_exact / d {n}")
        assert n == "2.bias" or a.abs().max() > 0


@pytest.mark.parametrize("mode", sorted(MODES))
def test_results_detached_under_a_no_autograd_mode(mode):
    """Under no_grad / inference mode results are detached like any op's, even when X or
    params require grad (they used to carry a graph back to them); the model's own
    parameters are always read detached."""
    model, (X, y) = _mlp(), _data()
    f = curvature(model, nn.CrossEntropyLoss(), exact_extensions(kfra=True))
    assert not any(v.requires_grad for v in f(X, y)["batch_l2"].values())
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    Xg = X.clone().requires_grad_(True)
    attached = f(Xg, y, params=params)
    assert attached["loss"].requires_grad and attached["ggnmp"]["0.bias"](torch.ones(1, 4, dtype=DT)).requires_grad
    for kw in ({}, {"params": params}):
        with MODES[mode]():
            qs = f(Xg, y, **kw)
            V = torch.ones(1, 4, dtype=DT)
            assert not any(qs[k]["0.bias"](V).requires_grad for k in ("ggnmp", "hmp", "pchmp"))
            assert not attached["hmp"]["0.bias"](V).requires_grad
        flat = [qs["loss"]] + [t for k, v in qs.items() if isinstance(v, dict) for x in v.values()
                               for t in (x if isinstance(x, list) else [x]) if isinstance(t, torch.Tensor)]
        assert len(flat) > 20 and not any(t.requires_grad for t in flat), f"{mode} {list(kw)}: attached results"
    assert model[0].weight.grad is None and params["0.weight"].grad is None
