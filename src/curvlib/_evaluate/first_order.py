"""The gradient and the first-order quantities, read off the sites' output gradients.

For a site ``y = x W^T`` with output gradient ``g_n`` of sample ``n``, sample ``n``'s
gradient is ``g_n^T x_n`` (summed over positions for sequence/conv inputs); each rule
gives it (``grad_batch``) or its reductions directly (``grad``, ``batch_l2``,
``sum_grad_squared``) when it has a cheaper formula. A parameter used by several sites
sums its individual gradients over the sites before any square or norm is taken.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Mapping, Optional, Sequence

import torch
from torch import Tensor

from .._core.site import Site, uses_of

__all__ = ["FIRST_ORDER", "first_order"]


FIRST_ORDER = ("grad_batch", "batch_l2", "sum_grad_squared", "variance")


def first_order(
    sites: Sequence[Site],
    gs: Sequence[Tensor],
    names: Sequence[str],
    params: Mapping[str, Tensor],
    wanted: Sequence[str],
    batch_size: int,
) -> Dict[str, Dict[str, Tensor]]:
    """The gradient and the first-order quantities, per parameter.

    Args:
        sites: recorded sites.
        gs: ``gs[k]``: gradient of the loss w.r.t. the output of site ``k``.
        names: trainable parameter names, in result order.
        params: name -> tensor.
        wanted: subset of :data:`FIRST_ORDER`.
        batch_size: ``N``.

    Returns:
        ``{"grad": {...}, "grad_batch": {...}, ...}`` for ``"grad"`` and each
        wanted quantity, each ``{name: tensor}`` in ``names``' order; per-sample
        ones are ``[N, *p]``, the others ``[*p]``.
    """
    uses = uses_of(sites)
    need = set(wanted)
    if "variance" in need:
        need.add("sum_grad_squared")
    results: Dict[str, Dict[str, Tensor]] = {"grad": {}}
    results.update({q: {} for q in need})
    _single_use(results, uses, names, gs, need)
    _shared(results, uses, names, gs, need, params, batch_size)
    if "variance" in need:
        _variance(results, names, batch_size, reuse="sum_grad_squared" not in wanted)
        if "sum_grad_squared" not in wanted:
            del results["sum_grad_squared"]
    # Keep the model's parameter order in every dict.
    return {q: {n: d[n] for n in names} for q, d in results.items()}


def _single_use(results, uses, names, gs, need) -> None:
    """Parameters read by one site: each site's rule is asked once for all its roles."""
    single: Dict[int, List[str]] = defaultdict(list)
    site_of: Dict[int, Site] = {}
    for name in names:
        if len(uses.get(name, ())) == 1:
            site, role = uses[name][0]
            single[id(site)].append(role)
            site_of[id(site)] = site
    for sid, roles in single.items():
        site = site_of[sid]
        rule, g = site.rule, gs[site.key]
        batch = rule.grad_batch(site, g, roles) if "grad_batch" in need else None
        summed = batch is not None and rule.grad_from_batch is not None and rule.grad_from_batch(site, g)
        per_q = {"grad": (rule.grad(site, g, roles) if rule.grad and not summed else None)}
        if "batch_l2" in need:
            per_q["batch_l2"] = rule.batch_l2(site, g, roles) if rule.batch_l2 else None
        if "sum_grad_squared" in need:
            per_q["sum_grad_squared"] = (
                rule.sum_grad_squared(site, g, roles) if rule.sum_grad_squared else None
            )
        if batch is None and any(v is None for v in per_q.values()):
            batch = rule.grad_batch(site, g, roles)
        for role in roles:
            name = site.params[role]
            b = batch[role] if batch is not None else None
            _store(results, name, b, {q: (v[role] if v is not None else None) for q, v in per_q.items()})


def _shared(results, uses, names, gs, need, params, batch_size: int) -> None:
    """Parameters read by several sites (shared modules, tied weights) or none: the
    individual gradients are summed over the sites first, ``g_n = Σ_k g_{n,k}``, since
    squares and norms do not distribute over the sum."""
    for name in names:
        u = uses.get(name, ())
        if len(u) == 1:
            continue
        if not u:
            p = params[name]
            b = p.new_zeros((batch_size,) + tuple(p.shape))
        else:
            b = sum(site.rule.grad_batch(site, gs[site.key], [role])[role] for site, role in u)
        _store(results, name, b, {q: None for q in ["grad", *need - {"grad_batch", "variance"}]})


def _variance(results, names, batch_size: int, reuse: bool = False) -> None:
    """``Σ_n g_n²/N − (Σ_n g_n/N)²`` in two kernels; it is ≥ 0 exactly, so the rounding
    below zero is clamped (N = 1: ``g² − g²`` from two different computations). ``reuse``:
    the sum of squares is not returned, so it is overwritten (no model-sized temporaries:
    650 MB each for GPT-2-small) where nothing differentiates through it."""
    for name in names:
        g_sum, sgs = results["grad"][name], results["sum_grad_squared"][name]
        if reuse and not (sgs.requires_grad or g_sum.requires_grad or _wrapped(sgs) or _wrapped(g_sum)
                          or sgs._base is not None):
            results["variance"][name] = sgs.div_(batch_size).addcmul_(
                g_sum, g_sum, value=-1.0 / batch_size**2).clamp_(min=0)
            continue
        results["variance"][name] = torch.addcmul(
            sgs / batch_size, g_sum, g_sum, value=-1.0 / batch_size**2).clamp(min=0)


def _wrapped(t: Tensor) -> bool:
    """A torch.func tensor (vmap, grad): no in-place updates of it."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def _store(results, name, batch: Optional[Tensor], given: Dict[str, Optional[Tensor]]):
    """Fill ``results[q][name]`` from a rule's direct answers or from ``batch``."""
    for q, value in given.items():
        if q == "variance":
            continue
        if value is None:
            if q == "grad":
                value = batch.sum(0)
            elif q == "batch_l2":
                value = (batch**2).flatten(1).sum(1)
            elif q == "sum_grad_squared":
                value = (batch**2).sum(0)
        results[q][name] = value
    if "grad_batch" in results:
        results["grad_batch"][name] = batch
