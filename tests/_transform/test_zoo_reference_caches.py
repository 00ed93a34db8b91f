"""The sweep's oracles (``oracles.zoo_reference``) on a model whose forward caches a value of its
parameters in evaluation mode.

timm's EfficientFormer (LeViT, EfficientViT-MSRA alike) keeps ``attention_biases[:, idxs]`` in
``attention_bias_cache`` in eval mode, keyed by device. The ecosystem sweep's logit-scale probe
runs the model under ``torch.no_grad``, which fills the cache with a constant; every oracle
forward then read it, and the oracle's gradient of ``attention_biases`` was zero, so that the
sweep reported curvlib's (the model's) gradient as wrong. The oracles' ``forward`` empties such
a cache for each call. Checked with hypothesis against the same model's per-sample gradients
and GGN diagonals without the cache (training mode: the same function here), and curvlib
against both.
"""

from __future__ import annotations

from typing import Dict

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import curvature
from curvlib.extensions import BatchDiagGGNExact, BatchGrad

from oracles import zoo_reference as oz
from oracles.on_device import seeded
from oracles.zoo import Problem

DT = torch.float64


class CachedBiasAttention(nn.Module):
    """Token mixing ``softmax(q kᵀ + B) v`` with the bias ``B = attention_biases[:, idxs]``
    cached per device in eval mode, as timm's EfficientFormer ``Attention`` does."""

    def __init__(self, dim: int, heads: int, tokens: int, classes: int = 3):
        super().__init__()
        self.heads, self.qkv, self.head = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, classes)
        self.attention_biases = nn.Parameter(torch.randn(heads, tokens, generator=seeded(5), dtype=DT))
        pos = torch.arange(tokens)
        self.register_buffer("attention_bias_idxs", (pos[:, None] - pos[None, :]).abs())
        self.attention_bias_cache: Dict[str, torch.Tensor] = {}

    def biases(self, device: torch.device) -> torch.Tensor:
        if self.training:
            return self.attention_biases[:, self.attention_bias_idxs]
        if str(device) not in self.attention_bias_cache:
            self.attention_bias_cache[str(device)] = self.attention_biases[:, self.attention_bias_idxs]
        return self.attention_bias_cache[str(device)]

    def forward(self, x):
        n, t, d = x.shape
        q, k, v = self.qkv(x).reshape(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) + self.biases(x.device)).softmax(-1)
        return self.head((attn @ v).transpose(1, 2).reshape(n, t, d).mean(1))


def _uncached(model: nn.Module, X, y, lossfn):
    """Per-sample gradients and GGN diagonals of the model without its cache (training mode)."""
    model.train()
    try:
        prob = Problem(model, X, y, lossfn, None, "")
        return oz.individual_gradients(prob), oz.ggn_diagonals(oz.ggn_parts(prob))
    finally:
        model.eval()


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 3), heads=st.integers(1, 2), tokens=st.integers(2, 4), filled=st.booleans(),
       seed=st.integers(0, 2**16))
def test_oracles_do_not_read_a_cache_filled_before(n, heads, tokens, filled, seed):
    torch.manual_seed(seed)
    model = CachedBiasAttention(2 * heads, heads, tokens).to(DT).eval()
    g = seeded(seed)
    X, y = torch.randn(n, tokens, 2 * heads, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)
    lossfn = nn.CrossEntropyLoss()
    if filled:
        with torch.no_grad():
            model(X)  # a probe that fills the cache with a constant
    prob = Problem(model, X, y, lossfn, None, "")
    grads, ggn = oz.individual_gradients(prob), oz.ggn_diagonals(oz.ggn_parts(prob))
    want_grads, want_ggn = _uncached(model, X, y, lossfn)
    qs = curvature(model, lossfn, [BatchGrad(), BatchDiagGGNExact()])(X, y)
    what = f"n={n} heads={heads} tokens={tokens} filled={filled}"
    for k, want in want_grads.items():
        assert torch.allclose(grads[k], want, rtol=1e-10, atol=1e-14), f"oracle grad_batch {k}: {what}"
        assert torch.allclose(qs["grad_batch"][k], want, rtol=1e-10, atol=1e-14), f"curvlib grad_batch {k}: {what}"
    for k, want in want_ggn.items():
        assert torch.allclose(ggn[k], want, rtol=1e-10, atol=1e-14), f"oracle GGN diagonal {k}: {what}"
        assert torch.allclose(qs["diag_ggn_exact_batch"][k], want, rtol=1e-10, atol=1e-14), f"curvlib {k}: {what}"
