"""A model that caches tensors in its own containers during ``forward`` (timm's attention-bias
caches: ``self.cache[key] = self.biases[:, self.idx]`` in eval mode).

Tracing must neither leave a traced value in the model (the next trace, a retry or a later
call, would read another graph's node) nor change the model: its containers are as they were.
Oracle: float64 brute force from plain autograd on a fresh copy of the model (an empty cache).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import curvature
from curvlib.extensions import BatchGrad, DiagGGNExact

DT = torch.float64


class Cached(nn.Module):
    """Linear -> a bias gathered from a parameter, cached per key in eval mode -> opaque tail."""

    def __init__(self, opaque_tail: bool):
        super().__init__()
        self.lin = nn.Linear(4, 5)
        self.biases = nn.Parameter(torch.randn(7))
        self.register_buffer("idx", torch.tensor([0, 2, 4, 5, 6]))
        self.cache = {}
        self.seen = []
        self.tail = Untraceable() if opaque_tail else nn.Tanh()

    def bias(self, key: str):
        if self.training:
            return self.biases[self.idx]
        if key not in self.cache:
            self.cache[key] = self.biases[self.idx]
            self.seen.append(key)
        return self.cache[key]

    def forward(self, x):
        return self.tail(self.lin(x) + self.bias(str(x.device)))


class Untraceable(nn.Module):
    """A module torch.fx cannot trace (a branch on a value): a retry makes it a leaf."""

    def forward(self, h):
        return torch.tanh(h) if bool(h.sum() > -1e9) else h


def _brute(model, X, y, lossfn):
    fresh = copy.deepcopy(model)
    fresh.cache.clear()
    params = dict(fresh.named_parameters())

    def loss_n(p, x, t):
        fresh.cache.clear()
        return lossfn(torch.func.functional_call(fresh, p, (x[None],)), t[None])

    per_sample = [torch.func.grad(loss_n)(params, X[i], y[i]) for i in range(X.shape[0])]  # (a branch on values)
    return {k: torch.stack([g[k] for g in per_sample]) for k in params}


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 4), opaque_tail=st.booleans())
def test_a_cache_filled_in_forward_is_left_as_found(seed, n, opaque_tail):
    torch.manual_seed(seed)
    model = Cached(opaque_tail).to(DT).eval()
    X, y = torch.randn(n, 4, dtype=DT), torch.randint(0, 5, (n,))
    lossfn = nn.CrossEntropyLoss(reduction="sum")
    qs = curvature(model, lossfn, [BatchGrad(), DiagGGNExact()])(X, y)
    assert model.cache == {} and model.seen == []  # the model is not changed
    ref = _brute(model, X, y, lossfn)
    for name, g in ref.items():
        torch.testing.assert_close(qs["grad_batch"][name], g)
    qs2 = curvature(model, lossfn, [BatchGrad()])(X, y)  # a second call traces again
    for name, g in ref.items():
        torch.testing.assert_close(qs2["grad_batch"][name], g)
    assert model.cache == {}
