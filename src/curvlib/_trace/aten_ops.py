"""The ATen graph's vocabulary, mapped to curvlib's (see :mod:`curvlib._trace.aten`).

* :func:`owner_call`: an op that *is* its owner module's forward on the module's own parameters
  (``aten.linear`` on an ``nn.Linear``, ``aten.conv2d`` with the module's stride, padding,
  dilation and groups, ``aten.embedding``, ``aten.layer_norm``, ``aten.group_norm``,
  ``aten.batch_norm``; arguments left out take the op schema's defaults), to be replayed
  as that module's call (its hand-written rule);
* :func:`conv1d_linear`: GPT-2's ``Conv1D``, ``addmm(b, x.view(-1, k), W)``, as
  ``F.linear(x, Wᵀ, b)`` on the unflattened input (a transposed Linear site);
* :func:`matmul_linear`: ``x @ W.T``, ``x @ W`` and ``W @ x`` on a 2-D parameter as ``F.linear``;
* :func:`torch_level`: any other op as its torch-level function where one takes the same
  arguments (``F.gelu``, ``torch.softmax``, ``Tensor.view``, ...), so the curvature rules
  classify it; else the ATen op itself.
"""

from __future__ import annotations

import copy
import operator
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.nn.utils import parametrize

from ..rules.batchnorm import eval_batch_norm
from ..rules.embedding import functional as embedding_lookup

__all__ = ["owners", "owner_call", "view_of", "INPUT_ARG", "conv1d_linear", "matmul_linear", "torch_level"]

aten = torch.ops.aten

def owners(model: nn.Module) -> Tuple[Dict[str, List[Tuple[str, nn.Module]]], Dict[int, str]]:
    """Canonical parameter name -> ``(role, module)`` for every module holding it directly; and
    ``id(parameter)`` -> canonical name."""
    canonical: Dict[int, str] = {}
    for name, p in model.named_parameters():
        canonical.setdefault(id(p), name)
    owners: Dict[str, List[Tuple[str, nn.Module]]] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        for role, p in m.named_parameters(recurse=False):
            if id(p) in canonical:
                owners.setdefault(canonical[id(p)], []).append((role, m))
    return owners, canonical


# op -> position of the module's input among its arguments
INPUT_ARG = {aten.linear.default: 0, aten.conv1d.default: 0, aten.conv2d.default: 0, aten.conv3d.default: 0,
             aten.conv1d.padding: 0, aten.conv2d.padding: 0, aten.conv3d.padding: 0,
             aten.embedding.default: 1, aten.layer_norm.default: 0, aten.group_norm.default: 0,
             aten.batch_norm.default: 0}


def _param(arg, names) -> Optional[str]:
    return names.get(arg) if isinstance(arg, fx.Node) else None


def _arg(node: fx.Node, i: int, name: str, default=None):
    """Argument ``i`` (``name``) of an ATen call, with the schema's default where it was left out
    (``aten.conv2d(x, w, b, [4, 4])``: padding, dilation, groups)."""
    if len(node.args) > i:
        return node.args[i]
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    if schema is not None and i < len(schema.arguments) and schema.arguments[i].has_default_value():
        return schema.arguments[i].default_value
    return default


# (the ``padding`` overloads take ``padding="valid"``/``"same"`` as a string)
_CONV = {aten.conv1d.default: nn.Conv1d, aten.conv2d.default: nn.Conv2d, aten.conv3d.default: nn.Conv3d,
         aten.conv1d.padding: nn.Conv1d, aten.conv2d.padding: nn.Conv2d, aten.conv3d.padding: nn.Conv3d}


def _matches(node: fx.Node, m: nn.Module, names, canonical) -> bool:
    """Whether ``node`` computes exactly ``m``'s forward on its own parameters."""
    t = node.target
    weight = lambda i: _param(_arg(node, i, "weight"), names)  # noqa: E731
    own = lambda role: m._parameters.get(role)  # noqa: E731  (not getattr: fx's tracer would record it)
    if t is aten.linear.default and _family_type(m) is nn.Linear:
        return _same(_arg(node, 2, "bias"), own("bias"), names, canonical)
    if t in _CONV and _CONV[t] is _family_type(m):
        hyper = [_arg(node, i, k) for i, k in ((3, "stride"), (4, "padding"), (5, "dilation"), (6, "groups"))]
        mine = [list(m.stride), m.padding if isinstance(m.padding, str) else list(m.padding), list(m.dilation), m.groups]
        norm = lambda v: list(v) if isinstance(v, (list, tuple)) else v  # noqa: E731
        return (m.padding_mode == "zeros" and [norm(h) for h in hyper] == mine
                and _same(_arg(node, 2, "bias"), own("bias"), names, canonical))
    if t is aten.embedding.default and _family_type(m) is nn.Embedding:
        pad = _arg(node, 2, "padding_idx", -1)
        return (m.max_norm is None and not m.sparse and (m.padding_idx if m.padding_idx is not None else -1) == pad
                and bool(_arg(node, 3, "scale_grad_by_freq", False)) == m.scale_grad_by_freq and weight(0))
    if t is aten.layer_norm.default and _family_type(m) is nn.LayerNorm:
        return (list(_arg(node, 1, "normalized_shape")) == list(m.normalized_shape) and _arg(node, 4, "eps", 1e-5) == m.eps
                and _same(_arg(node, 3, "bias"), own("bias"), names, canonical))
    if t is aten.group_norm.default and _family_type(m) is nn.GroupNorm:
        return (_arg(node, 1, "num_groups") == m.num_groups and _arg(node, 4, "eps", 1e-5) == m.eps
                and _same(_arg(node, 3, "bias"), own("bias"), names, canonical))
    if t is aten.batch_norm.default and _family_type(m) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
        return (_arg(node, 7, "eps") == m.eps and bool(_arg(node, 5, "training")) == (m.training or m._buffers.get("running_mean") is None)
                and _same(_arg(node, 2, "bias"), own("bias"), names, canonical))
    return False


def _same(arg, p: Optional[Tensor], names, canonical) -> bool:
    """An optional parameter argument is the module's own (both absent, or the same parameter)."""
    if p is None:
        return arg is None
    return isinstance(arg, fx.Node) and names.get(arg) == canonical.get(id(p))


_WEIGHT_ARG = {aten.linear.default: 1, aten.conv1d.default: 1, aten.conv2d.default: 1, aten.conv3d.default: 1,
               aten.conv1d.padding: 1, aten.conv2d.padding: 1, aten.conv3d.padding: 1,
               aten.embedding.default: 0, aten.layer_norm.default: 2, aten.group_norm.default: 2,
               aten.batch_norm.default: 1}


_FAMILY_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.LayerNorm, nn.GroupNorm,
                 nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _family_type(m: nn.Module) -> Optional[type]:
    """The torch.nn class among :data:`_FAMILY_TYPES` that ``m`` is an instance of (the class
    itself, or a subclass with its own ``forward``: timm's ``LayerNorm2d``), else ``None``."""
    return next((t for t in type(m).__mro__ if t in _FAMILY_TYPES), None)


def view_of(m: nn.Module) -> Optional[nn.Module]:
    """For a subclass of a family's class with its own ``forward`` (timm's ``LayerNorm2d``:
    ``permute``, ``layer_norm``, ``permute``; ``BatchNormAct2d``), whose ops the ATen graph
    spells out: a module *of the family's class* sharing ``m``'s parameter and buffer slots (a
    shallow copy, its class set to the family's: ``m`` is not changed), run by the family's rule
    where an op is exactly that class's forward, without ``m``'s submodules. ``None`` for the class itself."""
    base = _family_type(m)
    if base is None or type(m) is base or parametrize.is_parametrized(m):
        # (a parametrized layer's weight is a function of original0/original1: its op reads a
        # computed weight, never the module's own parameter, so it is a functional site; and
        # torch forbids copying such a module)
        return None
    view = copy.copy(m)  # (shares m's _parameters and _buffers dicts: buffers swapped in are seen)
    view.__class__ = base
    # The family's class has no submodules: ``m``'s (Inkling's embedding norm) run as their own ops, and
    # their parameters are not the view's (its layer's roles are what the family's rule reads).
    view._modules = {}
    # Nor its further parameters (T5Gemma2's embedding writes an extra ``eoi_embedding`` row in
    # ``forward``): their uses are ops of their own in the ATen graph (functional sites). The
    # family's rule reads its roles' values as arguments, never from these slots.
    if any(k not in _ROLES for k in m._parameters):
        view._parameters = {k: v for k, v in m._parameters.items() if k in _ROLES}
    return view


_ROLES = ("weight", "bias")  # the parameters of every class of _FAMILY_TYPES


def owner_call(node: fx.Node, names, owners, canonical) -> Optional[nn.Module]:
    """The module whose forward ``node`` is, called on its own parameters (else ``None``); for a
    subclass with its own forward, its :func:`view_of` (see ``views`` in :mod:`curvlib._trace.aten`)."""
    if node.target not in _WEIGHT_ARG:
        return None
    weight = _param(_arg(node, _WEIGHT_ARG[node.target], "weight"), names)
    if weight is None:
        return None
    for role, m in owners.get(weight, []):
        if role == "weight" and _matches(node, m, names, canonical):
            return m
    return None


def conv1d_linear(node: fx.Node, names, env) -> Optional[fx.Proxy]:
    """``addmm(b, x.view(-1, k), W)`` on parameters ``b [m]``, ``W [k, m]`` whose only use is a view
    (GPT-2's ``Conv1D``): ``F.linear(x, Wᵀ, b)`` on ``x`` itself, rows per sample."""
    if node.target is not aten.addmm.default or len(node.args) != 3 or node.kwargs:
        return None
    bias, flat, weight = node.args
    if _param(bias, names) is None or _param(weight, names) is None or not isinstance(flat, fx.Node):
        return None
    if flat.target not in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return None
    if not all(u.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default) for u in node.users):
        return None
    x = env[flat.args[0]]
    return F.linear(x, env[weight].t(), env[bias])


_TRANSPOSES = (aten.t.default, aten.numpy_T.default)


def _weight_operand(arg, names) -> Optional[Tuple[fx.Node, bool]]:
    """``(W's placeholder, transposed)`` for a 2-D parameter ``W`` or ``W.t()`` / ``W.T``."""
    if not isinstance(arg, fx.Node):
        return None
    transposed = arg.target in _TRANSPOSES
    w = arg.args[0] if transposed else arg
    val = getattr(w, "meta", {}).get("val")
    if _param(w, names) is None or not isinstance(val, Tensor) or val.dim() != 2:
        return None
    return w, transposed


def _ndim(arg) -> int:
    val = getattr(arg, "meta", {}).get("val") if isinstance(arg, fx.Node) else None
    return val.dim() if isinstance(val, Tensor) else -1


def matmul_linear(node: fx.Node, names, env) -> Optional[fx.Proxy]:
    """``matmul`` of an input-dependent tensor and a 2-D parameter ``W [O, I]``, as ``F.linear``
    (a Linear site with two Kronecker factors): ``x @ W.T`` is ``F.linear(x, W)``, ``x @ W``
    (``W`` stored ``[I, O]``) ``F.linear(x, Wᵀ)``, and ``W @ x`` on ``x [N, ..., I, S]`` (features
    in dim -2, FalconMamba's ``dt_proj.weight @ h``) ``F.linear(xᵀ, W)ᵀ`` over the last two dims:
    the same linear map, applied at every position."""
    if node.target is not aten.matmul.default or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    right, left = _weight_operand(b, names), _weight_operand(a, names)
    if right is not None and left is None and _ndim(a) >= 2:
        (w, transposed), x = right, env[a]
        return F.linear(x, env[w] if transposed else env[w].t())
    if left is not None and right is None and _ndim(b) >= 3:
        (w, transposed), x = left, env[b]
        return F.linear(x.transpose(-1, -2), env[w].t() if transposed else env[w]).transpose(-1, -2)
    return None


def linear_computed_bias(node: fx.Node, names, env) -> Optional[fx.Proxy]:
    """``F.linear(x, W, b)`` on a parameter ``W`` whose bias is computed in ``forward`` (BEiT's
    ``cat((q_bias, zeros, v_bias))``), as ``F.linear(x, W) + b``: the same values, with ``W`` a
    Linear site (two Kronecker factors) and the bias's parameters generic uses of the sum."""
    if node.target is not aten.linear.default or len(node.args) != 3 or node.kwargs:
        return None
    x, weight, bias = node.args
    if _weight_operand(weight, names) != (weight, False) or not isinstance(bias, fx.Node):
        return None
    if _param(bias, names) is not None:
        return None
    return F.linear(env[x], env[weight]) + env[bias]


# ----------------------------------------------------------------------------- torch-level ops


def _getitem_slice(x, dim=0, start=None, end=None, step=1):
    return x[(slice(None),) * (dim % max(x.dim(), 1) if isinstance(x, Tensor) else dim) + (slice(start, end, step),)]


_SAME_ARGS: Dict[str, Callable] = {
    **{n: getattr(torch, n) for n in (
        "add", "sub", "mul", "div", "neg", "cat", "stack", "sum", "mean", "softmax", "log_softmax", "split",
        "chunk", "unbind", "transpose", "permute", "squeeze", "unsqueeze", "flatten", "narrow", "select",
        "matmul", "bmm", "mm", "addmm", "baddbmm", "pow", "rsqrt", "sqrt", "where", "clamp", "relu", "tanh",
        "sigmoid", "exp", "log", "sin", "cos", "erf", "abs", "flip", "roll", "movedim", "var", "cumsum",
        "masked_fill", "repeat_interleave", "einsum", "amax", "maximum", "minimum", "log1p", "reciprocal")},
    **{n: getattr(F, n) for n in ("linear", "conv1d", "conv2d", "conv3d", "gelu", "silu", "mish", "hardswish",
                                  "hardsigmoid", "hardtanh", "softplus", "leaky_relu", "dropout", "max_pool1d",
                                  "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
                                  "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
                                  "scaled_dot_product_attention", "pad")},
}
_METHODS = {"view", "reshape", "expand", "contiguous", "t", "clone", "repeat", "unflatten", "expand_as",
            "view_as", "type_as", "detach", "to", "_unsafe_view"}
# in-place activations without a tensor method (timm's act(x, inplace=True) at the ATen level:
# ``aten.silu_(x)``): the functional with ``inplace=True``, whose arguments are the op's
_INPLACE_FUNCTIONS: Dict[str, Callable] = {
    n: getattr(F, n) for n in ("silu", "mish", "hardswish", "hardsigmoid", "hardtanh", "leaky_relu", "relu6", "selu",
                               "celu")}
_IDENTITY = {"alias", "lift_fresh_copy", "detach_"}
_SKIPPED = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size"}


def torch_level(target, args, kwargs):
    """Record ``target(*args, **kwargs)`` on proxies as its torch-level function where one takes
    the same arguments (see :data:`_SAME_ARGS`), else as the ATen op itself."""
    if target is operator.getitem:
        return args[0][args[1]]
    name = target.__name__.split(".")[0] if isinstance(target, torch._ops.OpOverload) else ""
    special = _SPECIAL.get(name)
    if name == "to":
        args, kwargs = _named(target, args, kwargs)
    if special is not None:
        return special(*args, **kwargs)
    if name in _SAME_ARGS:
        return _SAME_ARGS[name](*args, **kwargs)
    if name in _METHODS:
        method = "view" if name == "_unsafe_view" else name
        return getattr(args[0], method)(*args[1:], **kwargs)
    if name in _IDENTITY:
        return args[0]
    if name in _SKIPPED:
        return None
    if name.endswith("_") and not name.startswith("_") and hasattr(Tensor, name):
        # an in-place op (timm's act(x, inplace=True)): the tensor method, which curvlib's graph
        # passes know as in-place (probes, the value kept for residuals)
        return getattr(args[0], name)(*args[1:], **kwargs)
    if name.endswith("_") and name[:-1] in _INPLACE_FUNCTIONS:
        # (else the ATen op stays opaque: neither element-wise nor known as in-place)
        return _INPLACE_FUNCTIONS[name[:-1]](*args, **kwargs, inplace=True)
    return target(*args, **kwargs)


def _layer_norm(x, shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    return F.layer_norm(x, shape, weight, bias, eps)


def _group_norm(x, groups, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    return F.group_norm(x, groups, weight, bias, eps)


def _batch_norm(x, weight, bias, mean, var, training, momentum, eps, *_cudnn_enabled):
    """``aten::batch_norm``, with that op's own signature (the replay passes its arguments as the
    ATen graph holds them; the last, ``cudnn_enabled``, chooses a kernel and is not read)."""
    if not training and mean is not None and var is not None:  # (torch's backward: rules.batchnorm.eval_batch_norm)
        return eval_batch_norm(x, mean, var, weight, bias, eps)
    return F.batch_norm(x, mean, var, weight, bias, training, momentum, eps)


def _embedding(weight, ids, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return embedding_lookup(ids, weight, None if padding_idx == -1 else padding_idx, None, 2.0, scale_grad_by_freq, sparse)


def _index(x, indices):
    return x[tuple(slice(None) if i is None else i for i in indices)]


def _constant_pad(x, pad, value=0.0):
    return F.pad(x, pad, "constant", value)


def _to(x, *args, **kwargs):
    kwargs.pop("layout", None)
    kwargs.pop("pin_memory", None)
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    other = kwargs.pop("other", None)
    return x.to(other, *args, **kwargs) if other is not None else x.to(*args, **kwargs)


def _named(target, args, kwargs):
    """``(args[:1], kwargs)``: the op's arguments after the first by their schema names
    (``aten.to.dtype(x, float64, False, True, None)``: ``Tensor.to`` takes ``memory_format``
    only as a keyword, and no overload takes all of them positionally)."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return args, kwargs
    names = [a.name for a in schema.arguments]
    return args[:1], {**dict(zip(names[1:], args[1:])), **kwargs}


_SPECIAL: Dict[str, Callable] = {
    "layer_norm": _layer_norm, "group_norm": _group_norm, "batch_norm": _batch_norm, "embedding": _embedding,
    "slice": _getitem_slice, "index": _index, "constant_pad_nd": _constant_pad, "to": _to,
}
