"""``KFLR``/``KFAC(kfac_approx="expand" | "reduce")``: the two KFAC approximations of
Eschenhagen et al. (2023) for weights shared by several positions of a sample.

Oracle: the exact output-side factors from a per-position output offset ``δ``
(``B_expand = Σ_{n,s} J_{n,δ_s}ᵀ H_n J_{n,δ_s}``, ``B_reduce = Σ_n J_{n,Σδ}ᵀ H_n J_{n,Σδ}``)
and the layer's unfolded inputs; and curvlinops' ``KFACLinearOperator``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import KFAC, KFLR

from oracles.kron import input_factors, output_factors, shared_factors
from oracles.on_device import seeded

DT = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


class Seq(nn.Module):
    """A Linear layer on ``[N, T, D]`` (positions T), then mean pooling."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)).mean(1))


def convnet(conv, flat):
    return nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(flat, 3))


MODELS = {  # model, layer, input shape
    "linear_seq": (Seq, "inp", (5, 4, 3)),
    "conv1d": (lambda: convnet(nn.Conv1d(2, 3, 3, stride=2, padding=1), 12), "0", (5, 2, 7)),
    "conv2d": (lambda: convnet(nn.Conv2d(2, 3, 2, padding=1), 36), "0", (5, 2, 3, 2)),
    "conv_transpose2d": (lambda: convnet(nn.ConvTranspose2d(2, 3, 2, stride=2), 24), "0", (5, 2, 2, 1)),
}
LOSSES = {"ce": nn.CrossEntropyLoss(reduction="sum"), "mse": nn.MSELoss(reduction="sum")}


def _setup(kind, loss, seed=0):
    make, layer, shape = MODELS[kind]
    torch.manual_seed(seed)
    model = make().to(DT)
    X = torch.randn(shape, dtype=DT)
    y = torch.randint(0, 3, (shape[0],)) if loss == "ce" else torch.randn(shape[0], 3, dtype=DT)
    return model, layer, X, y


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_kflr_expand_and_reduce_match_oracle(kind, loss):
    model, layer, X, y = _setup(kind, loss)
    got = {a: curvature(model, LOSSES[loss], [KFLR(kfac_approx=a)])(X, y)["kflr"] for a in (None, "expand", "reduce")}
    B_expand, B_reduce = output_factors(model, LOSSES[loss], X, y, layer)
    A, A_expand, A_reduce = input_factors(model, X, layer)
    w, b = f"{layer}.weight", f"{layer}.bias"
    for approx, (B, Aw) in {None: (B_reduce, A), "expand": (B_expand, A_expand),
                            "reduce": (B_reduce, A_reduce)}.items():
        torch.testing.assert_close(got[approx][w][0], B)
        torch.testing.assert_close(got[approx][w][1], Aw)
        torch.testing.assert_close(got[approx][b][0], B)
    assert not torch.allclose(got["expand"][w][0], got["reduce"][w][0])
    assert not torch.allclose(got["expand"][w][1], got["reduce"][w][1])


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("kind", ["linear_seq", "conv2d"])
def test_kflr_matches_curvlinops(kind, loss, approx):
    curvlinops = pytest.importorskip("curvlinops")
    model, layer, X, y = _setup(kind, loss)
    got = curvature(model, LOSSES[loss], [KFLR(kfac_approx=approx)])(X, y)["kflr"]
    op = curvlinops.KFACLinearOperator(
        model, LOSSES[loss], list(model.parameters()), [(X, y)], fisher_type=curvlinops.FisherType.TYPE2,
        kfac_approx=approx, separate_weight_and_bias=True, check_deterministic=False,
    )
    op.compute_kronecker_factors()
    for name, _ in model.named_modules():
        if name in op._mapping:
            B, A = op._gradient_covariances[name], op._input_covariances[name]
            torch.testing.assert_close(got[f"{name}.weight"][0], B)
            torch.testing.assert_close(got[f"{name}.weight"][1], A)
            torch.testing.assert_close(got[f"{name}.bias"][0], B)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_kfac_samples_approach_kflr(approx):
    model, layer, X, y = _setup("conv2d", "ce")
    exact = curvature(model, LOSSES["ce"], [KFLR(kfac_approx=approx)])(X, y)["kflr"]
    mc = curvature(model, LOSSES["ce"], [KFAC(mc_samples=4000, kfac_approx=approx,
                                              generator=seeded(0))])(X, y)["kfac"]
    w = f"{layer}.weight"
    torch.testing.assert_close(mc[w][1], exact[w][1])  # A does not depend on the samples
    assert (mc[w][0] - exact[w][0]).norm() < 0.08 * exact[w][0].norm()


def test_kfac_approx_refusals():
    with pytest.raises(CurvatureError, match=r"KFLR\(kfac_approx='mean'\) is not supported; use None "
                       r"\(BackPACK's factors\) or one of \('expand', 'reduce'\)"):
        KFLR(kfac_approx="mean")
    with pytest.raises(CurvatureError, match=r"KFAC\(kfac_approx='sum'\)"):
        KFAC(kfac_approx="sum")



@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_kfac_approx_with_chunks(approx):
    """Column chunks and batch slices combine to the same factors (A is a batch mean for both)."""
    model, layer, X, y = _setup("linear_seq", "ce")
    ext = [KFLR(kfac_approx=approx)]
    whole = curvature(model, LOSSES["ce"], ext, chunk_size=None)(X, y)["kflr"]
    for kw in ({"chunk_size": 1}, {"batch_chunk_size": 2}):
        parts = curvature(model, LOSSES["ce"], ext, **kw)(X, y)["kflr"]
        for name in whole:
            for a, b in zip(parts[name], whole[name]):
                torch.testing.assert_close(a, b)


class Shared(nn.Module):
    """One Linear applied three times with different numbers of positions: on ``[N, T, D]``, on
    the mean over positions ``[N, D]`` and on the first ``K`` positions of its own output."""

    def __init__(self, k: int):
        super().__init__()
        self.lin, self.head, self.k = nn.Linear(3, 3), nn.Linear(3, 3), k

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        pooled = torch.tanh(self.lin(h.mean(1)))
        again = torch.tanh(self.lin(h[:, : self.k])).sum(1)
        return self.head(pooled * again)


@settings(max_examples=6, deadline=None)
@given(positions=st.integers(1, 4), k=st.integers(1, 4), loss=st.sampled_from(sorted(LOSSES)),
       seed=st.integers(0, 2**16))
@pytest.mark.parametrize("approx", [None, "expand", "reduce"])
def test_weight_applied_by_several_calls(approx, positions, k, loss, seed):
    """A weight applied by several calls: every call's positions are more positions sharing the
    weight (``S = Σ_u S_u``), for each approximation (oracle: per-(call, position) offsets)."""
    torch.manual_seed(seed)
    model = Shared(min(k, positions)).to(DT)
    X = torch.randn(4, positions, 3, dtype=DT)
    y = torch.randint(0, 3, (4,)) if loss == "ce" else torch.randn(4, 3, dtype=DT)
    got = curvature(model, LOSSES[loss], [KFLR(kfac_approx=approx)])(X, y)["kflr"]
    B, A = shared_factors(model, LOSSES[loss], X, y, model.lin, approx)
    torch.testing.assert_close(got["lin.weight"][0], B)
    torch.testing.assert_close(got["lin.weight"][1], A)
    torch.testing.assert_close(got["lin.bias"][0], B)
