"""Backward passes that read every site as its gradient arrives (to bound the backward's memory).

A plain ``torch.autograd.grad(loss, [every site's output])`` returns all the sites'
output gradients together at the end: on a language model every ``[N, T, d]`` of every
block and the head's ``[N, T, V]`` are alive at once, beside whatever the read-off then
builds. Here a hook on each site hands its gradient to a reader the moment the backward
has completed it, and the backward frees it right after (:func:`stream_sites`); the
backward's inputs are only the lowest sites (:func:`lowest_targets`), the others are
passed on the way. :func:`read_when_passed` builds per-parameter reads on top: a
parameter of several sites (tied or shared weights) waits for all of them.
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, Sequence, Set

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from .._core import settings

__all__ = ["as_edges", "lowest_targets", "read_when_passed", "stream_sites", "worth_streaming"]


def worth_streaming(shapes: Sequence[tuple], dtypes: Sequence[torch.dtype]) -> bool:
    """Whether sites with these output shapes and dtypes are read as the backward reaches them
    (:attr:`~curvlib._core.settings.Settings.stream_min_bytes` of outputs at least)."""
    total = 0
    for shape, dtype in zip(shapes, dtypes):
        n = 1
        for s in shape:
            n *= int(s)
        total += n * dtype.itemsize
    return total >= settings.current().stream_min_bytes


def as_edges(targets: Sequence[Tensor], lowest: set) -> list:
    """The targets as the backward's inputs: the lowest as tensors (leaves, first layers),
    every other one by its gradient edge (``(node, output_nr)``), which does not keep the
    tensor alive: site outputs that only curvlib would keep (on a language model: the head's
    logits and each block's projections) go as soon as the graph lets them."""
    return [t if k in lowest or not t.requires_grad else get_gradient_edge(t) for k, t in enumerate(targets)]


def stream_sites(loss: Tensor, targets: Sequence, lowest: set, like: Sequence[tuple],
                 read: Callable[[int, Tensor], None], retain: bool, cotangent: Optional[Tensor] = None) -> None:
    """One backward from ``loss`` (or from the output ``loss`` seeded with ``cotangent``)
    that hands every site's output gradient ``g_k`` to ``read(k, g_k)`` as soon as it is
    complete, then lets the backward free it.

    ``targets[k]``: site ``k``'s tensor (``k`` in ``lowest``) or gradient edge
    (:func:`as_edges`); ``like[k]``: its ``(shape, dtype, device)``. A hook on each runs
    when the backward reaches it (every use of the output has contributed by then). The
    backward's inputs are only the *lowest* targets (:func:`lowest_targets`): every other one lies
    on a path to one of them, so the backward passes through it, but is not an input, so
    its gradient is not kept to the end; the lowest ones' hooks hand on zeros (stride 0, no
    memory): nothing below them is needed. So at most the gradients the backward itself
    holds are alive, never all ``g_k`` at once (on a language model, every block's
    ``[N, T, d]`` and the head's ``[N, T, V]``). A site the loss does not reach is read with zeros.
    """
    done = [False] * len(targets)

    def hook(k: int, t):
        def on_grad(g: Tensor) -> None:
            read(k, g)
            done[k] = True

        if isinstance(t, Tensor):  # (a lowest target)
            return t.register_hook(lambda g: on_grad(g) or g.new_zeros(()).expand_as(g))
        nr = t.output_nr
        return t.node.register_prehook(lambda grads: None if grads[nr] is None else on_grad(grads[nr]))

    handles = [hook(k, t) for k, t in enumerate(targets) if not isinstance(t, Tensor) or t.requires_grad]
    try:
        if lowest and loss.requires_grad:
            torch.autograd.grad(loss, [targets[k] for k in sorted(lowest)], cotangent, retain_graph=retain,
                                allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    for k, (shape, dtype, device) in enumerate(like):
        if not done[k]:
            read(k, torch.zeros(shape, dtype=dtype, device=device))


def lowest_targets(targets: Sequence[Tensor]) -> set:
    """Indices of the targets with no other target below them in the autograd graph
    (leaves, i.e. zero probes, and outputs computed from the input alone)."""
    at = {(t.grad_fn, t.output_nr) for t in targets if t.grad_fn is not None}
    at |= {id(t) for t in targets if t.grad_fn is None}  # a leaf's edge: its AccumulateGrad node's variable
    reaches: Dict[object, bool] = {}  # graph node -> whether a target lies below it
    for t in targets:
        if t.grad_fn is not None:
            walk_down(t.grad_fn, at, reaches)
    return {k for k, t in enumerate(targets) if t.requires_grad and (t.grad_fn is None or not reaches[t.grad_fn])}


def walk_down(root, at: set, reaches: Dict[object, bool]) -> None:
    """Fill ``reaches[node]`` for ``root`` and every node below it, depth first without
    recursion (graphs are thousands of nodes deep); each node is visited once."""
    stack = [[root, iter(root.next_functions), False]]
    while stack:
        frame = stack[-1]
        for nxt, nr in frame[1]:
            if nxt is None:
                continue
            frame[2] = frame[2] or (nxt, nr) in at or id(getattr(nxt, "variable", None)) in at
            if nxt in reaches:
                frame[2] = frame[2] or reaches[nxt]
                continue
            stack.append([nxt, iter(nxt.next_functions), False])
            break
        else:
            stack.pop()
            reaches[frame[0]] = frame[2]
            if stack:
                stack[-1][2] = stack[-1][2] or frame[2]


def read_when_passed(pull: Callable[[Callable[[int, Tensor], None]], None], sites_of: Mapping[str, Set[int]],
                     read: Callable[[str, Dict[int, Tensor]], None]) -> None:
    """Run ``pull(on_site)`` (a streamed pullback: ``on_site(k, g_k)`` per site) and call
    ``read(name, m)`` for every name as soon as ``m`` holds ``g_k`` of all its sites
    ``sites_of[name]`` (``m[k] = g_k``, kept only until no name waiting needs it; a site
    the pullback never reaches arrives as zeros at the end). A name without sites is read
    last, with an empty ``m``."""
    waiting = {n for n, keys in sites_of.items() if keys}
    m: Dict[int, Tensor] = {}

    def on_site(k: int, g: Tensor) -> None:
        shared = any(k in sites_of[n] and len(sites_of[n]) > 1 for n in waiting)
        m[k] = g.clone() if shared else g  # (a kept g: the backward may add into its buffer)
        # (in ``sites_of``'s order, not the set's, which differs between processes: a sharded
        # model's ranks reduce each result as it is read, in the same order)
        for n in [n for n in sites_of if n in waiting and k in sites_of[n] and sites_of[n] <= m.keys()]:
            waiting.discard(n)
            read(n, m)
        for j in [j for j in m if not any(j in sites_of[n] for n in waiting)]:
            del m[j]  # every name reading site j is read

    pull(on_site)
    for n, keys in sites_of.items():
        if not keys:
            read(n, {})
