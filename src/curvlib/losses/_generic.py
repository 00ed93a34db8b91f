"""Curvature of any per-sample loss, from autodiff.

A *per-sample loss* is any ``L(f, y)`` (a loss module, a subclass with its own
``forward``, ``nn.NLLLoss``, ``nn.HuberLoss``, a plain function) whose value is
a sum or mean of terms that each depend on one sample's output. Its Hessian
w.r.t. the model output is then block diagonal over samples, with blocks

    H_n = ∂²L / ∂f_n²      [C, C],  C = the output entries per sample,

which already carry whatever normalisation ``L`` applies. All blocks come out
of ``C`` Hessian-vector products, each with the same unit direction ``e_c`` in
every sample's row (reverse-over-reverse autodiff of ``L`` alone, no forward
mode): row ``n`` of ``H e`` is ``H_n e_c`` because ``H`` is block diagonal.
That assumption is checked: two more products, along a random direction and
along the same direction scaled by a random factor per sample, must differ row
by row by exactly those factors, or the loss couples samples and is refused.

Factors are read off ``H_n = U Λ Uᵀ`` (``eigh``): the positive part
``S₊ = U √Λ₊ Uᵀ`` and, where ``H_n`` is indefinite, the negative part
``S₋ = U √Λ₋ Uᵀ`` (symmetric roots: column ``v`` belongs to output entry
``v``), eigenvalues within rounding of zero being dropped. Quantities linear
in the GGN (diagonals, Kronecker factor ``B``, products) use
``S₊S₊ᵀ − S₋S₋ᵀ`` and are exact; a square root needs ``S₋ = 0`` and is
refused otherwise. Monte-Carlo roots are ``S ε / √M`` with ``ε ~ N(0, I)``
per sample and draw, an unbiased estimate of the same GGN.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor
from torch.func import grad, vjp, vmap

from .._core import draws as _draws
from .._core.tensors import is_concrete
from .._core.errors import CurvatureError
from .._core import linalg

__all__ = ["GenericCurvature", "check_per_sample"]


class GenericCurvature:
    """Per-sample Hessian blocks of ``loss_of(out)`` and their factors (module doc).

    Args:
        loss_of: ``out -> L`` (the targets bound).
        out: model output ``[N, *]``.
        name: the loss, for messages.
    """

    def __init__(self, loss_of: Callable[[Tensor], Tensor], out: Tensor, name: str):
        self.loss_of, self.out, self.name = loss_of, out, name
        self._pull = None
        self._blocks: Optional[Tensor] = None
        self._eig: Optional[Tuple[Tensor, Tensor]] = None

    # ------------------------------------------------------------------ Hessian
    def _hvp(self) -> Callable[[Tensor], Tensor]:
        """``v [N, *out[1:]] -> H v`` (reverse over reverse: the Hessian is symmetric)."""
        if self._pull is None:
            _, self._pull = vjp(grad(self.loss_of), self.out)
        return lambda v: self._pull(v)[0]

    def blocks(self) -> Tensor:
        """``H [N, C, C]``: ``H[n, a, b] = ∂²L / ∂f_{n,a} ∂f_{n,b}``."""
        if self._blocks is None:
            n, c = self.out.shape[0], self.out[0].numel()
            eye = torch.eye(c, dtype=self.out.dtype, device=self.out.device)
            units = eye.reshape((c, 1) + tuple(self.out.shape[1:])).expand((c, n) + tuple(self.out.shape[1:]))
            cols = vmap(self._hvp())(units).reshape(c, n, c)  # [b, n, a] = H_n e_b
            H = cols.permute(1, 2, 0)
            self._blocks = (H + H.transpose(1, 2)) / 2
        return self._blocks

    def _eigh(self) -> Tuple[Tensor, Tensor]:
        """Eigenvalues ``[N, C]`` (within rounding of zero set to zero) and vectors ``[N, C, C]``."""
        if self._eig is None:
            evals, evecs = linalg.eigh(self.blocks())
            c = evals.shape[1]
            tol = evals.abs().amax(1, keepdim=True) * c * torch.finfo(evals.dtype).eps * 10
            self._eig = torch.where(evals.abs() > tol, evals, torch.zeros_like(evals)), evecs
        return self._eig

    @property
    def signed(self) -> bool:
        """Whether some block has a negative eigenvalue (an indefinite loss Hessian)."""
        evals, _ = self._eigh()

        return not is_concrete(evals) or bool((evals < 0).any())

    def most_negative(self) -> Tuple[float, int]:
        evals, _ = self._eigh()
        lowest = evals.min(1).values
        n = int(lowest.argmin())
        return float(lowest[n]), n

    # ------------------------------------------------------------------ factors
    def _symmetric_roots(self) -> List[Tuple[float, Tensor]]:
        """``[(sign, R [N, C, C])]``: ``R = U √Λ± Uᵀ``."""
        evals, evecs = self._eigh()
        parts = [(1.0, evals.clamp(min=0))]
        if self.signed:
            parts.append((-1.0, (-evals).clamp(min=0)))
        return [(sign, (evecs * lam.sqrt().unsqueeze(1)) @ evecs.transpose(1, 2)) for sign, lam in parts]

    def roots(self) -> List[Tuple[float, Tensor]]:
        """``[(sign, S [C, N, *out[1:]])]`` with ``Σ sign · S Sᵀ = H_n`` per sample."""
        n, c = self.out.shape[0], self.out[0].numel()
        return [(sign, R.permute(2, 0, 1).reshape((c, n) + tuple(self.out.shape[1:])))
                for sign, R in self._symmetric_roots()]

    def sampled_roots(self, mc_samples: int, generator: Optional[torch.Generator]) -> List[Tuple[float, Tensor]]:
        """``[(sign, S [M, N, *out[1:]])]``: ``R ε / √M``, ``ε ~ N(0, I)`` (``E[S Sᵀ] = R Rᵀ``)."""
        n, c = self.out.shape[0], self.out[0].numel()
        result = []
        for sign, R in self._symmetric_roots():
            eps = _draws.randn((mc_samples, n, c), generator, R.dtype, R.device)
            S = torch.einsum("nab,mnb->mna", R, eps) / mc_samples**0.5
            result.append((sign, S.reshape((mc_samples, n) + tuple(self.out.shape[1:]))))
        return result

    def matvec(self, mat: Tensor) -> Tensor:
        """``H_n`` per sample: ``mat [V, N, *out[1:]]`` -> same shape."""
        return vmap(self._hvp())(mat)

    def modified_matvec(self, mat: Tensor, modify: str) -> Tensor:
        """``U mod(Λ) Uᵀ`` per sample (``"clip"``: ``max(λ, 0)``; ``"abs"``: ``|λ|``)."""
        evals, evecs = self._eigh()
        lam = evals.clamp(min=0) if modify == "clip" else evals.abs()
        M = (evecs * lam.unsqueeze(1)) @ evecs.transpose(1, 2)  # [N, C, C]
        v, n = mat.shape[0], mat.shape[1]
        return torch.einsum("nab,vnb->vna", M, mat.reshape(v, n, -1)).reshape(mat.shape)


def check_per_sample(loss_of: Callable[[Tensor], Tensor], out: Tensor, name: str) -> None:
    """Refuse a loss whose Hessian couples samples (see the module doc).

    Two Hessian-vector products, with a random direction ``d`` and with ``w ⊙ d`` (``w`` a
    random scale per sample): for a per-sample loss row ``n`` of the second is ``w_n`` times
    row ``n`` of the first; any coupling ``H_nm ≠ 0`` between samples breaks that, whichever
    samples it joins. (One product along sample 0 alone would miss a coupling of two others.)
    """
    if out.shape[0] < 2:
        return
    gen = torch.Generator(device=out.device).manual_seed(0)
    d = torch.randn(out.shape, generator=gen, dtype=out.dtype, device=out.device)
    w = 0.5 + torch.rand((out.shape[0],) + (1,) * (out.dim() - 1), generator=gen, dtype=out.dtype, device=out.device)
    _, pull = vjp(grad(loss_of), out.detach())
    hv, hw = pull(d)[0].detach(), pull(w * d)[0].detach()
    gap = (hw - w * hv).reshape(out.shape[0], -1).abs().amax(1)
    worst = int(gap.argmax())
    tol = torch.finfo(out.dtype).eps ** 0.5 * max(float(hv.abs().max()), float(hw.abs().max()), 1e-30)
    if float(gap[worst]) > tol:
        raise CurvatureError(
            f"lossfn {name} couples samples: its second derivative w.r.t. the output of sample "
            f"{worst} depends on other samples' outputs (|Δ| = {float(gap[worst]):.3g}). curvlib "
            "needs a per-sample loss, a sum or mean of terms that each depend on one sample's "
            "output and target, to define individual gradients and the GGN. Losses over pairs "
            "or the whole batch (contrastive, ranking, batch statistics) are not supported."
        )
