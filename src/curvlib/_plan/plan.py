"""Plan one input signature: shapes, batch dimensions and checks, before any real work.

The graph runs on fake tensors for batch sizes ``N`` and ``N + 1``: a dimension
whose size follows the batch size is the batch dimension of that site's output.
Comparing the two runs also shows whether samples are mixed inside the model
(:mod:`curvlib._plan.independence`). The plan is cached per input signature.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from operator import attrgetter
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch import Tensor, fx

from . import independence as _independence
from .._core import inputs as _inputs
from .._core.errors import CurvatureError
from .batch_merges import residual_merges, split_merged_batches
from .._trace.program import Program
from .._core.batch_layout import batch_first_shape
from .._core.site import Recorder, Site
from .._hessian.free_blocks import check_free_block_cost
from .._hessian.rows import check_dense_size
from .._hessian.pointwise import reroot_regions, split_unequal_pairs

from .._interpret.graph import run_graph
from ..rules import checker_for
from .._interpret.diagnose import forward_failure

__all__ = ["Plan", "make_plan", "module_checks"]

# Per-sample entries of a dense residual: N·D² must stay below this.


@dataclass(frozen=True)
class Plan:
    """What one input signature looks like (cached).

    Attributes:
        out_shape: the model output's shape.
        site_shapes: output shape of every site, in recording order, batch first
            (:func:`curvlib._core.batch_layout.batch_first`: the shapes of the probes and of ``g``).
        site_dtypes: their dtypes.
        batch_dims: the batch dimension of every site's output as the layer produces it.
        saved_dims: per site with :attr:`~curvlib._core.site.Rule.saved_batch_dims` (else
            ``None``), the batch dimension of each saved input (:func:`saved_batch_dims`).
    """

    out_shape: Tuple[int, ...]
    out_dtype: torch.dtype
    site_shapes: Tuple[Tuple[int, ...], ...]
    site_dtypes: Tuple[torch.dtype, ...]
    batch_dims: Tuple[int, ...]
    # per site whose rule re-runs its op per sample (else None): saved key -> batch dim or None
    saved_dims: Tuple[Optional[Dict[str, Optional[int]]], ...] = ()
    residual_shapes: Tuple[Tuple[int, ...], ...] = ()
    # their dtypes: a node computing in float32 inside a float64 model keeps its own (its probe's)
    residual_dtypes: Tuple[torch.dtype, ...] = ()
    sites: Tuple[Site, ...] = ()
    # per residual: the batch dim of each input and of the output
    residual_dims: Tuple[Tuple[Tuple[int, ...], int], ...] = ()
    independence: Optional[_independence.Independence] = None  # samples mixed inside the model?
    # per residual: (c, s) when its output has the batch merged with c entries per sample (else None)
    residual_merges: Tuple[Optional[Tuple[int, int]], ...] = ()
    # the program the plan was made on: the traced one, or its rewrite with merged batches split off
    program: Optional[Program] = None
    # the largest floating-point value the forward computes from the input (bytes): one column's
    # backward holds cotangents of that size, beside the sites' (curvlib._plan.budget.auto_chunk_size)
    largest_value_bytes: int = 0


def module_checks(program: Program) -> List[Callable[[], None]]:
    """The per-call checks of the modules the graph calls (e.g. BatchNorm's mode).

    Found once per traced program: only families with a ``check`` contribute,
    so the per-call cost is one call per such module (none for an MLP).
    """
    checks, seen = [], set()
    for node in program.graph.nodes:
        if node.op == "call_module" and node.target not in seen:
            seen.add(node.target)
            module = attrgetter(node.target)(program.root)
            path = node.target[len(program.prefix):] if node.target.startswith(program.prefix) else node.target
            check = checker_for(module)
            if check is not None:
                checks.append(lambda check=check, module=module, where=path or type(module).__name__: check(module, where))
    return checks


def _shape_pass(program, X, params, trainable, batch, residual_nodes=None, runner=None, env=None):
    """Sites and output of a forward on fake tensors with batch size ``batch``."""
    with _quiet_fake_tensor_log(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = lambda t: mode.from_tensor(t) if not isinstance(t, torch._subclasses.FakeTensor) else t  # noqa: E731
        Xf = _inputs.with_batch(X, batch, real=False)
        pf = {k: torch.empty(tuple(v.shape), dtype=v.dtype, device=v.device) for k, v in params.items()}
        rec = Recorder(None, residual_nodes=residual_nodes)
        with torch.no_grad():
            out = (runner or run_graph)(program, Xf, pf, trainable, rec, fake_tensor=fake, env=env)
        return rec, out


def _real_shape_pass(program, X, params, trainable, batch, residual_nodes=None, runner=None, env=None):
    """Fallback of :func:`_shape_pass` for ops that fake tensors do not support."""
    Xb = _inputs.with_batch(X, batch, real=True)
    device = _inputs.first(X).device
    rec = Recorder(None, residual_nodes=residual_nodes)
    # Forked random state: the passes take the same random branches as the real forward.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        out = (runner or run_graph)(program, Xb, params, trainable, rec, env=env)
    return rec, out


def _checked_shape_pass(program, X, params, trainable, batch, residual_nodes, runner, env):
    """A shape pass on fake tensors (on real ones for ops without a fake kernel); a model
    that fails on ``X`` is reported by :func:`curvlib._interpret.diagnose.forward_failure`."""
    try:
        return _shape_pass(program, X, params, trainable, batch, residual_nodes, runner, env)
    except CurvatureError:
        raise
    except Exception:  # noqa: BLE001 - an op without a fake-tensor kernel, or a real failure
        env.clear()
    try:
        return _real_shape_pass(program, X, params, trainable, batch, residual_nodes, runner, env)
    except CurvatureError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported with the node, the input and a likely cause
        raise forward_failure(program, X, params, exc, batch) from exc


class _FakeTensorNoise(logging.Filter):
    """Drops the ERROR records FakeTensorMode logs for a failing op while curvlib's shape
    pass runs in this thread (curvlib reports the failure itself, naming the node)."""

    active = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.active, "on", False)


_FAKE_FILTER = _FakeTensorNoise()


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    # installed at the first shape pass, not when curvlib is imported (an import changes no
    # logger); addFilter keeps one copy of a filter already installed
    logging.getLogger("torch._subclasses.fake_tensor").addFilter(_FAKE_FILTER)
    before = getattr(_FakeTensorNoise.active, "on", False)
    _FakeTensorNoise.active.on = True
    try:
        yield
    finally:
        _FakeTensorNoise.active.on = before


def _batch_dim(shape_a, shape_b, n_a, n_b, where: str, mixing: Optional[str] = None) -> int:
    """The one dimension whose size is the batch size in both passes. ``mixing``: the graph's
    first node that does not keep samples apart in a known layout, which stopped the batch
    being split off merged rows (:func:`curvlib._plan.batch_merges.split_merged_batches`)."""
    dims = [d for d, (a, b) in enumerate(zip(shape_a, shape_b)) if a != b]
    if len(dims) == 1 and shape_a[dims[0]] == n_a and shape_b[dims[0]] == n_b:
        return dims[0]
    if mixing and dims:
        raise CurvatureError(
            f"Layer '{where}': its output (shape {list(shape_a)} for N={n_a}) holds the batch merged with "
            f"another dim, and curvlib cannot follow which sample each row belongs to: {mixing}. A layer on "
            "rows picked by the data (a mixture of experts' gather of the tokens routed to one expert, a "
            "variable number per sample) is not supported; experts run on every token row (weighted by "
            "the router's scores, as in Llama 4) or on each row's chosen expert weights (transformers' "
            "experts_implementation=\"batched_mm\") are.")
    if not dims:
        why = "does not change with the batch size"
    else:
        why = f"changes with the batch size in dims {dims}, not in exactly one dim of size N"
    raise CurvatureError(
        f"Layer '{where}': its output (shape {list(shape_a)} for N={n_a}) {why}. curvlib "
        "needs every parametrized layer to act on each sample of the batch separately, "
        "with the batch as one dimension of its output (e.g. do not merge the batch "
        "with another axis before a layer)."
    )


def saved_batch_dims(site: Site, site_b: Site, n: int) -> Dict[str, Optional[int]]:
    """The batch dim of each saved input tensor of a site whose rule re-runs its op per sample
    (:attr:`curvlib._core.site.Rule.saved_batch_dims`), from its planning passes at ``N`` and
    ``N + 1`` (``site_b``): the one dim whose size follows the batch size; ``None`` for a tensor
    the same in both, passed unchanged to every sample."""
    dims: Dict[str, Optional[int]] = {}
    for key, a in site.saved.items():
        b = site_b.saved.get(key)
        if key.startswith("param:") or not isinstance(a, Tensor) or not isinstance(b, Tensor):
            continue
        changed = [d for d, (p, q) in enumerate(zip(a.shape, b.shape)) if p != q]
        if a.dim() == b.dim() and not changed:
            dims[key] = None
        elif a.dim() == b.dim() and len(changed) == 1 and (a.shape[changed[0]], b.shape[changed[0]]) == (n, n + 1):
            dims[key] = changed[0]
        else:
            raise CurvatureError(
                f"Layer '{site.where}': an input of shape {list(a.shape)} (for N={n}; {list(b.shape)} for "
                f"N={n + 1}) does not carry the batch in exactly one dim, which curvlib's generic rule "
                "needs to split it per sample. Keep the batch in one dim of its own before this operation."
            )
    return dims


def _two_passes(program: Program, X, params, trainable, residual_nodes, runner):
    """``(recorder and output at N, recorder and output at N + 1, every node's value in each)``:
    the graph run on fake inputs of batch sizes ``N`` and ``N + 1`` (values keyed by
    ``program``'s nodes), refused unless both call the same layers and their outputs hold the
    batch in dim 0."""
    n = _inputs.batch_size(X)
    env_a, env_b = {}, {}
    rec_a, out_a = _checked_shape_pass(program, X, params, trainable, n, residual_nodes, runner, env_a)
    program_b = program.sibling or program  # (an ATen-level trace has the batch size baked in)
    rec_b, out_b = _checked_shape_pass(program_b, X, params, trainable, n + 1, _same_nodes(program, program_b, residual_nodes),
                                       runner, env_b)
    env_b = _same_nodes(program_b, program, env_b)
    calls_a, calls_b = [s.where for s in rec_a.sites], [s.where for s in rec_b.sites]
    if calls_a != calls_b:  # only possible without a graph (control flow in forward)
        raise CurvatureError(
            f"The model calls its parametrized layers differently for a batch of N={n} "
            f"({calls_a}) and of N={n + 1} ({calls_b}) samples: its forward takes a path "
            "that depends on the whole batch (or on random numbers drawn after batch-sized "
            "ones), so the samples are not independent and per-sample quantities are not "
            "defined. Make the control flow depend on each sample alone (or on nothing)."
        )
    if out_a.dim() == 0 or out_a.shape[0] != n or out_b.shape[0] != n + 1:
        raise CurvatureError(
            f"The model output has shape {list(out_a.shape)} for an input batch of "
            f"N={n}; curvlib needs the batch in dim 0 of the output."
        )
    return (rec_a, out_a, env_a), (rec_b, out_b, env_b)


def make_plan(program: Program, X: Tensor, params, trainable, residual_nodes=None, runner=None) -> Plan:
    """Learn shapes and batch dimensions (see the module docstring)."""
    n = _inputs.batch_size(X)
    # (every node's value in both passes: for _independence)
    (rec_a, out_a, env_a), (rec_b, _, env_b) = _two_passes(program, X, params, trainable, residual_nodes, runner)
    if residual_nodes and split_unequal_pairs(program, residual_nodes, env_a):
        # (element-wise regions of two tensors that broadcast: recorded node by node, planned again)
        return make_plan(program, X, params, trainable, residual_nodes, runner)
    merged = split_merged_batches(program, rec_a, rec_b, env_a, env_b, n, trainable)
    if merged is not None:
        if residual_nodes:  # (regions whose root now holds the batch in a dim of its own)
            reroot_regions(merged, residual_nodes)
        return make_plan(merged, X, params, trainable, residual_nodes, runner)
    batch_dims = []
    independence = _independence.analyse(program, env_a, env_b, n, trainable)
    for site, sa, sb in zip(rec_a.sites, rec_a.out_shapes, rec_b.out_shapes):
        d = _batch_dim(sa, sb, n, n + 1, site.where, independence.problem)
        if d != 0 and not site.rule.any_batch_dim:
            raise CurvatureError(
                f"Layer '{site.where}' ({site.rule.kind}): the batch is in dim {d} of its "
                f"output (shape {list(sa)}), but this layer needs it in dim 0."
            )
        batch_dims.append(d)
    residual_dims = residual_batch_dims(rec_a, rec_b)
    check_residual_sizes(rec_a.residuals, residual_dims, n)
    saved_dims = tuple(saved_batch_dims(site, site_b, n) if site.rule.saved_batch_dims else None
                       for site, site_b in zip(rec_a.sites, rec_b.sites))
    return Plan(
        out_shape=tuple(out_a.shape),
        out_dtype=out_a.dtype,
        site_shapes=tuple(batch_first_shape(shape, d, site.rule.channel_axes)
                          for site, shape, d in zip(rec_a.sites, rec_a.out_shapes, batch_dims)),
        site_dtypes=tuple(rec_a.out_dtypes),
        batch_dims=tuple(batch_dims),
        saved_dims=saved_dims,
        residual_shapes=tuple(rec_a.residual_shapes),
        residual_dtypes=tuple(rec_a.residual_dtypes),
        residual_dims=residual_dims,
        independence=independence,  # samples mixed?
        residual_merges=residual_merges(program, rec_a.residuals, residual_dims, independence, n),
        sites=tuple(Site(s.rule, dict(s.params), s.where, meta=dict(s.meta), key=s.key) for s in rec_a.sites),
        program=program,
        largest_value_bytes=_largest_value_bytes(program, env_a),
    )


def _largest_value_bytes(program: Program, env) -> int:
    """The bytes of the largest floating-point tensor a node computes from the model input."""
    sizes = [0]
    for node, value in env.items():
        if node in program.dependent:
            fx.node.map_aggregate(value, lambda t: sizes.append(t.numel() * t.element_size())
                                  if isinstance(t, Tensor) and t.is_floating_point() else None)
    return max(sizes)


def _same_nodes(program, other, table):
    """``table`` (keyed by ``program``'s nodes, and other keys) keyed by ``other``'s nodes: the ATen-level traces
    of N and N + 1 samples hold the same nodes, by name, with other sizes baked in."""
    if other is program or table is None:
        return table
    nodes = {n.name: n for n in other.graph.nodes}
    if [(n.name, n.op) for n in program.graph.nodes] != [(n.name, n.op) for n in other.graph.nodes]:
        raise CurvatureError(
            "The model's forward runs other operations for a batch of N + 1 samples than for N (traced at "
            "the ATen level): its code depends on the batch size beyond shapes, so per-sample quantities "
            "are not defined for it. Make the forward treat each sample alike.")
    return {nodes[k.name] if isinstance(k, fx.Node) else k: v for k, v in table.items()}


def residual_batch_dims(rec_a: Recorder, rec_b: Recorder) -> Tuple[Tuple[Tuple[int, ...], int], ...]:
    """Per residual, the batch dimension of each input and of the output, from two
    planning passes with batch sizes ``N`` and ``N + 1``: the one dimension whose
    size changes (0 if none or several do)."""

    def dim(a, b) -> int:
        changed = [k for k, (p, q) in enumerate(zip(a, b)) if p != q]
        return changed[0] if len(changed) == 1 else 0

    def fixed_dim(ra, x, y) -> Optional[int]:
        changed = [k for k, (p, q) in enumerate(zip(x.shape, y.shape)) if p != q]
        if len(changed) > 1:
            raise CurvatureError(
                f"The Hessian extensions need the second derivative of graph node '{ra.where}', per "
                f"sample; its input of shape {list(x.shape)} (an integer tensor or a value that does not "
                "depend on the model input, held fixed) changes with the batch size in several "
                "dimensions, so it cannot be split per sample. Keep the batch in one dimension.")
        return changed[0] if changed else None

    # the in_dims of a dense residual go on with those of its fixed inputs (integer tensors and
    # values that do not depend on the model input, ``meta["fixed"]``; ``None``: the same for
    # every sample): see curvlib._evaluate.linearise._finish
    return tuple(
        (tuple(dim(x.shape, y.shape) for x, y in zip(ra.inputs, rb.inputs))
         + tuple(fixed_dim(ra, x, y) for x, y in zip(ra.meta.get("fixed", ()), rb.meta.get("fixed", ()))),
         dim(za, zb))
        for ra, rb, za, zb in zip(rec_a.residuals, rec_b.residuals, rec_a.residual_shapes, rec_b.residual_shapes)
    )


def check_residual_sizes(residuals, dims, n: int) -> None:
    """Refuse dense or bilinear residuals too large to factor (called at planning).

    ``dims``: :func:`residual_batch_dims` of ``residuals``."""
    for res, (in_dims, _) in zip(residuals, dims):
        whole = [a for a, k in zip(res.inputs, in_dims) if k >= a.dim()]
        if whole and res.kind in ("dense", "bilinear"):
            raise CurvatureError(
                f"The Hessian extensions need the second derivative of graph node '{res.where}' per "
                f"sample, but its input of shape {list(whole[0].shape)} has no batch dimension (a value "
                "computed from the whole batch, e.g. a max over samples), so it does not split per "
                "sample. Use the GGN extensions (DiagGGNExact, BatchDiagGGNExact) or HMP for this model."
            )
        per_sample = [a.numel() // max(a.shape[k], 1) if k < a.dim() else a.numel()
                      for a, k in zip(res.inputs, in_dims)]
        if res.kind == "dense":
            # (free parameters: only their diagonals, from products, curvlib._hessian.free_blocks)
            own = {k: p.numel() for k, p in res.params.items() if k not in res.free}
            inputs = 0 if res.meta.get("zero_inputs") and not own else sum(per_sample)  # (a zero input block)
            check_dense_size(f"'{res.where}'", n, inputs + sum(own.values()),
                             f" over its inputs {[list(a.shape) for a in res.inputs]}"
                             + (f" and parameters {sorted(own)}" if own else ""))
            for name in res.free:
                check_free_block_cost(res.where, name, res.params[name], n)
        elif res.kind == "bilinear":
            check_dense_size(f"'{res.where}'", n, per_sample[0], " (a Linear layer whose input depends on its weight)")
