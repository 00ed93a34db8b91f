"""Fitting the curvature of influence functions: one block per parameter, stored as a plain dict.

Every strategy is written in the same form per parameter ``p``: an orthogonal basis ``Q`` of the
block (``Q = Q_out ⊗ Q_in`` on the block's core ``[G, o, a]``, :mod:`curvlib.precondition._kronbasis`;
the identity for ``"diagonal"`` and ``"identity"``) and a spectrum ``s [G, o, a]``, the block's
curvature being ``Q diag(s) Qᵀ``:

* ``"kfac"``: ``s = λ_out λ_inᵀ``, the Kronecker product of the factors' eigenvalues;
* ``"ekfac"``: ``s_i = (1/N) Σ_n F_n`` in the basis, streamed batch by batch (George et al. 2018);
* ``"diagonal"``: ``s`` the curvature's diagonal;
* ``"identity"``: no spectrum (``G = I``, no damping).

The curvature is that of the mean over the ``N`` training examples of each example's loss
``ℓ_n``, its share of the loss summed over its own positions (a sequence's tokens):
``G = (1/N) Σ_n F_n``. ``curvature``'s quantities carry the loss's reduction instead (``c = 1/M``
for ``"mean"``, ``M`` the data's normaliser: samples, counted targets, entries), so each is
rescaled by ``M/N`` (GGN and Monte-Carlo Fisher, linear in ``c``) or ``M²/N`` (the empirical
Fisher, quadratic in ``c``); ``M = 1`` for ``"sum"``.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import extensions as ext
from .. import losses
from .._core import inputs as _inputs
from .._core.errors import CurvatureError, CurvatureTypeError
from .._transform.entry import curvature
from ..operators import EKFAC, KFAC
from ..operators.data import Sliced, pairs
from ..precondition import _kronbasis

__all__ = ["STRATEGIES", "FISHER_TYPES", "fit", "check_fitted", "data_size", "layout_of"]

STRATEGIES = ("identity", "diagonal", "kfac", "ekfac")
FISHER_TYPES = ("mc", "exact", "empirical")
_DIAGONALS = {"mc": "diag_ggn_mc", "exact": "diag_ggn_exact", "empirical": "sum_grad_squared"}


def _check_choice(what: str, value, allowed) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise CurvatureError(f"{what}={value!r} is not supported; use one of {allowed}.")


def data_size(lossfn, data) -> Tuple[int, float]:
    """``(N, M)``: the data's examples and its loss normaliser ``M = Σ_b M_b`` (1 for ``"sum"``);
    refused for a loss whose normaliser curvlib cannot know (each example's loss is undefined)."""
    spec = losses.loss_spec(lossfn)
    examples, mass = 0, 0.0
    for X, y in pairs(data):
        m = losses.normaliser(spec, y)
        if m is None:
            raise CurvatureError(
                f"influence needs each example's own loss, which curvlib reads off the reduction of "
                f"nn.CrossEntropyLoss, nn.MSELoss and nn.BCEWithLogitsLoss; lossfn {lossfn!r} is not one of them.")
        examples += _inputs.batch_size(X)
        mass = 1.0 if spec.reduction == "sum" else mass + m
    if examples == 0:
        raise CurvatureError("data has no batches: pass (X, y) or a loader yielding at least one (X, y).")
    return examples, mass


def _block(layout: _kronbasis.Layout, eigen: Optional[_kronbasis.Eigen], spectrum: Optional[Tensor]) -> dict:
    """One parameter's entry of the fitted dict: plain tensors, ints and strings (``torch.save``-able)."""
    fields = dict(q_out=None, lam_out=None, q_in=None, lam_in=None)
    if eigen is not None:
        fields = dict(q_out=eigen.q_out, lam_out=eigen.lam_out, q_in=eigen.q_in, lam_in=eigen.lam_in)
    return dict(layout=(layout.kind, layout.groups, layout.out, layout.inp, tuple(layout.shape)),
                spectrum=spectrum, **fields)


def _kronecker_blocks(operator: KFAC, scale: float, corrected: bool) -> Dict[str, dict]:
    blocks = {}
    for name, eigen in operator.eigen.items():
        if corrected:
            spectrum = operator.eigenvalues[name]
        else:
            spectrum = eigen.lam_out[:, :, None] * eigen.lam_in[:, None, :]
        blocks[name] = _block(operator.layouts[name], eigen, spectrum.detach().mul_(scale))  # the operator's own
    return blocks


def _diagonal_blocks(model, lossfn, data, fisher_type, options, examples: int) -> Dict[str, dict]:
    """``(1/N) Σ_b`` of each batch's diagonal times its ``M_b`` (``M_b²`` empirical): ``(1/N) Σ_n diag F_n``."""
    extension = {"mc": lambda: ext.DiagGGNMC(mc_samples=options["mc_samples"], generator=options["generator"]),
                 "exact": ext.DiagGGNExact, "empirical": ext.SumGradSquared}[fisher_type]()
    spec = losses.loss_spec(lossfn)
    power = 2 if fisher_type == "empirical" else 1
    f = curvature(model, lossfn, [extension], output=options["output"])
    total: Dict[str, Tensor] = {}
    for X, y in pairs(data):
        weight = 1.0 if spec.reduction == "sum" else losses.normaliser(spec, y) ** power
        qs = f(X, y, params=options["params"], buffers=options["buffers"])
        for name, d in qs[extension.name].items():
            part = d.detach() * weight
            total[name] = part if name not in total else total[name] + part
    blocks = {}
    for name, d in total.items():
        layout = _matrix_layout(d.shape)
        blocks[name] = _block(layout, None, layout.to_core(d / examples))
    return blocks


def _matrix_layout(shape) -> _kronbasis.Layout:
    """A parameter as the matrix ``[1, shape[0], rest]`` (a vector: ``[1, P, 1]``), the core of
    a block without a basis: where low-rank queries are truncated, as for a Kronecker block."""
    shape = tuple(shape)
    rows = shape[0] if len(shape) > 1 else max(1, math.prod(shape))
    return _kronbasis.Layout("pair", 1, rows, math.prod(shape) // rows, shape)


def _identity_blocks(model, params: Optional[Mapping[str, Tensor]]) -> Dict[str, dict]:
    named = params if params is not None else {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not named:
        raise CurvatureError("influence: the model has no trainable parameter (and params= names none).")
    return {name: _block(_matrix_layout(p.shape), None, None) for name, p in named.items()}


def fit(model: nn.Module, lossfn, data, *, strategy: str = "ekfac", fisher_type: str = "mc",
        params: Optional[Mapping[str, Tensor]] = None, buffers: Optional[Mapping[str, Tensor]] = None,
        output=None, generator: Optional[torch.Generator] = None, mc_samples: int = 1,
        max_factor_dim: Optional[int] = None, kfac_approx: Optional[str] = "expand",
        batch_size: Optional[int] = None) -> dict:
    """The curvature of influence functions over ``data``: a dict of tensors, ``torch.save``-able.

    Args:
        model: any module ``curvlib.curvature`` takes; not changed.
        lossfn: ``nn.CrossEntropyLoss``, ``nn.MSELoss`` or ``nn.BCEWithLogitsLoss`` (each
            example's loss is read off its reduction).
        data: the training data: ``(X, y)`` or a re-iterable loader of such pairs.
        strategy: ``"identity"``, ``"diagonal"``, ``"kfac"`` or ``"ekfac"`` (module doc).
        fisher_type: the curvature approximated: ``"mc"`` (Fisher, labels sampled from the
            model), ``"exact"`` (the GGN) or ``"empirical"`` (the data's labels).
        params: parameter name -> tensor: these values, and the influence of exactly these
            parameters (a subset: e.g. the MLP weights); default every ``requires_grad`` one.
        buffers: buffer name -> tensor, replacing the model's (as for ``curvature``).
        output: the tensor of a container output the loss takes (as for ``curvature``).
        generator: draws the Monte-Carlo labels (``fisher_type="mc"``).
        mc_samples: sampled labels per example (``"mc"`` only).
        max_factor_dim: a Kronecker factor side larger than this is kept diagonal (a 50k
            vocabulary's).
        kfac_approx: ``"expand"`` (default) or ``"reduce"`` for weights shared by positions.
        batch_size: examples per ``curvature`` call in EK-FAC's eigenvalue pass (roots ``[N_b, P]``
            per column), the parameters in groups of ``≤ P / (1 + mc_samples · N_b)`` entries, a call
            each (``None``: the loader's batches, all at once). The same factors either way.

    Returns:
        ``{"strategy", "fisher_type", "examples": N, "blocks": {name: block}}``, each block a dict
        with ``layout`` (how the parameter maps to its core ``[G, o, a]``), the basis ``q_out
        [G, o, o]``, ``q_in [G, a, a]`` (``None``: identity), the KFAC factors' eigenvalues
        ``lam_out``, ``lam_in`` and the ``spectrum [G, o, a]`` (``None`` for ``"identity"``).

    Raises:
        CurvatureError: an unknown strategy or fisher type, data without batches, a loss whose
            examples' losses are unknown, or what ``curvature`` refuses for the model.
        CurvatureTypeError: ``generator`` not a ``torch.Generator``, ``data`` not pairs.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import influence
        >>> model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        >>> train = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(3)]
        >>> factors = influence.fit(model, nn.CrossEntropyLoss(), train, strategy="ekfac",
        ...                         generator=torch.Generator().manual_seed(0))
        >>> factors["strategy"], factors["examples"], sorted(factors["blocks"])
        ('ekfac', 24, ['0.bias', '0.weight', '2.bias', '2.weight'])
        >>> block = factors["blocks"]["0.weight"]
        >>> block["q_out"].shape, block["q_in"].shape, block["spectrum"].shape   # [G, o, o], [G, a, a], [G, o, a]
        (torch.Size([1, 6, 6]), torch.Size([1, 4, 4]), torch.Size([1, 6, 4]))
    """
    kronecker = _checked_options(strategy, fisher_type, generator, data, batch_size)
    kronecker.update(max_factor_dim=max_factor_dim, kfac_approx=kfac_approx)
    params = None if params is None else {n: p.detach() for n, p in params.items()}  # never differentiated
    options = dict(params=params, buffers=buffers, output=output, generator=generator, mc_samples=mc_samples)
    blocks, examples = _fitted_blocks(model, lossfn, data, strategy, fisher_type, options, kronecker)
    return dict(strategy=strategy, fisher_type=fisher_type, examples=examples, blocks=blocks)


def _checked_options(strategy, fisher_type, generator, data, batch_size) -> dict:
    """Refuse bad options before any work; EK-FAC's options for its eigenvalue pass."""
    _check_choice("strategy", strategy, STRATEGIES)
    _check_choice("fisher_type", fisher_type, FISHER_TYPES)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise CurvatureTypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}.")
    Sliced(data, batch_size)  # checks the size
    return dict(correction_batch_size=batch_size) if strategy == "ekfac" else {}


def _fitted_blocks(model, lossfn, data, strategy, fisher_type, options, kronecker) -> Tuple[Dict[str, dict], int]:
    examples, mass = data_size(lossfn, data)
    if strategy == "identity":
        return _identity_blocks(model, options["params"]), examples
    if strategy == "diagonal":
        return _diagonal_blocks(model, lossfn, data, fisher_type, options, examples), examples
    # keep_factors=False: only the eigendecompositions are returned, so each block's factors are
    # freed once decomposed rather than held beside every eigenbasis and the eigenvalue pass
    operator = (EKFAC if strategy == "ekfac" else KFAC)(model, lossfn, data, fisher_type=fisher_type, **kronecker,
                                                        **options, keep_factors=False)
    # the operators' curvature is the data's loss's, (1/M) Σ_n F_n ((1/M²) Σ_n g_n g_nᵀ empirical)
    scale = mass ** (2 if fisher_type == "empirical" else 1) / examples
    return _kronecker_blocks(operator, scale, corrected=strategy == "ekfac"), examples


def check_fitted(fitted) -> None:
    """Refuse what :func:`fit` did not return, before any work."""
    if not isinstance(fitted, Mapping) or not isinstance(fitted.get("blocks"), Mapping) \
            or fitted.get("strategy") not in STRATEGIES or not fitted["blocks"]:
        raise CurvatureTypeError(
            "factors must be the dict curvlib.influence.fit returns (keys 'strategy', 'fisher_type', "
            f"'examples', 'blocks'), got {type(fitted).__name__}"
            + (f" with keys {sorted(map(str, fitted))}" if isinstance(fitted, Mapping) else "") + ".")
    for name, block in fitted["blocks"].items():
        if not isinstance(block, Mapping) or "layout" not in block or "spectrum" not in block:
            raise CurvatureTypeError(f"factors['blocks'][{name!r}] is not a block fit returns.")
        if block["spectrum"] is not None and not bool(torch.isfinite(block["spectrum"]).all()):
            raise CurvatureError(f"factors of parameter {name!r} have non-finite eigenvalues (inf or NaN): "
                                 "refit on a model and data with finite losses.")


def layout_of(block: Mapping) -> _kronbasis.Layout:
    """The block's ``Layout``."""
    kind, groups, out, inp, shape = block["layout"]
    return _kronbasis.Layout(kind, int(groups), int(out), int(inp), tuple(int(s) for s in shape))

