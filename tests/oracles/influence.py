"""Brute-force influence for a ``Sequential`` of ``Linear`` and element-wise layers, in float64.

Everything is written out from ``torch.func`` on one example at a time, independently of
curvlib: each example's loss ``ℓ_n`` (``reduction="sum"`` on that example alone), its gradient
``g_n`` over all parameters, the curvature ``G = (1/N) Σ_n F_n`` as a dense matrix (``F_n`` the
GGN ``J_nᵀ ∇²ℓ J_n`` or the empirical ``g_n g_nᵀ``), and per Linear layer the Kronecker factors
``A = mean_n a_n a_nᵀ`` (the layer's input) and ``B = (1/N) Σ_n`` of the GGN (or the empirical
outer product) with respect to the layer's output. Each strategy is a dense block-diagonal
matrix ``S`` and ``score = g_Qᵀ (S + λ)⁻¹ g_N`` by a dense solve.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, hessian, jacrev

__all__ = ["Problem", "strategy_matrix", "scores", "self_scores", "heuristic_dampings"]


def _sum_loss(lossfn: nn.Module) -> nn.Module:
    return type(lossfn)(reduction="sum")


class Problem:
    """A Sequential model, a loss and training examples; dense float64 quantities on demand."""

    def __init__(self, model: nn.Sequential, lossfn: nn.Module, X: Tensor, y: Tensor, params=None):
        self.model, self.loss = model, _sum_loss(lossfn)
        self.X, self.y = X, y
        named = dict(model.named_parameters())
        self.names = list(params) if params is not None else list(named)
        self.params = {n: named[n].detach() for n in self.names}
        self.frozen = {n: p.detach() for n, p in named.items() if n not in self.params}
        self.sizes = [self.params[n].numel() for n in self.names]

    # -- per example
    def _flat(self, tensors: Dict[str, Tensor]) -> Tensor:
        return torch.cat([tensors[n].reshape(-1) for n in self.names])

    def _out(self, params, x):
        return functional_call(self.model, {**self.frozen, **params}, (x[None],))

    def gradients(self, X=None, y=None) -> Tensor:
        """``[N, P]``: each example's loss gradient."""
        X, y = (self.X, self.y) if X is None else (X, y)
        rows = [self._flat(grad(lambda p: self.loss(self._out(p, x), t[None]))(self.params)) for x, t in zip(X, y)]
        return torch.stack(rows)

    def _ggn(self, x, t) -> Tensor:
        out = self._out(self.params, x)
        jac = jacrev(lambda p: self._out(p, x).reshape(-1))(self.params)
        J = torch.cat([jac[n].reshape(out.numel(), -1) for n in self.names], dim=1)
        H = hessian(lambda o: self.loss(o.reshape(out.shape), t[None]))(out.reshape(-1).detach())
        return J.T @ H @ J

    def curvature(self, fisher_type: str) -> Tensor:
        """``[P, P]``: ``(1/N) Σ_n F_n``."""
        if fisher_type == "empirical":
            g = self.gradients()
            return g.T @ g / g.shape[0]
        return sum(self._ggn(x, t) for x, t in zip(self.X, self.y)) / self.X.shape[0]

    # -- Kronecker factors of each Linear layer
    def _split(self, x):
        """The inputs of each layer and a function from layer ``l``'s output to the model's."""
        inputs, h = [], x[None]
        for layer in self.model:
            inputs.append(h)
            h = layer(h)
        return inputs

    def factors(self, index: int, fisher_type: str) -> Tuple[Tensor, Tensor]:
        """``(B, A)`` of Linear layer ``model[index]``."""
        A, B = 0, 0
        rest = self.model[index + 1:]
        for x, t in zip(self.X, self.y):
            a = self._split(x)[index].detach()
            z = self.model[index](a).detach()
            A = A + a.T @ a
            if fisher_type == "empirical":
                b = grad(lambda zz: self.loss(rest(zz), t[None]))(z).reshape(-1, 1)
                B = B + b @ b.T
            else:
                out = rest(z)
                Jz = jacrev(lambda zz: rest(zz).reshape(-1))(z).reshape(out.numel(), -1)
                H = hessian(lambda o: self.loss(o.reshape(out.shape), t[None]))(out.reshape(-1).detach())
                B = B + Jz.T @ H @ Jz
        n = self.X.shape[0]
        return B / n, A / n

    def offsets(self) -> Dict[str, slice]:
        out, start = {}, 0
        for n, size in zip(self.names, self.sizes):
            out[n] = slice(start, start + size)
            start += size
        return out


def _eigvecs(m: Tensor) -> Tensor:
    return torch.linalg.eigh((m + m.T) / 2).eigenvectors


def strategy_matrix(problem: Problem, strategy: str, fisher_type: str) -> Tensor:
    """The strategy's dense block-diagonal ``[P, P]`` (identity: ``I``)."""
    P = sum(problem.sizes)
    if strategy == "identity":
        return torch.eye(P, dtype=torch.float64)
    G = problem.curvature(fisher_type)
    S = torch.zeros(P, P, dtype=torch.float64)
    for name, sl in problem.offsets().items():
        block = G[sl, sl]
        if strategy == "diagonal":
            S[sl, sl] = torch.diag(torch.diagonal(block))
            continue
        index, kind = int(name.split(".")[0]), name.split(".")[1]
        B, A = problem.factors(index, fisher_type)
        if strategy == "kfac":
            S[sl, sl] = torch.kron(B, A) if kind == "weight" else B
            continue
        Q = torch.kron(_eigvecs(B), _eigvecs(A)) if kind == "weight" else _eigvecs(B)
        S[sl, sl] = Q @ torch.diag(torch.diagonal(Q.T @ block @ Q)) @ Q.T
    return S


def heuristic_dampings(problem: Problem, S: Tensor, scale: float = 0.1) -> List[float]:
    """Per block: ``scale · tr(S_p) / P_p`` (the mean eigenvalue)."""
    return [scale * float(torch.trace(S[sl, sl])) / (sl.stop - sl.start) for sl in problem.offsets().values()]


def _damped(problem: Problem, S: Tensor, dampings) -> Tensor:
    out = S.clone()
    for lam, sl in zip(dampings, problem.offsets().values()):
        out[sl, sl] += lam * torch.eye(sl.stop - sl.start, dtype=S.dtype)
    return out


def scores(problem: Problem, S: Tensor, dampings, gq: Tensor, gn: Tensor) -> Tensor:
    """``[Q, N]``: ``g_qᵀ (S + Λ)⁻¹ g_n`` with ``Λ`` the per-block dampings."""
    return gq @ torch.linalg.solve(_damped(problem, S, dampings), gn.T)


def self_scores(problem: Problem, S: Tensor, dampings, gn: Tensor) -> Tensor:
    return torch.einsum("np,pn->n", gn, torch.linalg.solve(_damped(problem, S, dampings), gn.T))
