"""Factored residuals of softmax rows and matrix products (:mod:`curvlib._hessian.structured`)
against the dense per-sample residual ``∇²_u (g · f(u))`` from ``torch.func.hessian``."""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib._hessian.algebra import factor, positive_curvature
from curvlib._core.site import Residual

DT = torch.float64


def _dense(f, inputs, g, in_dims, out_dim):
    """``R [N, D, D]`` over the concatenated per-sample inputs, by brute force."""
    xs = [x.movedim(d, 0) for x, d in zip(inputs, in_dims)]
    n = xs[0].shape[0]
    sizes = [x[0].numel() for x in xs]
    R = []
    for k in range(n):
        u = torch.cat([x[k].reshape(-1) for x in xs])

        def contracted(u):
            parts = [p.reshape(x[k].shape).unsqueeze(d) for p, x, d in zip(torch.split(u, sizes), xs, in_dims)]
            return (f(*parts).movedim(out_dim, 0)[0] * g.movedim(out_dim, 0)[k]).sum()

        R.append(torch.func.hessian(contracted)(u))
    return torch.stack(R), sizes


def _assembled(res, g, n, sizes):
    """``Σ sign c cᵀ`` per sample from the signed columns."""
    total = 0
    for sign, taps, _ in factor(res, g):
        v = taps[0].shape[0]
        cols = torch.cat([taps[j][0:v].movedim(1 + d, 1).reshape(v, n, -1) for j, d in enumerate(res.in_dims)], 2)
        total = total + sign * torch.einsum("vni,vnj->nij", cols, cols)
    return total


def _check(res, f, g, n, floor: float = 0.0):
    """``floor``: the size of the terms that cancel in ``R`` (a tolerance scale where ``R`` is ~0)."""
    R, sizes = _dense(f, res.inputs, g, res.in_dims, res.out_dim)
    scale = float(R.abs().max()) + floor + 1e-30
    assert float((_assembled(res, g, n, sizes) - R).abs().max()) <= 1e-10 * scale
    for modify in ("clip", "abs"):
        lam, Q = torch.linalg.eigh(R)
        lam = lam.clamp(min=0) if modify == "clip" else lam.abs()
        M = (Q * lam.unsqueeze(1)) @ Q.transpose(1, 2)
        t = [torch.randn_like(x) for x in res.inputs]
        flat = torch.cat([x.movedim(d, 0).reshape(n, -1) for x, d in zip(t, res.in_dims)], 1)
        want = torch.einsum("nij,nj->ni", M, flat)
        got, _ = positive_curvature(res, g, modify)(t, {})
        got = torch.cat([c.movedim(d, 0).reshape(n, -1) for c, d in zip(got, res.in_dims)], 1)
        assert float((got - want).abs().max()) <= 1e-10 * scale, modify


@settings(deadline=None, max_examples=15)
@given(n=st.integers(1, 3), rows=st.integers(1, 3), s=st.integers(1, 4), bdim=st.integers(0, 2),
       axis=st.integers(-3, 2), masked=st.booleans(), seed=st.integers(0, 2**16))
def test_softmax_rows(n, rows, s, bdim, axis, masked, seed):
    torch.manual_seed(seed)
    a = torch.randn(rows, s, dtype=DT).unsqueeze(0).expand(n, rows, s).clone() + torch.randn(n, rows, s, dtype=DT)
    if masked:  # causal-like masked entries (never a whole row): weights exactly 0
        a = a.masked_fill(torch.ones(rows, s, dtype=torch.bool).triu(1), -1e9)
    a = a.movedim(0, bdim)
    axis = axis % 3
    if axis == bdim:
        axis = (bdim + 1) % 3
    g = torch.randn_like(a)
    res = Residual("softmax", "softmax", None, [a], in_dims=(bdim,), out_dim=bdim, meta={"axis": axis})
    _check(res, lambda x: torch.softmax(x, axis), g, n)


@settings(deadline=None, max_examples=15)
@given(n=st.integers(1, 3), heads=st.integers(1, 2), t=st.integers(1, 3), k=st.integers(1, 3), s=st.integers(1, 3),
       bdim=st.integers(0, 1), seed=st.integers(0, 2**16))
def test_matmul(n, heads, t, k, s, bdim, seed):
    torch.manual_seed(seed)
    x = torch.randn(n, heads, t, k, dtype=DT).movedim(0, bdim)
    y = torch.randn(n, heads, k, s, dtype=DT).movedim(0, bdim)
    g = torch.randn(n, heads, t, s, dtype=DT).movedim(0, bdim)
    res = Residual("matmul", "matmul", None, [x, y], taps=[0, 1], in_dims=(bdim, bdim), out_dim=bdim)
    _check(res, torch.matmul, g, n)


def test_attention_nodes_are_factored():
    """In a transformer layer, ``q kᵀ``, softmax and ``A v`` get factored residuals
    (no dense per-sample matrix), and so do the LayerNorms (per-row blocks): nothing is dense."""
    from curvlib._trace.program import trace_program
    from curvlib._hessian.residuals import residual_plan

    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True, activation="gelu")
    program = trace_program(nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval())
    kinds = {}
    for node, (kind, _, _) in residual_plan(program).items():
        kinds.setdefault(kind, []).append(str(node.target))
    assert len(kinds.get("matmul", [])) == 2 and len(kinds.get("softmax", [])) == 1, kinds
    assert "dense" not in kinds and len(kinds.get("norm", [])) == 2, kinds


@pytest.mark.parametrize("N", [2])
def test_broadcasting_matmul_stays_dense(N):
    """``X @ Y`` with different leading dims is not factored (dense, still exact)."""
    from curvlib import curvature
    from curvlib.extensions import DiagHessian

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 6), nn.Linear(3, 6)

        def forward(self, x):
            return (self.a(x).unflatten(-1, (2, 1, 3)) @ self.b(x).unflatten(-1, (1, 3, 2))).flatten(1)

    torch.manual_seed(0)
    model = M().to(DT)
    X, y = torch.randn(N, 3, dtype=DT), torch.randn(N, 4, dtype=DT)
    got = curvature(model, nn.MSELoss(reduction="sum"), [DiagHessian()])(X, y)["diag_h"]
    params = dict(model.named_parameters())
    for name, p in params.items():
        def loss(q, name=name):
            return torch.func.functional_call(model, {**params, name: q}, (X,)).sub(y).pow(2).sum()
        H = torch.func.hessian(loss)(p.detach()).reshape(p.numel(), p.numel())
        assert torch.allclose(got[name].reshape(-1), H.diagonal(), atol=1e-9), name
