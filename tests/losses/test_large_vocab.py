"""Cross-entropy at a language model's vocabulary.

The Monte-Carlo root ``[M, N, V, T]`` is drawn with no other ``[N, V, T]``-sized tensor
for ``M = 1``: one allocation of that size, the softmax, over which the root is written
(counted with a dispatch mode: the ops whose output is new memory); the exact GGN family is refused before any work with
the root's size and the name of its Monte-Carlo extension.
"""

from __future__ import annotations

import time
from unittest import mock

import pytest
import torch
from oracles.on_device import seeded
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import curvlib._evaluate.second_order as secondorder
from curvlib import CurvatureError, curvature, losses
from curvlib._core.settings import override
from curvlib.extensions import BatchDiagGGNExact, DiagGGNExact, DiagGGNMC, DiagHessian, KFAC, KFLR, SqrtGGNExact


class BigAllocations(TorchDispatchMode):
    """The ops whose output is new memory (a storage none of their inputs has; views and
    in-place results are not) of at least ``numel`` entries."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        held = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel and t.untyped_storage().data_ptr() not in held:
                self.ops.append(str(func))
        return out


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_sampled_root_holds_one_logits_sized_tensor(reduction):
    n, v, t = 2, 3000, 6
    logits = torch.randn(n, t, v).transpose(1, 2)  # [N, V, T], classes innermost in memory
    y = torch.randint(0, v, (n, t))
    spec = losses.loss_spec(nn.CrossEntropyLoss(reduction=reduction))
    with BigAllocations(n * v * t) as big, override(draw_entries=2 * v):
        ((_, S),) = losses.curvature_at(spec, logits, y).sampled_roots(1, seeded(0))
    assert S.shape == (1, n, v, t)
    assert big.ops == ["aten._softmax.default"], big.ops  # the root is written over p
    torch.testing.assert_close(S.sum(2), torch.zeros(1, n, t), atol=1e-6, rtol=0)  # p − e_ŷ sums to 0


class LM(nn.Module):
    def __init__(self, vocab: int = 50257, d: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(torch.tanh(self.tok(idx))).transpose(1, 2)


@pytest.mark.parametrize("ext, mc", [(DiagGGNExact(), "DiagGGNMC"), (BatchDiagGGNExact(), "BatchDiagGGNMC"),
                                     (KFLR(max_factor_dim=4096), "KFAC"), (SqrtGGNExact(), "SqrtGGNMC"),
                                     (DiagHessian(), "DiagGGNMC")])
def test_exact_family_refused_before_work_naming_the_mc_extension(ext, mc, monkeypatch):
    model = LM()
    X, y = torch.randint(0, 50257, (4, 128)), torch.randint(0, 50257, (4, 128))
    calls = mock.Mock(side_effect=AssertionError("second-order work started"))
    monkeypatch.setattr(secondorder, "second_order", calls)
    start = time.perf_counter()
    with pytest.raises(CurvatureError, match=rf"\[6432896, 4, 50257, 128\] would take .* GiB.* {mc}\(mc_samples=1\)"):
        curvature(model, nn.CrossEntropyLoss(), [ext])(X, y)
    assert time.perf_counter() - start < 5.0 and not calls.called


def test_monte_carlo_runs_at_full_vocabulary():
    """Same draws: the head bias's diagonal KFAC factor is DiagGGNMC's bias diagonal."""
    torch.manual_seed(0)
    model = LM(d=8)
    X, y = torch.randint(0, 50257, (2, 8)), torch.randint(0, 50257, (2, 8))
    f = lambda ext: curvature(model, nn.CrossEntropyLoss(), [ext])(X, y)[ext.name]  # noqa: E731
    diag = f(DiagGGNMC(generator=seeded(0)))
    kfac = f(KFAC(generator=seeded(0), max_factor_dim=4096))
    assert diag["head.weight"].shape == (50257, 8)
    assert [f.shape for f in kfac["head.weight"]] == [(50257,), (8, 8)]
    torch.testing.assert_close(kfac["head.bias"][0], diag["head.bias"])


@pytest.mark.parametrize("entries", [1, 40])
def test_large_linear_layers_by_blocks_of_samples_and_columns(entries):
    """Linear layers on sequences too large for ``Settings.linear_squares_entries``: the squared
    individual gradients a block of samples at a time, the GGN's columns one at a time."""
    from curvlib.extensions import SumGradSquared, Variance

    torch.manual_seed(0)
    model = LM(vocab=11, d=4).double()
    X, y = torch.randint(0, 11, (5, 3)), torch.randint(0, 11, (5, 3))
    exts = [SumGradSquared(), Variance(), DiagGGNExact()]
    want = curvature(model, nn.CrossEntropyLoss(), exts)(X, y)
    with override(linear_squares_entries=entries):
        got = curvature(model, nn.CrossEntropyLoss(), exts)(X, y)
    for ext in exts:
        for name in want[ext.name]:
            torch.testing.assert_close(got[ext.name][name], want[ext.name][name])


def test_kflr_without_the_option_is_told_to_sample_first():
    """An exact root too large for the device is refused before the dense-factor budget:
    ``max_factor_dim`` would not make KFLR fit, KFAC does."""
    X, y = torch.randint(0, 50257, (4, 128)), torch.randint(0, 50257, (4, 128))
    with pytest.raises(CurvatureError, match=r"KFAC\(mc_samples=1\)"):
        curvature(LM(), nn.CrossEntropyLoss(), [KFLR()])(X, y)
