"""Facts about tensors and devices that every stage asks: can a tensor's values be read, may
it be written in place, is a torch.func transform running, is a value being traced, how much
memory is free. No curvlib imports (every module may import this one)."""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor, fx
from torch._subclasses.fake_tensor import is_fake

__all__ = ["is_concrete", "is_wrapped", "inside_transform", "in_place_safe", "has_proxy", "available_bytes", "dense"]


def is_concrete(t: Tensor) -> bool:
    """True if ``t`` holds plain values (not a vmap/grad wrapper or a traced fake we cannot read)."""
    if is_fake(t):  # traced once per input signature (curvature(..., compile=True))
        return False
    try:
        return not is_wrapped(t)
    except AttributeError:  # pragma: no cover - older torch
        return True


def is_wrapped(t: Tensor) -> bool:
    """True if ``t`` is a torch.func wrapper (a ``vmap`` batched tensor, a ``grad``/``jvp``
    tensor): its values and strides are not those of the memory under it, and ``vmap`` has no
    batching rule for some in-place ops on it."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def inside_transform(*tensors: Tensor) -> bool:
    """True while a torch.func transform (``vmap``, ``grad``, ``vjp``, ``jvp``) runs, or if any of
    ``tensors`` is a torch.func wrapper (made inside one): nothing computed may then be kept
    past the call, and torch's fused ops without a batching rule must be avoided."""
    try:
        if torch._C._functorch.maybe_current_level() is not None:
            return True
    except AttributeError:  # pragma: no cover - older torch
        return True
    return any(is_wrapped(t) for t in tensors)


def in_place_safe(*tensors: Tensor) -> bool:
    """True if every one of ``tensors`` may be written (or summed into) in place: none is
    recorded by autograd (``requires_grad``) and none is a torch.func wrapper (:func:`is_wrapped`)."""
    return not any(t.requires_grad or is_wrapped(t) for t in tensors)


def has_proxy(value) -> bool:
    """True if ``value`` (a tensor, a proxy, or tuples, lists and dicts of them) holds a
    ``torch.fx.Proxy``: it is being traced symbolically, not computed."""
    found = []
    fx.node.map_aggregate(value, lambda a: found.append(a) if isinstance(a, fx.Proxy) else None)
    return bool(found)


def dense(t: Tensor) -> Tensor:
    """``t`` with the row-major strides of its shape: ``t`` itself where it has them, else a
    copy. ``Tensor.contiguous`` keeps any stride of a size-one dim (``[N, C, 1, 1]`` with
    strides ``(C, 1, C, C)``, a transposed token map reshaped); torch's (2.13) batching rule of
    a transposed convolution's backward then raises "grad_weight needs to be contiguous", so
    a per-sample map (``vmap`` of a ``vjp``) is handed its inputs dense. A vmap/grad wrapper is
    returned as it is (its strides are not the memory's)."""
    if not isinstance(t, Tensor) or is_wrapped(t):
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
