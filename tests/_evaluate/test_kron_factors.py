"""Kronecker factors read off a call: KFLR of convolutions and transposed convolutions
(BackPACK's factors), of a Linear on sequences (positions summed), KFRA on MLPs and CNNs
against :func:`oracles.second_order.kfra_reference`, the factors of recurrent weights, and
which layers each Kronecker extension refuses (float64).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import (
    KFAC, KFLR, KFRA,
)

from oracles.cases import CONV, CONVT, LOSSES, MAXPOOL, RecurrentNet, mlps, target_for
from oracles.checks import check_close
from oracles.kron import kron_reference_shared
from oracles.on_device import seeded
from oracles.reference import kflr_map
from oracles.second_order import kfra_reference, kron_reference

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same'")


def _check_kfra(model, lossfn, X, y):
    qs = curvature(model, lossfn, [KFRA()])(X, y)
    want = kfra_reference(model, lossfn, X, y)
    assert sorted(qs["kfra"]) == sorted(want)
    for name, factors in want.items():
        got = qs["kfra"][name]
        assert len(got) == len(factors), f"kfra[{name}]: {len(got)} factors, expected {len(factors)}"
        for i, (a, b) in enumerate(zip(got, factors)):
            check_close(a, b, f"kfra[{name}][{i}]")


@given(
    mlp=mlps(),
    n=st.integers(1, 4),
    loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_kfra_mlp(mlp, n, loss, reduction, seed):
    torch.manual_seed(seed)
    model, i = mlp
    model = model.double()
    X = torch.randn(n, i, generator=seeded(seed), dtype=torch.float64)
    y = target_for(model, X, loss, seed)
    _check_kfra(model, LOSSES[loss](reduction=reduction), X, y)


@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_kfra_cnn(d, loss):
    """Conv -> act -> pool -> flatten -> Linear chain (groups = 1)."""
    torch.manual_seed(d)
    spatial = (5, 4)[:d]
    body = nn.Sequential(CONV[d](2, 3, 2, padding=1), nn.Tanh(), MAXPOOL[d](2), nn.Flatten()).double()
    with torch.no_grad():
        f = body(torch.zeros((1, 2) + spatial, dtype=torch.float64)).shape[1]
    model = nn.Sequential(*body, nn.Linear(f, 2)).double()
    X = torch.randn((3, 2) + spatial, dtype=torch.float64)
    y = target_for(model, X, loss, d)
    _check_kfra(model, LOSSES[loss](), X, y)


@pytest.mark.parametrize("transpose", [False, True], ids=["conv", "conv_transpose"])
@pytest.mark.parametrize("d", [1, 2, 3])
def test_kflr_conv(d, transpose):
    """KFLR for convolutions and transposed convolutions: BackPACK's factors."""
    torch.manual_seed(d)
    spatial = (5, 4, 3)[:d]
    layer = (
        CONVT[d](2, 3, 2, padding=1, stride=(2,) * d, output_padding=1, dilation=1)
        if transpose
        else CONV[d](2, 3, 2, padding=1, stride=(2,) * d)
    )
    model = nn.Sequential(layer, nn.Sigmoid(), nn.Flatten()).double()
    with torch.no_grad():
        f = model(torch.zeros((1, 2) + spatial, dtype=torch.float64)).shape[1]
    model = nn.Sequential(*model, nn.Linear(f, 2)).double()
    X = torch.randn((3, 2) + spatial, dtype=torch.float64)
    y = torch.randint(0, 2, (3,))
    qs = curvature(model, nn.CrossEntropyLoss(), [KFLR()])(X, y)
    lossfn = nn.CrossEntropyLoss()
    for name, (mname, role) in kflr_map(model).items():
        want = kron_reference(model, lossfn, X, y, mname, role)
        got = qs["kflr"][name]
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            check_close(a, b, f"kflr[{name}][{i}]")


def test_recurrent_kron():
    """KFLR/KFAC give Kronecker factors of recurrent weights (time steps as shared positions;
    exact references in tests/rules/test_rnn_kron.py); KFRA refuses the RNN by name."""
    torch.manual_seed(0)
    model = RecurrentNet("rnn", 2, 3, 2, 1, True, False).double()
    X = torch.randn(3, 4, 2, dtype=torch.float64)
    y = torch.randn(3, 2, dtype=torch.float64)
    qs = curvature(model, nn.MSELoss(), [KFLR(), KFAC()])(X, y)
    for key in ("kflr", "kfac"):
        assert [tuple(f.shape) for f in qs[key]["rnn.weight_ih_l0"]] == [(3, 3), (2, 2)]
        assert [tuple(f.shape) for f in qs[key]["rnn.weight_hh_l0"]] == [(3, 3), (3, 3)]
    with pytest.raises(CurvatureError, match=r"KFRA is not defined for the recurrent module\(s\) \['rnn'\]"):
        curvature(model, nn.MSELoss(), [KFRA()])(X, y)


def test_kfra_refused_on_batchnorm_weight():
    """KFRA has no factors for BatchNorm (KFLR/KFAC give its exact blocks: tests/_evaluate/test_kron_layers.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double().eval()
    X = torch.randn(3, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (3,))
    with pytest.raises(CurvatureError, match=r"KFRA is not supported for module '1'.*batchnorm"):
        curvature(model, nn.CrossEntropyLoss(), [KFRA()])(X, y)
    qs = curvature(model, nn.CrossEntropyLoss(), [KFLR()])(X, y)
    assert [f.shape for f in qs["kflr"]["1.weight"]] == [(4, 4)]
    model[1].weight.requires_grad_(False)
    model[1].bias.requires_grad_(False)
    qs = curvature(model, nn.CrossEntropyLoss(), [KFRA()])(X, y)
    assert sorted(qs["kfra"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]


@pytest.mark.parametrize("ext_cls", [KFLR, KFAC, KFRA])
@pytest.mark.parametrize("which", ["grouped conv", "grouped conv transpose", "embedding", "batchnorm"])
def test_kron_refused_per_layer(ext_cls, which):
    """KFRA has factors for Linear and (groups=1) Conv/ConvTranspose only (the message names the
    parameter), KFLR/KFAC for every layer (grouped transposed convolutions included)."""
    torch.manual_seed(0)
    first, X = {
        "grouped conv": (nn.Conv1d(2, 2, 2, groups=2), torch.randn(3, 2, 3)),
        "grouped conv transpose": (nn.ConvTranspose1d(2, 2, 2, groups=2), torch.randn(3, 2, 3)),
        "embedding": (nn.Embedding(4, 2), torch.randint(0, 4, (3, 3))),
        "batchnorm": (nn.BatchNorm1d(2), torch.randn(3, 2, 3)),
    }[which]
    model = nn.Sequential(first, nn.Flatten()).double().eval()
    X = X.double() if X.is_floating_point() else X
    with torch.no_grad():
        f = model(X).shape[1]
    model = nn.Sequential(first, nn.Flatten(), nn.Linear(f, 2)).double().eval()
    call = curvature(model, nn.CrossEntropyLoss(), [ext_cls()])
    if ext_cls is KFRA:
        with pytest.raises(CurvatureError, match=r"'0'|'0\.weight'"):
            call(X, torch.randint(0, 2, (3,)))
    else:
        assert "0.weight" in call(X, torch.randint(0, 2, (3,)))[ext_cls.name]


def test_kron_on_linear_with_sequence_input():
    """Linear on [N, T, I]: positions summed in B, outer products summed in A
    (BackPACK's convolution convention; BackPACK refuses Linear with 3d inputs)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    X = torch.randn(4, 5, 3, dtype=torch.float64)
    y = torch.randn(4, 5, 2, dtype=torch.float64)
    lossfn = nn.MSELoss()
    qs = curvature(model, lossfn, [KFLR(), KFAC(mc_samples=2)])(X, y)
    for i in (0, 2):
        B, A = kron_reference_shared(model, lossfn, X, y, model[i])
        check_close(qs["kflr"][f"{i}.weight"][0], B, f"kflr[{i}.weight][B]")
        check_close(qs["kflr"][f"{i}.weight"][1], A, f"kflr[{i}.weight][A]")
        check_close(qs["kflr"][f"{i}.bias"][0], B, f"kflr[{i}.bias][B]")
        assert qs["kfac"][f"{i}.weight"][0].shape == B.shape
