"""Weighted residual columns (``curvlib._hessian.weighted``: one column per entry or eigenvector,
the sign as a weight per sample) and their reading per sign (``curvlib._evaluate.hessian_diag``),
against ``torch.func`` Hessians of the nodes and per-column sums (float64); end to end, the
Hessian diagonals of sweep language models against their float64 brute force."""

from __future__ import annotations

import pytest
import torch
from torch.func import hessian

from curvlib._core.site import Residual
from curvlib._evaluate import hessian_diag as hd
from curvlib._hessian.algebra import factor
from curvlib._hessian.weighted import weighted_factor

from oracles.checks import check_close
from oracles.on_device import DEVICE, seeded

N, D = 3, 5


def _node(kind: str):
    """``(residual, f)`` of one node on ``a [N, 2, D]``: ``f`` per sample ``[2, D] -> [2, D]``."""
    torch.manual_seed(0)
    a = torch.randn(N, 2, D, dtype=torch.float64)
    if kind == "diag":
        return Residual("t", "diag", torch.tanh, [a], taps=[0], in_dims=(0,)), torch.tanh
    if kind == "softmax":
        return Residual("s", "softmax", None, [a], taps=[0], in_dims=(0,), meta={"axis": -1}), \
            lambda x: torch.softmax(x, -1)
    w = torch.randn(D, dtype=torch.float64)
    meta = {"eps": 1e-5, "weight": w, "groups": None, "norm_dims": 1}
    return Residual("n", "norm", None, [a], taps=[0], in_dims=(0,), meta=meta), \
        lambda x: torch.nn.functional.layer_norm(x, (D,), w, None, 1e-5)


def _signed_sum(sets) -> torch.Tensor:
    """``Σ_c w_cn c_n c_nᵀ`` per sample ``[N, 2D, 2D]``."""
    total = 0
    for w, taps, _ in sets:
        c = taps[0][0:taps[0].shape[0]].reshape(taps[0].shape[0], N, -1)  # [V, N, 2D]
        w = w if isinstance(w, torch.Tensor) else torch.full(c.shape[:2], w, dtype=c.dtype)
        total = total + torch.einsum("vn,vnd,vne->nde", w, c, c)
    return total


@pytest.mark.parametrize("kind", ["diag", "softmax", "norm"])
def test_weighted_columns_are_the_residual(kind):
    """One weighted set, half the columns of the two signed ones, sums to the node's Hessian."""
    res, f = _node(kind)
    g = torch.randn(N, 2, D, dtype=torch.float64)
    brute = torch.stack([hessian(lambda x: (g[n] * f(x)).sum())(res.inputs[0][n]).reshape(2 * D, 2 * D)
                         for n in range(N)])
    sets = weighted_factor(res, g)
    assert len(sets) == 1 and isinstance(sets[0][0], torch.Tensor)
    w = sets[0][0]
    assert (w.abs() == 1).all() and (w > 0).any() and (w < 0).any()  # signs of both kinds: they matter
    assert sets[0][1][0].shape[0] == sum(t[0].shape[0] for _, t, _ in factor(res, g)) // 2
    check_close(_signed_sum(sets), brute, f"{kind}: Σ w c cᵀ")
    check_close(_signed_sum(factor(res, g)), brute, f"{kind}: signed sets")


def test_flowing_columns_keep_two_sets():
    """Where derivatives flow through the columns, their smooth signed sets (numbers as weights)."""
    res, f = _node("diag")
    g = torch.randn(N, 2, D, dtype=torch.float64, requires_grad=True)
    sets = weighted_factor(res, g)
    assert [w for w, _, _ in sets] == [1.0, -1.0]


@pytest.mark.parametrize("seed", range(4))
def test_halves_read_every_column_with_its_sign(seed):
    """``_halves``: ``Σ_sign sign Σ_rows m²`` per sample is ``Σ_v w_vn m_vn²`` (all of one sign,
    mixed, and a sample with no column of one sign)."""
    g = seeded(seed)
    v = 7
    w = torch.where(torch.rand(v, N, generator=g, device=DEVICE) < 0.5, 1.0, -1.0).double()
    if seed == 1:
        w[:, 0] = 1.0
    if seed == 2:
        w[:] = -1.0
    pulled = [torch.randn(v, N, 2, 3, generator=g, dtype=torch.float64, device=DEVICE),
              torch.randn(v, N, generator=g, dtype=torch.float64, device=DEVICE)]
    want = [torch.einsum("vn,vn...->n...", w, m**2) for m in pulled]
    got = [0, 0]
    for sign, ms in hd._halves(pulled, w, N):
        got = [t + sign * (m**2).sum(0) for t, m in zip(got, ms)]
    for a, b in zip(got, want):
        check_close(a, b, "Σ w m²")


def test_weights_of_one_value_pass_through():
    pulled = [torch.randn(4, N, 2, dtype=torch.float64)]
    (sign, ms), = list(hd._halves(pulled, -1.0, N))
    assert sign == -1.0 and ms[0] is pulled[0]


def test_weights_per_column_split_without_reading_values():
    """Columns of several signed sets in one batch (a number per column): each sign's columns
    by a fixed index, the same sums (no value read: traceable)."""
    torch.manual_seed(1)
    w = (1.0, -1.0, -1.0, 1.0, 1.0)
    pulled = [torch.randn(5, N, 2, dtype=torch.float64)]
    got = sum(sign * (ms[0] ** 2).sum(0) for sign, ms in hd._halves(pulled, w, N))
    want = torch.einsum("v,vnk->nk", torch.tensor(w, dtype=torch.float64), pulled[0] ** 2)
    check_close(got, want, "Σ w m²")
    joined = hd._joined_weights([(1.0, 0, 2), ((1.0, -1.0, -1.0), 1, 3), (-1.0, 0, 1)], N, "cpu")
    assert joined == (1.0, 1.0, -1.0, -1.0, -1.0)
