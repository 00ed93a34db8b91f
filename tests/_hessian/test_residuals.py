"""Which graph nodes carry a Hessian residual (``curvlib._hessian.residuals``): ops that select,
split or regroup entries (``split_with_sizes``, ``tensor_split``, ``index_select``, ``gather``,
``take_along_dim``) are linear, tuple outputs included (``unique_consecutive`` on integers: in
the zoo's BART classifier); the Hessian diagonals of models using them equal ``torch.func`` Hessians,
on the symbolic trace and on the ATen-level one (a dict input sends the model there)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from oracles.cases import DT
from oracles.checks import check_hessian_diagonals, check_second_order
from oracles.on_device import seeded


def _pick(how: str, h, x):
    """``[N, 6]`` -> ``[N, 4]`` by a selecting op."""
    if how == "split_with_sizes":
        p, q = torch.split_with_sizes(h, [2, 4], 1)
        return torch.cat([q[:, :2] * 1.5, p], 1)
    if how == "tensor_split":
        p, _, r = torch.tensor_split(h, 3, 1)
        return torch.cat([r, p], 1)
    if how == "index_select":
        return h.index_select(1, torch.arange(h.shape[1] - 2) + 2)
    if how == "gather":
        return h.gather(1, (x[:, :1] > 0).long() + torch.arange(h.shape[1] - 2)[None])
    return torch.take_along_dim(h, (x[:, :1] > 0).long() * 2 + torch.arange(h.shape[1] - 2)[None], 1)


HOW = ["split_with_sizes", "tensor_split", "index_select", "gather", "take_along_dim"]


class Picked(nn.Module):
    """``[N, 3]`` -> Linear -> Tanh -> a selecting op -> Sigmoid -> Linear."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.a, self.act, self.out_act, self.b = nn.Linear(3, 6), nn.Tanh(), nn.Sigmoid(), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.out_act(_pick(self.how, self.act(self.a(x)), x)))


@settings(max_examples=8)
@given(how=st.sampled_from(HOW), n=st.integers(1, 4), seed=st.integers(0, 50))
def test_selecting_ops_have_no_residual_and_the_hessian_is_exact(how, n, seed):
    g = seeded(seed)
    X, y = torch.randn(n, 3, generator=g, dtype=DT), torch.randn(n, 2, generator=g, dtype=DT)
    model = Picked(how).to(DT)
    check_second_order(model, nn.MSELoss(), X, y, hmp=False, seed=seed)


class DictPicked(Picked):
    """The same behind a dict input (traced at the ATen level, where the ops stay ATen overloads)."""

    def forward(self, x):  # noqa: D102 - as Picked: X = {"x": ...} reaches it as a keyword (the ATen front end)
        return super().forward(x)


@pytest.mark.parametrize("how", HOW)
def test_selecting_ops_on_the_aten_trace(how):
    from curvlib import curvature
    from curvlib.extensions import BatchDiagHessian, DiagHessian
    from oracles.second_order import hessian_per_sample

    g = seeded(7)
    X, y = torch.randn(3, 3, generator=g, dtype=DT), torch.randn(3, 2, generator=g, dtype=DT)
    model = DictPicked(how).to(DT)
    qs = curvature(model, nn.MSELoss(), [DiagHessian(), BatchDiagHessian()])({"x": X}, y)
    plain = Picked(how).to(DT)
    plain.load_state_dict(model.state_dict())
    for name, p in plain.named_parameters():
        Hn = hessian_per_sample(plain, nn.MSELoss(), X, y, name)
        torch.testing.assert_close(qs["diag_h_batch"][name], Hn.diagonal(dim1=1, dim2=2).reshape((3,) + tuple(p.shape)))
