"""Samples mixed inside the model, found by numeric tests (``curvlib._plan.mixing_numeric``):
generic layers (``nn.MultiheadAttention`` across the batch, with and without
dropout; a layer that differs for a batch of one), unknown parameter-free
modules, models without a graph, inside ``torch.func.vmap``; recurrence across
the batch (found in the graph); the checks run once per plan and only when an
extension needs independent samples.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature, extensions as E
from curvlib._core.settings import override

from oracles.checks import check_first_order
from oracles.first_order import assert_close_dicts, first_order_reference
from oracles.cases import DT, HotNet, hot_data


class Attention(nn.Module):
    """A user module owning ``scale`` around ``nn.MultiheadAttention`` on ``[N, T, E]`` (traced
    through as attention's math, so the static check names the product that mixes samples)."""

    def __init__(self, batch_first: bool, dropout: float = 0.0):
        super().__init__()
        self.mha = nn.MultiheadAttention(4, 2, dropout=dropout, batch_first=batch_first)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0] * self.scale


class RollGeneric(nn.Module):
    """A generic layer (owns ``scale``) that mixes samples when ``mix`` (rolls the batch dim)."""

    def __init__(self, mix: bool):
        super().__init__()
        self.scale, self.mix = nn.Parameter(torch.linspace(0.5, 1.5, 4)), mix

    def forward(self, x):
        return torch.tanh(x) * self.scale + (x.roll(1, 0) if self.mix else 0.0)


class Seq(nn.Module):
    """``[N, T, 3]`` -> Linear -> ``mid`` (``pick``: it returns a tuple) -> mean over T -> Linear."""

    def __init__(self, mid: nn.Module, pick: bool = False):
        super().__init__()
        self.inp, self.mid, self.out, self.pick = nn.Linear(3, 4), mid, nn.Linear(4, 2), pick

    def forward(self, x):
        h = self.mid(self.inp(x))
        return self.out((h[0] if self.pick else h).mean(1))


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_attention_across_the_batch_is_refused(dropout):
    X, y = hot_data(shape=(6, 3))
    with pytest.raises(CurvatureError, match=r"Samples are mixed inside the model: graph node 'matmul'"):
        curvature(Seq(Attention(batch_first=False, dropout=dropout)).to(DT), nn.MSELoss(), [E.BatchGrad()])(X, y)


def test_attention_within_each_sample_equals_the_oracle():
    X, y = hot_data(shape=(6, 3))
    check_first_order(Seq(Attention(batch_first=True)).to(DT), nn.MSELoss(), X, y)


def test_recurrence_across_the_batch_is_refused():
    X, y = hot_data(shape=(6, 3))
    with pytest.raises(CurvatureError, match=r"module 'mid' \(GRU\) with batch_first=False reads the batch dim 0"):
        curvature(Seq(nn.GRU(4, 4), pick=True).to(DT), nn.MSELoss(), [E.BatchGrad()])(X, y)
    check_first_order(Seq(nn.GRU(4, 4, batch_first=True), pick=True).to(DT), nn.MSELoss(), X, y)


class PerBatchSize(nn.Module):
    """A generic layer whose output depends on the batch size (not on other samples' values)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.w / x.shape[0]


def test_generic_layer_that_differs_for_a_batch_of_one_is_refused():
    X, y = hot_data()
    with pytest.raises(CurvatureError, match=r"module 'fn' \(PerBatchSize\): run on sample 0 alone"):
        curvature(HotNet(PerBatchSize()).to(DT), nn.MSELoss(), [E.BatchGrad()])(X, y)


class _Leaf(nn.Module):
    """A parameter-free module fx keeps as a leaf (its class claims to be torch.nn's)."""

    __module__ = "torch.nn.modules.curvlib_test"

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_unknown_parameter_free_modules_are_tested_numerically():
    X, y = hot_data()
    with pytest.raises(CurvatureError, match=r"module 'fn' \(_Leaf\): changing sample 0's input"):
        curvature(HotNet(_Leaf(lambda h: h - h.mean(0))).to(DT), nn.MSELoss(), [E.BatchGrad()])(X, y)
    check_first_order(HotNet(_Leaf(lambda h: h - h.mean(1, keepdim=True))).to(DT), nn.MSELoss(), X, y)


# ----------------------------------------------------------------------------- untraced, caching


class Untraced(nn.Module):
    """Data-dependent control flow: no graph, run eagerly."""

    def __init__(self, mix: bool):
        super().__init__()
        self.a, self.b, self.mix = nn.Linear(3, 4), nn.Linear(4, 2), mix

    def forward(self, x):
        h = self.a(x)
        if bool(h.sum() > -1e9) and self.mix:
            h = h - h.mean(0)
        return self.b(h)


def test_untraced_models_are_tested_on_their_forward():
    X, y = hot_data()
    # torch.fx cannot trace it; the ATen front end does, and its graph names the node
    with pytest.raises(CurvatureError, match=r"graph node 'mean' \(torch.mean over the batch dim 0"):
        curvature(Untraced(True).to(DT), nn.MSELoss(), [E.BatchGrad()])(X, y)
    with override(aten_front_end=False):  # the eager runner
        with pytest.raises(CurvatureError, match=r"own forward .*sample 0's rows of the output of layer 'a'"):
            curvature(Untraced(True).to(DT), nn.MSELoss(), [E.BatchGrad()])(X, y)
        assert curvature(Untraced(True).to(DT), nn.MSELoss())(X, y)["loss"].isfinite()
        check_first_order(Untraced(False).to(DT), nn.MSELoss(), X, y)


def test_checks_are_cached_with_the_plan_and_skipped_when_not_needed(monkeypatch):
    from curvlib._plan import independence as _independence
    from curvlib._plan import mixing_numeric as _mixing_numeric
    calls = {"analyse": 0, "numeric": 0}
    analyse, numeric = _independence.analyse, _mixing_numeric.pending_problem

    def count(key, fn):
        def wrapped(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(_independence, "analyse", count("analyse", analyse))
    monkeypatch.setattr(_mixing_numeric, "pending_problem", count("numeric", numeric))
    X, y = hot_data(shape=(6, 3))
    model = Seq(Attention(batch_first=True)).to(DT)
    curvature(model, nn.MSELoss(), [E.HMP()])(X, y)
    assert calls == {"analyse": 1, "numeric": 0}  # HMP needs no independent samples
    f = curvature(model, nn.MSELoss(), [E.BatchGrad()])
    f(X, y), f(X, y)
    assert calls == {"analyse": 2, "numeric": 1}
    f(X[:3], y[:3])  # another input signature: another plan
    assert calls == {"analyse": 3, "numeric": 2}


def test_numeric_checks_compose_with_vmap_over_an_ensemble():
    """Inside ``torch.func.vmap`` the numeric tests run on plain tensors (the first member)."""
    from torch.func import stack_module_state, vmap

    X, y = hot_data(shape=(6, 3))
    for batch_first in (True, False):
        ensemble = [Seq(RollGeneric(mix=not batch_first)).to(DT) for _ in range(2)]
        params, _ = stack_module_state(ensemble)
        f = curvature(ensemble[0], nn.MSELoss(), [E.BatchGrad()])
        if not batch_first:
            with pytest.raises(CurvatureError, match="graph node 'mid'"):
                vmap(lambda p: f(X, y, params=p))(params)
            continue
        got = vmap(lambda p: f(X, y, params=p))(params)["grad_batch"]
        for i, member in enumerate(ensemble):
            ref = first_order_reference(member, nn.MSELoss(), X, y)["grad_batch"]
            assert_close_dicts({k: v[i] for k, v in got.items()}, ref, "grad_batch")


class Folded(nn.Module):
    """An unknown module stacking ``[h, -h]`` along the batch (``[2N, 4]``), folded back."""

    def __init__(self):
        super().__init__()
        self.leaf = _Leaf(lambda h: torch.cat([h, -h]))

    def forward(self, h):
        return self.leaf(h).reshape(2, h.shape[0], 4).sum(0)


def test_a_batch_merged_by_an_unknown_operation_is_refused_conservatively():
    """Which rows of ``[2N, 4]`` belong to which sample is not known: refused, not guessed."""
    X, y = hot_data()
    with pytest.raises(CurvatureError, match="merged with another dim by an operation curvlib cannot follow"):
        curvature(HotNet(Folded()).to(DT), nn.MSELoss(), [E.BatchGrad()])(X, y)


# ----------------------------------------------------------------------------- -inf masks, uninitialised memory


def masked_reductions(m):
    """A leaf of the trace (tested numerically) whose input holds ``-inf`` (a masked column):
    its max, logsumexp, top-2 and softmax over features, and the masked column itself."""
    top = m.topk(2, dim=1).values
    return torch.cat([m.amax(1, keepdim=True), torch.logsumexp(m, 1, keepdim=True), top,
                      torch.softmax(m, 1)[:, 1:], m[:, :1]], 1)


def half_filled(h):
    """A leaf that returns a ``new_empty`` buffer of which it writes only the first columns."""
    out = h.new_empty(h.shape[0], h.shape[1] + 3)
    out[:, : h.shape[1]] = h
    return out


torch.fx.wrap("masked_reductions")
torch.fx.wrap("half_filled")


class Leaves(nn.Module):
    """``[N, 4]`` -> Linear -> a numerically tested leaf -> Linear."""

    def __init__(self, which: str):
        super().__init__()
        self.a, self.b, self.which = nn.Linear(3, 4), nn.Linear(4, 2), which

    def forward(self, x):
        h = self.a(x)
        if self.which == "masked":
            m = h.masked_fill(torch.arange(h.shape[1]) == 0, float("-inf"))
            z = masked_reductions(m)[:, :4]
        else:
            z = half_filled(h)[:, :4]
        return self.b(torch.tanh(z))


@pytest.mark.parametrize("which", ["masked", "uninitialised"])
@given(seed=st.integers(0, 20), n=st.integers(2, 5))
@settings(max_examples=5)
def test_numeric_probe_ignores_equal_infinities_and_unwritten_memory(which, seed, n):
    X, y = hot_data(seed, n=n)
    check_first_order(Leaves(which).to(DT), nn.MSELoss(), X, y)


def test_a_layer_that_fails_on_one_sample_alone_is_refused_naming_it():
    """A generic layer whose own code fails on a batch of one (it checks for two rows at least):
    its per-sample quantities cannot be recomputed, so the call is refused naming the layer and
    the error, before any work (the layer's own error does not reach the user raw)."""
    import pytest
    import torch
    from torch import nn

    from curvlib import CurvatureError, curvature
    from curvlib.extensions import BatchGrad

    class Pairs(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))

        def forward(self, x):
            if x.shape[0] < 2:
                raise ValueError("Pairs needs two rows at least")
            return x @ self.w

    model = nn.Sequential(nn.Linear(3, 3), Pairs(), nn.Linear(3, 2)).double()
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 0, 1])
    with pytest.raises(CurvatureError, match=r"Layer '1' \(Pairs.*each sample alone"):
        curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])(X, y)
