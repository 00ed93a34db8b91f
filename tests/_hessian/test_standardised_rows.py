"""Weight-standardised convolutions (timm's ``ScaledStdConv2d``, NFNets): ``conv(x, h(W, γ), b)``
with each output channel's weight standardised on its own (``curvlib._hessian.rows``). The
blocks of ``W``, ``γ``, ``b`` are block-diagonal over output channels, so their Hessian
diagonals come from ``K`` Hessian-vector products, and the input block (the node is linear in
``x``) is zero: no dense ``(|W| + |x|)²`` residual, which was refused for size on NFNet.
DiagHessian and BatchDiagHessian equal ``torch.func`` Hessian diagonals; a chain that mixes
the rows (a norm over the whole weight) keeps the dense residual, exact too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.func import functional_call, grad, jvp

from curvlib import curvature
from curvlib._hessian import rows as _rows
from curvlib._plan.traces import trace
from curvlib.rules import functional
from curvlib.extensions import BatchDiagHessian, DiagHessian

from oracles.cases import DT
from oracles.checks import check_hessian_diagonals
from oracles.on_device import seeded


class StdConv(nn.Conv2d):
    """``how``: ``"batch_norm"`` (timm's ScaledStdConv2d), ``"moments"`` (mean/var per output
    channel), ``"global"`` (divided by the whole weight's norm: rows mixed)."""

    def __init__(self, c_in, c_out, k, how, **kw):
        super().__init__(c_in, c_out, k, **kw)
        self.how = how
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(c_out, 1, 1, 1))
        self.scale = float(self.weight[0].numel()) ** -0.5

    def forward(self, x):
        w = self.weight
        if self.how == "batch_norm":
            w = F.batch_norm(w.reshape(1, self.out_channels, -1), None, None, weight=(self.gain * self.scale).view(-1),
                             training=True, momentum=0.0, eps=1e-5).reshape_as(w)
        elif self.how == "moments":
            w = self.gain * (w - w.mean(dim=(1, 2, 3), keepdim=True)) / torch.sqrt(
                w.var(dim=(1, 2, 3), keepdim=True, unbiased=False) + 1e-5)
        else:
            w = self.gain * w / w.norm()
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Net(nn.Module):
    def __init__(self, c: int, c_out: int, how: str, groups: int = 1, stride: int = 1):
        super().__init__()
        self.stem = nn.Conv2d(2, c, 3, padding=1)
        self.std = StdConv(c, c_out, 3, how, padding=1, groups=groups, stride=stride)
        self.head = nn.Linear(c_out, 3)

    def forward(self, x):
        return self.head(F.silu(self.std(torch.tanh(self.stem(x)))).mean((2, 3)))


def _problem(seed, n, c, c_out, hw, how, groups=1, stride=1):
    g = seeded(seed)
    torch.manual_seed(seed)
    X, y = torch.randn(n, 2, hw, hw, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)
    return Net(c, c_out, how, groups, stride).to(DT), nn.CrossEntropyLoss(), X, y


@settings(max_examples=10, deadline=None)
@given(how=st.sampled_from(["batch_norm", "moments", "global"]), n=st.integers(1, 3), groups=st.sampled_from([1, 2]),
       stride=st.sampled_from([1, 2]), hw=st.integers(2, 4), seed=st.integers(0, 50))
def test_standardised_conv_hessian_diagonals(how, n, groups, stride, hw, seed):
    check_hessian_diagonals(*_problem(seed, n, 2, 4, hw, how, groups, stride))


def _sampled_diagonal(model, lossfn, X, y, name, entries):
    """``[N, len(entries)]``: sample ``n``'s term of ``∇²_p L`` at flat ``entries``, by HVPs."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    p = params[name]
    with torch.no_grad():
        out0 = model(X)
    rows = []
    for i in range(X.shape[0]):
        mask = (torch.arange(X.shape[0]) == i).reshape((-1,) + (1,) * (out0.dim() - 1))

        def L(t, mask=mask):
            return lossfn(torch.where(mask, functional_call(model, {**params, name: t}, (X,)), out0), y)

        row = []
        for j in entries:
            e = torch.zeros(p.numel(), dtype=p.dtype)
            e[j] = 1
            row.append(jvp(grad(L), (p,), (e.reshape(p.shape),))[1].reshape(-1)[j])
        rows.append(torch.stack(row))
    return torch.stack(rows)


@pytest.mark.parametrize("how", ["batch_norm", "moments"])
def test_a_large_standardised_conv_is_not_refused(how):
    """``W [48, 16, 3, 3]`` on ``[2, 16, 8, 8]``: the dense residual, ``N·d² = 2 · 8032²``, was over
    the size limit; every parameter's diagonal checked at sampled entries."""
    model, lossfn, X, y = _problem(1, 2, 16, 48, 8, how)
    qs = curvature(model, lossfn, [DiagHessian(), BatchDiagHessian()])(X, y)
    gen = seeded(5)
    for name, p in model.named_parameters():
        entries = torch.randperm(p.numel(), generator=gen)[:12].tolist()
        want = _sampled_diagonal(model, lossfn, X, y, name, entries)
        torch.testing.assert_close(qs["diag_h_batch"][name].reshape(2, -1)[:, entries], want, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(qs["diag_h"][name].reshape(-1)[entries], want.sum(0), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("how,separable", [("batch_norm", True), ("moments", True), ("global", False)])
def test_rows_are_read_off_the_chain(how, separable):
    """Per-channel standardisation: separable rows, zero input block; a global norm: dense."""
    model, _, X, _ = _problem(0, 2, 2, 4, 3, how)
    program = trace(model, [DiagHessian()], X, real_input=True).program  # (as curvature traces it)
    params = dict(model.named_parameters())
    node = next(n for n in program.functional if "conv2d" in str(n.target))
    env = {}
    functional.run_nodes([a for a in program.graph.nodes if a.op == "get_attr"], env, program.root)
    found = _rows.separable_rows(program, node, env, {k: v.detach() for k, v in params.items()})
    assert found == (frozenset({"std.weight", "std.bias", "std.gain"}) if separable else frozenset())
    assert _rows.linear_in_inputs(program, node)
