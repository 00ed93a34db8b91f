"""The one ``all_reduce`` of :mod:`curvlib.distributed`: local results -> global ones.

Every summed entry goes into one flat buffer per dtype and device, unnormalised
(``× M_local``, ``M_local²`` or ``N_local``), with ``[N_local, M_local]`` appended to
the most precise buffer; after the ``all_reduce(SUM)`` the global sizes read back from
it divide the sums (``1/M_global``, ``1/M_global²``, ``1/N_global``). 16-bit results
exchange the sizes first and enter the buffer already scaled by ``r = M_local/M_global``.

In a sharded model's call (:func:`curvlib.distributed._scatter.scattering`) the results of
parameters sharded along their rows stay out of the buffer: after it, each is reduce-scattered
on its own with the same factors, and its local tensor is freed before the next.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .._core.errors import CurvatureError
from ..extensions.combine import Combine, Weight, formed, parts
from . import _scatter

__all__ = ["aggregate", "early_sink", "times"]

# Dtypes whose buffers hold the unnormalised sums and the sizes (one collective call).
_FUSED_DTYPES = (torch.float32, torch.float64)

#: (result key, parameter name, factor index, local tensor, weight: how it depends on c)
Entry = Tuple[str, Optional[str], Optional[int], Tensor, Weight]


def aggregate(
    local: Dict[str, object], kinds: Mapping[str, Combine], n_local: int, m_local: float, mean: bool, group,
    root_last: Optional[Mapping[str, bool]] = None, later: Sequence = (),
) -> Dict[str, object]:
    """The global quantities from this rank's ``local`` ones (module doc of
    :mod:`curvlib.distributed`). ``kinds``: result key -> how ranks combine it (an
    extension's ``ranks``). ``m_local``: the number of averaged terms (``"mean"``)
    or 1 (``"sum"``, no rescaling). ``root_last``: parameter name -> whether its Kronecker
    root factor is the last (:func:`curvlib._core.kronlayout.root_index`; needed when a side
    may be diagonal, ``max_factor_dim``). ``later``: the formed extensions (``Combine.FORMED``),
    formed again from the global results of their ``needs``, which ``local`` holds."""
    summed = _summed_entries(local, kinds, root_last or {})
    scatter = _scatter.current()
    done = [e for e in summed if scatter is not None and scatter.reduced(e[3])]  # (by early_sink)
    summed = [e for e in summed if not (scatter is not None and scatter.reduced(e[3]))]
    rows = {i for i, e in enumerate(summed) if scatter is not None and scatter.takes(e[1], e[3])}
    groups: Dict[Tuple[torch.dtype, torch.device], List[int]] = {}
    for i, entry in enumerate(summed):
        if i not in rows:
            groups.setdefault((entry[3].dtype, entry[3].device), []).append(i)
    buffers, sizes = _reduce(summed, groups, local, n_local, m_local, mean, group)
    n_global, m_global, r, pre, post = sizes
    out = _local_results(local, kinds, r)
    _unpack(out, summed, groups, buffers, post, loss_nan=mean and m_global == 0)
    del buffers
    for key, name, j, t, _ in done:
        _put(out, key, name, j, t)
    for i in sorted(rows):  # (one at a time: a whole entry beside its shard, never all of them)
        key, name, j, t, weight = summed[i]
        _put(out, key, name, j, scatter(name, t, weight.factor(*pre), weight.factor(*post)))
        _release(local, summed, [i])
    for ext in later:
        out[ext.name] = formed(ext, out, n_global)
    return {key: out[key] for key in local}


def early_sink(scatter, kinds: Mapping[str, Combine], n_local: int, m_local: float, mean: bool, group, device):
    """A sink (:mod:`curvlib._core.sink`) that reduce-scatters each summed first-order result of a
    row-sharded parameter the moment it is read, with the weights :func:`aggregate` would give it
    (the global sizes exchanged first, one small ``all_reduce``): unnormalised before the sum
    (``× M_local``, ``M_local²``, ``N_local``) and divided by the global sizes after; 16-bit
    results scaled by ``r = M_local/M_global`` before. :func:`aggregate` then keeps them as they are.

    Args:
        scatter: the sharded model's ``RowScatter``.
        kinds: result key -> how ranks combine it.
        n_local: the rank's samples.
        m_local: its number of averaged terms (``"mean"``) or 1.
        mean: the loss averages.
        group: the process group.
        device: where the sizes are exchanged (the inputs' device).

    Returns:
        ``sink(key, name, value)``: the rank's rows as a DTensor, or ``value`` as it is (per-sample
        results, a parameter not sharded along its rows).
    """
    sizes = torch.tensor([float(n_local), float(m_local), float(n_local) ** 2, float(m_local) ** 2],
                         dtype=torch.float64, device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.SUM, group=group)
    n_global, m_global, n_squares, m_squares = sizes.tolist()
    # every rank's sizes equal, W Σ n_k² = (Σ n_k)² (Cauchy–Schwarz: otherwise larger): each
    # entry's factor is the same on every rank, so it is applied after the sum, not to a copy before
    world = dist.get_world_size(group)
    uniform = world * n_squares == n_global ** 2 and world * m_squares == m_global ** 2
    n_global, m_global = round(n_global), (m_global if mean else 1.0)
    r = m_local / m_global if m_global else 0.0
    fused = ((float(m_local), float(n_local)), (1.0 / m_global if m_global else 0.0, 1.0 / n_global))
    scaled = ((r, n_local / n_global), (1.0, 1.0))

    def sink(key: str, name: str, value: Tensor) -> Tensor:
        kind = kinds.get(key)
        if kind is None or kind.samples_dim is not None or kind is Combine.FORMED or not scatter.takes(name, value):
            return value
        (part,) = parts(kind, {name: value})
        pre, post = fused if value.dtype in _FUSED_DTYPES else scaled
        before, after = part.weight.factor(*pre), part.weight.factor(*post)
        if uniform and before != 0:
            before, after = 1.0, before * after
        return scatter(name, value, before, after)

    return sink


def _summed_entries(local: Dict[str, object], kinds: Mapping[str, Combine],
                    root_last: Mapping[str, bool]) -> List[Entry]:
    """Every tensor summed over ranks, with how it depends on ``c``
    (:func:`curvlib.extensions.combine.parts`; the rank's own rows and a root factor that is
    the whole batch's already are not summed)."""
    summed: List[Entry] = []
    for key, value in local.items():
        kind = kinds[key]
        if kind.samples_dim is not None:
            continue
        for p in parts(kind, value, root_last):
            if p.index is not None and len(value[p.name]) not in (1, 2):  # pragma: no cover - future layouts
                raise CurvatureError(
                    f"{key}['{p.name}'] has {len(value[p.name])} Kronecker factors; "
                    "curvlib.distributed aggregates one- and two-factor layouts only."
                )
            if p.weight is not Weight.WHOLE:
                summed.append((key, p.name, p.index, p.tensor, p.weight))
    return summed


def _reduce(summed, groups, local, n_local: int, m_local: float, mean: bool, group):
    """One ``all_reduce`` per buffer (asynchronous, then waited for); returns the reduced
    buffers and ``(N_global, M_global, r, pre, post)``: an entry is scaled by its weight's factor
    of ``pre`` before and of ``post`` after (:meth:`curvlib.extensions.combine.Weight.factor`)."""

    fused = all(e[3].dtype in _FUSED_DTYPES for e in summed)  # (the reduce-scattered ones too)
    if fused:
        # Sizes go into the most precise buffer; the sums are unnormalised.
        size_key = max(groups, key=lambda k: torch.finfo(k[0]).bits)
        pre = (float(m_local), float(n_local))  # unnormalised: × M_local^power, × N_local
    else:
        sizes = torch.tensor([n_local, m_local], dtype=torch.float64, device=local["loss"].device)
        dist.all_reduce(sizes, op=dist.ReduceOp.SUM, group=group)
        n_global, m_global = sizes.tolist()
        r = (m_local / m_global if m_global else 0.0) if mean else 1.0
        size_key = None
        pre = (r, n_local / n_global)
    buffers, works = {}, []
    for key, idx in groups.items():
        buf = _filled(summed, idx, pre, key, (n_local, m_local) if key == size_key else None)
        _release(local, summed, idx)
        buffers[key] = buf
        works.append(dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=True))
    for work in works:
        work.wait()
    if not fused:
        return buffers, (n_global, m_global, r, pre, (1.0, 1.0))
    n_global, m_global = buffers[size_key][-2:].tolist()
    n_global = round(n_global)
    if not mean:
        m_global = 1.0
    # nothing counted on any rank: every term is zero (PyTorch: NaN loss, zero gradient)
    r = m_local / m_global if m_global else 0.0
    post = (1.0 / m_global if m_global else 0.0, 1.0 / n_global)  # the weights of (1/M_global, 1/N_global)
    return buffers, (n_global, m_global, r, pre, post)


def _filled(summed, idx: List[int], pre, key, sizes) -> Tensor:
    """One flat buffer of the entries ``idx``, each scaled by its weight's factor of ``pre`` as
    it is written (no scaled copy beside the buffer), the ``sizes`` at its end."""
    total = sum(summed[i][3].numel() for i in idx) + (2 if sizes is not None else 0)
    buf = torch.empty(total, dtype=key[0], device=key[1])
    offset = 0
    for i in idx:
        t, factor = summed[i][3].detach(), summed[i][4].factor(*pre)
        part = buf[offset:offset + t.numel()]
        if factor == 0:  # (a rank with nothing counted: zeros, not its NaN, 0/0; see times)
            part.zero_()
        else:
            torch.mul(t.reshape(-1), factor, out=part)
        offset += t.numel()
    if sizes is not None:
        buf[offset:] = torch.tensor(sizes, dtype=key[0], device=key[1])
    return buf


def _release(local: Dict[str, object], summed: List[Entry], idx: List[int]) -> None:
    """Drop the local tensors of the entries ``idx`` (now in their buffer) from ``local`` and
    ``summed``: shape-only stand-ins take their places, so that the local results are freed
    before the global ones are unpacked (two copies of a summed result at the peak, not three)."""
    for i in idx:
        key, name, j, t, weight = summed[i]
        stand_in = torch.empty(t.shape, dtype=t.dtype, device="meta")
        summed[i] = (key, name, j, stand_in, weight)
        if name is None:
            local[key] = stand_in
        elif j is None:
            local[key][name] = stand_in
        else:
            local[key][name][j] = stand_in


def _local_results(local: Dict[str, object], kinds, r: float) -> Dict[str, object]:
    """The rank's own per-sample results scaled by ``r``, ``r²`` or ``√r``, a root factor that
    is the whole batch's already as it is; empty slots for the summed ones."""
    out: Dict[str, object] = {}
    for key, value in local.items():
        kind = kinds[key]
        if isinstance(value, Tensor):  # (the loss: summed)
            continue
        out[key] = {}
        for p in parts(kind, value):
            if kind.samples_dim is not None:
                out[key][p.name] = times(p.tensor, p.weight.factor(r, 1.0))
            elif p.index is not None:
                factors = out[key].setdefault(p.name, [None] * len(value[p.name]))
                factors[p.index] = p.tensor if p.weight is Weight.WHOLE else None
    return out


def _unpack(out, summed, groups, buffers, post, loss_nan: bool) -> None:
    """Views of the reduced buffers into ``out``."""
    for key, idx in groups.items():
        offset, buf = 0, buffers[key]
        for i in idx:
            k, name, j, t, weight = summed[i]
            value = buf[offset:offset + t.numel()].view(t.shape) * weight.factor(*post)
            offset += t.numel()
            if name is None and loss_nan:  # (the loss)
                value = torch.full_like(value, float("nan"))
            _put(out, k, name, j, value)


def _put(out, key: str, name: Optional[str], j: Optional[int], value: Tensor) -> None:
    """``value`` into its slot of ``out``: the loss, a parameter's tensor or its factor ``j``."""
    if name is None:
        out[key] = value
    elif j is not None:
        out[key][name][j] = value
    else:
        out[key][name] = value


def times(t: Tensor, r: float) -> Tensor:
    """``r · t``; a rank with nothing counted (``r = 0``: its local results are NaN, 0/0)
    contributes zeros."""
    return torch.zeros_like(t) if r == 0 else t * r
