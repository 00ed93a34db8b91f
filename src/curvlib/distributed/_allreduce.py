"""The one ``all_reduce`` of :mod:`curvlib.distributed`: local results -> global ones.

Every summed entry goes into one flat buffer per dtype and device, unnormalised
(``× M_local``, ``M_local²`` or ``N_local``), with ``[N_local, M_local]`` appended to
the most precise buffer; after the ``all_reduce(SUM)`` the global sizes read back from
it divide the sums (``1/M_global``, ``1/M_global²``, ``1/N_global``). 16-bit results
exchange the sizes first and enter the buffer already scaled by ``r = M_local/M_global``.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from .._core.errors import CurvatureError
from .._core.kronlayout import root_index

__all__ = ["aggregate", "times"]

# Dtypes whose buffers hold the unnormalised sums and the sizes (one collective call).
_FUSED_DTYPES = (torch.float32, torch.float64)

#: (result key, parameter name, factor index, local tensor, power of c or "A")
Entry = Tuple[str, Optional[str], Optional[int], Tensor, object]


def aggregate(
    local: Dict[str, object], kinds, n_local: int, m_local: float, mean: bool, group,
    root_last: Optional[Mapping[str, bool]] = None,
) -> Dict[str, object]:
    """The global quantities from this rank's ``local`` ones (module doc of
    :mod:`curvlib.distributed`). ``m_local``: the number of averaged terms (``"mean"``)
    or 1 (``"sum"``, no rescaling). ``root_last``: parameter name -> whether its Kronecker
    root factor is the last (:func:`curvlib._core.kronlayout.root_index`; needed when a side
    may be diagonal, ``max_factor_dim``)."""
    summed = _summed_entries(local, kinds, n_local, root_last or {})
    groups: Dict[Tuple[torch.dtype, torch.device], List[int]] = {}
    for i, entry in enumerate(summed):
        groups.setdefault((entry[3].dtype, entry[3].device), []).append(i)
    buffers, sizes = _reduce(summed, groups, local, n_local, m_local, mean, group)
    n_global, m_global, r, post = sizes
    out = _local_results(local, kinds, r)
    sgs_global = _unpack(out, summed, groups, buffers, post, loss_nan=mean and m_global == 0)
    if "variance" in local:
        sgs = out.get("sum_grad_squared", sgs_global)
        # (1/N) Σ g² − ((1/N) Σ g)² ≥ 0 exactly; clamp the rounding below zero
        out["variance"] = {
            name: (sgs[name] / n_global - (out["grad"][name] / n_global) ** 2).clamp_(min=0)
            for name in local["variance"]
        }
    return {key: out[key] for key in local}


def _summed_entries(local: Dict[str, object], kinds, n_local: int, root_last: Mapping[str, bool]) -> List[Entry]:
    """Every tensor summed over ranks, with how it depends on ``c``."""
    summed: List[Entry] = []
    for key, value in local.items():
        kind = kinds[key]
        if key == "loss":
            summed.append((key, None, None, value, 1))
        elif kind in ("sum1", "sum2"):
            for name, t in value.items():
                summed.append((key, name, None, t, 1 if kind == "sum1" else 2))
        elif kind == "kfra":  # B is global already (reduced inside the recursion)
            for name, factors in value.items():
                if len(factors) == 2:
                    summed.append((key, name, 1, factors[1], "A"))
        elif kind in ("kron", "kron2"):
            for name, factors in value.items():
                if len(factors) not in (1, 2):  # pragma: no cover - guards future layouts
                    raise CurvatureError(
                        f"{key}['{name}'] has {len(factors)} Kronecker factors; "
                        "curvlib.distributed aggregates one- and two-factor layouts only."
                    )
                root = root_index(factors, root_last.get(name))  # B (or an exact block); the other is A
                for i, t in enumerate(factors):
                    summed.append((key, name, i, t, (1 if kind == "kron" else 2) if i == root else "A"))
    if "variance" in local and "sum_grad_squared" not in local:
        # Σ g² of this rank from its variance: var = sgs/N − (grad/N)².
        for name, var in local["variance"].items():
            grad = local["grad"][name]
            summed.append(("_sgs", name, None, var * n_local + grad * grad / n_local, 2))
    return summed


def _reduce(summed, groups, local, n_local: int, m_local: float, mean: bool, group):
    """One ``all_reduce`` per buffer (asynchronous, then waited for); returns the reduced
    buffers and ``(N_global, M_global, r, post-scale per power)``."""
    import torch.distributed as dist  # lazy: only with a process group

    fused = all(dtype in _FUSED_DTYPES for dtype, _ in groups)
    if fused:
        # Sizes go into the most precise buffer; the sums are unnormalised.
        size_key = max(groups, key=lambda k: torch.finfo(k[0]).bits)
        pre = {1: float(m_local), 2: float(m_local) ** 2, "A": float(n_local)}
    else:
        sizes = torch.tensor([n_local, m_local], dtype=torch.float64, device=local["loss"].device)
        dist.all_reduce(sizes, op=dist.ReduceOp.SUM, group=group)
        n_global, m_global = sizes.tolist()
        r = (m_local / m_global if m_global else 0.0) if mean else 1.0
        size_key = None
        pre = {1: r, 2: r * r, "A": n_local / n_global}
    buffers, works = {}, []
    for key, idx in groups.items():
        parts = [times(summed[i][3].detach(), pre[summed[i][4]]).reshape(-1) for i in idx]
        if key == size_key:
            parts.append(torch.tensor([n_local, m_local], dtype=key[0], device=key[1]))
        buf = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        buffers[key] = buf
        works.append(dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=True))
    for work in works:
        work.wait()
    if not fused:
        return buffers, (n_global, m_global, r, {1: 1.0, 2: 1.0, "A": 1.0})
    n_global, m_global = buffers[size_key][-2:].tolist()
    n_global = round(n_global)
    if not mean:
        m_global = 1.0
    # nothing counted on any rank: every term is zero (PyTorch: NaN loss, zero gradient)
    r = m_local / m_global if m_global else 0.0
    post = {1: 1.0 / m_global, 2: 1.0 / m_global**2, "A": 1.0 / n_global} if m_global else {
        1: 0.0, 2: 0.0, "A": 1.0 / n_global}
    return buffers, (n_global, m_global, r, post)


def _local_results(local: Dict[str, object], kinds, r: float) -> Dict[str, object]:
    """The rank's own per-sample results scaled by ``r``, ``r²`` or ``√r``; empty slots
    for the summed ones."""
    out: Dict[str, object] = {}
    for key, value in local.items():
        if key == "loss":
            continue
        kind = kinds[key]
        if kind in ("kron", "kron2"):
            out[key] = {name: [None] * len(fs) for name, fs in value.items()}
        elif kind == "kfra":
            out[key] = {name: [fs[0]] + [None] * (len(fs) - 1) for name, fs in value.items()}
        elif kind in ("sum1", "sum2", "variance"):
            out[key] = {}
        else:
            scale = {"local1": r, "local2": r * r, "local_half": r**0.5}[kind]
            out[key] = {name: times(t, scale) for name, t in value.items()}
    return out


def _unpack(out, summed, groups, buffers, post, loss_nan: bool) -> Dict[str, Tensor]:
    """Views of the reduced buffers into ``out``; returns the global ``Σ g²`` recovered
    from ranks' variances (when ``sum_grad_squared`` was not asked for)."""
    sgs_global: Dict[str, Tensor] = {}
    for key, idx in groups.items():
        offset, buf = 0, buffers[key]
        for i in idx:
            k, name, j, t, power = summed[i]
            value = buf[offset:offset + t.numel()].view(t.shape) * post[power]
            offset += t.numel()
            if k == "loss":
                out["loss"] = torch.full_like(value, float("nan")) if loss_nan else value
            elif k == "_sgs":
                sgs_global[name] = value
            elif j is not None:
                out[k][name][j] = value
            else:
                out[k][name] = value
    return sgs_global


def times(t: Tensor, r: float) -> Tensor:
    """``r · t``; a rank with nothing counted (``r = 0``: its local results are NaN, 0/0)
    contributes zeros."""
    return torch.zeros_like(t) if r == 0 else t * r
