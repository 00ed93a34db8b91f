"""Lanczos eigenpairs and stochastic Lanczos quadrature against ``torch.linalg.eigh`` on known spectra."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from curvlib._core.errors import CurvatureError, CurvatureTypeError
from curvlib.operators.eigen import lanczos, spectral_density
from curvlib.operators.estimators import hutchinson_trace
from oracles.on_device import seeded
from oracles.spectra import CountingOperator, low_rank, random_symmetric, with_spectrum


def _gapped_spectrum(size: int, seed: int) -> torch.Tensor:
    """A bulk in [−1, 1] and three separated eigenvalues at each end (gaps >= 0.2)."""
    bulk = 2 * torch.rand(size - 6, dtype=torch.float64, generator=seeded(seed)) - 1
    ends = torch.tensor([-2.6, -2.0, -1.4, 1.5, 2.2, 3.0], dtype=torch.float64)
    return torch.cat([bulk, ends])


def _expected(eigenvalues: torch.Tensor, k: int, which: str) -> torch.Tensor:
    ascending = eigenvalues.sort().values
    if which == "largest":
        return ascending.flip(0)[:k]
    if which == "smallest":
        return ascending[:k]
    if which == "largest_magnitude":
        return ascending[ascending.abs().argsort(descending=True)][:k]
    return torch.cat([ascending[: k // 2], ascending[len(ascending) - (k - k // 2):]])


@settings(max_examples=40)
@given(
    size=st.integers(10, 120),
    k=st.integers(1, 3),
    which=st.sampled_from(["largest", "smallest", "largest_magnitude", "both_ends"]),
    block_size=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_lanczos_matches_eigvalsh_at_the_ends(size, k, which, block_size, seed):
    spectrum = _gapped_spectrum(size, seed)
    A = with_spectrum(spectrum, seed)
    pairs = lanczos(A, k=k, which=which, block_size=block_size, generator=seeded(seed))
    assert pairs.converged
    truth = _expected(torch.linalg.eigvalsh(A), k, which)
    assert torch.allclose(pairs.values, truth, atol=1e-10, rtol=0)
    eye = torch.eye(k, dtype=torch.float64)
    assert torch.allclose(pairs.vectors.T @ pairs.vectors, eye, atol=1e-10)
    residuals = (A @ pairs.vectors - pairs.vectors * pairs.values).norm(dim=0)
    assert torch.allclose(pairs.residuals, residuals, atol=1e-14)
    assert (pairs.residuals <= 1.5e-8 * 3.0).all()


@settings(max_examples=30)
@given(size=st.integers(20, 60), num_iterations=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_the_residual_bounds_hold_before_convergence(size, num_iterations, seed):
    """Some eigenvalue lies within the residual of each Ritz value, converged or not."""
    A = random_symmetric(size, seed)
    pairs = lanczos(A, k=1, num_iterations=num_iterations, generator=seeded(seed))
    eigenvalues = torch.linalg.eigvalsh(A)
    distance = (eigenvalues[:, None] - pairs.values[None]).abs().min(dim=0).values
    assert (distance <= pairs.residuals * (1 + 1e-12) + 1e-13).all()
    assert pairs.num_matvecs == num_iterations + 1


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_small_operators_are_solved_exactly(size):
    A = random_symmetric(size, seed=size)
    pairs = lanczos(A, k=size, which="smallest", generator=seeded(0))
    assert torch.allclose(pairs.values, torch.linalg.eigvalsh(A), atol=1e-12)
    assert pairs.converged and pairs.num_matvecs <= 2 * size


def test_an_invariant_subspace_is_continued():
    """Rank 3 PSD: the Krylov space is invariant after 4 steps; the zero eigenvalues still come out."""
    A = low_rank(50, 3, seed=1)
    pairs = lanczos(A, k=5, generator=seeded(2))
    assert torch.allclose(pairs.values, torch.tensor([3.0, 2.0, 1.0, 0.0, 0.0], dtype=torch.float64), atol=1e-10)
    assert pairs.converged
    identity = lanczos(torch.eye(20, dtype=torch.float64), k=3, generator=seeded(3))
    assert torch.allclose(identity.values, torch.ones(3, dtype=torch.float64)) and identity.num_matvecs == 6
    zero = lanczos(torch.zeros(6, 6, dtype=torch.float64), k=3, generator=seeded(4))  # exact breakdown
    assert torch.equal(zero.values, torch.zeros(3, dtype=torch.float64)) and zero.converged
    assert torch.allclose(zero.vectors.T @ zero.vectors, torch.eye(3, dtype=torch.float64))


def test_a_block_finds_a_repeated_eigenvalue():
    spectrum = torch.cat([torch.linspace(-1.0, 1.0, 40, dtype=torch.float64), torch.tensor([4.0, 4.0])])
    A = with_spectrum(spectrum, seed=4)
    pairs = lanczos(A, k=2, block_size=2, generator=seeded(5))
    assert torch.allclose(pairs.values, torch.tensor([4.0, 4.0], dtype=torch.float64), atol=1e-10)


def test_lanczos_on_any_operator_counts_blocks_and_is_reproducible():
    A = with_spectrum(_gapped_spectrum(40, 0), seed=0)
    operator = CountingOperator(A)
    first = lanczos(operator, k=2, block_size=2, generator=seeded(7))
    assert operator.columns == first.num_matvecs and operator.calls == first.num_matvecs // 2
    again = lanczos(A, k=2, block_size=2, generator=seeded(7))
    assert torch.equal(first.values, again.values)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda A: lanczos(A[:3]), CurvatureError, "A must be square"),
        (lambda A: lanczos(A, k=7), CurvatureError, "k must be at most P = 6"),
        (lambda A: lanczos(A, k=0), CurvatureError, "k must be at least 1"),
        (lambda A: lanczos(A, which="top"), CurvatureError, "which must be one of"),
        (lambda A: lanczos(A, k=4, num_iterations=1, block_size=2), CurvatureError, "num_iterations · block_size"),
        (lambda A: lanczos(A, block_size=9), CurvatureError, "block_size must be at most"),
        (lambda A: lanczos(A, tol=0.0), CurvatureError, "tol must be a finite number > 0"),
        (lambda A: lanczos([[1.0]]), CurvatureTypeError, "A must be a linear operator"),
        (lambda A: spectral_density(A, num_probes=0), CurvatureError, "num_probes must be at least 1"),
        (lambda A: spectral_density(A, num_steps=2.5), CurvatureTypeError, "num_steps must be an int"),
        (lambda A: spectral_density(A).density(torch.zeros(3), sigma=-1.0), CurvatureError, "sigma"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call(random_symmetric(6, seed=0))


def _broadened(grid: torch.Tensor, points: torch.Tensor, sigma: float) -> torch.Tensor:
    """``(1/P) Σᵢ N(grid; λᵢ, σ²)``, the exact broadened eigenvalue histogram."""
    kernels = torch.exp(-0.5 * ((grid[:, None] - points[None]) / sigma) ** 2)
    return (kernels / (sigma * math.sqrt(2 * math.pi))).mean(dim=1)


@pytest.mark.parametrize("seed", range(3))
def test_density_matches_the_broadened_histogram(seed):
    g = seeded(seed)
    spectrum = torch.cat([0.3 * torch.randn(150, dtype=torch.float64, generator=g),
                          3 + torch.rand(50, dtype=torch.float64, generator=g), torch.tensor([8.0])])
    A = with_spectrum(spectrum, seed)
    density = spectral_density(A, num_probes=20, num_steps=60, generator=seeded(seed))
    grid = torch.linspace(-4.0, 10.0, 2801, dtype=torch.float64)
    spacing = grid[1] - grid[0]
    estimate = density.density(grid, sigma=0.1)
    assert abs(float(estimate.sum() * spacing) - 1) < 1e-9  # integrates to 1
    assert float((estimate - _broadened(grid, spectrum, 0.1)).abs().sum() * spacing) < 0.15
    assert torch.allclose(density.weights.sum(dim=1), torch.ones(20, dtype=torch.float64))


@pytest.mark.parametrize("distribution", ["rademacher", "normal"])
def test_slq_trace_is_hutchinson_with_the_same_probes(distribution):
    A = random_symmetric(40, seed=9)
    density = spectral_density(A, num_probes=7, num_steps=10, generator=seeded(1), distribution=distribution)
    hutchinson = hutchinson_trace(A, 7, generator=seeded(1), distribution=distribution)
    assert torch.allclose(density.trace().value, hutchinson.value, atol=1e-10)
    assert torch.allclose(density.trace().standard_error, hutchinson.standard_error, atol=1e-10)


def test_slq_trace_is_unbiased_with_its_standard_error():
    A = with_spectrum(torch.linspace(-1.0, 4.0, 30), seed=10)
    estimates = [spectral_density(A, num_probes=4, num_steps=5, generator=seeded(s)).trace() for s in range(200)]
    values = torch.stack([e.value for e in estimates])
    assert abs(float((values.mean() - A.trace()) / (values.std() / 200**0.5))) < 5
    errors = torch.stack([e.standard_error for e in estimates])
    assert 0.7 < float((errors**2).mean() / values.var()) < 1.4


def test_quadrature_is_exact_for_low_degree_polynomials():
    """With s steps, Σ ωⱼ θⱼ^d = qᵀ A^d q for d < 2s: tr_of(t³) is Hutchinson on A³."""
    A = random_symmetric(30, seed=11)
    density = spectral_density(A, num_probes=5, num_steps=3, generator=seeded(2))
    cubed = hutchinson_trace(torch.linalg.matrix_power(A, 5), 5, generator=seeded(2))
    assert torch.allclose(density.trace_of(lambda t: t**5).value, cubed.value, rtol=1e-10)


def test_full_krylov_space_gives_exact_quadrature_for_any_function():
    A = with_spectrum(torch.linspace(0.5, 2.0, 8), seed=12)
    density = spectral_density(A, num_probes=3, num_steps=50, generator=seeded(3))
    assert density.nodes.shape == (3, 8)  # capped at P
    log_det = hutchinson_trace(torch.linalg.matrix_exp(A), 3, generator=seeded(3))
    assert torch.allclose(density.trace_of(torch.exp).value, log_det.value, rtol=1e-10)
    low = spectral_density(low_rank(30, 2, seed=1), num_probes=2, num_steps=10, generator=seeded(4))
    assert torch.isfinite(low.nodes).all() and torch.allclose(low.weights.sum(dim=1), torch.ones(2, dtype=torch.float64))
