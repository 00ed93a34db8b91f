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

Kronecker factors follow BackPACK: for a weight, ``[B, A]`` with ``B`` the
output-side factor ``Σ_{v,n} (Σ_s m)(Σ_s m)ᵀ`` of the backpropagated root
(``s`` the positions sharing the weight) and ``A = (1/N) Σ_{n,s} x xᵀ`` the
input-side factor (unfolded input for convolutions); for a bias, ``[B]``.
``KFAC``/``KFLR(kfac_approx="expand" | "reduce")`` give instead the two
approximations of Eschenhagen et al. (2023) for layers whose weight several
positions of a sample share (convolutions, Linear layers on sequences), as
curvlinops defines them: ``"expand"`` ``B = Σ_{v,n,s} m mᵀ``,
``A = (1/(N·S)) Σ_{n,s} x xᵀ``; ``"reduce"`` ``B`` as BackPACK's,
``A = (1/N) Σ_n x̄ x̄ᵀ`` (``x̄`` the mean over the ``S`` positions). Without
shared positions all three coincide (for convolutions ``"expand"`` is the KFC
convention of Grosse & Martens, 2016). Other layers (``Embedding``: ``[A [V], B]``;
grouped convolutions: per-group factors; normalisations' scale and shift and 1-D
parameters of other modules: their exact block ``[F]``) follow
``curvlib._core.kronlayout`` and docs/conventions.md; ``KFRA`` has factors for Linear/Conv/ConvTranspose only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from .._core.errors import CurvatureError, CurvatureTypeError
from ._base import Extension


KFAC_APPROXES = ("expand", "reduce")


def _check_kfac_approx(cls_name: str, kfac_approx: object) -> None:
    if kfac_approx is not None and kfac_approx not in KFAC_APPROXES:
        raise CurvatureError(
            f"{cls_name}(kfac_approx={kfac_approx!r}) is not supported; use None (BackPACK's "
            f"factors) or one of {KFAC_APPROXES}."
        )


def _check_max_factor_dim(cls_name: str, max_factor_dim: object) -> None:
    if max_factor_dim is not None and (isinstance(max_factor_dim, bool) or not isinstance(max_factor_dim, int)
                                       or max_factor_dim < 1):
        raise CurvatureError(
            f"{cls_name}(max_factor_dim={max_factor_dim!r}): must be a positive int (a factor side "
            "larger than it is diagonal) or None (dense factors, refused above curvlib._plan.budget's budget)."
        )


def _check_mc(cls_name: str, mc_samples: object, generator: object) -> None:
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
        raise CurvatureError(
            f"{cls_name}(mc_samples={mc_samples!r}): mc_samples must be a positive int."
        )
    if generator is not None and not isinstance(generator, torch.Generator):
        raise CurvatureTypeError(
            f"{cls_name}(generator=...) must be a torch.Generator or None, got "
            f"{type(generator).__name__}."
        )


@dataclass(frozen=True)
class SecondOrder(Extension):
    """Base of the curvature extensions.

    Attributes:
        root: ``"exact"`` or ``"mc"``: which factor of the loss Hessian is
            backpropagated; ``"grad"``: the per-sample loss gradients (empirical
            Fisher); ``None`` for extensions that need none.
        quantity: what is read off per parameter: ``"diag"``, ``"batch_diag"``,
            ``"sqrt"``, ``"kron"``, ``"hessian_diag"``, ``"hessian_batch_diag"``,
            ``"kfra"``, or a product ``"ggnmp"``/``"hmp"``/``"pchmp"``.
        kron: True for Kronecker-factored extensions (layouts: ``curvlib._core.kronlayout`` and docs/conventions.md).
    """

    order: ClassVar[int] = 2
    root: ClassVar[Optional[str]] = None
    quantity: ClassVar[str] = ""
    kron: ClassVar[bool] = False


@dataclass(frozen=True)
class _MC(SecondOrder):
    mc_samples: int = 1
    generator: Optional[torch.Generator] = None
    root: ClassVar[Optional[str]] = "mc"

    def __post_init__(self):
        _check_mc(type(self).__name__, self.mc_samples, self.generator)


@dataclass(frozen=True)
class DiagGGNExact(SecondOrder):
    """Exact diagonal of the generalized Gauss-Newton matrix (BackPACK's ``DiagGGNExact``).

    Result key: ``"diag_ggn_exact"``, a dict parameter name -> ``p.shape``.

    Value: ``diag G`` restricted to ``p``, with ``G = Σ_n J_nᵀ (c∇²_f ℓ_n) J_n`` (``J_n`` the
    Jacobian of sample ``n``'s output w.r.t. the parameter, ``c`` the loss's
    reduction factor), computed by pulling the
    ``C`` columns of a symmetric factor of ``c∇²ℓ_n`` back through the model
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


@dataclass(frozen=True)
class DiagGGNMC(_MC):
    """Monte-Carlo estimate of the GGN diagonal (BackPACK's ``DiagGGNMC``).

    Result key: ``"diag_ggn_mc"``, a dict parameter name -> ``p.shape``.

    Value: ``Σ_n Σ_m (J_nᵀ s_m)²`` restricted to ``p``, an unbiased estimate of
    the diagonal of ``G = Σ_n J_nᵀ (c∇²_f ℓ_n) J_n`` (``J_n`` the
    Jacobian of sample ``n``'s output w.r.t. the parameter, ``c`` the loss's
    reduction factor) (for CrossEntropy, the diagonal of the Fisher).

    The exact loss-Hessian factor ``S_n`` is replaced by ``M`` columns
    ``s = √(1/M)·∇_f ℓ(f_n, ŷ)`` at labels ``ŷ`` drawn from the model's
    predictive distribution (CrossEntropy: categorical; MSE: Gaussian;
    BCEWithLogits: Bernoulli; other losses: Gaussian sketches ``S_n ε/√M``),
    scaled like the loss, so that ``E[s sᵀ]`` summed over the columns is
    ``c∇²ℓ_n``: an unbiased estimate of the exact quantity.

    Options: ``mc_samples`` (int ≥ 1, default 1): the number ``M`` of sampled
    labels per sample; ``generator`` (a ``torch.Generator`` or None): where the
    labels are drawn from (None: torch's global random state); the same
    generator state gives the same result.

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


@dataclass(frozen=True)
class BatchDiagGGNExact(SecondOrder):
    """Per-sample terms of the exact GGN diagonal (BackPACK's ``BatchDiagGGNExact``).

    Result key: ``"diag_ggn_exact_batch"``, a dict parameter name -> ``[N, *p.shape]``.

    Row ``n`` is ``diag(J_nᵀ (c∇²_f ℓ_n) J_n)`` restricted to ``p``; the rows sum
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


@dataclass(frozen=True)
class BatchDiagGGNMC(_MC):
    """Per-sample terms of the Monte-Carlo GGN diagonal (BackPACK's ``BatchDiagGGNMC``).

    Result key: ``"diag_ggn_mc_batch"``, a dict parameter name -> ``[N, *p.shape]``.

    Row ``n`` is ``Σ_m (J_nᵀ s_m)²`` restricted to ``p``, with the sampled
    columns ``s_m`` of sample ``n``; the rows sum to a ``diag_ggn_mc``.

    The exact loss-Hessian factor ``S_n`` is replaced by ``M`` columns
    ``s = √(1/M)·∇_f ℓ(f_n, ŷ)`` at labels ``ŷ`` drawn from the model's
    predictive distribution (CrossEntropy: categorical; MSE: Gaussian;
    BCEWithLogits: Bernoulli; other losses: Gaussian sketches ``S_n ε/√M``),
    scaled like the loss, so that ``E[s sᵀ]`` summed over the columns is
    ``c∇²ℓ_n``: an unbiased estimate of the exact quantity.

    Options: ``mc_samples`` (int ≥ 1, default 1): the number ``M`` of sampled
    labels per sample; ``generator`` (a ``torch.Generator`` or None): where the
    labels are drawn from (None: torch's global random state); the same
    generator state gives the same result.

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


@dataclass(frozen=True)
class DiagHessian(SecondOrder):
    """Exact diagonal of the Hessian of the loss (BackPACK's ``DiagHessian``).

    Result key: ``"diag_h"``, a dict parameter name -> ``p.shape``.

    Value: ``diag ∇²_p L``: the GGN diagonal plus the residual terms of every
    node with a second derivative (for an element-wise activation ``φ``,
    ``φ''(u)·g`` with ``g`` the loss gradient at its output), pulled back as
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


@dataclass(frozen=True)
class BatchDiagHessian(SecondOrder):
    """Per-sample terms of the Hessian diagonal (BackPACK's ``BatchDiagHessian``).

    Result key: ``"diag_h_batch"``, a dict parameter name -> ``[N, *p.shape]``.

    Row ``n`` is ``diag ∇²_p (c·ℓ_n)``, the Hessian diagonal of sample ``n``'s
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


@dataclass(frozen=True)
class KFAC(_MC):
    """Kronecker factors from sampled labels, KFAC (Martens & Grosse; BackPACK's ``KFAC``).

    Result key: ``"kfac"``, a dict parameter name -> list of factors.

    Per parameter, a list of factors whose Kronecker product in order
    approximates the parameter's block. ``Linear``/``Conv``/``ConvTranspose``
    weight ``[O, I, *k]``: ``[B [O, O], A [I·K, I·K]]`` (BackPACK's order,
    ``B ⊗ A`` ≈ the block of the weight flattened row-major); bias ``[B]``.
    ``A = (1/N) Σ_{n,s} x xᵀ`` (unfolded inputs, positions ``s``; no ``c``),
    ``B = Σ_{v,n} (Σ_s m)(Σ_s m)ᵀ`` over the backpropagated columns ``m`` at
    the layer's output (carrying ``c``). Grouped convolutions:
    ``[B [G, O/G, O/G], A [G, ., .]]``; ``Embedding [V, D]``: ``[A [V], B [D, D]]``
    (input side first, ``A`` diagonal); norms and other 1-D parameters: their
    exact block ``[F [P, P]]``; see docs/conventions.md.

    ``m`` are the ``M`` sampled columns ``s`` of the Monte-Carlo extensions, so
    ``B ⊗ A`` approximates the Fisher block.

    The exact loss-Hessian factor ``S_n`` is replaced by ``M`` columns
    ``s = √(1/M)·∇_f ℓ(f_n, ŷ)`` at labels ``ŷ`` drawn from the model's
    predictive distribution (CrossEntropy: categorical; MSE: Gaussian;
    BCEWithLogits: Bernoulli; other losses: Gaussian sketches ``S_n ε/√M``),
    scaled like the loss, so that ``E[s sᵀ]`` summed over the columns is
    ``c∇²ℓ_n``: an unbiased estimate of the exact quantity.

    Options: ``mc_samples`` (int ≥ 1, default 1): the number ``M`` of sampled
    labels per sample; ``generator`` (a ``torch.Generator`` or None): where the
    labels are drawn from (None: torch's global random state); the same
    generator state gives the same result.

    ``kfac_approx`` (None, ``"expand"`` or ``"reduce"``):
    None is BackPACK's; ``"expand"``/``"reduce"`` are Eschenhagen et al.'s
    approximations for weights shared by positions (curvlinops' definitions):
    ``"expand"`` ``B = Σ_{v,n,s} m mᵀ``, ``A = (1/(N·S)) Σ_{n,s} x xᵀ``;
    ``"reduce"`` ``B`` as None, ``A = (1/N) Σ_n x̄ x̄ᵀ`` (``x̄`` the mean over the
    ``S`` positions). Without shared positions all three coincide.
    ``max_factor_dim`` (int ≥ 1 or None): a factor side larger than it gets a 1-D,
    diagonal factor (kfac-jax's choice), computed as ``Σ_rows m²`` (or ``x²``) without
    forming the dense one: the language-model head ``[V, D]`` gets ``[B [V], A [D, D]]``;
    a 1-D parameter's exact block ``[F [P, P]]`` becomes ``[F [P]]``. With None, a dense
    factor over ``curvlib._plan.budget.DENSE_FACTOR_BYTES`` (1 GiB) is refused before any
    work. Refused with ``batch_chunk_size`` and ``process_group``.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import KFAC
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [KFAC(mc_samples=2)])(X, y)
        >>> B, A = qs["kfac"]["0.weight"]                  # 0.weight is [4, 3]
        >>> B.shape, A.shape
        (torch.Size([4, 4]), torch.Size([3, 3]))
        >>> [f.shape for f in qs["kfac"]["0.bias"]]
        [torch.Size([4, 4])]
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [KFAC(max_factor_dim=3)])(X, y)
        >>> [f.shape for f in qs["kfac"]["0.weight"]]  # the output side (4 > 3) diagonal
        [torch.Size([4]), torch.Size([3, 3])]
    """

    kfac_approx: Optional[str] = None
    max_factor_dim: Optional[int] = None
    name: ClassVar[str] = "kfac"
    quantity: ClassVar[str] = "kron"
    kron: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        _check_kfac_approx(type(self).__name__, self.kfac_approx)
        _check_max_factor_dim(type(self).__name__, self.max_factor_dim)


@dataclass(frozen=True)
class KFLR(SecondOrder):
    """Kronecker factors from the exact loss-Hessian factor, KFLR (Botev et al.; BackPACK's ``KFLR``).

    Result key: ``"kflr"``, a dict parameter name -> list of factors.

    Per parameter, a list of factors whose Kronecker product in order
    approximates the parameter's block. ``Linear``/``Conv``/``ConvTranspose``
    weight ``[O, I, *k]``: ``[B [O, O], A [I·K, I·K]]`` (BackPACK's order,
    ``B ⊗ A`` ≈ the block of the weight flattened row-major); bias ``[B]``.
    ``A = (1/N) Σ_{n,s} x xᵀ`` (unfolded inputs, positions ``s``; no ``c``),
    ``B = Σ_{v,n} (Σ_s m)(Σ_s m)ᵀ`` over the backpropagated columns ``m`` at
    the layer's output (carrying ``c``). Grouped convolutions:
    ``[B [G, O/G, O/G], A [G, ., .]]``; ``Embedding [V, D]``: ``[A [V], B [D, D]]``
    (input side first, ``A`` diagonal); norms and other 1-D parameters: their
    exact block ``[F [P, P]]``; see docs/conventions.md.

    ``m`` are the ``C`` exact columns of ``c∇²ℓ_n``'s factor, so ``B ⊗ A``
    approximates the GGN block (exact for one sample and no shared positions).
    Options: ``kfac_approx`` (None, ``"expand"`` or ``"reduce"``):
    None is BackPACK's; ``"expand"``/``"reduce"`` are Eschenhagen et al.'s
    approximations for weights shared by positions (curvlinops' definitions):
    ``"expand"`` ``B = Σ_{v,n,s} m mᵀ``, ``A = (1/(N·S)) Σ_{n,s} x xᵀ``;
    ``"reduce"`` ``B`` as None, ``A = (1/N) Σ_n x̄ x̄ᵀ`` (``x̄`` the mean over the
    ``S`` positions). Without shared positions all three coincide.
    ``max_factor_dim`` (int ≥ 1 or None): a factor side larger than it gets a 1-D,
    diagonal factor (kfac-jax's choice), computed as ``Σ_rows m²`` (or ``x²``) without
    forming the dense one: the language-model head ``[V, D]`` gets ``[B [V], A [D, D]]``;
    a 1-D parameter's exact block ``[F [P, P]]`` becomes ``[F [P]]``. With None, a dense
    factor over ``curvlib._plan.budget.DENSE_FACTOR_BYTES`` (1 GiB) is refused before any
    work. Refused with ``batch_chunk_size`` and ``process_group``.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import KFLR
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [KFLR()])(X, y)
        >>> B, A = qs["kflr"]["2.weight"]                  # 2.weight is [2, 4]
        >>> B.shape, A.shape
        (torch.Size([2, 2]), torch.Size([4, 4]))
        >>> h = torch.tanh(model[0](X))                    # the input of model[2]
        >>> torch.allclose(A, h.T @ h / 5, atol=1e-6)      # A = (1/N) Σ x xᵀ
        True
    """

    kfac_approx: Optional[str] = None
    max_factor_dim: Optional[int] = None
    name: ClassVar[str] = "kflr"
    root: ClassVar[Optional[str]] = "exact"
    quantity: ClassVar[str] = "kron"
    kron: ClassVar[bool] = True

    def __post_init__(self):
        _check_kfac_approx(type(self).__name__, self.kfac_approx)
        _check_max_factor_dim(type(self).__name__, self.max_factor_dim)


@dataclass(frozen=True)
class KFACEmpirical(SecondOrder):
    """Kronecker factors of the empirical Fisher ``Σ_n g_n g_nᵀ`` (curvlinops' ``EMPIRICAL``; not in BackPACK).

    Result key: ``"kfac_empirical"``, a dict parameter name -> list of factors.

    Per parameter, a list of factors whose Kronecker product in order
    approximates the parameter's block. ``Linear``/``Conv``/``ConvTranspose``
    weight ``[O, I, *k]``: ``[B [O, O], A [I·K, I·K]]`` (BackPACK's order,
    ``B ⊗ A`` ≈ the block of the weight flattened row-major); bias ``[B]``.
    ``A = (1/N) Σ_{n,s} x xᵀ`` (unfolded inputs, positions ``s``; no ``c``),
    ``B = Σ_{v,n} (Σ_s m)(Σ_s m)ᵀ`` over the backpropagated columns ``m`` at
    the layer's output (carrying ``c``). Grouped convolutions:
    ``[B [G, O/G, O/G], A [G, ., .]]``; ``Embedding [V, D]``: ``[A [V], B [D, D]]``
    (input side first, ``A`` diagonal); norms and other 1-D parameters: their
    exact block ``[F [P, P]]``; see docs/conventions.md.

    ``m`` is one column per sample: the gradient of sample ``n``'s own loss
    term at the layer's output, so ``B`` carries ``c²`` like ``SumGradSquared``.
    Options: ``kfac_approx`` (None, ``"expand"`` or ``"reduce"``):
    None is BackPACK's; ``"expand"``/``"reduce"`` are Eschenhagen et al.'s
    approximations for weights shared by positions (curvlinops' definitions):
    ``"expand"`` ``B = Σ_{v,n,s} m mᵀ``, ``A = (1/(N·S)) Σ_{n,s} x xᵀ``;
    ``"reduce"`` ``B`` as None, ``A = (1/N) Σ_n x̄ x̄ᵀ`` (``x̄`` the mean over the
    ``S`` positions). Without shared positions all three coincide.
    ``max_factor_dim`` (int ≥ 1 or None): a factor side larger than it gets a 1-D,
    diagonal factor (kfac-jax's choice), computed as ``Σ_rows m²`` (or ``x²``) without
    forming the dense one: the language-model head ``[V, D]`` gets ``[B [V], A [D, D]]``;
    a 1-D parameter's exact block ``[F [P, P]]`` becomes ``[F [P]]``. With None, a dense
    factor over ``curvlib._plan.budget.DENSE_FACTOR_BYTES`` (1 GiB) is refused before any
    work. Refused with ``batch_chunk_size`` and ``process_group``.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import KFACEmpirical
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [KFACEmpirical()])(X, y)
        >>> B, A = qs["kfac_empirical"]["0.weight"]
        >>> B.shape, A.shape
        (torch.Size([4, 4]), torch.Size([3, 3]))
    """

    kfac_approx: Optional[str] = None
    max_factor_dim: Optional[int] = None
    name: ClassVar[str] = "kfac_empirical"
    root: ClassVar[Optional[str]] = "grad"
    quantity: ClassVar[str] = "kron"
    kron: ClassVar[bool] = True

    def __post_init__(self):
        _check_kfac_approx(type(self).__name__, self.kfac_approx)
        _check_max_factor_dim(type(self).__name__, self.max_factor_dim)


@dataclass(frozen=True)
class KFRA(SecondOrder):
    """Kronecker factors from the batch-averaged GGN recursion, KFRA (Botev et al.; BackPACK's ``KFRA``).

    Result key: ``"kfra"``, a dict parameter name -> list of factors.

    Layout as ``KFLR``: weight ``[B [O, O], A [I·K, I·K]]``, bias ``[B]``, with
    ``A`` as KFLR's and ``B`` propagated backwards layer by layer as a
    batch-averaged ``[O, O]`` matrix (``Ḡ_in = avg_n(J_nᵀ Ḡ_out J_n)`` plus the
    activations' residuals), scaled like the loss. Needs a chain
    (Sequential-like) model of ``Linear``/``Conv``/``ConvTranspose`` layers and
    element-wise activations; refuses ``batch_chunk_size``. Options: none.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import KFRA
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [KFRA()])(X, y)
        >>> [f.shape for f in qs["kfra"]["0.weight"]]
        [torch.Size([4, 4]), torch.Size([3, 3])]
    """

    name: ClassVar[str] = "kfra"
    quantity: ClassVar[str] = "kfra"
    kron: ClassVar[bool] = True


@dataclass(frozen=True)
class SqrtGGNExact(SecondOrder):
    """Exact symmetric factorisation of the GGN (BackPACK's ``SqrtGGNExact``).

    Result key: ``"sqrt_ggn_exact"``, a dict parameter name -> ``[C, N, *p.shape]``.

    Entry ``[k, n]`` is ``J_nᵀ S_n[:, k]`` with ``S_n S_nᵀ = c∇²_f ℓ_n``
    (BackPACK's factor; ``C`` outputs per sample), so the GGN block of ``p`` is
    ``Σ_{k,n} s s ᵀ`` of the flattened entries. Refused for a loss with an
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


@dataclass(frozen=True)
class SqrtGGNMC(_MC):
    """Monte-Carlo symmetric factorisation of the GGN (BackPACK's ``SqrtGGNMC``).

    Result key: ``"sqrt_ggn_mc"``, a dict parameter name -> ``[M, N, *p.shape]``.

    Entry ``[m, n]`` is ``J_nᵀ s_m`` for the sampled columns ``s_m`` of sample
    ``n``; ``Σ_{m,n} s sᵀ`` is an unbiased estimate of the GGN block.

    The exact loss-Hessian factor ``S_n`` is replaced by ``M`` columns
    ``s = √(1/M)·∇_f ℓ(f_n, ŷ)`` at labels ``ŷ`` drawn from the model's
    predictive distribution (CrossEntropy: categorical; MSE: Gaussian;
    BCEWithLogits: Bernoulli; other losses: Gaussian sketches ``S_n ε/√M``),
    scaled like the loss, so that ``E[s sᵀ]`` summed over the columns is
    ``c∇²ℓ_n``: an unbiased estimate of the exact quantity.

    Options: ``mc_samples`` (int ≥ 1, default 1): the number ``M`` of sampled
    labels per sample; ``generator`` (a ``torch.Generator`` or None): where the
    labels are drawn from (None: torch's global random state); the same
    generator state gives the same result.

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


@dataclass(frozen=True)
class GGNMP(SecondOrder):
    """GGN block times vectors, as a callable (BackPACK's ``GGNMP``).

    Result key: ``"ggnmp"``, a dict parameter name -> callable
    ``V [K, *p.shape] -> [K, *p.shape]``.

    The callable multiplies ``K`` vectors by ``G_pp``, the block of ``G = Σ_n J_nᵀ (c∇²_f ℓ_n) J_n`` (``J_n`` the
    Jacobian of sample ``n``'s output w.r.t. the parameter, ``c`` the loss's
    reduction factor) for
    the parameter ``p`` (forward-over-reverse autodiff on the call's
    linearisation; any graph). It may be called later and many times; it is
    refused with ``process_group`` and ``batch_chunk_size``. Options: none.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import GGNMP
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [GGNMP()])(X, y)
        >>> V = torch.randn(2, 4, 3)                      # two vectors shaped like 0.weight
        >>> qs["ggnmp"]["0.weight"](V).shape
        torch.Size([2, 4, 3])
    """

    name: ClassVar[str] = "ggnmp"
    quantity: ClassVar[str] = "ggnmp"


@dataclass(frozen=True)
class HMP(SecondOrder):
    """Hessian block times vectors, as a callable (BackPACK's ``HMP``).

    Result key: ``"hmp"``, a dict parameter name -> callable
    ``V [K, *p.shape] -> [K, *p.shape]``.

    The callable multiplies ``K`` vectors by ``∇²_pp L``, the exact block of
    the loss's Hessian for the parameter ``p`` (double backward). It may be
    called later and many times; refused with ``process_group`` and
    ``batch_chunk_size``. Options: none.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import HMP
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [HMP()])(X, y)
        >>> V = torch.randn(2, 4)                         # two vectors shaped like 0.bias
        >>> qs["hmp"]["0.bias"](V).shape
        torch.Size([2, 4])
    """

    name: ClassVar[str] = "hmp"
    quantity: ClassVar[str] = "hmp"


@dataclass(frozen=True)
class PCHMP(SecondOrder):
    """Positive-curvature Hessian block times vectors (Chen et al.; BackPACK's ``PCHMP``).

    Result key: ``"pchmp"``, a dict parameter name -> callable
    ``V [K, *p.shape] -> [K, *p.shape]``.

    The Hessian block with every node's residual ``R = ∇²_u (g · φ(u))``
    (``g`` the loss gradient at the node's output) made positive
    semi-definite: for an element-wise activation ``R = diag(φ''(u)·g)`` becomes
    ``max(R, 0)`` (``modify="clip"``, default) or ``|R|`` (``modify="abs"``);
    other nodes and the loss Hessian have their eigenvalues modified alike.
    BackPACK 1.7.1 multiplies by ``g`` twice (``mod(φ''(u)·g·g)``); curvlib
    follows the definition. Options: ``modify``, ``"clip"`` or ``"abs"``.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import curvature
        >>> from curvlib.extensions import PCHMP
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> qs = curvature(model, nn.CrossEntropyLoss(), [PCHMP(modify="abs")])(X, y)
        >>> V = torch.randn(2, 4, 3)
        >>> qs["pchmp"]["0.weight"](V).shape
        torch.Size([2, 4, 3])
    """

    modify: str = "clip"
    name: ClassVar[str] = "pchmp"
    quantity: ClassVar[str] = "pchmp"

    def __post_init__(self):
        if self.modify not in ("clip", "abs"):
            raise CurvatureError(
                f"PCHMP(modify={self.modify!r}) is not supported; use 'clip' or 'abs'."
            )
