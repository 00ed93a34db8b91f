"""Facts about tensors and devices that every stage asks: can a tensor's values be read, how
much memory is free. No curvlib imports (every module may import this one)."""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

__all__ = ["is_concrete", "available_bytes"]


def is_concrete(t: Tensor) -> bool:
    """True if ``t`` holds plain values (not a vmap/grad wrapper or a traced fake we cannot read)."""
    if is_fake(t):  # traced once per input signature (curvature(..., compile=True))
        return False
    try:
        return not torch._C._functorch.is_functorch_wrapped_tensor(t)
    except AttributeError:  # pragma: no cover - older torch
        return True


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
