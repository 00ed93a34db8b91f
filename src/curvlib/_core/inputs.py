"""The model input ``X``: a tensor, or a mapping / tuple / list of them (one argument).

Hugging Face-style models and laplace-torch pass a mapping of tensors
(``input_ids``, ``attention_mask``, ...) as the model's single argument. curvlib
accepts nested mappings, tuples and lists whose tensor leaves all carry the
batch in dim 0; other leaves (ints, strings, ``None``) are passed unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
import inspect
from typing import Callable, List, Optional

import torch
from torch import fx
from torch.utils import _pytree
from torch import Tensor, nn

from .errors import CurvatureError, CurvatureTypeError

__all__ = ["tensors", "batch_size", "map_tensors", "check_input", "describe", "as_pytree", "with_defaults",
           "keyword_inputs"]


def tensors(X) -> List[Tensor]:
    """The tensor leaves of ``X`` in order."""
    if isinstance(X, Tensor):  # (the common case, several times per call)
        return [X]
    found: List[Tensor] = []
    map_tensors(lambda t: found.append(t) or t, X)
    return found


def map_tensors(fn: Callable[[Tensor], object], X):
    """``X`` with every tensor leaf replaced by ``fn(leaf)``: through any mapping (``dict``,
    ``UserDict``, Hugging Face's ``BatchEncoding``, rebuilt as its own type), tuple,
    named tuple or list; other leaves unchanged."""
    if isinstance(X, Tensor):
        return fn(X)
    if isinstance(X, Mapping):
        return _rebuilt(X, {k: map_tensors(fn, v) for k, v in X.items()})
    if isinstance(X, tuple) and hasattr(X, "_fields"):
        return type(X)(*(map_tensors(fn, v) for v in X))
    if isinstance(X, (tuple, list)):
        return type(X)(map_tensors(fn, v) for v in X)
    return X


def _rebuilt(X: Mapping, items: dict):
    try:
        return type(X)(items)
    except Exception:  # noqa: BLE001 - a mapping type without a dict constructor
        return items


def batch_size(X) -> int:
    """``N``: dim 0 of the (first) tensor leaf."""
    return int(first(X).shape[0])


def first(X) -> Tensor:
    """The first tensor leaf (device and dtype of the input for allocations)."""
    return X if isinstance(X, Tensor) else tensors(X)[0]


def describe(X) -> str:
    """``shape [6, 3], dtype float64`` (or per leaf for a container), for messages."""
    if isinstance(X, Tensor):
        return f"shape {list(X.shape)}, dtype {X.dtype}"
    if isinstance(X, Mapping):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in X.items() if tensors(v)) + "}"
    parts = [describe(v) for v in X if tensors(v)] if isinstance(X, (tuple, list)) else []
    return "(" + ", ".join(parts) + ")"


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


def select_batch(X, rows):
    """The samples ``rows`` (a list of indices) of every tensor leaf."""
    return map_tensors(lambda t: t[list(rows)], X)


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


def as_pytree(X):
    """``X`` with every mapping as a plain ``dict`` (torch's pytree knows those)."""
    if isinstance(X, Mapping):
        return {k: as_pytree(v) for k, v in X.items()}
    if isinstance(X, tuple) and hasattr(X, "_fields"):
        return type(X)(*(as_pytree(v) for v in X))
    if isinstance(X, (tuple, list)):
        return type(X)(as_pytree(v) for v in X)
    return X


def trace_structure(X):
    """The container to trace a model with: tensors replaced by ``torch.fx.PH``."""
    return map_tensors(lambda t: fx.PH, as_pytree(X))


def trace_leaves(X) -> list:
    """Every leaf of ``X`` in the order of the placeholders of :func:`trace_structure`'s trace."""
    return _pytree.tree_leaves(as_pytree(X))


def structure_key(X):
    """Hashable: ``None`` for a tensor, else the container's layout and non-tensor leaves."""
    if isinstance(X, Tensor):
        return None
    return repr(map_tensors(lambda t: "<tensor>", as_pytree(X)))


def with_defaults(forward: Callable, concrete: Optional[dict]) -> Optional[dict]:
    """``concrete`` plus the constant defaults of ``forward``'s further arguments (timm's
    ``forward(x, attn_mask=None)``): curvlib calls ``model(X)``, so they keep their defaults, and
    traced as inputs they would send the trace down a masked branch with no mask."""
    params = list(inspect.signature(forward).parameters.values())
    defaults = {p.name: p.default for p in params[1:]
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                and (p.default is None or isinstance(p.default, (bool, int, float, str)))}
    if not defaults:
        return concrete
    if concrete is None:
        concrete = {}
    return {**defaults, **concrete}


def keyword_inputs(model: nn.Module, X) -> bool:
    """A mapping ``X`` whose keys all name parameters of ``model.forward`` (or, for a forward
    taking ``**kwargs``, include every argument it requires) is passed as keyword arguments
    (``model(**X)``: ``input_ids``, ``attention_mask``, ``pixel_values``); any other ``X`` as
    the single argument."""
    if not isinstance(X, Mapping) or not X:
        return False
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    named = {k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not all(isinstance(k, str) for k in X):
        return False
    if set(X) <= named:
        return True
    # a forward that passes ``**kwargs`` on (PeftModel, other wrappers): keywords, when every
    # argument it requires is among the keys (else ``X`` is its one required argument)
    required = {k for k, p in params.items() if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return any(p.kind == p.VAR_KEYWORD for p in params.values()) and required <= set(X)
