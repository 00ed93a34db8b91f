"""Batch normalisation in evaluation mode (``nn.BatchNorm1d/2d/3d``), batched with an explicit ``n``.

With running statistics ``μ [C]`` and ``σ² [C]`` (buffers, not trained) the layer is
a per-channel affine map of its input, and samples do not interact:

    x̂[n, c, s] = (x[n, c, s] - μ[c]) / √(σ²[c] + ε),
    y[n, c, s] = x̂[n, c, s] γ[c] + β[c].

Shapes: ``x [N, C, *S]`` (``*S`` empty for ``BatchNorm1d`` on ``[N, C]``, one axis
``L`` for ``BatchNorm1d`` on ``[N, C, L]``, ``H, W`` for 2d, ``D, H, W`` for 3d),
``g = ∂L/∂y`` like ``x``, ``γ = weight [C]``, ``β = bias [C]``. The spatial axes
are flattened into ``s``, so the rule works on ``x̂ [n, c, s]`` and ``g [n, c, s]``.

Individual gradients (``[N, C]``, small, so every quantity is formed from them):

    ∂ℓ_n/∂γ[c] = Σ_s g[n, c, s] x̂[n, c, s],      ∂ℓ_n/∂β[c] = Σ_s g[n, c, s].

In training mode, or without running statistics (``track_running_stats=False``),
the layer normalises with the statistics of the current batch: every output
depends on every sample, so individual gradients are not defined (the
"individual gradient" of a sample would depend on which other samples share its
batch). :func:`check` refuses those configurations, also for ``affine=False``
layers, whose mixing would corrupt the quantities of the layers around them.

The forward never updates the running statistics (it runs with
``training=False``) and never writes to the module.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._core.calls import argument
from .._core.errors import CurvatureError
from .._core.family import Family
from .._core.site import Recorder, RoleTensors, Rule, Site

_EXPECTED_DIMS = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}

BATCH_STATISTICS_MSG = (
    "BatchNorm layer '{where}' ({kind}) {why}, so it normalises each sample with "
    "statistics of the whole batch: samples are mixed and per-sample quantities "
    "(individual gradients, their norms, curvature per sample) are ill-defined. "
    "curvlib supports BatchNorm only in evaluation mode with running statistics: "
    "call model.eval() before curvlib (or use a layer built with "
    "track_running_stats=True, trained to have running statistics)."
)


def check(module: nn.modules.batchnorm._BatchNorm, where: str) -> None:
    """Refuse a BatchNorm layer that would use batch statistics.

    Raises:
        CurvatureError: if ``module.training`` is true, or if the layer has no
            running statistics (``track_running_stats=False``).
    """
    kind = type(module).__name__
    if module.training:
        why = "is in training mode (module.training=True)"
    elif module.running_mean is None or module.running_var is None:
        why = (
            f"has no running statistics (track_running_stats={module.track_running_stats}, "
            "running_mean/running_var are None)"
        )
    else:
        return
    raise CurvatureError(BATCH_STATISTICS_MSG.format(where=where, kind=kind, why=why))


def _flat(site: Site, g: Tensor):
    """``x̂ [n, c, s]`` (or ``None`` when not saved) and ``g [n, c, s]``.

    The site is batch first with its channel axis kept at 1 (``channel_axes=1``: wherever
    the planner found the batch, never dim 1, the recorder moved it to the front).
    """
    xhat = site.saved.get("xhat")

    def canon(t: Tensor) -> Tensor:
        if t.dim() == 2:  # [N, C]
            return t.unsqueeze(-1)
        return t.flatten(2)

    return (canon(xhat) if xhat is not None else None), canon(g)


def grad_batch(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``{"weight": [N, C], "bias": [N, C]}``: ``Σ_s g x̂`` and ``Σ_s g``."""
    xhat, g = _flat(site, g)
    out = {}
    if "weight" in roles:
        out["weight"] = (g * xhat).sum(2)
    if "bias" in roles:
        out["bias"] = g.sum(2)
    return out


def grad(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``{"weight": [C], "bias": [C]}``: the individual gradients summed over ``n``."""
    return {role: v.sum(0) for role, v in grad_batch(site, g, roles).items()}


def batch_l2(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[N]`` per role: ``Σ_c (∂ℓ_n/∂p[c])²`` (the ``[N, C]`` gradients are small)."""
    return {role: (v**2).sum(1) for role, v in grad_batch(site, g, roles).items()}


def sum_grad_squared(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[C]`` per role: ``Σ_n (∂ℓ_n/∂p[c])²``."""
    return {role: (v**2).sum(0) for role, v in grad_batch(site, g, roles).items()}


def _column_grads(site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[V, N, C]`` per role for root columns ``m [V, *out]``: all columns in one
    product with ``x̂``."""
    mm = m.reshape(m.shape[0], m.shape[1], m.shape[2], -1)  # [V, N, C, s]
    out = {}
    if "weight" in roles:
        xhat = site.saved["xhat"]
        out["weight"] = (mm * xhat.reshape(xhat.shape[0], xhat.shape[1], -1)).sum(3)
    if "bias" in roles:
        out["bias"] = mm.sum(3)
    return out


def sum_squares_over_columns(site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[1, C]`` per role: ``Σ_v Σ_n (J_pᵀ m_v)²`` (one pass over all columns)."""
    return {role: v.square().sum((0, 1)).unsqueeze(0) for role, v in _column_grads(site, m, roles).items()}


def batch_sum_squares_over_columns(site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
    """``[N, C]`` per role: ``Σ_v (J_pᵀ m_v)²`` per sample."""
    return {role: v.square().sum(0) for role, v in _column_grads(site, m, roles).items()}


BATCHNORM = Rule(
    kind="batchnorm",
    grad_batch=grad_batch,
    grad=grad,
    batch_l2=batch_l2,
    sum_grad_squared=sum_grad_squared,
    sum_squares_over_columns=sum_squares_over_columns,
    batch_sum_squares_over_columns=batch_sum_squares_over_columns,
    any_batch_dim=True,
    channel_axes=1,
)


def eval_batch_norm(x: Tensor, mean: Tensor, var: Tensor, weight=None, bias=None, eps: float = 1e-5) -> Tensor:
    """``F.batch_norm(x, mean, var, weight, bias, training=False, eps=eps)`` written out as its
    per-channel affine map ``(x - μ) · γ / √(σ² + ε) + β``: the same values to rounding, and a
    backward of elementwise ops. Torch's own CPU ``native_batch_norm_backward`` (seen in 2.13)
    returns a wrong input gradient for a batch of one whose incoming gradient is channels-last
    with a batch stride other than ``C·H·W``, as ``bn(conv(x)).flatten(2).transpose(1, 2)``
    followed by a LayerNorm gives it (XCiT's, iFormer's, EfficientViT-MSRA's patch embeddings):
    every per-sample quantity of a one-sample batch upstream of the layer would be silently off."""
    shape = (1, -1) + (1,) * (x.dim() - 2)
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight
    out = (x - mean.view(shape)) * scale.view(shape)
    return out if bias is None else out + bias.view(shape)


def functional(x: Tensor, running_mean=None, running_var=None, weight=None, bias=None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """``F.batch_norm`` as a model calls it (a traced ``call_function`` node): in evaluation mode
    with running statistics, :func:`eval_batch_norm`; otherwise torch's own."""
    if not training and running_mean is not None and running_var is not None:
        return eval_batch_norm(x, running_mean, running_var, weight, bias, eps)
    return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)


def forward(module: nn.modules.batchnorm._BatchNorm, where: str, names: dict, tensors: dict, args, kwargs, rec: Recorder):
    """Run the BatchNorm layer in evaluation mode functionally and record its site.

    Only valid after :func:`check` accepted the module (evaluation mode, running
    statistics present); the running statistics are read, never updated.
    """
    check(module, where)
    x = argument(args, kwargs, 0, "input")
    dims = next((d for t, d in _EXPECTED_DIMS.items() if isinstance(module, t)), None)
    if dims is not None and x.dim() not in dims:
        raise CurvatureError(
            f"BatchNorm layer '{where}' ({type(module).__name__}) got an input with "
            f"{x.dim()} dims (shape {list(x.shape)}); it takes "
            + " or ".join(f"{d}D" for d in dims)
            + " input [N, C, *]."
        )
    mean, var = module.running_mean, module.running_var
    out = eval_batch_norm(x, mean, var, tensors.get("weight"), tensors.get("bias"), module.eps)
    saved = {}
    if "weight" in names:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        saved["xhat"] = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + module.eps)
    return rec.add(Site(BATCHNORM, names, where, saved=saved, ), out)


#: The family's record (:class:`~curvlib._core.family.Family`), registered in :data:`curvlib.rules.FAMILIES`.
FAMILY = Family("batchnorm", (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), forward, check,
                affine_in_input=True, affine_in_parameters=True, exact_block=True)
