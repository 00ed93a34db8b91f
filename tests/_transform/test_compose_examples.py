"""The "Composing with torch.func" patterns (docs/composing.md) against float64 brute force:
a sharpness regulariser (``grad`` of ``loss + λ·tr H`` through ``DiagHessian``, a LayerNorm
model: third derivatives) and meta-learning (``grad`` of a ``vmap`` over tasks of a
GGN-diagonal-preconditioned inner step)."""

from __future__ import annotations

import copy

import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.func import functional_call, grad, hessian, jacrev, vmap

from curvlib import curvature
from curvlib.extensions import DiagGGNExact, DiagHessian

from oracles.on_device import seeded

DT = torch.float64


class _PrimitiveLayerNorm(nn.LayerNorm):
    """The oracle's LayerNorm from primitives (torch 2.13's third derivative of F.layer_norm is wrong)."""

    def forward(self, x):
        c = x - x.mean(-1, keepdim=True)
        return c * torch.rsqrt((c * c).mean(-1, keepdim=True) + self.eps) * self.weight + self.bias


def _rel(got: dict, want: dict) -> float:
    scale = max(float(w.abs().max()) for w in want.values())
    return max(float((got[k] - want[k]).abs().max()) for k in want) / scale


@settings(max_examples=3)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 6), lam=st.sampled_from([1e-2, 1.0]))
def test_sharpness_regulariser_gradient(seed, n, lam):
    gen = seeded(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3)).double()
    X, y = torch.randn(n, 4, dtype=DT, generator=gen), torch.randint(0, 3, (n,), generator=gen)
    lossfn = nn.CrossEntropyLoss()
    f = curvature(model, lossfn, [DiagHessian()])
    params = {k: v.detach() for k, v in model.named_parameters()}

    def regularised(p):
        qs = f(X, y, params=p)
        return qs["loss"] + lam * sum(d.sum() for d in qs["diag_h"].values())

    twin = copy.deepcopy(model)
    twin[1].__class__ = _PrimitiveLayerNorm

    def loss(p):
        return lossfn(functional_call(twin, p, (X,)), y)

    def regularised_brute(p):
        H = hessian(loss)(p)
        trace = sum(torch.diagonal(H[k][k].reshape(p[k].numel(), p[k].numel())).sum() for k in p)
        return loss(p) + lam * trace

    assert _rel(grad(regularised)(params), grad(regularised_brute)(params)) < 1e-9


@settings(max_examples=3)
@given(seed=st.integers(0, 2**16), tasks=st.integers(1, 3), shots=st.integers(2, 5))
def test_meta_gradient_through_a_preconditioned_inner_step(seed, tasks, shots):
    gen = seeded(seed)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    lossfn = nn.CrossEntropyLoss()
    f = curvature(net, lossfn, [DiagGGNExact()])
    Xs, Xq = (torch.randn(tasks, shots, 4, dtype=DT, generator=gen) for _ in range(2))
    ys, yq = (torch.randint(0, 3, (tasks, shots), generator=gen) for _ in range(2))
    params = {k: v.detach() for k, v in net.named_parameters()}

    def step(p, g, d):
        return {k: p[k] - 0.5 * g[k] / (d[k] + 0.1) for k in p}

    def query_loss(p, X_s, y_s, X_q, y_q):
        qs = f(X_s, y_s, params=p)
        return lossfn(functional_call(net, step(p, qs["grad"], qs["diag_ggn_exact"]), (X_q,)), y_q)

    def ggn_diagonal(p, X_s, y_s):  # Σ_n J_nᵀ ∇²ℓ_n J_n, mean loss: ∇²ℓ_n / N
        out = lambda q: functional_call(net, q, (X_s,))  # noqa: E731
        J, logits = jacrev(out)(p), out(p)
        H = vmap(hessian(lambda z, t: lossfn(z[None], t[None])))(logits, y_s) / X_s.shape[0]
        return {k: torch.einsum("nc...,ncd,nd...->...", J[k], H, J[k]) for k in p}

    def query_brute(p, X_s, y_s, X_q, y_q):
        g = grad(lambda q: lossfn(functional_call(net, q, (X_s,)), y_s))(p)
        return lossfn(functional_call(net, step(p, g, ggn_diagonal(p, X_s, y_s)), (X_q,)), y_q)

    got = grad(lambda p: vmap(query_loss, in_dims=(None, 0, 0, 0, 0))(p, Xs, ys, Xq, yq).mean())(params)
    want = grad(lambda p: sum(query_brute(p, Xs[t], ys[t], Xq[t], yq[t]) for t in range(tasks)) / tasks)(params)
    assert _rel(got, want) < 1e-9
