"""Which mapping inputs are keyword arguments (``model(**X)``) and which one argument (``model(X)``)."""

from __future__ import annotations

import torch
from torch import nn

from curvlib import curvature
from curvlib._core.inputs import keyword_inputs
from curvlib.extensions import BatchGrad, DiagGGNExact

from oracles.first_order import individual_gradients


class Named(nn.Module):
    def forward(self, input_ids, attention_mask=None):
        return input_ids


class PassesOn(nn.Module):
    """A wrapper whose forward passes ``*args, **kwargs`` on (as ``peft.PeftModel`` does)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


class OneArgument(nn.Module):
    def forward(self, batch, **options):
        return batch["x"]


def test_keyword_inputs_by_signature():
    X = {"input_ids": torch.zeros(2, 3), "attention_mask": torch.ones(2, 3)}
    assert keyword_inputs(Named(), X)
    assert keyword_inputs(PassesOn(Named()), X)
    assert not keyword_inputs(OneArgument(), {"x": torch.zeros(2)})  # its required 'batch' is no key
    assert keyword_inputs(OneArgument(), {"batch": {"x": torch.zeros(2)}})
    assert not keyword_inputs(Named(), {"other": torch.zeros(2)})
    assert not keyword_inputs(Named(), torch.zeros(2))


def test_a_wrapper_passing_kwargs_on_gets_keywords():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x, scale=None):
            return self.b(torch.tanh(self.a(x) * scale))

    torch.manual_seed(0)
    net = Net().double()
    model = PassesOn(net)
    x, scale = torch.randn(5, 3, dtype=torch.float64), torch.rand(5, 1, dtype=torch.float64) + 0.5
    y = torch.randint(0, 2, (5,))
    qs = curvature(model, nn.CrossEntropyLoss(), [BatchGrad(), DiagGGNExact()])({"x": x, "scale": scale}, y)

    class Joined(nn.Module):  # the oracle's model: one tensor input
        def __init__(self):
            super().__init__()
            self.inner = net

        def forward(self, xs):
            return self.inner(xs[:, :3], scale=xs[:, 3:])

    ref = individual_gradients(Joined(), nn.CrossEntropyLoss(), torch.cat([x, scale], 1), y)
    for name, g in qs["grad_batch"].items():
        torch.testing.assert_close(g, ref[name], rtol=1e-10, atol=1e-12)
