"""The planning stage's one entry for a call: the cached plan and every refusal, before any work.

:func:`plan_call` runs, in this order, the checks a call needs once its input signature is
known: the targets (every call), the second-order extensions' support by layer family
(:mod:`~curvlib._plan.support`), the memory of the loss-Hessian roots and of dense Kronecker
factors (:mod:`~curvlib._plan.budget`), samples mixed inside the model
(:mod:`~curvlib._plan.independence`), dropout in layers without a rule and buffers updated under
a transform. The checks of the plan alone run once per plan; the entry knows none of them.

Its records: :class:`Request` (what one ``curvature(...)`` asks for) and :class:`CallContext`
(one call, complete before the evaluation stage starts: what ``curvlib._evaluate`` reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import losses
from .._core import dropout as _dropout, inputs as _inputs, strategy as _strategy
from .._core.dropout import DropoutSeed
from ..extensions import SecondOrder
from ..losses import LossSpec
from ..rules.generic import refuse_buffer_updates
from . import arguments as _arguments, budget as _budget
from .mixing_refusals import refuse_mixing, refuse_mixing_per_call
from .plan import Plan, make_plan
from .support import check_second_order, note_unused
from .traces import Traced

__all__ = ["Request", "CallContext", "plan_call"]


@dataclass(frozen=True)
class Request:
    """What one ``curvature(...)`` asks for, fixed when it is called.

    Attributes:
        spec: the loss.
        computed: the extensions computed (the requested ones, plus the ``needs`` of a formed
            one such as ``Variance`` when slices or ranks combine the results).
        chunked: the batch runs in slices (``batch_chunk_size``).
    """

    spec: LossSpec
    computed: Tuple
    chunked: bool

    @property
    def second(self) -> Tuple[SecondOrder, ...]:
        return tuple(e for e in self.computed if isinstance(e, SecondOrder))


@dataclass(frozen=True)
class CallContext:
    """One call's inputs to the evaluation stage, complete before it starts.

    Attributes:
        traced: the model's trace for ``X``; plan: its plan for ``X``'s signature.
        X, y: the input and the prepared targets; values: parameter name -> tensor;
        trainable: the names whose quantities are computed, in result order.
        seed: the dropout masks' seed (``None``: no active dropout); differentiable: results
        must carry derivatives (``params`` or ``X`` require grad under grad mode);
        negative: the loss Hessian's scale has a negative entry (``None``: not read yet);
        buffers: the caller's buffers; into: the batch's square-root buffers when this call
        is one slice of it (:mod:`curvlib._transform.chunking`).
    """

    traced: Traced
    plan: Plan
    X: object
    y: Tensor
    values: Mapping[str, Tensor]
    trainable: Tuple[str, ...]
    seed: Optional[int]
    differentiable: bool
    negative: Optional[bool]
    buffers: Optional[Mapping[str, Tensor]]
    into: object = None

    @property
    def program(self):
        return self.traced.program

    @property
    def device(self) -> torch.device:
        return _inputs.first(self.X).device

    @property
    def dropout_seed(self) -> DropoutSeed:
        """The seed every forward run of this call draws its dropout masks from."""
        return None if self.seed is None else (self.seed, self.device)


def plan_call(request: Request, traced: Traced, X, values: Mapping[str, Tensor], trainable: Sequence[str],
              y: Tensor) -> Tuple[Plan, Optional[bool]]:
    """The plan of ``X``'s signature (cached on ``traced``) and every check it needs.

    Returns ``(plan, negative)``: ``negative`` says whether the loss Hessian's scale has a negative
    entry, read with the targets' check under the ``"batched"`` strategy (one host read, see
    :func:`curvlib.losses.check_targets`), else ``None``.
    """
    plan = cached_plan(traced, X, values, frozenset(trainable))
    _arguments.check_targets_batch(request.spec, y, _inputs.batch_size(X))
    # the checks of the plan alone pass once per plan (an untraced model's plan is new per call)
    out = traced.checked.get(id(plan)) if traced.runner is None else None
    first = out is None
    if first:
        out = torch.empty(plan.out_shape, dtype=plan.out_dtype, device="meta")
    second = request.second
    # under "batched" (a host read stalls a GPU) the scale's sign is read with the targets'
    # check, in the same read; under "looped" where the loss Hessian is formed (fewer ops)
    signs = bool(second) and _strategy.batched(_inputs.first(X).device)
    negative = losses.check_targets(request.spec, out, y, signs=signs)
    if second:
        if first:
            kinds = {layer.path: layer.kind for layer in traced.program.layers.values()}
            check_second_order(second, plan.sites, trainable, kinds, {name: values[name].dim() for name in trainable})
        _budget.check_roots(second, plan.out_shape, plan.out_dtype, _inputs.first(X).device)
        if first:  # (after the roots: an exact root too large for the device is the first fix)
            _budget.check_factor_sizes(second, plan.sites, trainable, values)
    if not first:  # indexing by the input's values: its verdict is this call's
        refuse_mixing_per_call(plan, request.computed, traced.program, X, values, frozenset(trainable),
                               request.chunked)
    if first:
        note_unused(plan.sites, trainable)
        # samples mixed inside the model: refuse what needs them independent
        refuse_mixing(plan, request.computed, traced.program, X, values, frozenset(trainable), traced.runner,
                      request.chunked)
        _dropout.refuse_in_generic(traced.program, plan.sites)
        refuse_buffer_updates(traced.program, plan.sites, second)
        if traced.runner is None:
            traced.checked[id(plan)] = out  # (plans stay in traced.plans: their ids are not reused)
    return plan, negative


def cached_plan(traced: Traced, X, values: Mapping[str, Tensor], trainable: frozenset) -> Plan:
    """The plan of ``X``'s shapes, dtypes and devices and of the parameters' (made once, kept on ``traced``)."""
    leaves = _inputs.tensors(X)
    key = (
        tuple((tuple(t.shape), t.dtype, t.device.type) for t in leaves),
        tuple((n, tuple(v.shape), v.dtype) for n, v in values.items()),
        trainable,
    )
    plan = traced.plans.get(key)
    if plan is None or traced.runner is not None:  # an untraced model's path may change per call
        residuals = len(traced.residual_nodes)
        plan = make_plan(traced.program, X, values, trainable, traced.residual_nodes, runner=traced.runner)
        if len(traced.residual_nodes) != residuals:  # (regions split back into nodes: other plans are stale)
            traced.plans.clear()
        traced.plans[key] = plan
        traced.program = plan.program  # (a rewrite that split merged batches off made a new program)
    return plan
