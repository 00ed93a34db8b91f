"""Second-order quantities from one linearised forward pass.

GGN family. A symmetric factor ``S [V, N, *out]`` of the scaled loss Hessian
(exact: ``V = C``; Monte Carlo: ``V = M``) is pulled back through the graph
in one batched vector-Jacobian product, ``m_k = J_kᵀ S`` at every site ``k``
(``[V, *site_out]``). A site's rule then gives, per vector ``v``, the
per-sample parameter factor ``J_pᵀ m_v`` (its ``grad_batch`` applied to
``m_v``), so

* ``sqrt``       = ``[V, N, *p]``: ``grad_batch(m_v)`` for every ``v``,
* ``diag``       = ``Σ_v sum_grad_squared(m_v)`` (never forms ``[N, *p]`` where
  the rule avoids it),
* ``batch_diag`` = ``Σ_v grad_batch(m_v)²``,
* ``kron``       = ``[B, A]`` from the rule's Kronecker statistics (other layouts,
  e.g. the exact block ``[Σ sqrt sqrtᵀ]`` of a normalisation's scale: :mod:`curvlib._core.kronlayout`).

A parameter used by several sites sums ``J_pᵀ m`` over its sites before any
square is taken.

Hessian diagonal: the GGN's plus every nonlinear node's signed residual columns, pulled
back like ``S`` (:mod:`curvlib._evaluate.hessian_diag`).

Products (``GGNMP``, ``HMP``, ``PCHMP``) return callables that re-run the
forward with the parameter as the only variable (same random state, so the
same dropout masks), using forward-mode and reverse-mode autodiff; they
form no Jacobian or Hessian.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Mapping, Optional, Sequence

import torch
from torch import Tensor

from .._core import strategy as _strategy
from .._core.tensors import is_concrete
from .linearise import Linearization
from .._core.errors import CurvatureError
from ..extensions import SecondOrder
from .._core.kronlayout import add_root_factor
from ..rules.fixed_rows import unused_block
from .._core.scratch import reusing
from .._core.site import uses_of
from . import read_off as _read_off
from .hessian_diag import DiagRequest, hessian_diag
from .read_off import ColumnStatistic, batch_diag, column_statistic, diag, kronecker_factors, root_last, sqrt_columns
from .root_buffers import RootBuffers, write_sqrt
from .streamed import read_when_passed

def second_order(
    lin: Linearization,
    curv,
    exts: Sequence[SecondOrder],
    names: Sequence[str],
    params: Mapping[str, Tensor],
    batch_size: int,
    residual_grads: Sequence[Tensor],
    product: Optional[Callable],
    kfra_factors: Optional[Callable],
    chunk_size: Optional[int] = None,
    site_grads: Optional[Sequence[Tensor]] = None,
    into: Optional[RootBuffers] = None,
) -> Dict[str, Dict[str, object]]:
    """Every requested second-order quantity, per parameter (see module doc).

    ``curv`` is the loss Hessian at the output (:func:`curvlib.losses.curvature_at`):
    its roots come with signs (``Σ sign · S Sᵀ``; an indefinite loss Hessian has a
    negative part), and every quantity linear in the GGN is the signed sum.
    ``product(ext, name)`` builds a block-product callable; ``kfra_factors()``
    runs the KFRA recursion (both re-run the forward, so the caller owns them; ``None``
    when no such extension is asked for).
    ``chunk_size`` bounds the number of columns pulled back at once (memory
    ``∝ chunk_size × activations``); results are the same for any value.
    ``site_grads``: the loss gradient at every site (the empirical Fisher's root).
    ``into``: where square roots are written (a batch's, shared by its slices; see
    :mod:`curvlib._evaluate.root_buffers`); default: new buffers for this call.
    """
    uses = uses_of(lin.sites)
    results: Dict[str, Dict[str, object]] = {}

    def signed(roots, group):
        _refuse_indefinite_sqrt(curv, roots, group)
        total = None
        for sign, S in roots:
            part = _accumulate(lin, uses, S, group, names, params, batch_size, chunk_size, into)
            total = part if total is None else _signed_sum(total, part, sign, group, uses)
        return total

    exact = [e for e in exts if e.root == "exact"]
    if exact:
        results.update(signed(curv.roots(), exact))
    for ext in exts:
        q = ext.quantity
        if ext.root == "mc":
            results.update(signed(curv.sampled_roots(ext.mc_samples, ext.generator), [ext]))
        elif ext.root == "grad":  # one column per sample: its own loss gradient, already at every site
            m = [g.unsqueeze(0) for g in site_grads]
            cache: Dict[object, object] = {"static": {}}
            results[ext.name] = {n: _read("kron", uses, m, n, params, batch_size, 1, cache, _kron_options(ext)) for n in names}
        elif q in ("hessian_diag", "hessian_batch_diag"):
            results[ext.name] = hessian_diag(lin, uses, results[ext.name], residual_grads, DiagRequest(
                names, params, batch_size, batch=(q == "hessian_batch_diag"), chunk_size=chunk_size))
        elif q in ("ggnmp", "hmp", "pchmp"):
            results[ext.name] = {n: product(ext, n) for n in names}
        elif q == "kfra":
            results[ext.name] = kfra_factors()
    return {ext.name: results[ext.name] for ext in exts}


def _accumulate(lin, uses, S: Tensor, group, names, params, batch_size, chunk_size,
                into: Optional[RootBuffers] = None) -> Dict[str, Dict[str, object]]:
    """The group's quantities from the root ``S [V, N, *out]``, pulled back in chunks of columns.

    Square roots go column by column into ``into`` (plain autograd only: under torch.func
    or for results that need autograd, chunks are joined by ``torch.cat``).
    """
    acc: Dict[str, Dict[str, object]] = {}
    static: Dict[tuple, object] = {}  # column-independent results (KFAC's A), once per call
    owned: set = set()  # ids of running sums made here (safe to add into in place)
    total = S.shape[0]
    if not _read_off.LOOP_SQRT_COLUMNS or lin.batched_pullback is None or not is_concrete(S) or S.requires_grad:
        into = None
    elif into is None:
        into = RootBuffers()
    streamed = _streamed_reads(lin, group, S)
    for start, S_chunk in _chunks(S, 1 if streamed else chunk_size):
        # per-site rule results shared by the site's parameters, per chunk
        cache: Dict[object, object] = {"static": static}
        if streamed:
            for ext, part in _read_streamed(lin, uses, S_chunk, group, names, params, batch_size, cache).items():
                q = ext.read_as or ext.quantity
                acc[ext.name] = part if ext.name not in acc else {
                    n: _combine(q, acc[ext.name][n], part[n], owned, root_last(uses, n)) for n in names}
            if start + 1 == total:
                acc = {k: {n: v.result() if isinstance(v, ColumnStatistic) else v for n, v in d.items()}
                       for k, d in acc.items()}
            continue
        m = lin.pull_batched(S_chunk)
        for ext in group:
            q = ext.read_as or ext.quantity
            if q == "sqrt" and into is not None:
                cols = into.at(ext.name, total, start, S_chunk.shape[0])
                acc[ext.name] = {n: write_sqrt(uses, m, n, params[n], batch_size, cols) for n in names}
                continue
            kron = _kron_options(ext)
            part = {n: _read(q, uses, m, n, params, batch_size, S_chunk.shape[0], cache, kron) for n in names}
            if ext.name not in acc:
                acc[ext.name] = part
            else:
                acc[ext.name] = {n: _combine(q, acc[ext.name][n], part[n], owned, root_last(uses, n))
                                 for n in names}
    return acc


def _streamed_reads(lin, group, S: Tensor) -> bool:
    """Whether the columns are pulled back one at a time, each parameter read as soon as the
    pullback has passed all its sites (:func:`_read_streamed`): plain autograd on real
    tensors, no square roots (written column by column), and one column (the MC default) or
    the looped strategy (:mod:`curvlib._core.strategy`, the CPU default), whose batched pullback
    runs the backward's kernels once per column anyway (``mc_samples > 1``: the sites' columns of
    one sample at a time instead of all ``M``). The batched strategy (CUDA) keeps its fused
    pullback of several columns."""
    if S.shape[0] > 1 and _strategy.batched(S.device):
        return False
    return (lin.stream_pull is not None and is_concrete(S) and not S.requires_grad
            and all((e.read_as or e.quantity) in ("diag", "batch_diag", "kron") for e in group))


def _read_streamed(lin, uses, S: Tensor, group, names, params, batch_size: int, cache) -> Dict[object, dict]:
    """``{ext: {name: part}}`` for the one column ``S [1, N, *out]``, each parameter read
    during the column's pullback as soon as it has passed all the parameter's sites
    (:func:`curvlib._evaluate.streamed.read_when_passed`): the sites' pulled-back columns are
    never all alive at once (on a language model, every block's ``[N, T, d]``)."""
    parts: Dict[object, dict] = {ext: {} for ext in group}

    def read(n: str, m: Dict[int, Tensor]) -> None:
        m = {k: g.unsqueeze(0) for k, g in m.items()}  # [1, *site_out]: one column
        for ext in group:
            q = ext.read_as or ext.quantity
            # a diagonal through a statistic additive over the columns: squared once, after the last
            statistic = column_statistic(uses, m, n, q == "batch_diag") if q in ("diag", "batch_diag") else None
            parts[ext][n] = statistic if statistic is not None else \
                _read(q, uses, m, n, params, batch_size, 1, cache, _kron_options(ext))

    sites_of = {n: {site.key for site, _ in uses.get(n, ())} for n in names}
    with reusing():  # (one buffer for the rules' per-sample blocks during the pullback)
        read_when_passed(lambda on_site: lin.stream_pull(S[0], on_site), sites_of, read)
    return {ext: {n: part[n] for n in names} for ext, part in parts.items()}


def _refuse_indefinite_sqrt(curv, roots, group) -> None:
    sqrt = [e for e in group if e.quantity == "sqrt"]
    if sqrt and len(roots) > 1:
        if not is_concrete(roots[0][1]):  # under vmap/grad: the signs cannot be read
            raise CurvatureError(
                f"{type(sqrt[0]).__name__} under a torch.func transform (vmap, grad) with this loss: "
                "whether its Hessian w.r.t. the model output is positive semi-definite (so that the "
                "GGN has a real square root) depends on values the transform hides. Call it outside "
                "the transform, or use the GGN diagonals, Kronecker factors or GGNMP, which are exact "
                "for any loss Hessian."
            )
        value, n = curv.most_negative()
        raise CurvatureError(
            f"{type(sqrt[0]).__name__}: the Hessian of the loss w.r.t. the model output is indefinite "
            f"(eigenvalue {value:.3g} for sample {n}), so the GGN has no real square root. The GGN "
            "diagonals, Kronecker factors and GGNMP are exact for indefinite loss Hessians; use them, "
            "or a loss that is convex in the model output."
        )


def _signed_sum(total, part, sign: float, group, uses):
    """``total + sign · part`` for quantities linear in the GGN (``A`` of Kronecker factors is shared)."""
    out = {}
    for ext in group:
        q = ext.read_as or ext.quantity
        a, b = total[ext.name], part[ext.name]
        if q == "kron":
            out[ext.name] = {n: add_root_factor(a[n], b[n], lambda x, y: x + sign * y, root_last(uses, n))
                             for n in a}
        else:
            out[ext.name] = {n: a[n] + sign * b[n] for n in a}
    return out


def _chunks(S: Tensor, chunk_size: Optional[int]):
    """``(start, S[start:start + chunk_size])`` over the columns."""
    if chunk_size is None or chunk_size >= S.shape[0]:
        yield 0, S
        return
    for start in range(0, S.shape[0], chunk_size):
        yield start, S[start:start + chunk_size]


def _kron_options(ext) -> tuple:
    """A Kronecker extension's ``(kfac_approx, max_factor_dim)`` (``None`` for the others)."""
    return getattr(ext, "kfac_approx", None), getattr(ext, "max_factor_dim", None)


def _read(q: str, uses, m, name: str, params, n: int, v: int, cache=None, kron=(None, None)):
    """One chunk's contribution to quantity ``q`` of parameter ``name`` (``kron``: the Kronecker
    extension's ``(kfac_approx, max_factor_dim)``)."""
    if q == "diag":
        return diag(uses, m, name, params, cache)
    if q == "batch_diag":
        return batch_diag(uses, m, name, params, n, cache)
    if q == "sqrt":
        if uses.get(name):
            return sqrt_columns(uses, m, name)
        return params[name].new_zeros((v, n) + tuple(params[name].shape))
    if not uses.get(name):  # read by no site: a zero block in a generic parameter's layout
        return unused_block(params[name], kron[1])
    return kronecker_factors(uses, m, name, cache, *kron)  # "kron"


def _combine(q: str, acc, part, owned: Optional[set] = None, root_last: Optional[bool] = None):
    """Sum of chunk contributions; square roots are concatenated; ``A`` is chunk-independent
    (``root_last``: see :func:`curvlib._core.kronlayout.root_index`); column statistics add."""
    if isinstance(acc, ColumnStatistic):
        return dataclasses.replace(acc, value=_sum_into(acc.value, part.value, owned))
    if q == "sqrt":  # (only under autograd or torch.func: otherwise written into RootBuffers)
        return torch.cat([acc, part])
    if q == "kron":
        return add_root_factor(acc, part, lambda x, y: _sum_into(x, y, owned), root_last)
    return _sum_into(acc, part, owned)



def _sum_into(acc: Tensor, part: Tensor, owned: Optional[set]) -> Tensor:
    """``acc + part``, in place where that is safe (no third ``[N, *p]``-sized buffer for
    batch diagonals): only into a sum this accumulation made itself (ids in ``owned``;
    the first chunk's results may be shared between extensions), and never under
    autograd or torch.func."""
    if (owned is None or id(acc) not in owned or acc.requires_grad or part.requires_grad
            or not is_concrete(acc) or acc.shape != part.shape):
        total = acc + part
        if owned is not None:
            owned.add(id(total))
        return total
    return acc.add_(part)
