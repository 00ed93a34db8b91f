"""Mixture-of-experts layers on the batch's tokens flattened to rows ``[N·T, D]``: a router
``Linear`` on the rows, a top-k choice (discrete: constant under differentiation, as in the
model's own backward) and every expert run on every row, its output weighted by the router's
score (zero where the expert was not chosen), with the expert weights batched ``[E, D, H]``
and applied by ``bmm`` to ``[E, N·T, D]`` (Llama 4's experts); or each row repeated once per
chosen expert (``repeat_interleave``) and multiplied by the chosen experts' weights
``W[ids]`` (transformers' ``batched_mm`` experts). The planner splits the batch off
the merged dim of each layer (:func:`curvlib._plan.batch_merges.split_merged_batches`): every
row is one sample's token, a position sharing the weights, so every quantity equals the
float64 brute force."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st
from torch import nn
from torch.nn import functional as F

from curvlib import CurvatureError, curvature
from curvlib.extensions import KFLR, BatchGrad

from oracles.checks import check_first_order, check_second_order
from oracles.kron import shared_factors
from oracles.on_device import seeded
from oracles.second_order import ggn_block

DT = torch.float64


class DenseExpertsMoE(nn.Module):
    """``[N, T, D]`` -> rows ``[N·T, D]`` -> router top-k scores ``[N·T, E]`` (zero off the top k)
    -> experts ``bmm([E, N·T, D], [E, D, H])``, tanh, ``bmm(·, [E, H, D])`` -> weighted sum over
    experts -> Linear head on the mean over tokens."""

    def __init__(self, dim: int, experts: int, k: int, hidden: int = 3, classes: int = 3):
        super().__init__()
        self.k = k
        self.router = nn.Linear(dim, experts, bias=False)
        self.up = nn.Parameter(0.5 * torch.randn(experts, dim, hidden))
        self.down = nn.Parameter(0.5 * torch.randn(experts, hidden, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        n, t, d = x.shape
        rows = x.reshape(-1, d)
        logits = self.router(rows)
        top, idx = torch.topk(logits, self.k, dim=-1)
        # (a zero tensor made from the rows' count: one value, so any order of its rows fits)
        scores = torch.zeros(rows.shape[0], logits.shape[1], dtype=x.dtype).scatter(1, idx, torch.sigmoid(top))
        routed = rows.repeat(scores.shape[1], 1).view(scores.shape[1], -1, d)  # [E, N·T, D]
        h = torch.bmm(torch.tanh(torch.bmm(routed, self.up)), self.down)       # [E, N·T, D]
        out = (h * scores.t().unsqueeze(-1)).sum(0)                             # [N·T, D]
        return self.head((rows + out).reshape(n, t, d).mean(1))


class PickedExpertsMoE(DenseExpertsMoE):
    """As :class:`DenseExpertsMoE`, the experts run only on the rows that chose them: rows
    repeated ``k`` times ``[N·T·k, D]``, each multiplied by its expert's weights
    ``up.transpose(1, 2)[ids]`` ``[N·T·k, H, D]`` by ``bmm``, summed back over the ``k`` choices;
    the router an ``F.linear`` on its weight cast to the rows' dtype (as transformers' routers)."""

    def forward(self, x):
        n, t, d = x.shape
        rows = x.reshape(-1, d)
        top, idx = torch.topk(F.linear(rows, self.router.weight.to(rows.dtype)), self.k, dim=-1)
        ids = idx.reshape(-1)                                                   # [N·T·k]
        picked = rows.repeat_interleave(self.k, dim=0)                          # [N·T·k, D]
        h = torch.tanh(torch.bmm(self.up.transpose(1, 2)[ids], picked.unsqueeze(-1)).squeeze(-1))
        h = torch.bmm(self.down.transpose(1, 2)[ids], h.unsqueeze(-1)).squeeze(-1)
        out = (h * torch.sigmoid(top).reshape(-1, 1)).view(-1, self.k, d).sum(1)
        return self.head((rows + out).reshape(n, t, d).mean(1))


def _case(seed: int, n: int, t: int, experts: int, k: int, picked: bool = False):
    torch.manual_seed(seed)
    model = (PickedExpertsMoE if picked else DenseExpertsMoE)(4, experts, k).to(DT)
    gen = seeded(seed)
    X = torch.randn(n, t, 4, generator=gen, dtype=DT)
    return model, nn.CrossEntropyLoss(), X, torch.randint(0, 3, (n,), generator=gen)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 4), t=st.integers(2, 4), experts=st.integers(2, 4),
       k=st.integers(1, 2), picked=st.booleans())
def test_experts_first_order(seed, n, t, experts, k, picked):
    check_first_order(*_case(seed, n, t, experts, min(k, experts), picked))


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 3), t=st.integers(2, 3), k=st.integers(1, 2),
       picked=st.booleans())
def test_experts_ggn(seed, n, t, k, picked):
    check_second_order(*_case(seed, n, t, 3, k, picked), hessian=False, hmp=False)


def test_dense_experts_router_kflr_rows_are_positions():
    """KFLR "expand" of the router on the rows: ``A = Σ x xᵀ / (N·T)`` over every token row."""
    model, lossfn, X, y = _case(0, 3, 4, 3, 2)
    factors = curvature(model, lossfn, [KFLR(kfac_approx="expand")])(X, y)["kflr"]
    rows = X.reshape(-1, 4)
    torch.testing.assert_close(factors["router.weight"][1], rows.t() @ rows / rows.shape[0])


class GatheredExpertsMoE(nn.Module):
    """Each expert an ``nn.Linear`` on the rows routed to it, ``rows[tok]`` with ``tok`` from
    ``torch.where(idx == e)`` (a variable number of rows per sample), added back by
    ``index_add``: Mixtral's and JetMoE's own experts."""

    def __init__(self, dim: int = 4, experts: int = 3, k: int = 2):
        super().__init__()
        self.k = k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        n, t, d = x.shape
        rows = x.reshape(-1, d)
        top, idx = torch.topk(self.router(rows), self.k, dim=-1)
        out = torch.zeros_like(rows)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            out = out.index_add(0, tok, expert(rows[tok]) * torch.sigmoid(top[tok, slot]).unsqueeze(-1))
        return self.head((rows + out).reshape(n, t, d).mean(1))


def test_gathered_experts_are_refused_naming_the_selection():
    """Rows picked by the data: which sample each row belongs to changes per call and is not
    followed, so every extension is refused before any work, naming the selection."""
    torch.manual_seed(0)
    model = GatheredExpertsMoE().to(DT)
    X, y = torch.randn(3, 5, 4, dtype=DT), torch.randint(0, 3, (3,))
    with pytest.raises(CurvatureError, match="where.*not supported"):
        curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])(X, y)


def test_rows_that_mix_samples_are_refused():
    """Token rows sorted by their router score across the whole batch, an expert on them and a
    running sum over the sorted rows: one row's output holds other samples' rows, so samples
    mix and curvlib refuses."""

    class SortedRows(DenseExpertsMoE):
        def forward(self, x):
            n, t, d = x.shape
            rows = x.reshape(-1, d)
            order = torch.argsort(self.router(rows)[:, 0])
            h = torch.tanh(rows[order] @ self.up[0]).cumsum(0)[torch.argsort(order)]
            return self.head(h @ self.down[0]).reshape(n, t, -1).mean(1)

    torch.manual_seed(0)
    X, y = torch.randn(3, 2, 4, dtype=DT), torch.randint(0, 3, (3,))
    with pytest.raises(CurvatureError, match="sample"):
        curvature(SortedRows(4, 2, 1).to(DT), nn.CrossEntropyLoss(), [BatchGrad()])(X, y)


class SortedExperts(nn.Module):
    """Grouped experts as transformers' ``grouped_mm`` path dispatches them: the ``N·T·k``
    token-expert rows of the whole batch sorted by expert (``torch.sort``), counted per expert
    (``torch.histc``), each sorted row times its expert's weights, and added back to its token
    (``index_add``). ``mix``: a running sum over the sorted rows, which does mix samples.
    ``proj``: a Linear on the rows first (inside the module kept whole)."""

    def __init__(self, dim: int, experts: int, k: int, hidden: int = 3, mix: bool = False, proj: bool = False):
        super().__init__()
        self.k, self.experts, self.mix = k, experts, mix
        self.up = nn.Parameter(0.5 * torch.randn(experts, dim, hidden))
        self.down = nn.Parameter(0.5 * torch.randn(experts, hidden, dim))
        self.proj = nn.Linear(dim, dim) if proj else None

    def forward(self, rows, idx, weights):
        if self.proj is not None:
            rows = torch.tanh(self.proj(rows))
        ids, order = torch.sort(idx.reshape(-1))
        counts = torch.histc(ids.to(rows.dtype), bins=self.experts, min=0, max=self.experts - 1)
        picked = rows[order // self.k]
        h = torch.tanh(torch.bmm(picked.unsqueeze(1), self.up[ids]).squeeze(1))
        h = torch.bmm(h.unsqueeze(1), self.down[ids]).squeeze(1) * weights.reshape(-1)[order].unsqueeze(-1)
        if self.mix:
            h = h.cumsum(0)
        h = h * (1 + 0 * counts.sum())  # (the counts feed the computation, as grouped_mm's offsets do)
        return torch.zeros_like(rows).index_add(0, order // self.k, h)


class SortedExpertsMoE(nn.Module):
    """Router ``Linear`` and top-k on the rows ``[N·T, D]``, :class:`SortedExperts` on them, a
    Linear head on the mean over tokens (``aten``: a value read in ``forward``, so that the model
    is traced at the ATen level)."""

    def __init__(self, dim: int = 4, experts: int = 3, k: int = 2, mix: bool = False, aten: bool = False,
                 proj: bool = False):
        super().__init__()
        self.k, self.aten = k, aten
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = SortedExperts(dim, experts, k, mix=mix, proj=proj)
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        if self.aten and bool(x.abs().sum() >= 0):
            x = x * 1.0
        n, t, d = x.shape
        rows = x.reshape(-1, d)
        top, idx = torch.topk(self.router(rows), self.k, dim=-1)
        out = self.experts(rows, idx, torch.softmax(top, -1))
        return self.head((rows + out).reshape(n, t, d).mean(1))


def _sorted_case(seed: int, n: int, t: int, k: int, aten: bool, mix: bool = False, proj: bool = False):
    torch.manual_seed(seed)
    model = SortedExpertsMoE(k=k, aten=aten, mix=mix, proj=proj).to(DT)
    gen = seeded(seed)
    X = torch.randn(n, t, 4, generator=gen, dtype=DT)
    return model, nn.CrossEntropyLoss(), X, torch.randint(0, 3, (n,), generator=gen)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 4), t=st.integers(1, 4), k=st.integers(1, 2), aten=st.booleans())
def test_experts_on_rows_sorted_across_the_batch_are_exact(seed, n, t, k, aten):
    """The module that sorts the batch's rows is one layer run per sample on its rows: kept whole in
    the ATen-level trace (:mod:`curvlib._trace.module_calls`; for a batch of one too, as for the
    batch of two the trace is compared with), a leaf of torch.fx's as it owns its parameters, on
    batch-first operands (:mod:`curvlib._plan.merged_modules`); first order and the GGN family
    equal the float64 brute force (and the model is left as it was). (One token per sample and one
    expert each, ``t·k = 1``, sorts exactly ``N`` rows: a sort of the samples themselves, by shape.)"""
    assume(t * k > 1)
    case = _sorted_case(seed, n, t, k, aten)
    check_first_order(*case)
    check_second_order(*case, hessian=False, hmp=False)


@pytest.mark.parametrize("aten", [False, True])
def test_sorted_rows_that_mix_samples_are_refused(aten):
    """A running sum over the sorted rows mixes samples: the module kept whole fails the
    numeric test of its rows (sample j changed, other samples' rows change) and is refused."""
    model, lossfn, X, y = _sorted_case(0, 3, 3, 2, aten, mix=True)
    with pytest.raises(CurvatureError, match="sample"):
        curvature(model, lossfn, [BatchGrad()])(X, y)


@pytest.mark.parametrize("aten", [False, True])
def test_experts_on_sorted_rows_get_the_generic_layers_kronecker_form(aten):
    """A module kept whole is one generic layer: its stacked expert weights (no Linear owns them)
    get KFLR's generic form, the exact GGN block's diagonal (docs/conventions.md), as when the
    same experts are traced on rows in sample order; the router and head get two factors."""
    model, lossfn, X, y = _sorted_case(0, 3, 3, 2, aten)
    factors = curvature(model, lossfn, [KFLR()])(X, y)["kflr"]
    for name in ("experts.up", "experts.down"):
        exact = ggn_block(model, lossfn, X, y, name).diagonal()
        assert len(factors[name]) == 1
        torch.testing.assert_close(factors[name][0], exact, rtol=1e-9, atol=1e-12)
    assert len(factors["router.weight"]) == 2 and len(factors["head.weight"]) == 2


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 3), t=st.integers(1, 3), aten=st.booleans(),
       approx=st.sampled_from([None, "expand"]))
def test_a_linear_inside_the_module_kept_whole_gets_its_two_factors(seed, n, t, aten, approx):
    """A Linear inside the module kept whole (on the token rows ``[N·T, D]``) gets KFLR's two
    factors, formed sample by sample from its rows (:mod:`curvlib._evaluate.opaque_kron`), equal to
    the explicit oracle's (per-position output offsets). Holding a Linear, the module is traced
    through by torch.fx, whose graph then sorts values: the model goes to the ATen-level trace,
    which keeps the module whole."""
    model, lossfn, X, y = _sorted_case(seed, n, t, 2, aten, proj=True)
    factors = curvature(model, lossfn, [KFLR(kfac_approx=approx)])(X, y)["kflr"]
    B, A = shared_factors(model, lossfn, X, y, model.experts.proj, approx)
    for got, want in ((factors["experts.proj.weight"], [B, A]), (factors["experts.proj.bias"], [B])):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
