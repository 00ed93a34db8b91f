"""Convolutions ``nn.Conv1d/2d/3d``, batched with an explicit ``n``.

Letters: ``n`` batch, ``g`` group, ``c`` input channel within its group
(``C_in/G`` of them), ``o`` output channel within its group (``C_out/G``),
``k`` kernel offset (``K = k_1⋯k_d`` of them, row-major), ``l`` output
position (``L = L_1⋯L_d``, row-major), ``d`` the number of spatial dims.

Shapes: ``x [N, C_in, *S]``, ``W [C_out, C_in/G, *k]``, ``b [C_out]``,
``y`` and ``g = ∂L/∂y``: ``[N, C_out, *L]``.

Padding of any kind (integers, ``"valid"``, ``"same"``, ``padding_mode``) is
first made explicit: ``x̃ = pad(x)`` with per-side amounts (PyTorch's own
split for ``"same"``: ``left = ⌊dil·(k-1)/2⌋``, the rest on the right).
The *unfold* of the padded input,

    U[n, c, k, l] = x̃[n, c, stride·l + dil·k]          [N, C_in·K, L],

turns the convolution into a per-group matrix product,

    y[n, g, o, l] = Σ_{c,k} W[g, o, c, k] U[n, g, c, k, l] + b[g, o],

so the individual gradients are outer products summed over positions

    ∂ℓ_n/∂W[g] = Σ_l g[n, g, :, l] U[n, g, :, :, l]ᵀ,   ∂ℓ_n/∂b = Σ_l g[n, :, l].

The same structure (``a [n, g, A, l]``, ``b [n, g, B, l]``, individual
gradient ``Σ_l a_l b_lᵀ`` per group) also describes the transposed
convolution (:mod:`~curvlib.rules.conv_transpose`); :func:`outer_rule`
builds the rule table of either from a function giving ``(a, b)``.

Squared norms avoid ``[N, *W.shape]`` when ``L² ≤ A·B``:
``‖Σ_l a_l b_lᵀ‖² = Σ_{l,m} (a_l·a_m)(b_l·b_m)`` (two ``[N, G, L, L]`` Gram
matrices); for ``L = 1`` the sum of squares is ``Σ_n (a²)(b²)ᵀ``.
Otherwise the individual gradients are formed.
"""

from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from opt_einsum import contract
from torch import Tensor, nn

from .._errors import CurvatureError
from ._site import Recorder, RoleTensors, Rule, Site

# (site, g) -> (a [n, G, A, L], b [n, G, B, L], weight shape)
Operands = Callable[[Site, Tensor], Tuple[Tensor, Tensor, Tuple[int, ...]]]

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def explicit_padding(module: nn.Module) -> List[int]:
    """Per-side padding in :func:`torch.nn.functional.pad` order.

    Returns ``[left_d, right_d, …, left_1, right_1]`` (last spatial dim
    first), for integer, tuple, ``"valid"`` and ``"same"`` padding; for
    ``"same"`` the total ``dil·(k-1)`` is split as PyTorch does
    (``⌊total/2⌋`` on the left, the rest on the right).
    """
    pad: List[int] = []
    for j in reversed(range(len(module.kernel_size))):
        if module.padding == "valid":
            left = right = 0
        elif module.padding == "same":
            total = module.dilation[j] * (module.kernel_size[j] - 1)
            left, right = total // 2, total - total // 2
        else:
            left = right = module.padding[j]
        pad += [left, right]
    return pad


def unfold(
    x: Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
    positions: Sequence[int] = (),
) -> Tensor:
    """Patches of an (already padded) input, for any number of spatial dims.

    ``U[n, c·K + k, l] = x[n, c, stride·l + dil·k]`` (multi-indices ``k``,
    ``l`` flattened row-major), built from strided views
    (:meth:`torch.Tensor.unfold`), so values are copied exactly once.

    Args:
        x: ``[N, C, *P]``, padding already applied.
        kernel_size, stride, dilation: one entry per spatial dim.
        positions: if given, keep only the first ``positions[j]`` output
            positions along spatial dim ``j``.

    Returns:
        ``[N, C·K, L]``.
    """
    d = len(kernel_size)
    u = x
    for j in range(d):
        span = dilation[j] * (kernel_size[j] - 1) + 1
        u = u.unfold(2 + j, span, stride[j])[..., :: dilation[j]]
    # u: [N, C, L_1, …, L_d, k_1, …, k_d]
    if positions:
        u = u[(slice(None), slice(None)) + tuple(slice(0, p) for p in positions)]
    u = u.permute([0, 1, *range(2 + d, 2 + 2 * d), *range(2, 2 + d)])
    return u.reshape(x.shape[0], x.shape[1] * _prod(kernel_size), -1)


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def bias_grad_batch(g: Tensor) -> Tensor:
    """``g [N, C_out, *L] -> [N, C_out]``: the sum over positions."""
    return g.flatten(2).sum(2)


def outer_rule(kind: str, operands: Operands, weight_grad=None) -> Rule:
    """Rule table for layers whose weight gradient is ``Σ_l a_l b_lᵀ`` per group.

    Args:
        kind: the rule's name.
        operands: ``(site, g) -> (a [n, G, A, L], b [n, G, B, L], w_shape)``,
            where the individual weight gradient of sample ``n`` is
            ``contract("gal,gbl->gab", a[n], b[n])`` reshaped to ``w_shape``.
            The bias gradient is always :func:`bias_grad_batch` of ``g``.
        weight_grad: optional ``(site, g) -> Σ_n`` weight gradient, computed by
            PyTorch's own convolution weight-gradient kernel (much faster than
            contracting the unfolded input).
    """

    def grad_batch(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
        out = {}
        if "weight" in roles:
            a, b, shape = operands(site, g)
            out["weight"] = contract("ngal,ngbl->ngab", a, b).reshape(a.shape[0], *shape)
        if "bias" in roles:
            out["bias"] = bias_grad_batch(g)
        return out

    def grad(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
        out = {}
        if "weight" in roles and weight_grad is not None:
            out["weight"] = weight_grad(site, g)
        elif "weight" in roles:
            a, b, shape = operands(site, g)
            out["weight"] = contract("ngal,ngbl->gab", a, b).reshape(shape)
        if "bias" in roles:
            out["bias"] = g.flatten(2).sum((0, 2))
        return out

    def batch_l2(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
        out = {}
        if "weight" in roles:
            a, b, _ = operands(site, g)
            positions, size_a, size_b = a.shape[3], a.shape[2], b.shape[2]
            if positions * positions <= size_a * size_b:
                gram_a = contract("ngal,ngam->nglm", a, a)
                gram_b = contract("ngbl,ngbm->nglm", b, b)
                out["weight"] = (gram_a * gram_b).sum((1, 2, 3))
            else:
                out["weight"] = (contract("ngal,ngbl->ngab", a, b) ** 2).sum((1, 2, 3))
        if "bias" in roles:
            out["bias"] = (bias_grad_batch(g) ** 2).sum(1)
        return out

    def sum_grad_squared(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
        out = {}
        if "weight" in roles:
            a, b, shape = operands(site, g)
            if a.shape[3] == 1:
                sgs = contract("ngal,ngbl->gab", a**2, b**2)
            else:
                sgs = (contract("ngal,ngbl->ngab", a, b) ** 2).sum(0)
            out["weight"] = sgs.reshape(shape)
        if "bias" in roles:
            out["bias"] = (bias_grad_batch(g) ** 2).sum(0)
        return out

    return Rule(
        kind=kind,
        grad_batch=grad_batch,
        grad=grad,
        batch_l2=batch_l2,
        sum_grad_squared=sum_grad_squared,
    )


def padded_input(site: Site) -> Tensor:
    """``x̃ [N, C_in, *P]``: the saved input with the layer's padding applied (computed once per site)."""
    return cached(site, "padded", lambda: _pad(site))


def _pad(site: Site) -> Tensor:
    m, x = site.meta, site.saved["x"]
    return F.pad(x, m["pad"], mode=m["mode"]) if any(m["pad"]) else x


def cached(site: Site, key: str, compute):
    """A per-site memo for tensors derived from the saved inputs only (unfolds, paddings).

    Inside a functorch transform (the second-order read-off vmaps over
    columns) nothing is stored: a tensor made there must not leave it.
    """
    x = site.saved["x"]
    if _wrapped(x):
        return compute()
    memo = site.meta.setdefault("_memo", {})
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def _wrapped(t: Tensor) -> bool:
    try:
        return torch._C._functorch.is_functorch_wrapped_tensor(t) or torch._C._functorch.maybe_current_level() is not None
    except AttributeError:  # pragma: no cover
        return True


def conv_weight_grad(site: Site, g: Tensor) -> Tensor:
    """``Σ_n ∂ℓ_n/∂W`` by ``aten.convolution_backward`` on the padded input (weight only)."""
    m = site.meta
    x = padded_input(site)
    d = len(m["kernel_size"])
    w_shape = (g.shape[1], x.shape[1] // m["groups"], *m["kernel_size"])
    _, gw, _ = torch.ops.aten.convolution_backward(
        g, x, x.new_empty(w_shape), None, list(m["stride"]), [0] * d, list(m["dilation"]),
        False, [0] * d, m["groups"], [False, True, False],
    )
    return gw


def _operands(site: Site, g: Tensor) -> Tuple[Tensor, Tensor, Tuple[int, ...]]:
    """``a = g [n, G, C_out/G, L]``, ``b = U [n, G, C_in/G·K, L]`` (module docstring)."""
    m = site.meta
    x = padded_input(site)
    u = cached(site, "unfold", lambda: unfold(x, m["kernel_size"], m["stride"], m["dilation"]))
    n, groups = g.shape[0], m["groups"]
    a = g.reshape(n, groups, g.shape[1] // groups, -1)
    b = u.reshape(n, groups, u.shape[1] // groups, -1)
    c_in = x.shape[1]
    return a, b, (g.shape[1], c_in // groups, *m["kernel_size"])


CONV = outer_rule("conv", _operands, conv_weight_grad)


def kron(site: Site, role: str, m: Tensor) -> List[Tensor]:
    """BackPACK's Kronecker factors from the pulled-back root ``m [V, N, C_out, *L]``.

    ``B = Σ_{v,n} s sᵀ [C_out, C_out]`` with ``s = Σ_l m[v, n, :, l]`` (BackPACK
    sums positions *before* the outer product, so ``B`` is the bias GGN);
    weight: ``[B, A]`` with ``A`` from :func:`kron_input`, bias: ``[B]``.
    ``groups = 1`` only (refused at planning through ``meta["kron_error"]``).
    """
    s = m.flatten(3).sum(3)
    B = contract("vno,vnp->op", s, s)
    return [B] if role == "bias" else [B, kron_input(site)]


def kron_input(site: Site) -> Tensor:
    """``A = (1/N) Σ_{n,l} U[n, :, l] U[n, :, l]ᵀ [C_in·K, C_in·K]``.

    ``U`` is the unfold of the padded input, with ``padding_mode`` applied
    (BackPACK always pads with zeros; the two agree for ``"zeros"``).
    """
    m = site.meta
    x = padded_input(site)
    u = unfold(x, m["kernel_size"], m["stride"], m["dilation"])
    return contract("nil,njl->ij", u, u) / u.shape[0]


def kron_from_output_matrix(site: Site, role: str, G: Tensor) -> List[Tensor]:
    """KFRA factors from the batch-averaged output matrix ``G [C_out·L, C_out·L]``.

    As BackPACK: ``B[o, p] = Σ_{l,m} G[(o, l), (p, m)]``; weight ``[B, A]``, bias ``[B]``.
    """
    c_out = site.meta["out_channels"]
    B = G.reshape(c_out, G.shape[0] // c_out, c_out, G.shape[1] // c_out).sum((1, 3))
    return [B] if role == "bias" else [B, kron_input(site)]


def check(module: nn.Module, where: str) -> None:
    """Refuse a ``padding_mode`` this rule (and PyTorch) does not know."""
    if module.padding_mode not in PADDING_MODES:
        raise CurvatureError(
            f"Layer '{where}' ({type(module).__name__}): padding_mode="
            f"{module.padding_mode!r} is not supported; supported are {PADDING_MODES}."
        )


def check_batched(module: nn.Module, where: str, x: Tensor) -> None:
    """The input must be ``[N, C, *spatial]``: curvlib keeps the batch in dim 0."""
    d = len(module.kernel_size)
    if not isinstance(x, Tensor) or x.dim() != d + 2:
        shape = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise CurvatureError(
            f"Layer '{where}' ({type(module).__name__}) got an input of shape {shape}; "
            f"curvlib needs a batched input [N, C, *spatial] with {d + 2} dims "
            "(unbatched inputs are not supported: the batch must be in dim 0)."
        )


def forward(module: nn.Module, where: str, names: dict, tensors: dict, args, kwargs, rec: Recorder):
    """Run ``nn.Conv1d/2d/3d`` functionally (as its own forward does) and record its site.
    """
    x = args[0] if args else kwargs["input"]
    check_batched(module, where, x)
    conv = _CONV[len(module.kernel_size)]
    weight, bias = tensors["weight"], tensors.get("bias")
    pad = explicit_padding(module)
    if module.padding_mode == "zeros":
        out = conv(x, weight, bias, module.stride, module.padding, module.dilation, module.groups)
        mode = "constant"
    else:
        out = conv(F.pad(x, pad, mode=module.padding_mode), weight, bias, module.stride, 0,
                   module.dilation, module.groups)
        mode = module.padding_mode
    meta = {
        "kernel_size": tuple(module.kernel_size),
        "stride": tuple(module.stride),
        "dilation": tuple(module.dilation),
        "groups": module.groups,
        "out_channels": module.out_channels,
        "pad": pad,
        "mode": mode,
        "batch_dim": 0,
    }
    if module.groups != 1:
        meta["kron_error"] = (
            f"Kronecker factors of a grouped convolution (groups={module.groups}) are not "
            "defined (as in BackPACK); supported: groups=1."
        )
    return rec.add(Site(CONV, names, where, saved={"x": x}, meta=meta), out)
