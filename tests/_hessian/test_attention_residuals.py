"""Factored residuals of softmax rows and matrix products (:mod:`curvlib._hessian.structured`)
against the dense per-sample residual ``∇²_u (g · f(u))`` from ``torch.func.hessian``."""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib._core.site import Residual

from oracles.residuals import check_residual

DT = torch.float64


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
    check_residual(res, lambda x: torch.softmax(x, axis), g, n)


@settings(deadline=None, max_examples=15)
@given(n=st.integers(1, 3), heads=st.integers(1, 2), t=st.integers(1, 3), k=st.integers(1, 3), s=st.integers(1, 3),
       bdim=st.integers(0, 1), seed=st.integers(0, 2**16))
def test_matmul(n, heads, t, k, s, bdim, seed):
    torch.manual_seed(seed)
    x = torch.randn(n, heads, t, k, dtype=DT).movedim(0, bdim)
    y = torch.randn(n, heads, k, s, dtype=DT).movedim(0, bdim)
    g = torch.randn(n, heads, t, s, dtype=DT).movedim(0, bdim)
    res = Residual("matmul", "matmul", None, [x, y], taps=[0, 1], in_dims=(bdim, bdim), out_dim=bdim)
    check_residual(res, torch.matmul, g, n)


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
