"""A model that calls ``torch.vmap`` in its own forward (transformers builds attention masks so,
T5Gemma2), without a graph: run eagerly (:mod:`curvlib._trace.untraced`), its numeric mixing test
(:mod:`curvlib._plan.mixing_numeric`) runs the model outside curvlib's transforms without
switching functorch off (the model's own vmap needs it), and a generic layer that writes by a
boolean mask (``h[mask] = p``, which vmap cannot batch) is run sample by sample
(:func:`curvlib.rules.generic.map_samples`). First order equals the float64 brute force. Called
inside a torch.func transform, where the test must switch functorch off, such a model is refused
with a CurvatureError naming it, not a torch error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib._trace.program import trace_program
from curvlib.extensions import BatchGrad

from oracles.checks import check_first_order
from oracles.on_device import seeded

DT = torch.float64


def _allowed(q, k):
    """One entry of a mask, in transformers' style: ``q >= k``, moved to its device."""
    ones = q.new_ones((), dtype=torch.bool)
    return ones & (q >= k).to(ones.device)


class MarkedLinear(nn.Linear):
    """A Linear whose rows with a positive first input feature are replaced by a learned row
    (T5Gemma2's end-of-image embedding): its own forward, so a generic layer."""

    def __init__(self, d: int, h: int):
        super().__init__(d, h)
        self.mark = nn.Parameter(torch.randn(h))

    def forward(self, x):
        out = super().forward(x)
        out[x[..., 0] > 0] = self.mark
        return out


class VmapMask(nn.Module):
    """``[N, T, 3]`` -> (a Linear, or a :class:`MarkedLinear`) -> causal attention over T whose
    mask ``[T, T]`` is built by two nested ``torch.vmap`` -> Linear on the mean over T. A loop
    whose length is read with ``.item()`` keeps torch.fx and the ATen front end from tracing it."""

    def __init__(self, marked: bool):
        super().__init__()
        self.a = MarkedLinear(3, 4) if marked else nn.Linear(3, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        idx = torch.arange(x.shape[1])
        mask = torch.vmap(torch.vmap(_allowed, in_dims=(None, 0)), in_dims=(0, None))(idx, idx)
        h = self.a(x)
        for _ in range(int((x[0, 0, 0] * 0 + 1).item())):
            scores = (h @ h.transpose(1, 2)).masked_fill(~mask, float("-inf"))
            h = torch.tanh(scores.softmax(-1) @ h)
        return self.b(h.mean(1))


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 4), t=st.integers(2, 4), marked=st.booleans())
def test_vmap_in_forward_first_order(seed, n, t, marked):
    torch.manual_seed(seed)
    model = VmapMask(marked).to(DT)
    assert trace_program(model).graph is None
    g = seeded(seed)
    X, y = torch.randn(n, t, 3, generator=g, dtype=DT), torch.randn(n, 2, generator=g, dtype=DT)
    check_first_order(model, nn.MSELoss(), X, y)


def test_vmap_in_forward_inside_a_transform_is_refused_clearly():
    torch.manual_seed(0)
    model = VmapMask(False).to(DT)
    g = seeded(0)
    X, y = torch.randn(3, 3, 3, generator=g, dtype=DT), torch.randn(3, 2, generator=g, dtype=DT)
    f = curvature(model, nn.MSELoss(), [BatchGrad()])
    ws = torch.randn(2, 2, 4, dtype=DT)
    with pytest.raises(CurvatureError, match="VmapMask.*calls torch.vmap .* in its forward is not supported"):
        torch.func.vmap(lambda w: f(X, y, {"b.weight": w})["grad_batch"]["b.weight"])(ws)
