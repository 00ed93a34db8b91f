"""Affine map ``y = x Wᵀ + b`` (``nn.Linear``), batched with an explicit ``n``.

Shapes: ``x [N, *S, I]``, ``g = ∂L/∂y [N, *S, O]``, ``W [O, I]``, ``b [O]``.
The shared positions ``*S`` (sequence, extra axes) are flattened into ``s``,
so every function works on ``x [n, s, i]`` and ``g [n, s, o]``.

Individual gradients: ``∂ℓ_n/∂W = Σ_s g[n, s] x[n, s]ᵀ``, ``∂ℓ_n/∂b = Σ_s g[n, s]``.

The norms and squares avoid ``[N, O, I]`` where they can:

* ``s = 1``: ``‖g_n x_nᵀ‖² = ‖g_n‖² ‖x_n‖²`` and ``Σ_n (g_n x_nᵀ)² = (g²)ᵀ (x²)``;
* ``s > 1`` and ``s² ≤ O·I``: ``‖Σ_s g_s x_sᵀ‖² = Σ_{s,t} (g_s·g_t)(x_s·x_t)``
  (Gram matrices, ``[N, s, s]``);
* otherwise the individual gradients are formed.
"""

from __future__ import annotations

import functools

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from opt_einsum import contract
from torch import Tensor, nn
from torch.func import vmap

from . import _linear_columns
from ._linear_kron import dense_sides, flat_input, kron, kron_from_output_matrix, kron_input, kron_shared
from .._core import settings
from .._core.calls import argument
from .._core.scratch import scratch
from .._core.family import Family
from .._core.site import Recorder, RoleTensors, Rule, Site
from .._core.tensors import in_place_safe


def _per_sample_outer(g: Tensor, x: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """``Σ_s g[n, s] x[n, s]ᵀ`` ``[N, O, I]`` for ``g [N, S, O]``, ``x [N, S, I]`` (into ``out``, if S > 1)."""
    if g.shape[1] == 1:  # no shared positions: a broadcast product, no reduction
        return g[:, 0, :, None] * x[:, 0, None, :]
    return torch.bmm(g.transpose(1, 2), x, out=out)


def _flat(site: Site, g: Tensor) -> Tuple[Tensor, Tensor]:
    """``x [n, s, i]`` and ``g [n, s, o]`` (the site is batch first: :class:`~curvlib._core.site.Recorder`)."""
    return flat_input(site), g.reshape(g.shape[0], -1, g.shape[-1])


def grad_batch(site: Site, g: Tensor, roles: Sequence[str], transposed: bool = False) -> RoleTensors:
    """Weight ``[N, O, I]`` (``transposed``: ``[N, I, O]``, formed in that layout: a transposed
    view would make every later sum over the batch a strided, much slower one), bias ``[N, O]``."""
    x, g = _flat(site, g)
    out = {}
    if "weight" in roles:
        out["weight"] = _per_sample_outer(x, g) if transposed else _per_sample_outer(g, x)
    if "bias" in roles:
        out["bias"] = g.sum(1)
    return out


def grad(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    x, g = _flat(site, g)
    out = {}
    if "weight" in roles:  # one matrix product, as in a plain backward
        out["weight"] = _sum_outer(g, x)
    if "bias" in roles:
        out["bias"] = g.sum((0, 1))
    return out


def _sum_outer(g: Tensor, x: Tensor) -> Tensor:
    """``Σ_{n,s} g[n, s] x[n, s]ᵀ`` ``[O, I]`` for ``g [N, S, O]``, ``x [N, S, I]``: one matrix
    product where ``g``'s positions flatten without a copy, else one per sample into the
    sum (a language model's head: ``g`` is the logits' gradient seen through a transpose,
    ``[N, T, V]`` with the positions innermost; ``g[n]ᵀ`` is then contiguous and
    flattening would copy all of it: large for a language model's vocabulary)."""
    n, s = g.shape[0], g.shape[1]
    if n == 1 or s == 1 or g.stride(0) == g.stride(1) * s or not in_place_safe(g, x):
        return g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
    total = g[0].t() @ x[0]
    for k in range(1, n):
        total.addmm_(g[k].t(), x[k])
    return total


def grad_from_batch(site: Site, g: Tensor) -> bool:
    """Sum the individual gradients ``[N, O, I]`` (N·O·I reads) rather than the product
    ``gᵀx`` (2·N·S·O·I flops) when the weight is shared by ``S >= 8`` positions: measured
    8-12% of a BatchGrad on the GPT benchmark (S = 64; the transformer one, S = 32, within
    the noise); slower on an MLP or a convolution, where the product is one efficient kernel."""
    return flat_input(site).shape[1] >= 8


def batch_l2(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    x, g = _flat(site, g)
    s, i, o = x.shape[1], x.shape[2], g.shape[2]
    out = {}
    if "weight" in roles:
        if s == 1:
            out["weight"] = (g**2).sum((1, 2)) * (x**2).sum((1, 2))
        elif s * s <= o * i:
            out["weight"] = contract("nso,nto,nsi,nti->n", g, g, x, x)
        else:
            out["weight"] = (_per_sample_outer(g, x) ** 2).sum((1, 2))
    if "bias" in roles:
        out["bias"] = (g.sum(1) ** 2).sum(1)
    return out


def sum_grad_squared(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    x, g = _flat(site, g)
    out = {}
    if "weight" in roles:
        if x.shape[1] == 1:  # (g²)ᵀ (x²): one matrix product
            out["weight"] = (g**2).reshape(-1, g.shape[-1]).t() @ (x**2).reshape(-1, x.shape[-1])
        else:
            out["weight"] = _sum_squared_outer(g, x)
    if "bias" in roles:
        out["bias"] = (g.sum(1) ** 2).sum(0)
    return out


def grad_with_squares(site: Site, g: Tensor, roles: Sequence[str]) -> Optional[Tuple[RoleTensors, RoleTensors]]:
    """``(grad, sum_grad_squared)`` from one pass over the individual gradients, where a
    weight is shared by positions (``s > 1``) and nothing is differentiated: the squares need
    every ``Σ_s g[n, s] x[n, s]ᵀ`` anyway, and their sum is the gradient, so the gradient's
    own product ``gᵀx`` (as costly: GPT-2's head, 40 GFLOP) is not run. ``None`` otherwise
    (the caller asks :func:`grad` and :func:`sum_grad_squared`)."""
    x, gf = _flat(site, g)
    if x.shape[1] == 1 or not in_place_safe(gf, x):
        return None
    grads, squares = {}, {}
    if "weight" in roles:
        grads["weight"] = gf.new_empty(gf.shape[2], x.shape[2])
        squares["weight"] = _sum_squared_outer(gf, x, sums=grads["weight"])
    if "bias" in roles:
        per_sample = gf.sum(1)
        grads["bias"], squares["bias"] = per_sample.sum(0), (per_sample**2).sum(0)
    return grads, squares


def _sum_squared_outer(g: Tensor, x: Tensor, sums: Optional[Tensor] = None) -> Tensor:
    """``Σ_n (Σ_s g[n, s] x[n, s]ᵀ)²`` ``[O, I]`` for ``g [N, S, O]``, ``x [N, S, I]``, the
    individual gradients formed a block at a time and squared into the sum: a block of output
    rows of every sample (``Settings.linear_squares_entries``; one row of a block of samples if even that is
    larger), never ``[N, O, I]`` (for a language model's head, ``N`` times the head's size), in one reused buffer
    (:func:`curvlib._core.scratch.scratch`: no page faults). ``sums [O, I]`` (uninitialised;
    plain tensors only): filled with the individual gradients' sum too, the gradient without a
    second product of the same cost (GPT-2's head: 40 GFLOP)."""
    n, o, i = g.shape[0], g.shape[2], x.shape[2]
    if not in_place_safe(g, x):
        return _sum_squared_samples(g, x)
    total = g.new_empty(o, i)
    entries = settings.current().linear_squares_entries
    rows = min(o, max(1, entries // max(n * i, 1)))
    samples = min(n, max(1, entries // max(rows * i, 1)))
    for r in range(0, o, rows):
        for start in range(0, n, samples):  # (one block of samples unless one row of each is too large)
            block, xs = g[start:start + samples, :, r:r + rows], x[start:start + samples]
            part = _per_sample_outer(block, xs, out=scratch((block.shape[0], block.shape[2], i), g))
            _add_samples(part, total[r:r + rows], None if sums is None else sums[r:r + rows], first=start == 0)
    return total


#: Up to this many samples in a block, :func:`_add_samples` squares them one at a time into the sum
#: (``addcmul_``: no squared copy); more (small layers, large batches): two kernels, not one per sample.
_ONE_AT_A_TIME = 8


def _add_samples(part: Tensor, squares: Tensor, sums: Optional[Tensor], first: bool) -> None:
    """``squares += Σ_n part[n]²`` and ``sums += Σ_n part[n]`` for a block ``part [n', o, i]``
    (a scratch buffer, overwritten); ``first``: ``=`` instead of ``+=`` (the targets are
    uninitialised, so they are written once rather than zeroed and then added into)."""
    if sums is not None:  # (before the squares, which may overwrite part)
        if first:
            torch.sum(part, 0, out=sums)
        else:
            for k in range(part.shape[0]):  # (no [o', I] temporary)
                sums.add_(part[k])
    if part.shape[0] > _ONE_AT_A_TIME:
        if first:
            torch.sum(part.square_(), 0, out=squares)
        else:
            squares.add_(part.square_().sum(0))
        return
    for k in range(part.shape[0]):
        if first and k == 0:
            torch.mul(part[0], part[0], out=squares)
        else:
            squares.addcmul_(part[k], part[k])


def _sum_squared_samples(g: Tensor, x: Tensor) -> Tensor:
    """:func:`_sum_squared_outer` under autograd or torch.func: a block of samples at a time,
    summed out of place."""
    n, o, i = g.shape[0], g.shape[2], x.shape[2]
    step = max(1, settings.current().linear_squares_entries // max(o * i, 1))
    total = None
    for start in range(0, n, step):
        part = _per_sample_outer(g[start:start + step], x[start:start + step]) ** 2
        part = part.sum(0)
        total = part if total is None else total + part
    return total if total is not None else g.new_zeros(o, i)


def sum_squares_over_columns(site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``Σ_v Σ_n (J_pᵀ m_v)²`` for a root ``m [V, *out]`` (the GGN diagonal).

    Without shared positions the square separates, ``(m_vn x_nᵀ)² = m_vn² (x_n²)ᵀ``,
    so ``Σ_v`` moves inside: one matrix product ``(Σ_v m²)ᵀ (x²)``. With positions,
    the columns' Gram matrices over positions where they are cheaper
    (:mod:`curvlib.rules._linear_columns`), else the individual gradients.
    """
    x, entries = flat_input(site), settings.current().linear_squares_entries
    if _linear_columns.cheaper(m, x, entries):
        return _linear_columns.squares(m, x, roles, per_sample=False)
    if x.shape[1] != 1 and 1 < m.shape[0] and m.shape[0] * x.shape[0] * x.shape[2] * m.shape[-1] <= entries:
        return vmap(lambda mv: sum_grad_squared(site, mv, roles))(m)  # summed by the caller
    if x.shape[1] != 1:  # one column (MC), or a large layer (a language model's head): one column at
        # a time, summed here, on plain tensors where they are (vmap's would allocate every block)
        total: RoleTensors = {}
        for v in range(m.shape[0]):
            part = sum_grad_squared(site, m[v], roles)
            total = {r: part[r] + total[r] if r in total else part[r] for r in part}
        return {r: t.unsqueeze(0) for r, t in total.items()}
    return {r: t.unsqueeze(0) for r, t in column_squares(site, column_statistic(site, m), roles, False).items()}


def column_statistic(site: Site, m: Tensor) -> Optional[Tensor]:
    """``Σ_v m_v² [N, O]`` for a layer with one position per sample (else ``None``): with
    ``(m_vn x_nᵀ)² = m_vn² (x_n²)ᵀ``, the columns' squared gradients depend on them through it alone."""
    x = flat_input(site)
    if x.shape[1] != 1:
        return None
    return (m**2).sum(0).reshape(x.shape[0], -1)


def column_squares(site: Site, m2: Tensor, roles: Sequence[str], per_sample: bool) -> RoleTensors:
    """``Σ_v (J_pᵀ m_v)²`` from :func:`column_statistic` ``m2 = Σ_v m_v² [N, O]``: per sample
    ``m2 ⊗ x²`` (weight ``[N, O, I]``, bias ``[N, O]``), else ``m2ᵀ x²`` (``[O, I]``, ``[O]``)."""
    x2 = flat_input(site).reshape(m2.shape[0], -1) ** 2
    out = {}
    if "weight" in roles:
        out["weight"] = m2.unsqueeze(2) * x2.unsqueeze(1) if per_sample else m2.t() @ x2
    if "bias" in roles:
        out["bias"] = m2 if per_sample else m2.sum(0)
    return out


def batch_sum_squares_over_columns(site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``Σ_v (J_pᵀ m_v)²`` per sample ``[N, *p]``: with one position, ``(Σ_v m_v²) ⊗ x²``; with
    positions, from the columns' Gram matrices over positions where they are cheaper
    (:mod:`curvlib.rules._linear_columns`), else one column at a time."""
    x = flat_input(site)
    if _linear_columns.cheaper(m, x, settings.current().linear_squares_entries):
        return _linear_columns.squares(m, x, roles, per_sample=True)
    if x.shape[1] != 1:
        out = {}
        for k in range(m.shape[0]):
            part = grad_batch(site, m[k], roles)
            out = {r: part[r] ** 2 + out.get(r, 0) for r in part}
        return out
    return column_squares(site, column_statistic(site, m), roles, True)


def outer_factors(site: Site, role: str, m: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """``(g [V, N, O, 1], x [1, N, 1, I])`` (transposed weight: ``(x [1, N, I, 1], g [V, N, 1, O])``)
    whose product is the weight's per-sample gradients ``g_vn x_nᵀ`` for the columns
    ``m [V, *site_out]``, when each sample has one position; ``None`` otherwise or for the bias."""
    x = flat_input(site)
    if role != "weight" or x.shape[1] != 1:
        return None
    g = m.reshape(m.shape[0], m.shape[1], -1, m.shape[-1])
    if site.meta.get("transposed"):  # a weight stored [in, out] (LINEAR_TRANSPOSED): x_n g_vnᵀ
        return x[None, :, 0, :, None], g[:, :, 0, None, :]
    return g[:, :, 0, :, None], x[None, :, 0, None, :]


LINEAR = Rule(
    kind="linear",
    grad_batch=grad_batch,
    grad=grad,
    grad_with_squares=grad_with_squares,
    grad_from_batch=grad_from_batch,
    batch_l2=batch_l2,
    sum_grad_squared=sum_grad_squared,
    any_batch_dim=True,
    sum_squares_over_columns=sum_squares_over_columns,
    batch_sum_squares_over_columns=batch_sum_squares_over_columns,
    outer_factors=outer_factors,
    grad_batch_columns=_linear_columns.grad_batch_columns,
    weighted_squares_over_columns=_linear_columns.weighted_squares,
    column_statistic=column_statistic,
    column_squares=column_squares,
)


def _weight_transposed(fn):
    """``fn``'s weight entry for a weight stored transposed (``[in, out]``, GPT-2's ``Conv1D``:
    ``y = x W + b = F.linear(x, Wᵀ, b)``): the last two dims swapped (``[N]`` norms stay)."""

    def transposed(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
        out = dict(fn(site, g, roles))
        if "weight" in out and out["weight"].dim() >= 2:
            out["weight"] = out["weight"].transpose(-1, -2).contiguous()  # (see _grad_batch_transposed)
        return out

    return transposed


#: A Linear site whose weight parameter is ``Wᵀ`` (``[in, out]``); its Kronecker factors are
#: ``[A, B]`` (one per dim of the parameter, as BackPACK orders them), see :func:`curvlib._evaluate.read_off.kronecker_factors`.
LINEAR_TRANSPOSED = Rule(
    kind="linear",
    grad_batch=functools.partial(grad_batch, transposed=True),
    grad=_weight_transposed(grad),
    grad_from_batch=grad_from_batch,
    batch_l2=batch_l2,
    sum_grad_squared=_weight_transposed(sum_grad_squared),
    any_batch_dim=True,
    sum_squares_over_columns=_weight_transposed(sum_squares_over_columns),
    batch_sum_squares_over_columns=_weight_transposed(batch_sum_squares_over_columns),
    outer_factors=outer_factors,
    grad_batch_columns=functools.partial(_linear_columns.grad_batch_columns, transposed=True),
    weighted_squares_over_columns=functools.partial(_linear_columns.weighted_squares, transposed=True),
    column_statistic=column_statistic,
    column_squares=lambda site, m2, roles, per_sample: _weight_transposed(
        functools.partial(column_squares, per_sample=per_sample))(site, m2, roles),
)


def forward(module: nn.Linear, where: str, names: dict, tensors: dict, args, kwargs, rec: Recorder):
    """Run ``nn.Linear`` functionally and record its site."""
    x = argument(args, kwargs, 0, "input")
    out = F.linear(x, tensors["weight"], tensors.get("bias"))
    return rec.add(Site(LINEAR, names, where, saved={"x": x}), out)


#: The family's record (:class:`~curvlib._core.family.Family`), registered in :data:`curvlib.rules.FAMILIES`.
FAMILY = Family("linear", (nn.Linear,), forward, kron=kron, kron_input=kron_input,
                kron_from_output_matrix=kron_from_output_matrix, kron_layout="split",
                kfra_pullback=lambda tensors, G: tensors["weight"].t() @ G @ tensors["weight"],  # Wᵀ G W
                affine_in_input=True, affine_in_parameters=True, bilinear=True, kron_over_uses=True,
                shared_hessian=True, dense_sides=dense_sides, row_wise=True)
