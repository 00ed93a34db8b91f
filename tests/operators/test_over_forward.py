"""One vector's Hessian product, reverse over forward, on what it computes its own way: the
forward-mode rules of linear, softmax, log_softmax and layer_norm (``curvlib.operators._duals``)
and the loss's derivatives a few samples at a time (``Batch.loss_derivative``); the products
flattened entry by entry (``ParameterSpace.flatten_emptying``).

Oracles in float64: ``H v`` by reverse over reverse through ``torch.func`` (``vjp`` of ``grad``:
the Hessian is symmetric), the loss's gradient by ``torch.func.grad`` of the whole loss and its
Hessian's product by ``vjp`` of that gradient.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib.operators import Hessian
from curvlib._transform import network as network_module
from curvlib._transform.network import Network

from oracles.on_device import seeded

D = torch.float64


class TiedLM(nn.Module):
    """Tokens -> embedding + positions -> LayerNorm -> one causal softmax attention head (scores
    with ``−inf``) and a log_softmax -> a Linear across time on the transposed activations ->
    LayerNorm without affine -> head tied to the embedding (no bias), logits ``[N, V, T]``."""

    def __init__(self, vocab=300, d=6, length=5):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Parameter(0.3 * torch.randn(length, d))
        self.norm, self.qkv, self.mix = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(length, length)
        self.out_norm = nn.LayerNorm(d, elementwise_affine=False)
        self.register_buffer("mask", torch.triu(torch.full((length, length), float("-inf")), 1))

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos
        q, k, v = self.qkv(self.norm(h)).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(1, 2) + self.mask, dim=-1, dtype=torch.float64)
        h = h + a @ v + torch.log_softmax(q, dim=-1)
        h = h + self.mix(h.transpose(1, 2)).transpose(1, 2)
        return F.linear(self.out_norm(h), self.embed.weight).transpose(1, 2)


def _hvp_reference(model, lossfn, X, y, v):
    params = {n: p.detach() for n, p in model.named_parameters()}
    names = list(params)
    sizes = [p.numel() for p in params.values()]

    def loss(flat):
        theta = {n: t.view_as(params[n]) for n, t in zip(names, flat.split(sizes))}
        return lossfn(torch.func.functional_call(model, theta, (X,)), y)

    theta = torch.cat([p.reshape(-1) for p in params.values()])
    return torch.func.vjp(torch.func.grad(loss), theta)[1](v)[0]


@pytest.mark.parametrize("seed", [0, 1])
def test_tied_head_attention_and_layer_norms(seed):
    """A language model with a head tied to its embedding (vocabulary 300 > the width), causal
    attention, log_softmax, a Linear on transposed activations and a LayerNorm without affine:
    reverse over forward is taken and exact."""
    torch.manual_seed(seed)
    model = TiedLM().to(D)
    g = seeded(seed)
    X, y = torch.randint(0, 300, (3, 5), generator=g), torch.randint(0, 300, (3, 5), generator=g)
    y[1, 2] = -100  # (an ignored target)
    lossfn = nn.CrossEntropyLoss(label_smoothing=0.1)
    H = Hessian(model, lossfn, (X, y))
    v = torch.randn(H.shape[1], dtype=D, generator=g)
    want = _hvp_reference(model, lossfn, X, y, v)
    got = H @ v
    assert H.over_forward
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-11), float((got - want).abs().max())


class Logits(nn.Module):
    """``x [N, T, d]`` -> a Linear -> ``[N, K, T]`` (or ``[N, K]`` for ``x [N, d]``)."""

    def __init__(self, d, k):
        super().__init__()
        self.lin = nn.Linear(d, k)

    def forward(self, x):
        out = self.lin(x)
        return out.transpose(1, 2) if out.dim() == 3 else out


def _ce_targets(g, kind, n, k, t, ignored):
    """Class indices (or probabilities); ``ignored``: the first sample's targets all ignored (its
    chunk counts nothing: its own mean is 0/0), or every third target."""
    shape = (n,) if t is None else (n, t)
    if kind == "probabilities":
        return torch.softmax(torch.randn(shape[:1] + (k,) + shape[1:], generator=g, dtype=D), 1)
    y = torch.randint(1, k, shape, generator=g)
    if ignored == "first":
        y[0] = 0 if kind == "ce-weighted" else -100  # (class 0 weighs nothing: label smoothing still reads it)
    elif ignored == "some":
        y.view(-1)[::3] = -100
    if y.view(-1)[-1] in (0, -100):
        y.view(-1)[-1] = 1  # (something counted: a mean over nothing is NaN in torch)
    return y


configs = st.tuples(st.integers(0, 10**6), st.integers(1, 11), st.sampled_from([None, 3]),
                    st.sampled_from(["ce", "ce-weighted", "probabilities", "mse"]), st.sampled_from(["mean", "sum"]),
                    st.sampled_from([None, "first", "some"]), st.sampled_from([0.0, 0.2]))


@settings(max_examples=40, deadline=None)
@given(configs)
def test_loss_derivatives_by_chunks_of_samples(config):
    """``∇_f L`` and ``∇²_f L · u`` a few samples at a time equal the whole loss's, for
    cross-entropy (class weights, ignored targets, label smoothing, probabilities) and squared
    error, ``"mean"`` and ``"sum"``, a chunk that counts nothing included (with label smoothing
    and a class of weight 0 its terms still have a gradient, which its own mean cannot give)."""
    seed, n, t, kind, reduction, ignored, smoothing = config
    g, k, d = seeded(seed), 4, 3
    if kind == "mse":
        lossfn = nn.MSELoss(reduction=reduction)
    else:
        weight = torch.cat([torch.zeros(1, dtype=D), torch.rand(k - 1, generator=g, dtype=D) + 0.5]) \
            if kind == "ce-weighted" else None
        lossfn = nn.CrossEntropyLoss(weight=weight, reduction=reduction, label_smoothing=smoothing)
    X = torch.randn((n, d) if t is None else (n, t, d), generator=g, dtype=D)
    out = torch.randn((n, k) if t is None else (n, k, t), generator=g, dtype=D)
    y = torch.randn(out.shape, generator=g, dtype=D) if kind == "mse" else \
        _ce_targets(g, kind, n, k, t, None if kind == "probabilities" else ignored)
    batch = Network(Logits(d, k).to(D), lossfn).batch(X, y)
    u = torch.randn(out.shape, generator=g, dtype=D)
    gradient = torch.func.grad(lambda o: lossfn(o, y))
    want_grad = gradient(out)
    want_hvp = torch.func.vjp(gradient, out)[1](u)[0]  # (the loss Hessian is symmetric)
    with mock.patch.object(network_module, "LOSS_CHUNK_ENTRIES", 1):  # (chunks of samples even for a small output)
        got_grad, got_hvp = batch.loss_derivative(out), batch.loss_derivative(out, u)
    assert torch.allclose(got_grad, want_grad, rtol=1e-10, atol=1e-13), float((got_grad - want_grad).abs().max())
    assert torch.allclose(got_hvp, want_hvp, rtol=1e-10, atol=1e-13), float((got_hvp - want_hvp).abs().max())


@pytest.mark.parametrize("k", [None, 1, 3])
def test_flatten_emptying_equals_flatten(k):
    """The products' flattening entry by entry equals ``flatten`` and empties the dict it reads
    (each entry freed once copied); an entry that requires grad goes through ``flatten``."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    X, y = torch.randn(5, 3, dtype=D), torch.randint(0, 2, (5,))
    space = Hessian(model, nn.CrossEntropyLoss(), (X, y)).codomain
    g = seeded(7)
    entries = {n: torch.randn(((k,) if k else ()) + tuple(s), generator=g, dtype=D)
               for n, s in zip(space.names, space.shapes)}
    want = space.flatten(entries)
    taken = dict(reversed(list(entries.items())))  # (any order)
    got = space.flatten_emptying(taken)
    assert torch.equal(got, want) and got.shape == want.shape and not taken
    leaf = {n: t.clone().requires_grad_(True) for n, t in entries.items()}
    assert torch.equal(space.flatten_emptying(dict(leaf)), want)


class StdConvNet(nn.Module):
    """A weight-standardised convolution (timm's ``StdConv2d``: the weight normalised by a
    training-mode ``F.batch_norm`` over its own entries), then a head; ``affine``: the
    standardisation with a scale and shift of its own."""

    def __init__(self, affine: bool):
        super().__init__()
        self.conv, self.head = nn.Conv2d(2, 6, 3), nn.Linear(6, 3)
        self.gamma, self.beta = (nn.Parameter(torch.rand(6) + 0.5), nn.Parameter(torch.randn(6))) if affine else (None, None)

    def forward(self, x):
        w = F.batch_norm(self.conv.weight.reshape(1, 6, -1), None, None, self.gamma, self.beta, training=True,
                         momentum=0.0, eps=1e-6).reshape_as(self.conv.weight)
        h = torch.tanh(F.conv2d(x, w, self.conv.bias))
        return self.head(h.mean((2, 3)))


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), affine=st.booleans())
def test_batch_norm_on_its_own_statistics_goes_reverse_over_forward_exactly(seed, affine):
    """One vector's Hessian product, reverse over forward, through a training-mode batch norm
    without running statistics (torch's forward-mode derivative of the kernel is wrong when
    differentiated again), against reverse over reverse by torch.func."""
    torch.manual_seed(seed)
    model = StdConvNet(affine).to(D)
    X, y = torch.randn(4, 2, 5, 5, dtype=D), torch.randint(0, 3, (4,))
    lossfn = nn.CrossEntropyLoss()
    theta = {n: p.detach() for n, p in model.named_parameters()}
    g = seeded(seed)
    v = {n: torch.randn(t.shape, generator=g, dtype=D) for n, t in theta.items()}
    grad = torch.func.grad(lambda p: lossfn(torch.func.functional_call(model, p, (X,)), y))
    want = torch.func.vjp(grad, theta)[1](v)[0]
    H = Hessian(model, lossfn, (X, y))
    H.over_forward = True  # (the route under test, whatever the probe on the small tensors finds)
    got = H @ v
    for n in theta:
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-11, msg=n)
