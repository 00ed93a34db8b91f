"""Losses: which are understood structurally, targets, the ``"mean"`` normaliser, curvature.

Every loss curvlib accepts is a *per-sample loss*: ``L = c · Σ_n ℓ_n(f_n, y_n)``,
a sum or mean over samples of terms that each depend on one sample's output.
Because of that, row ``n`` of ``∂L/∂f`` is the gradient of sample ``n``'s own
term (the factor ``c`` included), which is what makes BackPACK's convention
hold: individual gradients carry ``c`` and sum to the gradient; and the
Hessian w.r.t. the output is block diagonal over samples.

Two kinds:

* **structural** (the fast path): instances of
  ``nn.MSELoss``, ``nn.CrossEntropyLoss`` (class indices with ``ignore_index``,
  or class probabilities; ``weight``, ``label_smoothing``) and
  ``nn.BCEWithLogitsLoss`` (``weight``, ``pos_weight``) whose ``forward`` is
  PyTorch's own, with ``reduction="mean"`` or ``"sum"``: closed-form Hessian
  roots (BackPACK's) and label sampling;
* **generic**: any other loss module or
  function called as ``lossfn(output, y)`` (a subclass that overrides
  ``forward``, e.g. a focal loss; ``nn.NLLLoss``, ``nn.HuberLoss``,
  ``nn.SmoothL1Loss``, ``nn.KLDivLoss``, ``nn.BCELoss``, ...): exact per-sample
  Hessian blocks from autodiff, symmetric roots by ``eigh``, Gaussian
  Monte-Carlo roots. Its normalisation is whatever the function does.

The reduction factor of a structural loss is ``c = 1`` for ``"sum"`` and
``c = 1 / normaliser`` for ``"mean"``, as PyTorch defines it:

* MSE and BCE: ``y.numel()`` (every output entry is a term);
* CE with class indices: ``Σ w[y]`` over the entries not equal to
  ``ignore_index`` (their count without ``weight``);
* CE with class probabilities ``[N, K, *D]``: ``N · prod(D)``.

This module is the only place that knows ``c``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Union

import torch
from torch import Tensor, nn

from .._core.tensors import is_concrete
from .._core.errors import CurvatureError, CurvatureTypeError
from ._generic import GenericCurvature, check_per_sample
from . import _targets
from ._structural import StructuralCurvature
from .._core.strategy import batched

__all__ = [
    "LossSpec", "loss_spec", "check_targets", "loss_value", "normaliser", "reduction_factor",
    "curvature_at", "sqrt_hessian", "sqrt_hessian_sampled", "hessian_matvec",
]

STRUCTURAL = {nn.MSELoss: "mse", nn.CrossEntropyLoss: "ce", nn.BCEWithLogitsLoss: "bce"}


@dataclass(frozen=True)
class LossSpec:
    """What curvlib knows of a loss (options are read from ``module`` when used).

    Attributes:
        kind: ``"mse"``, ``"ce"``, ``"bce"`` (structural) or ``"generic"``.
        reduction: ``"mean"`` or ``"sum"`` for structural losses; ``None`` for generic ones.
        module: the user's loss module or function; called, never changed.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import losses
        >>> spec = losses.loss_spec(nn.MSELoss(reduction="sum"))
        >>> spec.kind, spec.reduction, spec.name
        ('mse', 'sum', 'MSELoss')
    """

    kind: Literal["mse", "ce", "bce", "generic"]
    reduction: Optional[Literal["mean", "sum"]]
    module: Union[nn.Module, Callable]

    @property
    def structural(self) -> bool:
        """Whether curvlib knows the loss's form (MSE, cross-entropy, BCE), with closed-form Hessian
        roots and a known normaliser; otherwise the loss is a generic callable, differentiated as it is."""
        return self.kind in STRUCTURAL.values()

    @property
    def splits_by_sample(self) -> bool:
        """Whether the loss of a slice of the samples, ``lossfn(out[s], y[s])``, is its share of the
        whole loss scaled by its own normaliser (MSE, cross-entropy: their options act per class or
        not at all; BCE's ``weight`` may be per sample)."""
        return self.kind in ("mse", "ce")

    @property
    def name(self) -> str:
        m = self.module
        return type(m).__name__ if isinstance(m, nn.Module) else getattr(m, "__name__", repr(m))


def loss_spec(lossfn: object) -> LossSpec:
    """Check ``lossfn`` and describe it (structural or generic, see the module doc).

    Args:
        lossfn: a loss module (``nn.CrossEntropyLoss``, ``nn.MSELoss``, ``nn.BCEWithLogitsLoss``
            or any other) or a function ``lossfn(output, y)`` returning a scalar.

    Returns:
        LossSpec: its kind (structural or generic), reduction and the loss itself.

    Raises:
        CurvatureTypeError: ``lossfn`` is not callable as ``lossfn(output, y)``.
        CurvatureError: it has ``reduction="none"`` (curvlib needs a scalar loss).

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import losses
        >>> losses.loss_spec(nn.CrossEntropyLoss()).kind
        'ce'
        >>> losses.loss_spec(nn.HuberLoss()).kind                 # any other per-sample loss
        'generic'
        >>> from curvlib import CurvatureError
        >>> try:
        ...     losses.loss_spec(nn.MSELoss(reduction="none"))
        ... except CurvatureError as err:
        ...     print(err)
        MSELoss(reduction='none') is not supported: curvlib needs a scalar loss that sums or averages per-sample terms. Use reduction='sum' (or 'mean'); individual terms are what BatchGrad and the batch diagonals return.
    """
    if not callable(lossfn) or isinstance(lossfn, type):
        raise CurvatureTypeError(
            f"lossfn must be a loss module instance or a function lossfn(output, y) returning "
            f"a scalar, got {lossfn!r} of type {type(lossfn).__name__}."
        )
    name = type(lossfn).__name__
    reduction = getattr(lossfn, "reduction", None) if isinstance(lossfn, nn.Module) else None
    kind = next((k for cls, k in STRUCTURAL.items()
                 if isinstance(lossfn, cls) and type(lossfn).forward is cls.forward), "generic")
    # "batchmean" (KLDivLoss: the sum over a sample's entries, averaged over samples) is a
    # per-sample mean too; only the structural losses need to know their normaliser.
    accepted = ("mean", "sum", "batchmean") if kind == "generic" else ("mean", "sum")
    if reduction is not None and reduction not in accepted:
        raise CurvatureError(
            f"{name}(reduction={reduction!r}) is not supported: curvlib needs a scalar loss "
            "that sums or averages per-sample terms. Use reduction='sum' (or 'mean'); "
            "individual terms are what BatchGrad and the batch diagonals return."
        )
    _check_arity(lossfn, name)
    return LossSpec(kind=kind, reduction=None if kind == "generic" else reduction, module=lossfn)


def _check_arity(lossfn, name: str) -> None:
    """Refuse a loss whose ``forward`` needs more than ``(output, y)`` (e.g. ``GaussianNLLLoss``)."""
    fn = lossfn.forward if isinstance(lossfn, nn.Module) else lossfn
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    required = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) > 2:
        raise CurvatureError(
            f"lossfn {name} needs {len(required)} arguments ({', '.join(required)}); curvlib calls "
            "lossfn(output, y). Wrap it in a function of (output, y), e.g. for GaussianNLLLoss: "
            "lambda out, y: gnll(out[:, :1], y, out[:, 1:].exp()) with a model that outputs mean "
            "and log-variance."
        )




def check_targets(spec: LossSpec, out: Tensor, y: object, signs: bool = False) -> Optional[bool]:
    """Refuse targets that do not fit the model output for this loss (before any work).

    Args:
        spec: the loss.
        out: model output ``[N, *]`` (a meta tensor is enough).
        y: targets, batch in dim 0.
        signs: also read whether the loss Hessian's scale has a negative entry (a structural
            loss whose options allow one, as a negative ``weight``), in the same host
            read as cross-entropy's class-index range (one sync on a GPU), and return it.

    Returns:
        With ``signs``, that flag for ``curvature_at`` (``None`` where not read); else ``None``.

    Raises:
        CurvatureTypeError: ``y`` is not a tensor or has the wrong dtype.
        CurvatureError: shapes do not match, or a class index is out of range.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import losses
        >>> spec = losses.loss_spec(nn.MSELoss())
        >>> losses.check_targets(spec, torch.zeros(4, 3), torch.zeros(4, 3))     # fine: returns None
        >>> from curvlib import CurvatureError
        >>> try:
        ...     losses.check_targets(spec, torch.zeros(4, 3), torch.zeros(4, 2))
        ... except CurvatureError as err:
        ...     print(err)
        MSELoss: y has shape (4, 2), but the model output has shape (4, 3); they must be equal.
    """
    if not isinstance(y, Tensor):
        raise CurvatureTypeError(f"y must be a torch.Tensor, got {type(y).__name__}.")
    if out.dim() == 0:
        raise CurvatureError("The model output is a scalar; it needs the batch in dim 0.")
    if not spec.structural:
        return None  # the function itself decides what it accepts
    if spec.kind == "ce":
        return _targets.check_cross_entropy_targets(spec.module, out, y, _targets.scale_sign(spec, out, y, reduction_factor) if signs else None)
    name = spec.name
    if not y.is_floating_point():
        raise CurvatureTypeError(f"{name} needs floating-point targets y, got dtype {y.dtype}.")
    if tuple(y.shape) != tuple(out.shape):
        raise CurvatureError(
            f"{name}: y has shape {tuple(y.shape)}, but the model output has shape "
            f"{tuple(out.shape)}; they must be equal."
        )
    if y.dtype != out.dtype:
        raise CurvatureTypeError(
            f"{name}: y has dtype {y.dtype} but the model output has dtype {out.dtype}; they must be equal."
        )
    negative = _targets.scale_sign(spec, out, y, reduction_factor) if signs else None
    return None if negative is None else bool(negative)


def loss_value(spec: LossSpec, out: Tensor, y: Tensor) -> Tensor:
    """``lossfn(out, y)``, by the user's own loss (a module's ``forward``: its hooks are not run).

    Args:
        spec: the loss, as ``loss_spec`` describes it.
        out: the model output ``[N, *out]`` (logits for CE and BCE).
        y: the targets (class indices ``[N, ...]`` or probabilities for CE; ``out``'s shape for MSE and BCE).

    Returns:
        Tensor: the scalar loss, as ``spec.module(out, y)`` computes it.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import losses
        >>> spec = losses.loss_spec(nn.MSELoss())
        >>> out, y = torch.ones(2, 3), torch.zeros(2, 3)
        >>> losses.loss_value(spec, out, y)
        tensor(1.)
    """
    m = spec.module
    return m.forward(out, y) if isinstance(m, nn.Module) else m(out, y)


def normaliser(spec: LossSpec, y: Tensor, out_shape=None) -> Optional[float]:
    """``M`` with ``c = 1/M`` for ``"mean"`` (module doc), 1 for ``"sum"``, ``None`` if unknown (generic).

    Args:
        spec: the loss, as ``loss_spec`` describes it.
        y: the targets (class indices ``[N, ...]`` or probabilities for CE; ``out``'s shape for MSE and BCE).
        out_shape: the output's shape, for a generic loss's reading (optional).

    Returns:
        float or None: ``M``, the number of terms a ``"mean"`` averages over; 1.0 for ``"sum"``;
        None for a generic loss.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import losses
        >>> ce = losses.loss_spec(nn.CrossEntropyLoss(ignore_index=-1))
        >>> losses.normaliser(ce, torch.tensor([0, 2, -1, 1]))      # three counted targets
        3.0
        >>> losses.normaliser(losses.loss_spec(nn.MSELoss()), torch.zeros(4, 3))   # every entry
        12.0
    """
    if not spec.structural:
        return None
    if spec.reduction == "sum":
        return 1.0
    if spec.kind != "ce":
        return float(y.numel())
    if y.is_floating_point():  # probabilities [N, K, *D]
        return float(y.numel() // y.shape[1]) if y.dim() > 1 else float(y.numel())
    return float(_counted_weight(spec.module, y))


def _counted_weight(m: nn.Module, y: Tensor) -> Tensor:
    """A cross-entropy ``"mean"``'s denominator for class indices ``y``: the weight of every
    target not ``ignore_index`` (class weights ``w[y_n]`` if ``m.weight`` is set, else 1 each),
    summed; a 0-dim tensor (float64 when counted)."""
    counted = y != m.ignore_index
    if m.weight is None:
        return counted.sum().to(torch.float64)
    return (m.weight[torch.where(counted, y, torch.zeros_like(y))] * counted).sum()


def reduction_factor(spec: LossSpec, y: Tensor):
    """``c``: ``1/normaliser``. When nothing is counted (every target ignored) PyTorch's
    ``"mean"`` loss is 0/0 = NaN, but its gradient and ``torch.func.hessian`` are zero:
    every term is zero, and so is the curvature (``c = 0``). Cross-entropy's class
    indices whose values cannot be read (traced for ``compile=True``, batched) give a
    0-dim tensor ``c`` instead of a float; so do concrete ones under the ``"batched"``
    strategy (``curvlib.strategy``, the CUDA default), where reading the count
    would stall a GPU's launch queue (a host sync) in the middle of the call.

    Args:
        spec: the loss, as ``loss_spec`` describes it.
        y: the targets (class indices ``[N, ...]`` or probabilities for CE; ``out``'s shape for MSE and BCE).

    Returns:
        float or Tensor: ``c = 1/M`` (0 when nothing is counted); a 0-dim tensor where ``y``'s
        values cannot be read as Python numbers (under ``torch.func`` transforms).

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import losses
        >>> losses.reduction_factor(losses.loss_spec(nn.MSELoss()), torch.zeros(4, 3))
        0.08333333333333333
        >>> losses.reduction_factor(losses.loss_spec(nn.MSELoss(reduction="sum")), torch.zeros(4, 3))
        1.0
    """
    if spec.kind == "ce" and spec.reduction == "mean" and not y.is_floating_point() \
            and (not is_concrete(y) or batched(y.device)):
        total = _counted_weight(spec.module, y)
        return torch.where(total != 0, 1 / total, torch.zeros_like(total))
    m = normaliser(spec, y)
    return 1.0 / m if m else 0.0


def curvature_at(spec: LossSpec, out: Tensor, y: Tensor, check: bool = True, negative: Optional[bool] = None):
    """The loss Hessian at ``(out, y)``: an object with ``roots()``, ``sampled_roots(M, gen)``,
    ``matvec(mat)``, ``modified_matvec(mat, modify)``, ``signed`` and ``most_negative()``.

    Args:
        spec: the loss, as ``loss_spec`` describes it.
        out: the model output ``[N, *out]`` (logits for CE and BCE).
        y: the targets (class indices ``[N, ...]`` or probabilities for CE; ``out``'s shape for MSE and BCE).
        check: for a generic loss, refuse one that couples samples (where values are readable).
        negative: whether the scale has a negative entry, when ``check_targets`` read it (None: unknown).

    Returns:
        The loss Hessian at ``(out, y)``: an object with ``roots()`` (``[(sign, S [C, N, *out])]``),
        ``sampled_roots(M, gen)``, ``matvec(mat)``, ``modified_matvec(mat, modify)``, ``signed`` and
        ``most_negative()``.

    Raises:
        CurvatureError: a generic loss that couples samples (with ``check``).

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import losses
        >>> spec = losses.loss_spec(nn.CrossEntropyLoss())
        >>> out, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
        >>> hess = losses.curvature_at(spec, out, y)
        >>> [(sign, S.shape) for sign, S in hess.roots()]          # one positive root [C, N, C]
        [(1.0, torch.Size([3, 4, 3]))]
    """
    if not spec.structural:
        loss_of = lambda o: loss_value(spec, o, y)  # noqa: E731
        if check and is_concrete(out):
            check_per_sample(loss_of, out, spec.name)
        return GenericCurvature(loss_of, out, spec.name)
    return StructuralCurvature(spec, out, y, reduction_factor(spec, y), negative)


# -- the single-root helpers the rest of curvlib and the tests use -------------------


def sqrt_hessian(spec: LossSpec, out: Tensor, y: Tensor) -> Tensor:
    r"""Exact symmetric factor ``S [C, N, *out.shape[1:]]`` of the loss Hessian w.r.t. the
    output, $\sum_v S[v, n] S[v, n]^\top = c\, \nabla^2 \ell(\mathrm{out}[n], y[n])$ for every sample ``n``.

    Columns are indexed by the flattened per-sample output entry, BackPACK's order:

    * MSE: $\nabla^2 \ell = 2 I$, $S = \sqrt{2c}\, I$.
    * BCE: $\nabla^2 \ell = \operatorname{diag}(\sigma(f)(1 - \sigma(f)))$, $S = \sqrt{c}\, \operatorname{diag}\big(\sqrt{\sigma (1 - \sigma)}\big)$.
    * CE (per sample and position): $\nabla^2 \ell = \operatorname{diag}(p) - p p^\top$, ``p = softmax(f)``;
      column ``c'`` of the root is $\sqrt{p_{c'}}\, (e_{c'} - p)$, non-zero only at its own position.

    (The loss's options, as ``weight`` or ``pos_weight``, scale each term.)

    Args:
        spec: the loss, as ``loss_spec`` describes it.
        out: the model output ``[N, *out]`` (logits for CE and BCE).
        y: the targets (class indices ``[N, ...]`` or probabilities for CE; ``out``'s shape for MSE and BCE).

    Returns:
        Tensor: ``S [C, N, *out.shape[1:]]`` with $\sum_v S_v S_v^\top = c \nabla^2 \ell$ per sample (``C`` the
        entries of one sample's output).

    Raises:
        CurvatureError: the loss Hessian is indefinite (use ``curvature_at`` for signed roots).

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import losses
        >>> spec = losses.loss_spec(nn.MSELoss(reduction="sum"))
        >>> S = losses.sqrt_hessian(spec, torch.zeros(2, 3), torch.zeros(2, 3))   # [C, N, C]
        >>> torch.allclose(torch.einsum("vna,vnb->nab", S, S), 2 * torch.eye(3).expand(2, 3, 3))
        True
    """
    return _single(curvature_at(spec, out, y, check=False).roots(), spec)


def sqrt_hessian_sampled(spec: LossSpec, out: Tensor, y: Tensor, mc_samples: int,
                         generator: Optional[torch.Generator] = None) -> Tensor:
    r"""Monte-Carlo factor ``[M, N, *out.shape[1:]]``, $\mathbb{E}[\sum_m s_m s_m^\top] = c\, \nabla^2 \ell$.

    Column ``m`` is $\sqrt{c/M}\, \nabla_f \ell(f, \hat y_m)$ with ``ŷ_m`` drawn from the
    model's predictive distribution (the Fisher equals the Hessian for these losses):

    * MSE: $\ell = \lVert f - y \rVert^2$ is ``−log N(y; f, ½I)`` up to a constant;
      $\nabla \ell = 2(f - \hat y) = \sqrt{2}\, \varepsilon$, ``ε ~ N(0, I)``.
    * BCE: $\hat y \sim \mathrm{Bernoulli}(\sigma(f))$, $\nabla \ell = \sigma(f) - \hat y$.
    * CE: ``ŷ ~ Categorical(softmax(f))`` per sample and position, $\nabla \ell = p - \operatorname{onehot}(\hat y)$.

    The same ``generator`` state gives the same result.

    Args:
        spec: the loss, as ``loss_spec`` describes it.
        out: the model output ``[N, *out]`` (logits for CE and BCE).
        y: the targets (class indices ``[N, ...]`` or probabilities for CE; ``out``'s shape for MSE and BCE).
        mc_samples: the number ``M`` of sampled targets per sample, an int ≥ 1.
        generator: the ``torch.Generator`` the targets are drawn from (None: torch's global one).

    Returns:
        Tensor: ``[M, N, *out.shape[1:]]``, the sampled columns ``s_m``.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import losses
        >>> spec = losses.loss_spec(nn.CrossEntropyLoss())
        >>> out, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
        >>> g = torch.Generator().manual_seed(0)
        >>> losses.sqrt_hessian_sampled(spec, out, y, mc_samples=5, generator=g).shape   # [M, N, C]
        torch.Size([5, 4, 3])
    """
    return _single(curvature_at(spec, out, y, check=False).sampled_roots(mc_samples, generator), spec)


def hessian_matvec(spec: LossSpec, out: Tensor, y: Tensor, mat: Tensor) -> Tensor:
    r"""$c\, \nabla^2 \ell$ applied per sample: ``mat [V, N, *out.shape[1:]]`` -> same shape.

    Args:
        spec: the loss, as ``loss_spec`` describes it.
        out: the model output ``[N, *out]`` (logits for CE and BCE).
        y: the targets (class indices ``[N, ...]`` or probabilities for CE; ``out``'s shape for MSE and BCE).
        mat: ``[V, N, *out.shape[1:]]``: ``V`` vectors per sample.

    Returns:
        Tensor: $c \nabla^2 \ell_n$ times each vector, the shape of ``mat``.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import losses
        >>> spec = losses.loss_spec(nn.MSELoss(reduction="sum"))
        >>> mat = torch.randn(2, 4, 3)                             # [V, N, C]
        >>> torch.allclose(losses.hessian_matvec(spec, torch.zeros(4, 3), torch.zeros(4, 3), mat), 2 * mat)
        True
    """
    return curvature_at(spec, out, y, check=False).matvec(mat)


def _single(roots, spec: LossSpec) -> Tensor:
    if len(roots) != 1:
        raise CurvatureError(f"The Hessian of {spec.name} w.r.t. the model output is indefinite here.")
    return roots[0][1]
