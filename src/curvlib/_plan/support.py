"""Refusals of second-order extensions, decided from the plan's sites before any work.

KFAC/KFLR/KFACEmpirical need Kronecker factors (Linear, Conv, ConvTranspose, Embedding
weights, and RNN/LSTM/GRU weights, which are Linear sites shared over time steps; one use
per parameter, but shared Linear or recurrent weights are factored as positions),
the exact block (normalisations' scale and shift, 1-D parameters of other modules, any
number of uses), Embedding's layout (bias-like generic parameters) or the diagonal block
(other generic parameters, :mod:`curvlib.rules.fixed_rows`); KFRA's recursion has factors for Linear/Conv/ConvTranspose only. The Hessian extensions need a family whose second
derivative curvlib knows, and for a parameter used by several sites the coupling of its
weight and input, which curvlib has for :data:`SHARED_HESSIAN_KINDS`.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Dict, List, Mapping, Optional, Sequence

from .._core.errors import CurvatureError
from ..extensions import SecondOrder
from ..rules import FAMILY_OF, FamilyKinds, fixed_rows
from ..rules.fixed_rows import tied_across_layers
from .._core.site import Site, uses_of

__all__ = ["check_second_order", "note_unused"]

#: Families whose parameters get their exact curvature block (:attr:`~curvlib._core.family.Family.exact_block`).
EXACT_BLOCK_KINDS = FamilyKinds(lambda f: f.exact_block)
#: Families whose weight shared by several Linear sites is factored with the uses as
#: positions (:attr:`~curvlib._core.family.Family.kron_over_uses`).
KRON_OVER_USES_KINDS = FamilyKinds(lambda f: f.kron_over_uses)
#: A parameter used by several sites needs the coupling of weight and input; curvlib has it
#: for these families (:attr:`~curvlib._core.family.Family.shared_hessian`; Linear: "bilinear";
#: the others: the dense residual of the layer as a function of both).
SHARED_HESSIAN_KINDS = FamilyKinds(lambda f: f.shared_hessian)


def check_second_order(
    exts: Sequence[SecondOrder],
    sites: Sequence[Site],
    names: Sequence[str],
    layer_kinds: Optional[Mapping[str, str]] = None,
    param_dims: Optional[Mapping[str, int]] = None,
) -> None:
    """Refuse, before any work, what the requested extensions cannot do.

    Args:
        exts: the second-order extensions.
        sites: the planned sites.
        names: trainable parameter names.
        layer_kinds: layer path -> family. Support is decided by the family,
            not by the kind of its sites: an RNN is made of linear sites around
            hidden nonlinearities.
        param_dims: parameter name -> number of dims (Kronecker extensions give the
            exact block of a 1-D parameter of a module without Kronecker factors).
    """
    uses = uses_of(sites)
    layer_kinds = layer_kinds or {}
    params_shape = param_dims or {}
    params_of: Dict[str, List[str]] = defaultdict(list)
    family_of: Dict[str, str] = {}
    opaque_of: Dict[str, str] = {}
    for site in sites:
        params_of[site.where].extend(n for n in site.params.values() if n not in params_of[site.where])
        family_of[site.where] = site.meta.get("family", layer_kinds.get(site.where, "generic"))
        if site.meta.get("opaque") and site.meta.get("kron_inside"):
            opaque_of[site.where] = (site.meta["opaque"], site.meta["kron_inside"], site.meta.get("kron_rows", ()))
    for ext in exts:
        if ext.kron:
            _refuse_opaque(ext, opaque_of)
        if ext.layer_kinds is not None:
            _check_families(ext, ext.layer_kinds, params_of, family_of)
        if ext.kron:
            for name in names:
                _check_kron_uses(ext, name, uses.get(name, []), family_of, params_shape)
        if ext.hessian:
            _check_hessian_uses(ext, uses, family_of)


def _refuse_opaque(ext, opaque_of) -> None:
    """A Kronecker factor of a layer's weight needs the layer's input and output; inside a
    module curvlib runs whole (one opaque node) it sees them for the layers whose factors come from
    their rows (a ``Linear``: :mod:`curvlib._evaluate.opaque_kron`), except where the factors are
    pulled back as matrices (KFRA), not for a convolution, embedding or RNN. The module's other
    parameters (a mixture of experts' stacked expert weights) are a generic layer's: their exact
    block's diagonal, as where the module is traced."""
    for where, (why, inside, rows) in opaque_of.items():
        refused = sorted(inside if ext.recursion else set(inside) - set(rows))
        if not refused:
            continue
        which = ("layers" if ext.recursion else "convolution, embedding or recurrent layers")
        why = "; ".join(w.strip() for w in why.splitlines())
        # (a module kept whole by the ATen front end says why itself; else torch.fx failed on it)
        why = why if "kept whole" in why else f"torch.fx could not trace its forward ({why})"
        raise CurvatureError(
            f"{type(ext).__name__} is not defined for the parameters {refused} of module "
            f"'{where}': curvlib runs it as one opaque layer (generic rule), as {why}, and does not see "
            f"the inputs and outputs of the {which} inside it that Kronecker factors need"
            + (" (KFRA pulls the GGN back as a matrix layer by layer, which it cannot do through the module)"
               if ext.recursion else "") + ". Set requires_grad=False on those parameters (or leave them out "
            f"of params=) to get {type(ext).__name__} for the other layers, make the module traceable by torch.fx, "
            "or use DiagGGNExact / SqrtGGNExact / GGNMP, which are exact for it."
            + ("" if ext.recursion else " KFAC and KFLR form the factors of Linear layers inside it.")
        )


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


def _check_kron_uses(ext, name: str, u, family_of, param_dims) -> None:
    """A Kronecker factor of parameter ``name``, used by the sites ``u``."""
    label = type(ext).__name__
    if not u:
        return  # not used by the forward: zero factors (curvlib.rules.fixed_rows.unused_block)
    families = {family_of[s.where] for s, _ in u}
    if not ext.recursion and families <= set(EXACT_BLOCK_KINDS):
        _check_exact_block(label, name, u, families, param_dims, ext.options.kfac_approx)
        return
    if len(u) > 1 and not ext.recursion and tied_across_layers(u, family_of):
        return  # the diagonal of the exact block (curvlib.rules.fixed_rows.generic_block)
    if len(u) > 1 and (
        ext.recursion
        # (every use a Linear site, the rule's kind, of a layer whose family factors its uses)
        or any(s.rule.kind not in KRON_OVER_USES_KINDS or family_of[s.where] not in KRON_OVER_USES_KINDS for s, _ in u)
        or len({r for _, r in u}) > 1
    ):
        raise CurvatureError(
            f"{label} is not defined for parameter '{name}': it is used by several "
            f"layers ({', '.join(s.where for s, _ in u)}); curvlib factors shared "
            "weights of Linear and recurrent layers (KFAC, KFLR) only. Use DiagGGNExact or "
            "SqrtGGNExact, or untie the weights."
        )
    site = u[0][0]
    error = site.meta.get("kron_error") or (site.meta.get("kfra_error") if ext.recursion else None)
    if error:
        raise CurvatureError(f"{label} is not defined for parameter '{name}' (module '{site.where}'): {error}")
    family, approx = FAMILY_OF.get(site.rule.kind), ext.options.kfac_approx
    why = family.kron_refusal(site, approx) if family is not None and family.kron_refusal is not None else None
    if why:
        raise CurvatureError(f"{label}(kfac_approx={approx!r}) is not defined for parameter '{name}' {why}")


def _check_exact_block(label: str, name: str, u, families, param_dims, approx=None) -> None:
    """A normalisation's scale or shift, a 1-D parameter elsewhere (exact block), a bias-like
    ``≥ 2``-dim one (Embedding's layout at fixed rows) or any other (diagonal block):
    only KFAC-reduce of a bias-like one is undefined here (a dense ``R x R`` input factor)."""
    at_rows = any(FAMILY_OF[f].row_map is not None for f in families if f in FAMILY_OF)  # (Family.row_map)
    if approx == "reduce" and at_rows and param_dims.get(name, 1) >= 2 and len(u) == 1 and fixed_rows.bias_like(u[0][0]):
        raise CurvatureError(
            f"{label}(kfac_approx='reduce') is not defined for parameter '{name}' (added as a bias by "
            f"'{u[0][0].where}'): it is an embedding looked up at fixed rows (one per position), and "
            "KFAC-reduce's input factor, the mean over positions of the one-hot rows, is a dense R x R "
            "matrix. Use kfac_approx=None or 'expand' (diagonal row-count factors)."
        )


def _check_hessian_uses(ext, uses, family_of) -> None:
    label = type(ext).__name__
    for name, u in uses.items():
        kinds = {family_of[site.where] for site, _ in u}
        if len(u) > 1 and not kinds <= set(SHARED_HESSIAN_KINDS):
            raise CurvatureError(
                f"{label}: parameter '{name}' is used by several layers "
                f"({', '.join(s.where for s, _ in u)}) of families {sorted(kinds)}; the "
                "Hessian's weight-input coupling between uses is supported for: "
                f"{', '.join(SHARED_HESSIAN_KINDS)}. Use HMP for exact Hessian products."
            )


def note_unused(sites: Sequence[Site], names: Sequence[str]) -> None:
    """Say which trainable parameters the forward does not use on this input (a language model
    class that owns cross-attention weights it never calls): their gradient is zero, so every
    quantity of theirs is zero (factors: :func:`curvlib.rules.fixed_rows.unused_block`)."""
    uses = uses_of(sites)
    unused = [n for n in names if not uses.get(n)]
    if unused:
        shown = ", ".join(f"'{n}'" for n in unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
        warnings.warn(
            f"curvlib: the model's forward does not use the parameters {shown} on this input: their "
            "gradient is zero, and so is every quantity of theirs. Leave them out of params= (or set "
            "requires_grad=False) to skip them.", UserWarning, stacklevel=2)
