"""Transposed convolutions ``nn.ConvTranspose1d/2d/3d``, batched with an explicit ``n``.

Letters as in :mod:`~curvlib.rules.conv`: ``n`` batch, ``g`` group, ``c``
input channel within its group (``C_in/G``), ``o`` output channel within its
group (``C_out/G``), ``k`` kernel offset (``K``), ``l`` *input* position
(``L = S_1⋯S_d``).

Shapes: ``x [N, C_in, *S]``, ``W [C_in, C_out/G, *k]``, ``b [C_out]``,
``y [N, C_out, *P]`` with
``P_j = (S_j-1)·stride_j - 2·pad_j + dil_j·(k_j-1) + out_pad_j + 1``.

The transposed convolution scatters every input position into the output:

    y[n, g, o, p] = Σ_{c,k,l : p = stride·l - pad + dil·k} x[n, g, c, l] W[g, c, o, k] + b[g, o].

Hence, with ``g̃`` the output gradient zero-padded by ``pad`` on both sides,
the *unfold of g with the forward convolution's geometry*,

    V[n, o, k, l] = g̃[n, o, stride·l + dil·k]        (first ``S_j`` positions per dim),

has exactly one column per input position ``l``, and

    ∂ℓ_n/∂W[g] = Σ_l x[n, g, :, l] V[n, g, :, :, l]ᵀ,   ∂ℓ_n/∂b = Σ_p g[n, :, p].

(``g̃`` spans ``P + 2·pad ≥ (S-1)·stride + dil·(k-1) + 1`` positions, so every
``l < S`` has a full window; taps at padded positions fall outside ``y`` and
rightly contribute zero.) This is the convolution's
:class:`~curvlib.rules.conv.Correlation` with the roles swapped: ``x̃ → g̃``
(``C_x = C_out``), ``g → x`` (``C_g = C_in``, ``L = S``), whose weight
gradient ``[C_in, C_out/G, *k]`` is already the transposed layer's weight
shape. Individual gradients, norms and squares come from
:func:`~curvlib.rules.conv.outer_rule`; root columns of the GGN diagonal fold
into the channels of ``g̃``.

``forward(input, output_size)`` is honoured: ``output_size`` fixes
``out_pad`` through the module's own ``_output_padding``.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._core.calls import argument
from .._core.errors import CurvatureError
from .._core.family import Family
from .._core.site import Recorder, Site
from ._conv_correlation import Correlation
from ._conv_kron import input_factor
from ._conv_kron import kron as _conv_kron
from ._conv_kron import weight_output_factor
from ._conv_unfold import fold_columns
from .conv import check_batched, outer_rule

_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _correlation(site: Site, g: Tensor, columns: bool) -> Correlation:
    """``x = g̃ [N, C_out, *P + 2·pad]`` (``g`` with the zero padding left to the
    kernel), ``g = x [N, C_in, *S]`` (module docstring); root columns
    ``g [B, N, C_out, *P]`` fold into the channels of ``g̃``."""
    m = site.meta
    if columns:
        g = fold_columns(g, m["groups"])
    return Correlation(
        g, site.saved["x"], m["kernel_size"], m["stride"], m["dilation"], m["groups"], m["padding"], columns="x"
    )


CONV_TRANSPOSE = outer_rule("conv_transpose", _correlation)


def check(module: nn.Module, where: str) -> None:
    """Refuse a ``padding_mode`` other than ``"zeros"`` (PyTorch refuses it too)."""
    if module.padding_mode != "zeros":
        raise CurvatureError(
            f"Layer '{where}' ({type(module).__name__}): padding_mode="
            f"{module.padding_mode!r} is not supported; transposed convolutions "
            "support only padding_mode='zeros'."
        )


def kron_input(site: Site, approx: Optional[str] = None, max_dim: Optional[int] = None) -> Tensor:
    """``A = (1/N) Σ_{n,l} U[n, :, l] U[n, :, l]ᵀ [C_in·K, C_in·K]`` (BackPACK's convention;
    ``"expand"``/``"reduce"`` as for :func:`curvlib.rules.conv.kron_input`).

    ``U[n, c·K + k, l]`` is the input entry that kernel element ``k`` carries to
    output position ``l``, so that ``y[n, o, l] = Σ_{c,k} W[c, o, k] U[n, c·K + k, l]``.
    It is the transposed convolution of ``x`` with one-hot kernels (``groups =
    C_in``), with the module's stride, padding, output padding and dilation.
    """
    m = site.meta
    x = site.saved["x"]
    c_in, k = x.shape[1], _numel(m["kernel_size"])
    onehot = torch.eye(k, dtype=x.dtype, device=x.device).reshape((1, k) + m["kernel_size"])
    onehot = onehot.expand((c_in, k) + m["kernel_size"])
    u = _CONV_TRANSPOSE[len(m["kernel_size"])](
        x, onehot, None, m["stride"], m["padding"], m["output_padding"], c_in, m["dilation"]
    )
    cols = u.transpose(0, 1).reshape(c_in * k, -1)  # [C_in·K, N·L]: rows (c, k), columns (n, l)
    groups = m["groups"]
    if groups != 1:  # rows (g, c, k): group g's weights W[g·C_in/G:(g+1)·C_in/G] read only its rows
        cols = cols.reshape(groups, cols.shape[0] // groups, cols.shape[1])
    return input_factor(cols, x.shape[0], approx, max_dim)


def kron(site: Site, role: str, m: Tensor, approx: Optional[str] = None,
         max_dim: Optional[int] = None) -> List[Tensor]:
    """Factors from the pulled-back root ``m [V, N, C_out, *L]`` as for convolutions:
    BackPACK's ``B = Σ_{v,n} s sᵀ`` with ``s = Σ_l m[v, n, :, l]`` (``"expand"``:
    ``Σ_{v,n,l} m mᵀ``); weight ``[B, A]``, bias ``[B]``. With ``groups = G > 1``, as grouped
    convolutions: weight ``[B [G, C_out/G, C_out/G], A [G, C_in/G·K, C_in/G·K]]``, group ``g``'s
    weights ``W[g·C_in/G:(g+1)·C_in/G]`` (BackPACK's layout per group) ≈ ``B[g] ⊗ A[g]``, the
    diagonal blocks of the ungrouped ``B`` and ``A``; the bias keeps the full ``[B]``. ``max_dim``:
    a side larger than it gets its diagonal (:func:`curvlib.rules._gram.gram`)."""
    (B,) = _conv_kron(site, "bias", m, approx, max_dim)  # the output side is a convolution's
    return [B] if role == "bias" else [weight_output_factor(site, B), kron_input(site, approx, max_dim)]


def kron_from_output_matrix(site: Site, role: str, G: Tensor) -> List[Tensor]:
    """KFRA factors: ``B[o, p] = Σ_{l,m} G[(o, l), (p, m)]``; weight ``[B, A]``, bias ``[B]``."""
    c_out = site.meta["out_channels"]
    B = G.reshape(c_out, G.shape[0] // c_out, c_out, G.shape[1] // c_out).sum((1, 3))
    return [B] if role == "bias" else [B, kron_input(site)]


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for s in shape:
        total *= s
    return total


def forward(module: nn.Module, where: str, names: dict, tensors: dict, args, kwargs, rec: Recorder):
    """Run ``nn.ConvTranspose1d/2d/3d`` functionally and record its site."""
    x = argument(args, kwargs, 0, "input")
    output_size = argument(args, kwargs, 1, "output_size", None)
    check(module, where)
    check_batched(module, where, x)
    d = len(module.kernel_size)
    output_padding = module._output_padding(
        x,
        None if output_size is None else list(output_size),
        list(module.stride),
        list(module.padding),
        list(module.kernel_size),
        d,
        list(module.dilation),
    )
    out = _CONV_TRANSPOSE[d](
        x,
        tensors["weight"],
        tensors.get("bias"),
        module.stride,
        module.padding,
        output_padding,
        module.groups,
        module.dilation,
    )
    meta = {
        "kernel_size": tuple(module.kernel_size),
        "stride": tuple(module.stride),
        "padding": tuple(module.padding),
        "dilation": tuple(module.dilation),
        "groups": module.groups,
        "output_padding": tuple(output_padding),
        "out_channels": module.out_channels,
    }
    if module.groups != 1:  # KFAC/KFLR: per-group factors (kron); KFRA's recursion has none
        meta["kfra_error"] = f"KFRA's factors need groups=1 (as in BackPACK), got groups={module.groups}."
    return rec.add(Site(CONV_TRANSPOSE, names, where, saved={"x": x}, meta=meta), out)


def dense_sides(site: Site, role: str, shape: Sequence[int]) -> Optional[List[int]]:
    """The sides of the weight's (``[in, out/groups, *k]``) dense Kronecker factors,
    ``[out, in/groups · k]``; ``None`` for another role."""
    if role != "weight":
        return None
    out = shape[1] * site.meta.get("groups", 1)
    return [out, math.prod(shape) // out]


#: The family's record (:class:`~curvlib._core.family.Family`), registered in :data:`curvlib.rules.FAMILIES`.
FAMILY = Family("conv_transpose", (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d), forward, check,
                kron=kron, kron_input=kron_input, weight_output_factor=weight_output_factor,
                kron_from_output_matrix=kron_from_output_matrix, kron_layout="split", affine_in_input=True,
                affine_in_parameters=True, dense_sides=dense_sides, entry_wise=True)
