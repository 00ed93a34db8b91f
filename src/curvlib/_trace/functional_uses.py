"""Which graph nodes depend on the model input, and the nodes that read parameters directly.

A node that depends on the input and reads a parameter outside any layer (``x @ self.W``,
``F.conv2d(x, std(self.weight))``) is a *functional use*: :mod:`curvlib.rules.functional` treats
it as a site, its parameter-only chain recomputed as a function of the parameters.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from torch import fx, nn

from ..rules.functional import FunctionalUse, is_affine, linear_roles, linear_transposed
from .._core.aliasing import effective_inputs

__all__ = ["input_dependent", "shape_query", "functional_uses"]


def input_dependent(graph: fx.Graph, leaves: bool = False, inputs: Optional[Dict[fx.Node, List[fx.Node]]] = None) -> set:
    """Nodes whose value depends on the model input (the first placeholder; every
    placeholder when the input's leaves are the placeholders). ``inputs``: every node's
    :func:`~curvlib._core.aliasing.effective_inputs` (a buffer written in place with
    the input's values depends on the input from then on)."""
    inputs = effective_inputs(graph) if inputs is None else inputs
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    # (a placeholder with a default is a further argument specialised to it: a constant)
    dependent = set([p for p in placeholders if not p.args] if leaves else placeholders[:1])
    for node in graph.nodes:
        if any(a in dependent for a in inputs[node]) and not shape_query(node):
            dependent.add(node)
    return dependent


def shape_query(node: fx.Node) -> bool:
    """``x.shape``, ``x.size(1)``, ``x.dim()``, ``x.device``, ``x.dtype``: constant for the
    derivatives (``self.pos[:x.shape[1]]``, nanoGPT's ``wpe(torch.arange(x.size(1)))``)."""
    if node.op == "call_method":
        return node.target in ("size", "dim")
    return (node.op == "call_function" and node.target is getattr and len(node.args) == 2
            and node.args[1] in ("shape", "device", "dtype", "ndim"))


def functional_uses(graph: fx.Graph, root: nn.Module, param_names: Dict[int, str]) -> Dict[fx.Node, FunctionalUse]:
    """Nodes that depend on the model input and read parameters directly (see
    :mod:`curvlib.rules.functional`), with their parameter-only chains."""
    # (every input with the in-place writes into it: ``b = p.clone(); b[i].zero_()`` reads p
    # and is p with zeros, the writes part of the chain that recomputes it)
    sees = effective_inputs(graph)
    dependent = input_dependent(graph, getattr(graph._codegen, "pytree_info", None) is not None, sees)
    reads: Dict[fx.Node, frozenset] = {}  # parameter-only node -> parameter names it reads
    for node in graph.nodes:
        if node in dependent:
            continue
        if shape_query(node):  # (a parameter's ``.device``/``.shape``: metadata, constant for the derivatives)
            reads[node] = frozenset()
            continue
        names = set()
        if node.op == "get_attr":
            value = root
            for part in node.target.split("."):
                value = getattr(value, part)
            if isinstance(value, nn.Parameter) and id(value) in param_names:
                names.add(param_names[id(value)])
        elif node.op == "call_module":  # a layer on constants (wpe(arange(T))): its parameters
            names |= {param_names[id(p)] for p in root.get_submodule(node.target).parameters()
                      if id(p) in param_names}
        for a in sees[node]:
            names |= reads.get(a, frozenset())
        reads[node] = frozenset(names)
    uses: Dict[fx.Node, FunctionalUse] = {}
    for node in graph.nodes:
        if node not in dependent or node.op in ("placeholder", "output", "call_module"):
            continue
        constant_args = [a for a in sees[node] if a not in dependent]
        params = set().union(*(reads[a] for a in constant_args)) if constant_args else set()
        if not params:
            continue
        chain_set, stack = set(), list(constant_args)
        while stack:
            a = stack.pop()
            if a not in chain_set:
                chain_set.add(a)
                if not shape_query(a):  # (``x.shape`` of a computed x: a fixed value, not x's ancestry)
                    stack.extend(sees[a])
        chain = tuple(n for n in graph.nodes if n in chain_set)
        inputs = tuple(a for a in node.all_input_nodes if a in dependent)
        fixed = tuple(n for n in chain if not reads.get(n))  # (index computations, the input's shape)
        linear = linear_roles(node, root, param_names, dependent)
        uses[node] = FunctionalUse(node=node, chain=chain, params=tuple(sorted(params)), inputs=inputs, fixed=fixed,
                                   linear=linear, affine=is_affine(node, chain, fixed, root),
                                   transposed=linear is not None and linear_transposed(node))
    return uses
