"""One parameter's Kronecker factors as an eigenbasis acting on a "core" ``[G, o, a]``.

Every layout of :mod:`curvlib._core.kronlayout` is, after a reshape of the parameter, a
block-diagonal (over ``G`` groups) Kronecker product ``blockdiag_g(R[g] ⊗ I[g])`` acting
on the core ``C [G, o, a]`` by ``C[g] -> R[g] C[g] I[g]ᵀ``: ``R`` the root (output-side)
factor, ``I`` the input-side factor. Per layout (``p`` the parameter):

| factors | core of ``p`` | ``R`` | ``I`` |
|---|---|---|---|
| ``[B [o, o], A [a, a]]`` (Linear, Conv, RNN) | ``p.reshape(1, o, a)`` | ``B`` | ``A`` |
| same, ``ConvTranspose`` weight ``[C_in, o, *k]`` | ``p`` with dims 0, 1 swapped | ``B`` | ``A`` (rows ``(c, k)``) |
| ``[B [G, o, o], A [G, a, a]]`` (``groups=G``) | ``p.reshape(G, o, a)``; transposed: per group swapped | ``B[g]`` | ``A[g]`` |
| ``[A [R], B [D, D]]`` (Embedding, fixed rows) | ``p.reshape(R, D)ᵀ`` as ``[1, D, R]`` | ``B`` | ``diag(A)`` |
| ``[F [P, P]]`` (bias, norms, 1-D generic) | ``p.reshape(1, P, 1)`` | ``F`` | ``[1]`` |
| ``[F [P]]`` (generic diagonal) | ``p.reshape(1, P, 1)`` | ``diag(F)`` | ``[1]`` |
| ``[B [O], A [a, a]]`` (``max_factor_dim``, diagonal output side) | as Embedding's | ``A`` | ``diag(B)`` |
| ``[B, A]`` with ``A`` or both 1-D (``max_factor_dim``) | as ``[B, A]`` | ``B`` or ``diag(B)`` | ``diag(A)`` |

Each factor is stored as its eigendecomposition ``Q diag(λ) Qᵀ`` (``Q = None`` for a
diagonal factor), eigenvalues clamped at zero: the factors are positive semi-definite
up to rounding (an indefinite ``KFLR`` factor of an indefinite loss is made PSD).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from .._core.errors import CurvatureError


@dataclass(frozen=True)
class Layout:
    """How a parameter of shape ``shape`` maps to its core ``[G, o, a]``."""

    kind: str  # "pair", "transposed", "rows", "block", "diag"
    groups: int
    out: int
    inp: int
    shape: Tuple[int, ...]

    @property
    def single(self) -> bool:
        """One factor (the whole block): every damping method is ``F + λ I``."""
        return self.kind in ("block", "diag")

    def to_core(self, v: Tensor) -> Tensor:
        """``[*lead, *shape] -> [*lead, G, o, a]``."""
        lead = v.shape[: v.dim() - len(self.shape)]
        g, o, a = self.groups, self.out, self.inp
        if self.kind == "transposed":
            per = v.reshape(*lead, g, self.shape[0] // g, o, -1)  # [*, G, C_in/G, o, K]
            return per.transpose(-3, -2).reshape(*lead, g, o, a)
        if self.kind == "rows":
            return v.reshape(*lead, a, o).transpose(-1, -2).unsqueeze(-3)
        return v.reshape(*lead, g, o, a)

    def from_core(self, c: Tensor) -> Tensor:
        """Inverse of :meth:`to_core`."""
        lead = c.shape[:-3]
        g, o = self.groups, self.out
        if self.kind == "transposed":
            per = c.reshape(*lead, g, o, self.shape[0] // g, -1).transpose(-3, -2)
            return per.reshape(*lead, *self.shape)
        if self.kind == "rows":
            return c.squeeze(-3).transpose(-1, -2).reshape(*lead, *self.shape)
        return c.reshape(*lead, *self.shape)


def layout_of(name: str, factors, shape: Tuple[int, ...], transposed: Optional[bool]) -> Layout:
    """The layout of parameter ``name`` (module doc). ``transposed``: whether it is a
    ``ConvTranspose`` weight; ``None`` (unknown): read off the shapes, refused if both fit."""
    shape, numel = tuple(shape), 1
    for s in shape:
        numel *= s
    f = list(factors)
    dims = [t.dim() for t in f]
    if len(f) == 1 and dims == [2] and f[0].shape == (numel, numel):
        return Layout("block", 1, numel, 1, shape)
    if len(f) == 1 and dims == [1] and f[0].numel() == numel:
        return Layout("diag", 1, numel, 1, shape)
    if len(f) == 2 and dims == [1, 2]:  # diag(f0) ⊗ f1: Embedding's, or a Linear's with a diagonal B
        rows, d = f[0].numel(), f[1].shape[0]
        if rows * d == numel and shape[-1] == d:
            return Layout("rows", 1, d, rows, shape)
    if len(f) == 2 and set(dims) <= {1, 2, 3} and set(dims) != {2, 3}:  # a 1-D side: diagonal (max_factor_dim)
        g = next((t.shape[0] for t in f if t.dim() == 3), 1)
        o, a = (t.shape[-1] if t.dim() > 1 else t.numel() // g for t in f)
        if g * o * a == numel and len(shape) >= 2:
            return _pair(name, g, o, a, shape, transposed)
    raise CurvatureError(
        f"parameter {name!r} of shape {list(shape)}: Kronecker factors of shapes "
        f"{[list(t.shape) for t in f]} match no layout curvlib returns ([B, A], grouped "
        f"[B [G,o,o], A [G,a,a]], [A [R], B [D,D]], [F [P,P]], [F [P]]; see curvlib._core.kronlayout)."
    )


def _pair(name: str, g: int, o: int, a: int, shape, transposed: Optional[bool]) -> Layout:
    k = 1
    for s in shape[2:]:
        k *= s
    plain = shape[0] == g * o and a == k * shape[1]
    flipped = len(shape) >= 3 and shape[1] == o and shape[0] % g == 0 and a == k * shape[0] // g
    if transposed is None and plain and flipped:
        raise CurvatureError(
            f"parameter {name!r} of shape {list(shape)}: its factors fit both a convolution's "
            f"layout and a ConvTranspose's ([C_in, C_out/G, *k]); pass model= so that "
            f"curvlib can tell which module owns it."
        )
    if transposed or (transposed is None and flipped and not plain):
        if not flipped:
            raise CurvatureError(f"parameter {name!r} of shape {list(shape)} is not a ConvTranspose weight "
                                 f"for factors B [{g}, {o}, {o}], A [{g}, {a}, {a}].")
        return Layout("transposed", g, o, a, shape)
    if not plain:
        raise CurvatureError(f"parameter {name!r} of shape {list(shape)}: factors with output side {g}x{o} "
                             f"do not match its first dim.")
    return Layout("pair", g, o, a, shape)


@dataclass(frozen=True)
class Eigen:
    """``R = Q_r diag(λ_r) Q_rᵀ`` and ``I = Q_i diag(λ_i) Q_iᵀ`` per group (``Q = None``:
    identity). ``λ_r [G, o]``, ``λ_i [G, a]``, ``Q_r [G, o, o]``, ``Q_i [G, a, a]``."""

    q_out: Optional[Tensor]
    lam_out: Tensor
    q_in: Optional[Tensor]
    lam_in: Tensor

    def rotate(self, core: Tensor) -> Tensor:
        """``Q_rᵀ C Q_i`` per group: into the eigenbasis. Batched matrix products broadcast over the
        leading dims: one result per product, no copy of a strided ``C`` (einsum's permutes made two)."""
        if self.q_out is not None:
            core = torch.matmul(self.q_out.mT, core)
        if self.q_in is not None:
            core = torch.matmul(core, self.q_in)
        return core

    def unrotate(self, core: Tensor) -> Tensor:
        """``Q_r C Q_iᵀ`` per group: back from the eigenbasis (as :meth:`rotate`)."""
        if self.q_out is not None:
            core = torch.matmul(self.q_out, core)
        if self.q_in is not None:
            core = torch.matmul(core, self.q_in.mT)
        return core


def _eig(factor: Tensor, groups: int, name: str) -> Tuple[Optional[Tensor], Tensor]:
    if factor.dim() == 1:
        return None, factor.clamp_min(0).reshape(groups, -1)
    mat = factor.reshape(groups, factor.shape[-1], factor.shape[-1])
    if not bool(torch.isfinite(mat).all()):
        raise CurvatureError(
            f"The Kronecker factor of parameter '{name}' has non-finite entries (inf or NaN), so it has "
            "no eigendecomposition: the loop that produced it diverged. Damp more (a larger "
            "damping, or damping that grows when the loss rises, as KFACOptimizer's kl_clip does)."
        )
    # eigh(cM) = (c λ, Q): normalising by the largest entry keeps a factor of tiny entries
    # (1e-30..1e-16, float32 subnormals) in range, where LAPACK's float32 eigh fails to converge.
    scale = mat.abs().amax(dim=(-2, -1), keepdim=True)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    sym = (mat + mat.transpose(-1, -2)) / (2 * scale)
    try:
        lam, q = torch.linalg.eigh(sym)
    except torch.linalg.LinAlgError:  # ill-conditioned in float32: float64 converges
        lam, q = (t.to(mat.dtype) for t in torch.linalg.eigh(sym.double()))
    return q, (lam * scale[..., 0]).clamp_min(0)


def eigen_of(factors, layout: Layout, name: str = "", done: Optional[dict] = None) -> Eigen:
    """Eigendecompositions of the factors in ``layout`` (root factor first) of parameter ``name``.
    ``done``: ``(id(factor), G) -> (Q, λ)`` of factors decomposed before, updated: a factor several
    parameters share (one tensor) is decomposed once and its ``Q``, ``λ`` shared. Every factor
    passed with one ``done`` must have existed when the first was decomposed (``id`` is unique
    only among objects alive together; the earlier factors may be freed since)."""
    f = list(factors)
    g = layout.groups

    def eig(factor: Tensor, groups: int) -> Tuple[Optional[Tensor], Tensor]:
        if done is None:
            return _eig(factor, groups, name)
        key = (id(factor), groups)
        if key not in done:
            done[key] = _eig(factor, groups, name)
        return done[key]

    if layout.single:
        q, lam = eig(f[0], 1)
        return Eigen(q, lam, None, torch.ones(1, 1, dtype=lam.dtype, device=lam.device))
    r = 1 if layout.kind == "rows" else 0  # the factor acting on the core's o side
    q_out, lam_out = eig(f[r], g)
    q_in, lam_in = eig(f[1 - r], g)
    return Eigen(q_out, lam_out, q_in, lam_in)
