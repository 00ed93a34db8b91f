"""Pointwise regions: an element-wise subgraph recorded as one element-wise residual.

A language model's activation is often written out in primitives, e.g. GPT-2's
``0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))``: three nonlinear nodes (``x³``, ``tanh`` and
the product), each with its own residual, and so ``3 · 2`` sets of signed columns the size of
``x`` to pull back for the Hessian diagonal. The whole subgraph is one element-wise function
``z = φ(x)``, and its residuals sum to ``φ``'s:

    Σ_k (∂u_k/∂x)ᵀ ∇²_{u_k}(g_k · f_k(u_k)) (∂u_k/∂x) = ∇²_x (g_z · φ(x)) = diag(φ''(x) ⊙ g_z)

(the residual decomposition of the scalar ``x ↦ g_z · φ(x)``, whose outer function is linear,
``g_k = (∂z/∂k)ᵀ g_z`` the gradient at node ``k``), provided no value inside the region is used
outside it. So the region is recorded as a single ``"diag"`` residual at its exit, with
``φ`` the region itself and its input the region's one graph input: ``2`` column sets instead
of ``2 · (number of nonlinear nodes)``.

A *row region* also admits reductions ``sum``/``mean`` over the last axis alone with
``keepdim=True`` (RMSNorm written out: ``x * rsqrt(mean(x², -1, keepdim) + ε)``). Every value
in it then has the root's shape or that shape with a last axis of ``1``, and each row (last
axis) of the exit is a function of the same row of the root alone: the same sum of residuals
is block-diagonal over rows, recorded as one ``"row_region"`` residual
(:func:`curvlib._hessian.norm.region_residual`). Row regions are taken first; those without a
reduction are left to the pointwise ones.

A region is a set of nodes, each an element-wise function of graph tensors of one shape
(an element-wise node of :func:`curvlib.rules.elementwise.classify`, or ``+ − × ÷`` and
negation and powers of region tensors and Python numbers: never a tensor constant, which could
broadcast the result to a larger shape), whose graph inputs are the region's members and
one *root* node, and whose values, but the exit's, are used only inside the region. Regions
with fewer than two nonlinear nodes are left as they are (nothing to gain).

A *pair region* has two graph inputs instead of one: a gated MLP's ``act(a) ⊙ b`` (with the
activation a region of its own or one node). It is one function ``z = φ(a, b)`` acting entry by
entry when ``a``, ``b`` and ``z`` have one shape, recorded as one ``"pair"`` residual
(:mod:`curvlib._hessian.pairs`), taken after the regions of one input (which it may contain).
Whether the shapes agree is known once a planning pass has run: a pair whose inputs broadcast
is split back into its nodes' entries then (:func:`split_unequal_pairs`).
"""

from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass, replace
from typing import Callable, Dict, FrozenSet, List, Optional, Set, Tuple

import torch
from torch import Tensor, fx

from .._trace.graph_facts import overwrites_input
from .._trace.program import Program

__all__ = ["PointwiseRegion", "RowRegion", "PairRegion", "fuse_pointwise_regions", "split_unequal_pairs",
           "reroot_regions"]

# ``+ − × ÷``, powers and negation, out of place (in-place spellings overwrite a value the region's
# function is taken of; they end a region)
_ARITHMETIC_FUNCTIONS = frozenset({operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
                                   operator.pos, operator.pow, torch.add, torch.sub, torch.mul, torch.div,
                                   torch.neg, torch.pow})
_ARITHMETIC_METHODS = frozenset({"add", "sub", "mul", "div", "neg", "pow"})
# residual kinds of the nonlinear element-wise nodes a region absorbs
_NONLINEAR_KINDS = ("diag", "product", "dense")


@dataclass(frozen=True)
class PointwiseRegion:
    """A region by its nodes' names (the same in the ATen-level traces of ``N`` and ``N + 1``
    samples): ``root``, its input, and ``nodes`` in graph order, the exit last."""

    root: str
    nodes: Tuple[str, ...]

    def input_node(self, program: Program) -> fx.Node:
        return _by_name(program)[self.root]

    def function(self, program: Program) -> Callable[[Tensor], Tensor]:
        """``φ(x)``: the region's nodes of ``program`` evaluated on ``x`` at the root."""
        return _evaluated(program, (self.root,), self.nodes)


def _evaluated(program: Program, roots: Tuple[str, ...], names: Tuple[str, ...]) -> Callable[..., Tensor]:
    """The nodes ``names`` of ``program`` (graph order, the exit last) as a function of the
    values at ``roots``."""
    named = _by_name(program)
    inputs, nodes = [named[k] for k in roots], [named[k] for k in names]

    def phi(*xs: Tensor) -> Tensor:
        local: Dict[fx.Node, object] = dict(zip(inputs, xs))
        load = lambda a: fx.node.map_arg(a, local.__getitem__)  # noqa: E731
        for node in nodes:
            local[node] = program.apply(node, load(node.args), load(node.kwargs), {})
        return local[nodes[-1]]

    return phi


class RowRegion(PointwiseRegion):
    """A row region (module doc): its function acts on each row (last axis) of its input."""


@dataclass(frozen=True)
class PairRegion:
    """A pair region (module doc) by its nodes' names: ``roots``, its two inputs in graph order,
    ``nodes`` in graph order, the exit last, and ``unfused``, the plan's entries of its nodes
    without it (``(name, entry)``: what :func:`split_unequal_pairs` puts back)."""

    roots: Tuple[str, str]
    nodes: Tuple[str, ...]
    unfused: Tuple[Tuple[str, tuple], ...]

    def input_nodes(self, program: Program) -> List[fx.Node]:
        named = _by_name(program)
        return [named[k] for k in self.roots]

    def function(self, program: Program) -> Callable[[Tensor, Tensor], Tensor]:
        """``φ(a, b)``: the region's nodes of ``program`` evaluated on ``a`` and ``b`` at the roots."""
        return _evaluated(program, self.roots, self.nodes)

    def aligned(self, program: Program, env: Dict[fx.Node, object]) -> bool:
        """Whether, in ``env`` (values by node), both inputs and the exit are floating-point tensors
        of one shape (each exit entry a function of the same entry of the inputs)."""
        named = _by_name(program)
        values = [env.get(named[k]) for k in self.roots + (self.nodes[-1],)]
        return all(isinstance(v, Tensor) and v.is_floating_point() and v.shape == values[0].shape for v in values)


def _by_name(program: Program) -> Dict[str, fx.Node]:
    return {node.name: node for node in program.graph.nodes}


def fuse_pointwise_regions(program: Program, plan: Dict[fx.Node, tuple]) -> Dict[fx.Node, tuple]:
    """``plan`` (node -> ``(kind, φ, coupled)``, :func:`curvlib._hessian.residuals.residual_plan`)
    with every row region with a reduction recorded as one ``"row_region"`` residual, then
    every pointwise region as one ``"diag"`` residual, at its exit, each of at least two
    nonlinear nodes (the others' entries removed; module doc)."""
    dependent = program.dependent
    member = {node for node in program.graph.nodes if _pointwise(program, node, plan, dependent)}
    reductions = {node for node in program.graph.nodes if _row_reduction(program, node, dependent)}
    taken: Set[fx.Node] = set()
    fused = dict(plan)
    _fuse(program, plan, fused, (member | reductions, taken), lambda nodes: bool(nodes & reductions))
    _fuse(program, plan, fused, (member, taken), lambda nodes: True)
    _fuse_pairs(program, plan, fused, member - taken)
    return fused


def _fuse_pairs(program: Program, plan, fused, free: Set[fx.Node]) -> None:
    """Record in ``fused`` the pair regions of the nodes ``free`` (not in a region) and of the
    regions of one input (whole), each of at least two nonlinear nodes (module doc)."""
    dependent = program.dependent
    order = {node: k for k, node in enumerate(program.graph.nodes)}
    named = _by_name(program)
    wholes = [frozenset(named[k] for k in entry[1].nodes) for entry in fused.values() if type(entry[1]) is PointwiseRegion]
    pool = set(free).union(*wholes)
    for exit_node in reversed(list(program.graph.nodes)):
        if exit_node not in pool:
            continue
        grown = _grown(exit_node, pool, dependent)
        roots = sorted({a for n in grown for a in _dependent_args(n, dependent)} - grown, key=order.__getitem__)
        if len(roots) != 2 or sum(plan.get(n, ("",))[0] in _NONLINEAR_KINDS for n in grown) < 2 \
                or any(whole & grown and not whole <= grown for whole in wholes):  # (a region of one input: whole)
            continue
        ordered = sorted(grown, key=order.__getitem__)
        unfused = tuple((n.name, fused.pop(n)) for n in ordered if n in fused)
        pool -= grown
        fused[exit_node] = ("pair", PairRegion((roots[0].name, roots[1].name), tuple(n.name for n in ordered), unfused),
                            frozenset())


def split_unequal_pairs(program: Program, plan: Dict[fx.Node, tuple], env: Dict[fx.Node, object]) -> bool:
    """Replace in ``plan`` (in place) every pair region that is not
    :meth:`~PairRegion.aligned` in ``env`` (a planning pass's values: its inputs broadcast) by
    its nodes' own entries; whether any was."""
    named = _by_name(program)
    split = [node for node, entry in plan.items() if isinstance(entry[1], PairRegion) and not entry[1].aligned(program, env)]
    for node in split:
        region = plan.pop(node)[1]
        plan.update({named[k]: entry for k, entry in region.unfused})
    return bool(split)


def reroot_regions(program: Program, plan: Dict[fx.Node, tuple]) -> None:
    """Re-root in ``plan`` (in place) the regions whose root a graph rewrite gave the batch as a
    dim of its own (:func:`curvlib._plan.batch_merges.split_merged_batches`): their nodes read
    the root's value merged back to the layout they were found in (``unflatten``, ``movedim``,
    ``flatten`` of the root), which becomes their root."""
    named = _by_name(program)
    for key, (kind, region, coupled) in list(plan.items()):
        if not isinstance(region, (PointwiseRegion, PairRegion)):
            continue
        roots = (region.root,) if isinstance(region, PointwiseRegion) else region.roots
        inside, moved = set(roots) | set(region.nodes), dict.fromkeys(roots)
        for name in region.nodes:
            for a in named[name].all_input_nodes:
                origin = None if a.name in inside else _merged_back_from(a, roots)
                if origin is not None:
                    moved[origin] = a.name
        if any(moved.values()):
            new = tuple(moved[r] or r for r in roots)
            region = replace(region, root=new[0]) if isinstance(region, PointwiseRegion) else replace(region, roots=new)
            plan[key] = (kind, region, coupled)


def _merged_back_from(node: fx.Node, roots: Tuple[str, ...], depth: int = 4) -> Optional[str]:
    """The root ``node`` is computed from alone by a few one-input nodes (a merge back), if any."""
    for _ in range(depth):
        inputs = node.all_input_nodes
        if len(inputs) != 1:
            return None
        node = inputs[0]
        if node.name in roots:
            return node.name
    return None


def _fuse(program: Program, plan, fused, where: Tuple[Set[fx.Node], Set[fx.Node]], wanted) -> None:
    """Record in ``fused`` the regions of the nodes ``where[0]`` not yet in ``where[1]`` (added
    there) for which ``wanted(nodes)``: row regions where a reduction is among them."""
    member, taken = where
    dependent = program.dependent
    order = {node: k for k, node in enumerate(program.graph.nodes)}
    for exit_node in reversed(list(program.graph.nodes)):
        if exit_node in taken or exit_node not in member:  # (a sum of nonlinear parts may end a region)
            continue
        found = _region(exit_node, member - taken, dependent, order)
        if found is None:
            continue
        root, nodes = found
        if sum(plan.get(n, ("",))[0] in _NONLINEAR_KINDS for n in nodes) < 2 or not wanted(nodes):
            continue
        taken.update(nodes)
        for node in nodes:
            fused.pop(node, None)
        ordered = tuple(n.name for n in sorted(nodes, key=order.__getitem__))
        rows = any(_row_reduction(program, n, dependent) for n in nodes)
        fused[exit_node] = ("row_region", RowRegion(root.name, ordered), frozenset()) if rows else \
            ("diag", PointwiseRegion(root.name, ordered), frozenset())


_REDUCTIONS = (torch.sum, torch.mean)


def _row_reduction(program: Program, node: fx.Node, dependent) -> bool:
    """Whether ``node`` is ``sum``/``mean`` of one graph tensor over its last axis alone, with
    ``keepdim=True`` and no ``dtype``."""
    if node not in dependent or node.meta.get("no_grad"):
        return False
    if not ((node.op == "call_function" and node.target in _REDUCTIONS)
            or (node.op == "call_method" and node.target in ("sum", "mean"))):
        return False
    args, kwargs = list(node.args), dict(node.kwargs)
    if len(args) > 3 or not args or not isinstance(args[0], fx.Node) or args[0] not in dependent:
        return False
    dim = args[1] if len(args) > 1 else kwargs.pop("dim", None)
    keepdim = args[2] if len(args) > 2 else kwargs.pop("keepdim", False)
    if kwargs:  # (dtype, out)
        return False
    return keepdim is True and (dim == -1 or (isinstance(dim, (list, tuple)) and list(dim) == [-1]))


def _pointwise(program: Program, node: fx.Node, plan, dependent) -> bool:
    """Whether ``node`` computes each entry of its output from the same entry of its graph
    inputs, all of one shape (see the module doc)."""
    if node not in dependent or node.op not in ("call_function", "call_method", "call_module"):
        return False
    if node.meta.get("no_grad") or overwrites_input(program, node):
        return False
    graph_inputs = [a for a in node.all_input_nodes if a in dependent]
    if not graph_inputs or len(graph_inputs) != len(node.all_input_nodes):
        return False  # (a tensor constant among the arguments)
    kind = plan.get(node, ("",))[0]
    if kind == "diag":
        return len(graph_inputs) == 1
    if kind not in ("", "product", "dense"):  # (a quotient of two graph tensors is planned dense)
        return False
    arithmetic = (node.target in _ARITHMETIC_FUNCTIONS if node.op == "call_function"
                  else node.op == "call_method" and node.target in _ARITHMETIC_METHODS)
    numbers_only = all(isinstance(a, fx.Node) or (isinstance(a, numbers.Number) and not isinstance(a, complex))
                       for a in node.args)
    return arithmetic and numbers_only and not node.kwargs


def _dependent_args(node: fx.Node, dependent) -> List[fx.Node]:
    return [a for a in node.all_input_nodes if a in dependent]


def _region(exit_node: fx.Node, member: Set[fx.Node], dependent, order) -> Optional[Tuple[fx.Node, FrozenSet[fx.Node]]]:
    """``(root, nodes)``: the largest pointwise region ending at ``exit_node``, or ``None``."""
    grown = _grown(exit_node, member, dependent)
    inputs = {a for n in grown for a in _dependent_args(n, dependent)} - grown
    if len(inputs) == 1:
        return next(iter(inputs)), frozenset(grown)
    # several inputs: the region generated by one of its own nodes, earliest (largest) first
    for root in sorted(grown - {exit_node}, key=order.__getitem__):
        nodes = _generated(root, grown, exit_node, dependent, order)
        if nodes is not None:
            return root, nodes
    return None


def _grown(exit_node: fx.Node, member: Set[fx.Node], dependent) -> Set[fx.Node]:
    """The members whose every use leads to ``exit_node`` through members, up to a fixed point."""
    grown = {exit_node}
    changed = True
    while changed:
        changed = False
        for node in list(grown):
            for a in _dependent_args(node, dependent):
                if a not in grown and a in member and all(u in grown for u in a.users):
                    grown.add(a)
                    changed = True
    return grown


def _generated(root: fx.Node, grown: Set[fx.Node], exit_node: fx.Node, dependent, order) -> Optional[FrozenSet[fx.Node]]:
    """The nodes of ``grown`` computed from ``root`` alone (through each other), if they reach
    ``exit_node`` and only ``exit_node`` is used outside them."""
    nodes: Set[fx.Node] = set()
    for node in sorted(grown, key=order.__getitem__):
        if order[node] > order[root] and all(a is root or a in nodes for a in _dependent_args(node, dependent)):
            nodes.add(node)
    if exit_node not in nodes or any(u not in nodes for n in nodes - {exit_node} for u in n.users):
        return None
    return frozenset(nodes)
