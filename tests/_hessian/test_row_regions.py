"""Row regions (``curvlib._hessian.pointwise.RowRegion``): a normalisation written out in
primitives, recorded as one residual with a ``[D, D]`` block per row.

RMSNorm as Llama writes it (``x * rsqrt(x.pow(2).mean(-1, keepdim=True) + ε) * w``), a
LayerNorm written out (``sum`` and ``mean`` over the last axis), the norm on a tensor with the
batch in a later dim and on 4-d heads (q/k norms): DiagHessian and BatchDiagHessian against
``torch.func`` Hessians in float64, on the symbolic trace and at the ATen level; PCHMP against
the modified blocks; and the plan holds one residual per norm.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from curvlib import curvature
from curvlib.extensions import BatchDiagHessian, DiagHessian
from curvlib._hessian.pointwise import RowRegion
from curvlib._hessian.residuals import residual_plan
from curvlib._trace.program import trace_program

from oracles.cases import DT
from oracles.checks import check_hessian_diagonals, check_hessian_family
from oracles.on_device import seeded
from oracles.second_order import hessian_block, hessian_per_sample


def rms_norm(x, w, eps=1e-2):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def layer_norm(x, w):
    c = x - x.sum(-1, keepdim=True) / x.shape[-1]
    return c / torch.sqrt((c * c).mean(-1, keepdim=True) + 0.1) * w


class Normed(nn.Module):
    """``Linear -> tanh -> Linear -> norm -> tanh -> Linear`` on ``[N, T, D]`` (the first
    Linear's diagonal sees the blocks' off-diagonal entries; ``heads``: the norm on
    ``[N, T, 2, D/2]``; ``late``: the batch in dim 1 of the norm's input)."""

    def __init__(self, norm=rms_norm, heads: bool = False, late: bool = False, d: int = 4):
        super().__init__()
        self.norm, self.heads, self.late = norm, heads, late
        self.pre, self.inp, self.out = nn.Linear(3, 3), nn.Linear(3, d), nn.Linear(d, 2)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, d // 2 if heads else d))

    def forward(self, x):
        h = self.inp(torch.tanh(self.pre(x)))  # [N, T, D]
        if self.heads:
            h = self.norm(h.reshape(h.shape[0], h.shape[1], 2, -1), self.w).reshape(h.shape)
        elif self.late:
            h = self.norm(h.transpose(0, 1), self.w).transpose(0, 1)
        else:
            h = self.norm(h, self.w)
        return self.out(torch.tanh(h)).sum(1)


def _data(n=3, seed=0):
    g = seeded(seed)
    return torch.randn(n, 2, 3, generator=g, dtype=DT), torch.randint(0, 2, (n,), generator=g)


@pytest.mark.parametrize("norm", [rms_norm, layer_norm])
@pytest.mark.parametrize("layout", ["plain", "heads", "late"])
def test_hessian_diagonals_through_a_written_out_norm(norm, layout):
    torch.manual_seed(0)
    model = Normed(norm, heads=layout == "heads", late=layout == "late").to(DT)
    X, y = _data()
    check_hessian_diagonals(model, nn.CrossEntropyLoss(), X, y)


def test_hessian_diagonals_at_the_aten_level():
    """A dict input reaches forward as keywords: traced at the ATen level."""
    torch.manual_seed(1)
    model = Normed().to(DT)
    X, y = _data(n=2, seed=1)

    class Keywords(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return self.m(x)

    wrapped = Keywords()
    qs = curvature(wrapped, nn.CrossEntropyLoss(), [DiagHessian(), BatchDiagHessian()])({"x": X}, y)
    for name, p in wrapped.named_parameters():
        H = hessian_block(wrapped, nn.CrossEntropyLoss(), X, y, name)
        Hn = hessian_per_sample(wrapped, nn.CrossEntropyLoss(), X, y, name)
        torch.testing.assert_close(qs["diag_h"][name], H.diagonal().reshape(p.shape))
        torch.testing.assert_close(qs["diag_h_batch"][name],
                                   Hn.diagonal(dim1=1, dim2=2).reshape((2,) + tuple(p.shape)))


def test_hessian_family_through_rms_norm():
    torch.manual_seed(2)
    model = Normed().to(DT)
    X, y = _data(seed=2)
    check_hessian_family(model, nn.CrossEntropyLoss(), X, y, exact_pchmp=False)


def test_a_written_out_rms_norm_is_one_residual():
    program = trace_program(Normed(), None)
    plan = residual_plan(program)
    regions = [phi for kind, phi, _ in plan.values() if kind == "row_region"]
    assert len(regions) == 1 and isinstance(regions[0], RowRegion)
    assert regions[0].root == "inp" and [k for k, _, _ in plan.values()].count("row_region") == 1


def test_a_reduction_over_another_axis_is_no_row_region():
    """``mean(0)``/``mean(-2)``: not a row of the last axis; no row region holds it."""

    def over_tokens(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-2, keepdim=True) + 1e-2) * w

    program = trace_program(Normed(over_tokens), None)
    assert not any(k == "row_region" for k, _, _ in residual_plan(program).values())
    torch.manual_seed(3)
    model = Normed(over_tokens).to(DT)
    X, y = _data(seed=3)
    check_hessian_diagonals(model, nn.CrossEntropyLoss(), X, y)


def test_a_parameter_scaling_an_input_has_no_residual():
    """``weight * x`` (the norm's scale) is linear in each apart: no residual recorded."""
    program = trace_program(Normed(), None)
    scaled = [n for n in program.graph.nodes if n.op == "call_function" and n.name == "mul_1"]
    assert scaled and scaled[0] not in residual_plan(program)


class Squared(nn.Module):
    """``w * (w * h)``: the outer product's input depends on ``w`` (coupled: its residual stays)."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(3, 4), nn.Linear(4, 2)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        return self.out(torch.tanh(self.w * (self.w * self.inp(x)))).sum(1)


def test_a_parameter_scaling_an_input_that_depends_on_it():
    torch.manual_seed(4)
    model = Squared().to(DT)
    X, y = _data(seed=4)
    check_hessian_diagonals(model, nn.CrossEntropyLoss(), X, y)


class Float32Softmax(nn.Module):
    """Attention-like weights as Llama computes them: ``softmax(..., dtype=float32)`` in a float64 model."""

    def __init__(self):
        super().__init__()
        self.pre, self.inp, self.out = nn.Linear(3, 3), nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.inp(torch.tanh(self.pre(x)))
        return self.out(torch.softmax(h, -1, dtype=torch.float32).to(h.dtype) * h).sum(1)


def test_a_softmax_in_float32_is_recorded_by_rows(monkeypatch):
    """Its rows' closed form, not a dense per-sample Hessian; within float32's rounding of the
    float64 ``torch.func`` Hessians."""
    from curvlib._hessian import algebra

    def refuse(res, g):
        raise AssertionError(f"dense residual at {res.where}")

    torch.manual_seed(5)
    model = Float32Softmax().to(DT)
    X, y = _data(seed=5)
    monkeypatch.setattr(algebra, "_dense_columns", refuse)
    qs = curvature(model, nn.CrossEntropyLoss(), [DiagHessian(), BatchDiagHessian()])(X, y)
    for name, p in model.named_parameters():
        H = hessian_block(model, nn.CrossEntropyLoss(), X, y, name)
        Hn = hessian_per_sample(model, nn.CrossEntropyLoss(), X, y, name)
        assert qs["diag_h"][name].dtype == DT
        torch.testing.assert_close(qs["diag_h"][name], H.diagonal().reshape(p.shape), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(qs["diag_h_batch"][name], Hn.diagonal(dim1=1, dim2=2).reshape((3,) + tuple(p.shape)),
                                   rtol=1e-4, atol=1e-6)
