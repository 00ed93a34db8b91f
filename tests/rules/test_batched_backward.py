"""Softmax and smooth activations with a batched backward (curvlib.rules.batched_backward): the
same values as torch's ops, the same pullbacks of many columns at once, once differentiable."""

import pytest
import torch
import torch.nn.functional as F

from curvlib.rules.batched_backward import batched_backward_op

CASES = [
    (torch.softmax, (-1,), {}),
    (torch.softmax, (1,), {"dtype": torch.float64}),
    (F.softmax, (), {"dim": -1}),
    ("softmax", (-2,), {}),
    (F.silu, (), {}),
    (torch.tanh, (), {}),
    ("tanh", (), {}),
    (torch.sigmoid, (), {}),
    (F.sigmoid, (), {}),
    (F.gelu, (), {}),
    (F.gelu, (), {"approximate": "tanh"}),
]


def _reference(target, x, args, kwargs):
    return getattr(x, target)(*args, **kwargs) if isinstance(target, str) else target(x, *args, **kwargs)


@pytest.mark.parametrize("target,args,kwargs", CASES)
def test_same_values_and_batched_pullback(target, args, kwargs):
    torch.manual_seed(0)
    x = (4 * torch.randn(3, 4, 5, dtype=torch.float64)).requires_grad_(True)
    y = batched_backward_op(target, (x,) + args, kwargs)
    ref = _reference(target, x, args, kwargs)
    assert y is not None and "Backward" in type(y.grad_fn).__name__
    assert torch.equal(y, ref)  # the op's own forward: bit for bit
    cols = torch.randn((7,) + tuple(y.shape), dtype=torch.float64)
    (got,) = torch.autograd.grad(y, x, cols, is_grads_batched=True)
    (want,) = torch.autograd.grad(ref, x, cols, is_grads_batched=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


def test_once_differentiable():
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(batched_backward_op(F.silu, (x,), {}).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(g.sum(), x)


def test_op_as_it_is():
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    assert batched_backward_op(F.silu, (x.detach(),), {}) is None  # nothing to pull back
    assert batched_backward_op(F.silu, (x.detach().clone(),), {"inplace": True}) is None
    assert batched_backward_op(torch.tanh, (x,), {"out": torch.empty(4, 3, dtype=torch.float64)}) is None
    assert batched_backward_op(torch.relu, (x,), {}) is None  # not one of the ops
    with torch.no_grad():
        assert batched_backward_op(torch.tanh, (x,), {}) is None
