"""The weight gradient of a convolution as a :class:`Correlation`, and its kernels.

Letters as in :mod:`~curvlib.rules.conv`. A convolution's individual weight
gradient is a correlation of the output gradient ``g`` with the padded input
``x̃``; a transposed convolution's is the same with the roles swapped. Either
is described by a :class:`Correlation`,

    R[n, g, o, c, k] = Σ_l g[n, g, o, l] x[n, g, c, stride·l + dil·k],

and computed here in one of two exact ways (the choice between them, by shape
or by :attr:`curvlib._core.settings.Settings.conv_method`, is made by
:func:`curvlib.rules.conv.per_sample_weight_grad`):

* :func:`per_sample_by_kernel`: the batch as groups of one convolution, so that
  PyTorch's own weight-gradient kernel gives every sample's ``R[n]`` at once;
* :func:`per_sample_by_bmm`: ``R[n, g] = g[n, g] U[n, g]ᵀ`` from the unfold
  ``U`` (:func:`~curvlib.rules._conv_unfold.unfold`), one :func:`torch.bmm`.

The sum ``Σ_n R[n]`` is the kernel's own weight gradient (:func:`weight_grad`).
A convolution's site gives its correlation by :func:`conv_site_correlation`
(a transposed convolution's: :mod:`~curvlib.rules.conv_transpose`). For one
position (``L = 1``) ``R[n] = a bᵀ`` is an outer product, so its squares need
no ``R``: ``R[n]² = (a²)(b²)ᵀ`` (:func:`sum_outer_squares`,
:func:`one_position_column_squares`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._conv_unfold import cached, fold_columns, padded_input, prod, unfold
from .._core.site import Site
from .._core.tensors import in_place_safe


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
            group), see :func:`~curvlib.rules._conv_unfold.fold_columns`.
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


def conv_site_correlation(site: Site, g: Tensor, columns: bool) -> Correlation:
    """``x = x̃ [N, C_in, *P]``, ``g [N, C_out, *L]`` (:mod:`~curvlib.rules.conv`); root columns fold into ``g``.

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


def bias_grad_batch(g: Tensor) -> Tensor:
    """``g [N, C_out, *L] -> [N, C_out]``: the sum over positions."""
    return g.flatten(2).sum(2)


def padded_x(c: Correlation) -> Tensor:
    """``x`` with ``c.padding`` applied."""
    if not any(c.padding):
        return c.x
    return F.pad(c.x, [p for q in reversed(c.padding) for p in (q, q)])


def x_fit_to_positions(c: Correlation) -> Tuple[Tensor, Sequence[int]]:
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
    return padded_x(c)[(slice(None), slice(None)) + cut], (0,) * d


def kernel_weight_grad(g: Tensor, x: Tensor, padding: Sequence[int], c: Correlation, groups: int) -> Tensor:
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
    x, padding = x_fit_to_positions(c)
    return kernel_weight_grad(c.g, x, padding, c, c.groups)


def unfolded_x(c: Correlation) -> Tensor:
    """``U`` of the padded ``x``, ``[N, C_x·K, L]``."""
    if c.unfolded is not None:
        return c.unfolded()
    return unfold(padded_x(c), c.kernel_size, c.stride, c.dilation, positions=c.g.shape[2:])


def per_sample_by_bmm(c: Correlation) -> Tensor:
    """``R [N, C_g, C_x/G, *k]`` as ``g[n, g] U[n, g]ᵀ`` (``[C_g/G, L] × [L, C_x/G·K]``)
    for all ``(n, g)`` in one :func:`torch.bmm`."""
    n, c_x, c_g, groups = c.x.shape[0], c.x.shape[1], c.g.shape[1], c.groups
    positions = prod(c.g.shape[2:])
    w_shape = (n, c_g, c_x // groups) + tuple(c.kernel_size)
    u = unfolded_x(c).reshape(n * groups, -1, positions)  # [N·G, C_x/G·K, L]
    a = c.g.reshape(n * groups, c_g // groups, positions)  # [N·G, C_g/G, L]
    return torch.bmm(a, u.transpose(1, 2)).reshape(w_shape)


def per_sample_by_kernel(c: Correlation) -> Tensor:
    """``R [N, C_g, C_x/G, *k]`` by one grouped weight gradient with the batch as groups:
    ``x [1, N·C_x, *P]``, ``g [1, N·C_g, *L]``, ``N·G`` groups, so group ``(n, g)``'s
    kernel gradient is ``R[n, g]``."""
    n, c_x, c_g, groups = c.x.shape[0], c.x.shape[1], c.g.shape[1], c.groups
    w_shape = (n, c_g, c_x // groups) + tuple(c.kernel_size)
    x, padding = x_fit_to_positions(c)
    gw = kernel_weight_grad(
        c.g.reshape((1, n * c_g) + tuple(c.g.shape[2:])),
        x.reshape((1, n * c_x) + tuple(x.shape[2:])),
        padding, c, n * groups,
    )
    return gw.reshape(w_shape)


def square_fresh(r: Tensor) -> Tensor:
    """``r²``, in place (``r`` is a fresh result: no copy of ``[N, *W]``) unless autograd records
    it or it is a torch.func tensor (vmap has no in-place batching rule for ``square_``)."""
    return r.square_() if in_place_safe(r) else r.square()


def sum_outer_squares(c: Correlation, g_squared: bool, x_squared: bool) -> Tensor:
    """``Σ_n (a²)(b²)ᵀ`` per group for one position (``L = 1``): ``[C_g, C_x/G, *k]``.

    ``a = g[n, g, :, 0]``, ``b = U[n, g, :, 0]``; a side already squared (a sum of
    squared columns) is not squared again.
    """
    n, c_g, groups = c.g.shape[0], c.g.shape[1], c.groups
    u = unfolded_x(c)
    a2 = c.g if g_squared else c.g.square()
    b2 = u if x_squared else u.square()
    a2 = a2.reshape(n, groups, c_g // groups).permute(1, 2, 0)  # [G, C_g/G, N]
    b2 = b2.reshape(n, groups, -1).transpose(0, 1)  # [G, N, C_x/G·K]
    return torch.bmm(a2, b2).reshape((c_g, c.x.shape[1] // groups) + tuple(c.kernel_size))


def one_position_column_squares(
    correlation: CorrelationOf, site: Site, m: Tensor, first: Correlation, batch: bool
) -> Tensor:
    """``Σ_v R_v²`` for ``L = 1`` (``[*W]``, or ``[N, *W]`` with ``batch``), without any ``R_v``.

    With one position ``R_v[n] = a_vn b_nᵀ`` is an outer product, so the squares
    separate: ``Σ_v R_v[n]² = (Σ_v a_vn²)(b_n²)ᵀ`` (or ``(a_n²)(Σ_v b_vn²)ᵀ``
    when the columns sit in ``x``: squares commute with padding and unfolding).
    ``first``: the correlation of the first column, for the shapes.
    """
    n, c_g, groups = first.g.shape[0], first.g.shape[1], first.groups
    w_shape = (c_g, first.x.shape[1] // groups) + tuple(first.kernel_size)
    c = correlation(site, m.square().sum(0), False)
    on_g = c.columns == "g"
    if not batch:
        return sum_outer_squares(c, g_squared=on_g, x_squared=not on_g)
    u = unfolded_x(c)
    a2 = c.g if on_g else c.g.square()
    b2 = u.square() if on_g else u
    a2 = a2.reshape(n, groups, c_g // groups, 1)
    b2 = b2.reshape(n, groups, 1, -1)
    return (a2 * b2).reshape((n,) + w_shape)
