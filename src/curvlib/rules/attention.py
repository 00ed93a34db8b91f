"""Attention and PyTorch's transformer blocks, traced as their math.

``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``/``DecoderLayer``,
``nn.TransformerEncoder``/``Decoder``, ``nn.Transformer`` and
``F.scaled_dot_product_attention`` are not leaves of curvlib's trace: the
tracer (:mod:`curvlib._trace.program`) runs the functions below on its proxies
instead of their ``forward``, so the graph holds their math. PyTorch's own
forwards dispatch to fused kernels (``_native_multi_head_attention``,
``_transformer_encoder_layer_fwd``, the flash/efficient SDPA kernels) that
have no forward-mode derivative and no batching rule; the math here uses only
ordinary operations, so every extension applies through the existing rules:

* every projection is a Linear site: ``F.linear`` on the module's own
  parameter (``in_proj_weight`` packed ``[3E, E]``: the full product, then
  the rows of q, k or v; self-attention projects once), ``out_proj`` and the
  feed-forward layers are ``nn.Linear`` calls;
* per head ``h``: ``A = softmax(q kᵀ / √d_h + M)``, ``out = A v``, with the
  additive mask ``M`` (``-inf`` where a boolean mask forbids a key) built by
  one node from ``attn_mask``/``key_padding_mask``/``is_causal``.

Semantics follow PyTorch's slow path (``F.multi_head_attention_forward`` and
the layers' ``_sa_block``/``_mha_block``/``_ff_block``). Helpers marked
``curvlib_linear`` are affine in their tensor arguments (masking, appending
``bias_k``/zero rows, scaling): they have no second derivative.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._core.errors import CurvatureError
from . import plain


def _linear_marked(fn: Callable) -> Callable:
    """Affine in its tensor arguments (see the module doc); one graph node per call
    (``torch.fx.wrap`` below: run, not traced through)."""
    fn.curvlib_linear = True
    return fn


# ----------------------------------------------------------------------------- run-time helpers (graph nodes)


def _float_mask(mask: Optional[Tensor], like: Tensor, allowed_if_true: bool = False) -> Optional[Tensor]:
    """A boolean mask as an additive one (``-inf`` where a key is forbidden); a float mask as it is."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        forbidden = ~mask if allowed_if_true else mask
        return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(forbidden, float("-inf"))
    return mask.to(like.dtype)


def _causal(like: Tensor) -> Tensor:
    t, s = like.shape[-2], like.shape[-1]
    allowed = torch.ones(t, s, dtype=torch.bool, device=like.device).tril()
    return _float_mask(allowed, like, allowed_if_true=True)


@_linear_marked
def _masked_scores(scores: Tensor, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
                   num_heads: int, appended: int, causal: bool) -> Tensor:
    """``scores [N, H, T, S] + M`` for ``nn.MultiheadAttention``'s masks: ``attn_mask``
    ``[T, S']`` or ``[N·H, T, S']``, ``key_padding_mask`` ``[N, S']`` (``True``/non-zero:
    ignore), ``S' = S - appended`` (the ``bias_k``/zero columns appended are never masked).
    ``causal``: PyTorch's ``is_causal`` hint taken literally (no padding mask, no weights)."""
    bias = _causal(scores) if causal else _float_mask(attn_mask, scores)
    if bias is not None:
        if bias.dim() == 3:
            bias = bias.unflatten(0, (-1, num_heads))
        bias = F.pad(bias, (0, appended)) if appended and not causal else bias
        scores = scores + bias
    kpm = _float_mask(key_padding_mask, scores)
    if kpm is not None:
        kpm = F.pad(kpm, (0, appended)) if appended else kpm
        scores = scores + kpm[:, None, None, :]
    return scores


@_linear_marked
def _sdpa_masked_scores(scores: Tensor, attn_mask: Optional[Tensor], is_causal: bool) -> Tensor:
    """``scores + M`` for ``F.scaled_dot_product_attention`` (boolean ``True``: take part)."""
    if is_causal and attn_mask is not None:
        raise CurvatureError("F.scaled_dot_product_attention: attn_mask must be None when is_causal=True "
                             "(as in PyTorch).")
    bias = _causal(scores) if is_causal else _float_mask(attn_mask, scores, allowed_if_true=True)
    return scores + bias


@_linear_marked
def _scaled(query: Tensor, scale: Optional[float]) -> Tensor:
    """``query · scale`` (default ``1/√d``, ``d = query.shape[-1]``): ``(q s) kᵀ = s (q kᵀ)``."""
    return query * (1.0 / math.sqrt(query.shape[-1]) if scale is None else scale)


@_linear_marked
def _repeat_heads(kv: Tensor, query: Tensor) -> Tensor:
    """Grouped-query attention: each key/value head serves ``H_q / H_kv`` query heads."""
    return kv.repeat_interleave(query.shape[-3] // kv.shape[-3], dim=-3)


@_linear_marked
def _append_row(x: Tensor, row: Optional[Tensor]) -> Tensor:
    """``x [N, S, E]`` with one more position: ``row`` (``bias_k``/``bias_v`` ``[1, 1, E]``) or zeros."""
    row = x.new_zeros(x.shape[0], 1, x.shape[2]) if row is None else row.expand(x.shape[0], 1, x.shape[2])
    return torch.cat([x, row], dim=1)


@_linear_marked
def _batched(x: Tensor, where: str) -> Tensor:
    if x.dim() != 3:
        raise CurvatureError(f"{where}: curvlib needs batched 3-D inputs ({x.dim()}-D given).")
    return x


for _name in ("_masked_scores", "_sdpa_masked_scores", "_scaled", "_repeat_heads", "_append_row", "_batched"):
    torch.fx.wrap(_name)  # (must run at module level)


# ----------------------------------------------------------------------------- traced math


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """``softmax(q kᵀ · scale + M) v`` over the last two dims (``F.scaled_dot_product_attention``)."""
    q = _scaled(query, scale)
    if enable_gqa:
        key, value = _repeat_heads(key, query), _repeat_heads(value, query)
    scores = torch.matmul(q, key.transpose(-2, -1))
    if attn_mask is not None or is_causal:
        scores = _sdpa_masked_scores(scores, attn_mask, is_causal)
    weights = torch.softmax(scores, dim=-1) if attn_mask is None else _safe_softmax(scores)
    if not isinstance(dropout_p, (int, float)) or dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    return torch.matmul(weights, value)


def _safe_softmax(scores: Tensor) -> Tensor:
    """Softmax over the last dim, zero on rows whose scores are all ``-inf`` (a query that may
    attend to nothing: a left-padded position), as PyTorch's own attention math computes it;
    the masked rows' scores are replaced before the softmax, so that no NaN reaches a backward."""
    empty = torch.isneginf(scores).all(-1, keepdim=True)
    return torch.where(empty, 0.0, torch.softmax(torch.where(empty, 0.0, scores), dim=-1))


def _projections(m: nn.MultiheadAttention, query, key, value):
    """``q, k, v [N, L, E]`` (batch first). Packed weights: the full ``[3E]`` product of each
    distinct input, then its rows; separate weights: one Linear site each (+ its bias rows)."""
    e = m.embed_dim
    rows = (slice(0, e), slice(e, 2 * e), slice(2 * e, 3 * e))
    if m._qkv_same_embed_dim:
        inputs, products = (query, key, value), []
        for x in inputs:  # one product per distinct input (self-attention: one)
            same = next((p for y, p in products if y is x), None)
            products.append((x, same if same is not None else F.linear(x, m.in_proj_weight, m.in_proj_bias)))
        return tuple(p[..., r] for (_, p), r in zip(products, rows))
    out = []
    for x, w, r in zip((query, key, value), (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight), rows):
        y = F.linear(x, w)
        out.append(y if m.in_proj_bias is None else y + m.in_proj_bias[r])
    return tuple(out)


@dataclass(frozen=True)
class AttentionOptions:
    """``nn.MultiheadAttention.forward``'s options after ``(query, key, value)``, in its order
    (bound as torch binds them: by position or by name)."""

    key_padding_mask: Optional[Tensor] = None
    need_weights: bool = True
    attn_mask: Optional[Tensor] = None
    average_attn_weights: bool = True
    is_causal: bool = False


def multihead_attention(m: nn.MultiheadAttention, query, key, value, *options, **named):
    """``nn.MultiheadAttention.forward`` as math: ``(out, weights or None)``."""
    o = AttentionOptions(*options, **named)
    key_padding_mask, need_weights, attn_mask, is_causal = o.key_padding_mask, o.need_weights, o.attn_mask, o.is_causal
    if is_causal and attn_mask is None:
        raise CurvatureError("nn.MultiheadAttention: is_causal=True needs attn_mask (as in PyTorch).")
    h, d = m.num_heads, m.head_dim
    moved = {}  # batch first; an input given twice (self-attention) stays one tensor
    for t in (query, key, value):
        if id(t) not in moved:
            b = _batched(t, "nn.MultiheadAttention")
            moved[id(t)] = b if m.batch_first else b.transpose(0, 1)
    query, key, value = (moved[id(t)] for t in (query, key, value))
    q, k, v = _projections(m, query, key, value)
    appended = 0
    if m.bias_k is not None:
        k, v, appended = _append_row(k, m.bias_k), _append_row(v, m.bias_v), 1
    if m.add_zero_attn:
        k, v, appended = _append_row(k, None), _append_row(v, None), appended + 1
    q, k, v = (t.unflatten(-1, (h, d)).transpose(1, 2) for t in (q, k, v))  # [N, H, L, d]
    scores = torch.matmul(q * (1.0 / math.sqrt(d)), k.transpose(-2, -1))  # [N, H, T, S]
    if attn_mask is not None or key_padding_mask is not None:
        causal = bool(is_causal) and key_padding_mask is None and not need_weights
        scores = _masked_scores(scores, attn_mask, key_padding_mask, h, appended, causal)
    weights = torch.softmax(scores, dim=-1)
    if m.training and m.dropout > 0:
        weights = F.dropout(weights, p=m.dropout, training=True)
    out = m.out_proj(torch.matmul(weights, v).transpose(1, 2).flatten(2))  # [N, T, E]
    if not m.batch_first:
        out = out.transpose(0, 1)
    if not need_weights:
        return out, None
    return out, (weights.mean(1) if o.average_attn_weights else weights)


def _ff_block(m, x, dropouts):
    return dropouts[1](m.linear2(dropouts[0](m.activation(m.linear1(x)))))


def encoder_layer(m: nn.TransformerEncoderLayer, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
    """``nn.TransformerEncoderLayer.forward`` (PyTorch's slow path), pre- or post-norm."""

    def attend(x):
        x = m.self_attn(x, x, x, attn_mask=src_mask, key_padding_mask=src_key_padding_mask,
                        need_weights=False, is_causal=is_causal)[0]
        return m.dropout1(x)

    ff = functools.partial(_ff_block, m, dropouts=(m.dropout, m.dropout2))
    x = src
    if m.norm_first:
        x = x + attend(m.norm1(x))
        return x + ff(m.norm2(x))
    x = m.norm1(x + attend(x))
    return m.norm2(x + ff(x))


@dataclass(frozen=True)
class DecoderMasks:
    """The masks of ``nn.TransformerDecoder(Layer).forward``, after ``(tgt, memory)``, in its order
    (``tgt_is_causal``: the layer's default is ``False``, the decoder's ``None``; either is read
    as a truth value)."""

    tgt_mask: Optional[Tensor] = None
    memory_mask: Optional[Tensor] = None
    tgt_key_padding_mask: Optional[Tensor] = None
    memory_key_padding_mask: Optional[Tensor] = None
    tgt_is_causal: Optional[bool] = None
    memory_is_causal: bool = False


def decoder_layer(m: nn.TransformerDecoderLayer, tgt, memory, *masks, **named):
    """``nn.TransformerDecoderLayer.forward``, pre- or post-norm."""
    o = DecoderMasks(*masks, **named)

    def attend(x):
        x = m.self_attn(x, x, x, attn_mask=o.tgt_mask, key_padding_mask=o.tgt_key_padding_mask,
                        is_causal=bool(o.tgt_is_causal), need_weights=False)[0]
        return m.dropout1(x)

    def cross(x):
        x = m.multihead_attn(x, memory, memory, attn_mask=o.memory_mask, key_padding_mask=o.memory_key_padding_mask,
                             is_causal=o.memory_is_causal, need_weights=False)[0]
        return m.dropout2(x)

    ff = functools.partial(_ff_block, m, dropouts=(m.dropout, m.dropout3))
    x = tgt
    if m.norm_first:
        x = x + attend(m.norm1(x))
        x = x + cross(m.norm2(x))
        return x + ff(m.norm3(x))
    x = m.norm1(x + attend(x))
    x = m.norm2(x + cross(x))
    return m.norm3(x + ff(x))


def encoder(m: nn.TransformerEncoder, src, mask=None, src_key_padding_mask=None, is_causal=None):
    """``nn.TransformerEncoder.forward``: the layers in turn, then the optional norm."""
    out = src
    for layer in m.layers:
        out = layer(out, src_mask=mask, is_causal=bool(is_causal), src_key_padding_mask=src_key_padding_mask)
    return m.norm(out) if m.norm is not None else out


def decoder(m: nn.TransformerDecoder, tgt, memory, *masks, **named):
    """``nn.TransformerDecoder.forward``."""
    o = DecoderMasks(*masks, **named)
    out = tgt
    for layer in m.layers:
        out = layer(out, memory, tgt_mask=o.tgt_mask, memory_mask=o.memory_mask,
                    tgt_key_padding_mask=o.tgt_key_padding_mask, memory_key_padding_mask=o.memory_key_padding_mask,
                    tgt_is_causal=bool(o.tgt_is_causal), memory_is_causal=o.memory_is_causal)
    return m.norm(out) if m.norm is not None else out


@dataclass(frozen=True)
class TransformerMasks:
    """The masks of ``nn.Transformer.forward``, after ``(src, tgt)``, in its order."""

    src_mask: Optional[Tensor] = None
    tgt_mask: Optional[Tensor] = None
    memory_mask: Optional[Tensor] = None
    src_key_padding_mask: Optional[Tensor] = None
    tgt_key_padding_mask: Optional[Tensor] = None
    memory_key_padding_mask: Optional[Tensor] = None
    src_is_causal: Optional[bool] = None
    tgt_is_causal: Optional[bool] = None
    memory_is_causal: bool = False


def transformer(m: nn.Transformer, src, tgt, *masks, **named):
    """``nn.Transformer.forward``: encoder, then decoder on its memory."""
    o = TransformerMasks(*masks, **named)
    memory = m.encoder(src, mask=o.src_mask, src_key_padding_mask=o.src_key_padding_mask, is_causal=o.src_is_causal)
    return m.decoder(tgt, memory, tgt_mask=o.tgt_mask, memory_mask=o.memory_mask,
                     tgt_key_padding_mask=o.tgt_key_padding_mask, memory_key_padding_mask=o.memory_key_padding_mask,
                     tgt_is_causal=o.tgt_is_causal, memory_is_causal=o.memory_is_causal)


MATH = (
    (nn.MultiheadAttention, multihead_attention),
    (nn.TransformerEncoderLayer, encoder_layer),
    (nn.TransformerDecoderLayer, decoder_layer),
    (nn.TransformerEncoder, encoder),
    (nn.TransformerDecoder, decoder),
    (nn.Transformer, transformer),
)


def traced_forward(module: nn.Module) -> Optional[Callable]:
    """The math to trace in place of ``module.forward``, or ``None`` (a subclass with its own
    ``forward``, a parametrized module or one with a reparametrizing hook stays as it is)."""

    for cls, fn in MATH:
        if isinstance(module, cls) and type(module).forward is cls.forward and plain(module):
            return functools.partial(fn, module)
    return None
