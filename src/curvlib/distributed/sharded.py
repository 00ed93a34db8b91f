"""FSDP2-sharded models (``torch.distributed.fsdp.fully_shard``) as they are.

``fully_shard`` makes a model's parameters DTensors sharded over a device mesh, gathered by
hooks around each forward and backward. curvlib runs no hooks and takes derivatives with
``torch.func``, so it runs a *twin*: the same modules' state (buffers, attributes, shared
modules shared) under their classes before ``fully_shard``, without hooks, whose parameter
slots hold placeholders of the full shapes (one element each). During a call a parameter is
gathered (``DTensor.full_tensor()``) when a layer's forward reads it and dropped when the layer
is done; what autograd saves of it for the backward is kept as its name and gathered again when
a backward reads it. So a rank holds its shards plus the parameters of the layers it computes
at the moment, as FSDP does block by block; each column chunk of the second order gathers its
layers again. A view of a parameter taken outside a layer (``weight.t()``) keeps it until the
forward returns; the Hessian (``DiagHessian``), a torch.func transform and batch slices
(``batch_chunk_size``) keep what they hold until the call returns.

``f(X_local, y_local)`` is a collective over the mesh, every rank passing its own batch:
the data-parallel aggregation over the ranks of the mesh (:mod:`curvlib.distributed`) makes
summed results those of the global batch. They come back as DTensors: a parameter-shaped
result (``grad``, ``sum_grad_squared``, ``variance``, the diagonals) with its parameter's
placements and dtype (each rank keeps its own shard), each Kronecker factor split over the
ranks the same way along its rows. Per-sample results stay plain tensors of the rank's own
rows, and the loss a plain 0-dim tensor. :mod:`curvlib.precondition` (and so
:class:`curvlib.optim.KFACOptimizer`) takes such results: each layer's factors are
eigendecomposed by one rank, its owner, which preconditions that layer's vectors and scatters
the result back in shards (:func:`on_owners`).

A mixed precision policy (``MixedPrecisionPolicy(param_dtype=...)``) is followed as FSDP does:
parameters (and inputs where it casts them) in ``param_dtype``; summed results in the parameters'.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import types
from typing import Callable, Dict, Iterator, List, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._core.errors import CurvatureError
from .._core.inputs import map_tensors
from ..extensions.combine import Combine
from .._core import param_reads
from ._gather import LayerGather, storage_of
from ._scatter import RowScatter, scattering
from .owners import dtensor_type, is_sharded, on_owners, whole

__all__ = ["fsdp_mesh", "ShardedModel", "sharded", "batch_group", "is_sharded", "on_owners", "whole"]

#: Hook tables of ``nn.Module`` left empty in the twin (curvlib runs no hooks; FSDP's live here).
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
                "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
                "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")

#: Kronecker kinds: a list of factors per parameter, returned replicated.
_KRONECKER = (Combine.KRON, Combine.KRON_SQUARED, Combine.KRON_WHOLE_ROOT)


@functools.lru_cache(maxsize=None)
def _api() -> types.SimpleNamespace:
    """torch's FSDP2 and DTensor names (loaded once a sharded model is met)."""
    from torch.distributed import fsdp, tensor

    return types.SimpleNamespace(FSDPModule=fsdp.FSDPModule, DTensor=tensor.DTensor, Replicate=tensor.Replicate,
                                 Shard=tensor.Shard, distribute_tensor=tensor.distribute_tensor)


def fsdp_mesh(model: nn.Module):
    """The device mesh of the model's DTensor parameters, or ``None`` when it has none.

    ``curvlib.curvature`` calls it to tell a model sharded with ``fully_shard`` from a plain one.

    Args:
        model: the model, sharded with ``torch.distributed.fsdp.fully_shard`` or not.

    Returns:
        The ``DeviceMesh`` its DTensor parameters live on; ``None`` when no parameter is a DTensor.

    Raises:
        CurvatureError: the DTensor parameters sit on more than one mesh.

    Examples::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from torch import nn
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank here
        >>> model = fully_shard(nn.Linear(3, 2), mesh=init_device_mesh("cpu", (1,)))
        >>> from curvlib.distributed.sharded import fsdp_mesh
        >>> fsdp_mesh(model).shape
        (1,)
        >>> fsdp_mesh(nn.Linear(3, 2)) is None
        True
        >>> dist.destroy_process_group()
    """
    dtensor = dtensor_type()
    if dtensor is None:
        return None
    meshes: List[object] = []
    for p in model.parameters():  # (each fully_shard call without a mesh makes an equal one of its own)
        if isinstance(p, dtensor) and not any(p.device_mesh == m for m in meshes):
            meshes.append(p.device_mesh)
    if len(meshes) > 1:
        raise CurvatureError(
            f"The model's parameters are DTensors on {len(meshes)} device meshes; curvlib supports a model "
            "sharded with fully_shard over one mesh (1-D, or 2-D for hybrid sharding).")
    return meshes[0] if meshes else None


def _plain_class(cls: type) -> type:
    """The module's class before ``fully_shard`` (which makes ``FSDP<Class>(FSDPModule, Class)``)."""
    return next(c for c in cls.__mro__ if not issubclass(c, _api().FSDPModule))


def _placeholder(shape, dtype: torch.dtype, device) -> Tensor:
    """A tensor of ``shape`` holding one element (the twin's parameters between calls)."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


class ShardedModel:
    """The twin of a model sharded with ``fully_shard``, and the model's parameter shards.

    The twin (``module``): the same modules' state under their classes before ``fully_shard``,
    without hooks; its parameters are placeholders of the full shapes (one element each), which
    the forwards inside ``call()`` read gathered, layer by layer (the module doc says why).

    Args:
        model: the model sharded with ``fully_shard`` (its parameters DTensors).
        mesh: the device mesh they are sharded over (``fsdp_mesh(model)``).

    Attributes:
        module: the twin, an ``nn.Module`` to take derivatives of.
        mesh: the device mesh.
        shards: ``{name: parameter}``, the model's own (sharded) parameters.
        scatter: what reduces the summed results of parameters sharded along their rows
            straight into their shards (a reduce-scatter per result).

    Examples::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from torch import nn
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank here
        >>> model = fully_shard(nn.Linear(3, 2), mesh=init_device_mesh("cpu", (1,)))
        >>> from curvlib.distributed.sharded import ShardedModel, fsdp_mesh
        >>> twin = ShardedModel(model, fsdp_mesh(model))
        >>> type(twin.module).__name__, type(twin.shards["weight"]).__name__
        ('Linear', 'DTensor')
        >>> twin.module.weight.untyped_storage().nbytes()  # (a placeholder: one element)
        4
        >>> with twin.call() as reader:  # (what a forward reading the placeholder computes with)
        ...     torch.equal(reader.value("weight", twin.module.weight.detach()), model.weight.full_tensor())
        True
        >>> dist.destroy_process_group()
    """

    def __init__(self, model: nn.Module, mesh):
        self.mesh = mesh
        self.compute_dtypes = _compute_dtypes(model)
        self.cast_inputs = _casts_forward_inputs(model)
        self._twins: Dict[int, object] = {}
        self._pairs: List[tuple] = []  # (module, its twin)
        self.module = self._twin(model)
        self.shards = dict(model.named_parameters())
        self.scatter = RowScatter(self.shards, _api())
        self._slots = {name: self._twins[id(p)] for name, p in self.shards.items()}
        self._placeholders = {storage_of(slot): name for name, slot in self._slots.items()}

    def _twin(self, m: nn.Module) -> nn.Module:
        if id(m) in self._twins:
            return self._twins[id(m)]
        cls = _plain_class(type(m))
        twin = cls.__new__(cls)
        state = dict(m.__dict__)
        for table in _HOOK_TABLES:
            if table in state:
                state[table] = collections.OrderedDict()
        state["_parameters"] = {k: None if p is None else self._parameter(p) for k, p in m._parameters.items()}
        state["_modules"] = {k: None if c is None else self._twin(c) for k, c in m._modules.items()}
        twin.__dict__.update(state)
        self._twins[id(m)] = twin
        self._pairs.append((m, twin))
        return twin

    def _parameter(self, p: nn.Parameter) -> nn.Parameter:
        if id(p) not in self._twins:  # (a parameter shared by two modules: one twin)
            dtype = self.compute_dtypes.get(id(p), p.dtype)
            device = p.to_local().device if hasattr(p, "to_local") else p.device
            self._twins[id(p)] = nn.Parameter(_placeholder(p.shape, dtype, device), requires_grad=p.requires_grad)
        return self._twins[id(p)]

    def full(self, name: str, value: Tensor) -> Tensor:
        """``value`` as the twin computes with it.

        Args:
            name: the parameter's name in the model (``"0.weight"``).
            value: its value, a DTensor or a whole tensor.

        Returns:
            Whole (``full_tensor()``, a collective, for a DTensor), detached, in the twin's dtype.
        """
        t = whole(value)
        return (t.detach() if t.requires_grad else t).to(self._slots[name].dtype)

    def placeholder(self, name: str, value: object) -> object:
        """What the twin's pipeline is given for the caller's ``params[name]``.

        Args:
            name: the parameter's name.
            value: the caller's value for it.

        Returns:
            The parameter's placeholder (read gathered inside ``call()``) where ``value`` is a
            tensor of its shape; else ``value`` (``curvlib.curvature`` names what is wrong).
        """
        slot = self._slots.get(name)
        if slot is None or not isinstance(value, Tensor) or tuple(value.shape) != tuple(slot.shape):
            return value
        return slot.detach()

    @contextlib.contextmanager
    def call(self, params: Optional[Mapping[str, Tensor]] = None, when: str = "layers") -> Iterator[LayerGather]:
        """A context in which the twin's forwards read each parameter gathered (an all-gather
        every rank takes part in) when a layer reads it, and again when a backward reads what
        autograd saved of it; train/eval modes and reassigned buffers copied from the model.

        Args:
            params: the caller's ``{name: value}`` (sharded or whole), read instead of shards.
            when: ``"layers"`` (gathered in the forward and again in the backward), ``"forward"``
                (what autograd saves kept) or ``"call"`` (all gathered up front for the call).

        Yields:
            The call's reader: ``value(name, placeholder)``, what a forward computes with.
        """
        for m, twin in self._pairs:  # (what may change between calls: train/eval, reassigned buffers)
            twin.training = m.training
            twin._buffers.update(m._buffers)
        source = {**self.shards, **{k: v for k, v in (params or {}).items() if k in self._slots and isinstance(v, Tensor)}}
        device = next((slot.device for slot in self._slots.values()), torch.device("cpu"))
        reader = LayerGather(self._placeholders, source, self.full, batch_group(self.mesh), device, when)
        with param_reads.reading(reader):
            yield reader


def _fsdp_params(model: nn.Module) -> List[object]:
    """FSDP's records of the model's sharded parameters (``sharded_param``, ``mp_policy``)."""
    found = []
    for m in model.modules():
        if isinstance(m, _api().FSDPModule):
            for group in getattr(m._get_fsdp_state(), "_fsdp_param_groups", ()):
                found += list(getattr(group, "fsdp_params", ()))
    return found


def _compute_dtypes(model: nn.Module) -> Dict[int, torch.dtype]:
    """``id(parameter) -> dtype`` FSDP computes it in: its policy's ``param_dtype`` for a
    floating-point parameter (set before FSDP's first forward, unlike its own record)."""
    found = {}
    for fp in _fsdp_params(model):
        policy, p = getattr(fp, "mp_policy", None), fp.sharded_param
        if policy is not None and policy.param_dtype is not None and p.dtype.is_floating_point:
            found[id(p)] = policy.param_dtype
    return found


def _casts_forward_inputs(model: nn.Module) -> Optional[torch.dtype]:
    """The dtype the root's policy casts floating-point forward inputs to, if it does."""
    state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
    policy = getattr(state, "_mp_policy", None)
    if policy is None or not policy.cast_forward_inputs:
        return None
    return policy.param_dtype


def batch_group(mesh):
    """The process group of the mesh's ranks, over which the batch is split.

    Every rank of the mesh has its own data, so the results are aggregated over all of them:
    the group of a 1-D mesh, or the whole world for a 2-D (hybrid sharding) mesh over it.

    Args:
        mesh: the model's device mesh (``fsdp_mesh(model)``).

    Returns:
        The ``ProcessGroup`` that ``curvlib.curvature(..., process_group=)`` aggregates over.

    Raises:
        CurvatureError: a multi-dimensional mesh over part of the world.

    Examples::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from torch import nn
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank here
        >>> model = fully_shard(nn.Linear(3, 2), mesh=init_device_mesh("cpu", (1,)))
        >>> from curvlib.distributed.sharded import batch_group, fsdp_mesh
        >>> batch_group(fsdp_mesh(model)).size()
        1
        >>> dist.destroy_process_group()
    """
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    raise CurvatureError(
        f"The model is sharded over a {mesh.ndim}-D device mesh of {mesh.size()} of the "
        f"{dist.get_world_size()} ranks; curvlib aggregates a multi-dimensional mesh over the whole world only.")


def sharded(f: Callable[..., Dict[str, object]], model: ShardedModel, kinds: Mapping[str, Combine],
            when: str = "layers") -> Callable:
    """``f`` on the model's shards: parameters gathered layer by layer, results sharded back.

    ``curvlib.curvature`` returns this for a sharded model. The returned function casts
    floating-point inputs where the model's mixed precision policy does, calls ``f`` inside
    ``model.call()`` (each parameter gathered as a layer reads it) and returns each summed result as DTensors placed like the
    parameters (Kronecker factors split along their rows); per-sample results and the loss
    come back as ``f`` returned them.

    Args:
        f: the curvature function of the twin (``curvlib.curvature(model.module, ...)``,
            aggregated over ``batch_group(model.mesh)``), called as
            ``f(X, y, params=, generator=, buffers=)``.
        model: the twin of the sharded model.
        kinds: ``{result key: how it combines over ranks}``, a
            ``curvlib.extensions.combine.Combine`` per key (``SUM`` for ``"grad"``); a key
            not in it is returned as it is.
        when: ``ShardedModel.call``'s: ``"forward"`` where the rank's batch sets the number of
            backwards (the Hessian's), ``"call"`` where it sets the forwards' (batch slices).

    Returns:
        ``g(X, y, params=None, generator=None, buffers=None)``, a collective over the mesh, with
        ``params`` taking sharded or whole parameters.

    Examples::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from torch import nn
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank here
        >>> model = fully_shard(nn.Linear(3, 2), mesh=init_device_mesh("cpu", (1,)))
        >>> import curvlib
        >>> from curvlib.distributed.sharded import ShardedModel, batch_group, fsdp_mesh, sharded
        >>> from curvlib.extensions.combine import Combine
        >>> twin = ShardedModel(model, fsdp_mesh(model))
        >>> f = curvlib.curvature(twin.module, nn.MSELoss(), process_group=batch_group(twin.mesh))
        >>> g = sharded(f, twin, {"grad": Combine.SUM})
        >>> qs = g(torch.randn(4, 3), torch.randn(4, 2))
        >>> type(qs["grad"]["weight"]).__name__, qs["grad"]["weight"].shape
        ('DTensor', torch.Size([2, 3]))
        >>> dist.destroy_process_group()
    """

    def g(X, y, params: Optional[Mapping[str, Tensor]] = None, generator=None, buffers=None):
        if model.cast_inputs is not None:
            X = map_tensors(lambda t: t.to(model.cast_inputs) if t.is_floating_point() else t, X)
        given = None if params is None else {k: model.placeholder(k, v) for k, v in params.items()}
        with model.call(params, when):  # (parameters gathered as each layer reads them)
            with scattering(model.scatter):  # (summed results of row-sharded parameters: shards only)
                results = f(X, y, params=given, generator=generator, buffers=buffers)
        return {key: _distributed(value, kinds.get(key), model) for key, value in results.items()}

    return g


def _distributed(value, kind: Optional[Combine], model: ShardedModel):
    """One result as returned on a sharded model (module doc)."""
    if kind is None or not isinstance(value, Mapping) or kind.samples_dim is not None:
        return value  # (the loss; per-sample results: the rank's own rows)
    api = _api()
    out = {}
    for name, v in value.items():
        shard = model.shards[name]
        dtype = shard.dtype
        mesh = getattr(shard, "device_mesh", model.mesh)
        if kind in _KRONECKER:  # (split over the ranks like the parameter, along the factor's rows)
            placements = [api.Shard(0) if p.is_shard() else p for p in shard.placements] \
                if hasattr(shard, "placements") else [api.Replicate()] * mesh.ndim
            out[name] = [t.to(dtype) if is_sharded(t) else
                         api.distribute_tensor(t.to(dtype), mesh, placements, src_data_rank=None) for t in v]
        elif is_sharded(v):  # (reduce-scattered into its shards already)
            out[name] = v.to(dtype)
        elif hasattr(shard, "placements"):
            out[name] = api.distribute_tensor(v.to(dtype), mesh, shard.placements, src_data_rank=None)
        else:
            out[name] = v.to(dtype)
    return out
