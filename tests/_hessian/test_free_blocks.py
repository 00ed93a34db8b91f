"""The Hessian diagonal of a dense node's free parameters from Hessian-vector products
(``curvlib._hessian.free_blocks``): an opaque module (its forward loops over tensor values,
so it is one graph node) whose own parameters no input depends on. Its block ``R_pp`` is
never formed: mixture-of-experts layers (transformers' experts modules, ``[E, 2I, D]``
weights, refused before for the size of a dense ``(|θ| + |x|)²`` residual), a weight
normalised as a whole (rows coupled), a weight the node is linear in (a zero block).
DiagHessian and BatchDiagHessian equal ``torch.func`` Hessian diagonals, with the size
limit set below what the dense residual needed; where a node operation has no forward-mode
derivative the products go reverse over reverse, and a reverse-mode second derivative that
is not symmetric is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings as hsettings, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib._core import settings
from curvlib._hessian import free_blocks
from curvlib.extensions import BatchDiagHessian, DiagHessian

from oracles.cases import DT
from oracles.checks import check_hessian_diagonals
from oracles.on_device import seeded


class ProductNoJvp(torch.autograd.Function):
    """``a * b`` with a differentiable backward and no ``jvp``: no forward mode."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b):
        return a * b

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, g * a


class Experts(nn.Module):
    """transformers' experts layout: ``gate_up [E, 2H, D]``, ``down [E, D, H]``, a loop over the
    experts hit (tensor values: not traceable, one graph node). ``how``: ``"moe"`` (rows
    separate: one block per expert), ``"normed"`` (``gate_up`` divided by its whole norm: every
    entry coupled), ``"linear"`` (no activation and ``gate_up`` fixed to identity-like use: the
    node is linear in ``down``), ``"no_jvp"`` (the activation has no forward mode)."""

    def __init__(self, e: int, d: int, h: int, how: str):
        super().__init__()
        self.e, self.how = e, how
        self.gate_up = nn.Parameter(0.5 * torch.randn(e, 2 * h, d))
        self.down = nn.Parameter(0.5 * torch.randn(e, d, h))

    def forward(self, x, idx, w):
        out = torch.zeros_like(x)
        mask = F.one_hot(idx, self.e).permute(2, 1, 0)  # [E, k, M]
        gate_up = self.gate_up / self.gate_up.norm() if self.how == "normed" else self.gate_up
        for e in (mask.sum((1, 2)) > 0).nonzero()[:, 0].tolist():
            pos, tok = torch.where(mask[e])
            if self.how == "linear":
                hidden = x[tok, : self.down.shape[2]] * w[tok, pos, None]
            else:
                g, u = (x[tok] @ gate_up[e].T).chunk(2, dim=-1)
                hidden = ProductNoJvp.apply(F.silu(g), u) if self.how == "no_jvp" else F.silu(g) * u
            out.index_add_(0, tok, (hidden @ self.down[e].T) * w[tok, pos, None])
        return out


class MoENet(nn.Module):
    def __init__(self, d_in: int, d: int, e: int, h: int, k: int, classes: int, how: str):
        super().__init__()
        self.k = k
        self.embed = nn.Linear(d_in, d)
        self.router = nn.Linear(d, e, bias=False)
        self.experts = Experts(e, d, h, how)
        self.head = nn.Linear(d, classes)

    def forward(self, x):  # x [N, T, d_in]
        h = torch.tanh(self.embed(x))
        flat = h.reshape(-1, h.shape[-1])
        w, idx = torch.topk(torch.softmax(self.router(flat), dim=-1), self.k, dim=-1)
        moe = self.experts(flat, idx, w / w.sum(-1, keepdim=True)).reshape(h.shape)
        return self.head(torch.tanh(h + moe).mean(1))


def _problem(seed, n, t, e, k, how):
    g = seeded(seed)
    torch.manual_seed(seed)
    X = torch.randn(n, t, 3, generator=g, dtype=DT)
    y = torch.randint(0, 4, (n,), generator=g)
    return MoENet(3, 4, e, 3, k, 4, how).to(DT), nn.CrossEntropyLoss(), X, y


def _dense_need(model: MoENet, X) -> int:
    """The entries a dense residual over the experts' ``(θ, x, w)`` would take: ``N d²``."""
    tokens = X.shape[1]
    d = model.experts.gate_up.numel() + model.experts.down.numel() + tokens * (4 + model.k)
    return X.shape[0] * d * d


@hsettings(max_examples=12, deadline=None)
@given(how=st.sampled_from(["moe", "normed", "linear"]), n=st.integers(1, 3), t=st.integers(1, 4),
       e=st.integers(2, 4), k=st.integers(1, 2), seed=st.integers(0, 50))
def test_free_blocks_hessian_diagonals(how, n, t, e, k, seed):
    model, lossfn, X, y = _problem(seed, n, t, e, min(k, e), how)
    # (below what a dense residual over the experts' parameters and inputs needs: the old refusal)
    with settings.override(max_dense_residual_entries=_dense_need(model, X) // 4):
        check_hessian_diagonals(model, lossfn, X, y)


def test_rows_probe_finds_the_structure(monkeypatch):
    """Experts' ``gate_up``: one block per expert (``E`` times fewer products); normalised as a
    whole: one block; ``down``, which the node is linear in: a zero block, no products beyond
    the probe's."""
    seen = {}
    probe = free_blocks._SampleProducts.probe_rows

    def spy(self):
        seen[self.name] = probe(self)
        return seen[self.name]

    monkeypatch.setattr(free_blocks._SampleProducts, "probe_rows", spy)
    for how, expected in [("moe", {"gate_up": 3, "down": 0}), ("normed", {"gate_up": None, "down": 0}),
                          ("linear", {"gate_up": 0, "down": 0})]:
        seen.clear()
        model, lossfn, X, y = _problem(1, 2, 3, 3, 2, how)
        curvature(model, lossfn, [DiagHessian()])(X, y)
        assert {k.split(".")[-1]: v for k, v in seen.items()} == expected, how


def test_reverse_over_reverse_where_no_forward_mode():
    """A node operation without forward mode (a Function with no ``jvp``): the products and
    the dense input block go reverse over reverse, exact."""
    model, lossfn, X, y = _problem(3, 2, 3, 3, 2, "no_jvp")
    check_hessian_diagonals(model, lossfn, X, y)


def test_asymmetric_reverse_mode_is_refused(monkeypatch):
    """A reverse-mode second derivative that is not symmetric (as ``weight_norm``'s kernel's in
    torch 2.13) is refused, not returned."""
    model, lossfn, X, y = _problem(3, 2, 3, 3, 2, "no_jvp")

    class Skewed(ProductNoJvp):
        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            return g * b, 2 * g * a  # the gradient of no function: ∂²/∂a∂b ≠ ∂²/∂b∂a

    monkeypatch.setattr(ProductNoJvp, "apply", Skewed.apply)
    with pytest.raises(CurvatureError, match="not symmetric"):
        curvature(model, lossfn, [DiagHessian(), BatchDiagHessian()])(X, y)


def test_too_many_products_are_refused_before_any_work():
    """A free block whose diagonal takes more products than the limit is refused at planning,
    naming the node and the parameter."""
    model, lossfn, X, y = _problem(1, 2, 3, 3, 2, "moe")
    with settings.override(max_free_block_products=2 * model.experts.gate_up[0].numel() - 1):
        with pytest.raises(CurvatureError, match="experts.*gate_up.*Hessian-vector products"):
            curvature(model, lossfn, [DiagHessian()])(X, y)
    with settings.override(max_free_block_products=2 * model.experts.gate_up[0].numel()):
        curvature(model, lossfn, [DiagHessian()])(X, y)
