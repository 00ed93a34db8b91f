"""Target checks for ``nn.CrossEntropyLoss``: class indices or class probabilities."""

from __future__ import annotations

import torch
from torch import Tensor

from ._errors import CurvatureError, CurvatureTypeError
from ._strategy import batched


def check_cross_entropy_targets(module, out: Tensor, y: Tensor) -> None:
    """Class indices ``[N, *D]`` (``ignore_index`` allowed) or probabilities ``[N, K, *D]``.

    ``out`` is the model output ``[N, K, *D]``. Raises a :class:`CurvatureError`
    naming the bad shape, dtype or class index.
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
        return
    expected = (out.shape[0],) + tuple(out.shape[2:])
    if tuple(y.shape) != expected:
        raise CurvatureError(
            f"{name}: y has shape {tuple(y.shape)}, but for model output {tuple(out.shape)} it must "
            f"have shape {expected} (class indices) or {tuple(out.shape)} (class probabilities)."
        )
    _check_class_range(module, name, out.shape[1], y)


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


def _check_class_range(module, name: str, num_classes: int, y: Tensor) -> None:
    from .losses import _is_concrete

    if not _is_concrete(y) or y.numel() == 0:
        return
    ignore = module.ignore_index
    values = y.long() if y.dtype == torch.uint8 else y
    if batched(y.device):  # ignored entries read as class 0: one host read whatever y holds
        values = torch.where(values != ignore, values, 0)
    # One reduction and one host read (a sync on a GPU) when every index is in range, the
    # common case; ignored entries under "looped" (a CPU read is cheap) take the path below.
    lo, hi = torch.aminmax(values)
    if bool((lo >= 0) & (hi < num_classes)):
        return
    counted = y[y != ignore]
    if counted.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(counted.long()))
    if lo < 0 or hi >= num_classes:
        bad = lo if lo < 0 else hi
        raise CurvatureError(
            f"{name}: y holds class index {bad}, outside [0, {num_classes - 1}] for a model with "
            f"{num_classes} classes (and not the loss's ignore_index={ignore})."
        )
