"""How parts of a batch combine into the whole batch's results: one kind per quantity.

A part is a slice of the batch (``curvature(..., batch_chunk_size=)``,
:mod:`curvlib._transform.chunking`) or a rank's batch (``process_group=``,
:mod:`curvlib.distributed`). Its results carry ``c_k = 1/M_k`` (``M_k`` its share of the
``"mean"`` normaliser); with ``r = M_k / M`` (1 for ``"sum"``) and ``share = N_k / N``, each
tensor of a result enters the whole batch's with one :class:`Weight`, and :func:`parts` says
which: the one combiner both chunking and distributed read. Summed kinds add the weighted
parts; per-sample kinds keep each part's rows (slices: concatenated; ranks: the rank's own).

An extension names its kind in ``slices`` (batch slices) and ``ranks`` (process groups).
"""

from __future__ import annotations

import enum
from typing import Dict, List, Mapping, NamedTuple, Optional

from torch import Tensor

from .._core.kronlayout import root_index

__all__ = ["Combine", "Weight", "Part", "parts", "formed"]


class Weight(enum.Enum):
    """How one tensor of a part scales into the whole batch's."""

    R = "r"                  # ∝ c: r · part
    R_SQUARED = "r2"         # ∝ c²: r² · part
    R_ROOT = "sqrt_r"        # ∝ √c (square roots): √r · part
    SHARE = "share"          # a batch mean without c (Kronecker input factors): N_k/N · part
    WHOLE = "whole"          # already the whole batch's (KFRA's root factor): kept as it is

    def factor(self, r: float, share: float) -> float:
        """The weight's value for ``r`` and ``share`` (:mod:`curvlib.distributed` also passes
        the unnormalised sizes, ``M_local`` and ``N_local``, and their global inverses)."""
        return {Weight.R: r, Weight.R_SQUARED: r * r, Weight.R_ROOT: r**0.5, Weight.SHARE: share,
                Weight.WHOLE: 1.0}[self]


class Combine(str, enum.Enum):
    """How a quantity's parts combine (an extension's ``slices`` and ``ranks``)."""

    SUM = "sum"                    # Σ r · part (gradient, GGN/Hessian diagonals)
    SUM_SQUARED = "sum_squared"    # Σ r² · part (sum_grad_squared)
    KRON = "kron"                  # root factor Σ r ·, every other factor Σ share · (KFAC, KFLR)
    KRON_SQUARED = "kron_squared"  # root factor Σ r² ·, others Σ share · (KFACEmpirical)
    KRON_WHOLE_ROOT = "kron_whole_root"  # root factor (first) already the batch's, others Σ share · (KFRA)
    SAMPLES = "samples"            # r · part, one row per sample (grad_batch, batch diagonals)
    SAMPLES_SQUARED = "samples_squared"  # r² · part, one row per sample (batch_l2)
    SAMPLES_ROOT = "samples_root"  # √r · part, samples along dim 1 (square roots [V, N, *p])
    FORMED = "formed"              # formed again from the combined gradient and its ``needs`` (variance)

    @property
    def samples_dim(self) -> Optional[int]:
        """The dim that holds the samples of a per-sample kind; ``None`` for summed kinds."""
        return {Combine.SAMPLES: 0, Combine.SAMPLES_SQUARED: 0, Combine.SAMPLES_ROOT: 1}.get(self)


class Part(NamedTuple):
    """One tensor of a result: ``result[name]`` (``index is None``) or ``result[name][index]``
    (a Kronecker factor); ``name is None`` for a result that is one tensor (the loss)."""

    name: Optional[str]
    index: Optional[int]
    tensor: Tensor
    weight: Weight


_PLAIN = {Combine.SUM: Weight.R, Combine.SUM_SQUARED: Weight.R_SQUARED, Combine.SAMPLES: Weight.R,
          Combine.SAMPLES_SQUARED: Weight.R_SQUARED, Combine.SAMPLES_ROOT: Weight.R_ROOT}
_ROOT = {Combine.KRON: Weight.R, Combine.KRON_SQUARED: Weight.R_SQUARED, Combine.KRON_WHOLE_ROOT: Weight.WHOLE}


def parts(kind: Combine, value, root_last: Optional[Mapping[str, bool]] = None) -> List[Part]:
    """Every tensor of one result (``{name: tensor}``, ``{name: [factors]}`` or one tensor) with
    its weight. ``root_last``: parameter name -> whether its Kronecker root factor is the last
    (:func:`curvlib._core.kronlayout.root_index`). A :attr:`Combine.FORMED` result has none."""
    if kind is Combine.FORMED:
        return []
    if isinstance(value, Tensor):
        return [Part(None, None, value, _PLAIN[kind])]
    if kind in _PLAIN:
        return [Part(name, None, t, _PLAIN[kind]) for name, t in value.items()]
    out = []
    for name, factors in value.items():
        root = 0 if kind is Combine.KRON_WHOLE_ROOT else root_index(factors, (root_last or {}).get(name))
        out.extend(Part(name, i, t, _ROOT[kind] if i == root else Weight.SHARE) for i, t in enumerate(factors))
    return out


def formed(ext, results: Mapping[str, Dict[str, Tensor]], batch_size: int) -> Dict[str, Tensor]:
    """A :attr:`Combine.FORMED` extension's result from the whole batch's ``grad`` and the results
    of its ``needs`` (``ext.formed`` per parameter)."""
    grad = results["grad"]
    return {name: ext.formed(g, [results[need.name][name] for need in ext.needs], batch_size)
            for name, g in grad.items()}
