"""Symmetric eigendecompositions and SVDs in every floating dtype a model may use.

LAPACK (and cuSOLVER) have no half-precision kernels: ``torch.linalg.eigh`` of a bfloat16 or
float16 matrix raises. A model trained in half precision still has Hessian residuals and loss
Hessians to decompose, so those are decomposed in float32 and the factors returned in the
input's dtype (the rounding of the result is the input's; the decomposition adds none of its
own). LAPACK's symmetric solver can fail to converge on a matrix whose entries are all tiny
(a float32 residual of magnitude 1e-14: its intermediate products underflow); such a matrix is
decomposed scaled to unit largest entry, ``A = s (A/s)``, its eigenvalues scaled back, and in
float64 if that fails too. No curvlib imports (every module may import this one).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

__all__ = ["eigh", "svd"]

_HALF = (torch.float16, torch.bfloat16)


def eigh(A: Tensor) -> Tuple[Tensor, Tensor]:
    """``torch.linalg.eigh(A)``, in float32 for a half-precision ``A``, scaled (then in float64)
    where LAPACK does not converge (module doc)."""
    work = A.float() if A.dtype in _HALF else A
    try:
        evals, evecs = torch.linalg.eigh(work)
    except torch.linalg.LinAlgError:
        scale = work.abs().amax((-2, -1)).clamp_min(torch.finfo(work.dtype).tiny)  # [...]
        scaled = work / scale[..., None, None]
        try:
            evals, evecs = torch.linalg.eigh(scaled)
        except torch.linalg.LinAlgError:
            evals, evecs = torch.linalg.eigh(scaled.double())
        evals = evals.to(work.dtype) * scale[..., None]
    return evals.to(A.dtype), evecs.to(A.dtype)


def svd(A: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``torch.linalg.svd(A, full_matrices=False)``, in float32 for a half-precision ``A``."""
    if A.dtype not in _HALF:
        return torch.linalg.svd(A, full_matrices=False)
    U, S, Vh = torch.linalg.svd(A.float(), full_matrices=False)
    return U.to(A.dtype), S.to(A.dtype), Vh.to(A.dtype)
