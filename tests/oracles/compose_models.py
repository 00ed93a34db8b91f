"""The model list of the composition matrix: tiny float64 builders.

``build(name, seed)`` returns a :class:`Problem`: the model (eval mode), the
loss, and ``data(gen, n)`` drawing ``(X, y)`` with ``n`` samples. Sizes are
tiny on purpose: every brute force of :mod:`oracles.compose` is a dense
per-sample Jacobian or Hessian, nested under the transform being tested.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Tuple

import torch
from torch import Tensor, nn

from oracles.on_device import seeded
from oracles.compose import twin

DT = torch.float64
CLASSES = 2


class Pool(nn.Module):
    """Mean over dim 1 (positions), then a Linear head."""

    def __init__(self, body: nn.Module, d: int):
        super().__init__()
        self.body = body
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x).mean(1))


class GRUHead(nn.Module):
    """``nn.GRU`` (batch first), Linear head on the last step's output."""

    def __init__(self, i: int = 2, h: int = 2):
        super().__init__()
        self.gru = nn.GRU(i, h, batch_first=True)
        self.head = nn.Linear(h, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1])


class EmbeddingTanh(nn.Module):
    """``head(mean_t tanh(emb(ids)))``."""

    def __init__(self, vocab: int = 4, d: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.act = nn.Tanh()
        self.head = nn.Linear(d, CLASSES)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.act(self.emb(ids)).mean(1))


class ResBlock(nn.Module):
    """``head(flatten(tanh(x + conv2(tanh(conv1(x))))))``: a ResNet basic block without norms."""

    def __init__(self, c: int = 1, s: int = 2):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.act1 = nn.Tanh()
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.act2 = nn.Tanh()
        self.head = nn.Linear(c * s * s, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act2(x + self.conv2(self.act1(self.conv1(x))))
        return self.head(h.flatten(1))


class Problem(NamedTuple):
    name: str
    model: nn.Module
    lossfn: nn.Module
    data: Callable[[torch.Generator, int], Tuple[Tensor, Tensor]]
    float_input: bool  # grad w.r.t. X is defined
    tanh_only: bool  # every nonlinearity is an nn.Tanh module (the PCHMP oracle's domain)


def _floats(*shape):
    def data(gen, n):
        X = torch.randn((n,) + shape, generator=gen, dtype=DT)
        return X, torch.randint(0, CLASSES, (n,), generator=gen)

    return data


def _ids(vocab, t):
    def data(gen, n):
        return torch.randint(0, vocab, (n, t), generator=gen), torch.randint(0, CLASSES, (n,), generator=gen)

    return data


def _randomise_bn(model: nn.Module, gen: torch.Generator) -> None:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.copy_(0.3 * torch.randn(m.running_mean.shape, generator=gen, dtype=DT))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen, dtype=DT))
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=gen, dtype=DT))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=gen, dtype=DT))


def _module(name: str) -> Tuple[nn.Module, Callable, bool, bool]:
    if name == "mlp":
        return nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, CLASSES)), _floats(3), True, True
    if name == "mlp_ln":
        m = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3), nn.Tanh(), nn.Linear(3, CLASSES))
        return m, _floats(3), True, False
    if name == "cnn":
        m = nn.Sequential(nn.Conv2d(1, 2, 2), nn.Tanh(), nn.Flatten(), nn.Linear(8, CLASSES))
        return m, _floats(1, 3, 3), True, True
    if name == "bn_cnn":
        m = nn.Sequential(nn.Conv2d(1, 2, 2), nn.BatchNorm2d(2), nn.Tanh(), nn.Flatten(), nn.Linear(8, CLASSES))
        return m, _floats(1, 3, 3), True, True
    if name == "transformer":
        layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=4, dropout=0.0, batch_first=True)
        return Pool(layer, 4), _floats(2, 4), True, False
    if name == "gru":
        return GRUHead(), _floats(2, 2), True, False
    if name == "embedding":
        return EmbeddingTanh(), _ids(4, 2), False, True
    if name == "resnet":
        return ResBlock(), _floats(1, 2, 2), True, True
    raise KeyError(name)


MODELS = ("mlp", "mlp_ln", "cnn", "transformer", "gru", "embedding", "resnet", "bn_cnn")
INTEGER_INPUT = ("embedding",)  # no gradient w.r.t. X


def build(name: str, seed: int = 0) -> Problem:
    """The model ``name`` with parameters drawn from ``seed`` (eval mode, float64)."""
    torch.manual_seed(seed)
    model, data, float_input, tanh_only = _module(name)
    model = model.to(DT)
    gen = seeded(seed + 1000)
    with torch.no_grad():  # non-default values: LayerNorm's affine parameters are 1 and 0 at init
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=DT))
    _randomise_bn(model, gen)
    twin(model.eval())  # the oracle's copy, made here: a deepcopy inside a torch.func transform leaks its tensors
    return Problem(name, model.eval(), nn.CrossEntropyLoss(), data, float_input, tanh_only)
