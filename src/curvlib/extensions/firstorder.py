"""First-order extensions: quantities built from the individual gradients.

Let ``g_n = ∂(c·ℓ_n)/∂θ`` be sample ``n``'s individual gradient, where ``c`` is
the loss's reduction factor (``1/M`` for ``"mean"``, see
:mod:`curvlib.losses`), so that ``Σ_n g_n`` is the gradient. This is
BackPACK's convention.

| extension          | name               | value                                      |
|--------------------|--------------------|--------------------------------------------|
| ``BatchGrad``      | ``grad_batch``     | ``[N, *p.shape]``: ``g_n``                  |
| ``BatchL2Grad``    | ``batch_l2``       | ``[N]``: ``‖g_n‖²``                         |
| ``SumGradSquared`` | ``sum_grad_squared`` | ``p.shape``: ``Σ_n g_n²``                 |
| ``Variance``       | ``variance``       | ``p.shape``: ``(1/N) Σ_n g_n² − ((1/N) Σ_n g_n)²`` |

``Variance`` is BackPACK's formula, with ``N`` the batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ._base import Extension


@dataclass(frozen=True)
class BatchGrad(Extension):
    """Individual gradients ``[N, *p.shape]``; they sum to the gradient."""

    name: ClassVar[str] = "grad_batch"


@dataclass(frozen=True)
class BatchL2Grad(Extension):
    """Squared L2 norm of each individual gradient, ``[N]`` per parameter."""

    name: ClassVar[str] = "batch_l2"


@dataclass(frozen=True)
class SumGradSquared(Extension):
    """Sum over samples of the squared individual gradients, ``p.shape``."""

    name: ClassVar[str] = "sum_grad_squared"


@dataclass(frozen=True)
class Variance(Extension):
    """BackPACK's gradient variance ``(1/N) Σ g_n² − ((1/N) Σ g_n)²``, ``p.shape``."""

    name: ClassVar[str] = "variance"
