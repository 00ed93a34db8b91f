"""A nonlinear node whose input summarises the whole batch (a 0-d max over samples) has no
per-sample second derivative: the Hessian extensions refuse it at planning with a
CurvatureError naming the node (it was a raw IndexError); first order still runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import BatchGrad, DiagHessian


class BatchScaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)) * (x.abs().max() + 1.0))


def test_a_batch_wide_input_to_a_product_is_refused_for_the_hessian():
    model = BatchScaled().double()
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])(X, y)
    with pytest.raises(CurvatureError, match=r"graph node 'mul'.*no batch dimension"):
        curvature(model, nn.CrossEntropyLoss(), [DiagHessian()])(X, y)
