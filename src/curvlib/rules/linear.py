"""Affine map ``y = x Wᵀ + b`` (``nn.Linear``), batched with an explicit ``n``.

Shapes: ``x [N, *S, I]``, ``g = ∂L/∂y [N, *S, O]``, ``W [O, I]``, ``b [O]``.
The shared positions ``*S`` (sequence, extra axes) are flattened into ``s``,
so every function works on ``x [n, s, i]`` and ``g [n, s, o]``.

Individual gradients: ``∂ℓ_n/∂W = Σ_s g[n, s] x[n, s]ᵀ``, ``∂ℓ_n/∂b = Σ_s g[n, s]``.

The norms and squares avoid ``[N, O, I]`` where they can:

* ``s = 1``: ``‖g_n x_nᵀ‖² = ‖g_n‖² ‖x_n‖²`` and ``Σ_n (g_n x_nᵀ)² = (g²)ᵀ (x²)``;
* ``s > 1`` and ``s² ≤ O·I``: ``‖Σ_s g_s x_sᵀ‖² = Σ_{s,t} (g_s·g_t)(x_s·x_t)``
  (Gram matrices, ``[N, s, s]``);
* otherwise the individual gradients are formed.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch.nn.functional as F
from opt_einsum import contract
from torch import Tensor, nn

from ._site import Recorder, RoleTensors, Rule, Site


def _flat(site: Site, g: Tensor) -> Tuple[Tensor, Tensor]:
    """``x [n, s, i]`` and ``g [n, s, o]`` with the batch moved to the front."""
    x = site.saved["x"]
    bdim = site.meta.get("batch_dim", 0)
    if bdim != 0:
        x, g = x.movedim(bdim, 0), g.movedim(bdim, 0)
    n = x.shape[0]
    return x.reshape(n, -1, x.shape[-1]), g.reshape(n, -1, g.shape[-1])


def grad_batch(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    x, g = _flat(site, g)
    out = {}
    if "weight" in roles:
        out["weight"] = contract("nso,nsi->noi", g, x)
    if "bias" in roles:
        out["bias"] = g.sum(1)
    return out


def grad(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    x, g = _flat(site, g)
    out = {}
    if "weight" in roles:
        out["weight"] = contract("nso,nsi->oi", g, x)
    if "bias" in roles:
        out["bias"] = g.sum((0, 1))
    return out


def batch_l2(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    x, g = _flat(site, g)
    s, i, o = x.shape[1], x.shape[2], g.shape[2]
    out = {}
    if "weight" in roles:
        if s == 1:
            out["weight"] = (g**2).sum((1, 2)) * (x**2).sum((1, 2))
        elif s * s <= o * i:
            out["weight"] = contract("nso,nto,nsi,nti->n", g, g, x, x)
        else:
            out["weight"] = (contract("nso,nsi->noi", g, x) ** 2).sum((1, 2))
    if "bias" in roles:
        out["bias"] = (g.sum(1) ** 2).sum(1)
    return out


def sum_grad_squared(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
    x, g = _flat(site, g)
    out = {}
    if "weight" in roles:
        if x.shape[1] == 1:
            out["weight"] = contract("nso,nsi->oi", g**2, x**2)
        else:
            out["weight"] = (contract("nso,nsi->noi", g, x) ** 2).sum(0)
    if "bias" in roles:
        out["bias"] = (g.sum(1) ** 2).sum(0)
    return out


LINEAR = Rule(
    kind="linear",
    grad_batch=grad_batch,
    grad=grad,
    batch_l2=batch_l2,
    sum_grad_squared=sum_grad_squared,
    any_batch_dim=True,
)


def kron(site: Site, role: str, m: Tensor) -> list:
    """BackPACK's Kronecker factors from the pulled-back root ``m [V, N, O]``.

    ``B = Σ_{v,n} m m ᵀ [O, O]`` and ``A = (1/N) Σ_n x xᵀ [I, I]``;
    weight: ``[B, A]``, bias: ``[B]``. Only 2d inputs (checked at planning).
    """
    B = contract("vno,vnp->op", m, m)
    return [B] if role == "bias" else [B, kron_input(site)]


def kron_input(site: Site) -> Tensor:
    """Input-side Kronecker factor ``A = (1/N) Σ_n x xᵀ [I, I]``."""
    x = site.saved["x"]
    return contract("ni,nj->ij", x, x) / x.shape[0]


def kron_from_output_matrix(site: Site, role: str, G: Tensor) -> list:
    """KFRA factors from the batch-averaged output matrix ``G [O, O]``."""
    return [G] if role == "bias" else [G, kron_input(site)]


def forward(module: nn.Linear, where: str, names: dict, tensors: dict, args, kwargs, rec: Recorder):
    """Run ``nn.Linear`` functionally and record its site."""
    (x,) = _bind_input(args, kwargs, "input")
    out = F.linear(x, tensors["weight"], tensors.get("bias"))
    meta = {"batch_dim": 0}
    if x.dim() != 2:
        meta["kron_error"] = (
            f"Kronecker factors need 2d inputs [N, in_features] (as in BackPACK), got "
            f"shape {list(x.shape)}."
        )
    return rec.add(Site(LINEAR, names, where, saved={"x": x}, meta=meta), out)


def _bind_input(args, kwargs, name: str):
    """The single tensor argument of a ``forward(input)``."""
    if args:
        return (args[0],)
    return (kwargs[name],)
