"""Preconditioners from curvlib's results: damped inverses of Kronecker factors, diagonals, EKFAC.

Everything here is a pure function of result dicts (pytrees ``name -> tensor(s)``, as
:func:`curvlib.curvature` returns them): no in-place change of an input, differentiable,
usable under ``torch.func.vmap``/``grad``. A preconditioner maps a dict of vectors
shaped like the parameters (a gradient) to a dict of the same shapes.

**Kronecker factors** (``qs["kfac"]``, ``qs["kflr"]``, ``qs["kfra"]``,
``qs["kfac_empirical"]``; every layout of docs/conventions.md). For a weight with
factors ``[B [o, o], A [a, a]]`` (``B`` output side, ``A = (1/N) Σ x xᵀ`` input side)
and ``V [o, a]`` the vector as a matrix, ``(B ⊗ A + λ I)⁻¹ vec V`` is approximated by
``method``:

* ``"pi"`` (default; Martens & Grosse 2015, §6.3): ``(B + √λ/π I)⁻¹ V (A + π√λ I)⁻¹``
  with ``π = sqrt((tr A / dim A) / (tr B / dim B))``, the damping split in proportion to
  each factor's mean eigenvalue (``π = 1`` if a trace is zero); as curvlinops'
  ``KFACInverseLinearOperator(use_heuristic_damping=True)``;
* ``"plain"``: ``(B + √λ I)⁻¹ V (A + √λ I)⁻¹``;
* ``"exact"``: ``(B ⊗ A + λ I)⁻¹`` exactly, by eigendecompositions ``B = Q_B Λ_B Q_Bᵀ``,
  ``A = Q_A Λ_A Q_Aᵀ``: ``Q_B [(Q_Bᵀ V Q_A) / (λ_B λ_Aᵀ + λ)] Q_Aᵀ``.

On a model sharded with FSDP2 the factors and vectors are DTensors: each layer's factors are
gathered and eigendecomposed once, by the rank that owns the layer, which also preconditions
that layer's vectors; the results come back sharded like the vectors
(:mod:`curvlib.distributed.sharded`).

Grouped factors ``[B [G, o, o], A [G, a, a]]`` act per group (``π`` per group);
Embedding's ``[A [V], B [D, D]]`` is ``diag(A) ⊗ B``; a single factor ``[F [P, P]]`` or
``[F [P]]`` (biases, norms, generic parameters) is the whole block, inverted as
``(F + λ I)⁻¹`` for every method (curvlinops instead damps a bias with its layer's
``B`` damping, ``√λ`` or ``√λ/π``). ``ConvTranspose`` weights ``[C_in, C_out/G, *k]``
are in BackPACK's layout, ``B`` on ``C_out``: pass ``model=`` when a square one could
be mistaken for a convolution (refused otherwise). Eigenvalues are clamped at 0.

**EKFAC** (George et al. 2018): KFAC's eigenbasis, eigenvalues re-fitted to the second
moment of the per-sample gradients ``G_n`` (as matrices ``[o, a]``) in it:
``s = scale · Σ_n (Q_Bᵀ G_n Q_A)²``, and ``(Q_B ⊗ Q_A) (diag(s) + λ)⁻¹ (Q_B ⊗ Q_A)ᵀ``.
With ``rows = qs["grad_batch"]`` (which carry the loss's reduction factor ``c``: ``1/N``
for ``"mean"``) use ``scale = 1/c`` (:func:`reduction_scale`): ``diag(s)`` is then the
empirical Fisher ``c Σ_n ∇ℓ_n ∇ℓ_nᵀ`` in the eigenbasis, scaled as ``KFAC``'s and
``KFLR``'s factors approximate ``c Σ_n J_nᵀ ∇²ℓ_n J_n`` (curvlinops' EKFAC uses the same
correction). With ``rows = qs["sqrt_ggn_exact"]`` (or ``"sqrt_ggn_mc"``), ``scale = 1``
gives the GGN's (MC Fisher's) exact diagonal in the eigenbasis.

**Diagonals** (``diag_ggn_exact``, ``diag_ggn_mc``, ``diag_h``, ``sum_grad_squared``):
``v ⊙ (d + λ)^e`` with ``e = -1`` (Newton-like) or ``-1/2`` (Adam-like); ``negative``
says what happens to negative entries (a Hessian's): ``"clip"`` to 0, ``"abs"``, or
``"error"``.

Example::

    qs = curvature(model, lossfn, [KFAC(), BatchGrad()])(X, y)
    step = kron_inverse_vp(qs["kfac"], qs["grad"], damping=1e-3, model=model)
    s = ekfac_eigenvalues(qs["kfac"], qs["grad_batch"], scale=reduction_scale(lossfn, y))
    step_ekfac = ekfac_inverse_vp(qs["kfac"], s, qs["grad"], damping=1e-3)
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from .._core.errors import CurvatureError
from ._kronbasis import Eigen, Layout, eigen_of, layout_of
from ..distributed.sharded import is_sharded, on_owners, whole
from ..losses import loss_spec, normaliser

__all__ = [
    "kron_inverse_vp", "kron_preconditioner", "ekfac_eigenvalues", "ekfac_inverse_vp",
    "ekfac_preconditioner", "diag_inverse_vp", "reduction_scale", "transposed_weights",
]

METHODS = ("pi", "plain", "exact")
Vectors = Mapping[str, Tensor]


def transposed_weights(model: nn.Module) -> frozenset:
    """Names of ``model``'s ``ConvTranspose`` weights (their factors' ``B`` is on dim 1).

    Args:
        model: the model whose factors are preconditioned.

    Returns:
        frozenset: the names (``model.named_parameters()``'s) of its ``ConvTranspose`` weights.

    Examples::

        >>> from torch import nn
        >>> from curvlib.precondition import transposed_weights
        >>> transposed_weights(nn.Sequential(nn.ConvTranspose2d(2, 2, 3), nn.Conv2d(2, 2, 3)))
        frozenset({'0.weight'})
    """
    return frozenset(
        f"{prefix}.weight" if prefix else "weight"
        for prefix, m in model.named_modules()
        if isinstance(m, nn.modules.conv._ConvTransposeNd)
    )


def reduction_scale(lossfn, y: Tensor) -> float:
    """``1/c`` for a structural loss (``nn.CrossEntropyLoss``, ``nn.MSELoss``,
    ``nn.BCEWithLogitsLoss``) on targets ``y``: ``N`` for cross-entropy with
    ``reduction="mean"`` on class indices ``[N]``, ``y.numel()`` for MSE, 1 for ``"sum"``.

    Args:
        lossfn: the loss module the results were computed with.
        y: the targets of the batch.

    Returns:
        float: ``1/c``, the ``scale`` ``ekfac_eigenvalues`` takes for ``qs["grad_batch"]``.

    Raises:
        CurvatureError: a generic loss, whose normaliser curvlib does not know.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib.precondition import reduction_scale
        >>> reduction_scale(nn.CrossEntropyLoss(), torch.tensor([0, 2, 1]))
        3.0
        >>> reduction_scale(nn.MSELoss(reduction="sum"), torch.zeros(4, 3))
        1.0
    """
    m = normaliser(loss_spec(lossfn), y)
    if m is None:
        raise CurvatureError(f"reduction_scale: the normaliser of the generic loss {lossfn!r} is unknown; "
                             "pass scale= yourself (1 for a sum over samples, N for a mean).")
    return float(m)


def _check_damping(damping: float) -> None:
    if isinstance(damping, bool) or not isinstance(damping, (int, float)) or not damping > 0 \
            or not math.isfinite(damping):
        raise CurvatureError(f"damping={damping!r}: must be a positive finite float.")


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise CurvatureError(f"method={method!r} is not supported; use one of {METHODS}.")


def _factors_of(factors: Mapping[str, Sequence[Tensor]], name: str):
    if name not in factors:
        raise CurvatureError(f"no Kronecker factors for parameter {name!r} (factors have {sorted(factors)}).")
    return factors[name]


def _layout(factors, name: str, shape, transposed: Optional[frozenset]) -> Layout:
    flag = None if transposed is None else name in transposed
    return layout_of(name, _factors_of(factors, name), shape, flag)


def _denominator(eig: Eigen, layout: Layout, damping: float, method: str) -> Tensor:
    """``[G, o, a]``: the damped eigenvalues of the approximation, per entry of the core."""
    lo, li = eig.lam_out, eig.lam_in
    if layout.single or method == "exact":
        return lo[:, :, None] * li[:, None, :] + damping
    root = math.sqrt(damping)
    if method == "plain":
        return (lo + root)[:, :, None] * (li + root)[:, None, :]
    mean_o, mean_i = lo.mean(-1, keepdim=True), li.mean(-1, keepdim=True)
    ok = (mean_o > 0) & (mean_i > 0)
    pi = torch.where(ok, (mean_i / torch.where(ok, mean_o, 1.0)).sqrt(), 1.0)  # [G, 1]
    return (lo + root / pi)[:, :, None] * (li + root * pi)[:, None, :]


def _apply(eig: Eigen, layout: Layout, denom: Tensor, v: Tensor) -> Tensor:
    core = eig.rotate(layout.to_core(v)) / denom
    return layout.from_core(eig.unrotate(core))


def _in_eigenbasis(factors, model: Optional[nn.Module], denominator) -> Callable[[Vectors], Dict[str, Tensor]]:
    """``v -> Q (Qᵀ v / d)`` per parameter, ``Q`` the factors' eigenbasis (computed at the
    first use of a name, then kept) and ``d [G, o, a]`` from ``denominator(name, eig,
    layout)``, read at every call (EKFAC's eigenvalues may be updated in between)."""
    transposed = transposed_weights(model) if model is not None else None
    cache: Dict[str, Eigen] = {}

    def prepare(name: str, v: Tensor, mine: bool) -> Optional[Eigen]:  # (a sharded model's factors gathered whole)
        gathered = [whole(f) for f in _factors_of(factors, name)]
        return eigen_of(gathered, _layout(factors, name, v.shape, transposed), name) if mine else None

    def apply(name: str, eig: Eigen, v: Tensor) -> Tensor:
        layout = _layout(factors, name, v.shape, transposed)
        return _apply(eig, layout, denominator(name, eig, layout), v)

    def precondition(vectors: Vectors) -> Dict[str, Tensor]:
        if any(is_sharded(v) for v in vectors.values()):  # one rank per layer (curvlib.distributed.sharded)
            return on_owners(vectors, cache, prepare, apply)
        out = {}
        for name, v in vectors.items():
            layout = _layout(factors, name, v.shape, transposed)
            if name not in cache:
                cache[name] = eigen_of(factors[name], layout, name)
            out[name] = _apply(cache[name], layout, denominator(name, cache[name], layout), v)
        return out

    return precondition


def kron_preconditioner(factors: Mapping[str, Sequence[Tensor]], damping: float, *, method: str = "pi",
                        model: Optional[nn.Module] = None) -> Callable[[Vectors], Dict[str, Tensor]]:
    r"""Eigendecompose the factors once; return $P(\mathrm{vectors}) = \{\mathrm{name}: (F_\mathrm{name} + \lambda)^{-1} v\}$.

    Args:
        factors: ``qs["kfac"]`` (or ``"kflr"``, ``"kfra"``, ``"kfac_empirical"``): name ->
            list of factors (module doc for the layouts).
        damping: $\lambda > 0$.
        method: ``"pi"``, ``"plain"`` or ``"exact"`` (module doc, with the formulas).
        model: the model, to know its ``ConvTranspose`` weights (optional otherwise).

    Returns:
        ``P``, mapping a dict of tensors shaped like the parameters (any subset of the
        factors' names; batch them with ``torch.func.vmap``) to the preconditioned dict.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import KFLR
        >>> from curvlib.precondition import kron_preconditioner
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [KFLR()])(X, y)
        >>> P = kron_preconditioner(qs["kflr"], damping=1e-3, model=model)
        >>> step = P(qs["grad"])                      # a dict shaped like the parameters
        >>> step["0.weight"].shape
        torch.Size([4, 3])
    """
    _check_damping(damping)
    _check_method(method)
    return _in_eigenbasis(factors, model, lambda name, eig, layout: _denominator(eig, layout, damping, method))


def kron_inverse_vp(factors: Mapping[str, Sequence[Tensor]], vectors: Vectors, damping: float, *,
                    method: str = "pi", model: Optional[nn.Module] = None) -> Dict[str, Tensor]:
    r"""$\{\mathrm{name}: (F_\mathrm{name} + \lambda I)^{-1} v_\mathrm{name}\}$ for Kronecker factors (module doc for ``method``).

    ``kron_preconditioner`` caches the eigendecompositions for many calls.

    Args:
        factors: ``qs["kfac"]`` (or ``"kflr"``, ``"kfra"``, ``"kfac_empirical"``): name ->
            list of factors (module doc for the layouts).
        vectors: name -> tensor shaped like the parameter (e.g. ``qs["grad"]``), or
            ``[K, *p.shape]`` for ``K`` vectors.
        damping: $\lambda > 0$.
        method: ``"pi"``, ``"plain"`` or ``"exact"`` (module doc, with the formulas).
        model: the model, to know its ``ConvTranspose`` weights (optional otherwise).

    Returns:
        dict: name -> the preconditioned vector, shaped like ``vectors[name]``.

    Raises:
        CurvatureError: ``damping`` is not positive, an unknown ``method``, a vector without
            factors or of the wrong shape.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import KFLR
        >>> from curvlib.precondition import kron_inverse_vp
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [KFLR()])(X, y)
        >>> step = kron_inverse_vp(qs["kflr"], qs["grad"], damping=1e-2, method="exact")
        >>> {name: tuple(t.shape) for name, t in step.items()}["2.weight"]
        (2, 4)
    """
    return kron_preconditioner(factors, damping, method=method, model=model)(vectors)


def ekfac_eigenvalues(factors: Mapping[str, Sequence[Tensor]], rows: Vectors, *, scale: float,
                      model: Optional[nn.Module] = None) -> Dict[str, Tensor]:
    r"""EKFAC's re-fitted eigenvalues $s = \mathrm{scale} \cdot \sum_n (Q_B^\top G_n Q_A)^2$ per parameter.

    Args:
        factors: Kronecker factors (their eigenvectors are the basis).
        rows: name -> ``[K, *p.shape]`` gradient-like rows ``G_n``: ``qs["grad_batch"]``
            (``K = N``), or ``qs["sqrt_ggn_mc"]``/``["sqrt_ggn_exact"]`` ``[M, N, *p]``
            (all leading dims are summed over).
        scale: ``1/c`` for ``grad_batch`` (``reduction_scale``), 1 for square roots.
        model: the model, to know its ``ConvTranspose`` weights (optional otherwise).

    Returns:
        name -> ``s``, shaped ``[G, o, a]`` (the core of the layout; ``[1, o, a]`` for an
        ungrouped weight, ``[1, P, 1]`` for a single factor; where the first factor is 1-D,
        as for an Embedding ``[V, D]`` with factors ``[A [V], B [D, D]]``, the core is the
        parameter transposed, ``[1, D, V]``). ``ekfac_preconditioner`` reads it so; index
        it by parameter entry only through that layout.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import BatchGrad, KFLR
        >>> from curvlib.precondition import ekfac_eigenvalues
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [KFLR(), BatchGrad()])(X, y)
        >>> s = ekfac_eigenvalues(qs["kflr"], qs["grad_batch"], scale=len(X))   # 1/c of a "mean" loss
        >>> s["0.weight"].shape                                  # [G, o, a]
        torch.Size([1, 4, 3])
    """
    transposed = transposed_weights(model) if model is not None else None
    out = {}
    for name, r in rows.items():
        f = _factors_of(factors, name)
        lead = _row_dims(name, r, f)
        layout = _layout(factors, name, r.shape[lead:], transposed)
        rotated = eigen_of(f, layout, name).rotate(layout.to_core(r.reshape(-1, *r.shape[lead:])))
        out[name] = rotated.square().sum(0) * scale
    return out


def _row_dims(name: str, r: Tensor, f) -> int:
    """Leading (row) dims of ``r``: 1 for ``[N, *p]``, 2 for ``[M, N, *p]``; read off the
    factors' total size (the parameter's numel)."""
    numel = 1
    for t in f:
        numel *= t.shape[-1] * (t.shape[0] if t.dim() == 3 else 1)
    for lead in (1, 2):
        if math.prod(r.shape[lead:]) == numel and r.dim() > lead:
            return lead
    raise CurvatureError(f"rows for parameter {name!r} of shape {list(r.shape)}: expected [N, *p] or "
                         f"[M, N, *p] with numel(p) = {numel}.")


def ekfac_preconditioner(factors: Mapping[str, Sequence[Tensor]], eigenvalues: Mapping[str, Tensor],
                         damping: float, *, model: Optional[nn.Module] = None
                         ) -> Callable[[Vectors], Dict[str, Tensor]]:
    r"""$P(\mathrm{vectors}) = \{\mathrm{name}: (Q_B \otimes Q_A)(\operatorname{diag}(s) + \lambda)^{-1}(Q_B \otimes Q_A)^\top v\}$ for ``s`` from
    ``ekfac_eigenvalues`` (same ``factors``).

    Args:
        factors: the Kronecker factors ``ekfac_eigenvalues`` took (their eigenvectors are the basis).
        eigenvalues: ``ekfac_eigenvalues``' result: name -> ``s [G, o, a]``.
        damping: $\lambda > 0$.
        model: the model, to know its ``ConvTranspose`` weights (optional otherwise).

    Returns:
        ``P``, mapping a dict of tensors shaped like the parameters to the preconditioned dict.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import BatchGrad, KFLR
        >>> from curvlib.precondition import ekfac_eigenvalues, ekfac_preconditioner
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [KFLR(), BatchGrad()])(X, y)
        >>> s = ekfac_eigenvalues(qs["kflr"], qs["grad_batch"], scale=len(X))
        >>> P = ekfac_preconditioner(qs["kflr"], s, damping=1e-3)
        >>> P(qs["grad"])["2.weight"].shape
        torch.Size([2, 4])
    """
    _check_damping(damping)

    def denominator(name: str, eig: Eigen, layout: Layout) -> Tensor:
        if name not in eigenvalues:
            raise CurvatureError(f"no EKFAC eigenvalues for parameter {name!r}.")
        return eigenvalues[name] + damping

    return _in_eigenbasis(factors, model, denominator)


def ekfac_inverse_vp(factors: Mapping[str, Sequence[Tensor]], eigenvalues: Mapping[str, Tensor],
                     vectors: Vectors, damping: float, *, model: Optional[nn.Module] = None) -> Dict[str, Tensor]:
    r"""One-shot ``ekfac_preconditioner`` applied to ``vectors``.

    Args:
        factors: the Kronecker factors ``ekfac_eigenvalues`` took.
        eigenvalues: ``ekfac_eigenvalues``' result: name -> ``s [G, o, a]``.
        vectors: name -> tensor shaped like the parameter (e.g. ``qs["grad"]``).
        damping: $\lambda > 0$.
        model: the model, to know its ``ConvTranspose`` weights (optional otherwise).

    Returns:
        dict: name -> the preconditioned vector, shaped like ``vectors[name]``.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import BatchGrad, KFLR
        >>> from curvlib.precondition import ekfac_eigenvalues, ekfac_inverse_vp
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [KFLR(), BatchGrad()])(X, y)
        >>> s = ekfac_eigenvalues(qs["kflr"], qs["grad_batch"], scale=len(X))
        >>> ekfac_inverse_vp(qs["kflr"], s, qs["grad"], damping=1e-3)["0.bias"].shape
        torch.Size([4])
    """
    return ekfac_preconditioner(factors, eigenvalues, damping, model=model)(vectors)


def diag_inverse_vp(diagonal: Vectors, vectors: Vectors, damping: float, *, exponent: float = -1.0,
                    negative: str = "clip") -> Dict[str, Tensor]:
    r"""$\{\mathrm{name}: v \odot (d' + \lambda)^\mathrm{exponent}\}$ with ``d'`` the diagonal after ``negative``.

    Args:
        diagonal: name -> ``p.shape`` (``diag_ggn_exact``, ``diag_ggn_mc``, ``diag_h``,
            ``sum_grad_squared``, ...).
        vectors: name -> ``p.shape`` (e.g. ``qs["grad"]``).
        damping: $\lambda > 0$.
        exponent: ``-1`` (inverse) or e.g. ``-0.5`` (Adam-like); any negative float.
        negative: ``"clip"`` (``max(d, 0)``), ``"abs"`` (``|d|``) or ``"error"`` (refuse a
            negative entry; needs concrete values) for an indefinite diagonal (the Hessian's).

    Returns:
        dict: name -> $v \odot (d' + \lambda)^\mathrm{exponent}$, shaped like ``vectors[name]``.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import DiagHessian
        >>> from curvlib.precondition import diag_inverse_vp
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [DiagHessian()])(X, y)
        >>> step = diag_inverse_vp(qs["diag_h"], qs["grad"], 1e-3, negative="abs")
        >>> step["0.weight"].shape
        torch.Size([4, 3])
    """
    _check_damping(damping)
    if negative not in ("clip", "abs", "error"):
        raise CurvatureError(f"negative={negative!r} is not supported; use 'clip', 'abs' or 'error'.")
    if not exponent < 0:
        raise CurvatureError(f"exponent={exponent!r}: must be negative (-1 inverse, -0.5 Adam-like).")
    out = {}
    for name, v in vectors.items():
        if name not in diagonal or diagonal[name].shape != v.shape:
            raise CurvatureError(f"diagonal for parameter {name!r} missing or not of shape {list(v.shape)}.")
        d = diagonal[name]
        if negative == "error" and bool((d < 0).any()):
            raise CurvatureError(f"diagonal of parameter {name!r} has negative entries (min {float(d.min()):.3g}); "
                                 "use negative='clip' or 'abs'.")
        d = d.abs() if negative == "abs" else d.clamp_min(0)
        out[name] = v * (d + damping).pow(exponent)
    return out
