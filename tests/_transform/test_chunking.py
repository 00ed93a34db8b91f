"""``curvature(..., batch_chunk_size=B)``: slices of the batch combine into the whole batch's results.

The unchunked results are themselves checked against brute-force oracles
(``test_second_order_exact.py``, ``test_transform.py``); here every quantity computed
on slices must equal them (float64), for both reductions, all three losses,
outputs with extra axes, and uneven last slices. Monte-Carlo quantities are
checked statistically: with slices they still converge to the exact ones.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import (
    GGNMP,
    KFAC,
    KFLR,
    KFRA,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
    SumGradSquared,
    Variance,
)

from oracles.checks import _assert_same_state, state_snapshot
from oracles.on_device import seeded

DETERMINISTIC = [
    BatchGrad, BatchL2Grad, SumGradSquared, Variance, DiagGGNExact, BatchDiagGGNExact,
    DiagHessian, BatchDiagHessian, KFLR, SqrtGGNExact,
]
LOSSES = {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss, "bce": nn.BCEWithLogitsLoss}


def _model(seq: bool) -> nn.Module:
    torch.manual_seed(0)
    if seq:  # output [N, C, T]: CrossEntropy over C at each of T positions
        return nn.Sequential(nn.Conv1d(2, 4, 3, padding=1), nn.Tanh(), nn.Conv1d(4, 3, 1)).double()
    return nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 3 * 3, 4), nn.Sigmoid(), nn.Linear(4, 3)
    ).double()


def _data(model, loss: str, n: int, seq: bool, seed: int):
    gen = seeded(seed)
    X = torch.randn((n, 2, 5) if seq else (n, 2, 5, 5), generator=gen, dtype=torch.float64)
    with torch.no_grad():
        out = model(X)
    if loss == "ce":
        y = torch.randint(0, out.shape[1], (n,) + tuple(out.shape[2:]), generator=gen)
    elif loss == "bce":
        y = torch.rand(out.shape, generator=gen, dtype=torch.float64)
    else:
        y = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    return X, y


def _assert_same(a, b, where="result"):
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b)):
            _assert_same(u, v, f"{where}[{i}]")
    else:
        assert a.shape == b.shape, (where, a.shape, b.shape)
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=lambda m: f"{where}: {m}")


@settings(max_examples=12, deadline=None)
@given(
    loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    n=st.integers(2, 7),
    chunk=st.integers(1, 6),
    seq=st.booleans(),
)
def test_chunked_equals_whole_batch(loss, reduction, n, chunk, seq):
    model = _model(seq)
    X, y = _data(model, loss, n, seq, seed=n + 10 * chunk)
    lossfn = LOSSES[loss](reduction=reduction)
    exts = [cls() for cls in DETERMINISTIC]
    whole = curvature(model, lossfn, exts)(X, y)
    sliced = curvature(model, lossfn, [cls() for cls in DETERMINISTIC], batch_chunk_size=chunk)(X, y)
    _assert_same(whole, sliced)


def test_composes_with_column_chunks_and_params():
    model = _model(False)
    X, y = _data(model, "ce", 9, False, seed=3)
    params = {k: v.detach() * 1.1 for k, v in model.named_parameters() if k.startswith("3.")}
    exts = [DiagHessian(), BatchDiagGGNExact(), SqrtGGNExact(), Variance()]
    whole = curvature(model, nn.CrossEntropyLoss(), exts)(X, y, params=params)
    sliced = curvature(model, nn.CrossEntropyLoss(), exts, chunk_size=2, batch_chunk_size=4)(X, y, params=params)
    _assert_same(whole, sliced)


def test_kfac_input_factor_exact_and_output_factor_converges():
    """KFAC with slices: ``A`` equals KFLR's exactly; ``B`` converges to KFLR's as M grows."""
    model = _model(False)
    X, y = _data(model, "ce", 6, False, seed=4)
    exact = curvature(model, nn.CrossEntropyLoss(), [KFLR()])(X, y)["kflr"]
    errs = {}
    for m in (1, 100, 10000):
        ext = KFAC(mc_samples=m, generator=seeded(0))
        got = curvature(model, nn.CrossEntropyLoss(), [ext], batch_chunk_size=4)(X, y)["kfac"]
        for name in exact:
            if len(exact[name]) == 2:
                torch.testing.assert_close(got[name][1], exact[name][1])
        num = sum(((got[k][0] - exact[k][0]) ** 2).sum() for k in exact)
        errs[m] = float((num / sum((exact[k][0] ** 2).sum() for k in exact)) ** 0.5)
    assert errs[10000] < 0.1 and errs[10000] < errs[100] / 3 and errs[100] < errs[1], errs


@pytest.mark.parametrize("ext_cls,key", [(DiagGGNMC, "diag_ggn_mc"), (BatchDiagGGNMC, "diag_ggn_mc_batch"),
                                          (SqrtGGNMC, "sqrt_ggn_mc")])
def test_monte_carlo_with_slices_converges(ext_cls, key):
    model = _model(False)
    X, y = _data(model, "ce", 5, False, seed=5)
    exact = curvature(model, nn.CrossEntropyLoss(), [BatchDiagGGNExact()])(X, y)["diag_ggn_exact_batch"]
    errs = {}
    for m in (1, 100, 10000):
        ext = ext_cls(mc_samples=m, generator=seeded(1))
        got = curvature(model, nn.CrossEntropyLoss(), [ext], batch_chunk_size=2)(X, y)[key]
        if key == "sqrt_ggn_mc":
            assert all(g.shape[:2] == (m, 5) for g in got.values())
            got = {k: (g**2).sum(0) for k, g in got.items()}
        elif key == "diag_ggn_mc":
            exact_k = {k: v.sum(0) for k, v in exact.items()}
        ref = exact_k if key == "diag_ggn_mc" else exact
        num = sum(((got[k] - ref[k]) ** 2).sum() for k in ref)
        errs[m] = float((num / sum((ref[k] ** 2).sum() for k in ref)) ** 0.5)
    assert errs[10000] < 0.1 and errs[10000] < errs[100] / 3 and errs[100] < errs[1], errs


def test_model_untouched():
    model = _model(False)
    X, y = _data(model, "ce", 5, False, seed=6)
    before = state_snapshot(model)
    curvature(model, nn.CrossEntropyLoss(), [BatchGrad(), DiagGGNExact()], batch_chunk_size=2)(X, y)
    _assert_same_state(before, state_snapshot(model))


@pytest.mark.parametrize("ext", [KFRA(), GGNMP()])
def test_refused_before_any_work(ext):
    model = _model(False)
    with pytest.raises(CurvatureError, match=f"{type(ext).__name__} cannot be computed with batch_chunk_size"):
        curvature(model, nn.CrossEntropyLoss(), [ext], batch_chunk_size=2)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_bad_batch_chunk_size(bad):
    with pytest.raises(CurvatureError, match="batch_chunk_size must be a positive int"):
        curvature(_model(False), nn.CrossEntropyLoss(), [BatchGrad()], batch_chunk_size=bad)


def test_bad_targets_still_reported():
    model = _model(False)
    X, _ = _data(model, "ce", 5, False, seed=7)
    with pytest.raises(CurvatureError, match="batch size"):
        curvature(model, nn.CrossEntropyLoss(), [BatchGrad()], batch_chunk_size=2)(X, torch.zeros(4, dtype=torch.long))
