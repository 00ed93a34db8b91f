"""Residual of a broadcasting product ``z = x ⊙ y`` of two graph tensors (squeeze-excite's
``x [N, C, H, W] * s [N, C, 1, 1]``, a gate ``[N, T, 1]`` on ``[N, T, D]``).

Entry ``k`` of ``z`` reads ``x[πx(k)]`` and ``y[πy(k)]``, so with ``g = ∂L/∂z``

    ∂²(gᵀz)/∂x_i ∂y_j = Σ_{k: πx(k)=i, πy(k)=j} g_k,      the x–x and y–y blocks zero.

Split ``z``'s dims (batch first) into those both factors span (``B``), those only ``x``
spans (``T``, where ``y`` has size 1) and those only ``y`` spans (``S``). Per sample and
shared index ``b``, ``z[b] = x[b] y[b]ᵀ`` is the product of a ``[T, 1]`` and a ``[1, S]``
matrix: the residual is a matrix product's (:mod:`curvlib._hessian.structured`, inner size
``K = 1``) with ``G [N, B, T, S]`` the gradient in that layout. Squeeze-excite: ``B = C``,
``T = H·W``, ``S = 1``: per channel one ``[H·W + 1]`` block of rank 2, never the dense
``(C·H·W + C)²`` matrix. When ``T > S`` the roles are swapped (``zᵀ = yᵀ xᵀ``), so that the
smooth columns (one per ``(b, t)``) come from the smaller side.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Callable, List, Sequence, Tuple

import torch
from torch import Tensor

from .._core.errors import CurvatureError
from .structured import LazyColumns, matmul_columns, matmul_operator


def broadcastable(x: Tensor, y: Tensor, z: Tensor) -> bool:
    """Whether ``z = x ⊙ y`` broadcasts without adding dims: every dim of ``x`` and of ``y``
    is ``z``'s or 1 (the layout :func:`broadcast_columns` handles)."""
    return x.dim() == y.dim() == z.dim() and all(
        a in (c, 1) and b in (c, 1) for a, b, c in zip(x.shape, y.shape, z.shape))


class _Layout:
    """``x``, ``y`` and ``g`` as a matrix product's ``[N, B, T, 1]``, ``[N, B, 1, S]``,
    ``[N, B, T, S]`` (or, swapped, ``y``'s and ``x``'s), and back."""

    def __init__(self, res, g: Tensor):
        x, y = res.inputs
        dx, dy = res.in_dims
        if not (dx == dy == res.out_dim and x.shape[dx] == y.shape[dx] == g.shape[dx]):
            raise CurvatureError(
                f"The Hessian extensions need the second derivative of graph node '{res.where}' "
                f"(a broadcasting product of shapes {list(x.shape)} and {list(y.shape)}) per sample, "
                "but its factors do not both carry the batch in the same dimension.")
        self.dim = dx
        xc, yc, gc = (t.movedim(dx, 0) for t in (x, y, g))
        rest = range(1, gc.dim())
        shared = [k for k in rest if xc.shape[k] == yc.shape[k]]
        only_x = [k for k in rest if xc.shape[k] != yc.shape[k] and yc.shape[k] == 1]
        only_y = [k for k in rest if xc.shape[k] != yc.shape[k] and xc.shape[k] == 1]
        self.perm = [0] + shared + only_x + only_y
        self.inverse = [self.perm.index(k) for k in range(gc.dim())]
        size = lambda ks: math.prod(gc.shape[k] for k in ks)  # noqa: E731
        n, b, t, s = gc.shape[0], size(shared), size(only_x), size(only_y)
        self.shapes = [tuple(xc.permute(self.perm).shape), tuple(yc.permute(self.perm).shape)]
        self.swapped = t > s
        blocks = [xc.permute(self.perm).reshape(n, b, t, 1), yc.permute(self.perm).reshape(n, b, 1, s)]
        G = gc.permute(self.perm).reshape(n, b, t, s)
        if self.swapped:  # zᵀ = yᵀ xᵀ: [N, B, S, 1] times [N, B, 1, T]
            blocks, G = [blocks[1].transpose(-1, -2), blocks[0].transpose(-1, -2)], G.transpose(-1, -2)
        self.blocks, self.G = blocks, G
        self.proxy = SimpleNamespace(where=res.where, kind="matmul", inputs=blocks, in_dims=(0, 0), out_dim=0)

    def factor(self, i: int) -> int:
        """The product's factor that is the node's input ``i``."""
        return 1 - i if self.swapped else i

    def back(self, i: int, t: Tensor, lead: int = 0) -> Tensor:
        """Input ``i``'s part in the product layout ``[*lead, N, B, ., .]`` -> its own layout
        (one of the last two dims is 1: the product's transpose is a reshape)."""
        moved = t.reshape(tuple(t.shape[:lead]) + self.shapes[i])
        moved = moved.permute(list(range(lead)) + [lead + k for k in self.inverse])
        return moved.movedim(lead, lead + self.dim)

    def to_product(self, taps: Sequence[Tensor]) -> List[Tensor]:
        """Tangents of ``x`` and ``y`` -> the product's factors' (in its order)."""
        parts = [t.movedim(self.dim, 0).permute(self.perm).reshape(self.blocks[self.factor(i)].shape)
                 for i, t in enumerate(taps)]
        return parts[::-1] if self.swapped else parts

    def from_product(self, parts: Sequence[Tensor], lead: int = 0) -> List[Tensor]:
        """The product's factors' parts (its order) -> ``[x part, y part]``."""
        return [self.back(i, parts[self.factor(i)], lead) for i in range(2)]


def broadcast_columns(res, g: Tensor):
    """Signed columns of the residual (those of the matrix product, mapped back to ``x``, ``y``)."""
    layout = _Layout(res, g)
    sets = []
    for sign, taps, direct in matmul_columns(layout.proxy, layout.G):

        def part(i, taps=taps):
            inner = taps[layout.factor(i)]
            return LazyColumns(inner.shape[0], lambda a, b: layout.back(i, inner[a:b], 1))

        sets.append((sign, {0: part(0), 1: part(1)}, direct))
    return sets


def broadcast_operator(res, g: Tensor, clip: bool) -> Callable:
    """``mod(R)`` (the matrix product's, in its layout)."""
    layout = _Layout(res, g)
    inner = matmul_operator(layout.proxy, layout.G, clip)

    def apply(taps, theta) -> Tuple[List[Tensor], dict]:
        parts, _ = inner(layout.to_product(taps), theta)
        return layout.from_product(parts), {}

    return apply
