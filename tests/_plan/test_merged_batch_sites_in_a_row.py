"""Two ops on parameters in a row on rows merged with the batch (Swin V2's window attention:
scores ``[N·W, S, S]`` scaled by ``exp(τ)``, then a bias computed from parameters added).
The planner splits the batch off each of them (:func:`curvlib._plan.batch_merges.split_merged_batches`);
the second must recompute per sample from the first one's value as merged back, not from the
node that value replaced (that was a KeyError inside curvlib)."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from oracles.checks import check_first_order, check_second_order
from oracles.on_device import seeded

DT = torch.float64


class ScaledBiasedScores(nn.Module):
    """``[N, W·S, C]`` -> windows ``[N·W, S, C]`` -> ``tanh((q kᵀ) · exp(τ) + mlp(coords))``
    -> a Linear head on the mean."""

    def __init__(self, windows: int, size: int, dim: int, window_major: bool):
        super().__init__()
        self.windows, self.size, self.window_major = windows, size, window_major
        self.qk = nn.Linear(dim, 2 * dim)
        self.tau = nn.Parameter(0.1 * torch.randn(1, 1))
        self.register_buffer("coords", torch.randn(size, size, 2))
        self.meta = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
        self.proj = nn.Linear(size, dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        n, c = x.shape[0], x.shape[-1]
        w = x.reshape(n, self.windows, self.size, c)
        w = w.transpose(0, 1).reshape(-1, self.size, c) if self.window_major else w.reshape(-1, self.size, c)
        q, k = self.qk(w).chunk(2, dim=-1)
        scores = (q @ k.transpose(1, 2)) * self.tau.exp()
        scores = torch.tanh(scores + self.meta(self.coords).squeeze(-1))   # [N·W, S, S]
        h = self.proj(scores)
        if self.window_major:
            h = h.reshape(self.windows, n, self.size, -1).transpose(0, 1)
        return self.head(h.reshape(n, -1, h.shape[-1]).mean(1))


def _case(seed: int, n: int, windows: int, window_major: bool):
    torch.manual_seed(seed)
    model = ScaledBiasedScores(windows, size=3, dim=4, window_major=window_major).to(DT).eval()
    gen = seeded(seed)
    X = torch.randn(n, windows * 3, 4, generator=gen, dtype=DT)
    y = torch.randint(0, 3, (n,), generator=gen)
    return model, nn.CrossEntropyLoss(), X, y


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 3), windows=st.integers(2, 3), window_major=st.booleans())
def test_scaled_then_biased_scores_first_order(seed, n, windows, window_major):
    check_first_order(*_case(seed, n, windows, window_major))


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 3), window_major=st.booleans())
def test_scaled_then_biased_scores_second_order(seed, n, window_major):
    check_second_order(*_case(seed, n, 2, window_major), hessian=False)
