"""Roots larger than the device's free memory are refused before any work (:mod:`curvlib._plan.budget`);
the device is asked again only when a root is not far below the last reading."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import curvlib._plan.budget as budget
from curvlib import CurvatureError, curvature
from curvlib._core.settings import current
from curvlib._core.strategy import strategy
from curvlib.extensions import DiagGGNExact, SqrtGGNMC


@pytest.fixture
def free(monkeypatch):
    """``free["bytes"]`` is what the device reports; ``free["asked"]`` counts the readings."""
    state = {"bytes": 2**40, "asked": 0}

    def available(device):
        state["asked"] += 1
        return state["bytes"]

    monkeypatch.setattr("curvlib._core.tensors.available_bytes", available)
    monkeypatch.setattr(budget, "_last_free", {})
    with strategy("looped"):  # (the batched strategy, CUDA's default, also reads it to size its blocks)
        yield state


def _f(ext):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    return curvature(model, nn.CrossEntropyLoss(), [ext]), torch.randn(6, 4), torch.randint(0, 3, (6,))


def test_root_larger_than_free_memory_refused(free):
    f, X, y = _f(DiagGGNExact())
    free["bytes"] = 3 * 6 * 3 * 4 - 1  # root [C=3, N=6, 3] in float32, one byte short
    with pytest.raises(CurvatureError, match="exact loss-Hessian root"):
        f(X, y)
    f2, X, y = _f(SqrtGGNMC(mc_samples=1000))
    with pytest.raises(CurvatureError, match="Use fewer mc_samples"):
        f2(X, y)


def test_small_root_not_rechecked(free):
    f, X, y = _f(DiagGGNExact())
    for _ in range(3):
        f(X, y)
    assert free["asked"] == 1  # 216 bytes, far below the last reading


def test_root_near_the_last_reading_rechecked(free):
    f, X, y = _f(DiagGGNExact())
    headroom = current().budget_headroom
    free["bytes"] = headroom * 3 * 6 * 3 * 4 - 1  # fits, but not headroom times over
    f(X, y)
    f(X, y)
    assert free["asked"] == 2
    free["bytes"] = 100  # memory went away: refused at the next call
    with pytest.raises(CurvatureError, match="more than the"):
        f(X, y)
