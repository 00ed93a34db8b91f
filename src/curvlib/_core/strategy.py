"""How the columns of a second-order root are pulled back and read off, per device.

Exact second order pulls a root ``S [V, N, *out]`` back through the model and
reads every site's quantity off its ``V`` pulled-back columns. Two strategies
give the same numbers:

* ``"looped"`` (the CPU default): a few columns at a time (``chunk_size="auto"``
  takes :attr:`~curvlib._core.settings.Settings.auto_chunk_bytes_cpu`), and convolutions
  form their per-sample, per-column weight gradients in blocks of about
  :attr:`~curvlib._core.settings.Settings.conv_column_block_bytes`: small working sets stay in a
  CPU's caches, which is faster there;
* ``"batched"`` (the CUDA default): all columns of a chunk in one kernel per
  site where memory allows (conv blocks of :func:`column_block_bytes`, a share
  of the free device memory), and max-pooling recorded as a ``gather`` whose
  backward (``scatter_add``) has a batching rule, so the batched pullback
  (``autograd.grad(..., is_grads_batched=True)``) runs no per-column fallback.
  On a GPU every kernel launch costs about as much as a small kernel.

``"auto"`` picks by device. ``CURVLIB_STRATEGY=auto|batched|looped`` (read at
call time) or :func:`strategy` (a context manager, per thread and task) forces
one, e.g. so that the CPU test suite checks the CUDA path's math.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator, Optional, Union

import torch

from . import settings, tensors as _core
from .errors import CurvatureError

__all__ = ["STRATEGIES", "strategy", "resolve", "batched", "column_block_bytes"]

STRATEGIES = ("auto", "batched", "looped")
ENV = "CURVLIB_STRATEGY"


_forced: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("curvlib_strategy", default=None)


def _check(name: object, where: str) -> str:
    if name not in STRATEGIES:
        raise CurvatureError(f"{where}: strategy {name!r} is not known; supported are {STRATEGIES}.")
    return name  # type: ignore[return-value]


@contextlib.contextmanager
def strategy(name: str) -> Iterator[None]:
    """Force how second-order columns are processed inside the ``with`` block.

    Args:
        name: ``"batched"`` (all columns of a chunk in one kernel per site, the
            CUDA default), ``"looped"`` (a few columns at a time, the CPU
            default) or ``"auto"`` (by device). Results are the same; only
            speed and memory differ.

    Per thread and ``asyncio`` task (a ``contextvars`` variable); takes
    precedence over the ``CURVLIB_STRATEGY`` environment variable.

    Returns:
        A context manager; nothing is bound by ``with ... as``.

    Raises:
        CurvatureError: an unknown ``name``.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> import curvlib
        >>> from curvlib.extensions import DiagGGNExact
        >>> model, X, y = nn.Linear(3, 2), torch.randn(4, 3), torch.randint(0, 2, (4,))
        >>> with curvlib.strategy("batched"):
        ...     qs = curvlib.curvature(model, nn.CrossEntropyLoss(), [DiagGGNExact()])(X, y)
        >>> qs["diag_ggn_exact"]["weight"].shape
        torch.Size([2, 3])
    """
    token = _forced.set(_check(name, "curvlib.strategy"))
    try:
        yield
    finally:
        _forced.reset(token)


def resolve(device: Union[str, torch.device, None] = None) -> str:
    """``"batched"`` or ``"looped"`` for work on ``device`` (context, then environment, then device)."""
    name = _forced.get()
    if name is None:  # no context: the environment, read now
        name = _check(os.environ.get(ENV, "auto").strip().lower() or "auto", f"environment variable {ENV}")
    if name != "auto":
        return name
    kind = torch.device(device).type if device is not None else "cpu"
    return "batched" if kind == "cuda" else "looped"


def batched(device: Union[str, torch.device, None] = None) -> bool:
    """Whether ``device``'s work takes the batched strategy."""
    return resolve(device) == "batched"


def column_block_bytes(device: Union[str, torch.device], looped_bytes: int) -> int:
    """Byte budget of one block of per-sample, per-column gradients on ``device``.

    ``looped_bytes`` under ``"looped"``; under ``"batched"`` at least
    :attr:`~curvlib._core.settings.Settings.batched_min_bytes`, on CUDA up to
    :attr:`~curvlib._core.settings.Settings.batched_free_share` of the free memory (read by
    :func:`curvlib._core.tensors.available_bytes`).
    """
    if not batched(device):
        return looped_bytes
    device, knobs = torch.device(device), settings.current()
    if device.type != "cuda":
        return knobs.batched_min_bytes
    free = _core.available_bytes(device) or 0
    return max(knobs.batched_min_bytes, int(free * knobs.batched_free_share))
