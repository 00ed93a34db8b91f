"""Internal failures (src/curvlib/_transform/failures.py) reach the user as a CurvatureError naming where.

A bug inside curvlib (here: a rule raising ``KeyError``, the trace raising ``AssertionError``)
must not surface as a raw internal exception: it becomes a :class:`CurvatureError` that names
the site or graph node curvlib was working on, with the original chained. Errors of the
model's own code keep their type.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from curvlib import CurvatureError, curvature
from curvlib.extensions import BatchGrad
from curvlib.rules import functional
from curvlib._plan import traces


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.gamma = nn.Linear(3, 2), nn.Parameter(torch.ones(2))

    def forward(self, x):
        return self.fc(x) * self.gamma  # gamma: a functional site


def _data():
    return torch.randn(4, 3), torch.tensor([0, 1, 0, 1])


# A bug planted inside curvlib: a function called with arguments it does not take (the
# TypeError is raised in curvlib's calling frame, as a real bug's would be).


def test_rule_bug_names_the_site(monkeypatch):
    monkeypatch.setattr(functional, "evaluate", functional.batch_sized)
    X, y = _data()
    with pytest.raises(CurvatureError, match=r"internally on model Scaled at site mul .*TypeError") as info:
        curvature(Scaled(), nn.CrossEntropyLoss(), [BatchGrad()])(X, y)
    assert isinstance(info.value.__cause__, TypeError)


def test_trace_bug_at_setup(monkeypatch):
    monkeypatch.setattr(traces, "needs_aten", functional.batch_sized)  # a bug at setup: called with the wrong arguments
    with pytest.raises(CurvatureError, match="internally on model Scaled: TypeError"):
        curvature(Scaled(), nn.CrossEntropyLoss(), [BatchGrad()])


def test_model_errors_keep_their_type():
    class Raising(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            if x.sum() > 1e9:  # (traced at the ATen level: the model runs on the call's input)
                return x
            raise ZeroDivisionError("the model's own error")

    X, y = _data()
    with pytest.raises(Exception) as info:
        curvature(Raising(), nn.CrossEntropyLoss(), [BatchGrad()])(X, y)
    assert "internally" not in str(info.value)
