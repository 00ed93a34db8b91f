"""Target checks for ``nn.CrossEntropyLoss``: class indices or class probabilities."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn

from .._core.errors import CurvatureError, CurvatureTypeError
from .._core.tensors import is_concrete
from ._structural import may_be_negative, negative_scale
from .._core.strategy import batched


def check_cross_entropy_targets(module, out: Tensor, y: Tensor, negative: Optional[Tensor] = None) -> Optional[bool]:
    """Class indices ``[N, *D]`` (``ignore_index`` allowed) or probabilities ``[N, K, *D]``.

    ``out`` is the model output ``[N, K, *D]``. Raises a :class:`CurvatureError`
    naming the bad shape, dtype or class index. ``negative`` (a 0-dim bool tensor)
    is read with the class-index range, in the same host read; returns its value
    (``None`` if not given or nothing was read).
    """
    name = type(module).__name__
    if out.dim() < 2:
        raise CurvatureError(
            f"{name} needs model outputs [N, C] or [N, C, *D], got shape {tuple(out.shape)}."
        )
    if y.is_complex() or y.dtype == torch.bool:
        raise CurvatureTypeError(
            f"{name} needs class indices (an integer dtype) or class probabilities (the output's "
            f"floating dtype) as y, got dtype {y.dtype}."
        )
    if y.is_floating_point():
        _check_probabilities(name, out, y)
        if module.ignore_index >= 0:  # (PyTorch's own check, made before any work)
            raise CurvatureError(
                f"{name}(ignore_index={module.ignore_index}) with class probabilities y: PyTorch "
                "supports ignore_index for class indices only (a negative ignore_index, such as "
                "the default -100, is allowed and unused)."
            )
        return None if negative is None else bool(negative)
    expected = (out.shape[0],) + tuple(out.shape[2:])
    if tuple(y.shape) != expected:
        raise CurvatureError(
            f"{name}: y has shape {tuple(y.shape)}, but for model output {tuple(out.shape)} it must "
            f"have shape {expected} (class indices) or {tuple(out.shape)} (class probabilities)."
        )
    return _check_class_range(module, name, out.shape[1], y, negative)


def _check_probabilities(name: str, out: Tensor, y: Tensor) -> None:
    if tuple(y.shape) != tuple(out.shape):
        raise CurvatureError(
            f"{name}: y has the floating dtype {y.dtype} (class probabilities) and shape "
            f"{tuple(y.shape)}, but class probabilities must have the model output's shape "
            f"{tuple(out.shape)}; class indices need an integer dtype."
        )
    if y.dtype != out.dtype:
        raise CurvatureTypeError(
            f"{name}: class probabilities y have dtype {y.dtype} but the model output has dtype "
            f"{out.dtype}; they must be equal."
        )


def _check_class_range(module, name: str, num_classes: int, y: Tensor, negative: Optional[Tensor]) -> Optional[bool]:
    if not is_concrete(y) or y.numel() == 0:
        return None
    ignore = module.ignore_index
    values = y.long() if y.dtype == torch.uint8 else y
    if batched(y.device):  # ignored entries read as class 0: one host read whatever y holds
        values = torch.where(values != ignore, values, 0)
    # One reduction and one host read (a sync on a GPU) when every index is in range, the
    # common case; ignored entries under "looped" (a CPU read is cheap) take the path below.
    lo, hi = torch.aminmax(values)
    in_range = (lo >= 0) & (hi < num_classes)
    if negative is None:
        if bool(in_range):
            return None
    else:  # both bits in one read: in_range + 2 · negative
        code = int(in_range.to(torch.uint8) + 2 * negative.to(torch.uint8))
        if code & 1:
            return bool(code & 2)
    counted = y[y != ignore]
    if counted.numel() == 0:
        return None if negative is None else bool(negative)
    lo, hi = (int(v) for v in torch.aminmax(counted.long()))
    if lo < 0 or hi >= num_classes:
        bad = lo if lo < 0 else hi
        raise CurvatureError(
            f"{name}: y holds class index {bad}, outside [0, {num_classes - 1}] for a model with "
            f"{num_classes} classes (and not the loss's ignore_index={ignore})."
        )
    return None if negative is None else bool(negative)


def scale_sign(spec, out: Tensor, y: Tensor, reduction_factor: Callable) -> Optional[Tensor]:
    """Whether the loss Hessian's scale has a negative entry (``negative_scale`` of
    :mod:`curvlib.losses._structural`), a 0-dim bool tensor not yet read, for targets not yet
    checked; ``None`` where unknown (values hidden) or impossible (no option allows it).
    ``reduction_factor``: :func:`curvlib.losses.reduction_factor` (passed in: the losses import
    this module)."""
    unreadable = not isinstance(y, Tensor) or not is_concrete(y) or y.numel() == 0
    if unreadable or not may_be_negative(spec, y):
        return None
    if spec.kind == "ce" and (y.is_complex() or y.dtype == torch.bool):  # refused by the check itself
        return None
    y = prepare_targets(spec, y)
    if spec.kind == "ce" and not y.is_floating_point():
        if y.dim() == 0 or out.dim() < 2:
            return None
        # indices outside [0, K) (refused by the same read) count as ignored: w[y] must not fail
        y = torch.where((y >= 0) & (y < out.shape[1]), y, spec.module.ignore_index)
    elif spec.kind == "ce" and tuple(y.shape) != tuple(out.shape):
        return None
    return negative_scale(spec, out, y, reduction_factor(spec, y))


def prepare_targets(spec, y: Tensor) -> Tensor:
    """Integer class indices of any integer dtype as ``int64`` (what PyTorch's losses take)."""
    m = spec.module
    if isinstance(m, (nn.CrossEntropyLoss, nn.NLLLoss)) and isinstance(y, Tensor) and y.dtype in _SMALL_INTS:
        return y.long()
    return y


_SMALL_INTS = (torch.int32, torch.int16, torch.int8, torch.uint8)
