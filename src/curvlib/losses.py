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
            lo, hi = int(y.min()), int(y.max())
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
