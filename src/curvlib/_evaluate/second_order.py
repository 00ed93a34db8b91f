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
square is taken. Each of these read-offs is one :class:`ReadOff` of :data:`READ`, keyed by an
extension's ``read_as or quantity``; the quantities not read off the loss Hessian's roots are
the entries of :data:`AFTER_ROOTS`.

Hessian diagonal: the GGN's plus every nonlinear node's signed residual columns, pulled
back like ``S`` (:mod:`curvlib._evaluate.hessian_diag`).

Products (``GGNMP``, ``HMP``, ``PCHMP``) return callables that re-run the
forward with the parameter as the only variable (same random state, so the
same dropout masks), using forward-mode and reverse-mode autodiff; they
form no Jacobian or Hessian.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Sequence

import torch
from torch import Tensor

from .._core import settings, sink, strategy as _strategy
from .._core.tensors import is_concrete
from .linearise import Linearization
from .._core.errors import CurvatureError
from ..extensions import SecondOrder
from ..extensions._base import Options
from .._core.kronlayout import add_root_factor
from ..rules.fixed_rows import unused_block
from .._core.scratch import reusing
from .._core.site import uses_of
from .hessian_diag import DiagRequest, hessian_diag
from .read_off import ColumnStatistic, batch_diag, column_statistic, diag, kronecker_factors, root_last, sqrt_columns
from .root_buffers import RootBuffers, write_sqrt
from .streamed import read_when_passed

__all__ = ["Call", "Beside", "Chunk", "ReadOff", "READ", "AFTER_ROOTS", "second_order"]


@dataclass(frozen=True)
class Call:
    """One call's facts that every second-order read-off shares.

    Attributes:
        lin: the linearised forward pass.
        names: trainable parameter names, in result order.
        params: name -> tensor.
        batch_size: ``N``.
        chunk_size: bound on the columns pulled back at once (memory ``∝ chunk_size ×
            activations``); results are the same for any value.
        into: where square roots are written (a batch's, shared by its slices; see
            :mod:`curvlib._evaluate.root_buffers`); ``None``: new buffers for this call.
    """

    lin: Linearization
    names: Sequence[str]
    params: Mapping[str, Tensor]
    batch_size: int
    chunk_size: Optional[int] = None
    into: Optional[RootBuffers] = None

    @functools.cached_property
    def uses(self):
        """Parameter name -> its ``(site, role)`` uses."""
        return uses_of(self.lin.sites)


@dataclass(frozen=True)
class Beside:
    """What the caller computed beside the linearisation, for the quantities of
    :data:`AFTER_ROOTS` and the empirical Fisher's root.

    Attributes:
        residual_grads: the loss gradient at every residual's output (Hessian diagonals).
        site_grads: the loss gradient at every site (the empirical Fisher's root, ``root="grad"``).
        product: ``product(ext, name)`` builds a block-product callable (it re-runs the forward,
            so the caller owns it; ``None`` when none is asked for).
        kfra_factors: ``kfra_factors()`` runs the KFRA recursion (``None`` when not asked for).
    """

    residual_grads: Sequence[Tensor] = ()
    site_grads: Optional[Sequence[Tensor]] = None
    product: Optional[Callable] = None
    kfra_factors: Optional[Callable] = None


@dataclass(frozen=True)
class Chunk:
    """One chunk of pulled-back columns, ``m[k]`` ``[V, *site_out]`` at every site ``k``, as one
    extension reads it (``options``: the extension's)."""

    call: Call
    m: object
    columns: int
    cache: dict
    options: Options


def _add(acc, part, add, root_last):
    return add(acc, part)


def _add_kron(acc, part, add, root_last):
    """``A`` of Kronecker factors is the same in every chunk (:func:`curvlib._core.kronlayout.root_index`)."""
    return add_root_factor(acc, part, add, root_last)


def _cat(acc, part, add, root_last):
    return torch.cat([acc, part])


def _read_sqrt(c: Chunk, name: str):
    if c.call.uses.get(name):
        return sqrt_columns(c.call.uses, c.m, name)
    p = c.call.params[name]
    return p.new_zeros((c.columns, c.call.batch_size) + tuple(p.shape))


def _read_kron(c: Chunk, name: str):
    if not c.call.uses.get(name):  # read by no site: a zero block in a generic parameter's layout
        return unused_block(c.call.params[name], c.options.max_factor_dim)
    return kronecker_factors(c.call.uses, c.m, name, c.cache, c.options.kfac_approx, c.options.max_factor_dim)


@dataclass(frozen=True)
class ReadOff:
    """How one quantity is read off the pulled-back columns of the loss Hessian's roots.

    Attributes:
        read: ``read(chunk, name)``: one chunk's contribution for one parameter.
        join: ``join(acc, part, add, root_last)``: two chunks' (or roots') contributions as one,
            ``add`` adding two tensors.
        signed: roots of both signs add (``Σ sign · part``); a square root cannot, and is
            refused for an indefinite loss Hessian.
        written: square roots written column by column into :class:`RootBuffers`.
        statistic: read during the pullback of one column as a statistic additive over the
            columns (:func:`curvlib._evaluate.read_off.column_statistic`; ``True`` per sample);
            ``None``: no such statistic.
        streams: may be read while one column's pullback passes its sites.
    """

    read: Callable[[Chunk, str], object]
    join: Callable = _add
    signed: bool = True
    written: bool = False
    statistic: Optional[bool] = None
    streams: bool = True


#: The read-offs of the loss Hessian's roots, keyed by an extension's ``read_as or quantity``.
READ: Dict[str, ReadOff] = {
    "diag": ReadOff(lambda c, n: diag(c.call.uses, c.m, n, c.call.params, c.cache), statistic=False),
    "batch_diag": ReadOff(lambda c, n: batch_diag(c.call.uses, c.m, n, c.call.params, c.call.batch_size, c.cache),
                          statistic=True),
    "sqrt": ReadOff(_read_sqrt, join=_cat, signed=False, written=True, streams=False),
    "kron": ReadOff(_read_kron, join=_add_kron),
}


def _hessian(call: Call, ext, ggn, beside: Beside):
    return hessian_diag(call.lin, call.uses, ggn, beside.residual_grads, DiagRequest(
        call.names, call.params, call.batch_size, batch=ext.per_sample, chunk_size=call.chunk_size))


def _product(call: Call, ext, ggn, beside: Beside):
    return {n: beside.product(ext, n) for n in call.names}


def _kfra(call: Call, ext, ggn, beside: Beside):
    return beside.kfra_factors()


#: The quantities finished after (or instead of) the roots' read-off, keyed by ``quantity``:
#: ``f(call, ext, its read-off of the roots or None, beside)``.
AFTER_ROOTS: Dict[str, Callable] = {
    "hessian_diag": _hessian, "hessian_batch_diag": _hessian,
    "ggnmp": _product, "hmp": _product, "pchmp": _product,
    "kfra": _kfra,
}


def _quantity(ext) -> str:
    return ext.read_as or ext.quantity


def second_order(call: Call, curv, exts: Sequence[SecondOrder], beside: Beside = Beside()) -> Dict[str, Dict[str, object]]:
    """Every requested second-order quantity, per parameter (see module doc).

    ``curv`` is the loss Hessian at the output (:func:`curvlib.losses.curvature_at`):
    its roots come with signs (``Σ sign · S Sᵀ``; an indefinite loss Hessian has a
    negative part), and every quantity linear in the GGN is the signed sum. Extensions read
    the roots by their ``root`` (``"exact"``, ``"mc"``: sampled; ``"grad"``: one column per
    sample, its own loss gradient, ``beside.site_grads``) and :data:`READ`; then
    :data:`AFTER_ROOTS` finishes the others.
    """
    results: Dict[str, Dict[str, object]] = {}

    def signed(roots, group):
        _refuse_indefinite_sqrt(curv, roots, group)
        total = None
        for sign, S in roots:
            part = _accumulate(call, S, group, final=len(roots) == 1)
            total = part if total is None else _signed_sum(total, part, sign, group, call.uses)
        return total

    exact = [e for e in exts if e.root == "exact"]
    if exact:
        results.update(signed(curv.roots(), exact))
    for ext in exts:
        if ext.root == "mc":
            options = ext.options
            results.update(signed(curv.sampled_roots(options.mc_samples, options.generator), [ext]))
        elif ext.root == "grad":  # already at every site
            chunk = Chunk(call, [g.unsqueeze(0) for g in beside.site_grads], 1, {"static": {}}, ext.options)
            results[ext.name] = {n: READ[_quantity(ext)].read(chunk, n) for n in call.names}
        after = AFTER_ROOTS.get(ext.quantity)
        if after is not None:
            results[ext.name] = after(call, ext, results.get(ext.name), beside)
    return {ext.name: results[ext.name] for ext in exts}


def _accumulate(call: Call, S: Tensor, group, final: bool = False) -> Dict[str, Dict[str, object]]:
    """The group's quantities from the root ``S [V, N, *out]``, pulled back in chunks of columns.

    Square roots go column by column into the call's ``into`` buffers (plain autograd only: under torch.func
    or for results that need autograd, chunks are joined by ``torch.cat``). ``final``: ``S`` is
    the only root, so that a one-column read streamed is a parameter's result (which then goes to
    the call's result sink, :mod:`curvlib._core.sink`, as it is read).
    """
    lin, uses, names = call.lin, call.uses, call.names
    acc: Dict[str, Dict[str, object]] = {}
    static: Dict[tuple, object] = {}  # column-independent results (KFAC's A), once per call
    owned: set = set()  # ids of running sums made here (safe to add into in place)
    total = S.shape[0]
    into = call.into
    looped = settings.current().loop_sqrt_columns
    if not looped or lin.batched_pullback is None or not is_concrete(S) or S.requires_grad:
        into = None
    elif into is None:
        into = RootBuffers()
    streamed = _streamed_reads(lin, group, S)
    for start, S_chunk in _chunks(S, 1 if streamed else call.chunk_size):
        # per-site rule results shared by the site's parameters, per chunk
        cache: Dict[object, object] = {"static": static}
        if streamed:
            parts = _read_streamed(call, S_chunk, group, cache, sink.current() if final and total == 1 else None)
        else:
            parts = _read_chunk(call, lin.pull_batched(S_chunk), group, cache, into, (start, S_chunk.shape[0], total))
        for ext, part in parts.items():
            read = READ[_quantity(ext)]
            if ext.name not in acc or (read.written and into is not None):  # (written: the whole result)
                acc[ext.name] = part
            else:
                acc[ext.name] = {n: _combine(read.join, acc[ext.name][n], part[n], owned, root_last(uses, n))
                                 for n in names}
        if streamed and start + 1 == total:
            acc = {k: {n: v.result() if isinstance(v, ColumnStatistic) else v for n, v in d.items()}
                   for k, d in acc.items()}
    return acc


def _read_chunk(call: Call, m, group, cache, into: Optional[RootBuffers], at: tuple) -> Dict[object, dict]:
    """``{ext: {name: part}}`` for one chunk of pulled-back columns ``m``; square roots written
    into ``into`` at ``at = (start, columns, total)`` instead (their part is the whole result)."""
    parts: Dict[object, dict] = {}
    start, columns, total = at
    for ext in group:
        read = READ[_quantity(ext)]
        if read.written and into is not None:
            cols = into.at(ext.name, total, start, columns)
            parts[ext] = {n: write_sqrt(call.uses, m, n, call.params[n], call.batch_size, cols) for n in call.names}
            continue
        chunk = Chunk(call, m, columns, cache, ext.options)
        parts[ext] = {n: read.read(chunk, n) for n in call.names}
    return parts


def _streamed_reads(lin: Linearization, group, S: Tensor) -> bool:
    """Whether the columns are pulled back one at a time, each parameter read as soon as the
    pullback has passed all its sites (:func:`_read_streamed`): plain autograd on real
    tensors, no square roots (written column by column), and one column (the MC default) or
    the looped strategy (:mod:`curvlib._core.strategy`, the CPU default), whose batched pullback
    runs the backward's kernels once per column anyway (``mc_samples > 1``: the sites' columns of
    one sample at a time instead of all ``M``). The batched strategy (CUDA) keeps its fused
    pullback of several columns. Never where :attr:`~curvlib._core.settings.Settings.stream_columns`
    is off."""
    if not settings.current().stream_columns or (S.shape[0] > 1 and _strategy.batched(S.device)):
        return False
    return (lin.stream_pull is not None and is_concrete(S) and not S.requires_grad
            and all(READ[_quantity(e)].streams for e in group))


def _read_streamed(call: Call, S: Tensor, group, cache, into_sink=None) -> Dict[object, dict]:
    """``{ext: {name: part}}`` for the one column ``S [1, N, *out]``, each parameter read
    during the column's pullback as soon as it has passed all the parameter's sites
    (:func:`curvlib._evaluate.streamed.read_when_passed`): the sites' pulled-back columns are
    never all alive at once (on a language model, every block's ``[N, T, d]``). ``into_sink``
    (the only column of the only root): each tensor result finished after the roots goes there
    as it is read (a sharded model's: reduce-scattered into the rank's rows)."""
    uses, names = call.uses, call.names
    parts: Dict[object, dict] = {ext: {} for ext in group}
    options = {ext: ext.options for ext in group}

    def read(n: str, m: Dict[int, Tensor]) -> None:
        m = {k: g.unsqueeze(0) for k, g in m.items()}  # [1, *site_out]: one column
        for ext in group:
            how = READ[_quantity(ext)]
            # a diagonal through a statistic additive over the columns: squared once, after the last
            statistic = column_statistic(uses, m, n, how.statistic) if how.statistic is not None else None
            part = statistic if statistic is not None else how.read(Chunk(call, m, 1, cache, options[ext]), n)
            if into_sink is not None and ext.quantity not in AFTER_ROOTS:
                part = part.result() if isinstance(part, ColumnStatistic) else part
                part = into_sink(ext.name, n, part) if isinstance(part, Tensor) else part
            parts[ext][n] = part

    sites_of = {n: {site.key for site, _ in uses.get(n, ())} for n in names}
    with reusing():  # (one buffer for the rules' per-sample blocks during the pullback)
        read_when_passed(lambda on_site: call.lin.stream_pull(S[0], on_site), sites_of, read)
    return {ext: {n: part[n] for n in names} for ext, part in parts.items()}


def _refuse_indefinite_sqrt(curv, roots, group) -> None:
    sqrt = [e for e in group if not READ[_quantity(e)].signed]
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
        join = READ[_quantity(ext)].join
        a, b = total[ext.name], part[ext.name]
        out[ext.name] = {n: join(a[n], b[n], lambda x, y: x + sign * y, root_last(uses, n)) for n in a}
    return out


def _chunks(S: Tensor, chunk_size: Optional[int]):
    """``(start, S[start:start + chunk_size])`` over the columns."""
    if chunk_size is None or chunk_size >= S.shape[0]:
        yield 0, S
        return
    for start in range(0, S.shape[0], chunk_size):
        yield start, S[start:start + chunk_size]


def _combine(join, acc, part, owned: Optional[set] = None, root_last: Optional[bool] = None):
    """Two chunks' contributions as one (the read-off's ``join``: sums, concatenated square roots,
    Kronecker factors with a common ``A``); column statistics add."""
    if isinstance(acc, ColumnStatistic):
        return dataclasses.replace(acc, value=_sum_into(acc.value, part.value, owned))
    return join(acc, part, lambda x, y: _sum_into(x, y, owned), root_last)


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
