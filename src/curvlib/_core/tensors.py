"""Facts about tensors and devices that every stage asks: can a tensor's values be read, how
much memory is free. No curvlib imports (every module may import this one)."""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

__all__ = ["is_concrete", "available_bytes", "dense"]


def is_concrete(t: Tensor) -> bool:
    """True if ``t`` holds plain values (not a vmap/grad wrapper or a traced fake we cannot read)."""
    if is_fake(t):  # traced once per input signature (curvature(..., compile=True))
        return False
    try:
        return not torch._C._functorch.is_functorch_wrapped_tensor(t)
    except AttributeError:  # pragma: no cover - older torch
        return True


def dense(t: Tensor) -> Tensor:
    """``t`` with the row-major strides of its shape: ``t`` itself where it has them, else a
    copy. ``Tensor.contiguous`` keeps any stride of a size-one dim (``[N, C, 1, 1]`` with
    strides ``(C, 1, C, C)``, a transposed token map reshaped); torch's (2.13) batching rule of
    a transposed convolution's backward then raises "grad_weight needs to be contiguous", so
    a per-sample map (``vmap`` of a ``vjp``) is handed its inputs dense. A vmap/grad wrapper is
    returned as it is (its strides are not the memory's)."""
    if not isinstance(t, Tensor) or torch._C._functorch.is_functorch_wrapped_tensor(t):
        return t
    want, step = [], 1
    for size in reversed(t.shape):
        want.append(step)
        step *= max(size, 1)
    return t if tuple(reversed(want)) == t.stride() else t.clone(memory_format=torch.contiguous_format)


def available_bytes(device: torch.device) -> Optional[int]:
    """Free memory on ``device`` (``MemAvailable`` on a Linux CPU), or ``None`` if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None
