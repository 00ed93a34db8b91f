"""The Hessian diagonal: the GGN's plus every residual's signed columns, pulled back together.

``∇²L = G + Σ_a J_aᵀ R_a J_a`` over the graph's nonlinear nodes ``a`` (see
:mod:`curvlib._hessian.residuals`); each ``R_a`` comes as signed column sets
(:func:`curvlib._hessian.algebra.factor`): ``(sign, taps, direct)``, columns at the node's
inputs (pulled back through the graph) and, for a node reading parameters itself, the
parameters' own parts (added to the pulled-back ones before the square).

The column sets of one sign are *packed*: the columns of several nodes are stacked into one
batch (each column zero at the other nodes' inputs, as every input outside a set already is)
and pulled back in one batched vector-Jacobian product, then read once per parameter. A
batch holds up to ``chunk_size`` columns, or, without one, as many as the largest single
set (so the memory of a pullback stays that of the largest set's) or
:attr:`~curvlib._core.settings.Settings.packed_columns`, whichever is more; a set larger than that is
split. Exact for any
packing: each column's pulled-back square is the same, and the read-offs sum over columns.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .._core import settings
from .._core.tensors import is_concrete
from .._hessian.algebra import factor
from .._plan.batch_merges import per_sample
from .read_off import batch_diag, diag, sqrt_columns

__all__ = ["hessian_diag"]


# One node's column set: (node's residual, {input index: columns [V, *a]}, {param: [V, N, *p]}, V)
_Entry = Tuple[object, Dict[int, object], Dict[str, Tensor], int]


def hessian_diag(lin, uses, ggn: Dict[str, Tensor], names, params, n: int, residual_grads,
                 batch: bool, chunk_size: Optional[int] = None) -> Dict[str, Tensor]:
    """``ggn`` (the GGN's diagonal, or batch diagonal ``[N, *p]`` when ``batch``) plus every
    residual's signed columns' (see the module doc)."""
    total = dict(ggn)
    for sign, entries in _signed_entries(lin, residual_grads, n).items():
        tapped = [e for e in entries if e[1]]
        for e in entries:
            if not e[1]:  # a node without float inputs (an opaque layer on token ids): direct columns only
                for name, d in e[2].items():
                    total[name] = total[name] + sign * _square_sum(d, batch)
        if not tapped:
            continue
        least = settings.current().packed_columns
        cap = chunk_size if chunk_size is not None else max(least, max(e[3] for e in tapped))
        for pieces in _packed(tapped, max(1, cap)):
            taps, direct = _stacked(lin, pieces, n)
            m = lin.pull_batched(None, taps)
            cache: Dict[tuple, object] = {}
            for name in names:
                if name in direct:
                    pulled = sqrt_columns(uses, m, name) if uses.get(name) else 0.0
                    part = _square_sum(direct[name] + pulled, batch, fresh=True)
                elif batch:
                    part = batch_diag(uses, m, name, params, n, cache)
                else:
                    part = diag(uses, m, name, params, cache)
                total[name] = total[name] + sign * part
    return total


def _square_sum(cols: Tensor, batch: bool, fresh: bool = False) -> Tensor:
    """``Σ_v cols²`` per sample (``batch``) or ``Σ_v Σ_n cols²``, for ``cols [V, N, *p]``
    (``fresh``: made for this sum, squared in place where nothing differentiates it)."""
    plain = fresh and not cols.requires_grad and is_concrete(cols)
    squares = cols.square_() if plain else cols**2
    return squares.sum(0) if batch else squares.sum((0, 1))


def _signed_entries(lin, residual_grads, n: int) -> Dict[float, List[_Entry]]:
    """Every residual's column sets, by sign (empty ones, which reach nothing trainable, left out)."""
    out: Dict[float, List[_Entry]] = {}
    for res, g_z in zip(lin.residuals, residual_grads):
        for sign, tap_cols, direct in per_sample(res, factor(res, g_z), n):
            if not tap_cols and not direct:
                continue
            taps = {res.taps[j]: cols for j, cols in tap_cols.items()}
            v = next(iter(tap_cols.values() if tap_cols else direct.values())).shape[0]
            out.setdefault(sign, []).append((res, taps, direct, v))
    return out


def _packed(entries: List[_Entry], cap: int):
    """Batches of at most ``cap`` columns: lists of ``(entry, start, stop)`` (a slice of the
    entry's columns), in order, a set larger than ``cap`` split over batches."""
    batch: List[tuple] = []
    room = cap
    for e in entries:
        start = 0
        while start < e[3]:
            stop = min(e[3], start + room)
            batch.append((e, start, stop))
            room -= stop - start
            start = stop
            if room == 0:
                yield batch
                batch, room = [], cap
    if batch:
        yield batch


def _stacked(lin, pieces, n: int) -> Tuple[Dict[int, Tensor], Dict[str, Tensor]]:
    """The batch's columns ``{tap: [V, *a]}`` and direct parts ``{param: [V, N, *p]}``, each
    piece's columns in its rows and zeros in the others' (one piece: its own tensors, no copy)."""
    if len(pieces) == 1:
        (_, taps, direct, _), start, stop = pieces[0]
        return ({t: c[start:stop] for t, c in taps.items()}, {k: d[start:stop] for k, d in direct.items()})
    tap_ids = {t for (_, taps, _, _), _, _ in pieces for t in taps}
    names = {k for (_, _, direct, _), _, _ in pieces for k in direct}
    taps = {t: _joined(pieces, lambda e: e[1].get(t), tuple(lin.taps[t].shape)) for t in sorted(tap_ids)}
    direct = {}
    for k in names:
        shape = next(tuple(e[2][k].shape[1:]) for e, _, _ in pieces if k in e[2])
        direct[k] = _joined(pieces, lambda e: e[2].get(k), shape)
    return taps, direct


def _joined(pieces, cols_of, shape: tuple) -> Tensor:
    """``torch.cat`` over the pieces of ``cols_of(entry)[start:stop]``, zeros ``[stop - start,
    *shape]`` where the entry has none (``cat``, not writes into a buffer: the columns may be
    batched under a torch.func transform or carry autograd)."""
    parts = [None if cols_of(e) is None else cols_of(e)[start:stop] for e, start, stop in pieces]
    like = next(p for p in parts if p is not None)
    return torch.cat([like.new_zeros((stop - start,) + shape) if p is None else p
                      for p, (_, start, stop) in zip(parts, pieces)])
