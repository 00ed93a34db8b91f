"""Second-order extensions: the GGN, the Hessian and Kronecker factors.

Notation: the loss is ``L(θ) = c · Σ_n ℓ(f(x_n, θ), y_n)`` (``c`` the reduction
factor of ``curvlib.losses``), ``J_n = ∂f(x_n)/∂θ`` the per-sample Jacobian
of the model output and ``S_n`` a symmetric factor of the scaled loss Hessian,
``S_n S_nᵀ = c ∇²ℓ_n`` (exact: ``C`` columns, one per output entry; Monte
Carlo: ``M`` sampled columns). The GGN is ``G = Σ_n (J_nᵀ S_n)(J_nᵀ S_n)ᵀ``.

| extension | name | value for parameter ``p`` |
|---|---|---|
| ``DiagGGNExact()`` | ``diag_ggn_exact`` | ``diag G``, ``p.shape`` |
| ``DiagGGNMC(mc_samples)`` | ``diag_ggn_mc`` | MC estimate of ``diag G`` |
| ``BatchDiagGGNExact()`` | ``diag_ggn_exact_batch`` | ``[N, *p]``, per-sample terms of ``diag G`` |
| ``BatchDiagGGNMC(mc_samples)`` | ``diag_ggn_mc_batch`` | MC version |
| ``DiagHessian()`` | ``diag_h`` | ``diag ∇²L`` (exact, with the nonlinearities' second derivatives) |
| ``BatchDiagHessian()`` | ``diag_h_batch`` | ``[N, *p]`` per-sample terms |
| ``KFAC(mc_samples, kfac_approx)`` | ``kfac`` | Kronecker factors from MC ``S`` |
| ``KFLR(kfac_approx)`` | ``kflr`` | Kronecker factors from exact ``S`` |
| ``KFRA()`` | ``kfra`` | Kronecker factors from the batch-averaged recursion |
| ``KFACEmpirical()`` | ``kfac_empirical`` | Kronecker factors of the empirical Fisher |
| ``SqrtGGNExact()`` | ``sqrt_ggn_exact`` | ``[C, N, *p]``: ``J_nᵀ S_n`` |
| ``SqrtGGNMC(mc_samples)`` | ``sqrt_ggn_mc`` | ``[M, N, *p]`` |
| ``GGNMP()`` | ``ggnmp`` | callable ``[V, *p] -> [V, *p]``: GGN block times ``V`` |
| ``HMP()`` | ``hmp`` | callable: Hessian block times ``V`` |
| ``PCHMP(modify)`` | ``pchmp`` | callable: positive-curvature Hessian block times ``V`` |

Kronecker factors: :mod:`curvlib.extensions.kronecker`; block products:
:mod:`curvlib.extensions.products`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

from ._base import HESSIAN_FAMILIES, MonteCarlo, SecondOrder
from .combine import Combine


@dataclass(frozen=True)
class DiagGGNExact(SecondOrder):
    r"""Exact diagonal of the generalized Gauss-Newton matrix (BackPACK's ``DiagGGNExact``).

    Result key: ``"diag_ggn_exact"``, a dict parameter name -> ``p.shape``.

    Value: ``diag G`` restricted to ``p``, with $G = \sum_n J_n^\top (c \nabla_f^2 \ell_n) J_n$ (``J_n`` the
    Jacobian of sample ``n``'s output w.r.t. the parameter, ``c`` the loss's
    reduction factor), computed by pulling the
    ``C`` columns of a symmetric factor of $c \nabla^2 \ell_n$ back through the model
    (``C`` = outputs per sample); ``chunk_size=`` bounds their memory. Options: none.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import DiagGGNExact
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [DiagGGNExact()])(X, y)
        >>> qs["diag_ggn_exact"]["0.weight"].shape
        torch.Size([4, 3])
        >>> bool((qs["diag_ggn_exact"]["0.weight"] >= 0).all())
        True
    """

    name: ClassVar[str] = "diag_ggn_exact"
    root: ClassVar[Optional[str]] = "exact"
    quantity: ClassVar[str] = "diag"
    slices: ClassVar[Optional[Combine]] = Combine.SUM
    ranks: ClassVar[Optional[Combine]] = Combine.SUM
    monte_carlo: ClassVar[str] = "DiagGGNMC"
    ggn: ClassVar[bool] = True


@dataclass(frozen=True)
class DiagGGNMC(MonteCarlo):
    r"""Monte-Carlo estimate of the GGN diagonal (BackPACK's ``DiagGGNMC``).

    Result key: ``"diag_ggn_mc"``, a dict parameter name -> ``p.shape``.

    Value: $\sum_n \sum_m (J_n^\top s_m)^2$ restricted to ``p``, an unbiased estimate of
    the diagonal of $G = \sum_n J_n^\top (c \nabla_f^2 \ell_n) J_n$ (``J_n`` the
    Jacobian of sample ``n``'s output w.r.t. the parameter, ``c`` the loss's
    reduction factor) (for CrossEntropy, the diagonal of the Fisher).

    The exact loss-Hessian factor ``S_n`` is replaced by ``M`` columns
    $s = \sqrt{1/M}\, \nabla_f \ell(f_n, \hat y)$ at labels ``ŷ`` drawn from the model's
    predictive distribution (CrossEntropy: categorical; MSE: Gaussian;
    BCEWithLogits: Bernoulli; other losses: Gaussian sketches $S_n \varepsilon / \sqrt{M}$),
    scaled like the loss, so that $\mathbb{E}[s s^\top]$ summed over the columns is
    $c \nabla^2 \ell_n$: an unbiased estimate of the exact quantity.

    Args:
        mc_samples: the number ``M`` of sampled labels per sample, an int ≥ 1.
        generator: the ``torch.Generator`` the labels are drawn from (None: torch's
            global random state); the same generator state gives the same result.

    Raises:
        CurvatureError: ``mc_samples`` is not a positive int.
        CurvatureTypeError: ``generator`` is neither a ``torch.Generator`` nor None.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import DiagGGNMC
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [DiagGGNMC(mc_samples=2, generator=torch.Generator().manual_seed(0))])(X, y)
        >>> qs["diag_ggn_mc"]["0.weight"].shape
        torch.Size([4, 3])
    """

    name: ClassVar[str] = "diag_ggn_mc"
    quantity: ClassVar[str] = "diag"
    slices: ClassVar[Optional[Combine]] = Combine.SUM
    ranks: ClassVar[Optional[Combine]] = Combine.SUM
    ggn: ClassVar[bool] = True


@dataclass(frozen=True)
class BatchDiagGGNExact(SecondOrder):
    r"""Per-sample terms of the exact GGN diagonal (BackPACK's ``BatchDiagGGNExact``).

    Result key: ``"diag_ggn_exact_batch"``, a dict parameter name -> ``[N, *p.shape]``.

    Row ``n`` is $\operatorname{diag}(J_n^\top (c \nabla_f^2 \ell_n) J_n)$ restricted to ``p``; the rows sum
    to ``DiagGGNExact``'s ``diag_ggn_exact``. Options: none.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import BatchDiagGGNExact
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [BatchDiagGGNExact()])(X, y)
        >>> qs["diag_ggn_exact_batch"]["0.weight"].shape
        torch.Size([5, 4, 3])
    """

    name: ClassVar[str] = "diag_ggn_exact_batch"
    root: ClassVar[Optional[str]] = "exact"
    quantity: ClassVar[str] = "batch_diag"
    slices: ClassVar[Optional[Combine]] = Combine.SAMPLES
    ranks: ClassVar[Optional[Combine]] = Combine.SAMPLES
    per_sample: ClassVar[bool] = True
    monte_carlo: ClassVar[str] = "BatchDiagGGNMC"
    ggn: ClassVar[bool] = True


@dataclass(frozen=True)
class BatchDiagGGNMC(MonteCarlo):
    r"""Per-sample terms of the Monte-Carlo GGN diagonal (BackPACK's ``BatchDiagGGNMC``).

    Result key: ``"diag_ggn_mc_batch"``, a dict parameter name -> ``[N, *p.shape]``.

    Row ``n`` is $\sum_m (J_n^\top s_m)^2$ restricted to ``p``, with the sampled
    columns ``s_m`` of sample ``n``; the rows sum to a ``diag_ggn_mc``.

    The exact loss-Hessian factor ``S_n`` is replaced by ``M`` columns
    $s = \sqrt{1/M}\, \nabla_f \ell(f_n, \hat y)$ at labels ``ŷ`` drawn from the model's
    predictive distribution (CrossEntropy: categorical; MSE: Gaussian;
    BCEWithLogits: Bernoulli; other losses: Gaussian sketches $S_n \varepsilon / \sqrt{M}$),
    scaled like the loss, so that $\mathbb{E}[s s^\top]$ summed over the columns is
    $c \nabla^2 \ell_n$: an unbiased estimate of the exact quantity.

    Args:
        mc_samples: the number ``M`` of sampled labels per sample, an int ≥ 1.
        generator: the ``torch.Generator`` the labels are drawn from (None: torch's
            global random state); the same generator state gives the same result.

    Raises:
        CurvatureError: ``mc_samples`` is not a positive int.
        CurvatureTypeError: ``generator`` is neither a ``torch.Generator`` nor None.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import BatchDiagGGNMC
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [BatchDiagGGNMC(mc_samples=3)])(X, y)
        >>> qs["diag_ggn_mc_batch"]["2.bias"].shape
        torch.Size([5, 2])
    """

    name: ClassVar[str] = "diag_ggn_mc_batch"
    quantity: ClassVar[str] = "batch_diag"
    slices: ClassVar[Optional[Combine]] = Combine.SAMPLES
    ranks: ClassVar[Optional[Combine]] = Combine.SAMPLES
    per_sample: ClassVar[bool] = True
    ggn: ClassVar[bool] = True


@dataclass(frozen=True)
class DiagHessian(SecondOrder):
    r"""Exact diagonal of the Hessian of the loss (BackPACK's ``DiagHessian``).

    Result key: ``"diag_h"``, a dict parameter name -> ``p.shape``.

    Value: $\operatorname{diag} \nabla_p^2 L$: the GGN diagonal plus the residual terms of every
    node with a second derivative (for an element-wise activation $\varphi$,
    $\varphi''(u)\, g$ with ``g`` the loss gradient at its output), pulled back as
    signed columns. It may be negative. Options: none.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import DiagHessian
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [DiagHessian()])(X, y)
        >>> qs["diag_h"]["0.weight"].shape
        torch.Size([4, 3])
    """

    name: ClassVar[str] = "diag_h"
    root: ClassVar[Optional[str]] = "exact"
    quantity: ClassVar[str] = "hessian_diag"
    read_as: ClassVar[str] = "diag"
    slices: ClassVar[Optional[Combine]] = Combine.SUM
    ranks: ClassVar[Optional[Combine]] = Combine.SUM
    hessian: ClassVar[bool] = True
    function_needs: ClassVar[Tuple[str, ...]] = ("setup_context", "vmap", "jvp", "twice")
    layer_kinds: ClassVar[Optional[Tuple[str, ...]]] = HESSIAN_FAMILIES
    monte_carlo: ClassVar[str] = "DiagGGNMC"
    many_columns: ClassVar[bool] = True


@dataclass(frozen=True)
class BatchDiagHessian(SecondOrder):
    r"""Per-sample terms of the Hessian diagonal (BackPACK's ``BatchDiagHessian``).

    Result key: ``"diag_h_batch"``, a dict parameter name -> ``[N, *p.shape]``.

    Row ``n`` is $\operatorname{diag} \nabla_p^2 (c\, \ell_n)$, the Hessian diagonal of sample ``n``'s
    term of the loss; the rows sum to ``DiagHessian``'s ``diag_h``. Options: none.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import BatchDiagHessian
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [BatchDiagHessian()])(X, y)
        >>> qs["diag_h_batch"]["0.weight"].shape
        torch.Size([5, 4, 3])
    """

    name: ClassVar[str] = "diag_h_batch"
    root: ClassVar[Optional[str]] = "exact"
    quantity: ClassVar[str] = "hessian_batch_diag"
    read_as: ClassVar[str] = "batch_diag"
    slices: ClassVar[Optional[Combine]] = Combine.SAMPLES
    ranks: ClassVar[Optional[Combine]] = Combine.SAMPLES
    hessian: ClassVar[bool] = True
    per_sample: ClassVar[bool] = True
    function_needs: ClassVar[Tuple[str, ...]] = ("setup_context", "vmap", "jvp", "twice")
    layer_kinds: ClassVar[Optional[Tuple[str, ...]]] = HESSIAN_FAMILIES
    monte_carlo: ClassVar[str] = "BatchDiagGGNMC"
    many_columns: ClassVar[bool] = True


@dataclass(frozen=True)
class SqrtGGNExact(SecondOrder):
    r"""Exact symmetric factorisation of the GGN (BackPACK's ``SqrtGGNExact``).

    Result key: ``"sqrt_ggn_exact"``, a dict parameter name -> ``[C, N, *p.shape]``.

    Entry ``[k, n]`` is $J_n^\top S_n[:, k]$ with $S_n S_n^\top = c \nabla_f^2 \ell_n$
    (BackPACK's factor; ``C`` outputs per sample), so the GGN block of ``p`` is
    $\sum_{k,n} s s^\top$ of the flattened entries. Refused for a loss with an
    indefinite Hessian. Options: none.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import SqrtGGNExact
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [SqrtGGNExact()])(X, y)
        >>> S = qs["sqrt_ggn_exact"]["2.weight"]           # [C, N, 2, 4]
        >>> S.shape
        torch.Size([2, 5, 2, 4])
        >>> ggn_block = torch.einsum("knp,knq->pq", S.flatten(2), S.flatten(2))   # [8, 8]
        >>> ggn_block.shape
        torch.Size([8, 8])
    """

    name: ClassVar[str] = "sqrt_ggn_exact"
    root: ClassVar[Optional[str]] = "exact"
    quantity: ClassVar[str] = "sqrt"
    slices: ClassVar[Optional[Combine]] = Combine.SAMPLES_ROOT
    ranks: ClassVar[Optional[Combine]] = Combine.SAMPLES_ROOT
    monte_carlo: ClassVar[str] = "SqrtGGNMC"
    many_columns: ClassVar[bool] = True
    ggn: ClassVar[bool] = True


@dataclass(frozen=True)
class SqrtGGNMC(MonteCarlo):
    r"""Monte-Carlo symmetric factorisation of the GGN (BackPACK's ``SqrtGGNMC``).

    Result key: ``"sqrt_ggn_mc"``, a dict parameter name -> ``[M, N, *p.shape]``.

    Entry ``[m, n]`` is $J_n^\top s_m$ for the sampled columns ``s_m`` of sample
    ``n``; $\sum_{m,n} s s^\top$ is an unbiased estimate of the GGN block.

    The exact loss-Hessian factor ``S_n`` is replaced by ``M`` columns
    $s = \sqrt{1/M}\, \nabla_f \ell(f_n, \hat y)$ at labels ``ŷ`` drawn from the model's
    predictive distribution (CrossEntropy: categorical; MSE: Gaussian;
    BCEWithLogits: Bernoulli; other losses: Gaussian sketches $S_n \varepsilon / \sqrt{M}$),
    scaled like the loss, so that $\mathbb{E}[s s^\top]$ summed over the columns is
    $c \nabla^2 \ell_n$: an unbiased estimate of the exact quantity.

    Args:
        mc_samples: the number ``M`` of sampled labels per sample, an int ≥ 1.
        generator: the ``torch.Generator`` the labels are drawn from (None: torch's
            global random state); the same generator state gives the same result.

    Raises:
        CurvatureError: ``mc_samples`` is not a positive int.
        CurvatureTypeError: ``generator`` is neither a ``torch.Generator`` nor None.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import SqrtGGNMC
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [SqrtGGNMC(mc_samples=3)])(X, y)
        >>> qs["sqrt_ggn_mc"]["0.weight"].shape
        torch.Size([3, 5, 4, 3])
    """

    name: ClassVar[str] = "sqrt_ggn_mc"
    quantity: ClassVar[str] = "sqrt"
    slices: ClassVar[Optional[Combine]] = Combine.SAMPLES_ROOT
    ranks: ClassVar[Optional[Combine]] = Combine.SAMPLES_ROOT
    many_columns: ClassVar[bool] = True
    ggn: ClassVar[bool] = True
