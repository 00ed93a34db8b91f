"""``curvature(..., compile=True)``: one compiled program per input signature.

The first call with a new *signature* (the modules' ``training`` flags, the shapes,
dtypes and devices of ``X``'s tensors, of ``y`` and of every parameter value, and
which parameters are wanted) checks everything as the eager call does, then traces
stages 4-7 of :mod:`curvlib._transform.entry` (forward, loss, backward, read-off, the
plain-autograd route) into one flat aten graph with ``make_fx`` on fake tensors and
hands it to ``torch.compile(fullgraph=True)``. Later calls with that signature run
the compiled program: no Python per site, no per-call state that could recompile.
Monte-Carlo draws are made eagerly before the program runs and passed in
(:mod:`curvlib._core.draws`), so the ``generator`` of an MC extension keeps its meaning.

What cannot be traced this way is refused at ``curvature`` time (:func:`check`) or
at the first call (dropout in training mode, inputs that require grad, untraced
models, torch.func transforms around ``f``).
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional

import torch
from torch import Tensor
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from .._plan import arguments as _arguments
from .._core import draws as _draws, inputs as _inputs
from ..losses import _targets
from .._core.buffers import SWAPS, split as split_buffers
from .._core.errors import CurvatureError, CurvatureTypeError
from .._core.sync import LOCK
from .._core.tensors import inside_transform
from .._plan.checks import plan_call
from .._plan.checks import CallContext
from .call import evaluate

__all__ = ["check", "CompiledCall"]

# A compiled program computes the extensions whose class says ``compiles`` (the GGN family and
# the Hessian diagonals; first order always). Tracing runs on fake tensors, so a traced quantity
# cannot depend on values read in Python: where values are unknown (the signs of the Hessian
# residuals' eigenvalues, of a weighted loss's scale) the traced code takes the
# value-independent path (both signed parts).


def check(compile: object, setup) -> Optional[dict]:
    """``compile``'s torch.compile options (``None``: eager), or a refusal naming what is not supported."""
    if compile is False or compile is None:
        return None
    if compile is True:
        compile = {}
    if not isinstance(compile, Mapping):
        raise CurvatureTypeError(f"compile must be True, False or a dict of torch.compile options, got {type(compile).__name__}.")
    if "fullgraph" in compile:
        raise CurvatureError("compile options: fullgraph is always True for curvature(..., compile=...); leave it out.")
    supported = ("the first-order extensions and DiagGGNExact, DiagGGNMC, BatchDiagGGNExact, BatchDiagGGNMC, "
                 "KFAC, KFLR, KFACEmpirical, SqrtGGNExact, SqrtGGNMC, DiagHessian, BatchDiagHessian")
    for ext in setup.second:
        if not type(ext).compiles:
            raise CurvatureError(
                f"curvature(..., compile=True) does not compile {type(ext).__name__}: supported are {supported}. "
                "Use compile=False (torch.compile(f) around it then runs the call eagerly, one graph break)."
            )
    if not setup.spec.structural:
        raise CurvatureError(
            f"curvature(..., compile=True) with lossfn {setup.spec.name}: only nn.MSELoss, nn.CrossEntropyLoss "
            "and nn.BCEWithLogitsLoss are compiled (a generic loss's per-sample check reads values). Use compile=False."
        )
    if setup.process_group is not None or setup.chunk_kinds is not None:
        raise CurvatureError("curvature(..., compile=True) does not combine with process_group or batch_chunk_size.")
    return dict(compile)


class _Program:
    """One signature's compiled program: flat inputs -> flat results.

    ``graph`` is the traced aten graph itself, run as it is (the same operations, not
    compiled) while a ``TorchDispatchMode`` is active (a ``FlopCounterMode``, an
    operator counter): Dynamo skips a frame under such a mode, which with
    ``fullgraph=True`` raises, and then refuses the frame for good.
    """

    def __init__(self, run, spec, recipes, graph=None):
        self.run, self.spec, self.recipes, self.graph = run, spec, recipes, graph

    def __call__(self, *flat):
        # (is_compiling first: under a user's compiled step Dynamo must not see `graph`,
        # the module `run` compiled, a second time)
        if not torch.compiler.is_compiling() and _dispatch_mode_active() and self.graph is not None:
            return self.graph(*flat)
        return self.run(*flat)


def _dispatch_mode_active() -> bool:
    return torch._C._len_torch_dispatch_stack() > 0


class CompiledCall:
    """``f(X, y, params=None, generator=None, buffers=None)`` running compiled programs (module doc)."""

    def __init__(self, call, options: dict):
        self.call, self.options = call, options
        self.programs: Dict[tuple, _Program] = {}
        _make_graph_breaks()
        self.buffer_names = frozenset(n for n, _ in call.setup.model.named_buffers())

    def __call__(self, X, y: Tensor, params: Optional[Mapping[str, Tensor]] = None, generator=None,
                 buffers: Optional[Mapping[str, Tensor]] = None):
        if torch.compiler.is_compiling():  # inside a user's compiled function: no checks, no builds
            params, buffers = self._split_unchecked(params, buffers)
            values, trainable = self._values(params)
            program = self.programs.get(self._signature(X, y, values, trainable))
            if program is None:
                program = _GRAPH_BREAKS["build"](self, X, y, params)
            return self._run(program, X, y, values, buffers)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise CurvatureError(f"generator must be a torch.Generator or None, got {type(generator).__name__}.")
        # the caller's buffers are inputs of the program like the model's (same shapes, checked)
        params, buffers = split_buffers(self.call.setup.model, params, buffers)
        values, trainable = _arguments.parameter_values(self.call.setup.model, params)
        key = self._signature(X, y, values, trainable)
        program = self.programs.get(key)
        if program is None:
            program = self.programs[key] = self._build(X, y, params)
        else:  # the per-call checks (cheap once planned: the plan is cached)
            self._checked(X, y, params)
        return self._run(program, X, y, values, buffers)

    def _split_unchecked(self, params, buffers):
        """:func:`curvlib._core.buffers.split` without its checks (inside a compiled step: they ran
        eagerly at the signature's first call)."""
        names = self.buffer_names
        if names and isinstance(params, Mapping) and any(k in names for k in params):
            buffers = {**(buffers or {}), **{k: v for k, v in params.items() if k in names}}
            params = {k: v for k, v in params.items() if k not in names}
        return params, buffers

    def _values(self, params):
        model = self.call.setup.model
        if params is None:
            return ({n: p.detach() for n, p in model.named_parameters()},
                    [n for n, p in model.named_parameters() if p.requires_grad])
        return ({n: (params[n] if n in params else p.detach()) for n, p in model.named_parameters()},
                [n for n, _ in model.named_parameters() if n in params])

    def _signature(self, X, y: Tensor, values: Dict[str, Tensor], trainable: List[str]) -> tuple:
        model = self.call.setup.model
        return (
            tuple(m.training for m in model.modules()),
            tuple((tuple(t.shape), t.dtype, t.device.type) for t in pytree.tree_leaves(X)),
            (tuple(y.shape), y.dtype),
            tuple((n, tuple(v.shape), v.dtype) for n, v in values.items()),
            tuple(trainable),
        )

    def _checked(self, X, y, params):
        """Stages 2-3 of the eager call (every refusal) and this call's trace and plan."""
        s = self.call.setup
        if inside_transform():
            raise CurvatureError("curvature(..., compile=True) cannot run inside a torch.func transform; use compile=False.")
        _inputs.check_input(X)
        values, trainable = _arguments.parameter_values(s.model, params)
        traced = s.traced(X)
        for c in traced.checks:
            c()
        plan, _ = plan_call(s.request, traced, X, values, trainable, y)
        if traced.runner is not None:
            raise CurvatureError("curvature(..., compile=True) needs a model curvlib traces (this one runs untraced).")
        if traced.dropout:
            raise CurvatureError("curvature(..., compile=True): dropout in training mode is not compiled; "
                                 "call model.eval() or use compile=False.")
        if torch.is_grad_enabled() and (any(t.requires_grad for t in _inputs.tensors(X))
                                        or any(v.requires_grad for v in values.values())):
            raise CurvatureError("curvature(..., compile=True) returns results that are not differentiable: "
                                 "pass X and params that do not require grad (or use compile=False).")
        return traced, plan, values, trainable

    def _build(self, X, y, params) -> _Program:
        """Trace stages 4-7 for this signature (twice with Monte-Carlo draws: to learn them, then
        with them as inputs) and compile the graph."""
        from torch.fx.experimental.proxy_tensor import make_fx  # lazy: only for compile=True

        traced, plan, values, trainable = self._checked(X, y, params)
        names, buffers = list(values), _buffers(self.call.setup)
        leaves, x_spec = pytree.tree_flatten(X)
        n_in = len(names) + len(buffers) + len(leaves) + 1
        out_spec: list = []

        def program(*flat):
            v = dict(zip(names, flat[:len(names)]))
            b = dict(zip(buffers, flat[len(names):len(names) + len(buffers)]))
            loss_module = self.call.setup.spec.module
            X_ = pytree.tree_unflatten(list(flat[len(names) + len(buffers):n_in - 1]), x_spec)
            y_ = flat[n_in - 1]
            # buffers (BatchNorm statistics) are inputs, not constants baked into the graph; other
            # threads' calls wait while they are swapped in (curvlib._core.buffers._Swaps)
            with SWAPS.write(), LOCK, \
                    _reparametrize_module(self.call.setup.model, {k[6:]: t for k, t in b.items() if k[0] == "m"}), \
                    _reparametrize_module(loss_module, {k[6:]: t for k, t in b.items() if k[0] == "l"}), \
                    _draws.recording(_draws.Tape(list(flat[n_in:]) or None)) as tape, torch.enable_grad():
                y_ = _targets.prepare_targets(self.call.setup.spec, y_)
                call = CallContext(traced, plan, X_, y_, v, tuple(trainable), seed=None, differentiable=False,
                                   negative=None, buffers=None)
                result = evaluate(self.call.setup, call)
            recipes.append(tape.recipes)
            out, spec = pytree.tree_flatten(result)
            out_spec.append(spec)
            return out

        flat = [values[n] for n in names] + list(buffers.values()) + leaves + [y]
        recipes: list = []
        graph = make_fx(program, tracing_mode="fake")(*flat)
        if recipes[-1]:  # Monte-Carlo: trace again with the draws as inputs
            draws = [torch.empty(shape, dtype=dtype, device=device) for _, shape, _, dtype, device in recipes[-1]]
            recipes.clear()
            graph = make_fx(program, tracing_mode="fake")(*flat, *draws)
        _drop_unused_queries(graph)
        compiled = torch.compile(graph, fullgraph=True, **device_options(self.options, leaves[0].device))
        return _Program(compiled, out_spec[-1], recipes[-1], graph)

    def _run(self, program: _Program, X, y, values, given: Optional[Mapping[str, Tensor]] = None):
        draws = _replay(program.recipes) if program.recipes else []
        buffers = _buffers(self.call.setup)
        buffers = list({**buffers, **{"model." + k: v for k, v in (given or {}).items()}}.values())
        flat = list(values.values()) + buffers + pytree.tree_leaves(X) + [y] + draws
        return pytree.tree_unflatten(program(*flat), program.spec)


def _drop_unused_queries(graph: torch.fx.GraphModule) -> None:
    """Remove unused aten queries that answer a ``bool`` (``is_same_size``,
    ``_has_same_storage_numel``). Double backward (the Hessian residuals' second
    derivatives) asks them; ``make_fx`` records the question, whose answer was already
    used while tracing, but Dynamo cannot put a ``bool`` into a graph, so
    ``fullgraph=True`` would fail on it."""
    for node in list(graph.graph.nodes):
        if node.op == "call_function" and not node.users and _answers_bool(node.target):
            graph.graph.erase_node(node)
    graph.recompile()


def _answers_bool(target) -> bool:
    returns = getattr(getattr(target, "_schema", None), "returns", None)
    return bool(returns) and all(str(r.type) == "bool" for r in returns)


#: inductor settings curvlib's programs get on CPU unless the caller sets them (with
#: inductor's defaults the exact GGN diagonal of a convolutional net compiles slower than
#: eager; with these it is faster; an MLP is unchanged by them)
CPU_INDUCTOR_DEFAULTS = {
    # Inductor converts convolutions to channels-last when it expects a win; for the
    # per-sample and per-column convolution backwards of these programs it loses on CPU.
    "layout_optimization": False,
    # Fusing at most two nodes a kernel stops inductor from summing all C columns'
    # squared per-sample weight gradients, Σ_c Σ_n R_{c,n}², in one loop that reads C
    # blocks of [N, *W] at once: every block would stay alive until that loop (C times
    # a convolution's per-sample weight gradients), out of cache; one column at a time,
    # like eager, wins.
    "max_fusion_size": 2,
}


def device_options(options: dict, device: torch.device) -> dict:
    """``options`` with :data:`CPU_INDUCTOR_DEFAULTS` for inductor on CPU (the caller's
    settings win; a ``mode`` excludes ``options`` in torch.compile, so it is left alone)."""
    if device.type != "cpu" or options.get("backend", "inductor") != "inductor" or "mode" in options:
        return options
    return {**options, "options": {**CPU_INDUCTOR_DEFAULTS, **options.get("options", {})}}


def _buffers(setup) -> Dict[str, Tensor]:
    """The model's buffers (``model.*``) and the loss module's (``loss..*``: ``weight``, ``pos_weight``)."""
    loss = setup.spec.module
    named = [("model." + n, b) for n, b in setup.model.named_buffers()]
    if isinstance(loss, torch.nn.Module):
        named += [("loss.." + n, b) for n, b in loss.named_buffers()]
    return {n: b for n, b in named if isinstance(b, Tensor)}


def _build_outside(compiled: CompiledCall, X, y, params) -> _Program:
    """A new signature met inside a user's compiled function: built eagerly (a graph break there)."""
    values, trainable = compiled._values(params)
    key = compiled._signature(X, y, values, trainable)
    program = compiled.programs[key] = compiled._build(X, y, params)
    return program


def _replay(recipes):
    if torch.compiler.is_compiling() and any(r[2] is not None for r in recipes):
        return _GRAPH_BREAKS["replay"](recipes)  # Dynamo cannot trace a torch.Generator: a graph break
    return _draws.replay(recipes)


#: ``_build_outside`` and draws' replay as graph breaks for Dynamo (``torch.compiler.disable``),
#: made when the first compiled call is set up: ``torch.compiler.disable`` imports torch._dynamo,
#: seconds that ``import curvlib`` does not pay.
_GRAPH_BREAKS: Dict[str, object] = {}


def _make_graph_breaks() -> None:
    if not _GRAPH_BREAKS:
        _GRAPH_BREAKS["build"] = torch.compiler.disable(_build_outside, recursive=True)
        _GRAPH_BREAKS["replay"] = torch.compiler.disable(_draws.replay, recursive=True)
