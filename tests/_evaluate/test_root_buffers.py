"""Square roots written into one preallocated result (:mod:`curvlib._evaluate.root_buffers`).

With ``chunk_size`` and ``batch_chunk_size`` every column of ``SqrtGGNExact`` /
``SqrtGGNMC`` is written where it belongs instead of joining chunks and slices by
``torch.cat``. The reference is the joined path (columns vmapped, parts
concatenated: ``Settings.loop_sqrt_columns = False``), itself checked against oracles in
``test_second_order_exact.py``. The model has every kind of site the writer treats
apart: a Linear weight's outer product (batch in dim 0 and in dim 1), the same
weight used twice, a Linear over positions, a convolution, and a parameter no
site uses.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import curvlib._transform.chunking as chunking
import curvlib._evaluate.second_order as so
from curvlib import curvature
from curvlib._core.settings import override
from curvlib.extensions import BatchDiagGGNExact, BatchGrad, SqrtGGNExact, SqrtGGNMC
from oracles.on_device import seeded


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3)
        self.pos = nn.Linear(4, 3)  # over 3 positions per sample
        self.tied = nn.Linear(9, 9)  # used twice
        self.first = nn.Linear(9, 9)  # on [1, N, 9]: the batch in dim 1
        self.head = nn.Linear(9, 3)
        self.unused = nn.Parameter(torch.randn(2))

    def forward(self, x):
        h = torch.tanh(self.pos(self.conv(x))).flatten(1)
        h = self.first(h.unsqueeze(0)).squeeze(0)
        h = self.tied(torch.tanh(self.tied(h)))
        return self.head(torch.sigmoid(h))


def _problem(n=6, seed=0):
    torch.manual_seed(seed)
    model = _Net().double()
    X = torch.randn(n, 2, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (n,))
    return model, X, y


def _exts():
    return [SqrtGGNExact(), SqrtGGNMC(mc_samples=3, generator=seeded(2))]


def _roots(model, lossfn, X, y, **knobs):
    out = curvature(model, lossfn, _exts(), **knobs)(X, y)
    return {k: out[k] for k in ("sqrt_ggn_exact", "sqrt_ggn_mc")}


def _assert_same(got, ref, where):
    for key in ref:
        assert list(got[key]) == list(ref[key]), where
        for name in ref[key]:
            torch.testing.assert_close(got[key][name], ref[key][name], rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"{where} {key}[{name}]: {m}")


@pytest.mark.parametrize("knobs", [
    {"chunk_size": None}, {"chunk_size": 1}, {"chunk_size": 2},
    {"chunk_size": None, "batch_chunk_size": 4}, {"chunk_size": 1, "batch_chunk_size": 2},
])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_written_equals_joined(knobs, reduction):
    model, X, y = _problem()
    lossfn = nn.CrossEntropyLoss(reduction=reduction)
    written = _roots(model, lossfn, X, y, **knobs)
    with override(loop_sqrt_columns=False):
        joined = _roots(model, lossfn, X, y, **knobs)
    _assert_same(written, joined, str(knobs))
    assert torch.equal(written["sqrt_ggn_exact"]["unused"], torch.zeros(3, 6, 2, dtype=torch.float64))


def test_no_concatenation(monkeypatch):
    """Neither chunks nor slices are joined by ``torch.cat`` (one buffer per parameter);
    nor are the slices' per-sample gradients and batch diagonals (``[N, *p]``)."""

    def refuse(*args, **kwargs):
        raise AssertionError("square roots were concatenated")

    real = so._combine
    monkeypatch.setattr(so, "_combine", lambda q, *a, **k: refuse() if q == "sqrt" else real(q, *a, **k))
    monkeypatch.setattr(chunking, "_concatenated", refuse)
    model, X, y = _problem(n=7)
    exts = _exts() + [BatchGrad(), BatchDiagGGNExact()]
    out = curvature(model, nn.CrossEntropyLoss(), exts, chunk_size=1, batch_chunk_size=3)(X, y)
    assert out["sqrt_ggn_exact"]["tied.weight"].shape == (3, 7, 9, 9)
    assert out["grad_batch"]["conv.weight"].shape == (7, 3, 2, 3)
    assert out["sqrt_ggn_mc"]["conv.weight"].shape == (3, 7, 3, 2, 3)


def test_slice_with_nothing_counted():
    """A slice whose targets are all ignored contributes zeros, as when joined."""
    model, X, y = _problem()
    y[2:4] = -100
    lossfn = nn.CrossEntropyLoss(ignore_index=-100)
    exts = [SqrtGGNExact(), BatchGrad(), BatchDiagGGNExact()]
    whole = curvature(model, lossfn, exts)(X, y)
    sliced = curvature(model, lossfn, exts, chunk_size=1, batch_chunk_size=2)(X, y)
    for key in ("sqrt_ggn_exact", "grad_batch", "diag_ggn_exact_batch"):
        torch.testing.assert_close(sliced[key], whole[key], rtol=1e-10, atol=1e-12)
    assert all(torch.all(t[:, 2:4] == 0) for t in sliced["sqrt_ggn_exact"].values())
    assert all(torch.all(t[2:4] == 0) for t in sliced["grad_batch"].values())


def test_differentiable_results_still_joined():
    """Results that need autograd (``params`` requiring grad) take the joined path; the
    written one's values agree, and the gradient flows."""
    model, X, y = _problem()
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    f = curvature(model, nn.CrossEntropyLoss(), [SqrtGGNExact()], chunk_size=1, batch_chunk_size=4)
    diff = f(X, y, params=params)["sqrt_ggn_exact"]
    plain = f(X, y)["sqrt_ggn_exact"]
    for name in plain:
        torch.testing.assert_close(diff[name].detach(), plain[name], rtol=1e-10, atol=1e-12)
    (diff["head.weight"] ** 2).sum().backward()
    assert params["head.weight"].grad is not None
