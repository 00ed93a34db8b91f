"""Views of a buffer that in-place writes filled with merged-batch data keep the buffer's order
(:mod:`curvlib._plan.independence`): Longformer pads its chunked scores ``[N·H, C, W, 2W+1]`` into
a ``new_zeros`` buffer through views (``buf[:, :-1, :, w:] = ...``, then ``buf[:, -1, :, w:] = ...``,
a ``select`` of the buffer taken after the first write). The first write gives the buffer the
written order; a view of it taken afterwards has that order mapped through the view, and the next
write through it is checked against it. Drawn on both front ends (torch.fx, where the model calls
``copy_`` on views, and the ATen front end, where ``setitem`` becomes views and ``copy_``), both
merge orders; every quantity equals the float64 brute force. A second write from a tensor merged
in the other order stays refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import KFLR, BatchGrad

from oracles.merged_heads import merge, split
from oracles.checks import check_first_order, check_second_order
from oracles.on_device import seeded

DT = torch.float64
H, DH = 2, 2


class PaddedChunks(nn.Module):
    """``[N, T, 4]`` -> Linear -> heads merged ``[N·H, T, DH]`` -> ``buf = h.new_zeros(N·H, 3, T, DH + 1)``
    written through views: ``buf[:, :-1, :, 1:] = h`` (both chunks), then ``buf[:, -1, :, 1:] = tanh(h)``
    (a ``select`` of the buffer) -> split -> Linear -> mean -> Linear. ``setitem`` writes by
    indexing, else by ``copy_`` on the views; ``other_order`` merges the second write's heads in
    the other order (it then pairs sample ``m``'s rows with sample ``n``'s)."""

    def __init__(self, head_major: bool, setitem: bool, aten: bool, other_order: bool = False):
        super().__init__()
        self.qk, self.out, self.head = nn.Linear(4, H * DH), nn.Linear(DH + 1, 3), nn.Linear(3, 2)
        self.head_major, self.setitem, self.aten, self.other_order = head_major, setitem, aten, other_order

    def forward(self, x):
        if self.aten and bool(x.abs().sum() >= 0):  # a branch on values: the ATen front end
            x = x + 0
        n, t = x.shape[0], x.shape[1]
        heads = self.qk(x).view(n, t, H, DH).transpose(1, 2)                  # [N, H, T, DH]
        h = merge(heads, self.head_major)                                    # [N·H, T, DH]
        last = torch.tanh(merge(heads, self.head_major != self.other_order))
        buf = h.new_zeros(n * H, 3, t, DH + 1)
        if self.setitem:
            buf[:, :-1, :, 1:] = h[:, None]
            buf[:, -1, :, 1:] = last
        else:
            buf[:, :-1, :, 1:].copy_(h[:, None].expand(-1, 2, -1, -1))
            buf.select(1, -1)[:, :, 1:].copy_(last)
        z = split(buf, n, H, self.head_major)                                   # [N, H, 3, T, DH + 1]
        return self.head(torch.tanh(self.out(z)).mean((1, 2, 3)))


def _data(seed: int, n: int):
    g = seeded(seed)
    return torch.randn(n, 3, 4, generator=g, dtype=DT), torch.randn(n, 2, generator=g, dtype=DT)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 4), head_major=st.booleans(), setitem=st.booleans(),
       aten=st.booleans())
def test_views_of_a_written_buffer_keep_its_order(seed, n, head_major, setitem, aten):
    torch.manual_seed(seed)
    X, y = _data(seed, n)
    model = PaddedChunks(head_major, setitem, aten).to(DT)
    check_first_order(model, nn.MSELoss(), X, y)
    check_second_order(model, nn.MSELoss(), X, y, hessian=False, hmp=False)
    factors = curvature(model, nn.MSELoss(), [KFLR()])(X, y)["kflr"]
    assert factors and all(bool(f.isfinite().all()) for fs in factors.values() for f in fs)


@pytest.mark.parametrize("aten", [False, True])
@pytest.mark.parametrize("head_major", [False, True])
def test_second_write_in_another_order_stays_refused(aten, head_major):
    X, y = _data(3, 3)
    model = PaddedChunks(head_major, True, aten, other_order=True).to(DT)
    with pytest.raises(CurvatureError, match="Samples are mixed"):
        curvature(model, nn.MSELoss(), [BatchGrad()])(X, y)
