"""``curvature(model, lossfn, extensions)``: the transform, in visible stages.

The stages (numbered so in README.md, CONTRIBUTING.md and every module that names one):

1. **trace**, at ``curvature`` time (:class:`Setup`): the arguments checked
   (:mod:`curvlib._plan.arguments`) and the model traced once per ``training`` flags and
   input structure, with the refusals the trace shows (:mod:`curvlib._plan.traces`);

then per call of ``f(X, y, params=None, generator=None, buffers=None)`` (:class:`CurvatureCall`):

2. **inputs**: ``X``, ``y``, ``params`` and ``buffers`` checked (buffers:
   :mod:`curvlib._core.buffers`); every parameter's value;
3. **plan**: shapes and batch dimensions for this input signature (cached), and
   every refusal (targets, unsupported layers, memory) before any real work
   (:func:`curvlib._plan.checks.plan_call`);
4. **forward**: the linearised forward pass (:mod:`curvlib._evaluate.linearise`);
5. **loss and site gradients**: one backward from the loss to every site;
6. **first order** and 7. **second order** read off per-layer rules
   (:mod:`curvlib._transform.call`).

Nothing is stored on the model or the loss.
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .. import losses
from .._core import buffers as _buffers, dropout as _dropout, inputs as _inputs, outputs as _outputs
from .._core.errors import CurvatureError, CurvatureTypeError
from .._core.sync import prepare_forward_ad
from .._evaluate.first_order import reads
from .._interpret.diagnose import forward_failure, forward_mode_failure
from .._interpret.graph import NodeFailure
from .._plan import arguments as _arguments
from .._plan.checks import Request, cached_plan, plan_call
from .._evaluate.read_off import root_last
from .._core.site import uses_of
from .._plan.traces import Traced, Traces, warn_hooks
from .failures import internal_failure
from .._trace.branches import BranchChanged, batch_guard_values, check_branches_per_sample, guard_values_per_sample
from ..distributed import aggregated, result_kinds
from ..distributed.sharded import ShardedModel, batch_group, fsdp_mesh, sharded
from ..extensions import Extension, SecondOrder
from ..losses import _targets
from . import compiled as _compiled, wrappers as _wrappers
from .._plan.checks import CallContext
from .call import evaluate
from .chunking import check_batch_chunk_size, over_samples

__all__ = ["curvature", "Setup", "CurvatureCall"]


def curvature(
    model: nn.Module,
    lossfn: Union[nn.Module, Callable],
    extensions: Sequence[Extension] = (),
    process_group: object = None,
    chunk_size: Union[int, str, None] = "auto",
    batch_chunk_size: Optional[int] = None,
    compile: Union[bool, Mapping[str, object]] = False,
    output: Union[None, str, int, Callable] = None,
) -> Callable[..., Dict[str, object]]:
    r"""Turn a model and a loss into a function returning gradients and curvature.

    ``qs = curvature(model, lossfn, [ext, ...])(X, y)`` is a plain dict: ``qs["loss"]``
    (0-dim), ``qs["grad"]`` and ``qs[ext.name]`` per extension (parameter name -> quantity;
    BackPACK's keys: ``grad_batch``, ``diag_ggn_exact``, ``kflr``, ...). For the loss
    $L = c \sum_n \ell(f(x_n), y_n)$ (``c = 1/N`` for ``"mean"``) the individual gradients
    $g_n = \partial (c\, \ell_n) / \partial \theta$ sum to the gradient; docs/conventions.md has every formula.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import BatchGrad, DiagGGNExact
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [BatchGrad(), DiagGGNExact()])(X, y)
        >>> qs["grad_batch"]["0.weight"].shape, qs["diag_ggn_exact"]["0.weight"].shape
        (torch.Size([5, 4, 3]), torch.Size([4, 3]))

    Args:
        model: an ``nn.Module`` treating samples independently (batch in dim 0); traced once
            per ``training`` flags, never changed, its hooks not run.
        lossfn: ``nn.MSELoss``, ``nn.CrossEntropyLoss``, ``nn.BCEWithLogitsLoss`` (closed
            forms) or any per-sample loss ``lossfn(output, y)`` (see ``curvlib.losses``).
        extensions: instances from ``curvlib.extensions``.
        process_group: ``torch.distributed`` group: global-batch results on every rank.
        chunk_size: columns pulled back at once (``"auto"``: a memory budget; ``None``: all).
        batch_chunk_size: samples per slice; the slices' results are combined.
        compile: ``True`` or ``torch.compile`` options: one compiled graph per input signature.
        output: the tensor of a container output the loss takes (name, position, callable).

    Returns:
        ``f(X, y, params=None, generator=None, buffers=None)``: ``params``/``buffers`` replace
        the model's (results for exactly ``params``' entries, else every trainable parameter);
        ``generator`` draws dropout masks. ``f`` is pure: ``vmap`` and derivatives of results
        are exact (docs/transform.md, docs/composing.md, docs/large-models.md: the knobs).

    Raises:
        CurvatureTypeError: an argument has the wrong type.
        CurvatureError: anything else curvlib cannot handle, named in the message.
    """
    mesh = fsdp_mesh(model) if isinstance(model, nn.Module) else None
    if mesh is not None:
        return _on_shards(model, mesh, (lossfn, extensions), (process_group, chunk_size, batch_chunk_size, compile, output))
    setup = Setup(model, lossfn, extensions, process_group, chunk_size, batch_chunk_size, output)
    options = _compiled.check(compile, setup)
    prepare_forward_ad()  # torch's own one-time jvp set-up warns; not inside the user's call
    return _wrapped(CurvatureCall(setup), setup, options, batch_chunk_size, process_group)


def _on_shards(model: nn.Module, mesh, problem, options) -> Callable[..., Dict[str, object]]:
    """:func:`curvature` of a model sharded with FSDP's ``fully_shard`` over ``mesh``: of its
    twin with the parameters gathered layer by layer, aggregated over the mesh's ranks, summed
    results sharded like the parameters (:mod:`curvlib.distributed.sharded`)."""
    (lossfn, extensions), (process_group, chunk_size, batch_chunk_size, compile, output) = problem, options
    if process_group is not None:
        raise CurvatureError(
            "curvature(..., process_group=...) on a model sharded with fully_shard: f is a collective over "
            "the model's device mesh already (every rank passes its own batch); leave process_group out.")
    if compile:
        raise CurvatureError("curvature(..., compile=True) does not take a model sharded with fully_shard.")
    twin = ShardedModel(model, mesh)
    f = curvature(twin.module, lossfn, extensions, batch_group(mesh), chunk_size, batch_chunk_size, False, output)
    # (a gather is a collective: none in what runs as many times as the rank's batch asks, the
    # batch slices' forwards and the Hessian's backwards)
    hessian = any(getattr(e, "hessian", False) for e in extensions or ())
    when = "call" if batch_chunk_size is not None else "forward" if hessian else "layers"
    return _wrappers.public(sharded(f, twin, result_kinds(extensions), when), curvature.__doc__)


def _wrapped(f: "CurvatureCall", setup: "Setup", options, batch_chunk_size, process_group) -> Callable[..., Dict[str, object]]:
    """The call as users get it: compiled, or in batch slices and aggregated over ranks, with
    the parameter names of a ``torch.compile``d model's original module."""
    if options is not None:
        f = _compiled.CompiledCall(f, options)
        return _wrappers.renamed(f, setup.prefix, setup.model) if setup.prefix else f
    # a diagonal factor side makes the root factor's place a fact of the sites, not the shapes
    roots = f.kron_root_last if any(e.options.max_factor_dim for e in setup.exts) else None
    if setup.chunk_kinds is not None:
        f = over_samples(f, setup.spec, setup.computed, batch_chunk_size, root_last=roots)
    if process_group is not None:
        f = aggregated(f, setup.spec, setup.computed, process_group, root_last=roots,
                       sliced=setup.chunk_kinds is not None)
    if len(setup.computed) > len(setup.exts):
        f = _without(f, {e.name for e in setup.computed[len(setup.exts):]})
    if setup.prefix:
        f = _wrappers.renamed(f, setup.prefix, setup.model)
    return _wrappers.public(f, curvature.__doc__)


def _without(f: Callable[..., Dict[str, object]], names) -> Callable[..., Dict[str, object]]:
    """``f`` without the results ``names`` (computed only to form another quantity's totals)."""

    def g(*args, **kwargs) -> Dict[str, object]:
        return {key: value for key, value in f(*args, **kwargs).items() if key not in names}

    return g


# ----------------------------------------------------------------------------- setup


class Setup:
    """``curvature``'s arguments, checked, and the model's traces."""

    def __init__(self, model, lossfn, extensions, process_group, chunk_size, batch_chunk_size, output=None):
        if not isinstance(model, nn.Module):
            raise CurvatureTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        self.model, self.prefix = _arguments.unwrap_compiled(model)
        self.spec = losses.loss_spec(lossfn)
        self.exts = _arguments.check_extensions(extensions)
        _arguments.warn_linear_loss(self.spec, self.exts)
        _arguments.check_chunk_size(chunk_size)
        self.chunk_size = chunk_size
        self.computed = self._computed(batch_chunk_size is not None or process_group is not None)
        self.first = [e for e in self.computed if not isinstance(e, SecondOrder)]
        self.second = [e for e in self.computed if isinstance(e, SecondOrder)]
        unknown = [e for e in self.first if not reads(e)]
        if unknown:
            raise CurvatureError(f"Extension {unknown[0]!r} is not a curvlib extension this version computes.")
        self.chunk_kinds = None
        if batch_chunk_size is not None:
            self.chunk_kinds = check_batch_chunk_size(batch_chunk_size, self.computed, self.spec)
        if process_group is not None and not self.spec.structural:
            raise CurvatureError(
                f"process_group with lossfn {self.spec.name}: curvlib aggregates over ranks by the "
                "normaliser of nn.MSELoss, nn.CrossEntropyLoss and nn.BCEWithLogitsLoss, which it cannot "
                "know for another loss. Use one of those, or compute per rank and sum yourself."
            )
        self.process_group = process_group
        self.output = _outputs.check_selector(output)
        self.request = Request(self.spec, self.computed, batch_chunk_size is not None)
        self.traces = Traces(self.model, self.second, self.output)
        self.dropout_warned = False
        warn_hooks(self.model)
        try:
            self.traced()  # trace now: untraceable models and unsupported graphs fail at once
        except Exception as exc:
            failure = internal_failure(exc, self.model)
            if failure is None:
                raise
            raise failure from exc

    def _computed(self, combined: bool) -> tuple:
        """The requested extensions and, where slices or ranks combine the results, those a
        formed quantity ``needs`` (they combine exactly; it is formed once from the totals)."""
        exts, names = tuple(self.exts), {e.name for e in self.exts}
        extra = []
        for need in (need for e in exts for need in e.needs) if combined else ():
            if need.name not in names:
                names.add(need.name)
                extra.append(need())
        return exts + tuple(extra)

    def traced(self, X=None) -> Traced:
        """The model's trace for ``X`` (see :class:`curvlib._plan.traces.Traces`)."""
        return self.traces.get(X)


# ----------------------------------------------------------------------------- one call


class CurvatureCall:
    """``f(X, y, params=None, generator=None, buffers=None)`` of one :func:`curvature` (module doc, stages 2-7)."""

    def __init__(self, setup: Setup):
        self.setup = setup

    def __call__(self, X, y: Tensor, params: Optional[Mapping[str, Tensor]] = None,
                 generator: Optional[torch.Generator] = None, buffers: Optional[Mapping[str, Tensor]] = None,
                 _into=None) -> Dict[str, object]:
        """``_into``: the batch's square-root buffers when this is a slice of it (:mod:`curvlib._transform.chunking`)."""
        try:
            try:
                return self._run(X, y, params, generator, buffers, _into)
            except BranchChanged:
                # the model's code took another branch on this input's values than on the traced
                # one's (curvlib._trace.branches.input_branch): trace it again on this input
                self.setup.traces.forget_aten()
                return self._run(X, y, params, generator, buffers, _into)
        except Exception as exc:
            failure = internal_failure(exc, self.setup.model)
            if failure is None:
                raise
            raise failure from exc

    def _run(self, X, y, params, generator, buffers, _into) -> Dict[str, object]:
        s = self.setup
        call = self.context(X, y, params, generator, buffers, _into)
        # planned with the model's buffers (same shapes); run with the caller's
        with _buffers.using(s.model, call.buffers):
            try:
                return evaluate(s, call)
            except (NodeFailure, NotImplementedError) as exc:
                raise self.failure(call, exc) from exc

    def failure(self, call: CallContext, exc: Exception) -> Exception:
        """The error to raise for ``exc`` from running ``call``'s forward: a clear one for a
        forward-mode gap or a node that fails on real values (the shape passes did not), else ``exc``."""
        forward_mode = forward_mode_failure(exc, ", ".join(type(e).__name__ for e in self.setup.second) or "products")
        if forward_mode is not None:
            return forward_mode
        if not isinstance(exc, NodeFailure):
            return exc
        return forward_failure(call.traced.program, call.X, call.values, exc, _inputs.batch_size(call.X))

    def context(self, X, y, params=None, generator=None, buffers=None, _into=None) -> CallContext:
        """Stages 2-3 for ``f(X, y, ...)``: the inputs checked, the plan and every refusal."""
        s = self.setup
        _inputs.check_input(X)
        params, buffers = _buffers.split(s.model, params, buffers)
        _buffers.refuse_unbuffered(s.model, params, buffers)
        values, trainable = _arguments.parameter_values(s.model, params)
        traced = s.traced(X)
        for check in traced.checks:  # (the eager runner checks modules as they are called)
            check()
        if getattr(traced.program.graph, "curvlib_guarded", False):
            per_sample = guard_values_per_sample(traced.program, X)
            batch_values = batch_guard_values(traced.program)
            if per_sample is None or any(v != batch_values for v in per_sample):  # (forwards of the model)
                check_branches_per_sample(s.model, X, s.output, per_sample, batch_values)
        plan, negative = plan_call(s.request, traced, X, values, trainable, y)
        seed = self._dropout_seed(traced, generator)
        differentiable = torch.is_grad_enabled() and (
            any(t.requires_grad for t in _inputs.tensors(X)) or any(v.requires_grad for v in values.values())
        )
        return CallContext(traced, plan, X, _targets.prepare_targets(s.spec, y), values, tuple(trainable),
                           seed, differentiable, negative, buffers, _into)

    def kron_root_last(self, X, params: Optional[Mapping[str, Tensor]] = None) -> Dict[str, bool]:
        """Parameter name -> whether its Kronecker root factor is the last (Embedding's layout),
        read off the sites of ``X``'s (cached) plan: :func:`curvlib._evaluate.read_off.root_last`."""
        params, _ = _buffers.split(self.setup.model, params, None)
        values, trainable = _arguments.parameter_values(self.setup.model, params)
        plan = cached_plan(self.setup.traced(X), X, values, frozenset(trainable))
        uses = uses_of(plan.sites)
        return {name: root_last(uses, name) for name in trainable if name in uses}

    def _dropout_seed(self, traced: Traced, generator: Optional[torch.Generator]) -> Optional[int]:
        """One draw for this call's dropout masks (``None`` without active dropout)."""
        if generator is not None and not isinstance(generator, torch.Generator):
            raise CurvatureError(f"generator must be a torch.Generator or None, got {type(generator).__name__}.")
        if not traced.dropout:
            return None
        if not self.setup.dropout_warned:
            self.setup.dropout_warned = True
            warnings.warn(_dropout.warning(traced.dropout), UserWarning, stacklevel=3)
        return _dropout.draw_seed(generator)
