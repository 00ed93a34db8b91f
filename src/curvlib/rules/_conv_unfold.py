"""Index layouts of convolution inputs: explicit padding, unfolding, folded root columns.

Letters as in :mod:`~curvlib.rules.conv`: ``n`` batch, ``g`` group, ``c``
channel, ``k`` kernel offset (``K = k_1⋯k_d`` of them, row-major), ``l``
output position (``L = L_1⋯L_d``, row-major), ``d`` the number of spatial dims.

Padding of any kind is first made explicit (:func:`explicit_padding`),
``x̃ = pad(x)``; the *unfold* of the padded input (:func:`unfold`),

    U[n, c·K + k, l] = x̃[n, c, stride·l + dil·k]          [N, C·K, L],

turns a convolution into a per-group matrix product. Both depend on the saved
input only, so a site computes them once (:func:`cached`, :func:`padded_input`),
except inside a functorch transform, where nothing may be kept
(:func:`curvlib._core.tensors.inside_transform`).
"""

from __future__ import annotations

from typing import Callable, List, Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from .._core.site import Site
from .._core.tensors import inside_transform


def prod(values: Sequence[int]) -> int:
    """``Π values`` (``1`` for none): e.g. ``K`` from a kernel size, ``L`` from an output shape."""
    out = 1
    for v in values:
        out *= v
    return out


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
    return u.reshape(x.shape[0], x.shape[1] * prod(kernel_size), -1)


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


def fold_columns(t: Tensor, groups: int) -> Tensor:
    """``t [B, N, C, *S] -> [N, G·B·C/G, *S]``: channel ``(g, b, c)`` is ``t[b, n, (g, c)]``.

    Root columns become extra channels of each group, so that one correlation
    serves ``B`` columns; for ``B = 1`` this is a view.
    """
    b, n, c = t.shape[:3]
    spatial = tuple(t.shape[3:])
    t = t.reshape((b, n, groups, c // groups) + spatial).movedim(0, 2)
    return t.reshape((n, c * b) + spatial)


def cached(site: Site, key: str, compute: Callable[[], Tensor]) -> Tensor:
    """A per-site memo for tensors derived from the saved inputs only (unfolds, paddings).

    Inside a functorch transform (the second-order read-off vmaps over
    columns) nothing is stored: a tensor made there must not leave it.
    """
    x = site.saved["x"]
    if inside_transform(x):
        return compute()
    memo = site.meta.setdefault("_memo", {})
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def padded_input(site: Site) -> Tensor:
    """``x̃ [N, C_in, *P]``: the saved input with the layer's padding applied (computed once per site)."""
    return cached(site, "padded", lambda: _pad_saved_input(site))


def _pad_saved_input(site: Site) -> Tensor:
    """``pad(x)`` with the site's per-side amounts and mode; ``x`` itself where all are zero."""
    m, x = site.meta, site.saved["x"]
    return F.pad(x, m["pad"], mode=m["mode"]) if any(m["pad"]) else x
