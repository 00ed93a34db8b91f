"""CG and MINRES against ``torch.linalg.solve`` in float64, and MINRES against scipy's, iterate for iterate."""

import pytest
import scipy.sparse.linalg
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from curvlib._core.errors import CurvatureError, CurvatureTypeError
from curvlib.operators.solvers import cg, minres
from oracles.on_device import seeded
from oracles.spectra import CountingOperator, random_symmetric, with_spectrum


def _right_hand_sides(size: int, columns: int, seed: int) -> torch.Tensor:
    shape = (size,) if columns == 0 else (size, columns)
    return torch.randn(shape, dtype=torch.float64, generator=seeded(seed))


def _check_solution(A, damping, b, solution, tol, condition):
    """x solves the system to ``κ·tol``; the reported residual is the true one."""
    damped = A + damping * torch.eye(A.shape[0], dtype=torch.float64)
    exact = torch.linalg.solve(damped, b)
    scale = exact.norm(dim=0)
    assert ((solution.x - exact).norm(dim=0) <= 10 * condition * tol * scale).all()
    residual = (b - damped @ solution.x).norm(dim=0)
    assert torch.allclose(solution.residual_norm, residual, rtol=1e-6, atol=1e-15)
    assert solution.converged.all() and (solution.residual_norm <= tol * b.norm(dim=0)).all()
    assert solution.x.shape == b.shape and solution.iterations.shape == b.shape[1:]


@settings(max_examples=40)
@given(
    size=st.integers(1, 60),
    columns=st.integers(0, 3),
    damping=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_cg_solves_positive_definite_systems_within_p_iterations(size, columns, damping, seed):
    # κ <= 10: few enough iterations that rounding does not delay the exact-arithmetic P
    A = with_spectrum(torch.logspace(0, 1, size, dtype=torch.float64), seed)
    b = _right_hand_sides(size, columns, seed + 1)
    solution = cg(A, b, damping=damping, tol=1e-10)
    _check_solution(A, damping, b, solution, 1e-10, condition=10)
    assert (solution.iterations <= size).all()


def test_cg_ends_after_as_many_iterations_as_distinct_eigenvalues():
    A = with_spectrum(torch.tensor([1.0, 3.0, 7.0]).repeat_interleave(20), seed=1)
    solution = cg(A, _right_hand_sides(60, 2, 2), tol=1e-10)
    assert (solution.iterations <= 3).all() and solution.converged.all()


def test_preconditioning_reduces_iterations():
    """A badly scaled PSD matrix: Jacobi (diagonal) preconditioning undoes the scaling."""
    scales = torch.logspace(-2, 2, 50, dtype=torch.float64)
    core = with_spectrum(torch.linspace(1.0, 3.0, 50), seed=3)
    A = scales[:, None] * core * scales[None]
    b = _right_hand_sides(50, 2, 4)
    plain = cg(A, b, tol=1e-10)
    jacobi = torch.diag(1 / A.diagonal())
    preconditioned = cg(A, b, tol=1e-10, preconditioner=CountingOperator(jacobi))
    _check_solution(A, 0.0, b, preconditioned, 1e-10, condition=1e8)
    assert (preconditioned.iterations * 5 < plain.iterations).all()


def test_cg_refuses_an_indefinite_system():
    A = with_spectrum(torch.linspace(-1.0, 1.0, 20), seed=5)
    with pytest.raises(CurvatureError, match="minres"):
        cg(A, _right_hand_sides(20, 0, 6))
    assert cg(A, _right_hand_sides(20, 0, 6), damping=1.5).converged  # damping makes it definite


@settings(max_examples=40)
@given(
    size=st.integers(1, 60),
    columns=st.integers(0, 3),
    damping=st.sampled_from([0.0, -0.25]),
    seed=st.integers(0, 2**16),
)
def test_minres_solves_indefinite_systems(size, columns, damping, seed):
    magnitudes = torch.logspace(0, 0.5, size, dtype=torch.float64)
    signs = torch.where(torch.arange(size) % 2 == 0, 1.0, -1.0).to(torch.float64)
    A = with_spectrum(signs * magnitudes, seed)  # |λ| in [1, √10], both signs
    A = A - damping * torch.eye(size, dtype=torch.float64)  # (A − δ) + δ I: same system, any δ
    b = _right_hand_sides(size, columns, seed + 1)
    solution = minres(A, b, damping=damping, tol=1e-10)
    _check_solution(A, damping, b, solution, 1e-10, condition=10)
    assert (solution.iterations <= size).all()


@pytest.mark.parametrize("iterations", [1, 3, 10, 25])
def test_minres_iterates_are_scipys(iterations):
    A = random_symmetric(40, seed=7)
    b = _right_hand_sides(40, 0, 8)
    ours = minres(A, b, damping=0.3, tol=1e-14, max_iterations=iterations)
    theirs, _ = scipy.sparse.linalg.minres(
        A.cpu().numpy(), b.cpu().numpy(), shift=-0.3, rtol=1e-14, maxiter=iterations
    )
    theirs = torch.as_tensor(theirs, device=b.device)
    assert torch.allclose(ours.x, theirs, rtol=1e-8, atol=1e-10 * float(theirs.norm()))
    assert int(ours.iterations) == iterations and not ours.converged


def test_iteration_cap_and_zero_right_hand_side():
    A = with_spectrum(torch.logspace(0, 3, 40), seed=9)
    b = _right_hand_sides(40, 2, 10)
    b[:, 1] = 0
    for solve in (cg, minres):
        capped = solve(A, b, max_iterations=4)
        assert capped.iterations.tolist() == [4, 0]
        assert capped.converged.tolist() == [False, True] and capped.residual_norm[0] > 0
        assert torch.equal(capped.x[:, 1], torch.zeros(40, dtype=torch.float64))


def test_a_block_is_multiplied_as_one_product():
    A = with_spectrum(torch.linspace(1.0, 2.0, 30), seed=11)
    b = _right_hand_sides(30, 4, 12)
    for solve in (cg, minres):
        operator = CountingOperator(A)
        solution = solve(operator, b)
        assert operator.calls == int(solution.iterations.max()) + 1  # + the residual check
        assert torch.allclose(solution.x, solve(A, b).x)


@pytest.mark.parametrize("solve", [cg, minres])
@pytest.mark.parametrize(
    "make_b, kwargs, error, match",
    [
        (lambda A: torch.ones(5, dtype=torch.float64), {}, CurvatureError, r"b must have shape \[P\] or \[P, K\]"),
        (lambda A: torch.ones(6, 2, 1, dtype=torch.float64), {}, CurvatureError, "b must have shape"),
        (lambda A: torch.ones(6, dtype=torch.float32), {}, CurvatureTypeError, "b must have A's dtype"),
        (lambda A: [1.0] * 6, {}, CurvatureTypeError, "b must be a torch.Tensor"),
        (lambda A: torch.ones(6, dtype=torch.float64), {"tol": 0.0}, CurvatureError, "tol must be"),
        (lambda A: torch.ones(6, dtype=torch.float64), {"max_iterations": 0}, CurvatureError, "max_iterations"),
        (lambda A: torch.ones(6, dtype=torch.float64), {"damping": float("nan")}, CurvatureError, "damping"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(solve, make_b, kwargs, error, match):
    A = random_symmetric(6, seed=0)
    with pytest.raises(error, match=match):
        solve(A, make_b(A), **kwargs)


def test_a_preconditioner_without_matmul_is_refused():
    A = with_spectrum(torch.linspace(1.0, 2.0, 6), seed=0)
    with pytest.raises(CurvatureTypeError, match="preconditioner must support"):
        cg(A, torch.ones(6, dtype=torch.float64), preconditioner=2.0)
