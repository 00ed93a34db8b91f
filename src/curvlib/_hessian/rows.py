"""A node's own parameters whose rows act separately, read off its chain; dense residual sizes.

A functional site ``z = conv(x, h(W, γ), b)`` whose weight chain ``h`` is nonlinear has a
dense residual over ``(θ, x)`` (:mod:`curvlib._hessian.residuals`); each parameter none of
its inputs depends on (``free``) keeps only its own block ``R_pp = ∇²_p (gᵀ z)`` per sample,
whose diagonal comes from Hessian-vector products (:mod:`curvlib._hessian.free_blocks`).
When output channel ``o`` of the node depends on row ``o`` of the parameters alone (the
chain standardises each output channel's weight on its own: timm's ``ScaledStdConv2d``,
NFNets), ``R_pp`` is block-diagonal over the rows of ``p``, and ``|p| / rows`` products per
sample give the diagonal instead of ``|p|``.

:func:`separable_rows` reads that structure off the chain (:data:`_ELEMENTWISE` ops,
reshapes that keep the row axis whole, reductions over other axes, ``batch_norm`` over the
row axis as channels, and a final ``conv``/``linear`` whose output channels are the weight's
rows); elsewhere the products themselves probe it. :func:`check_dense_size` refuses a dense
block above :attr:`~curvlib._core.settings.Settings.max_dense_residual_entries`.
"""

from __future__ import annotations

import math
import operator
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, fx

from .._core import settings
from .._core.errors import CurvatureError
from ..rules import functional

__all__ = ["separable_rows", "linear_in_inputs", "check_dense_size"]

_ARITHMETIC = ("add", "sub", "mul", "div", "truediv", "neg", "pow", "sqrt", "rsqrt", "reciprocal", "abs", "exp")
_ELEMENTWISE = frozenset(_ARITHMETIC) | {"__add__", "__sub__", "__mul__", "__truediv__", "__radd__", "__rmul__"}
_RESHAPES = frozenset({"reshape", "view", "reshape_as", "view_as", "flatten"})
_REDUCTIONS = frozenset({"mean", "var", "std", "sum", "amax", "amin"})
_OUTPUT_OPS = {F.conv1d: 1, F.conv2d: 1, F.conv3d: 1, torch.conv1d: 1, torch.conv2d: 1, torch.conv3d: 1, F.linear: -1}
_BATCH_NORMS = (F.batch_norm, torch.batch_norm)


def _name(node: fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    target = node.target
    if target in (operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow):
        return target.__name__
    name = getattr(target, "__name__", "")
    return name.split(".")[0] if isinstance(target, torch._ops.OpOverload) else name


def separable_rows(program, node: fx.Node, env: Dict, params: Dict[str, Tensor]) -> frozenset:
    """The node's parameters (canonical names) whose rows act on output channels of their own
    (module doc), when all its parameters do; else an empty set."""
    use = program.functional.get(node)
    if use is None or use.linear is not None or not use.params or _OUTPUT_OPS.get(node.target) is None:
        return frozenset()
    values: Dict[fx.Node, object] = {a: env[a] for a in use.fixed}
    functional.run_nodes(use.chain, values, program.root, program.param_names, params)
    rows = {params[k].shape[0] if params[k].dim() else None for k in use.params}
    if len(rows) != 1 or None in rows:
        return frozenset()
    o = rows.pop()
    axes: Dict[fx.Node, int] = {}
    for c in use.chain:
        if c.op == "get_attr" and isinstance(values[c], Tensor) and _param_name(program, values, c) in use.params:
            axes[c] = 0
            continue
        tracked = [a for a in c.all_input_nodes if a in axes]
        if not tracked:
            continue  # a constant of the parameters
        axis = _axis(c, tracked, axes, values, o)
        if axis is None:
            return frozenset()
        axes[c] = axis
    return frozenset(use.params) if _output_rows(node, use, axes, values) else frozenset()


def linear_in_inputs(program, node: fx.Node) -> bool:
    """Whether the node is a functional ``conv``/``linear`` whose only input-dependent argument
    is its input ``x`` (its weight and bias computed from parameters): linear in ``x``, so its
    residual's input block is zero."""
    use = program.functional.get(node)
    return (use is not None and _OUTPUT_OPS.get(node.target) is not None and len(use.inputs) == 1
            and bool(node.args) and use.inputs[0] is node.args[0])


def _param_name(program, values, c: fx.Node) -> Optional[str]:
    target = program.root
    for part in c.target.split("."):
        target = getattr(target, part)
    return program.param_names.get(id(target))


def _axis(c: fx.Node, tracked: List[fx.Node], axes, values, o: int) -> Optional[int]:
    """The row axis of chain node ``c``'s value, or ``None`` where it mixes rows."""
    out = values[c]
    if not isinstance(out, Tensor):
        return None
    name = _name(c)
    if name in _ELEMENTWISE:
        found = {axes[a] + out.dim() - values[a].dim() for a in tracked}
        axis = found.pop() if len(found) == 1 else None
    elif name in _RESHAPES and tracked == [c.all_input_nodes[0]] or (name in ("reshape_as", "view_as")
                                                                      and c.all_input_nodes[0] in tracked):
        a = c.all_input_nodes[0]
        prefix = math.prod(values[a].shape[: axes[a]])
        axis = next((j for j in range(out.dim()) if math.prod(out.shape[:j]) == prefix and out.shape[j] == o), None)
    elif name in _REDUCTIONS and len(tracked) == 1 and c.all_input_nodes[0] is tracked[0]:
        axis = _reduced_axis(c, values[tracked[0]], axes[tracked[0]], out)
    elif c.target in _BATCH_NORMS:
        axis = _batch_norm_axis(c, axes)
    else:
        axis = None
    return axis if axis is not None and 0 <= axis < out.dim() and out.shape[axis] == o else None


def _reduced_axis(c: fx.Node, a: Tensor, axis: int, out: Tensor) -> Optional[int]:
    dim = c.args[1] if len(c.args) > 1 else c.kwargs.get("dim")
    if dim is None or isinstance(dim, fx.Node):
        return None
    dims = {d % a.dim() for d in (dim if isinstance(dim, (tuple, list)) else (dim,))}
    if axis in dims:
        return None
    return axis if out.dim() == a.dim() else axis - sum(d < axis for d in dims)


def _batch_norm_axis(c: fx.Node, axes) -> Optional[int]:
    """``batch_norm(input, running_mean, running_var, weight, bias, ...)``: channels (dim 1) are rows."""
    names = ("input", "running_mean", "running_var", "weight", "bias")
    args = dict(zip(names, c.args))
    args.update({k: v for k, v in c.kwargs.items() if k in names})
    ok = all(axes.get(v, 1 if k == "input" else 0) == (1 if k == "input" else 0)
             for k, v in args.items() if isinstance(v, fx.Node))
    return 1 if ok and args.get("input") in axes else None


def _output_rows(node: fx.Node, use, axes, values) -> bool:
    """The final op: its weight's and bias's rows are its output channels."""
    if node.kwargs.get("transposed"):
        return False
    weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if any(a in axes for a in node.args[:1]) or axes.get(weight) != 0:
        return False
    return not isinstance(bias, fx.Node) or axes.get(bias, 0) == 0


def check_dense_size(where: str, n: int, d: int, why: str = "") -> None:
    """Refuse a dense per-sample residual ``[N, d, d]`` over
    :attr:`~curvlib._core.settings.Settings.max_dense_residual_entries` entries."""
    limit = settings.current().max_dense_residual_entries
    if n * d * d > limit:
        raise CurvatureError(
            f"The Hessian extensions need the second derivative of graph node {where}, "
            f"a dense {d}x{d} matrix per sample here (N={n}){why}, which is too large "
            f"(limit: N·d² ≤ {limit}). Use the GGN extensions (DiagGGNExact, "
            "BatchDiagGGNExact) or HMP (exact Hessian-vector products) for this model."
        )
