"""Nodes that compute in another dtype than the model's parameters (Llama's RMSNorm casts to
float32 inside a float64 model; a float32 model may normalise in float64).

Every extension runs, its results in the parameters' dtype, the casts differentiated as the
model's own autograd differentiates them; compared with the brute-force oracles (which run
the model itself) at the precision of the narrower dtype. Hypothesis draws where the cast
node sits and which way it casts.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import curvature

from oracles.reference import assert_matches, exact_extensions, reference
from oracles.on_device import seeded


class CastNorm(nn.Module):
    """RMSNorm computed in ``inner`` dtype, its weight applied in the parameters' dtype (as Llama's)."""

    def __init__(self, d: int, inner: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d, generator=seeded(4)))
        self.inner = inner

    def forward(self, h):
        dtype = h.dtype
        h = h.to(self.inner)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(dtype)


class Model(nn.Module):
    def __init__(self, inner: torch.dtype, where: str):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 3)
        self.norm = CastNorm(4, inner)
        self.where = where

    def forward(self, x):
        h = self.a(x)
        if self.where == "before_activation":
            return self.b(torch.tanh(self.norm(h)))
        return self.b(self.norm(torch.tanh(h)))


@settings(max_examples=8)
@given(outer=st.sampled_from([torch.float64, torch.float32]), where=st.sampled_from(["before_activation", "after"]),
       seed=st.integers(0, 2**16))
def test_every_extension_through_a_cast_node(outer, where, seed):
    inner = torch.float32 if outer == torch.float64 else torch.float64
    torch.manual_seed(seed)
    model = Model(inner, where).to(outer)
    g = seeded(seed)
    X, y = torch.randn(4, 3, generator=g, dtype=outer), torch.randint(0, 3, (4,), generator=g)
    lossfn = nn.CrossEntropyLoss()
    qs = curvature(model, lossfn, exact_extensions(hessian=True))(X, y)
    for key, value in qs.items():
        if isinstance(value, dict):
            for name, v in value.items():
                if isinstance(v, torch.Tensor):
                    assert v.dtype == outer, (key, name, v.dtype)
    # (PCHMP runs and keeps the dtype; the oracle's positive-curvature block needs activation
    # modules, not this functional norm: its values are checked on the residual tests' models)
    V = torch.randn(2, 4, 3, generator=g, dtype=outer)
    assert qs["pchmp"]["a.weight"](V).dtype == outer
    ref = reference(model, lossfn, X, y, hessian=True, pchmp=False)
    assert_matches({k: v for k, v in qs.items() if k != "pchmp"}, ref, f"{outer}/{where}", rtol=2e-4)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_precision_model_with_float32_norm(half):
    """A bfloat16 / float16 model whose norm computes in float32: every extension runs (the
    residuals' eigendecompositions and SVDs, which LAPACK lacks in half precision, run in
    float32), results in the model's dtype, near the float64 twin's oracle values."""
    torch.manual_seed(0)
    model = Model(torch.float32, "before_activation").to(half)
    g = seeded(1)
    X, y = torch.randn(4, 3, generator=g).to(half), torch.randint(0, 3, (4,), generator=g)
    lossfn = nn.CrossEntropyLoss()
    qs = curvature(model, lossfn, exact_extensions(hessian=True))(X, y)
    twin = Model(torch.float64, "before_activation").to(torch.float64)
    twin.load_state_dict({k: v.to(torch.float64) for k, v in model.state_dict().items()})
    ref = reference(twin, lossfn, X.to(torch.float64), y, hessian=True, pchmp=False)
    for key in ("grad_batch", "diag_ggn_exact", "diag_h", "diag_h_batch"):
        for name, want in ref[key].items():
            got = qs[key][name]
            assert got.dtype == half
            scale = float(want.abs().max())
            assert float((got.to(torch.float64) - want).abs().max()) <= 0.05 * scale + 1e-3, (key, name)
    V = torch.randn(2, 4, 3, generator=g).to(half)
    assert qs["pchmp"]["a.weight"](V).dtype == half


class InnerMatmul(nn.Module):
    """A nonlinear node computing in ``inner`` dtype whose output meets another ``inner`` tensor in
    a matrix product (mixing dtypes there is an error): its residual's probe keeps its dtype."""

    def __init__(self, inner: torch.dtype):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 3)
        self.mix = nn.Parameter(torch.randn(4, 4, generator=seeded(5)) / 2)
        self.inner = inner

    def forward(self, x):
        h = torch.tanh(self.a(x).to(self.inner))
        return self.b((h @ self.mix.to(self.inner)).sigmoid().to(x.dtype))


@pytest.mark.parametrize("outer", [torch.float64, torch.float32])
def test_a_residual_in_an_inner_dtype_keeps_it(outer):
    inner = torch.float32 if outer == torch.float64 else torch.float64
    torch.manual_seed(2)
    model = InnerMatmul(inner).to(outer)
    g = seeded(2)
    X, y = torch.randn(4, 3, generator=g, dtype=outer), torch.randint(0, 3, (4,), generator=g)
    lossfn = nn.CrossEntropyLoss()
    qs = curvature(model, lossfn, exact_extensions(hessian=True))(X, y)
    ref = reference(model, lossfn, X, y, hessian=True, pchmp=False)
    assert_matches({k: v for k, v in qs.items() if k != "pchmp"}, ref, f"{outer}", rtol=2e-4)
