"""An op on parameters that takes no extra leading dim, on heads merged into the batch dim
(SAM's decomposed relative position: ``einsum("bqc,qkc->bqk", q, R)`` with ``q [N·H, S, C]``
and ``R`` gathered from a learned table). The planner runs it once per sample on that
sample's rows (:class:`curvlib._plan.batch_merges.PerSample`), so its parameters get exact
per-sample quantities; before, it was refused (its output's dim 0 is ``N·H``)."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from oracles import zoo_checks
from oracles.checks import check_first_order, check_second_order
from oracles.merged_heads import merge, split
from oracles.on_device import seeded
from oracles.zoo import Problem

DT = torch.float64


class RelPosHeads(nn.Module):
    """Attention with heads merged into the batch (batch-major or head-major), scores
    ``q kᵀ/√C + einsum(q, table[i - j])``, softmax, ``· v``, split back, a Linear head."""

    def __init__(self, heads: int, size: int, dim: int, head_major: bool):
        super().__init__()
        self.heads, self.hd, self.head_major = heads, dim // heads, head_major
        self.qkv = nn.Linear(dim, 3 * dim)
        self.table = nn.Parameter(0.3 * torch.randn(2 * size - 1, dim // heads))
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        n, s, _ = x.shape
        q, k, v = self.qkv(x).reshape(n, s, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)  # [N, H, S, C]
        q, k, v = (merge(t, self.head_major) for t in (q, k, v))                           # [N·H, S, C]
        pos = torch.arange(s)
        rel = self.table[pos[:, None] - pos[None, :] + s - 1]                              # [S, S, C]
        scores = q @ k.transpose(1, 2) / self.hd ** 0.5 + torch.einsum("bqc,qkc->bqk", q, rel)
        out = split(scores.softmax(-1) @ v, n, self.heads, self.head_major)                # [N, H, S, C]
        return self.head(out.transpose(1, 2).reshape(n, s, -1).mean(1))


def _case(seed: int, n: int, heads: int, head_major: bool):
    torch.manual_seed(seed)
    model = RelPosHeads(heads, size=3, dim=4, head_major=head_major).to(DT).eval()
    gen = seeded(seed)
    X = torch.randn(n, 3, 4, generator=gen, dtype=DT)
    y = torch.randint(0, 3, (n,), generator=gen)
    return model, nn.CrossEntropyLoss(), X, y


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 3), heads=st.sampled_from([2, 4]), head_major=st.booleans())
def test_einsum_on_merged_heads_first_order(seed, n, heads, head_major):
    check_first_order(*_case(seed, n, heads, head_major))


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 3), head_major=st.booleans())
def test_einsum_on_merged_heads_second_order(seed, n, head_major):
    check_second_order(*_case(seed, n, 2, head_major), hessian=False)


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 3), head_major=st.booleans())
def test_einsum_on_merged_heads_hessian_diagonals(seed, n, head_major):
    """DiagHessian and BatchDiagHessian against the brute-force per-sample Hessian diagonals
    (the per-sample op's own second derivative, bilinear in ``q`` and the table)."""
    model, lossfn, X, y = _case(seed, n, 2, head_major)
    zoo_checks.check_problem(Problem(model, X, y, lossfn, None, ""), "hessian")
