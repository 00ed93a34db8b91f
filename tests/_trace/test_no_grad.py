"""Regions of a model's ``forward`` that run without autograd are constant for every extension.

``torch.no_grad()``, ``torch.set_grad_enabled(False)`` and ``torch.inference_mode()`` inside
``forward`` stop the model's own backward there: parameters used only inside get no gradient,
and nothing upstream of the region is reached through it. curvlib records the grad mode of
every traced node (both front ends: torch.fx's symbolic trace and the ATen-level trace) and
cuts each value that leaves such a region (:func:`curvlib._trace.modes.cut_no_grad_regions`),
so first order, the GGN and the Hessian family agree with the model's own autograd. Checked
with hypothesis over where the region sits, how it is opened and which front end traces it,
against the brute-force oracles, which run the model itself.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

from curvlib import curvature
from curvlib.extensions import BatchGrad, DiagGGNExact
from curvlib._trace.modes import stop_gradient

from oracles.reference import assert_matches, exact_extensions, reference
from oracles.on_device import seeded

DT = torch.float64
PLACES = ("input_layer", "gate", "functional", "around_head", "re_enabled")
MODES = ("no_grad", "set_grad_enabled", "inference_mode")


def _region(mode: str):
    if mode == "no_grad":
        return torch.no_grad()
    if mode == "set_grad_enabled":
        return torch.set_grad_enabled(False)
    return torch.inference_mode()


class Gated(nn.Module):
    """``b(tanh(a(x)) * gate + s * x')``, one piece of it computed without autograd (``place``)."""

    def __init__(self, place: str, mode: str, aten: bool, d: int = 3, h: int = 4, c: int = 3):
        super().__init__()
        self.a, self.g, self.b = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, c)
        self.scale = nn.Parameter(torch.randn(h, generator=seeded(7), dtype=DT))
        self.place, self.mode, self.aten = place, mode, aten

    def _cut(self, fn):
        with _region(self.mode):
            out = fn()
        return out.clone()  # (an inference-mode tensor must be copied before autograd sees it)

    def forward(self, x):
        if self.aten and bool(x.abs().sum() >= 0):  # a branch on values: torch.fx cannot follow it
            x = x * 1.0
        if self.place == "input_layer":
            h = torch.tanh(self._cut(lambda: self.a(x)))
        else:
            h = torch.tanh(self.a(x))
        gate = torch.sigmoid(self.g(x))
        if self.place == "gate":
            gate = self._cut(lambda: torch.sigmoid(self.g(x)))
        extra = torch.tanh(self.a(x)) * self.scale
        if self.place == "functional":
            extra = self._cut(lambda: torch.tanh(self.a(x)) * self.scale)
        if self.place == "re_enabled":  # grad switched back on inside the region: differentiated
            with torch.no_grad():
                with torch.enable_grad():
                    extra = torch.tanh(self.a(x)) * self.scale
        z = h * gate + extra
        if self.place == "around_head":
            return self._cut(lambda: self.b(z)) + self.b(z) * 0.5
        return self.b(z)


def _data(seed: int, n: int = 4):
    g = seeded(seed)
    return torch.randn(n, 3, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)


@given(place=st.sampled_from(PLACES), mode=st.sampled_from(MODES), aten=st.booleans(),
       seed=st.integers(0, 2**16))
def test_no_grad_region_is_constant(place, mode, aten, seed):
    torch.manual_seed(seed)
    model = Gated(place, mode, aten).to(DT)
    X, y = _data(seed)
    lossfn = nn.CrossEntropyLoss()
    qs = curvature(model, lossfn, exact_extensions(hessian=True))(X, y)
    twin = Gated(place, "no_grad", aten).to(DT)  # (the oracle's torch.func transforms refuse inference tensors)
    twin.load_state_dict(model.state_dict())
    assert_matches(qs, reference(twin, lossfn, X, y, hessian=True, pchmp=False), f"{place}/{mode}/aten={aten}")


def test_parameters_only_used_without_grad_get_zeros():
    """``g`` is used only inside the region: every quantity of it is zero (the model's own
    backward leaves its ``.grad`` at ``None``); before the cut it got ``tanh``-gate gradients."""
    model = Gated("gate", "no_grad", aten=False).to(DT)
    X, y = _data(0)
    qs = curvature(model, nn.CrossEntropyLoss(), [BatchGrad(), DiagGGNExact()])(X, y)
    for key in ("grad_batch", "diag_ggn_exact"):
        assert float(qs[key]["g.weight"].abs().max()) == 0.0
        assert float(qs[key]["a.weight"].abs().max()) > 0.0


@pytest.mark.parametrize("aten", [False, True])
def test_batch_statistic_without_grad_is_a_constant(aten):
    """A statistic of the whole batch computed without autograd mixes values, not gradients:
    each sample's gradient is that of its own loss with the statistic held fixed."""

    class Normalised(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            if aten and bool(x.abs().sum() >= 0):
                x = x * 1.0
            h = torch.tanh(self.a(x))
            with torch.no_grad():
                scale = h.abs().mean() + 1.0
            return self.b(h / scale)

    model = Normalised().to(DT)
    X, y = _data(3, n=5)
    y = y % 2
    lossfn = nn.CrossEntropyLoss()
    qs = curvature(model, lossfn, [BatchGrad()])(X, y)
    for n in range(X.shape[0]):
        model.zero_grad()
        lossfn(model(X)[n:n + 1], y[n:n + 1]).backward()  # the whole batch's statistic, sample n's loss
        for name, p in model.named_parameters():
            torch.testing.assert_close(qs["grad_batch"][name][n], p.grad / X.shape[0], rtol=1e-10, atol=1e-12)


def test_stop_gradient_keeps_values_and_non_tensors():
    x = torch.randn(3, requires_grad=True)
    out = stop_gradient((x, 2, [x * 2]))
    assert out[1] == 2 and not out[0].requires_grad and not out[2][0].requires_grad
    torch.testing.assert_close(out[2][0], x.detach() * 2)


def test_trace_under_callers_no_grad_keeps_the_model_differentiable():
    """A call inside the caller's ``torch.no_grad()`` traces the model as it is: only the
    model's own regions are cut (the trace runs with grad mode on)."""
    model = Gated("gate", "no_grad", aten=False).to(DT)
    X, y = _data(1)
    lossfn = nn.CrossEntropyLoss()
    with torch.no_grad():
        qs = curvature(model, lossfn, [BatchGrad()])(X, y)
    assert float(qs["grad_batch"]["a.weight"].abs().max()) > 0.0
    assert float(qs["grad_batch"]["g.weight"].abs().max()) == 0.0
