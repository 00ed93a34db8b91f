"""A node's own parameters whose rows act separately: the Hessian diagonal of their block
without the dense block (weight-standardised convolutions: timm's ``ScaledStdConv2d``, NFNets).

A functional site ``z = conv(x, h(W, γ), b)`` whose weight chain ``h`` is nonlinear has a
dense residual over ``(θ, x)`` (:mod:`curvlib._hessian.residuals`); each parameter none of
its inputs depends on (``free``) keeps only its own block ``R_pp = ∇²_p (gᵀ z)`` per sample,
``|p| × |p|``: for NFNet's convolutions tens of thousands squared. When output channel ``o``
of the node depends on row ``o`` of the parameters alone (the chain standardises each output
channel's weight on its own), ``R_pp`` is block-diagonal over the rows of ``p``, and its
diagonal comes from ``K = |p| / rows`` Hessian-vector products per sample, the tangent of
product ``k`` one-hot at entry ``k`` of *every* row (a row's block sees only its own one-hot).

:func:`separable_rows` reads that structure off the chain (:data:`_ELEMENTWISE` ops,
reshapes that keep the row axis whole, reductions over other axes, ``batch_norm`` over the
row axis as channels, and a final ``conv``/``linear`` whose output channels are the weight's
rows); anything else leaves the block dense. Only the Hessian diagonal reads the block then
(:func:`rows_columns`: one signed column ``√(diag R_pp)±`` per sign, exact for the diagonal,
which sums the squares of a free parameter's columns); the eigenvalue-modified operator
(PCHMP) forms it dense, refused above
:attr:`~curvlib._core.settings.Settings.max_dense_residual_entries`.
"""

from __future__ import annotations

import math
from dataclasses import replace
import operator
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, fx
from torch.func import grad, jvp, vmap

from .._core import settings
from .._core.errors import CurvatureError
from .._core.sync import LOCK
from ..rules import functional
from ..rules.generic import map_samples
from .smooth import diag_pair, flows

__all__ = ["separable_rows", "linear_in_inputs", "rows_sets", "check_dense_size"]

#: Tangent entries per sample in one batch of Hessian-vector products (:func:`rows_columns`).
_HVP_ENTRIES = 2**22

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


def _front(t: Tensor, dim: int) -> Tensor:
    return t if dim == 0 else t.movedim(dim, 0)


def _back(t: Tensor, dim: int) -> Tensor:
    return t if dim == 0 else t.movedim(0, dim)


def rows_sets(res, g: Tensor):
    """``(column sets of the separable parameters, the residual left for the dense path or None)``:
    ``meta["rows"]`` (:func:`separable_rows`) by :func:`rows_columns`; the rest dense, unless
    nothing is left (``meta["zero_inputs"]``: the input block is zero, :func:`linear_in_inputs`)."""
    rows = tuple(res.meta.get("rows", ()))
    sets = [c for name in rows for c in rows_columns(res, g, name)]
    params = {k: v for k, v in res.params.items() if k not in rows}
    if not params and (res.meta.get("zero_inputs") or not res.inputs):
        return sets, None
    rest = replace(res, params=params, free=tuple(k for k in res.free if k not in rows),
                   meta={**res.meta, "rows": (), "zero_inputs": False})
    return sets, rest


def rows_columns(res, g: Tensor, name: str) -> list:
    """``[(+1, {}, {name: √d₊ [1, N, *p]}), (-1, {}, {name: √d₋})]`` with ``d = diag R_pp`` per
    sample, from ``K`` Hessian-vector products (module doc): exact for the Hessian diagonal,
    which reads a free parameter's columns only through the sum of their squares."""
    p = res.params[name]
    k = p[0].numel()
    colors = torch.eye(k, dtype=p.dtype, device=p.device).reshape((k, 1) + tuple(p.shape[1:])).expand((k,) + tuple(p.shape))
    gc = _front(g, res.out_dim)
    xs = [_front(a, d) for a, d in zip(res.inputs, res.in_dims)]
    fixed, fixed_dims = list(res.meta.get("fixed", ())), tuple(res.meta.get("fixed_dims", ()))
    fixed_dims = fixed_dims + (None,) * (len(fixed) - len(fixed_dims))

    def diagonal(xs_n, g_n, fixed_n):
        # one sample, batch of one in each input's own batch dimension
        inputs = [_back(x.unsqueeze(0), d) for x, d in zip(xs_n, res.in_dims)]
        ids = [f if d is None else f.unsqueeze(d) for f, d in zip(fixed_n, fixed_dims)]

        def fn(q):
            return (_front(res.phi({name: q}, *inputs, fixed=ids), res.out_dim).squeeze(0) * g_n).sum()

        out = 0
        for c in torch.split(colors, max(1, _HVP_ENTRIES // max(p.numel(), 1))):  # (memory: a chunk of K)
            hvp = vmap(lambda t: jvp(grad(fn), (p,), (t,))[1])(c)  # [C, *p]: entry k of every row's column k
            out = out + (hvp * c).sum(0)
        return out

    with LOCK:  # forward-over-reverse: forward-mode AD state is process-wide
        d = map_samples(diagonal, (0, 0, list(fixed_dims)))(xs, gc, fixed)  # [N, *p]
    plus, minus = diag_pair(d) if flows(d) else (d.clamp(min=0).sqrt(), (-d).clamp(min=0).sqrt())
    return [(1.0, {}, {name: plus.unsqueeze(0)}), (-1.0, {}, {name: minus.unsqueeze(0)})]
