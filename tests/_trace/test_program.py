"""The symbolic front end (src/curvlib/_trace/program.py) on modules built inside ``forward``.

A transformers model builds its activation module on every call (``ACT2FN[name](x)``): the
module is no submodule of the model, so torch.fx has no path to call it by. Its ops are
traced (it owns no parameters): the model gets a complete graph, with no retry loop over
opaque leaves, wherever the built module sits and whatever wraps the model (hypothesis);
BatchGrad, DiagGGNExact and KFLR against the float64 brute force.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from curvlib import curvature
from curvlib._trace.program import trace_program
from oracles.on_device import seeded
from oracles.zoo import Problem
from oracles.zoo_checks import check_exact

DT = torch.float64
BUILT = {"gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}


class Block(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc, self.act = nn.Linear(4, 4), act

    def forward(self, h):
        return BUILT[self.act]()(self.fc(h)) + h  # a new module per call


class Net(nn.Module):
    def __init__(self, acts):
        super().__init__()
        self.blocks = nn.ModuleList(Block(a) for a in acts)
        self.head = nn.Linear(4, 3)

    def forward(self, input_ids):
        h = input_ids
        for block in self.blocks:
            h = block(h)
        return {"logits": self.head(h)}


class OneLine(nn.Module):
    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, ids):
        return self.hf(input_ids=ids)["logits"]


@settings(max_examples=6, deadline=None)
@given(acts=st.lists(st.sampled_from(sorted(BUILT)), min_size=1, max_size=3), wrap=st.booleans(),
       seed=st.integers(0, 50))
def test_module_built_inside_forward(acts, wrap, seed):
    torch.manual_seed(seed)
    g = seeded(seed)
    net = Net(acts).to(DT)
    model = OneLine(net) if wrap else net
    program = trace_program(model)
    assert program.graph is not None and not program.opaque, (program.trace_error, program.opaque)
    X = torch.randn(4, 4, generator=g, dtype=DT)
    check_exact(Problem(model, X, torch.randint(0, 3, (4,), generator=g), nn.CrossEntropyLoss(),
                        None if wrap else "logits", ""))


@pytest.mark.parametrize("aten", [False, True])
def test_tensors_the_forward_creates_do_not_touch_the_model(aten):
    """A tensor created in ``forward`` (``torch.tensor([...])``) is held by its graph node; fx
    would store it as a new ``_tensor_constant`` attribute of the traced module, the user's
    model. Results stay exact; the model keeps exactly its attributes."""
    from oracles.reference import assert_matches, exact_extensions, reference

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 3)

        def forward(self, x):
            if aten and bool(x.abs().sum() >= 0):  # a branch on values: the ATen front end
                x = x * 1.0
            h = torch.tanh(self.a(x)) * torch.tensor([1.0, 2.0, 0.5, -1.0], dtype=x.dtype)
            return self.b(h) + torch.tensor([0.1, 0.0, -0.1], dtype=x.dtype)

    torch.manual_seed(0)
    model = Scaled().double()
    before = dict(vars(model))
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    qs = curvature(model, nn.CrossEntropyLoss(), exact_extensions(hessian=True, kflr=True))(X, y)
    assert set(vars(model)) == set(before)
    assert_matches(qs, reference(model, nn.CrossEntropyLoss(), X, y, hessian=True, pchmp=False), f"aten={aten}")


def test_a_program_is_frozen_and_later_stages_make_new_ones():
    """What later stages learn is not written into the traced program: it is frozen, and the
    selector of a container output is set when it is traced."""
    import dataclasses

    program = trace_program(nn.Sequential(nn.Linear(3, 2)), output="logits")
    assert program.selector == "logits"
    with pytest.raises(dataclasses.FrozenInstanceError):
        program.selector = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        program.sibling = program
