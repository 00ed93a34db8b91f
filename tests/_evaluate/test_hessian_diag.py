"""The Hessian diagonal's packed pullbacks (``curvlib._evaluate.hessian_diag``), against ``torch.func`` Hessians and per-column brute force (float64): a tiny
language model with a tied embedding and head, LayerNorm, a tanh MLP, a softmax and a product,
for every packing of the residual columns (``Settings.packed_columns``, ``chunk_size``); RMSNorm's
``rsqrt`` and other element-wise roots and logarithms (diagonal residuals)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import curvature
from curvlib._core.settings import override
from curvlib._evaluate import hessian_diag as hd
from curvlib.extensions import BatchDiagHessian, DiagHessian, SqrtGGNExact

from oracles.checks import check_close, check_hessian_diagonals
from oracles.on_device import seeded
from oracles.second_order import ggn_per_sample


class TiedLM(nn.Module):
    """Embedding tied to the output head, LayerNorm, a tanh MLP, a softmax gate, a product."""

    def __init__(self, vocab=7, d=4):
        super().__init__()
        self.emb, self.ln, self.up, self.down = nn.Embedding(vocab, d), nn.LayerNorm(d), nn.Linear(d, 6), nn.Linear(6, d)

    def forward(self, ids):
        h = self.ln(self.emb(ids))
        u = self.up(h)
        h = h + self.down(torch.tanh(u) * torch.softmax(u, -1))
        return nn.functional.linear(h, self.emb.weight).transpose(1, 2)  # [N, vocab, T]


def _problem(seed, n, t):
    g = seeded(seed)
    torch.manual_seed(seed)
    model = TiedLM().double()
    ids = torch.randint(0, 7, (n, t), generator=g)
    return model, ids, torch.randint(0, 7, (n, t), generator=g)


@settings(max_examples=6, deadline=None)
@given(packed=st.integers(1, 300), chunk=st.sampled_from([None, 1, 5, 64]), n=st.integers(1, 3),
       t=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_tied_language_model_any_packing(packed, chunk, n, t, seed):
    """DiagHessian / BatchDiagHessian exact for every way the residual columns are packed."""
    model, ids, y = _problem(seed, n, t)
    lossfn = nn.CrossEntropyLoss()
    with override(packed_columns=packed):
        _check_packing(model, lossfn, ids, y, chunk)


def _check_packing(model, lossfn, ids, y, chunk):
    if chunk is None:
        check_hessian_diagonals(model, lossfn, ids, y)
        return
    ref = curvature(model, lossfn, [DiagHessian(), BatchDiagHessian()])(ids, y)
    got = curvature(model, lossfn, [DiagHessian(), BatchDiagHessian()], chunk_size=chunk)(ids, y)
    for key in ("diag_h", "diag_h_batch"):
        for name in ref[key]:
            check_close(got[key][name], ref[key][name], f"{key}[{name}] chunk {chunk}")


def test_tied_language_model_sqrt_ggn():
    """SqrtGGNExact of the tied weight (embedding and head columns summed, in one batched call)."""
    model, ids, y = _problem(3, 2, 3)
    lossfn = nn.CrossEntropyLoss(reduction="sum")
    sqrt = curvature(model, lossfn, [SqrtGGNExact()])(ids, y)["sqrt_ggn_exact"]
    for name, p in model.named_parameters():
        G = ggn_per_sample(model, lossfn, ids, y, name)  # [N, P, P]
        S = sqrt[name].reshape(sqrt[name].shape[0], ids.shape[0], -1)  # [V, N, P]
        check_close(torch.einsum("vnp,vnq->npq", S, S), G, f"sqrt ggn [{name}]")


@pytest.mark.parametrize("packed", [1, 40, 10_000])
def test_columns_read_only_at_the_sites_they_reach(packed):
    """A batch pulled back from taps low in the graph reaches no site above them (``None``
    there, not zeros) and is neither joined nor read there; a tied weight read by columns that
    reach one of its sites reads as that site's parameter alone. Exact against ``torch.func``
    for any packing."""
    model, ids, y = _problem(5, 2, 3)
    lossfn = nn.CrossEntropyLoss()
    from curvlib._evaluate.linearise import Linearization
    unreached, pull = [], Linearization.pull_reached

    def spy(self, cot_taps):
        cols = pull(self, cot_taps)
        unreached.append(sum(c is None for c in cols))
        return cols

    tied_sites, read = [], hd._read_part

    def spy_read(total, uses, names, columns, request):
        tied_sites.extend(len(uses.get("emb.weight", ())) for name in names if name == "emb.weight")
        return read(total, uses, names, columns, request)

    with override(packed_columns=packed), pytest.MonkeyPatch.context() as mp:
        mp.setattr(Linearization, "pull_reached", spy)
        mp.setattr(hd, "_read_part", spy_read)
        check_hessian_diagonals(model, lossfn, ids, y)
    assert any(unreached), unreached
    assert 1 in tied_sites, tied_sites  # (the tied table read at the embedding alone: below the head)


@pytest.mark.parametrize("cap", [1, 3, 10])
@pytest.mark.parametrize("overhead", [0, 5, 1000])
def test_packing_covers_every_column_once(cap, overhead):
    """``_packed``: every column of every set exactly once, at most ``cap`` per batch, whatever
    the cost model."""
    sizes = [4, 1, 7, 2]
    entries = [(k, {t: None for t in taps}, {}, v, 1.0)
               for k, (v, taps) in enumerate([(4, [0]), (1, [2, 1]), (7, [3]), (2, [])])]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hd, "PULL_OVERHEAD", overhead)
        batches = list(hd._packed(entries, cap, sizes))
    assert all(sum(stop - start for _, start, stop in b) <= cap for b in batches)
    seen = sorted((e[0], c) for b in batches for e, start, stop in b for c in range(start, stop))
    assert seen == [(k, c) for k, v in enumerate([4, 1, 7, 2]) for c in range(v)]


class RMSNormNet(nn.Module):
    """Llama's RMSNorm (``x · rsqrt(mean x² + ε) · w``) and ``sqrt``/``log``/``reciprocal`` nodes:
    element-wise, with diagonal residuals."""

    def __init__(self, which: str):
        super().__init__()
        self.which, self.a, self.w, self.b = which, nn.Linear(3, 4), nn.Parameter(torch.randn(4)), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        if self.which == "rsqrt":
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        elif self.which == "sqrt":
            h = (h * h + 1.0).sqrt() * self.w
        elif self.which == "log":
            h = torch.log(h * h + 1.0) + torch.reciprocal(h * h + 2.0)
        return self.b(h)


@pytest.mark.parametrize("which", ["rsqrt", "sqrt", "log"])
def test_rms_norm_and_elementwise_roots(which):
    torch.manual_seed(0)
    model = RMSNormNet(which).double()
    X = torch.randn(3, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (3,))
    check_hessian_diagonals(model, nn.CrossEntropyLoss(), X, y)


class NormedRows(nn.Module):
    """A tanh before a LayerNorm and an RMSNorm written out with its own weight (a functional
    site), over positions: residual columns of mixed signs at both norms' parameters."""

    def __init__(self):
        super().__init__()
        self.a, self.ln, self.w, self.b = nn.Linear(3, 4), nn.LayerNorm(4), nn.Parameter(torch.randn(4)), nn.Linear(4, 2)

    def forward(self, x):
        h = self.ln(torch.tanh(self.a(x)))
        h = torch.tanh(h) * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        return self.b(h)


@pytest.mark.parametrize("packed", [1, 10_000])
def test_norms_read_weighted_columns_as_they_are(packed):
    """LayerNorm's and a functional site's parameters read columns of mixed signs weighted
    (``Σ_v w_vn (J_pᵀ m_v)²`` from the columns they form), not once per sign; exact."""
    torch.manual_seed(0)
    model, x = NormedRows().double(), torch.randn(3, 5, 3, dtype=torch.float64)
    y = torch.randn(3, 5, 2, dtype=torch.float64)
    read_per_sign = []
    with override(packed_columns=packed), pytest.MonkeyPatch.context() as mp:
        for f in ("diag", "batch_diag"):
            mp.setattr(hd, f, lambda uses, m, name, *a, _f=getattr(hd, f): read_per_sign.append(name) or _f(uses, m, name, *a))
        check_hessian_diagonals(model, nn.MSELoss(), x, y)
    assert not {"ln.weight", "ln.bias", "w"} & set(read_per_sign), read_per_sign


class EmbeddedRows(nn.Module):
    """An embedding (a token repeated within a sample: rows summed before the square) under a
    tanh and a softmax: mixed-sign residual columns at the table."""

    def __init__(self):
        super().__init__()
        self.emb, self.b = nn.Embedding(5, 4), nn.Linear(4, 3)

    def forward(self, ids):
        h = self.emb(ids)
        return self.b(torch.tanh(h) * torch.softmax(h, -1))


@pytest.mark.parametrize("packed", [1, 10_000])
def test_embedding_reads_weighted_columns_as_they_are(packed):
    """An embedding table's diagonal from weighted row squares (its batch diagonal from its
    columns, weighted), not once per sign; exact."""
    torch.manual_seed(1)
    model = EmbeddedRows().double()
    ids = torch.tensor([[0, 2, 2, 4], [1, 1, 3, 0], [2, 0, 0, 0]])
    y = torch.randn(3, 4, 3, dtype=torch.float64)
    read_per_sign = []
    with override(packed_columns=packed), pytest.MonkeyPatch.context() as mp:
        for f in ("diag", "batch_diag"):
            mp.setattr(hd, f, lambda uses, m, name, *a, _f=getattr(hd, f): read_per_sign.append(name) or _f(uses, m, name, *a))
        check_hessian_diagonals(model, nn.MSELoss(), ids, y)
    assert "emb.weight" not in read_per_sign, read_per_sign
