"""The operators on the ecosystem sweep's models, passed directly (dict ``X``, ``output=``) and
behind a one-line wrapper, against ``torch.func`` on the model's own forward in float64.

References: ``Jv`` by ``torch.func.jvp`` of ``θ ↦ select(model(X; θ))``, the loss Hessian with
respect to the output by ``torch.func.hessian``, so ``G v = Jᵀ H_out J v`` (a ``vjp``); the
Hessian product by ``jvp`` of ``grad`` of the loss.
"""

from __future__ import annotations

import pytest
import torch

from curvlib.operators import GGN, EmpiricalFisher, Hessian

from oracles import ecosystem
from oracles.on_device import seeded
from oracles.zoo import Problem
from oracles.zoo_reference import forward, operator_products

MODELS = [
    ("transformers/causal_lm/gpt2", "direct"),
    ("transformers/causal_lm/llama", "wrapped"),
    ("transformers/seq_cls/qwen2", "direct"),
    ("transformers/causal_lm/qwen2_moe", "direct"),
    ("torchvision/resnet18", "direct"),
]


def _reference(prob, theta, v):
    """``G v`` and ``H v`` by reverse-mode torch.func on the model itself (some kernels, as the
    grouped experts' matmul, have no forward mode): ``J v`` as the vector-Jacobian product of
    the linear map ``u ↦ Jᵀu``, ``H v`` as that of the gradient (``H`` is symmetric)."""
    def f(p):
        return forward_with(prob, p)

    out, pull = torch.func.vjp(f, theta)
    jv = torch.func.vjp(lambda u: pull(u)[0], torch.zeros_like(out))[1](v)[0]
    flat = out.detach().reshape(-1)
    hess = torch.func.hessian(lambda o: prob.lossfn(o.reshape(out.shape), prob.y))(flat)
    gv = pull((hess @ jv.reshape(-1)).reshape(out.shape))[0]
    grad = torch.func.grad(lambda p: prob.lossfn(f(p), prob.y))
    hv = torch.func.vjp(grad, theta)[1](v)[0]
    return gv, hv


def forward_with(prob, params):
    """The selected output with ``params``, through the references' own forward."""
    return torch.func.functional_call(_Selected(prob), {f"model.{n}": t for n, t in params.items()}, (prob.X,))


class _Selected(torch.nn.Module):
    def __init__(self, prob):
        super().__init__()
        self.model, self.output = prob.model, prob.output

    def forward(self, X):
        return forward(self.model, X, self.output)


@pytest.mark.parametrize("name, variant", MODELS)
def test_products_on_the_sweeps_models(name, variant):
    pytest.importorskip("transformers" if name.startswith("transformers") else "torchvision")
    why, prob = ecosystem.eligible_problem(name, variant)
    assert why is None, why
    theta = {n: p.detach() for n, p in prob.model.named_parameters() if p.requires_grad}
    g = seeded(1)
    v = {n: torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in theta.items()}
    gv_ref, hv_ref = _reference(prob, theta, v)
    data = (prob.X, prob.y)
    for Op, ref in ((GGN, gv_ref), (Hessian, hv_ref)):
        got = Op(prob.model, prob.lossfn, data, output=prob.output) @ v
        for n in theta:
            err = float((got[n] - ref[n]).abs().max())
            scale = max(float(ref[n].abs().max()) for n in theta)
            assert err <= 1e-6 * scale + 1e-12, f"{Op.__name__} of {name} ({variant}), {n}: {err:.3g} at {scale:.3g}"
    # the empirical Fisher is symmetric positive semi-definite: vᵀ E v >= 0 and uᵀ E v = vᵀ E u
    E = EmpiricalFisher(prob.model, prob.lossfn, data, output=prob.output)
    u = {n: torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in theta.items()}
    ev, eu = E.domain.flatten(E @ v), E.domain.flatten(E @ u)
    fv, fu = E.domain.flatten(v), E.domain.flatten(u)
    assert float(fv @ ev) >= -1e-12
    assert abs(float(fu @ ev - fv @ eu)) <= 1e-8 * float(ev.abs().max() * fu.abs().sum())


class _HardGate(torch.nn.Module):
    """A squeeze-excitation-like gate: ``x ⊙ hardsigmoid(W₂ tanh(W₁ x))`` (the module) then
    ``hardsigmoid`` again (the function), as torchvision's and timm's MobileNetV3 use them."""

    def __init__(self):
        super().__init__()
        self.inner, self.gate, self.act, self.head = (torch.nn.Linear(5, 4), torch.nn.Linear(4, 5),
                                                      torch.nn.Hardsigmoid(), torch.nn.Linear(5, 3))

    def forward(self, x):
        s = self.act(self.gate(torch.tanh(self.inner(x))))
        return self.head(torch.nn.functional.hardsigmoid(x * s * 4.0))


def test_the_sweeps_reference_runs_hardsigmoid_by_its_formula():
    """torch has no derivative of ``hardsigmoid_backward``: the sweep's reference
    (``operator_products``) runs hardsigmoid as ``relu6(x + 3) / 6``; it and the operators equal
    ``torch.func`` on the model with the formula written out."""
    torch.manual_seed(0)
    model = _HardGate().double()
    X, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    prob = Problem(model, X, y, torch.nn.CrossEntropyLoss(), None, "hardsigmoid gate")
    theta = {n: p.detach() for n, p in model.named_parameters()}
    g = seeded(2)
    v = {n: torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in theta.items()}

    def formula(p):
        hs = lambda t: torch.nn.functional.relu6(t + 3.0) / 6.0  # noqa: E731
        s = hs(torch.func.functional_call(model.gate, {"weight": p["gate.weight"], "bias": p["gate.bias"]},
                                          (torch.tanh(X @ p["inner.weight"].T + p["inner.bias"]),)))
        return hs(X * s * 4.0) @ p["head.weight"].T + p["head.bias"]

    out, pull = torch.func.vjp(formula, theta)
    jv = torch.func.jvp(formula, (theta,), (v,))[1]
    hess = torch.func.hessian(lambda o: prob.lossfn(o.reshape(out.shape), y))(out.detach().reshape(-1))
    gv_ref = pull((hess @ jv.reshape(-1)).reshape(out.shape))[0]
    hv_ref = torch.func.jvp(torch.func.grad(lambda p: prob.lossfn(formula(p), y)), (theta,), (v,))[1]
    gv_oracle, hv_oracle = operator_products(prob, v)
    gv, hv = GGN(model, prob.lossfn, (X, y)) @ v, Hessian(model, prob.lossfn, (X, y)) @ v
    for got, ref in ((gv_oracle, gv_ref), (hv_oracle, hv_ref), (gv, gv_ref), (hv, hv_ref)):
        for n in theta:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-10, atol=1e-12)
    assert any(float(hv_ref[n].abs().max()) > 1e-3 for n in theta)
