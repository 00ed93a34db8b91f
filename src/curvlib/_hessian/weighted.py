"""A residual's columns with a weight per (column, sample): ``R_n = Σ_c w_cn c_n c_nᵀ``.

:func:`curvlib._hessian.algebra.factor` gives two column sets, one per sign. For the
element-wise residual ``diag(r)`` (columns ``e_k √r₊`` and ``e_k √r₋``) and the per-row
eigendecompositions of softmax and normalisation rows (and row regions) (columns ``q √λ₊`` and ``q √λ₋``),
every (column, sample) is non-zero in one of the two sets only, so one set ``e_k √|r|``
(``q √|λ|``) with the sign of ``r`` (``λ``) as its weight holds the same terms in half the
columns: the Hessian diagonal pulls back half as many. Where derivatives flow through the
columns (their smooth forms, :mod:`curvlib._hessian.smooth`, are not disjoint) or the values
cannot be read (a weight's pattern decides shapes downstream), the two signed sets are kept,
each with its sign as the weight of every column.
"""

from __future__ import annotations

from typing import Dict, List, Tuple, Union

import torch
from torch import Tensor
from torch.fx.experimental import proxy_tensor

from .._core.tensors import is_concrete
from ..rules.elementwise import second_derivative
from .algebra import factor
from .norm import norm_residual, region_residual
from .pairs import pair_blocks, pair_weighted
from .smooth import flows
from .structured import LazyColumns, one_hot_columns, row_columns, row_columns_weighted, softmax_residual

#: ``(weights, {input index: columns [V, *input]}, {param: [V, N, *p]})``: ``weights`` a number
#: (every column, every sample) or ``[V, N]``.
WeightedColumns = List[Tuple[Union[float, Tensor], Dict[int, LazyColumns], Dict[str, Tensor]]]

__all__ = ["weighted_factor", "WeightedColumns"]


#: Residual kinds with one block per row: ``(layout, R [N, rows, S, S])`` of each
_ROWS = {"norm": norm_residual, "softmax": softmax_residual, "row_region": region_residual}


def _plain(t: Tensor) -> bool:
    """Values that can be read (the weights' pattern sets shapes downstream: not while a program
    is traced for torch.compile) and through which no derivative is taken."""
    tracing = torch.compiler.is_compiling() or proxy_tensor.get_proxy_mode() is not None
    return not tracing and is_concrete(t) and not flows(t)


def weighted_factor(res, g: Tensor) -> WeightedColumns:
    """The residual's columns with their weights (module doc); ``g`` the gradient at its output."""
    if res.kind == "diag":
        d = res.in_dims[0]
        r = second_derivative(res.phi, res.inputs[0]) * g
        r = r if d == 0 else r.movedim(d, 0)
        if _plain(r):
            weights = torch.where(r >= 0, 1.0, -1.0).to(r.dtype).reshape(r.shape[0], -1).t()  # [D, N]
            return [(weights, {0: one_hot_columns(r.abs().sqrt(), d)}, {})]
    elif res.kind == "pair":
        blocks = pair_blocks(res, g)
        if _plain(blocks[0]):
            return pair_weighted(res, blocks)
    elif res.kind in _ROWS:
        layout, R = _ROWS[res.kind](res, g)
        return row_columns_weighted(layout, R) if _plain(R) else row_columns(layout, R)
    return factor(res, g)
