"""Convolutions ``nn.Conv1d/2d/3d``, batched with an explicit ``n``.

Letters: ``n`` batch, ``g`` group, ``c`` input channel within its group
(``C_in/G`` of them), ``o`` output channel within its group (``C_out/G``),
``k`` kernel offset (``K = k_1⋯k_d`` of them, row-major), ``l`` output
position (``L = L_1⋯L_d``, row-major), ``d`` the number of spatial dims,
``v`` a column of a second-order root ``m [V, N, C_out, *L]``.

Shapes: ``x [N, C_in, *S]``, ``W [C_out, C_in/G, *k]``, ``b [C_out]``,
``y`` and ``g = ∂L/∂y``: ``[N, C_out, *L]``.

Padding of any kind (integers, ``"valid"``, ``"same"``, ``padding_mode``) is
first made explicit: ``x̃ = pad(x)`` with per-side amounts (PyTorch's own
split for ``"same"``: ``left = ⌊dil·(k-1)/2⌋``, the rest on the right).
Zero padding equal on both sides of every dim is not materialised where
PyTorch's convolution kernel can add it itself.
The *unfold* of the padded input,

    U[n, c, k, l] = x̃[n, c, stride·l + dil·k]          [N, C_in·K, L],

turns the convolution into a per-group matrix product,

    y[n, g, o, l] = Σ_{c,k} W[g, o, c, k] U[n, g, c, k, l] + b[g, o],

so the individual gradients are outer products summed over positions, i.e.
a *correlation* of the output gradient with the padded input:

    ∂ℓ_n/∂W[g, o, c, k] = Σ_l g[n, g, o, l] x̃[n, g, c, stride·l + dil·k],   ∂ℓ_n/∂b = Σ_l g[n, :, l].

The transposed convolution (:mod:`~curvlib.rules.conv_transpose`) has the
same structure with the roles of ``x`` and ``g`` swapped; a
:class:`Correlation` describes either, and :func:`outer_rule` builds the rule
table of either from a function giving it.

Individual gradients ``[N, C_g, C_x/G, *k]`` of a correlation of
``x [N, C_x, *P]`` with ``g [N, C_g, *L]`` (:func:`per_sample_weight_grad`)
are computed in one of two exact ways, chosen by shape (:func:`choose_method`):

* ``"conv"``: the batch as groups. ``x`` viewed as ``[1, N·C_x, *P]`` and
  ``g`` as ``[1, N·C_g, *L]`` are one grouped convolution's input and output
  gradient (``N·G`` groups), so PyTorch's own weight-gradient kernel
  (``aten.convolution_backward``) gives every sample's gradient at once as
  ``[N·C_g, C_x/G, *k]``, without unfolding (copying) the input ``K`` times;
* ``"bmm"``: ``U`` formed once, then per sample and group the matrix
  product ``g[n, g] U[n, g]ᵀ`` (``[C_g/G, L] × [L, C_x/G·K]``) in one
  :func:`torch.bmm`; for ``1×1`` kernels (``U`` is ``x̃``, up to a strided
  copy), few channels per group, and many channels over few positions.

The gradient ``Σ_n R[n]`` is PyTorch's own weight-gradient kernel with the
layer's groups, or, asked for right after the individual gradients of the
same ``g`` (BatchGrad), their sum.

Squared norms avoid ``[N, *W.shape]`` when ``L² ≤ A·B`` (``A = C_g/G``,
``B = C_x/G·K``): ``‖Σ_l a_l b_lᵀ‖² = Σ_{l,m} (a_l·a_m)(b_l·b_m)`` (two
``[N, G, L, L]`` Gram matrices); for ``L = 1`` the sum of squares is
``Σ_n (a²)(b²)ᵀ``. Otherwise the individual gradients are formed.

The GGN diagonal ``Σ_v Σ_n (J_Wᵀ m_v)²`` (:func:`outer_rule`'s
``sum_squares_over_columns``; per sample: ``batch_sum_squares_over_columns``)
takes the columns ``v`` in blocks: a block of ``B`` columns is folded into
the channels of ``g`` (``B·C_g/G`` per group; of ``g̃`` for the transposed
convolution), so one call (``"bmm"`` on the site's memoised unfold) gives
``[N, G, B, C_g/G, C_x/G, *k]``, squared in place and summed; blocks stay near
:attr:`~curvlib._core.settings.Settings.conv_column_block_bytes` (at least one column; under the ``"batched"``
strategy a whole chunk: :func:`curvlib._core.strategy.column_block_bytes`).
For ``L = 1`` the squares separate, ``Σ_{v,n} (a_vn b_nᵀ)² = Σ_n (Σ_v a_vn²)(b_n²)ᵀ``.

The pieces live in private modules, re-exported here: padding, unfolding and folded root
columns with the per-site memo in :mod:`~curvlib.rules._conv_unfold`; :class:`Correlation`,
a convolution site's correlation and the kernels that need no choice of method in
:mod:`~curvlib.rules._conv_correlation`; the Kronecker factors in :mod:`~curvlib.rules._conv_kron`.
The choices are made here, with :class:`~curvlib._core.settings.Settings` read at call time
(``conv_method``, ``conv_column_block_bytes``).
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from .._core import settings
from .._core.calls import argument
from .._core.errors import CurvatureError
from .._core.strategy import column_block_bytes
from ._conv_correlation import (
    Correlation, CorrelationOf, bias_grad_batch, conv_site_correlation, one_position_column_squares,
    per_sample_by_bmm, per_sample_by_kernel, square_fresh, sum_outer_squares, unfolded_x, weight_grad,
)
from ._conv_kron import input_factor, kron, kron_from_output_matrix, kron_input, weight_output_factor
from ._conv_unfold import cached, explicit_padding, fold_columns, padded_input, patches, prod, unfold
from ._linear_kron import dense_sides
from .._core.family import Family
from .._core.site import Recorder, RoleTensors, Rule, Site
from .._core.tensors import inside_transform

__all__ = [
    "CONV", "PADDING_MODES",
    "Correlation", "CorrelationOf", "bias_grad_batch", "cached", "check", "check_batched",
    "choose_method", "explicit_padding", "fold_columns", "forward", "input_factor", "kron",
    "kron_from_output_matrix", "kron_input", "outer_rule", "padded_input", "patches",
    "per_sample_weight_grad", "unfold", "weight_grad", "weight_output_factor"]

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def choose_method(c_x: int, c_g: int, kernel: int, positions: int, batched: bool = False) -> str:
    """``"conv"`` or ``"bmm"`` for per-sample gradients (see the module docstring).

    Args:
        c_x, c_g: channels per group of ``x`` and ``g`` (``C_x/G``, ``C_g/G``).
        kernel: ``K``, kernel offsets; positions: ``L``.
        batched: inside a functorch transform (``vmap`` over root columns), where
            both methods run through PyTorch's batching rules.

    ``"bmm"`` where the unfold is cheap or the grouped kernel is slow: ``K = 1``
    (``U`` is ``x̃`` itself, up to a strided view), ``C_x·C_g < 192`` (few
    channels per group) and ``C_x·C_g > 256·L`` (many channels over few
    positions); ``"conv"`` otherwise. Under ``vmap``: ``"bmm"`` for ``K = 1`` or
    ``C_x·C_g > 100·L``. Chosen by timing both on CPU (float32, oneDNN; the individual
    gradients written to fresh memory, as in use), where ``"conv"`` is the faster on
    typical ``3×3`` layers.
    """
    forced = settings.current().conv_method
    if forced is not None:
        return forced
    if batched:
        return "bmm" if kernel == 1 or c_x * c_g > 100 * positions else "conv"
    if kernel == 1 or c_x * c_g < 192 or c_x * c_g > 256 * positions:
        return "bmm"
    return "conv"


def per_sample_weight_grad(c: Correlation) -> Tensor:
    """``R [N, C_g, C_x/G, *k]``: every sample's weight gradient (module docstring).

    ``"conv"``: one grouped weight gradient with the batch as groups,
    ``x [1, N·C_x, *P]``, ``g [1, N·C_g, *L]``, ``N·G`` groups
    (:func:`~curvlib.rules._conv_correlation.per_sample_by_kernel`);
    ``"bmm"``: ``g[n, g] U[n, g]ᵀ`` for all ``(n, g)`` in one batched product
    (:func:`~curvlib.rules._conv_correlation.per_sample_by_bmm`).
    """
    c_x, c_g, groups = c.x.shape[1], c.g.shape[1], c.groups
    positions = prod(c.g.shape[2:])
    method = choose_method(c_x // groups, c_g // groups, prod(c.kernel_size), positions, inside_transform(c.g))
    if method == "bmm":
        return per_sample_by_bmm(c)
    return per_sample_by_kernel(c)


def _column_block(c: Correlation, itemsize: int) -> int:
    """Columns per block: ``[N, B, *W]`` near :attr:`~curvlib._core.settings.Settings.conv_column_block_bytes`, ``B ≥ 1`` (``"batched"``
    strategy: :func:`~curvlib._core.strategy.column_block_bytes`, all columns of a chunk)."""
    per_column = c.x.shape[0] * c.g.shape[1] * (c.x.shape[1] // c.groups) * prod(c.kernel_size) * itemsize
    budget = column_block_bytes(c.x.device, settings.current().conv_column_block_bytes)
    return max(1, budget // max(1, per_column))


def _column_squares(correlation: CorrelationOf, site: Site, m: Tensor, batch: bool) -> Tensor:
    """``Σ_v R_v²`` of ``m [V, N, *out]``, summed over samples (``[*W]``) or not (``batch``: ``[N, *W]``);
    ``L = 1``: :func:`~curvlib.rules._conv_correlation.one_position_column_squares`."""
    first = correlation(site, m[:1], True)
    if prod(first.g.shape[2:]) == 1:
        return one_position_column_squares(correlation, site, m, first, batch)
    return _blocked_column_squares(correlation, site, m, first, batch)


def _blocked_column_squares(correlation: CorrelationOf, site: Site, m: Tensor, first: Correlation,
                            batch: bool) -> Tensor:
    """``Σ_v R_v²`` (``[*W]``, or ``[N, *W]`` with ``batch``) over blocks of columns.

    A block of :func:`_column_block` columns is folded into the channels (:func:`fold_columns`),
    so one :func:`_column_weight_grads` gives ``R_v`` for all its ``v``; they are squared in place
    and summed, so the memory stays that of one block. ``first``: the first column's correlation.
    """
    n, c_g, groups = first.g.shape[0], first.g.shape[1], first.groups
    w_shape = (c_g, first.x.shape[1] // groups) + tuple(first.kernel_size)
    step = _column_block(first, m.element_size())
    total = None
    for start in range(0, m.shape[0], step):
        block = m[start:start + step]
        b = block.shape[0]
        c = first if b == 1 and start == 0 else correlation(site, block, True)
        r = _column_weight_grads(c)
        if c.columns == "g":  # channels (g, b, o) of R
            r = r.reshape(n, groups, b, -1)
        else:  # input channels (b, c) of R within each group
            r = r.reshape(n, c_g, b, -1)
        if batch:  # one column: a view, added to in place from the second block on
            part = square_fresh(r).sum(2) if b > 1 else square_fresh(r).squeeze(2)
        else:
            part = square_fresh(r).sum((0, 2))
        total = part if total is None else total.add_(part)
    return total.reshape(((n,) if batch else ()) + w_shape)


def _column_weight_grads(c: Correlation) -> Tensor:
    """``R`` of a block of root columns in ``g``: ``"bmm"`` on the site's memoised unfold (formed once
    for all the call's columns: the faster on every shape), else :func:`per_sample_weight_grad`."""
    if settings.current().conv_method is None and c.columns == "g" and c.unfolded is not None and not inside_transform(c.g):
        return per_sample_by_bmm(c)
    return per_sample_weight_grad(c)


def _weight_squared_norms(c: Correlation) -> Tensor:
    """``‖R[n]‖² [N]``, without ``R`` where that is cheaper.

    ``R[n, g] = Σ_l a_l b_lᵀ`` with ``a_l = g[n, g, :, l]`` (``A = C_g/G``) and
    ``b_l = U[n, g, :, l]`` (``B = C_x/G·K``), so
    ``‖R[n, g]‖² = Σ_{l,m} (a_l·a_m)(b_l·b_m)``: two Gram matrices ``[L, L]``,
    used when ``L² ≤ A·B``; otherwise ``R`` is formed and squared.
    """
    n, groups = c.g.shape[0], c.groups
    positions = prod(c.g.shape[2:])
    size_a = c.g.shape[1] // groups
    size_b = c.x.shape[1] // groups * prod(c.kernel_size)
    if positions * positions <= size_a * size_b:  # Gram matrices [N·G, L, L]
        a = c.g.reshape(n * groups, size_a, positions)
        b = unfolded_x(c).reshape(n * groups, size_b, positions)
        gram = (a.transpose(1, 2) @ a) * (b.transpose(1, 2) @ b)
        return gram.reshape(n, -1).sum(1)
    return square_fresh(per_sample_weight_grad(c).reshape(n, -1)).sum(1)


class _CorrelationRule:
    """The functions of :func:`outer_rule`'s table for one ``correlation`` (each ``(site, g, roles)``)."""

    def __init__(self, correlation: CorrelationOf):
        self.correlation = correlation

    def grad_batch(self, site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
        """Individual gradients: weight ``R [N, *W]``, bias ``Σ_l g [N, C_out]``.

        Weak references to ``g`` and ``R`` stay in ``site.meta`` (never inside a
        functorch transform), so that :meth:`grad` right after sums ``R``.
        """
        out = {}
        if "weight" in roles:
            out["weight"] = per_sample_weight_grad(self.correlation(site, g, False))
            if not inside_transform(g):  # its sum is the gradient, if asked for next
                site.meta["_grad_batch"] = (weakref.ref(g), weakref.ref(out["weight"]))
        if "bias" in roles:
            out["bias"] = bias_grad_batch(g)
        return out

    def grad(self, site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
        """The gradient: weight ``Σ_n R[n] [*W]`` (the individual gradients of the same
        ``g`` just formed by :meth:`grad_batch`, else the kernel), bias ``Σ_{n,l} g [C_out]``."""
        out = {}
        if "weight" in roles:
            g_ref, batch_ref = site.meta.pop("_grad_batch", (None, None))
            batch = batch_ref() if batch_ref is not None and g_ref() is g else None
            if batch is not None:
                out["weight"] = batch.sum(0)
            else:
                out["weight"] = weight_grad(self.correlation(site, g, False))
        if "bias" in roles:
            out["bias"] = g.flatten(2).sum((0, 2))
        return out

    def batch_l2(self, site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
        """Squared norms of the individual gradients, ``[N]`` per role."""
        out = {}
        if "weight" in roles:
            out["weight"] = _weight_squared_norms(self.correlation(site, g, False))
        if "bias" in roles:
            out["bias"] = bias_grad_batch(g).square().sum(1)
        return out

    def sum_grad_squared(self, site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
        """``Σ_n R[n]²`` per role (``L = 1``: ``Σ_n (a²)(b²)ᵀ``, without ``R``)."""
        out = {}
        if "weight" in roles:
            c = self.correlation(site, g, False)
            if prod(c.g.shape[2:]) == 1:
                out["weight"] = sum_outer_squares(c, g_squared=False, x_squared=False)
            else:
                out["weight"] = square_fresh(per_sample_weight_grad(c)).sum(0)
        if "bias" in roles:
            out["bias"] = bias_grad_batch(g).square().sum(0)
        return out

    def sum_squares_over_columns(self, site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
        """``Σ_v Σ_n (J_pᵀ m_v)²`` for a root ``m [V, N, C_out, *out]``, as ``[1, *p]``."""
        out = {}
        if "weight" in roles:
            out["weight"] = _column_squares(self.correlation, site, m, batch=False).unsqueeze(0)
        if "bias" in roles:
            out["bias"] = m.flatten(3).sum(3).square().sum((0, 1)).unsqueeze(0)
        return out

    def batch_sum_squares_over_columns(self, site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
        """``Σ_v (J_pᵀ m_v)²`` per sample ``[N, *p]`` for a root ``m [V, N, C_out, *out]``."""
        out = {}
        if "weight" in roles:
            out["weight"] = _column_squares(self.correlation, site, m, batch=True)
        if "bias" in roles:
            out["bias"] = m.flatten(3).sum(3).square().sum(0)
        return out


def outer_rule(kind: str, correlation: CorrelationOf) -> Rule:
    """Rule table for layers whose weight gradient is a :class:`Correlation`.

    Args:
        kind: the rule's name.
        correlation: ``(site, g, columns) -> Correlation``; the individual weight
            gradient of sample ``n`` is ``R[n]`` (:func:`per_sample_weight_grad`),
            already in the weight's shape ``[C_g, C_x/G, *k]``. With ``columns``,
            ``g`` is a block of root columns ``[B, N, *out]`` folded into the
            channels of one side (:func:`fold_columns`). The bias gradient is
            always :func:`bias_grad_batch` of ``g``.

    ``grad`` called right after ``grad_batch`` with the same ``g`` (the first-order
    read-off asks in this order) sums the individual gradients ``[N, *W]`` just
    formed instead of running the weight-gradient kernel again (``site.meta`` holds
    weak references to both until then; never inside a functorch transform).
    """
    rule = _CorrelationRule(correlation)
    return Rule(
        kind=kind,
        grad_batch=rule.grad_batch,
        grad=rule.grad,
        batch_l2=rule.batch_l2,
        sum_grad_squared=rule.sum_grad_squared,
        sum_squares_over_columns=rule.sum_squares_over_columns,
        batch_sum_squares_over_columns=rule.batch_sum_squares_over_columns,
    )


CONV = outer_rule("conv", conv_site_correlation)


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
    """Run ``nn.Conv1d/2d/3d`` functionally (as its own forward does) and record its site."""
    x = argument(args, kwargs, 0, "input")
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
    }
    if module.groups != 1:  # KFAC/KFLR: per-group factors (kron); KFRA's recursion has none
        meta["kfra_error"] = (
            f"KFRA's factors of a grouped convolution (groups={module.groups}) are not "
            "defined (as in BackPACK); supported: groups=1. KFAC and KFLR give per-group factors."
        )
    return rec.add(Site(CONV, names, where, saved={"x": x}, meta=meta), out)


#: The family's record (:class:`~curvlib._core.family.Family`), registered in :data:`curvlib.rules.FAMILIES`.
FAMILY = Family("conv", (nn.Conv1d, nn.Conv2d, nn.Conv3d), forward, check, kron, kron_input, weight_output_factor,
                kron_from_output_matrix, kron_layout="split", affine_in_input=True, affine_in_parameters=True,
                dense_sides=dense_sides, entry_wise=True)
