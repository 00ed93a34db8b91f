"""A dense residual's node (:mod:`curvlib._hessian.residuals`): which of its own parameters are
in ``u``, its value with its graph inputs and parameters replaced, and its recording."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

from torch import Tensor, fx

from .._core.site import Recorder, ResidualParts
from .._trace.program import Program
from ..rules import FamilyKinds, functional
from .rows import linear_in_inputs, separable_rows

__all__ = ["AFFINE_IN_PARAMETERS", "Evaluated", "own_parameters", "node_function", "record_dense"]

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
            # (the node's own fixed arguments, one sample's, beside its chain's fixed nodes)
            constants = {**{a: local[a] if a in local else env[a] for a in use.fixed},
                         **{a: local[a] for a in fixed_nodes}}
            return functional.evaluate(use, program.root, program.param_names, {**params, **theta}, list(inputs),
                                       constants)
        return program.apply(node, load(node.args), load(node.kwargs), {**params, **theta})

    return phi


@dataclass(frozen=True)
class Evaluated:
    """A node being recorded: its values ``env`` (its inputs as they were before it ran, for an
    in-place node), ``env_out`` (which receives its output + probe) and its output ``z``."""

    program: Program
    node: fx.Node
    env: Dict[fx.Node, object]
    env_out: Dict[fx.Node, object]
    z: Tensor
    inplace: bool


def record_dense(at: Evaluated, params: Dict[str, Tensor], trainable: frozenset, coupled, rec: Recorder) -> None:
    """Record the node's dense residual."""
    program, node, env, dependent = at.program, at.node, at.env, at.program.dependent
    # the node as a function of its input-dependent floating-point graph inputs ``u`` (and its
    # trainable parameters); every other tensor input is a constant of it: integer and boolean
    # values (token ids, masks) and values that do not depend on the model input, which may still
    # carry the batch (``torch.zeros(N, T, S)`` added to attention scores by ``baddbmm``). Per
    # sample they are sample n's rows where they carry the batch (``R_n = ∇²_u (g_n · f(θ, x_n;
    # c_n))``, the plan finds the dim, :func:`curvlib._plan.plan.residual_batch_dims`), never the batch's
    # (parameters, and values a functional use computes from them, are ``θ``'s: not constants)
    use = program.functional.get(node)
    from_parameters = set(use.chain) - set(use.fixed) if use is not None else set()
    tensors = [a for a in node.all_input_nodes if isinstance(env[a], Tensor)]
    inputs_nodes = [a for a in tensors if a in dependent and (env[a].is_floating_point() or env[a].is_complex())]
    fixed_nodes = [a for a in tensors if a not in inputs_nodes and a.op != "get_attr" and a not in from_parameters]
    inputs = [env[a] for a in inputs_nodes]
    own = own_parameters(program, node, trainable, coupled)
    if not inputs and not own:
        return
    phi = node_function(program, node, env, inputs_nodes, params, fixed_nodes)
    if at.inplace:
        phi_inplace = phi
        phi = lambda theta, *xs, fixed=(): phi_inplace(theta, *(x.clone() for x in xs), fixed=fixed)  # noqa: E731
    free = [n for n in own if n not in coupled]
    # free parameters whose rows act on output channels of their own: their blocks' diagonals
    # without the dense blocks (a weight-standardised convolution, :mod:`curvlib._hessian.rows`)
    rows = tuple(n for n in free if n in separable_rows(program, node, env, params)) if free else ()
    zero = len(free) == len(own) and linear_in_inputs(program, node)  # (no coupled parameter)
    at.env_out[node] = rec.residual(node.name, "dense", phi, inputs, at.z, ResidualParts({n: params[n] for n in own}, free=free),
                                    meta={"fixed": [env[a] for a in fixed_nodes], "rows": rows, "zero_inputs": zero})
