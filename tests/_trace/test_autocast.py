"""``torch.autocast`` inside a model's ``forward`` is refused, naming the node and module.

curvlib runs every node in its inputs' dtypes; under autocast the model runs some in lower
precision, so the results would differ from the model's (silently, before the refusal).
Both front ends record the autocast state of every traced node; the caller's own autocast
is not the model's and is not recorded.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import BatchGrad


class Autocast(nn.Module):
    def __init__(self, aten: bool, inside: bool = True):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)
        self.aten, self.inside = aten, inside

    def forward(self, x):
        if self.aten and bool(x.abs().sum() >= 0):  # a branch on values: the ATen front end
            x = x * 1.0
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.inside):
            h = self.a(x)
        return self.b(torch.tanh(h.float()))


@pytest.mark.parametrize("aten", [False, True])
def test_autocast_inside_forward_is_refused(aten):
    X, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    with pytest.raises(CurvatureError, match=r"graph node .*module 'a' \(Linear\).*torch\.autocast\('cpu'\)"):
        curvature(Autocast(aten), nn.CrossEntropyLoss(), [BatchGrad()])(X, y)


@pytest.mark.parametrize("aten", [False, True])
def test_a_model_without_autocast_is_traced_as_it_is(aten):
    """The caller's autocast around the first call is not part of the model's graph."""
    model = Autocast(aten, inside=False)
    X, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (the trace is made at set-up)
        f = curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])
    qs = f(X, y)
    torch.testing.assert_close(qs["loss"], nn.CrossEntropyLoss()(model(X), y))
