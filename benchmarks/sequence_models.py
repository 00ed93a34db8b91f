"""The sequence models of the benchmark: a small GPT and an LSTM classifier,
each with the copy Opacus needs and the map of that copy's per-sample gradients back
to the original parameters.

| problem | model | N | input | loss |
|---|---|---|---|---|
| ``gpt`` | token embedding (vocab 256) + learned positions ``nn.Parameter [T, d]``, 4 pre-LN ``nn.TransformerEncoderLayer`` (d 128, 4 heads, MLP 512, GELU, dropout 0, eval), causal mask, final LayerNorm, Linear head to the vocabulary; T = 64 | 32 | ``[N, 64]`` tokens | ``CrossEntropyLoss()`` on logits ``[N, 256, 64]`` vs ``[N, 64]`` (every position) |
| ``lstm`` | ``nn.LSTM`` 32 -> 128, 2 layers, ``batch_first``; last step -> Linear 128 -> 10; T = 50 | 64 | ``[N, 50, 32]`` | ``CrossEntropyLoss()`` |

Opacus copies (``opacus_copy``): ``GradSampleModule`` cannot take ``nn.MultiheadAttention``,
``nn.LSTM`` or a bare ``nn.Parameter`` used as a tensor, so the copy replaces them by
``ModuleValidator.fix`` (``DPMultiheadAttention`` with separate q/k/v ``Linear``s, ``DPLSTM``)
and the positions by an ``nn.Embedding(T, d)`` applied to ``arange(T)`` (same values). The
copy's attention gets the explicit causal mask with ``is_causal=False``:
``DPMultiheadAttention`` asserts ``is_causal == False``; the mask alone is the same math.
``opacus_to_original`` maps the copy's gradients back (q/k/v concatenated into
``in_proj_weight``/``in_proj_bias``, ``pos.weight`` -> ``pos``) so they are checked
against curvlib's ``BatchGrad``.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn


class GPT(nn.Module):
    """Decoder-only language model from PyTorch's own blocks; ``forward(tokens [N, T]) -> logits [N, V, T]``."""

    def __init__(self, vocab: int = 256, length: int = 64, d: int = 128, heads: int = 4,
                 hidden: int = 512, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.02 * torch.randn(length, d))
        block = nn.TransformerEncoderLayer(d, heads, hidden, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens) + self.pos
        h = self.blocks(h, mask=self.mask, is_causal=True)
        # [N, T, V] -> [N, V, T]: CrossEntropyLoss takes the classes in dim 1.
        return self.head(self.ln_f(h)).transpose(1, 2)


class _OpacusGPT(nn.Module):
    """The GPT as Opacus can take it (see the module docstring); same values, computed
    sequence-first (``[T, N, d]``): ``DPMultiheadAttention`` with ``batch_first=True`` checks
    a 2-D ``attn_mask`` against ``[1, N, N]`` instead of ``[1, T, T]`` (opacus 1.6), so the copy
    runs its attention sequence-first and is wrapped with ``GradSampleModule(batch_first=False)``."""

    batch_first = False

    def __init__(self, gpt: GPT):
        from opacus.validators import ModuleValidator

        super().__init__()
        self.embed = copy.deepcopy(gpt.embed)
        length, d = gpt.pos.shape
        self.pos = nn.Embedding(length, d).to(gpt.pos)
        with torch.no_grad():
            self.pos.weight.copy_(gpt.pos)
        self.blocks = ModuleValidator.fix(copy.deepcopy(gpt.blocks))
        for layer in self.blocks.layers:
            layer.self_attn.batch_first = False
        self.ln_f, self.head = copy.deepcopy(gpt.ln_f), copy.deepcopy(gpt.head)
        self.register_buffer("mask", gpt.mask.clone(), persistent=False)
        self.register_buffer("positions", torch.arange(length, device=gpt.pos.device), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        tokens = tokens.t()  # [T, N]: every module sees the batch in dim 1
        # The positions as the transpose of a contiguous [N, T] too: Opacus moves the batch dim
        # first and its ghost-clipping norm sampler for Embedding then views the indices.
        positions = self.positions[None].expand(tokens.shape[1], -1).contiguous().t()
        h = self.embed(tokens) + self.pos(positions)
        h = self.blocks(h, mask=self.mask, is_causal=False)
        return self.head(self.ln_f(h)).permute(1, 2, 0)  # [T, N, V] -> [N, V, T]


class LSTMClassifier(nn.Module):
    """``nn.LSTM`` (batch_first) whose last time step feeds a Linear classifier;
    ``forward(x [N, T, features]) -> logits [N, classes]``."""

    def __init__(self, features: int = 32, hidden: int = 128, layers: int = 2, classes: int = 10):
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def opacus_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with the same values that Opacus' ``GradSampleModule`` accepts."""
    from opacus.validators import ModuleValidator

    if isinstance(model, GPT):
        # Opacus records activations only in training mode; with dropout 0 and no
        # BatchNorm, the GPT's training mode is the same function as its eval mode.
        return _OpacusGPT(model).train()
    if isinstance(model, LSTMClassifier):  # nn.LSTM -> DPLSTM, weights loaded
        return ModuleValidator.fix(copy.deepcopy(model))
    # The other problems' models as they are (fix would also swap BatchNorm for GroupNorm).
    return copy.deepcopy(model)


def opacus_to_original(model: nn.Module, grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-sample gradients of :func:`opacus_copy`'s parameters -> those of ``model``'s, in
    ``model.named_parameters()`` order. ``in_proj_weight`` ``[3d, d]`` stacks the q, k, v
    projections (rows), so its per-sample gradient is theirs concatenated along dim 1."""
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.endswith("self_attn.in_proj_weight") or name.endswith("self_attn.in_proj_bias"):
            prefix, kind = name.rsplit(".", 1)[0], "weight" if name.endswith("weight") else "bias"
            out[name] = torch.cat([grads[f"{prefix}.{q}linear.{kind}"] for q in "qkv"], dim=1)
        elif name == "pos" and isinstance(model, GPT):
            out[name] = grads["pos.weight"]
        else:
            out[name] = grads[name]
    return out
