"""Checks of ``curvature``'s and ``f``'s arguments (before any work)."""

from __future__ import annotations

import warnings
from typing import Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor, nn

from ..losses import _targets
from .. import losses
from .._core.errors import CurvatureError, CurvatureTypeError
from .._core.sync import LOCK
from ..extensions._base import Extension

__all__ = ["check_extensions", "check_chunk_size", "check_targets_batch", "parameter_values", "unwrap_compiled"]


def check_extensions(extensions) -> tuple:
    """Extension instances with distinct names (a single instance is accepted too)."""
    if isinstance(extensions, Extension):
        extensions = [extensions]
    if not isinstance(extensions, (list, tuple)):
        raise CurvatureTypeError(
            "extensions must be a list or tuple of curvlib.extensions instances, got "
            f"{type(extensions).__name__}."
        )
    seen: Dict[str, Extension] = {}
    for ext in extensions:
        if isinstance(ext, type) and issubclass(ext, Extension):
            raise CurvatureTypeError(
                f"extensions holds the class {ext.__name__}, not an instance; pass {ext.__name__}() instead."
            )
        if not isinstance(ext, Extension):
            raise CurvatureTypeError(
                f"extensions holds {ext!r} of type {type(ext).__name__}, which is not a "
                "curvlib extension; use instances from curvlib.extensions, e.g. BatchGrad()."
            )
        if not ext.name:
            raise CurvatureTypeError(f"{type(ext).__name__} is a base class, not an extension; pass e.g. BatchGrad().")
        if ext.name in ("loss", "grad"):
            raise CurvatureError(f"Extension name {ext.name!r} is reserved for curvlib's own results.")
        if ext.name in seen:
            raise CurvatureError(
                f"Two extensions have the same name {ext.name!r} ({seen[ext.name]!r} and {ext!r}); "
                "their results would overwrite each other. Pass each once."
            )
        seen[ext.name] = ext
    return tuple(extensions)


def check_chunk_size(chunk_size: object) -> None:
    if chunk_size is not None and chunk_size != "auto" and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise CurvatureError(f"chunk_size must be a positive int, 'auto' or None, got {chunk_size!r}.")


def check_targets_batch(spec: losses.LossSpec, y: object, n: int) -> Tensor:
    """``y`` as a tensor with the batch size in dim 0 (integer class indices as ``int64``)."""
    if not isinstance(y, Tensor):
        raise CurvatureTypeError(f"y must be a torch.Tensor, got {type(y).__name__}.")
    if y.dim() == 0 or y.shape[0] != n:
        raise CurvatureError(
            f"y has shape {tuple(y.shape)} but X has batch size {n}; y needs the same batch size in dim 0."
        )
    return _targets.prepare_targets(spec, y)


def parameter_values(model: nn.Module, params: object) -> Tuple[Dict[str, Tensor], List[str]]:
    """Every parameter's value (``params`` entries replace the model's) and the names wanted.

    Without ``params``: the model's parameters, detached; quantities for those with
    ``requires_grad=True``. With it: its entries (checked against the model's
    parameters' names, shapes, dtypes and devices); quantities for exactly those.
    """
    with LOCK:  # another thread's generic rule may have swapped a module's parameter slots
        all_params = dict(model.named_parameters())
    if params is None:
        trainable = [n for n, p in all_params.items() if p.requires_grad]
        return {n: inference_free(p.detach()) for n, p in all_params.items()}, trainable
    given = _check_params(model, params, all_params)
    trainable = [n for n in all_params if n in given]
    return {n: (given[n] if n in given else inference_free(p.detach())) for n, p in all_params.items()}, trainable


def _check_params(model: nn.Module, params: object, all_params: Dict[str, Tensor]) -> Dict[str, Tensor]:
    if not isinstance(params, Mapping):
        raise CurvatureTypeError(f"params must be a dict mapping parameter names to tensors, got {type(params).__name__}.")
    for name, value in params.items():
        if name not in all_params:
            close = [n for n in all_params if n.split(".")[-1] == str(name).split(".")[-1]][:5]
            raise CurvatureError(
                f"params has an entry {name!r} that is not a parameter of the model "
                f"({type(model).__name__}); valid names are those of model.named_parameters()"
                + (f", e.g. {close}" if close else f": {list(all_params)[:10]}") + "."
            )
        if not isinstance(value, Tensor):
            raise CurvatureTypeError(f"params[{name!r}] must be a tensor, got {type(value).__name__}.")
        p = all_params[name]
        if tuple(value.shape) != tuple(p.shape):
            raise CurvatureError(
                f"params[{name!r}] has shape {tuple(value.shape)}, but the model's parameter has shape {tuple(p.shape)}."
            )
        if value.dtype != p.dtype or value.device != p.device:
            raise CurvatureError(
                f"params[{name!r}] has dtype {value.dtype} on {value.device}, but the model's parameter has "
                f"dtype {p.dtype} on {p.device}; curvlib runs the model with its own buffers and other "
                f"parameters, so pass values like the parameter's (value.to({p.dtype}), or convert the model)."
            )
    return dict(params)


def unwrap_compiled(model: nn.Module) -> Tuple[nn.Module, str]:
    """A ``torch.compile``d module's original module and the prefix of its parameter names.

    ``torch.compile(model)`` returns an ``OptimizedModule`` whose parameters are
    ``_orig_mod.<name>``; curvlib differentiates the original module eagerly (its
    rules need the module tree, which compiled code hides) and keys results like
    the compiled module's ``named_parameters()``.
    """
    try:
        from torch._dynamo.eval_frame import OptimizedModule  # lazy: importing torch._dynamo costs seconds
    except ImportError:  # pragma: no cover - torch without dynamo
        return model, ""
    prefix = ""
    while isinstance(model, OptimizedModule):
        model, prefix = model._orig_mod, prefix + "_orig_mod."
    return model, prefix


def with_prefix(result: Dict[str, object], prefix: str) -> Dict[str, object]:
    """Result dicts keyed ``prefix + name`` (``loss`` stays)."""
    return {key: (value if key == "loss" else {prefix + n: v for n, v in value.items()}) for key, value in result.items()}


def without_prefix(params: Optional[Mapping[str, Tensor]], prefix: str, model: nn.Module):
    """``params`` keyed like the compiled module's parameters, as the original module's."""
    if params is None or not isinstance(params, Mapping):
        return params
    with LOCK:
        names = [n for n, _ in model.named_parameters()]
    out = {}
    for name, value in params.items():
        if not (isinstance(name, str) and name.startswith(prefix) and name[len(prefix):] in names):
            raise CurvatureError(
                f"params has an entry {name!r}, which is not a parameter of the model; the model is "
                f"torch.compile'd, so its parameters are named '{prefix}<name>' (as in "
                f"compiled.named_parameters()), e.g. {[prefix + n for n in names[:3]]}."
            )
        out[name[len(prefix):]] = value
    return out


def inference_free(t):
    """A normal tensor for an inference tensor (autograd cannot save those); others unchanged."""
    return t.clone() if isinstance(t, Tensor) and t.is_inference() else t


def detached(t):
    """``t`` detached (and a normal tensor for an inference tensor); others unchanged."""
    if not isinstance(t, Tensor) or not (t.requires_grad or t.is_inference()):
        return t
    return inference_free(t.detach())


def bytes_of(shape, dtype: torch.dtype) -> int:
    numel = 1
    for s in shape:
        numel *= int(s)
    return numel * dtype.itemsize


def warn_linear_loss(spec: losses.LossSpec, extensions) -> None:
    """Warn (once, at ``curvature`` time) that ``nn.NLLLoss`` makes every GGN quantity 0.

    ``NLLLoss(f, y) = -f[y]`` is linear in the model output ``f``, so ``∇²_f ℓ = 0`` and
    the GGN vanishes even after ``nn.LogSoftmax``: the log-softmax's curvature is part of
    the model, which the GGN linearises. ``nn.CrossEntropyLoss`` on the logits puts it into
    the loss, where the GGN keeps it (same loss value and gradient).
    """
    wanted = sorted(e.name for e in extensions if e.ggn)  # (made of the loss Hessian alone)
    if not wanted or not isinstance(spec.module, nn.NLLLoss):
        return
    warnings.warn(
        f"lossfn is nn.NLLLoss, which is linear in the model output: its Hessian is 0, so "
        f"{', '.join(wanted)} will be exactly 0 (also after nn.LogSoftmax, whose curvature the GGN "
        "linearises away). For the GGN of a softmax classifier, drop the LogSoftmax and use "
        "nn.CrossEntropyLoss on the logits (same loss and gradient).",
        UserWarning, stacklevel=4,  # warn_linear_loss, Setup, curvature, the user's line
    )
