"""A model that calls ``torch.vmap`` in its own forward (transformers builds attention masks so,
T5Gemma2), without a graph: run eagerly (:mod:`curvlib._trace.untraced`), its numeric mixing test
(:mod:`curvlib._plan.mixing_numeric`) runs the model outside curvlib's transforms without
switching functorch off (the model's own vmap needs it), and a generic layer that writes by a
boolean mask (``h[mask] = p``, which vmap cannot batch) is run sample by sample
(:func:`curvlib.rules.generic.map_samples`). (A mask from index ranges alone is a constant of
the ATen-level trace: that model is traced.) First order equals the float64 brute force. Called
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
    whose length is read with ``.item()`` keeps torch.fx from tracing it; ``reads_input``: the
    mask's indices are computed from the input, which keeps the ATen front end from tracing it
    too (a mask from index ranges alone is a constant of the ATen trace)."""

    def __init__(self, marked: bool, reads_input: bool = True):
        super().__init__()
        self.a = MarkedLinear(3, 4) if marked else nn.Linear(3, 4)
        self.b = nn.Linear(4, 2)
        self.reads_input = reads_input

    def forward(self, x):
        idx = torch.arange(x.shape[1])
        if self.reads_input:  # (offset by a zero computed from the input: the mask reads it)
            idx = idx + (x[0, 0, 0] * 0).long()
        mask = torch.vmap(torch.vmap(_allowed, in_dims=(None, 0)), in_dims=(0, None))(idx, idx)
        h = self.a(x)
        for _ in range(int((x[0, 0, 0] * 0 + 1).item())):
            scores = (h @ h.transpose(1, 2)).masked_fill(~mask, float("-inf"))
            h = torch.tanh(scores.softmax(-1) @ h)
        return self.b(h.mean(1))


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 4), t=st.integers(2, 4), marked=st.booleans(),
       reads_input=st.booleans())
def test_vmap_in_forward_first_order(seed, n, t, marked, reads_input):
    torch.manual_seed(seed)
    model = VmapMask(marked, reads_input).to(DT)
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


def test_a_constant_vmap_mask_inside_a_transform_is_traced():
    """The same model with a mask from index ranges alone: traced at the ATen level (the mask a
    constant), so it runs inside a torch.func transform, each member as called alone."""
    torch.manual_seed(0)
    model = VmapMask(False, reads_input=False).to(DT)
    g = seeded(0)
    X, y = torch.randn(3, 3, 3, generator=g, dtype=DT), torch.randn(3, 2, generator=g, dtype=DT)
    f = curvature(model, nn.MSELoss(), [BatchGrad()])
    ws = torch.randn(2, 2, 4, dtype=DT)
    got = torch.func.vmap(lambda w: f(X, y, {"b.weight": w})["grad_batch"]["b.weight"])(ws)
    for w, g_w in zip(ws, got):
        torch.testing.assert_close(g_w, f(X, y, {"b.weight": w})["grad_batch"]["b.weight"], rtol=1e-12, atol=1e-14)
