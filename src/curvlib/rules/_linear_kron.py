"""Kronecker factors (KFAC, KFLR, KFRA) of the affine map ``y = x Wᵀ + b`` (``nn.Linear``).

``x [N, *S, I]`` with the positions ``*S`` sharing the weight flattened into ``s``
(:func:`flat_input`), the pulled-back root ``m [V, N, *S, O]``. The weight's block is
approximated as ``B ⊗ A``, ``B [O, O]`` from the root, ``A [I, I]`` from the inputs;
the bias gets ``B`` alone. Conventions are BackPACK's (``kfac_approx=None``) and
Eschenhagen et al.'s (2023) ``"expand"``/``"reduce"`` as curvlinops computes them.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._gram import gram
from .._core.site import Site


def flat_input(site: Site) -> Tensor:
    """``x [n, s, i]``."""
    x = site.saved["x"]
    return x.reshape(x.shape[0], -1, x.shape[-1])


def kron_output_sum(site: Site, m: Tensor) -> Tensor:
    """``Σ_s m[v, n, s]`` ``[V, N, O]``: the root summed over the positions sharing the weight."""
    return m.reshape(m.shape[0], m.shape[1], -1, m.shape[-1]).sum(2)


def kron(site: Site, role: str, m: Tensor, approx: Optional[str] = None, max_dim: Optional[int] = None) -> list:
    """Kronecker factors from the pulled-back root ``m [V, N, *S, O]``.

    ``approx=None`` (BackPACK's): ``B = Σ_{v,n} (Σ_s m)(Σ_s m)ᵀ [O, O]`` and
    ``A = (1/N) Σ_{n,s} x xᵀ [I, I]``; weight: ``[B, A]``, bias: ``[B]``. For 2d
    inputs this is BackPACK's KFAC/KFLR; with positions ``s`` (sequences) it is
    BackPACK's convolution convention, which BackPACK itself refuses for Linear.
    ``"expand"``/``"reduce"``: Eschenhagen et al. (2023), as curvlinops computes
    them: ``B = Σ_{v,n,s} m mᵀ``, ``A = (1/(N·S)) Σ_{n,s} x xᵀ`` (expand) and
    ``B`` as above, ``A = (1/N) Σ_n x̄ x̄ᵀ`` with ``x̄`` the mean over positions
    (reduce). Without positions all three agree. ``max_dim``: a side larger than it
    gets its diagonal, ``B [O]`` / ``A [I]`` (:func:`curvlib.rules._gram.gram`).
    """
    s = m if approx == "expand" else kron_output_sum(site, m)  # expand: every position a row
    B = gram(s.reshape(-1, s.shape[-1]), max_dim)
    return [B] if role == "bias" else [B, kron_input(site, approx, max_dim)]


def kron_input(site: Site, approx: Optional[str] = None, max_dim: Optional[int] = None) -> Tensor:
    """Input-side Kronecker factor ``A [I, I]`` (``[I]`` when ``I > max_dim``; see :func:`kron`)."""
    return _input_gram(flat_input(site), approx, max_dim)


def kron_shared(uses: Sequence[Tuple[Site, Tensor]], role: str, approx: Optional[str] = None,
                max_dim: Optional[int] = None) -> list:
    """Kronecker factors of a weight (or bias) that several Linear sites apply, from each site's
    pulled-back root: ``uses`` holds ``(site, m [V, N, *S_u, O])`` pairs. The uses are read as
    more positions sharing the weight, ``S = Σ_u S_u`` in all, and :func:`kron`'s formulas
    run over them: ``None``: ``B = Σ_{v,n} (Σ_{u,s} m)(Σ_{u,s} m)ᵀ``, ``A = (1/N) Σ_{n,u,s} x xᵀ``;
    ``"expand"``: ``B = Σ_{v,n,u,s} m mᵀ``, ``A = (1/(N·S)) Σ_{n,u,s} x xᵀ``; ``"reduce"``: ``B``
    as for ``None``, ``A = (1/N) Σ_n x̄ x̄ᵀ`` with ``x̄`` the mean over all ``S`` positions.
    (curvlinops, whose hooks fire per call, sums the per-call factors instead: for ``"expand"``
    its ``A`` is ``Σ_u A_u``, ``S/S_u`` times a use's share of this one.)"""
    if approx == "expand":
        B = sum(gram(m.reshape(-1, m.shape[-1]), max_dim) for _, m in uses)
    else:
        s = sum(kron_output_sum(site, m) for site, m in uses)
        B = gram(s.reshape(-1, s.shape[-1]), max_dim)
    if role == "bias":
        return [B]
    return [B, _input_gram(torch.cat([flat_input(site) for site, _ in uses], dim=1), approx, max_dim)]


def _input_gram(x: Tensor, approx: Optional[str], max_dim: Optional[int]) -> Tensor:
    """``A`` of :func:`kron` from the inputs ``x [N, S, I]``."""
    n, positions = x.shape[0], x.shape[1]
    if approx == "reduce":
        x = x.mean(1)
    else:
        x = x.reshape(-1, x.shape[-1])
    return gram(x, max_dim, 1.0 / (n * positions) if approx == "expand" else 1.0 / n)


def dense_sides(site: Site, role: str, shape: Sequence[int]) -> Optional[List[int]]:
    """The sides of a weight's dense Kronecker factors, ``[out, in]`` (a convolution's input
    side: its channels times its kernel); ``None`` for another role."""
    return [shape[0], math.prod(shape) // shape[0]] if role == "weight" else None


def kron_from_output_matrix(site: Site, role: str, G: Tensor) -> list:
    """KFRA factors from the batch-averaged output matrix ``G [S·O, S·O]`` (positions summed)."""
    out_features = G.shape[0] // flat_input(site).shape[1]
    s = G.shape[0] // out_features
    B = G.reshape(s, out_features, s, out_features).sum((0, 2))
    return [B] if role == "bias" else [B, kron_input(site)]
