"""Where a forward reads the parameters' values (a sharded model's call gathers them there).

A model sharded with ``fully_shard`` runs as a twin whose parameter slots hold placeholders:
tensors of the full shapes holding one element (:mod:`curvlib.distributed.sharded`). Inside
:func:`reading`, the forwards the evaluation runs (:class:`curvlib._evaluate.linearise.Forward`,
KFRA's recursion) read each value through the reader instead, at the moment a layer uses it:

* ``reader.value(name, value)`` returns the tensor to compute with (the sharded model: the
  parameter gathered whole, an all-gather; ``value`` itself when it is no placeholder);
* ``reader.saving()`` is the forward's ``torch.autograd.graph.saved_tensors_hooks``: a gathered
  value autograd saves for the backward is stored as the parameter's name and gathered again
  when the backward reads it, so a rank holds a layer's parameters while that layer runs
  forward or backward, not the whole model;
* ``reader.agreed(n)`` is one count every rank uses (the column chunks of the second order:
  each chunk's backward gathers again, so every rank must pull back as many chunks; whether
  the sites are read as the backward reaches them, which orders the backwards and the
  results' reductions: the same on every rank).

Outside it (the default) parameter values are read as they are. Planning and the checks before
the evaluation never read through it: what they do depends on each rank's batch, and a gather
is a collective every rank must take part in, in the same order.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import ContextManager, Iterator, Mapping, Optional, Protocol

from torch import Tensor

from .tensors import inside_transform

__all__ = ["Reader", "agreed", "current", "forward_values", "read_values", "reading"]


class Reader(Protocol):
    """What a sharded model's call reads parameter values through (module doc)."""

    def value(self, name: str, value: Tensor) -> Tensor: ...

    def saving(self) -> ContextManager[None]: ...

    def agreed(self, n: int) -> int: ...


_CURRENT: contextvars.ContextVar = contextvars.ContextVar("curvlib_param_reader", default=None)


def current() -> Optional[Reader]:
    """The reader of the call under way, or ``None``."""
    return _CURRENT.get()


@contextlib.contextmanager
def reading(reader: Optional[Reader]) -> Iterator[None]:
    """A context in which the evaluation's forwards read parameter values through ``reader``.

    Args:
        reader: a :class:`Reader` (``None``: values read as they are).

    Yields:
        None.
    """
    token = _CURRENT.set(reader)
    try:
        yield
    finally:
        _CURRENT.reset(token)


class _Read(Mapping):
    """``params`` with each value passed through ``reader.value`` when it is read."""

    def __init__(self, params: Mapping[str, Tensor], reader: Reader):
        self._params, self._reader = params, reader

    def __getitem__(self, name: str) -> Tensor:
        return self._reader.value(name, self._params[name])

    def __iter__(self):
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def read_values(params: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """``params`` as a forward computes with them: through the reader where one is set (each
    read a gather on a sharded model), else ``params`` itself."""
    reader = _CURRENT.get()
    return params if reader is None else _Read(params, reader)


@contextlib.contextmanager
def forward_values(params: Mapping[str, Tensor]) -> Iterator[Mapping[str, Tensor]]:
    """:func:`read_values` for a forward whose autograd graph is kept for backwards: inside
    ``reader.saving()`` too, except under a torch.func transform (whose ``vjp`` takes no saved
    tensor hooks: its graph keeps the gathered values it saves)."""
    reader = _CURRENT.get()
    if reader is None:
        yield params
        return
    with (contextlib.nullcontext() if inside_transform() else reader.saving()):
        yield _Read(params, reader)


def agreed(n: int) -> int:
    """``n`` where no reader is set; else the count every rank of the call uses."""
    reader = _CURRENT.get()
    return n if reader is None else reader.agreed(n)
