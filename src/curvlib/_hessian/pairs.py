"""Pair regions: an element-wise function of two tensors recorded as one residual.

A gated MLP multiplies an activation of one projection by another, ``z = act(a) ⊙ b``
(Llama, GLM-4: ``down(silu(gate(x)) * up(x))``). Recorded node by node it has the
activation's residual ``diag(act''(a) ⊙ b ⊙ g)`` (one set of columns the size of ``a``) and the
product's ``[[0, D], [D, 0]]`` (two sets): three sets. The region
(:class:`curvlib._hessian.pointwise.PairRegion`) is one function ``z = φ(a, b)`` acting entry by
entry, and its residuals sum to ``φ``'s, per entry ``k`` a ``2 × 2`` block over ``(a_k, b_k)``:

    R_k = g_k [[φ_aa, φ_ab], [φ_ab, φ_bb]]_k        (act(a) b:  g [[act''(a) b, act'(a)], [act'(a), 0]])

Its eigenpairs ``λ₁ ≥ λ₂`` with vectors ``(cos θ, sin θ)`` and ``(−sin θ, cos θ)``,
``θ = ½ atan2(R_ab, (R_aa − R_bb)/2)``, give two columns per entry, ``√|λ_j| v_j`` at
``(a_k, b_k)``, each weighted by ``sign λ_j``: two sets of the size of ``z`` (for
``act(a) b``, ``φ_bb = 0`` and ``det R_k = −g_k² act'(a_k)² ≤ 0``, so ``λ₁ ≥ 0 ≥ λ₂``: one
sign per set). Where derivatives flow through the columns (or values cannot be read), the
smooth polarised blocks ``αI ± R_k/(4α)`` (:func:`curvlib._hessian.smooth.polarised`): four sets.
"""

from __future__ import annotations

from typing import Dict, List, Tuple, Union

import torch
from torch import Tensor, fx
from torch.func import jvp, vjp

from .._core.errors import CurvatureError
from .._core.site import Recorder
from .._core.sync import LOCK
from .._trace.program import Program
from .pointwise import PairRegion
from .smooth import polarised
from .structured import one_hot_columns

__all__ = ["record_pair", "pair_blocks", "pair_weighted", "pair_columns"]


def record_pair(program: Program, node: fx.Node, region: PairRegion, env: Dict[fx.Node, object],
                rec: Recorder, z: Tensor) -> Tensor:
    """Record the residual of the pair region ending at ``node`` (values ``env``, output ``z``);
    return ``z`` + its probe. Inputs that broadcast (a planning pass splits such regions back
    into their nodes, :func:`curvlib._hessian.pointwise.split_unequal_pairs`) are recorded by
    the region's dense residual."""
    a, b = (env[n] for n in region.input_nodes(program))
    phi = region.function(program)
    if region.aligned(program, env):
        return rec.residual(node.name, "pair", phi, [a, b], z)
    return rec.residual(node.name, "dense", lambda theta, x, y, fixed=(): phi(x, y), [a, b], z,
                        meta={"fixed": [], "rows": (), "zero_inputs": False})


def _second_derivatives(phi, a: Tensor, b: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(φ_aa, φ_ab, φ_bb)`` entry by entry, by forward-over-reverse autodiff of the element-wise
    ``φ`` (``d/da`` and ``d/db`` of ``(φ_a, φ_b)`` along all-ones directions)."""
    ones, zeros = torch.ones_like(a), torch.zeros_like(a)

    def first(x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
        value, pull = vjp(phi, x, y)
        return pull(torch.ones_like(value))

    with LOCK:  # forward-mode AD state is process-wide (curvlib._core.sync)
        _, (p, q) = jvp(first, (a, b), (ones, zeros))
        _, (_, r) = jvp(first, (a, b), (zeros, ones))
    return p, q, r


def pair_blocks(res, g: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(R_aa, R_ab, R_bb)``, each of ``z``'s shape: the entries of every ``2 × 2`` block
    (module doc). ``z``'s entry ``k`` is ``φ(a_k, b_k)`` for the same index ``k`` of the
    tensors as they are, so ``g`` pairs with them whatever their batch dim."""
    if len(set(res.in_dims)) != 1:
        raise CurvatureError(f"graph node '{res.where}' combines two tensors of one shape whose batch sits in "
                             f"different dims ({list(res.in_dims)}): entries of different samples would be mixed.")
    p, q, r = _second_derivatives(res.phi, *res.inputs)
    return p * g, q * g, r * g


def _front(t: Tensor, dim: int) -> Tensor:
    return t if dim == 0 else t.movedim(dim, 0)


def _signs(lam: Tensor, dim: int) -> Union[float, Tensor]:
    """``sign λ`` per (column, sample): one number when it is the same for all, else ``[D, N]``."""
    if bool((lam >= 0).all()):
        return 1.0
    if bool((lam <= 0).all()):
        return -1.0
    signs = _front(torch.where(lam >= 0, 1.0, -1.0).to(lam.dtype), dim)
    return signs.reshape(signs.shape[0], -1).t()


def pair_weighted(res, blocks: Tuple[Tensor, Tensor, Tensor]) -> List[tuple]:
    """``[(weights, {0: columns at a, 1: columns at b}, {})]``: the eigen-columns ``√|λ_j| v_j`` of
    the blocks (:func:`pair_blocks`), one set per ``j``, weighted by ``sign λ_j`` (values that can
    be read)."""
    raa, rab, rbb = blocks
    mean, half = (raa + rbb) / 2, (raa - rbb) / 2
    radius = torch.sqrt(half * half + rab * rab)
    theta = torch.atan2(rab, half) / 2
    cos, sin = theta.cos(), theta.sin()
    d = res.in_dims[0]
    sets = []
    for lam, (va, vb) in ((mean + radius, (cos, sin)), (mean - radius, (-sin, cos))):
        scale = lam.abs().sqrt()
        sets.append((_signs(lam, d), {0: one_hot_columns(_front(scale * va, d), d),
                                      1: one_hot_columns(_front(scale * vb, d), d)}, {}))
    return sets


def pair_columns(res, g: Tensor) -> List[tuple]:
    """``[(sign, {0: columns at a, 1: columns at b}, {})]``: the columns of the polarised blocks
    ``αI ± R_k/(4α)``, smooth in ``R`` (module doc)."""
    raa, rab, rbb = pair_blocks(res, g)
    R = torch.stack([torch.stack([raa, rab], -1), torch.stack([rab, rbb], -1)], -2)  # [*z, 2, 2]
    d = res.in_dims[0]
    sets = []
    for sign, W in zip((1.0, -1.0), polarised(R)):
        for j in range(2):
            sets.append((sign, {0: one_hot_columns(_front(W[..., 0, j], d), d),
                                1: one_hot_columns(_front(W[..., 1, j], d), d)}, {}))
    return sets
