"""Element-wise subgraphs recorded as one residual (``curvlib._hessian.pointwise``).

Random element-wise expressions of a Linear layer's output (unary functions, ``+ − × ÷``
of the expression's own values and of Python numbers: GPT-2's tanh GELU, ``x σ(1.702 x)``,
``x / (1 + x²)``), optionally with a value from inside the expression also used outside it
(then that value must stay a region's exit or input), on the symbolic trace and at the ATen
level (dict input). DiagHessian, BatchDiagHessian and PCHMP against ``torch.func`` Hessians;
and the plan holds one residual per region.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import curvature
from curvlib.extensions import BatchDiagHessian, DiagHessian
from curvlib._hessian.pointwise import PointwiseRegion
from curvlib._hessian.residuals import residual_plan
from curvlib._trace.program import trace_program

from oracles.cases import DT
from oracles.checks import check_hessian_diagonals, check_hessian_family
from oracles.on_device import seeded
from oracles.second_order import hessian_block, hessian_per_sample

UNARY = ["tanh", "sigmoid", "square", "cube", "sin", "neg", "scale", "shift", "rsub"]
BINARY = ["mul", "add", "sub", "div"]


def _unary(op: str, a):
    return {"tanh": lambda: torch.tanh(a), "sigmoid": lambda: torch.sigmoid(a), "square": lambda: a * a,
            "cube": lambda: torch.pow(a, 3.0), "sin": lambda: a.sin(), "neg": lambda: -a,
            "scale": lambda: 0.7 * a, "shift": lambda: a + 0.3, "rsub": lambda: 1.0 - a}[op]()


def _binary(op: str, a, b):
    if op == "div":
        return a / (1.0 + b * b)  # (a denominator away from zero)
    return {"mul": lambda: a * b, "add": lambda: a + b, "sub": lambda: a - b}[op]()


class Expression(nn.Module):
    """``Linear -> e(h) -> Linear``; ``leak``: the expression's value ``leak`` also reaches the
    output through a second Linear (it must not be inside a region)."""

    def __init__(self, steps, leak, width: int = 4):
        super().__init__()
        self.steps, self.leak = steps, leak
        self.inp, self.out = nn.Linear(3, width), nn.Linear(width, 2)
        self.side = nn.Linear(width, 2) if leak is not None else None

    def forward(self, x):
        values = [self.inp(x)]
        for op, i, j in self.steps:
            a, b = values[i % len(values)], values[j % len(values)]
            values.append(_binary(op, a, b) if op in BINARY else _unary(op, a))
        y = self.out(values[-1])
        if self.side is not None:
            y = y + self.side(values[self.leak % len(values)])
        return y


STEPS = st.lists(st.tuples(st.sampled_from(UNARY + BINARY), st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=7)


@settings(deadline=None, max_examples=30)
@given(steps=STEPS, leak=st.one_of(st.none(), st.integers(0, 9)), aten=st.booleans(), n=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_hessian_diagonals_of_element_wise_expressions(steps, leak, aten, n, seed):
    g = seeded(seed)
    torch.manual_seed(seed)
    model = Expression(steps, leak).to(DT)
    X = torch.randn(n, 3, generator=g, dtype=DT)
    y = torch.randint(0, 2, (n,), generator=g)
    if not aten:
        check_hessian_diagonals(model, nn.CrossEntropyLoss(), X, y)
        return
    # a dict input reaches forward as keywords, traced at the ATen level
    qs = curvature(model, nn.CrossEntropyLoss(), [DiagHessian(), BatchDiagHessian()])({"x": X}, y)
    for name, p in model.named_parameters():
        H = hessian_block(model, nn.CrossEntropyLoss(), X, y, name)
        Hn = hessian_per_sample(model, nn.CrossEntropyLoss(), X, y, name)
        torch.testing.assert_close(qs["diag_h"][name], H.diagonal().reshape(p.shape))
        torch.testing.assert_close(qs["diag_h_batch"][name], Hn.diagonal(dim1=1, dim2=2).reshape((n,) + tuple(p.shape)))


def test_tanh_gelu_hessian_family():
    """GPT-2's GELU written out: DiagHessian, BatchDiagHessian and PCHMP exact."""
    steps = _GELU_TANH
    g = seeded(0)
    model = Expression(steps, None).to(DT)
    X, y = torch.randn(3, 3, generator=g, dtype=DT), torch.randint(0, 2, (3,), generator=g)
    check_hessian_family(model, nn.CrossEntropyLoss(), X, y, exact_pchmp=False)


# 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))), the values indexed as Expression builds them
_GELU_TANH = [("cube", 0, 0), ("scale", 1, 0), ("add", 0, 2), ("scale", 3, 0), ("tanh", 4, 0),
              ("shift", 5, 0), ("scale", 0, 0), ("mul", 7, 6)]


class _Gelu(nn.Module):
    def __init__(self, leak: bool):
        super().__init__()
        self.inp, self.out, self.leak = nn.Linear(3, 4), nn.Linear(4, 2), leak

    def forward(self, x):
        h = self.inp(x)
        t = torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0)))
        z = 0.5 * h * (1.0 + t)
        return self.out(z) + (self.out(t) if self.leak else 0.0)


def _regions(model):
    program = trace_program(model, None)
    return [phi for kind, phi, _ in residual_plan(program).values() if isinstance(phi, PointwiseRegion)], program


def test_a_written_out_gelu_is_one_residual():
    regions, program = _regions(_Gelu(leak=False))
    assert len(regions) == 1 and len(residual_plan(program)) == 1
    assert regions[0].root == "inp"


class _Rational(nn.Module):
    """``h / (1 + h²) + σ(h)``: a quotient of two graph tensors inside the region."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h / (1.0 + h * h) + torch.sigmoid(h))


def test_a_quotient_is_inside_the_region():
    regions, program = _regions(_Rational())
    assert len(regions) == 1 and len(residual_plan(program)) == 1


def test_a_value_used_outside_ends_the_region():
    """``t`` (the tanh) also feeds the output: no region holds it but as its exit or root."""
    regions, program = _regions(_Gelu(leak=True))
    _check_regions(regions, program)
    assert all("tanh" not in r.nodes[:-1] for r in regions)


def _check_regions(regions, program):
    """Every region: its values but the exit's used only inside it, its graph inputs its own
    nodes and the root."""
    named = {n.name: n for n in program.graph.nodes}
    for r in regions:
        inside = {named[k] for k in r.nodes}
        assert r.root not in r.nodes
        for node in inside:
            assert all(a in inside or a.name == r.root for a in node.all_input_nodes)
            if node.name != r.nodes[-1]:
                assert all(u in inside for u in node.users)


@settings(deadline=None, max_examples=40)
@given(steps=STEPS, leak=st.one_of(st.none(), st.integers(0, 9)))
def test_regions_are_closed(steps, leak):
    regions, program = _regions(Expression(steps, leak))
    _check_regions(regions, program)


def test_a_tensor_constant_ends_the_region():
    """``h * c`` with a constant tensor could broadcast ``h`` to a larger shape: not in a region."""

    class WithConstant(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(3, 4)
            self.register_buffer("c", torch.ones(2, 1, 4))

        def forward(self, x):
            h = self.inp(x)
            return (torch.tanh(h) * self.c * torch.sigmoid(h)).sum(0)

    regions, _ = _regions(WithConstant())
    assert all("mul" not in r.nodes for r in regions)


class _RouterOnMergedRows(nn.Module):
    """A router on tokens merged across the batch (``[N·T, D]``, an MoE layer's), its scores an
    element-wise region of the router's output (``√softplus``, DeepSeek-V4's; ``σ(s)·tanh(s)``):
    the plan gives the router the batch as a dim of its own, and the region reads its output
    merged back."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.embed, self.router, self.head = nn.Linear(3, 4), nn.Linear(4, 5), nn.Linear(5, 2)

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        s = self.router(h.reshape(-1, h.shape[-1]))  # [N·T, 5]
        scores = torch.nn.functional.softplus(s).sqrt() if self.how == "softplus" else torch.sigmoid(s) * torch.tanh(s)
        return self.head(scores.reshape(h.shape[:-1] + (5,))).mean(1)


@settings(max_examples=6, deadline=None)
@given(how=st.sampled_from(["softplus", "gate"]), n=st.integers(1, 3), t=st.integers(1, 4), seed=st.integers(0, 50))
def test_a_region_on_rows_merged_across_the_batch(how, n, t, seed):
    g = seeded(seed)
    torch.manual_seed(seed)
    X, y = torch.randn(n, t, 3, generator=g, dtype=DT), torch.randint(0, 2, (n,), generator=g)
    check_hessian_diagonals(_RouterOnMergedRows(how).to(DT), nn.CrossEntropyLoss(), X, y)
