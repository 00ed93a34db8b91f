"""Parameter-free graph nodes, sorted by their second derivative.

Curvature needs to know, for every node ``z = φ(a)`` of the traced graph,
its *residual*: the second-derivative term ``Σ_k g_k ∇²φ_k(a)`` (``g = ∂L/∂z``)
that the Hessian has and the GGN drops. Nodes fall into:

* ``"linear"``: piecewise linear in the graph tensors (reshapes, indexing,
  sums, pooling, padding, dropout with its fixed mask, ReLU, max-pooling,
  BatchNorm in eval mode, the affine layers): residual zero;
* ``"elementwise"``: ``z_i = φ(a_i)`` with a smooth ``φ`` (sigmoid, tanh, ELU,
  GELU, ...): residual ``diag(φ''(a) ⊙ g)``, with ``φ''`` obtained by
  forward-over-reverse differentiation of ``φ`` itself (exact, no table of
  formulas to get wrong);
* ``"other"``: anything else (products of two graph tensors, softmax, norms
  without parameters, unknown modules); the Hessian extensions refuse them.

The GGN extensions need none of this: Jacobians come from autodiff.
"""

from __future__ import annotations

import operator
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.func import jvp, vjp

from .._core.sync import LOCK

LINEAR_MODULES: Tuple[type, ...] = (
    nn.Identity, nn.Flatten, nn.Unflatten,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
    nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d,
    nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d,
    nn.ReflectionPad1d, nn.ReflectionPad2d, nn.ReflectionPad3d,
    nn.ReplicationPad1d, nn.ReplicationPad2d, nn.ReplicationPad3d,
    nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
    nn.ReLU, nn.LeakyReLU, nn.ReLU6, nn.Hardtanh, nn.Threshold, nn.Hardsigmoid,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
    nn.PixelShuffle, nn.PixelUnshuffle, nn.ChannelShuffle,
)

ELEMENTWISE_MODULES: Tuple[type, ...] = (
    nn.Sigmoid, nn.Tanh, nn.LogSigmoid, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Softplus, nn.Mish, nn.Softsign, nn.Tanhshrink, nn.Hardswish,
)

_LINEAR_FUNCTIONS = {
    operator.add, operator.sub, operator.neg, operator.pos, operator.getitem,
    torch.add, torch.sub, torch.neg, torch.flatten, torch.reshape, torch.cat, torch.stack,
    torch.transpose, torch.permute, torch.squeeze, torch.unsqueeze, torch.sum, torch.mean,
    torch.movedim, torch.swapaxes, torch.narrow, torch.select, torch.chunk, torch.split, torch.unbind,
    torch.relu, torch.flip, torch.roll, torch.index_select, torch.gather, torch.take_along_dim, torch.tensor_split,
    torch.hsplit, torch.vsplit, torch.dsplit, torch.split_with_sizes, torch.unique_consecutive,
    F.relu, F.leaky_relu, F.relu6, F.hardtanh, F.hardsigmoid, F.pad, F.dropout, F.dropout1d, F.dropout2d,
    F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d,
    F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
    F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d, getattr,
}
_LINEAR_METHODS = {
    "view", "reshape", "flatten", "permute", "transpose", "squeeze", "unsqueeze",
    "contiguous", "mean", "sum", "size", "dim", "expand", "expand_as", "repeat", "chunk",
    "split", "unbind", "__getitem__", "t", "neg", "relu", "narrow", "select", "to", "type_as",
    "float", "double", "flip", "roll", "movedim", "view_as", "reshape_as", "clone",
    "add", "sub", "unflatten", "index_select", "gather", "split_with_sizes", "tensor_split", "take_along_dim",
    "unique_consecutive",
}
# ATen operators (an ATen trace keeps some as they are) that select, split or regroup entries of
# their tensor input: linear in it (``unique_consecutive`` returns a subset of its values; its
# indices and counts are integers, not differentiated)
_LINEAR_ATEN = frozenset("""split split_with_sizes unbind chunk tensor_split index_select gather take_along_dim
select slice narrow view _unsafe_view reshape expand permute transpose squeeze unsqueeze cat stack clone
index unique_consecutive alias""".split())
# Piecewise linear in all their floating-point arguments together, for fixed integer and boolean
# ones (second derivative zero wherever it exists, as for ReLU): they select, compare, place or
# sum entries. A mixture-of-experts router's ``topk`` (its values are some of its input's, its
# indices integers), ``where``/``masked_fill`` on a mask (``where(c, a, b)`` is linear in ``(a, b)``
# jointly), ``clamp``/``abs``/``maximum``, ``max``/``sort`` along a dim, scatter-adds of rows
# back into place, ``tril``/``triu``, ``cumsum``; ``floor``/``sign`` and comparisons have derivative
# zero; complex views (``real``, ``view_as_real``) and FFTs are linear maps. Not ``prod``-like
# reductions (``cumprod``, ``scatter_reduce``): those multiply entries.
_PIECEWISE_LINEAR = frozenset("""where masked_fill masked_scatter clamp clamp_min clamp_max clip abs maximum minimum fmax
fmin max min amax amin topk sort msort kthvalue median nanmedian mode cummax cummin index_add index_copy index_fill
index_put _unsafe_index_put scatter scatter_add diagonal diag_embed diag tril triu take tile repeat
repeat_interleave nan_to_num cumsum diff sign floor ceil round trunc fix rot90 constant_pad_nd flip roll
hardtanh threshold relu relu6 zeros_like ones_like full_like new_zeros new_ones new_full fill masked_select
gt lt ge le eq ne greater less greater_equal less_equal logical_and logical_or logical_not isnan isinf isfinite
real imag view_as_real view_as_complex conj conj_physical resolve_conj resolve_neg complex
_fft_c2c _fft_r2c _fft_c2r
""".split()) | {"__gt__", "__lt__", "__ge__", "__le__", "__eq__", "__ne__", "__and__", "__or__", "__invert__"}
# the same as Python operators (``h > 0.1`` in a traced graph): boolean results, derivative zero
_COMPARISONS = {operator.gt, operator.lt, operator.ge, operator.le, operator.eq, operator.ne, operator.and_,
                operator.or_, operator.invert, operator.not_}
_ELEMENTWISE_FUNCTIONS = {
    torch.sigmoid, torch.tanh, torch.exp, torch.sin, torch.cos, torch.log1p,
    torch.rsqrt, torch.sqrt, torch.log, torch.reciprocal,  # (RMSNorm's 1/√(mean x² + ε))
    F.sigmoid, F.tanh, F.gelu, F.silu, F.softplus, F.elu, F.selu, F.celu, F.logsigmoid,
    F.mish, F.softsign, F.tanhshrink, F.hardswish,
}


def hardsigmoid(x: Tensor, inplace: bool = False) -> Tensor:
    """``F.hardsigmoid`` as ``relu6(x + 3) / 6`` (the same values, bit for bit): piecewise linear
    (no second derivative; classified ``"linear"``), and torch has no forward-mode derivative of
    ``hardsigmoid_backward``, which the block products and Hessian diagonals take through it."""
    return F.relu6(x + 3.0) / 6.0
_ELEMENTWISE_METHODS = {"sigmoid", "tanh", "exp", "sin", "cos", "log1p", "rsqrt", "sqrt", "log", "reciprocal"}
# ``h += p`` and the like (curvlib._trace.program records them in place): their out-of-place twins
_AUGMENTED = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
              operator.itruediv: operator.truediv}
_SCALAR_ARITHMETIC = {operator.mul, operator.truediv, torch.mul, torch.div, "mul", "div"}


def _name(target) -> str:
    """A torch function's name (``torch.where`` -> ``"where"``), else ``""``."""
    return getattr(target, "__name__", "") if callable(target) else ""


def _multiplies(node: fx.Node) -> bool:
    """``scatter(..., reduce="multiply")``: a product of entries, not piecewise linear."""
    return node.kwargs.get("reduce") == "multiply" or "multiply" in node.args[1:]


def _depends_on_input(arg, dependent: set) -> bool:
    return isinstance(arg, fx.Node) and arg in dependent


def classify(node: fx.Node, root: nn.Module, layers: dict, dependent: set) -> Tuple[str, Optional[Callable]]:
    """``("linear" | "elementwise" | "other", φ)`` for one graph node.

    Args:
        node: the node.
        root: the traced root module (to resolve ``call_module`` targets).
        layers: targets of parametrized layers (sites; linear in their input
            unless their family is listed as nonlinear by the caller).
        dependent: nodes that depend on the model input (others are constants).

    Returns:
        the kind, and for ``"elementwise"`` a function ``φ(a)`` of the node's
        first tensor argument (other arguments bound).
    """
    if not any(_depends_on_input(a, dependent) for a in node.all_input_nodes):
        return "linear", None  # a constant
    if node.op in ("placeholder", "output", "get_attr"):
        return "linear", None
    if node.op == "call_module":
        return _classify_module(node, root, layers)
    if node.op == "call_function" and getattr(node.target, "curvlib_linear", False):
        return "linear", None  # curvlib's own affine helpers (masking in curvlib.rules.attention)
    target = _out_of_place(node)
    found = _classify_from_tables(node, target, dependent)
    if found is not None:
        return found
    if target in _SCALAR_ARITHMETIC or target in ("mul", "div"):
        return _classify_arithmetic(node, target, dependent)
    return "other", None


def _classify_module(node: fx.Node, root: nn.Module, layers: dict) -> Tuple[str, Optional[Callable]]:
    if node.target in layers:
        return "linear", None
    module = root.get_submodule(node.target)
    if isinstance(module, LINEAR_MODULES):
        return "linear", None
    if isinstance(module, ELEMENTWISE_MODULES):
        return "elementwise", module.forward  # (its hooks are not part of the math)
    return "other", None


def _out_of_place(node: fx.Node):
    """The node's target with in-place spellings dropped: ``x.relu_()`` has the curvature of
    ``x.relu()``, ``torch.sigmoid_`` and ``F.relu_`` those of ``torch.sigmoid`` and ``F.relu``."""
    target = node.target
    if node.op == "call_method" and target.endswith("_") and not target.endswith("__"):
        return target[:-1]
    if target in _AUGMENTED:
        return _AUGMENTED[target]
    name = getattr(target, "__name__", "") if node.op == "call_function" else ""
    if name.endswith("_") and not name.endswith("__"):
        for namespace in (F, torch):
            if hasattr(namespace, name[:-1]):
                return getattr(namespace, name[:-1])
    return target


def _classify_from_tables(node: fx.Node, target, dependent: set) -> Optional[Tuple[str, Optional[Callable]]]:
    """The kind from the tables of linear and element-wise methods and functions (``None``: not
    in them)."""
    if node.op == "call_method":
        if target in _LINEAR_METHODS or (target in _PIECEWISE_LINEAR and not _multiplies(node)):
            return "linear", None
        if target in _ELEMENTWISE_METHODS:
            rest, kwargs = node.args[1:], node.kwargs
            return "elementwise", (lambda a, t=target, r=rest, k=kwargs: getattr(a, t)(*r, **k))
    if node.op != "call_function":
        return None
    if target in _LINEAR_FUNCTIONS or target in _COMPARISONS or (isinstance(target, torch._ops.OpOverload)
                                       and target.overloadpacket.__name__ in _LINEAR_ATEN):
        return "linear", None
    aten = isinstance(target, torch._ops.OpOverload) and target.overloadpacket.__name__ in _PIECEWISE_LINEAR
    if (aten or (_name(target) in _PIECEWISE_LINEAR and getattr(target, "__module__", None) == "torch")) \
            and not _multiplies(node):
        return "linear", None
    if getattr(target, "__module__", None) == "torch._C._fft" or (  # torch.fft.*: linear maps (FNet's mixing)
            isinstance(target, torch._ops.OpOverload) and target.overloadpacket.__name__.lstrip("_").startswith("fft")):
        return "linear", None
    first_only = _depends_on_input(node.args[0], dependent) and not any(
        _depends_on_input(a, dependent) for a in node.args[1:])
    if target in _ELEMENTWISE_FUNCTIONS and first_only:
        rest, kwargs = node.args[1:], {k: v for k, v in node.kwargs.items() if k != "inplace"}
        return "elementwise", (lambda a, t=target, r=rest, k=kwargs: t(a, *r, **k))
    if target in (operator.pow, torch.pow) and first_only:
        exponent = node.args[1]
        return "elementwise", (lambda a, e=exponent: a**e)
    return None


def _classify_arithmetic(node: fx.Node, target, dependent: set) -> Tuple[str, Optional[Callable]]:
    """``x * c``, ``c * x``, ``x / c``: linear; a product or quotient of two input-dependent
    values: other."""
    dep = [_depends_on_input(a, dependent) for a in node.args]
    if target in (operator.truediv, torch.div, "div"):
        return ("linear", None) if dep[0] and not any(dep[1:]) else ("other", None)
    return ("linear", None) if sum(dep) == 1 else ("other", None)


def second_derivative(phi: Callable[[Tensor], Tensor], a: Tensor) -> Tensor:
    """``φ''(a)`` element-wise, by forward-over-reverse autodiff of ``φ``.

    For an element-wise ``φ``, ``d/da (φ'(a) ⊙ 1)`` along the all-ones
    direction is exactly ``φ''(a)``.
    """
    ones = torch.ones_like(a)

    def first_derivative(x: Tensor) -> Tensor:
        return vjp(phi, x)[1](ones)[0]

    with LOCK:  # forward-mode AD state is process-wide (curvlib._core.sync)
        return jvp(first_derivative, (a,), (ones,))[1]
