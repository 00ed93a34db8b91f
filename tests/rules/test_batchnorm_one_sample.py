"""Evaluation-mode BatchNorm in a batch of one, under a gradient torch's own kernel gets wrong.

``bn(conv(x)).flatten(2).transpose(1, 2)`` followed by a LayerNorm (the patch embedding of
timm's XCiT, iFormer and EfficientViT-MSRA) hands the BatchNorm's backward a channels-last
gradient whose batch stride is not ``C·H·W``; for a batch of one, torch's CPU
``native_batch_norm_backward`` (2.13) then returns a wrong input gradient, and every
per-sample quantity of the layers before it was silently off by up to 50 %. The rule (and a
traced ``F.batch_norm`` call) writes the layer out as its affine map
(``rules.batchnorm.eval_batch_norm``). Checked with hypothesis over the batch size, the shapes,
the head and the spelling of the layer, against the brute-force oracles with the same
torch kernel handed a contiguous gradient (``oracles.torch_fixes``): the oracles run every
sample alone, in a batch of one themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st
from torch import nn

from curvlib import curvature

from oracles.on_device import seeded
from oracles.reference import assert_matches, exact_extensions, reference
from oracles.torch_fixes import ContiguousNormGrads

DT = torch.float64


class PatchEmbed(nn.Module):
    """``head(pool(norm(tokens(bn(conv(x))))))``, the tokens ``flatten(2).transpose(1, 2)``,
    with a class token in front (``cls``) or not; the BatchNorm called as its module or as
    ``F.batch_norm(..., training=False)`` on its buffers (``functional``)."""

    def __init__(self, c: int, cls: bool, functional: bool, classes: int = 3):
        super().__init__()
        self.functional = functional
        self.conv, self.bn = nn.Conv2d(2, c, 3, stride=2, padding=1), nn.BatchNorm2d(c)
        self.norm, self.head = nn.LayerNorm(c), nn.Linear(c, classes)
        self.cls = nn.Parameter(torch.randn(1, 1, c, generator=seeded(7), dtype=DT)) if cls else None

    def forward(self, x):
        h, bn = self.conv(x), self.bn
        h = (F.batch_norm(h, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.1, bn.eps)
             if self.functional else bn(h))
        t = h.flatten(2).transpose(1, 2)
        if self.cls is not None:
            t = torch.cat([self.cls.expand(t.shape[0], -1, -1), t], 1)
        return self.head(self.norm(t).mean(1))


@given(n=st.integers(1, 3), c=st.integers(2, 4), px=st.sampled_from([4, 6]), cls=st.booleans(),
       functional=st.booleans(), seed=st.integers(0, 2**16))
def test_eval_batchnorm_before_tokens_is_exact(n, c, px, cls, functional, seed):
    torch.manual_seed(seed)
    model = PatchEmbed(c, cls, functional).to(DT).eval()
    g = seeded(seed)
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5, generator=g)
        model.bn.running_var.uniform_(0.5, 2.0, generator=g)
        model.bn.weight.add_(torch.randn(c, generator=g, dtype=DT))
    X, y = torch.randn(n, 2, px, px, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)
    lossfn = nn.CrossEntropyLoss()
    qs = curvature(model, lossfn, exact_extensions(hessian=True))(X, y)
    with ContiguousNormGrads():
        ref = reference(model, lossfn, X, y, hessian=True, pchmp=False)
    assert_matches(qs, ref, f"n={n} c={c} px={px} cls={cls} functional={functional}")
