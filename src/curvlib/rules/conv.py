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
convolution), so one call gives ``[N, G, B, C_g/G, C_x/G, *k]``, squared in
place and summed; blocks are sized so that this stays near
:data:`COLUMN_BLOCK_BYTES` (at least one column: the block sizes hardly
change the time, the memory stays that of one individual gradient). For
``L = 1`` the squares separate,
``Σ_{v,n} (a_vn b_nᵀ)² = Σ_n (Σ_v a_vn²)(b_n²)ᵀ``.
"""

from __future__ import annotations

import weakref
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._errors import CurvatureError
from ._site import Recorder, RoleTensors, Rule, Site

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}

#: Force the per-sample method (``"conv"`` or ``"bmm"``) instead of choosing by shape
#: (:func:`choose_method`); both are exact, so this only changes speed (and is used by
#: the tests to cover both).
METHOD: Optional[str] = None

#: Target size of one block of per-sample, per-column weight gradients
#: ``[N, B, *W]`` in the GGN diagonal (at least one column per block).
COLUMN_BLOCK_BYTES = 2**20


class Correlation(NamedTuple):
    """``R[n, g, o, c, k] = Σ_l g[n, g, o, l] x[n, g, c, stride·l + dil·k]`` (weight gradient).

    Attributes:
        x: ``[N, C_x, *P]``, padded but for ``padding``.
        g: ``[N, C_g, *L]``.
        kernel_size, stride, dilation: one entry per spatial dim.
        groups: ``G``; channels ``(g, o)`` of ``g`` see only channels ``(g, c)`` of ``x``.
        padding: zeros still to add on both sides of each spatial dim of ``x``
            (``()``: none); PyTorch's kernel pads internally, without a copy.
        unfolded: optional ``() -> U`` of the padded ``x`` ``[N, C_x·K, L]``
            (memoised by the caller).
        columns: ``"g"`` or ``"x"``: the side that holds a block of ``B`` root
            columns folded into its channels (channel ``(g, b, c)``, ``B·C/G`` per
            group), see :func:`fold_columns`.
    """

    x: Tensor
    g: Tensor
    kernel_size: Tuple[int, ...]
    stride: Tuple[int, ...]
    dilation: Tuple[int, ...]
    groups: int
    padding: Tuple[int, ...] = ()
    unfolded: Optional[Callable[[], Tensor]] = None
    columns: str = "g"


# (site, g, columns) -> Correlation of one output gradient g [N, *out] (columns=False)
# or of a block of root columns g [B, N, *out] folded by fold_columns (columns=True).
CorrelationOf = Callable[[Site, Tensor, bool], Correlation]


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
    u = patches(x, kernel_size, stride, dilation, positions)
    u = u.permute([0, 1, *range(2 + d, 2 + 2 * d), *range(2, 2 + d)])
    return u.reshape(x.shape[0], x.shape[1] * _prod(kernel_size), -1)


def patches(
    x: Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
    positions: Sequence[int] = (),
) -> Tensor:
    """The strided view behind :func:`unfold`: ``[N, C, L_1, …, L_d, k_1, …, k_d]`` (no copy)."""
    u = x
    for j in range(len(kernel_size)):
        span = dilation[j] * (kernel_size[j] - 1) + 1
        u = u.unfold(2 + j, span, stride[j])[..., :: dilation[j]]
    if positions:
        u = u[(slice(None), slice(None)) + tuple(slice(0, p) for p in positions)]
    return u


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def bias_grad_batch(g: Tensor) -> Tensor:
    """``g [N, C_out, *L] -> [N, C_out]``: the sum over positions."""
    return g.flatten(2).sum(2)


def fold_columns(t: Tensor, groups: int) -> Tensor:
    """``t [B, N, C, *S] -> [N, G·B·C/G, *S]``: channel ``(g, b, c)`` is ``t[b, n, (g, c)]``.

    Root columns become extra channels of each group, so that one correlation
    serves ``B`` columns; for ``B = 1`` this is a view.
    """
    b, n, c = t.shape[:3]
    spatial = tuple(t.shape[3:])
    t = t.reshape((b, n, groups, c // groups) + spatial).movedim(0, 2)
    return t.reshape((n, c * b) + spatial)


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
    ``C_x·C_g > 100·L``. Measured on CPU (float32, oneDNN; the individual gradients
    written to fresh memory, as in use), where ``"conv"`` is 2-3x faster on
    typical ``3×3`` layers.
    """
    if METHOD is not None:
        return METHOD
    if batched:
        return "bmm" if kernel == 1 or c_x * c_g > 100 * positions else "conv"
    if kernel == 1 or c_x * c_g < 192 or c_x * c_g > 256 * positions:
        return "bmm"
    return "conv"


def _padded(c: Correlation) -> Tensor:
    """``x`` with ``c.padding`` applied."""
    if not any(c.padding):
        return c.x
    return F.pad(c.x, [p for q in reversed(c.padding) for p in (q, q)])


def _fit(c: Correlation) -> Tuple[Tensor, Sequence[int]]:
    """``(x, padding)`` for PyTorch's weight-gradient kernel, which needs a
    convolution of ``x`` to have exactly the ``L`` positions of ``g``.

    Where ``x`` is longer (a transposed convolution's ``g̃`` with
    ``out_pad ≥ stride``) the padded ``x`` is cut to the span of ``L`` positions.
    """
    d = len(c.kernel_size)
    padding = c.padding or (0,) * d
    spans = [dl * (k - 1) + 1 for k, dl in zip(c.kernel_size, c.dilation)]
    natural = [(p + 2 * q - span) // s + 1 for p, q, span, s in zip(c.x.shape[2:], padding, spans, c.stride)]
    if list(natural) == list(c.g.shape[2:]):
        return c.x, padding
    cut = tuple(slice(0, s * (l - 1) + span) for s, l, span in zip(c.stride, c.g.shape[2:], spans))
    return _padded(c)[(slice(None), slice(None)) + cut], (0,) * d


def _conv_weight_grad(g: Tensor, x: Tensor, padding, c: Correlation, groups: int) -> Tensor:
    """``aten.convolution_backward`` (weight only) of a ``groups``-grouped convolution
    of ``x [M, C_x, *P]`` (zero-padded by ``padding``) with output gradient
    ``g [M, C_g, *L]`` and ``c``'s geometry: ``[C_g, C_x/G, *k]``."""
    d = len(c.kernel_size)
    w_shape = (g.shape[1], x.shape[1] // groups) + tuple(c.kernel_size)
    _, gw, _ = torch.ops.aten.convolution_backward(
        g, x, x.new_empty(w_shape), None, list(c.stride), list(padding), list(c.dilation),
        False, [0] * d, groups, [False, True, False],
    )
    return gw


def weight_grad(c: Correlation) -> Tensor:
    """``Σ_n R[n]`` ``[C_g, C_x/G, *k]``, by PyTorch's convolution weight-gradient kernel."""
    x, padding = _fit(c)
    return _conv_weight_grad(c.g, x, padding, c, c.groups)


def _unfolded(c: Correlation) -> Tensor:
    """``U`` of the padded ``x``, ``[N, C_x·K, L]``."""
    if c.unfolded is not None:
        return c.unfolded()
    return unfold(_padded(c), c.kernel_size, c.stride, c.dilation, positions=c.g.shape[2:])


def per_sample_weight_grad(c: Correlation) -> Tensor:
    """``R [N, C_g, C_x/G, *k]``: every sample's weight gradient (module docstring).

    ``"conv"``: one grouped weight gradient with the batch as groups,
    ``x [1, N·C_x, *P]``, ``g [1, N·C_g, *L]``, ``N·G`` groups;
    ``"bmm"``: ``g[n, g] U[n, g]ᵀ`` for all ``(n, g)`` in one batched product.
    """
    n, c_x, c_g, groups = c.x.shape[0], c.x.shape[1], c.g.shape[1], c.groups
    positions = _prod(c.g.shape[2:])
    w_shape = (n, c_g, c_x // groups) + tuple(c.kernel_size)
    method = choose_method(c_x // groups, c_g // groups, _prod(c.kernel_size), positions, _wrapped(c.g))
    if method == "bmm":
        u = _unfolded(c).reshape(n * groups, -1, positions)  # [N·G, C_x/G·K, L]
        a = c.g.reshape(n * groups, c_g // groups, positions)  # [N·G, C_g/G, L]
        return torch.bmm(a, u.transpose(1, 2)).reshape(w_shape)
    x, padding = _fit(c)
    gw = _conv_weight_grad(
        c.g.reshape((1, n * c_g) + tuple(c.g.shape[2:])),
        x.reshape((1, n * c_x) + tuple(x.shape[2:])),
        padding, c, n * groups,
    )
    return gw.reshape(w_shape)


def _squared(r: Tensor) -> Tensor:
    """``r²``, in place (``r`` is a fresh result: no copy of ``[N, *W]``) unless autograd records it."""
    return r.square() if r.requires_grad else r.square_()


def _sum_outer_squares(c: Correlation, g_squared: bool, x_squared: bool) -> Tensor:
    """``Σ_n (a²)(b²)ᵀ`` per group for one position (``L = 1``): ``[C_g, C_x/G, *k]``.

    ``a = g[n, g, :, 0]``, ``b = U[n, g, :, 0]``; a side already squared (a sum of
    squared columns) is not squared again.
    """
    n, c_g, groups = c.g.shape[0], c.g.shape[1], c.groups
    u = _unfolded(c)
    a2 = c.g if g_squared else c.g.square()
    b2 = u if x_squared else u.square()
    a2 = a2.reshape(n, groups, c_g // groups).permute(1, 2, 0)  # [G, C_g/G, N]
    b2 = b2.reshape(n, groups, -1).transpose(0, 1)  # [G, N, C_x/G·K]
    return torch.bmm(a2, b2).reshape((c_g, c.x.shape[1] // groups) + tuple(c.kernel_size))


def _column_block(c: Correlation, itemsize: int) -> int:
    """Columns per block: ``[N, B, *W]`` near :data:`COLUMN_BLOCK_BYTES`, ``B ≥ 1``."""
    per_column = c.x.shape[0] * c.g.shape[1] * (c.x.shape[1] // c.groups) * _prod(c.kernel_size) * itemsize
    return max(1, COLUMN_BLOCK_BYTES // max(1, per_column))


def _column_squares(correlation: CorrelationOf, site: Site, m: Tensor, batch: bool) -> Tensor:
    """``Σ_v R_v²``, summed over samples (``[*W]``) or not (``batch``: ``[N, *W]``).

    ``m [V, N, *out]``. ``L = 1``: ``Σ_v R_v² = (Σ_v a_v²)(b²)ᵀ`` per sample (or
    ``(a²)(Σ_v b_v²)ᵀ`` when the columns sit in ``x``: squares commute with padding
    and unfolding). Otherwise blocks of :func:`_column_block` columns, folded into
    the channels (:func:`fold_columns`).
    """
    first = correlation(site, m[:1], True)
    n, c_g, groups = first.g.shape[0], first.g.shape[1], first.groups
    w_shape = (c_g, first.x.shape[1] // groups) + tuple(first.kernel_size)
    if _prod(first.g.shape[2:]) == 1:
        c = correlation(site, m.square().sum(0), False)
        on_g = c.columns == "g"
        if not batch:
            return _sum_outer_squares(c, g_squared=on_g, x_squared=not on_g)
        u = _unfolded(c)
        a2 = c.g if on_g else c.g.square()
        b2 = u.square() if on_g else u
        a2 = a2.reshape(n, groups, c_g // groups, 1)
        b2 = b2.reshape(n, groups, 1, -1)
        return (a2 * b2).reshape((n,) + w_shape)
    step = _column_block(first, m.element_size())
    total = None
    for start in range(0, m.shape[0], step):
        block = m[start:start + step]
        c = first if block.shape[0] == 1 and start == 0 else correlation(site, block, True)
        r = per_sample_weight_grad(c)
        b = block.shape[0]
        if c.columns == "g":  # channels (g, b, o) of R
            r = r.reshape(n, groups, b, -1)
        else:  # input channels (b, c) of R within each group
            r = r.reshape(n, c_g, b, -1)
        if batch:  # one column: a view, added to in place from the second block on
            part = _squared(r).sum(2) if b > 1 else _squared(r).squeeze(2)
        else:
            part = _squared(r).sum((0, 2))
        total = part if total is None else total.add_(part)
    return total.reshape(((n,) if batch else ()) + w_shape)


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

    def grad_batch(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
        out = {}
        if "weight" in roles:
            out["weight"] = per_sample_weight_grad(correlation(site, g, False))
            if not _wrapped(g):  # its sum is the gradient, if asked for next
                site.meta["_grad_batch"] = (weakref.ref(g), weakref.ref(out["weight"]))
        if "bias" in roles:
            out["bias"] = bias_grad_batch(g)
        return out

    def grad(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
        out = {}
        if "weight" in roles:
            g_ref, batch_ref = site.meta.pop("_grad_batch", (None, None))
            batch = batch_ref() if batch_ref is not None and g_ref() is g else None
            if batch is not None:
                out["weight"] = batch.sum(0)
            else:
                out["weight"] = weight_grad(correlation(site, g, False))
        if "bias" in roles:
            out["bias"] = g.flatten(2).sum((0, 2))
        return out

    def batch_l2(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
        out = {}
        if "weight" in roles:
            c = correlation(site, g, False)
            n, groups = g.shape[0], c.groups
            positions = _prod(c.g.shape[2:])
            size_a = c.g.shape[1] // groups
            size_b = c.x.shape[1] // groups * _prod(c.kernel_size)
            if positions * positions <= size_a * size_b:  # Gram matrices [N·G, L, L]
                a = c.g.reshape(n * groups, size_a, positions)
                b = _unfolded(c).reshape(n * groups, size_b, positions)
                gram = (a.transpose(1, 2) @ a) * (b.transpose(1, 2) @ b)
                out["weight"] = gram.reshape(n, -1).sum(1)
            else:
                out["weight"] = _squared(per_sample_weight_grad(c).reshape(n, -1)).sum(1)
        if "bias" in roles:
            out["bias"] = bias_grad_batch(g).square().sum(1)
        return out

    def sum_grad_squared(site: Site, g: Tensor, roles: Sequence[str]) -> RoleTensors:
        out = {}
        if "weight" in roles:
            c = correlation(site, g, False)
            if _prod(c.g.shape[2:]) == 1:
                out["weight"] = _sum_outer_squares(c, g_squared=False, x_squared=False)
            else:
                out["weight"] = _squared(per_sample_weight_grad(c)).sum(0)
        if "bias" in roles:
            out["bias"] = bias_grad_batch(g).square().sum(0)
        return out

    def sum_squares_over_columns(site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
        """``Σ_v Σ_n (J_pᵀ m_v)²`` for a root ``m [V, N, C_out, *out]``, as ``[1, *p]``."""
        out = {}
        if "weight" in roles:
            out["weight"] = _column_squares(correlation, site, m, batch=False).unsqueeze(0)
        if "bias" in roles:
            out["bias"] = m.flatten(3).sum(3).square().sum((0, 1)).unsqueeze(0)
        return out

    def batch_sum_squares_over_columns(site: Site, m: Tensor, roles: Sequence[str]) -> RoleTensors:
        """``Σ_v (J_pᵀ m_v)²`` per sample ``[N, *p]`` for a root ``m [V, N, C_out, *out]``."""
        out = {}
        if "weight" in roles:
            out["weight"] = _column_squares(correlation, site, m, batch=True)
        if "bias" in roles:
            out["bias"] = m.flatten(3).sum(3).square().sum(0)
        return out

    return Rule(
        kind=kind,
        grad_batch=grad_batch,
        grad=grad,
        batch_l2=batch_l2,
        sum_grad_squared=sum_grad_squared,
        sum_squares_over_columns=sum_squares_over_columns,
        batch_sum_squares_over_columns=batch_sum_squares_over_columns,
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


def _correlation(site: Site, g: Tensor, columns: bool) -> Correlation:
    """``x = x̃ [N, C_in, *P]``, ``g [N, C_out, *L]`` (module docstring); root columns fold into ``g``.

    Zero padding that is the same on both sides of every dim is left to PyTorch's
    kernel (``x`` is then the saved input); other padding is applied here, once.
    """
    m = site.meta
    pad = m["pad"]
    if m["mode"] == "constant" and pad[0::2] == pad[1::2]:
        x, padding = site.saved["x"], tuple(reversed(pad[0::2]))
    else:
        x, padding = padded_input(site), ()
    if columns:
        g = fold_columns(g, m["groups"])

    def unfolded() -> Tensor:
        return cached(site, "unfold", lambda: unfold(padded_input(site), m["kernel_size"], m["stride"], m["dilation"]))

    return Correlation(
        x, g, m["kernel_size"], m["stride"], m["dilation"], m["groups"], padding, unfolded, columns="g"
    )


CONV = outer_rule("conv", _correlation)


def kron(site: Site, role: str, m: Tensor, approx: Optional[str] = None) -> List[Tensor]:
    """Kronecker factors from the pulled-back root ``m [V, N, C_out, *L]``.

    BackPACK's (``approx=None``): ``B = Σ_{v,n} s sᵀ [C_out, C_out]`` with
    ``s = Σ_l m[v, n, :, l]`` (positions summed *before* the outer product, so
    ``B`` is the bias GGN); weight: ``[B, A]`` with ``A`` from :func:`kron_input`,
    bias: ``[B]``. ``"expand"``: ``B = Σ_{v,n,l} m mᵀ``; ``"reduce"``: ``B`` as
    BackPACK's (curvlinops' definitions). With ``groups = G > 1`` the weight's
    factors are block-diagonal per group (:func:`weight_output_factor`,
    :func:`kron_input`): ``[B [G, C_out/G, C_out/G], A [G, C_in/G·K, C_in/G·K]]``,
    the GGN block of group ``g``'s weights ``W[g·C_out/G:(g+1)·C_out/G]``
    (row-major) approximated by ``B[g] ⊗ A[g]``, groups uncoupled; the bias keeps
    the full ``[B]``.
    """
    if approx == "expand":
        s = m.flatten(3).transpose(2, 3).reshape(-1, m.shape[2])  # [V·N·L, C_out]
    else:
        s = m.flatten(3).sum(3).flatten(0, 1)  # [V·N, C_out]
    B = s.t() @ s
    return [B] if role == "bias" else [weight_output_factor(site, B), kron_input(site, approx)]


def weight_output_factor(site: Site, B: Tensor) -> Tensor:
    """The weight's output factor from the full ``B [C_out, C_out]``: ``B`` itself for
    ``groups = 1``, else its ``G`` diagonal blocks ``[G, C_out/G, C_out/G]`` (a group's
    weights see only their own output channels)."""
    groups = site.meta["groups"]
    if groups == 1:
        return B
    o = B.shape[0] // groups
    return B.reshape(groups, o, groups, o).diagonal(dim1=0, dim2=2).permute(2, 0, 1)


def kron_input(site: Site, approx: Optional[str] = None) -> Tensor:
    """``A = (1/N) Σ_{n,l} U[n, :, l] U[n, :, l]ᵀ [C_in·K, C_in·K]`` (BackPACK's).

    ``U`` is the unfold of the padded input, with ``padding_mode`` applied
    (BackPACK always pads with zeros; the two agree for ``"zeros"``).
    ``"expand"``: the same over ``N·L``; ``"reduce"``: ``(1/N) Σ_n Ū Ūᵀ`` with ``Ū``
    the mean over positions.
    """
    m = site.meta
    x = padded_input(site)
    d = len(m["kernel_size"])
    u = patches(x, m["kernel_size"], m["stride"], m["dilation"])
    # one copy, straight into [C_in·K, N·L]: rows (c, k), columns (n, l)
    cols = u.permute([1, *range(2 + d, 2 + 2 * d), 0, *range(2, 2 + d)]).reshape(u.shape[1] * _prod(m["kernel_size"]), -1)
    groups = m["groups"]
    if groups != 1:  # rows (g, c, k): one factor per group, [G, C_in/G·K, N·L]
        cols = cols.reshape(groups, cols.shape[0] // groups, cols.shape[1])
    return input_factor(cols, x.shape[0], approx)


def input_factor(cols: Tensor, n: int, approx: Optional[str]) -> Tensor:
    """``A`` from the unfolded inputs ``cols [*G, C·K, N·L]`` (columns ordered ``(n, l)``;
    optional leading group dims give one factor per group)."""
    if approx == "reduce":
        cols = cols.reshape(cols.shape[:-1] + (n, -1)).mean(-1)
        return cols @ cols.transpose(-1, -2) / n
    scale = n * (cols.shape[-1] // n) if approx == "expand" else n
    return cols @ cols.transpose(-1, -2) / scale


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
    if module.groups != 1:  # KFAC/KFLR: per-group factors (kron); KFRA's recursion has none
        meta["kfra_error"] = (
            f"KFRA's factors of a grouped convolution (groups={module.groups}) are not "
            "defined (as in BackPACK); supported: groups=1. KFAC and KFLR give per-group factors."
        )
    return rec.add(Site(CONV, names, where, saved={"x": x}, meta=meta), out)
