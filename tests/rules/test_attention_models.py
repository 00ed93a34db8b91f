"""Whole ``nn.Transformer``, attention dropout in training mode, and attention inside a user
module that owns parameters, against brute force (see :mod:`oracles.attention` for the
oracles and why they run in ``oracle_mode``)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import curvature
from curvlib.extensions import BatchDiagGGNExact, BatchGrad, DiagGGNExact, DiagHessian, GGNMP, HMP

from oracles.reference import assert_close, assert_matches, exact_extensions, product_matrix, reference
from oracles.attention import CE, DT, check_all
from oracles.on_device import seeded


class Seq2Seq(nn.Module):
    """``nn.Transformer`` (1 encoder + 1 decoder layer) on ``x [N, S+T, E]`` split into source and
    target: source mask (bool/float/none), causal target mask, memory mask, source and memory
    key padding from the input (key 0 is never hidden)."""

    def __init__(self, e, heads, s, t, norm_first, batch_first, src_mask, memory_mask, padding):
        super().__init__()
        self.tr = nn.Transformer(e, heads, 1, 1, 2 * e, dropout=0.1, batch_first=batch_first, norm_first=norm_first)
        self.head = nn.Linear(e, 3)
        self.s, self.batch_first, self.padding = s, batch_first, padding
        forbid = torch.ones(s, s, dtype=torch.bool).triu(1)
        self.register_buffer("src_mask", None if src_mask == "none" else forbid if src_mask == "bool" else
                             torch.randn(s, s, dtype=DT).masked_fill(forbid, -1e9))
        self.register_buffer("tgt_mask", nn.Transformer.generate_square_subsequent_mask(t, dtype=DT))
        self.register_buffer("memory_mask", torch.ones(t, s, dtype=torch.bool).triu(1) if memory_mask else None)
        self.register_buffer("later", torch.arange(s) > 0)

    def forward(self, x):
        src, tgt = x[:, :self.s], x[:, self.s:]
        pad = torch.logical_and(src[..., 0] > 0.3, self.later) if self.padding else None
        if not self.batch_first:
            src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)
        h = self.tr(src, tgt, src_mask=self.src_mask, tgt_mask=self.tgt_mask, memory_mask=self.memory_mask,
                    src_key_padding_mask=pad, memory_key_padding_mask=pad, tgt_is_causal=True)
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.head(h.mean(1))


@settings(deadline=None, max_examples=5)
@given(
    n=st.integers(1, 2), s=st.integers(1, 3), t=st.integers(1, 2), heads=st.sampled_from([1, 2]),
    norm_first=st.booleans(), batch_first=st.booleans(), src_mask=st.sampled_from(["none", "bool", "float"]),
    memory_mask=st.booleans(), padding=st.booleans(), seed=st.integers(0, 2**16),
)
def test_whole_transformer(n, s, t, heads, norm_first, batch_first, src_mask, memory_mask, padding, seed):
    """Every exact extension (first order, GGN family, Hessian family, products) through
    ``nn.Transformer``: encoder, decoder, memory, all its masks; dropout in eval."""
    torch.manual_seed(seed)
    model = Seq2Seq(4, heads, s, t, norm_first, batch_first, src_mask, memory_mask, padding).to(DT).eval()
    X = torch.randn(n, s + t, 4, dtype=DT)
    check_all(model, X, torch.randint(0, 3, (n,)))


# ----------------------------------------------------------------------------- attention dropout


class DropMHA(nn.Module):
    """Self-attention with dropout on the attention weights, then a linear head."""

    def __init__(self, e, heads, p):
        super().__init__()
        self.mha = nn.MultiheadAttention(e, heads, dropout=p, batch_first=True)
        self.head = nn.Linear(e, 3)

    def forward(self, x):
        return self.head(self.mha(x, x, x, need_weights=False)[0].mean(1))


class MaskedTwin(nn.Module):
    """``DropMHA`` in plain operations, its dropout noise ``[N, H, T, T]`` read from the input
    (packed after the features, so the per-sample oracles see each sample's own mask)."""

    def __init__(self, model: DropMHA, t: int):
        super().__init__()
        mha = model.mha
        self.in_proj_weight = nn.Parameter(mha.in_proj_weight.detach().clone())
        self.in_proj_bias = nn.Parameter(mha.in_proj_bias.detach().clone())
        self.out_proj, self.head = nn.Linear(mha.embed_dim, mha.embed_dim), nn.Linear(mha.embed_dim, 3)
        self.out_proj.load_state_dict(mha.out_proj.state_dict())
        self.head.load_state_dict(model.head.state_dict())
        self.h, self.e, self.t, self.p = mha.num_heads, mha.embed_dim, t, mha.dropout

    def forward(self, xp):
        e, h, t = self.e, self.h, self.t
        x, noise = xp[:, :t * e].unflatten(1, (t, e)), xp[:, t * e:].unflatten(1, (h, t, t))
        proj = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        q, k, v = (proj[..., i * e:(i + 1) * e].unflatten(-1, (h, e // h)).transpose(1, 2) for i in range(3))
        weights = torch.softmax(q @ k.transpose(-2, -1) * (e // h) ** -0.5, dim=-1) * noise / (1 - self.p)
        return self.head(self.out_proj((weights @ v).transpose(1, 2).flatten(2)).mean(1))


def _noise(shape, p, seed):
    """curvlib's documented masks (:mod:`curvlib._core.dropout`, reproduced as in ``test_dropout``): one
    seed ``randint(0, 2**62)`` from the call's generator, then ``bernoulli(1 − p)`` per dropout node."""
    call_seed = int(torch.randint(0, 2**62, (1,), generator=seeded(seed)).item())
    return torch.empty(shape, dtype=DT).bernoulli_(1 - p, generator=seeded(call_seed))


@pytest.mark.filterwarnings("ignore:The model has dropout in training mode")
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("heads", [1, 2])
def test_attention_dropout_matches_the_masked_oracle(heads, seed):
    """``nn.MultiheadAttention(dropout=0.4)`` in training mode: every exact extension equals the
    brute force of the same attention with the masks curvlib documents (the loss checks the masks)."""
    torch.manual_seed(seed)
    n, t, e, p = 2, 3, 4, 0.4
    model = DropMHA(e, heads, p).to(DT).train()
    X, y = torch.randn(n, t, e, dtype=DT), torch.randint(0, 3, (n,))
    qs = curvature(model, CE, exact_extensions())(X, y, generator=seeded(seed))
    twin = MaskedTwin(model, t).to(DT)
    packed = torch.cat([X.flatten(1), _noise((n, heads, t, t), p, seed).flatten(1)], 1)
    ref = reference(twin, CE, packed, y, pchmp=False)
    names = {"mha.in_proj_weight": "in_proj_weight", "mha.in_proj_bias": "in_proj_bias",
             "mha.out_proj.weight": "out_proj.weight", "mha.out_proj.bias": "out_proj.bias",
             "head.weight": "head.weight", "head.bias": "head.bias"}
    renamed = {k: v if k == "loss" else {mine: v[theirs] for mine, theirs in names.items()} for k, v in ref.items()}
    assert_matches(qs, renamed, "dropout attention")


@pytest.mark.filterwarnings("ignore:The model has dropout in training mode")
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_dropout_consistent_in_one_call(norm_first):
    """``TransformerEncoderLayer(dropout=0.3)`` in training mode (attention, feed-forward and
    residual dropouts): one call's quantities are those of one masked function: individual
    gradients sum to its gradient, the diagonals are the diagonals of the GGN and Hessian blocks
    that the products of the same call give, per-sample diagonals sum to the whole; a second call
    with the same generator repeats it, another seed changes it."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.3, batch_first=True, norm_first=norm_first)
    model = nn.Sequential(layer, nn.Flatten(), nn.Linear(12, 3)).to(DT).train()
    X, y = torch.randn(3, 3, 4, dtype=DT), torch.randint(0, 3, (3,))
    f = curvature(model, CE, [BatchGrad(), DiagGGNExact(), BatchDiagGGNExact(), DiagHessian(), GGNMP(), HMP()])
    qs = f(X, y, generator=seeded(5))
    again = f(X, y, generator=seeded(5))
    other = f(X, y, generator=seeded(6))
    assert not torch.allclose(qs["loss"], CE(copy.deepcopy(model).eval()(X), y))  # the masks are active
    assert torch.equal(again["loss"], qs["loss"]) and not torch.equal(other["loss"], qs["loss"])
    for name, p in model.named_parameters():
        assert_close(qs["grad_batch"][name].sum(0), qs["grad"][name], f"Σ grad_batch [{name}]")
        assert_close(qs["diag_ggn_exact_batch"][name].sum(0), qs["diag_ggn_exact"][name], f"Σ diag GGN [{name}]")
        ggn, hess = product_matrix(qs["ggnmp"][name], p.shape), product_matrix(qs["hmp"][name], p.shape)
        assert_close(qs["diag_ggn_exact"][name].flatten(), ggn.diagonal(), f"diag GGN vs GGNMP [{name}]")
        assert_close(qs["diag_h"][name].flatten(), hess.diagonal(), f"diag H vs HMP [{name}]")
        assert_close(again["diag_h"][name], qs["diag_h"][name], f"repeated call [{name}]", rtol=0, atol=0)


# ----------------------------------------------------------------------------- attention in a user module


class OwnsAndAttends(nn.Module):
    """A user block owning a parameter directly (``scale``) with an ``nn.MultiheadAttention`` and a
    ``TransformerEncoderLayer`` inside: traced through (``scale`` a functional site), not a generic leaf
    running PyTorch's fused kernels (which warned about a missing batching rule and broke the products)."""

    def __init__(self, e, heads, sdpa):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(e))
        self.mha = nn.MultiheadAttention(e, heads, batch_first=True)
        self.layer = nn.TransformerEncoderLayer(e, heads, 2 * e, batch_first=True)
        self.sdpa = sdpa

    def forward(self, x):
        h = x * self.scale
        h = self.mha(h, h, h, need_weights=False)[0]
        if self.sdpa:
            h = F.scaled_dot_product_attention(h, h, h, is_causal=True)
        return self.layer(h)


class Outer(nn.Module):
    def __init__(self, sdpa):
        super().__init__()
        self.block = OwnsAndAttends(4, 2, sdpa)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.block(x).mean(1))


@pytest.mark.parametrize("sdpa", [False, True])
def test_attention_inside_a_module_owning_parameters(sdpa):
    """Every exact extension through attention nested in a user module that owns a parameter;
    no torch fallback warning (``check_all`` turns warnings into errors); no generic leaf."""
    from curvlib._trace.program import trace_program

    torch.manual_seed(0)
    model = Outer(sdpa).to(DT).eval()
    layers = trace_program(model).layers
    assert "block" not in layers and "block.mha.out_proj" in layers, list(layers)
    check_all(model, torch.randn(2, 3, 4, dtype=DT), torch.randint(0, 3, (2,)))
