"""A dense residual's node as a function (:mod:`curvlib._hessian.residuals`): which of its own
parameters are in ``u``, and its value with its graph inputs and parameters replaced."""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence

from torch import Tensor, fx

from .._trace.program import Program
from ..rules import FamilyKinds, functional

__all__ = ["AFFINE_IN_PARAMETERS", "own_parameters", "node_function"]

#: Families affine in their parameters (∂²f/∂θ² = 0): a parameter that no input depends on has
#: a zero residual block of its own and leaves ``u`` (:attr:`~curvlib._core.family.Family.affine_in_parameters`).
AFFINE_IN_PARAMETERS = FamilyKinds(lambda f: f.affine_in_parameters)


def own_parameters(program: Program, node: fx.Node, trainable: frozenset, coupled: frozenset) -> List[str]:
    """The node's trainable parameters in ``u``: those its inputs depend on, and, unless
    the layer is affine in its parameters, the others too (as ``free`` ones)."""
    if node.op == "call_module" and node.target in program.layers:
        layer = program.layers[node.target]
        names, affine = dict.fromkeys(layer.names.values()), layer.kind in AFFINE_IN_PARAMETERS
    else:
        use = program.functional.get(node)
        names = use.params if use is not None else ()
        affine = use is not None and (use.linear is not None or use.affine)
    return [n for n in names if n in trainable and (n in coupled or not affine)]


def node_function(program: Program, node: fx.Node, env, inputs_nodes, params, fixed_nodes=()) -> Callable:
    """``phi(theta, *inputs, fixed=())``: the node's value with its graph inputs and
    parameters replaced (and, when given, its other tensor inputs ``fixed_nodes``: one sample's)."""

    def phi(theta: Dict[str, Tensor], *inputs: Tensor, fixed: Sequence[Tensor] = ()):
        local = {**dict(zip(fixed_nodes, fixed)), **dict(zip(inputs_nodes, inputs))}
        load = lambda a: fx.node.map_arg(a, lambda n: local[n] if n in local else env[n])  # noqa: E731
        use = program.functional.get(node) if node.op != "call_module" else None
        if use is not None:
            return functional.evaluate(use, program.root, program.param_names, {**params, **theta}, list(inputs),
                                       {a: local[a] if a in local else env[a] for a in use.fixed})
        return program.apply(node, load(node.args), load(node.kwargs), {**params, **theta})

    return phi
