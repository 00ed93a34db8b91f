"""Second-order quantities from one linearised forward pass.

GGN family. A symmetric factor ``S [V, N, *out]`` of the scaled loss Hessian
(exact: ``V = C``; Monte Carlo: ``V = M``) is pulled back through the graph
in one batched vector-Jacobian product, ``m_k = J_kᵀ S`` at every site ``k``
(``[V, *site_out]``). A site's rule then gives, per vector ``v``, the
per-sample parameter factor ``J_pᵀ m_v`` (its ``grad_batch`` applied to
``m_v``), so

* ``sqrt``       = ``[V, N, *p]``: ``grad_batch(m_v)`` for every ``v``,
* ``diag``       = ``Σ_v sum_grad_squared(m_v)`` (never forms ``[N, *p]`` where
  the rule avoids it),
* ``batch_diag`` = ``Σ_v grad_batch(m_v)²``,
* ``kron``       = ``[B, A]`` from the rule's Kronecker statistics.

A parameter used by several sites sums ``J_pᵀ m`` over its sites before any
square is taken.

Hessian diagonal. ``∇²L = G + Σ_a J_aᵀ diag(φ''(a) ⊙ g_z) J_a`` over the
element-wise nonlinearities ``z = φ(a)`` (``g_z = ∂L/∂z``), for graphs whose
other nodes are piecewise linear. Each residual is split into its positive
and negative parts, ``r = r₊ − r₋``; the columns ``e_d √r±[n, d]`` (one per
feature ``d`` of ``a``) are pulled back from ``a`` like ``S``, and their
``diag``/``batch_diag`` are added with the sign.

Products (``GGNMP``, ``HMP``, ``PCHMP``) return callables that re-run the
forward with the parameter as the only variable (same random state, so the
same dropout masks), using forward-mode and reverse-mode autodiff; they
form no Jacobian or Hessian.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.func import grad, jvp, vjp, vmap

from . import losses
from ._engine import Linearization, run_graph
from ._errors import CurvatureError
from .extensions.secondorder import SecondOrder
from .rules._site import Recorder, Site
from .rules.elementwise import second_derivative

KRON_KINDS = ("linear", "conv")
HESSIAN_SITE_KINDS = ("linear", "conv", "conv_transpose", "batchnorm", "embedding")


def _uses(sites: Sequence[Site]) -> Dict[str, List[Tuple[Site, str]]]:
    uses: Dict[str, List[Tuple[Site, str]]] = defaultdict(list)
    for site in sites:
        for role, name in site.params.items():
            uses[name].append((site, role))
    return uses


def _sqrt(uses, m_by_site, name) -> Tensor:
    """``[V, N, *p]``: ``Σ_sites J_pᵀ m_v`` per sample."""
    total = None
    for site, role in uses[name]:
        m = m_by_site[site.key]
        part = vmap(lambda mv: site.rule.grad_batch(site, mv, [role])[role])(m)
        total = part if total is None else total + part
    return total


def _diag(uses, m_by_site, name, params) -> Tensor:
    """``Σ_v Σ_n (J_pᵀ m_v)²``, via the rule's sum of squares for single-use parameters."""
    u = uses.get(name, [])
    if not u:
        return torch.zeros_like(params[name])
    if len(u) == 1:
        site, role = u[0]
        rule = site.rule
        if rule.sum_grad_squared is not None:
            m = m_by_site[site.key]
            return vmap(lambda mv: rule.sum_grad_squared(site, mv, [role])[role])(m).sum(0)
    return (_sqrt(uses, m_by_site, name) ** 2).sum((0, 1))


def _batch_diag(uses, m_by_site, name, params, n) -> Tensor:
    if not uses.get(name):
        return params[name].new_zeros((n,) + tuple(params[name].shape))
    return (_sqrt(uses, m_by_site, name) ** 2).sum(0)


def _kron(uses, m_by_site, name, ext_name) -> List[Tensor]:
    (site, role), = uses[name]
    from .rules import kron_factors  # the families' Kronecker statistics

    return kron_factors(site, role, m_by_site[site.key])


def check_second_order(exts: Sequence[SecondOrder], sites: Sequence[Site], names: Sequence[str], n_residual_other: List[str], layer_kinds: Mapping[str, str] = None) -> None:
    """Refuse, before any work, what the requested extensions cannot do.

    ``layer_kinds`` maps a layer's path to its family: a family's sites may be
    of another kind (an RNN is made of linear sites around hidden
    nonlinearities), so support is decided by the family.
    """
    uses = _uses(sites)
    layer_kinds = layer_kinds or {}
    for ext in exts:
        for site in sites:
            family = layer_kinds.get(site.where, site.rule.kind)
            hessian = ext.quantity in ("hessian_diag", "hessian_batch_diag", "pchmp")
            if (ext.kron and family not in KRON_KINDS) or (hessian and family not in HESSIAN_SITE_KINDS):
                supported = KRON_KINDS if ext.kron else HESSIAN_SITE_KINDS
                raise CurvatureError(
                    f"{type(ext).__name__} is not supported for module '{site.where}' (layer "
                    f"family '{family}', parameters {sorted(site.params.values())}); supported "
                    f"families: {', '.join(supported)}. Remove the extension or set "
                    "requires_grad=False on those parameters."
                )
        if ext.kron:
            for name in names:
                u = uses.get(name, [])
                if len(u) != 1 or u[0][0].rule.kind not in KRON_KINDS:
                    where = u[0][0].where if u else "?"
                    kind = u[0][0].rule.kind if u else "unused"
                    why = "used by several layers" if len(u) > 1 else f"of a '{kind}' layer"
                    raise CurvatureError(
                        f"{type(ext).__name__} is not defined for parameter '{name}' ({why}, "
                        f"module '{where}'). {type(ext).__name__} supports weight and bias of "
                        f"layers of kind: {', '.join(KRON_KINDS)} (Linear on 2d inputs, Conv). "
                        "Remove the extension or set requires_grad=False on that parameter."
                    )
                site = u[0][0]
                check = getattr(site.rule, "kron_check", None)
                if site.meta.get("kron_error"):
                    raise CurvatureError(
                        f"{type(ext).__name__} is not defined for parameter '{name}' (module "
                        f"'{site.where}'): {site.meta['kron_error']}"
                    )
        if ext.quantity in ("hessian_diag", "hessian_batch_diag", "pchmp"):
            if n_residual_other:
                raise CurvatureError(
                    f"{type(ext).__name__} needs the second derivative of every operation; "
                    f"curvlib does not know it for: {', '.join(n_residual_other)}. Supported: "
                    "piecewise-linear operations (reshapes, pooling, padding, dropout, ReLU, "
                    "additions) and element-wise activations (Sigmoid, Tanh, ELU, SELU, GELU, "
                    "SiLU, Softplus, LogSigmoid, ...)."
                )
            for site in sites:
                if site.rule.kind not in HESSIAN_SITE_KINDS:
                    raise CurvatureError(
                        f"{type(ext).__name__} is not supported for module '{site.where}' (layer "
                        f"kind '{site.rule.kind}'); supported: {', '.join(HESSIAN_SITE_KINDS)}."
                    )
            for name, u in uses.items():
                if len(u) > 1:
                    raise CurvatureError(
                        f"{type(ext).__name__}: parameter '{name}' is used by several layers "
                        f"({', '.join(s.where for s, _ in u)}); the Hessian's cross terms between "
                        "uses are not supported yet."
                    )


def second_order(
    lin: Linearization,
    spec: losses.LossSpec,
    y: Tensor,
    exts: Sequence[SecondOrder],
    names: Sequence[str],
    params: Mapping[str, Tensor],
    batch_size: int,
    residual_grads: Sequence[Tensor],
    rerun: Callable,
) -> Dict[str, Dict[str, object]]:
    """Every requested second-order quantity, per parameter (see module doc)."""
    uses = _uses(lin.sites)
    results: Dict[str, Dict[str, object]] = {}
    out = lin.out

    exact_exts = [e for e in exts if e.root == "exact"]
    m_exact = None
    if exact_exts:
        S = losses.sqrt_hessian(spec, out, y)
        m_exact = lin.pull_batched(S)

    for ext in exts:
        q = ext.quantity
        if ext.root == "mc":
            S = losses.sqrt_hessian_sampled(spec, out, y, ext.mc_samples, ext.generator)
            m = lin.pull_batched(S)
        else:
            m = m_exact
        res: Dict[str, object] = {}
        if q == "diag":
            res = {n: _diag(uses, m, n, params) for n in names}
        elif q == "batch_diag":
            res = {n: _batch_diag(uses, m, n, params, batch_size) for n in names}
        elif q == "sqrt":
            v = S.shape[0]
            res = {
                n: (_sqrt(uses, m, n) if uses.get(n) else params[n].new_zeros((v, batch_size) + tuple(params[n].shape)))
                for n in names
            }
        elif q == "kron":
            res = {n: _kron(uses, m, n, ext.name) for n in names}
        elif q in ("hessian_diag", "hessian_batch_diag"):
            res = _hessian_diag(lin, uses, m, names, params, batch_size, residual_grads, batch=(q == "hessian_batch_diag"))
        elif q in ("ggnmp", "hmp", "pchmp"):
            res = {n: rerun(ext, n) for n in names}
        elif q == "kfra":
            res = rerun(ext, None)
        results[ext.name] = res
    return results


def _hessian_diag(lin, uses, m_ggn, names, params, n, residual_grads, batch: bool):
    read = (lambda m, name: _batch_diag(uses, m, name, params, n)) if batch else (lambda m, name: _diag(uses, m, name, params))
    total = {name: read(m_ggn, name) for name in names}
    for i, (res, g_z) in enumerate(zip(lin.residuals, residual_grads)):
        r = second_derivative(res.phi, res.a) * g_z  # [N, *a]
        if not bool((r != 0).any()) if _concrete(r) else False:
            continue
        d = r[0].numel()
        eye = torch.eye(d, dtype=r.dtype, device=r.device).reshape((d, 1) + tuple(r.shape[1:]))
        for sign, part in ((1.0, r.clamp(min=0)), (-1.0, (-r).clamp(min=0))):
            cols = eye * part.sqrt().unsqueeze(0)  # [d, N, *a]
            m = lin.pull_batched(None, {i: cols})
            for name in names:
                total[name] = total[name] + sign * read(m, name)
    return total


def _concrete(t: Tensor) -> bool:
    try:
        return not torch._C._functorch.is_functorch_wrapped_tensor(t)
    except AttributeError:  # pragma: no cover
        return True
