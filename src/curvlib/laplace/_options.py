"""The options laplace-torch passes to a backend: checked, honoured or refused.

laplace-torch forwards ``backend_kwargs`` to the backend's constructor and
``asdl_fisher_kwargs`` to ``diag``/``kron`` (``KronLaplace``, ``DiagLaplace``);
it passes ``N`` to ``diag``, ``full`` and ``kron`` itself. Its curvlinops
backend forwards ``mc_samples`` and ``kfac_approx`` to curvlinops, whose
``KFACLinearOperator`` takes ``mc_samples`` for the Monte-Carlo Fisher only
(``mc_samples != 1`` with another Fisher type is a ``ValueError``) and
``kfac_approx`` in ``("expand", "reduce")`` (Eschenhagen et al., 2023).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

import torch

from .._core.errors import CurvatureError, CurvatureTypeError

KFAC_APPROXES = ("expand", "reduce")

# the keywords each method accepts besides its positional arguments
METHOD_OPTIONS = {
    "diag": ("N", "mc_samples"),
    "full": ("N", "mc_samples"),
    "kron": ("mc_samples", "kfac_approx"),
}


def refuse_unknown(where: str, given: Iterable[str], accepted: Iterable[str]) -> None:
    """A :class:`CurvatureTypeError` naming the first keyword not in ``accepted``."""
    accepted = tuple(accepted)
    for key in given:
        if key not in accepted:
            raise CurvatureTypeError(
                f"{where}: unknown keyword argument {key!r}; accepted: "
                f"{', '.join(accepted)}. (laplace-torch forwards backend_kwargs to the "
                "constructor and asdl_fisher_kwargs to diag and kron.)"
            )


def method_options(backend: Any, method: str, kwargs: Mapping[str, Any]) -> Dict[str, Any]:
    """``{"mc_samples": int, "kfac_approx": str or None}`` for one call of ``method``.

    ``mc_samples`` defaults to the backend's ``num_samples`` and must be 1 unless
    the backend is a Monte-Carlo Fisher (as for curvlinops' KFAC).
    ``kfac_approx`` is ``None`` when not given.
    """
    where = f"{type(backend).__name__}.{method}"
    refuse_unknown(where, kwargs, METHOD_OPTIONS[method])
    stochastic = getattr(backend, "stochastic", False)
    mc = kwargs.get("mc_samples", getattr(backend, "num_samples", 1) if stochastic else 1)
    if isinstance(mc, bool) or not isinstance(mc, int) or mc < 1:
        raise CurvatureError(f"{where}(mc_samples={mc!r}): mc_samples must be a positive int.")
    if mc != 1 and not stochastic:
        raise CurvatureError(
            f"{where}(mc_samples={mc}): mc_samples applies to the Monte-Carlo Fisher "
            f"({type(backend).__name__.replace('EF', 'GGN')}(..., stochastic=True)); this backend "
            "computes the exact curvature, which takes no samples (mc_samples=1 only)."
        )
    approx = kwargs.get("kfac_approx")
    if approx is not None and approx not in KFAC_APPROXES:
        raise CurvatureError(
            f"{where}(kfac_approx={approx!r}) is not supported; use one of {KFAC_APPROXES}."
        )
    return {"mc_samples": mc, "kfac_approx": approx}


def check_constructor(name: str, unknown: Mapping[str, Any], accepted: Tuple[str, ...]) -> None:
    refuse_unknown(f"{name}(...)", unknown, accepted)


def generator_or_none(name: str, generator: Optional[torch.Generator]) -> Optional[torch.Generator]:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise CurvatureTypeError(
            f"{name}(generator=...) must be a torch.Generator or None, got "
            f"{type(generator).__name__}."
        )
    return generator
