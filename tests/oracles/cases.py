"""Shared models and drawn cases (float64): hypothesis strategies and small modules.

* second order on drawn models: ``LOSSES``, ``ACTS``, :func:`targets` / :func:`target_for`,
  the strategies :func:`mlps`, :func:`cnns` (with :func:`pools`), :func:`conv_transposes`,
  and :class:`MeanEmbedding`, :class:`RecurrentNet`, :class:`Product`;
* :func:`conv_configs`: every ``nn.ConvNd`` constructor option with an input it accepts;
* samples mixed inside a model: :class:`HotNet` and :func:`hot_data`.
"""

from __future__ import annotations

import torch
from hypothesis import assume, strategies as st
from torch import nn

from oracles.on_device import seeded

DT = torch.float64
N = 5


# ----------------------------------------------------------------------------- second order on drawn models


LOSSES = {"mse": nn.MSELoss, "ce": nn.CrossEntropyLoss, "bce": nn.BCEWithLogitsLoss}


ACTS = {
    "relu": nn.ReLU,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
    "leaky": lambda: nn.LeakyReLU(0.2),
    "logsigmoid": nn.LogSigmoid,
    "elu": nn.ELU,
    "selu": nn.SELU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "softplus": nn.Softplus,
    "identity": nn.Identity,
}


def targets(kind: str, out: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if kind == "ce":
        return torch.randint(0, out.shape[1], (out.shape[0],) + tuple(out.shape[2:]), generator=gen)
    if kind == "bce":
        return torch.rand(out.shape, generator=gen, dtype=out.dtype)
    return torch.randn(out.shape, generator=gen, dtype=out.dtype)


def target_for(model, X, loss, seed):
    """Targets of kind ``loss`` for ``model(X)``, drawn from ``seed + 7``."""
    with torch.no_grad():
        out = model(X)
    return targets(loss, out, seeded(seed + 7))


@st.composite
def mlps(draw):
    i = draw(st.integers(1, 3))
    widths = draw(st.lists(st.integers(1, 4), min_size=0, max_size=2))
    o = draw(st.integers(1, 3))
    bias = draw(st.booleans())
    acts = [draw(st.sampled_from(sorted(ACTS))) for _ in widths]
    final = draw(st.sampled_from(["none", "sigmoid", "tanh", "softplus"]))
    # a nonlinearity on the input itself (no parameter behind it: no residual)
    layers = [ACTS[draw(st.sampled_from(["tanh", "gelu"]))]()] if draw(st.booleans()) else []
    d = i
    for w, a in zip(widths, acts):
        layers += [nn.Linear(d, w, bias=bias), ACTS[a]()]
        d = w
    layers.append(nn.Linear(d, o, bias=bias))
    if final != "none":
        layers.append(ACTS[final]())
    return nn.Sequential(*layers), i


CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


MAXPOOL = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}


AVGPOOL = {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d}


ADAPTIVE = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}


CONVT = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


@st.composite
def pools(draw, d):
    kind = draw(st.sampled_from(["none", "max", "avg", "adaptive"]))
    if kind == "none":
        return None
    if kind == "adaptive":
        return ADAPTIVE[d](draw(st.integers(1, 2)))
    k = draw(st.integers(1, 2))
    stride = draw(st.sampled_from([None, 1, 2]))
    padding = draw(st.integers(0, k // 2))
    ceil = draw(st.booleans())
    if kind == "max":
        dilation = draw(st.integers(1, 2))
        if dilation > 1:
            # a dilated window may then hold no input element at all: PyTorch's
            # max_pool3d backward corrupts memory there (a torch bug, not curvlib's)
            padding = 0
        return MAXPOOL[d](k, stride=stride, padding=padding, dilation=dilation, ceil_mode=ceil)
    return AVGPOOL[d](k, stride=stride, padding=padding, ceil_mode=ceil, count_include_pad=draw(st.booleans()))


@st.composite
def cnns(draw, dims=(1, 2, 3)):
    """``(model, input shape without N)``: conv -> act -> [pad] -> [pool] -> dropout(eval) -> flatten -> linear."""
    d = draw(st.sampled_from(dims))
    groups = draw(st.integers(1, 2))
    c_in = groups * draw(st.integers(1, 2))
    c_out = groups * draw(st.integers(1, 2))
    kmax = 3 if d < 3 else 2
    kernel = tuple(draw(st.integers(1, kmax)) for _ in range(d))
    conv = CONV[d](
        c_in,
        c_out,
        kernel,
        stride=draw(st.integers(1, 2)),
        padding=draw(st.integers(0, 1)),
        dilation=draw(st.integers(1, 2)),
        groups=groups,
        bias=draw(st.booleans()),
        padding_mode=draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"])),
    )
    layers = [conv, ACTS[draw(st.sampled_from(sorted(ACTS)))]()]
    if d == 2 and draw(st.booleans()):
        layers.append(nn.ZeroPad2d(tuple(draw(st.integers(0, 1)) for _ in range(4))))
    pool = draw(pools(d))
    if pool is not None:
        layers.append(pool)
    if draw(st.booleans()):
        layers.append(nn.Dropout(0.5))
    smax = 5 if d < 3 else 3
    spatial = tuple(draw(st.integers(2, smax)) for _ in range(d))
    model = nn.Sequential(*layers).double().eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros((1, c_in) + spatial, dtype=torch.float64))
    except RuntimeError:
        assume(False)
    assume(out.numel() > 0)
    o = draw(st.integers(1, 3))
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(out.numel(), o)).double().eval()
    return model, (c_in,) + spatial, groups


@st.composite
def conv_transposes(draw):
    d = draw(st.sampled_from([1, 2, 3]))
    groups = draw(st.integers(1, 2))
    c_in = groups * draw(st.integers(1, 2))
    c_out = groups * draw(st.integers(1, 2))
    stride = draw(st.integers(1, 2))
    dilation = draw(st.integers(1, 2))
    kernel = draw(st.integers(1, 2))
    up = CONVT[d](
        c_in, c_out, kernel, stride=stride, padding=draw(st.integers(0, 1)),
        output_padding=draw(st.integers(0, max(stride, dilation) - 1)), groups=groups,
        bias=draw(st.booleans()), dilation=dilation,
    )
    spatial = tuple(draw(st.integers(1, 3 if d < 3 else 2)) for _ in range(d))
    act = ACTS[draw(st.sampled_from(sorted(ACTS)))]()
    body = nn.Sequential(up, act).double()
    try:
        with torch.no_grad():
            out = body(torch.zeros((1, c_in) + spatial, dtype=torch.float64))
    except RuntimeError:
        assume(False)
    assume(out.numel() > 0)
    model = nn.Sequential(up, act, nn.Flatten(), nn.Linear(out.numel(), 2)).double()
    return model, (c_in,) + spatial


class MeanEmbedding(nn.Module):
    """``idx [N, S]`` -> embedding -> Tanh -> mean over ``S`` -> Linear."""

    def __init__(self, v, d, o, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(v, d, padding_idx=padding_idx)
        self.act = nn.Tanh()
        self.head = nn.Linear(d, o)

    def forward(self, idx):
        return self.head(self.act(self.emb(idx)).mean(1))


class RecurrentNet(nn.Module):
    def __init__(self, kind, i, h, o, layers, batch_first, bidirectional):
        super().__init__()
        cls = {"rnn": nn.RNN, "lstm": nn.LSTM, "gru": nn.GRU}[kind]
        self.rnn = cls(i, h, num_layers=layers, batch_first=batch_first, bidirectional=bidirectional)
        self.batch_first = batch_first
        self.fc = nn.Linear(h * (2 if bidirectional else 1), o)

    def forward(self, x):
        out, _ = self.rnn(x if self.batch_first else x.transpose(0, 1))
        if not self.batch_first:
            out = out.transpose(0, 1)
        return self.fc(out[:, -1])


class Product(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.c(self.a(x) * self.b(x))


# ----------------------------------------------------------------------------- convolutions


@st.composite
def conv_configs(draw, dims=(1, 2, 3)):
    """``(d, conv kwargs, spatial input shape)``: a valid nn.ConvNd and an input it accepts."""
    d = draw(st.sampled_from(dims))
    groups = draw(st.integers(1, 2))
    c_in = groups * draw(st.integers(1, 2))
    c_out = groups * draw(st.integers(1, 2))
    kmax = 3 if d < 3 else 2
    int_kernel = d > 1 and draw(st.booleans())
    if int_kernel:
        kernel = (draw(st.integers(1, kmax)),) * d
    else:
        kernel = tuple(draw(st.integers(1, kmax)) for _ in range(d))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(d))
    mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    padding_kind = draw(st.sampled_from(["int", "tuple", "valid", "same"]))
    if padding_kind == "same":
        stride = 1
        padding = "same"
        per_side = [(dl * (k - 1) + 1) // 2 + 1 for k, dl in zip(kernel, dilation)]
    else:
        stride = draw(st.one_of(st.integers(1, 2), st.tuples(*[st.integers(1, 2)] * d)))
        if padding_kind == "int":
            padding = draw(st.integers(0, 2))
            per_side = [padding] * d
        elif padding_kind == "tuple":
            padding = tuple(draw(st.integers(0, 2)) for _ in range(d))
            per_side = list(padding)
        else:
            padding = "valid"
            per_side = [0] * d
    smax = 7 if d < 3 else 4
    spatial = []
    for k, dl, p in zip(kernel, dilation, per_side):
        # the padded input must hold one window; reflect needs padding < size
        low = max(dl * (k - 1) + 1 - 2 * p, p + 1, 1)
        spatial.append(draw(st.integers(low, max(low, smax))))
    kwargs = dict(
        in_channels=c_in,
        out_channels=c_out,
        kernel_size=kernel[0] if int_kernel else kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        bias=draw(st.booleans()),
        padding_mode=mode,
    )
    return d, kwargs, tuple(spatial)


# ----------------------------------------------------------------------------- samples mixed inside a model


class HotNet(nn.Module):
    """``b(fn(a(x)))``: ``fn`` acts on the hot activation ``[N, 4]`` (``a`` trainable)."""

    def __init__(self, fn, pre=None, d_in: int = 3):
        super().__init__()
        self.a, self.b, self.fn, self.pre = nn.Linear(d_in, 4), nn.Linear(4, 2), fn, pre

    def forward(self, x):
        if self.pre is not None:
            x = self.pre(x)
        return self.b(torch.tanh(self.fn(self.a(x))))


def hot_data(seed: int = 0, n: int = N, shape=(3,)):
    g = seeded(seed)
    return torch.randn((n,) + tuple(shape), generator=g, dtype=DT), torch.randn(n, 2, generator=g, dtype=DT)
