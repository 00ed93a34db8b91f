"""Workarounds for torch bugs that would make a brute-force oracle wrong.

:class:`ContiguousNormGrads` (a dispatch mode, :func:`exact_backward` as a decorator) hands
``native_batch_norm_backward`` a contiguous incoming gradient. The oracles run every sample
alone, in a batch of one, which is where torch's CPU kernel goes wrong.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class ContiguousNormGrads(TorchDispatchMode):
    """Works around a PyTorch CPU bug (seen in 2.13): ``native_batch_norm_backward`` in eval
    mode returns a wrong input gradient for a batch of one whose incoming gradient is
    channels-last with a batch stride other than ``C·H·W`` (``[1, C, H, W]`` with strides
    ``(C, 1, W·C, C)``: what a LayerNorm's backward hands ``bn(conv(x)).flatten(2).transpose(1, 2)``,
    the patch embedding of XCiT, iFormer and EfficientViT-MSRA).
    Every oracle here runs one sample alone, so torch's own gradients of those models were
    off by up to 50 % (finite differences and the in-batch gradient agree with curvlib); the
    gradient made contiguous first gives the exact result. Values are unchanged."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _NORM_BACKWARDS and torch.is_tensor(args[0]) and not args[0].is_contiguous():
            args = (args[0].contiguous(),) + tuple(args[1:])
        return func(*args, **(kwargs or {}))


_NORM_BACKWARDS = {torch.ops.aten.native_batch_norm_backward.default}


def exact_backward(f):
    """``f`` run under :class:`ContiguousNormGrads` (its backward calls included)."""

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        with ContiguousNormGrads():
            return f(*args, **kwargs)

    return wrapped
