"""Models called with keyword inputs (``X`` a dict whose keys name the forward's arguments,
``model(**X)``) on both front ends, against the float64 brute force.

torch.fx traces ``model(**X)`` through a holder: one placeholder per tensor of the dict, the
forward's other arguments at their defaults. The model builds a mask as transformers does:
``torch.vmap`` over an index range taken from the input's shape, and ``torch.finfo`` of a
traced dtype; torch.fx records each as one call, the ATen-level trace evaluates the mask once
(a constant: it reads neither inputs nor parameters). The two front ends give the brute
force's values. A vmapped function that reads the input through its closure is refused for
the graph-based quantities with a ``CurvatureError``; first order still runs.

The brute force runs on an adapter taking the dict's tensors packed in one tensor: the same
model at ``model.``, so its parameters' names carry that prefix.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib._core.settings import override
from curvlib.extensions import KFLR, BatchGrad, DiagGGNExact

from oracles.on_device import seeded
from oracles.reference import assert_matches, exact_extensions, kflr_map, reference

DT = torch.float64
D, H, C = 3, 4, 2


def returns_logits(forward):
    """A ``(*args, **kwargs)`` wrapper of the kind transformers puts on forwards."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return forward(self, *args, **kwargs)["logits"]

    return wrapper


class Keywords(nn.Module):
    def __init__(self, reads_input: bool = False, masks: bool = True):
        super().__init__()
        self.inp, self.act, self.out = nn.Linear(D, H), nn.Tanh(), nn.Linear(H, C)
        self.reads_input, self.masks = reads_input, masks

    @returns_logits
    def forward(self, x, gate=None, position_ids=None, labels=None, use_cache=None, scale: float = 1.0, **kwargs):
        h = self.act(self.inp(x)) * scale
        if not self.masks:
            return {"logits": self.out(h * gate if gate is not None else h)}
        # a mask over an index range from the input's shape, built by torch.vmap (transformers'
        # masks): the first H - 1 features kept
        keep = torch.vmap(lambda i: i < H - 1)(torch.arange(h.shape[-1], device=h.device))
        if self.reads_input:  # a mask function that reads the input through its closure
            first = x[:, 0]
            keep = torch.vmap(lambda i: first[i] > -100.0)(torch.arange(h.shape[0]))[:, None] & keep
        h = torch.where(keep, h, torch.zeros((), dtype=h.dtype))
        h = h.clamp(min=torch.finfo(h.dtype).min)  # (the identity on finite values)
        if gate is not None:
            h = h * gate
        return {"logits": self.out(h)}


class Packed(nn.Module):
    """The brute force's model: ``Keywords`` on one tensor ``[x | gate]``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, xg):
        return self.model(x=xg[:, :D], gate=xg[:, D:])


def _unprefixed(ref: dict) -> dict:
    return {k: ({n[len("model."):]: v for n, v in q.items()} if isinstance(q, dict) else q) for k, q in ref.items()}


def _problem(n: int, seed: int, gate_first: bool, reads_input: bool = False, masks: bool = True):
    torch.manual_seed(seed)
    model = Keywords(reads_input, masks).to(DT)
    gen = seeded(seed)
    x = torch.randn(n, D, generator=gen, dtype=DT)
    gate = torch.rand(n, H, generator=gen, dtype=DT) + 0.5
    X = {"gate": gate, "x": x} if gate_first else {"x": x, "gate": gate}
    y = torch.randint(0, C, (n,), generator=gen)
    return model, X, y, torch.cat([x, gate], 1)


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 4), seed=st.integers(0, 2**16), gate_first=st.booleans(), aten=st.booleans(),
       masks=st.booleans())
def test_keyword_inputs_on_both_front_ends(n, seed, gate_first, aten, masks):
    model, X, y, packed = _problem(n, seed, gate_first, masks=masks)
    lossfn = nn.CrossEntropyLoss()
    oracle = Packed(model)
    ref = _unprefixed(reference(oracle, lossfn, packed, y, hessian=False, kflr=kflr_map(oracle)))
    with override(aten_front_end=aten):
        qs = curvature(model, lossfn, exact_extensions(hessian=False, kflr=True))(X, y)
    assert_matches(qs, ref, f"keyword inputs ({'ATen' if aten else 'torch.fx'} front end)")


def test_front_ends_agree_on_keyword_inputs():
    model, X, y, _ = _problem(3, 0, gate_first=False)
    lossfn = nn.CrossEntropyLoss()
    out = {}
    for aten in (False, True):
        with override(aten_front_end=aten):
            out[aten] = curvature(model, lossfn, [BatchGrad(), DiagGGNExact(), KFLR()])(X, y)
    for key in ("grad_batch", "diag_ggn_exact"):
        for name, v in out[False][key].items():
            torch.testing.assert_close(out[True][key][name], v, rtol=1e-12, atol=1e-14)
    for name, fs in out[False]["kflr"].items():
        for a, b in zip(out[True]["kflr"][name], fs):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("aten", [False, True])
def test_vmap_reading_the_input_is_refused_for_the_graph(aten):
    model, X, y, packed = _problem(3, 1, gate_first=False, reads_input=True)
    lossfn = nn.CrossEntropyLoss()
    with override(aten_front_end=aten):
        with pytest.raises(CurvatureError, match="could not be traced"):
            curvature(model, lossfn, [DiagGGNExact()])(X, y)
        qs = curvature(model, lossfn, [BatchGrad()])(X, y)  # first order runs the model as it is
    ref = _unprefixed(reference(Packed(model), lossfn, packed, y, hessian=False))
    for name, v in qs["grad_batch"].items():
        torch.testing.assert_close(v, ref["grad_batch"][name], rtol=1e-10, atol=1e-12)


class MarkedEmbedding(nn.Embedding):
    """An embedding subclass with a parameter of its own written over one token's rows by a
    boolean mask (T5Gemma2's end-of-image embedding)."""

    def __init__(self, num: int, dim: int, marker: int):
        super().__init__(num, dim)
        self.marker = marker
        self.marked = nn.Parameter(torch.zeros(dim))

    def forward(self, ids):
        e = super().forward(ids) * 1.5
        e[ids == self.marker] = self.marked.to(e.dtype)
        return e


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.act, self.out = MarkedEmbedding(5, H, marker=2), nn.Tanh(), nn.Linear(H, C)

    def forward(self, input_ids):
        return self.out(self.act(self.embed(input_ids))).sum(1)


@settings(max_examples=4, deadline=None)
@given(n=st.integers(1, 4), seed=st.integers(0, 2**16), keywords=st.booleans())
def test_embedding_subclass_with_a_masked_parameter(n, seed, keywords):
    """Traced at the ATen level: the ``embedding`` op is the family's rule on the weight alone,
    the extra parameter a site of its own, its masked write run per sample without a boolean
    index (which torch.vmap cannot batch)."""
    torch.manual_seed(seed)
    model = Tagger().to(DT)
    with torch.no_grad():
        model.embed.marked.normal_()
    gen = seeded(seed)
    ids = torch.randint(0, 5, (n, 6), generator=gen)
    ids[0, 0] = 2  # the marker occurs
    y = torch.randint(0, C, (n,), generator=gen)
    lossfn = nn.CrossEntropyLoss()
    ref = reference(model, lossfn, ids, y, hessian=False, kflr=None)
    qs = curvature(model, lossfn, exact_extensions(hessian=False))({"input_ids": ids} if keywords else ids, y)
    assert_matches(qs, ref, "embedding subclass")


class PairBlock(nn.Module):
    """Returns a tuple, and checks its input's type (torch.fx's proxy fails it: an opaque leaf)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, H)

    def forward(self, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError("expects a tensor")
        return torch.tanh(self.lin(x)), x


class NoMakeFx(nn.Module):
    """Keyword inputs, a forward that refuses to run under make_fx (no ATen-level trace) and an
    opaque submodule returning a tuple (no generic rule can run it whole)."""

    def __init__(self):
        super().__init__()
        self.block, self.out = PairBlock(), nn.Linear(H, C)

    def forward(self, x, gate):
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        if get_proxy_mode() is not None:
            raise RuntimeError("this forward does not run under make_fx")
        return self.out(self.block(x)[0] * gate)


def test_opaque_tuple_module_with_keyword_inputs_runs_first_order_eagerly():
    """First order runs the model as it is, called with ``X`` as keywords (exact); the GGN is
    refused with a CurvatureError naming the module."""
    torch.manual_seed(0)
    model = NoMakeFx().to(DT)
    _, X, y, packed = _problem(3, 0, gate_first=False)
    lossfn = nn.CrossEntropyLoss()
    qs = curvature(model, lossfn, [BatchGrad()])(X, y)
    ref = _unprefixed(reference(Packed(model), lossfn, packed, y, hessian=False))
    for name, v in qs["grad_batch"].items():
        torch.testing.assert_close(v, ref["grad_batch"][name], rtol=1e-10, atol=1e-12)
    with pytest.raises(CurvatureError, match="block"):
        curvature(model, lossfn, [DiagGGNExact()])(X, y)
