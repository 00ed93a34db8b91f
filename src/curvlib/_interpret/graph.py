"""Interpret a traced :class:`~curvlib._trace.program.Program`'s graph node by node.

Every ``call_module`` node of a layer with a rule runs through the rule, which
records its sites (inputs saved, output probed); other modules run by their own
``forward``. A failure is re-raised as :class:`NodeFailure`, naming the graph node,
so that :mod:`curvlib._interpret.diagnose` can say which line of the model failed and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional

from operator import attrgetter
import weakref
import torch
from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree

from .._core import dropout as _dropout, inputs as _inputs, outputs as _outputs, param_reads
from .._hessian import residuals as _residuals
from .._core.errors import CurvatureError
from .._trace.program import Program
from ..rules import functional
from .._core.site import Recorder
from .._trace.graph_facts import overwrites_input

__all__ = ["NodeFailure", "run_graph"]



def run_graph(
    program: Program,
    X: Tensor,
    params: Mapping[str, Tensor],
    trainable: frozenset,
    rec: Recorder,
    fake_tensor: Optional[Callable[[Tensor], Tensor]] = None,
    env: Optional[Dict[fx.Node, object]] = None,
    preserve_inputs: bool = False,
) -> Tensor:
    """Interpret the program's graph on input ``X``.

    Args:
        program: the traced model.
        X: input ``[N, *]``.
        params: canonical name -> tensor for *every* parameter of the model.
        trainable: names whose quantities are wanted (their sites get probes).
        rec: collects the sites.
        fake_tensor: during planning, turns a real buffer read by ``get_attr``
            into a fake one (``None`` otherwise).

        env: if given, filled with every node's value.
        preserve_inputs: run in-place nodes on copies of their inputs, so that ``env``
            keeps every node's own value (only for chains, where nobody reads an
            in-place node's input again: KFRA).

    Returns:
        The model output.
    """
    run = _Run(program, params, trainable, rec, fake_tensor, {} if env is None else env, preserve_inputs,
               env is not None)
    where: List[Optional[fx.Node]] = [None]  # the node being run
    try:
        return _interpret(run, X, where)
    except (CurvatureError, NodeFailure):
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the graph node that failed
        raise NodeFailure(program, where[0], exc) from exc


@dataclass(frozen=True)
class _Run:
    """One interpretation of a program: :func:`run_graph`'s arguments but the input."""

    program: Program
    params: Mapping[str, Tensor]
    trainable: frozenset
    rec: Recorder
    fake_tensor: Optional[Callable[[Tensor], Tensor]]
    env: Dict[fx.Node, object]
    preserve_inputs: bool
    keeps_values: bool  # the caller reads ``env`` afterwards

    @property
    def releases(self) -> bool:
        """Whether values may be dropped after their last reader: nobody asked for them (no
        ``env`` given) and nothing is recorded (no sites, no residuals, no planning pass)."""
        return not (self.keeps_values or self.trainable or self.rec.residual_nodes or self.fake_tensor is not None)


class NodeFailure(RuntimeError):
    """The model's forward raised at a graph node: the node and the original error."""

    def __init__(self, program: Program, node: Optional[fx.Node], exc: BaseException):
        self.program, self.node, self.exc = program, node, exc
        where = f" at graph node '{node.name}'" if node is not None else ""
        super().__init__(f"{type(exc).__name__}{where}: {exc}")


def _interpret(run: _Run, X, where: List[Optional[fx.Node]]) -> Tensor:
    program, params, trainable, rec, env = run.program, run.params, run.trainable, run.rec, run.env
    leaves = _inputs.trace_leaves(X) if program.leaf_inputs else None  # one placeholder per leaf
    dropout = _dropout.new_generator(rec.dropout_seed)  # None unless this call has active dropout
    noises = env.setdefault(_dropout.NOISES, {}) if dropout is not None else None
    placeholders_seen = 0
    result = None
    # a run that records nothing and keeps no values (products, operators): each value is
    # dropped after its last reader, as eager PyTorch frees it (a forward-mode pass then holds
    # one layer's primals and tangents, not the whole network's)
    free = _last_readers(program) if run.releases else {}
    lazy, first, last = _lazy_parameters(run)
    for node in program.graph.nodes:
        where[0] = node
        if node in lazy:  # (read when a node first needs it: see _lazy_parameters)
            continue
        for p in first.get(node, ()):
            env[p] = _attribute(run, p)
        load = lambda a: fx.node.map_arg(a, lambda n: env[n])  # noqa: E731
        before = None
        if node in rec.residual_nodes and overwrites_input(program, node):
            # The node overwrites its input: keep the value it is a function of.
            before = {a: env[a].clone() for a in node.all_input_nodes if isinstance(env.get(a), Tensor)}
        dropout_kind = _dropout.node_dropout(program, node) if dropout is not None else None
        if _on_copies(program, node, run.preserve_inputs):
            load = lambda a: fx.node.map_arg(a, lambda n: env[n].clone() if isinstance(env[n], Tensor) else env[n])  # noqa: E731
        if node.op == "placeholder":
            env[node] = (leaves[placeholders_seen] if leaves is not None and placeholders_seen < len(leaves)
                         else _placeholder(node, X, placeholders_seen))
            placeholders_seen += 1
        elif node.op == "get_attr":
            env[node] = _attribute(run, node)
        elif dropout_kind is not None:  # dropout: the mask from this call's generator
            env[node] = _dropout.run_node(program, node, dropout_kind, load(node.args), load(node.kwargs), dropout, noises)
        elif node.op == "call_module":
            env[node] = _call_module(program, node, load(node.args), load(node.kwargs), params, trainable, rec)
        elif node.op in ("call_function", "call_method"):
            env[node] = program.apply(node, load(node.args), load(node.kwargs), params)
        _record(run, node, before)
        if node.op == "output":
            result = load(node.args[0])
            if program.out_spec is not None:
                result = pytree.tree_unflatten(list(result), program.out_spec)
        for done in free.get(node, ()):
            env.pop(done, None)
        for done in last.get(node, ()):
            env.pop(done, None)
    return result if isinstance(result, Tensor) else _chosen(program, result)


def _lazy_parameters(run: _Run):
    """On a sharded model's call (a reader of :mod:`curvlib._core.param_reads`, each read a
    gather), the ``get_attr`` nodes of parameters, read just before the first node that needs
    them and dropped after the last, not held from where the graph reads them (an ATen-level
    graph reads them all first) to its end: ``(those nodes, {node: the ones to read before it},
    {node: the ones to drop after it})``. Empty where values are kept or recorded for later
    (``env`` given, the Hessian's residuals, planning)."""
    if (param_reads.current() is None or run.keeps_values or run.rec.residual_nodes
            or run.fake_tensor is not None):
        return frozenset(), {}, {}
    program = run.program
    lazy = {node for node in program.graph.nodes if node.op == "get_attr"
            and isinstance(attrgetter(node.target)(program.root), nn.Parameter)}
    first: Dict[fx.Node, List[fx.Node]] = {}
    last: Dict[fx.Node, fx.Node] = {}
    for node in program.graph.nodes:
        for read in _reads(program, node):
            if read in lazy and read not in last:
                first.setdefault(node, []).append(read)
            if read in lazy:
                last[read] = node
    drops: Dict[fx.Node, List[fx.Node]] = {}
    for read, node in last.items():
        drops.setdefault(node, []).append(read)
    return frozenset(lazy), first, drops


def _reads(program: Program, node: fx.Node) -> List[fx.Node]:
    """The nodes whose values ``node`` reads: its inputs, and the inputs and fixed values of the
    functional use it records."""
    reads = list(node.all_input_nodes)
    use = program.functional.get(node)
    if use is not None:
        reads += [a for a in list(getattr(use, "inputs", ())) + list(getattr(use, "fixed", ())) if isinstance(a, fx.Node)]
    return reads


def _last_readers(program: Program) -> Dict[fx.Node, List[fx.Node]]:
    """Node -> the nodes whose values no later node reads (its inputs, and the inputs and fixed
    values of the functional use it records)."""
    last: Dict[fx.Node, fx.Node] = {}
    for node in program.graph.nodes:
        for read in _reads(program, node):
            last[read] = node
    frees: Dict[fx.Node, List[fx.Node]] = {}
    for read, node in last.items():
        frees.setdefault(node, []).append(read)
    return frees


def _attribute(run: _Run, node: fx.Node):
    """The value a ``get_attr`` node reads: a parameter's from ``params``, a buffer (fake while
    planning) or a constant of the model."""
    value = attrgetter(node.target)(run.program.root)
    if isinstance(value, nn.Parameter):
        return run.params[run.program.param_names[id(value)]]
    if isinstance(value, Tensor) and run.fake_tensor is not None:
        return run.fake_tensor(value)
    return value


def _record(run: _Run, node: fx.Node, before) -> None:
    """Record what the node's value makes: a functional site (a call that uses parameters outside
    their module) and a residual (a nonlinear node the Hessian needs); ``before``: the values of
    the inputs an in-place node overwrote."""
    program, env, rec = run.program, run.env, run.rec
    if node in program.functional:
        env[node] = _record_functional(program, program.functional[node], env[node], env, run.params,
                                       run.trainable, rec)
        if overwrites_input(program, node) and isinstance(node.args[0], fx.Node):
            env[node.args[0]] = env[node]  # (``h += p``: a later read of ``h`` sees the site's output)
    if node in rec.residual_nodes:
        _residuals.record(program, node, rec.residual_nodes[node], env, run.params, run.trainable, rec, before)
        if before is not None:
            # In eager PyTorch the overwritten input *is* the output: alias it, so
            # that later uses of the input see the output's probe too.
            first = node.all_input_nodes[0]
            env[first] = env[node]


def _chosen(program: Program, result):
    """The tensor of a container output (a ModelOutput, tuple, dict: :mod:`curvlib._core.outputs`)
    the loss takes; the default rule's choice said once per traced graph."""
    chosen, where = _outputs.select(result, program.selector)
    if program.selector is None and not program.output_choice and program.graph not in _SAID:
        _SAID.add(program.graph)  # (an ATen-level trace found its choice when traced, and said it then)
        _outputs.say_choice(_outputs.describe_choice(result, where))
    return chosen


#: The graphs of the programs whose default choice of a container output's tensor was said (once
#: per traced graph, whichever program holds it after planning's rewrites).
_SAID: "weakref.WeakSet[fx.Graph]" = weakref.WeakSet()


def _on_copies(program, node: fx.Node, preserve_inputs: bool) -> bool:
    """Whether ``node`` writes into its input and must run on copies: when the caller's inputs
    are preserved, and for a parameter use (``h += self.pos``), whose functional rule needs the
    input as it was (later reads of ``h`` see the site's output)."""
    return ((preserve_inputs or node in program.functional) and node.op != "placeholder"
            and overwrites_input(program, node))


def _record_functional(program, use, value, env, params, trainable, rec):
    """A call that uses parameters outside their module (``F.linear(x, self.w)``,
    ``x @ self.w``): a linear use records its site; another, when a parameter it uses
    is trainable, is recorded by the functional rule. ``value``: the call's output."""
    if use.linear is not None:
        names = {r: n for r, n in use.linear.items() if n in trainable}
        return functional.record_linear(use, names, env[use.inputs[0]], value, rec)
    if any(n in trainable for n in use.params):
        values = functional.UseValues(
            {n: n for n in use.params if n in trainable}, {n: params[n] for n in use.params},
            [env[a] for a in use.inputs], {a: env[a] for a in use.fixed},
            batch_sized_chain=value.dim() > 0 and functional.batch_sized(use, env, _batch_size(value, rec)),
        )
        return functional.record(use, values, value, rec, program.root, program.param_names)
    return value


def _batch_size(value: Tensor, rec) -> int:
    """The batch size of the output ``value`` of the site ``rec`` records next, read in the dim
    the plan found for it (dim 0 while planning)."""
    return value.shape[rec.batch_dim(len(rec.sites))]


def _placeholder(node: fx.Node, X, seen: int):
    if seen == 0:
        return X
    if node.args:
        return node.args[0]  # default value of a further argument
    raise CurvatureError(
        f"The model's forward takes a second required argument '{node.target}'; curvlib calls "
        "model(X) with one argument (pass several inputs as a dict or tuple X)."
    )


def _call_module(program, node: fx.Node, args, kwargs, params, trainable, rec):
    """A module node: a layer through its rule (recording its sites), any other module
    by its own ``forward`` (hooks are not part of the math and are not run)."""
    layer = program.layers.get(node.target)
    if layer is None:  # not a layer: nothing to record
        return program.apply(node, args, kwargs, params)
    if program.dependent and node not in program.dependent:
        # a layer on constants (nanoGPT's wpe(torch.arange(T))): part of the parameter-only
        # chain of the op that uses its output, which records the site (rules.functional);
        # run by its family's forward, unrecorded (Program.apply), so that its derivatives are
        # the family's in every mode (an Embedding's padding row constant in forward mode too)
        return program.apply(node, args, kwargs, params)
    names = {r: n for r, n in layer.names.items() if n in trainable}
    tensors = {r: params[n] for r, n in layer.names.items()}
    planned = rec.residual_nodes.get(node)
    # a layer that records its own nonlinear nodes (recurrent): what it needs to know
    rec.layer_residuals = planned[1] if planned is not None and planned[0] == "layer" else None
    # its sites' family, and for a submodule torch.fx could not trace, why (for refusals)
    rec.layer_meta = {"family": layer.kind,
                      **({"opaque": layer.opaque, "kron_inside": layer.kron_inside,
                         "kron_rows": layer.kron_inside_rows} if layer.opaque else {})}
    try:
        return layer.forward(layer.module, layer.path, names, tensors, args, kwargs, rec)
    finally:
        rec.layer_residuals, rec.layer_meta = None, {}

