"""Kronecker-factored extensions: ``KFAC``, ``KFLR``, ``KFACEmpirical``, ``KFRA``.

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
from typing import ClassVar, Optional, Tuple

from .._core.errors import CurvatureError
from ._base import KFRA_FAMILIES, KRON_FAMILIES, MonteCarlo, SecondOrder
from .combine import Combine


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
            "larger than it is diagonal) or None (dense factors, refused where they would not fit in memory)."
        )


@dataclass(frozen=True)
class KFAC(MonteCarlo):
    r"""Kronecker factors from sampled labels, KFAC (Martens & Grosse; BackPACK's ``KFAC``).

    Result key: ``"kfac"``, a dict parameter name -> list of factors.

    Per parameter, a list of factors whose Kronecker product in order
    approximates the parameter's block. ``Linear``/``Conv``/``ConvTranspose``
    weight ``[O, I, *k]``: ``[B [O, O], A [I·K, I·K]]`` (BackPACK's order,
    $B \otimes A \approx$ the block of the weight flattened row-major); bias ``[B]``.
    $A = \frac{1}{N} \sum_{n,s} x x^\top$ (unfolded inputs, positions $s$; no $c$),
    $B = \sum_{v,n} (\sum_s m)(\sum_s m)^\top$ over the backpropagated columns $m$ at
    the layer's output (carrying $c$). Grouped convolutions:
    ``[B [G, O/G, O/G], A [G, ., .]]``; ``Embedding [V, D]``: ``[A [V], B [D, D]]``
    (input side first, $A$ diagonal); norms and other 1-D parameters: their
    exact block ``[F [P, P]]``; the documentation's "Conventions" page defines each factor.

    $m$ are the $M$ sampled columns $s$ of the Monte-Carlo extensions, so
    $B \otimes A$ approximates the Fisher block.

    The exact loss-Hessian factor $S_n$ is replaced by $M$ columns
    $s = \sqrt{1/M}\, \nabla_f \ell(f_n, \hat y)$ at labels $\hat y$ drawn from the model's
    predictive distribution (CrossEntropy: categorical; MSE: Gaussian;
    BCEWithLogits: Bernoulli; other losses: Gaussian sketches $S_n \varepsilon / \sqrt{M}$),
    scaled like the loss, so that $\mathbb{E}[s s^\top]$ summed over the columns is
    $c \nabla^2 \ell_n$: an unbiased estimate of the exact quantity.

    Args:
        mc_samples: the number ``M`` of sampled labels per sample, an int ≥ 1.
        generator: the ``torch.Generator`` the labels are drawn from (None: torch's
            global random state); the same generator state gives the same result.
        kfac_approx: None (BackPACK's), ``"expand"`` or ``"reduce"``: Eschenhagen et al.'s
            approximations for weights shared by positions (curvlinops' definitions):
            ``"expand"`` $B = \sum_{v,n,s} m m^\top$, $A = \frac{1}{N S} \sum_{n,s} x x^\top$;
            ``"reduce"`` $B$ as None, $A = \frac{1}{N} \sum_n \bar x \bar x^\top$ ($\bar x$ the mean
            over the $S$ positions). Without shared positions all three coincide.
        max_factor_dim: an int ≥ 1, or None: a factor side larger than it gets a 1-D,
            diagonal factor (kfac-jax's choice), computed as $\sum_\text{rows} m^2$ (or $x^2$) without
            forming the dense one: the language-model head ``[V, D]`` gets ``[B [V], A [D, D]]``;
            a 1-D parameter's exact block ``[F [P, P]]`` becomes ``[F [P]]``. With None, a
            dense factor over 1 GiB is refused before any work.

    Raises:
        CurvatureError: ``mc_samples`` is not a positive int.
        CurvatureTypeError: ``generator`` is neither a ``torch.Generator`` nor None.
        CurvatureError: ``kfac_approx`` is not None, ``"expand"`` or ``"reduce"``;
            ``max_factor_dim`` is not a positive int or None. When called: a dense factor
            over 1 GiB without ``max_factor_dim``; ``max_factor_dim`` together with
            ``batch_chunk_size`` or ``process_group``.

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
    slices: ClassVar[Optional[Combine]] = Combine.KRON
    ranks: ClassVar[Optional[Combine]] = Combine.KRON
    layer_kinds: ClassVar[Optional[Tuple[str, ...]]] = KRON_FAMILIES
    kron: ClassVar[bool] = True
    ggn: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        _check_kfac_approx(type(self).__name__, self.kfac_approx)
        _check_max_factor_dim(type(self).__name__, self.max_factor_dim)


@dataclass(frozen=True)
class KFLR(SecondOrder):
    r"""Kronecker factors from the exact loss-Hessian factor, KFLR (Botev et al.; BackPACK's ``KFLR``).

    Result key: ``"kflr"``, a dict parameter name -> list of factors.

    Per parameter, a list of factors whose Kronecker product in order
    approximates the parameter's block. ``Linear``/``Conv``/``ConvTranspose``
    weight ``[O, I, *k]``: ``[B [O, O], A [I·K, I·K]]`` (BackPACK's order,
    $B \otimes A \approx$ the block of the weight flattened row-major); bias ``[B]``.
    $A = \frac{1}{N} \sum_{n,s} x x^\top$ (unfolded inputs, positions $s$; no $c$),
    $B = \sum_{v,n} (\sum_s m)(\sum_s m)^\top$ over the backpropagated columns $m$ at
    the layer's output (carrying $c$). Grouped convolutions:
    ``[B [G, O/G, O/G], A [G, ., .]]``; ``Embedding [V, D]``: ``[A [V], B [D, D]]``
    (input side first, $A$ diagonal); norms and other 1-D parameters: their
    exact block ``[F [P, P]]``; the documentation's "Conventions" page defines each factor.

    $m$ are the $C$ exact columns of $c \nabla^2 \ell_n$'s factor, so $B \otimes A$
    approximates the GGN block (exact for one sample and no shared positions).

    Args:
        kfac_approx: None (BackPACK's), ``"expand"`` or ``"reduce"``: Eschenhagen et al.'s
            approximations for weights shared by positions (curvlinops' definitions):
            ``"expand"`` $B = \sum_{v,n,s} m m^\top$, $A = \frac{1}{N S} \sum_{n,s} x x^\top$;
            ``"reduce"`` $B$ as None, $A = \frac{1}{N} \sum_n \bar x \bar x^\top$ ($\bar x$ the mean
            over the $S$ positions). Without shared positions all three coincide.
        max_factor_dim: an int ≥ 1, or None: a factor side larger than it gets a 1-D,
            diagonal factor (kfac-jax's choice), computed as $\sum_\text{rows} m^2$ (or $x^2$) without
            forming the dense one: the language-model head ``[V, D]`` gets ``[B [V], A [D, D]]``;
            a 1-D parameter's exact block ``[F [P, P]]`` becomes ``[F [P]]``. With None, a
            dense factor over 1 GiB is refused before any work.

    Raises:
        CurvatureError: ``kfac_approx`` is not None, ``"expand"`` or ``"reduce"``;
            ``max_factor_dim`` is not a positive int or None. When called: a dense factor
            over 1 GiB without ``max_factor_dim``; ``max_factor_dim`` together with
            ``batch_chunk_size`` or ``process_group``.

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
    slices: ClassVar[Optional[Combine]] = Combine.KRON
    ranks: ClassVar[Optional[Combine]] = Combine.KRON
    layer_kinds: ClassVar[Optional[Tuple[str, ...]]] = KRON_FAMILIES
    monte_carlo: ClassVar[str] = "KFAC"
    kron: ClassVar[bool] = True
    ggn: ClassVar[bool] = True

    def __post_init__(self):
        _check_kfac_approx(type(self).__name__, self.kfac_approx)
        _check_max_factor_dim(type(self).__name__, self.max_factor_dim)


@dataclass(frozen=True)
class KFACEmpirical(SecondOrder):
    r"""Kronecker factors of the empirical Fisher $\sum_n g_n g_n^\top$ (curvlinops' ``EMPIRICAL``; not in BackPACK).

    Result key: ``"kfac_empirical"``, a dict parameter name -> list of factors.

    Per parameter, a list of factors whose Kronecker product in order
    approximates the parameter's block. ``Linear``/``Conv``/``ConvTranspose``
    weight ``[O, I, *k]``: ``[B [O, O], A [I·K, I·K]]`` (BackPACK's order,
    $B \otimes A \approx$ the block of the weight flattened row-major); bias ``[B]``.
    $A = \frac{1}{N} \sum_{n,s} x x^\top$ (unfolded inputs, positions $s$; no $c$),
    $B = \sum_{v,n} (\sum_s m)(\sum_s m)^\top$ over the backpropagated columns $m$ at
    the layer's output (carrying $c$). Grouped convolutions:
    ``[B [G, O/G, O/G], A [G, ., .]]``; ``Embedding [V, D]``: ``[A [V], B [D, D]]``
    (input side first, $A$ diagonal); norms and other 1-D parameters: their
    exact block ``[F [P, P]]``; the documentation's "Conventions" page defines each factor.

    $m$ is one column per sample: the gradient of sample $n$'s own loss
    term at the layer's output, so $B$ carries $c^2$ like ``SumGradSquared``.

    Args:
        kfac_approx: None (BackPACK's), ``"expand"`` or ``"reduce"``: Eschenhagen et al.'s
            approximations for weights shared by positions (curvlinops' definitions):
            ``"expand"`` $B = \sum_{v,n,s} m m^\top$, $A = \frac{1}{N S} \sum_{n,s} x x^\top$;
            ``"reduce"`` $B$ as None, $A = \frac{1}{N} \sum_n \bar x \bar x^\top$ ($\bar x$ the mean
            over the $S$ positions). Without shared positions all three coincide.
        max_factor_dim: an int ≥ 1, or None: a factor side larger than it gets a 1-D,
            diagonal factor (kfac-jax's choice), computed as $\sum_\text{rows} m^2$ (or $x^2$) without
            forming the dense one: the language-model head ``[V, D]`` gets ``[B [V], A [D, D]]``;
            a 1-D parameter's exact block ``[F [P, P]]`` becomes ``[F [P]]``. With None, a
            dense factor over 1 GiB is refused before any work.

    Raises:
        CurvatureError: ``kfac_approx`` is not None, ``"expand"`` or ``"reduce"``;
            ``max_factor_dim`` is not a positive int or None. When called: a dense factor
            over 1 GiB without ``max_factor_dim``; ``max_factor_dim`` together with
            ``batch_chunk_size`` or ``process_group``.

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
    slices: ClassVar[Optional[Combine]] = Combine.KRON_SQUARED
    ranks: ClassVar[Optional[Combine]] = Combine.KRON_SQUARED
    layer_kinds: ClassVar[Optional[Tuple[str, ...]]] = KRON_FAMILIES
    kron: ClassVar[bool] = True

    def __post_init__(self):
        _check_kfac_approx(type(self).__name__, self.kfac_approx)
        _check_max_factor_dim(type(self).__name__, self.max_factor_dim)


@dataclass(frozen=True)
class KFRA(SecondOrder):
    r"""Kronecker factors from the batch-averaged GGN recursion, KFRA (Botev et al.; BackPACK's ``KFRA``).

    Result key: ``"kfra"``, a dict parameter name -> list of factors.

    Layout as ``KFLR``: weight ``[B [O, O], A [I·K, I·K]]``, bias ``[B]``, with
    ``A`` as KFLR's and ``B`` propagated backwards layer by layer as a
    batch-averaged ``[O, O]`` matrix ($\bar G_\text{in} = \operatorname{avg}_n(J_n^\top \bar G_\text{out} J_n)$ plus the
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
    slices_refused: ClassVar[str] = ("its recursion multiplies batch averages layer by layer, so it does not split "
                                      "into slices of the batch")
    ranks: ClassVar[Optional[Combine]] = Combine.KRON_WHOLE_ROOT
    compiles: ClassVar[bool] = False
    layer_kinds: ClassVar[Optional[Tuple[str, ...]]] = KFRA_FAMILIES
    kron: ClassVar[bool] = True
    recursion: ClassVar[bool] = True
    ggn: ClassVar[bool] = True
