"""Pure brute-force oracles for the composition matrix, float64.

``brute(name, model, params, X, y)`` returns ``{param: tensor}`` for an
extension's result name, computed with ``torch.func`` only and *pure* in
``params`` (name -> tensor, buffers included as entries) and ``X``: any
``torch.func`` transform (``vmap``, ``grad``, ``jvp``, ``jacrev``, ``hessian``)
of it is the oracle for the same transform of curvlib's ``f(X, y, params=p)``.

Notation: the loss is ``L = Σ_n ℓ_n`` with ``ℓ_n = c · lossfn(f(x_n), y_n)``
(``c = 1/N`` for ``reduction="mean"``: the reduction's factor per sample, for
any output shape). Samples are looped over in Python, never ``vmap``ped: torch
2.13 differentiates ``vmap(grad(...))`` through ``F.layer_norm`` wrongly at
second order, and a loop keeps the oracle off that path.

* individual gradients ``g_n = ∇ℓ_n``; the first-order quantities from them;
* per-sample GGN ``G_n = J_nᵀ H_n J_n`` (``J_n = jacrev`` of sample ``n``'s
  output, ``H_n = hessian`` of ``ℓ_n`` w.r.t. that output);
* per-sample Hessian blocks ``jacrev(jacrev(ℓ_n))`` per parameter;
* products: the dense block (applied to a fixed ``V`` by :func:`canonical`);
* ``sqrt_ggn_exact``: ``G_n`` (roots are not unique; curvlib's root ``S`` is
  compared through ``Σ_v S_v S_vᵀ``, a function of the result invariant to it);
* ``pchmp`` (models whose only nonlinearities are ``nn.Tanh`` modules):
  ``G + Σ_act J_{p→a}ᵀ diag(clip(φ''(a) ⊙ g)) J_{p→a}`` (Chen et al.),
  ``g = ∂L/∂φ(a)``;
* Kronecker factors: :mod:`oracles.compose_kron`.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Dict, List

import torch
from torch import Tensor, nn
from torch.func import grad, hessian, jacrev
from torch.nn.attention import SDPBackend, sdpa_kernel

from oracles.first_order import functional_call

DT = torch.float64
Params = Dict[str, Tensor]


class PrimitiveLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` written out from primitives: torch 2.13 differentiates ``F.layer_norm``
    wrongly at third order under ``grad(vmap(grad))``; the oracle must not."""

    def forward(self, x: Tensor) -> Tensor:
        dims = tuple(range(-len(self.normalized_shape), 0))
        mu = x.mean(dims, keepdim=True)
        var = ((x - mu) ** 2).mean(dims, keepdim=True)
        h = (x - mu) / torch.sqrt(var + self.eps)
        return h * self.weight + self.bias if self.elementwise_affine else h


_TWINS: Dict[int, tuple] = {}


def twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose LayerNorms are :class:`PrimitiveLayerNorm` (same names and values).
    Call it once outside any ``torch.func`` transform (a copy made inside one holds its tensors)."""
    if isinstance(model, _Twin) or not any(isinstance(m, nn.LayerNorm) for m in model.modules()):
        return model
    if id(model) not in _TWINS or _TWINS[id(model)][0] is not model:
        copy = deepcopy(model)
        for m in copy.modules():
            if type(m) is nn.LayerNorm:
                m.__class__ = PrimitiveLayerNorm
        copy.__class__ = type("Twin" + type(copy).__name__, (type(copy), _Twin), {})
        _TWINS.clear()
        _TWINS[id(model)] = (model, copy)
    return _TWINS[id(model)][1]


class _Twin:
    pass


def split(model: nn.Module, params: Params):
    """``params`` -> (trainable entries, buffer entries): buffers are model buffers' names."""
    buffers = {n for n, _ in model.named_buffers()}
    return ({k: v for k, v in params.items() if k not in buffers},
            {k: v for k, v in params.items() if k in buffers})


def full_params(model: nn.Module) -> Params:
    """Every parameter and buffer of ``model``, detached (the default ``params``)."""
    return {**{n: p.detach() for n, p in model.named_parameters()},
            **{n: b.detach() for n, b in model.named_buffers()}}


def output(model, params: Params, x: Tensor) -> Tensor:
    """The model output at ``params`` (buffers included) on a batch ``x``."""
    full = full_params(model)
    full.update(params)
    fast = torch.backends.mha.get_fastpath_enabled()
    # The math of attention only: the fused kernels (SDPA's, the encoder layer's fast path
    # taken when nothing requires grad) have no forward AD or double backward.
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            return functional_call(model, full, (x,))
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)


def _scale(lossfn: nn.Module, n: int) -> float:
    return 1.0 / n if getattr(lossfn, "reduction", "mean") == "mean" else 1.0


def sample_loss(model, lossfn, params: Params, X: Tensor, y: Tensor, i: int) -> Tensor:
    """``ℓ_i = c · lossfn(f(x_i), y_i)``."""
    out = output(model, params, X[i : i + 1])
    return _scale(lossfn, X.shape[0]) * lossfn(out, y[i : i + 1])


def individual_gradients(model, lossfn, params, X, y) -> Params:
    """``{p: [N, *p.shape]}``: ``g_n = ∇_p ℓ_n``."""
    train, bufs = split(model, params)
    per = [grad(lambda t, i=i: sample_loss(model, lossfn, {**bufs, **t}, X, y, i))(train) for i in range(X.shape[0])]
    return {k: torch.stack([g[k] for g in per]) for k in train}


def _jacobian_and_loss_hessian(model, lossfn, params, X, y, i):
    """Sample ``i``: ``J [C, *p]`` per trainable ``p`` and ``H [C, C]`` (scaled like ``ℓ_i``)."""
    train, bufs = split(model, params)
    out = output(model, params, X[i : i + 1])
    c = _scale(lossfn, X.shape[0])

    def f(t):
        return output(model, {**bufs, **t}, X[i : i + 1]).reshape(-1)

    J = jacrev(f)(train)
    H = hessian(lambda o: c * lossfn(o.reshape(out.shape), y[i : i + 1]))(out.reshape(-1))
    return J, H


def ggn_per_sample(model, lossfn, params, X, y) -> Params:
    """``{p: [N, P, P]}``: ``G_n = J_nᵀ H_n J_n``."""
    train, _ = split(model, params)
    per = {k: [] for k in train}
    for i in range(X.shape[0]):
        J, H = _jacobian_and_loss_hessian(model, lossfn, params, X, y, i)
        for k in train:
            Jk = J[k].reshape(J[k].shape[0], -1)
            per[k].append(Jk.T @ H @ Jk)
    return {k: torch.stack(v) for k, v in per.items()}


def hessian_per_sample(model, lossfn, params, X, y) -> Params:
    """``{p: [N, P, P]}``: ``∇²_p ℓ_n`` (reverse over reverse), other parameters fixed."""
    train, bufs = split(model, params)
    result = {}
    for k, v in train.items():
        blocks = []
        for i in range(X.shape[0]):
            def loss_of(t, i=i, k=k):
                return sample_loss(model, lossfn, {**params, k: t}, X, y, i)

            blocks.append(jacrev(jacrev(loss_of))(v).reshape(v.numel(), v.numel()))
        result[k] = torch.stack(blocks)
    return result


class _Taps:
    """Forward hooks on every ``nn.Tanh``: record its input, add an offset to its output."""

    def __init__(self, model: nn.Module, deltas=None):
        self.inputs: List[Tensor] = []
        self.deltas = deltas
        self.handles = [m.register_forward_hook(self) for m in model.modules() if isinstance(m, nn.Tanh)]

    def __call__(self, module, args, out):
        k = len(self.inputs)
        self.inputs.append(args[0])
        return out if self.deltas is None else out + self.deltas[k]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def tanh_residual(model, lossfn, params, X, y, modify: str = "clip") -> Params:
    """``{p: [P, P]}``: ``Σ_act J_{p→a}ᵀ diag(mod(φ''(a) ⊙ g)) J_{p→a}`` over the ``nn.Tanh``
    modules (the only nonlinearities allowed), ``φ'' = −2 tanh (1 − tanh²)``."""
    train, bufs = split(model, params)

    def activations(t):
        with _Taps(model) as taps:
            output(model, {**bufs, **t}, X)
            return tuple(taps.inputs)

    a = activations(train)

    def loss_of(deltas):
        with _Taps(model, deltas):
            return lossfn(output(model, params, X), y)

    g = grad(loss_of)([torch.zeros_like(t) for t in a])
    Ja = jacrev(activations)(train)
    result = {}
    for k, v in train.items():
        R = torch.zeros(v.numel(), v.numel(), dtype=v.dtype)
        for ai, gi, Ji in zip(a, g, Ja):
            th = torch.tanh(ai)
            r = (-2 * th * (1 - th**2) * gi).flatten()
            r = r.clamp(min=0) if modify == "clip" else r.abs()
            J = Ji[k].reshape(ai.numel(), v.numel())
            R = R + J.T @ (r[:, None] * J)
        result[k] = R
    return result


def _first(name, gb, n):
    if name == "grad_batch":
        return gb
    if name == "batch_l2":
        return {k: (v**2).flatten(1).sum(1) for k, v in gb.items()}
    if name == "sum_grad_squared":
        return {k: (v**2).sum(0) for k, v in gb.items()}
    return {k: (v**2).sum(0) / n - (v.sum(0) / n) ** 2 for k, v in gb.items()}  # variance


def _diag(blocks: Params, train: Params, batch: bool) -> Params:
    out = {}
    for k, B in blocks.items():
        d = B.diagonal(dim1=-2, dim2=-1)
        out[k] = d.reshape((B.shape[0],) + tuple(train[k].shape)) if batch else d.sum(0).reshape(train[k].shape)
    return out


FIRST = ("grad_batch", "batch_l2", "sum_grad_squared", "variance")
BRUTE_NAMES = FIRST + ("grad", "loss", "diag_ggn_exact", "diag_ggn_exact_batch", "sqrt_ggn_exact", "ggnmp",
                       "diag_h", "diag_h_batch", "hmp", "pchmp", "kflr", "kfac_empirical")


def brute(name: str, model: nn.Module, lossfn: nn.Module, params: Params, X: Tensor, y: Tensor,
          generator=None) -> Params:
    """``{param: tensor}``: extension ``name``'s value by brute force (see module doc); products
    return the dense block ``[P, P]``, ``sqrt_ggn_exact`` the per-sample GGN ``[N, P, P]``,
    Kronecker extensions lists of factors. ``generator`` is unused (exact quantities only)."""
    model = twin(model)
    train, _ = split(model, params)
    n = X.shape[0]
    if name == "loss":
        return {"loss": lossfn(output(model, params, X), y)}
    if name in FIRST or name == "grad":
        gb = individual_gradients(model, lossfn, params, X, y)
        return {k: v.sum(0) for k, v in gb.items()} if name == "grad" else _first(name, gb, n)
    if name in ("diag_ggn_exact", "diag_ggn_exact_batch", "sqrt_ggn_exact", "ggnmp", "pchmp"):
        Gn = ggn_per_sample(model, lossfn, params, X, y)
        if name == "sqrt_ggn_exact":
            return Gn
        if name == "ggnmp":
            return {k: v.sum(0) for k, v in Gn.items()}
        if name == "pchmp":
            R = tanh_residual(model, lossfn, params, X, y)
            return {k: v.sum(0) + R[k] for k, v in Gn.items()}
        return _diag(Gn, train, name.endswith("_batch"))
    if name in ("diag_h", "diag_h_batch", "hmp"):
        Hn = hessian_per_sample(model, lossfn, params, X, y)
        if name == "hmp":
            return {k: v.sum(0) for k, v in Hn.items()}
        return _diag(Hn, train, name.endswith("_batch"))
    if name in ("kflr", "kfac_empirical"):
        from oracles.compose_kron import kron_brute

        return kron_brute(name, model, lossfn, params, X, y)
    raise KeyError(f"no brute force for {name!r}")


PRODUCTS = ("ggnmp", "hmp", "pchmp")


def canonical(name: str, value, vectors: Params, brute_side: bool) -> Dict[str, Tensor]:
    """A result as a flat dict of plain tensors that curvlib and the brute force share:
    products applied to ``vectors[p] [V, *p]``, square roots as ``Σ_v S_v S_vᵀ`` per sample,
    Kronecker lists as one entry per factor (``p#i``)."""
    if name == "loss":
        return {"loss": value["loss"] if isinstance(value, dict) else value}
    out: Dict[str, Tensor] = {}
    for k, v in value.items():
        if name in PRODUCTS:
            V = vectors[k]
            out[k] = (V.reshape(V.shape[0], -1) @ v).reshape(V.shape) if brute_side else v(V)
        elif name.startswith("sqrt_ggn") and not brute_side:
            S = v.reshape(v.shape[0], v.shape[1], -1)
            out[k] = torch.einsum("vnp,vnq->npq", S, S)
        elif isinstance(v, (list, tuple)):
            out.update({f"{k}#{i}": f for i, f in enumerate(v)})
        else:
            out[k] = v
    return out


def weighted_sum(tensors: Dict[str, Tensor], weights: Dict[str, Tensor]) -> Tensor:
    """``Σ_k <w_k, t_k>``: a fixed random scalar function of every returned tensor."""
    return sum((weights[k] * t).sum() for k, t in tensors.items())


def random_like(tensors: Dict[str, Tensor], gen: torch.Generator) -> Dict[str, Tensor]:
    return {k: torch.randn(t.shape, generator=gen, dtype=t.dtype) for k, t in tensors.items()}
