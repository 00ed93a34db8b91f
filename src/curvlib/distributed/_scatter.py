"""Summed results of a sharded model reduced straight into row shards (``reduce_scatter``).

On a model sharded with ``fully_shard`` over a 1-D mesh, a rank keeps only its rows of a summed
result (its parameter's ``Shard(0)`` placement; a Kronecker factor split along its rows the
same way). All-reducing the whole result and slicing it would hold, per rank, the local result,
a whole flat buffer of every result and the whole reduced copy; ``reduce_scatter`` sums each
result over the ranks and leaves each rank its own rows, one result at a time:

$$\\text{rank } k\\text{'s rows} = \\sum_{\\text{ranks } j} w_j \\cdot \\text{local}_j[k c : (k + 1) c],
\\qquad c = \\lceil d_0 / W \\rceil,$$

with $w_j$ the weight of the entry on rank $j$ (:mod:`curvlib.distributed._allreduce`),
the rows padded with zeros to $c W$ (``torch.chunk``'s split, which DTensor's ``Shard(0)`` uses:
the last ranks may hold fewer rows, or none). Where every rank's $w_j$ is the same, it is applied after
the sum instead; then, if the rows divide evenly, the entry is reduce-scattered as it is, with no
scaled copy beside it.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["RowScatter", "current", "scattering"]

#: The scatter of the sharded call under way (``None``: every summed result all-reduced whole).
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("curvlib_row_scatter", default=None)


def current() -> Optional["RowScatter"]:
    """The :class:`RowScatter` of the sharded call under way, or ``None``."""
    return _CURRENT.get()


@contextlib.contextmanager
def scattering(scatter: "RowScatter") -> Iterator[None]:
    """A context in which :func:`curvlib.distributed._allreduce.aggregate` reduce-scatters the
    results ``scatter`` takes (a sharded model's call: :func:`curvlib.distributed.sharded.sharded`).

    Args:
        scatter: the sharded model's :class:`RowScatter`.

    Yields:
        None.
    """
    token = _CURRENT.set(scatter)
    try:
        yield
    finally:
        _CURRENT.reset(token)


class RowScatter:
    """Reduce-scatters a parameter's summed results into its row shards (module doc).

    Args:
        shards: ``{name: parameter}``, the sharded model's own parameters (DTensors).
        api: torch's DTensor names (``DTensor``, ``Shard``), loaded by the caller.

    Attributes:
        shards: the parameters, as given.
    """

    def __init__(self, shards: Mapping[str, Tensor], api):
        self.shards, self._api = shards, api

    def takes(self, name: Optional[str], t: Tensor) -> bool:
        """Whether the entry ``t`` of parameter ``name`` is reduce-scattered: the parameter is
        sharded along its rows over a 1-D mesh (the group results are summed over) and ``t`` has
        rows; other entries (a 2-D hybrid mesh, the loss) are all-reduced whole."""
        p = self.shards.get(name) if name is not None else None
        if p is None or not isinstance(p, self._api.DTensor) or t.dim() == 0:
            return False
        return p.device_mesh.ndim == 1 and tuple(p.placements) == (self._api.Shard(0),)

    def reduced(self, t: object) -> bool:
        """Whether ``t`` is a result reduce-scattered already (a DTensor)."""
        return isinstance(t, self._api.DTensor)

    def __call__(self, name: str, t: Tensor, pre: float, post: float) -> Tensor:
        """``post · Σ_ranks pre · t`` as a DTensor of this rank's rows (a collective).

        Args:
            name: the parameter ``t`` belongs to (one :meth:`takes` accepted).
            t: this rank's entry, whole.
            pre: its factor before the sum (a rank with ``pre = 0`` contributes zeros, not NaN).
            post: the factor after.

        Returns:
            The DTensor on the parameter's mesh, placed ``Shard(0)``, of ``t``'s shape.
        """
        mesh = self.shards[name].device_mesh
        group = mesh.get_group()
        world, rank = group.size(), dist.get_rank(group)
        rows = t.shape[0]
        per = -(-rows // world)  # c = ⌈d_0 / W⌉ rows a rank (zeros below the last real row)
        if pre == 1 and per * world == rows and t.is_contiguous():  # (the entry as it is: no copy)
            padded = t.detach()
        else:
            padded = t.new_zeros((per * world,) + tuple(t.shape[1:]))
            if pre != 0:
                torch.mul(t.detach(), pre, out=padded[:rows])
        mine = t.new_empty((per,) + tuple(t.shape[1:]))
        # (torch 2.13 names it reduce_scatter_single and warns on the older name)
        reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        reduce_scatter(mine, padded, op=dist.ReduceOp.SUM, group=group)
        del padded
        own = max(0, min(per, rows - rank * per))
        mine = (mine[:own] * post) if own < per else mine.mul_(post)
        stride = torch.empty(t.shape, device="meta").stride()
        return self._api.DTensor.from_local(mine, mesh, [self._api.Shard(0)], run_check=False, shape=t.shape,
                                            stride=stride)
