"""A forward decorated by a ``functools.wraps`` wrapper that takes ``(*args, **kwargs)`` (as
transformers' ``can_return_tuple``) around a forward with many named inputs and ``**kwargs``:
torch.fx reads the inner signature but rewrites the wrapper's code, which holds too few
variable names for it ("co_varnames is too small"). The trace goes through a function of the
inner signature that calls the wrapper: the graph-based quantities run and equal the brute force.
(The model builds a mask by ``torch.vmap``, as transformers does, which only torch.fx traces.)"""

from __future__ import annotations

import functools

import torch
from hypothesis import given, settings, strategies as st
from torch import nn


from oracles.checks import check_first_order, check_second_order
from oracles.on_device import seeded
from oracles.reference import kflr_map

DT = torch.float64


def returns_tuple(forward):
    """A wrapper of the kind transformers puts on forwards: ``(*args, **kwargs)``, one local."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        return out["logits"]

    return wrapper


class ManyInputs(nn.Module):
    def __init__(self, d=3, c=2):
        super().__init__()
        self.inp, self.act, self.out = nn.Linear(d, 4), nn.Tanh(), nn.Linear(4, c)

    @returns_tuple
    def forward(self, x, mask=None, position_ids=None, cache=None, embeds=None, labels=None,
                use_cache=None, output_attentions=None, scale: float = 1.0, **kwargs):
        # a mask built by torch.vmap, as transformers builds attention masks: the ATen front end
        # cannot trace it, so the model goes through torch.fx
        keep = torch.vmap(lambda i: i >= 0)(torch.arange(4))
        h = self.act(self.inp(x)) * scale * keep
        if mask is not None:
            h = h * mask
        return {"logits": self.out(h)}


@settings(max_examples=4, deadline=None)
@given(n=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_wrapped_forward_with_many_inputs(n, seed):
    torch.manual_seed(seed)
    model = ManyInputs().to(DT)
    gen = seeded(seed)
    X = torch.randn(n, 3, generator=gen, dtype=DT)
    y = torch.randint(0, 2, (n,), generator=gen)
    lossfn = nn.CrossEntropyLoss()
    check_first_order(model, lossfn, X, y)
    check_second_order(model, lossfn, X, y, hessian=True, kflr=kflr_map(model))
