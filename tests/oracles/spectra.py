"""Dense float64 symmetric matrices with known spectra, and an operator that counts its products.

The oracles for :mod:`curvlib.operators`' algorithms: ``Q diag(λ) Qᵀ`` with a random
orthogonal ``Q`` has exactly the eigenvalues ``λ``; ``torch.linalg`` gives the rest.
"""

from __future__ import annotations

import torch

from oracles.on_device import seeded


def with_spectrum(values, seed: int) -> torch.Tensor:
    """``Q diag(values) Qᵀ`` in float64, ``Q`` Haar-random from ``seed``."""
    values = torch.as_tensor(values, dtype=torch.float64)
    size = values.shape[0]
    gaussian = torch.randn(size, size, dtype=torch.float64, generator=seeded(seed))
    Q, R = torch.linalg.qr(gaussian)
    Q = Q * R.diagonal().sign()  # Haar measure
    return (Q * values.to(Q.device)) @ Q.T


def low_rank(size: int, rank: int, seed: int, indefinite: bool = False) -> torch.Tensor:
    """A symmetric ``[size, size]`` matrix of rank ``rank`` (PSD unless ``indefinite``)."""
    values = torch.zeros(size, dtype=torch.float64)
    values[:rank] = 1.0 + torch.arange(rank, dtype=torch.float64)
    if indefinite:
        values[: rank // 2] *= -1
    return with_spectrum(values, seed)


def decaying(size: int, rate: float, seed: int) -> torch.Tensor:
    """PSD with eigenvalues ``rateⁱ``, ``i = 0 … size−1``: a fast-decaying spectrum."""
    return with_spectrum(rate ** torch.arange(size, dtype=torch.float64), seed)


def random_symmetric(size: int, seed: int) -> torch.Tensor:
    """``(G + Gᵀ)/2`` for a standard normal ``G``: indefinite, no structure."""
    gaussian = torch.randn(size, size, dtype=torch.float64, generator=seeded(seed))
    return (gaussian + gaussian.T) / 2


class CountingOperator:
    """A linear operator (``shape``, ``dtype``, ``device``, ``@``) that counts the columns it multiplies."""

    def __init__(self, matrix: torch.Tensor):
        self.matrix = matrix
        self.shape = tuple(matrix.shape)
        self.dtype = matrix.dtype
        self.device = matrix.device
        self.columns = 0
        self.calls = 0

    def __matmul__(self, X: torch.Tensor) -> torch.Tensor:
        self.columns += 1 if X.dim() == 1 else X.shape[1]
        self.calls += 1
        return self.matrix @ X
