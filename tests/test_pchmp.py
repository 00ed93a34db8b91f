"""PCHMP on normalisations, modules used twice and batch layouts, against ``oracles_pchmp``.

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

from typing import Dict

import pytest
import torch
from hypothesis import given, strategies as st
from torch import Tensor, nn

from curvlib import curvature
from curvlib.extensions import BatchDiagHessian, DiagHessian, PCHMP

from oracles_pchmp import hessian_blocks_autograd, pchmp_blocks

DT = torch.float64
RTOL = 1e-7
LOSSES = {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss, "bce": nn.BCEWithLogitsLoss}
ACTS = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "gelu": nn.functional.gelu, "identity": lambda h: h}


def assert_blocks_close(got: Dict[str, Tensor], want: Dict[str, Tensor], what: str) -> None:
    """Every block within ``RTOL`` of the largest entry of any block of ``want``."""
    assert list(got) == list(want), f"{what}: keys {list(got)} != {list(want)}"
    scale = max([float(w.abs().max()) for w in want.values()] + [1e-300])
    for name in want:
        err = float((got[name] - want[name]).abs().max())
        assert err <= RTOL * scale, f"{what}[{name}]: max error {err:.3e}, relative {err / scale:.3e}"


def curvlib_blocks(model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor, modify: str) -> Dict[str, Tensor]:
    """``{name: [P, P]}``: curvlib's PCHMP applied to the identity."""
    fns = curvature(model, lossfn, [PCHMP(modify=modify)])(X, y)["pchmp"]
    blocks = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            P = p.numel()
            blocks[name] = fns[name](torch.eye(P, dtype=DT).reshape((P,) + tuple(p.shape))).reshape(P, P)
    return blocks


def check_pchmp(model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor, modify: str) -> None:
    assert_blocks_close(curvlib_blocks(model, lossfn, X, y, modify), pchmp_blocks(model, lossfn, X, y, modify),
                        f"pchmp ({modify})")


def _case(model: nn.Module, x_shape, loss: str, reduction: str, seed: int, freeze: str = "none"):
    """Random parameters (normalisations too), inputs and targets; ``freeze``: a
    parameter name suffix whose parameters are frozen."""
    gen = torch.Generator().manual_seed(seed)
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
