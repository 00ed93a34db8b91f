"""In-place updates inside ``forward`` on parameter uses outside any layer (functional sites).

BERT-style embeddings write ``embeddings += position_embeddings``; a layer scale may be
``h.mul_(self.gamma)``. The functional rule re-evaluates such a node as a function of the
parameters under ``torch.func.vjp``, which refuses an in-place update of a captured tensor:
the rule updates a copy and lets later readers of the overwritten tensor see the result, as
eager PyTorch does. Checked with hypothesis over the spelling of the update, the tensor it
writes into and the front end (torch.fx or the ATen level), against the brute-force oracles.
"""

from __future__ import annotations

import operator

import torch
from hypothesis import given, strategies as st
from torch import nn

from curvlib import curvature

from oracles.reference import assert_matches, exact_extensions, reference
from oracles.on_device import seeded

DT = torch.float64
UPDATES = {
    "iadd": lambda h, p: operator.iadd(h, p),
    "add_": lambda h, p: h.add_(p),
    "mul_": lambda h, p: h.mul_(p),
    "sub_alpha": lambda h, p: h.sub_(p, alpha=0.5),
}


class InPlace(nn.Module):
    """``b(tanh(update(a(x), pos)))``, the update written in place (``into``: into the layer's
    output itself, or into a copy that another branch also reads after the update)."""

    def __init__(self, update: str, into: str, aten: bool, d: int = 3, h: int = 4, c: int = 3):
        super().__init__()
        self.a, self.b = nn.Linear(d, h), nn.Linear(h, c)
        self.pos = nn.Parameter(torch.randn(h, generator=seeded(5), dtype=DT))
        self.update, self.into, self.aten = update, into, aten

    def forward(self, x):
        if self.aten and bool(x.abs().sum() >= 0):  # a branch on values: the ATen front end
            x = x * 1.0
        h = self.a(x)
        target = h if self.into == "output" else h.clone()
        updated = UPDATES[self.update](target, self.pos * 1.5)
        if self.into == "alias":  # read the overwritten tensor by its old name
            return self.b(torch.tanh(target)) + 0.1 * self.b(updated)
        return self.b(torch.tanh(updated))


@given(update=st.sampled_from(sorted(UPDATES)), into=st.sampled_from(["output", "copy", "alias"]),
       aten=st.booleans(), seed=st.integers(0, 2**16))
def test_inplace_parameter_updates_are_exact(update, into, aten, seed):
    torch.manual_seed(seed)
    model = InPlace(update, into, aten).to(DT)
    g = seeded(seed)
    X, y = torch.randn(4, 3, generator=g, dtype=DT), torch.randint(0, 3, (4,), generator=g)
    lossfn = nn.CrossEntropyLoss()
    qs = curvature(model, lossfn, exact_extensions(hessian=True))(X, y)
    assert_matches(qs, reference(model, lossfn, X, y, hessian=True, pchmp=False), f"{update}/{into}/aten={aten}")


# writes into a tensor computed from parameters alone, before an op reads it (torchvision's
# Swin V2: ``qkv_bias = bias.clone(); qkv_bias[L:2L].zero_()``, a leaf function to torch.fx)
def _setitem(t, q):
    t[0:2] = 0.0


def _setitem_param(t, q):
    t[1:3] = q * 2.0


WRITES = {
    "zero_": lambda t, q: t[1:3].zero_(),
    "setitem": _setitem,
    "setitem_param": _setitem_param,
    "mul_view": lambda t, q: t.narrow(0, 1, 2).mul_(3.0),
    "copy_param": lambda t, q: t[2:4].copy_(q),
    "iadd_param": lambda t, q: t[0:2].add_(q),
}


def _write_then_linear(x, weight, bias, q, write, target):
    return _inline(x, weight, bias, q, write, target)


torch.fx.wrap("_write_then_linear")


class WrittenCopy(nn.Module):
    """``b(tanh(linear(x, W', b')))`` where ``W'``/``b'`` are copies of ``a``'s parameters with
    a slice written in place (``front``: torch.fx inlines the writes; ``leaf``: they sit in a
    function torch.fx keeps opaque; ``aten``: the ATen front end)."""

    def __init__(self, write: str, target: str, front: str, d: int = 3, h: int = 4, c: int = 3):
        super().__init__()
        self.a, self.b = nn.Linear(d, h), nn.Linear(h, c)
        self.q = nn.Parameter(torch.randn(2, generator=seeded(7), dtype=DT))
        self.write, self.target, self.front = write, target, front

    def forward(self, x):
        if self.front == "aten" and bool(x.abs().sum() >= 0):
            x = x * 1.0
        args = (x, self.a.weight, self.a.bias, self.q, self.write, self.target)
        h = _write_then_linear(*args) if self.front == "leaf" else _inline(*args)
        return self.b(torch.tanh(h))


def _inline(x, weight, bias, q, write, target):
    w, b = weight.clone(), bias.clone()
    t = w[:, 0] if target == "weight" else b
    early = t[0:2]  # a view read after the write: it sees the written values
    WRITES[write](t, q)
    return torch.nn.functional.linear(x, w, b) + early.sum()


@given(write=st.sampled_from(sorted(WRITES)), target=st.sampled_from(["weight", "bias"]),
       front=st.sampled_from(["fx", "leaf", "aten"]), seed=st.integers(0, 2**16))
def test_writes_into_parameter_copies_are_exact(write, target, front, seed):
    torch.manual_seed(seed)
    model = WrittenCopy(write, target, front).to(DT)
    g = seeded(seed)
    X, y = torch.randn(4, 3, generator=g, dtype=DT), torch.randint(0, 3, (4,), generator=g)
    lossfn = nn.CrossEntropyLoss()
    qs = curvature(model, lossfn, exact_extensions(hessian=True, kflr=False))(X, y)
    assert_matches(qs, reference(model, lossfn, X, y, hessian=True, pchmp=False), f"{write}/{target}/{front}")
