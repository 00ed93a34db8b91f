"""A graph may rely on the strides of a kernel's result: the ATen trace records no ``contiguous()``
where the traced tensor already was (a permute that only moves dims of size 1, timm's GCViT
window partition with windows of one pixel), so a later ``view`` needs the kernel's layout.
``layer_norm`` runs inside ``torch.func`` transforms as a formula (:func:`curvlib.rules.layernorm.normalise`),
whose result must then be contiguous as the fused kernel's is, whatever the input's strides.

References: the dense GGN and Hessian of the model by ``torch.func`` on its own forward, float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings, strategies as st
from torch import nn
from torch.overrides import TorchFunctionMode

from curvlib._core.settings import override
from curvlib.operators import GGN, Hessian
from curvlib.rules import layernorm

from oracles.dense_operators import dense_ggn_and_hessian

D = torch.float64


class WindowNet(nn.Module):
    """Channels-last ``layer_norm`` of a convolution, then window partition: windows of
    ``window`` pixels (1: the permute moves dims of size 1 only, and ``contiguous()`` is a no-op
    at trace time), ``functional``: ``F.layer_norm`` instead of ``nn.LayerNorm``. Its branch on a
    size keeps torch.fx from tracing it: the ATen front end does."""

    def __init__(self, channels: int, window: int, functional: bool):
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(2, channels, 1), nn.LayerNorm(channels), nn.Linear(channels, 3)
        self.window, self.functional = window, functional

    def forward(self, x):
        h = self.conv(x).permute(0, 2, 3, 1)
        h = F.layer_norm(h, h.shape[-1:], self.norm.weight, self.norm.bias) if self.functional else self.norm(h)
        n, height, width, c = h.shape
        w = self.window
        if height % w or width % w:  # (a Python branch on a size, as timm's checks: torch.fx cannot trace it)
            raise ValueError("the windows do not tile the image")
        h = h.view(n, height // w, w, width // w, w, c).permute(0, 1, 3, 2, 4, 5).contiguous().view(n, -1, w * w, c)
        return self.head(torch.tanh(h).mean(2)).mean(1)


class _LayerNormByFormula(TorchFunctionMode):
    """``F.layer_norm`` as ``(x − μ) / √(σ² + ε) ⊙ w + b``: torch 2.13's second derivative of the
    fused kernel with a weight is wrong under ``torch.func`` (``tests/rules/test_layernorm.py``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.layer_norm:
            x, shape, w, b = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("weight"), \
                args[3] if len(args) > 3 else kwargs.get("bias")
            dims = tuple(range(-len(shape), 0))
            centred = x - x.mean(dims, keepdim=True)
            xhat = centred / torch.sqrt((centred * centred).mean(dims, keepdim=True) + 1e-5)
            return xhat * w + b
        return func(*args, **kwargs)


def _dense_references(model, lossfn, X, y):
    """The dense GGN and Hessian, layer_norm by its formula (:class:`_LayerNormByFormula`)."""
    with _LayerNormByFormula():
        return dense_ggn_and_hessian(model, lossfn, X, y)


@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize("functional", [False, True])
@settings(max_examples=1, deadline=None, database=None, phases=[Phase.generate])
@given(seed=st.integers(0, 2**16))
def test_a_view_after_layer_norm_that_relies_on_its_contiguous_result(seed, window, functional):
    torch.manual_seed(seed)
    model = WindowNet(4, window, functional).to(D)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    X, y = torch.randn(3, 2, 2, 2, dtype=D), torch.randint(0, 3, (3,))
    lossfn = nn.CrossEntropyLoss()
    ggn, hessian = _dense_references(model, lossfn, X, y)
    with override(aten_front_end=True):
        G, H = GGN(model, lossfn, (X, y)), Hessian(model, lossfn, (X, y))
        v = torch.randn(G.shape[1], dtype=D)
        for A, ref, what in ((G, ggn, "GGN"), (H, hessian, "Hessian")):
            torch.testing.assert_close(A.to_dense(), ref, rtol=1e-9, atol=1e-11, msg=what)
            torch.testing.assert_close(A @ v, ref @ v, rtol=1e-9, atol=1e-11, msg=f"{what} @ v")


@pytest.mark.parametrize("functional", [False, True])
def test_the_layer_norm_formula_is_contiguous_like_the_kernel(functional):
    """The formula's result under a transform has the fused kernel's (contiguous) strides."""
    x = torch.randn(2, 3, 4, 5, dtype=D).permute(0, 2, 3, 1)
    w = torch.randn(3, dtype=D)
    run = (lambda x: layernorm.layer_norm(x, (3,), w)) if functional else (lambda x: layernorm.normalise(x, (3,), 1e-5))
    out = torch.func.vmap(run)(x)
    assert out.is_contiguous() and F.layer_norm(x, (3,), w if functional else None).is_contiguous()
