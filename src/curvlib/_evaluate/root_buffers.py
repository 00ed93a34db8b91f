"""Square roots of the GGN (``SqrtGGNExact``, ``SqrtGGNMC``) written into one preallocated result.

A square root ``[V, N, *p]`` per parameter is the largest result curvlib
returns. Pulled back in chunks of columns (``chunk_size``) or computed on
slices of the batch (``batch_chunk_size``), its parts would otherwise be joined
by ``torch.cat``, holding every part and the joined result at once. Here each
column is written where it belongs as soon as it is formed: one buffer per
(result, parameter), allocated when its first column is known, so that neither
knob raises peak memory above the unchunked call's (a column ``[N, *p]`` at a
time is the only temporary, as without chunks; a Linear layer's outer product
``g_n x_nᵀ`` is written with no temporary at all).

Only for plain tensors outside autograd and ``torch.func`` (the common case);
otherwise the parts are joined as before.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor


__all__ = ["RootBuffers", "write_sqrt"]


class RootBuffers:
    """The preallocated square roots of one call: ``(result key, parameter) -> [V, n, *p]``.

    ``n_total=None``: ``n`` is the batch's size. With ``batch_chunk_size`` one instance
    serves all slices of the batch: ``n = n_total``, and the slice being computed writes
    its samples ``[start, start + n_k)`` (set :attr:`start` before each slice).
    """

    def __init__(self, n_total: Optional[int] = None):
        self.n_total = n_total
        self.start = 0
        self.buffers: Dict[Tuple[str, str], Tensor] = {}

    def at(self, key: str, v_total: int, start: int, v: int) -> "_Columns":
        """Where the columns ``[start, start + v)`` of result ``key`` (``v_total`` in all) go."""
        return _Columns(self, key, v_total, start, v)

    def view(self, key: str, name: str, n_k: int) -> Tensor:
        """The whole root of the slice being computed (``[V, n_k, *p]``)."""
        buf = self.buffers[(key, name)]
        return buf if self.n_total is None else buf[:, self.start:self.start + n_k]


class _Columns:
    def __init__(self, roots: RootBuffers, key: str, v_total: int, start: int, v: int):
        self.roots, self.key, self.v_total, self.start, self.v = roots, key, v_total, start, v

    def __call__(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """``[v, n_k, *p]`` for columns of shape ``(n_k, *p)``; the buffer is made at the first."""
        roots, key = self.roots, (self.key, name)
        if key not in roots.buffers:
            n = shape[0] if roots.n_total is None else roots.n_total
            roots.buffers[key] = torch.empty((self.v_total, n) + tuple(shape[1:]), dtype=dtype, device=device)
        return roots.view(self.key, name, shape[0])[self.start:self.start + self.v]


def write_sqrt(uses, m_by_site, name: str, p: Tensor, n: int, columns: _Columns) -> Tensor:
    """Parameter ``name``'s square root for the columns ``m_by_site`` (``[v, *site_out]``)
    written into ``columns``; returns the whole root written so far (``[V, n, *p]``)."""
    if uses.get(name):
        sqrt_into(uses, m_by_site, name, lambda shape, dtype: columns(name, shape, dtype, p.device))
    else:  # a parameter no site uses
        columns(name, (n,) + tuple(p.shape), p.dtype, p.device).zero_()
    return columns.roots.view(columns.key, name, n)


def sqrt_into(uses, m_by_site, name: str, dest: Callable[[Tuple[int, ...], torch.dtype], Tensor]) -> Tensor:
    """``[V, N, *p]``: ``Σ_sites J_pᵀ m_v`` per sample (:func:`curvlib._evaluate.second_order._sqrt`),
    written into ``dest(shape, dtype)`` (``[V, *shape]`` for a column ``shape = (N, *p)``):
    a Linear weight's outer products all at once, any other site column by column."""
    out = None
    for i, (site, role) in enumerate(uses[name]):
        m = m_by_site[site.key]
        outer = site.rule.outer_factors(site, role, m) if site.rule.outer_factors is not None else None
        if outer is not None:
            if out is None:
                shape = torch.broadcast_shapes(outer[0].shape, outer[1].shape)
                out = dest(tuple(shape[1:]), torch.result_type(*outer))
            if i:
                out.addcmul_(*outer)
            else:
                torch.mul(*outer, out=out)
            continue
        for v in range(m.shape[0]):
            col = site.rule.grad_batch(site, m[v], [role])[role]
            if out is None:
                out = dest(tuple(col.shape), col.dtype)
            if i:
                out[v].add_(col)
            else:
                out[v].copy_(col)
    return out

