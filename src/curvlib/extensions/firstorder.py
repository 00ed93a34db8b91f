"""First-order extensions: quantities built from the individual gradients.

Let ``g_n = ∂(c·ℓ_n)/∂θ`` be sample ``n``'s individual gradient, where ``c`` is
the loss's reduction factor (``1/M`` for ``"mean"``, see
`curvlib.losses`), so that ``Σ_n g_n`` is the gradient. This is
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
from typing import Callable, ClassVar, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._core.tensors import is_concrete
from ._base import Extension
from .combine import Combine


@dataclass(frozen=True)
class BatchGrad(Extension):
    r"""Individual gradients, one per sample (BackPACK's ``BatchGrad``).

    Result key: ``"grad_batch"``, a dict parameter name -> ``[N, *p.shape]``.

    Row ``n`` is $g_n = \partial (c\, \ell_n) / \partial p$, the gradient of sample ``n``'s term of
    the loss $L = c \sum_n \ell_n$ with the reduction factor ``c`` in it (``1/N``
    for ``reduction="mean"`` over ``N`` samples, 1 for ``"sum"``), so the rows
    sum to the gradient ``qs["grad"]``. Options: none. Computed without forming
    ``[N, *p.shape]`` intermediates beyond the result itself.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import BatchGrad
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])(X, y)
        >>> qs["grad_batch"]["0.weight"].shape
        torch.Size([5, 4, 3])
        >>> torch.allclose(qs["grad_batch"]["0.weight"].sum(0), qs["grad"]["0.weight"], atol=1e-6)
        True
    """

    name: ClassVar[str] = "grad_batch"
    quantity: ClassVar[str] = "grad_batch"
    slices: ClassVar[Optional[Combine]] = Combine.SAMPLES
    ranks: ClassVar[Optional[Combine]] = Combine.SAMPLES

    def from_individual(self, batch: Tensor) -> Tensor:
        return batch


@dataclass(frozen=True)
class BatchL2Grad(Extension):
    r"""Squared L2 norm of each individual gradient (BackPACK's ``BatchL2Grad``).

    Result key: ``"batch_l2"``, a dict parameter name -> ``[N]``.

    Entry ``n`` is $\lVert g_n \rVert^2$ for the individual gradient ``g_n`` of
    ``BatchGrad`` (with the reduction factor ``c``, so it carries $c^2$),
    computed without forming ``g_n`` where the layer allows (``Linear``:
    $\lVert m_n \rVert^2 \lVert x_n \rVert^2$). Sum over parameters for the norm of the whole
    individual gradient (e.g. per-sample clipping). Options: none.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import BatchL2Grad
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [BatchL2Grad()])(X, y)
        >>> qs["batch_l2"]["0.weight"].shape
        torch.Size([5])
        >>> per_sample = sum(qs["batch_l2"].values())          # ‖g_n‖² over all parameters
        >>> per_sample.shape
        torch.Size([5])
    """

    name: ClassVar[str] = "batch_l2"
    quantity: ClassVar[str] = "batch_l2"
    slices: ClassVar[Optional[Combine]] = Combine.SAMPLES_SQUARED
    ranks: ClassVar[Optional[Combine]] = Combine.SAMPLES_SQUARED

    def from_individual(self, batch: Tensor) -> Tensor:
        return (batch**2).flatten(1).sum(1)

    def shortcut(self, rule) -> Optional[Callable]:
        return rule.batch_l2


@dataclass(frozen=True)
class SumGradSquared(Extension):
    r"""Sum over samples of the squared individual gradients (BackPACK's ``SumGradSquared``).

    Result key: ``"sum_grad_squared"``, a dict parameter name -> ``p.shape``.

    Value: $\sum_n g_n \odot g_n$ (element-wise), ``g_n`` as in ``BatchGrad``;
    it carries $c^2$ ($1/N^2$ for ``"mean"``). It is the diagonal of the
    empirical Fisher $\sum_n g_n g_n^\top$. Options: none.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import SumGradSquared
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [SumGradSquared()])(X, y)
        >>> qs["sum_grad_squared"]["2.weight"].shape
        torch.Size([2, 4])
        >>> bool((qs["sum_grad_squared"]["2.weight"] >= 0).all())
        True
    """

    name: ClassVar[str] = "sum_grad_squared"
    quantity: ClassVar[str] = "sum_grad_squared"
    slices: ClassVar[Optional[Combine]] = Combine.SUM_SQUARED
    ranks: ClassVar[Optional[Combine]] = Combine.SUM_SQUARED

    def from_individual(self, batch: Tensor) -> Tensor:
        return (batch**2).sum(0)

    def shortcut(self, rule) -> Optional[Callable]:
        return rule.sum_grad_squared

    def shortcut_with_grad(self, rule) -> Optional[Callable]:
        return rule.grad_with_squares


@dataclass(frozen=True)
class Variance(Extension):
    r"""Gradient variance over the batch (BackPACK's ``Variance``).

    Result key: ``"variance"``, a dict parameter name -> ``p.shape``.

    Value, element-wise: $\frac{1}{N} \sum_n g_n^2 - \big(\frac{1}{N} \sum_n g_n\big)^2$ with ``g_n`` as
    in ``BatchGrad`` (carrying ``c``) and ``N`` the batch size, exactly
    BackPACK's formula. With ``process_group`` it is recomputed from the global
    sums. Options: none.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import Variance
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [Variance()])(X, y)
        >>> from curvlib.extensions import BatchGrad
        >>> g = curvature(model, nn.CrossEntropyLoss(), [BatchGrad()])(X, y)["grad_batch"]["0.bias"]
        >>> torch.allclose(qs["variance"]["0.bias"], g.pow(2).mean(0) - g.mean(0).pow(2), atol=1e-7)
        True
    """

    name: ClassVar[str] = "variance"
    quantity: ClassVar[str] = "variance"
    slices: ClassVar[Optional[Combine]] = Combine.FORMED
    ranks: ClassVar[Optional[Combine]] = Combine.FORMED
    needs: ClassVar[Tuple[type, ...]] = (SumGradSquared,)

    def formed(self, grad: Tensor, needed: Sequence[Tensor], batch_size: int, overwrite: bool = False) -> Tensor:
        r"""$\sum_n g_n^2 / N - (\sum_n g_n / N)^2$ in two kernels; it is ≥ 0 exactly, so the rounding
        below zero is clamped (N = 1: $g^2 - g^2$ from two different computations)."""
        (sgs,) = needed
        if overwrite and _plain(sgs) and _plain(grad) and sgs._base is None:  # no model-sized temporaries
            return sgs.div_(batch_size).addcmul_(grad, grad, value=-1.0 / batch_size**2).clamp_(min=0)
        return torch.addcmul(sgs / batch_size, grad, grad, value=-1.0 / batch_size**2).clamp(min=0)


def _plain(t: Tensor) -> bool:
    """Values that nothing differentiates through (in place is safe)."""
    return not t.requires_grad and is_concrete(t)
