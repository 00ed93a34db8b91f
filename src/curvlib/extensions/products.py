"""Block curvature-matrix products: ``GGNMP``, ``HMP``, ``PCHMP`` (callables ``[V, *p] -> [V, *p]``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

from .._core.errors import CurvatureError
from ._base import HESSIAN_FAMILIES, SecondOrder
from .combine import Combine

__all__ = ["BlockProduct", "GGNMP", "HMP", "PCHMP"]


@dataclass(frozen=True)
class BlockProduct(SecondOrder):
    """Base of the block products: callables evaluated later, so neither batch slices nor ranks
    combine them, and they are not compiled."""

    slices: ClassVar[Optional[Combine]] = None
    slices_refused: ClassVar[str] = ("block products are callables that would keep every slice's forward pass "
                                     "alive, so slicing would not save memory")
    ranks: ClassVar[Optional[Combine]] = None
    ranks_refused: ClassVar[str] = (
        "block products are callables evaluated later, each would be a collective of its "
        "own. Build them without process_group and sum r · (local product) over the ranks "
        "yourself, with r = M_local / M_global for reduction='mean' (1 for 'sum')."
    )
    compiles: ClassVar[bool] = False


@dataclass(frozen=True)
class GGNMP(BlockProduct):
    r"""GGN block times vectors, as a callable (BackPACK's ``GGNMP``).

    Result key: ``"ggnmp"``, a dict parameter name -> callable
    ``V [K, *p.shape] -> [K, *p.shape]``.

    The callable multiplies ``K`` vectors by ``G_pp``, the block of $G = \sum_n J_n^\top (c \nabla_f^2 \ell_n) J_n$ (``J_n`` the
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
    function_needs: ClassVar[Tuple[str, ...]] = ("setup_context", "vmap", "jvp")
    independent_samples: ClassVar[bool] = False
    ggn: ClassVar[bool] = True


@dataclass(frozen=True)
class HMP(BlockProduct):
    r"""Hessian block times vectors, as a callable (BackPACK's ``HMP``).

    Result key: ``"hmp"``, a dict parameter name -> callable
    ``V [K, *p.shape] -> [K, *p.shape]``.

    The callable multiplies ``K`` vectors by $\nabla_{pp}^2 L$, the exact block of
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
    function_needs: ClassVar[Tuple[str, ...]] = ("setup_context", "vmap", "twice")
    independent_samples: ClassVar[bool] = False


@dataclass(frozen=True)
class PCHMP(BlockProduct):
    r"""Positive-curvature Hessian block times vectors (Chen et al.; BackPACK's ``PCHMP``).

    Result key: ``"pchmp"``, a dict parameter name -> callable
    ``V [K, *p.shape] -> [K, *p.shape]``.

    The Hessian block with every node's residual $R = \nabla_u^2 (g \cdot \varphi(u))$
    (``g`` the loss gradient at the node's output) made positive
    semi-definite: for an element-wise activation $R = \operatorname{diag}(\varphi''(u)\, g)$ becomes
    ``max(R, 0)`` (``modify="clip"``, default) or ``|R|`` (``modify="abs"``);
    other nodes and the loss Hessian have their eigenvalues modified alike.
    BackPACK 1.7.1 multiplies by ``g`` twice ($\operatorname{mod}(\varphi''(u)\, g\, g)$); curvlib
    follows the definition.

    Args:
        modify: how a residual is made positive semi-definite: ``"clip"`` its
            negative eigenvalues to 0, or ``"abs"`` their absolute values.

    Raises:
        CurvatureError: ``modify`` is neither ``"clip"`` nor ``"abs"``.

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
    hessian: ClassVar[bool] = True
    residuals_per_node: ClassVar[bool] = True
    function_needs: ClassVar[Tuple[str, ...]] = ("setup_context", "vmap", "jvp", "twice")
    layer_kinds: ClassVar[Optional[Tuple[str, ...]]] = HESSIAN_FAMILIES

    def __post_init__(self):
        if self.modify not in ("clip", "abs"):
            raise CurvatureError(
                f"PCHMP(modify={self.modify!r}) is not supported; use 'clip' or 'abs'."
            )
