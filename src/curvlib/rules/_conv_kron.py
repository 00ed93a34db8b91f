"""Kronecker factors (KFAC, KFLR, KFRA) of convolutions ``nn.Conv1d/2d/3d``.

The weight's curvature block is approximated as ``B ⊗ A``: ``B [C_out, C_out]``
from the output side (the pulled-back root, or KFRA's output matrix) and
``A [C_in·K, C_in·K]`` from the unfolded input ``U [N, C_in·K, L]``
(:func:`~curvlib.rules._conv_unfold.unfold`); the bias gets ``B`` alone.
Conventions are BackPACK's, with curvlinops' ``"expand"``/``"reduce"``
variants. With ``groups = G > 1`` the weight's factors are block-diagonal per
group (``[B [G, C_out/G, C_out/G], A [G, C_in/G·K, C_in/G·K]]``); KFRA is refused
there (``meta["kfra_error"]``).
"""

from __future__ import annotations

from typing import List, Optional

from torch import Tensor

from ._conv_unfold import padded_input, patches, prod
from ._gram import gram
from .._core.site import Site


def kron(site: Site, role: str, m: Tensor, approx: Optional[str] = None,
         max_dim: Optional[int] = None) -> List[Tensor]:
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
    the full ``[B]``. ``max_dim``: a side larger than it gets its diagonal
    (:func:`curvlib.rules._gram.gram`; grouped: the blocks' diagonals in group order).
    """
    if approx == "expand":
        s = m.flatten(3).transpose(2, 3).reshape(-1, m.shape[2])  # [V·N·L, C_out]
    else:
        s = m.flatten(3).sum(3).flatten(0, 1)  # [V·N, C_out]
    B = gram(s, max_dim)
    return [B] if role == "bias" else [weight_output_factor(site, B), kron_input(site, approx, max_dim)]


def weight_output_factor(site: Site, B: Tensor) -> Tensor:
    """The weight's output factor from the full ``B [C_out, C_out]``: ``B`` itself for
    ``groups = 1``, else its ``G`` diagonal blocks ``[G, C_out/G, C_out/G]`` (a group's
    weights see only their own output channels; a diagonal ``B [C_out]`` is its own blocks)."""
    groups = site.meta["groups"]
    if groups == 1 or B.dim() == 1:
        return B
    o = B.shape[0] // groups
    return B.reshape(groups, o, groups, o).diagonal(dim1=0, dim2=2).permute(2, 0, 1)


def kron_input(site: Site, approx: Optional[str] = None, max_dim: Optional[int] = None) -> Tensor:
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
    cols = u.permute([1, *range(2 + d, 2 + 2 * d), 0, *range(2, 2 + d)]).reshape(u.shape[1] * prod(m["kernel_size"]), -1)
    groups = m["groups"]
    if groups != 1:  # rows (g, c, k): one factor per group, [G, C_in/G·K, N·L]
        cols = cols.reshape(groups, cols.shape[0] // groups, cols.shape[1])
    return input_factor(cols, x.shape[0], approx, max_dim)


def input_factor(cols: Tensor, n: int, approx: Optional[str], max_dim: Optional[int] = None) -> Tensor:
    """``A`` from the unfolded inputs ``cols [*G, C·K, N·L]`` (columns ordered ``(n, l)``;
    optional leading group dims give one factor per group; ``C·K > max_dim``: its diagonal)."""
    if approx == "reduce":
        cols = cols.reshape(cols.shape[:-1] + (n, -1)).mean(-1)
        return gram(cols.transpose(-1, -2), max_dim, 1.0 / n)
    scale = n * (cols.shape[-1] // n) if approx == "expand" else n
    return gram(cols.transpose(-1, -2), max_dim, 1.0 / scale)


def kron_from_output_matrix(site: Site, role: str, G: Tensor) -> List[Tensor]:
    """KFRA factors from the batch-averaged output matrix ``G [C_out·L, C_out·L]``.

    As BackPACK: ``B[o, p] = Σ_{l,m} G[(o, l), (p, m)]``; weight ``[B, A]``, bias ``[B]``.
    """
    c_out = site.meta["out_channels"]
    B = G.reshape(c_out, G.shape[0] // c_out, c_out, G.shape[1] // c_out).sum((1, 3))
    return [B] if role == "bias" else [B, kron_input(site)]
