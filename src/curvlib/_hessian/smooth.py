"""Signed columns of residuals that stay differentiable (derivatives *through* results).

The Hessian diagonal pulls signed columns ``c`` with ``R = Σ_c s_c c cᵀ`` back
through the graph (:func:`curvlib._hessian.algebra.factor`). The default columns
are ``q √λ±``: an eigendecomposition (or an SVD) and a square root of each sign's
part. Their values are exact, but their derivatives are not: ``√`` has an
infinite slope at 0 (every entry's *other* sign part is exactly 0, so a forward-
mode tangent is ``0/0 = NaN``), and an eigenvector's derivative divides by
eigenvalue gaps (``inf`` for the repeated eigenvalues of a LayerNorm block).

When derivatives flow (:func:`flows`), the columns come from a polarisation
identity instead, smooth in ``R`` and exact for *every* ``α ≠ 0``:

    (αI + R/(4α))(αI + R/(4α))ᵀ − (αI − R/(4α))(αI − R/(4α))ᵀ = R      (R symmetric),
    (a u + b w)(a u + b w)ᵀ − (a u − b w)(a u − b w)ᵀ = 2ab (u wᵀ + w uᵀ).

Since the identity holds for any ``α``, any derivative of the columns' signed sum
is the derivative of ``R`` itself, whatever ``α``'s own derivative: ``α`` only
sets the scale (chosen like ``√|R|``, so that the round-off of the difference is
relative to ``R``'s largest entry, as for ``q √λ±``), and never vanishes (a zero
entry borrows its sample's largest, or 1), so nothing divides by 0. For an
element-wise residual with ``α = √|r|/2`` the columns *equal* ``√r±``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._core import inputs as _inputs
from .._core.errors import CurvatureError


def transform_levels() -> Tuple[bool, bool]:
    """``(any torch.func transform active, a differentiating one: grad/jvp/jacrev/hessian)``."""
    stack = torch._C._functorch.get_interpreter_stack()
    if not stack:
        return False, False
    diff = (torch._C._functorch.TransformType.Grad, torch._C._functorch.TransformType.Jvp)
    return True, any(i.key() in diff for i in stack)


def flows(*tensors: Tensor) -> bool:
    """Whether derivatives can be taken of results built from ``tensors``: any of them
    requires grad (plain autograd) or a torch.func transform is active (its tensors are
    wrapped; a vmap alone needs no derivative, but smooth columns are exact there too)."""
    if transform_levels()[0]:
        return True
    return any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def _positive(a: Tensor, dims) -> Tensor:
    """``a ≥ 0`` with its zeros replaced by the largest entry over ``dims`` (or by 1 where all
    are 0): a scale that never vanishes. (``where`` picks before any ``√``: no ``0·inf``.)"""
    top = a.amax(dim=dims, keepdim=True)
    top = torch.where(top > 0, top, torch.ones_like(top))
    return torch.where(a > 0, a, top)


def diag_pair(r: Tensor) -> Tuple[Tensor, Tensor]:
    """``(c₊, c₋)`` with ``c₊² − c₋² = r`` entry-wise, smooth in ``r [N, *]``: ``α ± r/(4α)``,
    ``α = √|r|/2`` (so ``c± = √r±`` where ``r ≠ 0``)."""
    dims = tuple(range(1, r.dim())) or (0,)
    alpha = _positive(r.abs(), dims).sqrt() / 2
    beta = r / (4 * alpha)
    return alpha + beta, alpha - beta


def product_pair(g: Tensor) -> Tuple[Tensor, Tensor]:
    """``(a, b)`` with ``2ab = g`` entry-wise, smooth in ``g [N, *]``: ``a = √(|g|/2)``
    (zeros borrowed), ``b = g/(2a)`` (``= sign(g) √(|g|/2)`` where ``g ≠ 0``)."""
    dims = tuple(range(1, g.dim())) or (0,)
    a = (_positive(g.abs(), dims) / 2).sqrt()
    return a, g / (2 * a)


def row_scale(G: Tensor) -> Tensor:
    """``√(‖G_row‖/2)`` over the last axis of ``G [N, ..., O]`` -> ``[N, ...]``, zeros borrowed
    (the norm from its square: ``‖·‖`` has no derivative at 0)."""
    n2 = (G * G).sum(-1)
    dims = tuple(range(1, n2.dim())) or (0,)
    return (_positive(n2, dims).sqrt() / 2).sqrt()


def polarised(R: Tensor) -> Tuple[Tensor, Tensor]:
    """``(W₊, W₋) = αI ± R/(4α)`` per block of ``R [..., S, S]`` (symmetric): their columns
    satisfy ``W₊W₊ᵀ − W₋W₋ᵀ = R``; ``α = √(max|R|)/2`` per block."""
    top = R.abs().amax(dim=(-2, -1), keepdim=True)
    alpha = torch.where(top > 0, top, torch.ones_like(top)).sqrt() / 2
    eye = torch.eye(R.shape[-1], dtype=R.dtype, device=R.device)
    return alpha * eye + R / (4 * alpha), alpha * eye - R / (4 * alpha)


def derivatives_requested(X, values) -> Optional[str]:
    """How derivatives may be taken through a call's results (``None``: they cannot):
    ``X``/``params`` that require grad with grad mode on (plain autograd), or a
    differentiating torch.func transform (``grad``, ``jvp``, ``jacrev``, ``hessian``)."""
    if torch.is_grad_enabled() and (
        any(t.requires_grad for t in _inputs.tensors(X)) or any(v.requires_grad for v in values.values())
    ):
        return "X or params that require grad"
    return "a torch.func grad/jvp transform" if transform_levels()[1] else None


def refuse_pchmp(ext, how: Optional[str]) -> None:
    """Refuse, before the product's work, a ``PCHMP`` product whose call was differentiable.

    ``PCHMP`` modifies eigenvalues (``max(λ, 0)`` or ``|λ|``): not differentiable where an
    eigenvalue is 0, and its eigenvectors' derivatives divide by eigenvalue gaps, which
    vanish structurally (a LayerNorm row's residual has ``d − 3`` equal eigenvalues: torch's
    ``eigh`` derivative is then wrong or NaN). Rather than a derivative defined almost
    everywhere on some models and wrong on others, curvlib refuses derivatives through
    ``PCHMP`` altogether. The refusal comes when the product is applied (the other results
    of the same call stay differentiable; nothing of the product has been computed yet):
    when the call's ``X``/``params`` required grad and grad mode is on, or it ran under a
    differentiating torch.func transform. ``vmap`` alone is not refused.
    """
    if how is None or (how.startswith("X") and not torch.is_grad_enabled()):
        return
    raise CurvatureError(
        f"PCHMP(modify={ext.modify!r}) with {how}: its eigenvalue modification (clip/abs) is not "
        "differentiable (kinks at zero eigenvalues, eigenvector derivatives that divide by vanishing "
        "eigenvalue gaps), so curvlib returns no derivatives through it. Apply the product under "
        "torch.no_grad(), or call f with detached X/params for PCHMP (HMP and GGNMP are differentiable)."
    )
