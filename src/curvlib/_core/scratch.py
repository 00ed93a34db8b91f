"""One reusable block of memory for a read-off's short-lived pieces (to save page faults).

A rule that forms per-sample pieces a block at a time and reduces them at once (a Linear
over positions: ``Σ_s g[n, s] x[n, s]ᵀ`` ``[n', o', I]``, up to 64 MiB, squared into its sum
and dropped) would otherwise allocate every block fresh, and a fresh block that glibc maps
anew (above its mmap threshold, 128 KiB to 32 MiB as it adapts) faults its pages in as the
product first writes them: a product into a fresh block pays a page fault per page on top of
its own work, which a reused block does not, and a language model forms many such blocks a call.
Inside :func:`reusing` (one streamed read-off), :func:`scratch` hands out views of one buffer
per dtype and device, grown to the largest block asked for and freed when the context ends;
outside it, a fresh tensor.

A view is valid until the next :func:`scratch` call: only for pieces that are reduced
before the next block is formed, on plain tensors (no autograd record, no torch.func).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Dict, Iterator, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["reusing", "scratch"]

_BUFFERS: ContextVar[Optional[Dict[tuple, Tensor]]] = ContextVar("curvlib_scratch", default=None)


@contextlib.contextmanager
def reusing() -> Iterator[None]:
    """Within this context, :func:`scratch` reuses one buffer per dtype and device."""
    token = _BUFFERS.set({})
    try:
        yield
    finally:
        _BUFFERS.reset(token)


def scratch(shape: Sequence[int], like: Tensor) -> Tensor:
    """An uninitialised contiguous tensor of ``shape`` with ``like``'s dtype and device: a view
    of the context's buffer inside :func:`reusing` (valid until the next call), else fresh."""
    buffers = _BUFFERS.get()
    if buffers is None:
        return like.new_empty(shape)
    numel = 1
    for s in shape:
        numel *= int(s)
    key = (like.dtype, like.device)
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buffers.pop(key, None)  # (the smaller one goes before the larger one is allocated)
        buf = buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel].view(tuple(int(s) for s in shape))
