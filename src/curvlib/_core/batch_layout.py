"""The canonical per-sample layout of a site's tensors, and back.

A layer may carry the batch in any dim (a sequence-first ``[T, N, D]`` block, channels
before the batch); the read-offs work on ``[batch, *channels, shared..., features]``.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch
from torch import Tensor


def batch_first(t: Tensor, batch_dim: int, channel_axes: int = 0, lead: int = 0) -> Tensor:
    """``t`` in the canonical layout ``[batch, *channels, shared..., features]``: the batch
    moved from ``batch_dim`` to the front, the ``channel_axes`` after it kept in place
    (:attr:`curvlib._core.site.Rule.channel_axes`); ``lead`` leading dims (columns ``[V, ...]``) stay in front of
    it all. A view; ``t`` itself when the batch is already in front."""
    if batch_dim == 0:
        return t
    kept = tuple(range(lead + 1, lead + 1 + channel_axes))
    return t.movedim((lead + batch_dim,) + kept, (lead,) + kept)


def from_batch_first(t: Tensor, batch_dim: int, channel_axes: int = 0) -> Tensor:
    """The inverse of :func:`batch_first`: a canonical tensor in the site's own layout."""
    if batch_dim == 0:
        return t
    kept = tuple(range(1, 1 + channel_axes))
    return t.movedim((0,) + kept, (batch_dim,) + kept)


def batch_first_shape(shape: Sequence[int], batch_dim: int, channel_axes: int = 0) -> Tuple[int, ...]:
    """The shape :func:`batch_first` gives a tensor of ``shape``."""
    return tuple(batch_first(torch.empty(tuple(shape), device="meta"), batch_dim, channel_axes).shape)
