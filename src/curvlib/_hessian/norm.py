"""Block-diagonal residuals of the normalisations (``nn.LayerNorm``, ``nn.GroupNorm``).

Both normalise independent *rows* of ``d`` entries (a LayerNorm position over
its ``normalized_shape``; a GroupNorm sample's group of channels, all spatial
positions), then apply an element-wise affine map ``y = x̂ ⊙ w + b``. When no
input depends on the layer's own ``w``/``b`` (a module used once), they leave
``u`` (:mod:`curvlib._hessian.residuals`) and, with ``g̃ = g ⊙ w`` (``g = ∂L/∂y``), the
residual over ``x`` is block-diagonal with one ``[d, d]`` block per row.

Per row, with ``c = x − mean(x)``, ``σ = √(mean(c²) + ε)``, ``x̂ = c/σ``,
``P = I − 11ᵀ/d`` and ``ĝ = P g̃`` (``g̃ · x̂ = ĝ · x̂`` as ``x̂`` is centred):

    ∇_x (g̃ · x̂) = (ĝ − (ĝ·x̂) x̂ / d) / σ,
    R = ∇²_x (g̃ · x̂) = ( −(ĝ x̂ᵀ + x̂ ĝᵀ) − (ĝ·x̂) P + 3 (ĝ·x̂) x̂ x̂ᵀ / d ) / (d σ²)

(differentiate ``(ĝ·c)/σ`` with ``∂c/∂x = P``, ``∂σ/∂x = c/(dσ)``). Only
``[N, rows, d, d]`` per call, eigendecomposed row by row like softmax's rows
(:func:`curvlib._hessian.structured.row_columns`): ``rows · d`` signed columns
per sample for the Hessian diagonal, never the dense ``(rows·d)²`` matrix.

A *row region* (:class:`curvlib._hessian.pointwise.RowRegion`: a normalisation written out in
primitives, e.g. RMSNorm's ``x * rsqrt(mean(x², -1, keepdim) + ε)``) acts on each row ``x_r``
(last axis, ``D`` entries) of its input alone: its residual is block-diagonal too, each block
``∇²_{x_r} (g_r · φ(x_r))`` computed by :func:`torch.func.hessian` of the region's function on
one row (:func:`region_residual`), and read like the LayerNorm's blocks.
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch
from torch import Tensor
from torch.func import jacrev, vmap

from .._core.errors import CurvatureError
from .structured import row_columns, row_operator


class _NormRows:
    """An input with the batch in ``bdim`` in the layout ``[N, rows, d]`` (rows contiguous) and back."""

    def __init__(self, x: Tensor, bdim: int, d: int):
        self.bdim, self.d = bdim, d
        self.moved_shape = tuple((x if bdim == 0 else x.movedim(bdim, 0)).shape)

    def rows(self, t: Tensor) -> Tensor:
        t = t if self.bdim == 0 else t.movedim(self.bdim, 0)
        return t.reshape(self.moved_shape[0], -1, self.d)

    def back(self, t: Tensor, lead: int = 0) -> Tensor:
        """``[*lead, N, rows, d]`` -> the input's own layout."""
        t = t.reshape(tuple(t.shape[:lead]) + self.moved_shape)
        return t if self.bdim == 0 else t.movedim(lead, lead + self.bdim)


def _layout(res) -> Tuple[_NormRows, Tensor]:
    """The row layout of the input, and ``w`` broadcastable against it (or ``None``)."""
    x, bdim, meta = res.inputs[0], res.in_dims[0], res.meta
    w = meta.get("weight")
    if meta["groups"] is None:  # LayerNorm: rows are the leading positions, d = prod(normalized_shape)
        k = meta["norm_dims"]
        if bdim >= x.dim() - k:
            raise CurvatureError(f"LayerNorm '{res.where}': the batch is in one of the normalised axes "
                                 "of its input; samples would be mixed.")
        d = x[(0,) * (x.dim() - k)].numel()
        return _NormRows(x, bdim, d), w
    if bdim != 0:  # GroupNorm: [N, C, *S], rows are the groups
        raise CurvatureError(f"GroupNorm '{res.where}' needs the batch in dim 0 of its input.")
    d = x[0].numel() // meta["groups"]
    w = None if w is None else w.reshape((1, -1) + (1,) * (x.dim() - 2))
    return _NormRows(x, 0, d), w


def norm_residual(res, g: Tensor) -> Tuple[_NormRows, Tensor]:
    """``(layout, R [N, rows, d, d])``: the per-row residuals (module doc)."""
    layout, w = _layout(res)
    x = res.inputs[0]
    g = g if res.out_dim == res.in_dims[0] else g.movedim(res.out_dim, res.in_dims[0])
    gt = layout.rows(g if w is None else g * w)
    xr = layout.rows(x)
    d = layout.d
    c = xr - xr.mean(-1, keepdim=True)
    var = (c * c).mean(-1, keepdim=True) + res.meta["eps"]  # σ² [N, rows, 1]
    xhat = c / var.sqrt()
    gh = gt - gt.mean(-1, keepdim=True)  # ĝ
    a = (gh * xhat).sum(-1, keepdim=True).unsqueeze(-1)  # ĝ·x̂ [N, rows, 1, 1]
    eye = torch.eye(d, dtype=x.dtype, device=x.device)
    proj = eye - 1.0 / d
    outer = gh.unsqueeze(-1) * xhat.unsqueeze(-2)
    R = -(outer + outer.transpose(-1, -2)) - a * proj + (3.0 / d) * a * (xhat.unsqueeze(-1) * xhat.unsqueeze(-2))
    return layout, R / (d * var.unsqueeze(-1))


def norm_columns(res, g: Tensor):
    """Signed columns of every row's ``R``: ``rows · d`` per sample."""
    return row_columns(*norm_residual(res, g))


def norm_operator(res, g: Tensor, clip: bool) -> Callable:
    """``mod(R)`` row by row (PCHMP)."""
    layout, R = norm_residual(res, g)
    return row_operator(layout, R, clip)


def region_residual(res, g: Tensor) -> Tuple[_NormRows, Tensor]:
    """``(layout, R [N, rows, D, D])`` of a row region: per row ``∇²_x (g_r · φ(x))`` at the
    row ``x`` of the input (module doc)."""
    x, bdim, phi = res.inputs[0], res.in_dims[0], res.phi
    if x.dim() < 2 or bdim == x.dim() - 1:
        raise CurvatureError(f"graph node '{res.where}' reduces over the batch dim of its input; "
                             "samples would be mixed.")
    layout = _NormRows(x, bdim, x.shape[-1])
    xr = layout.rows(x)  # [N, rows, D]
    g = g if res.out_dim == bdim else g.movedim(res.out_dim, bdim)
    gr = (g if bdim == 0 else g.movedim(bdim, 0)).reshape(xr.shape[0], xr.shape[1], -1)

    def contracted(row: Tensor, g_row: Tensor) -> Tensor:
        return (g_row * phi(row)).sum()

    # (the samples' rows as one batch of N·rows: one vmap level over the double jacrev, not two)
    n, rows, d = xr.shape
    blocks = vmap(jacrev(jacrev(contracted)))(xr.reshape(n * rows, d), gr.reshape(n * rows, gr.shape[-1]))
    return layout, blocks.reshape(n, rows, d, d)


def region_columns(res, g: Tensor):
    """Signed columns of every row's block of a row region: ``rows · D`` per sample."""
    return row_columns(*region_residual(res, g))


def region_operator(res, g: Tensor, clip: bool) -> Callable:
    """``mod(R)`` of a row region, row by row (PCHMP)."""
    layout, R = region_residual(res, g)
    return row_operator(layout, R, clip)
