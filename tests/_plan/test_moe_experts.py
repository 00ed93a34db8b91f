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
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.nn import functional as F

from curvlib import CurvatureError, curvature
from curvlib.extensions import KFLR, BatchGrad

from oracles.checks import check_first_order, check_second_order
from oracles.on_device import seeded

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
