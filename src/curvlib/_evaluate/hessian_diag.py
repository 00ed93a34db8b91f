"""The Hessian diagonal: the GGN's plus every residual's weighted columns, pulled back together.

``∇²L = G + Σ_a J_aᵀ R_a J_a`` over the graph's nonlinear nodes ``a`` (see
:mod:`curvlib._hessian.residuals`); each ``R_a`` comes as column sets with a weight ±1 per
(column, sample) (:func:`curvlib._hessian.weighted.weighted_factor`): ``(weights, taps,
direct)``, columns at the node's inputs (pulled back through the graph) and, for a node reading
parameters itself, the parameters' own parts (added to the pulled-back ones before the square).
The diagonal adds ``Σ_c w_c (J_pᵀ c)²``.

The column sets are *packed*: the columns of several nodes are stacked into one batch (each
column zero at the other nodes' inputs, as every input outside a set already is) and pulled back
in one batched vector-Jacobian product. A batch holds up to ``chunk_size`` columns, or, without
one, as many as the largest single set (so the memory of a pullback stays that of the largest
set's) or :attr:`~curvlib._core.settings.Settings.packed_columns`, whichever is more; a set larger than that is split. A pullback
runs from its highest tap down for every column, so nodes of similar depth are packed together
(:func:`_packed`, a cost model); consecutive batches are then joined up to the same bound and
read together. A batch reaches only the sites below its taps (the backward leaves the others
``None``): each parameter reads, and joins, only the batches that reach it (:func:`_reached_parts`).
A site that reads columns of mixed weights as they are (a Linear's Gram
matrices over positions, :attr:`~curvlib._core.site.Rule.weighted_squares_over_columns`; a read
that forms the columns ``J_pᵀ m_v`` anyway, :func:`~curvlib._evaluate.read_off.weighted_diag`)
reads them once; for the other parameters the columns are read once per sign: columns of mixed
weights are sorted, per sample, into the positive and the negative ones (:func:`_halves`, only
at the sites those parameters read; a sample with fewer columns of a sign gets zero columns),
each half read like the GGN's columns. Exact for any packing:
each column's pulled-back square is the same, and the read-offs sum over columns.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .._core import settings
from .._core.tensors import is_concrete
from .._hessian.algebra import factor
from .._hessian.weighted import weighted_factor
from .._plan.batch_merges import per_sample
from .read_off import batch_diag, diag, sqrt_columns, weighted_diag

__all__ = ["hessian_diag", "DiagRequest"]

#: The fixed cost of a batched pullback per tap below its top one, in tap entries pulled back
#: (:func:`_packed`; measured on the tiny language models of ``benchmarks/hessian_cost.py``).
PULL_OVERHEAD = 1500

#: A number (every column, every sample), a tuple (a number per column) or ``[V, N]``.
Weights = Union[float, Tuple[float, ...], Tensor]
# One node's column set: (node's residual, {input index: columns [V, *a]}, {param: [V, N, *p]}, V,
# weights: a number or [V, N])
_Entry = Tuple[object, Dict[int, object], Dict[str, Tensor], int, Weights]


@dataclass(frozen=True)
class DiagRequest:
    """What :func:`hessian_diag` reads: the parameters ``names`` (values ``params``) of a batch of
    ``n`` samples, their diagonals (``batch``: per sample ``[N, *p]``), pulling back at most
    ``chunk_size`` columns at once (``None``: see the module doc)."""

    names: Sequence[str]
    params: Dict[str, Tensor]
    n: int
    batch: bool
    chunk_size: Optional[int] = None


def hessian_diag(lin, uses, ggn: Dict[str, Tensor], residual_grads, request: DiagRequest) -> Dict[str, Tensor]:
    """``ggn`` (the GGN's diagonal, or batch diagonal ``[N, *p]`` when ``request.batch``) plus
    every residual's weighted columns' (see the module doc)."""
    names, n, batch, chunk_size = request.names, request.n, request.batch, request.chunk_size
    total = dict(ggn)
    entries = _entries(lin, residual_grads, n)
    for e in entries:
        if not e[1]:  # a node without float inputs (an opaque layer on token ids): direct columns only
            for name, d in e[2].items():
                total[name] = total[name] + _square_sum(d, batch, e[4])
    tapped = [e for e in entries if e[1]]
    if not tapped:
        return total
    cap = max(1, chunk_size if chunk_size is not None else max(settings.current().packed_columns, max(e[3] for e in tapped)))
    for group in _read_groups(lin, _packed(tapped, cap, [t.numel() for t in lin.taps]), cap, n):
        for part_uses, part, columns in _reached_parts(lin, group, names, uses, n):
            _read_part(total, part_uses, part, columns, request)
    return total


def _read_part(total: Dict[str, Tensor], uses, names: List[str], columns, request: DiagRequest) -> None:
    """Add to ``total`` the parameters ``names``' diagonals of one read's ``columns`` ``(site
    columns, direct parts, weights)`` (see the module doc)."""
    pulled, direct, weights = columns
    params, n, batch = request.params, request.n, request.batch
    for name in direct:  # (the parameter's own parts join its pulled-back ones before the square)
        cols = sqrt_columns(uses, pulled, name) if uses.get(name) else 0.0
        total[name] = total[name] + _square_sum(direct[name] + cols, batch, weights, fresh=True)
    rest = [name for name in names if name not in direct]
    for name, part in _weighted_reads(uses, pulled, rest, weights, request).items():
        total[name] = total[name] + part
        rest.remove(name)
    for sign, m in _halves(pulled, weights, n, {site.key for name in rest for site, _ in uses.get(name, ())}) \
            if rest else ():
        cache: Dict[tuple, object] = {}
        for name in rest:
            part = batch_diag(uses, m, name, params, n, cache) if batch else diag(uses, m, name, params, cache)
            total[name] = total[name] + sign * part


#: One pulled-back batch: (site columns [V, *site_out], None where the columns do not reach the
#: site; direct parts {param: [V, N, *p]}; weights; V)
_Pulled = Tuple[List[Optional[Tensor]], Dict[str, Tensor], Weights, int]


def _read_groups(lin, batches, cap: int, n: int) -> Iterator[List[_Pulled]]:
    """Consecutive pulled-back batches joined up to ``cap`` columns: each batch pulled back alone
    (:func:`_packed`), read together (a read-off costs per call, not only per column)."""
    group: List[_Pulled] = []
    for pieces in batches:
        taps, direct, weights = _stacked(lin, pieces, n)
        v = sum(stop - start for _, start, stop in pieces)
        if group and sum(g[3] for g in group) + v > cap:
            yield group
            group = []
        group.append((lin.pull_reached(taps), direct, weights, v))
    if group:
        yield group


def _reached_parts(lin, group: List[_Pulled], names: Sequence[str], uses, n: int) -> Iterator[tuple]:
    """``(uses, names, (site columns, direct parts, weights))``: the read group's columns per set
    of parameters they reach. Per parameter, the batches are grouped by which of its sites they
    reach (and whether they carry its direct part), and each group is read with the parameter's
    uses cut to those sites: a batch that reaches none of a site has zero columns there
    (``J_pᵀ 0 = 0``), so leaving them out changes no sum ``Σ_v w_v (Σ_sites J_pᵀ m_v)²`` and
    saves reading (and joining) them; a pullback from taps high in the graph reaches only the
    sites below them, and a tied weight read by columns that reach one of its sites reads as
    that site's parameter alone."""
    parts: Dict[tuple, Dict[str, list]] = {}  # batches -> {name: its uses there}
    for name in names:
        u = uses.get(name, ())
        by_sites: Dict[tuple, List[int]] = {}
        for i, (pulled, direct, _, _) in enumerate(group):
            sites = tuple(j for j, (site, _) in enumerate(u) if pulled[site.key] is not None)
            if sites or name in direct:
                by_sites.setdefault((sites, name in direct), []).append(i)
        for (sites, _), batches in by_sites.items():
            parts.setdefault(tuple(batches), {})[name] = [u[j] for j in sites]
    for batches, cut in parts.items():
        part_uses = {**uses, **{name: u for name, u in cut.items() if u}}
        for name in [name for name, u in cut.items() if not u]:
            part_uses.pop(name, None)
        keys = {site.key for u in cut.values() for site, _ in u}
        yield part_uses, list(cut), _joined_group(lin, [group[i] for i in batches], keys, list(cut), n)


def _joined_group(lin, group: List[_Pulled], keys, names: Sequence[str], n: int) -> Tuple[List[Optional[Tensor]], Dict[str, Tensor], Weights]:
    """The batches' columns at the sites ``keys`` and direct parts of ``names`` joined along the
    columns (zeros where a batch has none there; ``None`` at the other sites)."""
    pulled: List[Optional[Tensor]] = [None] * len(group[0][0])
    for k in keys:
        parts = [g[0][k] for g in group]
        like = next((p for p in parts if p is not None), None)
        pulled[k] = parts[0] if len(parts) == 1 and like is not None else torch.cat(
            [lin.zeros_at(k, g[3], like) if p is None else p for p, g in zip(parts, group)])
    direct = {}
    for k in [k for k in names if any(k in g[1] for g in group)]:
        like = next(g[1][k] for g in group if k in g[1])
        direct[k] = like if len(group) == 1 else torch.cat(
            [g[1][k] if k in g[1] else like.new_zeros((g[3],) + tuple(like.shape[1:])) for g in group])
    weights = group[0][2] if len(group) == 1 else _joined_weights([(g[2], 0, g[3]) for g in group], n, lin.out.device)
    return pulled, direct, weights


def _square_sum(cols: Tensor, batch: bool, weights: Weights = 1.0, fresh: bool = False) -> Tensor:
    """``Σ_v w_v cols²`` per sample (``batch``) or ``Σ_v Σ_n w_vn cols²``, for ``cols [V, N, *p]``
    (``fresh``: made for this sum, squared in place where nothing differentiates it)."""
    plain = fresh and not cols.requires_grad and is_concrete(cols)
    squares = cols.square_() if plain else cols**2
    if isinstance(weights, tuple):
        weights = torch.tensor(weights, dtype=cols.dtype, device=cols.device).unsqueeze(1)
    if isinstance(weights, Tensor):
        squares = squares * weights.reshape(tuple(weights.shape) + (1,) * (cols.dim() - 2))
    elif weights != 1.0:
        squares = weights * squares
    return squares.sum(0) if batch else squares.sum((0, 1))


def _entries(lin, residual_grads, n: int) -> List[_Entry]:
    """Every residual's column sets (empty ones, which reach nothing trainable, left out); a
    node on rows that merge the batch (:func:`~curvlib._plan.batch_merges.per_sample`) keeps
    one set per sign."""
    out: List[_Entry] = []
    for res, g_z in zip(lin.residuals, residual_grads):
        sets = weighted_factor(res, g_z) if res.meta.get("merge") is None else per_sample(res, factor(res, g_z), n)
        for weights, tap_cols, direct in sets:
            if not tap_cols and not direct:
                continue
            taps = {res.taps[j]: cols for j, cols in tap_cols.items()}
            v = next(iter(tap_cols.values() if tap_cols else direct.values())).shape[0]
            out.append((res, taps, direct, v, weights))
    return out


def _weighted_reads(uses, pulled: List[Tensor], names: List[str], weights: Weights, request: DiagRequest) -> Dict[str, Tensor]:
    """``Σ_v w_v (J_pᵀ m_v)²`` (per sample: ``request.batch``) of the parameters in ``names`` read
    from columns of mixed signs as they are: those whose one site weights its Gram matrices
    (:attr:`~curvlib._core.site.Rule.weighted_squares_over_columns`) and those whose read forms
    the columns ``J_pᵀ m_v`` anyway (:func:`~curvlib._evaluate.read_off.weighted_diag`), with
    the columns' weights ``[V, N]`` or one number per column; none for weights of one number."""
    if not isinstance(weights, (tuple, Tensor)):
        return {}
    batch = request.batch
    out: Dict[str, Tensor] = {}
    by_site: Dict[int, object] = {}
    cache: Dict[tuple, object] = {}
    for name in names:
        u = uses.get(name, ())
        if not u:
            continue
        m = pulled[u[0][0].key]
        w = weights if isinstance(weights, Tensor) else \
            torch.tensor(weights, dtype=m.dtype, device=m.device).unsqueeze(1).expand(-1, m.shape[1])
        site, role = u[0]
        if len(u) == 1 and site.rule.weighted_squares_over_columns is not None and site.key not in by_site:
            roles = [r for r, p in site.params.items() if len(uses.get(p, ())) == 1]
            by_site[site.key] = site.rule.weighted_squares_over_columns(site, m, roles, w, batch)
        if len(u) == 1 and role in (by_site.get(site.key) or {}):
            out[name] = by_site[site.key][role]
            continue
        part = weighted_diag(uses, pulled, name, request.params[name].numel(), w, batch, cache)
        if part is not None:
            out[name] = part
    return out


def _halves(pulled: List[Tensor], weights: Weights, n: int, keys=None) -> Iterator[Tuple[float, List[Optional[Tensor]]]]:
    """``(sign, site columns)`` of one sign each, of the sites ``keys`` (all by default; ``None``
    at the others, and where ``pulled`` has none):
    the batch as it is for one weight (a number), else, per sign, every sample's columns of that
    sign moved to the front (one stable sort per sample) and the rows past the sample's count
    zeroed: ``[P, N, ...]`` with ``P`` the largest count of any sample."""
    keys = range(len(pulled)) if keys is None else keys
    if isinstance(weights, tuple):  # a number per column: the columns of each, as they are
        device = next(t for t in pulled if t is not None).device
        for w in sorted(set(weights), reverse=True):
            at = torch.tensor([i for i, x in enumerate(weights) if x == w], device=device)
            yield w, [t.index_select(0, at) if k in keys and t is not None else None for k, t in enumerate(pulled)]
        return
    if not isinstance(weights, Tensor):
        yield weights, pulled
        return
    pos = weights > 0  # [V, N]
    count = pos.sum(0)  # [N]
    order = torch.argsort((~pos).to(torch.uint8), dim=0, stable=True)  # per sample: positive ones first
    v = weights.shape[0]
    hi, lo = int(count.max()), int(count.min())
    samples = torch.arange(n, device=weights.device)
    for sign, start, stop in ((1.0, 0, hi), (-1.0, lo, v)):
        if stop <= start:
            continue
        at = torch.arange(start, stop, device=weights.device).unsqueeze(1)
        keep = (at < count) if sign > 0 else (at >= count)  # [P, N]
        rows = (order[start:stop] * n + samples).flatten()  # entry (p, s): row idx·N + s of [V·N, ...]
        drop = None if bool(keep.all()) else (~keep).flatten().nonzero().squeeze(1)
        yield sign, [_picked(t, rows, drop, stop - start) if k in keys and t is not None else None
                     for k, t in enumerate(pulled)]


def _picked(t: Tensor, rows: Tensor, drop: Optional[Tensor], p: int) -> Tensor:
    """Rows ``rows`` of ``t [V, N, ...]`` seen as ``[V·N, ...]``, those in ``drop`` zeroed: ``[P, N, ...]``."""
    flat = t.reshape((-1,) + tuple(t.shape[2:])).index_select(0, rows)
    if drop is not None:
        flat = flat.index_fill(0, drop, 0)
    return flat.reshape((p,) + tuple(t.shape[1:]))


def _packed(entries: List[_Entry], cap: int, sizes: Optional[Sequence[int]] = None) -> List[list]:
    """Batches of at most ``cap`` columns: lists of ``(entry, start, stop)`` (a slice of the
    entry's columns; a set larger than ``cap`` split into slices of ``cap``), every column once.

    A batched pullback runs the backward from the highest of its taps down, for every column of
    the batch (zeros included), and each node of it costs a fixed overhead besides: its cost is
    modelled as ``PULL_OVERHEAD · k + columns · e`` with ``k`` the taps recorded up to the top
    one (forward order: a measure of the nodes below it) and ``e`` their entries (``sizes``, the
    taps' entries; by default one each). The slices, ordered by their top tap, are cut into
    consecutive batches of least total cost (dynamic programming over the cut points)."""
    pieces = [(e, a, min(e[3], a + cap)) for e in entries for a in range(0, e[3], cap)]
    pieces.sort(key=lambda p: max(p[0][1], default=0))
    cum = list(itertools.accumulate(sizes if sizes is not None else [1] * (1 + max(
        (t for e in entries for t in e[1]), default=0))))
    top = [max(p[0][1], default=0) for p in pieces]
    best, cut = [0.0] * (len(pieces) + 1), [0] * (len(pieces) + 1)
    for j in range(1, len(pieces) + 1):  # best[j]: the first j slices in batches
        best[j], cols = float("inf"), 0
        k = top[j - 1]  # (the highest tap of any batch ending at slice j - 1)
        for i in range(j - 1, -1, -1):  # the last batch: slices i..j-1
            cols += pieces[i][2] - pieces[i][1]
            if cols > cap and i < j - 1:
                break
            cost = best[i] + PULL_OVERHEAD * (k + 1) + cols * cum[k]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    batches, j = [], len(pieces)
    while j:
        batches.append(pieces[cut[j]:j])
        j = cut[j]
    return batches[::-1]


def _stacked(lin, pieces, n: int) -> Tuple[Dict[int, Tensor], Dict[str, Tensor], Weights]:
    """The batch's columns ``{tap: [V, *a]}``, direct parts ``{param: [V, N, *p]}`` and weights,
    each piece's columns in its rows and zeros in the others' (one piece: its own tensors, no
    copy; one number when every piece has that weight for all its columns, else ``[V, N]``)."""
    if len(pieces) == 1:
        (_, taps, direct, _, w), start, stop = pieces[0]
        weights = w[start:stop] if isinstance(w, Tensor) else w
        return ({t: c[start:stop] for t, c in taps.items()}, {k: d[start:stop] for k, d in direct.items()}, weights)
    tap_ids = {t for (_, taps, _, _, _), _, _ in pieces for t in taps}
    names = {k for (_, _, direct, _, _), _, _ in pieces for k in direct}
    taps = {t: _joined(pieces, lambda e: e[1].get(t), tuple(lin.taps[t].shape)) for t in sorted(tap_ids)}
    direct = {}
    for k in names:
        shape = next(tuple(e[2][k].shape[1:]) for e, _, _ in pieces if k in e[2])
        direct[k] = _joined(pieces, lambda e: e[2].get(k), shape)
    return taps, direct, _joined_weights([(e[4], start, stop) for e, start, stop in pieces], n, lin.out.device)


def _joined_weights(parts, n: int, device) -> Weights:
    """Weights ``(w, start, stop)`` joined: one number if all parts have it, a tuple of one number
    per column if all are numbers (the signs known without reading any value), else ``[V, N]``."""
    ws = [w for w, _, _ in parts]
    if not any(isinstance(w, Tensor) for w in ws):
        cols = tuple(x for w, a, b in parts for x in (w[a:b] if isinstance(w, tuple) else (w,) * (b - a)))
        return cols[0] if len(set(cols)) == 1 else cols
    return torch.cat([w[a:b].to(device) if isinstance(w, Tensor) else
                      torch.tensor(w[a:b] if isinstance(w, tuple) else (w,) * (b - a), device=device)
                      .unsqueeze(1).expand(b - a, n) for w, a, b in parts])


def _joined(pieces, cols_of, shape: tuple) -> Tensor:
    """``torch.cat`` over the pieces of ``cols_of(entry)[start:stop]``, zeros ``[stop - start,
    *shape]`` where the entry has none (``cat``, not writes into a buffer: the columns may be
    batched under a torch.func transform or carry autograd)."""
    parts = [None if cols_of(e) is None else cols_of(e)[start:stop] for e, start, stop in pieces]
    like = next(p for p in parts if p is not None)
    return torch.cat([like.new_zeros((stop - start,) + shape) if p is None else p
                      for p, (_, start, stop) in zip(parts, pieces)])
