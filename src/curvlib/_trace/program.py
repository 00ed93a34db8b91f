"""Trace a model once into a :class:`Program`: an fx graph plus a table of layers.

The model is traced with :mod:`torch.fx` symbolically (no data flows). Leaves
of the trace are

* every module that owns parameters directly (``nn.Linear``, ``nn.Conv2d``,
  a user module with an ``nn.Parameter``, ...): a *layer*, run by its rule
  from :mod:`curvlib.rules`, or by the generic torch.func rule if none fits;
* the built-in parameter-free ``torch.nn`` modules (``ReLU``, ``MaxPool2d``,
  ...), run as they are;
* *opaque* submodules: those whose ``forward`` torch.fx cannot trace (type or
  shape assertions on proxies, data-dependent control flow, iteration over a
  tensor). When the whole model fails to trace, the deepest module on fx's
  module stack at the failure becomes a leaf and tracing is repeated, until it
  succeeds or the failure is in the model's own ``forward`` (then the model has
  no graph). An opaque module owning parameters (in its subtree) is one layer
  run by the generic rule; a parameter-free one runs as it is.

Everything else (user containers, functional ops, tensor methods, residual
additions) is inlined into the graph, so any traceable model works, Sequential
or not. A module instance called twice is two nodes that name the same layer.

Parameters take their canonical names (``model.named_parameters()``'s): tied
weights (one ``Parameter`` held by two modules) are one entry.
"""

from __future__ import annotations

import dataclasses
import inspect
import traceback
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch.nn.utils import parametrize
import torch.nn.functional as F
from torch import fx, nn

from .. import rules
from .._core.errors import CurvatureError
from .._core.site import Recorder
from .._core.sync import LOCK
from .._core.tensors import inside_transform
from ..rules import attention, batchnorm, elementwise, embedding, layernorm
from .._core.inputs import keyword_inputs, trace_structure, with_defaults
from ..rules.batched_backward import batched_backward_op
from ..rules.functional import FunctionalUse, split_computed_bias
from ..rules.generic import restored
from .functional_uses import functional_uses, input_dependent
from .layer import Layer
from .modes import refuse_autocast
from .tracer import Tracer, owns_parameters

__all__ = ["Program", "Layer", "trace_program", "assemble"]


@dataclass(frozen=True, eq=False)
class Program:
    """A traced model: the graph, its layers, and where parameters live. Frozen: a later stage
    that rewrites the graph (:mod:`curvlib._plan.batch_merges`) makes a new program with
    :func:`dataclasses.replace`; what a later stage learns about a program lives in that
    stage's own records (:class:`curvlib._plan.traces.Traced`).

    Attributes:
        root: the module the graph's ``get_attr``/``call_module`` targets refer to.
        graph: the fx graph, or ``None`` if the model could not be traced.
        trace_error: why tracing failed (with the model line), if it did.
        layers: module target (path relative to ``root``) -> :class:`Layer`.
        param_names: ``id(parameter)`` -> canonical name.
        prefix: path prefix of the user's model inside ``root`` (``""`` or ``"model."``).
    """

    root: nn.Module
    graph: Optional[fx.Graph]
    trace_error: Optional[str]
    layers: Dict[str, Layer]
    param_names: Dict[int, str]
    prefix: str = ""
    calls: List[str] = field(default_factory=list)
    functional: Dict[fx.Node, "FunctionalUse"] = field(default_factory=dict)
    dependent: frozenset = frozenset()
    out_spec: object = None  # traced with a container input: the output's pytree spec
    leaf_inputs: bool = False  # traced with a container input: one placeholder per leaf
    opaque: Dict[str, str] = field(default_factory=dict)  # untraceable submodule target -> fx's error
    aten: bool = False  # traced at the ATen level on one input signature (curvlib._trace.aten)
    output_choice: str = ""  # where the loss's tensor was found in a container output
    aten_error: str = ""  # why the ATen-level trace failed, when it was tried and failed
    selector: object = None  # curvature(..., output=): which tensor of a container output the loss takes
    sibling: Optional["Program"] = None  # an ATen-level trace: the same model traced on a batch of N + 1

    def apply(self, node: fx.Node, args, kwargs, params: Dict[str, torch.Tensor]):
        """The value of the call node ``node`` on given arguments, recording nothing: the one
        evaluation of a node that the interpreter (for all but the layers it records), KFRA's
        chain and the residuals' node functions share. A layer by its family's ``forward`` on
        ``params`` (name -> tensor), another module by its own ``forward`` without hooks, a
        method or a function as it is, except layer norm and hardsigmoid inside torch.func
        transforms, which run from primitives (:func:`curvlib.rules.layernorm.normalise`,
        :func:`curvlib.rules.elementwise.hardsigmoid`: torch's kernels' higher derivatives), softmax
        and smooth activations outside them while columns are pulled back many at once (a
        backward that batches over them, :mod:`curvlib.rules.batched_backward`), and an
        evaluation-mode ``F.batch_norm`` and ``F.embedding``, always (:data:`_ALWAYS`)."""
        if node.op == "call_module":
            layer = self.layers.get(node.target)
            if layer is None:
                module = self.root.get_submodule(node.target)
                if type(module) is nn.Hardsigmoid and inside_transform():
                    return elementwise.hardsigmoid(*args)
                return rules.call_without_hooks(module, args, kwargs)
            tensors = {r: params[n] for r, n in layer.names.items()}
            return layer.forward(layer.module, layer.path, {}, tensors, args, kwargs, Recorder(None))
        if layernorm.primitives_active() and not inside_transform():  # columns pulled back many at once
            batched = batched_backward_op(node.target, args, kwargs)
            if batched is not None:
                return batched
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.target in _PRIMITIVES and inside_transform():
            return _PRIMITIVES[node.target](*args, **kwargs)
        return _ALWAYS.get(node.target, node.target)(*args, **kwargs)


_PRIMITIVES = {F.layer_norm: layernorm.layer_norm, torch.layer_norm: layernorm.layer_norm,
               F.hardsigmoid: elementwise.hardsigmoid}
#: Functions always run by curvlib's own: an evaluation-mode batch norm (its backward), an
#: embedding's look-up (its padding row constant in forward mode too).
_ALWAYS = {F.batch_norm: batchnorm.functional, F.embedding: embedding.functional}


def _outermost_owners(root: nn.Module) -> List[str]:
    """Layers of a model without a graph: the modules that own parameters directly
    (or through ``torch.nn.utils.parametrize``), except those inside another
    such module (a module's layer covers its whole subtree). Each module once,
    at its first path (that of ``named_modules()``)."""
    owners = [
        path for path, m in root.named_modules()
        if owns_parameters(m) or parametrize.is_parametrized(m)
    ]
    return [
        path for path in owners
        if not any(q != path and (q == "" or path.startswith(q + ".")) for q in owners)
    ]


class _Root(nn.Module):
    """Holds a model that owns parameters itself, so that it becomes a leaf."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):  # pragma: no cover - traced, not run
        return self.model(x)


class _Keywords(nn.Module):
    """Holds a model called with keyword inputs: ``forward(X)`` is ``model(**X)``. Traced with
    ``X`` as a dict whose tensor leaves are placeholders; the model's other arguments keep
    their defaults, as when curvlib calls it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, X):
        return self.model(**X)


def _model_line(exc: BaseException) -> str:
    """The deepest frame of ``exc``'s traceback outside torch, as ``file:line: code``."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if "/torch/" not in f.filename.replace("\\", "/")]
    if not user:
        return ""
    f = user[-1]
    return f"{f.filename}:{f.lineno}: {f.line}"


def trace_program(model: nn.Module, example=None, output=None) -> Program:
    """Trace ``model``; never runs it on data and never changes it. ``output``: which tensor of
    a container output the loss takes (``curvature(..., output=)``; ``None``: the default rule).

    ``example``: the input's structure when it is a container (dict, tuple, ...)
    of tensors rather than a tensor. The model then sees a real container whose
    tensor leaves are proxies (fx's ``concrete_args``), so that a branch like
    ``isinstance(data, Mapping)`` takes the path the real input takes; every
    leaf becomes a placeholder, in :func:`curvlib._core.inputs.trace_leaves` order
    (non-tensor leaves are specialised to their values).
    """
    param_names: Dict[int, str] = {}
    for name, p in model.named_parameters():
        param_names.setdefault(id(p), name)

    root, prefix = (model, "")
    if (owns_parameters(model) and rules.has_family(model)) or attention.traced_forward(model) is not None:
        # A bare nn.Linear/Conv/... model: trace a holder so that it is one layer
        # with its hand-written rule. Any other model that owns parameters is
        # traced as it is; its direct parameter uses become functional sites. (An attention
        # module or transformer block as the model: traced through the holder as its math.)
        root, prefix = (_Root(model), "model.")

    concrete, through = None, None
    if keyword_inputs(model, example):
        # the dict's keys are the forward's keyword arguments: the model is traced through a
        # holder calling ``model(**X)`` (the ATen-level trace's root holds it at ``model.`` too)
        root, prefix, through = (_Keywords(model), "model.", model)
        concrete = {"X": trace_structure(example)}
    elif example is not None and not isinstance(example, torch.Tensor):
        first = next(iter(inspect.signature(root.forward).parameters))
        concrete = {first: trace_structure(example)}
    traced_with = concrete if through is not None else with_defaults(root.forward, concrete)
    graph, error, opaque = _trace_with_opaque_leaves(root, traced_with, through)
    program = assemble(root, prefix, graph, error, opaque, param_names, leaf_inputs=concrete is not None)
    return dataclasses.replace(program, selector=output)


def assemble(root, prefix, graph, error, opaque, param_names, leaf_inputs: bool) -> Program:
    """The :class:`Program` of a graph (or of no graph): its layers and functional uses."""
    if graph is not None:
        refuse_autocast(graph, root, prefix)
    layers: Dict[str, Layer] = {}
    modules = dict(root.named_modules(remove_duplicate=False))
    targets = (
        [n.target for n in graph.nodes if n.op == "call_module"]
        if graph is not None
        else _outermost_owners(root)
    )
    for target in targets:
        if target in layers:
            continue
        module = modules[target]
        if not any(True for _ in module.parameters()):
            continue
        names = {
            role: param_names[id(p)]
            for role, p in module.named_parameters(remove_duplicate=False)
        }
        path = target[len(prefix):] if target.startswith(prefix) else target
        forward, kind = rules.forward_for(module)
        layers[target] = Layer(path=path, module=module, names=names, forward=forward, kind=kind,
                               opaque=opaque.get(target, ""))
    if graph is not None:  # (F.linear(x, W, b(θ)) as F.linear(x, W) + b(θ): W keeps its Linear rule)
        split_computed_bias(graph, root, param_names, input_dependent(graph, leaves=leaf_inputs))
    functional = functional_uses(graph, root, param_names) if graph is not None else {}
    return Program(
        root=root, graph=graph, trace_error=error, layers=layers,
        param_names=param_names, prefix=prefix, functional=functional,
        dependent=frozenset(input_dependent(graph, leaves=leaf_inputs)) if graph is not None else frozenset(),
        out_spec=getattr(getattr(graph._codegen, "pytree_info", None), "out_spec", None) if graph is not None else None,
        leaf_inputs=leaf_inputs, opaque=opaque,
    )


def _why(exc: BaseException) -> str:
    """fx's error, first line, with the model line that raised it."""
    line = _model_line(exc)
    message = str(exc).strip()
    return type(exc).__name__ + (f": {message}" if message else "") + (f"\n  at {line}" if line else "")


def _trace_with_opaque_leaves(root: nn.Module, concrete, through: Optional[nn.Module] = None,
                              ) -> "tuple[Optional[fx.Graph], Optional[str], Dict[str, str]]":
    """Trace ``root``; while a submodule's ``forward`` fails, retry with it as a leaf.

    Returns ``(graph, error, opaque)``: the graph (``None`` when the model's own
    ``forward`` fails, with ``error`` saying why) and, per opaque module target in
    the graph, why fx could not trace it. Each retry adds one module, so at most
    one retry per submodule. ``through``: the model inside a holder ``root``, traced
    through as the root itself is (its own ``forward`` failing means no graph)."""
    opaque: Dict[int, str] = {}
    for _ in range(sum(1 for _ in root.modules()) + 1):
        tracer = Tracer(opaque, through=through)
        try:
            with LOCK, restored(root):  # (a cache the forward fills must not keep this trace's values)
                graph = tracer.trace(root, concrete_args=concrete)
        except Exception as exc:  # noqa: BLE001 - any tracing failure means "untraceable"
            failed = tracer.failed
            if failed is None or failed is root or failed is through or id(failed) in opaque:
                return None, _why(exc), {}
            opaque[id(tracer.failed)] = _why(exc)
            continue
        modules = dict(root.named_modules(remove_duplicate=False))
        targets = {n.target: opaque[id(modules[n.target])] for n in graph.nodes
                   if n.op == "call_module" and id(modules[n.target]) in opaque}
        return graph, None, targets
    # (each retry adds one installed module, so this is not reached; were it, the model has no graph)
    return None, "torch.fx kept failing with every submodule it could not trace made a leaf", {}  # pragma: no cover
