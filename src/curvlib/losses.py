"""Loss functions: checks, value and output gradient, and where ``"mean"`` scales.

Supported: ``nn.MSELoss``, ``nn.CrossEntropyLoss`` (class indices, outputs
``[N, C]`` or ``[N, C, *D]``) and ``nn.BCEWithLogitsLoss``, each with
``reduction="mean"`` or ``"sum"``.

Every supported loss is a sum over samples, ``L = c · Σ_n ℓ(f_n, y_n)``, with
the reduction factor ``c`` = 1 for ``"sum"`` and ``1/M`` for ``"mean"``, where
``M`` is the number of averaged terms:

* MSE and BCE: ``M = out.numel()`` (every output entry is a term),
* CE: ``M = N · prod(D)`` (one term per sample and spatial position).

Because ``L`` is a sum of per-sample terms, the gradient of ``L`` with respect
to the model output, row ``n``, is the gradient of sample ``n``'s own term
(factor ``c`` included). That is what makes BackPACK's convention hold: the
individual gradients carry ``c`` and sum to the gradient.

This module is the only place that knows ``c``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from ._errors import CurvatureError, CurvatureTypeError

__all__ = ["LossSpec", "loss_spec", "check_targets", "reduction_factor"]

SUPPORTED_LOSSES = "nn.MSELoss, nn.CrossEntropyLoss, nn.BCEWithLogitsLoss"


@dataclass(frozen=True)
class LossSpec:
    """What curvlib needs to know of a loss module (a plain record, no tensors).

    Attributes:
        kind: ``"mse"``, ``"ce"`` or ``"bce"``.
        reduction: ``"mean"`` or ``"sum"``.
        module: the user's loss module; called, never changed.
    """

    kind: Literal["mse", "ce", "bce"]
    reduction: Literal["mean", "sum"]
    module: nn.Module


def loss_spec(lossfn: object) -> LossSpec:
    """Check that ``lossfn`` is a supported loss module and describe it.

    Raises:
        CurvatureTypeError: ``lossfn`` is not one of the supported loss modules.
        CurvatureError: it has an option curvlib does not support.
    """
    if isinstance(lossfn, nn.MSELoss):
        kind = "mse"
    elif isinstance(lossfn, nn.CrossEntropyLoss):
        kind = "ce"
    elif isinstance(lossfn, nn.BCEWithLogitsLoss):
        kind = "bce"
    else:
        raise CurvatureTypeError(
            f"lossfn must be one of {SUPPORTED_LOSSES} (an instance), got "
            f"{type(lossfn).__name__}: {lossfn!r}."
        )
    name = type(lossfn).__name__
    reduction = lossfn.reduction
    if reduction not in ("mean", "sum"):
        raise CurvatureError(
            f"{name}(reduction={reduction!r}) is not supported: curvlib needs a "
            "scalar loss. Use reduction='mean' or reduction='sum'."
        )
    if kind == "ce":
        if lossfn.weight is not None:
            raise CurvatureError(
                "CrossEntropyLoss(weight=...) is not supported (class weights "
                "change the 'mean' normaliser per batch). Use weight=None."
            )
        if lossfn.label_smoothing != 0.0:
            raise CurvatureError(
                f"CrossEntropyLoss(label_smoothing={lossfn.label_smoothing}) is "
                "not supported. Use label_smoothing=0.0."
            )
    if kind == "bce" and (lossfn.weight is not None or lossfn.pos_weight is not None):
        raise CurvatureError(
            "BCEWithLogitsLoss(weight=..., pos_weight=...) is not supported. "
            "Use weight=None and pos_weight=None."
        )
    return LossSpec(kind=kind, reduction=reduction, module=lossfn)


def _is_concrete(t: Tensor) -> bool:
    """True if ``t`` holds plain values (not a vmap/grad wrapper we cannot read)."""
    try:
        return not torch._C._functorch.is_functorch_wrapped_tensor(t)
    except AttributeError:  # pragma: no cover - older torch
        return True


def check_targets(spec: LossSpec, out: Tensor, y: object) -> None:
    """Refuse targets that do not fit the model output for this loss.

    Args:
        spec: the loss.
        out: model output ``[N, *]``.
        y: targets, batch in dim 0.

    Raises:
        CurvatureTypeError: ``y`` is not a tensor or has the wrong dtype.
        CurvatureError: shapes do not match, or a class index is out of range.
    """
    name = type(spec.module).__name__
    if not isinstance(y, Tensor):
        raise CurvatureTypeError(f"y must be a torch.Tensor, got {type(y).__name__}.")
    if out.dim() == 0:
        raise CurvatureError("The model output is a scalar; it needs the batch in dim 0.")
    if spec.kind == "ce":
        if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
            raise CurvatureTypeError(
                f"{name} needs integer class indices as y (dtype torch.long), got "
                f"dtype {y.dtype}. Class probabilities as targets are not supported."
            )
        if out.dim() < 2:
            raise CurvatureError(
                f"{name} needs model outputs [N, C] or [N, C, *D], got shape "
                f"{tuple(out.shape)}."
            )
        expected = (out.shape[0],) + tuple(out.shape[2:])
        if tuple(y.shape) != expected:
            raise CurvatureError(
                f"{name}: y has shape {tuple(y.shape)}, but for model output "
                f"{tuple(out.shape)} it must have shape {expected} (class indices)."
            )
        num_classes = out.shape[1]
        if _is_concrete(y) and y.numel() > 0:
            lo, hi = torch.aminmax(y.detach()) if y.dtype != torch.uint8 else (y.min(), y.max())
            lo, hi = int(lo), int(hi)
            if lo < 0 or hi >= num_classes:
                bad = lo if lo < 0 else hi
                raise CurvatureError(
                    f"{name}: y holds class index {bad}, outside [0, {num_classes - 1}] "
                    f"for a model with {num_classes} classes (ignore_index entries "
                    "are not supported)."
                )
        return
    if not y.is_floating_point():
        raise CurvatureTypeError(
            f"{name} needs floating-point targets y, got dtype {y.dtype}."
        )
    if tuple(y.shape) != tuple(out.shape):
        raise CurvatureError(
            f"{name}: y has shape {tuple(y.shape)}, but the model output has shape "
            f"{tuple(out.shape)}; they must be equal."
        )
    if y.dtype != out.dtype:
        raise CurvatureTypeError(
            f"{name}: y has dtype {y.dtype} but the model output has dtype "
            f"{out.dtype}; they must be equal."
        )


def reduction_factor(spec: LossSpec, out: Tensor) -> float:
    """The factor ``c`` in ``L = c · Σ_n ℓ_n`` (see the module docstring)."""
    if spec.reduction == "sum":
        return 1.0
    if spec.kind == "ce":
        return 1.0 / (out.numel() // out.shape[1])
    return 1.0 / out.numel()


def loss_value(spec: LossSpec, out: Tensor, y: Tensor) -> Tensor:
    """``lossfn(out, y)``, computed by the user's own (stateless) loss module."""
    return spec.module(out, y)


def _per_sample_columns(out: Tensor) -> int:
    """Number of output entries per sample (the contract's ``C``)."""
    return out[0].numel() if out.shape[0] > 0 else 0


def sqrt_hessian(spec: LossSpec, out: Tensor, y: Tensor) -> Tensor:
    """Exact symmetric factor of the loss Hessian w.r.t. the model output.

    Returns ``S [C, N, *out.shape[1:]]`` with ``C`` the number of output
    entries per sample, such that for every sample ``n``

        Σ_v S[v, n] S[v, n]ᵀ = c · ∇²ℓ(out[n], y[n]),

    where ``c`` is the reduction factor (so ``Sᵀ S`` summed over samples is the
    Hessian of the *returned* loss). Columns are indexed by the flattened
    per-sample output entry, BackPACK's order.

    * MSE: ``∇²ℓ = 2 I``, ``S = √(2c) I``.
    * BCE: ``∇²ℓ = diag(σ(f)(1 − σ(f)))``, ``S = √c · diag(√(σ(1 − σ)))``.
    * CE (per sample and position): ``∇²ℓ = diag(p) − p pᵀ``, ``p = softmax(f)``;
      column ``c'`` of the root is ``√p_{c'} (e_{c'} − p)``, non-zero only at
      its own position.
    """
    n = out.shape[0]
    per = _per_sample_columns(out)
    c = reduction_factor(spec, out)
    eye = torch.eye(per, dtype=out.dtype, device=out.device)
    if spec.kind == "mse":
        diag = torch.full_like(out, (2.0 * c) ** 0.5)
    elif spec.kind == "bce":
        s = torch.sigmoid(out)
        diag = (s * (1 - s) * c).sqrt()
    else:
        p = torch.softmax(out, dim=1)  # [N, K, *D]
        k = out.shape[1]
        rest = out[0, 0].numel()
        p_flat = p.reshape(n, k, rest)  # [N, K, R]
        # S[(a, r), n, b, r'] = δ(r, r') √p[n,a,r] (δ(a,b) − p[n,b,r])
        eye_k = torch.eye(k, dtype=out.dtype, device=out.device)
        block = p_flat.sqrt().permute(1, 2, 0)[:, :, :, None] * (
            eye_k[:, None, None, :] - p_flat.permute(2, 0, 1)[None]
        )  # [K(a), R(r), N, K(b)]
        eye_r = torch.eye(rest, dtype=out.dtype, device=out.device)
        S = block[..., None] * eye_r[None, :, None, None, :]  # [a, r, n, b, r']
        return (S * c**0.5).reshape((k * rest, n) + tuple(out.shape[1:]))
    # diagonal Hessians: column v is the v-th output entry
    S = eye.reshape((per, 1) + tuple(out.shape[1:])) * diag.unsqueeze(0)
    return S


def sqrt_hessian_sampled(
    spec: LossSpec,
    out: Tensor,
    y: Tensor,
    mc_samples: int,
    generator: "torch.Generator | None" = None,
) -> Tensor:
    """Monte-Carlo symmetric factor of the loss Hessian, ``[M, N, *out.shape[1:]]``.

    Column ``m`` is ``√(c/M) · ∇_f ℓ(f, ŷ_m)`` with ``ŷ_m`` drawn from the
    model's predictive distribution, so that ``E[Σ_m s_m s_mᵀ] = c · ∇²ℓ``
    (the Fisher equals the Hessian for these losses):

    * MSE: ``ℓ = ‖f − y‖²`` is ``−log N(y; f, ½I)`` up to a constant;
      ``∇ℓ = 2(f − ŷ) = √2 ε``, ``ε ~ N(0, I)``.
    * BCE: ``ŷ ~ Bernoulli(σ(f))``, ``∇ℓ = σ(f) − ŷ``.
    * CE: ``ŷ ~ Categorical(softmax(f))`` per sample and position,
      ``∇ℓ = p − onehot(ŷ)``.

    The same ``generator`` state gives the same result.
    """
    c = reduction_factor(spec, out)
    scale = (c / mc_samples) ** 0.5
    shape = (mc_samples,) + tuple(out.shape)
    if spec.kind == "mse":
        eps = torch.randn(shape, generator=generator, dtype=out.dtype, device=out.device)
        return eps * (2.0**0.5 * scale)
    if spec.kind == "bce":
        s = torch.sigmoid(out).detach()
        draws = torch.bernoulli(s.expand(shape).contiguous(), generator=generator)
        return (torch.sigmoid(out) - draws) * scale
    p = torch.softmax(out, dim=1)
    k = out.shape[1]
    p_rows = p.movedim(1, -1).reshape(-1, k)  # [N·R, K]
    # Inverse-CDF sampling, ŷ = #{j : P_j ≤ u} with P the cumulative probabilities and
    # u ~ U[0, 1): a few vectorised ops, several times cheaper than torch.multinomial
    # for the small class counts of a loss (rounding in P only shifts mass ~1e-7).
    u = torch.rand((mc_samples, p_rows.shape[0], 1), generator=generator, dtype=out.dtype, device=out.device)
    cdf = p_rows.detach().cumsum(-1)  # [N·R, K]
    draws = (cdf.unsqueeze(0) <= u).sum(-1).clamp_(max=k - 1)  # [M, N·R]
    onehot = torch.nn.functional.one_hot(draws, k).to(out.dtype)  # [M, N·R, K]
    grads = p_rows.unsqueeze(0) - onehot
    moved = tuple(out.movedim(1, -1).shape)
    return (grads.reshape((mc_samples,) + moved).movedim(-1, 2) * scale)


def hessian_matvec(spec: LossSpec, out: Tensor, y: Tensor, mat: Tensor) -> Tensor:
    """``c · ∇²ℓ`` applied per sample: ``mat [V, N, *out.shape[1:]]`` -> same shape."""
    c = reduction_factor(spec, out)
    if spec.kind == "mse":
        return 2.0 * c * mat
    if spec.kind == "bce":
        s = torch.sigmoid(out)
        return c * s * (1 - s) * mat
    p = torch.softmax(out, dim=1)
    return c * (p * mat - p * (p * mat).sum(2, keepdim=True))
