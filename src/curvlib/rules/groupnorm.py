"""Group normalisation (``nn.GroupNorm``), batched with an explicit ``n``.

The ``C`` channels are split into ``G`` groups of ``C / G``; each sample is
normalised per group over the group's channels and all spatial positions,
then a per-channel affine map is applied:

    x̂[n, c, s] = (x[n, c, s] - mean_{n, group(c)}) / √(var_{n, group(c)} + ε),
    y[n, c, s] = x̂[n, c, s] γ[c] + β[c].

Shapes: ``x [N, C, *S]`` (batch in dim 0, as the layer requires), ``g = ∂L/∂y``
like ``x``, ``γ = weight [C]``, ``β = bias [C]``. The statistics are taken per
sample, so samples never mix. The spatial axes are flattened into ``s``; the
rule works on ``x̂ [n, c, s]`` and ``g [n, c, s]``.

Given ``x̂`` the site is linear in ``(γ, β)``; the individual gradients

    ∂ℓ_n/∂γ[c] = Σ_s g[n, c, s] x̂[n, c, s],      ∂ℓ_n/∂β[c] = Σ_s g[n, c, s]

are ``[N, C]`` (small), and every first-order quantity is read off them. The
GGN family needs nothing more; the Hessian family takes the normalisation's
second derivative as a dense per-sample residual of the node (see
:mod:`curvlib._hessian.residuals`).

The forward normalises with ``F.layer_norm`` on the ``[N, G, C/G · S]`` view
(:func:`curvlib.rules.layernorm.normalise`: from primitives inside torch.func transforms)
(no affine map; the same statistics, population variance and ``ε`` as
``group_norm``), then ``y = β + x̂ γ`` per channel. This gives the saved ``x̂``
and the output from one fused normalisation, agrees with the module to rounding,
and keeps every transform working: in torch 2.13 ``F.group_norm`` fails under
forward-mode autodiff on some non-contiguous inputs ("view size is not
compatible", the block products) and under ``vmap(hessian(·))`` ("Expected
X.is_contiguous"), while ``layer_norm`` without a weight is exact under all of
them.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from .._core.calls import argument
from .._core.errors import CurvatureError
from .._core.family import Family
from .._core.site import Recorder, RoleTensors, Rule, Site
from .layernorm import normalise


def _canon(t: Tensor) -> Tensor:
    """``[N, C, *S]`` -> ``[n, c, s]``."""
    return t.reshape(t.shape[0], t.shape[1], -1)


def _column_gradients(site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[V, N, C]`` per role: the individual gradients of every column of a root ``m [V, N, C, *S]``."""
    gc = m.reshape(m.shape[0], m.shape[1], m.shape[2], -1)
    out = {}
    if "weight" in roles:
        out["weight"] = (gc * _canon(site.saved["xhat"])).sum(3)
    if "bias" in roles:
        out["bias"] = gc.sum(3)
    return out


def grad_batch(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``{"weight": [N, C], "bias": [N, C]}``: ``Σ_s g x̂`` and ``Σ_s g``."""
    return {role: v[0] for role, v in _column_gradients(site, g.unsqueeze(0), roles).items()}


def grad(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[C]`` per role: the sum over the batch and the positions at once."""
    gc = _canon(g)
    out = {}
    if "weight" in roles:
        out["weight"] = (gc * _canon(site.saved["xhat"])).sum((0, 2))
    if "bias" in roles:
        out["bias"] = gc.sum((0, 2))
    return out


def batch_l2(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[N]`` per role: ``Σ_c (∂ℓ_n/∂p[c])²``."""
    return {role: (v**2).sum(1) for role, v in grad_batch(site, g, roles).items()}


def sum_grad_squared(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[C]`` per role: ``Σ_n (∂ℓ_n/∂p[c])²``."""
    return {role: (v**2).sum(0) for role, v in grad_batch(site, g, roles).items()}


def sum_squares_over_columns(site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[1, C]`` per role: ``Σ_v Σ_n (∂ℓ_n/∂p)²`` for a root ``m [V, *out]`` in one pass."""
    return {role: (v**2).sum((0, 1)).unsqueeze(0) for role, v in _column_gradients(site, m, roles).items()}


def batch_sum_squares_over_columns(site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[N, C]`` per role: ``Σ_v (∂ℓ_n/∂p)²`` for a root ``m [V, *out]`` in one pass."""
    return {role: (v**2).sum(0) for role, v in _column_gradients(site, m, roles).items()}


GROUPNORM = Rule(
    kind="groupnorm",
    grad_batch=grad_batch,
    grad=grad,
    batch_l2=batch_l2,
    sum_grad_squared=sum_grad_squared,
    sum_squares_over_columns=sum_squares_over_columns,
    batch_sum_squares_over_columns=batch_sum_squares_over_columns,
    any_batch_dim=False,
)


def forward(module: nn.GroupNorm, where: str, names: dict, tensors: dict, args, kwargs, rec: Recorder):
    """Run ``nn.GroupNorm`` functionally and record its site."""
    x = argument(args, kwargs, 0, "input")
    if x.dim() < 2 or x.shape[1] != module.num_channels:
        raise CurvatureError(
            f"GroupNorm '{where}' (num_channels={module.num_channels}, num_groups="
            f"{module.num_groups}) got an input of shape {list(x.shape)}; it needs "
            f"[N, {module.num_channels}, *] with the batch in dim 0."
        )
    n, c, groups = x.shape[0], x.shape[1], module.num_groups
    per_group = x[0].numel() // groups
    if n * per_group == 1:  # refused by the module itself (torch's _verify_batch_size)
        raise CurvatureError(
            f"GroupNorm '{where}' got an input of shape {list(x.shape)}: a batch of one sample "
            "whose groups hold a single value each, which torch refuses to normalise "
            "(\"Expected more than 1 value per channel\")."
        )
    xhat = normalise(x.reshape(n, groups, per_group), (per_group,), module.eps).reshape(x.shape)
    shape = (1, c) + (1,) * (x.dim() - 2)
    weight, bias = tensors.get("weight"), tensors.get("bias")
    if weight is None:
        out = xhat if bias is None else xhat + bias.view(shape)
    elif bias is None:
        out = xhat * weight.view(shape)
    else:
        out = torch.addcmul(bias.view(shape), xhat, weight.view(shape))
    saved = {"xhat": xhat} if "weight" in names else {}
    return rec.add(Site(GROUPNORM, names, where, saved=saved), out)


def norm_blocks(module: nn.GroupNorm) -> dict:
    """What the per-row blocks of its ``"norm"`` residual need: the groups."""
    return {"groups": module.num_groups}


#: The family's record (:class:`~curvlib._core.family.Family`), registered in :data:`curvlib.rules.FAMILIES`.
FAMILY = Family("groupnorm", (nn.GroupNorm,), forward, affine_in_parameters=True, norm_residual=norm_blocks,
                exact_block=True, shared_hessian=True)
