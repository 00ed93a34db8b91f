"""Operations piecewise linear in their floating-point arguments (for fixed integer and boolean
ones) have no Hessian residual: a mixture-of-experts router's ``topk``, ``where``/``masked_fill``
on masks, ``clamp``, ``maximum``, ``max``/``sort``/``cummax`` along a dim, scatter-adds of rows
back into place, ``tril``; FFTs are linear maps. They are planned as linear (no dense per-sample matrix, which for large
nodes was refused for size, and ``topk``'s tuple output was refused outright), and the Hessian
diagonals of models using them equal ``torch.func`` Hessians, on both front ends."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from oracles.cases import DT
from oracles.checks import check_hessian_diagonals
from oracles.on_device import seeded
from oracles.second_order import hessian_per_sample


def _op(how: str, h):
    """``[N, 6]`` -> ``[N, 6]`` by a piecewise-linear operation (values of two branches mixed)."""
    if how == "topk":  # a router: the top-3 scores in place, the others zero
        values, idx = torch.topk(h, 3, dim=-1)
        return torch.zeros_like(h).scatter_add(-1, idx, values)
    if how == "sort":
        return torch.sort(h, dim=-1, descending=True).values
    if how == "where":
        return torch.where(h > 0.1, h, 0.5 * h.flip(-1))
    if how == "masked_fill":
        return h.masked_fill(h < -0.2, 0.25)
    if how == "clamp":
        return h.clamp(-0.5, 0.4) + torch.clamp(h, min=h.roll(1, -1))
    if how == "maximum":
        return torch.maximum(h, h.flip(-1)) + h.abs()
    if how == "max":
        return h - h.max(dim=-1, keepdim=True).values + h.amax(-1, keepdim=True) * 0.5
    if how == "cummax":
        return torch.cummax(h, dim=-1).values
    if how == "index_add":
        return torch.zeros_like(h).index_add(1, torch.tensor([5, 4, 3, 2, 1, 0]), h)
    if how == "fft":  # FNet's token mixing: linear maps through complex values
        mixed = torch.fft.fftn(h.unflatten(-1, (2, 3)), dim=(1, 2))
        return torch.cat([mixed.real, torch.fft.rfft(h, dim=-1).imag[:, :1, None].expand(-1, 2, 1)], -1)[..., :3].flatten(1)
    return torch.tril(h.unflatten(-1, (2, 3)), diagonal=1).flatten(1)  # "tril"


HOW = ["topk", "sort", "where", "masked_fill", "clamp", "maximum", "max", "cummax", "index_add", "tril", "fft"]


class Routed(nn.Module):
    """``[N, 3]`` -> Linear -> Tanh -> a piecewise-linear operation -> Sigmoid -> Linear."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.a, self.act, self.out_act, self.b = nn.Linear(3, 6), nn.Tanh(), nn.Sigmoid(), nn.Linear(6, 2)

    def forward(self, x):
        return self.b(self.out_act(_op(self.how, self.act(self.a(x)))))


class DictRouted(Routed):
    """The same behind a dict input (the ATen-level front end)."""


@settings(max_examples=12, deadline=None)
@given(how=st.sampled_from(HOW), n=st.integers(1, 3), seed=st.integers(0, 50))
def test_hessian_diagonals_through_piecewise_linear_operations(how, n, seed):
    g = seeded(seed)
    torch.manual_seed(seed)
    X, y = torch.randn(n, 3, generator=g, dtype=DT), torch.randn(n, 2, generator=g, dtype=DT)
    check_hessian_diagonals(Routed(how).to(DT), nn.MSELoss(), X, y)


@pytest.mark.parametrize("how", HOW)
def test_they_carry_no_residual(how):
    from curvlib._hessian.residuals import residual_plan
    from curvlib._trace.program import trace_program

    program = trace_program(Routed(how).to(DT))
    kinds = sorted(kind for kind, _, _ in residual_plan(program, fuse=False).values())
    assert kinds == ["diag", "diag"], kinds  # the two activations only


@pytest.mark.parametrize("how", ["topk", "where", "clamp", "cummax", "fft"])
def test_on_the_aten_trace(how):
    from curvlib import curvature
    from curvlib.extensions import BatchDiagHessian

    g = seeded(5)
    torch.manual_seed(5)
    X, y = torch.randn(3, 3, generator=g, dtype=DT), torch.randn(3, 2, generator=g, dtype=DT)
    model = DictRouted(how).to(DT)
    qs = curvature(model, nn.MSELoss(), [BatchDiagHessian()])({"x": X}, y)
    for name, p in model.named_parameters():
        Hn = hessian_per_sample(model, nn.MSELoss(), X, y, name)
        torch.testing.assert_close(qs["diag_h_batch"][name], Hn.diagonal(dim1=1, dim2=2).reshape((3,) + tuple(p.shape)))
