"""GGN diagonals read while columns are pulled back one at a time (the streamed read-off, CPU):
a Linear with one position per sample sums its columns' statistic ``Σ_v m_v²`` over the columns
and squares once (``Rule.column_statistic``). DiagGGNExact and BatchDiagGGNExact against the
float64 brute force, with the streamed path forced on and checked to be taken (the looped
strategy, which CUDA does not default to, pinned)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import curvature
from curvlib._core.settings import override
from curvlib._core.strategy import strategy
from curvlib._evaluate import second_order
from curvlib.extensions import BatchDiagGGNExact, DiagGGNExact

from oracles.on_device import seeded
from oracles.second_order import ggn_block, ggn_per_sample

DT = torch.float64


@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 4), c=st.integers(2, 5), seed=st.integers(0, 2**16))
def test_streamed_linear_diagonals(n, c, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, c)).to(DT)
    gen = seeded(seed)
    X, y = torch.randn(n, 3, generator=gen, dtype=DT), torch.randint(0, c, (n,), generator=gen)
    lossfn = nn.CrossEntropyLoss()
    taken = []
    original = second_order.column_statistic
    # (tiny sites: read as the backward reaches them)
    with override(stream_min_bytes=0), strategy("looped"), pytest.MonkeyPatch.context() as mp:
        mp.setattr(second_order, "column_statistic", lambda *a: taken.append(a) or original(*a))
        qs = curvature(model, lossfn, [DiagGGNExact(), BatchDiagGGNExact()])(X, y)
    assert taken, "the streamed read-off was not taken"
    for name, p in model.named_parameters():
        G = ggn_block(model, lossfn, X, y, name)
        torch.testing.assert_close(qs["diag_ggn_exact"][name], G.diagonal().reshape(p.shape))
        Gn = ggn_per_sample(model, lossfn, X, y, name)
        torch.testing.assert_close(qs["diag_ggn_exact_batch"][name],
                                   Gn.diagonal(dim1=1, dim2=2).reshape((n,) + tuple(p.shape)))
