"""Host syncs per call under the ``"batched"`` strategy (the CUDA default).

On a GPU every read of a device value by the host (``.item()``, ``float(t)``,
``bool(t)``, ``F.one_hot``'s range check: each dispatches
``aten._local_scalar_dense``) stalls the launch queue in the middle of a call.
Counted here on the CPU with a dispatch mode, the strategy forced: one read for
cross-entropy's class indices (the range check before any work, which also
reads the sign of the loss Hessian's scale where options allow a negative one),
none for MSE and plain BCE; one for BCE with ``weight``/``pos_weight`` and
cross-entropy with class probabilities in second order (the scale's sign picks
one root or a positive and a negative one).

Values: ``"batched"`` (a 0-dim tensor reduction factor, per-target scales, the
range check with ignored entries masked) against ``"looped"`` and the float64
oracles of ``loss_checks.check_exact`` (``torch.func.hessian`` of PyTorch's own
loss, per-sample parameter copies); Monte-Carlo extensions with the same
generator seed give the same draws under both; the sampled labels' gradients (a
scatter of −1, no one-hot) equal ``p − F.one_hot(ŷ)``.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import curvlib
from curvlib import CurvatureError, curvature, extensions as E
from curvlib._core.settings import override
from curvlib.losses._structural import _ce_sampled

from oracles.loss_checks import F64, bce_problems, ce_problems, check_exact, close, model_and_input
from oracles.on_device import seeded

FIRST = ("BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance")
SECOND = ("DiagGGNExact", "BatchDiagGGNExact", "DiagGGNMC", "BatchDiagGGNMC", "KFAC", "KFLR", "KFACEmpirical",
          "SqrtGGNExact", "SqrtGGNMC", "DiagHessian", "BatchDiagHessian", "KFRA")
SCALAR_READ = torch.ops.aten._local_scalar_dense.default


class CountReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense`` (a host read of a device value: a sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is SCALAR_READ
        return func(*args, **(kwargs or {}))


def reads_per_call(f, X, y) -> int:
    f(X, y)  # (the first call traces and plans)
    with CountReads() as mode:
        f(X, y)
    return mode.reads


def _model(kind: str, classes: int):
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, classes)).double(), torch.randn(6, 4, dtype=F64)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(2 * 2 * 2, classes))
    return model.double(), torch.randn(6, 1, 6, 6, dtype=F64)


W = torch.tensor([1.0, 0.5, 2.0], dtype=F64)
Y_INDEX = torch.tensor([0, 1, 2, 1, 0, 2])
Y_IGNORED = torch.tensor([0, -100, 2, 1, -100, 2])
Y_REAL_IGNORED = torch.tensor([0, 1, 2, 1, 1, 2])
Y_PROB = torch.softmax(torch.randn(6, 3, generator=seeded(1), dtype=F64), 1)
Y_REAL = torch.rand(6, 3, generator=seeded(2), dtype=F64)

#: (loss, targets, host reads with first order only, with second order)
LOSSES = {
    "ce": (lambda: nn.CrossEntropyLoss(), Y_INDEX, 1, 1),
    "ce ignored": (lambda: nn.CrossEntropyLoss(), Y_IGNORED, 1, 1),
    "ce weight ignore_index": (lambda: nn.CrossEntropyLoss(weight=W, ignore_index=1), Y_REAL_IGNORED, 1, 1),
    "ce label_smoothing": (lambda: nn.CrossEntropyLoss(label_smoothing=0.2), Y_IGNORED, 1, 1),
    "ce weight smoothing sum": (lambda: nn.CrossEntropyLoss(weight=W, label_smoothing=0.2, reduction="sum"),
                                Y_IGNORED, 1, 1),
    "mse": (lambda: nn.MSELoss(), Y_REAL, 0, 0),
    "mse sum": (lambda: nn.MSELoss(reduction="sum"), Y_REAL, 0, 0),
    "bce": (lambda: nn.BCEWithLogitsLoss(), Y_REAL, 0, 0),
    # the scale's sign (one root, or a positive and a negative one) is read: one sync
    "bce weight pos_weight": (lambda: nn.BCEWithLogitsLoss(weight=W, pos_weight=W), Y_REAL, 0, 1),
    "ce probabilities": (lambda: nn.CrossEntropyLoss(), Y_PROB, 0, 1),
}


@pytest.mark.parametrize("model_kind", ["mlp", "cnn"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_host_reads_per_call_under_batched(model_kind, loss):
    make_loss, y, first, second = LOSSES[loss]
    model, X = _model(model_kind, 3)
    counts, want = {}, {}
    with curvlib.strategy("batched"):
        for name in FIRST + SECOND:
            if name == "KFRA" and model_kind == "cnn":
                continue
            counts[name] = reads_per_call(curvature(model, make_loss(), [getattr(E, name)()]), X, y)
            want[name] = first if name in FIRST else second
    assert counts == want


def test_looped_reads_no_more_than_before():
    """Under ``"looped"`` (the CPU default) plain cross-entropy reads the range once, the
    reduction factor and whether a target is ignored once each (cheap on a CPU: float scale)."""
    model, X = _model("mlp", 3)
    with curvlib.strategy("looped"):
        assert reads_per_call(curvature(model, nn.CrossEntropyLoss(), [E.BatchGrad()]), X, Y_INDEX) == 1
        assert reads_per_call(curvature(model, nn.CrossEntropyLoss(), [E.DiagGGNMC()]), X, Y_INDEX) == 3


# ----------------------------------------------------------------------------- values


ALL = [E.BatchGrad, E.BatchL2Grad, E.SumGradSquared, E.Variance, E.DiagGGNExact, E.BatchDiagGGNExact, E.KFLR,
       E.KFACEmpirical, E.DiagHessian, E.BatchDiagHessian]
MC = [E.DiagGGNMC, E.BatchDiagGGNMC, E.KFAC, E.SqrtGGNMC]


def _both(model, lossfn, X, y, exts):
    out = {}
    for name in ("looped", "batched"):
        with curvlib.strategy(name):
            out[name] = curvature(model, lossfn, exts())(X, y)
    return out["looped"], out["batched"]


def _same(a, b, what, equal_nan=False):
    if isinstance(a, dict):
        assert list(a) == list(b), what
        for k in a:
            _same(a[k], b[k], f"{what}[{k}]", equal_nan)
    elif isinstance(a, (list, tuple)):
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            _same(u, v, f"{what}[{i}]", equal_nan)
    else:
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13, equal_nan=equal_nan, msg=lambda m: f"{what}: {m}")


@settings(max_examples=12)
@given(problem=ce_problems(), seed=st.integers(0, 2**16))
def test_cross_entropy_options_batched_equal_looped_and_oracle(problem, seed):
    model, lossfn, X, y = problem
    with curvlib.strategy("batched"):
        check_exact(model, lossfn, X, y)
    mc = lambda: [cls(mc_samples=3, generator=seeded(seed)) for cls in MC]  # noqa: E731
    _same(*_both(model, lossfn, X, y, lambda: [cls() for cls in ALL] + mc()), "looped vs batched")


@settings(max_examples=8)
@given(problem=bce_problems(), seed=st.integers(0, 2**16))
def test_bce_options_batched_equal_looped_and_oracle(problem, seed):
    model, lossfn, X, y = problem
    with curvlib.strategy("batched"):
        check_exact(model, lossfn, X, y)
    mc = lambda: [cls(mc_samples=3, generator=seeded(seed)) for cls in MC]  # noqa: E731
    _same(*_both(model, lossfn, X, y, lambda: [cls() for cls in ALL] + mc()), "looped vs batched")


def test_every_target_ignored_under_batched():
    """Nothing counted: the loss is NaN (0/0, as PyTorch's), gradient and curvature zero."""
    model, X = model_and_input(False, 3, 4, 3, 5, 1, 1, "tanh", seeded(0))
    y = torch.full((5,), 1)
    for lossfn in (nn.CrossEntropyLoss(ignore_index=1), nn.CrossEntropyLoss(weight=W, ignore_index=1)):
        looped, batched = _both(model, lossfn, X, y, lambda: [cls() for cls in ALL + MC])
        assert batched["loss"].isnan()
        _same(looped, batched, "all ignored", equal_nan=True)
        for key in ("diag_ggn_exact", "diag_ggn_mc", "diag_h", "grad"):
            assert all((t == 0).all() for t in batched[key].values()), key


@pytest.mark.parametrize("weight", [None, W])
def test_negative_weight_sign_read_with_the_range(weight):
    """The scale's sign read with the class-index range: a negative weight of a class that
    occurs is refused by the square root, one that does not occur is not (exact, as looped)."""
    model, X = model_and_input(False, 3, 4, 3, 4, 1, 1, "tanh", seeded(1))
    w = torch.tensor([1.0, -0.5, 2.0], dtype=F64)
    lossfn = nn.CrossEntropyLoss(weight=w, reduction="sum")
    with curvlib.strategy("batched"):
        check_exact(model, lossfn, X, torch.tensor([0, 1, 2, 1]), sqrt=False)
        with pytest.raises(CurvatureError, match=r"indefinite \(eigenvalue -[0-9.e-]+ for sample 1\)"):
            curvature(model, lossfn, [E.SqrtGGNExact()])(X, torch.tensor([0, 1, 2, 1]))
        check_exact(model, lossfn, X, torch.tensor([0, 2, 2, -100]))  # class 1 absent: a square root


@pytest.mark.parametrize("strategy", ["batched", "looped"])
@pytest.mark.parametrize("weight", [None, W])
def test_out_of_range_index_refused_with_ignored_entries(strategy, weight):
    model, X = model_and_input(False, 3, 4, 3, 4, 1, 1, "tanh", seeded(1))
    f = curvature(model, nn.CrossEntropyLoss(weight=weight), [E.DiagGGNExact()])
    with curvlib.strategy(strategy):
        for bad in (3, -2):
            with pytest.raises(CurvatureError, match=rf"y holds class index {bad}, outside \[0, 2\]"):
                f(X, torch.tensor([0, -100, bad, 1]))
        f(X, torch.tensor([0, -100, 2, 1]))


def test_uint8_targets_with_a_real_ignore_index_under_batched():
    model, X = model_and_input(False, 3, 4, 3, 4, 1, 1, "tanh", seeded(2))
    lossfn = nn.CrossEntropyLoss(ignore_index=255)
    y = torch.tensor([0, 255, 2, 1], dtype=torch.uint8)
    looped, batched = _both(model, lossfn, X, y, lambda: [E.BatchGrad(), E.DiagGGNExact()])
    _same(looped, batched, "uint8")
    with curvlib.strategy("batched"):
        assert reads_per_call(curvature(model, lossfn, [E.DiagGGNExact()]), X, y) == 1


# ----------------------------------------------------------------------------- the one-hot


def _ce_sampled_with_torch_one_hot(out, m, generator):
    """The sampled cross-entropy gradients written with ``F.one_hot`` (a reference copy)."""
    from curvlib._core import draws as _draws
    k = out.shape[1]
    p_rows = torch.softmax(out.movedim(1, -1), dim=-1).reshape(-1, k)
    u = _draws.rand((m, p_rows.shape[0], 1), generator, out.dtype, out.device)
    draws = (p_rows.detach().cumsum(-1).unsqueeze(0) <= u).sum(-1).clamp_(max=k - 1)
    grads = p_rows.unsqueeze(0) - nn.functional.one_hot(draws, k).to(out.dtype)
    return grads.reshape((m,) + tuple(out.movedim(1, -1).shape)).movedim(-1, 2)


@given(k=st.integers(2, 5), d=st.integers(0, 2), m=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_sampled_labels_unchanged_by_the_one_hot(k, d, m, seed):
    out = torch.randn((3, k) + (2,) * d, generator=seeded(seed), dtype=F64)
    with override(draw_entries=k * (1 + seed % 3)):  # cumulative sums in blocks of rows
        got = _ce_sampled(out, m, seeded(seed + 1))
    want = _ce_sampled_with_torch_one_hot(out, m, seeded(seed + 1))
    assert torch.equal(got, want)
    close(got.sum(2), torch.zeros_like(got.sum(2)), "p - onehot sums to 0 over classes")
