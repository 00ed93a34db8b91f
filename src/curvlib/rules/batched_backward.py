"""Softmax and smooth activations whose backward batches over many pulled-back columns.

A forward whose graph is pulled back with many columns at once (the Hessian's residual
columns, square roots: ``autograd.grad(..., is_grads_batched=True)``, torch's legacy vmap)
runs every backward kernel without a legacy batching rule once per column:
``_softmax_backward_data``, ``silu_backward``, ``tanh_backward``, ``sigmoid_backward`` and
``gelu_backward`` among them (a tiny language model's Hessian diagonal: over a thousand calls
of each per call). While :func:`curvlib.rules.layernorm.from_primitives` is active, outside
torch.func transforms, these ops run as an :class:`torch.autograd.Function` with the same
forward (the same values, bit for bit) and a backward of batched primitives:

    softmax:      ∂x = y ⊙ (g − Σ_dim g ⊙ y)
    element-wise: ∂x = g ⊙ φ'(x),  φ'(x) formed once in the forward:
        silu: σ(x)(1 + x(1 − σ(x))),  tanh: 1 − y²,  sigmoid: y(1 − y),
        gelu: Φ(x) + x ϕ(x)  ("tanh": ½(1 + t) + ½x(1 − t²) √(2/π)(1 + 3·0.044715 x²),
        t = tanh(√(2/π)(x + 0.044715 x³))).

The backward is once differentiable (a second derivative through it raises): the pulled-back
forward is differentiated once; results that must be differentiable take the torch.func
route, where the ops run as they are.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.fx.experimental import proxy_tensor

__all__ = ["batched_backward_op"]


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int) -> Tensor:
        y = torch.softmax(x, dim)
        ctx.save_for_backward(y)
        ctx.dim = dim
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor):
        (y,) = ctx.saved_tensors
        return y * (g - (g * y).sum(ctx.dim, keepdim=True)), None


class _Pointwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, phi: Callable, slope: Callable) -> Tensor:
        y = phi(x)
        ctx.save_for_backward(slope(x, y))
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor):
        (d,) = ctx.saved_tensors
        return g * d, None, None


def _silu_slope(x: Tensor, y: Tensor) -> Tensor:
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def _gelu_slope(x: Tensor, y: Tensor, approximate: str) -> Tensor:
    if approximate == "tanh":
        k = math.sqrt(2.0 / math.pi)
        t = torch.tanh(k * (x + 0.044715 * x**3))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)
    return 0.5 * (1 + torch.erf(x * (1.0 / math.sqrt(2.0)))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _softmax(x, dim=None, _stacklevel=3, dtype=None):  # F.softmax
    return None if dim is None else _torch_softmax(x, dim, dtype)


def _torch_softmax(x, dim, dtype=None):  # torch.softmax, Tensor.softmax (dtype: the input cast first, as torch does)
    return _Softmax.apply(x if dtype is None else x.to(dtype), dim)


def _silu(x, inplace=False):
    return None if inplace else _Pointwise.apply(x, F.silu, _silu_slope)


def _tanh(x, *, out=None):
    return None if out is not None else _Pointwise.apply(x, torch.tanh, lambda _, y: 1 - y * y)


def _sigmoid(x, *, out=None):
    return None if out is not None else _Pointwise.apply(x, torch.sigmoid, lambda _, y: y * (1 - y))


def _gelu(x, approximate="none"):
    if approximate not in ("none", "tanh"):
        return None
    return _Pointwise.apply(x, lambda t: F.gelu(t, approximate=approximate),
                            lambda t, y: _gelu_slope(t, y, approximate))


#: The ops (graph call targets and method names) and their forms: ``None`` for arguments they
#: do not take (an ``out=``, in place): the op then runs as it is.
_FORMS: Dict[object, Callable[..., Optional[Tensor]]] = {
    torch.softmax: _torch_softmax, F.softmax: _softmax, "softmax": _torch_softmax,
    F.silu: _silu,
    torch.tanh: _tanh, F.tanh: _tanh, "tanh": _tanh,
    torch.sigmoid: _sigmoid, F.sigmoid: _sigmoid, "sigmoid": _sigmoid,
    F.gelu: _gelu,
}


def batched_backward_op(target, args, kwargs) -> Optional[Tensor]:
    """``target(*args, **kwargs)`` with a batched backward (module doc) where ``target`` (a
    function or a method name) is one of the ops and its input is a floating tensor that
    requires grad, else ``None`` (also while a program is traced for torch.compile or
    ``make_fx``: the op is recorded as it is)."""
    form = _FORMS.get(target) if isinstance(target, str) or callable(target) else None
    if form is not None and (torch.compiler.is_compiling() or proxy_tensor.get_proxy_mode() is not None):
        return None
    x = args[0] if args else kwargs.get("input")
    if form is None or not isinstance(x, Tensor) or not x.requires_grad or not torch.is_grad_enabled() \
            or not x.is_floating_point():
        return None
    if not args:
        kwargs = dict(kwargs)
        args = (kwargs.pop("input"),)
    try:
        return form(*args, **kwargs)
    except TypeError:  # arguments the op takes and the form does not name: the op as it is
        return None
