"""An op on parameters run once per sample on rows merged with the batch (:class:`PerSample`).

A functional site whose operands hold the batch merged with rows (SAM's relative-position
``einsum`` on queries ``[N·H, h, w, C]``) and which takes no extra leading dim is run as
``vmap`` over the samples of the split-off batch
(:func:`curvlib._plan.batch_merges.split_merged_batches`); :func:`agrees` tests, on drawn
operands of the planning pass's shapes, that this gives the values of the merged op (the
op acts on each sample's rows alone).
"""

from __future__ import annotations

import torch
from torch import Tensor, fx

from .mixing_ops import Batch

__all__ = ["PerSample", "agrees", "call_node"]


def call_node(node: fx.Node, args, kwargs):
    """``node``'s op on ``args`` and ``kwargs`` (a function, or a tensor method)."""
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


class PerSample:
    """``op`` run once per sample (:func:`torch.func.vmap` over a leading batch dim of the
    operands at ``positions``), for an op on merged rows that takes no extra leading dim:
    every sample's rows ``[c, ...]`` go through the op as the merged ``[N·c, ...]`` did.
    ``method``: ``op`` names a tensor method (a ``call_method`` node)."""

    def __init__(self, op, positions, method: bool = False):
        self.op, self.positions, self.method = op, frozenset(positions), method
        self.__name__ = f"per_sample_{getattr(op, '__name__', op)}"

    def __call__(self, *args, **kwargs):
        def one(*a):
            return getattr(a[0], self.op)(*a[1:], **kwargs) if self.method else self.op(*a, **kwargs)

        in_dims = tuple(0 if k in self.positions else None for k in range(len(args)))
        return torch.func.vmap(one, in_dims=in_dims)(*args)


def _drawn(value, gen: torch.Generator):
    """A real tensor of ``value``'s shape, dtype and device drawn from ``gen`` (the planning
    passes hold fake tensors); ``None`` for one that is not floating point."""
    if not value.dtype.is_floating_point:
        return None
    # drawn on the CPU generator's device: torch's default device (set_default_device) may be another
    draw = torch.randn(tuple(value.shape), generator=gen, dtype=torch.float64, device="cpu")
    return draw.to(value.dtype).to(value.device)


def agrees(node: fx.Node, env, positions, batch: Batch) -> bool:
    """Whether ``node`` run once per sample on its merged operands (:class:`PerSample`, each
    sample's rows as :func:`curvlib._plan.unmerge.unmerge` splits them off) gives, merged back, the values it gave
    on the merged rows: the op acts on each sample's rows alone, not across them. Tested on
    drawn operands of the planning pass's shapes; an op on integer operands is not tested
    (and not split: refused by the planner)."""
    outer, inner, d = batch.c // batch.s, batch.s, batch.dim
    gen = torch.Generator().manual_seed(0)
    drawn = {}
    for m in node.all_input_nodes:
        drawn[m] = _drawn(env[m], gen) if isinstance(env.get(m), Tensor) else env.get(m)
        if isinstance(env.get(m), Tensor) and drawn[m] is None:
            return False
    load = lambda a: fx.node.map_arg(a, lambda m: drawn[m])  # noqa: E731
    args, kwargs = list(load(node.args)), load(node.kwargs)
    with torch.no_grad():
        want = call_node(node, args, kwargs)
    for k in positions:
        args[k] = args[k].unflatten(d, (outer, -1, inner)).movedim(d + 1, 0).flatten(d + 1, d + 2)
    method = node.op == "call_method"
    try:
        with torch.no_grad():
            out = PerSample(node.target, positions, method)(*args, **kwargs)
    except (RuntimeError, ValueError, TypeError, IndexError):  # (the op refuses one sample's rows)
        return False
    if not isinstance(out, Tensor) or not isinstance(want, Tensor) or out.dim() != want.dim() + 1:
        return False
    out = out.unflatten(d + 1, (outer, inner)).movedim(0, d + 1).flatten(d, d + 2)
    scale = want.abs().max() if want.numel() else 0
    return out.shape == want.shape and bool(torch.allclose(out, want, rtol=1e-4, atol=1e-5 * float(scale)))
