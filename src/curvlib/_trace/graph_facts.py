"""Facts read off a traced program's graph without running it: in-place nodes, chains.

Asked by planning (which probes the forward needs, whether KFRA's recursion applies) and
by the interpreter; they depend only on the graph, so they live with the trace.
"""

from __future__ import annotations

from typing import List

from torch import fx

from .._core.errors import CurvatureError
from ..rules.functional import INPLACE_OPERATORS
from .modes import TensorConstant
from .program import Program

__all__ = ["is_inplace", "overwrites_input", "has_inplace", "chain_nodes"]


def is_inplace(program: Program, node: fx.Node) -> bool:
    """Whether the node overwrites its input (``inplace=True`` modules/functions, ``x.relu_()``)."""
    if node.op == "call_module":
        return bool(getattr(program.root.get_submodule(node.target), "inplace", False))
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    name = getattr(node.target, "__name__", "")
    return bool(node.kwargs.get("inplace", False)) or (name.endswith("_") and not name.endswith("__"))


def overwrites_input(program: Program, node: fx.Node) -> bool:
    """Whether the node writes its result into its first input (``x.add_(y)``, ``x += y``)."""
    return is_inplace(program, node) or (node.op == "call_function" and node.target in INPLACE_OPERATORS)


def has_inplace(program: Program) -> bool:
    """Whether any node of the graph may overwrite a tensor (``inplace=True``,
    ``x.relu_()``, ``x += y``). Such graphs keep the zero probes, which in-place
    operations cannot disturb (and a version check catches anything missed here)."""
    if program.graph is None:
        return True
    return any(overwrites_input(program, node) for node in program.graph.nodes
               if node.op in ("call_module", "call_method", "call_function"))


def chain_nodes(program) -> List[fx.Node]:
    """The graph's nodes from input to output, if they form a chain; else raise."""
    recurrent = sorted(path for path, layer in program.layers.items() if layer.family.recurrent)
    if recurrent:
        # a recurrent layer is a loop of one cell over time steps, not a chain of layers: KFRA's
        # backward recursion G_in = Jᵀ G_out J over layers has no layer-to-layer Jacobian to use
        raise CurvatureError(
            f"KFRA is not defined for the recurrent module(s) {recurrent}: KFRA's recursion passes "
            "the output curvature backward through a chain of layers, and a recurrent layer's "
            "weights are shared over its unrolled time steps (a loop, not a chain). Use KFLR or "
            "KFAC (Kronecker factors with the time steps as shared positions)."
        )
    nodes = [n for n in program.graph.nodes
             if n.op not in ("output", "get_attr") and not isinstance(n.target, TensorConstant)]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    chain = [placeholders[0]]
    for node in nodes:
        if node.op == "placeholder":
            continue
        tensor_inputs = [a for a in node.all_input_nodes
                         if a.op != "get_attr" and not isinstance(a.target, TensorConstant)]
        if tensor_inputs != [chain[-1]]:
            raise CurvatureError(
                f"KFRA needs a chain of operations (a Sequential-like model); graph node "
                f"'{node.name}' ({node.op} {getattr(node.target, '__name__', node.target)}) "
                f"takes inputs {[a.name for a in tensor_inputs]}. Use KFLR or KFAC for "
                "branching models."
            )
        chain.append(node)
    return chain
