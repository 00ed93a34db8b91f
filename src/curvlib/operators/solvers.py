"""Krylov solvers for ``(A + damping·I) x = b`` with a symmetric linear operator ``A [P, P]``.

``cg`` (preconditioned conjugate gradients) for positive definite ``A + damping·I``;
``minres`` (Paige–Saunders) for symmetric indefinite or singular ones. ``b`` is
``[P]`` or a block ``[P, K]`` whose columns are solved independently but multiplied
together, one product ``A @ [P, K]`` per iteration. ``A`` is anything with ``shape``,
``dtype``, ``device`` and ``A @ X`` (a dense tensor, or a curvlib operator).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .._core.errors import CurvatureError
from . import _validate

__all__ = ["Solution", "cg", "minres"]

NOT_DEFINITE = (
    "cg needs A + damping·I and the preconditioner M positive definite; along a search direction p "
    "with residual r, pᵀ(A + damping·I)p = {:.3g} and rᵀMr = {:.3g}, one of them <= 0. "
    "Use minres for an indefinite A + damping·I, or increase damping."
)


class Solution(NamedTuple):
    r"""The result of a Krylov solve; every field has ``b``'s column shape.

    Attributes:
        x: ``[P]`` or ``[P, K]``, like ``b``.
        residual_norm: ``[]`` or ``[K]``: $\lVert b - (A + \mathrm{damping} \cdot I) x \rVert$, recomputed with ``A``
            (not the recurrence's value).
        iterations: ``[]`` or ``[K]`` (int64): iterations until the column converged.
        converged: ``[]`` or ``[K]`` (bool): $\mathrm{residual\_norm} \le \mathrm{tol} \cdot \lVert b \rVert$.

    Examples::

        >>> import torch
        >>> from curvlib.operators import cg
        >>> solution = cg(2 * torch.eye(3, dtype=torch.float64), torch.ones(3, 2, dtype=torch.float64))
        >>> solution.x[:, 0].tolist(), solution.iterations.tolist(), solution.converged.tolist()
        ([0.5, 0.5, 0.5], [1, 1], [True, True])
    """

    x: Tensor
    residual_norm: Tensor
    iterations: Tensor
    converged: Tensor


def _checked(A, b, damping, tol, max_iterations, default_factor: int):
    """Shared checks; returns ``b`` as a block, whether it was a vector, and the cap."""
    size = _validate.operator_size(A)
    B, was_vector = _validate.right_hand_side(b, A, size)
    _validate.real(damping, "damping")
    _validate.positive_real(tol, "tol")
    if max_iterations is None:
        max_iterations = default_factor * size
    return B, was_vector, _validate.count(max_iterations, "max_iterations", 1)


def _damped(A, damping: float, X: Tensor) -> Tensor:
    """``(A + damping·I) X``."""
    return _validate.apply(A, X) + damping * X if damping != 0.0 else _validate.apply(A, X)


def _solution(A, damping, B, X, iterations, tol, was_vector) -> Solution:
    """Recompute the residuals with ``A`` and shape the fields like ``b``."""
    residual = (B - _damped(A, damping, X)).norm(dim=0)
    converged = residual <= tol * B.norm(dim=0)
    fields = (X, residual, iterations, converged)
    return Solution(*(field.squeeze(-1) for field in fields)) if was_vector else Solution(*fields)


def _precondition(preconditioner, R: Tensor) -> Tensor:
    """``M R``, or ``R`` without a preconditioner."""
    return R if preconditioner is None else _validate.apply(preconditioner, R, "preconditioner")


def cg(A, b, damping=0.0, tol=1e-8, max_iterations=None, preconditioner=None) -> Solution:
    r"""Preconditioned conjugate gradients for ``(A + damping·I) x = b``, ``A + damping·I`` positive definite.

    From $x_0 = 0$, with ``M`` the preconditioner ($M \approx (A + \mathrm{damping} \cdot I)^{-1}$, symmetric
    positive definite; the identity if ``None``): ``r = b − (A+δI)x``, ``z = M r``,
    $\alpha = r^\top z / p^\top (A + \delta I) p$, ``x += αp``, ``r −= α(A+δI)p``, $p = z + (r'^\top z' / r^\top z)\, p$.
    A column stops when $\lVert r \rVert \le \mathrm{tol} \cdot \lVert b \rVert$. In exact arithmetic CG ends within ``P``
    iterations (within the number of distinct eigenvalues of ``M(A+δI)``), and the error
    satisfies $\lVert x - x^* \rVert_{A + \delta I} \le 2 \big((\sqrt{\kappa} - 1) / (\sqrt{\kappa} + 1)\big)^k \lVert x^* \rVert_{A + \delta I}$, $\kappa$ the
    condition number of ``M(A+δI)``.

    Args:
        A: symmetric operator ``[P, P]``.
        b: right-hand side ``[P]`` or ``[P, K]``, on ``A``'s dtype and device.
        damping: ``δ`` added to the diagonal.
        tol: relative residual tolerance ``> 0``.
        max_iterations: cap per column, default ``10·P`` (scipy's).
        preconditioner: anything with ``M @ X`` for ``X [P, K]``, or ``None``.

    Returns:
        ``Solution``.

    Raises:
        CurvatureError: bad shapes, dtypes or devices; ``A + damping·I`` (or ``M``) found
            not positive definite along a search direction (use ``minres``).

    Examples::

        >>> import torch
        >>> from curvlib.operators import cg
        >>> A = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
        >>> b = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> solution = cg(A, b)
        >>> bool(torch.allclose(A @ solution.x, b)), int(solution.iterations)
        (True, 2)
    """
    B, was_vector, max_iterations = _checked(A, b, damping, tol, max_iterations, 10)
    _validate.linear_map_or_none(preconditioner, "preconditioner")
    damping = float(damping)
    X, R = torch.zeros_like(B), B.clone()
    target = tol * B.norm(dim=0)
    Z = _precondition(preconditioner, R)
    p, rz = Z, (R * Z).sum(dim=0)
    active = R.norm(dim=0) > target
    iterations = torch.zeros(B.shape[1], dtype=torch.int64, device=B.device)
    while bool(active.any()) and int(iterations.max()) < max_iterations:
        Ap = _damped(A, damping, p)
        curvature = (p * Ap).sum(dim=0)
        if bool((active & (curvature <= 0)).any()) or bool((active & (rz <= 0)).any()):
            raise CurvatureError(NOT_DEFINITE.format(curvature[active].min().item(), rz[active].min().item()))
        alpha = torch.where(active, rz / torch.where(active, curvature, 1.0), 0.0)
        X, R = X + torch.where(active, alpha * p, 0.0), R - torch.where(active, alpha * Ap, 0.0)
        iterations += active.to(torch.int64)
        active = active & (R.norm(dim=0) > target)
        Z = _precondition(preconditioner, R)
        rz_next = (R * Z).sum(dim=0)
        p = Z + torch.where(active, rz_next / torch.where(active, rz, 1.0), 0.0) * p
        rz = rz_next
    return _solution(A, damping, B, X, iterations, tol, was_vector)


def minres(A, b, damping=0.0, tol=1e-8, max_iterations=None) -> Solution:
    r"""MINRES (Paige, Saunders 1975) for ``(A + damping·I) x = b``, ``A`` symmetric, possibly indefinite.

    Iterate ``k`` minimises $\lVert b - (A + \delta I) x \rVert$ over the Krylov space
    $\operatorname{span}\{b, (A + \delta I) b, \dots, (A + \delta I)^{k-1} b\}$, through the Lanczos recurrence and Givens
    rotations of its tridiagonal (the residual norm is non-increasing). A column stops
    when the recurrence's residual is $\le \mathrm{tol} \cdot \lVert b \rVert$; in exact arithmetic MINRES ends
    within ``P`` iterations, and for spectra in ``[−b, −a] ∪ [c, d]`` of equal widths the
    residual falls like $2 \big((\sqrt{\kappa} - 1) / (\sqrt{\kappa} + 1)\big)^{\lfloor k/2 \rfloor}$, $\kappa = b d / (a c)$.
    As scipy's ``minres`` without a preconditioner (its ``shift`` is ``−damping``).

    Args:
        A: symmetric operator ``[P, P]``.
        b: right-hand side ``[P]`` or ``[P, K]``, on ``A``'s dtype and device.
        damping: ``δ`` added to the diagonal.
        tol: relative residual tolerance ``> 0``.
        max_iterations: cap per column, default ``5·P`` (scipy's).

    Returns:
        ``Solution``.

    Raises:
        CurvatureError: bad shapes, dtypes or devices.

    Examples::

        >>> import torch
        >>> from curvlib.operators import minres
        >>> A = torch.tensor([[1.0, 2.0], [2.0, -1.0]], dtype=torch.float64)
        >>> b = torch.tensor([1.0, 0.0], dtype=torch.float64)
        >>> solution = minres(A, b)
        >>> bool(torch.allclose(A @ solution.x, b)), bool(solution.converged)
        (True, True)
    """
    B, was_vector, max_iterations = _checked(A, b, damping, tol, max_iterations, 5)
    X, iterations = _minres_iteration(A, float(damping), B, tol, max_iterations)
    return _solution(A, float(damping), B, X, iterations, tol, was_vector)


def _minres_iteration(A, damping: float, B: Tensor, tol: float, max_iterations: int):
    """Paige–Saunders MINRES on every column of ``B`` at once (scipy's variable names)."""
    zeros = B.new_zeros(B.shape[1])
    beta1 = B.norm(dim=0)
    X, r1, r2, w, w2 = torch.zeros_like(B), B.clone(), B.clone(), torch.zeros_like(B), torch.zeros_like(B)
    beta, oldb, dbar, epsln, phibar = beta1.clone(), zeros, zeros, zeros, beta1.clone()
    cs, sn = -torch.ones_like(zeros), zeros
    tiny = torch.finfo(B.dtype).eps
    iterations = torch.zeros(B.shape[1], dtype=torch.int64, device=B.device)
    active = beta1 > 0
    for step in range(max_iterations):
        if not bool(active.any()):
            break
        safe_beta = torch.where(active, beta, 1.0)
        v = r2 / safe_beta
        y = _damped(A, damping, v)
        if step > 0:
            y = y - (beta / torch.where(oldb == 0, 1.0, oldb)) * r1
        alfa = (v * y).sum(dim=0)
        y = y - (alfa / safe_beta) * r2
        r1, r2 = r2, y
        oldb, beta = beta, y.norm(dim=0)
        # Givens rotation of the new column of the tridiagonal
        oldeps = epsln
        delta = cs * dbar + sn * alfa
        gbar = sn * dbar - cs * alfa
        epsln, dbar = sn * beta, -cs * beta
        gamma = torch.hypot(gbar, beta).clamp_min(tiny)
        cs, sn = gbar / gamma, beta / gamma
        phi, phibar = cs * phibar, sn * phibar
        w1, w2 = w2, w
        w = (v - oldeps * w1 - delta * w2) / gamma
        X = X + torch.where(active, phi * w, 0.0)  # finished columns may hold inf/nan
        iterations += active.to(torch.int64)
        active = active & (phibar > tol * beta1)
    return X, iterations
