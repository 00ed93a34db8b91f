"""Block-diagonal residuals of LayerNorm and GroupNorm (:mod:`curvlib._hessian.norm`)
against the dense per-sample residual ``∇²_x (g · f(x))`` from ``torch.func.hessian``,
and the Hessian family through them against brute force."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings, strategies as st
from torch import nn

from curvlib._core.site import Residual

from oracles.checks import check_hessian_family
from oracles.residuals import check_residual

DT = torch.float64


@settings(deadline=None, max_examples=20)
@given(n=st.integers(1, 3), lead=st.lists(st.integers(1, 3), max_size=2), norm=st.lists(st.integers(1, 3), min_size=1, max_size=2),
       bdim=st.integers(0, 2), affine=st.booleans(), eps=st.sampled_from([1e-5, 0.3]), seed=st.integers(0, 2**16))
def test_layernorm_rows(n, lead, norm, bdim, affine, eps, seed):
    torch.manual_seed(seed)
    bdim = min(bdim, len(lead))
    shape = list(lead)
    shape.insert(bdim, n)
    x = torch.randn(shape + norm, dtype=DT) * 2 + 0.5
    g = torch.randn_like(x)
    w = torch.randn(norm, dtype=DT) if affine else None
    b = torch.randn(norm, dtype=DT) if affine else None
    res = Residual("ln", "norm", None, [x], in_dims=(bdim,), out_dim=bdim,
                   meta={"eps": eps, "weight": w, "groups": None, "norm_dims": len(norm)})
    # (the product with w, not F.layer_norm's weight: torch.func's second derivative of that is wrong)
    f = lambda t: F.layer_norm(t, norm, None, None, eps) * (1 if w is None else w) + (0 if b is None else b)  # noqa: E731
    check_residual(res, f, g, n, floor=_terms(x.flatten(-len(norm)), g if w is None else g * w))


def _terms(rows, gt):
    """``max |g̃| / σ²`` over ``rows [..., d]``: the size of R's terms, which cancel for rows of 2 (``x̂ = ±1``)."""
    return float(gt.abs().max() / rows.var(-1, unbiased=False).min().clamp_min(1e-12))


@settings(deadline=None, max_examples=15)
@given(n=st.integers(1, 3), groups=st.integers(1, 3), per=st.integers(1, 2), spatial=st.lists(st.integers(1, 3), max_size=2),
       affine=st.booleans(), seed=st.integers(0, 2**16))
def test_groupnorm_rows(n, groups, per, spatial, affine, seed):
    torch.manual_seed(seed)
    assume(per * torch.Size(spatial).numel() > 1)  # (the oracle runs one sample: torch refuses groups of one value)
    c = groups * per
    x = torch.randn([n, c] + spatial, dtype=DT)
    g = torch.randn_like(x)
    w = torch.randn(c, dtype=DT) if affine else None
    res = Residual("gn", "norm", None, [x], in_dims=(0,), out_dim=0, meta={"eps": 1e-5, "weight": w, "groups": groups})
    view = (1, c) + (1,) * len(spatial)
    check_residual(res, lambda t: F.group_norm(t, groups, None, None, 1e-5) * (1 if w is None else w.view(view)), g, n,
           floor=_terms(x.reshape(n, groups, -1), g if w is None else g * w.view(view)))


class _LNNet(nn.Module):
    def __init__(self, norm, affine, batch_first):
        super().__init__()
        d = 1
        for s in norm:
            d *= s
        self.norm, self.batch_first = norm, batch_first
        self.inp = nn.Linear(3, d)
        self.ln = nn.LayerNorm(norm, elementwise_affine=affine)
        self.out = nn.Linear(d, 2)

    def forward(self, x):  # x [N, T, 3]
        h = self.inp(x)
        if not self.batch_first:
            h = h.transpose(0, 1)
        h = self.ln(h.unflatten(-1, self.norm)).flatten(-len(self.norm))
        h = torch.tanh(h) if self.batch_first else torch.tanh(h).transpose(0, 1)
        return self.out(h).sum(1)


@settings(deadline=None, max_examples=6)
@given(norm=st.sampled_from([(4,), (2, 2), (3,)]), affine=st.booleans(), batch_first=st.booleans(), seed=st.integers(0, 2**10))
def test_layernorm_hessian_family(norm, affine, batch_first, seed):
    """DiagHessian, BatchDiagHessian vs torch.func Hessians; PCHMP vs oracles.pchmp's blocks."""
    torch.manual_seed(seed)
    model = _LNNet(norm, affine, batch_first).to(DT)
    X, y = torch.randn(2, 2, 3, dtype=DT), torch.randn(2, 2, dtype=DT)
    check_hessian_family(model, nn.MSELoss(reduction="sum"), X, y, exact_pchmp=False)


@pytest.mark.parametrize("affine", [True, False])
def test_groupnorm_hessian_family(affine):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 2), nn.GroupNorm(2, 4, affine=affine), nn.Tanh(), nn.Flatten(), nn.Linear(16, 2)).to(DT)
    X, y = torch.randn(2, 2, 3, 3, dtype=DT), torch.randn(2, 2, dtype=DT)
    check_hessian_family(model, nn.MSELoss(reduction="sum"), X, y, exact_pchmp=False)


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.out = nn.LayerNorm(3), nn.Linear(3, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.ln(torch.tanh(self.ln(x)))))


def test_shared_layernorm_stays_dense():
    """A LayerNorm whose input depends on its own weight (its second use) keeps the dense residual."""
    from curvlib._trace.program import trace_program
    from curvlib._hessian.residuals import residual_plan

    kinds = sorted(kind for kind, _, _ in residual_plan(trace_program(_Twice().to(DT))).values())
    assert kinds == ["dense", "diag", "diag", "norm"], kinds


def test_shared_layernorm_hessian():
    """DiagHessian of a LayerNorm applied twice vs autograd's double backward (not torch.func,
    whose second derivative of ``F.layer_norm`` with a weight is wrong in the weight-input coupling)."""
    from curvlib import curvature
    from curvlib.extensions import DiagHessian
    from oracles.pchmp import hessian_blocks_autograd

    torch.manual_seed(0)
    model = _Twice().to(DT)
    with torch.no_grad():
        model.ln.weight.add_(torch.randn(3, dtype=DT))
    X, y = torch.randn(2, 3, dtype=DT), torch.randn(2, 1, dtype=DT)
    lossfn = nn.MSELoss(reduction="sum")
    got = curvature(model, lossfn, [DiagHessian()])(X, y)["diag_h"]
    for name, H in hessian_blocks_autograd(model, lossfn, X, y).items():
        torch.testing.assert_close(got[name].reshape(-1), H.diagonal(), rtol=1e-7, atol=1e-10 * float(H.abs().max()))


def test_frozen_layernorm_weight_scales_residual():
    """A frozen (non-trainable) LayerNorm weight still scales ``g`` in the residual."""
    torch.manual_seed(1)
    model = _LNNet((4,), True, True).to(DT)
    with torch.no_grad():
        model.ln.weight.copy_(torch.randn(4, dtype=DT) * 2)
    model.ln.weight.requires_grad_(False)
    X, y = torch.randn(2, 2, 3, dtype=DT), torch.randn(2, 2, dtype=DT)
    check_hessian_family(model, nn.MSELoss(reduction="sum"), X, y, exact_pchmp=False)
