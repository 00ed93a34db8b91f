"""The residual of a broadcasting product ``z = x ⊙ y`` of two graph tensors
(``curvlib._hessian.broadcast``): squeeze-excite's ``x [N, C, H, W] * s [N, C, 1, 1]``, a spatial
gate ``[N, 1, H, W]``, an outer product of a channel and a spatial factor. Per shared index it
is a matrix product's residual (inner size 1), never the dense ``(C·H·W + C)²`` matrix that was
refused for size on EfficientNet's blocks. DiagHessian and BatchDiagHessian equal ``torch.func``
Hessian diagonals."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from oracles.cases import DT
from oracles.checks import check_hessian_diagonals
from oracles.on_device import seeded

GATES = ["channel", "channel_left", "spatial", "outer"]


class Gated(nn.Module):
    """Conv -> a gate computed from its output (squeeze-excite style) -> product -> pool -> Linear."""

    def __init__(self, c: int, gate: str):
        super().__init__()
        self.gate = gate
        self.conv = nn.Conv2d(2, c, 3, padding=1)
        self.reduce, self.expand = nn.Conv2d(c, 2, 1), nn.Conv2d(2, c, 1)
        self.head = nn.Linear(c, 3)

    def forward(self, x):
        h = self.conv(x)
        s = torch.sigmoid(self.expand(torch.tanh(self.reduce(h.mean((2, 3), keepdim=True)))))  # [N, C, 1, 1]
        if self.gate == "channel":
            z = h * s
        elif self.gate == "channel_left":
            z = s * h
        elif self.gate == "spatial":
            z = h * torch.sigmoid(h.mean(1, keepdim=True))  # [N, C, H, W] * [N, 1, H, W]
        else:
            z = torch.tanh(h.mean(1, keepdim=True)) * s  # [N, 1, H, W] * [N, C, 1, 1]
        return self.head(z.mean((2, 3)))


@settings(max_examples=10, deadline=None)
@given(gate=st.sampled_from(GATES), n=st.integers(1, 3), c=st.integers(1, 4), hw=st.integers(1, 5),
       seed=st.integers(0, 50))
def test_broadcast_product_hessian_diagonals(gate, n, c, hw, seed):
    g = seeded(seed)
    torch.manual_seed(seed)
    X, y = torch.randn(n, 2, hw, hw, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)
    check_hessian_diagonals(Gated(c, gate).to(DT), nn.CrossEntropyLoss(), X, y)


@pytest.mark.parametrize("gate", ["channel", "outer"])
def test_squeeze_excite_on_a_large_feature_map_is_not_refused(gate):
    """``[2, 8, 28, 28] * [2, 8, 1, 1]``: dense, ``N·d² = 2 · 6280²`` was over the size limit."""
    g = seeded(3)
    torch.manual_seed(3)
    X, y = torch.randn(2, 2, 28, 28, generator=g, dtype=DT), torch.tensor([0, 2])
    start = time.perf_counter()
    check_hessian_diagonals(Gated(8, gate).to(DT), nn.CrossEntropyLoss(), X, y)
    assert time.perf_counter() - start < 120
