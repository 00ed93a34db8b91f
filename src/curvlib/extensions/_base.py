"""Extensions are small frozen records: a result name and what they need.

An extension holds no state and no code that walks the model; the engine
computes the per-site pieces an extension needs and the extension's class
says how they are laid out. Which extension supports which layer family is a
table checked before any work (second-order extensions).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._core.errors import CurvatureError, CurvatureTypeError
from ..rules import FamilyKinds
from .combine import Combine


# Layer families an extension supports, where not all:
#: KFRA's recursion reads factors off the families with factors from the batch-averaged output
#: matrix (``Family.kron_from_output_matrix``: Linear/Conv/ConvTranspose, weight ``[G_z, A]``, bias ``[G_z]``).
KFRA_FAMILIES = FamilyKinds(lambda f: f.kron_from_output_matrix is not None)
#: KFAC, KFLR, KFACEmpirical (layouts: curvlib._core.kronlayout): every family. Kronecker factors for
#: Linear/Conv/ConvTranspose/Embedding weights and the recurrent layers' (Linear sites, time steps
#: as positions: curvlib.rules.rnn), the exact block for the normalisations' scale and shift and
#: for 1-D parameters of other modules, a diagonal block for the rest (curvlib.rules.fixed_rows).
KRON_FAMILIES = FamilyKinds(lambda f: True)
#: The Hessian extensions: every family (the recurrent ones through their unrolled nodes,
#: curvlib.rules.rnn_steps; the generic one through its dense residual).
HESSIAN_FAMILIES = FamilyKinds(lambda f: True)


@dataclass(frozen=True)
class Options:
    """The options the stages read of an extension: its own fields of these names, the
    defaults for the others (:attr:`Extension.options`)."""

    kfac_approx: Optional[str] = None
    max_factor_dim: Optional[int] = None
    mc_samples: int = 1
    generator: Optional[torch.Generator] = None
    modify: str = "clip"


_OPTIONS = tuple(f.name for f in dataclasses.fields(Options))


@dataclass(frozen=True)
class Extension:
    """Base class of every curvlib extension: a frozen record of a result's name and its options.

    ``curvature(model, lossfn, extensions)`` takes instances of the classes of
    ``curvlib.extensions``; an extension holds no state and no code that walks the model. Its
    class attribute ``name`` is the key of its result in the dict ``curvature`` returns
    (BackPACK's attribute name); its constructor's arguments are its options. The other class
    attributes describe the extension to curvlib's engine and may change.

    Examples::

        >>> from curvlib.extensions import KFAC, BatchGrad, Extension
        >>> isinstance(BatchGrad(), Extension), BatchGrad.name, KFAC.name
        (True, 'grad_batch', 'kfac')
        >>> KFAC(mc_samples=2).mc_samples                 # the options are fields
        2
    """

    # What the stages ask of an extension (class attributes; the engine's, not the user's):
    # name: key of the extension's result in the dict returned by
    #     ``curvlib.curvature`` (BackPACK's attribute name).
    # order: 1 for first-order extensions (they need only the gradient
    #     backpropagated once), 2 for curvature extensions.
    # quantity: what the evaluation stage reads off (first order: the result's name;
    #     second order: see :class:`SecondOrder`).
    # slices: how the results of batch slices combine under ``batch_chunk_size``
    #     (:class:`curvlib.extensions.combine.Combine`); ``None``: refused, for the
    #     reason ``slices_refused``.
    # ranks: how the ranks' local results combine under ``process_group`` (a
    #     :class:`~curvlib.extensions.combine.Combine`); ``None``: refused, for the reason
    #     ``ranks_refused``.
    # needs: extensions whose results it is formed from (:meth:`formed`, after they are read
    #     and again once slices or ranks have combined them, ``Combine.FORMED``); they are
    #     computed with it and dropped from the results unless asked for.
    # compiles: ``curvature(..., compile=True)`` computes it.
    # function_needs: what a custom ``torch.autograd.Function`` in the model must define
    #     for it: ``"setup_context"``, ``"vmap"`` (a rule), ``"jvp"`` (forward mode),
    #     ``"twice"`` (a backward that is not ``@once_differentiable``).
    # layer_kinds: the layer families (:data:`curvlib.rules.FAMILY_OF`) it supports;
    #     ``None``: every family.
    # independent_samples: it needs samples that do not mix inside the model.
    # root: ``"exact"`` or ``"mc"``: which factor of the loss Hessian is
    #     backpropagated; ``"grad"``: the per-sample loss gradients (empirical
    #     Fisher); ``None`` for extensions that need none (every first-order one).
    # hessian: it needs the nonlinearities' second derivatives (residual terms), which it
    #     reads of the loss's backward.
    # per_sample: its result has one row per sample.
    # ggn: it is made of the loss Hessian alone (the GGN and its Kronecker, square-root,
    #     sampled and product forms): exactly 0 for a loss linear in the model output.

    name: ClassVar[str] = ""
    order: ClassVar[int] = 1
    quantity: ClassVar[str] = ""
    slices: ClassVar[Optional[Combine]] = None
    slices_refused: ClassVar[str] = ""
    ranks: ClassVar[Optional[Combine]] = None
    ranks_refused: ClassVar[str] = ""
    needs: ClassVar[Tuple[type, ...]] = ()
    compiles: ClassVar[bool] = True
    function_needs: ClassVar[Tuple[str, ...]] = ()
    layer_kinds: ClassVar[Optional[Tuple[str, ...]]] = None
    independent_samples: ClassVar[bool] = True
    root: ClassVar[Optional[str]] = None
    hessian: ClassVar[bool] = False
    per_sample: ClassVar[bool] = False
    ggn: ClassVar[bool] = False

    @functools.cached_property
    def options(self) -> Options:
        """Its options as one typed record (the one place the stages read them; made once per
        extension, as the fields are frozen: the column loops read it per chunk)."""
        return Options(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in _OPTIONS})

    def from_individual(self, batch: Tensor) -> Tensor:
        """A first-order quantity of one parameter from its individual gradients
        ``batch [N, *p]`` (rules may give some directly, :mod:`curvlib._evaluate.first_order`)."""
        raise NotImplementedError(f"{type(self).__name__} is not read off the individual gradients.")

    def shortcut(self, rule) -> Optional[Callable]:
        """The rule's function that gives the first-order quantity directly,
        ``(site, g, roles) -> {role: tensor}`` (``None``: read off the individual gradients)."""
        return None

    def shortcut_with_grad(self, rule) -> Optional[Callable]:
        """The rule's function that gives ``(grad, quantity)`` in one pass, or ``None``."""
        return None

    def formed(self, grad: Tensor, needed: Sequence[Tensor], batch_size: int, overwrite: bool = False) -> Tensor:
        """The quantity of one parameter from its gradient and its ``needs``' results, in their
        order. ``overwrite``: those results are not returned, so they may be written over where
        nothing differentiates through them."""
        raise NotImplementedError(f"{type(self).__name__} is not formed from other quantities.")


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
    """Base of the curvature (second-order) extensions: all but the first-order ``BatchGrad``,
    ``BatchL2Grad``, ``SumGradSquared`` and ``Variance``.

    Each backpropagates a factor of the loss Hessian (or, for the products and the Hessian
    diagonals, the loss's second derivatives) through the model; ``order`` is 2.

    Examples::

        >>> from curvlib.extensions import DiagGGNExact, SecondOrder, SumGradSquared
        >>> isinstance(DiagGGNExact(), SecondOrder), isinstance(SumGradSquared(), SecondOrder)
        (True, False)
        >>> DiagGGNExact.order, SumGradSquared.order
        (2, 1)
    """

    # What the stages ask of a curvature extension besides Extension's:
    # quantity: what is read off per parameter: ``"diag"``, ``"batch_diag"``,
    #     ``"sqrt"``, ``"kron"``, ``"hessian_diag"``, ``"hessian_batch_diag"``,
    #     ``"kfra"``, or a product ``"ggnmp"``/``"hmp"``/``"pchmp"``.
    # kron: True for Kronecker-factored extensions (layouts: ``curvlib._core.kronlayout`` and docs/conventions.md).
    # read_as: how the quantity is read off when not as itself (the Hessian diagonals:
    #     as the GGN's diagonals, from signed columns).
    # residuals_per_node: it transforms each graph node's residual on its own (PCHMP's
    #     eigenvalue modification), so its result depends on how the forward is cut into
    #     nodes: element-wise subgraphs stay node by node (the other Hessian extensions
    #     record one residual per element-wise region, :mod:`curvlib._hessian.pointwise`).
    # recursion: it is read off the batch-averaged GGN recursion (KFRA): a chain graph,
    #     the forward's node values kept, a closure of its own.
    # many_columns: its columns are pulled back many at once (the Hessian's residual
    #     columns, square roots), so the forward writes LayerNorm from primitives
    #     (:func:`curvlib.rules.layernorm.from_primitives`).
    # monte_carlo: the Monte-Carlo extension that gives the same quantity from sampled
    #     columns (named by refusals of the exact one's memory).

    order: ClassVar[int] = 2
    kron: ClassVar[bool] = False
    read_as: ClassVar[str] = ""
    residuals_per_node: ClassVar[bool] = False
    recursion: ClassVar[bool] = False
    many_columns: ClassVar[bool] = False
    monte_carlo: ClassVar[str] = ""


@dataclass(frozen=True)
class MonteCarlo(SecondOrder):
    """Base of the Monte-Carlo extensions: ``mc_samples`` sampled columns of the loss-Hessian
    factor per sample, drawn from ``generator`` (the global one when ``None``)."""

    mc_samples: int = 1
    generator: Optional[torch.Generator] = None
    root: ClassVar[Optional[str]] = "mc"

    def __post_init__(self):
        _check_mc(type(self).__name__, self.mc_samples, self.generator)
