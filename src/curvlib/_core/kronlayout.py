"""Layouts of the Kronecker factors of ``KFAC``, ``KFLR``, ``KFACEmpirical`` per parameter.

Each parameter gets a list of factors whose Kronecker product (in order; a 1-D factor
stands for a diagonal matrix; a leading group dim for a block-diagonal matrix, one
block per group) approximates its curvature block:

| layer | parameter | factors | stands for |
|---|---|---|---|
| ``Linear``, ``Conv``, ``ConvTranspose`` (``groups=1``) | weight | ``[B, A]`` | BackPACK's layout, ``B ⊗ A`` |
| same | bias | ``[B]`` | ``B`` (exact bias block for ``kfac_approx=None``) |
| ``Conv``, ``ConvTranspose`` with ``groups=G`` | weight | ``[B [G, o, o], A [G, a, a]]`` | ``blockdiag_g(B[g] ⊗ A[g])`` |
| ``RNN``, ``LSTM``, ``GRU`` (time steps as positions) | weight_ih/hh/hr, bias_ih/hh | as ``Linear`` | ``B ⊗ A``, ``B`` |
| ``Embedding`` ``[V, D]`` | weight | ``[A [V], B [D, D]]`` | ``diag(A) ⊗ B`` (row-major ``W``) |
| ``LayerNorm``, ``GroupNorm``, ``BatchNorm``; any other 1-D parameter | weight, bias | ``[F [P, P]]`` | the exact block of ``p`` flattened (``P = p.numel()``) |
| bias-like generic ``p [*L, D]`` (``h + self.pos[:T]``; :mod:`curvlib.rules.fixed_rows`) | ``p`` | ``[A [R], B [D, D]]`` | ``diag(A) ⊗ B``, Embedding's at fixed rows |
| any other generic parameter with ``≥ 2`` dims; a weight tied across layers of different kinds | ``p`` | ``[F [P]]`` | ``diag(F)``: the exact block's diagonal |

Exactly one factor depends on the backpropagated root (``B``, or ``F``): it is summed
over column chunks and signs of the loss Hessian, and rescaled like the loss over
slices of the batch and over ranks; every other factor is a batch mean of the layer's
inputs (averaged with the samples' shares). :func:`root_index` says which it is.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

from torch import Tensor

__all__ = ["root_index", "add_root_factor"]


def root_index(factors: Sequence[Tensor], root_last: Optional[bool] = None) -> int:
    """Index of the factor that depends on the root (see the module doc).

    ``0`` for every layout but Embedding's ``[A [V], B [D, D]]`` (also at fixed rows).
    ``root_last``: whether the parameter has that layout, from its sites; ``None``: read
    off the shapes (Embedding's is the only one with two factors whose first is 1-D),
    which holds without ``max_factor_dim``: with it a Linear weight's ``B`` may be
    diagonal too (``[B [O], A]``), which only the sites tell apart.
    """
    if len(factors) != 2:
        return 0
    if root_last is not None:
        return int(root_last)
    if factors[0] is not None and factors[0].dim() == 1:
        return 1
    return 0


def add_root_factor(acc: Sequence[Tensor], part: Sequence[Tensor], add: Callable,
                    root_last: Optional[bool] = None) -> List[Tensor]:
    """``acc`` with its root factor replaced by ``add(acc's, part's)`` (column chunks, signs
    of the loss Hessian); the input factors, independent of the root, are kept."""
    i = root_index(acc, root_last)
    return list(acc[:i]) + [add(acc[i], part[i])] + list(acc[i + 1:])
