"""Memory the loss-Hessian roots will take, checked against what the device has (before any work).

Exact second order pulls a root ``S [C, N, *out]`` back through the model and
Monte-Carlo extensions one of ``[M, N, *out]``; the columns are pulled in
chunks (``chunk_size``), but the root itself is formed whole. A root larger
than the device's free memory is refused with its size instead of failing
(or swapping) half-way through.
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Sequence, Tuple

import torch

from ._arguments import bytes_of
from ._errors import CurvatureError

__all__ = ["available_bytes", "check_roots"]

#: A root of at most ``1/HEADROOM`` of the free memory last read on its device is not re-checked.
HEADROOM = 8
_last_free: Dict[str, int] = {}  # device -> free bytes at the last reading


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


def _gib(b: int) -> str:
    return f"{b / 2**30:.3g} GiB"


def check_roots(exts: Sequence, out_shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """Refuse an extension whose root ``[V, N, *out]`` cannot fit in the device's free memory."""
    per_sample = 1
    for s in out_shape[1:]:
        per_sample *= int(s)
    free = None
    for ext in exts:
        root = getattr(ext, "root", None)
        if root not in ("exact", "mc"):
            continue
        v = per_sample if root == "exact" else ext.mc_samples
        need = bytes_of((v,) + tuple(out_shape), dtype)
        last = _last_free.get(str(device))
        if free is None and last is not None and need * HEADROOM <= last:
            continue  # fitted many times over at the last reading
        if free is None:
            free = available_bytes(device)
            if free is not None:
                _last_free[str(device)] = free
        if free is not None and need > free:
            what = "Monte-Carlo columns" if root == "mc" else "exact loss-Hessian root (one column per output entry)"
            fix = (
                f"use fewer mc_samples (at most {max(1, free // max(bytes_of(out_shape, dtype), 1))} fit)"
                if root == "mc" else "use the Monte-Carlo version of the extension"
            )
            raise CurvatureError(
                f"{type(ext).__name__}: its {what} [{v}, {', '.join(map(str, out_shape))}] would take "
                f"{_gib(need)} ({dtype}), more than the {_gib(free)} free on {device}. {fix.capitalize()}, "
                "or pass batch_chunk_size= to process fewer samples at once."
            )
