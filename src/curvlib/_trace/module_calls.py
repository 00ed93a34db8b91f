"""Modules kept whole in an ATen-level trace: those that reorder rows across the batch.

A mixture-of-experts layer with grouped experts (transformers' ``grouped_mm``) sorts the
``N·T·k`` token-expert rows of the whole batch by expert (``torch.sort``), counts rows per
expert (``torch.histc``) and multiplies each group by its expert's weights: inside the
module, which sample a row belongs to is decided by the data of every sample. Yet the
module maps each token row to its output row alone (the router's choice is per token), so
run on one sample's rows it gives that sample's rows of the batch's output. Such a module
is kept as one node of the ATen graph (the custom op :data:`MODULE_CALL`,
``curvlib::module_call``, which ``make_fx`` records without entering it), replayed as a
``call_module`` node: one layer run by the generic rule, per sample (``torch.vmap`` of a
vector-Jacobian product on the sample's rows), and planned like every other layer (the
batch in one dim of its inputs and output, merged rows included).

Which modules: during the first ATen trace, global module hooks note each call's span of
graph nodes (:func:`module_spans`); a node that reorders or counts rows over a dim that
holds the batch (:func:`reorders_rows`) names the innermost module around it that owns
parameters (:func:`modules_to_keep_whole`); the model is then traced again with those
modules routed through :data:`MODULE_CALL` (:func:`kept_whole`).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Dict, List, Tuple

import torch
from torch import Tensor, fx, nn
from torch.fx.experimental import proxy_tensor
from torch.utils import _pytree as pytree

__all__ = ["MODULE_CALL", "module_spans", "orders_by_value", "reorders_rows", "modules_to_keep_whole", "kept_whole",
           "replay_module"]

_KEYS = itertools.count()
# key -> [module path, module, the call's (args, kwargs) leaves, their spec, positions of the tensor
# leaves, its outputs: None for one tensor, else how many]; alive while the trace that made it is replayed
_CALLS: Dict[int, list] = {}

aten = torch.ops.aten
# ops whose output order or counts depend on the values of all the rows they are given (a
# mixture of experts' dispatch: sort the token-expert rows by expert, count rows per expert)
_REORDERING = {"sort", "argsort", "msort", "histc", "bincount"}


def _call(key: int, tensors: List[Tensor], traced: bool = False):
    path, module, leaves, spec, at, _ = _CALLS[key]
    full = list(leaves)
    for i, t in zip(at, tensors):
        full[i] = t
    args, kwargs = pytree.tree_unflatten(full, spec)
    return module(*args, **kwargs) if traced else type(module).forward(module, *args, **kwargs)


@torch.library.custom_op("curvlib::module_call", mutates_args=())
def MODULE_CALL(tensors: List[Tensor], key: int) -> List[Tensor]:  # noqa: N802 - an op, named as a constant
    """The module of call ``key`` on ``tensors`` (its parameters its own), its outputs as a list
    (copies: an op's outputs may not alias its inputs)."""
    out = _call(key, tensors)
    single = isinstance(out, Tensor)
    outs = [out] if single else list(out) if isinstance(out, (tuple, list)) else None
    if outs is None or not all(isinstance(o, Tensor) for o in outs):
        raise TypeError(f"module '{_CALLS[key][0]}' returns {type(out).__name__}, not tensors")
    _CALLS[key][5] = None if single else len(outs)
    return [o.detach().clone() for o in outs]


@contextlib.contextmanager
def module_spans(model: nn.Module, n: int):
    """Yields a list that fills with ``(path, first node, last node, whole)`` for every call of
    one of ``model``'s modules while ``make_fx`` records (``first``: the last node before the
    call; ``whole``: the call returns one tensor whose dim 0 holds the batch of ``n``, rows or
    samples, so that it can be one layer run per sample by the generic rule)."""
    paths = {id(m): p for p, m in model.named_modules()}
    spans: List[Tuple[str, fx.Node, fx.Node, bool]] = []
    open_calls: List[Tuple[int, fx.Node]] = []

    def last_node():
        mode = proxy_tensor.get_proxy_mode()
        return None if mode is None else mode.tracer.graph._root.prev

    def enter(module, args):
        node = last_node()
        if node is not None and id(module) in paths:
            open_calls.append((id(module), node))

    def leave(module, args, out):
        node = last_node()
        if node is not None and open_calls and open_calls[-1][0] == id(module):
            _, first = open_calls.pop()
            # (one tensor: the generic rule's output, which holds the batch in its dim 0, rows or samples)
            whole = isinstance(out, Tensor) and out.dim() > 0 and out.shape[0] % n == 0
            spans.append((paths[id(module)], first, node, whole))

    hooks = (nn.modules.module.register_module_forward_pre_hook(enter),
             nn.modules.module.register_module_forward_hook(leave))
    try:
        yield spans
    finally:
        for h in hooks:
            h.remove()


def orders_by_value(node: fx.Node) -> bool:
    """``node`` (of a torch.fx or ATen graph) sorts or counts values (:data:`_REORDERING`), over
    whatever dims: on a torch.fx graph, without shapes, the sign that a module may reorder the
    batch's rows, which only the ATen-level trace can tell (:func:`reorders_rows`)."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name.split(".")[0] in _REORDERING


def reorders_rows(node: fx.Node, n: int) -> bool:
    """``node`` orders or counts rows by their values over a dim that holds the batch merged with
    more rows (``sort`` of the flattened ``[N·T·k]`` expert ids; neither a per-sample ``sort``
    along the sequence nor one of ``N`` lengths, which reorders whole samples)."""
    name = getattr(node.target, "__name__", "").split(".")[0]
    if node.op != "call_function" or name not in _REORDERING or not node.args:
        return False
    x = getattr(node.args[0], "meta", {}).get("val")
    if not isinstance(x, Tensor) or x.dim() == 0:
        return False
    if name in ("sort", "argsort", "msort"):
        dim = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], int) else node.kwargs.get("dim", -1)
        dim = dim % x.dim() if name != "msort" else 0
        return dim == 0 and x.shape[0] % n == 0 and x.shape[0] > n
    return x.numel() % n == 0 and x.numel() > n  # (counts over every entry: histc, bincount)


def modules_to_keep_whole(gm: fx.GraphModule, spans, model: nn.Module, n: int) -> Dict[str, str]:
    """``{module path: why}``: for each node that reorders rows across the batch, the innermost
    module around it that owns parameters and returns one tensor of rows (JetMoE's router returns
    its sorted rows and a list of counts: the module that uses them, and returns rows again, is
    kept whole); none when only the model itself would do."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    ranges = [(p, order[a], order[b]) for p, a, b, whole in spans if whole and a in order and b in order]
    modules = dict(model.named_modules())
    keep: Dict[str, str] = {}
    for node in gm.graph.nodes:
        if not reorders_rows(node, n):
            continue
        around = sorted((r for r in ranges if r[1] < order[node] <= r[2] and r[0]), key=lambda r: r[2] - r[1])
        owner = next((p for p, _, _ in around if any(True for _ in modules[p].parameters())), None)
        if owner is not None and not any(owner.startswith(k + ".") for k in keep):
            keep = {k: v for k, v in keep.items() if not k.startswith(owner + ".")}
            keep[owner] = (f"its forward orders the rows of the whole batch by their values (graph node "
                           f"'{node.name}', {getattr(node.target, '__name__', node.target)}): kept whole, run "
                           "per sample by the generic rule")
    return keep


@contextlib.contextmanager
def kept_whole(model: nn.Module, paths: Dict[str, str]):
    """Calls of the modules at ``paths`` routed through :data:`MODULE_CALL` for the block (an
    instance ``forward`` each, removed after); yields the keys made, dropped by :func:`forget`."""
    keys: List[int] = []
    patched = []
    for path in paths:
        module = model.get_submodule(path)

        def forward(*args, _path=path, _module=module, **kwargs):
            leaves, spec = pytree.tree_flatten((args, kwargs))
            at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
            key = next(_KEYS)
            _CALLS[key] = [_path, _module, leaves, spec, at, None]
            keys.append(key)
            outs = torch.ops.curvlib.module_call([leaves[i] for i in at], key)
            return outs[0] if _CALLS[key][5] is None else tuple(outs)

        had = "forward" in module.__dict__
        old = module.__dict__.get("forward")
        module.forward = forward
        patched.append((module, had, old))
    try:
        yield keys
    finally:
        for module, had, old in patched:
            if had:
                module.forward = old
            else:
                del module.forward


def forget(keys: List[int]) -> None:
    """Drop the calls of a replayed trace."""
    for key in keys:
        _CALLS.pop(key, None)


def replay_module(tensors, key: int):
    """The node ``MODULE_CALL(tensors, key)`` on fx proxies: the module called on them (curvlib's
    tracer records one ``call_module`` node), its outputs as a list, as the op returns them."""
    out = _call(key, list(tensors), traced=True)
    count = _CALLS[key][5]
    return [out] if count is None else [out[i] for i in range(count)]
