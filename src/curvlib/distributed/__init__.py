"""Data-parallel aggregation: the quantities of the global batch on every rank.

``curvature(model, lossfn, extensions, process_group=pg)`` returns
``f(X_local, y_local, params=None)``. Every rank of ``pg`` calls it on its own
batch (local batch sizes may differ) and gets what a single process would
return on the concatenation of all ranks' batches, in rank order:

* summed over samples, identical on every rank: ``loss``, ``grad``,
  ``sum_grad_squared``, ``variance``, ``diag_ggn_exact``, ``diag_ggn_mc``,
  ``diag_h`` and the Kronecker factors of ``KFAC`` and ``KFLR``;
* per sample, for the rank's own samples only (the rank's rows of the
  global result): ``grad_batch``, ``batch_l2``, the batch diagonals and the
  GGN square roots (``[C, N_local, *p]``, ``[M, N_local, *p]``).

How the global quantities come out of the local ones
----------------------------------------------------
Every supported loss is ``L = c · Σ_n ℓ_n`` with ``c = 1/M`` for ``"mean"``
(``M`` the number of averaged terms: ``y.numel()`` for all three losses) and
``c = 1`` for ``"sum"`` (:mod:`curvlib.losses`). A rank's local results carry
``c_local = 1/M_local``; the global ones carry ``1/M_global``. With
``r = M_local / M_global`` (``r = 1`` for ``"sum"``):

| quantity | depends on ``c`` as | global value |
|---|---|---|
| loss, grad, GGN/Hessian diagonals, ``B`` of KFAC/KFLR | ``c`` | ``Σ_ranks r · local`` |
| ``sum_grad_squared`` | ``c²`` | ``Σ_ranks r² · local`` |
| ``A = (1/N) Σ x xᵀ`` of KFAC/KFLR | ``1/N`` | ``Σ_ranks (N_local/N_global) · local`` |
| ``variance`` (formed from its ``needs``) | | ``(1/N) Σ g² − ((1/N) Σ g)²`` with the global ``grad``, ``Σ g²`` (every rank computes its ``Σ g²`` for it), ``N`` |
| ``grad_batch``, batch diagonals | ``c`` | ``r · local`` (stays on the rank) |
| ``batch_l2`` | ``c²`` | ``r² · local`` |
| ``sqrt_ggn_exact``, ``sqrt_ggn_mc`` | ``√c`` | ``√r · local`` |

Collective calls
----------------
One ``all_reduce(SUM)`` per call of ``f`` (per dtype and device of the
results; one for a usual model): everything summed is flattened into one
buffer, together with ``[N_local, M_local]``. The summed terms are put in the
buffer without their local normalisation (times ``M_local``, ``M_local²`` or
``N_local``) and divided by the global sizes read back from the same buffer,
so the sizes need no exchange of their own. Results in 16-bit floating
dtypes (which cannot hold such sums exactly) take a second call: the sizes
are exchanged first (``int64``), then the buffer is reduced with ``r`` applied.
Only ``all_reduce`` with ``SUM`` is used: gloo (CPU) and NCCL (GPU) both work.

Monte Carlo
-----------
``DiagGGNMC``, ``BatchDiagGGNMC``, ``SqrtGGNMC`` and ``KFAC`` draw independent
samples on every rank, even when every rank seeded its random state the same
way (as data-parallel scripts usually do): per call, curvlib draws one number
from the extension's ``generator`` (or from the global random state when it
has none), mixes it with the rank into a seed, and runs the local computation
on a stream seeded with it. The generator (or the global state) is then left
as it was after that single draw: ranks that start in step stay in step, and
results are reproducible from the generator's state and the rank.

KFRA: its recursion ``G_a = (1/N) Σ_n J_nᵀ G_z J_n`` averages over the batch
at *every* layer and multiplies those averages, so the global factors are not
a sum of local ones: each matrix is made global where it is formed (one
collective per layer, :func:`kfra_reducer`); its input factors ``A`` are then
aggregated like KFLR's.

Refused (before any work)
-------------------------
* ``GGNMP``, ``HMP``, ``PCHMP``: the products are callables evaluated later,
  each would be a collective of its own. Compute them without
  ``process_group`` and sum ``r · (local product)`` over the ranks yourself.

Caveats: ``f`` is a collective, so every rank of the group must call it, with
the same extensions and parameters (same shapes and dtypes), the same number
of times; the summed results are detached from autograd; ``f`` cannot run
under ``torch.func.vmap``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .._core import inputs as _inputs
from ..losses import _targets
from .._core.buffers import vmapped
from .._core.errors import CurvatureError, CurvatureTypeError
from ..extensions import SecondOrder
from ..extensions.combine import Combine
from .._core import sink as _sink
from . import _scatter
from ._allreduce import aggregate, early_sink, times
from ..losses import LossSpec, normaliser

__all__ = ["aggregated"]

# How each result is aggregated: an extension's ``ranks``, a curvlib.extensions.combine.Combine
# (per-sample kinds stay the rank's own rows, scaled; summed kinds are summed over ranks).
_MASK64 = (1 << 64) - 1


def _refuse_vmapped(X, y, params, buffers) -> None:
    """Collectives have no vmap rule ("Batching rule not implemented for c10d::allreduce_"):
    refuse a call whose inputs ``vmap`` batches, before any work."""
    given = [t for d in (params, buffers) if isinstance(d, Mapping) for t in d.values()]
    if any(isinstance(t, Tensor) and vmapped(t) for t in _inputs.tensors(X) + [y] + given):
        raise CurvatureError(
            "curvature(..., process_group=...) under torch.func.vmap: the all_reduce over ranks "
            "cannot be vmapped. Call f per member or task (a loop), or without process_group."
        )


def aggregated(
    f: Callable[..., Dict[str, object]],
    spec: LossSpec,
    exts: Tuple,
    process_group: object,
    root_last: Optional[Callable[..., Mapping[str, bool]]] = None,
    sliced: bool = False,
) -> Callable[..., Dict[str, object]]:
    """Wrap the single-process transform ``f`` so that it returns global quantities.

    Args:
        f: ``f(X, y, params=None)`` of ``curvlib.curvature`` without a group.
        spec: the loss (its reduction decides the rescaling).
        exts: the extensions ``f`` computes.
        process_group: a ``torch.distributed`` group (``dist.group.WORLD``) this process is in.
        root_last: ``(X, params) -> {name: bool}``: a Kronecker root factor last (``max_factor_dim``).
        sliced: ``f`` combines batch slices (``batch_chunk_size``): results reduced after it only.

    Returns:
        ``g(X_local, y_local, params=None)``: a collective call returning the
        quantities of the global batch (see the module doc).

    Raises:
        CurvatureError: an extension that cannot be aggregated, or no torch.distributed.
        CurvatureTypeError: ``process_group`` is not a process group.

    Examples::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import DiagGGNExact
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> f = curvature(model, nn.CrossEntropyLoss(), [DiagGGNExact()], process_group=dist.group.WORLD)
        >>> qs = f(X, y)                                   # every rank calls it: a collective
        >>> single = curvature(model, nn.CrossEntropyLoss(), [DiagGGNExact()])(X, y)
        >>> torch.allclose(qs["diag_ggn_exact"]["0.weight"], single["diag_ggn_exact"]["0.weight"])
        True
        >>> dist.destroy_process_group()
    """
    kinds, generators, later = _aggregation_kinds(exts)
    _check_group(process_group)
    mean = spec.reduction == "mean"

    def g(X, y: Tensor, params: Optional[Mapping[str, Tensor]] = None, generator=None,
          buffers: Optional[Mapping[str, Tensor]] = None) -> Dict[str, object]:
        _refuse_vmapped(X, y, params, buffers)
        rank, device = _member_rank(dist, process_group), _inputs.first(X).device
        with _rank_streams(generators, rank, device), \
                _sink.sinking(None if sliced else _early(spec, kinds, process_group, X, y, device)):
            local = f(X, y, params=params, generator=generator, buffers=buffers)
        n_local = _inputs.batch_size(X)
        m_local = normaliser(spec, _targets.prepare_targets(spec, y)) if mean else 1.0
        return aggregate(local, kinds, n_local, m_local, mean, process_group, root_last and root_last(X, params),
                         later)

    return g


def _early(spec: LossSpec, kinds: Mapping[str, Combine], process_group, X, y: Tensor, device):
    """On a sharded model's call, the sink that reduces each first-order result into the rank's
    rows as it is read (:func:`curvlib.distributed._allreduce.early_sink`); ``None`` otherwise,
    or when the sizes cannot be read (``f`` then says what is wrong with the inputs)."""
    scatter = _scatter.current()
    if scatter is None:
        return None
    mean = spec.reduction == "mean"
    try:
        n_local = _inputs.batch_size(X)
        m_local = normaliser(spec, _targets.prepare_targets(spec, y)) if mean else 1.0
    except (CurvatureError, RuntimeError, ValueError, TypeError):
        return None
    return early_sink(scatter, kinds, n_local, m_local, mean, process_group, device)


def result_kinds(exts: Tuple) -> Dict[str, Combine]:
    """How each result of ``exts`` combines over ranks (result key -> kind; ``loss`` and ``grad``
    summed); refuses what cannot be combined."""
    return _aggregation_kinds(tuple(exts))[0]


def _member_rank(dist, process_group) -> int:
    """This process's rank in ``process_group``, refused when it is not a member."""
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise CurvatureError(
            "This process is not a member of process_group; only its members may call "
            "the function curvature(..., process_group=...) returned."
        )
    return rank


def _aggregation_kinds(exts: Tuple) -> Tuple[Dict[str, Combine], List[Optional[torch.Generator]], List]:
    """How each result combines over ranks (result key -> kind of :func:`aggregate`), the
    Monte-Carlo generators whose streams differ per rank, and the extensions formed from the
    global results of their ``needs``; refuses what cannot be combined."""
    kinds: Dict[str, Combine] = {"loss": Combine.SUM, "grad": Combine.SUM}
    generators: List[Optional[torch.Generator]] = []
    for ext in exts:
        kind = type(ext).ranks
        if kind is None and type(ext).ranks_refused:
            raise CurvatureError(
                f"{type(ext).__name__} cannot be aggregated over a process group: {type(ext).ranks_refused}"
            )
        if kind is None:
            raise CurvatureError(
                f"{type(ext).__name__} (result {ext.name!r}) has no data-parallel aggregation "
                "rule in curvlib.distributed; call curvature without process_group."
            )
        if isinstance(ext, SecondOrder) and ext.root == "mc" and not any(g is ext.generator for g in generators):
            generators.append(ext.generator)
        kinds[ext.name] = kind
    return kinds, generators, [e for e in exts if kinds[e.name] is Combine.FORMED]


def kfra_reducer(spec: LossSpec, process_group, n_local: int, m_local: int) -> Callable[[Tensor, str], Tensor]:
    """The collective KFRA's recursion needs at every layer (see :mod:`curvlib._evaluate.kfra`).

    KFRA's matrices are batch averages multiplied layer by layer, so they are
    made global where they are formed: ``reduce(G, "loss")`` turns the local
    summed loss Hessian into the global one (``× r = M_local/M_global``, then
    summed over ranks), ``reduce(G, "batch")`` a local batch average into the
    global one (``× N_local/N_global``, then summed). One collective for the
    sizes, one per reduced matrix.
    """
    import torch.distributed as dist  # lazy: only with a process group

    sizes = torch.tensor([float(n_local), float(m_local)], dtype=torch.float64)
    dist.all_reduce(sizes, op=dist.ReduceOp.SUM, group=process_group)
    n_global, m_global = sizes.tolist()
    r = (m_local / m_global if m_global else 0.0) if spec.reduction == "mean" else 1.0

    def reduce(G: Tensor, kind: str) -> Tensor:
        G = times(G, r if kind == "loss" else n_local / n_global)
        dist.all_reduce(G, op=dist.ReduceOp.SUM, group=process_group)
        return G

    return reduce


def _check_group(process_group: object) -> None:
    try:
        import torch.distributed as dist  # lazy: only with a process group
    except ImportError:  # pragma: no cover
        dist = None
    if dist is None or not dist.is_available():
        raise CurvatureError(
            "curvature(..., process_group=...) needs torch.distributed, which this torch "
            "build does not provide (torch.distributed.is_available() is False)."
        )
    if not dist.is_initialized():
        raise CurvatureError(
            "curvature(..., process_group=...): torch.distributed is not initialised; call "
            "torch.distributed.init_process_group(...) on every rank first (or pass "
            "process_group=None for one process)."
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise CurvatureTypeError(
            "process_group must be a torch.distributed process group (e.g. "
            f"torch.distributed.group.WORLD or one from new_group), got {process_group!r} "
            f"of type {type(process_group).__name__}."
        )


# ----------------------------------------------------------------------------- streams


def _mix(base: int, rank: int) -> int:
    """A seed from a shared draw and the rank (splitmix64 finaliser), in [0, 2^63)."""
    z = (base + (rank + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _draw(generator: Optional[torch.Generator]) -> int:
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=device).item())


@contextlib.contextmanager
def _rank_streams(generators: List[Optional[torch.Generator]], rank: int, device: torch.device):
    """Run the block on per-rank random streams (see "Monte Carlo" in the module doc).

    Each generator (``None``: the global random state) advances by one draw, exactly
    as it would on every other rank, and is restored to that state afterwards.
    """
    if not generators:
        yield
        return
    with contextlib.ExitStack() as stack:
        for gen in generators:
            seed = _mix(_draw(gen), rank)
            if gen is None:
                cuda = [device] if device.type == "cuda" else []
                stack.enter_context(torch.random.fork_rng(devices=cuda))
                torch.default_generator.manual_seed(seed)
                if cuda:
                    with torch.cuda.device(device):
                        torch.cuda.manual_seed(seed)
            else:
                state = gen.get_state()
                stack.callback(gen.set_state, state)
                gen.manual_seed(seed)
        yield
