"""Forward-mode rules for reverse over forward (:func:`curvlib.operators.plain.hessian_products_over_forward`):
``linear``, ``softmax``, ``log_softmax`` and ``layer_norm`` on dual tensors, their primal by torch's
kernel (no forward mode inside) and their tangent by a formula written with differentiable
operations, so that one backward through the forward differentiates both.

torch's own forward-mode derivatives of these kernels cannot serve: softmax's writes into its saved
result and layer_norm's gives a wrong derivative when differentiated again, and ``addmm``'s forms
its tangent ``dx Wᵀ + x dWᵀ + db`` from two products and two sums, four temporaries the size of the
output (at a language model's head, ``[N·T, V]`` each). Each rule here keeps what the backward of
its tangent reads and one buffer for the tangent. An argument without a tangent at the current
level (a constant) is taken as one.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import Tensor

__all__ = ["dual_linear", "dual_softmax", "dual_layer_norm", "softmax_formula", "batch_statistics_norm"]


def parts(t: Optional[Tensor]) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """``(primal, tangent)`` of ``t`` at the current dual level (tangent None for a constant)."""
    if not isinstance(t, Tensor):
        return t, None
    primal, tangent = fwAD.unpack_dual(t)
    return primal, tangent


def dual_linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:  # noqa: A002 - F.linear's names
    """``F.linear`` with tangent ``dx Wᵀ + x dWᵀ + db`` accumulated into one buffer, rows by
    ``out_features``: the first product (``addmm`` with ``db``) allocates it, the second adds
    into it in place (``addmm_``, whose backward reads its two factors, never the buffer; on the
    buffer itself, not a view of it, so the backward copies nothing)."""
    (xp, xt), (wp, wt), (bp, bt) = parts(input), parts(weight), parts(bias)
    out = F.linear(xp, wp, bp)
    products = [(a.reshape(-1, a.shape[-1]), b.t()) for a, b in ((xt, wp), (xp, wt)) if a is not None and b is not None]
    if not products:
        return out if bt is None else fwAD.make_dual(out, bt.expand(out.shape).contiguous())
    (a, b), rest = products[0], products[1:]
    tangent = torch.mm(a, b) if bt is None else torch.addmm(bt, a, b)
    for a, b in rest:
        tangent.addmm_(a, b)
    return fwAD.make_dual(out, tangent.view(out.shape))


def dual_softmax(x: Tensor, dim: int, dtype=None, log: bool = False) -> Tensor:
    """``softmax(x)`` along ``dim`` (or its log) with tangent ``p ⊙ (dx − ⟨p, dx⟩)`` (log:
    ``dx − ⟨p, dx⟩``), ``p`` the softmax; the backward of the tangent reads ``p`` (saved by the
    primal's own) and ``dx``. A row whose largest entry is not finite (all ``−inf``: masked out)
    gives zeros (log: ``−inf``), as :func:`softmax_formula`, which then computes every row."""
    if dtype is not None:
        x = x.to(dtype)
    xp, xt = parts(x)
    if not bool(torch.isfinite(xp.detach().amax(dim)).all()):
        return softmax_formula(x, dim, None, log)
    out = torch.log_softmax(xp, dim) if log else torch.softmax(xp, dim)
    if xt is None:
        return out
    if log:
        tangent = xt - (out.exp() * xt).sum(dim, keepdim=True)
    else:
        tangent = out * xt
        tangent = tangent - out * tangent.sum(dim, keepdim=True)
    return fwAD.make_dual(out, tangent)


def dual_layer_norm(input: Tensor, normalized_shape: Sequence[int],  # noqa: A002 - F.layer_norm's names
                    weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    r"""``F.layer_norm`` as ``x̂ ⊙ w + b``, ``x̂ = (x − μ) r`` by torch's kernel without the affine
    part, ``r = 1/√(σ² + ε)``; tangent $d\hat x \odot w + \hat x \odot dw + db$ with
    $d\hat x = r\,(dx - \overline{dx} - \hat x\, \overline{\hat x \odot dx})$ (means over the
    normalised dims; $\hat x$ has zero mean, so $\overline{\hat x \odot (dx - \overline{dx})} =
    \overline{\hat x \odot dx}$). Its backward reads ``x``, ``x̂``, ``dx`` and ``dx̂``."""
    (xp, xt), (wp, wt), (bp, bt) = parts(input), parts(weight), parts(bias)
    dims = tuple(range(-len(normalized_shape), 0))
    xhat = F.layer_norm(xp, normalized_shape, None, None, eps)
    out = xhat if wp is None else xhat * wp
    out = out if bp is None else out + bp
    tangent = None
    if xt is not None:
        r = torch.rsqrt(xp.var(dims, unbiased=False, keepdim=True) + eps)
        s = (xhat * xt).mean(dims, keepdim=True)
        tangent = xt * r - xt.mean(dims, keepdim=True) * r - xhat * (s * r)
        tangent = tangent if wp is None else tangent * wp
    for term in (None if wt is None else xhat * wt, bt):
        if term is not None:
            tangent = term if tangent is None else tangent + term
    return out if tangent is None else fwAD.make_dual(out, tangent.expand(out.shape))


def softmax_formula(x: Tensor, dim: int, dtype=None, log: bool = False) -> Tensor:
    """``softmax(x)`` (or its log) along ``dim`` as ``exp(x − m) / Σ exp(x − m)``, ``m`` the row's
    largest finite entry; a row of ``−inf`` gives zeros (log: ``−inf``)."""
    x = x if dtype is None else x.to(dtype)
    m = x.detach().amax(dim, keepdim=True)
    shifted = x - torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = shifted.exp().sum(dim, keepdim=True)
    return shifted - total.log() if log else shifted.exp() / torch.where(total > 0, total, torch.ones_like(total))


def batch_statistics_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                          eps: float = 1e-5) -> Tensor:
    """``F.batch_norm(x, None, None, weight, bias, training=True, eps=eps)`` (normalised by the
    statistics of ``x`` itself over every dim but 1, biased variance; a weight-standardised
    convolution's weight) from differentiable primitives: torch's forward-mode derivative of the
    kernel gives a wrong derivative when differentiated again, as layer_norm's does."""
    dims = (0,) + tuple(range(2, x.dim()))
    centred = x - x.mean(dims, keepdim=True)
    out = centred * torch.rsqrt((centred * centred).mean(dims, keepdim=True) + eps)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    out = out if weight is None else out * weight.reshape(shape)
    return out if bias is None else out + bias.reshape(shape)
