"""Agreement with BackPACK 1.7 where BackPACK supports a case (skipped without it).

The oracle for correctness is autograd (other test files); this file pins
BackPACK's *conventions*: shapes, "mean" scaling, Kronecker factor order.
"""

import copy

import pytest
import torch
from torch import nn

from curvlib import curvature
from curvlib import extensions as ce

backpack = pytest.importorskip("backpack")
from backpack import backpack as bp_context, extend  # noqa: E402
from backpack import extensions as be  # noqa: E402

DT = torch.float64

PAIRS = [
    (ce.BatchGrad, be.BatchGrad, "grad_batch"),
    (ce.BatchL2Grad, be.BatchL2Grad, "batch_l2"),
    (ce.SumGradSquared, be.SumGradSquared, "sum_grad_squared"),
    (ce.Variance, be.Variance, "variance"),
    (ce.DiagGGNExact, be.DiagGGNExact, "diag_ggn_exact"),
    (ce.BatchDiagGGNExact, be.BatchDiagGGNExact, "diag_ggn_exact_batch"),
    (ce.DiagHessian, be.DiagHessian, "diag_h"),
    (ce.BatchDiagHessian, be.BatchDiagHessian, "diag_h_batch"),
    (ce.SqrtGGNExact, be.SqrtGGNExact, "sqrt_ggn_exact"),
    (ce.KFLR, be.KFLR, "kflr"),
    (ce.KFRA, be.KFRA, "kfra"),
]


def _mlp():
    return nn.Sequential(nn.Linear(6, 5), nn.Sigmoid(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(3, 2, 2, stride=2), nn.Sigmoid(), nn.Flatten(), nn.Linear(8, 3),
    )


def _convt():
    return nn.Sequential(
        nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 7 * 7, 3),
    )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(
    "make, xshape", [(_mlp, (5, 6)), (_cnn, (4, 2, 8, 8)), (_convt, (3, 2, 4, 4))], ids=["mlp", "cnn", "convt"]
)
@pytest.mark.parametrize("ours, theirs, name", PAIRS, ids=[p[2] for p in PAIRS])
def test_matches_backpack(make, xshape, ours, theirs, name, reduction):
    torch.manual_seed(0)
    model = make().to(DT)
    X = torch.randn(xshape, dtype=DT)
    y = torch.randint(0, 3, (xshape[0],))
    lossfn = nn.CrossEntropyLoss(reduction=reduction)
    if name == "kfra" and make is _cnn:
        pytest.skip("BackPACK 1.7.1's KFRA through MaxPool2d fails in float64 (scatter dtype)")
    qs = curvature(model, lossfn, [ours()])(X, y)

    bmodel, blossfn = extend(copy.deepcopy(model)), extend(copy.deepcopy(lossfn))
    with bp_context(theirs()):
        blossfn(bmodel(X), y).backward()
    for pname, p in bmodel.named_parameters():
        expected = getattr(p, name)
        actual = qs[name][pname]
        if isinstance(expected, list):
            assert len(actual) == len(expected), f"{name}[{pname}]: factor count"
            for a, e in zip(actual, expected):
                torch.testing.assert_close(a, e, msg=lambda m: f"{name}[{pname}] factor: {m}")
        else:
            torch.testing.assert_close(actual, expected, msg=lambda m: f"{name}[{pname}]: {m}")
