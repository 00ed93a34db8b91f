"""The Hessian diagonal of a dense residual's free parameters, without their dense blocks.

A parameter ``p`` of a dense node ``z = f(θ, x)`` that none of the node's inputs depends on
(``free``, :func:`curvlib._hessian.dense_node.own_parameters`) enters the Hessian diagonal
through its own block ``R_pp = ∇²_p (gᵀ z)`` per sample alone: its couplings with the inputs
and the other parameters fall in off-diagonal blocks of the Hessian. The diagonal of ``R_pp``
comes from Hessian-vector products of the node, never ``|p| × |p|`` entries: an MoE layer's
expert weights (``[E, 2I, D]``, one opaque module), a standardised convolution's weight.

One product per *colour*: the tangent of colour ``k`` is one-hot at entry ``k`` of every
row of ``p`` along dim 0 when ``R_pp`` is block-diagonal over those rows (the row's block
sees only its own one-hot, so entry ``(i, k)`` of the product is ``(R_pp)_{ik,ik}``), else at
entry ``k`` of ``p`` alone: ``|p| / rows`` or ``|p|`` products per sample. The rows are
separate where :func:`curvlib._hessian.rows.separable_rows` reads it off the chain, or where
the node's products say so: one product per row with a random tangent ``t_i`` supported on
row ``i`` (fixed seed); ``R_pp t_i`` zero outside row ``i`` for every ``i`` and sample means
``R_{i'i} t_i = 0``, so ``R_{i'i} = 0`` (a non-zero matrix maps a random vector to zero with
probability 0; the zeros are exact, as autograd gives a coupling that does not exist). Every
product zero means ``R_pp = 0`` (a node linear in ``p``): no columns. The probes read values;
where derivatives flow through the result or values cannot be read (a traced or batched
call), only the chain's structure is used. The products go forward over reverse, or
reverse over reverse where a node operation has no forward mode, once they pass the symmetry
check (:mod:`curvlib._core.reverse`).

The Hessian diagonal reads a free parameter's columns only through the sum of their
squares, so two signed columns ``√(diag R_pp)±`` per sample are exact for it; the
eigenvalue-modified operator (PCHMP) forms the blocks dense instead
(:func:`curvlib._hessian.algebra.positive_curvature`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator, List, Optional

import torch
from torch import Tensor
from torch.func import grad, jvp, vjp, vmap

from .._core import settings
from .._core.errors import CurvatureError, missing_forward_mode
from .._core.reverse import check_symmetric, missing_forward_mode_reason
from .._core.sync import LOCK
from .._core.tensors import is_concrete
from ..rules.generic import map_samples
from .smooth import diag_pair, flows

__all__ = ["free_sets", "check_free_block_cost"]

#: Tangent entries per sample in one batch of Hessian-vector products (memory: a chunk of colours).
_HVP_ENTRIES = 2**22

#: The seed of the row probes' random tangents (fixed: the same call gives the same columns).
_PROBE_SEED = 20261129


def _front(t: Tensor, dim: int) -> Tensor:
    return t if dim == 0 else t.movedim(dim, 0)


def _back(t: Tensor, dim: int) -> Tensor:
    return t if dim == 0 else t.movedim(0, dim)


def free_sets(res, g: Tensor):
    """``(column sets of the free parameters, the residual left for the dense path or None)``:
    each free parameter by :func:`_diagonal_columns`; the rest dense, unless nothing is left
    (no coupled parameter, and no input or ``meta["zero_inputs"]``: the input block is zero,
    :func:`curvlib._hessian.rows.linear_in_inputs`)."""
    sets = [c for name in res.free for c in _diagonal_columns(res, g, name)]
    params = {k: v for k, v in res.params.items() if k not in res.free}
    if not params and (res.meta.get("zero_inputs") or not res.inputs):
        return sets, None
    rest = replace(res, params=params, free=(), meta={**res.meta, "rows": (), "zero_inputs": False})
    return sets, rest


def check_free_block_cost(where: str, name: str, p: Tensor, n: int) -> None:
    """Refuse (at planning) a free parameter whose diagonal takes more than
    :attr:`~curvlib._core.settings.Settings.max_free_block_products` Hessian-vector products of
    the node over the batch at best (``N · |p| / rows``, rows separate along dim 0)."""
    limit = settings.current().max_free_block_products
    colours = p.numel() // p.shape[0] if p.dim() >= 2 and p.shape[0] > 1 else p.numel()
    if n * colours > limit:
        raise CurvatureError(
            f"The Hessian extensions need the diagonal of the second derivative of graph node '{where}' "
            f"in its parameter '{name}' (shape {list(p.shape)}): at least {colours} Hessian-vector products "
            f"of the node per sample here (N={n}), too many (limit: N·products ≤ {limit}, "
            "curvlib._core.settings.Settings.max_free_block_products). Use the GGN extensions (DiagGGNExact, "
            "BatchDiagGGNExact) or HMP (exact Hessian-vector products) for this model.")


def _diagonal_columns(res, g: Tensor, name: str) -> list:
    """``[(+1, {}, {name: √d₊ [1, N, *p]}), (-1, {}, {name: √d₋})]`` with ``d = diag R_pp`` per
    sample (module doc), or ``[]`` where ``R_pp = 0``."""
    p = res.params[name]
    hvps = _SampleProducts(res, g, name)
    rows = p.shape[0] if name in res.meta.get("rows", ()) and p.dim() else None
    if rows is None:
        rows = hvps.probe_rows()
        if rows == 0:
            return []
    d = 0
    for colours in _colours(p, rows):
        d = d + (hvps(colours) * colours).sum(1)  # [N, *p]: each colour's own entries
    plus, minus = diag_pair(d) if flows(d) else (d.clamp(min=0).sqrt(), (-d).clamp(min=0).sqrt())
    return [(1.0, {}, {name: plus.unsqueeze(0)}), (-1.0, {}, {name: minus.unsqueeze(0)})]


def _colours(p: Tensor, rows: Optional[int]) -> Iterator[Tensor]:
    """One-hot tangents ``[C, *p]`` in chunks: at entry ``k`` of every row (``rows``: ``p``'s
    dim-0 size) or of ``p`` (``rows`` 1 or ``None``)."""
    separate = bool(rows and rows > 1)
    shape = tuple(p.shape[1:]) if separate else tuple(p.shape)
    k = max(1, p.numel() // rows) if separate else p.numel()
    chunk = max(1, _HVP_ENTRIES // max(p.numel(), 1))
    for start in range(0, k, chunk):
        c = min(chunk, k - start)
        one_hot = torch.zeros(c, k, dtype=p.dtype, device=p.device)
        one_hot[torch.arange(c, device=p.device), torch.arange(start, start + c, device=p.device)] = 1
        if separate:
            yield one_hot.reshape((c, 1) + shape).expand((c,) + tuple(p.shape))
        else:
            yield one_hot.reshape((c,) + shape)


class _SampleProducts:
    """``R_pp t`` per sample for tangents ``[C, *p]`` -> ``[N, C, *p]`` (``R_pp`` of sample ``n``
    with its inputs, fixed inputs and output gradient)."""

    def __init__(self, res, g: Tensor, name: str):
        self.res, self.name, self.p = res, name, res.params[name]
        self.g = _front(g, res.out_dim)
        self.xs = [_front(a, d) for a, d in zip(res.inputs, res.in_dims)]
        fixed, dims = list(res.meta.get("fixed", ())), tuple(res.meta.get("fixed_dims", ()))
        self.fixed, self.fixed_dims = fixed, list(dims + (None,) * (len(fixed) - len(dims)))
        self.reverse = False  # reverse over reverse: a node operation has no forward mode

    def __call__(self, tangents: Tensor) -> Tensor:
        if not self.reverse:
            try:
                return self._products(tangents)
            except NotImplementedError as exc:
                if not missing_forward_mode(exc):
                    raise
                self.reverse = True
                # (symmetry of Σ_n R_n: the check's products summed over the samples)
                check_symmetric(lambda u: {"p": self._products(u["p"].unsqueeze(0)).sum((0, 1))}, {"p": self.p},
                                f"The Hessian diagonal at graph node '{self.res.where}'", missing_forward_mode_reason(exc))
        return self._products(tangents)

    def _products(self, tangents: Tensor) -> Tensor:
        res, name, p = self.res, self.name, self.p
        reverse = self.reverse

        def products(xs_n, g_n, fixed_n):
            # one sample, a batch of one in each input's own batch dimension
            inputs = [_back(x.unsqueeze(0), d) for x, d in zip(xs_n, res.in_dims)]
            ids = [f if d is None else f.unsqueeze(d) for f, d in zip(fixed_n, self.fixed_dims)]

            def contracted(q):
                return (_front(res.phi({name: q}, *inputs, fixed=ids), res.out_dim).squeeze(0) * g_n).sum()

            if reverse:  # H t = ∇⟨∇f, t⟩ (module doc of curvlib._core.reverse)
                _, pull = vjp(grad(contracted), p)
                return vmap(lambda t: pull(t)[0])(tangents)
            return vmap(lambda t: jvp(grad(contracted), (p,), (t,))[1])(tangents)

        with LOCK:  # forward-over-reverse: forward-mode AD state is process-wide
            return map_samples(products, (0, 0, self.fixed_dims))(self.xs, self.g, self.fixed)

    def probe_rows(self) -> Optional[int]:
        """0 where ``R_pp = 0`` in every sample, ``p``'s dim-0 size where its rows are separate
        in every sample, else ``None`` (module doc); ``None`` where values cannot be read."""
        p = self.p
        readable = all(is_concrete(t) and not flows(t) for t in (self.g, *self.xs))
        if not readable or p.numel() == 0:
            return None
        rows = p.shape[0] if p.dim() >= 2 and p.shape[0] > 1 else 1
        if rows * p.numel() > 2 * _HVP_ENTRIES:
            return None  # (the probes' tangents: a row's noise per row)
        gen = torch.Generator(device=p.device).manual_seed(_PROBE_SEED)
        noise = torch.randn(p.shape, generator=gen, dtype=p.dtype, device=p.device)
        support = torch.eye(rows, dtype=p.dtype, device=p.device).reshape((rows, rows) + (1,) * (p.dim() - 1))
        tangents = (support * noise) if rows > 1 else noise.unsqueeze(0)  # [rows, *p]: row i's noise
        chunk = max(1, _HVP_ENTRIES // p.numel())
        out = torch.cat([self(t) for t in torch.split(tangents, chunk)], dim=1)  # [N, rows, *p]
        if not out.any():
            return 0
        if rows == 1:
            return None
        outside = out.reshape(out.shape[:2] + (rows, -1)) * (1 - support.reshape(1, rows, rows, 1))
        return rows if not outside.any() else None
