"""Parametrized modules the generic rule runs whole (torch.fx cannot trace them), written the
way mixture-of-experts blocks are (JetMoE's attention experts): rows routed by their values
with the group sizes read into Python (``.tolist()``, which ``vmap`` cannot run), an argument
built from the batch size with one equal row per sample (an attention mask expanded to the
batch). Individual gradients and the GGN diagonal against the float64 brute force.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import curvature
from curvlib.extensions import BatchGrad, DiagGGNExact

from oracles.first_order import individual_gradients
from oracles.on_device import seeded
from oracles.second_order import ggn_block

DT = torch.float64


class Routed(nn.Module):
    """Each row of ``h [N, T, D]`` goes to one of two experts by the sign of its sum; rows are
    sorted by expert, split by the counted sizes, transformed, put back, and masked (a module that
    sorts the batch's rows: run whole, :mod:`curvlib._trace.module_calls`)."""

    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, d, d, generator=seeded(3), dtype=DT) / d)

    def forward(self, h, mask):
        n, t, d = h.shape
        flat = h.reshape(-1, d)
        choice = (flat.sum(-1) > 0).long()
        order = torch.argsort(choice, stable=True)
        sizes = torch.bincount(choice, minlength=2).tolist()
        parts = flat[order].split(sizes)
        out = torch.cat([torch.tanh(p @ self.w[e]) for e, p in enumerate(parts)])
        back = torch.zeros_like(out).index_add(0, order, out)
        return back.reshape(n, t, d) * mask


class RoutedNet(nn.Module):
    def __init__(self, d: int = 3, c: int = 3):
        super().__init__()
        self.inp, self.mid, self.head = nn.Linear(3, d), Routed(d), nn.Linear(d, c)

    def forward(self, x):
        h = self.inp(x)
        mask = torch.ones(x.shape[0], x.shape[1], 1, dtype=x.dtype)  # one (equal) row per sample
        return self.head(self.mid(h, mask).sum(1))


@settings(max_examples=6, deadline=None)
@given(n=st.integers(2, 4), t=st.integers(2, 3), seed=st.integers(0, 2**16))
def test_routed_module_run_whole(n, t, seed):
    """On the ATen-level trace (a dict input reaches forward as keywords), where the routing
    module is kept whole: individual gradients and the GGN diagonal. (``T ≥ 2``: with one row
    per sample, a sort of the rows is one of whole samples, refused as mixing them.)"""
    torch.manual_seed(seed)
    model = RoutedNet().to(DT)
    gen = seeded(seed)
    X, y = torch.randn(n, t, 3, generator=gen, dtype=DT), torch.randint(0, 3, (n,), generator=gen)
    lossfn = nn.CrossEntropyLoss()
    qs = curvature(model, lossfn, [BatchGrad(), DiagGGNExact()])({"x": X}, y)
    want = individual_gradients(model, lossfn, X, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(qs["grad_batch"][name], want[name])
        G = ggn_block(model, lossfn, X, y, name)
        torch.testing.assert_close(qs["diag_ggn_exact"][name], G.diagonal().reshape(p.shape))


class VmapEncoder(nn.Module):
    """Runs ``torch.vmap`` inside its forward (neither torch.fx nor the ATen-level trace enters
    it: a generic site) and returns a container with one floating-point tensor, as transformers'
    encoders return a ``ModelOutput``."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h):
        z = torch.vmap(lambda row: torch.tanh(self.lin(row)))(h)
        return {"last_hidden_state": z, "length": torch.tensor(h.shape[1]), "attentions": None}


class EncoderNet(nn.Module):
    def __init__(self, d: int = 3, c: int = 3):
        super().__init__()
        self.inp, self.enc, self.head = nn.Linear(3, d), VmapEncoder(d), nn.Linear(d, c)

    def forward(self, x):
        return self.head(self.enc(self.inp(x))["last_hidden_state"].sum(1))


@settings(max_examples=4, deadline=None)
@given(n=st.integers(1, 3), t=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_module_run_whole_returning_a_container(n, t, seed):
    torch.manual_seed(seed)
    model = EncoderNet().to(DT)
    gen = seeded(seed)
    X, y = torch.randn(n, t, 3, generator=gen, dtype=DT), torch.randint(0, 3, (n,), generator=gen)
    qs = curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])(X, y)
    want = individual_gradients(model, nn.CrossEntropyLoss(), X, y)
    for name in want:
        torch.testing.assert_close(qs["grad_batch"][name], want[name])
