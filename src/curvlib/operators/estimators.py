"""Randomised trace and diagonal estimators for a symmetric linear operator ``A [P, P]``.

Every estimator draws its test vectors from ``generator`` (a ``torch.Generator``; the
global stream when ``None``), multiplies ``A`` by blocks ``[P, K]`` and returns an
``Estimate``. ``A`` is anything with ``shape``, ``dtype``, ``device`` and ``A @ X``
(a dense tensor, or a curvlib operator). Test vectors have i.i.d. Rademacher (±1) or
standard normal entries.

References: Hutchinson (1989); Meyer, Musco, Musco, Woodruff, *Hutch++* (SOSA 2021);
Epperly, Tropp, Webber, *XTrace: making the most of every sample in stochastic trace
estimation* (SIMAX 2024).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .._core.errors import CurvatureError
from . import _validate

__all__ = ["Estimate", "hutchinson_trace", "hutchpp_trace", "xtrace", "hutchinson_diagonal", "xdiag"]


class Estimate(NamedTuple):
    r"""A randomised estimate and its error estimate.

    Attributes:
        value: the estimate, ``[]`` for a trace, ``[P]`` for a diagonal.
        standard_error: same shape as ``value``: the sample standard error of the mean
            of the estimator's exchangeable (or independent) terms, $\mathrm{std} / \sqrt{n}$; ``None``
            when there is a single term.
        num_matvecs: the number of columns multiplied by ``A``.

    Examples::

        >>> import torch
        >>> from curvlib.operators import hutchinson_trace
        >>> est = hutchinson_trace(torch.eye(4, dtype=torch.float64), 3)
        >>> float(est.value), float(est.standard_error), est.num_matvecs
        (4.0, 0.0, 3)
    """

    value: Tensor
    standard_error: Tensor | None
    num_matvecs: int


def _mean_and_error(samples: Tensor, num_matvecs: int) -> Estimate:
    """Mean over the last axis of ``samples`` and its standard error ``std / √n``."""
    n = samples.shape[-1]
    error = samples.std(dim=-1) / n**0.5 if n > 1 else None
    return Estimate(samples.mean(dim=-1), error, num_matvecs)


def _checked(A, num_matvecs, minimum: int, generator, distribution: str = "rademacher") -> int:
    """Shared checks: ``P`` of ``A``, the matvec budget, the generator and distribution."""
    size = _validate.operator_size(A)
    _validate.count(num_matvecs, "num_matvecs", minimum)
    _validate.generator_or_none(generator)
    _validate.choice(distribution, "distribution", _validate.DISTRIBUTIONS)
    return size


def _test_vectors(A, size: int, count: int, generator, distribution: str) -> Tensor:
    """``count`` test vectors ``[P, count]`` on ``A``'s dtype and device."""
    return _validate.draw(distribution, (size, count), generator, A.dtype, A.device)


def hutchinson_trace(A, num_matvecs: int, generator=None, distribution: str = "rademacher") -> Estimate:
    r"""Hutchinson's estimate of ``tr A`` from ``m = num_matvecs`` test vectors.

    $t = \frac{1}{m} \sum_i z_i^\top A z_i$ is unbiased; its variance is
    $2 (\lVert A \rVert_F^2 - \sum_i A_{ii}^2) / m$ for Rademacher $z_i$ and $2 \lVert A \rVert_F^2 / m$ for normal
    $z_i$ (symmetric ``A``). The standard error is the sample one, $\operatorname{std}(z_i^\top A z_i) / \sqrt{m}$.

    Args:
        A: symmetric operator ``[P, P]``.
        num_matvecs: number of test vectors ``m >= 1``, all multiplied as one block
            ``[P, m]`` (average calls with independent generators for a smaller block).
        generator: ``torch.Generator`` for the test vectors.
        distribution: ``"rademacher"`` (default, lower variance) or ``"normal"``.

    Returns:
        ``Estimate`` with a scalar ``value``.

    Raises:
        CurvatureError: ``A`` not square, ``num_matvecs < 1``, unknown ``distribution``.

    Examples::

        >>> import torch
        >>> from curvlib.operators import hutchinson_trace
        >>> A = torch.diag(torch.arange(1.0, 5.0, dtype=torch.float64))
        >>> est = hutchinson_trace(A, 8, generator=torch.Generator().manual_seed(0))
        >>> float(est.value)  # diagonal A: every Rademacher sample is exact
        10.0
    """
    size = _checked(A, num_matvecs, 1, generator, distribution)
    Z = _test_vectors(A, size, num_matvecs, generator, distribution)
    samples = (Z * _validate.apply(A, Z)).sum(dim=0)
    return _mean_and_error(samples, num_matvecs)


def hutchinson_diagonal(A, num_matvecs: int, generator=None, distribution: str = "rademacher") -> Estimate:
    r"""Hutchinson's (Bekas, Kokiopoulou, Saad 2007) estimate of ``diag A``.

    $d = \frac{1}{m} \sum_i z_i \odot A z_i$ is unbiased; entry ``j`` has variance
    $\sum_{k \ne j} A_{jk}^2 / m$ for Rademacher $z_i$ ($(\sum_k A_{jk}^2 + A_{jj}^2) / m$ for normal).
    The per-entry standard error is the sample one over the ``m`` terms.

    Args:
        A: symmetric operator ``[P, P]``.
        num_matvecs: number of test vectors ``m >= 1``.
        generator: ``torch.Generator`` for the test vectors.
        distribution: ``"rademacher"`` (default) or ``"normal"``.

    Returns:
        ``Estimate`` with ``value`` and ``standard_error`` of shape ``[P]``.

    Raises:
        CurvatureError: ``A`` not square, ``num_matvecs < 1``, unknown ``distribution``.

    Examples::

        >>> import torch
        >>> from curvlib.operators import hutchinson_diagonal
        >>> A = torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
        >>> hutchinson_diagonal(A, 4, generator=torch.Generator().manual_seed(0)).value
        tensor([1., 2., 3.], dtype=torch.float64)
    """
    size = _checked(A, num_matvecs, 1, generator, distribution)
    Z = _test_vectors(A, size, num_matvecs, generator, distribution)
    return _mean_and_error(Z * _validate.apply(A, Z), num_matvecs)


def hutchpp_trace(A, num_matvecs: int, generator=None, distribution: str = "rademacher") -> Estimate:
    r"""Hutch++ (Meyer, Musco, Musco, Woodruff 2021): exact trace on a sketched range, Hutchinson on the rest.

    With ``s = ⌊m/3⌋`` sketch vectors ``S``, ``Q = orth(A S)`` (``[P, s]``) and the other
    ``g = m − 2s`` vectors ``G``:
    $t = \operatorname{tr}(Q^\top A Q) + \frac{1}{g} \sum_i g_i^\top (I - Q Q^\top) A (I - Q Q^\top) g_i$.
    Unbiased; exact when ``rank A <= s`` and ``A S`` has ``A``'s rank (then
    $(I - Q Q^\top) A = 0$; almost surely for normal ``S``, for Rademacher ``S`` unless its
    columns are dependent, a chance that falls like $2^{-P}$). For PSD ``A``,
    ``|t − tr A| <= ε tr A`` with probability ``1 − δ`` when $m = O(\sqrt{\log(1/\delta)} / \varepsilon)$.
    The standard error is the Hutchinson part's sample one (given ``Q``, the first
    term is exact).

    Args:
        A: symmetric operator ``[P, P]``.
        num_matvecs: ``m >= 3``: ``s`` for the sketch, ``s`` for ``A Q``, ``m − 2s``
            for Hutchinson.
        generator: ``torch.Generator`` for ``S`` and ``G``.
        distribution: entries of ``S`` and ``G``: ``"rademacher"`` or ``"normal"``.

    Returns:
        ``Estimate`` with a scalar ``value``.

    Raises:
        CurvatureError: ``A`` not square, ``num_matvecs < 3``, unknown ``distribution``.

    Examples::

        >>> import torch
        >>> from curvlib.operators import hutchpp_trace
        >>> U = torch.randn(50, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        >>> A = U @ U.T  # rank 2 <= 9 // 3: exact
        >>> est = hutchpp_trace(A, 9, generator=torch.Generator().manual_seed(0))
        >>> bool(torch.isclose(est.value, A.trace()))
        True
    """
    size = _checked(A, num_matvecs, 3, generator, distribution)
    sketch_count = num_matvecs // 3
    S = _test_vectors(A, size, sketch_count, generator, distribution)
    G = _test_vectors(A, size, num_matvecs - 2 * sketch_count, generator, distribution)
    Q = torch.linalg.qr(_validate.apply(A, S)).Q
    low_rank_trace = (Q * _validate.apply(A, Q)).sum()
    # gᵀ (I − QQᵀ) A (I − QQᵀ) g = g'ᵀ A g' with g' = (I − QQᵀ) g
    G_deflated = G - Q @ (Q.T @ G)
    samples = (G_deflated * _validate.apply(A, G_deflated)).sum(dim=0)
    rest = _mean_and_error(samples, num_matvecs)
    return Estimate(low_rank_trace + rest.value, rest.standard_error, num_matvecs)


def _leave_one_out(A, size: int, num_matvecs, generator, name: str, distribution: str):
    """XTrace's shared stage: ``W``, ``Y = A W``, ``Q R = Y``, ``A Q`` and the vectors ``sᵢ``.

    ``sᵢ`` is the unit vector with ``Qᵢ Qᵢᵀ = Q (I − sᵢ sᵢᵀ) Qᵀ``, ``Qᵢ`` an orthonormal
    basis of ``range(Y)`` without column ``i``: the normalised ``i``-th column of
    ``R⁻ᵀ``. A (numerically) zero pivot of ``R`` is raised to ``ε max|Rⱼⱼ|``, which keeps
    ``sᵢ`` finite and pointing along ``range(Y)``'s complement, as in exact arithmetic.
    """
    count = num_matvecs // 2
    if count > size:
        raise CurvatureError(
            f"num_matvecs must be at most 2·P = {2 * size} for {name}; got {num_matvecs}. "
            f"With P matvecs the exact value is available from A @ torch.eye(P)."
        )
    W = _test_vectors(A, size, count, generator, distribution)
    Y = _validate.apply(A, W)
    Q, R = torch.linalg.qr(Y)
    pivots = R.diagonal()
    floor = torch.finfo(R.dtype).eps * pivots.abs().max().clamp_min(torch.finfo(R.dtype).tiny)
    safe_pivots = torch.where(pivots.abs() < floor, torch.where(pivots < 0, -floor, floor), pivots)
    R_safe = R.triu(1) + torch.diag(safe_pivots)
    eye = torch.eye(count, dtype=R.dtype, device=R.device)
    S = torch.linalg.solve_triangular(R_safe.T, eye, upper=False)
    S = S / S.norm(dim=0, keepdim=True)
    return W, Y, Q, R, _validate.apply(A, Q), S


def xtrace(A, num_matvecs: int, generator=None, distribution: str = "rademacher") -> Estimate:
    r"""XTrace (Epperly, Tropp, Webber 2024): Hutch++ made exchangeable.

    With ``s = ⌊m/2⌋`` test vectors ``W``, ``Y = A W`` and, for each ``i``,
    $Q_i$ an orthonormal basis of the other ``s − 1`` columns of ``Y``:
    $t_i = \operatorname{tr}(Q_i^\top A Q_i) + w_i^\top (I - Q_i Q_i^\top) A (I - Q_i Q_i^\top) w_i$ is unbiased, and
    $t = \frac{1}{s} \sum_i t_i$. Exact when ``rank A <= s − 1`` and every ``s − 1`` columns of
    ``W`` are independent (for Gaussian ``W`` almost surely, for Rademacher ``W`` but for a
    chance falling like $2^{-P}$). All $t_i$ come from ``2s``
    matvecs (``A W`` and ``A Q``) through $Q_i Q_i^\top = Q (I - s_i s_i^\top) Q^\top$. The error
    estimate is the paper's $\hat\varepsilon = \sqrt{\sum_i (t_i - t)^2 / (s (s - 1))}$.

    Args:
        A: symmetric operator ``[P, P]``.
        num_matvecs: ``m`` with ``2 <= m <= 2P``; ``2⌊m/2⌋`` matvecs are used.
        generator: ``torch.Generator`` for ``W``.
        distribution: entries of ``W``: ``"rademacher"`` (default) or ``"normal"``.

    Returns:
        ``Estimate`` with a scalar ``value``.

    Raises:
        CurvatureError: ``A`` not square, ``num_matvecs`` outside ``[2, 2P]``, unknown
            ``distribution``.

    Examples::

        >>> import torch
        >>> from curvlib.operators import xtrace
        >>> U = torch.randn(50, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        >>> A = U @ U.T  # rank 3 <= 8 // 2 - 1: exact
        >>> est = xtrace(A, 8, generator=torch.Generator().manual_seed(0))
        >>> bool(torch.isclose(est.value, A.trace()))
        True
    """
    size = _checked(A, num_matvecs, 2, generator, distribution)
    W, Y, Q, R, AQ, S = _leave_one_out(A, size, num_matvecs, generator, "xtrace", distribution)
    H = Q.T @ AQ
    # tr(Qᵢᵀ A Qᵢ) = tr H − sᵢᵀ H sᵢ
    projected = H.trace() - (S * (H @ S)).sum(dim=0)
    # uᵢ = (I − QᵢQᵢᵀ) wᵢ = wᵢ − Q dᵢ with dᵢ = (I − sᵢsᵢᵀ) Qᵀ wᵢ; A uᵢ = yᵢ − A Q dᵢ
    QW = Q.T @ W
    D = QW - S * (S * QW).sum(dim=0, keepdim=True)
    U = W - Q @ D
    samples = projected + (U * (Y - AQ @ D)).sum(dim=0)
    return _mean_and_error(samples, 2 * (num_matvecs // 2))


def xdiag(A, num_matvecs: int, generator=None) -> Estimate:
    r"""XDiag (Epperly, Tropp, Webber 2024): the exchangeable diagonal estimator.

    With ``W``, ``Y = A W`` and $Q_i$ as in ``xtrace`` (``s = ⌊m/2⌋``):
    $d_i = \operatorname{diag}(Q_i Q_i^\top A) + w_i \odot (I - Q_i Q_i^\top) A w_i$ is unbiased (Rademacher $w_i$,
    $w_i \odot w_i = 1$) and $d = \frac{1}{s} \sum_i d_i$; exact when ``rank A <= s − 1`` (and every
    ``s − 1`` columns of ``W`` independent, as in ``xtrace``). Uses
    ``A`` symmetric ($Q^\top A = (A Q)^\top$). The per-entry error estimate is
    $\sqrt{\sum_i (d_i - d)^2 / (s (s - 1))}$.

    Args:
        A: symmetric operator ``[P, P]``.
        num_matvecs: ``m`` with ``2 <= m <= 2P``; ``2⌊m/2⌋`` matvecs are used.
        generator: ``torch.Generator`` for ``W``.

    Returns:
        ``Estimate`` with ``value`` and ``standard_error`` of shape ``[P]``.

    Raises:
        CurvatureError: ``A`` not square, ``num_matvecs`` outside ``[2, 2P]``.

    Examples::

        >>> import torch
        >>> from curvlib.operators import xdiag
        >>> U = torch.randn(50, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        >>> A = U @ U.T  # rank 3 <= 8 // 2 - 1: exact
        >>> est = xdiag(A, 8, generator=torch.Generator().manual_seed(0))
        >>> bool(torch.allclose(est.value, A.diagonal()))
        True
    """
    size = _checked(A, num_matvecs, 2, generator)
    W, Y, Q, R, AQ, S = _leave_one_out(A, size, num_matvecs, generator, "xdiag", "rademacher")
    # diag(QᵢQᵢᵀ A) = diag(Q QᵀA) − (Q sᵢ) ⊙ (A Q sᵢ)
    projected = (Q * AQ).sum(dim=1, keepdim=True) - (Q @ S) * (AQ @ S)
    # (I − QᵢQᵢᵀ) A wᵢ = yᵢ − Q (I − sᵢsᵢᵀ) Qᵀ yᵢ, and Qᵀ Y = R
    D = R - S * (S * R).sum(dim=0, keepdim=True)
    samples = projected + W * (Y - Q @ D)
    return _mean_and_error(samples, 2 * (num_matvecs // 2))
