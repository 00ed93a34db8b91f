"""Per-sample algebra of the residuals recorded by :mod:`curvlib._hessian.residuals`.

A residual ``R_n`` (sample ``n``) lives on ``u = (θ, inputs)``. Two views:

* :func:`factor`: signed columns, ``R = Σ_c s_c c cᵀ`` exactly (the Hessian
  diagonal pulls them back through the graph); ``q √λ±`` by default, smooth
  polarised columns when derivatives flow through the result
  (:mod:`curvlib._hessian.smooth`);
* :func:`positive_curvature`: ``mod(R)`` as an operator on tangents of ``u``,
  ``mod`` acting on the eigenvalues (PCHMP).

The batch may sit in any dimension of a node's inputs and output
(``Residual.in_dims``, ``Residual.out_dim``, from the planner): every
function here moves it to the front first (*canonical* layout ``[N, ...]``)
and moves it back for what it returns, so that "one sample" is one slice.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.func import hessian, jacrev

from . import norm as _residual_norm, structured as _residual_structured
from .structured import one_hot_columns
from .._core.tensors import is_concrete
from .broadcast import broadcast_columns, broadcast_operator
from .pairs import pair_columns
from .free_blocks import free_sets
from .rows import check_dense_size
from .smooth import diag_pair, flows, polarised, product_pair, row_scale
from .._core.errors import missing_forward_mode
from .._core.reverse import check_symmetric_matrices, missing_forward_mode_reason
from .._core.sync import LOCK
from ..rules.elementwise import second_derivative
from ..rules.generic import map_samples
from .._core import linalg

Columns = List[Tuple[float, Dict[int, Tensor], Dict[str, Tensor]]]


def _front(t: Tensor, dim: int, lead: int = 0) -> Tensor:
    """Move the batch from ``dim`` (after ``lead`` extra leading dims) to position ``lead``."""
    return t if dim == 0 else t.movedim(lead + dim, lead)


def _back(t: Tensor, dim: int, lead: int = 0) -> Tensor:
    """Inverse of :func:`_front`."""
    return t if dim == 0 else t.movedim(lead, lead + dim)


def factor(res, g: Tensor) -> Columns:
    """Signed column sets of the residual: ``[(sign, {input index: [V, *input]}, {param: [V, N, *p]})]``.

    ``g`` is the gradient at the node's output. Columns are per sample: column
    ``v`` of sample ``n`` is non-zero only in sample ``n``'s slice of the input.
    """
    if res.kind in ("diag", "product"):
        d = res.in_dims[0]
        if res.kind == "diag":  # R = diag(φ''(a) g): columns e_k √r±
            r = _front(second_derivative(res.phi, res.inputs[0]) * g, d)
            # √r± has no derivative where r± = 0: smooth pair c₊² − c₋² = r when derivatives flow
            plus, minus = diag_pair(r) if flows(r) else (r.clamp(min=0).sqrt(), (-r).clamp(min=0).sqrt())
            return [(1.0, {0: one_hot_columns(plus, d)}, {}), (-1.0, {0: one_hot_columns(minus, d)}, {})]
        # R = [[0, D], [D, 0]], D = diag(g): columns (e_k a_k, ±e_k b_k), 2 a_k b_k = g_k
        # (a = √(|g|/2), b = sign(g) a; smooth in g when derivatives flow)
        gc = _front(g, d)
        if flows(gc):
            m, ms = product_pair(gc)
        else:
            m = (gc.abs() / 2).sqrt()
            ms = m * torch.sign(gc)
        pos = {0: one_hot_columns(m, d), 1: one_hot_columns(ms, d)}
        neg = {0: one_hot_columns(m, d), 1: one_hot_columns(-ms, d)}
        return [(1.0, pos, {}), (-1.0, neg, {})]
    return _COLUMNS.get(res.kind, _dense_columns)(res, g)


def _bilinear_layout(res, g: Tensor) -> Tuple[Tensor, Tensor]:
    """``x [N, S, I]`` and ``G [N, S, O]`` (positions sharing the weight flattened into ``S``)."""
    x = _front(res.inputs[0], res.in_dims[0])
    gc = _front(g, res.out_dim)
    n = x.shape[0]
    return x.reshape(n, -1, x.shape[-1]), gc.reshape(n, -1, gc.shape[-1])


def _bilinear_columns(res, g: Tensor) -> Columns:
    """``z_s = W x_s``: ``R`` couples ``W_oi`` and ``x_si`` with ``g_so``. Column ``(s, i)``:
    W-part ``g_s ⊗ e_i / √(2‖g_s‖)``, x-part ``±e_{s,i} √(‖g_s‖/2)``; each pair's
    difference of outer products is ``(g_s ⊗ e_i) e_{s,i}ᵀ`` + transpose, summing to ``R``."""
    xs, gs = _bilinear_layout(res, g)
    n, s, i = xs.shape
    smooth = flows(gs)
    norm = gs.norm(dim=2)  # [N, S]
    m = row_scale(gs) if smooth else (norm / 2).sqrt()  # (‖g‖ and √ have no derivative at 0)
    eye_s = torch.eye(s, dtype=xs.dtype, device=xs.device)
    eye_i = torch.eye(i, dtype=xs.dtype, device=xs.device)
    x_c = _front(res.inputs[0], res.in_dims[0])
    x_part = torch.einsum("ab,cd,nb->acnbd", eye_s, eye_i, m).reshape((s * i,) + tuple(x_c.shape))
    x_part = _back(x_part, res.in_dims[0], 1)
    if smooth:  # x-part m, W-part g/(2m): the pair's products are g whatever m
        w_scale = gs / (2 * m).unsqueeze(-1)
    else:
        w_scale = gs / (2 * norm.clamp_min(torch.finfo(xs.dtype).tiny)).sqrt().unsqueeze(-1)  # [N, S, O]
    w_part = torch.einsum("nao,cd->acnod", w_scale, eye_i).reshape(s * i, n, gs.shape[2], i)
    name = res.site.params["weight"]
    return [(1.0, {0: x_part}, {name: w_part}), (-1.0, {0: -x_part}, {name: w_part})]


#: Signed columns of the structured kinds besides ``"diag"`` and ``"product"`` (others: dense)
_COLUMNS = {"bilinear": _bilinear_columns, "softmax": _residual_structured.softmax_columns,
            "matmul": _residual_structured.matmul_columns, "broadcast": broadcast_columns,
            "norm": _residual_norm.norm_columns, "row_region": _residual_norm.region_columns, "pair": pair_columns}


def _layout(res):
    """How ``u = (θ, inputs)`` of a dense residual splits: names, shapes and sizes
    (input shapes per sample, in the canonical layout)."""
    names = list(res.params)
    shapes_p = [tuple(res.params[k].shape) for k in names]
    sizes_p = [res.params[k].numel() for k in names]
    inputs = [_front(a, d) for a, d in zip(res.inputs, res.in_dims)]
    shapes_in = [tuple(a.shape[1:]) for a in inputs]
    sizes_in = [a[0].numel() for a in inputs]
    return names, shapes_p, sizes_p, shapes_in, sizes_in


def _split_taps(res, parts: Sequence[Tensor], lead: Tuple[int, ...]) -> List[Tensor]:
    """Flat per-sample input parts ``[*lead, N, D_j]`` -> tensors in each input's own layout."""
    _, _, _, shapes_in, _ = _layout(res)
    k = len(lead)
    return [_back(p.reshape(tuple(p.shape[: k + 1]) + sh), d, k) for p, sh, d in zip(parts, shapes_in, res.in_dims)]


def _dense_columns(res, g: Tensor) -> Columns:
    """``R = Q Λ Qᵀ`` per sample: columns ``q_j √λ_j±``, split into the parameters'
    (direct) and the inputs' parts.

    A ``free`` parameter couples with nothing else in a diagonal block of the Hessian, so
    its block is not formed here: two columns ``√(diag R_pp)±`` from Hessian-vector products
    (:mod:`curvlib._hessian.free_blocks`; a standardised convolution weight,
    ``conv(x, std(W))``, or an MoE layer's expert weights). The rest, ``(coupled
    parameters, inputs)``, is decomposed dense. Columns whose eigenvalue is negligible in
    every sample, ``|λ_j| ≤ 10 ε max|λ|`` (below eigh's own error), are dropped: each entry
    of a diagonal ``Σ_j λ_j (J q_j)_p²`` moves by at most that bound times ``‖J_p‖²``.
    """
    if res.free or res.meta.get("zero_inputs"):
        sets, rest = free_sets(res, g)
        return sets + (_dense_columns(rest, g) if rest is not None else [])
    layout = _layout(res)
    R = _dense_matrix(res, g)  # [N, D, D]
    if flows(R):  # eigh's and √'s derivatives are not finite everywhere: αI ± R/(4α)
        return _column_sets(res, layout, polarised(R))
    if is_concrete(R) and not R.any():
        return []  # exactly zero (an input the node is linear in): no columns, no eigh
    evals, evecs = linalg.eigh(R)
    scaled = []
    for lam in (evals, -evals):
        keep = _needed(lam, evals)
        scaled.append(evecs[:, :, keep] * lam[:, keep].clamp(min=0).sqrt().unsqueeze(1))  # [N, D, V]
    return _column_sets(res, layout, scaled)


def _needed(lam: Tensor, evals: Tensor) -> Tensor:
    """Which eigen-columns ``[d]`` (bool) some sample needs: ``λ > 10 ε max|λ|`` (all of them
    for traced values, which cannot be read)."""
    if not is_concrete(evals):
        return torch.ones(lam.shape[1], dtype=torch.bool, device=lam.device)
    tol = 10 * torch.finfo(evals.dtype).eps * evals.abs().amax(dim=1, keepdim=True)
    return (lam > tol).any(0)


def _column_sets(res, layout, scaled: Sequence[Tensor]) -> Columns:
    """``(+1, taps, direct), (-1, ...)`` from per-sample columns ``[N, D, V]`` of ``R``: the
    parameters' parts (direct) and the inputs' (taps)."""
    names, shapes_p, sizes_p, _, sizes_in = layout
    sets: Columns = []
    for sign, w in zip((1.0, -1.0), scaled):
        cols = w.permute(2, 0, 1)  # [V, N, D]
        if cols.shape[0] == 0:
            continue
        n = cols.shape[1]
        parts = torch.split(cols, sizes_p + sizes_in, dim=2)
        direct = {k: p.reshape((cols.shape[0], n) + sh) for k, p, sh in zip(names, parts[: len(names)], shapes_p)}
        taps = dict(enumerate(_split_taps(res, parts[len(names):], (cols.shape[0],))))
        sets.append((sign, taps, direct))
    return sets


def _dense_matrix(res, g: Tensor) -> Tensor:
    """Per-sample residual ``R [N, D, D]`` over ``u = (θ, inputs)`` (dense kind), without
    the couplings of the ``free`` parameters (which enter no diagonal block of the Hessian)."""
    names, shapes_p, sizes_p, shapes_in, sizes_in = _layout(res)
    gc = _front(g, res.out_dim)
    n = gc.shape[0]
    theta_flat = [res.params[k].reshape(1, -1).expand(n, -1) for k in names]
    inputs = [_front(a, d).reshape(n, -1) for a, d in zip(res.inputs, res.in_dims)]
    u = torch.cat(theta_flat + inputs, dim=1)

    # fixed inputs (token ids, masks, constants that carry the batch): sample n's rows where they do
    fixed, fixed_dims = list(res.meta.get("fixed", ())), tuple(res.meta.get("fixed_dims", ()))
    fixed_dims = fixed_dims + (None,) * (len(fixed) - len(fixed_dims))

    # (u in its parts' widest dtype; each back in its own inside: a float32 node keeps float32 operands)
    dtypes_p, dtypes_in = [res.params[k].dtype for k in names], [a.dtype for a in res.inputs]

    def contracted(u_n: Tensor, g_n: Tensor, fixed_n) -> Tensor:
        parts = list(torch.split(u_n, sizes_p + sizes_in))
        theta = {k: p.reshape(sh).to(dt) for k, p, sh, dt in zip(names, parts[: len(names)], shapes_p, dtypes_p)}
        # one sample, batch of one in the input's own batch dimension
        xs = [_back(p.reshape((1,) + sh).to(dt), d)
              for p, sh, d, dt in zip(parts[len(names):], shapes_in, res.in_dims, dtypes_in)]
        ids = [f if d is None else f.unsqueeze(d) for f, d in zip(fixed_n, fixed_dims)]
        return (_front(res.phi(theta, *xs, fixed=ids), res.out_dim).squeeze(0) * g_n).sum()

    with LOCK:  # hessian is forward-over-reverse: forward-mode AD state is process-wide
        # (a loop for value-dependent branches)
        try:
            R = map_samples(hessian(contracted), (0, 0, list(fixed_dims)))(u, gc, fixed)
        except NotImplementedError as exc:
            if not missing_forward_mode(exc):
                raise
            # reverse over reverse where a node operation has no forward mode, if symmetric
            R = map_samples(jacrev(jacrev(contracted)), (0, 0, list(fixed_dims)))(u, gc, fixed)
            check_symmetric_matrices(R, f"The Hessian extensions at graph node '{res.where}'",
                                     missing_forward_mode_reason(exc))
    R = (R + R.transpose(1, 2)) / 2
    if res.free:
        # block id per coordinate: 1 + k for the k-th free parameter, 0 for the rest of u
        ids = torch.cat([torch.full((s,), 1 + k if name in res.free else 0, device=R.device)
                         for k, (name, s) in enumerate(zip(names + [None] * len(sizes_in), sizes_p + sizes_in))])
        R = R * (ids[:, None] == ids[None, :])
    return R


def _modified(R: Tensor, clip: bool) -> Tensor:
    """``R [N, D, D]`` with its eigenvalues clipped at zero or in absolute value."""
    evals, evecs = linalg.eigh(R)
    evals = evals.clamp(min=0) if clip else evals.abs()
    return (evecs * evals.unsqueeze(1)) @ evecs.transpose(1, 2)


def positive_curvature(res, g: Tensor, modify: str, view: Optional[str] = None,
                       memo: Optional[dict] = None) -> Optional[Callable]:
    """The residual with its negative curvature clipped (``"clip"``) or flipped (``"abs"``),
    as the block of one parameter ``p`` sees it.

    Returns ``apply(tap_tangents, theta_tangents) -> (tap_cotangents, theta_cotangents)``:
    ``mod(R|u_p)`` applied per sample to the tangent of ``u_p``, with ``mod``
    acting on the eigenvalues, or ``None`` when ``mod(R|u_p) = 0``. ``theta_*``
    are dicts (parameter name -> ``[*p]``, the same direction for every sample;
    the cotangent is summed over samples). For an element-wise node this is
    Chen et al.'s ``mod(φ''(a) g)``.

    ``view``: ``p`` when it is one of the node's own parameters, else ``None``.
    ``u_p`` holds what moves with ``p``: the node's inputs, and ``p`` itself
    when it is the node's own; never the node's other parameters, which are
    constants of ``L(p)`` (a later use of a shared module cannot change the
    block of a parameter before it: for a Linear, ``R|x = 0``). This is the
    Hessian's chain recursion of ``L`` as a function of ``p`` alone, with every
    node's residual modified (``docs/conventions.md``). ``memo``: a dict kept
    per residual across views (the dense ``R`` is computed once).
    """
    clip = modify == "clip"
    if res.kind == "bilinear":  # R = [[0, G], [G, 0]] over (W, x): R|x = 0
        return _bilinear_operator(res, g, clip) if view == res.site.params["weight"] else None
    if res.kind == "dense":  # (a zero input block: R|x = 0)
        return None if view is None and res.meta.get("zero_inputs") else \
            _dense_operator(res, g, clip, view, {} if memo is None else memo)
    if res.kind == "product" and res.meta.get("param_taps") and view is None:
        return None  # y a function of other parameters alone, a constant of L(p): R|x = 0
    return _structured_operator(res, g, clip)


def _structured_operator(res, g: Tensor, clip: bool) -> Callable:
    """``mod(R)`` of a residual over its inputs alone (no parameter in ``u``)."""
    if res.kind == "diag":  # element-wise: per entry, in any layout
        r = second_derivative(res.phi, res.inputs[0]) * g
        m = r.clamp(min=0) if clip else r.abs()
        return lambda taps, theta: ([m * taps[0]], {})
    if res.kind == "product":
        # per entry: [[0, g], [g, 0]] has eigenpairs ±|g|, (1, ±s)/√2 with s = sign(g)
        a, s = g.abs(), torch.sign(g)
        if clip:
            return lambda taps, theta: ([a / 2 * (taps[0] + s * taps[1]), a / 2 * (s * taps[0] + taps[1])], {})
        return lambda taps, theta: ([a * taps[0], a * taps[1]], {})
    if res.kind == "softmax":
        return _residual_structured.softmax_operator(res, g, clip)
    if res.kind in ("matmul", "broadcast"):
        return (_residual_structured.matmul_operator if res.kind == "matmul" else broadcast_operator)(res, g, clip)
    if res.kind == "norm":
        return _residual_norm.norm_operator(res, g, clip)
    if res.kind == "row_region":
        return _residual_norm.region_operator(res, g, clip)
    raise AssertionError(f"curvlib internal error: residual kind {res.kind!r}")  # pragma: no cover


def _bilinear_operator(res, g: Tensor, clip: bool) -> Callable:
    """``mod(R)`` of ``z_s = W x_s`` per sample: with ``G [S, O]`` (rows ``g_s``),
    ``R = [[0, Gᵀ ⊗ I], [G ⊗ I, 0]]`` over ``(W [O, I], x [S, I])``, whose eigenvalues
    are ``±σ_j(G)``. Hence ``|R| = diag(√(GᵀG) ⊗ I, √(GGᵀ) ⊗ I)`` and
    ``clip(R) = (|R| + R) / 2``. (Positions ``S`` share ``W``: for ``S > 1`` the
    ``g_s`` are not orthogonal, so ``σ_j ≠ ‖g_s‖``.)"""
    name = res.site.params["weight"]
    xs, G = _bilinear_layout(res, g)  # [N, S, I], [N, S, O]
    d = res.in_dims[0]
    shape_c = tuple(_front(res.inputs[0], d).shape)
    # from the SVD G = U Σ Vᵀ (not eigh of GᵀG, whose round-off √ would amplify)
    U, sigma, Vh = linalg.svd(G)
    root_w = (Vh.transpose(1, 2) * sigma.unsqueeze(1)) @ Vh  # √(GᵀG) = V Σ Vᵀ [N, O, O]
    root_x = (U * sigma.unsqueeze(1)) @ U.transpose(1, 2)  # √(GGᵀ) = U Σ Uᵀ [N, S, S]

    def apply(taps, theta):
        tx = _front(taps[0], d).reshape(xs.shape)  # [N, S, I]
        tw = theta.get(name)  # [O, I] or None (zero tangent)
        cx = root_x @ tx
        cw = torch.einsum("nop,pi->oi", root_w, tw) if tw is not None else None
        if clip:  # add R t: x-part G tw, W-part Σ_n G_nᵀ tx_n, and halve
            cx = (cx + (G @ tw if tw is not None else 0)) / 2
            cw = (cw + torch.einsum("nso,nsi->oi", G, tx)) / 2 if tw is not None else None
        return [_back(cx.reshape(shape_c), d)], ({name: cw} if tw is not None else {})

    return apply


def _dense_operator(res, g: Tensor, clip: bool, view: Optional[str], memo: dict) -> Callable:
    """``mod(R|u_p)`` of a dense residual, applied per sample to ``(θ, inputs)`` tangents
    (zero outside ``u_p``; see :func:`positive_curvature`)."""
    names, _, sizes_p, _, sizes_in = _layout(res)
    coupled = [k for k in names if k not in res.free]
    # Without coupled parameters R is block-diagonal over (each free θ, inputs) (their
    # couplings are left out): mod(R) restricted to u_p is mod(R|u_p), one operator for all.
    key = (clip, view if coupled else None)
    if key not in memo:
        if "R" not in memo:  # (the blocks left out of the Hessian diagonal's are formed here)
            check_dense_size(f"'{res.where}'", _front(g, res.out_dim).shape[0], sum(sizes_p) + sum(sizes_in),
                             " for the eigenvalue-modified residual (PCHMP)")
            memo["R"] = _dense_matrix(res, g)
        R = memo["R"]
        if coupled:  # R|u_p: zero rows and columns (zero eigenvalues) outside u_p
            keep = torch.cat([torch.full((s,), k == view, device=R.device) for k, s in zip(names, sizes_p)]
                             + [torch.ones(sum(sizes_in), dtype=torch.bool, device=R.device)])
            R = R * (keep[:, None] & keep[None, :])
        memo[key] = _modified(R, clip)
    M = memo[key]  # [N, D, D]
    n = M.shape[0]

    def apply(taps, theta):
        t_theta = [
            (theta[k].reshape(1, -1) if k in theta else res.params[k].new_zeros(1, res.params[k].numel())).expand(n, -1)
            for k in names
        ]
        t_in = [_front(t, dim).reshape(n, -1) for t, dim in zip(taps, res.in_dims)]
        # (a node the model computes in another dtype than its parameters, a float32 RMSNorm in
        # a float64 model: R is applied in R's dtype, each part returned in its tangent's dtype)
        c = torch.einsum("nij,nj->ni", M, torch.cat(t_theta + t_in, dim=1).to(M.dtype))
        parts = torch.split(c, sizes_p + sizes_in, dim=1)
        theta_c = {k: p.sum(0).reshape(res.params[k].shape).to(res.params[k].dtype)
                   for k, p in zip(names, parts[: len(names)]) if k in theta}
        tap_parts = [p.to(t.dtype) for p, t in zip(parts[len(names):], taps)]
        return _split_taps(res, tap_parts, ()), theta_c

    return apply
