"""Buffers from the caller: ``f(X, y, params=..., buffers=...)``.

A model's buffers (BatchNorm's running statistics, registered constants) are read by
its forward but never differentiated. ``f`` reads the model's own buffers unless the
caller passes ``buffers`` (name -> tensor, as ``model.named_buffers()``; the second
output of ``torch.func.stack_module_state``) or puts buffer entries into ``params``
(as ``torch.func.functional_call`` accepts them); results never have a buffer entry.

Under ``vmap`` over stacked parameters every member needs its own buffers: reading the
model's would silently evaluate every member with the base model's statistics. So a
call whose parameters are batched by ``vmap`` while the model has buffers its forward
reads, and that does not pass them, is refused before any work
(:func:`refuse_unbuffered`).

The given buffers are swapped into the model's buffer slots for the call's forward
passes (and whenever a block product it returns is evaluated), under
:data:`curvlib._core.sync.LOCK`, as ``torch.func.functional_call`` does; the model's own
buffers are back in place when ``f`` returns. Calls reading a model's own buffers
from other threads wait while a swap is in place (:class:`_Swaps`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module

from .errors import CurvatureError, CurvatureTypeError
from .sync import LOCK

__all__ = ["bind_products", "refuse_unbuffered", "split", "using"]

#: buffers that a module's forward never reads in eval mode (BatchNorm counts its
#: training steps; only a training-mode update with ``momentum=None`` reads it)
UNREAD = ("num_batches_tracked",)

MSG_UNBUFFERED = (
    "f is called under torch.func.vmap with batched params, but the model ({model}) has "
    "buffers its forward reads ({names}) and no buffers were passed: every member would "
    "silently use the base model's buffers. Pass each member's buffers, e.g. "
    "`params, buffers = torch.func.stack_module_state(models)` and "
    "`vmap(lambda p, b: f(X, y, params=p, buffers=b))(params, buffers)`, or "
    "`buffers=dict(model.named_buffers())` if every member shares the model's buffers."
)


def split(model: nn.Module, params: object, buffers: object) -> Tuple[object, Optional[Dict[str, Tensor]]]:
    """``(params without buffer entries, buffers)``, the buffers checked against the model's.

    Buffer entries of ``params`` move into the buffers (they get no results). ``buffers``
    ``None`` and no buffer entry in ``params``: ``(params, None)`` (the model's own).

    Raises:
        CurvatureTypeError: ``buffers`` is not a mapping, or a value is not a tensor.
        CurvatureError: an unknown name, a name given twice, or a shape, dtype or device
            unlike the model's buffer.
    """
    with LOCK:  # another call may have swapped the slots
        own = {n: b for n, b in model.named_buffers() if isinstance(b, Tensor)}
    if buffers is not None and not isinstance(buffers, Mapping):
        raise CurvatureTypeError(
            f"buffers must be a dict mapping buffer names to tensors, got {type(buffers).__name__}."
        )
    given = dict(buffers) if buffers is not None else {}
    if isinstance(params, Mapping) and any(name in own for name in params):
        twice = [name for name in params if name in own and name in given]
        if twice:
            raise CurvatureError(
                f"{twice[0]!r} is in both params and buffers; pass each buffer once (buffers= preferred)."
            )
        given.update({name: value for name, value in params.items() if name in own})
        params = {name: value for name, value in params.items() if name not in own}
    if buffers is None and not given:
        return params, None
    for name, value in given.items():
        _check(model, own, name, value)
    return params, given


def _check(model: nn.Module, own: Dict[str, Tensor], name: object, value: object) -> None:
    if name not in own:
        raise CurvatureError(
            f"buffers has an entry {name!r} that is not a buffer of the model ({type(model).__name__}); "
            f"valid names are those of model.named_buffers(): {list(own)[:10]}."
        )
    if not isinstance(value, Tensor):
        raise CurvatureTypeError(f"buffers[{name!r}] must be a tensor, got {type(value).__name__}.")
    b = own[name]
    if tuple(value.shape) != tuple(b.shape) or value.dtype != b.dtype or value.device != b.device:
        raise CurvatureError(
            f"buffers[{name!r}] has shape {tuple(value.shape)}, dtype {value.dtype} on {value.device}, but "
            f"the model's buffer has shape {tuple(b.shape)}, dtype {b.dtype} on {b.device} (under vmap: "
            "one member's shape); pass values like the model's."
        )


def vmapped(t: Tensor) -> bool:
    """Whether ``t`` is batched by ``torch.func.vmap`` at some level (under any other
    torch.func wrappers, e.g. ``grad`` inside ``vmap``)."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False


def refuse_unbuffered(model: nn.Module, params: object, buffers: Optional[Mapping[str, Tensor]]) -> None:
    """Refuse batched ``params`` without the buffers the forward reads (module doc).

    Raises:
        CurvatureError: some ``params`` value is vmapped, the model has a buffer other
            than :data:`UNREAD` ones, and ``buffers`` lacks it.
    """
    if not isinstance(params, Mapping) or not any(isinstance(v, Tensor) and vmapped(v) for v in params.values()):
        return
    with LOCK:
        read = [n for n, b in model.named_buffers() if isinstance(b, Tensor) and n.split(".")[-1] not in UNREAD]
    missing = [n for n in read if buffers is None or n not in buffers]
    if missing:
        raise CurvatureError(MSG_UNBUFFERED.format(model=type(model).__name__, names=", ".join(missing[:4])
                                                   + (", ..." if len(missing) > 4 else "")))


class _Swaps:
    """Who may read the modules' buffer slots: calls that read a model's own buffers run
    together (readers); a call that swaps the caller's buffers in runs alone (the writer,
    re-entrant: its block products swap them in again). A reader never sees another
    thread's buffers, so calls may still come from several threads."""

    def __init__(self):
        self.cond = threading.Condition()
        self.readers, self.writer, self.depth = 0, None, 0

    @contextlib.contextmanager
    def read(self):
        me = threading.get_ident()
        with self.cond:
            nested = self.writer == me  # inside this thread's own swap: it reads those
            while not nested and self.writer is not None:
                self.cond.wait()
            self.readers += not nested
        try:
            yield
        finally:
            with self.cond:
                self.readers -= not nested
                self.cond.notify_all()

    @contextlib.contextmanager
    def write(self):
        me = threading.get_ident()
        with self.cond:
            while self.writer not in (None, me) or (self.writer is None and self.readers):
                self.cond.wait()
            self.writer, self.depth = me, self.depth + 1
        try:
            yield
        finally:
            with self.cond:
                self.depth -= 1
                if not self.depth:
                    self.writer = None
                self.cond.notify_all()


SWAPS = _Swaps()


@contextlib.contextmanager
def using(model: nn.Module, buffers: Optional[Mapping[str, Tensor]]):
    """The model runs with ``buffers`` in its buffer slots; ``None``: with its own (waiting
    while another thread's call has swapped buffers in, see :class:`_Swaps`)."""
    if not buffers:
        if next(model.buffers(), None) is None:
            yield
            return
        with SWAPS.read():
            yield
        return

    # the swap waits for readers first, then takes LOCK (readers may take LOCK: no cycle)
    with SWAPS.write(), LOCK, _reparametrize_module(model, dict(buffers)):
        yield


def bind_products(make: Callable, model: nn.Module, buffers: Optional[Mapping[str, Tensor]]) -> Callable:
    """``make(ext, name)`` whose block products run with ``buffers`` (``None``: the model's
    own) whenever they are evaluated."""
    if not buffers and next(model.buffers(), None) is None:
        return make

    def bound_make(ext, name):
        product = make(ext, name)

        def bound(V: Tensor) -> Tensor:
            with using(model, buffers):
                return product(V)

        bound.__doc__ = product.__doc__
        return bound

    return bound_make
