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

from curvlib._core.site import Residual

from oracles.cases import DT
from oracles.checks import check_hessian_diagonals, curvlib_blocks
from oracles.on_device import seeded
from oracles.pchmp import assert_blocks_close, pchmp_blocks
from oracles.residuals import check_residual

@settings(deadline=None, max_examples=25)
@given(n=st.integers(1, 3), sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       pattern=st.lists(st.sampled_from(["both", "x", "y"]), min_size=3, max_size=3), bdim=st.integers(0, 3),
       seed=st.integers(0, 2**16))
def test_broadcast_residual_against_the_dense_one(n, sizes, pattern, bdim, seed):
    """Signed columns and PCHMP operators of ``x ⊙ y`` for any broadcast pattern (per dim: both
    factors span it, only ``x``, only ``y``), batch in any dim, against ``torch.func.hessian``."""
    torch.manual_seed(seed)
    shape_x = [s if p in ("both", "x") else 1 for s, p in zip(sizes, pattern)]
    shape_y = [s if p in ("both", "y") else 1 for s, p in zip(sizes, pattern)]
    bdim = bdim % (len(sizes) + 1)
    x = torch.randn([n] + shape_x, dtype=DT).movedim(0, bdim)
    y = torch.randn([n] + shape_y, dtype=DT).movedim(0, bdim)
    g = torch.randn((x * y).shape, dtype=DT)
    res = Residual("mul", "broadcast", None, [x, y], taps=[0, 1], in_dims=(bdim, bdim), out_dim=bdim)
    check_residual(res, torch.mul, g, n)


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


@settings(max_examples=6, deadline=None)
@given(gate=st.sampled_from(GATES), modify=st.sampled_from(["clip", "abs"]), n=st.integers(1, 2),
       hw=st.integers(1, 3), seed=st.integers(0, 50))
def test_broadcast_product_pchmp(gate, modify, n, hw, seed):
    """PCHMP: the eigenvalue-modified residual, as the dense oracle forms it."""
    g = seeded(seed)
    torch.manual_seed(seed)
    X, y = torch.randn(n, 2, hw, hw, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)
    model, lossfn = Gated(2, gate).to(DT), nn.CrossEntropyLoss()
    assert_blocks_close(curvlib_blocks(model, lossfn, X, y, modify), pchmp_blocks(model, lossfn, X, y, modify),
                        f"pchmp ({modify})")
