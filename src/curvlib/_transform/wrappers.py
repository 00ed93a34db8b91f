"""The wrappers around the function ``curvature`` returns: inference mode and
``no_grad`` handling, one opaque step under ``torch.compile``, and the parameter
names of a ``torch.compile``d model."""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch
from torch import Tensor, nn

from .._plan import arguments as _arguments
from .._core import inputs as _inputs
from .._core.errors import CurvatureError

__all__ = ["public", "renamed"]


def renamed(f: Callable, prefix: str, model: nn.Module) -> Callable:
    """Results, ``params`` and ``buffers`` keyed like a ``torch.compile``d module's
    parameters and buffers."""

    def g(X, y, params=None, generator=None, buffers=None):
        params, buffers = _unprefixed_buffers(params, buffers, prefix, model)
        result = f(X, y, params=_arguments.without_prefix(params, prefix, model), generator=generator,
                   buffers=buffers)
        return _arguments.with_prefix(result, prefix)

    return g


def _unprefixed_buffers(params, buffers, prefix: str, model: nn.Module):
    """``(params without buffer entries, buffers keyed like the original module's)``: buffer
    entries of ``params`` (``prefix + name``) move into the buffers."""
    names = {prefix + n for n, _ in model.named_buffers()}
    if isinstance(params, Mapping) and any(k in names for k in params):
        buffers = {**{k: v for k, v in params.items() if k in names}, **(buffers or {})}
        params = {k: v for k, v in params.items() if k not in names}
    if not isinstance(buffers, Mapping):
        return params, buffers  # None, or a wrong type that f reports
    for key in buffers:
        if key not in names:
            raise CurvatureError(
                f"buffers has an entry {key!r}, which is not a buffer of the model; the model is "
                f"torch.compile'd, so its buffers are named '{prefix}<name>' (as in "
                f"compiled.named_buffers()), e.g. {sorted(names)[:3]}."
            )
    return params, {k[len(prefix):]: v for k, v in buffers.items()}


def public(f: Callable, doc: Optional[str]) -> Callable:
    """``f`` callable under ``torch.inference_mode()``: it leaves inference mode for the
    call (autograd is the method, not an option) and copies inference tensors, also
    those made under inference mode and passed in outside it (the block products it
    returns do the same when they are called). Under ``torch.no_grad()`` and inference
    mode the inputs are read detached, so the results are too."""

    # Under torch.compile the call runs eagerly, as one opaque step of the compiled
    # function (one graph break, here): Dynamo tracing into it broke the graph at every
    # site, recompiled per call and failed on the second-order passes' retained graphs
    # (donated buffers). The disabled function is an inner one: torch.compile unwraps a
    # disabled function it is given directly.
    @torch.compiler.disable(recursive=True)
    def eager(X, y, params, generator, buffers):
        # Under no_grad / inference mode results are detached, as any op's would be (no
        # graph back to X or params is built or kept alive).
        free = _arguments.inference_free if torch.is_grad_enabled() else _arguments.detached
        with torch.inference_mode(False):
            # inference tensors (made under inference mode, also passed in outside it)
            X = _inputs.map_tensors(free, X)
            y = free(y)
            if isinstance(params, Mapping) and any(free(v) is not v for v in params.values()):
                params = {k: free(v) for k, v in params.items()}
            if isinstance(buffers, Mapping) and any(free(v) is not v for v in buffers.values()):
                buffers = {k: free(v) for k, v in buffers.items()}
            return f(X, y, params=params, generator=generator, buffers=buffers)

    def call(X, y, params: Optional[Mapping[str, Tensor]] = None, generator: Optional[torch.Generator] = None,
             buffers: Optional[Mapping[str, Tensor]] = None):
        return eager(X, y, params, generator, buffers)

    call.__doc__ = doc
    return call
