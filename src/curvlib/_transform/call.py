"""One call's evaluation (stages 4-7 of :mod:`curvlib._transform.entry`): forward, loss and site
gradients, first order, second order, from a :class:`CallContext` complete before it starts.

Shared by the eager call and the compiled one (:mod:`curvlib._transform.compiled`, which traces
:func:`evaluate` once per input signature).
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

from .. import losses
from .._core import buffers as _buffers, inputs as _inputs, param_reads
from .._core.errors import CurvatureError
from .._core.tensors import is_concrete
from .._evaluate.first_order import first_order, first_order_streamed, streams
from .._evaluate.kfra import kfra
from .._evaluate.linearise import Forward, forward_with_probes
from .._evaluate.products import products, rng_state
from .._evaluate.second_order import Beside, Call, second_order
from .._plan import budget as _budget
from .._plan.checks import CallContext
from ..distributed import kfra_reducer
from ..extensions.products import BlockProduct
from ..losses._generic import check_per_sample
from ..rules.layernorm import from_primitives

__all__ = ["evaluate"]


def evaluate(s, c: CallContext) -> Dict[str, object]:
    """Stages 4-7 for the setup ``s`` (:class:`curvlib._transform.entry.Setup`: the loss, the
    extensions, the options) and the call ``c`` (the caller's buffers are in the model's slots for
    this call; the block products put them there again whenever they are evaluated). Where it can,
    the first order is read during the loss's backward, after the second order
    (:func:`curvlib._evaluate.first_order.streams`)."""
    traced, X, y, device = c.traced, c.X, c.y, c.device
    trainable, n = list(c.trainable), _inputs.batch_size(c.X)
    rng = rng_state(device)
    with from_primitives(any(e.many_columns for e in s.second)):
        fwd = Forward(traced.program, c.plan, X, c.values, frozenset(trainable), traced.residual_nodes,
                      runner=traced.runner, dropout_seed=c.dropout_seed)
        lin = forward_with_probes(
            fwd, direct=traced.direct, functorch=c.differentiable,
            # KFRA reuses the forward's node values, unless an in-place node overwrote its input
            keep_values=traced.direct and any(e.recursion for e in s.second),
        )
    wanted, generic = s.first, not s.spec.structural
    if streams(lin, s.second, generic):  # second order first: the loss's backward then frees the graph
        later = _second_order(s, c, lin, rng, None, [])
        loss, first = first_order_streamed(lin, lambda out: _scalar_loss(s.spec, out, y), trainable, c.values,
                                           wanted, n, keep_output=generic)
        if generic:  # (checked once the graph is spent)
            check_per_sample(lambda o: losses.loss_value(s.spec, o, y), lin.out.detach(), s.spec.name)
        return {"loss": loss, **first, **later}
    loss, gs, residual_grads = _loss_and_site_gradients(s.spec, lin, y, bool(s.second))
    return {"loss": loss, **first_order(lin.sites, gs, trainable, c.values, wanted, n),
            **_second_order(s, c, lin, rng, gs, residual_grads)}


def _second_order(s, c: CallContext, lin, rng, gs, residual_grads) -> Dict[str, object]:
    """Stage 7 (``gs``: the loss gradient at every site, the empirical Fisher's root; ``None``
    when the first order is read during the loss's backward, which then comes after)."""
    if not s.second:
        return {}
    trainable = list(c.trainable)
    curv = losses.curvature_at(s.spec, lin.out, c.y, negative=c.negative)
    product = None
    if any(isinstance(e, BlockProduct) for e in s.second):  # (built only when asked for)
        product = _buffers.bind_products(products(c, s.spec, curv, lin, residual_grads, rng), s.model, c.buffers)
    kfra_factors = None
    if any(e.recursion for e in s.second):  # (the recursion's closure only when asked for)
        kfra_factors = _kfra_factors(s, c, lin, curv)
    chunk = s.chunk_size
    if chunk == "auto":  # (a sharded model's chunks gather its layers again: as many on every rank)
        chunk = param_reads.agreed(_budget.auto_chunk_size(c.plan, s.second, c.device))
    call = Call(lin, trainable, c.values, _inputs.batch_size(c.X), chunk_size=chunk, into=c.into)
    return second_order(call, curv, s.second, Beside(residual_grads, gs, product, kfra_factors))


def _loss_and_site_gradients(spec, lin, y: Tensor, keep_graph: bool):
    """Stage 5: the loss and its gradient at every site (and residual) output."""
    if lin.pull_loss is not None:  # plain autograd: one backward from the loss
        loss, (gs, residual_grads) = lin.pull_loss(lambda out: _scalar_loss(spec, out, y), retain=keep_graph)
    else:
        loss, pullback = torch.func.vjp(lambda o: _scalar_loss(spec, o, y), lin.out)
        gs, residual_grads = lin.pull(pullback(torch.ones_like(loss))[0])
    if not spec.structural and not keep_graph and is_concrete(lin.out):
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


def _kfra_factors(s, c: CallContext, lin, curv):
    """``() -> KFRA factors``, reusing the forward's node values where it kept them."""
    fwd = Forward(c.traced.program, c.plan, c.X, c.values, frozenset(c.trainable), dropout_seed=c.dropout_seed)

    def factors():
        reduce = None
        if s.process_group is not None:
            reduce = kfra_reducer(s.spec, s.process_group, _inputs.batch_size(c.X), losses.normaliser(s.spec, c.y))
        return kfra(fwd, curv, list(c.trainable), lin.sites, reduce=reduce, values=lin.values)

    return factors
