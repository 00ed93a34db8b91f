"""Run a traced :class:`~curvlib._trace.program.Program` functionally and differentiate it.

One evaluation is, in the stages of :mod:`curvlib._transform.entry`,

3. *plan* (once per input signature, cached; :mod:`curvlib._plan.plan`): the graph run on
   fake tensors for batch sizes ``N`` and ``N + 1`` gives every site's output shape and
   which of its dimensions is the batch, and the model's output shape, so that targets
   and layers are checked before any real work;
4. *forward* (here): run the graph with real tensors under :func:`torch.func.vjp`,
   adding a zero probe to every site's output;
5. *loss and site gradients*: ``g_k = ∂L/∂probe_k`` for all sites in one vector-Jacobian
   product seeded with ``∂L/∂output``;
6. and 7. *read off*: each site's rule turns ``(saved inputs, g_k)`` into per-sample
   quantities; a parameter used by several sites sums its individual
   gradients over the sites before any square or norm is taken. Under plain
   autograd, 5 and 6 go together where they can: each site is read as the
   backward completes its ``g_k``, which is then freed (:mod:`curvlib._evaluate.streamed`).

Everything here is a pure function of ``(params, X, y)``; it composes with
:func:`torch.func.vmap` because it only uses torch.func transforms.
"""


from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, fx
from torch.func import vjp

from .._core import inputs as _inputs, param_reads, sink, strategy as _strategy
from .._trace.program import Program
from .._interpret.graph import run_graph
from .._plan.plan import Plan
from .._core.batch_layout import batch_first
from .._core.site import Recorder, Site
from .._core.tensors import inside_transform
from .streamed import as_edges, lowest_targets, stream_sites, worth_streaming

__all__ = ["Forward", "Linearization", "forward_with_probes"]


@dataclass
class Linearization:
    """The forward pass of one evaluation, ready to pull vectors back.

    Attributes:
        out: model output ``[N, *]``.
        sites: recorded sites (saved tensors filled in).
        residuals: recorded element-wise nonlinearities (Hessian only).
        taps: their inputs ``a``, in the same order.
        pullback: ``(cot_out, cot_taps) -> (site_grads, residual_grads)``.
    """

    out: Tensor
    sites: List[Site]
    residuals: list
    taps: List[Tensor]
    pullback: Callable
    batched_pullback: Optional[Callable] = None
    pull_loss: Optional[Callable] = None
    stream_pull: Optional[Callable] = None  # (cot_out, read): one column, read site by site
    values: Optional[Dict[fx.Node, object]] = None
    reached_pullback: Optional[Callable] = None  # (cot_taps) -> site gradients, None where unreached
    site_zeros: Optional[Callable[[int, int], Tensor]] = None  # (site k, V) -> zeros [V, *site_out]

    def pull(self, cot_out: Tensor, cot_taps: Optional[Sequence[Tensor]] = None):
        """Pull one cotangent back to every site output and residual output."""
        if cot_taps is None:
            cot_taps = [torch.zeros_like(t) for t in self.taps]
        return self.pullback((cot_out, list(cot_taps)))

    def pull_batched(self, cot_out: Optional[Tensor], cot_taps: Optional[Dict[int, Tensor]] = None):
        """Pull ``V`` cotangents at once (``cot_out [V, *out]`` and/or taps ``{i: [V, *a_i]}``).

        Returns the list of site gradients ``[V, *site_out]`` (residual
        gradients are dropped).
        """
        cot_taps = cot_taps or {}
        batched_out = cot_out is not None
        if self.batched_pullback is not None:  # plain autograd: is_grads_batched
            v = (cot_out if batched_out else next(iter(cot_taps.values()))).shape[0]
            # (None: no cotangent there, the backward starts only where there is one; the
            # batched strategy's vmap takes tensors: zeros)
            zeros = (lambda t: None) if v == 1 or not _strategy.batched(self.out.device) else \
                (lambda t: t.new_zeros((v,) + tuple(t.shape)))
            c_out = cot_out if batched_out else zeros(self.out)
            c_taps = [cot_taps[i] if i in cot_taps else zeros(t) for i, t in enumerate(self.taps)]
            if v == 1:  # one column: a plain backward is cheaper than a batched one
                first = lambda c: None if c is None else c[0]  # noqa: E731
                return [g.unsqueeze(0) for g in self.pullback((first(c_out), [first(c) for c in c_taps]))[0]]
            return self.batched_pullback(c_out, c_taps)
        out_arg = cot_out if batched_out else torch.zeros_like(self.out)
        tap_args = [cot_taps.get(i, torch.zeros_like(t)) for i, t in enumerate(self.taps)]
        tap_dims = [0 if i in cot_taps else None for i in range(len(self.taps))]

        def one(c_out, c_taps):
            return self.pullback((c_out, list(c_taps)))[0]

        return torch.func.vmap(one, in_dims=(0 if batched_out else None, tap_dims))(out_arg, tap_args)

    def pull_reached(self, cot_taps: Dict[int, Tensor]) -> List[Optional[Tensor]]:
        """:meth:`pull_batched` of tap cotangents ``{i: [V, *a_i]}`` with ``None`` at every site
        the columns do not reach (no path from a tap to it: its columns are zero), where the
        backward tells (plain autograd, one backward for all columns); zeros elsewhere."""
        v = next(iter(cot_taps.values())).shape[0]
        if self.reached_pullback is None or v == 1 or _strategy.batched(self.out.device):
            return self.pull_batched(None, cot_taps)
        return self.reached_pullback([cot_taps.get(i) for i in range(len(self.taps))])

    def zeros_at(self, k: int, v: int, like: Optional[Tensor] = None) -> Tensor:
        """Zero columns ``[v, *site_out]`` at site ``k`` (``like``: a tensor of that shape past
        its first dim, where there is one)."""
        if like is not None:
            return like.new_zeros((v,) + tuple(like.shape[1:]))
        return self.site_zeros(k, v)


@dataclass(frozen=True)
class Forward:
    """One forward to linearise: the traced program and its plan for ``X``, parameter name ->
    value (every parameter), the names whose quantities are wanted, the residual nodes to tap
    (``None``: none), the runner of a model without a graph (``None``: the graph interpreter)
    and the call's dropout seed (:data:`curvlib._core.dropout.DropoutSeed`)."""

    program: Program
    plan: Plan
    X: object
    params: Mapping[str, Tensor]
    trainable: frozenset
    residual_nodes: Optional[dict] = None
    runner: Optional[Callable] = None
    dropout_seed: object = None

    def run(self, X, rec: Recorder, env: Optional[Dict[fx.Node, object]] = None) -> Tensor:
        """The model output on ``X``, recorded by ``rec`` (``env``: filled with every node's value;
        a graph only)."""
        with param_reads.forward_values(self.params) as params:  # (a sharded model's: gathered per layer)
            if env is not None:
                return run_graph(self.program, X, params, self.trainable, rec, env=env)
            return (self.runner or run_graph)(self.program, X, params, self.trainable, rec)


def forward_with_probes(fwd: Forward, direct: bool = False, keep_values: bool = False,
                        functorch: bool = False) -> Linearization:
    """Run the forward, differentiable with respect to the probes.

    Outside any torch.func transform this uses plain autograd (less overhead,
    the common case); inside one (``vmap`` over an ensemble of parameters) it
    uses :func:`torch.func.vjp`, which composes. Both give the same pullback.
    ``direct=True`` (plain autograd only; for graphs without in-place
    operations, see :func:`~curvlib._trace.graph_facts.has_inplace`) differentiates with respect to the
    sites' outputs themselves instead of zero probes added to them.
    ``keep_values=True`` (plain autograd only) keeps every graph node's value in
    ``Linearization.values`` (KFRA's recursion reuses them). ``functorch=True``
    takes the torch.func route outside transforms too: its results stay
    differentiable w.r.t. inputs and parameter values that require grad.
    """
    if functorch or inside_transform():
        return _forward_functorch(fwd)
    if direct:
        lin = _forward_autograd(fwd, True, keep_values)
        if lin is not None:
            return lin
    return _forward_autograd(fwd, False, keep_values)


class _LazyProbes:
    """Zero probes created on first use (direct mode needs few or none)."""

    def __init__(self, plan: Plan, X: Tensor):
        self._plan, self._X = plan, X
        self._made: Dict[int, Tensor] = {}

    def __len__(self) -> int:
        return len(self._plan.site_shapes)

    def __getitem__(self, k: int) -> Tensor:
        if k not in self._made:
            self._made[k] = torch.zeros(
                self._plan.site_shapes[k], dtype=self._plan.site_dtypes[k], device=_inputs.first(self._X).device, requires_grad=True
            )
        return self._made[k]


def _zero_probes(plan: Plan, X: Tensor, requires_grad: bool):
    probes = [
        torch.zeros(shape, dtype=dtype, device=_inputs.first(X).device, requires_grad=requires_grad)
        for shape, dtype in zip(plan.site_shapes, plan.site_dtypes)
    ]
    rprobes = [
        torch.zeros(shape, dtype=dtype, device=_inputs.first(X).device, requires_grad=requires_grad)
        for shape, dtype in zip(plan.residual_shapes, plan.residual_dtypes)
    ]
    return probes, rprobes


def _finish(rec: Recorder, plan: Plan, saved, taps) -> None:
    if len(rec.sites) != len(plan.site_shapes):  # pragma: no cover - internal invariant
        raise RuntimeError("curvlib internal error: the forward recorded a different set of sites")
    for site, s in zip(rec.sites, saved):
        site.saved = s
    merges = plan.residual_merges or (None,) * len(rec.residuals)
    for r, (in_dims, out_dim), merge in zip(rec.residuals, plan.residual_dims, merges):
        r.meta["merge"] = merge
        r.inputs = [taps[k] for k in r.taps]
        k = len(r.inputs)  # after the inputs' batch dims: those of the integer inputs (dense kind)
        r.in_dims, r.out_dim = in_dims[:k], out_dim
        if "fixed" in r.meta:
            r.meta["fixed_dims"] = in_dims[k:]


def _forward_functorch(fwd: Forward) -> Linearization:
    plan, residual_nodes = fwd.plan, fwd.residual_nodes
    probes, rprobes = _zero_probes(plan, fwd.X, requires_grad=False)
    recorded: List[Recorder] = []

    def forward(probes_, rprobes_):
        rec = Recorder(probes_, rprobes_ if residual_nodes else None, residual_nodes, dropout_seed=fwd.dropout_seed,
                       batch_dims=plan.batch_dims, saved_dims=plan.saved_dims)
        out = fwd.run(fwd.X, rec)
        recorded.append(rec)
        return (out, [a for r in rec.residuals for a in r.inputs]), [s.saved for s in rec.sites]

    (out, taps), pullback, saved = vjp(forward, probes, rprobes, has_aux=True)
    rec = recorded[-1]
    _finish(rec, plan, saved, taps)
    return Linearization(out=out, sites=rec.sites, residuals=rec.residuals, taps=list(taps), pullback=pullback)


def _batched(pullback: Callable, device: torch.device) -> Callable:
    """``(c_out [V, *out], c_taps) -> site gradients [V, *site_out]`` for ``pullback``.

    ``"looped"`` (:mod:`curvlib._core.strategy`, the CPU default):
    ``autograd.grad(is_grads_batched=True)``, whose legacy vmap runs most backward
    kernels (convolution, pooling) once per column. ``"batched"`` (the CUDA default):
    :func:`torch.func.vmap` over the same backward, whose batching rules fold the
    ``V`` columns into each kernel's batch: one ``convolution_backward`` or
    ``max_pool2d_with_indices_backward`` per site and chunk instead of ``V``.
    """
    def pull(c_out, c_taps):
        if not _strategy.batched(device):
            return pullback((c_out, c_taps), batched=True)[0]
        return torch.func.vmap(lambda o, t: pullback((o, t))[0])(c_out, list(c_taps))

    return pull


def _autograd_probes(plan, X, direct: bool):
    """``(probes, residual probes, X)`` for :func:`_forward_autograd`: zero probes added
    to every site's output, or (``direct``) sites read as they are, lazily."""
    if not direct:
        return (*_zero_probes(plan, X, requires_grad=True), X)
    probes = _LazyProbes(plan, X)
    rprobes = [
        torch.zeros(shape, dtype=dtype, device=_inputs.first(X).device, requires_grad=True)
        for shape, dtype in zip(plan.residual_shapes, plan.residual_dtypes)
    ]
    # A floating input that requires grad puts the first layers' outputs into the
    # autograd graph (the engine never computes the input's own gradient).
    X = _inputs.map_tensors(lambda t: t.detach().requires_grad_(True) if t.is_floating_point() else t, X)
    return probes, rprobes, X


def _forward_autograd(fwd: Forward, direct: bool = False, keep_values: bool = False):
    """The forward under plain autograd (``None`` if ``direct`` and an in-place
    operation overwrote a site's output: the caller then runs it with probes)."""
    plan, residual_nodes = fwd.plan, fwd.residual_nodes
    probes, rprobes, X = _autograd_probes(plan, fwd.X, direct)
    rec = Recorder(probes, rprobes if residual_nodes else None, residual_nodes, direct=direct,
                   dropout_seed=fwd.dropout_seed, batch_dims=plan.batch_dims, saved_dims=plan.saved_dims)
    values: Optional[Dict[fx.Node, object]] = {} if keep_values and fwd.runner is None else None
    with torch.enable_grad():
        out = fwd.run(X, rec, env=values)
    if direct and rec.overwritten():
        return None
    taps = [a for r in rec.residuals for a in r.inputs]
    # small sites: every target is an input, read all at once (streaming's hooks cost more),
    # unless results go to a sink as they are read (a sharded model's: each parameter's result
    # reduced into the rank's rows as soon as its layer is passed, never every layer's whole)
    # (a sharded model's call: one choice on every rank, whose batches differ in size)
    worth = sink.current() is not None or worth_streaming(plan.site_shapes, plan.site_dtypes)
    stream = bool(param_reads.agreed(int(worth)))
    lowest = lowest_targets(rec.targets) if stream else set(range(len(rec.targets)))
    inputs = as_edges(rec.targets, lowest) + (rprobes if residual_nodes else [])
    like = [(tuple(t.shape), t.dtype, t.device) for t in list(rec.targets) + (rprobes if residual_nodes else [])]
    pullback, pull_loss, stream_pull = _pullbacks([out], taps, inputs, like, len(rec.targets), lowest,
                                                  list(rec.layouts))  # (not rec: it holds the targets)
    saved = [{k: v.detach() for k, v in site.saved.items()} for site in rec.sites]
    _finish(rec, plan, saved, [t.detach() for t in taps])
    lin = Linearization(out=out.detach(), sites=rec.sites, residuals=rec.residuals, taps=[t.detach() for t in taps], pullback=pullback)
    lin.batched_pullback = _batched(pullback, _inputs.first(X).device)
    lin.pull_loss, lin.stream_pull = pull_loss, stream_pull if stream else None
    lin.reached_pullback = lambda c_taps: pullback((None, c_taps), batched=True, reached=True)[0]
    lin.site_zeros = _site_zeros(like, list(rec.layouts))
    lin.values = values
    return lin


def _site_zeros(like: List[tuple], layouts: List[Tuple[int, int]]) -> Callable[[int, int], Tensor]:
    """``(k, V) -> zeros [V, *site_out]``: site ``k``'s columns of zeros, batch first (``like[k]``:
    its target's shape, dtype and device; ``layouts[k]``: as in :func:`_pullbacks`)."""
    def zeros(k: int, v: int) -> Tensor:
        shape, dtype, device = like[k]
        return batch_first(torch.zeros((v,) + shape, dtype=dtype, device=device), *layouts[k], lead=1)

    return zeros


def _pullbacks(held: List[Tensor], taps: List[Tensor], inputs: list, like: List[tuple], n_sites: int,
               lowest: set, layouts: List[Tuple[int, int]]):
    """``(pullback, pull_loss, stream_pull)`` of :class:`Linearization` under plain autograd: ``held``,
    ``[out]`` (let go by a streamed backward that frees the graph); ``inputs``, the sites'
    targets (:func:`curvlib._evaluate.streamed.as_edges`) and the residual probes, ``like`` their shapes.
    ``layouts[k]``: how site ``k``'s gradient is moved batch first (``Recorder.layouts``: a direct
    target's gradient comes in the layer's own layout)."""

    def canon(k: int, g: Tensor, lead: int) -> Tensor:
        return batch_first(g, *layouts[k], lead=lead)

    def sites_first(grads: list, lead: int) -> list:
        return [None if g is None else canon(k, g, lead) for k, g in enumerate(grads[:n_sites])]

    def read_first(read: Callable[[int, Tensor], None]) -> Callable[[int, Tensor], None]:
        return lambda k, g: read(k, canon(k, g, 0))

    def pullback(cotangents, batched: bool = False, reached: bool = False):
        # (reached: None, not zeros, at the sites no cotangent reaches)
        cot_out, cot_taps = cotangents  # (None where there is no cotangent: a zero one)
        pairs = [(o, c) for o, c in zip(held + taps, [cot_out] + list(cot_taps)) if c is not None and o.requires_grad]
        if not inputs or not pairs:
            grads = [None] * len(inputs)
        else:
            grads = torch.autograd.grad(
                [o for o, _ in pairs], inputs, [c for _, c in pairs],
                retain_graph=True, allow_unused=True, is_grads_batched=batched,
            )
        lead = (next(c for c in [cot_out, *cot_taps] if c is not None).shape[0],) if batched else ()
        grads = [torch.zeros(lead + shape, dtype=dtype, device=device) if g is None and not (reached and k < n_sites)
                 else g for k, (g, (shape, dtype, device)) in enumerate(zip(grads, like))]
        return sites_first(grads, len(lead)), grads[n_sites:]

    def pull_loss(loss_of: Callable[[Tensor], Tensor], retain: bool, read: Optional[Callable] = None):
        """The loss and its gradient at every site in *one* backward from the loss
        (no separate backward for ``∂L/∂out``); ``retain=False`` frees the graph.
        ``read(k, g_k)``: each site's gradient is handed to ``read`` as the backward
        completes it and then dropped (:func:`curvlib._evaluate.streamed.stream_sites`); nothing is returned for the
        sites then (``(loss, None)``), and without ``retain`` the output is let go too."""
        with torch.enable_grad():
            loss = loss_of(held[0])
        if read is not None:
            if not retain:
                held.clear()  # the loss's graph keeps what it needs of the output (log-softmax)
            stream_sites(loss, inputs[:n_sites], lowest, like[:n_sites], read_first(read), retain)
            return loss.detach(), None
        if not inputs or not loss.requires_grad:
            grads = [None] * len(inputs)
        else:
            grads = torch.autograd.grad(loss, inputs, retain_graph=retain, allow_unused=True)
        grads = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                 for g, (shape, dtype, device) in zip(grads, like)]
        return loss.detach(), (sites_first(grads, 0), grads[n_sites:])

    def stream_pull(cot_out: Tensor, read: Callable[[int, Tensor], None]) -> None:
        """Pull one cotangent ``[*out]`` back, each site's ``[*site_out]`` handed to ``read``
        as it is complete (:func:`curvlib._evaluate.streamed.stream_sites`); the graph is kept."""
        stream_sites(held[0], inputs[:n_sites], lowest, like[:n_sites], read_first(read), True, cot_out)

    return pullback, pull_loss, stream_pull
