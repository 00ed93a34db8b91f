"""Linear's read-offs over all columns of a root at once (``curvlib.rules._linear_columns``: one
batched product, Gram matrices over positions), and Embedding's, against ``grad_batch`` column
by column (float64)."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from curvlib._core.site import Site
from curvlib.rules import embedding, linear

from oracles.checks import check_close
from oracles.on_device import seeded


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
    g = seeded(seed)
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
    g = seeded(seed)
    idx = torch.randint(0, e, (n, p), generator=g)
    m = torch.randn(v, n, p, d, generator=g, dtype=torch.float64)
    site = Site(embedding.EMBEDDING, {"weight": "w"}, "emb", saved={"idx": idx},
                meta={"padding_idx": 0 if pad else None, "num_embeddings": e})
    got = embedding.grad_batch_columns(site, m, ["weight"])["weight"]
    want = torch.stack([embedding.grad_batch(site, m[k], ["weight"])["weight"] for k in range(v)])
    check_close(got, want, "embedding grad_batch_columns")


@settings(max_examples=25, deadline=None)
@given(v=st.integers(2, 40), n=st.integers(1, 3), s=st.integers(2, 6), i=st.integers(1, 9), o=st.integers(1, 5),
       transposed=st.booleans(), per_sample=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_weighted_column_read_offs(v, n, s, i, o, transposed, per_sample, seed):
    """Columns with a sign per (column, sample) read as they are, ``Σ_v w_vn grad_batch(m_v)²``, equal
    the per-column ``grad_batch`` squared and weighted; ``None`` where the Gram matrices cost more."""
    g = seeded(seed)
    x = torch.randn(n, s, i, generator=g, dtype=torch.float64)
    m = torch.randn(v, n, s, o, generator=g, dtype=torch.float64)
    w = torch.where(torch.rand(v, n, generator=g) < 0.5, 1.0, -1.0).to(torch.float64)
    site = _linear_site(x, transposed)
    rule, roles = site.rule, ["weight", "bias"]
    got = rule.weighted_squares_over_columns(site, m, roles, w, per_sample)
    if s * (v + i) >= v * i:
        assert got is None
        return
    for r in roles:
        cols = torch.stack([rule.grad_batch(site, m[k], roles)[r] for k in range(v)])  # [V, N, *p]
        want = (w.reshape(v, n, *([1] * (cols.dim() - 2))) * cols ** 2).sum(0)
        check_close(got[r], want if per_sample else want.sum(0), f"weighted_squares_over_columns[{r}]")
