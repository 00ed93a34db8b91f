"""Results on a sharded model's mesh: DTensors told apart, made whole, and computed layer by
layer on one rank each (:func:`on_owners`, how :mod:`curvlib.precondition` preconditions a
sharded model's vectors with Kronecker factors held once, by their owner)."""

from __future__ import annotations

import sys
from typing import Callable, Dict, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["dtensor_type", "is_sharded", "on_owners", "whole"]


def dtensor_type() -> Optional[type]:
    """``DTensor`` where it is loaded (a model with DTensor parameters loaded it; no import here,
    which would cost every call a second)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def whole(t: Tensor) -> Tensor:
    """``t`` whole: a DTensor's ``full_tensor()`` (a collective), any other tensor itself.

    Args:
        t: a tensor, a DTensor or not.

    Returns:
        The whole tensor; ``t`` itself when it is no DTensor.

    Examples::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from torch import nn
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank here
        >>> model = fully_shard(nn.Linear(3, 2), mesh=init_device_mesh("cpu", (1,)))
        >>> from curvlib.distributed.sharded import whole
        >>> whole(model.weight).shape, type(whole(model.weight)).__name__
        (torch.Size([2, 3]), 'Tensor')
        >>> t = torch.ones(2)
        >>> whole(t) is t
        True
        >>> dist.destroy_process_group()
    """
    return t.full_tensor() if is_sharded(t) else t


def is_sharded(t: object) -> bool:
    """Whether ``t`` is a DTensor (a parameter of a sharded model, or a result on one).

    Args:
        t: any object.

    Returns:
        ``True`` for a DTensor; ``False`` for anything else, and when DTensor was never loaded.

    Examples::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from torch import nn
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank here
        >>> model = fully_shard(nn.Linear(3, 2), mesh=init_device_mesh("cpu", (1,)))
        >>> from curvlib.distributed.sharded import is_sharded
        >>> is_sharded(model.weight), is_sharded(torch.ones(2))
        (True, False)
        >>> dist.destroy_process_group()
    """
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def on_owners(vectors: Mapping[str, Tensor], states: Dict[str, object], prepare: Callable[[str, Tensor, bool], object],
              apply: Callable[[str, object, Tensor], Tensor]) -> Dict[str, Tensor]:
    """``{name: apply(name, state, v)}`` for DTensor ``vectors``, layer by layer on one rank each.

    Layer ``k`` (in sorted order, the same on every rank) is owned by rank ``k mod W``. Every
    rank gathers the layer's vector (``full_tensor``, a collective) and, the first time, calls
    ``prepare(name, v, mine)`` (which gathers the layer's factors, collectives every rank takes
    part in, and, where ``mine``, returns the layer's state: its eigendecomposition); the owner
    computes ``apply(name, state, v)``, whose result is scattered from it in the vector's
    placements. Each layer's state is kept in ``states`` on its owner only.

    ``curvlib.precondition``'s Kronecker functions precondition sharded vectors this way.

    Args:
        vectors: ``{name: vector}``, DTensors (for a vector that is no DTensor, only its owner
            gets the result; the other ranks get an uninitialised tensor of its shape).
        states: ``{name: state}``, filled in by ``prepare`` the first time a layer is met and
            read on the next calls (``None`` on the ranks that do not own the layer).
        prepare: ``prepare(name, v, mine)``, called on every rank with the whole vector;
            returns the layer's state where ``mine``.
        apply: ``apply(name, state, v)``, called on the owner only; returns the layer's result,
            a tensor of ``v``'s shape.

    Returns:
        ``{name: result}``, each a DTensor placed like its vector.

    Examples::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from torch import nn
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank here
        >>> model = fully_shard(nn.Linear(3, 2), mesh=init_device_mesh("cpu", (1,)))
        >>> from torch.distributed.tensor import Shard, distribute_tensor
        >>> from curvlib.distributed.sharded import on_owners
        >>> v = {"w": distribute_tensor(torch.ones(4), model.weight.device_mesh, [Shard(0)])}
        >>> states = {}
        >>> out = on_owners(v, states, lambda name, v, mine: 2.0 if mine else None,
        ...                 lambda name, scale, v: scale * v)
        >>> out["w"].full_tensor(), states
        (tensor([2., 2., 2., 2.]), {'w': 2.0})
        >>> dist.destroy_process_group()
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for k, name in enumerate(sorted(vectors)):
        v, owner = vectors[name], k % world
        full = whole(v)
        if name not in states:
            states[name] = prepare(name, full, rank == owner)
        result = apply(name, states[name], full) if rank == owner else torch.empty_like(full)
        out[name] = sys.modules["torch.distributed.tensor"].distribute_tensor(result, v.device_mesh, v.placements, src_data_rank=owner) \
            if is_sharded(v) else result
    return out
