"""``curvature(model, lossfn, extensions)``: the transform, in visible stages.

At ``curvature`` time: check the arguments and trace the model (:class:`_Setup`,
:mod:`curvlib._tracing`).
Per call of ``f(X, y, params=None, generator=None, buffers=None)`` (:class:`_Call`):

1. **inputs**: ``X``, ``y``, ``params`` and ``buffers`` checked (buffers:
   :mod:`curvlib._buffers`); every parameter's value;
2. **plan**: shapes and batch dimensions for this input signature (cached), and
   every refusal (targets, unsupported layers, memory) before any real work;
3. **forward**: the linearised forward pass (:mod:`curvlib._engine`);
4. **loss and site gradients**: one backward from the loss to every site;
5. **first order** and 6. **second order** read off per-layer rules.

Nothing is stored on the model or the loss.
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from . import _arguments, _budget, _buffers, _compiled, _dropout, _inputs, _outputs, _strategy, _targets, _wrappers, losses
from ._core import is_concrete
from ._branches import BranchChanged, batch_guard_values, check_branches_per_sample, guard_values_per_sample
from ._diagnose import forward_failure, forward_mode_failure
from ._independence import refuse_mixing
from ._engine import forward_with_probes
from ._firstorder import FIRST_ORDER, first_order, first_order_streamed, streams
from ._graph import NodeFailure
from ._plan import Plan, make_plan
from ._errors import CurvatureError, CurvatureTypeError
from ._kfra import kfra
from ._products import products, rng_state
from ._secondorder import second_order
from ._support import check_second_order
from ._budget import check_factor_sizes, refuse_combined
from ._tracing import Traced, Traces, warn_hooks
from ._sync import prepare_forward_ad
from .extensions._base import Extension
from .rules.generic import refuse_buffer_updates
from .extensions.secondorder import SecondOrder
from ._chunking import over_samples
from .distributed import aggregated
from ._loss_generic import check_per_sample
from .distributed import kfra_reducer
from ._chunking import check_batch_chunk_size
from .extensions import SumGradSquared

__all__ = ["curvature"]


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
    """Turn a model and a loss into a function returning gradients and curvature.

    ``f = curvature(model, lossfn, [ext, ...])``; ``qs = f(X, y)`` is a plain
    dict: ``qs["loss"]`` (0-dim, ``lossfn(model(X), y)``), ``qs["grad"]``
    (parameter name -> gradient, autograd's) and ``qs[ext.name]`` for every
    extension (parameter name -> quantity; the keys are BackPACK's attribute
    names: ``grad_batch``, ``diag_ggn_exact``, ``kflr``, ...). With the loss
    ``L = c·Σ_n ℓ(f(x_n), y_n)`` (``c = 1/N`` for ``reduction="mean"`` over
    ``N`` samples), the individual gradients ``g_n = ∂(c·ℓ_n)/∂θ`` sum to the
    gradient and the GGN is ``Σ_n J_nᵀ (c∇²ℓ_n) J_n``; see each extension's
    docstring and docs/conventions.md.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import BatchGrad, DiagGGNExact
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> f = curvature(model, nn.CrossEntropyLoss(), [BatchGrad(), DiagGGNExact()])
        >>> qs = f(X, y)
        >>> sorted(qs)
        ['diag_ggn_exact', 'grad', 'grad_batch', 'loss']
        >>> qs["grad_batch"]["0.weight"].shape            # [N, *p.shape]
        torch.Size([5, 4, 3])
        >>> qs["diag_ggn_exact"]["0.weight"].shape        # p.shape
        torch.Size([4, 3])
        >>> params = {k: v.detach() * 2 for k, v in model.named_parameters()}
        >>> f(X, y, params=params)["grad"]["2.bias"].shape   # at other parameter values
        torch.Size([2])

    Args:
        model: any ``nn.Module`` whose forward treats samples independently
            (the batch in dim 0 of its input and output). It is traced once per
            combination of its modules' ``training`` flags and never changed; a
            module compiled by ``torch.compile`` is differentiated through its original module.
            Hooks registered on its modules are not run (they are not part of the math).
        lossfn: a per-sample loss: ``nn.MSELoss``, ``nn.CrossEntropyLoss``
            (``weight``, ``ignore_index``, ``label_smoothing``, class indices or
            probabilities) and ``nn.BCEWithLogitsLoss`` (``weight``, ``pos_weight``)
            with ``reduction="mean"`` or ``"sum"`` (closed forms), or any loss module
            or function ``lossfn(output, y)`` that sums or averages per-sample terms
            (exact Hessians by autodiff; see ``curvlib.losses``).
        extensions: instances from ``curvlib.extensions``.
        process_group: a ``torch.distributed`` process group: every rank calls
            ``f`` on its local batch and gets the quantities of the global batch
            (see ``curvlib.distributed``). ``None``: one process.
        chunk_size: at most this many columns (classes, Monte-Carlo samples,
            residual columns) are pulled back through the model at once, which
            bounds the memory of the exact second-order quantities; the results
            do not depend on it. ``"auto"`` (default): as many as fit in 256 MiB
            of pulled-back site outputs under the "batched" strategy (the CUDA
            default; there up to 1/8 of the free device memory when that is more),
            32 MiB under "looped" (the CPU default) unless a batch diagonal is
            requested (``curvlib.strategy`` picks the strategy).
            ``None``: all at once.
        batch_chunk_size: at most this many samples are processed at once; the
            slices' results are combined into the whole batch's (sums add,
            per-sample rows are concatenated, ``"mean"`` factors are those of the whole
            batch). Not for KFRA and the block products.
        compile: ``True`` (or a dict of ``torch.compile`` options, e.g. ``{"mode":
            "max-autotune"}``): each input signature's call is traced once into one
            graph and compiled with ``torch.compile(fullgraph=True)`` (first order, the
            GGN family and the Hessian diagonals; see docs/large-models.md, "Compiled calls").
            Results are then not differentiable; KFRA and the block products are refused.
        output: which tensor of a container output (``ModelOutput``, dataclass, tuple,
            dict) the loss takes: a name, a position or a callable ``out -> Tensor``;
            default: the entry named ``logits``, else the first tensor (said once).

    Returns:
        ``f(X, y, params=None, generator=None, buffers=None)`` returning a plain dict
        with ``"loss"`` (0-dim), ``"grad"`` (name -> gradient) and, per extension,
        ``ext.name`` (name -> quantity). ``X`` is a tensor, or a dict/tuple of
        tensors passed to the model as one argument, all with the batch in dim 0.
        ``params`` (name -> tensor) replaces the model's parameters; quantities are
        then returned for exactly its entries, otherwise for every parameter with
        ``requires_grad=True`` (a frozen parameter gets no entry). ``buffers``
        (name -> tensor, as ``model.named_buffers()``; the second output of
        ``torch.func.stack_module_state``) replaces the model's buffers, e.g.
        BatchNorm's running statistics (default: the model's own); buffer entries
        may also be put into ``params``; no result has a buffer entry. ``generator``
        draws the dropout masks of a model in training mode (default: the global
        random state). ``f`` is a pure function of ``(X, y, params, buffers)``:
        ``torch.func.vmap`` (over stacked ``params`` and ``buffers``, a task dim of
        ``X``/``y``, or both; vmapped ``params`` without the buffers the forward reads
        are refused) and derivatives of results (``grad``, ``jvp``, ``jacrev``,
        ``hessian``, or ``params``/``X`` that require grad) are exact, PCHMP's
        derivatives refused: see docs/composing.md.
        The model's own parameters are read detached. ``f`` may be called from
        several threads.

    Raises:
        CurvatureTypeError: an argument has the wrong type.
        CurvatureError: anything else curvlib cannot handle, named in the message.
    """
    setup = _Setup(model, lossfn, extensions, process_group, chunk_size, batch_chunk_size, output)
    options = _compiled.check(compile, setup)
    prepare_forward_ad()  # torch's own one-time jvp set-up warns; not inside the user's call
    f: Callable[..., Dict[str, object]] = _Call(setup)
    if options is not None:
        f = _compiled.CompiledCall(f, options)
        return _wrappers.renamed(f, setup.prefix, setup.model) if setup.prefix else f
    if setup.chunk_kinds is not None:
        f = over_samples(f, setup.spec, setup.chunk_kinds, batch_chunk_size, drop=setup.computed[len(setup.exts):])
    if process_group is not None:
        f = aggregated(f, setup.spec, setup.exts, process_group)
    if setup.prefix:
        f = _wrappers.renamed(f, setup.prefix, setup.model)
    return _wrappers.public(f, curvature.__doc__)


# ----------------------------------------------------------------------------- setup


class _Setup:
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
        self.computed = self._computed(batch_chunk_size)
        self.first = [e for e in self.computed if not isinstance(e, SecondOrder)]
        self.second = [e for e in self.computed if isinstance(e, SecondOrder)]
        unknown = [e for e in self.first if e.name not in FIRST_ORDER]
        if unknown:
            raise CurvatureError(f"Extension {unknown[0]!r} is not a curvlib extension this version computes.")
        self.chunk_kinds = None
        if batch_chunk_size is not None:
            self.chunk_kinds = check_batch_chunk_size(batch_chunk_size, self.computed, self.spec)
        if process_group is not None and self.spec.kind == "generic":
            raise CurvatureError(
                f"process_group with lossfn {self.spec.name}: curvlib aggregates over ranks by the "
                "normaliser of nn.MSELoss, nn.CrossEntropyLoss and nn.BCEWithLogitsLoss, which it cannot "
                "know for another loss. Use one of those, or compute per rank and sum yourself."
            )
        self.process_group = process_group
        refuse_combined(self.exts, batch_chunk_size, process_group)
        self.output = _outputs.check_selector(output)
        self.traces = Traces(self.model, self.second, self.output)
        self.dropout_warned = False
        warn_hooks(self.model)
        self.traced()  # trace now: untraceable models and unsupported graphs fail at once

    def _computed(self, batch_chunk_size) -> tuple:
        exts = self.exts
        names = {e.name for e in exts}
        if batch_chunk_size is not None and "variance" in names and "sum_grad_squared" not in names:
            # slices combine Σ g² exactly; the variance is formed once from the totals
            return tuple(exts) + (SumGradSquared(),)
        return tuple(exts)

    def traced(self, X=None) -> Traced:
        """The model's trace for ``X`` (see :class:`curvlib._tracing.Traces`)."""
        return self.traces.get(X)


# ----------------------------------------------------------------------------- one call


class _Call:
    """``f(X, y, params=None, generator=None, buffers=None)`` of one :func:`curvature` (module doc, stages 1-6)."""

    def __init__(self, setup: _Setup):
        self.setup = setup

    def __call__(self, X, y: Tensor, params: Optional[Mapping[str, Tensor]] = None,
                 generator: Optional[torch.Generator] = None, buffers: Optional[Mapping[str, Tensor]] = None,
                 _into=None) -> Dict[str, object]:
        """``_into``: the batch's square-root buffers when this is a slice of it (:mod:`curvlib._chunking`)."""
        try:
            return self._run(X, y, params, generator, buffers, _into)
        except BranchChanged:
            # the model's code took another branch on this input's values than on the traced
            # one's (curvlib._branches.input_branch): trace it again on this input
            self.setup.traces.forget_aten()
            return self._run(X, y, params, generator, buffers, _into)

    def _run(self, X, y, params, generator, buffers, _into) -> Dict[str, object]:
        s = self.setup
        n = _inputs.check_input(X)
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
        read: Dict[str, object] = {}
        plan = self._plan(traced, X, values, trainable, y, n, read)
        y = _targets.prepare_targets(s.spec, y)
        seed = self._dropout_seed(traced, generator)
        differentiable = torch.is_grad_enabled() and (
            any(t.requires_grad for t in _inputs.tensors(X)) or any(v.requires_grad for v in values.values())
        )
        # planned with the model's buffers (same shapes); run with the caller's
        with _dropout.masks(seed, _inputs.first(X).device), _buffers.using(s.model, buffers):
            try:
                return self._evaluate(traced, plan, X, y, values, trainable, differentiable, seed, _into,
                                      negative=read.get("negative"), buffers=buffers)
            except (NodeFailure, NotImplementedError) as exc:
                forward_mode = forward_mode_failure(exc, ", ".join(type(e).__name__ for e in s.second))
                if forward_mode is not None:
                    raise forward_mode from exc
                if not isinstance(exc, NodeFailure):
                    raise
                # the real forward failed where the shape passes did not
                raise forward_failure(traced.program, X, values, exc, n) from exc

    def _plan(self, traced: Traced, X, values, trainable: List[str], y: Tensor, n: int,
              read: Optional[Dict[str, object]] = None) -> Plan:
        """Stage 2: the cached plan, and every check that needs it (before any work).

        ``read``: receives ``"negative"``, whether the loss Hessian's scale has a negative
        entry, read with the targets' check (one host read, see :func:`losses.check_targets`)."""
        s = self.setup
        plan = self._cached_plan(traced, X, values, frozenset(trainable))
        _arguments.check_targets_batch(s.spec, y, n)
        # the checks of the plan alone pass once per plan (an untraced model's plan is new per call)
        out = traced.checked.get(id(plan)) if traced.runner is None else None
        first = out is None
        if first:
            out = torch.empty(plan.out_shape, dtype=plan.out_dtype, device="meta")
        # under "batched" (a host read stalls a GPU) the scale's sign is read with the targets'
        # check, in the same read; under "looped" where the loss Hessian is formed (fewer ops)
        signs = bool(s.second) and read is not None and _strategy.batched(_inputs.first(X).device)
        negative = losses.check_targets(s.spec, out, y, signs=signs)
        if read is not None:
            read["negative"] = negative
        if s.second:
            if first:
                kinds = {layer.path: layer.kind for layer in traced.program.layers.values()}
                check_second_order(s.second, plan.sites, trainable, [], kinds,
                                   {name: values[name].dim() for name in trainable})
            _budget.check_roots(s.second, plan.out_shape, plan.out_dtype, _inputs.first(X).device)
            if first:  # (after the roots: an exact root too large for the device is the first fix)
                check_factor_sizes(s.second, plan.sites, trainable, values)
        if first:
            # Samples mixed inside the model: refuse what needs them independent (curvlib._independence).
            refuse_mixing(plan, s.computed, traced.program, X, values, frozenset(trainable), traced.runner,
                          s.chunk_kinds is not None)
            _dropout.refuse_in_generic(traced.program, plan.sites)
            refuse_buffer_updates(traced.program, plan.sites, s.second)
            if traced.runner is None:
                traced.checked[id(plan)] = out  # (plans stay in traced.plans: their ids are not reused)
        return plan

    @staticmethod
    def _cached_plan(traced: Traced, X, values, trainable: frozenset) -> Plan:
        leaves = _inputs.tensors(X)
        key = (
            tuple((tuple(t.shape), t.dtype, t.device.type) for t in leaves),
            tuple((n, tuple(v.shape), v.dtype) for n, v in values.items()),
            trainable,
        )
        plan = traced.plans.get(key)
        if plan is None or traced.runner is not None:  # an untraced model's path may change per call
            plan = traced.plans[key] = make_plan(
                traced.program, X, values, trainable, traced.residual_nodes, runner=traced.runner
            )
        return plan

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

    def _evaluate(self, traced, plan, X, y, values, trainable, differentiable, seed, into=None,
                  negative: Optional[bool] = None, buffers=None) -> Dict[str, object]:
        """Stages 3-6 (``buffers``: the caller's, in the model's slots for this call; the block
        products put them there again whenever they are evaluated). Where it can, the first order
        is read during the loss's backward, after the second order (:func:`streams`)."""
        s = self.setup
        frozen_trainable = frozenset(trainable)
        rng = rng_state(_inputs.first(X).device)
        lin = forward_with_probes(
            traced.program, plan, X, values, frozen_trainable, traced.residual_nodes, runner=traced.runner,
            # KFRA reuses the forward's node values, unless an in-place node overwrote its input
            direct=traced.direct, keep_values=traced.direct and any(e.quantity == "kfra" for e in s.second),
            functorch=differentiable,
        )
        wanted, n, generic = [e.name for e in s.first], _inputs.batch_size(X), s.spec.kind == "generic"

        def second(gs, residual_grads) -> Dict[str, object]:  # stage 6 (gs: the empirical Fisher's root)
            if not s.second:
                return {}
            curv = losses.curvature_at(s.spec, lin.out, y, negative=negative)
            product = _buffers.bind_products(products(traced.program, s.spec, y, curv, X, values, traced.residual_nodes,
                                                      lin, residual_grads, rng, frozen_trainable, seed), s.model, buffers)
            chunk = _budget.auto_chunk_size(plan, s.second, _inputs.first(X).device) if s.chunk_size == "auto" else s.chunk_size
            return second_order(lin, curv, s.second, trainable, values, n, residual_grads, product,
                                _kfra_factors(s, traced, lin, curv, X, y, trainable, values), chunk_size=chunk,
                                site_grads=gs, into=into)

        if streams(lin, s.second, generic):  # second order first: the loss's backward then frees the graph
            later = second(None, [])
            loss, first = first_order_streamed(lin, lambda out: _scalar_loss(s.spec, out, y), trainable, values,
                                               wanted, n, keep_output=generic)
            if generic:  # (checked once the graph is spent)
                check_per_sample(lambda o: losses.loss_value(s.spec, o, y), lin.out.detach(), s.spec.name)
            return {"loss": loss, **first, **later}
        loss, gs, residual_grads = _loss_and_site_gradients(s.spec, lin, y, bool(s.second))
        return {"loss": loss, **first_order(lin.sites, gs, trainable, values, wanted, n), **second(gs, residual_grads)}


def _loss_and_site_gradients(spec, lin, y: Tensor, keep_graph: bool):
    """Stage 4: the loss and its gradient at every site (and residual) output."""
    if lin.pull_loss is not None:  # plain autograd: one backward from the loss
        loss, (gs, residual_grads) = lin.pull_loss(lambda out: _scalar_loss(spec, out, y), retain=keep_graph)
    else:
        loss, pullback = torch.func.vjp(lambda o: _scalar_loss(spec, o, y), lin.out)
        gs, residual_grads = lin.pull(pullback(torch.ones_like(loss))[0])
    if spec.kind == "generic" and not keep_graph and is_concrete(lin.out):
        check_per_sample(lambda o: losses.loss_value(spec, o, y), lin.out.detach(), spec.name)
    return loss, gs, residual_grads


def _scalar_loss(spec, out: Tensor, y: Tensor) -> Tensor:
    loss = losses.loss_value(spec, out, y)
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise CurvatureError(
            f"lossfn {spec.name} returned {shape}, not a scalar: curvlib needs the sum or mean over "
            "samples of per-sample terms (reduction='sum' or 'mean', or .sum() in a function)."
        )
    return loss


def _kfra_factors(s: _Setup, traced: Traced, lin, curv, X, y, trainable, values):
    """``() -> KFRA factors``, reusing the forward's node values where it kept them."""

    def factors():
        reduce = None
        if s.process_group is not None:
            reduce = kfra_reducer(s.spec, s.process_group, _inputs.batch_size(X), losses.normaliser(s.spec, y))
        forward = (lin.out, lin.values) if lin.values is not None else None
        return kfra(traced.program, curv, X, trainable, values, lin.sites, reduce=reduce, forward=forward)

    return factors
