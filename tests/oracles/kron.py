"""Kronecker factors from their definitions (float64, plain torch.func): per-position offsets.

* :func:`output_factors`: ``(B_expand, B_reduce)`` of KFAC's two approximations (Eschenhagen
  et al., 2023) for a layer whose weight is shared by several positions of a sample, from a
  per-position output offset ``δ [N, O, S]``;
* :func:`input_factors`: ``(A_backpack, A_expand, A_reduce)`` from the layer's unfolded
  inputs ``u [N, I, S]``;
* :func:`kron_reference_shared`: KFLR's factors of a Linear over all its calls and positions;
* :func:`shared_factors`: the three approximations' factors of a Linear applied by several calls.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import jacrev

from oracles.second_order import layer_input, loss_hessian_blocks, unfold_conv_input

DT = torch.float64


def output_factors(model, lossfn, X, y, layer):
    """``(B_expand, B_reduce)``: per-position offsets δ ``[N, O, S]`` on the layer's output."""
    module = model.get_submodule(layer)
    channel_last = isinstance(module, nn.Linear)
    state = {}

    def hook(m, args, out):
        if "delta" not in state:
            return out
        d = state["delta"]  # [N, O, S]
        if channel_last:
            return out + d.transpose(1, 2).reshape(out.shape)
        return out + d.reshape(out.shape)

    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(X)
            z = module(layer_input(model, X, layer))
        n = z.shape[0]
        o = z.shape[-1] if channel_last else z.shape[1]
        s = z[0].numel() // o

        def f(delta):
            state["delta"] = delta
            return model(X)

        J = jacrev(f)(torch.zeros(n, o, s, dtype=DT)).reshape(n, -1, n, o, s)
    finally:
        handle.remove()
    Jn = torch.stack([J[i, :, i] for i in range(n)])  # [N, C, O, S]
    H = loss_hessian_blocks(lossfn, out, y)
    expand = torch.einsum("ncos,ncd,ndqs->oq", Jn, H, Jn)
    summed = Jn.sum(-1)
    return expand, torch.einsum("nco,ncd,ndq->oq", summed, H, summed)


def input_factors(model, X, layer):
    """``(A_backpack, A_expand, A_reduce)`` from the layer's unfolded inputs ``u [N, I, S]``."""
    module = model.get_submodule(layer)
    x = layer_input(model, X, layer)
    n = x.shape[0]
    if isinstance(module, nn.Linear):
        u = x.transpose(1, 2)
    elif isinstance(module, nn.ConvTranspose2d):
        # y[n, o, l] = Σ_{c,k} W[c, o, k] u[n, c·K + k, l]: u is the Jacobian of a
        # single-output-channel transposed convolution w.r.t. its weight
        c_in, k = x.shape[1], module.weight[0, 0].numel()

        def single(weight):
            return nn.functional.conv_transpose2d(x, weight, None, module.stride, module.padding,
                                                  module.output_padding, 1, module.dilation)

        w = torch.zeros((c_in, 1) + tuple(module.kernel_size), dtype=DT)
        u = jacrev(single)(w).reshape(n, -1, c_in * k).transpose(1, 2)
    else:
        u = unfold_conv_input(module, x)
    A = torch.einsum("nis,njs->ij", u, u) / n
    ubar = u.mean(-1)
    return A, A / u.shape[-1], ubar.T @ ubar / n


def kron_reference_shared(model, lossfn, X, y, module):
    """KFLR factors of a Linear over all its calls and positions, explicitly:
    ``B = Σ_n J_nᵀ H_n J_n`` with ``J_n`` the Jacobian of the output w.r.t. a
    per-sample offset ``δ_n [O]`` added at every position of every call, and
    ``A = (1/N) Σ_{calls, n, s} x xᵀ``."""
    inputs, state = [], {"delta": None}

    def hook(mod, args, out):
        inputs.append(args[0].detach())
        if state["delta"] is None:
            return out
        shape = (out.shape[0],) + (1,) * (out.dim() - 2) + (out.shape[-1],)
        return out + state["delta"].reshape(shape)

    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(X)
        n, o = X.shape[0], module.out_features

        def f(delta):
            state["delta"] = delta
            return model(X)

        J = torch.func.jacrev(f)(torch.zeros(n, o, dtype=X.dtype))
    finally:
        handle.remove()
    J = J.reshape(n, -1, n, o)
    Jn = torch.stack([J[i, :, i, :] for i in range(n)])  # [N, C, O]
    Hb = torch.stack([
        torch.func.hessian(lambda z: lossfn(torch.cat([out[:i], z.unsqueeze(0), out[i + 1:]]), y))(out[i]).reshape(Jn.shape[1], Jn.shape[1])
        for i in range(n)
    ])
    B = torch.einsum("nco,ncd,ndq->oq", Jn, Hb, Jn)
    calls = inputs[: len(inputs) // 2]  # the first (hook-free) forward's calls
    A = sum(torch.einsum("nsi,nsj->ij", x.reshape(n, -1, x.shape[-1]), x.reshape(n, -1, x.shape[-1])) for x in calls) / n
    return B, A


def shared_factors(model, lossfn, X, y, module, approx=None):
    """KFLR's ``(B, A)`` of a Linear applied by several calls, each call's positions read as more
    positions sharing the weight (``S`` in all), from per-(call, position) output offsets
    ``δ_{u,s}``: ``"expand"``: ``B = Σ_{n,u,s} J_{n,δ_{u,s}}ᵀ H_n J_{n,δ_{u,s}}``,
    ``A = (1/(N·S)) Σ_{n,u,s} x xᵀ``; ``None`` and ``"reduce"``: ``B`` from the summed offset
    ``Σ_{u,s} δ_{u,s}``, ``A = (1/N) Σ_{n,u,s} x xᵀ`` (``None``) or ``(1/N) Σ_n x̄ x̄ᵀ``, ``x̄`` the
    mean over all ``S`` positions (``"reduce"``)."""
    inputs, state = [], {"deltas": None, "call": 0}

    def hook(mod, args, out):
        if state["deltas"] is None:
            inputs.append(args[0].detach())
            return out
        d = state["deltas"][state["call"]]  # [N, S_u, O]
        state["call"] += 1
        return out + d.reshape(out.shape)

    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(X)
        n, o = X.shape[0], module.out_features
        xs = [x.reshape(n, -1, x.shape[-1]) for x in inputs]

        def f(*deltas):
            state["deltas"], state["call"] = deltas, 0
            return model(X)

        zeros = tuple(torch.zeros(n, x.shape[1], o, dtype=X.dtype) for x in xs)
        Js = torch.func.jacrev(f, argnums=tuple(range(len(zeros))))(*zeros)
    finally:
        handle.remove()
    # per sample n its own offsets: J [N, C, S, O], the calls' positions concatenated
    J = torch.cat([j.reshape(n, -1, n, x.shape[1], o) for j, x in zip(Js, xs)], dim=3)
    Jn = torch.stack([J[i, :, i] for i in range(n)])
    H = loss_hessian_blocks(lossfn, out, y)
    x = torch.cat(xs, dim=1)  # [N, S, I]
    if approx == "expand":
        return torch.einsum("ncso,ncd,ndsq->oq", Jn, H, Jn), torch.einsum("nsi,nsj->ij", x, x) / (n * x.shape[1])
    summed = Jn.sum(2)
    B = torch.einsum("nco,ncd,ndq->oq", summed, H, summed)
    if approx == "reduce":
        xbar = x.mean(1)
        return B, xbar.T @ xbar / n
    return B, torch.einsum("nsi,nsj->ij", x, x) / n
