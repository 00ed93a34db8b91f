"""A convolution on heads merged into the batch dim (MViTv2's pooling of queries,
keys and values: a depthwise ``Conv2d`` on ``[N·H, C/H, h, w]``). These rules take no extra
leading dim, so the planner runs it by the generic rule on the merged rows
(:func:`curvlib._plan.merged_modules.batch_first_module`): exact per-sample quantities, where
it was refused before (its output's dim 0 is ``N·H``)."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from oracles.checks import check_first_order, check_second_order
from oracles.merged_heads import merge, split
from oracles.on_device import seeded

DT = torch.float64


class PooledHeads(nn.Module):
    """``[N, C, h, w]`` -> Conv2d -> heads merged into the batch (batch-major or head-major)
    ``[N·H, C/H, h, w]`` -> a depthwise strided Conv2d (the pooling) -> split
    back -> Tanh -> mean over positions -> Linear."""

    def __init__(self, heads: int, dim: int, head_major: bool):
        super().__init__()
        self.heads, self.head_major = heads, head_major
        self.proj = nn.Conv2d(3, dim, 1)
        self.pool = nn.Conv2d(dim // heads, dim // heads, 3, stride=2, padding=1, groups=dim // heads)
        self.act, self.head = nn.Tanh(), nn.Linear(dim, 2)

    def forward(self, x):
        n = x.shape[0]
        h = self.proj(x)
        h = merge(h.unflatten(1, (self.heads, -1)), self.head_major)
        h = self.pool(h)
        h = split(h, n, self.heads, self.head_major).flatten(1, 2)
        return self.head(self.act(h).mean((2, 3)))


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 3), heads=st.sampled_from([2, 3]), head_major=st.booleans(), seed=st.integers(0, 50))
def test_conv_on_heads_merged_into_the_batch_is_exact(n, heads, head_major, seed):
    g = seeded(seed)
    torch.manual_seed(seed)
    model = PooledHeads(heads, 2 * heads, head_major).to(DT)
    X, y = torch.randn(n, 3, 4, 4, generator=g, dtype=DT), torch.randn(n, 2, generator=g, dtype=DT)
    check_first_order(model, nn.MSELoss(), X, y)
    check_second_order(model, nn.MSELoss(), X, y, hmp=False, seed=seed)
