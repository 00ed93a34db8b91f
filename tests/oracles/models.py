"""A zoo of small non-Sequential architectures for the graph tests and the example.

Every model here treats the samples of a batch independently and is traceable
by ``torch.fx``; sizes are tiny so that float64 brute-force oracles stay fast.

* :class:`TinyResNet`: ResNet basic blocks (conv-bn-relu-conv-bn, identity or
  1x1-projection shortcut, ``relu(out + shortcut)``), BatchNorm in eval mode,
  global average pooling, a Linear head; input ``[N, 3, 8, 8]``.
* :class:`TinyTransformer`: token embedding, a learned positional parameter in
  a submodule, one pre-LayerNorm encoder block whose multi-head self-attention
  is written with ``nn.Linear`` projections and torch ops, a GELU MLP,
  residuals; output per token ``[N, C, T]`` or mean-pooled ``[N, C]``.
* :class:`TinyCausalLM`: a causal language model of bias-free Linear layers, logits ``[N, T, V]``;
  :func:`tiny_gpt2`: transformers' GPT-2 from a tiny config, logits ``[N, V, T]``.
* :class:`TiedAutoencoder`: decoder weight = encoder weight transposed, either
  through a shared ``Parameter`` held by a decoder module (``"shared"``) or
  read directly in the parent's forward (``"functional"``); MSE loss.
* small feature models: in-place activations, gating ``x * σ(gate(x))``,
  ``torch.cat`` of branches, a module used twice, functional ops.

:data:`ZOO` maps a name to a :class:`Case` builder ``(seed) -> Case`` with
float64 model, loss, inputs and targets.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, NamedTuple, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from oracles.on_device import seeded

DT = torch.float64


# ----------------------------------------------------------------------------- ResNet


class BasicBlock(nn.Module):
    """``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class TinyResNet(nn.Module):
    """Stem conv-bn-relu, basic blocks (one identity, one projection shortcut),
    global average pooling, Linear head."""

    def __init__(self, channels: Tuple[int, ...] = (4, 8), classes: int = 3, in_channels: int = 3):
        super().__init__()
        c0 = channels[0]
        self.stem = nn.Sequential(nn.Conv2d(in_channels, c0, 3, padding=1, bias=False), nn.BatchNorm2d(c0), nn.ReLU())
        blocks, c = [], c0
        for i, c_next in enumerate(channels):
            blocks.append(BasicBlock(c, c_next, stride=1 if i == 0 else 2))
            c = c_next
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(c, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks(self.stem(x))
        return self.head(torch.flatten(self.pool(h), 1))


def randomise_batchnorm(model: nn.Module, gen: torch.Generator) -> nn.Module:
    """Non-trivial running statistics and affine parameters; eval mode."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                m.running_mean.copy_(0.3 * torch.randn(m.running_mean.shape, generator=gen, dtype=m.running_mean.dtype))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen, dtype=m.running_var.dtype))
                if m.affine:
                    m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=gen, dtype=m.weight.dtype))
                    m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=gen, dtype=m.bias.dtype))
    return model.eval()


# ----------------------------------------------------------------------------- transformer


class PositionalEmbedding(nn.Module):
    """A learned positional parameter ``[T, d]`` added to every sequence."""

    def __init__(self, length: int, d: int):
        super().__init__()
        self.pos = nn.Parameter(0.1 * torch.randn(length, d))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.pos


class SelfAttention(nn.Module):
    """Multi-head self-attention with ``nn.Linear`` projections:
    ``o(softmax(q kᵀ / √d_head) v)`` per head."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        assert d % heads == 0
        self.heads, self.d_head = heads, d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:  # x [N, T, d]
        def split(t: Tensor) -> Tensor:  # [N, T, d] -> [N, h, T, d_head]
            return t.unflatten(-1, (self.heads, self.d_head)).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)
        att = torch.softmax(scores, dim=-1) @ v  # [N, h, T, d_head]
        return self.o(att.transpose(1, 2).flatten(2))


class TinyTransformer(nn.Module):
    """Token embedding + positions, one pre-LN encoder block, Linear classifier.

    ``pool="mean"``: output ``[N, C]`` (sequence classification);
    ``pool="none"``: output ``[N, C, T]`` (per-token classification, the
    layout ``CrossEntropyLoss`` expects).
    """

    def __init__(self, vocab: int = 7, length: int = 4, d: int = 4, heads: int = 2, hidden: int = 6,
                 classes: int = 3, pool: str = "mean"):
        super().__init__()
        self.pool = pool
        self.embed = nn.Embedding(vocab, d)
        self.positions = PositionalEmbedding(length, d)
        self.ln1 = nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: Tensor) -> Tensor:  # tokens [N, T] (long)
        h = self.positions(self.embed(tokens))
        h = h + self.attn(self.ln1(h))
        h = h + self.mlp(self.ln2(h))
        if self.pool == "mean":
            return self.head(h.mean(dim=1))
        return self.head(h).permute(0, 2, 1)


class TinyCausalLM(nn.Module):
    """A causal language model of bias-free ``nn.Linear`` layers (what kronfluence can track):
    token embedding plus positions, one pre-LN block (single-head causal attention, a tanh
    MLP), an untied head; logits ``[N, T, V]``."""

    def __init__(self, vocab: int = 11, d: int = 8, length: int = 5):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Parameter(0.1 * torch.randn(length, d))
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(d, 2 * d, bias=False), nn.Linear(2 * d, d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: Tensor) -> Tensor:  # ids [N, T] (long)
        T = ids.shape[1]
        h = self.embed(ids) + self.pos[:T]
        x = self.norm1(h)
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        h = h + self.o(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v)
        h = h + self.down(torch.tanh(self.up(self.norm2(h))))
        return self.head(h)


class SequenceLogits(nn.Module):
    """A Hugging Face language model's logits as ``nn.CrossEntropyLoss`` takes them, ``[N, V, T]``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, ids: Tensor) -> Tensor:
        return self.inner(input_ids=ids).logits.transpose(1, 2)


def tiny_gpt2(vocab: int, seed: int = 0) -> nn.Module:
    """transformers' ``GPT2LMHeadModel`` (``Conv1D`` layers, the embedding tied to the head): one
    block of width 8, eager attention, float64, eval; logits ``[N, V, T]`` (:class:`SequenceLogits`)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=vocab, n_positions=8,
                                  attn_implementation="eager", bos_token_id=0, eos_token_id=0)
    return SequenceLogits(transformers.GPT2LMHeadModel(cfg).to(DT).eval())


# ----------------------------------------------------------------------------- tied autoencoder


class TransposedLinear(nn.Module):
    """``F.linear(h, weight.t(), bias)`` with ``weight`` a Parameter shared with another module."""

    def __init__(self, weight: nn.Parameter, bias: bool = True):
        super().__init__()
        self.weight = weight
        self.bias = nn.Parameter(torch.zeros(weight.shape[1])) if bias else None

    def forward(self, h: Tensor) -> Tensor:
        return F.linear(h, self.weight.t(), self.bias)


class TiedAutoencoder(nn.Module):
    """``dec(σ(enc(x)))`` with the decoder's weight the encoder's, transposed.

    ``tie="shared"``: the decoder is a :class:`TransposedLinear` holding the
    encoder's ``Parameter``; ``tie="functional"``: the parent's forward calls
    ``F.linear(h, self.enc.weight.t())`` itself.
    """

    def __init__(self, d: int = 5, code: int = 3, tie: str = "shared", act: Callable[[], nn.Module] = nn.Sigmoid):
        super().__init__()
        self.tie = tie
        self.enc = nn.Linear(d, code)
        self.act = act()
        if tie == "shared":
            self.dec = TransposedLinear(self.enc.weight)
        elif tie != "functional":
            raise ValueError(tie)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.enc(x))
        if self.tie == "shared":
            return self.dec(h)
        return F.linear(h, self.enc.weight.t())


# ----------------------------------------------------------------------------- feature models


class InplaceNet(nn.Module):
    """In-place activations: modules (``inplace=True``), functional and a tensor method."""

    def __init__(self, d: int = 4, h: int = 5, c: int = 3, smooth: bool = False, method: bool = True):
        super().__init__()
        self.method = method
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, h)
        self.head = nn.Linear(h, c)
        self.act1 = nn.ELU(inplace=True) if smooth else nn.ReLU(inplace=True)
        self.act3 = nn.LeakyReLU(0.1, inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act1(self.fc1(x))
        h = F.relu(self.fc2(h), inplace=True)
        h = self.act3(self.fc3(h))
        out = self.head(h)
        return out.relu_() if self.method else out


class GatedNet(nn.Module):
    """``x * σ(gate(x))`` gating (a product of two branches)."""

    def __init__(self, d: int = 4, h: int = 5, c: int = 3):
        super().__init__()
        self.inp, self.gate, self.head = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, c)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.inp(x) * torch.sigmoid(self.gate(x)))


class BranchCat(nn.Module):
    """Two branches concatenated along the features."""

    def __init__(self, d: int = 4, h: int = 3, c: int = 3):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(d, h), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(d, h), nn.ReLU())
        self.head = nn.Linear(2 * h, c)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.cat([self.a(x), self.b(x)], dim=1))


class ReusedModule(nn.Module):
    """One Linear applied twice (module reuse: its parameters have two uses)."""

    def __init__(self, d: int = 4, c: int = 3):
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, c)
        self.act = nn.Tanh()

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.inp(x))
        h = self.act(self.block(h))
        h = self.block(h)
        return self.head(h)


class FunctionalOps(nn.Module):
    """Functional ops between layers: F.relu, view, permute, indexing,
    ``mean(dim)``, torch.flatten, F.gelu, scalar arithmetic.
    Input ``[N, 2, 3, 4]``."""

    def __init__(self, c: int = 3, smooth: bool = True):
        super().__init__()
        self.smooth = smooth
        self.lin = nn.Linear(4, 5)
        self.mix = nn.Linear(3, 3)
        self.head = nn.Linear(10, c)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.lin(x))  # [N, 2, 3, 5]
        h = h.permute(0, 1, 3, 2)  # [N, 2, 5, 3]
        h = self.mix(2.0 * h - 1.0)  # [N, 2, 5, 3]
        h = h[:, :, :, 1:].mean(dim=-1)  # [N, 2, 5]
        h = h.view(h.shape[0], 2, 5) / 3.0
        h = torch.flatten(h, 1)  # [N, 10]
        h = F.gelu(h) if self.smooth else F.relu(-h)
        return self.head(0.5 * h + 0.1)


# ----------------------------------------------------------------------------- cases


class Case(NamedTuple):
    """A float64 model, its loss, one batch; ``hessian``: what blocks the
    Hessian family today (``None``: supported)."""

    model: nn.Module
    lossfn: nn.Module
    X: Tensor
    y: Tensor
    hessian: "str | None" = None


def _targets(lossfn: nn.Module, out: Tensor, gen: torch.Generator) -> Tensor:
    if isinstance(lossfn, nn.CrossEntropyLoss):
        return torch.randint(0, out.shape[1], (out.shape[0],) + tuple(out.shape[2:]), generator=gen)
    if isinstance(lossfn, nn.BCEWithLogitsLoss):
        return torch.rand(out.shape, generator=gen, dtype=out.dtype)
    return torch.randn(out.shape, generator=gen, dtype=out.dtype)


def _case(model: nn.Module, lossfn: nn.Module, X: Tensor, gen: torch.Generator, hessian=None) -> Case:
    with torch.no_grad():
        out = model(X)
    return Case(model, lossfn, X, _targets(lossfn, out, gen), hessian)


def _float(seed: int, *shape: int) -> Tuple[torch.Generator, Tensor]:
    torch.manual_seed(seed)
    gen = seeded(seed + 1000)
    return gen, torch.randn(shape, generator=gen, dtype=DT)


def resnet(seed: int = 0, n: int = 2) -> Case:
    gen, X = _float(seed, n, 3, 8, 8)
    model = randomise_batchnorm(TinyResNet().to(DT), gen)
    return _case(model, nn.CrossEntropyLoss(), X, gen)


def transformer(seed: int = 0, n: int = 2, pool: str = "mean") -> Case:
    torch.manual_seed(seed)
    gen = seeded(seed + 1000)
    model = TinyTransformer(pool=pool).to(DT)
    X = torch.randint(0, 7, (n, 4), generator=gen)
    return _case(model, nn.CrossEntropyLoss(), X, gen, hessian="softmax, q·kᵀ products, LayerNorm")


def autoencoder(seed: int = 0, n: int = 3, tie: str = "shared") -> Case:
    gen, X = _float(seed, n, 5)
    return _case(TiedAutoencoder(tie=tie).to(DT), nn.MSELoss(), X, gen, hessian="tied weights")


def inplace(seed: int = 0, n: int = 3, smooth: bool = False) -> Case:
    gen, X = _float(seed, n, 4)
    return _case(InplaceNet(smooth=smooth).to(DT), nn.CrossEntropyLoss(), X, gen)


def gated(seed: int = 0, n: int = 3) -> Case:
    gen, X = _float(seed, n, 4)
    return _case(GatedNet().to(DT), nn.BCEWithLogitsLoss(), X, gen, hessian="x * gate(x) product")


def branch_cat(seed: int = 0, n: int = 3) -> Case:
    gen, X = _float(seed, n, 4)
    return _case(BranchCat().to(DT), nn.CrossEntropyLoss(), X, gen)


def reused(seed: int = 0, n: int = 3) -> Case:
    gen, X = _float(seed, n, 4)
    return _case(ReusedModule().to(DT), nn.MSELoss(), X, gen, hessian="module used twice")


def functional(seed: int = 0, n: int = 3, smooth: bool = True) -> Case:
    gen, X = _float(seed, n, 2, 3, 4)
    return _case(FunctionalOps(smooth=smooth).to(DT), nn.CrossEntropyLoss(reduction="sum"), X, gen)


class StandardisedConvNet(nn.Module):
    """Weight-standardised convolutions (timm's ``ScaledStdConv2d``, NFNets): each output
    channel's weight is centred and scaled, ``Ŵ_o = γ_o (W_o - mean W_o) / std W_o``, before
    ``F.conv2d``; the convolution is a functional site whose weight chain is nonlinear in
    ``W`` (a dense per-sample residual over ``(W, γ, x)`` whose ``x`` block is zero)."""

    def __init__(self):
        super().__init__()
        self.w1, self.g1 = nn.Parameter(torch.randn(4, 2, 3, 3)), nn.Parameter(1 + 0.1 * torch.randn(4, 1, 1, 1))
        self.b1 = nn.Parameter(0.1 * torch.randn(4))
        self.w2, self.g2 = nn.Parameter(torch.randn(3, 4, 2, 2)), nn.Parameter(1 + 0.1 * torch.randn(3, 1, 1, 1))
        self.head = nn.Linear(3 * 2 * 2, 3)

    @staticmethod
    def _standardised(w: Tensor, gain: Tensor) -> Tensor:
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        var = w.var(dim=(1, 2, 3), keepdim=True, unbiased=False)
        return gain * (w - mean) / torch.sqrt(var + 1e-5)

    def forward(self, x):
        h = torch.tanh(F.conv2d(x, self._standardised(self.w1, self.g1), self.b1))
        h = F.softplus(F.conv2d(h, self._standardised(self.w2, self.g2), stride=2))
        return self.head(h.flatten(1))


def standardised_conv(seed: int = 0, n: int = 3) -> Case:
    gen, X = _float(seed, n, 2, 7, 7)
    return _case(StandardisedConvNet().to(DT), nn.CrossEntropyLoss(), X, gen)


ZOO: Dict[str, Callable[..., Case]] = {
    "standardised_conv": standardised_conv,
    "resnet": resnet,
    "transformer": transformer,
    "transformer_per_token": lambda seed=0, n=2: transformer(seed, n, pool="none"),
    "autoencoder_shared": lambda seed=0, n=3: autoencoder(seed, n, tie="shared"),
    "autoencoder_functional": lambda seed=0, n=3: autoencoder(seed, n, tie="functional"),
    "inplace": inplace,
    "inplace_smooth": lambda seed=0, n=3: inplace(seed, n, smooth=True),
    "gated": gated,
    "branch_cat": branch_cat,
    "reused": reused,
    "functional": functional,
}
