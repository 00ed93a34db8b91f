"""Where each first-order result goes the moment it is read (a sharded model's call).

:class:`curvlib._evaluate.first_order.FirstOrderReader` stores a parameter's summed results as
soon as its last site is read, during the loss's backward where it streams. Inside
:func:`sinking` it hands each one to the sink, ``sink(key, name, value) -> value``, and keeps what
comes back: on a model sharded with ``fully_shard``, :mod:`curvlib.distributed` reduce-scatters
it there into the rank's rows, so that a rank never holds every layer's whole local result at
once. Outside it (the default) results are kept as read.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator, Optional

from torch import Tensor

__all__ = ["Sink", "current", "sinking"]

#: ``sink(result key, parameter name, value) -> the value to keep``.
Sink = Callable[[str, str, Tensor], Tensor]

_CURRENT: contextvars.ContextVar = contextvars.ContextVar("curvlib_result_sink", default=None)


def current() -> Optional[Sink]:
    """The sink of the call under way, or ``None``."""
    return _CURRENT.get()


@contextlib.contextmanager
def sinking(sink: Optional[Sink]) -> Iterator[None]:
    """A context in which first-order results go to ``sink`` as they are read (``None``: kept).

    Args:
        sink: ``sink(key, name, value)``, returning the value to keep.

    Yields:
        None.
    """
    token = _CURRENT.set(sink)
    try:
        yield
    finally:
        _CURRENT.reset(token)
