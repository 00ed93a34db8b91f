"""The whole network's GGN and Hessian as dense matrices, by reverse-mode ``torch.func`` on the
model's own forward (float64 references for the operators' tests)."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor, nn


def dense_ggn_and_hessian(model: nn.Module, lossfn, X, y) -> Tuple[Tensor, Tensor]:
    """``(G, ∇²L)`` over every parameter flattened in ``named_parameters`` order: ``J = jacrev(f)``,
    ``H_out = hessian(L)`` at the output, ``G = Jᵀ H_out J``; ``∇²L`` by ``jacrev`` of ``jacrev``."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    theta = torch.cat([p.reshape(-1) for p in params.values()])

    def f(t):
        values, start = {}, 0
        for name, p in params.items():
            values[name] = t[start:start + p.numel()].reshape(p.shape)
            start += p.numel()
        return torch.func.functional_call(model, values, (X,))

    out = f(theta).detach()
    J = torch.func.jacrev(f)(theta).reshape(out.numel(), -1)
    H_out = torch.func.hessian(lambda o: lossfn(o, y))(out).reshape(out.numel(), out.numel())
    return J.T @ H_out @ J, torch.func.jacrev(torch.func.jacrev(lambda t: lossfn(f(t), y)))(theta)
