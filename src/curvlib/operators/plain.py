"""The operators' products by plain autograd, for models ``torch.func`` cannot differentiate: a
custom ``autograd.Function`` written the old way (``forward(ctx, ...)``, no ``setup_context``:
Bloom's GeLU) is refused by every ``torch.func`` transform, while ``torch.autograd.grad`` runs it.

Each product keeps one forward with its graph: ``J v`` is the derivative of ``⟨Jᵀu, v⟩`` in ``u``
(reverse over reverse, exact: ``u ↦ Jᵀu`` is linear), ``Jᵀw`` one backward, ``H v`` the
derivative of ``⟨∇L, v⟩``. The vectors are taken one at a time (no ``vmap``).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor

from .._core.errors import CurvatureError
from .._core.tensors import is_wrapped
from .._transform.network import Batch

__all__ = ["needs_plain_autograd", "output_curvature", "hessian_products", "jacobian_products", "transposed_products"]

Directions = Dict[str, Tensor]


def needs_plain_autograd(exc: Optional[BaseException]) -> bool:
    """Whether ``exc`` (or an error it was raised from) is ``torch.func`` refusing a custom
    ``autograd.Function`` without ``setup_context``."""
    while exc is not None:
        cause = getattr(exc, "exc", exc)
        if isinstance(cause, RuntimeError) and "must override the setup_context" in str(cause):
            return True
        exc = exc.__cause__
    return False


def _leaves(batch: Batch, V: Directions) -> Dict[str, Tensor]:
    if any(is_wrapped(v) for v in V.values()):
        raise CurvatureError(
            "The model applies a custom autograd.Function without setup_context, which torch.func cannot "
            "transform: its products run on plain autograd and cannot be vmapped. Multiply the vectors "
            "as a block (A @ V with V [P, K]) instead.")
    return {n: batch.values[n].detach().requires_grad_(True) for n in V}


def _grads(outputs, inputs: List[Tensor], cotangent, create_graph: bool = False) -> List[Tensor]:
    """``torch.autograd.grad`` with zeros for inputs the outputs do not reach."""
    got = torch.autograd.grad(outputs, inputs, cotangent, retain_graph=True, create_graph=create_graph, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, got)]


def _columns(V: Directions) -> List[List[Tensor]]:
    k = next(iter(V.values())).shape[0]
    return [[v[j] for v in V.values()] for j in range(k)]


def _forward(batch: Batch, leaves: Dict[str, Tensor]):
    out = batch.output(leaves)
    u = torch.zeros_like(out, requires_grad=True)
    jtu = _grads(out, list(leaves.values()), u, create_graph=True)
    return out, u, jtu


def _jv(out: Tensor, u: Tensor, jtu: List[Tensor], V: Directions) -> Tensor:
    used = [k for k, g in enumerate(jtu) if g.requires_grad]
    if not used:
        return torch.zeros((next(iter(V.values())).shape[0],) + tuple(out.shape), dtype=out.dtype, device=out.device)
    return torch.stack([torch.autograd.grad([jtu[k] for k in used], u, [col[k] for k in used], retain_graph=True)[0]
                        for col in _columns(V)])


def output_curvature(batch: Batch, V: Directions, apply: Callable[[Tensor, Tensor], Tensor]) -> Directions:
    """``Jᵀ D J V`` (as :meth:`curvlib.operators.NetworkOperator.output_curvature`)."""
    leaves = _leaves(batch, V)
    with torch.enable_grad():
        out, u, jtu = _forward(batch, leaves)
        djv = apply(out.detach(), _jv(out, u, jtu, V).detach())
        pulled = [_grads(out, list(leaves.values()), c) for c in djv]
    return {n: torch.stack([p[k] for p in pulled]) for k, n in enumerate(leaves)}


def jacobian_products(batch: Batch, V: Directions) -> Tensor:
    """``J V``, ``[K, N, *out]``."""
    leaves = _leaves(batch, V)
    with torch.enable_grad():
        out, u, jtu = _forward(batch, leaves)
        return _jv(out, u, jtu, V).detach()


def transposed_products(batch: Batch, names, W: Tensor) -> Directions:
    """``Jᵀ W`` for ``W [K, N, *out]``."""
    leaves = _leaves(batch, {n: W for n in names})
    with torch.enable_grad():
        out = batch.output(leaves)
        pulled = [_grads(out, list(leaves.values()), w.reshape(out.shape)) for w in W]
    return {n: torch.stack([p[k] for p in pulled]) for k, n in enumerate(leaves)}


def hessian_products(batch: Batch, V: Directions):
    """``H V`` and the product function of one vector dict (for the symmetry check)."""
    leaves = _leaves(batch, V)
    with torch.enable_grad():
        gradient = _grads(batch.loss(batch.output(leaves)), list(leaves.values()), None, create_graph=True)
    used = [k for k, g in enumerate(gradient) if g.requires_grad]
    names = list(leaves)

    def one(v: Directions) -> Directions:
        if not used:
            return {n: torch.zeros_like(leaves[n]) for n in names}
        got = _grads([gradient[k] for k in used], list(leaves.values()), [v[names[k]] for k in used])
        return {n: g.detach() for n, g in zip(names, got)}

    cols = [one(dict(zip(names, col))) for col in _columns(V)]
    return {n: torch.stack([c[n] for c in cols]) for n in names}, one
