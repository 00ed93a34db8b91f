"""Attention and PyTorch's transformer blocks, traced as their math, against brute force.

Every model here is built from PyTorch's own modules (``nn.MultiheadAttention``,
``nn.TransformerEncoderLayer``/``DecoderLayer``, ``nn.TransformerEncoder``,
``F.scaled_dot_product_attention``); the oracles (:mod:`oracles.reference`) run
those original modules. Their first-order oracle runs each sample through the
module on its own (plain autograd); the second-order ones use ``torch.func``
(``jacrev``/``hessian``), under which PyTorch's slow path is taken (parameters
require grad), with SDPA pinned to its composite math kernel
(``sdpa_kernel(SDPBackend.MATH)``: the fused CPU kernel has no forward-mode
derivative) and the MHA fast path off (``torch.backends.mha.set_fastpath_enabled(False)``,
which only changes how the no-grad reference loss is computed). curvlib
itself is run with neither setting and must not warn.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import curvature
from curvlib.extensions import KFLR

from oracles.attention import CE, DT, check_all, oracle_mode
from oracles.on_device import seeded

class MHAModel(nn.Module):
    """One ``nn.MultiheadAttention`` with the given options, keys/values made from ``x``."""

    def __init__(self, e, heads, kdim, vdim, bias, bias_kv, zero_attn, batch_first, mode, mask, padding,
                 need_weights, average, t):
        super().__init__()
        self.mha = nn.MultiheadAttention(e, heads, bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn,
                                         kdim=kdim, vdim=vdim, batch_first=batch_first)
        self.to_k = nn.Linear(e, kdim or e)
        self.to_v = nn.Linear(e, vdim or e)
        self.head = nn.Linear(e, 3)
        self.batch_first, self.mode, self.padding = batch_first, mode, padding
        self.need_weights, self.average = need_weights, average
        forbid = torch.ones(t, t, dtype=torch.bool).triu(1)  # causal: row 0 always sees key 0
        self.register_buffer("mask", None if mask == "none" else
                             forbid if mask == "bool" else torch.randn(t, t, dtype=DT).masked_fill(forbid, -1e9))
        self.register_buffer("later", torch.arange(t) > 0)  # padding never hides key 0

    def forward(self, x):
        q = x
        k = x if self.mode == "self" else self.to_k(x)
        v = k if self.mode in ("self", "kv") and self.to_k.out_features == self.to_v.out_features else self.to_v(x)
        if not self.batch_first:  # (the same tensor stays the same: self-attention)
            moved = {}
            for a in (q, k, v):
                moved.setdefault(id(a), a.transpose(0, 1))
            q, k, v = (moved[id(a)] for a in (q, k, v))
        pad = torch.logical_and(x[..., 0] > 0.3, self.later) if self.padding else None
        out, w = self.mha(q, k, v, key_padding_mask=pad, attn_mask=self.mask, need_weights=self.need_weights,
                          average_attn_weights=self.average)
        if not self.batch_first:
            out = out.transpose(0, 1)
        logits = self.head(out.mean(1))
        if w is not None:
            logits = logits + (w**2).flatten(1).sum(1, keepdim=True)
        return logits


@settings(deadline=None, max_examples=12)
@given(
    n=st.integers(1, 3), t=st.integers(1, 3), e=st.sampled_from([2, 4]), heads=st.sampled_from([1, 2]),
    separate=st.booleans(), bias=st.booleans(), bias_kv=st.booleans(), zero_attn=st.booleans(),
    batch_first=st.booleans(), mode=st.sampled_from(["self", "kv", "cross"]),
    mask=st.sampled_from(["none", "bool", "float"]), padding=st.booleans(), need_weights=st.booleans(),
    average=st.booleans(), seed=st.integers(0, 2**16),
)
def test_multihead_attention_options(n, t, e, heads, separate, bias, bias_kv, zero_attn, batch_first, mode, mask,
                                     padding, need_weights, average, seed):
    """Every exact extension through ``nn.MultiheadAttention`` with its options: packed or
    separate (``kdim``/``vdim``) projections, biases, ``bias_k``/``bias_v``, zero attention,
    boolean/float ``attn_mask``, ``key_padding_mask`` from the input, the weights returned."""
    torch.manual_seed(seed)
    kdim = vdim = None
    if separate:
        kdim, vdim = e + 1, e + 2
        mode = "cross" if mode == "self" else mode
    model = MHAModel(e, heads, kdim, vdim, bias, bias_kv, zero_attn, batch_first, mode, mask, padding,
                     need_weights, average, t).to(DT).eval()
    X = torch.randn(n, t, e, dtype=DT)
    y = torch.randint(0, 3, (n,))
    check_all(model, X, y)


class Encoder(nn.Module):
    """Token embedding (tied with the output layer), learned positions, a ``TransformerEncoder``
    stack with a causal mask and a key padding mask (token 0); logits of every position,
    ``[N, T·V]`` (one row per sample, as the oracles split samples)."""

    def __init__(self, vocab, e, heads, layers, t, norm_first, activation, batch_first, final_norm):
        super().__init__()
        self.emb = nn.Embedding(vocab, e)
        self.pos = nn.Parameter(torch.randn(t, e) * 0.5)
        layer = nn.TransformerEncoderLayer(e, heads, 2 * e, dropout=0.1, activation=activation,
                                           batch_first=batch_first, norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(e) if final_norm else None,
                                         enable_nested_tensor=False)
        self.batch_first = batch_first
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(t, dtype=DT))

    def forward(self, idx):
        h = self.emb(idx) + self.pos
        pad = idx == 0
        if not self.batch_first:
            h = h.transpose(0, 1)
        h = self.enc(h, mask=self.causal, src_key_padding_mask=pad)
        if not self.batch_first:
            h = h.transpose(0, 1)
        return F.linear(h, self.emb.weight).flatten(1)  # tied output layer, [N, T·V]


def _tokens(n, t, vocab, gen):
    idx = torch.randint(0, vocab, (n, t), generator=gen)
    idx[:, 0] = torch.randint(1, vocab, (n,), generator=gen)  # the first token is never padding
    return idx


@settings(deadline=None, max_examples=6)
@given(
    n=st.integers(1, 2), t=st.integers(1, 3), heads=st.sampled_from([1, 2]), layers=st.integers(1, 2),
    norm_first=st.booleans(), activation=st.sampled_from(["relu", "gelu", "callable"]),
    batch_first=st.booleans(), final_norm=st.booleans(), seed=st.integers(0, 2**16),
)
def test_transformer_encoder_tied_padding(n, t, heads, layers, norm_first, activation, batch_first, final_norm, seed):
    """A small language model: tied input/output embeddings, key padding, causal mask,
    ``norm_first`` both ways, relu/gelu/a callable activation, dropout in eval."""
    torch.manual_seed(seed)
    act = torch.tanh if activation == "callable" else activation
    vocab, e = 5, 4
    model = Encoder(vocab, e, heads, layers, t, norm_first, act, batch_first, final_norm).to(DT).eval()
    gen = seeded(seed)
    X = _tokens(n, t, vocab, gen)
    y = torch.randint(0, vocab, (n, t), generator=gen)
    check_all(model, X, y, lossfn=_FlatCE())


class _FlatCE(nn.Module):
    """Mean cross-entropy over all positions of ``[N, T·V]`` logits and ``[N, T]`` targets."""

    def forward(self, logits, y):
        return F.cross_entropy(logits.reshape(y.numel(), -1), y.flatten())


class Decoder(nn.Module):
    """A ``TransformerDecoderLayer`` on a target sequence and a memory made from it."""

    def __init__(self, e, heads, norm_first, activation, batch_first, t):
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(e, heads, 2 * e, dropout=0.2, activation=activation,
                                                batch_first=batch_first, norm_first=norm_first)
        self.memory = nn.Linear(e, e)
        self.head = nn.Linear(e, 3)
        self.batch_first = batch_first
        self.register_buffer("causal", torch.ones(t, t, dtype=torch.bool).triu(1))
        self.register_buffer("later", torch.arange(t) > 0)

    def forward(self, x):
        mem = torch.tanh(self.memory(x))
        pad = torch.logical_and(x[..., 1] > 0.0, self.later)
        tgt = x
        if not self.batch_first:
            tgt, mem = tgt.transpose(0, 1), mem.transpose(0, 1)
        h = self.layer(tgt, mem, tgt_mask=self.causal, memory_key_padding_mask=pad)
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.head(h.mean(1))


@settings(deadline=None, max_examples=6)
@given(
    n=st.integers(1, 3), t=st.integers(1, 3), heads=st.sampled_from([1, 2]), norm_first=st.booleans(),
    activation=st.sampled_from(["relu", "gelu"]), batch_first=st.booleans(), seed=st.integers(0, 2**16),
)
def test_transformer_decoder_layer(n, t, heads, norm_first, activation, batch_first, seed):
    torch.manual_seed(seed)
    model = Decoder(4, heads, norm_first, activation, batch_first, t).to(DT).eval()
    X = torch.randn(n, t, 4, dtype=DT)
    y = torch.randint(0, 3, (n,))
    check_all(model, X, y)


class SDPA(nn.Module):
    """``F.scaled_dot_product_attention`` on projections of ``x`` with its options."""

    def __init__(self, e, heads, kv_heads, mask, causal, scale, t):
        super().__init__()
        self.q = nn.Linear(e, heads * 2)
        self.kv = nn.Linear(e, kv_heads * 4)
        self.head = nn.Linear(heads * 2, 3)
        self.heads, self.kv_heads, self.causal, self.scale = heads, kv_heads, causal, scale
        allowed = torch.ones(t, t, dtype=torch.bool).tril()
        self.register_buffer("mask", None if mask == "none" else
                             allowed if mask == "bool" else torch.randn(t, t, dtype=DT))

    def forward(self, x):
        q = self.q(x).unflatten(-1, (self.heads, 2)).transpose(1, 2)
        k, v = self.kv(x).unflatten(-1, (self.kv_heads, 4)).transpose(1, 2).chunk(2, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.causal, scale=self.scale,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.head(out.transpose(1, 2).flatten(2).mean(1))


@settings(deadline=None, max_examples=10)
@given(
    n=st.integers(1, 3), t=st.integers(1, 4), heads=st.sampled_from([(1, 1), (2, 2), (2, 1)]),
    mask=st.sampled_from(["none", "bool", "float", "causal"]), scale=st.sampled_from([None, 0.7]),
    seed=st.integers(0, 2**16),
)
def test_scaled_dot_product_attention(n, t, heads, mask, scale, seed):
    """SDPA with boolean/float masks, ``is_causal``, ``scale`` and grouped-query heads."""
    torch.manual_seed(seed)
    causal = mask == "causal"
    model = SDPA(3, heads[0], heads[1], "none" if causal else mask, causal, scale, t).to(DT).eval()
    X = torch.randn(n, t, 3, dtype=DT)
    y = torch.randint(0, 3, (n,))
    check_all(model, X, y)


def test_packed_projection_is_one_linear_site_kflr():
    """Self-attention's packed ``in_proj_weight`` is one Linear site: its KFLR factors equal
    those of the same projection written as an explicit ``nn.Linear``."""
    torch.manual_seed(0)
    e, t, n = 4, 3, 3

    class Explicit(nn.Module):
        def __init__(self, mha):
            super().__init__()
            self.proj = nn.Linear(e, 3 * e)
            self.out = nn.Linear(e, e)
            self.head = nn.Linear(e, 3)
            with torch.no_grad():
                self.proj.weight.copy_(mha.in_proj_weight)
                self.proj.bias.copy_(mha.in_proj_bias)
                self.out.load_state_dict(mha.out_proj.state_dict())

        def forward(self, x):
            p = self.proj(x)
            q, k, v = (p[..., i * e:(i + 1) * e].unflatten(-1, (2, e // 2)).transpose(1, 2) for i in range(3))
            a = torch.softmax(q @ k.transpose(-2, -1) / (e // 2) ** 0.5, dim=-1) @ v
            return self.head(self.out(a.transpose(1, 2).flatten(2)).mean(1))

    class Torch(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(e, 2, batch_first=True)
            self.head = nn.Linear(e, 3)

        def forward(self, x):
            return self.head(self.mha(x, x, x, need_weights=False)[0].mean(1))

    ours = Torch().to(DT).eval()
    explicit = Explicit(ours.mha).to(DT)
    explicit.head.load_state_dict(ours.head.state_dict())
    X, y = torch.randn(n, t, e, dtype=DT), torch.randint(0, 3, (n,))
    a = curvature(ours, CE, [KFLR()])(X, y)["kflr"]
    b = curvature(explicit, CE, [KFLR()])(X, y)["kflr"]
    pairs = {"mha.in_proj_weight": "proj.weight", "mha.in_proj_bias": "proj.bias",
             "mha.out_proj.weight": "out.weight", "mha.out_proj.bias": "out.bias"}
    for mine, theirs in pairs.items():
        for fa, fb in zip(a[mine], b[theirs]):
            torch.testing.assert_close(fa, fb, rtol=1e-10, atol=1e-12)


def test_no_fused_kernel_in_graph():
    """The traced graph of a transformer holds no fused attention kernel and no opaque
    attention module: projections are Linear sites, attention is matmul/softmax."""
    from curvlib._trace.program import trace_program

    layer = nn.TransformerEncoderLayer(4, 2, 8, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Flatten(), nn.Linear(8, 2))
    program = trace_program(model.eval())
    targets = {str(n.target) for n in program.graph.nodes}
    assert not any("native" in s or "flash" in s or "transformer_encoder_layer_fwd" in s for s in targets), targets
    assert not any(isinstance(layer.module, (nn.MultiheadAttention, nn.TransformerEncoderLayer))
                   for layer in program.layers.values())
    assert sum(1 for u in program.functional.values() if u.linear is not None) == 2  # one packed product per layer


class _Twin(nn.Module):
    """``MHAModel``'s self-attention written out in plain operations (its parameters owned
    directly, so that the PCHMP oracle sees every operation as a node of its own)."""

    def __init__(self, torch_model: "MHAModel"):
        super().__init__()
        mha = torch_model.mha
        self.in_proj_weight = nn.Parameter(mha.in_proj_weight.detach().clone())
        self.in_proj_bias = nn.Parameter(mha.in_proj_bias.detach().clone())
        self.out_proj = nn.Linear(mha.embed_dim, mha.embed_dim).to(DT)
        self.head = nn.Linear(mha.embed_dim, 3).to(DT)
        self.out_proj.load_state_dict(mha.out_proj.state_dict())
        self.head.load_state_dict(torch_model.head.state_dict())
        self.h, self.e = mha.num_heads, mha.embed_dim
        self.register_buffer("bias", torch_model.mask.clone())
        self.register_buffer("later", torch_model.later.clone())

    def forward(self, x):
        p = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        e, h = self.e, self.h
        q, k, v = (p[..., i * e:(i + 1) * e].unflatten(-1, (h, e // h)).transpose(1, 2) for i in range(3))
        pad = torch.zeros(x.shape[:2], dtype=DT).masked_fill(torch.logical_and(x[..., 0] > 0.3, self.later), float("-inf"))
        scores = torch.matmul(q * (e // h) ** -0.5, k.transpose(-2, -1)) + self.bias + pad[:, None, None, :]
        a = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.head(self.out_proj(a.transpose(1, 2).flatten(2)).mean(1))


@pytest.mark.parametrize("modify", ["clip", "abs"])
@pytest.mark.parametrize("seed", [0, 1])
def test_pchmp_attention(modify, seed):
    """PCHMP through ``nn.MultiheadAttention`` (float mask, key padding) equals the
    brute-force positive-curvature blocks (:mod:`oracles.pchmp`) of the same attention
    written out in plain operations: the residuals of ``q kᵀ``, softmax and ``A v``."""
    from curvlib.extensions import PCHMP
    from oracles.reference import product_matrix
    from oracles.pchmp import pchmp_blocks

    torch.manual_seed(seed)
    n, t, e = 2, 3, 4
    model = MHAModel(e, 2, None, None, True, False, False, True, "self", "float", True, False, True, t).to(DT).eval()
    twin = _Twin(model)
    X, y = torch.randn(n, t, e, dtype=DT), torch.randint(0, 3, (n,))
    assert torch.allclose(model(X), twin(X))
    got = curvature(model, CE, [PCHMP(modify=modify)])(X, y)["pchmp"]
    want = pchmp_blocks(twin, CE, X, y, modify)
    names = {"mha.in_proj_weight": "in_proj_weight", "mha.in_proj_bias": "in_proj_bias",
             "mha.out_proj.weight": "out_proj.weight", "mha.out_proj.bias": "out_proj.bias",
             "head.weight": "head.weight", "head.bias": "head.bias"}
    scale = max(float(w.abs().max()) for w in want.values())
    params = dict(model.named_parameters())
    for mine, theirs in names.items():
        block = product_matrix(got[mine], params[mine].shape)
        err = float((block - want[theirs]).abs().max())
        assert err <= 1e-7 * scale, f"pchmp[{mine}] ({modify}): max error {err:.3g} at scale {scale:.3g}"


def test_diag_ggn_mc_attention():
    """DiagGGNMC / BatchDiagGGNMC through a transformer decoder layer converge to the exact
    GGN diagonals (``oracles.second_order.ggn_per_sample``; seeded generators, error ~ 1/√M)."""
    from curvlib.extensions import BatchDiagGGNMC, DiagGGNMC
    from oracles.second_order import ggn_per_sample

    torch.manual_seed(0)
    model = Decoder(4, 2, True, "gelu", True, 3).to(DT).eval()
    X, y = torch.randn(2, 3, 4, dtype=DT), torch.randint(0, 3, (2,))
    with oracle_mode():
        per = {k: ggn_per_sample(model, CE, X, y, k).diagonal(dim1=1, dim2=2).reshape((2,) + p.shape)
               for k, p in model.named_parameters()}
    exact = {"diag_ggn_mc": {k: v.sum(0) for k, v in per.items()}, "diag_ggn_mc_batch": per}
    errors = {}
    for m in (100, 10000):
        exts = [DiagGGNMC(mc_samples=m, generator=seeded(1)),
                BatchDiagGGNMC(mc_samples=m, generator=seeded(2))]
        qs = curvature(model, CE, exts)(X, y)
        for key, want in exact.items():
            num = sum(float(((qs[key][k] - w) ** 2).sum()) for k, w in want.items())
            errors[key, m] = (num / sum(float((w**2).sum()) for w in want.values())) ** 0.5
    for key in exact:
        assert errors[key, 10000] < 0.05 and errors[key, 10000] < errors[key, 100] / 3, errors
