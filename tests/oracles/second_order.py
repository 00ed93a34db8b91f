"""Brute-force second-order references (float64, plain torch.func / autograd).

Nothing of curvlib is used here. Notation: ``L(θ) = lossfn(f(X; θ), y)`` with
model output ``f [N, *out]`` (``C`` entries per sample), ``p`` one parameter
(``P`` entries, flattened), all other parameters held fixed.

* Output Jacobian ``J [N, C, P]``: ``jacrev`` of the whole-batch output
  w.r.t. ``p``; row block ``n`` is sample ``n``'s Jacobian ``J_n`` (the
  model treats samples independently).
* Loss Hessian w.r.t. the output, ``torch.func.hessian`` of ``o ↦ lossfn(o, y)``
  at ``o = f``: ``[N·C, N·C]``. For the supported losses it is block
  diagonal over samples (checked); block ``n`` is ``H_n [C, C]`` and
  already carries the reduction's scaling.
* Per-sample GGN ``G_n = J_nᵀ H_n J_n [P, P]``, GGN block ``G = Σ_n G_n``.
* Hessian block ``∇²_p L [P, P]`` by ``jacrev(jacrev(p ↦ L))`` (reverse over
  reverse: rows and columns of entries autograd holds constant are zero).
* Per-sample Hessian ``∇²_p L_n``: the Hessian of ``p ↦ lossfn(f̃(p), y)``
  where ``f̃`` takes row ``n`` from ``f(X; p)`` and every other row from the
  fixed ``f(X; θ)``: sample ``n``'s term with exactly the same scaling; they
  sum to ``∇²_p L`` because ``L`` is a sum of per-sample terms.
* Kronecker factors (BackPACK's convention): for a layer with output
  ``z [N, O, *S]`` add a virtual per-sample, per-channel offset
  ``δ [N, O]`` broadcast over the positions ``S``; then
  ``B = Σ_n J_{n,δ}ᵀ H_n J_{n,δ} [O, O]`` (the exact GGN w.r.t. that offset,
  summed over samples; for ``Linear`` on 2d inputs this is the GGN of the
  bias) and ``A = (1/N) Σ_{n,s} u_{n,s} u_{n,s}ᵀ`` with ``u`` the layer input
  (Linear) or its unfolded patches (Conv, by an identity-kernel convolution).
* Residual (Hessian minus GGN) of smooth element-wise activation modules
  ``z = φ(a)``: ``R = Σ_act J_{p→a}ᵀ diag(φ''(a) ⊙ g) J_{p→a}`` with
  ``g = ∂L/∂z``; ``J_{p→a}`` by ``jacrev``, ``g`` by ``torch.func.grad`` of an
  offset added to ``z``, ``φ''`` by double autograd. The positive-curvature
  Hessian (Chen et al.) is ``G + R`` with ``φ''(a) ⊙ g`` clipped at zero
  (``"clip"``) or in absolute value (``"abs"``).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad, hessian, jacrev

from oracles.first_order import functional_call
from oracles.on_device import plain_kernels

# Activation modules with a non-zero second derivative (residual terms).
SMOOTH_ACTIVATIONS: Tuple[type, ...] = (
    nn.Sigmoid, nn.Tanh, nn.LogSigmoid, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Softplus, nn.Mish, nn.Softsign, nn.Tanhshrink,
)


def detached_params(model: nn.Module) -> Dict[str, Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def trainable_names(model: nn.Module) -> List[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _output_fn(model: nn.Module, X: Tensor, name: str):
    params = detached_params(model)

    def f(t: Tensor) -> Tensor:
        return functional_call(model, {**params, name: t}, (X,))

    return f, params[name]


def loss_hessian_blocks(lossfn: nn.Module, out: Tensor, y: Tensor) -> Tensor:
    """``[N, C, C]``: the diagonal blocks of ``∇²_o lossfn(o, y)`` (off-diagonal ones are checked zero)."""
    n, c = out.shape[0], out[0].numel()
    H = hessian(lambda o: lossfn(o, y))(out.detach()).reshape(n, c, n, c)
    blocks = torch.stack([H[i, :, i, :] for i in range(n)])
    off = H.clone()
    for i in range(n):
        off[i, :, i, :] = 0
    assert off.abs().max() == 0 if off.numel() else True, "loss Hessian is not block diagonal"
    return blocks


def loss_root(lossfn: nn.Module, out: Tensor, y: Tensor) -> Tensor:
    """BackPACK's symmetric root ``S [C, N, *out[1:]]`` of the per-sample loss Hessian,
    written out per loss (``c`` the reduction factor: 1 for ``"sum"``; for
    ``"mean"`` 1/numel (MSE, BCE) or 1/(N·prod(D)) (CE on ``[N, K, *D]``)):

    * MSE: ``S[v, n] = √(2c) e_v``;
    * BCE: ``S[v, n] = √(c σ(f_v)(1 − σ(f_v))) e_v``;
    * CE: column ``v = (a, r)`` (class ``a``, position ``r``) is
      ``√c √p_{a,r} (e_a − p_{:,r})`` at position ``r``, zero elsewhere.
    """
    n = out.shape[0]
    per = out[0].numel()
    mean = lossfn.reduction == "mean"
    if isinstance(lossfn, nn.CrossEntropyLoss):
        k = out.shape[1]
        r = per // k
        c = 1.0 / (n * r) if mean else 1.0
        p = torch.softmax(out, 1).reshape(n, k, r)
        S = torch.zeros(k, r, n, k, r, dtype=out.dtype)
        for a in range(k):
            for j in range(r):
                e = torch.zeros(k, dtype=out.dtype)
                e[a] = 1
                S[a, j, :, :, j] = (c * p[:, a, j]).sqrt()[:, None] * (e[None] - p[:, :, j])
        return S.reshape((per, n) + tuple(out.shape[1:]))
    c = 1.0 / out.numel() if mean else 1.0
    if isinstance(lossfn, nn.MSELoss):
        d = torch.full((n, per), (2 * c) ** 0.5, dtype=out.dtype)
    else:
        s = torch.sigmoid(out).reshape(n, per)
        d = (c * s * (1 - s)).sqrt()
    S = torch.eye(per, dtype=out.dtype)[:, None, :] * d[None]
    return S.reshape((per, n) + tuple(out.shape[1:]))


@plain_kernels
def output_jacobian(model: nn.Module, X: Tensor, name: str) -> Tensor:
    """``[N, C, P]``: Jacobian of the model output w.r.t. parameter ``name``."""
    f, p = _output_fn(model, X, name)
    J = jacrev(f)(p)
    n = X.shape[0]
    return J.reshape(n, -1, p.numel())


@plain_kernels
def ggn_per_sample(model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor, name: str) -> Tensor:
    """``[N, P, P]``: ``G_n = J_nᵀ H_n J_n``."""
    J = output_jacobian(model, X, name)
    with torch.no_grad():
        out = model(X)
    Hb = loss_hessian_blocks(lossfn, out, y)
    return torch.einsum("ncp,ncd,ndq->npq", J, Hb, J)


def ggn_block(model, lossfn, X, y, name) -> Tensor:
    """``[P, P]``: the exact GGN block of parameter ``name``."""
    return ggn_per_sample(model, lossfn, X, y, name).sum(0)


def _hessian(fn):
    """Reverse-over-reverse Hessian. (Forward-over-reverse is not symmetric where
    autograd treats part of a parameter as constant, e.g. the ``padding_idx`` row
    of an embedding: its gradient is zero, but a forward tangent still flows.)"""
    return jacrev(jacrev(fn))


@plain_kernels
def hessian_block(model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor, name: str) -> Tensor:
    """``[P, P]``: ``∇²_p L`` by ``torch.func.hessian``."""
    f, p = _output_fn(model, X, name)
    H = _hessian(lambda t: lossfn(f(t), y))(p)
    return H.reshape(p.numel(), p.numel())


@plain_kernels
def hessian_per_sample(model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor, name: str) -> Tensor:
    """``[N, P, P]``: sample ``n``'s term of ``∇²_p L`` (see module doc)."""
    f, p = _output_fn(model, X, name)
    with torch.no_grad():
        out0 = f(p)
    n = X.shape[0]
    result = []
    for i in range(n):
        mask = torch.zeros((n,) + (1,) * (out0.dim() - 1), dtype=torch.bool)
        mask[i] = True

        def L(t, mask=mask):
            return lossfn(torch.where(mask, f(t), out0), y)

        result.append(_hessian(L)(p).reshape(p.numel(), p.numel()))
    return torch.stack(result)


# ---------------------------------------------------------------- Kronecker factors


class _Offset:
    """Forward hook on one module adding ``δ [N, O]`` to its output, broadcast over positions."""

    def __init__(self, module: nn.Module):
        self.delta: Optional[Tensor] = None
        self.inputs: List[Tensor] = []
        self.handle = module.register_forward_hook(self)

    def __call__(self, module, args, out):
        self.inputs.append(args[0])
        if self.delta is None:
            return out
        return out + self.delta.reshape(self.delta.shape + (1,) * (out.dim() - 2))


@plain_kernels
def kron_output_factor(model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor, module_name: str) -> Tensor:
    """``B [O, O] = Σ_n J_{n,δ}ᵀ H_n J_{n,δ}`` for the per-channel output offset ``δ``."""
    module = model.get_submodule(module_name)
    hook = _Offset(module)
    try:
        with torch.no_grad():
            out = model(X)
            z = module(hook.inputs[0])
        n, o = z.shape[0], z.shape[1]

        def f(delta):
            hook.delta = delta
            return model(X)

        J = jacrev(f)(torch.zeros(n, o, dtype=z.dtype))
    finally:
        hook.handle.remove()
    J = J.reshape(n, -1, n, o)
    Jn = torch.stack([J[i, :, i, :] for i in range(n)])  # [N, C, O]
    Hb = loss_hessian_blocks(lossfn, out, y)
    return torch.einsum("nco,ncd,ndq->oq", Jn, Hb, Jn)


@plain_kernels
def layer_input(model: nn.Module, X: Tensor, module_name: str) -> Tensor:
    module = model.get_submodule(module_name)
    hook = _Offset(module)
    try:
        with torch.no_grad():
            model(X)
    finally:
        hook.handle.remove()
    (x,) = hook.inputs
    return x


def unfold_conv_input(conv: nn.Module, x: Tensor) -> Tensor:
    """``[N, C_in·K, S_out]``: the patches a ``groups=1`` ConvNd multiplies with its weight,
    extracted by a convolution with an identity kernel (same options as ``conv``)."""
    d = x.dim() - 2
    k = tuple(conv.kernel_size)
    c_in = x.shape[1]
    kk = int(torch.tensor(k).prod())
    eye = torch.eye(c_in * kk, dtype=x.dtype).reshape(c_in * kk, c_in, *k)
    padding = conv.padding
    if conv.padding_mode != "zeros":
        x = F.pad(x, conv._reversed_padding_repeated_twice, mode=conv.padding_mode)
        padding = 0
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[d]
    u = fn(x, eye, None, conv.stride, padding, conv.dilation, 1)
    return u.reshape(u.shape[0], c_in * kk, -1)


def kron_input_factor(model: nn.Module, X: Tensor, module_name: str) -> Tensor:
    """``A = (1/N) Σ_{n,s} u uᵀ``: layer input (Linear, 2d) or unfolded patches (Conv, groups=1)."""
    module = model.get_submodule(module_name)
    x = layer_input(model, X, module_name)
    if isinstance(module, nn.Linear):
        assert x.dim() == 2
        return x.T @ x / x.shape[0]
    assert module.groups == 1
    if isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        # y[n, o, l] = Σ_{c,k} W[c, o, k] U[n, c·K + k, l]: U is the Jacobian of a
        # single-output-channel transposed convolution w.r.t. its weight.
        c_in, k = x.shape[1], module.weight[0, 0].numel()
        w = torch.zeros((c_in, 1) + tuple(module.kernel_size), dtype=x.dtype)
        conv_t = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[x.dim() - 2]

        def single(weight):
            return conv_t(x, weight, None, module.stride, module.padding, module.output_padding, 1, module.dilation)

        jac = torch.func.jacrev(single)(w)  # [N, 1, *L, C_in, 1, *k]
        u = jac.reshape(x.shape[0], -1, c_in * k).transpose(1, 2)  # [N, C_in·K, L]
        return torch.einsum("nis,njs->ij", u, u) / x.shape[0]
    u = unfold_conv_input(module, x)
    return torch.einsum("nis,njs->ij", u, u) / x.shape[0]


def kron_reference(model, lossfn, X, y, module_name: str, role: str) -> List[Tensor]:
    """BackPACK's KFLR factors: weight -> ``[B, A]``, bias -> ``[B]``."""
    B = kron_output_factor(model, lossfn, X, y, module_name)
    if role == "bias":
        return [B]
    return [B, kron_input_factor(model, X, module_name)]


# ---------------------------------------------------------------- Hessian residuals


def _second_derivative(module: nn.Module, a: Tensor) -> Tensor:
    a = a.detach().clone().requires_grad_(True)
    (d1,) = torch.autograd.grad(module(a).sum(), a, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), a)
    return d2


class _Taps:
    """Forward hooks on every smooth activation module: record inputs ``a``,
    add offsets ``δ_k`` to the outputs (one per call, in call order)."""

    def __init__(self, model: nn.Module):
        self.modules = [m for m in model.modules() if isinstance(m, SMOOTH_ACTIVATIONS)]
        self.inputs: List[Tensor] = []
        self.calls: List[nn.Module] = []
        self.deltas: Optional[Sequence[Tensor]] = None
        self.handles = [m.register_forward_hook(self) for m in self.modules]

    def __call__(self, module, args, out):
        k = len(self.inputs)
        self.inputs.append(args[0])
        self.calls.append(module)
        if self.deltas is not None:
            return out + self.deltas[k]
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


@plain_kernels
def residual_block(model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor, name: str, modify: Optional[str] = None) -> Tensor:
    """``[P, P]``: ``Σ_act J_{p→a}ᵀ diag(mod(φ''(a) ⊙ g)) J_{p→a}`` over smooth activation modules.

    ``modify``: ``None`` (exact: ``G + R`` is the Hessian), ``"clip"`` or ``"abs"``.
    """
    params = detached_params(model)
    p = params[name]
    taps = _Taps(model)
    try:
        with torch.no_grad():
            model(X)
        a_vals = [a.detach() for a in taps.inputs]
        calls = list(taps.calls)
        shapes = [tuple(m(a).shape) for m, a in zip(calls, a_vals)]

        def activations(t):
            taps.inputs, taps.calls, taps.deltas = [], [], None
            functional_call(model, {**params, name: t}, (X,))
            return tuple(taps.inputs)

        Ja = jacrev(activations)(p) if a_vals else ()

        def L(deltas):
            taps.inputs, taps.calls, taps.deltas = [], [], deltas
            return lossfn(model(X), y)

        gs = grad(L)([torch.zeros(s, dtype=p.dtype) for s in shapes]) if a_vals else []
    finally:
        taps.remove()
    R = torch.zeros(p.numel(), p.numel(), dtype=p.dtype)
    for module, a, J, g in zip(calls, a_vals, Ja, gs):
        r = (_second_derivative(module, a) * g).flatten()
        if modify == "clip":
            r = r.clamp(min=0)
        elif modify == "abs":
            r = r.abs()
        J = J.reshape(a.numel(), p.numel())
        R = R + torch.einsum("ap,a,aq->pq", J, r, J)
    return R


def pc_hessian_block(model, lossfn, X, y, name, modify: str) -> Tensor:
    """Positive-curvature Hessian block ``G + R_mod`` (Chen et al.)."""
    return ggn_block(model, lossfn, X, y, name) + residual_block(model, lossfn, X, y, name, modify)


# ---------------------------------------------------------------- KFRA


def kfra_reference(model: nn.Sequential, lossfn: nn.Module, X: Tensor, y: Tensor) -> Dict[str, List[Tensor]]:
    """KFRA factors (Botev et al., BackPACK's convention) of a ``nn.Sequential``.

    Starting from the summed loss Hessian ``G = Σ_n H_n [D, D]`` at the output,
    walk the modules backwards; at a Linear/Conv layer read off
    ``B[o, p] = Σ_{l,m} G[(o, l), (p, m)]`` (positions ``l`` summed out) and
    ``A`` as in :func:`kron_input_factor`; then pass ``G`` to the module's
    input as the batch average ``(1/N) Σ_n J_nᵀ G J_n`` with ``J_n`` the
    module's Jacobian at sample ``n`` (``jacrev`` on that sample alone).
    """
    acts = [X]
    with torch.no_grad():
        for m in model:
            acts.append(m(acts[-1]))
    n = X.shape[0]
    G = loss_hessian_blocks(lossfn, acts[-1], y).sum(0)
    result: Dict[str, List[Tensor]] = {}
    for k in reversed(range(len(model))):
        m = model[k]
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            c_out = acts[k + 1].shape[1]
            B = G.reshape(c_out, -1, c_out, G.shape[1] // c_out).sum((1, 3))
            for role, p in m.named_parameters(recurse=False):
                if p.requires_grad:
                    result[f"{k}.{role}"] = [B] if role == "bias" else [B, kron_input_factor(model, X, str(k))]
        if k == 0:
            break
        a = acts[k]
        d_a, d_z = a[0].numel(), acts[k + 1][0].numel()
        total = torch.zeros(d_a, d_a, dtype=G.dtype)
        for i in range(n):
            J = jacrev(m)(a[i : i + 1]).reshape(d_z, d_a)
            total = total + J.T @ G @ J
        G = total / n
    return result
