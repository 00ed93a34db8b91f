"""Chunking over samples: ``curvature(..., batch_chunk_size=B)``.

The batch is cut into consecutive slices of at most ``B`` samples, the
transform runs on each slice, and the slices' results are combined into
exactly those of the whole batch, so peak memory follows ``B`` instead of
``N`` (together with ``chunk_size``, which bounds the columns pulled back at
once, it bounds the memory of the exact second-order quantities over both
classes and samples).

Every structural loss is ``L = c · Σ_n ℓ_n`` with ``c = 1/M`` for ``"mean"``
(``M`` its normaliser, :func:`curvlib.losses.normaliser`: ``y.numel()``, or the
counted targets' weight for cross-entropy with ``weight``/``ignore_index``)
and ``c = 1`` for ``"sum"``. A slice's results carry ``c_k = 1/M_k``; with
``r_k = M_k / M`` (``1`` for ``"sum"``; a slice with ``M_k = 0`` contributes
nothing) the batch's are

| quantity | whole batch |
|---|---|
| loss, grad, GGN/Hessian diagonals, ``B`` of KFAC/KFLR | ``Σ_k r_k · slice_k`` |
| ``sum_grad_squared``, ``B`` of KFACEmpirical | ``Σ_k r_k² · slice_k`` |
| ``A = (1/N) Σ x xᵀ`` of KFAC/KFLR (every input factor, :mod:`curvlib._core.kronlayout`) | ``Σ_k (N_k/N) · slice_k`` |
| ``variance`` (formed: an extension's ``needs``) | ``(1/N) Σ g² − ((1/N) Σ g)²`` from the batch's ``grad`` and ``Σ g²`` (the slices always compute ``Σ g²`` for it) |
| ``grad_batch``, batch diagonals | ``r_k · slice_k``, concatenated over samples |
| ``batch_l2`` | ``r_k² · slice_k``, concatenated |
| ``sqrt_ggn_exact``, ``sqrt_ggn_mc`` | ``√r_k · slice_k``, concatenated along dim 1 |

(each extension's ``slices``, a :class:`curvlib.extensions.combine.Combine`; the weights are
:func:`curvlib.extensions.combine.parts`', the same as :mod:`curvlib.distributed`'s with slices
in place of ranks). "Concatenated" results are written into one preallocated tensor of the
batch's size as each slice arrives (square roots by the slice itself, column by
column: :mod:`curvlib._evaluate.root_buffers`), so that a slice's result is the only
temporary beside it; only under autograd or ``torch.func`` are slices joined by
``torch.cat``. Monte-Carlo extensions draw fresh samples for every slice from their
generator, so results with a generator are reproducible for a given
``batch_size`` but differ from an unchunked call's draws (they have the same
distribution). Refused, before any work: KFRA (its recursion multiplies
batch averages layer by layer, which does not split into slices) and the
block products (callables that would have to keep every slice's forward
alive, which defeats the purpose).
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, Sequence

import torch
from torch import Tensor

from .._core import inputs as _inputs
from .._core.tensors import is_concrete
from .._core.buffers import vmapped
from .._core.errors import CurvatureError
from .._evaluate.root_buffers import RootBuffers
from ..extensions.combine import Combine, formed, parts
from ..losses import LossSpec, normaliser

__all__ = ["over_samples", "check_batch_chunk_size", "slice_kinds"]


def check_batch_chunk_size(batch_chunk_size: object, exts: Sequence, spec: Optional[LossSpec] = None) -> Dict[str, Combine]:
    """Validate the argument and the extensions; return result name -> how its slices combine."""
    if isinstance(batch_chunk_size, bool) or not isinstance(batch_chunk_size, int) or batch_chunk_size < 1:
        raise CurvatureError(f"batch_chunk_size must be a positive int or None, got {batch_chunk_size!r}.")
    if spec is not None and not spec.structural:
        raise CurvatureError(
            f"batch_chunk_size with lossfn {spec.name}: slices are combined by the loss's 'mean' "
            "normaliser, which curvlib knows for nn.MSELoss, nn.CrossEntropyLoss and "
            "nn.BCEWithLogitsLoss only. Call without batch_chunk_size, or use chunk_size= to bound memory."
        )
    return slice_kinds(exts)


def slice_kinds(exts: Sequence) -> Dict[str, Combine]:
    """Result name -> how its slices combine (each extension's ``slices``), refusing the
    extensions that do not combine."""
    kinds = {"loss": Combine.SUM, "grad": Combine.SUM}
    for ext in exts:
        kind, why = type(ext).slices, type(ext).slices_refused
        if kind is None:
            raise CurvatureError(
                f"{type(ext).__name__} cannot be computed with batch_chunk_size: {why}. "
                "Call curvature without batch_chunk_size for it."
            )
        kinds[ext.name] = kind
    return kinds


def over_samples(
    f: Callable[..., Dict[str, object]], spec: LossSpec, exts: Sequence, batch_chunk_size: int,
    root_last: Optional[Callable[..., Mapping[str, bool]]] = None,
) -> Callable[..., Dict[str, object]]:
    """Wrap ``f(X, y, params=None)`` to run on slices of at most ``batch_chunk_size`` samples.

    ``exts``: the extensions ``f`` computes (a formed one's ``needs`` among them).
    ``root_last(X, params)``: parameter name -> whether its Kronecker root factor is the last
    (asked once a slice has run, when a factor side may be diagonal:
    :func:`curvlib._core.kronlayout.root_index`).
    """
    kinds = slice_kinds(exts)
    later = [e for e in exts if kinds[e.name] is Combine.FORMED]

    def g(X, y: Tensor, params: Optional[Mapping[str, Tensor]] = None, generator=None,
          buffers: Optional[Mapping[str, Tensor]] = None) -> Dict[str, object]:
        leaves = _inputs.tensors(X)
        n = int(leaves[0].shape[0]) if leaves and leaves[0].dim() > 0 else 0
        if n <= batch_chunk_size or not isinstance(y, Tensor) or y.dim() == 0 or y.shape[0] != n:
            return f(X, y, params=params, generator=generator, buffers=buffers)  # (f reports bad input)
        _refuse_per_sample_weights(spec, y)
        _refuse_vmapped_counts(spec, y)
        total = normaliser(spec, y)
        combined = _Combined(kinds, n, later)
        # square roots: every slice writes its samples into one [V, N, *p] per parameter
        into = {"_into": combined.into} if combined.into is not None else {}
        for start in range(0, n, batch_chunk_size):
            stop = min(n, start + batch_chunk_size)
            if combined.into is not None:
                combined.into.start = start
            part = f(_inputs.slice_batch(X, start, stop), y[start:stop], params=params, generator=generator,
                     buffers=buffers, **into)
            # r = M_k / M: this slice's share of the "mean" normaliser (0 for a slice with
            # nothing counted, whose own results are NaN: 0/0). Nothing counted in the whole
            # batch: every slice's results as they are (NaN loss and curvature, autograd's zero
            # gradient), which is what the unchunked call returns.
            r = normaliser(spec, y[start:stop]) / total if total else 1.0
            if root_last is not None and combined.root_last is None:
                combined.root_last = root_last(_inputs.slice_batch(X, start, stop), params)
            combined.add(part, r, (stop - start) / n, start)
            del part
        return combined.result()

    return g


def _refuse_per_sample_weights(spec: LossSpec, y: Tensor) -> None:
    """A ``BCEWithLogitsLoss`` ``weight``/``pos_weight`` with the batch in dim 0 does not fit a slice."""
    if spec.kind != "bce":
        return
    for arg in ("weight", "pos_weight"):
        w = getattr(spec.module, arg)
        if w is not None and w.dim() == y.dim() and w.shape[0] != 1:
            raise CurvatureError(
                f"batch_chunk_size with {spec.name}({arg}=<shape {tuple(w.shape)}>): a {arg} with "
                "one entry per sample cannot be cut into slices of the batch. Use a weight that "
                "broadcasts over samples, or call without batch_chunk_size (chunk_size= bounds memory too)."
            )


def _refuse_vmapped_counts(spec: LossSpec, y: Tensor) -> None:
    """Slices are weighted by their share ``M_k / M`` of the ``"mean"`` normaliser, a host
    read of a cross-entropy's counted targets, which ``vmap`` over ``y`` cannot do."""
    if spec.kind == "ce" and spec.reduction == "mean" and not y.is_floating_point() and vmapped(y):
        raise CurvatureError(
            f"batch_chunk_size with {spec.name}(reduction='mean') under torch.func.vmap over y: each "
            "slice is weighted by its count of counted targets, read on the host, which vmap cannot "
            "do. Call f without batch_chunk_size under vmap (chunk_size= bounds memory too), or loop."
        )


class _Combined:
    """The whole batch's results from its slices' (the table in the module doc)."""

    def __init__(self, kinds: Mapping[str, Combine], n: int, later: Sequence = ()):
        self.kinds, self.n, self.later = kinds, n, later
        self.root_last: Optional[Mapping[str, bool]] = None  # name -> Kronecker root factor last
        self.into = RootBuffers(n) if Combine.SAMPLES_ROOT in kinds.values() else None
        self.acc: Dict[str, object] = {}
        self.pieces: Dict[str, Dict[str, object]] = {}  # key -> name -> batch's tensor, or slices to join
        self.order: list = []

    def add(self, part: Dict[str, object], r: float, share: float, start: int = 0) -> None:
        self.order = self.order or list(part)
        for key, value in part.items():
            kind = self.kinds[key]
            for p in parts(kind, value, self.root_last):
                scale = p.weight.factor(r, share)
                if kind.samples_dim is not None:
                    self._place(key, p.name, p.tensor, start, r, scale)
                elif p.name is None:
                    self.acc[key] = _add(self.acc.get(key), _scaled(p.tensor, scale))
                elif p.index is None:
                    sums = self.acc.setdefault(key, {})
                    sums[p.name] = _add(sums.get(p.name), _scaled(p.tensor, scale))
                else:  # a Kronecker factor
                    factors = self.acc.setdefault(key, {}).setdefault(p.name, [])
                    if p.index == len(factors):
                        factors.append(None)
                    factors[p.index] = _add(factors[p.index], _scaled(p.tensor, scale))

    def _place(self, key: str, name: str, t: Tensor, start: int, r: float, scale: float) -> None:
        """A slice's per-sample result, scaled, into the batch's: written into one preallocated
        tensor (square roots by the slice itself, see :mod:`curvlib._evaluate.root_buffers`), or, under
        autograd or torch.func, kept to be concatenated."""
        per_name = self.pieces.setdefault(key, {})
        dim = self.kinds[key].samples_dim
        if self.into is not None and (key, name) in self.into.buffers:
            per_name[name] = self.into.buffers[(key, name)]
            _scale_written(t, r, scale)
            return
        if name not in per_name and is_concrete(t) and not t.requires_grad:
            shape = list(t.shape)
            shape[dim] = self.n
            per_name[name] = t.new_empty(shape)
        buf = per_name.setdefault(name, [])
        if isinstance(buf, list):
            buf.append(_scaled(t, scale))
            return
        view = buf.narrow(dim, start, t.shape[dim])
        if r == 0:
            view.zero_()
        elif scale == 1:
            view.copy_(t)
        else:
            torch.mul(t, scale, out=view)

    def result(self) -> Dict[str, object]:
        out: Dict[str, object] = dict(self.acc)
        for key, per_name in self.pieces.items():
            dim = self.kinds[key].samples_dim
            out[key] = {name: _concatenated(ts, dim) if isinstance(ts, list) else ts
                        for name, ts in per_name.items()}
        for ext in self.later:  # formed from the batch's totals
            out[ext.name] = formed(ext, out, self.n)
        return {k: out[k] for k in self.order}


def _scaled(t: Tensor, r: float) -> Tensor:
    """``r · t``; a slice with nothing counted (``r = 0``) contributes zeros, not its NaNs."""
    return torch.zeros_like(t) if r == 0 else t * r


def _scale_written(t: Tensor, r: float, scale: float) -> None:
    """A slice's part of a preallocated result, scaled in place like :func:`_scaled`."""
    if r == 0:
        t.zero_()
    elif scale != 1:
        t.mul_(scale)


def _concatenated(ts, dim: int) -> Tensor:
    """``torch.cat`` into one preallocated result (no second copy of every slice at once)."""
    if len(ts) == 1:
        return ts[0]
    shape = list(ts[0].shape)
    shape[dim] = sum(t.shape[dim] for t in ts)
    out = ts[0].new_empty(shape)
    start = 0
    for i in range(len(ts)):
        t = ts[i]
        out.narrow(dim, start, t.shape[dim]).copy_(t)
        start += t.shape[dim]
        ts[i] = None  # free the slice as soon as it is copied
    return out


def _add(total: Optional[Tensor], t: Tensor) -> Tensor:
    return t if total is None else total + t
