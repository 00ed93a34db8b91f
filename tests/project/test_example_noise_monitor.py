"""examples/noise_monitor.py: its per-layer SNR, tr diag GGN and per-sample norms against a brute force.

Oracle (float64): per-sample gradients of the one-sample losses by ``torch.func.vmap(grad)``;
the GGN of the mean loss as ``(1/N) Σ_n J_nᵀ (∇²_f ℓ_n) J_n`` with ``J_n`` from ``jacrev`` and
the logits' Hessian from ``torch.func.hessian``.
"""

import os
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.func import functional_call, grad, hessian, jacrev, vmap

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import noise_monitor  # noqa: E402

from curvlib import curvature  # noqa: E402
from curvlib.extensions import BatchL2Grad, DiagGGNExact, Variance  # noqa: E402


@pytest.fixture(autouse=True)
def _on_cpu():
    with torch.device("cpu"):
        yield


def brute_force(model, X, y):
    params = {k: p.detach() for k, p in model.named_parameters()}

    def one_loss(p, x, t):
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), t[None])

    g = vmap(grad(one_loss), in_dims=(None, 0, 0))(params, X, y)  # ∇ℓ_n, [N, *p]
    n = len(X)
    stats = {}
    for name in params:
        layer = noise_monitor.layer_of(name)
        s = stats.setdefault(layer, {"signal": 0.0, "trace_cov": 0.0, "tr_ggn": 0.0})
        mean = g[name].mean(0)
        s["signal"] += float(mean.pow(2).sum())
        s["trace_cov"] += float((g[name] - mean).pow(2).sum() / n)  # tr Σ, 1/N-normalised
    for i in range(n):
        J = jacrev(lambda p: functional_call(model, p, (X[i:i + 1],)).squeeze(0))(params)
        H = hessian(lambda f: nn.functional.cross_entropy(f[None], y[i:i + 1]))(model(X[i:i + 1]).squeeze(0).detach())
        for name, Jp in J.items():
            Jp = Jp.flatten(1)  # [C, P_p]
            stats[noise_monitor.layer_of(name)]["tr_ggn"] += float(torch.einsum("cp,cd,dp->", Jp, H, Jp)) / n
    norms = torch.stack([v.flatten(1).pow(2).sum(1) for v in g.values()]).sum(0).sqrt()
    return {k: {"snr": s["signal"] / (s["trace_cov"] / n), "tr_ggn": s["tr_ggn"]} for k, s in stats.items()}, norms


@settings(max_examples=8, deadline=None)
@given(n=st.integers(2, 7), seed=st.integers(0, 1000), hidden=st.integers(1, 5))
def test_statistics_match_brute_force(n, seed, hidden):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 3)).double()
    X, y = torch.randn(n, 4, dtype=torch.float64), torch.randint(0, 3, (n,))
    qs = curvature(model, nn.CrossEntropyLoss(), [Variance(), BatchL2Grad(), DiagGGNExact()])(X, y)
    want, want_norms = brute_force(model, X, y)
    got = noise_monitor.layer_statistics(qs, n)
    assert got.keys() == want.keys() == {"0", "2"}
    for layer in want:
        for key in ("snr", "tr_ggn"):
            assert got[layer][key] == pytest.approx(want[layer][key], rel=1e-9), (layer, key)
    torch.testing.assert_close(noise_monitor.per_sample_norms(qs, n), want_norms, rtol=1e-10, atol=1e-12)
