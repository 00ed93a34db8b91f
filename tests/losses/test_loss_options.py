"""Loss options against brute-force float64 oracles, on small models.

``nn.CrossEntropyLoss`` with ``weight``, ``ignore_index`` (a real class, or the
default -100 present in ``y``), ``label_smoothing``, class-index and
class-probability targets; ``nn.BCEWithLogitsLoss`` with ``weight`` (every
broadcastable shape) and ``pos_weight``; ``reduction`` ``"mean"``/``"sum"``;
outputs ``[N, C]`` (MLP) and ``[N, C, D]`` (Conv1d).

The oracles know nothing of the options: first order by per-sample parameter
copies (``oracles.first_order.first_order_reference``), second order from
``torch.func.hessian`` of ``o ↦ lossfn(o, y)`` (``oracles.second_order``), so PyTorch's
own loss defines every scaling (``"mean"`` normaliser, ignored samples, ...).
Monte-Carlo extensions are checked to converge to the exact quantities;
``batch_chunk_size`` to reproduce the unchunked results, also with a slice
whose targets are all ignored. (Root-level unit tests: ``test_loss_option_roots.py``.)
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import (
    KFLR, BatchDiagGGNExact, BatchDiagHessian, BatchGrad, BatchL2Grad, DiagGGNExact, DiagHessian, KFACEmpirical,
    SqrtGGNExact, SqrtGGNMC, SumGradSquared, Variance,
)

from oracles.loss_checks import (
    F64, assert_converges, bce_problems, bce_weight, ce_problems, ce_targets, check_exact, close, mc_errors, model_and_input,
)
from oracles.on_device import seeded


# ----------------------------------------------------------------------------- problems


# ----------------------------------------------------------------------------- the check


@given(problem=ce_problems())
def test_cross_entropy_options(problem):
    check_exact(*problem)


@given(problem=bce_problems())
def test_bce_with_logits_options(problem):
    check_exact(*problem)


def test_ignored_samples_contribute_nothing():
    """A sample whose target is ``ignore_index`` has zero individual gradient and GGN terms."""
    model, X = model_and_input(False, 3, 4, 3, 5, 1, 1, "tanh", seeded(0))
    y = torch.tensor([0, 2, 1, 2, 0])
    lossfn = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 0.5, 2.0], dtype=F64), ignore_index=2, label_smoothing=0.2)
    qs = check_exact(model, lossfn, X, y)
    for key in ("grad_batch", "diag_ggn_exact_batch", "diag_h_batch"):
        for name, t in qs[key].items():
            assert t[[1, 3]].abs().max() == 0 and t[[0, 2, 4]].abs().max() > 0, (key, name)


def test_negative_class_weight_is_exact_and_refuses_the_square_root():
    """A negative class weight makes the loss concave for those targets: the GGN-linear
    quantities are exact (signed parts), its square root is refused naming the eigenvalue."""
    model, X = model_and_input(False, 3, 4, 3, 4, 1, 1, "tanh", seeded(1))
    y = torch.tensor([0, 1, 2, 1])
    lossfn = nn.CrossEntropyLoss(weight=torch.tensor([1.0, -0.5, 2.0], dtype=F64), reduction="sum")
    check_exact(model, lossfn, X, y, sqrt=False)
    for ext in (SqrtGGNExact(), SqrtGGNMC(mc_samples=2)):
        with pytest.raises(CurvatureError, match=r"indefinite \(eigenvalue -[0-9.e-]+ for sample 1\)"):
            curvature(model, lossfn, [ext])(X, y)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8, torch.uint8])
def test_small_integer_targets(dtype):
    model, X = model_and_input(True, 2, 3, 3, 3, 2, 1, "tanh", seeded(2))
    y = torch.tensor([[0, 2], [1, 1], [2, 0]])
    lossfn = nn.CrossEntropyLoss(ignore_index=1, weight=torch.tensor([1.0, 0.5, 2.0], dtype=F64))
    exts = lambda: [BatchGrad(), DiagGGNExact(), KFLR()]  # noqa: E731
    want = curvature(model, lossfn, exts())(X, y)
    got = curvature(model, lossfn, exts())(X, y.to(dtype))
    for key in ("grad_batch", "diag_ggn_exact"):
        for name, t in want[key].items():
            close(got[key][name], t, f"{key}[{name}] with {dtype}", tol=0)


def test_real_ignore_index_with_probabilities_refused_before_work():
    model, X = model_and_input(False, 2, 3, 3, 2, 1, 1, "tanh", seeded(3))
    y = torch.softmax(torch.randn(2, 3, dtype=F64), 1)
    with pytest.raises(CurvatureError, match=r"ignore_index=1\) with class probabilities"):
        curvature(model, nn.CrossEntropyLoss(ignore_index=1), [BatchGrad()])(X, y)


# ----------------------------------------------------------------------------- Monte Carlo

W3 = torch.tensor([1.5, 0.4, 0.9], dtype=F64)


def fixed_problem(case: str, n: int = 4):
    """``(model, lossfn, X, y)``: CE with every option on ``[N, C]``, CE with probabilities on
    ``[N, C, D]``, BCE with ``weight`` and ``pos_weight``; targets of samples 1 and 2 ignored (CE)."""
    gen = seeded(5)
    model, X = model_and_input(case == "ce prob", 3, 4, 3, n, 2, 2, "tanh", gen)
    with torch.no_grad():
        out = model(X)
    if case == "ce index":
        y = torch.randint(0, 3, (n,), generator=gen)
        y[y == 1] = 0
        y[1:3] = 1
        return model, nn.CrossEntropyLoss(weight=W3, ignore_index=1, label_smoothing=0.2), X, y
    if case == "ce prob":
        y = ce_targets(out, "prob", "none", 0, gen)
        return model, nn.CrossEntropyLoss(weight=W3, label_smoothing=0.2), X, y
    lossfn = nn.BCEWithLogitsLoss(weight=bce_weight("class", out.shape, gen), pos_weight=bce_weight("class", out.shape, gen))
    return model, lossfn, X, torch.rand(out.shape, generator=gen, dtype=F64)


@pytest.mark.parametrize("case", ["ce index", "ce prob", "bce"])
def test_monte_carlo_converges_to_exact(case):
    """DiagGGNMC, BatchDiagGGNMC, SqrtGGNMC (outer products) and KFAC's ``B``: relative error
    shrinks like 1/√M; ignored samples get exactly zero."""
    model, lossfn, X, y = fixed_problem(case)

    def ignored_are_zero(qs):
        if case == "ce index":
            for key, dim in (("diag_ggn_mc_batch", 0), ("sqrt_ggn_mc", 1)):
                assert all(t.narrow(dim, 1, 2).abs().max() == 0 for t in qs[key].values()), key

    assert_converges(mc_errors(model, lossfn, X, y, on_result=ignored_are_zero))


# ----------------------------------------------------------------------------- slices of the batch

CHUNKABLE = (BatchGrad, BatchL2Grad, SumGradSquared, Variance, DiagGGNExact, BatchDiagGGNExact, SqrtGGNExact,
             KFLR, DiagHessian, BatchDiagHessian, KFACEmpirical)


def same(a, b, where, equal_nan=False):
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            same(a[k], b[k], f"{where}[{k}]", equal_nan)
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b)):
            same(u, v, f"{where}[{i}]", equal_nan)
    else:
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13, equal_nan=equal_nan, msg=lambda m: f"{where}: {m}")


@pytest.mark.parametrize("case", ["ce index", "ce prob", "bce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_batch_chunks_equal_whole_batch(case, reduction):
    """Slices of 1, 2 and 4 samples; for CE with indices, slice [1:3] of 2 has only ignored targets."""
    model, lossfn, X, y = fixed_problem(case, n=5)
    lossfn.reduction = reduction
    whole = curvature(model, lossfn, [cls() for cls in CHUNKABLE])(X, y)
    for size in (1, 2, 4):
        same(curvature(model, lossfn, [cls() for cls in CHUNKABLE], batch_chunk_size=size)(X, y), whole, f"{size}")


def test_all_ignored_batch_like_pytorch():
    """Nothing counted: the ``"mean"`` loss is 0/0 = NaN as PyTorch's, the gradient autograd's
    (zero), the curvature zero (``torch.func.hessian`` of PyTorch's loss); slices give the same."""
    model, lossfn, X, _ = fixed_problem("ce index", n=5)
    y = torch.ones(5, dtype=torch.long)  # every target is ignore_index = 1
    loss = lossfn(model(X), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    whole = curvature(model, lossfn, [cls() for cls in CHUNKABLE])(X, y)
    assert whole["loss"].isnan()
    for (name, _), g in zip(model.named_parameters(), grads):
        close(whole["grad"][name], g, f"grad[{name}]")
        assert (whole["diag_ggn_exact"][name] == 0).all(), name
    H = torch.func.hessian(lambda o: lossfn(o, y))(model(X).detach())
    assert (H == 0).all()
    for size in (1, 2):
        same(curvature(model, lossfn, [cls() for cls in CHUNKABLE], batch_chunk_size=size)(X, y), whole,
             f"{size}", equal_nan=True)


def test_per_sample_bce_weight_refused_with_slices():
    model, lossfn, X, y = fixed_problem("bce")
    lossfn = nn.BCEWithLogitsLoss(weight=torch.rand(y.shape, dtype=F64))
    with pytest.raises(CurvatureError, match=r"weight=<shape \(4, 3\)>\): a weight with one entry per sample"):
        curvature(model, lossfn, [DiagGGNExact()], batch_chunk_size=2)(X, y)
