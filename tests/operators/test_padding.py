"""Embeddings with a padding row under the whole-network operators, against dense float64 brute
force by reverse mode (``jacrev``), which holds the padding row constant: ``∂ out / ∂ W[pad] = 0``.

torch's forward-mode derivative of ``embedding`` ignores ``padding_idx``, so a product through
``J v`` must hold the row constant itself, wherever the look-up runs: on the model's inputs, or
on indices the forward makes itself (a layer on constants, RoCBert's ``torch.zeros`` shape ids),
by the module or by ``F.embedding``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib.operators import GGN, Hessian

from oracles.dense_operators import dense_ggn_and_hessian
from oracles.on_device import seeded

D = torch.float64


class _Lookups(nn.Module):
    """A token embedding of the input and a second table with ``padding_idx`` looked up at
    ``ids`` from the input, or at constant ``ids`` the forward makes (all the padding index, or
    every row in turn), by the module or functionally; concatenated, then a Linear head."""

    def __init__(self, pad: int, ids: str, functional: bool):
        super().__init__()
        self.tokens, self.table = nn.Embedding(5, 3), nn.Embedding(4, 2, padding_idx=pad)
        self.head, self.ids, self.functional = nn.Linear(5, 2), ids, functional

    def forward(self, x):
        if self.ids == "input":
            ids = x % 4
        elif self.ids == "zeros":
            ids = torch.zeros(x.shape, dtype=torch.long, device=x.device) + self.table.padding_idx % 4
        else:
            ids = torch.arange(x.shape[1], device=x.device).expand(x.shape) % 4
        second = (F.embedding(ids, self.table.weight, self.table.padding_idx) if self.functional
                  else self.table(ids))
        return self.head(torch.cat([self.tokens(x), second], -1)).mean(1)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), pad=st.sampled_from([0, 2, -1]), ids=st.sampled_from(["input", "zeros", "arange"]),
       functional=st.booleans())
def test_padding_row_constant_in_products(seed, pad, ids, functional):
    torch.manual_seed(seed)
    model = _Lookups(pad, ids, functional).to(D)
    with torch.no_grad():  # (the padding row need not be zero; its derivative must)
        model.table.weight.normal_()
    g = seeded(seed)
    X, y = torch.randint(0, 5, (4, 3), generator=g), torch.randint(0, 2, (4,), generator=g)
    lossfn = nn.CrossEntropyLoss()
    G, H = dense_ggn_and_hessian(model, lossfn, X, y)
    assert torch.allclose(GGN(model, lossfn, (X, y)).to_dense(), G, rtol=1e-10, atol=1e-12)
    assert torch.allclose(Hessian(model, lossfn, (X, y)).to_dense(), H, rtol=1e-10, atol=1e-12)
