"""Second-order extensions against the brute-force references of ``oracles_second``.

Exact quantities (GGN diagonal / per-sample diagonal / square root, Hessian
diagonal / per-sample diagonal, KFLR, and the block products GGNMP, HMP,
PCHMP) are compared in float64 over models drawn by hypothesis; Monte-Carlo
quantities (DiagGGNMC, BatchDiagGGNMC, SqrtGGNMC, KFAC) are tested
statistically with seeded generators; refusals are checked for their message.
"""

from __future__ import annotations

import warnings
from typing import Dict, Optional

import pytest
import torch
from hypothesis import assume, given, strategies as st
from torch import nn

import curvlib
from curvlib import CurvatureError, curvature
from curvlib.extensions import (
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    GGNMP,
    HMP,
    KFAC,
    KFLR,
    KFRA,
    PCHMP,
    SqrtGGNExact,
    SqrtGGNMC,
)

from helpers import _assert_same_state, state_snapshot
from oracles_second import (
    detached_params,
    ggn_per_sample,
    ggn_block,
    hessian_block,
    hessian_per_sample,
    kfra_reference,
    kron_input_factor,
    kron_output_factor,
    kron_reference,
    loss_root,
    output_jacobian,
    residual_block,
    trainable_names,
)
from on_device import seeded

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same'")

LOSSES = {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss, "bce": nn.BCEWithLogitsLoss}
ACTS = {
    "relu": nn.ReLU,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
    "leaky": lambda: nn.LeakyReLU(0.2),
    "logsigmoid": nn.LogSigmoid,
    "elu": nn.ELU,
    "selu": nn.SELU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "softplus": nn.Softplus,
    "identity": nn.Identity,
}
RTOL, ATOL = 1e-7, 1e-9


def _close(actual, expected, what):
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def targets(kind: str, out: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if kind == "ce":
        return torch.randint(0, out.shape[1], (out.shape[0],) + tuple(out.shape[2:]), generator=gen)
    if kind == "bce":
        return torch.rand(out.shape, generator=gen, dtype=out.dtype)
    return torch.randn(out.shape, generator=gen, dtype=out.dtype)


def _data(model, X, loss, seed):
    with torch.no_grad():
        out = model(X)
    return targets(loss, out, seeded(seed + 7))


# ----------------------------------------------------------------------------- the check


def check_second_order(
    model: nn.Module,
    lossfn: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    *,
    hessian: bool = True,
    hmp: bool = True,
    modify: str = "clip",
    kflr: Optional[Dict[str, tuple]] = None,
    seed: int = 0,
    constant_rows: Optional[Dict[str, int]] = None,
) -> dict:
    """Compare every exact second-order quantity with the oracle.

    Args:
        hessian: also DiagHessian, BatchDiagHessian and PCHMP (the model's
            nonlinearities must be modules of ``oracles_second.SMOOTH_ACTIVATIONS``
            or piecewise linear, so that the residual oracle is complete: this is
            checked, ``G + R = ∇²L``).
        hmp: also HMP.
        kflr: ``{param name: (module name, role)}`` to check KFLR for (then
            every trainable parameter must be in it).
        constant_rows: ``{param name: row}``: the product directions ``V`` get
            a zero in that row (an embedding's ``padding_idx``, which autograd
            holds constant; the full products are tested by
            :func:`test_embedding_padding_row_products`).
    """
    exts = [DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), GGNMP()]
    if hmp:
        exts.append(HMP())
    if hessian:
        exts += [DiagHessian(), BatchDiagHessian(), PCHMP(modify=modify)]
    if kflr is not None:
        exts.append(KFLR())
    before = state_snapshot(model)
    qs = curvature(model, lossfn, exts)(X, y)
    torch.testing.assert_close(qs["loss"], lossfn(model(X), y))
    n = X.shape[0]
    with torch.no_grad():
        c = model(X)[0].numel()
    names = trainable_names(model)
    params = detached_params(model)
    gen = seeded(seed)
    for ext in exts:
        assert list(qs[ext.name]) == names, f"{ext.name}: keys {list(qs[ext.name])} != {names}"
    for name in names:
        p = params[name]
        P = p.numel()
        Gn = ggn_per_sample(model, lossfn, X, y, name)
        G = Gn.sum(0)
        _close(qs["diag_ggn_exact"][name], G.diagonal().reshape(p.shape), f"diag_ggn_exact[{name}]")
        _close(
            qs["diag_ggn_exact_batch"][name],
            Gn.diagonal(dim1=1, dim2=2).reshape((n,) + tuple(p.shape)),
            f"diag_ggn_exact_batch[{name}]",
        )
        sq = qs["sqrt_ggn_exact"][name]
        assert tuple(sq.shape) == (c, n) + tuple(p.shape), f"sqrt_ggn_exact[{name}] shape {tuple(sq.shape)}"
        sq = sq.reshape(c, n, P)
        _close(torch.einsum("vnp,vnq->npq", sq, sq), Gn, f"sqrt_ggn_exact[{name}] (per-sample SᵀS)")
        J = output_jacobian(model, X, name)  # [N, C, P]; BackPACK's factor is J_nᵀ S_n
        S = loss_root(lossfn, model(X).detach(), y).reshape(c, n, c)
        _close(sq, torch.einsum("ncp,vnc->vnp", J, S), f"sqrt_ggn_exact[{name}] (= J_nᵀ S_n)")

        V = torch.randn((3,) + tuple(p.shape), generator=gen, dtype=p.dtype)
        if constant_rows and name in constant_rows:
            V[:, constant_rows[name]] = 0
        Vf = V.reshape(3, P)
        _close(qs["ggnmp"][name](V), (Vf @ G).reshape(V.shape), f"ggnmp[{name}]")
        H = None
        if hmp or hessian:
            H = hessian_block(model, lossfn, X, y, name)
        if hmp:
            _close(qs["hmp"][name](V), (Vf @ H).reshape(V.shape), f"hmp[{name}]")
        if hessian:
            Hn = hessian_per_sample(model, lossfn, X, y, name)
            _close(Hn.sum(0), H, f"oracle self-check: per-sample Hessians sum to the Hessian [{name}]")
            R = residual_block(model, lossfn, X, y, name)
            _close(G + R, H, f"oracle self-check: G + residual = Hessian [{name}]")
            _close(qs["diag_h"][name], H.diagonal().reshape(p.shape), f"diag_h[{name}]")
            _close(
                qs["diag_h_batch"][name],
                Hn.diagonal(dim1=1, dim2=2).reshape((n,) + tuple(p.shape)),
                f"diag_h_batch[{name}]",
            )
            PC = G + residual_block(model, lossfn, X, y, name, modify)
            _close(qs["pchmp"][name](V), (Vf @ PC).reshape(V.shape), f"pchmp[{name}] ({modify})")
        if kflr is not None:
            module_name, role = kflr[name]
            got = qs["kflr"][name]
            want = kron_reference(model, lossfn, X, y, module_name, role)
            assert len(got) == len(want), f"kflr[{name}]: {len(got)} factors, expected {len(want)}"
            for i, (a, b) in enumerate(zip(got, want)):
                _close(a, b, f"kflr[{name}][{i}]")
    # the product callables re-run the forward: the model must still be untouched
    _assert_same_state(before, state_snapshot(model))
    return qs


def _linear_kflr_map(model: nn.Module) -> Dict[str, tuple]:
    out = {}
    for mname, m in model.named_modules():
        for role, p in m.named_parameters(recurse=False):
            if p.requires_grad:
                out[f"{mname}.{role}" if mname else role] = (mname, role)
    return out


# ----------------------------------------------------------------------------- MLPs


@st.composite
def mlps(draw):
    i = draw(st.integers(1, 3))
    widths = draw(st.lists(st.integers(1, 4), min_size=0, max_size=2))
    o = draw(st.integers(1, 3))
    bias = draw(st.booleans())
    acts = [draw(st.sampled_from(sorted(ACTS))) for _ in widths]
    final = draw(st.sampled_from(["none", "sigmoid", "tanh", "softplus"]))
    # a nonlinearity on the input itself (no parameter behind it: no residual)
    layers = [ACTS[draw(st.sampled_from(["tanh", "gelu"]))]()] if draw(st.booleans()) else []
    d = i
    for w, a in zip(widths, acts):
        layers += [nn.Linear(d, w, bias=bias), ACTS[a]()]
        d = w
    layers.append(nn.Linear(d, o, bias=bias))
    if final != "none":
        layers.append(ACTS[final]())
    return nn.Sequential(*layers), i


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
    y = _data(model, X, loss, seed)
    check_second_order(
        model, LOSSES[loss](reduction=reduction), X, y, modify=modify, kflr=_linear_kflr_map(model), seed=seed
    )


def test_mlp_frozen_parameter_and_params_argument():
    """Frozen parameters get no entry; ``params=`` evaluates at the given values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    model[0].bias.requires_grad_(False)
    X = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (4,))
    lossfn = nn.CrossEntropyLoss()
    check_second_order(model, lossfn, X, y, kflr=_linear_kflr_map(model))

    new = {"2.weight": torch.randn(2, 4, dtype=torch.float64)}
    qs = curvature(model, lossfn, [DiagGGNExact(), DiagHessian()])(X, y, params=new)
    assert list(qs["diag_h"]) == ["2.weight"]
    twin = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        twin[2].weight.copy_(new["2.weight"])
    G = ggn_per_sample(twin, lossfn, X, y, "2.weight").sum(0)
    _close(qs["diag_ggn_exact"]["2.weight"], G.diagonal().reshape(2, 4), "diag_ggn_exact with params=")
    H = hessian_block(twin, lossfn, X, y, "2.weight")
    _close(qs["diag_h"]["2.weight"], H.diagonal().reshape(2, 4), "diag_h with params=")


@given(n=st.integers(1, 4), widths=st.lists(st.integers(1, 4), min_size=1, max_size=3), loss=st.sampled_from(sorted(LOSSES)), seed=st.integers(0, 2**16))
def test_piecewise_linear_net_hessian_is_ggn(n, widths, loss, seed):
    """ReLU / LeakyReLU nets: residuals vanish, so diag_h = diag_ggn and PCHMP = HMP = GGNMP."""
    torch.manual_seed(seed)
    layers, d = [], 2
    for k, w in enumerate(widths):
        layers += [nn.Linear(d, w), nn.ReLU() if k % 2 == 0 else nn.LeakyReLU(0.3)]
        d = w
    model = nn.Sequential(*layers, nn.Linear(d, 3)).double()
    X = torch.randn(n, 2, dtype=torch.float64)
    y = _data(model, X, loss, seed)
    lossfn = LOSSES[loss](reduction="sum")
    qs = curvature(model, lossfn, [DiagGGNExact(), DiagHessian(), BatchDiagGGNExact(), BatchDiagHessian(), GGNMP(), HMP(), PCHMP(modify="abs")])(X, y)
    for name, p in model.named_parameters():
        _close(qs["diag_h"][name], qs["diag_ggn_exact"][name], f"diag_h vs diag_ggn [{name}]")
        _close(qs["diag_h_batch"][name], qs["diag_ggn_exact_batch"][name], f"batch [{name}]")
        V = torch.randn((2,) + tuple(p.shape), dtype=torch.float64)
        _close(qs["pchmp"][name](V), qs["ggnmp"][name](V), f"pchmp vs ggnmp [{name}]")
        _close(qs["hmp"][name](V), qs["ggnmp"][name](V), f"hmp vs ggnmp [{name}]")


def _check_kfra(model, lossfn, X, y):
    qs = curvature(model, lossfn, [KFRA()])(X, y)
    want = kfra_reference(model, lossfn, X, y)
    assert sorted(qs["kfra"]) == sorted(want)
    for name, factors in want.items():
        got = qs["kfra"][name]
        assert len(got) == len(factors), f"kfra[{name}]: {len(got)} factors, expected {len(factors)}"
        for i, (a, b) in enumerate(zip(got, factors)):
            _close(a, b, f"kfra[{name}][{i}]")


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
    y = _data(model, X, loss, seed)
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
    y = _data(model, X, loss, d)
    _check_kfra(model, LOSSES[loss](), X, y)


# ----------------------------------------------------------------------------- CNNs

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
MAXPOOL = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}
AVGPOOL = {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d}
ADAPTIVE = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}
CONVT = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


@st.composite
def pools(draw, d):
    kind = draw(st.sampled_from(["none", "max", "avg", "adaptive"]))
    if kind == "none":
        return None
    if kind == "adaptive":
        return ADAPTIVE[d](draw(st.integers(1, 2)))
    k = draw(st.integers(1, 2))
    stride = draw(st.sampled_from([None, 1, 2]))
    padding = draw(st.integers(0, k // 2))
    ceil = draw(st.booleans())
    if kind == "max":
        dilation = draw(st.integers(1, 2))
        if dilation > 1:
            # a dilated window may then hold no input element at all: PyTorch's
            # max_pool3d backward corrupts memory there (a torch bug, not curvlib's)
            padding = 0
        return MAXPOOL[d](k, stride=stride, padding=padding, dilation=dilation, ceil_mode=ceil)
    return AVGPOOL[d](k, stride=stride, padding=padding, ceil_mode=ceil, count_include_pad=draw(st.booleans()))


@st.composite
def cnns(draw, dims=(1, 2, 3)):
    """``(model, input shape without N)``: conv -> act -> [pad] -> [pool] -> dropout(eval) -> flatten -> linear."""
    d = draw(st.sampled_from(dims))
    groups = draw(st.integers(1, 2))
    c_in = groups * draw(st.integers(1, 2))
    c_out = groups * draw(st.integers(1, 2))
    kmax = 3 if d < 3 else 2
    kernel = tuple(draw(st.integers(1, kmax)) for _ in range(d))
    conv = CONV[d](
        c_in,
        c_out,
        kernel,
        stride=draw(st.integers(1, 2)),
        padding=draw(st.integers(0, 1)),
        dilation=draw(st.integers(1, 2)),
        groups=groups,
        bias=draw(st.booleans()),
        padding_mode=draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"])),
    )
    layers = [conv, ACTS[draw(st.sampled_from(sorted(ACTS)))]()]
    if d == 2 and draw(st.booleans()):
        layers.append(nn.ZeroPad2d(tuple(draw(st.integers(0, 1)) for _ in range(4))))
    pool = draw(pools(d))
    if pool is not None:
        layers.append(pool)
    if draw(st.booleans()):
        layers.append(nn.Dropout(0.5))
    smax = 5 if d < 3 else 3
    spatial = tuple(draw(st.integers(2, smax)) for _ in range(d))
    model = nn.Sequential(*layers).double().eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros((1, c_in) + spatial, dtype=torch.float64))
    except RuntimeError:
        assume(False)
    assume(out.numel() > 0)
    o = draw(st.integers(1, 3))
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(out.numel(), o)).double().eval()
    return model, (c_in,) + spatial, groups


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
    y = _data(model, X, loss, seed)
    lossfn = LOSSES[loss](reduction=reduction)
    if groups == 1:  # KFLR of the conv (all options, padding modes) and of the head
        check_second_order(model, lossfn, X, y, seed=seed, kflr=_linear_kflr_map(model))
    else:
        check_second_order(model, lossfn, X, y, seed=seed)
        with pytest.raises(CurvatureError, match=r"KFRA.*0\.weight.*groups=2"):
            curvature(model, lossfn, [KFRA()])(X, y)
        # KFLR: per-group factors (tests/test_kron_layers.py checks their values)
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
    y = _data(model, X, loss, 1)
    qs = check_second_order(model, LOSSES[loss](reduction=reduction), X, y)
    assert qs["sqrt_ggn_exact"]["0.weight"].shape[0] == 3 * (4 * 3 if d == 2 else 4)


class Functional(nn.Module):
    """Nonlinearities written as functions/methods/operators, two branches added and concatenated."""

    def __init__(self, which):
        super().__init__()
        self.which = which
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x)
        if self.which == 0:
            u, v = torch.sigmoid(h), nn.functional.gelu(self.b(x))
        elif self.which == 1:
            u, v = h.tanh(), torch.exp(0.5 * self.b(x)) / 3.0
        else:
            u, v = nn.functional.softplus(h, beta=2.0), self.b(x) ** 2 - nn.functional.silu(h)
        return self.c(torch.cat([u + v, 2 * u - v], dim=1))


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_functional_nonlinearities(which, loss):
    """Element-wise functions in the forward (not modules): Hessian diagonals and HMP
    against the full Hessian oracle (which needs no knowledge of the nonlinearities)."""
    torch.manual_seed(which)
    model = Functional(which).double()
    X = torch.randn(3, 3, dtype=torch.float64)
    y = _data(model, X, loss, which)
    lossfn = LOSSES[loss](reduction="sum")
    qs = curvature(model, lossfn, [DiagHessian(), BatchDiagHessian(), HMP(), DiagGGNExact()])(X, y)
    for name, p in model.named_parameters():
        Hn = hessian_per_sample(model, lossfn, X, y, name)
        _close(qs["diag_h"][name], Hn.sum(0).diagonal().reshape(p.shape), f"diag_h[{name}]")
        _close(qs["diag_h_batch"][name], Hn.diagonal(dim1=1, dim2=2).reshape((3,) + tuple(p.shape)), f"diag_h_batch[{name}]")
        V = torch.randn((2,) + tuple(p.shape), dtype=torch.float64)
        _close(qs["hmp"][name](V), (V.reshape(2, -1) @ Hn.sum(0)).reshape(V.shape), f"hmp[{name}]")
        G = ggn_per_sample(model, lossfn, X, y, name).sum(0)
        _close(qs["diag_ggn_exact"][name], G.diagonal().reshape(p.shape), f"diag_ggn_exact[{name}]")


class Twice(nn.Module):
    """One Linear applied twice: its parameters are used by two sites."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.act = nn.Tanh()
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        return self.out(self.fc(self.act(self.fc(x))))


def check_hessian_diagonals(model, lossfn, X, y):
    """DiagHessian and BatchDiagHessian against torch.func Hessian blocks (any graph)."""
    qs = curvature(model, lossfn, [DiagHessian(), BatchDiagHessian()])(X, y)
    params = detached_params(model)
    for name in trainable_names(model):
        p = params[name]
        H = hessian_block(model, lossfn, X, y, name)
        _close(qs["diag_h"][name], H.diagonal().reshape(p.shape), f"diag_h[{name}]")
        Hn = hessian_per_sample(model, lossfn, X, y, name)
        _close(
            qs["diag_h_batch"][name],
            Hn.diagonal(dim1=1, dim2=2).reshape((X.shape[0],) + tuple(p.shape)),
            f"diag_h_batch[{name}]",
        )


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_shared_parameters(loss):
    """GGN family, products and the Hessian diagonals include the cross terms between
    uses (weight-input coupling of the second use); KFLR treats the uses like positions."""
    torch.manual_seed(0)
    model = Twice().double()
    X = torch.randn(4, 3, dtype=torch.float64)
    y = _data(model, X, loss, 0)
    lossfn = LOSSES[loss](reduction="sum")
    check_second_order(model, lossfn, X, y, hessian=False)
    check_hessian_diagonals(model, lossfn, X, y)
    qs = curvature(model, lossfn, [KFLR()])(X, y)
    for role in ("weight", "bias"):
        B, A = _kron_reference_shared(model, lossfn, X, y, model.fc)
        _close(qs["kflr"][f"fc.{role}"][0], B, f"kflr[fc.{role}][B]")
        if role == "weight":
            _close(qs["kflr"]["fc.weight"][1], A, "kflr[fc.weight][A]")


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
    for name, (mname, role) in _linear_kflr_map(model).items():
        want = kron_reference(model, lossfn, X, y, mname, role)
        got = qs["kflr"][name]
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            _close(a, b, f"kflr[{name}][{i}]")


@st.composite
def conv_transposes(draw):
    d = draw(st.sampled_from([1, 2, 3]))
    groups = draw(st.integers(1, 2))
    c_in = groups * draw(st.integers(1, 2))
    c_out = groups * draw(st.integers(1, 2))
    stride = draw(st.integers(1, 2))
    dilation = draw(st.integers(1, 2))
    kernel = draw(st.integers(1, 2))
    up = CONVT[d](
        c_in, c_out, kernel, stride=stride, padding=draw(st.integers(0, 1)),
        output_padding=draw(st.integers(0, max(stride, dilation) - 1)), groups=groups,
        bias=draw(st.booleans()), dilation=dilation,
    )
    spatial = tuple(draw(st.integers(1, 3 if d < 3 else 2)) for _ in range(d))
    act = ACTS[draw(st.sampled_from(sorted(ACTS)))]()
    body = nn.Sequential(up, act).double()
    try:
        with torch.no_grad():
            out = body(torch.zeros((1, c_in) + spatial, dtype=torch.float64))
    except RuntimeError:
        assume(False)
    assume(out.numel() > 0)
    model = nn.Sequential(up, act, nn.Flatten(), nn.Linear(out.numel(), 2)).double()
    return model, (c_in,) + spatial


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
    y = _data(model, X, loss, seed)
    check_second_order(model, LOSSES[loss](reduction=reduction), X, y, seed=seed)


# ----------------------------------------------------------------------------- BatchNorm, Embedding


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
    y = _data(model, X, loss, seed)
    check_second_order(model, LOSSES[loss](reduction=reduction), X, y, seed=seed)


class MeanEmbedding(nn.Module):
    """``idx [N, S]`` -> embedding -> Tanh -> mean over ``S`` -> Linear."""

    def __init__(self, v, d, o, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(v, d, padding_idx=padding_idx)
        self.act = nn.Tanh()
        self.head = nn.Linear(d, o)

    def forward(self, idx):
        return self.head(self.act(self.emb(idx)).mean(1))


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
    y = _data(model, X, loss, seed)
    check_second_order(
        model, LOSSES[loss](reduction=reduction), X, y, seed=seed,
        constant_rows={"emb.weight": 0} if pad else None,
    )


@pytest.mark.parametrize("ext_cls", [GGNMP, HMP, PCHMP])
def test_embedding_padding_row_products(ext_cls):
    """With ``padding_idx`` autograd holds that row constant (zero gradient), so the
    GGN/Hessian blocks have zero rows *and* columns there (what the diagonals and
    the square root use); a product must not let a direction's padding-row
    component leak into the other rows."""
    torch.manual_seed(0)
    model = MeanEmbedding(3, 2, 2, padding_idx=0).double()
    X = torch.tensor([[0, 1], [1, 1], [2, 0]])
    y = torch.randn(3, 2, dtype=torch.float64)
    lossfn = nn.MSELoss(reduction="sum")
    ext = ext_cls()
    prod = curvature(model, lossfn, [ext])(X, y)[ext.name]["emb.weight"]
    G = ggn_per_sample(model, lossfn, X, y, "emb.weight").sum(0)
    H = hessian_block(model, lossfn, X, y, "emb.weight")
    want = {"ggnmp": G, "hmp": H, "pchmp": G + residual_block(model, lossfn, X, y, "emb.weight", "clip")}[ext.name]
    V = torch.eye(6, dtype=torch.float64).reshape(6, 3, 2)
    _close(prod(V).reshape(6, 6), want, f"{ext.name}[emb.weight] with padding_idx")


# ----------------------------------------------------------------------------- RNN / LSTM


class RecurrentNet(nn.Module):
    def __init__(self, kind, i, h, o, layers, batch_first, bidirectional):
        super().__init__()
        cls = {"rnn": nn.RNN, "lstm": nn.LSTM, "gru": nn.GRU}[kind]
        self.rnn = cls(i, h, num_layers=layers, batch_first=batch_first, bidirectional=bidirectional)
        self.batch_first = batch_first
        self.fc = nn.Linear(h * (2 if bidirectional else 1), o)

    def forward(self, x):
        out, _ = self.rnn(x if self.batch_first else x.transpose(0, 1))
        if not self.batch_first:
            out = out.transpose(0, 1)
        return self.fc(out[:, -1])


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
    y = _data(model, X, loss, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_second_order(model, LOSSES[loss](reduction=reduction), X, y, hessian=False, seed=seed)


@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
def test_recurrent_hessian_family(kind):
    """The recurrent cell's nonlinearities are nodes of the unrolled graph: the Hessian
    diagonal is exact (once refused; full coverage in tests/rules/test_rnn_hessian.py),
    and PCHMP runs."""
    torch.manual_seed(0)
    model = RecurrentNet(kind, 2, 3, 2, 1, True, False).double()
    X = torch.randn(3, 4, 2, dtype=torch.float64)
    y = torch.randn(3, 2, dtype=torch.float64)
    lossfn = nn.MSELoss()
    qs = curvature(model, lossfn, [DiagHessian(), PCHMP()])(X, y)
    for name, p in model.named_parameters():
        H = torch.autograd.functional.hessian(
            lambda t: lossfn(torch.func.functional_call(model, {name: t}, (X,)), y), p.detach())
        _close(qs["diag_h"][name], H.reshape(p.numel(), p.numel()).diagonal().reshape(p.shape), f"diag_h[{name}]")
        assert qs["pchmp"][name](torch.ones((1,) + tuple(p.shape), dtype=torch.float64)).shape == (1,) + p.shape


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


# ----------------------------------------------------------------------------- Monte Carlo

MC_SIZES = (1, 100, 10000)


def _tiny(loss):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    X = torch.randn(4, 3, generator=seeded(1), dtype=torch.float64)
    y = _data(model, X, loss, 1)
    return model, LOSSES[loss](), X, y


def _rel(est: Dict[str, torch.Tensor], exact: Dict[str, torch.Tensor]) -> float:
    num = sum(((est[k] - exact[k]) ** 2).sum() for k in exact)
    den = sum((exact[k] ** 2).sum() for k in exact)
    return float((num / den) ** 0.5)


def _errors(ext_cls, loss, read, exact, seed=0):
    model, lossfn, X, y = _tiny(loss)
    errs = {}
    for m in MC_SIZES:
        ext = ext_cls(mc_samples=m, generator=seeded(seed))
        qs = curvature(model, lossfn, [ext])(X, y)
        errs[m] = _rel(read(qs[ext.name]), exact)
    return errs


def _assert_converges(errs):
    assert errs[10000] < 0.1, errs
    assert errs[10000] < errs[100] / 3, errs
    assert errs[100] < errs[1], errs


def _exact_ggn(loss):
    model, lossfn, X, y = _tiny(loss)
    return {name: ggn_per_sample(model, lossfn, X, y, name) for name in trainable_names(model)}


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_diag_ggn_mc_converges(loss):
    Gn = _exact_ggn(loss)
    params = detached_params(_tiny(loss)[0])
    exact = {k: v.sum(0).diagonal().reshape(params[k].shape) for k, v in Gn.items()}
    _assert_converges(_errors(DiagGGNMC, loss, lambda r: r, exact))


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_batch_diag_ggn_mc_converges(loss):
    Gn = _exact_ggn(loss)
    params = detached_params(_tiny(loss)[0])
    exact = {k: v.diagonal(dim1=1, dim2=2).reshape((4,) + tuple(params[k].shape)) for k, v in Gn.items()}
    _assert_converges(_errors(BatchDiagGGNMC, loss, lambda r: r, exact))


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_sqrt_ggn_mc_outer_products_converge(loss):
    """``Σ_m s_{m,n} s_{m,n}ᵀ`` -> the per-sample GGN block ``G_n``; shape ``[M, N, *p]``."""
    Gn = _exact_ggn(loss)
    params = detached_params(_tiny(loss)[0])

    def read(r):
        out = {}
        for k, s in r.items():
            assert s.shape[1:] == (4,) + tuple(params[k].shape)
            sf = s.reshape(s.shape[0], 4, -1)
            out[k] = torch.einsum("mnp,mnq->npq", sf, sf)
        return out

    _assert_converges(_errors(SqrtGGNMC, loss, read, Gn))


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_kfac_converges_to_kflr(loss):
    """KFAC's output factor ``B`` -> KFLR's; the input factor ``A`` is exact for any M."""
    model, lossfn, X, y = _tiny(loss)
    exact = {}
    A = {}
    for name in trainable_names(model):
        mname, role = name.split(".")
        exact[name] = kron_output_factor(model, lossfn, X, y, mname)
        if role == "weight":
            A[name] = kron_input_factor(model, X, mname)

    def read(r):
        for k, a in A.items():
            assert len(r[k]) == 2
            _close(r[k][1], a, f"kfac[{k}][1]")
        return {k: f[0] for k, f in r.items()}

    _assert_converges(_errors(KFAC, loss, read, exact))


@pytest.mark.parametrize("ext_cls", [DiagGGNMC, BatchDiagGGNMC, SqrtGGNMC, KFAC])
def test_mc_reproducible_with_generator(ext_cls):
    model, lossfn, X, y = _tiny("ce")

    def run(seed):
        ext = ext_cls(mc_samples=3, generator=seeded(seed))
        return curvature(model, lossfn, [ext])(X, y)[ext.name]

    a, b, c = run(5), run(5), run(6)
    flat = lambda r: torch.cat([torch.cat([f.flatten() for f in v]) if isinstance(v, list) else v.flatten() for v in r.values()])  # noqa: E731
    assert torch.equal(flat(a), flat(b))
    assert not torch.equal(flat(a), flat(c))
    if ext_cls is SqrtGGNMC:
        assert all(v.shape[0] == 3 for v in a.values())


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_mc_sample_mean_matches_exact_diag(loss):
    """Averaging many independent 1-sample DiagGGNMC estimates (fresh seeds) gives ``diag G``."""
    model, lossfn, X, y = _tiny(loss)
    exact = curvature(model, lossfn, [DiagGGNExact()])(X, y)["diag_ggn_exact"]
    k = 300
    acc = {n: 0 for n in exact}
    for seed in range(k):
        r = curvature(model, lossfn, [DiagGGNMC(mc_samples=10, generator=seeded(seed))])(X, y)
        for n_ in exact:
            acc[n_] = acc[n_] + r["diag_ggn_mc"][n_] / k
    assert _rel(acc, exact) < 0.1


# ----------------------------------------------------------------------------- refusals


def test_kfra_refused_on_batchnorm_weight():
    """KFRA has no factors for BatchNorm (KFLR/KFAC give its exact blocks: tests/test_kron_layers.py)."""
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


def test_unused_parameter():
    """A parameter the forward never uses: zero curvature of the right shape; KFLR refuses it."""

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
    with pytest.raises(CurvatureError, match=r"'b\.weight'"):
        curvature(model, lossfn, [KFLR()])(X, y)


def _kron_reference_shared(model, lossfn, X, y, module):
    """KFLR factors of a Linear over all its calls and positions, explicitly:
    ``B = Σ_n J_nᵀ H_n J_n`` with ``J_n`` the Jacobian of the output w.r.t. a
    per-sample offset ``δ_n [O]`` added at every position of every call, and
    ``A = (1/N) Σ_{calls, n, s} x xᵀ``."""
    inputs, state = [], {"delta": None}

    def hook(mod, args, out):
        inputs.append(args[0].detach())
        if state["delta"] is None:
            return out
        shape = (out.shape[0],) + (1,) * (out.dim() - 2) + (out.shape[-1],)
        return out + state["delta"].reshape(shape)

    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(X)
        n, o = X.shape[0], module.out_features

        def f(delta):
            state["delta"] = delta
            return model(X)

        J = torch.func.jacrev(f)(torch.zeros(n, o, dtype=X.dtype))
    finally:
        handle.remove()
    J = J.reshape(n, -1, n, o)
    Jn = torch.stack([J[i, :, i, :] for i in range(n)])  # [N, C, O]
    Hb = torch.stack([
        torch.func.hessian(lambda z: lossfn(torch.cat([out[:i], z.unsqueeze(0), out[i + 1:]]), y))(out[i]).reshape(Jn.shape[1], Jn.shape[1])
        for i in range(n)
    ])
    B = torch.einsum("nco,ncd,ndq->oq", Jn, Hb, Jn)
    calls = inputs[: len(inputs) // 2]  # the first (hook-free) forward's calls
    A = sum(torch.einsum("nsi,nsj->ij", x.reshape(n, -1, x.shape[-1]), x.reshape(n, -1, x.shape[-1])) for x in calls) / n
    return B, A


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
        B, A = _kron_reference_shared(model, lossfn, X, y, model[i])
        _close(qs["kflr"][f"{i}.weight"][0], B, f"kflr[{i}.weight][B]")
        _close(qs["kflr"][f"{i}.weight"][1], A, f"kflr[{i}.weight][A]")
        _close(qs["kflr"][f"{i}.bias"][0], B, f"kflr[{i}.bias][B]")
        assert qs["kfac"][f"{i}.weight"][0].shape == B.shape


class Softmaxed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.b(torch.softmax(self.a(x), dim=1))


class Product(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.c(self.a(x) * self.b(x))


class Divided(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.c(self.a(x) / (1.5 + torch.sigmoid(self.b(x))) + x.mean(1, keepdim=True) ** 2)


@pytest.mark.parametrize("model_cls, node", [(Softmaxed, "softmax"), (Product, "mul"), (Divided, "truediv")])
def test_hessian_of_non_elementwise_nodes(model_cls, node):
    """Products, softmax, division: the Hessian diagonals are exact (dense or structured
    residuals); the GGN family is right too."""
    torch.manual_seed(0)
    model = model_cls().double()
    X = torch.randn(3, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (3,))
    lossfn = nn.CrossEntropyLoss()
    check_hessian_diagonals(model, lossfn, X, y)
    qs = curvature(model, lossfn, [DiagGGNExact()])(X, y)
    for name, p in model.named_parameters():
        G = ggn_per_sample(model, lossfn, X, y, name).sum(0)
        _close(qs["diag_ggn_exact"][name], G.diagonal().reshape(p.shape), f"diag_ggn_exact[{name}]")


@pytest.mark.parametrize("ext_cls", [DiagGGNMC, BatchDiagGGNMC, SqrtGGNMC, KFAC])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3", None])
def test_bad_mc_samples(ext_cls, bad):
    with pytest.raises(CurvatureError, match="mc_samples"):
        ext_cls(mc_samples=bad)


@pytest.mark.parametrize("ext_cls", [DiagGGNMC, BatchDiagGGNMC, SqrtGGNMC, KFAC])
def test_bad_generator(ext_cls):
    with pytest.raises(TypeError, match="generator"):
        ext_cls(generator=0)


def test_bad_pchmp_modify():
    with pytest.raises(CurvatureError, match="modify"):
        PCHMP(modify="bad")
    assert PCHMP().modify == "clip"


@pytest.mark.parametrize("ext_cls", [GGNMP, HMP, PCHMP])
def test_products_refuse_wrong_shapes(ext_cls):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Sigmoid(), nn.Linear(2, 2)).double()
    X = torch.randn(3, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (3,))
    ext = ext_cls()
    prod = curvature(model, nn.CrossEntropyLoss(), [ext])(X, y)[ext.name]["0.weight"]
    for bad in (
        torch.randn(2, 3, dtype=torch.float64),  # p.shape without the V dim
        torch.randn(1, 3, 2, dtype=torch.float64),  # transposed
        torch.randn(1, 1, 2, 3, dtype=torch.float64),  # one dim too many
        [[0.0] * 3] * 2,  # not a tensor
    ):
        with pytest.raises(CurvatureError, match=r"0\.weight"):
            prod(bad)


@pytest.mark.parametrize("ext_cls", [GGNMP, HMP, PCHMP])
def test_products_with_no_vectors(ext_cls):
    """``V = 0`` directions: an empty ``[0, *p.shape]`` result."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Sigmoid(), nn.Linear(2, 2)).double()
    X = torch.randn(3, 3, dtype=torch.float64)
    ext = ext_cls()
    prod = curvature(model, nn.CrossEntropyLoss(), [ext])(X, torch.randint(0, 2, (3,)))[ext.name]["0.weight"]
    assert prod(torch.zeros(0, 2, 3, dtype=torch.float64)).shape == (0, 2, 3)


@pytest.mark.parametrize("depth", [1, 2])
def test_hmp_mse_mean(depth):
    """HMP with the default ``MSELoss()`` (reduction="mean")."""
    torch.manual_seed(0)
    layers = [nn.Linear(3, 3), nn.Tanh()] * (depth - 1) + [nn.Linear(3, 2)]
    model = nn.Sequential(*layers).double()
    X = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    lossfn = nn.MSELoss()
    qs = curvature(model, lossfn, [HMP()])(X, y)
    for name, p in model.named_parameters():
        V = torch.randn((2,) + tuple(p.shape), dtype=torch.float64)
        H = hessian_block(model, lossfn, X, y, name)
        _close(qs["hmp"][name](V), (V.reshape(2, -1) @ H).reshape(V.shape), f"hmp[{name}]")


# ----------------------------------------------------------------------------- BackPACK


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
    y = _data(model, X, loss, 1)
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
                    _close(a, b, f"{c.name}[{name}][{i}] vs BackPACK")
            else:
                _close(got, want, f"{c.name}[{name}] vs BackPACK")


def _pch_reference_product(model, lossfn, X, y, name, modify):
    """``G_p + Σ_n J_nᵀ mod(R_n) J_n`` for ``Product`` (``z = a(x) ⊙ b(x)``), built
    explicitly: ``R_n = [[0, diag g_n], [diag g_n, 0]]`` over ``(a(x_n), b(x_n))``,
    ``mod`` on its eigenvalues, ``J_n`` the Jacobian of ``(a(x_n), b(x_n))`` w.r.t. ``p``."""
    params = detached_params(model)
    p0 = params[name]

    def branches(p):
        full = {**params, name: p}
        xa = torch.func.functional_call(model.a, {k[2:]: v for k, v in full.items() if k.startswith("a.")}, (X,))
        xb = torch.func.functional_call(model.b, {k[2:]: v for k, v in full.items() if k.startswith("b.")}, (X,))
        return torch.cat([xa, xb], dim=1)  # [N, 2D]

    u = branches(p0)
    d = u.shape[1] // 2
    z = (u[:, :d] * u[:, d:]).detach().requires_grad_(True)
    (g,) = torch.autograd.grad(lossfn(model.c(z), y), z)
    J = torch.func.jacrev(branches)(p0).reshape(X.shape[0], 2 * d, -1)  # [N, 2D, P]
    total = ggn_block(model, lossfn, X, y, name)
    for n in range(X.shape[0]):
        R = torch.zeros(2 * d, 2 * d, dtype=X.dtype)
        R[:d, d:] = torch.diag(g[n])
        R[d:, :d] = torch.diag(g[n])
        lam, Q = torch.linalg.eigh(R)
        lam = lam.clamp(min=0) if modify == "clip" else lam.abs()
        total = total + J[n].T @ (Q @ torch.diag(lam) @ Q.T) @ J[n]
    return total.reshape(p0.numel(), p0.numel())


@pytest.mark.parametrize("modify", ["clip", "abs"])
def test_pchmp_on_products(modify):
    """PCHMP on a product of two branches: the eigenvalue-modified residual (Chen et al.'s
    definition extended from element-wise activations), against an explicit block."""
    torch.manual_seed(0)
    model = Product().double()
    X = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (4,))
    lossfn = nn.CrossEntropyLoss()
    qs = curvature(model, lossfn, [PCHMP(modify=modify)])(X, y)
    for name, p in model.named_parameters():
        if not name.startswith(("a.", "b.")):
            continue
        ref = _pch_reference_product(model, lossfn, X, y, name, modify)
        V = torch.randn((3,) + tuple(p.shape), dtype=torch.float64)
        _close(qs["pchmp"][name](V), (V.reshape(3, -1) @ ref).reshape(V.shape), f"pchmp[{name}] ({modify})")


@pytest.mark.parametrize("chunk_size,auto_bytes", [(1, None), (2, None), (5, None), ("auto", 1), ("auto", 200)])
def test_chunk_size_gives_identical_results(chunk_size, auto_bytes, monkeypatch):
    """Pulling the columns back in chunks changes memory, not results (``"auto"``
    with a tiny byte budget: one column, or a few, per chunk)."""
    import curvlib._plan.budget as budget

    if auto_bytes is not None:
        monkeypatch.setattr(budget, "AUTO_CHUNK_BYTES", auto_bytes)
        monkeypatch.setattr(budget, "AUTO_CHUNK_BYTES_CPU", auto_bytes)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3), nn.Sigmoid(), nn.Linear(3, 3)).double()
    X = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (4,))
    exts = lambda: [DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), KFLR(), DiagHessian(), BatchDiagHessian(),  # noqa: E731
                    DiagGGNMC(mc_samples=5, generator=seeded(1))]
    whole = curvature(model, nn.CrossEntropyLoss(), exts(), chunk_size=None)(X, y)
    chunked = curvature(model, nn.CrossEntropyLoss(), exts(), chunk_size=chunk_size)(X, y)
    for key in ("diag_ggn_exact", "diag_ggn_exact_batch", "sqrt_ggn_exact", "diag_h", "diag_h_batch", "diag_ggn_mc"):
        for name in whole[key]:
            _close(chunked[key][name], whole[key][name], f"{key}[{name}] chunk_size={chunk_size}")
    for name in whole["kflr"]:
        for a, b in zip(chunked["kflr"][name], whole["kflr"][name]):
            _close(a, b, f"kflr[{name}] chunk_size={chunk_size}")


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "all"])
def test_chunk_size_validated(bad):
    with pytest.raises(ValueError, match="chunk_size must be a positive int, 'auto' or None"):
        curvature(nn.Linear(2, 2), nn.MSELoss(), [DiagGGNExact()], chunk_size=bad)


def test_auto_chunk_size_follows_the_byte_budget(monkeypatch):
    """``"auto"``: columns per chunk = budget // bytes of one column's site outputs."""
    import curvlib._plan.budget as budget
    from curvlib._plan.plan import Plan

    plan = Plan(out_shape=(4, 3), out_dtype=torch.float32, site_shapes=((4, 5), (4, 3)),
                site_dtypes=(torch.float32, torch.float64), batch_dims=(0, 0))
    per_column = 4 * 5 * 4 + 4 * 3 * 8
    monkeypatch.setenv("CURVLIB_STRATEGY", "auto")  # (the strategy by device; forced ones below)
    monkeypatch.setattr(budget, "AUTO_CHUNK_BYTES", 3 * per_column + 1)
    monkeypatch.setattr(budget, "AUTO_CHUNK_BYTES_CPU", 2 * per_column)
    monkeypatch.setattr("curvlib._core.tensors.available_bytes", lambda device: None)  # (no GPU here)
    assert budget.auto_chunk_size(plan) == 3
    assert budget.auto_chunk_size(plan, [DiagGGNExact()], "cpu") == 2
    assert budget.auto_chunk_size(plan, [DiagGGNExact(), BatchDiagGGNExact()], "cpu") == 3
    monkeypatch.setattr(budget, "AUTO_CHUNK_BYTES", 1)
    assert budget.auto_chunk_size(plan) == 1
    # CUDA: up to a share of the free device memory (read per call), never below the budget
    monkeypatch.setattr("curvlib._core.tensors.available_bytes", lambda device: 80 * per_column)
    assert budget.auto_chunk_size(plan, [DiagGGNExact()], "cuda") == 10
    assert budget.auto_chunk_size(plan, [DiagGGNExact()], torch.device("cuda", 0)) == 10
    monkeypatch.setattr(budget, "AUTO_CHUNK_BYTES", 3 * per_column + 1)
    monkeypatch.setattr("curvlib._core.tensors.available_bytes", lambda device: None)
    assert budget.auto_chunk_size(plan, [DiagGGNExact()], "cuda") == 3
    assert budget.auto_chunk_size(plan, [DiagGGNExact()], "cpu") == 2  # the CPU never reads it
    # forced strategies: "batched" on a CPU takes the large budget (no free memory read),
    # "looped" on CUDA the small one
    monkeypatch.setattr("curvlib._core.tensors.available_bytes", lambda device: 80 * per_column)
    with curvlib.strategy("batched"):
        assert budget.auto_chunk_size(plan, [DiagGGNExact()], "cpu") == 3
        assert budget.auto_chunk_size(plan, [DiagGGNExact()], "cuda") == 10
    with curvlib.strategy("looped"):
        assert budget.auto_chunk_size(plan, [DiagGGNExact()], "cuda") == 2
    monkeypatch.setenv("CURVLIB_STRATEGY", "batched")
    assert budget.auto_chunk_size(plan, [DiagGGNExact()], "cpu") == 3


def test_sqrt_columns_loop_equals_vmap(monkeypatch):
    """SqrtGGNExact/MC column by column (default) and vmapped over columns agree."""
    import curvlib._evaluate.read_off as read_off

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh(), nn.Linear(4, 3), nn.Flatten(), nn.Linear(9, 3)).double()
    X = torch.randn(5, 2, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    exts = lambda: [SqrtGGNExact(), SqrtGGNMC(mc_samples=3, generator=seeded(2))]  # noqa: E731
    looped = curvature(model, nn.CrossEntropyLoss(), exts())(X, y)
    monkeypatch.setattr(read_off, "LOOP_SQRT_COLUMNS", False)
    vmapped = curvature(model, nn.CrossEntropyLoss(), exts())(X, y)
    for key in ("sqrt_ggn_exact", "sqrt_ggn_mc"):
        for name in looped[key]:
            _close(looped[key][name], vmapped[key][name], f"{key}[{name}]")
