"""A boolean-mask write of one value, ``x[mask] = v``, in a form torch.vmap can batch.

A functional site runs per sample under :func:`torch.func.vmap`, which cannot batch an
index by a boolean mask (the number of selected rows depends on the data).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, fx

from .._core.aliasing import op_name

__all__ = ["masked_write"]


def masked_write(node: fx.Node, args, kwargs) -> Optional[Tensor]:
    """``x.index_put_([mask], v)`` with one boolean ``mask`` over leading dims of ``x`` and a
    value ``v`` that is the same for every selected row (T5Gemma2's ``x[ids == eoi] = e``), run
    as ``x.copy_(torch.where(mask, v, x))``: the same values, with no data-dependent shape
    (torch.vmap cannot batch a boolean-mask index, and a site runs under it per sample)."""
    if op_name(node) not in ("index_put_", "index_put") or len(args) < 3 or kwargs.get("accumulate") \
            or (len(args) > 3 and args[3]):
        return None
    x, indices, value = args[:3]
    if not (isinstance(x, Tensor) and isinstance(indices, (list, tuple)) and len(indices) == 1
            and isinstance(indices[0], Tensor) and indices[0].dtype is torch.bool and isinstance(value, Tensor)):
        return None
    mask = indices[0]
    rest = x.dim() - mask.dim()
    if rest < 0 or value.dim() > rest or mask.shape != x.shape[:mask.dim()]:
        return None
    filled = torch.where(mask.reshape(mask.shape + (1,) * rest), value.to(x.dtype), x)
    return x.copy_(filled) if op_name(node) == "index_put_" else filled
