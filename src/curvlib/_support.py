"""Refusals of second-order extensions, decided from the plan's sites before any work.

A Kronecker factor needs a Linear/Conv family and one use per parameter (shared Linear
weights are factored as positions); the Hessian extensions need a family whose second
derivative curvlib knows, and for a parameter used by several sites the coupling of its
weight and input, which curvlib has for :data:`SHARED_HESSIAN_KINDS`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Mapping, Optional, Sequence

from ._errors import CurvatureError
from ._secondorder import uses_of
from .extensions.secondorder import SecondOrder
from .rules._site import Site

__all__ = ["check_second_order", "HESSIAN_QUANTITIES"]

KRON_KINDS = ("linear", "conv", "conv_transpose")
# Families the Hessian extensions support (the recurrent ones through their unrolled
# nodes, curvlib.rules.rnn_steps).
HESSIAN_SITE_KINDS = (
    "linear", "conv", "conv_transpose", "batchnorm", "embedding", "layernorm", "groupnorm", "generic", "rnn",
)
# A parameter used by several sites needs the coupling of weight and input;
# curvlib has it for these families (affine-in-input Linear: "bilinear";
# the others: the dense residual of the layer as a function of both).
SHARED_HESSIAN_KINDS = ("linear", "embedding", "layernorm", "groupnorm", "generic", "rnn")


HESSIAN_QUANTITIES = ("hessian_diag", "hessian_batch_diag", "pchmp")


def check_second_order(
    exts: Sequence[SecondOrder],
    sites: Sequence[Site],
    names: Sequence[str],
    unknown_nodes: List[str],
    layer_kinds: Optional[Mapping[str, str]] = None,
) -> None:
    """Refuse, before any work, what the requested extensions cannot do.

    Args:
        exts: the second-order extensions.
        sites: the planned sites.
        names: trainable parameter names.
        unknown_nodes: graph nodes whose second derivative is unknown.
        layer_kinds: layer path -> family. Support is decided by the family,
            not by the kind of its sites: an RNN is made of linear sites around
            hidden nonlinearities.
    """
    uses = uses_of(sites)
    layer_kinds = layer_kinds or {}
    params_of: Dict[str, List[str]] = defaultdict(list)
    family_of: Dict[str, str] = {}
    for site in sites:
        params_of[site.where].extend(n for n in site.params.values() if n not in params_of[site.where])
        family_of[site.where] = site.meta.get("family", layer_kinds.get(site.where, "generic"))
    for ext in exts:
        hessian = ext.quantity in HESSIAN_QUANTITIES
        if ext.kron or hessian:
            _check_families(ext, KRON_KINDS if ext.kron else HESSIAN_SITE_KINDS, params_of, family_of)
        if ext.kron:
            for name in names:
                _check_kron_uses(ext, name, uses.get(name, []), family_of)
        if hessian:
            _check_hessian_uses(ext, uses, unknown_nodes, family_of)


def _check_families(ext, supported, params_of, family_of) -> None:
    for where, pnames in params_of.items():
        family = family_of[where]
        if family not in supported:
            raise CurvatureError(
                f"{type(ext).__name__} is not supported for module '{where}' (layer family "
                f"'{family}', parameters {sorted(pnames)}); supported families: "
                f"{', '.join(supported)}. Remove the extension or set "
                "requires_grad=False on those parameters."
            )


def _check_kron_uses(ext, name: str, u, family_of) -> None:
    """A Kronecker factor of parameter ``name``, used by the sites ``u``."""
    label = type(ext).__name__
    if not u:
        raise CurvatureError(
            f"{label} is not defined for parameter '{name}': the model's forward "
            "does not use it. Set requires_grad=False on it or leave it out of params."
        )
    if len(u) > 1 and (
        ext.quantity == "kfra"
        or any(s.rule.kind != "linear" or family_of[s.where] != "linear" for s, _ in u)
        or len({r for _, r in u}) > 1
    ):
        raise CurvatureError(
            f"{label} is not defined for parameter '{name}': it is used by several "
            f"layers ({', '.join(s.where for s, _ in u)}); curvlib factors shared "
            "weights of Linear layers (KFAC, KFLR) only. Use DiagGGNExact or "
            "SqrtGGNExact, or untie the weights."
        )
    if len(u) > 1 and getattr(ext, "kfac_approx", None) is not None:
        raise CurvatureError(
            f"{label}(kfac_approx={ext.kfac_approx!r}) is not defined for parameter "
            f"'{name}': it is used by several layers ({', '.join(s.where for s, _ in u)}). "
            f"Use {label}() (BackPACK's factors, uses treated as positions)."
        )
    site = u[0][0]
    if site.meta.get("kron_error"):
        raise CurvatureError(
            f"{label} is not defined for parameter '{name}' (module "
            f"'{site.where}'): {site.meta['kron_error']}"
        )


def _check_hessian_uses(ext, uses, unknown_nodes, family_of) -> None:
    label = type(ext).__name__
    if unknown_nodes:
        raise CurvatureError(f"{label} is not supported for: {', '.join(unknown_nodes)}.")
    for name, u in uses.items():
        kinds = {family_of[site.where] for site, _ in u}
        if len(u) > 1 and not kinds <= set(SHARED_HESSIAN_KINDS):
            raise CurvatureError(
                f"{label}: parameter '{name}' is used by several layers "
                f"({', '.join(s.where for s, _ in u)}) of families {sorted(kinds)}; the "
                "Hessian's weight-input coupling between uses is supported for: "
                f"{', '.join(SHARED_HESSIAN_KINDS)}. Use HMP for exact Hessian products."
            )
