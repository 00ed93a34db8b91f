"""Trace and diagonal estimators against dense float64 oracles: exactness, bias, variance, error estimates.

Statistical tests use fixed seeds (``seeded(seed)`` for seed in a range), so they are
deterministic; each compares a sample mean with the truth within a few standard errors
(|z| < 5 for a single check, so a correct estimator fails with probability < 1e-6).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from curvlib._core.errors import CurvatureError, CurvatureTypeError
from curvlib.operators.estimators import hutchinson_diagonal, hutchinson_trace, hutchpp_trace, xdiag, xtrace
from oracles.on_device import seeded
from oracles.spectra import CountingOperator, decaying, low_rank, random_symmetric, with_spectrum

SEEDS = range(400)


def _runs(estimator, A, num_matvecs, **kwargs):
    """Values and standard errors over ``SEEDS``, stacked."""
    results = [estimator(A, num_matvecs, generator=seeded(seed), **kwargs) for seed in SEEDS]
    return torch.stack([r.value for r in results]), torch.stack([r.standard_error for r in results])


@pytest.mark.parametrize("distribution", ["rademacher", "normal"])
def test_hutchinson_trace_unbiased_with_the_variance_formula(distribution):
    A, m = random_symmetric(30, seed=1), 10
    values, errors = _runs(hutchinson_trace, A, m, distribution=distribution)
    frobenius = (A**2).sum()
    variance = 2 * (frobenius - (A.diagonal() ** 2).sum()) / m if distribution == "rademacher" else 2 * frobenius / m
    z = (values.mean() - A.trace()) / (variance / len(SEEDS)).sqrt()
    assert abs(z) < 5
    # sample variance over 400 seeds: relative spread about √(2/400) ≈ 7% (more for heavy tails)
    assert 0.75 < float(values.var() / variance) < 1.3
    # the reported standard error² is unbiased for the estimator's variance
    assert 0.8 < float((errors**2).mean() / variance) < 1.25


def test_hutchinson_diagonal_unbiased_with_per_entry_variance():
    A, m = random_symmetric(20, seed=2), 8
    values, errors = _runs(hutchinson_diagonal, A, m)
    variance = ((A**2).sum(dim=1) - A.diagonal() ** 2) / m  # Rademacher: Σ_{k≠j} A_jk² / m
    z = (values.mean(dim=0) - A.diagonal()) / (variance / len(SEEDS)).sqrt()
    assert z.abs().max() < 5
    assert 0.7 < float((values.var(dim=0) / variance).mean()) < 1.3
    assert 0.8 < float(((errors**2).mean(dim=0) / variance).mean()) < 1.25


def test_rademacher_hutchinson_is_exact_on_a_diagonal_matrix():
    A = torch.diag(torch.arange(1.0, 9.0, dtype=torch.float64))
    assert torch.allclose(hutchinson_trace(A, 3, generator=seeded(0)).value, A.trace())
    assert torch.allclose(hutchinson_diagonal(A, 1, generator=seeded(0)).value, A.diagonal())


@settings(max_examples=30)
@given(
    size=st.integers(8, 40),
    num_matvecs=st.integers(6, 24),
    indefinite=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_low_rank_matrices_are_estimated_exactly(size, num_matvecs, indefinite, seed):
    """Hutch++ is exact for rank <= ⌊m/3⌋, XTrace and XDiag for rank <= ⌊m/2⌋ − 1."""
    num_matvecs = min(num_matvecs, 2 * size)
    for estimator, rank in [(hutchpp_trace, num_matvecs // 3), (xtrace, num_matvecs // 2 - 1)]:
        A = low_rank(size, rank, seed, indefinite)
        estimate = estimator(A, num_matvecs, generator=seeded(seed + 1))
        assert torch.allclose(estimate.value, A.trace(), atol=1e-9 * A.abs().sum(), rtol=0)
    A = low_rank(size, num_matvecs // 2 - 1, seed, indefinite)
    estimate = xdiag(A, num_matvecs, generator=seeded(seed + 1))
    assert torch.allclose(estimate.value, A.diagonal(), atol=1e-9 * A.abs().max() * size, rtol=0)


@pytest.mark.parametrize("estimator", [hutchpp_trace, xtrace])
def test_variance_reduced_trace_estimators_are_unbiased(estimator):
    A, m = with_spectrum(torch.linspace(-1.0, 3.0, 30), seed=3), 12
    values, errors = _runs(estimator, A, m)
    z = (values.mean() - A.trace()) / (values.std() / len(SEEDS) ** 0.5)
    assert abs(z) < 5
    # the reported error estimate has the size of the actual spread
    assert 0.3 < float(errors.mean() / values.std()) < 3


def test_xdiag_is_unbiased():
    A, m = random_symmetric(20, seed=4), 12
    values, errors = _runs(xdiag, A, m)
    z = (values.mean(dim=0) - A.diagonal()) / (values.std(dim=0) / len(SEEDS) ** 0.5)
    assert z.abs().max() < 5
    assert 0.3 < float((errors.mean(dim=0) / values.std(dim=0)).median()) < 3


def test_variance_reduction_beats_hutchinson_on_a_decaying_spectrum():
    """At equal matvecs on λᵢ = 0.6ⁱ, Hutch++/XTrace/XDiag have a mean squared error over 100 times smaller."""
    A, m = decaying(60, 0.6, seed=5), 24
    seeds = range(60)

    def mse(estimator, truth):
        return torch.stack([((estimator(A, m, generator=seeded(s)).value - truth) ** 2).mean() for s in seeds]).mean()

    hutchinson = mse(hutchinson_trace, A.trace())
    assert mse(hutchpp_trace, A.trace()) < 0.01 * hutchinson
    assert mse(xtrace, A.trace()) < 0.01 * hutchinson
    assert mse(xdiag, A.diagonal()) < 0.01 * mse(hutchinson_diagonal, A.diagonal())


@pytest.mark.parametrize(
    "estimator, num_matvecs, used",
    [(hutchinson_trace, 7, 7), (hutchinson_diagonal, 5, 5), (hutchpp_trace, 10, 10), (xtrace, 9, 8), (xdiag, 6, 6)],
)
def test_any_operator_and_the_matvec_count(estimator, num_matvecs, used):
    A = random_symmetric(15, seed=6)
    operator = CountingOperator(A)
    estimate = estimator(operator, num_matvecs, generator=seeded(7))
    assert estimate.num_matvecs == used == operator.columns
    assert operator.calls <= 3  # blocks, not one column at a time
    assert torch.allclose(estimate.value, estimator(A, num_matvecs, generator=seeded(7)).value)


def test_a_single_sample_has_no_standard_error():
    A = random_symmetric(10, seed=8)
    assert hutchinson_trace(A, 1, generator=seeded(0)).standard_error is None
    assert xtrace(A, 2, generator=seeded(0)).standard_error is None


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda A: hutchinson_trace(A[:, :3], 4), CurvatureError, "A must be square"),
        (lambda A: hutchinson_trace("A", 4), CurvatureTypeError, "A must be a linear operator"),
        (lambda A: hutchinson_trace(A.int(), 4), CurvatureTypeError, "A.dtype"),
        (lambda A: hutchinson_trace(A, 0), CurvatureError, "num_matvecs must be at least 1"),
        (lambda A: hutchinson_trace(A, 2.0), CurvatureTypeError, "num_matvecs must be an int"),
        (lambda A: hutchinson_trace(A, 4, distribution="uniform"), CurvatureError, "distribution"),
        (lambda A: hutchinson_diagonal(A, 4, generator=0), CurvatureTypeError, "generator"),
        (lambda A: hutchpp_trace(A, 2), CurvatureError, "num_matvecs must be at least 3"),
        (lambda A: xtrace(A, 1), CurvatureError, "num_matvecs must be at least 2"),
        (lambda A: xtrace(A, 14), CurvatureError, r"at most 2·P = 12"),
        (lambda A: xdiag(A, 14), CurvatureError, r"at most 2·P = 12"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call(random_symmetric(6, seed=0))


def test_an_operator_returning_the_wrong_shape_is_refused():
    class Wrong(CountingOperator):
        def __matmul__(self, X):
            return super().__matmul__(X)[:-1]

    with pytest.raises(CurvatureError, match=r"A @ X must return X's shape"):
        hutchinson_trace(Wrong(random_symmetric(6, seed=0)), 3)
