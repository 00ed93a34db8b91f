"""Square roots of the GGN (``SqrtGGNExact``, ``SqrtGGNMC``) written into one preallocated result.

A square root ``[V, N, *p]`` per parameter is the largest result curvlib
returns. Pulled back in chunks of columns (``chunk_size``) or computed on
slices of the batch (``batch_chunk_size``), its parts would otherwise be joined
by ``torch.cat``, holding every part and the joined result at once. Here each
column is written where it belongs as soon as it is formed: one buffer per
(result, parameter), allocated when its first column is known, so that neither
knob raises peak memory above the unchunked call's (a column ``[N, *p]`` at a
time is the only temporary, as without chunks, or a block of columns up to
:attr:`~curvlib._core.settings.Settings.column_block_entries` where a rule forms them in one
batched call; a Linear layer's outer product ``g_n x_nᵀ`` is written with no temporary at all).

Only for plain tensors outside autograd and ``torch.func`` (the common case);
otherwise the parts are joined by ``torch.cat``.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from .._core import settings


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
        sqrt_into(uses, m_by_site, name, lambda shape, dtype: columns(name, shape, dtype, p.device), p.numel())
    else:  # a parameter no site uses
        columns(name, (n,) + tuple(p.shape), p.dtype, p.device).zero_()
    return columns.roots.view(columns.key, name, n)


def sqrt_into(uses, m_by_site, name: str, dest: Callable[[Tuple[int, ...], torch.dtype], Tensor],
              numel: int = 1) -> Tensor:
    """``[V, N, *p]``: ``Σ_sites J_pᵀ m_v`` per sample (:func:`curvlib._evaluate.read_off.sqrt_columns`),
    written into ``dest(shape, dtype)`` (``[V, *shape]`` for a column ``shape = (N, *p)``):
    a Linear weight's outer products all at once, any other site a block of columns at a time
    (``numel``: the parameter's, which sizes the blocks)."""
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
        step = _columns_at_once(site, m, numel)
        for v in range(0, m.shape[0], step):
            cols = _columns(site, m[v:v + step], role, step)
            if out is None:
                out = dest(tuple(cols.shape[1:]), cols.dtype)
            if i:
                out[v:v + step].add_(cols)
            else:
                out[v:v + step].copy_(cols)
    return out


def _columns_at_once(site, m: Tensor, numel: int) -> int:
    """How many columns a rule with :attr:`~curvlib._core.site.Rule.grad_batch_columns` forms at
    once (``m [V, N, ...]``, a parameter of ``numel`` entries): a block of at most
    :attr:`~curvlib._core.settings.Settings.column_block_entries` entries (1 for the other rules)."""
    if site.rule.grad_batch_columns is None or m.dim() < 2:
        return 1
    return max(1, settings.current().column_block_entries // max(m.shape[1] * numel, 1))


def _columns(site, m: Tensor, role: str, step: int) -> Tensor:
    """``[v, N, *p]`` for the columns ``m [v, *site_out]``: one batched call, or one column."""
    if step > 1:
        return site.rule.grad_batch_columns(site, m, [role])[role]
    return site.rule.grad_batch(site, m[0], [role])[role].unsqueeze(0)

