"""The Hessian diagonal's packed pullbacks (``curvlib._evaluate.hessian_diag``) and the column
read-offs they use, against ``torch.func`` Hessians and per-column brute force (float64): a tiny
language model with a tied embedding and head, LayerNorm, a tanh MLP, a softmax and a product,
for every packing of the residual columns (``PACKED_COLUMNS``, ``chunk_size``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import curvature
from curvlib._core.site import Site
from curvlib._evaluate import hessian_diag as hd
from curvlib.extensions import BatchDiagHessian, DiagHessian, SqrtGGNExact
from curvlib.rules import embedding, linear

from oracles.checks import check_close, check_hessian_diagonals
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
    g = torch.Generator().manual_seed(seed)
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
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hd, "PACKED_COLUMNS", packed)
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


def _linear_site(x, transposed):
    site = Site(linear.LINEAR_TRANSPOSED if transposed else linear.LINEAR, {"weight": "w", "bias": "b"}, "lin",
                saved={"x": x}, meta={"transposed": transposed})
    return site


@settings(max_examples=25, deadline=None)
@given(v=st.integers(1, 40), n=st.integers(1, 3), s=st.integers(1, 6), i=st.integers(1, 9), o=st.integers(1, 5),
       transposed=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_column_read_offs(v, n, s, i, o, transposed, seed):
    """Linear's all-columns read-offs (Gram matrices over positions, one batched product) equal
    the per-column ``grad_batch`` squared and summed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, s, i, generator=g, dtype=torch.float64)
    m = torch.randn(v, n, s, o, generator=g, dtype=torch.float64)
    site = _linear_site(x, transposed)
    rule, roles = site.rule, ["weight", "bias"]
    cols = {r: torch.stack([rule.grad_batch(site, m[k], roles)[r] for k in range(v)]) for r in roles}
    got = rule.grad_batch_columns(site, m, roles)
    diag = rule.sum_squares_over_columns(site, m, roles)
    batch = rule.batch_sum_squares_over_columns(site, m, roles)
    for r in roles:
        check_close(got[r], cols[r], f"grad_batch_columns[{r}]")
        check_close(diag[r].sum(0), (cols[r] ** 2).sum((0, 1)), f"sum_squares_over_columns[{r}]")
        check_close(batch[r], (cols[r] ** 2).sum(0), f"batch_sum_squares_over_columns[{r}]")


@settings(max_examples=20, deadline=None)
@given(v=st.integers(1, 12), n=st.integers(1, 3), p=st.integers(1, 5), e=st.integers(1, 6), d=st.integers(1, 4),
       pad=st.booleans(), seed=st.integers(0, 2**16))
def test_embedding_grad_batch_columns(v, n, p, e, d, pad, seed):
    """Embedding's all-columns per-sample gradients (one scatter) equal ``grad_batch`` per column,
    repeated indices and the padding row included."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, e, (n, p), generator=g)
    m = torch.randn(v, n, p, d, generator=g, dtype=torch.float64)
    site = Site(embedding.EMBEDDING, {"weight": "w"}, "emb", saved={"idx": idx},
                meta={"padding_idx": 0 if pad else None, "num_embeddings": e})
    got = embedding.grad_batch_columns(site, m, ["weight"])["weight"]
    want = torch.stack([embedding.grad_batch(site, m[k], ["weight"])["weight"] for k in range(v)])
    check_close(got, want, "embedding grad_batch_columns")


@pytest.mark.parametrize("cap", [1, 3, 10])
def test_packing_covers_every_column_once(cap):
    """``_packed``: every column of every set exactly once, in order, at most ``cap`` per batch."""
    entries = [(k, {}, {}, v) for k, v in enumerate([4, 1, 7, 2])]
    batches = list(hd._packed(entries, cap))
    assert all(sum(stop - start for _, start, stop in b) <= cap for b in batches)
    seen = [(e[0], c) for b in batches for e, start, stop in b for c in range(start, stop)]
    assert seen == [(k, c) for k, v in enumerate([4, 1, 7, 2]) for c in range(v)]
