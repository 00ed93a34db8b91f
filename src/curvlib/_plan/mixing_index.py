"""Indexing along the batch dim, decided on values: does every output row read its own sample?

``h[idx]``, ``h[rows, cols]``, ``h[mask]``, ``index_select``/``gather``/``take_along_dim``
along the batch dim keep samples apart exactly when output entry ``k`` reads an entry of
the sample that the output's batch layout gives ``k``. The test runs the operation
itself on a tensor of *sample ids* (entry ``i`` along the batch dim holds ``(i // s) % N``,
the layout of :class:`curvlib._plan.mixing_ops.Batch`) with the real index values, and
compares the ids that come out with the output layout's: no pattern of how the index was
built (a constant ``arange`` baked in by the ATen trace, ``arange(x.shape[0])``,
``arange(N)[:, None]`` beside per-sample positions, a mask with one hit per sample).

Index tensors in other slots than the batch's (per-sample positions ``lengths - 1``) only
pick entries within a row: they are replaced by zeros, which keeps their shape.

An index that depends only on constants and shapes is evaluated in both planning passes
(``N`` and ``N + 1``) and decided there; one that depends on the input's values is
decided on every call (:func:`curvlib._plan.mixing_numeric.gather_problem`): the values differ per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, fx, nn

from .._core import inputs as _inputs
from .._core.aliasing import VIEWS, op_name, writers
from .mixing_ops import Batch

__all__ = ["GATHERS", "input_values", "GatherCheck", "gather_check", "MISSING", "Values", "gather_slots", "needed_values", "run_check", "sample_check"]

MISSING = object()
ZERO = object()  # an index within rows, replaced by zeros
# ops that draw random numbers or leave memory uninitialised: their values are not constants
_RANDOM = ("rand", "normal", "bernoulli", "dropout", "multinomial", "empty", "poisson", "uniform")
# ops whose value depends on their tensor input's shape and dtype only
_SHAPE_ONLY = frozenset("zeros_like ones_like full_like new_zeros new_ones new_full".split())
_BIG = 1 << 22  # entries: larger constants are not evaluated


def _name(node: fx.Node) -> str:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))
    return name.split(".")[0]


class Values:
    """Values of the nodes that depend on no input value (constants, shapes), in one planning pass.

    ``env``: every node's value in the pass (fake tensors, or real ones); ``root``: the module
    holding that pass's constants (an ATen trace bakes ``arange(N)`` in as a constant)."""

    def __init__(self, root: nn.Module, env: Dict):
        self.root, self.env, self.cache = root, env, {}

    def get(self, node):
        """The value, or :data:`MISSING` when it depends on the input's values."""
        if not isinstance(node, fx.Node):
            return node
        order = self._pending(node)
        for m in order:
            self.cache[m] = self._one(m)
        return self.cache[node]

    def _pending(self, node) -> List[fx.Node]:
        """Ancestors of ``node`` not yet evaluated, in graph order (no recursion: deep graphs)."""
        seen, stack = set(), [node]
        while stack:
            m = stack.pop()
            if m in seen or m in self.cache:
                continue
            seen.add(m)
            if m.op in ("call_function", "call_method") and _name(m) not in _SHAPE_ONLY:
                stack.extend(m.all_input_nodes)
        index = {m: i for i, m in enumerate(node.graph.nodes)}
        return sorted(seen, key=index.__getitem__)

    def _one(self, node):
        value = self.env.get(node, MISSING)
        if value is not MISSING and not _holds_tensor(value):
            return value  # shapes, sizes, dtypes
        if node.op == "get_attr":
            try:
                real = attrgetter(node.target)(self.root)
            except AttributeError:
                return MISSING
            ok = isinstance(real, Tensor) and not isinstance(real, nn.Parameter)
            return real if ok and _same_shape(real, value) else MISSING
        if node.op not in ("call_function", "call_method") or any(r in _name(node) for r in _RANDOM) \
                or writers(node):  # (written in place later: not what its own op gives)
            return MISSING
        if _name(node) in _SHAPE_ONLY:
            stand = lambda a: _stand_in(self.env.get(a, MISSING)) if isinstance(a, fx.Node) else a  # noqa: E731
            args, kwargs = fx.node.map_arg(node.args, stand), fx.node.map_arg(node.kwargs, stand)
        else:
            args, kwargs = fx.node.map_arg(node.args, self.cache.get), fx.node.map_arg(node.kwargs, self.cache.get)
        if _has_missing((args, kwargs)) or (isinstance(value, Tensor) and value.numel() > _BIG):
            return MISSING
        try:
            with torch.no_grad():
                out = (getattr(args[0], node.target)(*args[1:], **kwargs) if node.op == "call_method"
                       else node.target(*args, **kwargs))
        except Exception:  # noqa: BLE001 - then the value is not known; decided per call instead
            return MISSING
        return out if _same_shape(out, value) else MISSING


def _holds_tensor(value) -> bool:
    found = []
    fx.node.map_aggregate(value, lambda a: found.append(a) if isinstance(a, Tensor) else None)
    return bool(found)


def _has_missing(value) -> bool:
    found = []
    fx.node.map_aggregate(value, lambda a: found.append(a) if a is MISSING else None)
    return bool(found)


def _same_shape(real, value) -> bool:
    if not isinstance(value, Tensor):
        return value is MISSING or not isinstance(real, Tensor)
    return isinstance(real, Tensor) and tuple(real.shape) == tuple(value.shape)


def _stand_in(value):
    if isinstance(value, Tensor):
        return torch.zeros(tuple(value.shape), dtype=value.dtype)
    return value


# ----------------------------------------------------------------------------- the sample-id test


@dataclass(frozen=True)
class GatherCheck:
    """An indexing node whose batch-dim index depends on the input's values: tested per call.

    ``args``: the node's arguments in the planning pass, tensors as ``meta`` tensors (their
    shapes); ``shape``: the source's shape; ``inputs``: the index nodes whose values the test
    needs; ``layout``: the output batch the analysis assumed from the planning passes."""

    node: fx.Node
    source: fx.Node
    batch: Batch
    layout: Batch
    args: tuple
    shape: Tuple[int, ...]
    inputs: Tuple[fx.Node, ...]


def gather_check(node: fx.Node, batch: Batch, layout, values, items: list, needed: list) -> GatherCheck:
    """The :class:`GatherCheck` of ``node`` (``values``: its arguments' planning values)."""
    meta = fx.node.map_aggregate(values, lambda v: torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
                                 if isinstance(v, Tensor) else v)
    inputs = tuple(items[k] for k in needed if isinstance(items[k], fx.Node))
    return GatherCheck(node, node.args[0], batch, layout, tuple(meta), tuple(values[0].shape), inputs)


def _width(v) -> int:
    if v is None:
        return 0
    if isinstance(v, Tensor) and v.dtype == torch.bool:
        return v.dim()
    return 1


def gather_slots(name: str, node: fx.Node, values, batch: Batch, ndim: int) -> Optional[Tuple[list, list]]:
    """``(index args, needed)`` of an indexing op whose index reads the batch dim: the flat
    list of its index arguments (nodes or constants) and which of them the test needs the
    values of; ``None`` when no index reads the batch dim."""
    if name == "getitem":
        items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        vals = values[1] if isinstance(values[1], tuple) else (values[1],)
        used = sum(_width(v) for v in vals if v is not Ellipsis)
        dim, needed, covering = 0, [], False
        for k, v in enumerate(vals):
            w = ndim - used if v is Ellipsis else _width(v)
            covers = v is not Ellipsis and dim <= batch.dim < dim + w
            if isinstance(v, (Tensor, list)) and (covers or (isinstance(v, Tensor) and v.dtype == torch.bool)):
                needed.append(k)
            covering |= covers and isinstance(v, (Tensor, list))
            dim += w
        return (list(items), needed) if covering else None
    dim_pos, index_pos = {"index_select": (1, 2), "gather": (1, 2), "take_along_dim": (2, 1)}[name]
    dim = values[dim_pos] if len(values) > dim_pos else None
    if not isinstance(dim, int) or dim % ndim != batch.dim:
        return None
    return [node.args[index_pos]], [0]


def sample_ids(shape, batch: Batch, n: int) -> Tensor:
    """``shape``-sized ids: entry ``i`` along the batch dim holds its sample ``(i // s) % n``."""
    size = shape[batch.dim]
    ids = (torch.arange(size) // batch.s) % n
    view = [1] * len(shape)
    view[batch.dim] = size
    return ids.reshape(view).expand(tuple(shape)).contiguous()


def run_check(name: str, node: fx.Node, values, shape, batch: Batch, index: list, n: int) -> Optional[Tensor]:
    """The op run on sample ids in place of its source; ``index``: the flat index values
    (:data:`ZERO`: replaced by zeros of the shape in ``values``)."""
    ids = sample_ids(shape, batch, n)
    flat = [torch.zeros(tuple(o.shape), dtype=o.dtype) if v is ZERO else v for v, o in zip(index, _flat(name, values))]
    if name == "getitem":
        return ids[tuple(flat) if isinstance(values[1], tuple) else flat[0]]
    if name == "index_select":
        return torch.index_select(ids, values[1], flat[0])
    if name == "gather":
        return torch.gather(ids, values[1], flat[0])
    return torch.take_along_dim(ids, flat[0], values[2])


def _flat(name, values) -> list:
    if name == "getitem":
        return list(values[1]) if isinstance(values[1], tuple) else [values[1]]
    return [values[2] if name in ("index_select", "gather") else values[1]]


def sample_check(out_ids: Tensor, layout, n: int) -> Tuple[Optional[str], Optional[Batch]]:
    """``(why, layout)``: whether every output entry holds its own sample's id under the
    output ``layout`` (``s`` inferred where the planning passes left it open)."""
    if not isinstance(layout, Batch):
        return None, None  # the output lost the batch: the shape rule decides
    if tuple(out_ids.shape) and out_ids.shape[layout.dim] != layout.c * n:
        return "selects a different number of rows per call than in the planning passes", None
    strides = [layout.s] if layout.s else [s for s in range(1, layout.c + 1) if layout.c % s == 0]
    for s in strides:
        if torch.equal(out_ids, sample_ids(tuple(out_ids.shape), Batch(layout.dim, layout.c, s), n)):
            return None, Batch(layout.dim, layout.c, s)
    row = _first_wrong(out_ids, layout, n)
    return f"reads rows of other samples (output row {row} of the batch dim {layout.dim})", None


def _first_wrong(out_ids: Tensor, layout: Batch, n: int) -> int:
    s = layout.s or 1
    want = sample_ids(tuple(out_ids.shape), Batch(layout.dim, layout.c, s), n)
    bad = (out_ids != want).movedim(layout.dim, 0).reshape(out_ids.shape[layout.dim], -1).any(1)
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else 0


def needed_values(index: Sequence, needed: Sequence[int], get) -> Optional[list]:
    """The flat index values for :func:`run_check` from ``get(node)``; ``None`` if a needed one is missing."""
    out = []
    for k, item in enumerate(index):
        value = get(item) if isinstance(item, fx.Node) else (torch.as_tensor(item) if isinstance(item, list) else item)
        if k in needed and (value is MISSING or value is None):
            return None
        # an integer index within rows (missing values are tensors: other values are constants)
        positions = k not in needed and (value is MISSING or isinstance(value, Tensor))
        out.append(ZERO if positions else value)
    return out


GATHERS = frozenset(["index_select", "gather", "take_along_dim"])  # (and getitem with a tensor index)


def input_values(program, X, nodes: Sequence[fx.Node]) -> Optional[Dict[fx.Node, object]]:
    """The values of ``nodes`` on input ``X`` from their ancestors alone (a mask or an index
    computed from the input: a few cheap ops, not the model's forward); ``None`` when an
    ancestor runs a module or reads a parameter (then the caller runs the forward)."""
    seen, stack = set(), list(nodes)
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        if m.op == "call_module" or m in program.functional:
            return None
        stack.extend(m.all_input_nodes)
        stack.extend(writers(m))  # (run in graph order: the writes before the reads after them)
    leaves = _inputs.trace_leaves(X) if program.leaf_inputs else None
    env: Dict[fx.Node, object] = {}
    placeholders = 0
    for node in program.graph.nodes:
        if node.op == "placeholder":
            value = (leaves[placeholders] if leaves is not None and placeholders < len(leaves)
                     else X if placeholders == 0 else (node.args[0] if node.args else MISSING))
            placeholders += 1
        elif node not in seen:
            continue
        elif node.op == "get_attr":
            value = attrgetter(node.target)(program.root)
            if isinstance(value, nn.Parameter):
                return None
        else:
            load = lambda a: env[a]  # noqa: E731
            value = program.apply(node, fx.node.map_arg(node.args, load), fx.node.map_arg(node.kwargs, load), {})
        env[node] = value
    return env
