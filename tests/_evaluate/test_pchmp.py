"""PCHMP on normalisations, modules used twice and batch layouts, against ``oracles.pchmp``.

Full blocks: curvlib's callable is applied to an identity ``[P, *p.shape]``
and compared, for every trainable parameter, with the explicit
``Σ J_uᵀ mod(R_n) J_u`` of the oracle, with one scale for the whole result
(the largest entry of any block). Models drawn by hypothesis:

* LayerNorm (affine or not, with or without bias, over one or two trailing
  dims, the batch in dim 0 or 1 of its input) between a Linear and a head;
* GroupNorm on ``[N, C, L]``;
* a Linear and/or a LayerNorm used twice, with a smooth nonlinearity between
  the uses, on ``[N, I]`` or ``[N, S, I]`` inputs.

The oracle itself is checked first: without modification its blocks are the
Hessian's (autograd's double backward).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st
from torch import Tensor, nn

from curvlib import curvature
from curvlib.extensions import BatchDiagHessian, DiagHessian

from oracles.checks import curvlib_blocks
from oracles.pchmp import assert_blocks_close, hessian_blocks_autograd, pchmp_blocks
from oracles.on_device import seeded

DT = torch.float64
RTOL = 1e-7
LOSSES = {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss, "bce": nn.BCEWithLogitsLoss}
ACTS = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "gelu": nn.functional.gelu, "identity": lambda h: h}


def check_pchmp(model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor, modify: str) -> None:
    assert_blocks_close(curvlib_blocks(model, lossfn, X, y, modify), pchmp_blocks(model, lossfn, X, y, modify),
                        f"pchmp ({modify})")


def _case(model: nn.Module, x_shape, loss: str, reduction: str, seed: int, freeze: str = "none"):
    """Random parameters (normalisations too), inputs and targets; ``freeze``: a
    parameter name suffix whose parameters are frozen."""
    gen = seeded(seed)
    model = model.to(DT)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=DT))
            p.requires_grad_(not name.endswith(freeze))
    X = torch.randn(x_shape, generator=gen, dtype=DT)
    with torch.no_grad():
        out = model(X)
    if loss == "ce":
        y = torch.randint(0, out.shape[1], (out.shape[0],), generator=gen)
    else:
        y = (torch.rand if loss == "bce" else torch.randn)(out.shape, generator=gen, dtype=DT)
    return model, LOSSES[loss](reduction=reduction), X, y


_common = dict(
    loss=st.sampled_from(sorted(LOSSES)),
    reduction=st.sampled_from(["mean", "sum"]),
    modify=st.sampled_from(["clip", "abs"]),
    seed=st.integers(0, 2**16),
)


# ----------------------------------------------------------------------------- models


class NormNet(nn.Module):
    """``x [N, T, I]`` -> Linear -> norm -> act -> flatten -> Linear.

    ``layout``: ``"ntd"`` (norm over the features of ``[N, T, D]``), ``"tnd"``
    (over those of ``[T, N, D]``: the batch in dim 1), ``"td"`` (over both
    trailing dims), ``"ncl"`` (GroupNorm on ``[N, D, T]``).
    """

    def __init__(self, i: int, t: int, d: int, norm: nn.Module, layout: str, act: str):
        super().__init__()
        self.a, self.norm, self.head = nn.Linear(i, d), norm, nn.Linear(t * d, 2)
        self.layout, self.act = layout, ACTS[act]

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if self.layout == "tnd":
            h = self.norm(h.transpose(0, 1)).transpose(0, 1)
        elif self.layout == "ncl":
            h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        else:
            h = self.norm(h)
        return self.head(self.act(h).flatten(1))


class Twice(nn.Module):
    """A Linear (``"linear"``), a LayerNorm (``"layernorm"``) or both used twice:
    ``head(u(act(fc(u(x)))))``-like chains with a smooth nonlinearity between the uses."""

    def __init__(self, d: int, s: int, which: str, bias: bool, act: str):
        super().__init__()
        self.fc, self.norm = nn.Linear(d, d, bias=bias), nn.LayerNorm(d)
        self.head = nn.Linear(d * max(s, 1), 2)
        self.which, self.act = which, ACTS[act]

    def forward(self, x: Tensor) -> Tensor:
        if self.which == "linear":
            h = self.fc(torch.tanh(self.fc(x)))
        elif self.which == "layernorm":
            h = self.norm(self.act(self.fc(self.norm(x))))
        else:
            h = self.norm(self.fc(torch.tanh(self.fc(self.norm(x)))))
        return self.head(self.act(h).flatten(1))


# ----------------------------------------------------------------------------- the oracle


@pytest.mark.parametrize("which", ["layernorm_tnd", "groupnorm", "linear_twice", "both_twice"])
def test_oracle_without_modification_is_the_hessian(which):
    """``Σ J_uᵀ R_n J_u`` (no modification) plus the GGN is ``∇²_p L``: the oracle's
    decomposition (nodes, ``u``, dropped couplings) loses nothing."""
    if which == "layernorm_tnd":
        model, shape = NormNet(2, 2, 3, nn.LayerNorm(3), "tnd", "tanh"), (3, 2, 2)
    elif which == "groupnorm":
        model, shape = NormNet(2, 2, 4, nn.GroupNorm(2, 4), "ncl", "gelu"), (3, 2, 2)
    else:
        model, shape = Twice(3, 2, which.split("_")[0], True, "sigmoid"), (3, 2, 3)
    model, lossfn, X, y = _case(model, shape, "ce", "mean", 0)
    assert_blocks_close(pchmp_blocks(model, lossfn, X, y, None), hessian_blocks_autograd(model, lossfn, X, y),
                        "oracle without modification vs Hessian")


# ----------------------------------------------------------------------------- properties


@given(
    n=st.integers(1, 3),
    t=st.integers(1, 2),
    d=st.integers(1, 3),
    layout=st.sampled_from(["ntd", "tnd", "td"]),
    affine=st.sampled_from(["both", "weight", "none"]),
    eps=st.sampled_from([1e-5, 0.5]),
    act=st.sampled_from(sorted(ACTS)),
    freeze=st.sampled_from(["none", "norm.weight", "a.weight"]),
    **_common,
)
def test_layernorm(n, t, d, layout, affine, eps, act, freeze, loss, reduction, modify, seed):
    shape = (t, d) if layout == "td" else (d,)
    norm = nn.LayerNorm(shape, eps=eps, elementwise_affine=affine != "none", bias=affine == "both")
    model = NormNet(2, t, d, norm, layout, act)
    check_pchmp(*_case(model, (n, t, 2), loss, reduction, seed, freeze), modify)


@given(
    n=st.integers(1, 3),
    groups=st.integers(1, 2),
    per_group=st.integers(1, 2),
    length=st.integers(1, 2),
    affine=st.booleans(),
    act=st.sampled_from(sorted(ACTS)),
    **_common,
)
def test_groupnorm(n, groups, per_group, length, affine, act, loss, reduction, modify, seed):
    if per_group * length == 1:
        length = 2  # a group of one value: torch refuses to normalise it
    c = groups * per_group
    model = NormNet(2, length, c, nn.GroupNorm(groups, c, affine=affine), "ncl", act)
    check_pchmp(*_case(model, (n, length, 2), loss, reduction, seed), modify)


@given(
    n=st.integers(1, 3),
    d=st.integers(1, 3),
    s=st.integers(0, 2),
    which=st.sampled_from(["linear", "layernorm", "both"]),
    bias=st.booleans(),
    act=st.sampled_from(sorted(ACTS)),
    freeze=st.sampled_from(["none", "fc.weight", "norm.bias"]),
    **_common,
)
def test_module_used_twice(n, d, s, which, bias, act, freeze, loss, reduction, modify, seed):
    model = Twice(d, s, which, bias, act)
    check_pchmp(*_case(model, (n, s, d) if s else (n, d), loss, reduction, seed, freeze), modify)


# ----------------------------------------------------------------------------- batch layouts


class BatchInDim1(nn.Module):
    """A nonlinear node of each residual kind on ``[T, N, D]`` (the batch in dim 1)."""

    def __init__(self, kind: str):
        super().__init__()
        self.a, self.norm, self.head = nn.Linear(2, 3), nn.LayerNorm(3), nn.Linear(6, 2)
        self.kind = kind

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x.transpose(0, 1))  # [T, N, D]
        if self.kind == "diag":
            h = torch.tanh(h)
        elif self.kind == "product":
            h = h * torch.sigmoid(h)
        elif self.kind == "dense":
            h = torch.softmax(h, dim=-1)
        else:
            h = torch.tanh(self.norm(h))
        return self.head(h.transpose(0, 1).flatten(1))


@pytest.mark.parametrize("kind", ["diag", "product", "dense", "layernorm"])
def test_residuals_with_the_batch_in_dim_1(kind):
    """Residuals are per sample, whichever dim holds the batch: the Hessian diagonals
    (signed columns) and PCHMP (modified blocks) against the oracle."""
    model, lossfn, X, y = _case(BatchInDim1(kind), (3, 2, 2), "mse", "mean", 1)
    qs = curvature(model, lossfn, [DiagHessian(), BatchDiagHessian()])(X, y)
    H = hessian_blocks_autograd(model, lossfn, X, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(qs["diag_h"][name], H[name].diagonal().reshape(p.shape), rtol=RTOL, atol=1e-10)
    per_sample = [hessian_blocks_autograd(model, lossfn, X[i:i + 1], y[i:i + 1]) for i in range(3)]
    for name, p in model.named_parameters():
        want = torch.stack([h[name].diagonal() / 3 for h in per_sample]).reshape((3,) + tuple(p.shape))
        torch.testing.assert_close(qs["diag_h_batch"][name], want, rtol=RTOL, atol=1e-10)
    for modify in ("clip", "abs"):
        check_pchmp(model, lossfn, X, y, modify)


class Scale(nn.Module):
    """A layer nonlinear in its own parameter (generic rule): ``tanh(x) softplus(s) + s³``."""

    def __init__(self, d: int):
        super().__init__()
        self.s = nn.Parameter(torch.zeros(d))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x) * nn.functional.softplus(self.s) + self.s**3


class ScaleNet(nn.Module):
    def __init__(self, twice: bool):
        super().__init__()
        self.a, self.scale, self.head = nn.Linear(3, 3), Scale(3), nn.Linear(3, 2)
        self.twice = twice

    def forward(self, x: Tensor) -> Tensor:
        h = self.scale(self.a(x))
        return self.head(self.scale(h) if self.twice else h)


@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
@pytest.mark.parametrize("loss", ["mse", "ce"])
def test_layer_nonlinear_in_its_parameter(twice, loss):
    """Used once, the parameter's own block ``∂²/∂s²`` is modified on its own (its
    coupling with the input enters no diagonal block); used twice, jointly with the
    second use's input, which depends on it."""
    model, lossfn, X, y = _case(ScaleNet(twice), (4, 3), loss, "sum", 3)
    assert_blocks_close(pchmp_blocks(model, lossfn, X, y, None), hessian_blocks_autograd(model, lossfn, X, y),
                        "oracle without modification vs Hessian")
    for modify in ("clip", "abs"):
        check_pchmp(model, lossfn, X, y, modify)
