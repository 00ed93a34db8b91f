"""Memory the loss-Hessian roots will take, checked against what the device has (before any work).

Exact second order pulls a root ``S [C, N, *out]`` back through the model and
Monte-Carlo extensions one of ``[M, N, *out]``; the columns are pulled in
chunks (``chunk_size``), but the root itself is formed whole. A root larger
than the device's free memory is refused with its size instead of failing
(or swapping) half-way through.

Dense Kronecker factors likewise (:func:`check_factor_sizes`): a factor is dense on
each side of its parameter (:mod:`curvlib._core.kronlayout`), so one huge side makes one
huge factor: a language-model head at ``V = 50257`` has ``B`` of ``V² · 4 = 10.1 GB``
(float32), more than the whole model. Unless the extension was given
``max_factor_dim`` (sides larger than it get a 1-D, diagonal factor,
:mod:`curvlib.rules._gram`), a dense factor over
:attr:`~curvlib._core.settings.Settings.dense_factor_bytes` is refused
when the plan is built, naming the parameter, the factor's bytes and the option.
Dense sides per parameter ``p`` (the family of its sites' rule: its
:attr:`~curvlib._core.family.Family.dense_sides`, :func:`dense_sides`):

| sites | dense sides |
|---|---|
| Linear (also recurrent, transposed), Conv weight | ``p.shape[0]`` and ``p.numel() / p.shape[0]`` |
| ConvTranspose weight ``[C_in, C_out/G, *k]`` | ``C_out`` and ``C_in/G · K`` |
| a bias, any 1-D parameter (exact block ``[P, P]``) | ``P`` |
| Embedding ``[V, D]``, a bias-like generic ``[*L, D]`` | ``D`` (the rows' factor is diagonal) |
| other generic ``≥ 2``-dim parameters, weights tied across layer kinds | none (diagonal blocks) |
"""

from __future__ import annotations

import math
from typing import Dict, List, Mapping, Sequence, Tuple, Union

import torch

from .arguments import bytes_of
from .._core import settings, tensors as _core, strategy as _strategy
from .._core.errors import CurvatureError
from .._core.site import uses_of
from ..rules import FAMILY_OF

__all__ = ["auto_chunk_size", "check_factor_sizes", "check_roots", "dense_sides"]

_last_free: Dict[str, int] = {}  # device -> free bytes at the last reading
#: cotangents of the largest intermediate value a backward holds at once (per column)
LIVE_COTANGENTS = 2


def _gib(b: int) -> str:
    return f"{b / 2**30:.3g} GiB"


def check_roots(exts: Sequence, out_shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """Refuse an extension whose root ``[V, N, *out]`` cannot fit in the device's free memory."""
    per_sample = 1
    for s in out_shape[1:]:
        per_sample *= int(s)
    free = None
    for ext in exts:
        root = ext.root
        if root not in ("exact", "mc"):
            continue
        v = per_sample if root == "exact" else ext.options.mc_samples
        need = bytes_of((v,) + tuple(out_shape), dtype)
        last = _last_free.get(str(device))
        if free is None and last is not None and need * settings.current().budget_headroom <= last:
            continue  # fitted many times over at the last reading
        if free is None:
            free = _core.available_bytes(device)
            if free is not None:
                _last_free[str(device)] = free
        if free is not None and need > free:
            what = "Monte-Carlo columns" if root == "mc" else "exact loss-Hessian root (one column per output entry)"
            fix = (
                f"use fewer mc_samples (at most {max(1, free // max(bytes_of(out_shape, dtype), 1))} fit)"
                if root == "mc" else _monte_carlo_fix(ext)
            )
            # (fewer samples at once help only where one sample's root fits)
            slices = ", or pass batch_chunk_size= to process fewer samples at once" \
                if need // max(int(out_shape[0]), 1) <= free else ""
            raise CurvatureError(
                f"{type(ext).__name__}: its {what} [{v}, {', '.join(map(str, out_shape))}] would take "
                f"{_gib(need)} ({dtype}), more than the {_gib(free)} free on {device}. "
                f"{fix[0].upper() + fix[1:]}{slices}."
            )


def _monte_carlo_fix(ext) -> str:
    """The refusal's advice: the extension's Monte-Carlo version (``SecondOrder.monte_carlo``)."""
    name, mc = type(ext).__name__, type(ext).monte_carlo
    if not mc:
        return "use a Monte-Carlo extension (DiagGGNMC, KFAC, SqrtGGNMC)"
    if ext.hessian:
        return (f"{name} has no Monte-Carlo version; use {mc}(mc_samples=1) for the GGN's "
                "(HMP gives exact Hessian products)")
    return f"use {mc}(mc_samples=1), its Monte-Carlo version (one sampled column per sample)"


def auto_chunk_size(plan, exts: Sequence = (), device: Union[str, torch.device] = "cuda") -> int:
    """``chunk_size="auto"``: columns per chunk so that their site gradients fit in the byte budget
    (``plan``: a :class:`~curvlib._plan.plan.Plan`, read for its ``site_shapes``/``site_dtypes``;
    :attr:`~curvlib._core.settings.Settings.auto_chunk_bytes_cpu` under the ``"looped"`` strategy,
    the CPU default; the larger budgets under ``"batched"``, the CUDA default: :mod:`curvlib._core.strategy`)."""
    device = torch.device(device)
    knobs = settings.current()
    budget = knobs.auto_chunk_bytes
    batch_diagonal = any(e.per_sample for e in exts)
    looped = not _strategy.batched(device)  # curvlib._core.strategy: CPU default "looped", CUDA "batched"
    if looped and not batch_diagonal:
        budget = min(budget, knobs.auto_chunk_bytes_cpu)
    if device.type == "cuda" and not looped:
        free = _core.available_bytes(device)
        budget = max(budget, int((free or 0) * knobs.auto_chunk_free_share))
    per_column = sum(bytes_of(shape, dtype) for shape, dtype in zip(plan.site_shapes, plan.site_dtypes))
    # one column's backward also holds the cotangents of the values it passes through: at least
    # the largest one's, and the next one's beside it while a node pulls back (a chunked linear
    # attention's [N, H, chunks, C, C, d] intermediates can be far larger than every site's output)
    per_column = max(per_column, LIVE_COTANGENTS * plan.largest_value_bytes)
    return max(1, budget // max(per_column, 1))


def dense_sides(u, shape: Sequence[int]) -> List[int]:
    """The dims of the dense factors of a parameter of ``shape`` used by the sites ``u``
    (``[(site, role)]``), per the module doc's table."""
    kinds = {site.rule.kind for site, _ in u}
    numel = math.prod(shape)
    if not u or len(kinds) > 1:
        return []  # unused (refused elsewhere) or tied across kinds: a diagonal block
    kind, (site, role) = kinds.pop(), u[0]
    if len(shape) == 1:
        return [numel]
    family = FAMILY_OF.get(kind)
    sides = family.dense_sides(site, role, shape) if family is not None and family.dense_sides is not None else None
    if sides is not None:
        return sides  # the family's own (a weight's [out, in]; Embedding's rows diagonal: [D])
    return [shape[-1]] if len(u) == 1 else []  # a generic ≥ 2-dim one at most this (else diagonal)


def check_factor_sizes(exts: Sequence, sites: Sequence, names: Sequence[str],
                       values: Mapping[str, torch.Tensor]) -> None:
    """Refuse a Kronecker extension without ``max_factor_dim`` whose dense factor of some
    parameter would take more than
    :attr:`~curvlib._core.settings.Settings.dense_factor_bytes` (before any work)."""
    exts = [e for e in exts if e.kron and not e.recursion and e.options.max_factor_dim is None]
    if not exts:
        return
    uses = uses_of(sites)
    for name in names:
        p = values[name]
        sides = dense_sides(uses.get(name, []), tuple(p.shape))
        side = max(sides, default=0)
        size = side * side * p.dtype.itemsize
        limit = settings.current().dense_factor_bytes
        if size > limit:
            label = type(exts[0]).__name__
            where = ", ".join(sorted({s.where for s, _ in uses[name]}))
            fits = math.isqrt(limit // p.dtype.itemsize)
            raise CurvatureError(
                f"{label}: parameter '{name}' (module '{where}', shape {list(p.shape)}) would get a dense "
                f"Kronecker factor [{side}, {side}] of {size} bytes ({size / 2**30:.3g} GiB, {p.dtype}), "
                f"over the {limit} bytes allowed without an explicit choice "
                f"(curvlib._core.settings.Settings.dense_factor_bytes, 1 GiB by default). "
                f"Pass {label}(max_factor_dim=...) so that a side larger than it gets a diagonal (1-D) factor, "
                f"e.g. max_factor_dim={min(4096, fits)} "
                f"(dense sides up to {fits} fit the budget; max_factor_dim={side} keeps this one dense), "
                "or set requires_grad=False on the parameter."
            )
