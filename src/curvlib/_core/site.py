"""Sites: the parametrized primitives a forward pass is made of.

A *site* is one application of a parametrized primitive (an affine map, a
convolution, an embedding look-up, ...) inside the forward pass. A module
used twice gives two sites; an RNN gives two or three sites per layer and
direction (input-to-hidden, hidden-to-hidden, projection), each shared over
the time steps.

During the forward pass every site records the tensors its rule needs
(``saved``) and gets a zero *probe* added to its output. Differentiating the
loss with respect to the probes yields ``g``, the gradient of the loss with
respect to the site's output, which holds every sample's own output gradient
in its batch rows (samples never mix). A :class:`Rule` turns ``(saved, g)``
into per-sample quantities of the site's parameters.

One layout for every rule: a site's ``saved`` tensors and ``g`` are *batch first*,
``[batch, shared..., features]`` (:func:`batch_first`). A layer that carries the batch
elsewhere (a sequence-first ``[T, N, D]`` Linear, LayerNorm or Embedding) is moved there by
the :class:`Recorder` as the site is recorded, from the batch dimension the planner found;
its probe is batch first, so its gradient is too. No rule looks for the batch.

Index letters used by the rules: ``n`` batch, ``s`` positions sharing the
weight (sequence, spatial; flattened), ``i`` input features, ``o`` output
features, ``v`` backpropagated vectors.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .batch_layout import batch_first, batch_first_shape, from_batch_first

# role -> tensor, e.g. {"weight": [N, *w.shape], "bias": [N, *b.shape]}
RoleTensors = Dict[str, Tensor]
RuleFn = Callable[["Site", Tensor, Sequence[str]], RoleTensors]


@dataclass(frozen=True)
class Rule:
    """Per-sample math of one primitive kind, as a table of pure functions.

    Every function takes ``(site, g, roles)``: the recorded site, the output
    gradient ``g`` (same shape as the site's output) and the parameter roles
    to compute (e.g. ``("weight", "bias")``), and returns a dict role ->
    tensor.

    Attributes:
        kind: short name of the primitive (``"linear"``, ``"conv"``, ...).
        grad_batch: role -> ``[N, *p.shape]``, individual gradients.
        grad: role -> ``p.shape``, their sum (default: sum of ``grad_batch``).
        batch_l2: role -> ``[N]``, squared norms (default: from ``grad_batch``).
        sum_grad_squared: role -> ``p.shape`` (default: from ``grad_batch``).
        sum_squares_over_columns: optional fast ``Σ_v sum_grad_squared(m_v)``.
        any_batch_dim: the site's output may carry the batch in any dim (the planner finds
            it); the recorder then hands the rule its tensors in the canonical layout
            (:func:`batch_first`). Otherwise the batch must be in dim 0 of the site's output.
        channel_axes: the axes right after the batch that the canonical layout keeps in
            place (BatchNorm's channel axis 1); 0: the features are the trailing axes.
        saved_batch_dims: every saved tensor carries the batch in a dim of its own, or not
            at all, found by the planner (rules that re-run the layer's op on one sample: a
            generic module or op after a transpose, ``[T, N, D]``). The recorder moves each
            batch first too and records the layer's own layout in ``site.meta``:
            ``"in_dims"`` (saved key -> dim, ``None``: the same for every sample) and
            ``"out_dim"``. Implies ``any_batch_dim``.
    """

    kind: str
    grad_batch: RuleFn
    grad: Optional[RuleFn] = None
    # (site, g) -> whether, when the individual gradients are computed anyway, their sum
    # Σ_n grad_batch_n is cheaper than ``grad`` (e.g. a Linear over many positions).
    grad_from_batch: Optional[Callable[[Site, Tensor], bool]] = None
    batch_l2: Optional[RuleFn] = None
    sum_grad_squared: Optional[RuleFn] = None
    # (site, g, roles) -> (grad, sum_grad_squared) from one pass over the individual
    # gradients, or None where the two are cheaper apart (Linear over positions)
    grad_with_squares: Optional[Callable[..., Optional[Tuple[RoleTensors, RoleTensors]]]] = None
    any_batch_dim: bool = False
    channel_axes: int = 0
    saved_batch_dims: bool = False
    # (site, m [V, *out], roles) -> role -> [K, *p] whose sum over K is
    # Σ_v sum_grad_squared(m_v): a faster GGN diagonal where the layer allows.
    sum_squares_over_columns: Optional[RuleFn] = None
    # (site, m [V, *out], roles) -> role -> [N, *p]: Σ_v grad_batch(m_v)².
    batch_sum_squares_over_columns: Optional[RuleFn] = None
    # (site, m [V, *out], roles, weights [V, N], per_sample) -> role -> Σ_v w_vn grad_batch(m_v)²
    # ([N, *p], or summed over samples [*p]) where the layer reads columns of mixed signs without
    # sorting them by sign (a Linear's Gram matrices over positions), else None
    weighted_squares_over_columns: Optional[Callable[..., Optional[RoleTensors]]] = None
    # (site, m [V, *out], roles) -> role -> [V, N, *p]: grad_batch of every column in one
    # batched call (no loop over columns, no vmap)
    grad_batch_columns: Optional[RuleFn] = None
    # (site, m [V, *out]) -> a statistic of the columns, additive over them, from which
    # column_squares(site, statistic, roles, per_sample) gives Σ_v grad_batch(m_v)² ([N, *p])
    # or its sum over samples ([*p]); None where the site has none. Columns pulled back one at
    # a time add statistics and square once (a Linear with one position: Σ_v m_v², [N, O]).
    column_statistic: Optional[Callable[["Site", Tensor], Optional[Tensor]]] = None
    column_squares: Optional[Callable[["Site", Tensor, Sequence[str], bool], RoleTensors]] = None
    # the columns of a square root go through one vmapped grad_batch, not a loop over them
    # (a rule whose grad_batch is itself a vmapped VJP of one op: one batched call is cheaper)
    vmap_columns: bool = False
    # (site, role, m [V, *out]) -> (a, b) whose broadcast product is the per-sample gradients
    # [V, N, *p] of ``role`` when each is one outer product (a Linear on one position per
    # sample: g_vn x_nᵀ), else None: square roots are then written without forming them twice
    outer_factors: Optional[Callable[["Site", str, Tensor], Optional[Tuple[Tensor, Tensor]]]] = None


@dataclass
class Site:
    """One recorded application of a primitive.

    Attributes:
        rule: the primitive's math.
        params: role -> canonical parameter name (``model.named_parameters()``),
            only for parameters whose quantities are wanted.
        where: path of the module in the model, for messages.
        meta: hyperparameters (no tensors), e.g. stride and groups.
        saved: tensors the rule needs, e.g. ``{"x": layer input}``, batch first
            (:func:`batch_first`, applied by the :class:`Recorder`).
        key: index of the site's probe.
    """

    rule: Rule
    params: Dict[str, str]
    where: str
    meta: Dict[str, Any] = field(default_factory=dict)
    saved: Dict[str, Tensor] = field(default_factory=dict)
    key: int = -1


def sample_layout(site: Site, inputs: Dict[str, Tensor], n: int):
    """``(in_dims, out_dim)``: where each of ``site``'s saved ``inputs`` carried the batch in the
    layer (``None``: not batched) and where its output does, as the recorder put them in
    ``site.meta`` from the plan (:attr:`Rule.saved_batch_dims`); the saved
    tensors themselves are batch first. A site recorded outside a plan (none is read off)
    has its batched inputs told by a dim 0 of size ``n``."""
    if "in_dims" in site.meta:
        return {k: site.meta["in_dims"].get(k) for k in inputs}, site.meta["out_dim"]
    return {k: 0 if (v.dim() > 0 and v.shape[0] == n) else None for k, v in inputs.items()}, 0


@dataclass
class Residual:
    """A graph node whose second derivative enters the Hessian (see :mod:`curvlib._hessian.residuals`).

    Attributes:
        where: the graph node's name, for messages.
        kind: ``"diag"``, ``"product"``, ``"bilinear"``, ``"softmax"``, ``"matmul"``, ``"broadcast"``, ``"norm"``, ``"row_region"`` or ``"dense"``.
        phi: ``φ(a)`` (diag) or ``φ(theta, *inputs)`` (dense); ``None`` otherwise.
        inputs: the node's graph inputs (*taps*: the forward returns them, so that
            vectors can be pulled back from them).
        params: dense kind: the node's own trainable parameters in ``u`` (canonical name -> tensor).
        site: bilinear kind: the Linear site.
        taps: indices of ``inputs`` in the forward's list of taps.
        free: dense kind: those of ``params`` that none of the node's inputs
            depends on (their couplings with the rest of ``u`` are left out).
        in_dims: the batch dimension of every input (filled in from the plan).
        out_dim: the batch dimension of the node's output.
        meta: kind-specific facts (softmax: its ``axis``).
    """

    where: str
    kind: str
    phi: Optional[Callable]
    inputs: List[Tensor]
    params: Dict[str, Tensor] = field(default_factory=dict)
    site: Optional["Site"] = None
    taps: List[int] = field(default_factory=list)
    free: Tuple[str, ...] = ()
    in_dims: Tuple[int, ...] = ()
    out_dim: int = 0
    meta: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ResidualParts:
    """What a residual holds besides its inputs (:class:`Residual`): the dense kind's own
    trainable parameters in ``u`` (``params``) and those of them no input depends on (``free``);
    the bilinear kind's Linear ``site``."""

    params: Mapping[str, Tensor] = field(default_factory=dict)
    site: Optional[Site] = None
    free: Tuple[str, ...] = ()


class Recorder:
    """Collects sites during one forward pass and adds their probes.

    With ``probes=None`` (the planning pass) nothing is added and only the
    output shapes are recorded; otherwise ``probes[k]`` is added to the
    output of the ``k``-th site. ``targets[k]`` is the tensor whose gradient is
    the ``k``-th site's output gradient: its probe, or, with ``direct=True``
    (plain autograd, which differentiates with respect to intermediate tensors),
    the site's output itself whenever that is already part of the autograd
    graph: no zero tensor, no addition, no extra copy of the activation.

    ``residual_nodes`` (graph node -> ``φ``) switches on the bookkeeping the
    Hessian needs: those nodes' inputs are recorded as taps and their
    outputs get probes from ``residual_probes``.

    ``batch_dims[k]`` (the plan's; ``None`` in the planning passes, which find them) is where
    the ``k``-th site's output carries the batch. The recorder puts every site in the canonical
    layout (:func:`batch_first`) as it is recorded: its saved tensors are moved batch first,
    and its probe is batch first (added to the output moved back into the site's layout), so
    that the site's output gradient ``g`` arrives batch first too. A direct target keeps the
    layer's layout (no probe, no copy): ``layouts[k]`` says how its gradient is moved batch
    first (``batch_first(g, *layouts[k])``), ``(0, 0)`` for a probe. Rules never look for the batch.
    ``saved_dims[k]`` (the plan's, for a rule with :attr:`Rule.saved_batch_dims`): the batch
    dim of each of the site's saved tensors, which then move batch first by their own dims.
    """

    def __init__(
        self,
        probes: Optional[Sequence[Tensor]] = None,
        residual_probes: Optional[Sequence[Tensor]] = None,
        residual_nodes: Optional[Mapping[Any, Any]] = None,
        direct: bool = False,
        dropout_seed: Optional[Tuple[int, torch.device]] = None,
        batch_dims: Optional[Sequence[int]] = None,
        saved_dims: Optional[Sequence[Optional[Mapping[str, Optional[int]]]]] = None,
    ):
        self.probes = probes
        self.batch_dims = batch_dims
        self.saved_dims = saved_dims
        # the call's dropout seed (curvlib._core.dropout.DropoutSeed): every forward run of the
        # call draws the same masks from it; None without active dropout
        self.dropout_seed = dropout_seed
        self.direct = direct
        self.targets: List[Tensor] = []
        self.layouts: List[Tuple[int, int]] = []  # per target: (batch dim, channel axes) of its gradient
        self.versions: List[Optional[int]] = []  # of direct targets, to detect in-place changes
        self.residual_probes = residual_probes
        self.residual_nodes = residual_nodes or {}
        self.sites: List[Site] = []
        self.out_shapes: List[Tuple[int, ...]] = []
        self.out_dtypes: List[torch.dtype] = []
        self.residuals: List[Residual] = []
        self.residual_shapes: List[Tuple[int, ...]] = []
        self.residual_dtypes: List[torch.dtype] = []
        # Set while a layer whose rule records its own nonlinear nodes runs (a recurrent
        # module: its rnn_steps.Coupling); None when no residuals are wanted from it.
        self.layer_residuals: Any = None
        # Set while a layer runs: what every site it records carries in its meta (the layer's
        # family; why torch.fx could not trace it), so a site is complete when recorded.
        self.layer_meta: Dict[str, Any] = {}

    def residual(self, where: str, kind: str, phi: Optional[Callable], inputs: List[Tensor], z: Tensor,
                 parts: Optional["ResidualParts"] = None, meta: Optional[Dict[str, Any]] = None) -> Tensor:
        """Record the residual of a node with output ``z`` (``parts``: its parameters and site, see
        :class:`ResidualParts`); return ``z`` + its probe."""
        k = len(self.residuals)
        first = sum(len(r.inputs) for r in self.residuals)
        parts = parts or ResidualParts()
        self.residuals.append(
            Residual(where, kind, phi, list(inputs), dict(parts.params), parts.site,
                     list(range(first, first + len(inputs))), tuple(parts.free), (0,) * len(inputs),
                     meta=dict(meta or {}))
        )
        self.residual_shapes.append(tuple(z.shape))
        self.residual_dtypes.append(z.dtype)
        if self.residual_probes is None:
            return z
        return z + self.residual_probes[k]

    def add(self, site: Site, out: Tensor) -> Tensor:
        """Record ``site`` whose primitive produced ``out``; return ``out`` + probe."""
        if not site.params:  # nothing wanted from this site: no probe needed
            return out
        site.key = len(self.sites)
        site.meta.update(self.layer_meta)
        self.sites.append(site)
        self.out_shapes.append(tuple(out.shape))
        self.out_dtypes.append(out.dtype)
        bdim = self.batch_dim(site.key)
        if site.rule.saved_batch_dims:
            self._own_dims(site, bdim)
        elif bdim:
            axes = site.rule.channel_axes
            site.saved = {k: batch_first(v, bdim, axes) if isinstance(v, Tensor) else v for k, v in site.saved.items()}
        if self.probes is None:
            return out
        if self.direct and out.requires_grad and not out.is_leaf and all(out is not t for t in self.targets):
            self.targets.append(out)
            self.layouts.append((bdim, site.rule.channel_axes))
            self.versions.append(out._version)
            return out
        probe = self.probes[site.key]  # batch first: its gradient is g in the canonical layout
        self.targets.append(probe)
        self.layouts.append((0, 0))
        self.versions.append(None)
        return out + from_batch_first(probe, bdim, site.rule.channel_axes)

    def _own_dims(self, site: Site, bdim: int) -> None:
        """Each saved tensor of ``site`` moved batch first by its own batch dim (the plan's),
        the layer's own layout kept in its meta (:attr:`Rule.saved_batch_dims`); nothing while
        planning, which finds the dims."""
        if self.saved_dims is None:
            return
        dims = dict(self.saved_dims[site.key])
        site.meta["in_dims"], site.meta["out_dim"] = dims, bdim
        site.saved = {k: batch_first(v, dims[k]) if dims.get(k) else v for k, v in site.saved.items()}

    def batch_dim(self, k: int) -> int:
        """Where the ``k``-th site's output carries the batch (0 while planning)."""
        return self.batch_dims[k] if self.batch_dims is not None else 0

    def probe_shape(self, site: Site, k: int, shape: Sequence[int]) -> Tuple[int, ...]:
        """The shape of the ``k``-th probe for a site whose output has ``shape``."""
        return batch_first_shape(shape, self.batch_dim(k), site.rule.channel_axes)

    def open(self, site: Site, out_shape: Tuple[int, ...], dtype: torch.dtype) -> Optional[Tensor]:
        """Record a site whose output is built piecewise (RNN steps).

        Returns the probe (to be added slice by slice), or ``None`` when there
        is nothing to add (planning pass, or no wanted parameter).
        """
        if not site.params:
            return None
        site.key = len(self.sites)
        site.meta.update(self.layer_meta)
        self.sites.append(site)
        self.out_shapes.append(tuple(out_shape))
        self.out_dtypes.append(dtype)
        if self.batch_dim(site.key):  # pragma: no cover - piecewise outputs are built [N, steps, out]
            raise RuntimeError(f"curvlib internal error: site '{site.where}' is built piecewise "
                               f"with the batch in dim {self.batch_dim(site.key)}")
        if self.probes is None:
            return None
        self.targets.append(self.probes[site.key])
        self.layouts.append((0, 0))
        self.versions.append(None)
        return self.probes[site.key]

    def overwritten(self) -> bool:
        """Whether an in-place operation changed a direct target after it was recorded
        (its gradient would then be that of the changed tensor: redo with probes)."""
        return any(v is not None and t._version != v for t, v in zip(self.targets, self.versions))


def uses_of(sites: Sequence[Site]) -> Dict[str, List[Tuple[Site, str]]]:
    """Parameter name -> every ``(site, role)`` that reads it (several for shared weights)."""
    uses: Dict[str, List[Tuple[Site, str]]] = defaultdict(list)
    for site in sites:
        for role, name in site.params.items():
            uses[name].append((site, role))
    return uses


def reduce_over_batch(values: Mapping[str, Tensor]) -> RoleTensors:
    """Sum per-sample tensors ``[N, *p]`` over the batch."""
    return {role: v.sum(0) for role, v in values.items()}
