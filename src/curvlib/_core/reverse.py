"""Reverse-over-reverse second derivatives where torch has no forward mode, checked.

Second derivatives go forward over reverse (a Jacobian-vector product of a gradient). Where
a model operation has no forward-mode derivative in torch (``_grouped_mm``, MoE layers'
expert kernel; a custom ``autograd.Function`` without ``jvp``), they go reverse over reverse:
the same symmetric matrix, ``H t = ∇(⟨∇f, t⟩)``. torch's reverse-mode second derivative of a
kernel can be wrong, though (``weight_norm``'s in torch 2.13), and a wrong one is not
symmetric: the products are used only once they pass a symmetry check.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
from torch import Tensor

from .errors import CurvatureError

__all__ = ["check_symmetric", "check_symmetric_matrices", "missing_forward_mode_reason"]

_KNOWN_WRONG = "weight_norm's kernel is known wrong in torch 2.13"
_ADVICE = ("Use the GGN quantities for this model, or write the operation without the kernel (weight "
           "normalisation as w = g * v / v.norm(...) in a parametrization).")


def check_symmetric(product: Callable, theta: Dict[str, Tensor], what: str, reason: str,
                    known: str = _KNOWN_WRONG, advice: str = _ADVICE) -> None:
    """Refuse reverse-over-reverse Hessian products that are not symmetric: for random ``u, w``,
    ``|uᵀ(Hw) − wᵀ(Hu)| ≤ √ε (‖u‖‖Hw‖ + ‖w‖‖Hu‖)``. ``reason``: the sentence saying why the
    forward-mode route is closed; ``known``, ``advice``: what is known to cause it, what to do;
    ``product``: dict -> dict."""
    first = next(iter(theta.values()))
    gen = torch.Generator(device=first.device).manual_seed(0)
    u, w = ({n: torch.randn(t.shape, generator=gen, dtype=t.dtype, device=t.device) for n, t in theta.items()}
            for _ in range(2))
    hu, hw = product(u), product(w)
    dot = lambda a, b: sum(float((a[n] * b[n]).sum()) for n in a)  # noqa: E731
    gap = abs(dot(u, hw) - dot(w, hu))
    scale = dot(u, u) ** 0.5 * dot(hw, hw) ** 0.5 + dot(w, w) ** 0.5 * dot(hu, hu) ** 0.5
    if gap > torch.finfo(first.dtype).eps ** 0.5 * scale:
        raise CurvatureError(
            f"{what}: {reason} Its reverse-mode second derivative is not reliable here: the products are not "
            f"symmetric (uᵀHw − wᵀHu = {gap:.2g} at scale {scale:.2g}; {known}). {advice}")


def check_symmetric_matrices(R: Tensor, what: str, reason: str) -> None:
    """Refuse reverse-over-reverse Hessians ``R [..., D, D]`` that are not symmetric:
    ``‖R − Rᵀ‖ ≤ √ε ‖R‖`` (Frobenius, over all of them)."""
    gap = float((R - R.transpose(-1, -2)).norm())
    scale = float(R.norm())
    if gap > torch.finfo(R.dtype).eps ** 0.5 * scale:
        raise CurvatureError(
            f"{what}: {reason} Its reverse-mode second derivative is not reliable here: the Hessian is not "
            f"symmetric (‖R − Rᵀ‖ = {gap:.2g} at ‖R‖ = {scale:.2g}; {_KNOWN_WRONG}). {_ADVICE}")


def missing_forward_mode_reason(failure: BaseException) -> str:
    """The sentence saying which model operation has no forward-mode derivative (``failure``:
    torch's error, or a graph node's failure holding it as ``exc`` with the ``node``)."""
    node = getattr(failure, "node", None)
    cause = getattr(failure, "exc", failure)
    return (f"forward-mode derivatives (torch.func.jvp) of the model's operations are needed, but torch has none "
            f"for one of them{f' (graph node {node.name!r})' if node is not None else ''}: {str(cause).splitlines()[0]}")
