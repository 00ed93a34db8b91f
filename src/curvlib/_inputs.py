"""The model input ``X``: a tensor, or a mapping / tuple / list of them (one argument).

Hugging Face-style models and laplace-torch pass a dict of tensors (``input_ids``,
``attention_mask``, ...) as the model's single argument. curvlib accepts any
pytree (``torch.utils._pytree``) whose tensor leaves all carry the batch in dim 0;
other leaves (ints, strings, ``None``) are passed to the model unchanged.
"""

from __future__ import annotations

from typing import Callable, List

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from ._errors import CurvatureError, CurvatureTypeError

__all__ = ["tensors", "batch_size", "map_tensors", "check_input", "describe"]


def tensors(X) -> List[Tensor]:
    """The tensor leaves of ``X`` in pytree order."""
    return [t for t in pytree.tree_leaves(X) if isinstance(t, Tensor)]


def map_tensors(fn: Callable[[Tensor], object], X):
    """``X`` with every tensor leaf replaced by ``fn(leaf)``."""
    return pytree.tree_map(lambda t: fn(t) if isinstance(t, Tensor) else t, X)


def batch_size(X) -> int:
    """``N``: dim 0 of the (first) tensor leaf."""
    return int(tensors(X)[0].shape[0])


def first(X) -> Tensor:
    """The first tensor leaf (device and dtype of the input for allocations)."""
    return tensors(X)[0]


def describe(X) -> str:
    """``shape [6, 3], dtype float64`` (or per leaf for a pytree), for messages."""
    if isinstance(X, Tensor):
        return f"shape {list(X.shape)}, dtype {X.dtype}"
    leaves = pytree.tree_flatten_with_path(X)[0]
    parts = [f"{pytree.keystr(path) or 'X'}: {list(t.shape)} {t.dtype}" for path, t in leaves if isinstance(t, Tensor)]
    return "{" + ", ".join(parts) + "}"


def check_input(X) -> int:
    """Check ``X`` and return the batch size ``N`` (before any work).

    Raises:
        CurvatureTypeError: ``X`` holds no tensor.
        CurvatureError: a scalar tensor, tensor leaves with different batch sizes, or ``N = 0``.
    """
    leaves = tensors(X)
    if not leaves:
        raise CurvatureTypeError(
            f"X must be a torch.Tensor, or a dict/tuple/list of tensors passed to the model as its "
            f"one argument, got {type(X).__name__} with no tensor in it."
        )
    if any(t.dim() == 0 for t in leaves):
        raise CurvatureError(f"X ({describe(X)}) holds a scalar tensor; every tensor needs the batch in dim 0.")
    sizes = {int(t.shape[0]) for t in leaves}
    if len(sizes) > 1:
        raise CurvatureError(
            f"The tensors of X have different sizes in dim 0 ({describe(X)}); curvlib needs all of "
            "them to carry the batch in dim 0."
        )
    n = sizes.pop()
    if n == 0:
        raise CurvatureError(
            f"X has batch size 0 ({describe(X)}); curvlib needs at least one sample (there are no "
            "per-sample quantities of an empty batch, and the 'mean' loss of none is undefined)."
        )
    return n


def slice_batch(X, start: int, stop: int):
    """Samples ``start:stop`` of every tensor leaf."""
    return map_tensors(lambda t: t[start:stop], X)


def with_batch(X, n: int, real: bool):
    """A batch of ``n`` samples shaped like ``X``: ``real``: ``X`` with its first sample
    appended as needed; otherwise uninitialised tensors (for fake-tensor passes)."""
    n0 = batch_size(X)

    def one(t: Tensor) -> Tensor:
        shape = (n,) + tuple(t.shape[1:])
        if real:
            return t if n == n0 else torch.cat([t, t[:1].expand((n - n0,) + tuple(t.shape[1:]))])
        if t.is_floating_point() or t.is_complex():
            return torch.empty(shape, dtype=t.dtype, device=t.device)
        return torch.zeros(shape, dtype=t.dtype, device=t.device)  # valid indices for embeddings

    return map_tensors(one, X)
