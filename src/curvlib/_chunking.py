"""Chunking over samples: ``curvature(..., batch_chunk_size=B)``.

The batch is cut into consecutive slices of at most ``B`` samples, the
transform runs on each slice, and the slices' results are combined into
exactly those of the whole batch, so peak memory follows ``B`` instead of
``N`` (together with ``chunk_size``, which bounds the columns pulled back at
once, it bounds the memory of the exact second-order quantities over both
classes and samples).

Every supported loss is ``L = c · Σ_n ℓ_n`` with ``c = 1/M`` for ``"mean"``
(``M = y.numel()``) and ``c = 1`` for ``"sum"``. A slice's results carry
``c_k = 1/M_k``; with ``r_k = M_k / M`` (``1`` for ``"sum"``) the batch's are

| quantity | whole batch |
|---|---|
| loss, grad, GGN/Hessian diagonals, ``B`` of KFAC/KFLR | ``Σ_k r_k · slice_k`` |
| ``sum_grad_squared`` | ``Σ_k r_k² · slice_k`` |
| ``A = (1/N) Σ x xᵀ`` of KFAC/KFLR | ``Σ_k (N_k/N) · slice_k`` |
| ``variance`` | ``(1/N) Σ g² − ((1/N) Σ g)²`` from the batch's ``grad`` and ``Σ g²`` (the slices always compute ``Σ g²`` for it) |
| ``grad_batch``, batch diagonals | ``r_k · slice_k``, concatenated over samples |
| ``batch_l2`` | ``r_k² · slice_k``, concatenated |
| ``sqrt_ggn_exact``, ``sqrt_ggn_mc`` | ``√r_k · slice_k``, concatenated along dim 1 |

(the same rescaling as :mod:`curvlib.distributed`, with slices in place of
ranks). Monte-Carlo extensions draw fresh samples for every slice from their
generator, so results with a generator are reproducible for a given
``batch_size`` but differ from an unchunked call's draws (they have the same
distribution). Refused, before any work: KFRA (its recursion multiplies
batch averages layer by layer, which does not split into slices) and the
block products (callables that would have to keep every slice's forward
alive, which defeats the purpose).
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, Sequence

import torch
from torch import Tensor

from ._errors import CurvatureError
from .extensions.firstorder import BatchGrad, BatchL2Grad, SumGradSquared, Variance
from .extensions.secondorder import SecondOrder
from .losses import LossSpec

__all__ = ["over_samples", "check_batch_chunk_size"]

# result name or second-order quantity -> how slices combine
_FIRST_ORDER = {
    BatchGrad.name: "cat1",
    BatchL2Grad.name: "cat2",
    SumGradSquared.name: "sum2",
    Variance.name: "variance",
}
_SECOND_ORDER = {
    "diag": "sum1",
    "hessian_diag": "sum1",
    "batch_diag": "cat1",
    "hessian_batch_diag": "cat1",
    "sqrt": "cat_half",
    "kron": "kron",
}


def check_batch_chunk_size(batch_chunk_size: object, exts: Sequence) -> Dict[str, str]:
    """Validate the argument and the extensions; return result name -> combination kind."""
    if isinstance(batch_chunk_size, bool) or not isinstance(batch_chunk_size, int) or batch_chunk_size < 1:
        raise CurvatureError(f"batch_chunk_size must be a positive int or None, got {batch_chunk_size!r}.")
    kinds = {"grad": "sum1"}
    for ext in exts:
        kind = _SECOND_ORDER.get(ext.quantity) if isinstance(ext, SecondOrder) else _FIRST_ORDER.get(ext.name)
        if kind is None:
            why = (
                "its recursion multiplies batch averages layer by layer, so it does not split "
                "into slices of the batch"
                if isinstance(ext, SecondOrder) and ext.quantity == "kfra"
                else "block products are callables that would keep every slice's forward pass "
                "alive, so slicing would not save memory"
            )
            raise CurvatureError(
                f"{type(ext).__name__} cannot be computed with batch_chunk_size: {why}. "
                "Call curvature without batch_chunk_size for it."
            )
        kinds[ext.name] = kind
    return kinds


def over_samples(
    f: Callable[..., Dict[str, object]], spec: LossSpec, kinds: Mapping[str, str], batch_chunk_size: int,
    drop: Sequence = (),
) -> Callable[..., Dict[str, object]]:
    """Wrap ``f(X, y, params=None)`` to run on slices of at most ``batch_chunk_size`` samples.

    ``drop``: extensions ``f`` computes only for the combination (``SumGradSquared``
    behind ``Variance``), removed from the result.
    """
    mean = spec.reduction == "mean"
    dropped = {e.name for e in drop}

    def g(X: Tensor, y: Tensor, params: Optional[Mapping[str, Tensor]] = None) -> Dict[str, object]:
        n = X.shape[0] if isinstance(X, Tensor) and X.dim() > 0 else 0
        if n <= batch_chunk_size or not isinstance(y, Tensor) or y.dim() == 0 or y.shape[0] != n:
            return f(X, y, params=params)  # (f itself reports bad input)
        m_total = y.numel() if mean else 1
        acc: Dict[str, object] = {}
        cat: Dict[str, Dict[str, list]] = {}
        order: list = []
        for start in range(0, n, batch_chunk_size):
            Xk, yk = X[start:start + batch_chunk_size], y[start:start + batch_chunk_size]
            part = f(Xk, yk, params=params)
            order = order or list(part)
            n_k = Xk.shape[0]
            r = yk.numel() / m_total if mean else 1.0
            for key, value in part.items():
                kind = "sum1" if key == "loss" else kinds[key]
                if key == "loss":
                    acc[key] = _add(acc.get(key), value * r)
                elif kind in ("sum1", "sum2"):
                    scale = r if kind == "sum1" else r * r
                    acc[key] = {name: _add(acc.get(key, {}).get(name), t * scale) for name, t in value.items()}
                elif kind == "kron":
                    old = acc.get(key, {})
                    acc[key] = {
                        name: [
                            _add(old[name][i] if name in old else None, t * (r if i == 0 else n_k / n))
                            for i, t in enumerate(fs)
                        ]
                        for name, fs in value.items()
                    }
                elif kind == "variance":
                    continue  # formed below from the combined Σ g² (always computed with it)
                else:
                    scale = {"cat1": r, "cat2": r * r, "cat_half": r**0.5}[kind]
                    for name, t in value.items():
                        cat.setdefault(key, {}).setdefault(name, []).append(t * scale)
            del part
        out: Dict[str, object] = dict(acc)
        for key, per_name in cat.items():
            dim = 1 if kinds[key] == "cat_half" else 0
            out[key] = {name: torch.cat(ts, dim) for name, ts in per_name.items()}
        if "variance" in kinds:
            sgs = out["sum_grad_squared"]
            out["variance"] = {
                name: sgs[name] / n - (out["grad"][name] / n) ** 2 for name in out["grad"]
            }
        return {k: out[k] for k in order if k not in dropped}

    return g


def _add(total: Optional[Tensor], t: Tensor) -> Tensor:
    return t if total is None else total + t
