"""A recurrent layer on a batch merged with rows (timm's Sequencer: each image row of a
sample a sequence, ``[N·H, W, C]`` into a bidirectional LSTM). The planner splits the batch
off (:func:`curvlib._plan.batch_merges.split_merged_batches`), the rule runs the recurrence
on every row and its sites see a sample's rows as positions sharing the weight
(:func:`curvlib.rules.rnn._split_rows`). Before, curvlib failed inside (``'tuple' object has
no attribute 'shape'``). Oracles: float64 brute force (``torch.func``); KFLR with
``kfac_approx=None`` from its definition, ``B`` of the input projection being the exact GGN
block of its bias (every row and step a position) and ``A = (1/N) Σ x xᵀ`` over rows and
steps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import KFLR, BatchGrad, DiagHessian

from oracles.checks import check_first_order, check_second_order
from oracles.on_device import seeded
from oracles.second_order import ggn_per_sample

DT = torch.float64
KINDS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}


class RowRNN(nn.Module):
    """``[N, R, T, C]`` -> rows merged into the batch (sample-major ``n·R + r``, or row-major
    ``r·N + n``), ``[N·R, T, C]`` (or ``[T, N·R, C]``) -> recurrent layer -> back to
    ``[N, R, T, ·]`` -> a Linear head on the mean; ``states``: the final hidden states read too."""

    def __init__(self, kind: str, batch_first: bool, bidirectional: bool, row_major: bool, states: bool):
        super().__init__()
        self.batch_first, self.row_major, self.states, self.lstm = batch_first, row_major, states, kind == "lstm"
        self.rnn = KINDS[kind](3, 2, batch_first=batch_first, bidirectional=bidirectional)
        d = 2 if bidirectional else 1
        self.head = nn.Linear(2 * d + (2 if states else 0), 3)

    def forward(self, x):
        n, r, t, c = x.shape
        rows = (x.transpose(0, 1) if self.row_major else x).reshape(n * r, t, c)
        out, hidden = self.rnn(rows if self.batch_first else rows.transpose(0, 1))
        out = out if self.batch_first else out.transpose(0, 1)                      # [N·R, T, ·]
        out = out.reshape(r, n, t, -1).transpose(0, 1) if self.row_major else out.reshape(n, r, t, -1)
        feats = out.mean((1, 2))
        if self.states:
            h = hidden[0] if self.lstm else hidden                  # [D, N·R, H]
            h = h.reshape(h.shape[0], r, n, -1).transpose(1, 2) if self.row_major else h.reshape(h.shape[0], n, r, -1)
            feats = torch.cat([feats, h.mean((0, 2))], -1)
        return self.head(feats)


def _case(seed, n, kind, batch_first, bidirectional, row_major, states):
    torch.manual_seed(seed)
    model = RowRNN(kind, batch_first, bidirectional, row_major, states).to(DT).eval()
    gen = seeded(seed)
    X = torch.randn(n, 2, 3, 3, generator=gen, dtype=DT)
    y = torch.randint(0, 3, (n,), generator=gen)
    return model, nn.CrossEntropyLoss(), X, y


CASES = dict(seed=st.integers(0, 2**16), kind=st.sampled_from(sorted(KINDS)), batch_first=st.booleans(),
             bidirectional=st.booleans(), row_major=st.booleans(), states=st.just(False))


@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 3), **CASES)
def test_rnn_on_merged_rows_first_order(n, seed, kind, batch_first, bidirectional, row_major, states):
    check_first_order(*_case(seed, n, kind, batch_first, bidirectional, row_major, states))


@settings(max_examples=4, deadline=None)
@given(n=st.integers(2, 3), **CASES)
def test_rnn_on_merged_rows_ggn(n, seed, kind, batch_first, bidirectional, row_major, states):
    check_second_order(*_case(seed, n, kind, batch_first, bidirectional, row_major, states), hessian=False)


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), row_major=st.booleans(), batch_first=st.booleans())
def test_rnn_on_merged_rows_kflr(seed, row_major, batch_first):
    model, lossfn, X, y = _case(seed, 3, "lstm", batch_first, False, row_major, False)
    B, A = curvature(model, lossfn, [KFLR(kfac_approx=None)])(X, y)["kflr"]["rnn.weight_ih_l0"]
    G = ggn_per_sample(model, lossfn, X, y, "rnn.bias_ih_l0").sum(0)
    torch.testing.assert_close(B, G)
    x = X.reshape(-1, X.shape[-1])
    torch.testing.assert_close(A, x.t() @ x / X.shape[0])


def test_final_states_on_merged_rows_are_refused():
    """``h_n [L·D, N·R, H]`` read back: its merge (batch in dim 1) is one the sample-independence
    analysis does not follow, so it is refused by name, not failed inside."""
    model, lossfn, X, y = _case(0, 2, "lstm", True, False, False, True)
    with pytest.raises(CurvatureError, match="merged with another dim"):
        curvature(model, lossfn, [BatchGrad()])(X, y)


def test_hessian_on_merged_rows_is_refused():
    """The step nodes' residuals are recorded per row of the recurrence: refused by name."""
    model, lossfn, X, y = _case(0, 2, "lstm", True, False, False, False)
    with pytest.raises(CurvatureError, match="merged with rows|Hessian"):
        curvature(model, lossfn, [DiagHessian()])(X, y)
