"""Root columns pulled back in chunks (``chunk_size``): the results do not change, ``"auto"``
follows the byte budget (:func:`curvlib._plan.budget.auto_chunk_size`, per device and forced
strategy), and square-root columns looped or vmapped agree.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import curvlib
from curvlib import curvature
from curvlib._core.settings import override
from curvlib.extensions import (
    BatchDiagGGNExact, BatchDiagHessian, DiagGGNExact, DiagGGNMC, DiagHessian, KFLR, SqrtGGNExact,
    SqrtGGNMC,
)

from oracles.checks import check_close
from oracles.on_device import seeded



@pytest.mark.parametrize("chunk_size,auto_bytes", [(1, None), (2, None), (5, None), ("auto", 1), ("auto", 200)])
def test_chunk_size_gives_identical_results(chunk_size, auto_bytes):
    """Pulling the columns back in chunks changes memory, not results (``"auto"``
    with a tiny byte budget: one column, or a few, per chunk)."""
    budgets = {} if auto_bytes is None else dict(auto_chunk_bytes=auto_bytes, auto_chunk_bytes_cpu=auto_bytes)
    with override(**budgets):
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
                check_close(chunked[key][name], whole[key][name], f"{key}[{name}] chunk_size={chunk_size}")
        for name in whole["kflr"]:
            for a, b in zip(chunked["kflr"][name], whole["kflr"][name]):
                check_close(a, b, f"kflr[{name}] chunk_size={chunk_size}")


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
    # (the device's free memory is simulated: no GPU here)
    monkeypatch.setattr("curvlib._core.tensors.available_bytes", lambda device: None)
    with override(auto_chunk_bytes=3 * per_column + 1, auto_chunk_bytes_cpu=2 * per_column):
        assert budget.auto_chunk_size(plan) == 3
        assert budget.auto_chunk_size(plan, [DiagGGNExact()], "cpu") == 2
        assert budget.auto_chunk_size(plan, [DiagGGNExact(), BatchDiagGGNExact()], "cpu") == 3
        with override(auto_chunk_bytes=1):
            assert budget.auto_chunk_size(plan) == 1
            # CUDA: up to a share of the free device memory (read per call), never below the budget
            monkeypatch.setattr("curvlib._core.tensors.available_bytes", lambda device: 80 * per_column)
            assert budget.auto_chunk_size(plan, [DiagGGNExact()], "cuda") == 10
            assert budget.auto_chunk_size(plan, [DiagGGNExact()], torch.device("cuda", 0)) == 10
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


def test_auto_chunk_size_counts_the_largest_intermediate(monkeypatch):
    """A column's backward holds cotangents of the largest value the forward computes (a chunked
    linear attention's intermediates can dwarf every site's output): the budget counts two of
    them per column where they exceed the sites', and the plan records that value's bytes."""
    import curvlib._plan.budget as budget
    from curvlib._plan.plan import Plan

    sites = dict(out_shape=(4, 3), out_dtype=torch.float32, site_shapes=((4, 5),), site_dtypes=(torch.float32,),
                 batch_dims=(0,))
    monkeypatch.setattr("curvlib._core.tensors.available_bytes", lambda device: None)
    with override(auto_chunk_bytes=8000, auto_chunk_bytes_cpu=8000):
        assert budget.auto_chunk_size(Plan(**sites, largest_value_bytes=40), [DiagGGNExact()], "cpu") == 100
        assert budget.auto_chunk_size(Plan(**sites, largest_value_bytes=400), [DiagGGNExact()], "cpu") == 10

    class Wide(nn.Module):  # a [N, 64, 64] intermediate between two small Linear layers
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 64), nn.Linear(64, 2)

        def forward(self, x):
            h = self.a(x)
            return self.b(torch.tanh(h[:, :, None] * h[:, None, :]).mean(1))

    from curvlib._hessian.residuals import residual_plan
    from curvlib._plan.plan import make_plan
    from curvlib._trace.program import trace_program

    model = Wide().double()
    program = trace_program(model)
    params = dict(model.named_parameters())
    plan = make_plan(program, torch.randn(5, 3, dtype=torch.float64), params, frozenset(params), residual_plan(program))
    assert plan.largest_value_bytes == 5 * 64 * 64 * 8


def test_sqrt_columns_loop_equals_vmap():
    """SqrtGGNExact/MC column by column (default) and vmapped over columns agree."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh(), nn.Linear(4, 3), nn.Flatten(), nn.Linear(9, 3)).double()
    X = torch.randn(5, 2, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    exts = lambda: [SqrtGGNExact(), SqrtGGNMC(mc_samples=3, generator=seeded(2))]  # noqa: E731
    looped = curvature(model, nn.CrossEntropyLoss(), exts())(X, y)
    with override(loop_sqrt_columns=False):
        vmapped = curvature(model, nn.CrossEntropyLoss(), exts())(X, y)
    for key in ("sqrt_ggn_exact", "sqrt_ggn_mc"):
        for name in looped[key]:
            check_close(looped[key][name], vmapped[key][name], f"{key}[{name}]")
