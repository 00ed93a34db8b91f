"""Factored residuals of attention's nonlinear nodes: softmax rows and matrix products.

Both are exact and never form the dense per-sample ``(D × D)`` residual that
:mod:`curvlib._hessian.algebra` builds for other nodes.

**Softmax** ``s = softmax(a)`` along one axis (rows independent). Per row, with
``c = gᵀ s`` and ``b = s ⊙ (g − c)``:

    ∇_a (gᵀ s) = b,     R_row = ∇²_a (gᵀ s) = diag(b) − b sᵀ − s bᵀ

(differentiate ``b = s ⊙ g − (gᵀ s) s`` with ``∂s/∂a = diag(s) − s sᵀ``). ``R`` is
block-diagonal over rows: only ``[rows, S, S]`` per sample (``S`` the softmax
length), eigendecomposed row by row.

**Matrix product** ``z = X Y`` of two graph tensors, ``X [*B, T, K]``,
``Y [*B, K, S]`` (same leading dims ``B``, batch among them). With
``G = ∂L/∂z [*B, T, S]``, ``gᵀ(XY)`` is bilinear: per leading index
``R = [[0, G ⊗ I_K], [(G ⊗ I_K)ᵀ, 0]]`` over ``(X, Y)``, i.e.
``∂²/∂X_tk ∂Y_k's = g_ts δ_kk'``. From the SVD ``G = U Σ Vᵀ`` its eigenpairs are
``±σ_j`` with vectors ``(u_j ⊗ e_k, ±v_j ⊗ e_k)/√2``, so

* signed columns (Hessian diagonal): ``(u_j e_kᵀ, ±e_k v_jᵀ) √(σ_j/2)``, one pair per
  ``(b, j, k)``;
* ``|R| = diag(√(GGᵀ) ⊗ I, √(GᵀG) ⊗ I)``, ``clip(R) = (|R| + R)/2`` with
  ``R (t_X, t_Y) = (G t_Yᵀ, t_Xᵀ G)`` (PCHMP).

Signed columns are :class:`LazyColumns`: a chunk of columns is built when it is
pulled back (memory ``chunk × N × input``, never all columns at once).
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch
from torch import Tensor

from .._core.errors import CurvatureError
from .smooth import flows, polarised, row_scale
from .._core import linalg


def _front(t: Tensor, dim: int, lead: int = 0) -> Tensor:
    return t if dim == 0 else t.movedim(lead + dim, lead)


def _back(t: Tensor, dim: int, lead: int = 0) -> Tensor:
    return t if dim == 0 else t.movedim(lead, lead + dim)


class LazyColumns:
    """``V`` columns ``[V, *shape]`` built slice by slice (``cols[a:b]``) by ``make(start, stop)``."""

    def __init__(self, v: int, make: Callable[[int, int], Tensor]):
        self.shape = (v,)
        self._make = make

    def __getitem__(self, sl: slice) -> Tensor:
        start, stop, _ = sl.indices(self.shape[0])
        return self._make(start, stop)


def one_hot_columns(scale: Tensor, dim: int) -> LazyColumns:
    """``[D, *scale.shape]`` lazily: column ``k`` is ``scale`` (batch in front) at entry ``k`` of
    every sample's slice and zero elsewhere, moved to batch dim ``dim``; ``D`` = entries per
    sample (an element-wise residual's ``e_k √r±``: built chunk by chunk, never ``D × D``)."""
    d = scale[0].numel()
    entries = torch.arange(d, device=scale.device)

    def make(start, stop):
        hot = (torch.arange(start, stop, device=scale.device).unsqueeze(1) == entries).to(scale.dtype)  # [C, D]
        return _back(hot.reshape((stop - start, 1) + tuple(scale.shape[1:])) * scale, dim, 1)

    return LazyColumns(d, make)


# ----------------------------------------------------------------------------- softmax


class _Rows:
    """A softmax input in the layout ``[N, rows, S]`` and back (batch dim ``bdim``, axis ``axis``)."""

    def __init__(self, a: Tensor, bdim: int, axis: int):
        axis = axis % a.dim()
        if axis == bdim:
            raise CurvatureError("softmax along the batch dim mixes samples; curvlib cannot factor it.")
        self.bdim, self.axis = bdim, (axis + 1 if axis < bdim else axis)  # axis after the batch moved to 0
        moved = _front(a, bdim).movedim(self.axis, -1)
        self.moved_shape = tuple(moved.shape)

    def rows(self, t: Tensor) -> Tensor:
        return _front(t, self.bdim).movedim(self.axis, -1).reshape(self.moved_shape[0], -1, self.moved_shape[-1])

    def back(self, t: Tensor, lead: int = 0) -> Tensor:
        """``[*lead, N, rows, S]`` -> the input's own layout."""
        t = t.reshape(tuple(t.shape[:lead]) + self.moved_shape).movedim(-1, lead + self.axis)
        return _back(t, self.bdim, lead)


def softmax_residual(res, g: Tensor) -> Tuple[_Rows, Tensor]:
    """``(layout, R [N, rows, S, S])``: the per-row residuals (module doc)."""
    a = res.inputs[0]
    layout = _Rows(a, res.in_dims[0], res.meta["axis"])
    s = layout.rows(torch.softmax(a, res.meta["axis"], dtype=res.meta.get("dtype")))
    gr = layout.rows(g if res.out_dim == res.in_dims[0] else g.movedim(res.out_dim, res.in_dims[0]))
    b = s * (gr - (s * gr).sum(-1, keepdim=True))
    R = torch.diag_embed(b) - b.unsqueeze(-1) * s.unsqueeze(-2) - s.unsqueeze(-1) * b.unsqueeze(-2)
    return layout, R.to(a.dtype)  # (a softmax in another dtype: its R, over the input)


def row_columns(layout, R: Tensor):
    """Signed columns ``q √λ±`` of block-diagonal residuals ``R [N, rows, S, S]`` (one block per
    row of ``layout``, which maps ``[*lead, N, rows, S]`` back to the input's layout), one per
    (row, eigenvector), built per chunk."""
    if flows(R):  # eigh's and √'s derivatives are not finite everywhere: αI ± R/(4α)
        scaled = polarised(R)
    else:
        evals, evecs = linalg.eigh(R)  # [N, rows, S], [N, rows, S, S]
        scaled = [evecs * lam.sqrt().unsqueeze(-2) for lam in (evals.clamp(min=0), (-evals).clamp(min=0))]
    return [(sign, {0: _row_lazy(layout, w)}, {}) for sign, w in zip((1.0, -1.0), scaled)]


def row_columns_weighted(layout, R: Tensor):
    """``[(w [rows·S, N], {0: columns}, {})]``: one set of columns ``q √|λ|`` with the sign of
    ``λ`` per (column, sample) as weight (``R`` of plain values: its eigenvectors' derivatives
    are not wanted)."""
    evals, evecs = linalg.eigh(R)  # [N, rows, S], [N, rows, S, S]
    weights = torch.where(evals >= 0, 1.0, -1.0).to(R.dtype).permute(1, 2, 0).reshape(-1, R.shape[0])
    return [(weights, {0: _row_lazy(layout, evecs * evals.abs().sqrt().unsqueeze(-2))}, {})]


def _row_lazy(layout, w: Tensor) -> "LazyColumns":
    """Columns of per-row vectors ``w [N, rows, S, S]`` (column ``c = (r, j)`` is ``w[:, r, :, j]``
    placed in row ``r``), built per chunk."""
    n, rows, s = w.shape[:3]

    def make(start, stop):
        c = torch.arange(start, stop, device=w.device)
        r, j = c // s, c % s
        # column c is w[:, r, :, j] placed in row r: a one-hot product, not an
        # index_put (whose vmap batching rule misplaces the batch dim of the values)
        rows_of = (r.unsqueeze(1) == torch.arange(rows, device=w.device)).to(w.dtype)  # [C, rows]
        out = w.permute(1, 3, 0, 2)[r, j].unsqueeze(2) * rows_of[:, None, :, None]  # [C, N, rows, S]
        return layout.back(out, 1)

    return LazyColumns(rows * s, make)


def row_operator(layout, R: Tensor, clip: bool) -> Callable:
    """``mod(R)`` of block-diagonal residuals ``R [N, rows, S, S]``, row by row."""
    evals, evecs = linalg.eigh(R)
    evals = evals.clamp(min=0) if clip else evals.abs()
    M = (evecs * evals.unsqueeze(-2)) @ evecs.transpose(-1, -2)  # [N, rows, S, S]

    def apply(taps, theta):
        t = layout.rows(taps[0])
        return [layout.back(torch.einsum("nrij,nrj->nri", M, t))], {}

    return apply


def softmax_columns(res, g: Tensor):
    """Signed columns ``q √λ±`` of every row's ``R``, one per (row, eigenvector)."""
    return row_columns(*softmax_residual(res, g))


def softmax_operator(res, g: Tensor, clip: bool) -> Callable:
    """``mod(R)`` row by row."""
    layout, R = softmax_residual(res, g)
    return row_operator(layout, R, clip)


# ----------------------------------------------------------------------------- matrix products


def _blocks(res, g: Tensor):
    """``X [N, B, T, K]``, ``Y [N, B, K, S]``, ``G [N, B, T, S]`` and the shapes to go back."""
    x, y = res.inputs
    dx, dy = res.in_dims
    if dx >= x.dim() - 2 or dy >= y.dim() - 2 or res.out_dim >= g.dim() - 2:
        raise CurvatureError(
            f"The Hessian extensions: graph node '{res.where}' multiplies matrices whose rows or "
            "columns are samples; curvlib needs the batch among the leading dims of a matrix product."
        )
    xc, yc, gc = _front(x, dx), _front(y, dy), _front(g, res.out_dim)
    n = xc.shape[0]
    flat = lambda t: t.reshape((n, -1) + tuple(t.shape[-2:]))  # noqa: E731
    return flat(xc), flat(yc), flat(gc), tuple(xc.shape), tuple(yc.shape)


def matmul_columns(res, g: Tensor):
    """Signed columns ``(u_j e_kᵀ, ±e_k v_jᵀ) √(σ_j/2)`` per leading index ``b`` (module doc)."""
    if flows(g, *res.inputs):
        return _matmul_columns_smooth(res, g)
    X, Y, G, shape_x, shape_y = _blocks(res, g)
    n, nb, t, k = X.shape
    s = Y.shape[-1]
    U, sigma, Vh = linalg.svd(G)  # [N, B, T, r], [N, B, r], [N, B, r, S]
    r = sigma.shape[-1]
    m = (sigma / 2).sqrt().unsqueeze(-2)
    ux, vy = U * m, Vh * m.transpose(-1, -2)  # scaled u_j (columns), v_j (rows)
    dx, dy = res.in_dims

    def make(start, stop, sign):
        c = torch.arange(start, stop, device=X.device)
        b, j, kk = c // (r * k), (c // k) % r, c % k  # column c: u_j at (b, :, k), ±v_j at (b, k, :)
        cx, cy = _placed(ux.permute(1, 3, 0, 2)[b, j], sign * vy.permute(1, 2, 0, 3)[b, j], b, kk, nb, k)
        return _back(cx.reshape((-1,) + shape_x), dx, 1), _back(cy.reshape((-1,) + shape_y), dy, 1)

    return _matmul_sets(make, nb * r * k)


def _matmul_columns_smooth(res, g: Tensor):
    """Signed columns whose derivatives are finite (the SVD's are not at repeated or zero σ):
    ``R = Σ_{b,t,k} u wᵀ + w uᵀ`` with ``u = e_{t,k}`` in ``X`` and ``w`` the ``Y`` tangent whose
    row ``k`` is ``G[t, :]``; one pair ``(a u ± w/(2a))`` per ``(b, t, k)``, ``a = √(‖G[t]‖/2)``
    (:mod:`curvlib._hessian.smooth`: the pair's difference of outer products is ``u wᵀ + w uᵀ``)."""
    X, Y, G, shape_x, shape_y = _blocks(res, g)
    n, nb, t, k = X.shape
    s = Y.shape[-1]
    a = row_scale(G)  # [N, B, T]
    wy = G / (2 * a).unsqueeze(-1)  # [N, B, T, S]
    dx, dy = res.in_dims

    def make(start, stop, sign):
        c = torch.arange(start, stop, device=X.device)
        b, tt, kk = c // (t * k), (c // k) % t, c % k  # column c: a at (b, t, k), ±w at (b, k, :)
        at_t = (tt.unsqueeze(1) == torch.arange(t, device=X.device)).to(X.dtype)  # [C, T]
        x_col = a.permute(1, 2, 0)[b, tt].unsqueeze(-1) * at_t.unsqueeze(1)  # [C, N, T]
        cx, cy = _placed(x_col, sign * wy.permute(1, 2, 0, 3)[b, tt], b, kk, nb, k)
        return _back(cx.reshape((-1,) + shape_x), dx, 1), _back(cy.reshape((-1,) + shape_y), dy, 1)

    return _matmul_sets(make, nb * t * k)


def _placed(x_col: Tensor, y_row: Tensor, b: Tensor, kk: Tensor, nb: int, k: int):
    """Columns of a matrix product's residual placed in ``X [C, N, B, T, K]`` (``x_col [C, N, T]``
    at ``(b, :, k)``) and ``Y [C, N, B, K, S]`` (``y_row [C, N, S]`` at ``(b, k, :)``).

    One-hot products, not index_puts: torch's vmap batching rule of an index_put that mixes
    advanced indices with a slice misplaces the batch dim of the values."""
    at_b = (b.unsqueeze(1) == torch.arange(nb, device=b.device)).to(x_col.dtype)[:, None, :, None, None]
    at_k = (kk.unsqueeze(1) == torch.arange(k, device=b.device)).to(x_col.dtype)  # [C, K]
    cx = x_col[:, :, None, :, None] * at_b * at_k[:, None, None, None, :]
    cy = y_row[:, :, None, None, :] * at_b * at_k[:, None, None, :, None]
    return cx, cy


def _matmul_sets(make, v: int):
    """The two signed sets of lazily built ``(X, Y)`` column parts (a chunk built once for both)."""
    sets = []
    for sign in (1.0, -1.0):
        cache = {}

        def part(i, sign=sign, cache=cache):
            def build(start, stop):
                if cache.get("key") != (start, stop):
                    cache["key"], cache["val"] = (start, stop), make(start, stop, sign)
                return cache["val"][i]
            return build

        sets.append((sign, {0: LazyColumns(v, part(0)), 1: LazyColumns(v, part(1))}, {}))
    return sets


def matmul_operator(res, g: Tensor, clip: bool) -> Callable:
    """``mod(R)`` per leading index: ``|R| = diag(√(GGᵀ) ⊗ I, √(GᵀG) ⊗ I)``, ``clip = (|R| + R)/2``."""
    X, Y, G, shape_x, shape_y = _blocks(res, g)
    dx, dy = res.in_dims
    U, sigma, Vh = linalg.svd(G)  # (SVD, not eigh of GGᵀ: no √ of round-off)
    root_x = (U * sigma.unsqueeze(-2)) @ U.transpose(-1, -2)  # √(GGᵀ) [N, B, T, T]
    root_y = (Vh.transpose(-1, -2) * sigma.unsqueeze(-2)) @ Vh  # √(GᵀG) [N, B, S, S]

    def apply(taps, theta):
        tx = _front(taps[0], dx).reshape(X.shape)
        ty = _front(taps[1], dy).reshape(Y.shape)
        cx, cy = root_x @ tx, ty @ root_y
        if clip:
            cx, cy = (cx + G @ ty.transpose(-1, -2)) / 2, (cy + tx.transpose(-1, -2) @ G) / 2
        return [_back(cx.reshape(shape_x), dx), _back(cy.reshape(shape_y), dy)], {}

    return apply
