"""Functional parameter uses: an op in ``forward`` that reads a parameter directly.

``F.linear(h, self.enc.weight.t())`` (a tied decoder) or ``x @ self.w`` uses
a parameter outside any parametrized module. The traced graph shows it as a
node that depends on the model input *and* on parameters (through a chain
of parameter-only nodes such as ``.t()``). Such a node is a site of its own:

    z = op(inputs, h(θ)),      ∂ℓ_n/∂θ = (∂ op(inputs_n, h(θ))/∂θ)ᵀ g_n,

computed per sample with :func:`torch.func.vjp` on the node run on sample
``n`` alone (batch of one), vectorised with :func:`torch.func.vmap`, as the
generic module rule does. The parameter-only chain ``h`` is re-evaluated
from the parameter tensors, so tied uses (the encoder's weight in the
decoder) get their own exact per-sample contribution, summed with the
module's before any square is taken.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import operator
from operator import attrgetter
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from torch import Tensor, fx, nn
from torch.func import vjp, vmap

from .._core.aliasing import VIEWS, op_name, view_base
from .masked_writes import masked_write
from .._core.batch_layout import from_batch_first
from .._core.site import Recorder, RoleTensors, Rule, Site, sample_layout
from .._core.tensors import dense, is_wrapped
from ._conv_correlation import Correlation
from ._conv_unfold import unfold
from .conv import per_sample_weight_grad
from .linear import LINEAR, LINEAR_TRANSPOSED


@dataclass(frozen=True)
class FunctionalUse:
    """How to recompute one graph node from parameters and its input-dependent arguments.

    Attributes:
        node: the node (depends on the model input and on parameters).
        chain: its parameter-only ancestors, in graph order (``get_attr`` and ops on them).
        params: canonical names of the parameters the chain reads.
        inputs: the node's input-dependent argument nodes.
        linear: for ``F.linear(x, W, b)`` with ``W`` (and ``b``) parameters read as they are:
            role (``"weight"``, ``"bias"``) -> canonical name; the node is then a Linear site
            (:mod:`curvlib.rules.linear`: per-sample outer products, Kronecker factors), not
            a generic one.
        affine: the node is affine in its inputs and parameters jointly (a bias added, a
            parameter concatenated): no second derivative of its own.
    """

    node: fx.Node
    chain: Tuple[fx.Node, ...]
    params: Tuple[str, ...]
    inputs: Tuple[fx.Node, ...]
    linear: Optional[Dict[str, str]] = None  # F.linear on parameters: role -> canonical name
    affine: bool = False  # affine in the parameters and the inputs together (see :func:`is_affine`)
    fixed: Tuple[fx.Node, ...] = ()  # chain nodes reading no parameter: their values are taken as they are
    transposed: bool = False  # ``F.linear(x, W.t(), b)``: the weight parameter is stored ``[in, out]``



def evaluate(use: FunctionalUse, root: nn.Module, param_names: Dict[int, str],
             tensors: Dict[str, Tensor], inputs: Sequence[Tensor], constants: Optional[Dict] = None):
    """The node's value with parameters ``tensors`` (canonical name -> tensor) and ``inputs``;
    ``constants``: values of chain nodes that read the model input's shape only."""
    env: Dict[fx.Node, object] = dict(constants or {})
    env.update(zip(use.inputs, inputs))
    run_nodes(use.chain + (use.node,), env, root, param_names, tensors)
    return env[use.node]


#: ``x += y`` and the other augmented assignments: they write into their first argument
INPLACE_OPERATORS = frozenset(getattr(operator, name) for name in (
    "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul",
    "iand", "ior", "ixor", "ilshift", "irshift"))


def _overwrites_first(node: fx.Node) -> bool:
    """``x.add_(y)``, ``x += y``, ``torch.ops.aten.add_``: the node writes into its first argument."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    name = getattr(node.target, "__name__", "").split(".")[0]
    return node.target in INPLACE_OPERATORS or (name.endswith("_") and not name.endswith("__")
                                                 and not name.startswith("_"))


def run_nodes(nodes: Sequence[fx.Node], env: Dict, root: nn.Module, param_names: Optional[Dict[int, str]] = None,
              tensors: Optional[Dict[str, Tensor]] = None) -> Dict:
    """Run ``nodes`` (in graph order) into ``env``, skipping those it holds; parameters read by
    ``get_attr`` or a ``call_module`` are taken from ``tensors`` (canonical name -> tensor) when
    given, as they are otherwise. In-place writes run on copies (:func:`_write_into_copy`)."""
    load = lambda a: fx.node.map_arg(a, lambda n: env[n])  # noqa: E731
    for node in nodes:
        if node in env:
            continue
        if node.op == "get_attr":
            value = attrgetter(node.target)(root)
            if tensors is not None and isinstance(value, nn.Parameter):
                value = tensors[param_names[id(value)]]
            env[node] = value
        elif node.op in ("call_function", "call_method"):
            written = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
            if written is not None and isinstance(env.get(written), Tensor) \
                    and (_overwrites_first(node) or node.target is operator.setitem):
                _write_into_copy(node, written, env, load)
            else:
                env[node] = _call(node, load(node.args), load(node.kwargs))
        else:  # call_module on parameters or constants (wpe(arange(T))), with the given parameters
            module = attrgetter(node.target)(root)
            own = {k: tensors[param_names[id(p)]] for k, p in module.named_parameters()
                   if tensors is not None and param_names.get(id(p)) in tensors}
            env[node] = torch.func.functional_call(module, own, tuple(load(node.args)), load(node.kwargs))
    return env


def _call(node: fx.Node, args, kwargs):
    masked = masked_write(node, args, kwargs)
    if masked is not None:
        return masked
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    return getattr(args[0], node.target)(*args[1:], **kwargs)


def _write_into_copy(node: fx.Node, written: fx.Node, env: Dict, load) -> None:
    """Run the in-place write ``node`` into ``written`` (``b[2:4].zero_()``, ``x += y``,
    ``m[:, 0] = v``) without touching the tensor ``env`` holds: that may be a parameter, a
    buffer of the model or a tensor captured from outside a torch.func transform (which
    refuses in-place updates). The memory written (the base of ``written``'s views) is
    copied, the views read so far are taken again of the copy, the write runs on it in
    place, and later nodes read the copy, as in eager they read the written memory."""
    base = view_base(written)
    if base not in env:
        base = written
    env[base] = env[base].clone()
    stack = [base]  # the views of the base computed so far, each taken again after the one it views
    while stack:
        m = stack.pop()
        for u in m.users:
            if u in env and u.op in ("call_function", "call_method") and u.args and u.args[0] is m \
                    and op_name(u) in VIEWS:
                env[u] = _call(u, load(u.args), load(u.kwargs))
                stack.append(u)
    result = _call(node, load(node.args), load(node.kwargs))
    env[node] = env[written] if node.target is operator.setitem else result


def _of_free_parameters(site: Site, roles: Sequence[str], inputs: Sequence[Tensor]):
    """``(f, free)``: the node as a function ``f(free)`` of the parameters in ``roles`` (the others
    fixed at their values), on ``inputs``."""
    use, root, param_names = site.meta["use"], site.meta["root"], site.meta["param_names"]
    params = {k[6:]: v for k, v in site.saved.items() if k.startswith("param:")}
    free = {r: p for r, p in params.items() if r in set(roles)}
    fixed = {r: p for r, p in params.items() if r not in free}

    def f(free_params):
        return evaluate(use, root, param_names, {**fixed, **free_params}, inputs, site.meta.get("constants"))

    return f, free


def grad_batch(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    if site.meta.get("batch_sized_chain"):
        return _grad_batch_masked(site, g, roles)
    conv = _conv_grad_batch(site, g, roles)
    if conv is not None:
        return conv
    keys = [f"in{i}" for i in range(len(site.meta["use"].inputs))]
    own, out_dim = sample_layout(site, {k: site.saved[k] for k in keys}, g.shape[0])
    own = [own[k] for k in keys]  # each input's batch dim in the op's own layout (saved: batch first)

    def one_sample(inputs_n: List[Tensor], g_n: Tensor) -> Dict[str, Tensor]:
        f, free = _of_free_parameters(site, roles, [x if d is None else x.unsqueeze(d) for x, d in zip(inputs_n, own)])
        return vjp(f, free)[1](g_n.unsqueeze(out_dim))[0]

    in_dims = [None if d is None else 0 for d in own]
    # (dense: torch's batched transposed-convolution backward refuses odd strides of size-one dims)
    return vmap(one_sample, in_dims=(in_dims, 0))([dense(site.saved[k]) for k in keys], dense(g))


_CONV_DIMS = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3, F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
_CONV_ARGS = (("input", None), ("weight", None), ("bias", None), ("stride", 1), ("padding", 0), ("dilation", 1),
              ("groups", 1))


def _conv_grad_batch(site: Site, g: Tensor, roles: Sequence[str]) -> Optional[RoleTensors]:
    """A convolution of the input with a weight computed from parameters (timm's weight-
    standardised ``ScaledStdConv2d``: ``conv(x, h(W, γ), b)``): every sample's gradient of the
    computed weight ``Ŵ`` from the convolution rule's kernels (``R_n = g_n ⋆ x_n``, one call
    for the batch), then pulled back through the parameter chain, ``∂ℓ_n/∂θ = h'(θ)ᵀ R_n``
    (vmapped over samples), instead of a vector-Jacobian product of the whole convolution per
    sample. ``None`` where this does not apply (then the generic way runs)."""
    use, dims = site.meta["use"], _CONV_DIMS.get(site.meta["use"].node.target)
    if dims is None or len(use.inputs) != 1 or is_wrapped(g):
        return None
    args = {name: (use.node.args[k] if k < len(use.node.args) else use.node.kwargs.get(name, default))
            for k, (name, default) in enumerate(_CONV_ARGS)}
    computed = [a for a in (args["weight"], args["bias"]) if a is not None]
    x = site.saved["in0"]
    batch_apart = site.meta.get("in_dims", {}).get("in0", 0) != 0 or site.meta.get("out_dim")  # (conv: both 0)
    if (args["input"] is not use.inputs[0] or batch_apart or x.shape[0] != g.shape[0]
            or not all(_static_ints(args[k]) for k in ("stride", "padding", "dilation", "groups"))
            or not all(isinstance(a, fx.Node) and a in use.chain for a in computed)):
        return None  # (a padding computed in forward, or "same": the generic way)
    per_dim = lambda v: (v,) * dims if isinstance(v, int) else tuple(v)  # noqa: E731
    stride, padding, dilation = per_dim(args["stride"]), per_dim(args["padding"]), per_dim(args["dilation"])
    f, free = _chain_of_free_parameters(site, roles, computed)
    weight_and_bias, pull = vjp(f, free)
    kernel = tuple(weight_and_bias[0].shape[2:])
    pad = [p for q in reversed(padding) for p in (q, q)]
    corr = Correlation(x, g, kernel, stride, dilation, args["groups"], padding if any(padding) else (),
                       lambda: unfold(F.pad(x, pad), kernel, stride, dilation), columns="g")
    grads = (per_sample_weight_grad(corr),) + ((g.flatten(2).sum(2),) if len(computed) == 2 else ())
    return vmap(lambda *per_sample: pull(per_sample)[0])(*grads)


def _static_ints(value) -> bool:
    """An int or a tuple/list of ints written in the graph (not a value computed in forward)."""
    return isinstance(value, int) or (isinstance(value, (tuple, list)) and all(isinstance(v, int) for v in value))


def _chain_of_free_parameters(site: Site, roles: Sequence[str], nodes: Sequence[fx.Node]):
    """``(f, free)``: the values of the parameter-only chain's ``nodes`` as a function ``f(free)`` of
    the parameters in ``roles`` (the others fixed at their values)."""
    use, root, param_names = site.meta["use"], site.meta["root"], site.meta["param_names"]
    params = {k[6:]: v for k, v in site.saved.items() if k.startswith("param:")}
    free = {r: p for r, p in params.items() if r in set(roles)}
    fixed = {r: p for r, p in params.items() if r not in free}

    def f(free_params):
        env: Dict[fx.Node, object] = dict(site.meta.get("constants") or {})
        run_nodes(use.chain, env, root, param_names, {**fixed, **free_params})
        return tuple(env[n] for n in nodes)

    return f, free


def _grad_batch_masked(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """Individual gradients when the parameter-only chain itself has the batch size (a class token
    ``cls.expand(N, -1, -1)``, token-type ids expanded to ``[N, T]``): the node cannot run on one
    sample, so each sample's gradient is the full node's vector-Jacobian product with the output
    gradient of that sample alone, ``g_n = vjp(op)(g · e_n)`` (N products of the whole node)."""
    n = g.shape[0]
    keys = [f"in{i}" for i in range(len(site.meta["use"].inputs))]
    own, out_dim = sample_layout(site, {k: site.saved[k] for k in keys}, n)
    # the whole op runs in its own layout: inputs and g moved back from batch first
    inputs = [dense(site.saved[k] if own[k] is None else from_batch_first(site.saved[k], own[k])) for k in keys]
    f, free = _of_free_parameters(site, roles, inputs)
    pull = vjp(f, free)[1]
    rows = torch.eye(n, dtype=g.dtype, device=g.device).reshape((n, n) + (1,) * (g.dim() - 1))
    return vmap(lambda row: pull(from_batch_first(g * row, out_dim))[0])(rows)


def batch_sized(use: FunctionalUse, env: Dict, n: int) -> bool:
    """Whether a value of the use's parameter-only chain has the batch size ``n`` in some dim (see
    :func:`_grad_batch_masked`; a constant built for the batch, such as XLNet's position encoding
    expanded to ``[2T, N, D]``); a dim that happens to equal ``N`` only costs time."""
    return n > 1 and any(isinstance(env.get(c), Tensor) and n in env[c].shape for c in use.chain if c.op != "get_attr")


FUNCTIONAL = Rule(kind="generic", grad_batch=grad_batch, vmap_columns=True, any_batch_dim=True, saved_batch_dims=True)


@dataclass(frozen=True)
class UseValues:
    """A functional use's values in one interpreted call: its trainable roles (role -> name), the
    tensors of all its parameters (name -> tensor), its inputs' values, the values of the chain's
    nodes that read no parameter, and whether the chain has the batch size (:func:`batch_sized`)."""

    names: Dict[str, str]
    tensors: Dict[str, Tensor]
    inputs: Sequence[Tensor]
    constants: Dict = field(default_factory=dict)
    batch_sized_chain: bool = False


def record(use: FunctionalUse, values: UseValues, out: Tensor, rec: Recorder, root: nn.Module,
           param_names: Dict[int, str]) -> Tensor:
    """Record the node as a site (``out`` is its value, computed by the interpreter; ``root`` and
    ``param_names``: the traced program's, to run the chain again)."""
    saved = {f"param:{k}": v for k, v in values.tensors.items()}
    saved.update({f"in{i}": x for i, x in enumerate(values.inputs)})
    meta = {"use": use, "root": root, "param_names": param_names, "constants": values.constants or {},
            "batch_sized_chain": values.batch_sized_chain}
    where = f"{use.node.name} (op in forward using {', '.join(use.params)})"
    return rec.add(Site(FUNCTIONAL, values.names, where, meta=meta, saved=saved), out)


def _parameter_name(arg, root: nn.Module, param_names: Dict[int, str]) -> Optional[str]:
    """The canonical name of a parameter read as it is by ``get_attr`` (else ``None``)."""
    if not isinstance(arg, fx.Node) or arg.op != "get_attr":
        return None
    value = attrgetter(arg.target)(root)
    return param_names.get(id(value)) if isinstance(value, nn.Parameter) else None


def linear_roles(node: fx.Node, root: nn.Module, param_names: Dict[int, str], dependent) -> Optional[Dict[str, str]]:
    """``{"weight": name[, "bias": name]}`` for ``F.linear(x, W, b)`` whose input depends on
    the model input and whose ``W`` (and ``b``, if any) are parameters read as they are."""
    if node.op != "call_function" or node.target is not F.linear:
        return None
    args = list(node.args) + [node.kwargs.get(k) for k in ("input", "weight", "bias")[len(node.args):]]
    x, w, b = (args + [None] * 3)[:3]
    if not (isinstance(x, fx.Node) and x in dependent):
        return None
    roles = {"weight": _parameter_name(_untransposed(w), root, param_names)}
    if b is not None:
        roles["bias"] = _parameter_name(b, root, param_names)
    return roles if all(roles.values()) else None


def split_computed_bias(graph: fx.Graph, root: nn.Module, param_names: Dict[int, str], dependent) -> None:
    """Rewrite ``F.linear(x, W, b)`` on a parameter ``W`` whose bias is computed in ``forward``
    (timm's Swin V2 and BEiT: ``cat((q_bias, zeros, v_bias))``) as ``F.linear(x, W) + b``: the
    same values, with ``W`` a Linear site (two Kronecker factors) and the bias's parameters
    generic uses of the sum (the ATen front end's ``linear_computed_bias``)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not F.linear:
            continue
        args = list(node.args) + [node.kwargs.get(k) for k in ("input", "weight", "bias")[len(node.args):]]
        x, w, b = (args + [None] * 3)[:3]
        if not (isinstance(x, fx.Node) and x in dependent and isinstance(b, fx.Node)) \
                or _parameter_name(_untransposed(w), root, param_names) is None \
                or _parameter_name(b, root, param_names) is not None:
            continue
        with graph.inserting_before(node):
            product = graph.call_function(F.linear, (x, w))
            summed = graph.call_function(operator.add, (product, b))
        node.replace_all_uses_with(summed)
        graph.erase_node(node)
        dependent.update((product, summed))


def _untransposed(w):
    """``W`` of ``W.t()`` / ``W.T`` / ``torch.t(W)`` (a weight stored ``[in, out]``), else ``w``."""
    if not isinstance(w, fx.Node):
        return w
    if (w.op == "call_method" and w.target == "t") or (w.op == "call_function" and w.target is torch.t):
        return w.args[0]
    return w


def linear_transposed(node: fx.Node) -> bool:
    """Whether ``F.linear(x, W, b)``'s weight argument is a transposed parameter."""
    args = list(node.args) + [node.kwargs.get("weight")]
    return _untransposed(args[1]) is not args[1]


# Operations affine in all their tensor arguments jointly, and the reshaping ops a parameter
# may go through on the way (a slice of a packed bias, ``bias_k.expand(...)``).
_AFFINE_OPS = {operator.add, operator.sub, torch.add, torch.sub, torch.cat, F.linear, F.embedding, torch.embedding,
               operator.iadd, operator.isub, "add", "sub", "add_", "sub_"}
_RESHAPING = {operator.getitem, "__getitem__", "view", "reshape", "expand", "repeat", "unsqueeze", "squeeze",
              "flatten", "unflatten", "transpose", "permute", "t", "contiguous", torch.reshape, torch.transpose,
              torch.unsqueeze, torch.flatten, "chunk", "split", torch.chunk, torch.split, torch.permute, torch.squeeze,
              torch.movedim, torch.swapaxes, torch.t, torch.narrow, torch.select, "movedim", "narrow", "select", "clone",
              torch.clone}


#: reshapes to another tensor's shape (``pos.expand_as(x)``): linear in the first, the other's values unused
_SHAPED_LIKE = {"expand_as", "view_as", "reshape_as"}


def is_affine(node: fx.Node, chain: Sequence[fx.Node], fixed: Sequence[fx.Node] = (),
              root: Optional[nn.Module] = None) -> bool:
    """Whether the node is affine in its inputs and its parameters together (``x + b[:E]``,
    ``cat([k, bias_k.expand(...)])``, ``x + wpe(arange(T))``; not ``F.linear``, whose weight
    multiplies the input). ``fixed``: chain nodes that read no parameter (indices). The chain
    may sum and concatenate what it computes from the parameters (``ngram[0] + wpe(positions)``:
    sums of affine functions are affine)."""
    if node.target is F.linear or not (node.target in _AFFINE_OPS or node.target in _RESHAPING
                                       or node.target in _SHAPED_LIKE or getattr(node.target, "curvlib_linear", False)):
        return False
    return all(n.op == "get_attr" or n.target in _RESHAPING or n in fixed or _lookup_embedding(n, root)
               or (n.target in _AFFINE_OPS and n.target is not F.linear) for n in chain)


def _lookup_embedding(node: fx.Node, root: Optional[nn.Module]) -> bool:
    """An ``nn.Embedding`` called on constants: linear in its weight."""
    return (root is not None and node.op == "call_module"
            and type(root.get_submodule(node.target)) is nn.Embedding)


def record_linear(use: FunctionalUse, names: Dict[str, str], x: Tensor, out: Tensor, rec: Recorder) -> Tensor:
    """Record ``F.linear(x, W, b)`` on parameters as a Linear site (``names``: trainable roles)."""
    where = f"{use.node.name} (F.linear on {use.linear['weight']}{'ᵀ' if use.transposed else ''})"
    rule = LINEAR_TRANSPOSED if use.transposed else LINEAR
    return rec.add(Site(rule, names, where, saved={"x": x}, meta={"family": "linear",
                                                                   "node": use.node.name, "transposed": use.transposed}), out)
