"""A batch merged into dim 0 with windows or heads before a layer (window attention:
``[N·W, S, C]`` into ``qkv``): the planner splits it off around the layer
(:func:`curvlib._plan.batch_merges.split_merged_batches`), so every quantity equals the brute force, the
layer's windows counting as positions that share its weight. Both orders of the merge
(batch-major ``n·W + w``, window-major ``w·N + n``) and an op on a parameter broadcast over
merged scores (a relative-position bias) are drawn; a merge that regroups samples stays
refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import KFLR, BatchGrad

from oracles.checks import check_first_order, check_hessian_family, check_second_order
from oracles.on_device import seeded

DT = torch.float64


class WindowNet(nn.Module):
    """``[N, W·S, C]`` -> windows ``[N·W, S, C]`` (batch-major, or window-major with
    ``window_major``) -> LayerNorm, Linear, scores ``q kᵀ + bias`` with a learned bias
    ``[S, S]`` -> merged back -> a Linear head on the mean over positions."""

    def __init__(self, windows: int, size: int, dim: int, window_major: bool):
        super().__init__()
        self.windows, self.size, self.window_major = windows, size, window_major
        self.norm = nn.LayerNorm(dim)
        self.qk = nn.Linear(dim, 2 * dim)
        self.bias = nn.Parameter(0.1 * torch.randn(size, size))
        self.act = nn.Tanh()
        self.proj = nn.Linear(size, dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        n, c = x.shape[0], x.shape[-1]
        w = x.reshape(n, self.windows, self.size, c)
        w = w.transpose(0, 1).reshape(-1, self.size, c) if self.window_major else w.reshape(-1, self.size, c)
        q, k = self.qk(self.norm(w)).chunk(2, dim=-1)
        scores = self.act(q @ k.transpose(1, 2) + self.bias)            # [N·W, S, S]
        h = self.proj(scores)                                            # [N·W, S, C]
        if self.window_major:
            h = h.reshape(self.windows, n, self.size, -1).transpose(0, 1)
        return self.head(h.reshape(n, -1, h.shape[-1]).mean(1))


def _case(seed: int, n: int, windows: int, window_major: bool):
    torch.manual_seed(seed)
    model = WindowNet(windows, size=3, dim=4, window_major=window_major).to(DT).eval()
    gen = seeded(seed)
    X = torch.randn(n, windows * 3, 4, generator=gen, dtype=DT)
    y = torch.randint(0, 3, (n,), generator=gen)
    return model, nn.CrossEntropyLoss(), X, y


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 4), windows=st.integers(2, 3), window_major=st.booleans())
def test_windows_first_order(seed, n, windows, window_major):
    check_first_order(*_case(seed, n, windows, window_major))


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 3), window_major=st.booleans())
def test_windows_second_order(seed, n, window_major):
    """GGN family and block products against the brute force; DiagHessian and BatchDiagHessian
    against ``torch.func`` Hessians (the scores' tanh, product and LayerNorm residuals sit in the
    merged layout, and the windows of a sample share ``proj`` below them)."""
    case = _case(seed, n, 2, window_major)
    check_second_order(*case, hessian=False, hmp=True)
    check_hessian_family(*case, exact_pchmp=False, pchmp_optional=True)


def test_windows_get_kronecker_factors():
    """The layers on windows keep two Kronecker factors (windows are positions), and KFLR
    "expand" of ``qk`` equals the merged-order-free definition: ``A = Σ x xᵀ / (N·W·S)``."""
    model, lossfn, X, y = _case(0, 3, 2, window_major=False)
    factors = curvature(model, lossfn, [KFLR(kfac_approx="expand")])(X, y)["kflr"]
    assert [tuple(f.shape) for f in factors["qk.weight"]] == [(8, 8), (4, 4)]
    x = model.norm(X.reshape(-1, 3, 4)).detach().reshape(-1, 4)
    torch.testing.assert_close(factors["qk.weight"][1], x.t() @ x / x.shape[0])


def test_merge_that_regroups_samples_is_refused():
    """``x.t()`` then rows of two entries: each row holds two samples' values."""

    class Regroup(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 3)

        def forward(self, x):  # [N, 4] -> [4, N] -> [2N, 2]
            return self.fc(x.t().reshape(-1, 2)).reshape(x.shape[0], -1)

    f = curvature(Regroup().to(DT), nn.MSELoss(), [BatchGrad()])
    with pytest.raises(CurvatureError, match="fc|sample"):
        f(torch.randn(5, 4, dtype=DT), torch.randn(5, 6, dtype=DT))


class MergedActivation(nn.Module):
    """``tanh`` on rows merged into the batch dim (``[N, 4, 2] -> [2N, 2, 2]``), then split back
    and read by a Linear shared over positions. Before the column split of
    :func:`curvlib._hessian.algebra.per_sample`, its DiagHessian of ``a`` was 39 % off (the
    tanh's columns spanned both rows of a sample, whose positions then share ``a``)."""

    def __init__(self):
        super().__init__()
        self.a, self.act, self.b = nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 3)

    def forward(self, x):
        h = self.act(self.a(x).reshape(-1, 2, 2)).reshape(x.shape[0], 4, 2)
        return self.b(h).mean(1)


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 4))
def test_residual_on_merged_rows(seed, n):
    torch.manual_seed(seed)
    gen = seeded(seed)
    X = torch.randn(n, 4, 2, generator=gen, dtype=DT)
    check_second_order(MergedActivation().to(DT), nn.CrossEntropyLoss(), X, torch.randint(0, 3, (n,), generator=gen),
                       hessian=True, hmp=True)


# ----------------------------------------------------------------------------- BatchNorm1d on merged rows


class RowNorm(nn.Module):
    """``[N, T, 3]`` -> Linear -> rows ``[N·T, 4]`` (batch-major, or token-major with
    ``token_major``) -> BatchNorm1d -> back to ``[N, T, 4]`` -> Tanh -> mean over T -> Linear."""

    def __init__(self, token_major: bool):
        super().__init__()
        self.a, self.bn, self.act, self.b = nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)
        self.token_major = token_major

    def forward(self, x):
        n, t, _ = x.shape
        h = self.a(x)
        if self.token_major:
            h = self.bn(h.transpose(0, 1).reshape(t * n, 4)).reshape(t, n, 4).transpose(0, 1)
        else:
            h = self.bn(h.reshape(n * t, 4)).reshape(n, t, 4)
        return self.b(self.act(h).mean(1))


def _row_norm(seed: int, token_major: bool, training: bool) -> RowNorm:
    model = RowNorm(token_major).to(DT).train(training)
    g = seeded(seed + 100)
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1, generator=g)
        model.bn.running_var.uniform_(0.5, 2, generator=g)
        model.bn.weight.uniform_(0.5, 1.5, generator=g)
        model.bn.bias.uniform_(-0.5, 0.5, generator=g)
    return model


@settings(max_examples=8)
@given(n=st.integers(2, 4), t=st.integers(1, 4), token_major=st.booleans(), seed=st.integers(0, 50))
def test_eval_batch_norm_on_rows_merging_batch_and_tokens_is_exact(n, t, token_major, seed):
    """Running statistics normalise each row alone: the rows stay apart, every quantity exact."""
    g = seeded(seed)
    X, y = torch.randn(n, t, 3, generator=g, dtype=DT), torch.randn(n, 2, generator=g, dtype=DT)
    model = _row_norm(seed, token_major, training=False)
    check_first_order(model, nn.MSELoss(), X, y)
    check_second_order(model, nn.MSELoss(), X, y, hmp=False, seed=seed)
    qs = curvature(model, nn.MSELoss(), [KFLR()])(X, y)
    assert all(bool(f.isfinite().all()) for fs in qs["kflr"].values() for f in fs)


class LinearNorm(nn.Module):
    """LeViT's ``LinearNorm``: Linear, then an eval-mode BatchNorm1d on the rows ``[N·T, C]``
    that merge the batch and the tokens (``flatten(0, 1)``), reshaped back."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.linear, self.bn = nn.Linear(c_in, c_out, bias=False), nn.BatchNorm1d(c_out)

    def forward(self, x):
        x = self.linear(x)
        return self.bn(x.flatten(0, 1)).reshape_as(x)


class NestedRowNorm(nn.Module):
    """``[N, T, 3]`` -> two LinearNorm blocks (the BatchNorm a submodule's, named by a dotted
    path) with a Tanh between and after -> mean over T -> Linear."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(LinearNorm(3, 4), nn.Tanh(), LinearNorm(4, 4))
        self.act, self.head = nn.Tanh(), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.act(self.blocks(x)).mean(1))


@settings(max_examples=6)
@given(n=st.integers(2, 4), t=st.integers(2, 4), seed=st.integers(0, 50))
def test_eval_batch_norm_of_a_submodule_on_merged_rows_is_exact(n, t, seed):
    """A BatchNorm1d deeper than the root (LeViT's ``stages.0.blocks.0.attn.qkv.bn``) is
    found by its path: its rows are split apart as the root's are, every quantity exact."""
    g = seeded(seed)
    X, y = torch.randn(n, t, 3, generator=g, dtype=DT), torch.randn(n, 2, generator=g, dtype=DT)
    model = NestedRowNorm().to(DT).eval()
    with torch.no_grad():
        for bn in (model.blocks[0].bn, model.blocks[2].bn):
            bn.running_mean.uniform_(-1, 1, generator=g)
            bn.running_var.uniform_(0.5, 2, generator=g)
            bn.weight.uniform_(0.5, 1.5, generator=g)
            bn.bias.uniform_(-0.5, 0.5, generator=g)
    check_first_order(model, nn.MSELoss(), X, y)
    check_second_order(model, nn.MSELoss(), X, y, hmp=False, seed=seed)


@pytest.mark.parametrize("token_major", [False, True])
def test_train_batch_norm_on_merged_rows_stays_refused(token_major):
    g = seeded(3)
    X, y = torch.randn(4, 3, 3, generator=g, dtype=DT), torch.randn(4, 2, generator=g, dtype=DT)
    with pytest.raises(CurvatureError, match="bn"):
        curvature(_row_norm(0, token_major, training=True), nn.MSELoss(), [BatchGrad()])(X, y)
