"""A Linear layer's per-sample quantities for all columns ``m [V, *out]`` of a root at once.

:func:`grad_batch_columns`: the per-sample gradients of every column in one batched product.
:func:`squares`: their squares summed over the columns, from the columns' Gram matrices over
the positions that share the weight: for columns ``m [V, N, S, O]`` and the layer input ``x [N, S, I]``,

    Σ_v (Σ_s m[v, n, s, o] x[n, s, i])² = Σ_{s,t} M[n, s, t, o] x[n, s, i] x[n, t, i],
    M[n, s, t, o] = Σ_v m[v, n, s, o] m[v, n, t, o],

``V·N·S²·O`` products for ``M`` and ``N·S²·O·I`` for the rest, against ``V·N·S·O·I`` for the
individual gradients: fewer where ``S (V + I) < V·I`` (a language model's layers under the
Hessian's residual columns, ``V`` a sample's activations). The bias's is ``Σ_{s,t} M``. Weighted columns (the Hessian's, a sign per column and sample:
``Σ_v w_vn (J_pᵀ m_v)²``) weight ``M``'s terms, with no sorting of the columns by sign.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .._core import settings
from .._core.site import RoleTensors, Site


def grad_batch_columns(site: Site, m: Tensor, roles: Sequence[str], transposed: bool = False) -> RoleTensors:
    """``grad_batch`` of every column of ``m [V, *out]``: weight ``[V, N, O, I]`` (``transposed``:
    ``[V, N, I, O]``), bias ``[V, N, O]``; one batched product over the samples."""
    x = site.saved["x"]
    x = x.reshape(x.shape[0], -1, x.shape[-1])  # [N, S, I]
    g = m.reshape(m.shape[0], x.shape[0], -1, m.shape[-1])  # [V, N, S, O]
    out = {}
    if "weight" in roles:
        out["weight"] = torch.einsum("nsi,vnso->vnio", x, g) if transposed else torch.einsum("vnso,nsi->vnoi", g, x)
    if "bias" in roles:
        out["bias"] = g.sum(2)
    return out


def cheaper(m: Tensor, x: Tensor, entries: int) -> bool:
    """Whether the Gram matrices cost less than the individual gradients for ``m [V, *out]`` and
    ``x [N, S, I]`` (``S > 1``), and ``[N, S, S, max(O, I)]`` fits in ``entries``."""
    v, (n, s, i), o = m.shape[0], x.shape, m.shape[-1]
    return s > 1 and v > 1 and s * (v + i) < v * i and n * s * s * max(o, i) <= entries


def squares(m: Tensor, x: Tensor, roles: Sequence[str], per_sample: bool, weights: Optional[Tensor] = None) -> RoleTensors:
    """``Σ_v (J_pᵀ m_v)²`` per sample (``per_sample``: weight ``[N, O, I]``, bias ``[N, O]``) or
    also summed over the samples (weight ``[1, O, I]``, bias ``[1, O]``: one block of columns);
    with ``weights [V, N]``, ``Σ_v w_vn (J_pᵀ m_v)²`` (``M = Σ_v w_vn m_vn m_vnᵀ``)."""
    n, s, v = x.shape[0], x.shape[1], m.shape[0]
    # M as [N, O, S, S]: the columns moved last once (one copy), then one batched product per
    # (sample, output) reading that copy and its transpose (an einsum copied both operands)
    mo = m.reshape(v, n, s, m.shape[-1]).permute(1, 3, 2, 0).contiguous()  # [N, O, S, V]
    mw = mo if weights is None else mo * weights.t().reshape(n, 1, 1, v).to(mo.dtype)
    M = torch.matmul(mw, mo.transpose(-1, -2))  # [N, O, S, S]
    o = M.shape[1]
    out = {}
    if "weight" in roles:
        xx = (x.unsqueeze(2) * x.unsqueeze(1)).reshape(n, s * s, -1)  # [N, S·S, I]
        Mf = M.reshape(n, o, s * s)
        out["weight"] = torch.bmm(Mf, xx) if per_sample else \
            (Mf.transpose(0, 1).reshape(o, n * s * s) @ xx.reshape(n * s * s, -1)).unsqueeze(0)
    if "bias" in roles:
        out["bias"] = M.sum((2, 3)) if per_sample else M.sum((0, 2, 3)).unsqueeze(0)
    return out


def weighted_squares(site: Site, m: Tensor, roles: Sequence[str], weights: Tensor, per_sample: bool,
                     transposed: bool = False) -> Optional[RoleTensors]:
    """``Σ_v w_vn (J_pᵀ m_v)²`` for ``weights [V, N]`` (weight ``[N, O, I]``, ``transposed``:
    ``[N, I, O]``, bias ``[N, O]``; without ``per_sample`` summed over the samples), from the
    Gram matrices where they are :func:`cheaper`, else ``None``."""
    x = site.saved["x"]
    x = x.reshape(x.shape[0], -1, x.shape[-1])  # [N, S, I]
    if not cheaper(m, x, settings.current().linear_squares_entries):
        return None
    out = {r: t if per_sample else t[0] for r, t in squares(m, x, roles, per_sample, weights).items()}
    if transposed and "weight" in out:
        out["weight"] = out["weight"].transpose(-1, -2)
    return out
