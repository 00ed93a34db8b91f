"""Every exact second-order quantity at once, on drawn models, against the brute force of
:mod:`oracles.second_order` (float64): :func:`oracles.checks.check_second_order` reads the GGN
diagonal, its per-sample diagonals and square root, the Hessian diagonals, the block products
(GGNMP, HMP, PCHMP) and KFLR off one call. MLPs, CNNs (every pooling, padding mode, groups),
transposed convolutions, BatchNorm in evaluation mode, embeddings, recurrent layers, shared
and unused parameters; and the same values as BackPACK 1.7 where it computes them.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import (
    BatchDiagGGNExact, BatchDiagGGNMC, BatchDiagHessian, DiagGGNExact, DiagGGNMC, DiagHessian, KFAC, KFACEmpirical, KFLR, KFRA,
    SqrtGGNExact, SqrtGGNMC,
)

from oracles.cases import ACTS, CONV, LOSSES, MeanEmbedding, RecurrentNet, cnns, conv_transposes, mlps, target_for
from oracles.checks import check_close, check_hessian_diagonals, check_second_order
from oracles.kron import kron_reference_shared
from oracles.on_device import seeded
from oracles.reference import kflr_map
from oracles.second_order import ggn_per_sample, hessian_block

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same'")


@given(
    mlp=mlps(),
    n=st.integers(1, 4),
    loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    modify=st.sampled_from(["clip", "abs"]),
    seed=st.integers(0, 2**16),
)
def test_mlp(mlp, n, loss, reduction, modify, seed):
    torch.manual_seed(seed)
    model, i = mlp
    model = model.double()
    X = torch.randn(n, i, generator=seeded(seed), dtype=torch.float64)
    y = target_for(model, X, loss, seed)
    check_second_order(
        model, LOSSES[loss](reduction=reduction), X, y, modify=modify, kflr=kflr_map(model), seed=seed
    )


def test_mlp_frozen_parameter_and_params_argument():
    """Frozen parameters get no entry; ``params=`` evaluates at the given values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    model[0].bias.requires_grad_(False)
    X = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (4,))
    lossfn = nn.CrossEntropyLoss()
    check_second_order(model, lossfn, X, y, kflr=kflr_map(model))

    new = {"2.weight": torch.randn(2, 4, dtype=torch.float64)}
    qs = curvature(model, lossfn, [DiagGGNExact(), DiagHessian()])(X, y, params=new)
    assert list(qs["diag_h"]) == ["2.weight"]
    twin = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        twin[2].weight.copy_(new["2.weight"])
    G = ggn_per_sample(twin, lossfn, X, y, "2.weight").sum(0)
    check_close(qs["diag_ggn_exact"]["2.weight"], G.diagonal().reshape(2, 4), "diag_ggn_exact with params=")
    H = hessian_block(twin, lossfn, X, y, "2.weight")
    check_close(qs["diag_h"]["2.weight"], H.diagonal().reshape(2, 4), "diag_h with params=")


@given(
    cnn=cnns(),
    n=st.integers(1, 3),
    loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_cnn(cnn, n, loss, reduction, seed):
    torch.manual_seed(seed)
    model, shape, groups = cnn
    X = torch.randn((n,) + shape, generator=seeded(seed), dtype=torch.float64)
    y = target_for(model, X, loss, seed)
    lossfn = LOSSES[loss](reduction=reduction)
    if groups == 1:  # KFLR of the conv (all options, padding modes) and of the head
        check_second_order(model, lossfn, X, y, seed=seed, kflr=kflr_map(model))
    else:
        check_second_order(model, lossfn, X, y, seed=seed)
        with pytest.raises(CurvatureError, match=r"KFRA.*0\.weight.*groups=2"):
            curvature(model, lossfn, [KFRA()])(X, y)
        # KFLR: per-group factors (tests/_evaluate/test_kron_layers.py checks their values)
        got = curvature(model, lossfn, [KFLR()])(X, y)["kflr"]["0.weight"]
        w = model[0].weight
        assert got[0].shape == (groups, w.shape[0] // groups, w.shape[0] // groups)
        assert got[1].shape[:1] == (groups,) and got[1].shape[1] == w[0].numel()


@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_per_position_outputs(d, loss, reduction):
    """Outputs ``[N, C, *D]`` (CE: a class per position; the root has ``C·prod(D)`` columns)."""
    torch.manual_seed(1)
    model = nn.Sequential(CONV[d](2, 3, 2), nn.Tanh(), CONV[d](3, 3, 2, padding=1)).double()
    X = torch.randn((3, 2) + (4, 3)[:d], dtype=torch.float64)
    y = target_for(model, X, loss, 1)
    qs = check_second_order(model, LOSSES[loss](reduction=reduction), X, y)
    assert qs["sqrt_ggn_exact"]["0.weight"].shape[0] == 3 * (4 * 3 if d == 2 else 4)


class Twice(nn.Module):
    """One Linear applied twice: its parameters are used by two sites."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.act = nn.Tanh()
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        return self.out(self.fc(self.act(self.fc(x))))


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_shared_parameters(loss):
    """GGN family, products and the Hessian diagonals include the cross terms between
    uses (weight-input coupling of the second use); KFLR treats the uses like positions."""
    torch.manual_seed(0)
    model = Twice().double()
    X = torch.randn(4, 3, dtype=torch.float64)
    y = target_for(model, X, loss, 0)
    lossfn = LOSSES[loss](reduction="sum")
    check_second_order(model, lossfn, X, y, hessian=False)
    check_hessian_diagonals(model, lossfn, X, y)
    qs = curvature(model, lossfn, [KFLR()])(X, y)
    for role in ("weight", "bias"):
        B, A = kron_reference_shared(model, lossfn, X, y, model.fc)
        check_close(qs["kflr"][f"fc.{role}"][0], B, f"kflr[fc.{role}][B]")
        if role == "weight":
            check_close(qs["kflr"]["fc.weight"][1], A, "kflr[fc.weight][A]")


@given(
    net=conv_transposes(),
    n=st.integers(1, 3),
    loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_conv_transpose(net, n, loss, reduction, seed):
    torch.manual_seed(seed)
    model, shape = net
    X = torch.randn((n,) + shape, generator=seeded(seed), dtype=torch.float64)
    y = target_for(model, X, loss, seed)
    check_second_order(model, LOSSES[loss](reduction=reduction), X, y, seed=seed)


def _randomise_bn(bn: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(bn.running_mean.shape, generator=gen))
        bn.running_var.copy_(torch.rand(bn.running_var.shape, generator=gen) + 0.5)
        if bn.affine:
            bn.weight.copy_(torch.randn(bn.weight.shape, generator=gen))
            bn.bias.copy_(torch.randn(bn.bias.shape, generator=gen))


@given(
    conv=st.booleans(),
    affine=st.booleans(),
    act=st.sampled_from(sorted(ACTS)),
    n=st.integers(1, 3),
    loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_batchnorm_eval(conv, affine, act, n, loss, reduction, seed):
    torch.manual_seed(seed)
    gen = seeded(seed)
    if conv:
        bn = nn.BatchNorm2d(2, affine=affine)
        model = nn.Sequential(nn.Conv2d(1, 2, 2), bn, ACTS[act](), nn.Flatten(), nn.Linear(2 * 2 * 2, 2))
        X = torch.randn(n, 1, 3, 3, generator=gen, dtype=torch.float64)
    else:
        bn = nn.BatchNorm1d(3, affine=affine)
        model = nn.Sequential(nn.Linear(2, 3), bn, ACTS[act](), nn.Linear(3, 2))
        X = torch.randn(n, 2, generator=gen, dtype=torch.float64)
    _randomise_bn(bn, gen)
    model = model.double().eval()
    y = target_for(model, X, loss, seed)
    check_second_order(model, LOSSES[loss](reduction=reduction), X, y, seed=seed)


@given(
    n=st.integers(1, 3),
    s=st.integers(1, 4),
    v=st.integers(1, 4),
    d=st.integers(1, 3),
    pad=st.booleans(),
    loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_embedding(n, s, v, d, pad, loss, reduction, seed):
    """Repeated indices within a sample (small vocabulary), optionally a padding index."""
    torch.manual_seed(seed)
    gen = seeded(seed)
    model = MeanEmbedding(v, d, 2, padding_idx=0 if pad else None).double()
    X = torch.randint(0, v, (n, s), generator=gen)
    y = target_for(model, X, loss, seed)
    check_second_order(
        model, LOSSES[loss](reduction=reduction), X, y, seed=seed,
        constant_rows={"emb.weight": 0} if pad else None,
    )


@given(
    kind=st.sampled_from(["rnn", "lstm", "gru"]),
    n=st.integers(1, 3),
    t=st.integers(1, 3),
    h=st.integers(1, 2),
    layers=st.integers(1, 2),
    batch_first=st.booleans(),
    bidirectional=st.booleans(),
    loss=st.sampled_from(["mse", "ce"]),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_recurrent_ggn(kind, n, t, h, layers, batch_first, bidirectional, loss, reduction, seed):
    """GGN family (+ HMP by the re-run forward) on RNN/LSTM/GRU models."""
    torch.manual_seed(seed)
    model = RecurrentNet(kind, 2, h, 2, layers, batch_first, bidirectional).double()
    X = torch.randn(n, t, 2, generator=seeded(seed), dtype=torch.float64)
    y = target_for(model, X, loss, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_second_order(model, LOSSES[loss](reduction=reduction), X, y, hessian=False, seed=seed)


def test_unused_parameter():
    """A parameter the forward never uses: zero curvature of the right shape, Kronecker factors
    included (in a generic parameter's layout), and one note naming it."""

    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x):
            return self.a(torch.tanh(x))

    model = Unused().double()
    X = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (4,))
    lossfn = nn.CrossEntropyLoss()
    check_second_order(model, lossfn, X, y)
    exts = [DiagGGNMC(mc_samples=2), BatchDiagGGNMC(mc_samples=2), SqrtGGNMC(mc_samples=2)]
    qs = curvature(model, lossfn, exts)(X, y)
    assert qs["sqrt_ggn_mc"]["b.weight"].shape == (2, 4, 2, 3)
    for ext in exts:
        assert not qs[ext.name]["b.weight"].any()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = curvature(model, lossfn, [KFLR(), KFAC(mc_samples=2), KFACEmpirical()])
        qs, again = f(X, y), f(X, y)
    notes = [w for w in caught if "does not use the parameters 'b.weight', 'b.bias'" in str(w.message)]
    assert len(notes) == 1  # once per input signature, not per call
    for key in ("kflr", "kfac", "kfac_empirical"):
        assert [tuple(f.shape) for f in qs[key]["b.weight"]] == [(6,)]
        assert [tuple(f.shape) for f in again[key]["b.bias"]] == [(2, 2)]
        assert not any(f.any() for f in qs[key]["b.weight"] + qs[key]["b.bias"])
        assert qs[key]["a.weight"][0].any()


def _backpack_models():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(3, 4), nn.Sigmoid(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    cnn = nn.Sequential(
        nn.Conv2d(2, 3, 2, padding=1), nn.Sigmoid(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(3 * 2 * 2, 3)
    )
    return {"mlp": (mlp.double(), (3,)), "cnn": (cnn.double(), (2, 3, 4))}


@pytest.mark.parametrize("which", ["mlp", "cnn"])
@pytest.mark.parametrize("loss", ["mse", "ce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_matches_backpack(which, loss, reduction):
    """Same values as BackPACK 1.7 (shapes and scaling), where BackPACK computes them."""
    backpack = pytest.importorskip("backpack")
    import copy

    from backpack import extensions as bx

    model, shape = _backpack_models()[which]
    X = torch.randn((5,) + shape, generator=seeded(1), dtype=torch.float64)
    y = target_for(model, X, loss, 1)
    lossfn = LOSSES[loss](reduction=reduction)
    pairs = [
        (bx.DiagGGNExact, DiagGGNExact), (bx.BatchDiagGGNExact, BatchDiagGGNExact),
        (bx.SqrtGGNExact, SqrtGGNExact), (bx.DiagHessian, DiagHessian),
        (bx.BatchDiagHessian, BatchDiagHessian), (bx.KFLR, KFLR), (bx.KFRA, KFRA),
    ]
    bmodel = backpack.extend(copy.deepcopy(model))
    bloss = backpack.extend(copy.deepcopy(lossfn))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # BackPACK makes some tensors in the default dtype
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with backpack.backpack(*[b() for b, _ in pairs]):
                bloss(bmodel(X), y).backward()
    finally:
        torch.set_default_dtype(default)
    qs = curvature(model, lossfn, [c() for _, c in pairs])(X, y)
    for name, p in bmodel.named_parameters():
        for _, c in pairs:
            got, want = qs[c.name][name], getattr(p, c.name)
            if isinstance(want, list):
                assert len(got) == len(want), f"{c.name}[{name}]"
                for i, (a, b) in enumerate(zip(got, want)):
                    check_close(a, b, f"{c.name}[{name}][{i}] vs BackPACK")
            else:
                check_close(got, want, f"{c.name}[{name}] vs BackPACK")
