"""Brute-force references built from plain torch.func / autograd (float64).

The individual gradient of sample ``n`` is *defined* here as the gradient with
respect to a private copy ``θ_n`` of the parameters, in a batch where every
sample runs through its own copy:

    L(θ_1, …, θ_N) = lossfn(cat_n model_{θ_n}(x_n), y),   g_n = ∂L/∂θ_n.

This needs no knowledge of the loss's scaling and works for any model that
treats samples independently; each sample is run in its own Python call, so
no batching trick of curvlib's is reused.
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor, nn
from torch.func import functional_call as _functional_call

from oracles.on_device import plain_kernels


def functional_call(module, tensors, args):
    """torch.func.functional_call, restoring every parameter slot afterwards
    (torch 2.13 leaves plain tensors in a submodule that appears twice)."""
    slots = [(m, dict(m._parameters)) for m in module.modules()]
    try:
        return _functional_call(module, tensors, args)
    finally:
        for m, saved in slots:
            m._parameters.clear()
            m._parameters.update(saved)


@plain_kernels
def individual_gradients(model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor, names=None) -> Dict[str, Tensor]:
    """``{name: [N, *p.shape]}`` by per-sample parameter copies (see module doc)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    names = [n for n, p in model.named_parameters() if p.requires_grad] if names is None else names
    copies = [{n: params[n].clone().requires_grad_(True) for n in names} for _ in range(X.shape[0])]
    outs = [
        functional_call(model, {**params, **copies[i]}, (X[i : i + 1],))
        for i in range(X.shape[0])
    ]
    loss = lossfn(torch.cat(outs), y)
    flat = [c[n] for c in copies for n in names]
    grads = torch.autograd.grad(loss, flat, allow_unused=True)
    result = {}
    for j, n in enumerate(names):
        per = [grads[i * len(names) + j] for i in range(X.shape[0])]
        per = [torch.zeros_like(params[n]) if g is None else g for g in per]
        result[n] = torch.stack(per)
    return result


def first_order_reference(model, lossfn, X, y, names=None) -> Dict[str, Dict[str, Tensor]]:
    """Every first-order quantity and the gradient, from :func:`individual_gradients`."""
    gb = individual_gradients(model, lossfn, X, y, names)
    n = X.shape[0]
    params = dict(model.named_parameters())
    grad = torch.autograd.grad(lossfn(model(X), y), [params[k] for k in gb], allow_unused=True)
    return {
        "grad": {k: (torch.zeros_like(params[k]) if g is None else g) for k, g in zip(gb, grad)},
        "grad_batch": gb,
        "batch_l2": {k: (v**2).flatten(1).sum(1) for k, v in gb.items()},
        "sum_grad_squared": {k: (v**2).sum(0) for k, v in gb.items()},
        "variance": {k: (v**2).sum(0) / n - (v.sum(0) / n) ** 2 for k, v in gb.items()},
    }


def assert_close_dicts(actual: Dict[str, Tensor], expected: Dict[str, Tensor], what: str = "", rtol=1e-7, atol=1e-9):
    """Same keys, same shapes, same values; the message names the parameter."""
    assert list(actual) == list(expected), f"{what}: keys {list(actual)} != {list(expected)}"
    for k in expected:
        a, e = actual[k], expected[k]
        assert a.shape == e.shape, f"{what}[{k}]: shape {tuple(a.shape)} != {tuple(e.shape)}"
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{what}[{k}]: {m}")
