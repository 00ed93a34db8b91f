"""Embedding look-up ``y[n, p] = W[idx[n, p]]`` (``nn.Embedding``), batched with an explicit ``n``.

Shapes: indices ``idx [N, *S]`` (integers in ``[0, V)``), ``W [V, D]``, output and
``g = ∂L/∂y`` ``[N, *S, D]``. The positions ``*S`` are flattened into ``p``
(``P`` of them; ``P = 1`` for ``idx [N]``), so the rule works on ``idx [n, p]``
and ``g [n, p, d]``. Positions holding ``padding_idx`` get no gradient; their
``g`` rows are zeroed first (written ``g̃`` below), so they drop out of every
formula.

Individual gradient (``e_v`` the ``v``-th unit vector of length ``V``):

    ∂ℓ_n/∂W = Σ_p e_{idx[n, p]} g̃[n, p]ᵀ        [N, V, D],

i.e. row ``v`` of sample ``n`` is ``G[n, v] = Σ_{p: idx[n, p] = v} g̃[n, p]``, a
scatter-add of the ``g̃`` rows at the indices.

The norms and squares never form ``[N, V, D]``: only the pairs ``(n, v)`` that
occur are non-zero rows of ``G``, at most ``N·P`` of them. With the key
``k = n·V + idx[n, p]`` sorted, equal keys are adjacent; numbering the runs
``r = 0, 1, …`` gives ``G_r = Σ_{p in run r} g̃_p`` (``[N·P, D]``, unused rows
zero) and

    ‖∂ℓ_n/∂W‖² = Σ_{runs r of sample n} ‖G_r‖²,
    Σ_n (∂ℓ_n/∂W)²[v] = Σ_{runs r with index v} G_r²,

in ``O(N·P·(D + log N·P))`` time and ``O(N·P·D)`` memory, with fixed shapes (no
``unique``), so it also runs under :func:`torch.func.vmap`. This equals the Gram
form ``‖∂ℓ_n/∂W‖² = Σ_{p,q} [idx_p = idx_q] g̃_p·g̃_q`` without its ``P²`` cost.

Refused (see :func:`check`): ``max_norm`` (the look-up renormalises rows of the
weight in place, mutating the module) and ``scale_grad_by_freq=True`` (the
gradient is divided by index counts over the whole batch, mixing samples).
``sparse=True`` only changes how autograd stores ``W.grad``; the quantities
here are dense tensors either way.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._core.calls import argument
from .._core.errors import CurvatureError
from ._gram import gram
from .._core.family import Family
from .._core.site import Recorder, RoleTensors, Rule, Site
from .._core.tensors import in_place_safe, is_wrapped


def check(module: nn.Embedding, where: str) -> None:
    """Refuse the options whose individual gradients are not defined here.

    Raises:
        CurvatureError: if ``max_norm`` is set or ``scale_grad_by_freq`` is true.
    """
    if module.max_norm is not None:
        raise CurvatureError(
            f"Embedding '{where}' has max_norm={module.max_norm}: every look-up "
            "renormalises rows of the weight in place, which would mutate the model "
            "(curvlib never changes it). Supported: max_norm=None; renormalise the "
            "weight yourself outside curvlib if you need it."
        )
    if module.scale_grad_by_freq:
        raise CurvatureError(
            f"Embedding '{where}' has scale_grad_by_freq=True: its gradient is divided "
            "by how often each index occurs in the whole batch, which mixes samples, "
            "so individual gradients are ill-defined. Supported: scale_grad_by_freq=False."
        )


def _flat(site: Site, g: Tensor) -> Tuple[Tensor, Tensor]:
    """``idx [n, p]`` and ``g̃ [n, p, d]`` (padding rows zeroed; the site is batch first)."""
    idx = site.saved["idx"]
    n = idx.shape[0]
    idx, g = idx.reshape(n, -1), g.reshape(n, -1, g.shape[-1])
    pad = site.meta["padding_idx"]
    if pad is not None:
        g = g * (idx != pad).unsqueeze(-1).to(g.dtype)
    return idx, g


def grad_batch(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``{"weight": [N, V, D]}``: ``G[n, v] = Σ_{p: idx[n, p] = v} g̃[n, p]``."""
    if "weight" not in roles:
        return {}
    idx, g = _flat(site, g)
    n, v, d = idx.shape[0], site.meta["num_embeddings"], g.shape[-1]
    sample = torch.arange(n, device=idx.device).unsqueeze(1)
    keys = (sample * v + idx).reshape(-1)
    return {"weight": _rows_summed(g, keys, n * v).view(n, v, d)}


def grad_batch_columns(site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
    """:func:`grad_batch` of every column of ``m [V, *out]`` at once, ``{"weight": [V, N, E, D]}``:
    one scatter, each (column, sample) pair its own block of rows."""
    if "weight" not in roles:
        return {}
    cols = m.shape[0]
    idx = site.saved["idx"].reshape(site.saved["idx"].shape[0], -1)  # [N, P]
    g = m.reshape(cols, idx.shape[0], idx.shape[1], m.shape[-1])  # [V, N, P, D]
    pad = site.meta["padding_idx"]
    if pad is not None:
        g = g * (idx != pad).unsqueeze(-1).to(g.dtype)
    n, e, d = idx.shape[0], site.meta["num_embeddings"], g.shape[-1]
    block = torch.arange(cols * n, device=idx.device).reshape(cols, n, 1)
    keys = (block * e + idx).reshape(-1)
    return {"weight": _rows_summed(g, keys, cols * n * e).view(cols, n, e, d)}


def _rows_summed(g: Tensor, keys: Tensor, rows: int) -> Tensor:
    """``[rows, D]`` zeros with ``g``'s rows (``[..., D]``, flattened) added at ``keys``: in place where
    ``g`` allows it, so that no second tensor of the result's size is made (a vocabulary's rows
    per sample); out of place under a torch.func transform (the zeros are not batched) or autograd."""
    d = g.shape[-1]
    out = g.new_zeros(rows, d)
    if not in_place_safe(g):
        return out.index_add(0, keys, g.reshape(-1, d))
    return out.index_add_(0, keys, g.reshape(-1, d))


def grad(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``{"weight": [V, D]}``: ``Σ_{n,p} e_{idx[n, p]} g̃[n, p]ᵀ``."""
    if "weight" not in roles:
        return {}
    idx, g = _flat(site, g)
    d = g.shape[-1]
    out = g.new_zeros(site.meta["num_embeddings"], d)
    if is_wrapped(g):  # (vmap: new_zeros is unbatched, g batched)
        return {"weight": out.index_add(0, idx.reshape(-1), g.reshape(-1, d))}
    return {"weight": out.index_add_(0, idx.reshape(-1), g.reshape(-1, d))}  # no second [V, D]


def _runs(site: Site, g: Tensor):
    """Rows ``G_r`` of the non-zero ``(n, v)`` pairs (see module docstring).

    Returns:
        ``(first, sample, index, rows)``, all over the ``N·P`` sorted positions:
        ``first [N·P]`` 1.0 where a run starts (else 0.0), ``sample``/``index``
        ``[N·P]`` the run's ``n`` and ``v``, ``rows [N·P, D]`` the run's ``G_r``.
    """
    idx, g = _flat(site, g)
    n, v, d = idx.shape[0], site.meta["num_embeddings"], g.shape[-1]
    sample = torch.arange(n, device=idx.device).unsqueeze(1)
    keys, order = (sample * v + idx).reshape(-1).sort()
    starts = torch.cat([keys.new_ones(1, dtype=torch.bool), keys[1:] != keys[:-1]])
    run = starts.cumsum(0) - 1
    sums = g.new_zeros(keys.shape[0], d).index_add(0, run, g.reshape(-1, d)[order])
    return starts.to(g.dtype), keys // v, keys % v, sums[run]


def batch_l2(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``{"weight": [N]}``: ``Σ_{runs r of n} ‖G_r‖²``."""
    if "weight" not in roles:
        return {}
    first, sample, _, rows = _runs(site, g)
    n = site.saved["idx"].shape[0]
    return {"weight": g.new_zeros(n).index_add(0, sample, (rows**2).sum(1) * first)}


def sum_grad_squared(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``{"weight": [V, D]}``: ``Σ_{runs r with index v} G_r²``."""
    if "weight" not in roles:
        return {}
    first, _, index, rows = _runs(site, g)
    out = g.new_zeros(site.meta["num_embeddings"], rows.shape[1])
    squares = rows**2 * first.unsqueeze(1)
    if not in_place_safe(squares):
        return {"weight": out.index_add(0, index, squares)}
    return {"weight": out.index_add_(0, index, squares)}  # no second [V, D] (large for a vocabulary)


def kron(site: Site, role: str, m: Tensor, approx: Optional[str] = None,
         max_dim: Optional[int] = None) -> List[Tensor]:
    """Kronecker factors ``[A, B]`` of the weight ``W [V, D]`` from the root ``m [V', N, *S, D]``.

    The look-up is a Linear map of the one-hot input ``x = e_idx`` (``0`` at padding
    positions, whose rows get no gradient), ``y = Wᵀ x``, so Linear's factors apply with
    the roles of rows and columns swapped; in the row-major order of ``W`` (row ``v``,
    column ``d``) the input factor comes first:

    * ``A [V]``: the diagonal of ``(1/N) Σ_{n,p} x xᵀ``, i.e. token counts
      ``#{(n, p): idx[n, p] = v ≠ padding_idx} / N`` (``"expand"``: ``/ (N·P)``); never
      a dense ``V × V`` matrix;
    * ``B [D, D]``: ``Σ_{v',n} (Σ_p m̃)(Σ_p m̃)ᵀ`` (``"expand"``: ``Σ_{v',n,p} m̃ m̃ᵀ``),
      ``m̃`` the root with padding positions zeroed.

    ``"reduce"`` equals ``None`` for ``idx [N]`` (one position); on sequences its input
    factor is dense, which :func:`curvlib._plan.support.check_second_order` refuses. ``max_dim``:
    ``B [D]``, its diagonal, when ``D > max_dim`` (:func:`curvlib.rules._gram.gram`).
    """
    idx, rows = _root_rows(site, m)  # [N, P], [V', N, P, D]
    if approx == "reduce" and idx.shape[1] > 1:  # (refused before any work; a backstop)
        raise CurvatureError(f"KFAC-reduce of Embedding '{site.where}' on sequences needs a dense V x V factor.")
    s = rows.reshape(-1, rows.shape[-1]) if approx == "expand" else rows.sum(2).reshape(-1, rows.shape[-1])
    return [kron_input(site, approx), gram(s, max_dim)]


def _root_rows(site: Site, m: Tensor) -> Tuple[Tensor, Tensor]:
    """``idx [N, P]`` and the root ``m [V', N, P, D]`` with padding positions zeroed."""
    idx = _flat_index(site)
    m = m.reshape(m.shape[0], idx.shape[0], idx.shape[1], m.shape[-1])
    pad = site.meta["padding_idx"]
    if pad is not None:
        m = m * (idx != pad % site.meta["num_embeddings"]).unsqueeze(-1).to(m.dtype)
    return idx, m


def _flat_index(site: Site) -> Tensor:
    """``idx [N, P]``."""
    idx = site.saved["idx"]
    return idx.reshape(idx.shape[0], -1)


def kron_input(site: Site, approx: Optional[str] = None) -> Tensor:
    """``A [V]``: token counts (padding left out) over ``N`` (``"expand"``: ``N·P``), see :func:`kron`."""
    idx = _flat_index(site)
    n, positions = idx.shape
    v = site.meta["num_embeddings"]
    dtype = site.meta.get("dtype", torch.get_default_dtype())
    weights = torch.ones(idx.numel(), dtype=dtype, device=idx.device)
    pad = site.meta["padding_idx"]
    if pad is not None:
        weights = weights * (idx.reshape(-1) != pad % v).to(dtype)
    counts = weights.new_zeros(v).index_add(0, idx.reshape(-1), weights)
    return counts / (n * positions if approx == "expand" else n)


def sum_squares_over_columns(site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``{"weight": [1, V, D]}``: ``Σ_c Σ_n G_c[n]²`` for a root ``m [C, *out]`` at once
    (each distinct ``(n, v)`` pair's row ``Σ_{p: idx[n,p]=v} m̃_c[n, p]``, squared, summed
    over the columns, then added into row ``v``)."""
    if "weight" not in roles:
        return {}
    return {"weight": _row_squares(site, m).unsqueeze(0)}


def weighted_squares_over_columns(site: Site, m: Tensor, roles: Sequence[str], weights: Tensor,
                                  per_sample: bool) -> RoleTensors:
    """``{"weight": [V, D]}``: ``Σ_c Σ_n w_cn G_c[n]²`` for a root ``m [C, *out]`` and weights
    ``[C, N]`` (each ``(n, v)`` row's square weighted by its sample's weight); ``per_sample``:
    ``[N, V, D]``, ``Σ_c w_cn G_c[n]²`` (each sample's rows are its own)."""
    if "weight" not in roles:
        return {}
    return {"weight": _row_squares(site, m, weights, per_sample)}


def _row_squares(site: Site, m: Tensor, weights: Optional[Tensor] = None, per_sample: bool = False) -> Tensor:
    """``[V, D]``: ``Σ_c Σ_n (w_cn) G_c[n]²`` (see :func:`sum_squares_over_columns`); ``per_sample``:
    ``[N, V, D]``, each run's square added into its own sample's row ``n·V + v``."""
    idx, _ = _flat(site, m[0])
    c, n, v = m.shape[0], idx.shape[0], site.meta["num_embeddings"]
    mc = m.reshape(c, n * idx.shape[1], m.shape[-1])
    pad = site.meta["padding_idx"]
    if pad is not None:
        mc = mc * (idx != pad).reshape(1, -1, 1).to(mc.dtype)
    # runs of equal sorted keys n·V + v (module doc; fixed shapes, so it runs under vmap)
    keys, order = (torch.arange(n, device=idx.device).unsqueeze(1) * v + idx).reshape(-1).sort()
    starts = torch.cat([keys.new_ones(1, dtype=torch.bool), keys[1:] != keys[:-1]])
    run = starts.cumsum(0) - 1
    rows = mc.new_zeros(c, keys.shape[0], mc.shape[-1]).index_add(1, run, mc[:, order])  # [C, N·P, D]
    if weights is None:
        squares = (rows**2).sum(0)[run]
    else:  # (a run's rows are one sample's: its weight, w[c, key // V])
        squares = ((rows**2)[:, run] * weights[:, keys // v].unsqueeze(-1).to(rows.dtype)).sum(0)
    squares = squares * starts.to(mc.dtype).unsqueeze(1)  # once per run, at its start
    out = mc.new_zeros(n * v if per_sample else v, mc.shape[-1])
    at = keys if per_sample else keys % v
    out = out.index_add(0, at, squares) if not in_place_safe(squares) else out.index_add_(0, at, squares)
    return out.reshape(n, v, -1) if per_sample else out  # (in place: no second [V, D])


EMBEDDING = Rule(
    kind="embedding",
    grad_batch=grad_batch,
    grad=grad,
    batch_l2=batch_l2,
    sum_grad_squared=sum_grad_squared,
    sum_squares_over_columns=sum_squares_over_columns,
    weighted_squares_over_columns=weighted_squares_over_columns,
    grad_batch_columns=grad_batch_columns,
    any_batch_dim=True,
)


def forward(module: nn.Embedding, where: str, names: dict, tensors: dict, args, kwargs, rec: Recorder):
    """Run ``nn.Embedding`` functionally (never renormalising its weight) and record its site."""
    check(module, where)
    idx = argument(args, kwargs, 0, "input")
    out = functional(idx, tensors["weight"], module.padding_idx)
    meta = {"padding_idx": module.padding_idx, "num_embeddings": module.num_embeddings,
            "dtype": out.dtype, "index_dims": idx.dim()}
    return rec.add(Site(EMBEDDING, names, where, saved={"idx": idx}, meta=meta), out)


def functional(input: Tensor, weight: Tensor, padding_idx: Optional[int] = None,  # noqa: A002 - F.embedding's names
               max_norm: Optional[float] = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
               sparse: bool = False) -> Tensor:
    """``F.embedding`` with the padding row a constant in every mode of differentiation: torch's
    backward gives ``W[padding_idx]`` no gradient, its forward mode a tangent all the same, so the
    looked-up rows at the padding index are taken off the graph (``torch.where`` with their
    detached values) and ``J v`` agrees with ``Jᵀ``."""
    out = F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    if padding_idx is None:
        return out
    pad = padding_idx % weight.shape[0]
    return torch.where((input == pad).unsqueeze(-1), out.detach(), out)


def kron_refusal(site: Site, approx: Optional[str]) -> Optional[str]:
    """KFAC-reduce on sequences is not defined: its input factor would be a dense ``V x V`` matrix."""
    if approx != "reduce" or site.meta.get("index_dims", 1) <= 1:
        return None
    return (f"(Embedding '{site.where}' on sequences): KFAC-reduce's input factor, the mean over positions "
            "of the one-hot inputs, is a dense V x V matrix. Use kfac_approx=None or 'expand' "
            "(diagonal token-frequency factors).")


def dense_sides(site: Site, role: str, shape: Sequence[int]) -> List[int]:
    """The weight's rows get a diagonal factor: one dense factor, of the embedding dim."""
    return [shape[-1]]


#: The family's record (:class:`~curvlib._core.family.Family`), registered in :data:`curvlib.rules.FAMILIES`.
FAMILY = Family("embedding", (nn.Embedding,), forward, check, kron=kron, kron_input=kron_input, kron_layout="own",
                root_last=True, affine_in_input=True, affine_in_parameters=True, shared_hessian=True,
                kron_refusal=kron_refusal, dense_sides=dense_sides, row_wise=True)
