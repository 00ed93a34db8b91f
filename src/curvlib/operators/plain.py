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
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .._core.errors import CurvatureError
from .._core.tensors import is_wrapped
from .._transform.network import Batch
from . import _duals

__all__ = ["needs_plain_autograd", "output_curvature", "hessian_products", "hessian_products_over_forward",
           "jacobian_products", "transposed_products", "custom_functions"]

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
    """``H V``, the product function of one vector dict (for the symmetry check) and the names of
    the custom ``autograd.Function``\ s the loss's graph runs (:func:`custom_functions`)."""
    leaves = _leaves(batch, V)
    with torch.enable_grad():
        loss = batch.loss(batch.output(leaves))
        gradient = _grads(loss, list(leaves.values()), None, create_graph=True)
    functions = custom_functions(loss)
    del loss
    used = [k for k, g in enumerate(gradient) if g.requires_grad]
    names = list(leaves)

    def one(v: Directions) -> Directions:
        if not used:
            return {n: torch.zeros_like(leaves[n]) for n in names}
        got = _grads([gradient[k] for k in used], list(leaves.values()), [v[names[k]] for k in used])
        return {n: g.detach() for n, g in zip(names, got)}

    cols = [one(dict(zip(names, col))) for col in _columns(V)]
    return {n: torch.stack([c[n] for c in cols]) for n in names}, one, functions


def custom_functions(root: Tensor) -> List[str]:
    """The names of the custom ``autograd.Function``\ s in ``root``'s autograd graph, in the order
    met from ``root`` (their backward nodes carry the Function as ``_forward_cls``)."""
    found: List[str] = []
    seen, stack = set(), [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        cls = getattr(node, "_forward_cls", None)
        if cls is not None and cls.__name__ not in found:
            found.append(cls.__name__)
        stack.extend(fn for fn, _ in node.next_functions)
    return found


class _Composed(TorchFunctionMode):
    """``linear``, ``softmax``, ``log_softmax``, ``layer_norm`` and ``batch_norm`` on the input's own
    statistics by the forward-mode rules of :mod:`curvlib.operators._duals`: torch's forward-mode
    derivatives of those kernels cannot be differentiated again, which reverse over forward needs
    (softmax's writes into its saved result; layer_norm's and batch_norm's give a wrong
    derivative), and ``addmm``'s makes four temporaries the size of the output for its tangent."""

    _SOFT = (torch.softmax, F.softmax, Tensor.softmax)
    _LOG = (torch.log_softmax, F.log_softmax, Tensor.log_softmax)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self._SOFT or func in self._LOG:  # (the mode is off inside this method: plain ops)
            rest = list(args[1:])
            dim = kwargs.pop("dim", rest[0] if rest else None)
            dtype = kwargs.pop("dtype", None) or next((a for a in rest[1:] if isinstance(a, torch.dtype)), None)
            if isinstance(dim, int):
                return _duals.dual_softmax(args[0], dim, dtype, log=func in self._LOG)
        if func in (F.layer_norm, torch.layer_norm):
            return _duals.dual_layer_norm(*args[:5], **{k: v for k, v in kwargs.items() if k != "cudnn_enable"})
        if func is F.linear:
            return _duals.dual_linear(*args, **kwargs)
        if func is F.batch_norm:
            bn = dict(zip(("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
                          args), **kwargs)
            if bn.get("training") and bn.get("running_mean") is None and bn.get("running_var") is None:
                return _duals.batch_statistics_norm(bn["input"], bn.get("weight"), bn.get("bias"), bn.get("eps", 1e-5))
        return func(*args, **kwargs)


def hessian_products_over_forward(batch: Batch, V: Directions) -> Directions:
    """``H V`` one vector at a time, reverse over forward: ``H v = ∇_θ ⟨∇_f L, J v⟩``, the gradient of
    the loss's derivative along ``v``, with the output's tangent ``J v`` from forward mode. Its two
    terms are one backward of the dual graph: ``∇_θ ⟨∇_f L, J v⟩ = Jᵀ (∇²_f L · J v) + (∂(J v)/∂θ)ᵀ ∇_f L``,
    the output ``f`` pulled back with the loss Hessian's product in closed form (the GGN's,
    ``diag(p) − p pᵀ`` for softmax cross-entropy) and the tangent ``J v`` with the loss's gradient,
    both computed off the graph. So the loss never runs in forward mode nor keeps a graph of its
    gradient, and neither ``∇_θ L`` nor its tangent is formed, as forward over reverse forms both.
    The forward holds the primal and tangent activations; linear, softmax and layer_norm run by
    forward-mode rules of their own (:class:`_Composed`). Raises torch's error where a model
    operation has no differentiable forward-mode derivative, or where forward mode is already in
    use (torch has one dual level); a derivative torch gets wrong is not seen here (``Hessian``
    compares the two ways once)."""
    leaves = _leaves(batch, V)
    names = list(leaves)
    cols = []
    for col in _columns(V):
        with torch.enable_grad():
            with fwAD.dual_level(), _Composed():
                duals = {n: fwAD.make_dual(leaves[n], _own_storage(v.to(leaves[n].dtype))) for n, v in zip(names, col)}
                dual = list(fwAD.unpack_dual(batch.output(duals)))  # [f, J v], emptied by _seeded_root
                del duals
            root = _seeded_root(batch, dual)
        if root is None:  # (the output does not move along v)
            cols.append([torch.zeros_like(leaf) for leaf in leaves.values()])
            continue
        got = torch.autograd.grad(root, list(leaves.values()), allow_unused=True)  # (the graph freed as it goes)
        del root
        cols.append([torch.zeros_like(x) if g is None else g for x, g in zip(leaves.values(), got)])
    if len(cols) == 1:  # (one vector: its products as they are, no copy)
        return {n: cols[0][k].unsqueeze(0) for k, n in enumerate(names)}
    return {n: torch.stack([c[k] for c in cols]) for k, n in enumerate(names)}


def _seeded_root(batch: Batch, dual: List[Optional[Tensor]]) -> Optional[Tensor]:
    """A scalar whose backward sends ``∇²_f L · J v`` to ``f`` and ``∇_f L`` to ``J v`` (None where
    ``f`` does not move along ``v``) for ``dual = [f, J v]``, which it empties: one backward from
    it is ``H v``. The graph saves neither ``f`` nor ``J v``, so ``J v`` is freed once the loss
    Hessian has read it, ``f`` once the loss's gradient has."""
    out, jv = dual
    dual.clear()
    if jv is None or not out.requires_grad:
        return None
    primal, tangent = out.detach(), jv.detach()
    held: List[Tensor] = [batch.loss_derivative(primal, tangent)]
    if not jv.requires_grad:  # (the output linear along v: no second term)
        return _Seed.apply(held, out)
    root = _Seed.apply(held, out, jv)
    del out, jv, tangent
    held.append(batch.loss_derivative(primal))
    return root


class _Seed(torch.autograd.Function):
    """``0`` from ``roots``; its backward returns the given cotangents once and lets go of them, so
    each is freed when the graph's first node that reads it has run (a cotangent passed to
    ``torch.autograd.grad`` stays referenced for the whole backward)."""

    @staticmethod
    def forward(ctx, held: List[Tensor], *roots: Tensor) -> Tensor:  # noqa: D102 - the class doc
        ctx.held = held
        return roots[0].new_zeros(())

    @staticmethod
    def backward(ctx, _grad: Tensor):  # noqa: D102 - the class doc
        held, ctx.held = ctx.held, None
        return (None, *held)


def _own_storage(t: Tensor) -> Tensor:
    """``t``'s memory as a tensor that owns a storage of exactly its size: forward mode copies a
    tangent whose storage differs in size or offset from its primal's (a parameter's slice of a
    flat vector), and an alias through DLPack avoids that copy of the whole vector."""
    if not t.is_contiguous() or t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    try:
        return torch.from_dlpack(t.detach())
    except (RuntimeError, TypeError, BufferError):  # (a tensor DLPack cannot export: forward mode copies it)
        return t
