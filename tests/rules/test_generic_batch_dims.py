"""Generic and functional sites with the batch in any dim of their inputs and output.

A sequence-first block (``[T, N, D]``: XLNet, ``nn.MultiheadAttention(batch_first=False)``), a
parameter used after a transpose, or an opaque module that moves the batch, is still a per-sample
layer: the planner finds each input's batch dim and the output's
(:func:`curvlib._plan.plan.saved_batch_dims`), and the generic rules run each sample as a batch
of one in the layer's own layout. Checked over drawn batch dims against the float64 brute force:
first order, the GGN family and block products, the Hessian diagonals, and KFLR's exact blocks
of the generic parameters.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import curvature
from curvlib.extensions import KFLR, BatchDiagHessian, DiagHessian

from oracles.checks import check_first_order, check_second_order
from oracles.on_device import seeded
from oracles.second_order import ggn_block, hessian_per_sample

DT = torch.float64


def _opaque(x):
    """A branch on tensor values: torch.fx cannot trace it, so the ATen front end runs."""
    return x * 1.0 if bool(x.abs().sum() >= 0) else x


class ScaleAfterMove(nn.Module):
    """``[N, T, D]`` -> the batch moved to dim ``bdim`` -> ``tanh(γ ⊙ h + β)`` (functional sites
    whose input and output carry the batch in ``bdim``) -> moved back -> a Linear head."""

    def __init__(self, bdim: int, aten: bool, d: int = 3, c: int = 3):
        super().__init__()
        self.bdim, self.aten = bdim, aten
        self.a, self.head = nn.Linear(d, 4), nn.Linear(4, c)
        self.gamma = nn.Parameter(torch.randn(4, generator=seeded(1), dtype=DT))
        self.beta = nn.Parameter(0.1 * torch.randn(4, generator=seeded(2), dtype=DT))

    def forward(self, x):
        x = _opaque(x) if self.aten else x
        h = self.a(x).unsqueeze(2).movedim(0, self.bdim)       # [.., N, ..] (4-D, batch in bdim)
        h = torch.tanh(h * self.gamma + self.beta)
        return self.head(h.movedim(self.bdim, 0).sum((1, 2)))


class MovesBatch(nn.Module):
    """An opaque parametrized module: input with the batch in ``dim_in``, output in ``dim_out``
    (a generic site whose input and output layouts differ)."""

    def __init__(self, dim_in: int, dim_out: int, d: int = 4):
        super().__init__()
        self.dim_in, self.dim_out = dim_in, dim_out
        self.w = nn.Parameter(torch.randn(d, d, generator=seeded(3), dtype=DT) / d)

    def forward(self, h):
        h = _opaque(h)
        return torch.tanh(h @ self.w).movedim(self.dim_in, self.dim_out)


class GenericNet(nn.Module):
    def __init__(self, dim_in: int, dim_out: int, d: int = 3, c: int = 3):
        super().__init__()
        self.dim_in, self.dim_out = dim_in, dim_out
        self.a, self.mid, self.head = nn.Linear(d, 4), MovesBatch(dim_in, dim_out), nn.Linear(4, c)

    def forward(self, x):
        h = self.mid(self.a(x).unsqueeze(2).movedim(0, self.dim_in))  # 4-D, the batch in dim_in
        return self.head(h.movedim(self.dim_out, 0).sum((1, 2)))


class _LearnedQuery(nn.Module):
    """``inp`` Linear, a learned ``[1, 1, E]`` token ``tok``, ``nn.MultiheadAttention`` with the
    batch first or not, a ``head``; the subclass's forward says how the token queries."""

    batch_first = True

    def __init__(self, aten: bool, e: int = 4, heads: int = 2, c: int = 3, seed: int = 4):
        super().__init__()
        self.aten = aten
        self.inp = nn.Linear(3, e)
        self.tok = nn.Parameter(torch.randn(1, 1, e, generator=seeded(seed), dtype=DT))
        self.attn = nn.MultiheadAttention(e, heads, batch_first=self.batch_first, dtype=DT)
        self.head = nn.Linear(e, c)


class SequenceFirstAttention(_LearnedQuery):
    """``nn.MultiheadAttention(batch_first=False)`` on ``[T, N, E]``, with a learned query token
    concatenated in front (a parameter chain expanded to the batch: ``tok.expand(1, N, E)``)."""

    batch_first = False

    def forward(self, x):
        x = _opaque(x) if self.aten else x
        h = self.inp(x).transpose(0, 1)                                   # [T, N, E]
        h = torch.cat([self.tok.expand(1, h.shape[1], -1), h], 0)         # [1 + T, N, E]
        out = self.attn(h, h, h)[0]  # (need_weights: the math path, twice differentiable)
        return self.head(torch.tanh(out[0]))


class PooledByProbe(_LearnedQuery):
    """SigLIP's pooling head: a learned probe (``tok``) repeated to the batch queries the sequence
    (``nn.MultiheadAttention(batch_first=True)``; on the ATen front end its heads are merged with
    the batch into dim 0 of a ``bmm`` whose query is a parameter chain)."""

    def __init__(self, aten: bool):
        super().__init__(aten, seed=5)

    def forward(self, x):
        x = _opaque(x) if self.aten else x
        h = self.inp(x)
        q = self.tok.repeat(h.shape[0], 1, 1)
        return self.head(torch.tanh(self.attn(q, h, h)[0][:, 0]))


def _data(seed: int, n: int, t: int = 3):
    gen = seeded(seed)
    return torch.randn(n, t, 3, generator=gen, dtype=DT), torch.randint(0, 3, (n,), generator=gen)


def _models(kind: str, a: int, b: int, aten: bool) -> nn.Module:
    if kind == "scale":
        return ScaleAfterMove(a, aten)
    if kind == "generic":
        return GenericNet(a, b)
    if kind == "attention":
        return SequenceFirstAttention(aten)
    return PooledByProbe(aten)


ALL_KINDS = ["scale", "generic", "attention", "probe"]  # every kind on both front ends (not drawn: CI's profile may skip one)


@pytest.mark.parametrize("aten", [False, True])
@pytest.mark.parametrize("kind", ALL_KINDS)
@settings(max_examples=3, deadline=None)
@given(a=st.integers(0, 2), b=st.integers(0, 2), n=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_first_order(kind, a, b, aten, n, seed):
    torch.manual_seed(seed)
    X, y = _data(seed, n)
    check_first_order(_models(kind, a, b, aten).to(DT), nn.CrossEntropyLoss(), X, y)


@pytest.mark.parametrize("aten", [False, True])
@pytest.mark.parametrize("kind", ALL_KINDS)
@settings(max_examples=2, deadline=None)
@given(a=st.integers(0, 2), b=st.integers(0, 2), n=st.integers(2, 3),
       seed=st.integers(0, 2**16))
def test_second_order(kind, a, b, aten, n, seed):
    """The GGN family and block products (GGNMP, HMP), and the Hessian diagonals, whole and per
    sample, against ``torch.func`` Hessians."""
    torch.manual_seed(seed)
    X, y = _data(seed, n)
    model, lossfn = _models(kind, a, b, aten).to(DT), nn.CrossEntropyLoss()
    check_second_order(model, lossfn, X, y, hessian=False, hmp=True)
    qs = curvature(model, lossfn, [DiagHessian(), BatchDiagHessian()])(X, y)
    for name, p in model.named_parameters():
        want = hessian_per_sample(model, lossfn, X, y, name).diagonal(dim1=1, dim2=2)
        torch.testing.assert_close(qs["diag_h_batch"][name], want.reshape((n,) + p.shape), rtol=1e-7, atol=1e-10)
        torch.testing.assert_close(qs["diag_h"][name], want.sum(0).reshape(p.shape), rtol=1e-7, atol=1e-10)


@settings(max_examples=6, deadline=None)
@given(kind=st.sampled_from(["scale", "generic"]), a=st.integers(1, 2), b=st.integers(0, 2), n=st.integers(2, 3),
       seed=st.integers(0, 2**16))
def test_kflr_blocks_of_generic_parameters(kind, a, b, n, seed):
    """KFLR of a generic parameter is its exact GGN block (a 1-D one: ``[G]``), its diagonal
    for ``≥ 2`` dims (``[diag G]``), whatever the dims carrying the batch."""
    torch.manual_seed(seed)
    X, y = _data(seed, n)
    model, lossfn = _models(kind, a, b, False).to(DT), nn.CrossEntropyLoss()
    got = curvature(model, lossfn, [KFLR()])(X, y)["kflr"]
    for name in ("gamma", "beta") if kind == "scale" else ("mid.w",):
        G = ggn_block(model, lossfn, X, y, name)
        (factor,) = got[name]
        want = G if factor.dim() == 2 else G.diagonal()
        torch.testing.assert_close(factor.reshape(want.shape), want, rtol=1e-7, atol=1e-10, msg=name)


class Positions(nn.Module):
    """Token embedding plus learned positions ``pos [T, D]``, batch first or sequence first
    (``h [T, N, D] + pos[:, None]``): the same function of the parameters."""

    def __init__(self, sequence_first: bool, v: int = 5, d: int = 3, t: int = 3):
        super().__init__()
        self.sequence_first = sequence_first
        self.tok, self.out = nn.Embedding(v, d), nn.Linear(d, 3)
        self.pos = nn.Parameter(torch.randn(t, d, generator=seeded(6)))

    def forward(self, x):
        h = self.tok(x)
        if self.sequence_first:
            h = torch.tanh(h.transpose(0, 1) + self.pos[:, None]).transpose(0, 1)
        else:
            h = torch.tanh(h + self.pos)
        return self.out(h.mean(1))


@settings(max_examples=4, deadline=None)
@given(n=st.integers(1, 3), approx=st.sampled_from([None, "expand"]), seed=st.integers(0, 2**16))
def test_positions_sequence_first_keep_their_factors(n, approx, seed):
    """Learned positions added to a sequence-first ``[T, N, D]`` get the embedding layout
    ``[A [R], B [D, D]]`` (rows read off the op in its own layout), equal to those of the same
    model batch first (checked against their definitions in ``test_kron_fixed_rows``)."""
    X, y = torch.randint(0, 5, (n, 3), generator=seeded(seed)), torch.randint(0, 3, (n,), generator=seeded(seed + 1))
    got = {}
    for sequence_first in (False, True):
        torch.manual_seed(seed)
        model = Positions(sequence_first).to(DT)
        got[sequence_first] = curvature(model, nn.CrossEntropyLoss(), [KFLR(kfac_approx=approx)])(X, y)["kflr"]
    for name, factors in got[False].items():
        assert len(got[True][name]) == len(factors), name
        for a, b in zip(got[True][name], factors):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)
