"""Second-order extensions: the GGN, the Hessian and Kronecker factors.

Notation: the loss is ``L(θ) = c · Σ_n ℓ(f(x_n, θ), y_n)`` (``c`` the reduction
factor of :mod:`curvlib.losses`), ``J_n = ∂f(x_n)/∂θ`` the per-sample Jacobian
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
:mod:`curvlib._kronlayout`; ``KFRA`` has factors for Linear/Conv/ConvTranspose only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from .._errors import CurvatureError, CurvatureTypeError
from ._base import Extension


KFAC_APPROXES = ("expand", "reduce")


def _check_kfac_approx(cls_name: str, kfac_approx: object) -> None:
    if kfac_approx is not None and kfac_approx not in KFAC_APPROXES:
        raise CurvatureError(
            f"{cls_name}(kfac_approx={kfac_approx!r}) is not supported; use None (BackPACK's "
            f"factors) or one of {KFAC_APPROXES}."
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

    Class attributes:
        root: ``"exact"`` or ``"mc"``: which factor of the loss Hessian is
            backpropagated; ``"grad"``: the per-sample loss gradients (empirical
            Fisher); ``None`` for extensions that need none.
        quantity: what is read off per parameter: ``"diag"``, ``"batch_diag"``,
            ``"sqrt"``, ``"kron"``, ``"hessian_diag"``, ``"hessian_batch_diag"``,
            ``"kfra"``, or a product ``"ggnmp"``/``"hmp"``/``"pchmp"``.
        kron: True for Kronecker-factored extensions (layouts: :mod:`curvlib._kronlayout`).
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
    """Exact diagonal of the GGN, ``p.shape``."""

    name: ClassVar[str] = "diag_ggn_exact"
    root: ClassVar[Optional[str]] = "exact"
    quantity: ClassVar[str] = "diag"


@dataclass(frozen=True)
class DiagGGNMC(_MC):
    """Monte-Carlo estimate of the GGN diagonal (``mc_samples`` draws), ``p.shape``."""

    name: ClassVar[str] = "diag_ggn_mc"
    quantity: ClassVar[str] = "diag"


@dataclass(frozen=True)
class BatchDiagGGNExact(SecondOrder):
    """Per-sample terms of the exact GGN diagonal, ``[N, *p.shape]`` (sum = ``diag_ggn_exact``)."""

    name: ClassVar[str] = "diag_ggn_exact_batch"
    root: ClassVar[Optional[str]] = "exact"
    quantity: ClassVar[str] = "batch_diag"


@dataclass(frozen=True)
class BatchDiagGGNMC(_MC):
    """Per-sample terms of the MC GGN diagonal, ``[N, *p.shape]``."""

    name: ClassVar[str] = "diag_ggn_mc_batch"
    quantity: ClassVar[str] = "batch_diag"


@dataclass(frozen=True)
class DiagHessian(SecondOrder):
    """Exact diagonal of the Hessian of the loss, ``p.shape``."""

    name: ClassVar[str] = "diag_h"
    root: ClassVar[Optional[str]] = "exact"
    quantity: ClassVar[str] = "hessian_diag"


@dataclass(frozen=True)
class BatchDiagHessian(SecondOrder):
    """Per-sample terms of the Hessian diagonal, ``[N, *p.shape]`` (sum = ``diag_h``)."""

    name: ClassVar[str] = "diag_h_batch"
    root: ClassVar[Optional[str]] = "exact"
    quantity: ClassVar[str] = "hessian_batch_diag"


@dataclass(frozen=True)
class KFAC(_MC):
    """Kronecker factors from a Monte-Carlo root of the loss Hessian (Martens & Grosse);
    ``kfac_approx``: ``None`` (BackPACK's), ``"expand"`` or ``"reduce"`` (module doc)."""

    kfac_approx: Optional[str] = None
    name: ClassVar[str] = "kfac"
    quantity: ClassVar[str] = "kron"
    kron: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        _check_kfac_approx(type(self).__name__, self.kfac_approx)


@dataclass(frozen=True)
class KFLR(SecondOrder):
    """Kronecker factors from the exact root of the loss Hessian (Botev et al.);
    ``kfac_approx`` as for :class:`KFAC`."""

    kfac_approx: Optional[str] = None
    name: ClassVar[str] = "kflr"
    root: ClassVar[Optional[str]] = "exact"
    quantity: ClassVar[str] = "kron"
    kron: ClassVar[bool] = True

    def __post_init__(self):
        _check_kfac_approx(type(self).__name__, self.kfac_approx)


@dataclass(frozen=True)
class KFACEmpirical(SecondOrder):
    """Kronecker factors of the empirical Fisher ``Σ_n g_n g_nᵀ`` (``g_n`` the individual gradients).

    The backpropagated root is each sample's own loss gradient (one column), so
    ``B = Σ_n m_n m_nᵀ`` with ``m_n`` the gradient of sample ``n``'s term at the
    layer's output (positions sharing the weight summed, as in KFAC) and ``A`` as
    in KFAC. Like ``SumGradSquared``, it carries the square of the ``"mean"`` factor.
    Not in BackPACK; curvlinops calls it ``FisherType.EMPIRICAL``. ``kfac_approx`` as for
    :class:`KFAC`.
    """

    kfac_approx: Optional[str] = None
    name: ClassVar[str] = "kfac_empirical"
    root: ClassVar[Optional[str]] = "grad"
    quantity: ClassVar[str] = "kron"
    kron: ClassVar[bool] = True

    def __post_init__(self):
        _check_kfac_approx(type(self).__name__, self.kfac_approx)


@dataclass(frozen=True)
class KFRA(SecondOrder):
    """Kronecker factors from the batch-averaged GGN recursion (Botev et al.)."""

    name: ClassVar[str] = "kfra"
    quantity: ClassVar[str] = "kfra"
    kron: ClassVar[bool] = True


@dataclass(frozen=True)
class SqrtGGNExact(SecondOrder):
    """Exact per-sample GGN factor ``J_nᵀ S_n``, ``[C, N, *p.shape]``."""

    name: ClassVar[str] = "sqrt_ggn_exact"
    root: ClassVar[Optional[str]] = "exact"
    quantity: ClassVar[str] = "sqrt"


@dataclass(frozen=True)
class SqrtGGNMC(_MC):
    """Monte-Carlo per-sample GGN factor, ``[mc_samples, N, *p.shape]``."""

    name: ClassVar[str] = "sqrt_ggn_mc"
    quantity: ClassVar[str] = "sqrt"


@dataclass(frozen=True)
class GGNMP(SecondOrder):
    """Callable per parameter: ``[V, *p.shape] -> [V, *p.shape]``, GGN block times ``V``."""

    name: ClassVar[str] = "ggnmp"
    quantity: ClassVar[str] = "ggnmp"


@dataclass(frozen=True)
class HMP(SecondOrder):
    """Callable per parameter: Hessian block times ``V`` (exact, double backward)."""

    name: ClassVar[str] = "hmp"
    quantity: ClassVar[str] = "hmp"


@dataclass(frozen=True)
class PCHMP(SecondOrder):
    """Callable per parameter: positive-curvature Hessian block times ``V`` (Chen et al.).

    The residual term ``f''(x)·g`` of every element-wise activation (``g`` the
    gradient w.r.t. its output) is clipped at zero (``modify="clip"``) or
    replaced by its absolute value (``modify="abs"``).
    """

    modify: str = "clip"
    name: ClassVar[str] = "pchmp"
    quantity: ClassVar[str] = "pchmp"

    def __post_init__(self):
        if self.modify not in ("clip", "abs"):
            raise CurvatureError(
                f"PCHMP(modify={self.modify!r}) is not supported; use 'clip' or 'abs'."
            )
