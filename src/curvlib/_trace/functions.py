"""Custom ``autograd.Function`` applications in an ATen-level trace: one opaque node each.

``make_fx`` would record a Function's ``forward`` ops, and the graph would then be
differentiated through those instead of the Function's own ``backward`` (a straight-through
estimator, a custom GeLU's hand-written gradient: silently other derivatives). While the
model is traced at the ATen level (:mod:`curvlib._trace.aten`), ``Function.apply`` is
replaced by a call of the custom op :data:`APPLIED` (``curvlib::autograd_function``), which
``make_fx`` keeps as one node holding the call's tensors and a key; the key names the
Function class and the call's other arguments (:data:`_CALLS`). The replay
(:func:`replay`) turns that node back into ``Fn.apply(...)`` on proxies, which curvlib's
tracer records as the same ``call_function`` node a symbolic trace gives
(:func:`curvlib._trace.tracer.function_call`): interpreted by ``Fn.apply``, so every
derivative runs the Function's own ``backward`` (and ``jvp``/``vmap`` where torch.func needs
them; :mod:`curvlib._plan.traces` refuses what a Function lacks).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Dict, List

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .tracer import function_apply

__all__ = ["APPLIED", "recorded_functions", "forget", "replay"]

_APPLY = torch.autograd.Function.__dict__["apply"]  # the real one (taken before any patch)
_KEYS = itertools.count()
# key -> (Function class, the call's (args, kwargs) leaves, their spec, positions of the tensor leaves,
# its outputs: ``None`` for one tensor, else how many); alive while the trace that made it is replayed
_CALLS: Dict[int, list] = {}


def _call(key: int, tensors: List[Tensor], traced: bool = False):
    """``Fn.apply`` of call ``key`` on ``tensors``: the real one, or (``traced``) the one in place now,
    which curvlib's tracer records as one node."""
    cls, leaves, spec, at, _ = _CALLS[key]
    full = list(leaves)
    for i, t in zip(at, tensors):
        full[i] = t
    args, kwargs = pytree.tree_unflatten(full, spec)
    return cls.apply(*args, **kwargs) if traced else _APPLY.__func__(cls, *args, **kwargs)


@torch.library.custom_op("curvlib::autograd_function", mutates_args=())
def APPLIED(tensors: List[Tensor], key: int) -> List[Tensor]:  # noqa: N802 - an op, named as a constant
    """``Fn.apply`` of the call ``key`` on ``tensors``, its outputs as a list (copies: an op's
    outputs may not alias its inputs)."""
    out = _call(key, tensors)
    single = isinstance(out, Tensor)
    outs = [out] if single else list(out)
    if not all(isinstance(o, Tensor) for o in outs):
        raise TypeError(f"the custom autograd.Function {_CALLS[key][0].__name__} returns a non-tensor output")
    _CALLS[key][4] = None if single else len(outs)
    return [o.detach().clone() for o in outs]


@contextlib.contextmanager
def recorded_functions():
    """``Function.apply`` routed through :data:`APPLIED` for the block (under the lock
    :func:`~curvlib._trace.tracer.function_apply` takes); yields the keys made, forgotten by
    :func:`forget` once the graph is replayed."""
    keys: List[int] = []

    def apply(cls, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        key = next(_KEYS)
        _CALLS[key] = [cls, leaves, spec, at, None]
        keys.append(key)
        outs = torch.ops.curvlib.autograd_function([leaves[i] for i in at], key)
        return outs[0] if _CALLS[key][4] is None else tuple(outs)

    with function_apply(apply):
        yield keys


def forget(keys: List[int]) -> None:
    """Drop the calls of a replayed trace."""
    for key in keys:
        _CALLS.pop(key, None)


def replay(tensors, key: int):
    """The node ``APPLIED(tensors, key)`` on fx proxies: ``Fn.apply`` on them (curvlib's tracer
    records one ``call_function`` node), its outputs as a list, as the op returns them."""
    out = _call(key, list(tensors), traced=True)
    count = _CALLS[key][4]
    return [out] if count is None else [out[i] for i in range(count)]
