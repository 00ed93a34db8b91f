"""Parameter uses outside modules (src/curvlib/_trace/functional_uses.py) whose chain reads a shape or a device.

timm's class-attention ViTs expand a class token to ``x.shape[0]`` rows of a tensor that a
position embedding (a parameter) made; XCiT's positional encoding reads its convolution's
``weight.device``. The shape and the device are metadata, constant for the derivatives:
the class token's chain must not pull in the position embedding, nor a ``.device`` read
the weight. BatchGrad, DiagGGNExact and KFLR against the float64 brute force (hypothesis
over where the shape is read and the wrapper).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from oracles.on_device import seeded
from oracles.zoo import Problem
from oracles.zoo_checks import check_exact

DT = torch.float64


class ClassAttention(nn.Module):
    def __init__(self, late):
        super().__init__()
        self.proj, self.head, self.late = nn.Linear(3, 4), nn.Linear(4, 3), late
        self.pos = nn.Parameter(torch.randn(1, 5, 4))
        self.cls = nn.Parameter(torch.randn(1, 1, 4))
        self.enc = nn.Linear(2, 4)

    def forward(self, x):
        h = self.proj(x) + self.pos
        grid = torch.arange(10, device=self.enc.weight.device, dtype=self.enc.weight.dtype).view(5, 2) / 10
        h = h + self.enc(grid)  # a layer on constants, placed by its weight's device
        h = torch.tanh(h) if self.late else h
        cls = self.cls.expand(h.shape[0], -1, -1)  # the shape of a tensor the parameters made
        h = torch.cat([cls, h], 1)
        return self.head(h.mean(1))


class Wrapper(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, pixels):
        return (self.net(pixels),)


@settings(max_examples=5, deadline=None)
@given(late=st.booleans(), wrap=st.booleans(), seed=st.integers(0, 50))
def test_shape_and_device_reads_end_a_chain(late, wrap, seed):
    torch.manual_seed(seed)
    g = seeded(seed)
    net = ClassAttention(late).to(DT)
    X = torch.randn(3, 5, 3, generator=g, dtype=DT)
    check_exact(Problem(Wrapper(net) if wrap else net, X, torch.randint(0, 3, (3,), generator=g),
                        nn.CrossEntropyLoss(), 0 if wrap else None, ""),
                kflr_skip=("enc.", "net.enc."))  # (a layer on constants: its exact block)
