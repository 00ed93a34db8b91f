"""Extreme eigenpairs and the spectral density of a symmetric linear operator ``A [P, P]``.

``lanczos`` finds a few eigenvalues at the ends of the spectrum with their vectors
(block Lanczos, full reorthogonalisation, Rayleigh–Ritz); ``spectral_density``
estimates the whole spectrum by stochastic Lanczos quadrature (Ubaru, Chen, Saad,
SIMAX 2017; PyHessian's ESD, Yao et al. 2020). ``A`` is anything with ``shape``,
``dtype``, ``device`` and ``A @ X`` for blocks ``X [P, K]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from .._core.errors import CurvatureError
from . import _validate
from .estimators import Estimate

__all__ = ["Eigenpairs", "lanczos", "SpectralDensity", "spectral_density"]

WHICH = ("largest", "smallest", "largest_magnitude", "both_ends")


class Eigenpairs(NamedTuple):
    r"""Ritz pairs of a symmetric operator.

    Attributes:
        values: ``[k]`` Ritz values, in the order ``which`` asks for.
        vectors: ``[P, k]`` orthonormal Ritz vectors, column ``i`` for ``values[i]``.
        residuals: ``[k]`` $\lVert A v_i - \lambda_i v_i \rVert$, recomputed with ``A``. For symmetric ``A``
            some eigenvalue lies within ``residuals[i]`` of ``values[i]``; if the rest of
            the spectrum is at least ``δ`` away from ``values[i]``, within
            $\mathrm{residuals}[i]^2 / \delta$, and $\sin \angle(v_i, \mathrm{eigenvector}) \le \mathrm{residuals}[i] / \delta$.
        converged: whether every residual met the tolerance before the iteration cap.
        num_matvecs: columns multiplied by ``A``, the residual check included.

    Examples::

        >>> import torch
        >>> from curvlib.operators import lanczos
        >>> pairs = lanczos(torch.diag(torch.arange(1.0, 6.0, dtype=torch.float64)), k=1)
        >>> pairs.vectors.shape, pairs.residuals.shape, pairs.converged
        (torch.Size([5, 1]), torch.Size([1]), True)
    """

    values: Tensor
    vectors: Tensor
    residuals: Tensor
    converged: bool
    num_matvecs: int


def _select(theta: Tensor, k: int, which: str) -> Tensor:
    """Indices of the ``k`` wanted Ritz values ``theta`` (ascending), in the output order."""
    if which == "largest":
        return theta.argsort(descending=True)[:k]
    if which == "smallest":
        return theta.argsort()[:k]
    if which == "largest_magnitude":
        return theta.abs().argsort(descending=True)[:k]
    ascending = theta.argsort()
    return torch.cat([ascending[: k // 2], ascending[len(theta) - (k - k // 2):]])


def _extend_orthonormal(Q: Tensor, end: int, W: Tensor, width: int, generator, scale: Tensor) -> None:
    """Write ``width`` orthonormal rows ``Q[end:end + width]`` ⊥ ``Q[:end]`` spanning the first columns of ``W``.

    The basis is kept as rows of a preallocated buffer, so each new vector is orthogonalised
    against a contiguous ``Q[:row]`` in place of a copy of the basis grown by one column. A
    column that falls below the breakdown threshold (its Krylov space is invariant) is replaced
    by a random direction orthogonal to everything so far, so the iteration continues in the
    complement.
    """
    row = end
    for col in range(W.shape[1]):
        if row == end + width:
            break
        w = _orthogonalised(W[:, col], Q[:row])
        if w.norm() <= _validate.breakdown_threshold(scale, W.dtype):
            w = _orthogonalised(_validate.draw("normal", (W.shape[0],), generator, W.dtype, W.device), Q[:row])
        Q[row] = w / w.norm()
        row += 1


def _orthogonalised(w: Tensor, rows: Tensor) -> Tensor:
    """``w`` less its projection on the orthonormal ``rows``: one classical Gram–Schmidt pass,
    and a second where the first removed most of ``w``, $\lVert w' \rVert < \lVert w \rVert / \sqrt{2}$
    (the DGKS criterion; twice is enough, Kahan–Parlett). A residual already orthogonalised
    against ``rows`` loses almost nothing in the first pass and takes one."""
    before = w.norm()
    w = w - rows.T @ (rows @ w)
    if bool(w.norm() * math.sqrt(2) < before):
        w = w - rows.T @ (rows @ w)
    return w


def _ritz(T: Tensor, dim: int, residual: Tensor, k: int, which: str):
    """Ritz values, coefficients, residual estimates ``‖(residual block) sᵢ‖`` and ``max|θ|``."""
    theta, S = torch.linalg.eigh((T[:dim, :dim] + T[:dim, :dim].T) / 2)
    chosen = _select(theta, k, which)
    last = S[dim - residual.shape[1]: dim, chosen]
    return theta[chosen], S[:, chosen], (residual @ last).norm(dim=0), theta.abs().max()


def lanczos(A, k=1, which="largest", num_iterations=None, tol=None, block_size=1, generator=None):
    r"""``k`` eigenpairs at one or both ends of the spectrum of a symmetric ``A``.

    Block Lanczos with full reorthogonalisation: the Krylov basis ``V`` of
    $[V_0, A V_0, A^2 V_0, \dots]$ ($V_0$ random ``[P, block_size]``) grows by one block per
    iteration; the Ritz pairs of $T = V^\top A V$ are the estimates. Iteration stops when
    the ``k`` wanted pairs have residual estimates $\lVert A y - \theta y \rVert \le \mathrm{tol} \cdot \max |\theta|$ (the
    last term a lower bound on $\lVert A \rVert_2$), when ``V`` spans all ``P`` dimensions (then the
    pairs are exact), or after ``num_iterations`` blocks. An invariant subspace
    (breakdown) is continued with a random orthogonal block. Each distinct eigenvalue
    appears in ``V`` with multiplicity at most ``block_size`` before a breakdown.

    Memory: the basis, ``P ×`` the Krylov dimension reached (at most twice that while it grows).

    Bound: for symmetric ``A`` and returned $(\lambda_i, v_i, r_i)$, some eigenvalue lies in
    $[\lambda_i - r_i, \lambda_i + r_i]$ (and within $r_i^2 / \delta$ given a gap ``δ``; see ``Eigenpairs``).

    Args:
        A: symmetric operator ``[P, P]``.
        k: number of eigenpairs, ``1 <= k <= P``.
        which: ``"largest"`` (descending), ``"smallest"`` (ascending),
            ``"largest_magnitude"`` (descending $|\lambda|$) or ``"both_ends"`` (``⌊k/2⌋``
            smallest and ``⌈k/2⌉`` largest, ascending, as scipy's ``eigsh(which="BE")``).
        num_iterations: cap on the number of blocks; default ``⌈max(100, 10k) /
            block_size⌉``. The Krylov dimension is at most ``P``.
        tol: relative residual tolerance, default $\sqrt{\varepsilon}$ of ``A.dtype``.
        block_size: columns per product ``A @ V``, ``1 <= block_size <= P``.
        generator: ``torch.Generator`` for the start block (and breakdown restarts).

    Returns:
        ``Eigenpairs``.

    Raises:
        CurvatureError: ``A`` not square, ``k`` outside ``[1, P]``, unknown ``which``,
            ``num_iterations · block_size < k``.

    Examples::

        >>> import torch
        >>> from curvlib.operators import lanczos
        >>> A = torch.diag(torch.arange(1.0, 11.0, dtype=torch.float64))
        >>> pairs = lanczos(A, k=2, generator=torch.Generator().manual_seed(0))
        >>> [round(value, 8) for value in pairs.values.tolist()]
        [10.0, 9.0]
    """
    size = _validate.operator_size(A)
    if _validate.count(k, "k", 1) > size:
        raise CurvatureError(f"k must be at most P = {size} (A's size); got {k}.")
    _validate.choice(which, "which", WHICH)
    _validate.generator_or_none(generator)
    if _validate.count(block_size, "block_size", 1) > size:
        raise CurvatureError(f"block_size must be at most P = {size} (A's size); got {block_size}.")
    if num_iterations is None:
        num_iterations = math.ceil(max(100, 10 * k) / block_size)
    if _validate.count(num_iterations, "num_iterations", 1) * block_size < k:
        raise CurvatureError(
            f"num_iterations · block_size must be at least k = {k}; got {num_iterations} · {block_size}."
        )
    tol = _validate.default_tolerance(A.dtype) if tol is None else _validate.positive_real(tol, "tol")
    return _block_lanczos(A, size, k, which, min(size, num_iterations * block_size), tol, block_size, generator)


def _block_lanczos(A, size, k, which, max_dim, tol, block_size, generator) -> Eigenpairs:
    """The iteration of ``lanczos`` on checked arguments. The basis is the rows of ``Q``
    (``Q[:end]``, contiguous), so its products with a block are plain matrix products."""
    start = _validate.draw("normal", (size, block_size), generator, A.dtype, A.device)
    Q = _grown(torch.linalg.qr(start).Q.T, min(max_dim, max(2 * k, 8 * block_size)))
    T = Q.new_zeros(max_dim, max_dim)
    begin, end, matvecs, scale = 0, block_size, 0, Q.new_zeros(())
    while True:
        AV = _validate.apply(A, Q[begin:end].T.contiguous())
        matvecs += end - begin
        scale = torch.maximum(scale, AV.norm(dim=0).max())
        coefficients = Q[:end] @ AV
        residual = AV - Q[:end].T @ coefficients
        correction = Q[:end] @ residual  # second Gram–Schmidt pass
        residual = residual - Q[:end].T @ correction
        T[:end, begin:end] = coefficients + correction
        if end >= k:
            values, ritz_coefficients, estimates, norm = _ritz(T, end, residual, k, which)
            if end in (size, max_dim) or bool((estimates <= tol * norm).all()):
                break
        width = min(block_size, size - end, max_dim - end)
        if end + width > Q.shape[0]:
            Q = _grown(Q[:end], min(max_dim, 2 * Q.shape[0]))
        _extend_orthonormal(Q, end, residual, width, generator, scale)
        T[end:end + width, begin:end] = Q[end:end + width] @ residual
        begin, end = end, end + width
    return _finish(A, Q[:end].T @ ritz_coefficients, values, tol * norm, matvecs)


def _grown(rows: Tensor, capacity: int) -> Tensor:
    """``rows`` at the start of a ``[capacity, P]`` buffer: the basis doubles as it grows,
    so memory stays within twice the Krylov dimension reached."""
    buffer = rows.new_zeros(capacity, rows.shape[1])
    buffer[: rows.shape[0]] = rows
    return buffer


def _finish(A, vectors: Tensor, values: Tensor, tolerance: Tensor, matvecs: int) -> Eigenpairs:
    """Recompute the residuals ``‖A v − λ v‖`` with one block product."""
    residuals = (_validate.apply(A, vectors) - vectors * values).norm(dim=0)
    converged = bool((residuals <= tolerance).all())
    return Eigenpairs(values, vectors, residuals, converged, matvecs + vectors.shape[1])


@dataclass(frozen=True)
class SpectralDensity:
    r"""Stochastic Lanczos quadrature of a symmetric ``A [P, P]``: one Gauss rule per probe.

    For probe ``z`` ($q = z / \lVert z \rVert$) the Lanczos tridiagonal $T = U \operatorname{diag}(\theta) U^\top$ gives
    nodes $\theta_j$ and weights $\omega_j = U_{0j}^2$ ($\sum_j \omega_j = 1$) with
    $\sum_j \omega_j f(\theta_j) \approx q^\top f(A)\, q$, exact for polynomials of degree ``< 2·num_steps``.

    Attributes:
        nodes: ``[num_probes, num_steps]`` Ritz values per probe (after a breakdown, the
            trailing ones carry weight 0).
        weights: ``[num_probes, num_steps]``, each row sums to 1.
        scales: ``[num_probes]`` $\lVert z \rVert^2$ (``P`` for Rademacher probes).
        num_matvecs: columns multiplied by ``A``.

    Examples::

        >>> import torch
        >>> from curvlib.operators import spectral_density
        >>> sld = spectral_density(torch.eye(6, dtype=torch.float64), num_probes=2, num_steps=3)
        >>> sld.nodes.shape, sld.weights.sum(dim=1).tolist()
        (torch.Size([2, 3]), [1.0, 1.0])
    """

    nodes: Tensor
    weights: Tensor
    scales: Tensor
    num_matvecs: int

    def density(self, grid: Tensor, sigma: float) -> Tensor:
        r"""Gaussian-broadened spectral density at ``grid``: ``[G] -> [G]``.

        $\varphi(t) = \frac{1}{n} \sum_\mathrm{probes} \sum_j \omega_j\, \mathcal{N}(t; \theta_j, \sigma^2)$, which integrates to exactly 1 over
        the real line (PyHessian's ESD normalises on its grid instead); its expectation is
        $\frac{1}{P} \sum_i \mathcal{N}(t; \lambda_i, \sigma^2)$ up to the quadrature error.

        Args:
            grid: ``[G]`` points ``t``.
            sigma: $\sigma > 0$, the width of the Gaussians.

        Returns:
            Tensor: ``[G]``, the density at each point.
        """
        sigma = _validate.positive_real(sigma, "sigma")
        grid = torch.as_tensor(grid, dtype=self.nodes.dtype, device=self.nodes.device)
        offsets = (grid[:, None, None] - self.nodes[None]) / sigma
        kernels = torch.exp(-0.5 * offsets**2) / (sigma * math.sqrt(2 * math.pi))
        return (kernels * self.weights[None]).sum(dim=2).mean(dim=1)

    def trace_of(self, fn: Callable[[Tensor], Tensor]) -> Estimate:
        r"""$\operatorname{tr} f(A) \approx \frac{1}{n} \sum_\mathrm{probes} \lVert z \rVert^2 \sum_j \omega_j f(\theta_j)$ (unbiased up to quadrature error).

        ``fn`` maps a tensor of nodes to ``f`` elementwise (``torch.log``, ``lambda t: t**2``).
        The standard error is the sample one over probes. ``trace_of(identity)`` equals
        Hutchinson's estimate $\frac{1}{n} \sum z^\top A z$ with the same probes.

        Args:
            fn: maps a tensor of nodes to ``f`` of each, elementwise.

        Returns:
            Estimate: the estimate of ``tr f(A)``, its standard error over probes and the matvecs.
        """
        samples = self.scales * (self.weights * fn(self.nodes)).sum(dim=1)
        count = samples.shape[0]
        error = samples.std() / count**0.5 if count > 1 else None
        return Estimate(samples.mean(), error, self.num_matvecs)

    def trace(self) -> Estimate:
        """``tr A``: ``trace_of`` the identity.

        Returns:
            Estimate: the estimate of ``tr A``.
        """
        return self.trace_of(lambda nodes: nodes)


def spectral_density(A, num_probes=10, num_steps=50, generator=None, distribution="rademacher"):
    r"""Stochastic Lanczos quadrature (Ubaru, Chen, Saad 2017), PyHessian's ESD.

    For each probe ``z`` (i.i.d. Rademacher or normal entries), ``num_steps`` Lanczos
    steps with full reorthogonalisation from $q = z / \lVert z \rVert$ give $T = U \operatorname{diag}(\theta) U^\top$;
    $(\theta_j, U_{0j}^2)$ is the Gauss quadrature rule of the measure $\sum_i (q^\top u_i)^2 \delta_{\lambda_i}$.
    $\operatorname{tr} f(A) \approx \frac{1}{n} \sum \lVert z \rVert^2 \sum_j \omega_j f(\theta_j)$: the quadrature is exact for polynomials
    ``f`` of degree ``< 2·num_steps``, the probe average is Hutchinson's with variance
    ``O(1/n)``; for analytic ``f`` the quadrature error decays geometrically in
    ``num_steps``. All probes advance together: one product ``A @ [P, num_probes]`` per
    step; memory ``P · num_steps · num_probes`` for the bases (split the probes over
    calls and average the ``trace_of`` values when that is too much).

    Args:
        A: symmetric operator ``[P, P]``.
        num_probes: ``n >= 1`` probe vectors.
        num_steps: Lanczos steps per probe, ``>= 1``; capped at ``P`` (then exact).
        generator: ``torch.Generator`` for the probes.
        distribution: ``"rademacher"`` (default, as PyHessian) or ``"normal"``.

    Returns:
        ``SpectralDensity``.

    Raises:
        CurvatureError: ``A`` not square, ``num_probes``/``num_steps`` < 1.

    Examples::

        >>> import torch
        >>> from curvlib.operators import spectral_density
        >>> A = torch.diag(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64))
        >>> sld = spectral_density(A, num_probes=3, num_steps=4, generator=torch.Generator().manual_seed(0))
        >>> round(float(sld.trace().value), 10)  # the trace, exact up to rounding
        10.0
        >>> grid = torch.linspace(0.0, 5.0, 6, dtype=torch.float64)
        >>> sld.density(grid, sigma=0.1).shape
        torch.Size([6])
    """
    size = _validate.operator_size(A)
    _validate.count(num_probes, "num_probes", 1)
    steps = min(_validate.count(num_steps, "num_steps", 1), size)
    _validate.generator_or_none(generator)
    _validate.choice(distribution, "distribution", _validate.DISTRIBUTIONS)
    probes = _validate.draw(distribution, (size, num_probes), generator, A.dtype, A.device)
    alphas, betas = _batched_lanczos(A, probes / probes.norm(dim=0), steps)
    T = torch.diag_embed(alphas) + torch.diag_embed(betas, 1) + torch.diag_embed(betas, -1)
    nodes, U = torch.linalg.eigh(T)
    return SpectralDensity(nodes, U[:, 0, :] ** 2, probes.norm(dim=0) ** 2, steps * num_probes)


def _batched_lanczos(A, q: Tensor, steps: int) -> tuple[Tensor, Tensor]:
    """Lanczos from each column of ``q [P, n]``: diagonals ``[n, steps]``, off-diagonals ``[n, steps − 1]``.

    Full reorthogonalisation per probe. A probe whose Krylov space becomes invariant
    (``β`` below the breakdown threshold) continues with the zero vector: its ``α``, ``β``
    are 0 from then on, which splits ``T`` and gives the extra nodes weight 0.
    """
    basis = q.new_zeros(steps, *q.shape)
    alphas, betas = [], []
    scale = q.new_zeros(q.shape[1])
    for step in range(steps):
        basis[step] = q
        w = _validate.apply(A, q)
        scale = torch.maximum(scale, w.norm(dim=0))
        alphas.append((q * w).sum(dim=0))
        for _ in range(2):  # full reorthogonalisation, twice
            projections = torch.einsum("spn,pn->sn", basis[: step + 1], w)
            w = w - torch.einsum("spn,sn->pn", basis[: step + 1], projections)
        beta = w.norm(dim=0)
        alive = beta > _validate.breakdown_threshold(scale, q.dtype)
        q = torch.where(alive, w / torch.where(alive, beta, 1.0), 0.0)
        betas.append(torch.where(alive, beta, 0.0))
    return torch.stack(alphas, dim=1), torch.stack(betas[:-1], dim=1)
