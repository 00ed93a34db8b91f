"""Hessian diagonals (``DiagHessian``, ``BatchDiagHessian``) where the residual terms matter:
element-wise functions written in the forward, products, softmax and division (dense or
structured residuals), recurrent cells; and where they vanish (piecewise-linear nets: the
Hessian family equals the GGN family). Against ``torch.func`` Hessians (float64).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

from curvlib import curvature
from curvlib.extensions import (
    BatchDiagGGNExact, BatchDiagHessian, DiagGGNExact, DiagHessian, GGNMP, HMP, PCHMP,
)

from oracles.cases import LOSSES, Product, RecurrentNet, target_for
from oracles.checks import check_close, check_hessian_diagonals
from oracles.second_order import ggn_per_sample, hessian_per_sample

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same'")


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
    y = target_for(model, X, loss, seed)
    lossfn = LOSSES[loss](reduction="sum")
    qs = curvature(model, lossfn, [DiagGGNExact(), DiagHessian(), BatchDiagGGNExact(), BatchDiagHessian(), GGNMP(), HMP(), PCHMP(modify="abs")])(X, y)
    for name, p in model.named_parameters():
        check_close(qs["diag_h"][name], qs["diag_ggn_exact"][name], f"diag_h vs diag_ggn [{name}]")
        check_close(qs["diag_h_batch"][name], qs["diag_ggn_exact_batch"][name], f"batch [{name}]")
        V = torch.randn((2,) + tuple(p.shape), dtype=torch.float64)
        check_close(qs["pchmp"][name](V), qs["ggnmp"][name](V), f"pchmp vs ggnmp [{name}]")
        check_close(qs["hmp"][name](V), qs["ggnmp"][name](V), f"hmp vs ggnmp [{name}]")


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
    y = target_for(model, X, loss, which)
    lossfn = LOSSES[loss](reduction="sum")
    qs = curvature(model, lossfn, [DiagHessian(), BatchDiagHessian(), HMP(), DiagGGNExact()])(X, y)
    for name, p in model.named_parameters():
        Hn = hessian_per_sample(model, lossfn, X, y, name)
        check_close(qs["diag_h"][name], Hn.sum(0).diagonal().reshape(p.shape), f"diag_h[{name}]")
        check_close(qs["diag_h_batch"][name], Hn.diagonal(dim1=1, dim2=2).reshape((3,) + tuple(p.shape)), f"diag_h_batch[{name}]")
        V = torch.randn((2,) + tuple(p.shape), dtype=torch.float64)
        check_close(qs["hmp"][name](V), (V.reshape(2, -1) @ Hn.sum(0)).reshape(V.shape), f"hmp[{name}]")
        G = ggn_per_sample(model, lossfn, X, y, name).sum(0)
        check_close(qs["diag_ggn_exact"][name], G.diagonal().reshape(p.shape), f"diag_ggn_exact[{name}]")


class Softmaxed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.b(torch.softmax(self.a(x), dim=1))


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
        check_close(qs["diag_ggn_exact"][name], G.diagonal().reshape(p.shape), f"diag_ggn_exact[{name}]")


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
        with torch.backends.cudnn.flags(enabled=False):  # (cuDNN's RNNs have no double backward)
            H = torch.autograd.functional.hessian(
                lambda t: lossfn(torch.func.functional_call(model, {name: t}, (X,)), y), p.detach())
        check_close(qs["diag_h"][name], H.reshape(p.numel(), p.numel()).diagonal().reshape(p.shape), f"diag_h[{name}]")
        assert qs["pchmp"][name](torch.ones((1,) + tuple(p.shape), dtype=torch.float64)).shape == (1,) + p.shape
