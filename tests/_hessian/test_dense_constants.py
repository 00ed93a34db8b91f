"""A dense residual's node that also reads a value not computed from the model input, which
carries the batch all the same (``baddbmm(torch.zeros(N, T, S), q, kᵀ)`` in GPT-NeoX-Japanese's
attention, a buffer expanded to ``[N, ...]``): per sample, the node is evaluated on sample
``n``'s rows of that value, not on the whole batch's (which broadcasts the one-sample output
back to ``N`` rows and scales its residual by ``N``). The Hessian diagonals of such models
equal ``torch.func`` Hessians, on the symbolic trace and on the ATen-level one."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from oracles.cases import DT
from oracles.checks import check_hessian_diagonals
from oracles.on_device import seeded
from oracles.second_order import hessian_per_sample

#: dense nodes ``f(h, c)`` of an input-dependent ``h [N, T, D]`` and a constant ``c`` that
#: carries the batch (built from ``h``'s shape and a buffer, never from its values)
NODES = ["baddbmm", "atan2", "pow_base", "addcmul", "where"]


class ConstantInside(nn.Module):
    """``[N, T, 3]`` -> Linear -> ``f(h, c)`` -> Linear, ``c`` a buffer expanded to the batch."""

    def __init__(self, node: str, t: int, d: int = 4):
        super().__init__()
        self.node, self.d = node, d
        self.a, self.b = nn.Linear(3, 2 * d), nn.Linear(t if node == "baddbmm" else d, 2)
        # position-dependent, sample-independent (a position table): 0.5 ... 1.5
        self.register_buffer("table", torch.linspace(0.5, 1.5, t * d).reshape(t, d))

    def forward(self, x):
        q, k = self.a(x).split(self.d, -1)  # [N, T, D] each
        n, t, d = q.shape
        if self.node == "baddbmm":  # scores = zeros + q kᵀ / √d, the zeros made per batch
            base = torch.zeros(n, t, t, dtype=q.dtype, device=q.device) + self.table[:, :1].T
            h = torch.baddbmm(base, q, k.transpose(1, 2), beta=1.0, alpha=1 / math.sqrt(d)).softmax(-1)
        else:
            c = self.table.expand(n, t, d)
            if self.node == "atan2":
                h = torch.atan2(q * k, c)
            elif self.node == "pow_base":
                h = torch.pow(c, q)
            elif self.node == "addcmul":
                h = torch.addcmul(c, q, k.tanh(), value=0.5)
            else:
                h = torch.where(c > 1.0, q * k, c)
        return self.b(h)


class DictConstantInside(ConstantInside):
    """The same behind a dict input (the ATen-level front end)."""


@settings(max_examples=12, deadline=None)
@given(node=st.sampled_from(NODES), n=st.integers(1, 3), t=st.integers(1, 3), seed=st.integers(0, 50))
def test_hessian_diagonals_with_a_constant_that_carries_the_batch(node, n, t, seed):
    g = seeded(seed)
    torch.manual_seed(seed)
    X, y = torch.randn(n, t, 3, generator=g, dtype=DT), torch.randn(n, t, 2, generator=g, dtype=DT)
    check_hessian_diagonals(ConstantInside(node, t).to(DT), nn.MSELoss(), X, y)


@pytest.mark.parametrize("node", NODES)
def test_on_the_aten_trace(node):
    from curvlib import curvature
    from curvlib.extensions import BatchDiagHessian

    g = seeded(3)
    torch.manual_seed(3)
    X, y = torch.randn(3, 2, 3, generator=g, dtype=DT), torch.randn(3, 2, 2, generator=g, dtype=DT)
    model = DictConstantInside(node, 2).to(DT)
    qs = curvature(model, nn.MSELoss(), [BatchDiagHessian()])({"x": X}, y)
    for name, p in model.named_parameters():
        Hn = hessian_per_sample(model, nn.MSELoss(), X, y, name)
        torch.testing.assert_close(qs["diag_h_batch"][name], Hn.diagonal(dim1=1, dim2=2).reshape((3,) + tuple(p.shape)))


class FunctionalEmbedding(nn.Module):
    """``F.embedding(ids, W)`` on the module's own weight (I-BERT's quantised embedding), read as
    it is (affine in ``W``: no residual) or computed from it (``tanh(W)``: a dense residual over
    ``W`` whose per-sample function takes sample ``n``'s ids)."""

    def __init__(self, computed: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(7, 3, generator=seeded(1)))
        self.computed = computed
        self.out = nn.Linear(3, 2)

    def forward(self, ids):
        w = torch.tanh(self.weight) if self.computed else self.weight
        return self.out(torch.sigmoid(nn.functional.embedding(ids, w)))


@pytest.mark.parametrize("computed", [False, True])
def test_a_functional_embedding(computed):
    g = seeded(8)
    X = torch.randint(0, 7, (3, 4), generator=g)
    y = torch.randn(3, 4, 2, generator=g, dtype=DT)
    check_hessian_diagonals(FunctionalEmbedding(computed).to(DT), nn.MSELoss(), X, y)


class PositionsInPlace(nn.Module):
    """``h.add_(positions(arange(T)))`` (FNet's embeddings): affine in the table and in ``h``."""

    def __init__(self):
        super().__init__()
        self.a, self.positions, self.out = nn.Linear(3, 4), nn.Embedding(6, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        h.add_(self.positions(torch.arange(x.shape[1], device=x.device)))
        return self.out(torch.tanh(h))


def _only_the_activation_has_a_residual(model: nn.Module, seed: int) -> None:
    """``model`` (``[N, 5, 3] -> [N, 5, 2]``, one ``tanh``): planned with that one residual, and
    its Hessian diagonals equal ``torch.func`` Hessians."""
    from curvlib._hessian.residuals import residual_plan
    from curvlib._trace.program import trace_program

    kinds = [kind for kind, _, _ in residual_plan(trace_program(model)).values()]
    assert kinds == ["diag"], kinds
    g = seeded(seed)
    X, y = torch.randn(3, 5, 3, generator=g, dtype=DT), torch.randn(3, 5, 2, generator=g, dtype=DT)
    check_hessian_diagonals(model, nn.MSELoss(), X, y)


def test_positions_added_in_place_carry_no_residual():
    _only_the_activation_has_a_residual(PositionsInPlace().to(DT), seed=9)


class TableReadTwice(nn.Module):
    """One position table read at two index sets and summed (LayoutLM's ``x`` coordinates of a
    box's left and right edges): the sum is affine in the table, its input depends on the table."""

    def __init__(self):
        super().__init__()
        self.a, self.table, self.out = nn.Linear(3, 4), nn.Embedding(6, 4), nn.Linear(4, 2)

    def forward(self, x):
        t = x.shape[1]
        left, right = torch.arange(t, device=x.device), torch.arange(t, device=x.device).flip(0)
        return self.out(torch.tanh(self.a(x) + self.table(left) + self.table(right)))


def test_a_table_read_twice_carries_no_residual():
    _only_the_activation_has_a_residual(TableReadTwice().to(DT), seed=10)


class TableShapedLikeTheBatch(nn.Module):
    """A position table brought to the batch's shape before it is added: ``expand_as`` (FlauBERT)
    or ``permute``/``unsqueeze``/``expand(N, ...)``/``contiguous`` then ``add_`` (MPNet's relative
    attention bias): affine in the table, which now carries the batch."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.a, self.table, self.out = nn.Linear(3, 4), nn.Embedding(6, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        rows = self.table(torch.arange(x.shape[1], device=x.device))  # [T, 4]
        if self.how == "expand_as":
            return self.out(torch.tanh(h + rows.expand_as(h)))
        bias = torch.permute(rows, (1, 0)).unsqueeze(0).expand(x.shape[0], -1, -1).contiguous()  # [N, 4, T]
        return self.out(torch.tanh(h.add_(bias.transpose(1, 2))))


@pytest.mark.parametrize("how", ["expand_as", "expand"])
def test_a_table_shaped_like_the_batch_carries_no_residual(how):
    _only_the_activation_has_a_residual(TableShapedLikeTheBatch(how).to(DT), seed=11)


class StreamsConcatenated(nn.Module):
    """ProphetNet's predicting streams: ``cat([h, ngram[k] + pos(positions), ...])`` with the
    positions built per call (``[N, T]``: the sum carries the batch); the concatenation, and the
    sums its chain forms from the two tables, are affine in both."""

    def __init__(self):
        super().__init__()
        self.a, self.ngram, self.pos, self.out = nn.Linear(3, 4), nn.Embedding(2, 4), nn.Embedding(6, 4), nn.Linear(4, 2)

    def forward(self, x):
        n, t = x.shape[:2]
        p = self.pos(torch.arange(t, device=x.device).unsqueeze(0).expand(n, t))  # [N, T, 4]
        streams = [self.ngram.weight[k] + p for k in range(2)]
        h = torch.tanh(torch.cat([self.a(x)] + streams, dim=1))  # [N, 3T, 4]
        return self.out(h.reshape(n, 3, t, 4).sum(1))


def test_streams_concatenated_carry_no_residual():
    _only_the_activation_has_a_residual(StreamsConcatenated().to(DT), seed=12)
