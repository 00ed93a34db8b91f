"""Stage 1 of :func:`curvlib.curvature` (:mod:`curvlib._transform.entry`): trace the model
once per ``training`` flags and input structure, and refuse, before any call, what the trace
shows cannot be computed (an untraceable model for second order, a branching graph for KFRA,
a custom ``autograd.Function`` lacking what torch.func needs). User forward hooks are not run
(they are not part of the math): say so once.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.autograd.function import _is_setup_context_defined
from torch import Tensor, fx, nn

from .._core import dropout as _dropout, settings
from .._hessian import residuals as _residuals
from .._core.errors import CurvatureError
from .._trace.graph_facts import chain_nodes, has_inplace
from .plan import Plan, module_checks
from ..rules import subclassed
from .._trace.aten import trace_aten_pair
from .._trace.module_calls import orders_by_value
from .._core.inputs import keyword_inputs, structure_key, tensors
from .._core.outputs import say_choice
from .._core.sync import LOCK
from .._trace.program import Program, assemble, trace_program
from .._trace.untraced import run_eager
from ..extensions import SecondOrder
from ..rules import math_hooks

__all__ = ["Traced", "Traces", "trace", "warn_hooks", "warn_opaque"]


@dataclass
class Traced:
    """Everything derived from one trace of the model (per combination of ``training`` flags)."""

    program: Program
    runner: Optional[Callable]
    checks: List[Callable[[], None]]
    direct: bool
    residual_nodes: dict
    dropout: List[str]
    plans: Dict[tuple, Plan] = field(default_factory=dict)
    checked: Dict[int, Tensor] = field(default_factory=dict)  # id(plan) -> meta output, once its checks passed
    pending: bool = False  # torch.fx could not follow the model: traced at the ATen level on each input signature


class Traces:
    """A model's traces: one per ``training`` flags and input structure (torch.fx bakes
    ``self.training`` in), and, for a model torch.fx cannot follow, one ATen-level trace per
    input signature (:mod:`curvlib._trace.aten` bakes shapes in)."""

    def __init__(self, model: nn.Module, second: Sequence[SecondOrder], output):
        self.model, self.second, self.output = model, second, output
        self._symbolic: Dict[tuple, Traced] = {}
        self._aten: Dict[tuple, Traced] = {}
        self.opaque_warned = self.output_said = False

    def get(self, X=None) -> Traced:
        """The trace for ``X`` (``None``: its structure is one tensor; traced once at setup)."""
        key = (tuple(m.training for m in self.model.modules()), structure_key(X))
        traced = self._symbolic.get(key)
        if traced is None:
            with LOCK:  # reads the module tree, whose slots another thread's call may have swapped
                traced = self._symbolic[key] = trace(self.model, self.second, X, self.output)
        if traced.pending and X is not None:
            key = key + (tuple((tuple(t.shape), t.dtype, t.device.type) for t in tensors(X)),)
            traced = self._aten.get(key)
            if traced is None:
                with LOCK:
                    traced = self._aten[key] = trace(self.model, self.second, X, self.output, real_input=True)
                if traced.program.output_choice and self.output is None and not self.output_said:
                    self.output_said = True  # say once which tensor of a container output the loss takes
                    say_choice(traced.program.output_choice)
        if traced.program.opaque and not self.opaque_warned and not traced.pending:
            self.opaque_warned = True
            warn_opaque(traced.program)
        return traced

    def forget_aten(self) -> None:
        """Drop the ATen-level traces (an input's values took another branch than the traced one's)."""
        with LOCK:
            self._aten.clear()


def warn_hooks(model: nn.Module) -> None:
    """Say once which user forward hooks curvlib does not run (they may change outputs)."""
    hooked = []
    for path, m in model.named_modules():
        hooks = [h for h in list(m._forward_hooks.values()) + list(m._forward_pre_hooks.values())
                 if h not in math_hooks(m) and not _library_hook(h)]
        if hooks:
            hooked.append(f"'{path or type(m).__name__}' ({type(m).__name__})")
    if hooked:
        warnings.warn(
            f"curvlib does not run the forward hooks of {', '.join(hooked[:3])}{', ...' if len(hooked) > 3 else ''}: "
            "hooks are not part of the math, every module runs its own forward. A hook that changes a "
            "module's input or output is therefore not seen; fold such a change into the module's forward.",
            UserWarning, stacklevel=3,
        )


def warn_opaque(program: Program) -> None:
    """Say once per trace which submodules torch.fx could not trace, and what that means."""
    modules = dict(program.root.named_modules(remove_duplicate=False))
    lines = []
    for target, why in program.opaque.items():
        path = target[len(program.prefix):] if target.startswith(program.prefix) else target
        owns = any(True for _ in modules[target].parameters())
        role = "one layer (generic rule)" if owns else "a parameter-free operation"
        lines.append(f"  '{path}' ({type(modules[target]).__name__}), {role}: {why.splitlines()[0]}"
                     + "".join(f"\n  {rest.strip()}" for rest in why.splitlines()[1:]))
    warnings.warn(
        "torch.fx could not trace the forward of these submodules; curvlib treats each as one opaque "
        "graph node, run as it is (exact results for the branch each call takes; KFAC/KFLR/KFRA are "
        "refused for parameters inside them):\n" + "\n".join(lines),
        UserWarning, stacklevel=6,  # warn_opaque, Traces.get, Setup.traced, Setup, curvature, the user's line
    )


def _library_hook(hook) -> bool:
    """Observer hooks other libraries leave behind (BackPACK's input/output store, laplace's feature recorder)."""
    module = getattr(hook, "__module__", "") or ""
    return module.split(".")[0] in ("backpack", "laplace", "curvlinops", "opacus")


def needs_aten(program: Program, model: nn.Module, X) -> bool:
    """Whether the model needs the ATen-level front end (:mod:`curvlib._trace.aten`): torch.fx could
    not trace its ``forward``, left a submodule opaque, ``X`` holds keyword inputs, or a layer is a
    subclass of a family's class with its own ``forward`` (timm's ``LayerNorm2d``), which only
    the generic rule could run whole, or the graph sorts or counts values (a mixture of experts
    sorting the batch's token rows by expert: the ATen-level trace keeps the module around such a
    sort whole when it reorders rows across the batch, :mod:`curvlib._trace.module_calls`)."""
    return (program.graph is None or bool(program.opaque) or (X is not None and keyword_inputs(model, X))
            or any(layer.family.runs_own_code and subclassed(layer.module) for layer in program.layers.values())
            or any(_kept_whole(use.node) for use in program.functional.values())
            or any(orders_by_value(node) for node in program.graph.nodes))


#: Modules whose functions torch.fx records as they are (ops, not user code kept whole).
_LIBRARY_ROOTS = frozenset({"torch", "_operator", "operator", "builtins", "math", "curvlib"})


def _kept_whole(node: fx.Node) -> bool:
    """A Python function torch.fx kept whole (``torch.fx.wrap``: torchvision's
    ``shifted_window_attention``) that reads parameters: one generic site, whose ``F.linear``
    calls inside get no Kronecker factors; at the ATen level they are Linear sites. A custom
    ``autograd.Function`` (``.function``) stays on the fx trace."""
    target = node.target
    root = (getattr(target, "__module__", None) or "").split(".")[0]
    return node.op == "call_function" and not hasattr(target, "function") and root not in _LIBRARY_ROOTS


def trace(model: nn.Module, second: Sequence[SecondOrder], X=None, output=None, real_input: bool = False) -> Traced:
    """The model's trace. ``real_input``: ``X`` is a real input (not only its structure), so that a
    model torch.fx cannot follow is traced at the ATen level on it; otherwise such a model's
    trace is marked ``pending`` (traced again on the first call's input)."""
    program = trace_program(model, X if not real_input else _structure_only(X), output)
    pending = settings.current().aten_front_end and needs_aten(program, model, X)
    aten_error = ""
    if pending and real_input:
        program, aten_error = _aten_level(program, model, X, output, bool(second))
    elif pending:
        return Traced(program=program, runner=None, checks=[], direct=True, residual_nodes={}, dropout=[],
                      pending=True)
    if second and program.graph is None:
        raise CurvatureError(
            f"{type(second[0]).__name__} needs the model's computation graph, but model "
            f"{type(model).__name__} could not be traced with torch.fx:\n  {program.trace_error}\n"
            + (f"nor at the ATen level: {aten_error}\n" if aten_error else "")
            + "First-order extensions do not need the graph."
        )
    if any(e.recursion for e in second):
        chain_nodes(program)  # refuse branching graphs before any work
    hessian = any(e.hessian for e in second)
    traced = program.graph is not None
    if traced:
        _refuse_unsupported_functions(program, second)
    return Traced(
        program=program,
        runner=None if traced else run_eager,
        checks=module_checks(program) if traced else [],
        direct=not has_inplace(program),  # differentiate w.r.t. site outputs, not zero probes
        residual_nodes=_residuals.residual_plan(program, fuse=not any(e.residuals_per_node for e in second))
        if hessian else {},
        dropout=_dropout.active(program),
    )


def _aten_level(program: Program, model: nn.Module, X, output, second: bool) -> "tuple[Program, str]":
    """``(program, why the ATen-level trace failed or "")``: the model traced at the ATen level
    on ``X`` (with its batch-of-N + 1 sibling), or, when that fails, the symbolic trace to keep
    (keyword inputs included: torch.fx traced ``model(**X)``). With keyword inputs and only
    first-order extensions (``second`` false), a symbolic trace with opaque submodules is not kept:
    the model runs eagerly, called with ``X`` as keywords, which needs no module to return one tensor."""
    try:
        return trace_aten_pair(model, X, output), ""
    except CurvatureError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model's forward or make_fx failed: keep fx's trace
        aten_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if not second and program.opaque and keyword_inputs(model, X):
        program = assemble(program.root, program.prefix, None, "torch.fx left submodules opaque", {},
                           program.param_names, program.leaf_inputs)
        program = dataclasses.replace(program, selector=output)
    return program, aten_error


def _structure_only(X):
    """``X`` for torch.fx's symbolic trace: ``None`` for a tensor (its structure is that of one argument)."""
    return None if isinstance(X, torch.Tensor) else X


# What torch.func needs of a custom autograd.Function: an extension's ``function_needs``.
_ONCE_DIFFERENTIABLE = torch.autograd.function.once_differentiable(lambda ctx, *g: g).__code__
_LACKS = {
    "setup_context": "a setup_context staticmethod (forward without ctx)",
    "vmap": "a vmap staticmethod or generate_vmap_rule = True",
    "jvp": "a jvp staticmethod (forward-mode AD)",
    "twice": "a backward that is not @once_differentiable (its second derivative)",
}


def _function_lacks(fn: type) -> set:
    lacks = set()
    if not _is_setup_context_defined(fn.setup_context):
        lacks.add("setup_context")
    if not getattr(fn, "generate_vmap_rule", False) and "vmap" not in vars(fn) and \
            not any("vmap" in vars(c) for c in fn.__mro__[1:] if c not in (torch.autograd.Function,)):
        lacks.add("vmap")
    if fn.jvp is torch.autograd.Function.jvp:
        lacks.add("jvp")
    if getattr(fn.backward, "__code__", None) is _ONCE_DIFFERENTIABLE:
        lacks.add("twice")
    return lacks


def _refuse_unsupported_functions(program: Program, exts: Sequence[SecondOrder]) -> None:
    """Refuse, before any work, an extension that needs of a custom ``autograd.Function``
    what it does not define (``function_needs``). Differentiating a
    ``@once_differentiable`` backward again is not defined (its code may leave autograd,
    e.g. numpy or a custom kernel), so any value would be a guess."""
    exts = [e for e in exts if type(e).function_needs]
    if not exts:
        return
    for node in program.graph.nodes:
        fn = getattr(node.target, "function", None) if node.op == "call_function" else None
        if fn is None:
            continue
        lacks = _function_lacks(fn)
        for ext in exts:
            missing = [_LACKS[k] for k in type(ext).function_needs if k in lacks]
            if missing:
                raise CurvatureError(
                    f"{type(ext).__name__} runs the custom autograd.Function {fn.__qualname__} (graph node "
                    f"'{node.name}') under torch.func transforms, which needs {'; '.join(missing)}. "
                    "Add them (https://pytorch.org/docs/stable/notes/extending.func.html), or use the "
                    "first-order and GGN extensions (DiagGGNExact, KFLR, SqrtGGNExact, ...), which use "
                    "only its backward."
                )
