"""Pure brute-force Kronecker factors (KFLR, KFACEmpirical) for the composition matrix.

From their definitions (docs/supported-models.md, "Kronecker factors per layer"), pure in
``params`` and ``X`` like :mod:`oracles.compose`:

* a weight ``W [O, I, *k]`` of a Linear/Conv site (positions ``s`` sharing it):
  ``[B [O, O], A [I·K, I·K]]``, ``A = (1/N) Σ_{n,s} x xᵀ`` (unfolded patches
  for convolutions), ``B`` the block of a virtual per-channel offset ``δ [O]``
  added to the site's output at every position: its exact GGN
  ``Σ_n J_{n,δ}ᵀ H_n J_{n,δ}`` (KFLR) or ``Σ_n g_{n,δ} g_{n,δ}ᵀ`` (empirical);
  a bias gets ``[B]``. For sites that are not module calls (attention's packed
  ``in_proj``/``out_proj``, the GRU's ``W_ih x_t``/``W_hh h_{t-1}``) the offset
  is the site's own bias, so ``B`` is that bias's block;
* ``Embedding [V, D]``: ``[A [V], B [D, D]]``, ``A`` the token counts ``/ N``;
* LayerNorm/BatchNorm weight and bias: ``[F [P, P]]``, their exact block.
"""

from __future__ import annotations

import math
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad, hessian, jacrev

from oracles.first_order import functional_call
from oracles.compose import _scale, ggn_per_sample, individual_gradients, output, split
from oracles.second_order import unfold_conv_input


def layer_inputs(model: nn.Module, params, X: Tensor) -> Dict[str, Tensor]:
    """``{module name: its first positional input}`` for every module called as a module."""
    seen: Dict[str, Tensor] = {}

    def record(name):
        def hook(mod, args):
            seen.setdefault(name, args[0])  # returns None: the call's arguments stay as they are

        return hook

    handles = [m.register_forward_pre_hook(record(name)) for name, m in model.named_modules()]
    try:
        output(model, params, X)
    finally:
        for h in handles:
            h.remove()
    return seen


def _offset_block(model, lossfn, params, X, y, module: nn.Module, dim: int, empirical: bool) -> Tensor:
    """``[O, O]``: block of an offset ``δ [O]`` added to ``module``'s output along ``dim``."""
    c = _scale(lossfn, X.shape[0])
    total = None
    for i in range(X.shape[0]):
        def out_i(delta, i=i):
            def hook(m, a, o):
                shape = [1] * o.dim()
                shape[dim] = -1
                return o + delta.reshape(shape)

            h = module.register_forward_hook(hook)
            try:
                return output(model, params, X[i : i + 1])
            finally:
                h.remove()

        o = _channels(model, params, X[i : i + 1], module, dim)
        zero = torch.zeros(o, dtype=X.dtype if X.is_floating_point() else torch.float64)
        if empirical:
            g = grad(lambda d: c * lossfn(out_i(d), y[i : i + 1]))(zero)
            term = torch.outer(g, g)
        else:
            out = out_i(zero)
            J = jacrev(lambda d: out_i(d).reshape(-1))(zero)
            H = hessian(lambda u: c * lossfn(u.reshape(out.shape), y[i : i + 1]))(out.reshape(-1))
            term = J.T @ H @ J
        total = term if total is None else total + term
    return total


def _channels(model, params, x, module, dim) -> int:
    sizes = []
    h = module.register_forward_hook(lambda m, a, o: sizes.append(o.shape[dim]))
    try:
        output(model, params, x)
    finally:
        h.remove()
    return sizes[0]


def _input_factor(module: nn.Module, x: Tensor, n: int) -> Tensor:
    if isinstance(module, nn.Conv2d):
        u = unfold_conv_input(module, x)
        return torch.einsum("nis,njs->ij", u, u) / n
    x = x.reshape(-1, x.shape[-1])
    return x.T @ x / n


def _attention_output(mha: nn.MultiheadAttention, w, b, x: Tensor) -> Tensor:
    """``[N, T, d]``: the input of ``out_proj`` (self-attention, batch first, no masks)."""
    n, t, d = x.shape
    h = mha.num_heads
    q, k, v = F.linear(x, w, b).chunk(3, -1)
    q, k, v = (z.reshape(n, t, h, d // h).transpose(1, 2) for z in (q, k, v))
    a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // h), -1)
    return (a @ v).transpose(1, 2).reshape(n, t, d)


def kron_brute(name: str, model: nn.Module, lossfn, params, X: Tensor, y: Tensor) -> Dict[str, List[Tensor]]:
    """``{param: [factors]}`` for ``kflr`` or ``kfac_empirical`` (see module doc)."""
    train, _ = split(model, params)
    full = {**{k: v.detach() for k, v in model.named_parameters()}, **params}
    empirical = name == "kfac_empirical"
    if empirical:
        gb = individual_gradients(model, lossfn, params, X, y)
        block = {k: v.flatten(1).T @ v.flatten(1) for k, v in gb.items()}
    else:
        block = {k: v.sum(0) for k, v in ggn_per_sample(model, lossfn, params, X, y).items()}
    inputs = layer_inputs(model, params, X)
    n = X.shape[0]
    result: Dict[str, List[Tensor]] = {}
    for mname, mod in model.named_modules():
        pre = f"{mname}." if mname else ""
        keys = [pre + r for r, _ in mod.named_parameters(recurse=False) if pre + r in train]
        if not keys:
            continue
        if isinstance(mod, (nn.LayerNorm, nn.BatchNorm2d)):
            result.update({k: [block[k]] for k in keys})
        elif isinstance(mod, nn.Embedding):
            B = _offset_block(model, lossfn, params, X, y, mod, -1, empirical)
            counts = F.one_hot(X.reshape(-1), mod.num_embeddings).sum(0).to(B.dtype) / n
            result[pre + "weight"] = [counts, B]
        elif isinstance(mod, nn.MultiheadAttention):
            x = inputs[mname]
            result[pre + "in_proj_weight"] = [block[pre + "in_proj_bias"], _input_factor(mod, x, n)]
            result[pre + "in_proj_bias"] = [block[pre + "in_proj_bias"]]
        elif isinstance(mod, nn.Linear) and mname not in inputs:  # attention's out_proj
            parent = model.get_submodule(mname.rsplit(".", 1)[0])
            ppre = mname.rsplit(".", 1)[0] + "."
            z = _attention_output(parent, full[ppre + "in_proj_weight"], full[ppre + "in_proj_bias"], inputs[ppre[:-1]])
            result[pre + "weight"] = [block[pre + "bias"], _input_factor(mod, z, n)]
            result[pre + "bias"] = [block[pre + "bias"]]
        elif isinstance(mod, nn.GRU):
            x = inputs[mname]
            hs = output_hidden(mod, full, pre, x)
            hprev = torch.cat([torch.zeros_like(hs[:, :1]), hs[:, :-1]], 1)
            result[pre + "weight_ih_l0"] = [block[pre + "bias_ih_l0"], _input_factor(mod, x, n)]
            result[pre + "weight_hh_l0"] = [block[pre + "bias_hh_l0"], _input_factor(mod, hprev, n)]
            result[pre + "bias_ih_l0"] = [block[pre + "bias_ih_l0"]]
            result[pre + "bias_hh_l0"] = [block[pre + "bias_hh_l0"]]
        elif isinstance(mod, (nn.Linear, nn.Conv2d)):
            B = _offset_block(model, lossfn, params, X, y, mod, 1 if isinstance(mod, nn.Conv2d) else -1, empirical)
            result[pre + "weight"] = [B, _input_factor(mod, inputs[mname], n)]
            if pre + "bias" in train:
                result[pre + "bias"] = [B]
        else:
            raise KeyError(f"no Kronecker oracle for {type(mod).__name__} {mname!r}")
    return {k: result[k] for k in train}


def output_hidden(gru: nn.GRU, full, pre: str, x: Tensor) -> Tensor:
    """``[N, T, H]``: the GRU's hidden states at ``full``'s values (one layer, batch first)."""
    mine = {k[len(pre):]: v for k, v in full.items() if k.startswith(pre)}
    return functional_call(gru, mine, (x,))[0]
