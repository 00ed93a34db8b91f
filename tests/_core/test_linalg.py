"""``curvlib._core.linalg.eigh``: LAPACK's symmetric solver fails to converge on some float32
matrices whose entries are all tiny (a residual of DeepSeek-V4's tiny model, largest entry
1e-14, kept in ``data/``); scaled to unit largest entry it converges. The decomposition then
reconstructs the matrix, and its eigenvalues equal float64's, for such matrices and at every
scale (hypothesis)."""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import given, settings, strategies as st

from curvlib._core import linalg

from oracles.on_device import DEVICE, seeded


def _stored() -> torch.Tensor:
    d = torch.load(Path(__file__).parent / "data" / "eigh_no_convergence.pt", map_location=DEVICE)
    A = torch.zeros(d["shape"], dtype=d["values"].dtype)
    A[d["indices"][:, 0].long(), d["indices"][:, 1].long()] = d["values"]
    return A


def _check(A: torch.Tensor, rtol: float) -> None:
    evals, evecs = linalg.eigh(A)
    assert evals.dtype == A.dtype and evecs.dtype == A.dtype
    ref = torch.linalg.eigvalsh(A.double())
    scale = A.double().abs().amax((-2, -1), keepdim=True).squeeze(-1)
    assert ((evals.double() - ref).abs() <= rtol * scale).all()
    rebuilt = (evecs.double() * evals.double().unsqueeze(-2)) @ evecs.double().transpose(-1, -2)
    assert ((rebuilt - A.double()).abs() <= rtol * scale.unsqueeze(-1)).all()


def test_a_matrix_lapack_does_not_converge_on():
    A = _stored()
    try:  # (whether torch's LAPACK still fails on it: the reason for the fallback)
        torch.linalg.eigh(A)
    except torch.linalg.LinAlgError:
        pass
    _check(A, 1e-4)
    _check(torch.stack([A, A.T.contiguous() * 3, torch.eye(100)]), 1e-4)  # (a batch: one scale per matrix)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 12), exponent=st.integers(-30, 10), dtype=st.sampled_from([torch.float32, torch.float64]),
       seed=st.integers(0, 1000))
def test_eigh_at_every_scale(n, exponent, dtype, seed):
    g = seeded(seed)
    M = torch.randn(2, n, n, generator=g, dtype=torch.float64)
    A = ((M + M.transpose(1, 2)) * 10.0**exponent).to(dtype)
    _check(A, 1e-4 if dtype == torch.float32 else 1e-10)
