"""One fitted block at work: its damping, the preconditioned query, pairwise and self scores.

Per block (:mod:`curvlib.influence._fit`), with ``C(v)`` a vector's core ``[G, o, a]``,
``R(C) = Q_outᵀ C Q_in`` the rotation into the block's basis and ``λ_p`` its damping,

    P g = C⁻¹( Rᵀ( R(C(g)) / (s + λ_p) ) ),       score(q, n) = Σ_p ⟨P g_q, g_n⟩_p,
    self(n) = Σ_p Σ_i R(C(g_n))_i² / (s_i + λ_p),

``g`` an example's gradient: ``curvature``'s ``grad_batch`` row times the batch's loss
normaliser ``M_b``, the gradient of the example's loss summed over its positions. With
``rank = r``, a preconditioned query's core whose sides both exceed ``r`` is replaced by its
best rank-``r`` approximation per group (truncated SVD, ``U_r diag(σ_r) V_rᵀ``): ``r (o + a)``
numbers per group instead of ``o a``.
"""

from __future__ import annotations

import math
import numbers
from typing import Dict, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor

from .._core.errors import CurvatureError
from ..precondition import _kronbasis
from ._fit import layout_of

__all__ = ["HEURISTIC_DAMPING", "block_dampings", "precondition", "pairwise", "self_scores", "check_rank",
           "compress", "dense"]

#: ``damping=None``: ``λ_p = 0.1 · mean(s_p)`` per block (kronfluence's heuristic, per module there)
HEURISTIC_DAMPING = 0.1

#: columns per product of a block's contraction (:func:`_contract`), summed in float64
CONTRACTION_SLICE = 2**16

Query = Union[Tensor, Tuple[Tensor, Tensor]]  # a block's core [Q, G, o, a], or (left [Q,G,o,r], right [Q,G,r,a])


def _eigen(block: Mapping) -> Optional[_kronbasis.Eigen]:
    if block["q_out"] is None and block["q_in"] is None:
        return None
    return _kronbasis.Eigen(block["q_out"], block["lam_out"], block["q_in"], block["lam_in"])


def block_dampings(fitted: Mapping, damping: Optional[float]) -> Dict[str, float]:
    """Parameter name -> ``λ_p``: ``damping``, or the heuristic (``HEURISTIC_DAMPING · mean(s_p)``;
    a block whose spectrum is all zero takes the mean over every block's entries)."""
    blocks = fitted["blocks"]
    if damping is not None:
        if isinstance(damping, bool) or not isinstance(damping, numbers.Real) or not damping > 0 \
                or not math.isfinite(damping):
            raise CurvatureError(f"damping={damping!r}: must be a positive finite number, or None for "
                                 f"{HEURISTIC_DAMPING} times each block's mean eigenvalue.")
        return {name: float(damping) for name in blocks}
    spectra = {n: b["spectrum"] for n, b in blocks.items() if b["spectrum"] is not None}
    if not spectra:
        return {name: 0.0 for name in blocks}  # the identity strategy: no curvature, no damping
    total = sum(float(s.sum()) for s in spectra.values())
    count = sum(s.numel() for s in spectra.values())
    if total <= 0:
        raise CurvatureError("every fitted eigenvalue is zero, so the heuristic damping is zero: pass damping=.")
    fallback = HEURISTIC_DAMPING * total / count
    return {n: (HEURISTIC_DAMPING * float(s.mean())) or fallback for n, s in spectra.items()}


def precondition(block: Mapping, damping: float, g: Tensor) -> Tensor:
    """``P g`` as cores ``[K, G, o, a]`` for ``g [K, *p]`` (module doc)."""
    core = layout_of(block)
    c = core.to_core(g.to(_dtype(block, g)))
    if block["spectrum"] is None:
        return c
    eigen = _eigen(block)
    denominator = block["spectrum"] + damping
    if eigen is None:
        return c / denominator
    return eigen.unrotate(eigen.rotate(c) / denominator)


def _dtype(block: Mapping, g: Tensor) -> torch.dtype:
    return block["spectrum"].dtype if block["spectrum"] is not None else g.dtype


def check_rank(rank) -> None:
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise CurvatureError(f"query_rank={rank!r}: must be a positive int, or None to keep the queries whole.")


def compress(core: Tensor, rank: Optional[int]) -> Query:
    """The best rank-``r`` approximation per query and group, as ``(U_r diag(σ_r), V_rᵀ)``, when
    both sides of the core exceed ``r``; else the core itself."""
    if rank is None or min(core.shape[-2:]) <= rank:
        return core
    u, sigma, vh = torch.linalg.svd(core, full_matrices=False)
    return (u[..., :rank] * sigma[..., None, :rank]).contiguous(), vh[..., :rank, :].contiguous()


def dense(query: Query) -> Tensor:
    """A query's core ``[Q, G, o, a]``, multiplied out where it is held at low rank."""
    return query[0] @ query[1] if isinstance(query, tuple) else query


def pairwise(query: Query, block: Mapping, g: Tensor) -> Tensor:
    """``[Q, N_b]``: ``⟨P g_q, g_n⟩`` on one block, ``g [N_b, *p]`` the batch's gradients."""
    layout = layout_of(block)
    if isinstance(query, tuple):
        left, right = query
        return torch.einsum("qgor,ngoa,qgra->qn", left, layout.to_core(g).to(left.dtype), right)
    return _inner(query, layout.to_core(g).to(query.dtype), layout)


def _inner(query: Tensor, core: Tensor, layout: _kronbasis.Layout) -> Tensor:
    """``[Q, N]``: ``Σ_{g,o,a} query[q, g, o, a] core[n, g, o, a]``, the two flattened: in the cores'
    order where ``Q ≥ N`` (the query's, as ``precondition`` makes it), else in the parameter's (the
    gradient's). Where the two orders differ in memory (a ``"rows"`` or ``"transposed"`` layout's
    core is a strided view of its parameter), only the operand with fewer rows is copied."""
    # an einsum over the cores permutes the query to the gradient's memory order: Q copies of a
    # block (a 50k vocabulary's embedding: 4 × 147 MiB) for one example's gradient
    if query.shape[0] < core.shape[0]:
        query, core = layout.from_core(query), layout.from_core(core)
    return _contract(query.reshape(query.shape[0], -1), core.reshape(core.shape[0], -1))


def _contract(a: Tensor, b: Tensor) -> Tensor:
    """``a bᵀ`` (``[Q, K] × [N, K] -> [Q, N]``) in slices of ``CONTRACTION_SLICE`` columns, their
    products summed in float64, returned in ``a``'s dtype."""
    # a float32 product over a whole block (K = 38.6 M entries for a 50k vocabulary's head) sums
    # in float32 along K: on such a block of scores that cancel (Σ|terms| ≈ 50 |score|), 3e-4 to
    # 2e-3 off the float64 score depending on the kernel; slices of 2^16 summed in float64: 5e-6
    total = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64, device=a.device)
    for start in range(0, a.shape[-1], CONTRACTION_SLICE):
        stop = start + CONTRACTION_SLICE
        total += a[:, start:stop] @ b[:, start:stop].mT
    return total.to(a.dtype)


def self_scores(block: Mapping, damping: float, g: Tensor) -> Tensor:
    """``[N_b]``: ``g_nᵀ P g_n`` on one block."""
    c = layout_of(block).to_core(g.to(_dtype(block, g)))
    if block["spectrum"] is None:
        return c.square().flatten(1).sum(1)
    eigen = _eigen(block)
    # Σ_i R(C)_i² / (s_i + λ) as a contraction of R(C)² with 1 / (s + λ): one temporary of the core's size
    rotated = (c.square() if eigen is None else eigen.rotate(c).square_()).flatten(1)
    return _contract(rotated, (block["spectrum"] + damping).reciprocal().flatten()[None])[:, 0]
