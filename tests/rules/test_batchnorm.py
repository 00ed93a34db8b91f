"""BatchNorm rule (evaluation mode) against the per-sample-copies oracle, and its refusals."""

from collections import OrderedDict

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import BatchGrad, BatchL2Grad

from oracles.checks import check_first_order, check_second_order, state_snapshot, _assert_same_state
from oracles.on_device import seeded

BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
LOSSES = {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss}


def _randomise(bn: nn.Module, gen: torch.Generator) -> None:
    """Non-trivial running statistics and affine parameters, set before the test."""
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(bn.running_mean.shape, generator=gen, dtype=torch.float64))
        bn.running_var.copy_(0.5 + 2 * torch.rand(bn.running_var.shape, generator=gen, dtype=torch.float64))
        if bn.affine:
            bn.weight.copy_(torch.randn(bn.weight.shape, generator=gen, dtype=torch.float64))
            bn.bias.copy_(torch.randn(bn.bias.shape, generator=gen, dtype=torch.float64))


def _targets(kind, out, gen):
    if kind == "ce":
        return torch.randint(0, out.shape[1], (out.shape[0],), generator=gen)
    return torch.randn(out.shape, generator=gen, dtype=out.dtype)


@given(
    n=st.integers(1, 4),
    spatial=st.sampled_from([(), (3,), (2, 3), (2, 1, 2)]),
    c=st.integers(1, 3),
    affine=st.booleans(),
    freeze_bias=st.booleans(),
    loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_batchnorm_eval(n, spatial, c, affine, freeze_bias, loss, reduction, seed):
    """Linear (on the last axis) -> BatchNorm{1,2,3}d -> Flatten -> Linear, eval mode.

    With ``affine=False`` the BatchNorm has no parameters; the layers around it
    must still be right.
    """
    gen = seeded(seed)
    torch.manual_seed(seed)
    bn = BN[max(len(spatial), 1)](c, affine=affine).double()
    _randomise(bn, gen)
    last = spatial[-1] if spatial else c
    numel = c * (1 if not spatial else torch.Size(spatial).numel())
    model = nn.Sequential(nn.Linear(last, last), bn, nn.Flatten(), nn.Linear(numel, 3)).double().eval()
    if affine and freeze_bias:
        bn.bias.requires_grad_(False)
    X = torch.randn((n, c, *spatial), generator=gen, dtype=torch.float64)
    y = _targets(loss, model(X), gen)
    check_first_order(model, LOSSES[loss](reduction=reduction), X, y)


def test_batchnorm_running_stats_from_training_forwards():
    """Running statistics learnt by train-mode forwards (then ``.eval()``); BatchNorm first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 3 * 2, 2)).double()
    model[0].momentum = 0.5
    for _ in range(3):
        model(3 * torch.randn(6, 2, 3, 2, dtype=torch.float64) + 1.5)
    model.eval()
    X = torch.randn(4, 2, 3, 2, dtype=torch.float64)
    check_first_order(model, nn.CrossEntropyLoss(), X, torch.randint(0, 2, (4,)))


def test_batchnorm_batch_not_in_dim0():
    """BatchNorm1d on ``[L, C, N]`` (the batch in dim 2) is handled exactly."""

    class LastBatch(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3)
            self.fc = nn.Linear(3 * 4, 2)

        def forward(self, x):  # x [N, C, L]
            h = self.bn(x.transpose(0, 2)).transpose(0, 2)
            return self.fc(h.flatten(1))

    gen = seeded(1)
    model = LastBatch().double()
    _randomise(model.bn, gen)
    model.eval()
    X = torch.randn(5, 3, 4, dtype=torch.float64, generator=gen)
    check_first_order(model, nn.MSELoss(), X, torch.randn(5, 2, dtype=torch.float64, generator=gen))


class _BatchMoved(nn.Module):
    """A BatchNorm2d on ``x [N, C, H, W]`` permuted by ``perm`` (its own inverse, channel kept in
    dim 1), so that the layer sees the batch in dim ``perm[0]``."""

    def __init__(self, c: int, h: int, w: int, perm):
        super().__init__()
        self.perm = perm
        self.bn = nn.BatchNorm2d(c)
        self.fc = nn.Linear(c * h * w, 2)

    def forward(self, x):
        h = self.bn(x.permute(self.perm)).permute(self.perm)
        return self.fc(torch.tanh(h).flatten(1))


@given(perm=st.sampled_from([(2, 1, 0, 3), (3, 1, 2, 0)]), n=st.integers(2, 4), c=st.integers(1, 3),
       h=st.integers(1, 3), w=st.integers(2, 3), seed=st.integers(0, 2**16))
def test_batchnorm_batch_in_spatial_dim_second_order(perm, n, c, h, w, seed):
    """BatchNorm with the batch in dim 2 or 3 of its input (the recorder moves it to the front, the
    channel axis kept at 1): first order and the exact GGN family against the oracles."""
    gen = seeded(seed)
    model = _BatchMoved(c, h, w, perm).double()
    _randomise(model.bn, gen)
    model.eval()
    X = torch.randn(n, c, h, w, dtype=torch.float64, generator=gen)
    y = torch.randn(n, 2, dtype=torch.float64, generator=gen)
    check_first_order(model, nn.MSELoss(), X, y)
    check_second_order(model, nn.MSELoss(), X, y, hessian=False, hmp=False)


def _named_model(affine: bool, **bn_kwargs) -> nn.Module:
    return nn.Sequential(
        OrderedDict(fc=nn.Linear(3, 4), norm=nn.BatchNorm1d(4, affine=affine, **bn_kwargs), out=nn.Linear(4, 2))
    ).double()


@pytest.mark.parametrize("affine", [True, False])
def test_batchnorm_training_mode_refused(affine):
    """A BatchNorm in training mode mixes samples: refused, naming the path, model untouched."""
    model = _named_model(affine)
    model.train()
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    before = state_snapshot(model)
    with pytest.raises(CurvatureError, match=r"'norm'.*training mode.*model\.eval\(\)"):
        curvature(model, nn.MSELoss(), [BatchGrad()])(X, y)
    _assert_same_state(before, state_snapshot(model))
    assert model.norm.num_batches_tracked.item() == 0


def test_batchnorm_switched_to_training_after_first_call_refused():
    """The mode is checked on every call, not only when the plan is built."""
    model = _named_model(True).eval()
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    f = curvature(model, nn.MSELoss(), [BatchGrad(), BatchL2Grad()])
    f(X, y)
    model.train()
    before = state_snapshot(model)
    with pytest.raises(ValueError, match="'norm'.*training mode"):
        f(X, y)
    _assert_same_state(before, state_snapshot(model))


@pytest.mark.parametrize("affine", [True, False])
def test_batchnorm_without_running_stats_refused(affine):
    """``track_running_stats=False`` always normalises with batch statistics."""
    model = _named_model(affine, track_running_stats=False).eval()
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    with pytest.raises(CurvatureError, match="'norm'.*track_running_stats=False.*model.eval"):
        curvature(model, nn.MSELoss(), [BatchGrad()])(X, y)


def test_batchnorm_wrong_input_rank_refused():
    """BatchNorm2d fed a 3D input: refused with the layer's path, like torch itself would."""
    model = nn.Sequential(OrderedDict(norm=nn.BatchNorm2d(3), flat=nn.Flatten(), out=nn.Linear(6, 2)))
    model = model.double().eval()
    X = torch.randn(4, 3, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="'norm'.*3 dims"):
        curvature(model, nn.MSELoss(), [BatchGrad()])(X, torch.randn(4, 2, dtype=torch.float64))
