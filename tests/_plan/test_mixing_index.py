"""Indexing along the batch dim, decided on values (``curvlib._plan.mixing_index``).

* every way of keeping each sample's own rows (``arange(N)`` from ``x.shape[0]`` or ``size(0)``,
  broadcast beside per-sample positions, ``gather``/``take_along_dim`` along the sequence,
  ``index_select`` with ``arange``, boolean masks with one or ``k`` hits per sample, built from
  constants or from the input's values) equals the float64 per-sample oracle: first order,
  the GGN family, the Hessian diagonals and KFLR;
* indexing that reads other samples' rows (a constant or an input-dependent permutation,
  also one that fixes the first and last sample) is refused naming the node; an index that
  depends on the input is tested on every call.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature, extensions as E

from oracles.cases import DT
from oracles.checks import check_first_order, check_second_order
from oracles.on_device import seeded
from oracles.second_order import kron_reference


def _last(x):
    """Per sample: the last position whose first feature is positive (at least 0): its own data."""
    return (x[..., 0] > 0).sum(1).clamp(min=1) - 1


def _mid_swap(n: int):
    """A permutation that keeps the first and the last sample (the numeric leak test's samples)."""
    idx = torch.arange(n)
    return torch.cat([idx[:1], idx[1:3].flip(0), idx[3:]])


# how -> function of (h [N, T, 4], x [N, T, 3]) -> [N, 4]
KEEP = {
    "arange_shape": lambda h, x: h[torch.arange(x.shape[0]), _last(x)],
    "arange_size": lambda h, x: h[torch.arange(h.size(0)), _last(x)],
    "arange_int": lambda h, x: h[torch.arange(h.shape[0]), -1],
    "broadcast": lambda h, x: h[torch.arange(h.shape[0])[:, None], torch.stack([_last(x), _last(x) * 0], 1)].sum(1),
    "gather": lambda h, x: h.gather(1, _last(x)[:, None, None].expand(-1, 1, 4)).squeeze(1),
    "take_along_dim": lambda h, x: torch.take_along_dim(h, _last(x)[:, None, None], 1).squeeze(1),
    "index_select": lambda h, x: h.index_select(0, torch.arange(h.shape[0]))[:, 0],
    "mask_data_one": lambda h, x: h[torch.arange(h.shape[1])[None] == _last(x)[:, None]],
    "mask_const_k": lambda h, x: h[torch.arange(h.shape[1]).expand(h.shape[0], -1) >= h.shape[1] - 2]
    .view(h.shape[0], 2, 4).sum(1),
    "mask_eos": lambda h, x: h[x[..., 1] == x[..., 1].amax(1, keepdim=True)].view(h.shape[0], -1, 4)[:, -1],
}

MIX = {
    "perm_const": (lambda h, x: h[torch.arange(h.shape[0]).roll(1), -1], "indexes the batch dim 0 with a tensor"),
    "perm_middle": (lambda h, x: h[_mid_swap(h.shape[0]), _last(x)], "indexes the batch dim 0 with a tensor"),
    "perm_data": (lambda h, x: h[x[:, 0, 0].argsort(descending=True), -1], "depends on the input's values"),
    "index_select_perm": (lambda h, x: h.index_select(0, _mid_swap(h.shape[0]))[:, 0], "index_select along"),
    "gather_batch": (lambda h, x: h.gather(0, torch.zeros_like(h[:, :1], dtype=torch.long)).squeeze(1),
                     "Tensor.gather along the batch dim 0"),
}


class Pool(nn.Module):
    """``[N, T, 3]`` -> Linear -> Tanh -> ``pick`` -> Linear: one row per sample picked by indexing."""

    def __init__(self, pick):
        super().__init__()
        self.a, self.act, self.b, self.pick = nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), pick

    def forward(self, x):
        return self.b(self.pick(self.act(self.a(x)), x))


def _data(seed: int, n: int, t: int):
    g = seeded(seed)
    return torch.randn(n, t, 3, generator=g, dtype=DT), torch.randn(n, 2, generator=g, dtype=DT)


def check_kflr(model, X, y):
    """KFLR runs; the factors of ``b`` (2-D input, where the oracle applies) equal the oracle's."""
    qs = curvature(model, nn.MSELoss(), [E.KFLR()])(X, y)
    assert all(bool(f.isfinite().all()) for fs in qs["kflr"].values() for f in fs)
    for name, role in (("b.weight", "weight"), ("b.bias", "bias")):
        for got, want in zip(qs["kflr"][name], kron_reference(model, nn.MSELoss(), X, y, "b", role), strict=True):
            torch.testing.assert_close(got, want)


@settings(max_examples=10)
@given(how=st.sampled_from(sorted(KEEP)), n=st.integers(2, 5), t=st.integers(2, 5), seed=st.integers(0, 50))
def test_indexing_that_keeps_samples_apart_is_exact(how, n, t, seed):
    X, y = _data(seed, n, t)
    model = Pool(KEEP[how]).to(DT)
    check_first_order(model, nn.MSELoss(), X, y)
    check_second_order(model, nn.MSELoss(), X, y, hmp=False, seed=seed)
    check_kflr(model, X, y)


@pytest.mark.parametrize("how", sorted(MIX))
def test_indexing_across_samples_is_refused(how):
    pick, match = MIX[how]
    X, y = _data(1, 5, 4)
    with pytest.raises(CurvatureError, match=r"Samples are mixed inside the model: graph node .*" + match):
        curvature(Pool(pick).to(DT), nn.MSELoss(), [E.BatchGrad()])(X, y)


def test_input_dependent_index_is_tested_on_every_call():
    """The same input signature: sorted samples (the identity) pass, the next call's shuffled ones are refused."""
    X, y = _data(2, 5, 4)
    X = X[X[:, 0, 0].argsort()]
    f = curvature(Pool(lambda h, x: h[x[:, 0, 0].argsort(), -1]).to(DT), nn.MSELoss(), [E.BatchGrad()])
    f(X, y)
    with pytest.raises(CurvatureError, match="reads rows of other samples .* on this input"):
        f(X.flip(0), y)


class WrittenMask(nn.Module):
    """Longformer's global attention: ``m = zeros_like(x[..., 0])``, ``m[:, 0] = 1`` written in
    place, then ``h[m.nonzero(as_tuple=True)]`` picks each sample's first token (``flip``:
    the sample indices reversed, other samples' tokens). The index's value is the write's, not
    the ``zeros_like``'s."""

    def __init__(self, aten: bool, flip: bool = False):
        super().__init__()
        self.a, self.b, self.aten, self.flip = nn.Linear(3, 4), nn.Linear(4, 2), aten, flip

    def forward(self, x):
        if self.aten and bool(x.abs().sum() >= 0):  # a branch on values: the ATen front end
            x = x + 0
        h = torch.tanh(self.a(x))
        m = torch.zeros_like(x[..., 0])
        m[:, 0] = 1
        i, j = m.nonzero(as_tuple=True)
        return self.b(h[i.flip(0) if self.flip else i, j])


@pytest.mark.parametrize("aten", [False, True])
def test_index_from_a_mask_written_in_place(aten):
    g = seeded(6)
    X, y = torch.randn(3, 4, 3, generator=g, dtype=DT), torch.randn(3, 2, generator=g, dtype=DT)
    check_first_order(WrittenMask(aten).to(DT), nn.MSELoss(), X, y)
    with pytest.raises(CurvatureError, match="Samples are mixed"):
        curvature(WrittenMask(aten, flip=True).to(DT), nn.MSELoss(), [E.BatchGrad()])(X, y)
