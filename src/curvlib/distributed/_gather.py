"""A sharded model's parameters gathered layer by layer, while the layer computes.

The twin of a model sharded with ``fully_shard`` (:mod:`curvlib.distributed.sharded`) holds
placeholders in its parameter slots. During a call, :class:`LayerGather` is the reader of
:mod:`curvlib._core.param_reads`: a forward reading a placeholder gets the parameter gathered
whole (``full_tensor()``, an all-gather over its mesh) at that moment, and drops it when the
layer is done with it. What autograd saves of it for the backward (the weight of
``x Wᵀ``, whose input gradient is ``g W``; a view such as ``Wᵀ``) is stored as a
:class:`SavedParameter`, the parameter's name and the view's geometry, and gathered again when
the backward reads it: a rank holds the parameters of the layers it is computing, not the
model's.

Every gather is a collective over the parameter's mesh, so every rank gathers the same
parameters in the same order: the forwards run the same graph, the backwards visit its nodes
in the same order (autograd's order is the graph's), and the column chunks pulled back are as
many on every rank (:meth:`LayerGather.agreed`).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["LayerGather", "SavedParameter", "storage_of"]


def storage_of(t: Tensor) -> int:
    """The address of ``t``'s storage (``-1`` where it has none a view could share: a tensor
    subclass or a torch.func wrapper)."""
    if type(t) is not Tensor and not isinstance(t, torch.nn.Parameter):
        return -1
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1


@dataclass(frozen=True)
class SavedParameter:
    """A gathered parameter's view autograd saved: its name and geometry (gathered again when read)."""

    name: str
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int


class LayerGather:
    """The reader of one call on a sharded model (module doc).

    Args:
        placeholders: ``{storage address: name}`` of the twin's placeholders.
        source: ``{name: value}``, each parameter's shard (a DTensor) or a whole value given by
            the caller.
        full: ``full(name, value)``, the whole tensor the twin computes with (a collective for a
            DTensor).
        group: the process group the ranks' counts are agreed over.
        device: where that agreement's tensor lives (the shards' device).
        when: ``"layers"``: what autograd saves of a gathered parameter is stored as its name
            and gathered again in the backward; ``"forward"``: saved as it is, gathered until
            the call returns (the Hessian's backwards, as many as the rank's batch asks, must
            not gather); ``"call"``: every parameter gathered once, up front, for the whole
            call (batch slices: as many forwards as the rank's batch asks).
    """

    def __init__(self, placeholders: Mapping[int, str], source: Mapping[str, Tensor],
                 full: Callable[[str, Tensor], Tensor], group, device, when: str = "layers"):
        self._placeholders, self._source, self._full = placeholders, source, full
        self._group, self._device, self._when = group, device, when
        # storage address -> (gathered tensor, name); an entry whose tensor is gone is stale
        self._alive: Dict[int, Tuple[weakref.ref, str]] = {}
        # (up front: one all-gather per parameter, in the model's order on every rank)
        self._held = {name: self.gather(name) for name in source} if when == "call" else {}

    def value(self, name: str, value: Tensor) -> Tensor:
        """``value`` to compute with: its parameter gathered where it is a placeholder."""
        slot = self._placeholders.get(storage_of(value))
        if slot is None:
            return value
        return self._held[slot] if slot in self._held else self.gather(slot)

    def gather(self, name: str) -> Tensor:
        """The parameter ``name`` whole (a collective where it is sharded)."""
        with torch.no_grad():  # (full_tensor is differentiable: no graph to the shard)
            t = self._full(name, self._source[name])
        ptr = storage_of(t)
        if ptr >= 0:
            self._alive[ptr] = (weakref.ref(t), name)
        return t

    def saving(self):
        """The forward's saved tensor hooks: a gathered parameter (or a view of one) saved as a
        :class:`SavedParameter`, gathered again when the backward reads it (none where the
        call does not gather in the backward)."""
        if self._when != "layers":
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: Tensor):
        entry = self._alive.get(storage_of(t))
        if entry is None or entry[0]() is None:
            return t
        return SavedParameter(entry[1], tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def _unpack(self, saved):
        if not isinstance(saved, SavedParameter):
            return saved
        return self.gather(saved.name).as_strided(saved.size, saved.stride, saved.offset)

    def agreed(self, n: int) -> int:
        """The smallest ``n`` over the ranks (an all-reduce): one count (or choice) every rank
        uses; ``n`` itself in batch slices (no collective: the ranks may run different numbers
        of them, which gather nothing and reduce nothing while they run)."""
        if self._when == "call":
            return n
        t = torch.tensor([n], dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group)
        return int(t.item())
