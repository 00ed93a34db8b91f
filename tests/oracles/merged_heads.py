"""Heads merged into the batch dim, as attention code writes it: ``[N, H, ...]`` <-> ``[N·H, ...]``."""

from __future__ import annotations

from torch import Tensor


def merge(t: Tensor, head_major: bool) -> Tensor:
    """``[N, H, ...]`` -> ``[N·H, ...]``: batch-major (row ``n·H + h``) or head-major (``h·N + n``)."""
    return (t.transpose(0, 1) if head_major else t).flatten(0, 1)


def split(t: Tensor, n: int, heads: int, head_major: bool) -> Tensor:
    """The inverse of :func:`merge`: ``[N·H, ...]`` -> ``[N, H, ...]``."""
    t = t.unflatten(0, (heads, n) if head_major else (n, heads))
    return t.transpose(0, 1) if head_major else t
