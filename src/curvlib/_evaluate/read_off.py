"""Per-parameter read-offs of the GGN family from pulled-back root columns ``m [V, *site_out]``.

Given the columns at every site a parameter is used by (``m_by_site``), each function returns one
parameter's quantity (see :mod:`curvlib._evaluate.second_order` for the formulas): the square-root
columns ``[V, N, *p]``, the diagonal ``Σ_v Σ_n (J_pᵀ m_v)_n²``, the batch diagonal, or Kronecker
factors. A parameter used by several sites sums ``J_pᵀ m`` over its sites before any square.
``cache`` shares a site's per-column pieces between the parameters it reads (weight and bias).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch import Tensor
from torch.func import vmap

from .._core import settings
from .._core.tensors import is_concrete
from ..rules import FAMILY_OF, fixed_rows, kron_factors, kron_input_factor, kron_layout, kron_weight_output, linear
from ..rules.fixed_rows import tied_across_layers
from . import opaque_kron

__all__ = ["sqrt_columns", "diag", "batch_diag", "weighted_diag", "kronecker_factors", "root_last",
           "ColumnStatistic", "column_statistic"]


def sqrt_columns(uses, m_by_site, name) -> Tensor:
    """``[V, N, *p]``: ``Σ_sites J_pᵀ m_v`` per sample."""
    total = None
    for site, role in uses[name]:
        m = m_by_site[site.key]
        if site.rule.grad_batch_columns is not None:  # all columns in one batched call
            part = site.rule.grad_batch_columns(site, m, [role]).get(role)
        elif (settings.current().loop_sqrt_columns and is_concrete(m) and not _one_outer_product(site, m)
              and not site.rule.vmap_columns):
            # column by column into one buffer: the rules' own batched kernels (e.g. the
            # grouped convolution of a convolution's per-sample gradients) instead of
            # their vmapped versions (a Linear without shared positions stays vmapped:
            # there all columns are one broadcast product)
            part = None
            for v in range(m.shape[0]):
                col = site.rule.grad_batch(site, m[v], [role])[role]
                if part is None:
                    part = col.new_empty((m.shape[0],) + tuple(col.shape))
                part[v] = col
        else:
            part = vmap(lambda mv: site.rule.grad_batch(site, mv, [role])[role])(m)
        if part is None:
            continue
        total = part if total is None else total.add_(part)
    return total


def _one_outer_product(site, m: Tensor) -> bool:
    """A site whose per-sample weight gradient is a single outer product (``g_n x_nᵀ``: the
    rule's ``outer_factors``), which one batched product computes for all columns at once."""
    return site.rule.outer_factors is not None and site.rule.outer_factors(site, "weight", m[:1]) is not None


def _rows(site):
    """The parameter row each output position reads, for a bias at fixed rows (else ``None``)."""
    row_map = FAMILY_OF[site.rule.kind].row_map
    return row_map(site) if row_map is not None else None


def diag(uses, m_by_site, name, params, cache=None) -> Tensor:
    """``Σ_v Σ_n (J_pᵀ m_v)²``, via the rule's sum of squares for single-use parameters.

    ``cache`` (a dict, per chunk of columns) lets the parameters of one site share a
    single rule call: the rule is asked for all the site's roles at once.
    """
    u = uses.get(name, [])
    if not u:
        return torch.zeros_like(params[name])
    if len(u) == 1:
        site, role = u[0]
        rule = site.rule
        m = m_by_site[site.key]
        rows = _rows(site)
        if rows is not None:  # a bias-like parameter (learned positions): a scatter of m
            return fixed_rows.squares_per_sample(site, rows, m).sum(0)
        if rule.sum_squares_over_columns is not None:
            per_role = _per_site(cache, site, uses, "diag", lambda roles: rule.sum_squares_over_columns(site, m, roles))
            return _column_sum(per_role[role])
        if rule.sum_grad_squared is not None:
            # one column at a time: a rule may form [N, *p] per column (convolutions); no
            # `0 + first column` copy (an embedding's [V, D]: large for a language model's vocabulary)
            total = rule.sum_grad_squared(site, m[0], [role])[role]
            for k in range(1, m.shape[0]):
                total = total + rule.sum_grad_squared(site, m[k], [role])[role]
            return total
        if rule.vmap_columns:
            return (_site_columns(cache, site, uses, m)[role] ** 2).sum((0, 1))
    return _column_squares(uses, m_by_site, name, params[name].numel(), (0, 1))


def _column_squares(uses, m_by_site, name, numel: int, dims, weights: Optional[Tensor] = None) -> Tensor:
    """``Σ_dims (Σ_sites J_pᵀ m_v)²`` (``dims``: ``(0, 1)``, columns and samples, or ``0``; with
    ``weights [V, N]`` each square weighted, ``Σ_v w_vn (·)²``) from :func:`sqrt_columns` of blocks of
    columns, each ``[v, N, *p]`` at most
    :attr:`~curvlib._core.settings.Settings.linear_squares_entries` entries (one column if even that
    is larger)."""
    m0 = m_by_site[uses[name][0][0].key]
    entries = settings.current().linear_squares_entries
    step = max(1, entries // max(m0.shape[1] * numel, 1)) if m0.dim() > 1 else m0.shape[0]
    total = None
    for a in range(0, m0.shape[0], step):
        block = {site.key: m_by_site[site.key][a:a + step] for site, _ in uses[name]}
        squares = _squares(sqrt_columns(uses, block, name))
        if weights is not None:
            w = weights[a:a + step]
            squares = squares * w.reshape(tuple(w.shape) + (1,) * (squares.dim() - 2)).to(squares.dtype)
        part = squares.sum(dims)
        total = part if total is None else total + part
    return total


def weighted_diag(uses, m_by_site, name, numel: int, weights: Tensor, per_sample: bool,
                  cache=None) -> Optional[Tensor]:
    """``Σ_v w_vn (J_pᵀ m_v)²`` for weights ``[V, N]`` (``per_sample``: ``[N, *p]``, else summed over
    the samples; ``numel``: the parameter's entries) where the read forms the columns ``J_pᵀ m_v`` anyway, so that weighting each
    square costs no more than summing it: a parameter of one site whose rule is vmapped over
    columns and has no faster sum of squares (the site's columns shared through ``cache``) or,
    per sample, forms all its columns in one batched call, or a parameter of several sites
    whose columns all come vmapped or in one batched call; ``None`` otherwise."""
    u = uses.get(name, ())
    if len(u) == 1:
        site, role = u[0]
        rule = site.rule
        if _rows(site) is not None or getattr(rule, "batch_sum_squares_over_columns", None) is not None:
            return None
        if per_sample and not rule.vmap_columns and rule.grad_batch_columns is not None:
            return _column_squares(uses, m_by_site, name, numel, 0, weights)  # (as batch_diag reads it)
        if not rule.vmap_columns or rule.sum_squares_over_columns is not None or rule.sum_grad_squared is not None:
            return None
        cols = _site_columns(cache, site, uses, m_by_site[site.key])[role]
        squares = cols**2 * weights.reshape(tuple(weights.shape) + (1,) * (cols.dim() - 2)).to(cols.dtype)
        return squares.sum(0) if per_sample else squares.sum((0, 1))
    if u and all(site.rule.vmap_columns or site.rule.grad_batch_columns is not None for site, _ in u):
        return _column_squares(uses, m_by_site, name, numel, 0 if per_sample else (0, 1), weights)
    return None


def _squares(cols: Tensor) -> Tensor:
    """``cols²`` for columns :func:`sqrt_columns` formed, squared in place where nothing
    differentiates them (no second ``[V, N, *p]``)."""
    if cols.requires_grad or not is_concrete(cols):
        return cols**2
    return cols.square_()


def _site_columns(cache, site, uses, m: Tensor) -> Dict[str, Tensor]:
    """``{role: [V, N, *p]}``, ``J_pᵀ m_v`` per sample for all single-use roles of a site whose
    rule is vmapped over columns (a functional site: one vector-Jacobian product of the
    node gives every parameter it reads, instead of one per parameter)."""
    return _per_site(cache, site, uses, "columns", lambda roles: vmap(lambda mv: site.rule.grad_batch(site, mv, roles))(m))


def _column_sum(t: Tensor) -> Tensor:
    """Sum over the leading column dim; a view when there is one column (no copy of ``[*p]``)."""
    return t[0] if t.shape[0] == 1 else t.sum(0)


def _single_roles(site, uses) -> List[str]:
    """The roles of ``site`` whose parameters have no other use."""
    return [role for role, name in site.params.items() if len(uses.get(name, ())) == 1]


def _per_site(cache, site, uses, what: str, compute):
    """``compute(roles)`` for all single-use roles of ``site``, once per ``cache``."""
    if cache is None:
        return compute(_single_roles(site, uses))
    key = (what, site.key)
    if key not in cache:
        cache[key] = compute(_single_roles(site, uses))
    return cache[key]


def batch_diag(uses, m_by_site, name, params, n, cache=None) -> Tensor:
    """``Σ_v (J_pᵀ m_v)²`` per sample ``[N, *p]``, without forming ``[V, N, *p]``."""
    u = uses.get(name, [])
    if not u:
        return params[name].new_zeros((n,) + tuple(params[name].shape))
    if len(u) == 1:
        site, role = u[0]
        rows = _rows(site)
        if rows is not None:  # a bias-like parameter (learned positions): a scatter of m
            return fixed_rows.squares_per_sample(site, rows, m_by_site[site.key])
        fast = getattr(site.rule, "batch_sum_squares_over_columns", None)
        if fast is not None:
            m = m_by_site[site.key]
            return _per_site(cache, site, uses, "batch_diag", lambda roles: fast(site, m, roles))[role]
        if site.rule.vmap_columns:
            return (_site_columns(cache, site, uses, m_by_site[site.key])[role] ** 2).sum(0)
    if all(site.rule.vmap_columns or site.rule.grad_batch_columns is not None for site, _ in u):
        return _column_squares(uses, m_by_site, name, params[name].numel(), 0)
    v = m_by_site[u[0][0].key].shape[0]
    total = None
    for k in range(v):  # one column at a time: memory [N, *p]
        col = sum(site.rule.grad_batch(site, m_by_site[site.key][k], [role])[role] for site, role in u)
        total = col**2 if total is None else total + col**2
    return total


@dataclass
class ColumnStatistic:
    """A parameter's GGN diagonal (``per_sample``: batch diagonal) still as its site's statistic of
    the columns read so far (:attr:`~curvlib._core.site.Rule.column_statistic`), additive over
    them; :meth:`result` squares once."""

    site: object
    role: str
    per_sample: bool
    value: Tensor

    def result(self) -> Tensor:
        return self.site.rule.column_squares(self.site, self.value, [self.role], self.per_sample)[self.role]


def column_statistic(uses, m_by_site, name, per_sample: bool) -> Optional[ColumnStatistic]:
    """``name``'s diagonal read-off of the columns ``m_by_site`` as a :class:`ColumnStatistic`, for a
    parameter of one site whose rule has one (``None`` otherwise: read it with :func:`diag` /
    :func:`batch_diag`)."""
    u = uses.get(name, [])
    if len(u) != 1 or u[0][0].rule.column_statistic is None or _rows(u[0][0]) is not None:
        return None
    (site, role), = u
    value = site.rule.column_statistic(site, m_by_site[site.key])
    return None if value is None else ColumnStatistic(site, role, per_sample, value)


def kronecker_factors(uses, m_by_site, name, cache=None, approx=None, max_dim=None) -> List[Tensor]:
    """Kronecker factors, one per dim of the parameter: ``[B, A]`` for a Linear weight
    ``[out, in]``, ``[A, B]`` for one stored transposed (GPT-2's ``Conv1D``, see
    ``rules.linear.LINEAR_TRANSPOSED``); see :func:`_kron_stored`. ``max_dim``: the
    extension's ``max_factor_dim`` (a larger side gets a 1-D, diagonal, factor)."""
    u = uses[name]
    flipped = [site.meta.get("transposed", False) and role == "weight" for site, role in u]
    if any(flipped) and (len(u) > 1):  # a transposed weight also used elsewhere: its exact block (or diagonal)
        return fixed_rows.generic_block(u, m_by_site, lambda: sqrt_columns(uses, m_by_site, name), approx, max_dim)
    factors = _kron_stored(uses, m_by_site, name, cache, approx, max_dim)
    return factors[::-1] if any(flipped) else factors


def _kron_stored(uses, m_by_site, name, cache=None, approx=None, max_dim=None) -> List[Tensor]:
    """Kronecker factors in the sites' own layout; a Linear weight used by several sites treats the uses like
    positions sharing the weight (:func:`curvlib.rules._linear_kron.kron_shared`).

    With a ``cache``, a site's output factor ``B`` (the same for its weight and bias)
    is formed once per chunk of columns, and its input factor ``A`` (independent of
    the columns) once per call. ``approx``: ``None``, ``"expand"`` or ``"reduce"``
    (for every use of a shared Linear weight, as positions).
    """
    u = uses[name]
    if len(u) == 1 and opaque_kron.covers(*u[0]):  # a Linear inside a module run whole
        (site, role), = u
        return opaque_kron.factors(site, role, m_by_site[site.key], {} if cache is None else cache, approx, max_dim)
    if not all(kron_layout(site) for site, _ in u) or (len(u) > 1 and tied_across_layers(u)):
        # normalisations, generic parameters, tied weights: the exact block, its diagonal, or
        # Embedding's layout at fixed rows for bias-like ones (curvlib.rules.fixed_rows)
        return fixed_rows.generic_block(u, m_by_site, lambda: sqrt_columns(uses, m_by_site, name), approx, max_dim)
    if len(u) == 1:
        ((site, role),) = u
        if cache is None or kron_layout(site) == "own":
            return kron_factors(site, role, m_by_site[site.key], approx, max_dim)
        B = _cached(cache, ("kron_B", site.key, approx, max_dim),
                    lambda: kron_factors(site, "bias", m_by_site[site.key], approx, max_dim)[0])
        if role == "bias":
            return [B]
        static = cache.setdefault("static", {})
        return [kron_weight_output(site, B), _cached(static, ("kron_A", site.key, approx, max_dim),
                                                     lambda: kron_input_factor(site, approx, max_dim))]
    return linear.kron_shared([(site, m_by_site[site.key]) for site, _ in u], u[0][1], approx, max_dim)


def root_last(uses, name: str) -> bool:
    """Whether ``name``'s root factor comes last: Embedding's ``[A [V], B]`` (also at fixed
    rows) and a weight stored transposed (``[A, B]``, :func:`kronecker_factors`). Shapes alone cannot
    tell: a Linear weight's ``B`` may be diagonal (``[B [O], A]``), a transposed one's ``A``."""
    u = uses.get(name, ())
    if len(u) == 1 and u[0][0].meta.get("transposed", False) and u[0][1] == "weight":
        return True
    return any(FAMILY_OF[site.rule.kind].root_last for site, _ in u)


def _cached(cache: dict, key, compute):
    if key not in cache:
        cache[key] = compute()
    return cache[key]
