"""Memory the loss-Hessian roots will take, checked against what the device has (before any work).

Exact second order pulls a root ``S [C, N, *out]`` back through the model and
Monte-Carlo extensions one of ``[M, N, *out]``; the columns are pulled in
chunks (``chunk_size``), but the root itself is formed whole. A root larger
than the device's free memory is refused with its size instead of failing
(or swapping) half-way through.
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from ._arguments import bytes_of
from . import _strategy
from ._errors import CurvatureError

__all__ = ["AUTO_CHUNK_BYTES", "AUTO_CHUNK_BYTES_CPU", "AUTO_CHUNK_FREE_SHARE", "auto_chunk_size", "available_bytes", "check_roots"]

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


#: ``chunk_size="auto"``: the pulled-back site outputs of one chunk of columns
#: (``[chunk, *site output]`` for every site) take at most this many bytes ...
AUTO_CHUNK_BYTES = 256 * 2**20
#: ... or this many on a CPU when no batch diagonal is requested: there, chunks of
#: a few columns stay in cache and are faster as well as smaller (3c3d, C = 10:
#: DiagGGNExact 9.2x -> 8.0x a backward, 530 -> 194 MiB; KFLR 6.7x -> 5.2x).
#: Batch diagonals sum ``Σ_v m_v²`` over all columns of a chunk before one outer
#: product per sample, so they keep the larger chunks.
AUTO_CHUNK_BYTES_CPU = 32 * 2**20


#: ... and on a GPU, where every chunk costs kernel launches, up to this share of the
#: device's free memory when that is more (an H100 with 70 GiB free: ~8.7 GiB a chunk,
#: all columns at once on the benchmark problems).
AUTO_CHUNK_FREE_SHARE = 1 / 8


def auto_chunk_size(plan, exts: Sequence = (), device: Union[str, torch.device] = "cuda") -> int:
    """``chunk_size="auto"``: columns per chunk so that their site gradients fit in the byte budget
    (``plan``: a :class:`~curvlib._plan.Plan`, read for its ``site_shapes``/``site_dtypes``;
    :data:`AUTO_CHUNK_BYTES_CPU` under the ``"looped"`` strategy, the CPU default;
    the larger budgets under ``"batched"``, the CUDA default: :mod:`curvlib._strategy`)."""
    device = torch.device(device)
    budget = AUTO_CHUNK_BYTES
    batch_diagonal = any(getattr(e, "quantity", None) in ("batch_diag", "hessian_batch_diag") for e in exts)
    looped = not _strategy.batched(device)  # curvlib._strategy: CPU default "looped", CUDA "batched"
    if looped and not batch_diagonal:
        budget = min(budget, AUTO_CHUNK_BYTES_CPU)
    if device.type == "cuda" and not looped:
        free = available_bytes(device)
        budget = max(budget, int((free or 0) * AUTO_CHUNK_FREE_SHARE))
    per_column = sum(bytes_of(shape, dtype) for shape, dtype in zip(plan.site_shapes, plan.site_dtypes))
    return max(1, budget // max(per_column, 1))
