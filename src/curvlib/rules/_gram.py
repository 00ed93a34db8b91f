"""One side of a Kronecker factor from its rows: dense, or its diagonal when the side is huge.

Every Kronecker factor curvlib forms is a Gram matrix ``α Σ_r z_r z_rᵀ`` of rows
``z [R, D]`` (pulled-back roots for the output side ``B``, inputs for ``A``). A side
whose dimension ``D`` exceeds the extension's ``max_factor_dim`` gets the diagonal
``α Σ_r z_r²`` ``[D]`` instead (a 1-D factor stands for a diagonal matrix; kfac-jax's
choice for such layers): ``O(R·D)`` work and ``O(D)`` memory, the dense ``[D, D]``
(``10 GB`` for a language-model head's ``V = 50257`` in float32) is never formed.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["gram", "diagonal_side"]


def diagonal_side(dim: int, max_dim: Optional[int]) -> bool:
    """Whether a side of dimension ``dim`` gets a diagonal factor under ``max_dim`` (None: never)."""
    return max_dim is not None and dim > max_dim


def gram(rows: Tensor, max_dim: Optional[int], alpha: float = 1.0) -> Tensor:
    """``α zᵀz [*G, D, D]``, or its diagonal ``α Σ_r z_r² [*G·D]`` when ``D > max_dim``.

    Args:
        rows: ``z [*G, R, D]``; optional leading group dims give one factor per group.
        max_dim: the extension's ``max_factor_dim`` (None: always dense).
        alpha: the factor's scale (``1/N`` of an input factor).

    Returns:
        ``[*G, D, D]`` dense, or ``[G·D]`` diagonal (groups flattened in order: the
        diagonal of the block-diagonal matrix).
    """
    if diagonal_side(rows.shape[-1], max_dim):
        diag = (rows * rows).sum(-2).reshape(-1)
        return diag if alpha == 1.0 else diag * alpha
    t = rows.transpose(-1, -2)
    if alpha == 1.0:
        return t @ rows
    if rows.dim() == 2:  # α zᵀz in one BLAS call (no separate pass over the [D, D] result)
        return torch.addmm(rows.new_zeros(()), t, rows, beta=0, alpha=alpha)
    return t @ rows * alpha
