"""Kronecker factors of a generic parameter with ``≥ 2`` dims (no hand-written rule).

Bias-like parameters. A parameter ``p [*L, D]`` (leading dims flattened into ``R`` rows)
used only by one op ``z = h ± sel(p)`` in ``forward``, where ``sel`` selects and
broadcasts rows (``self.pos``, ``self.pos[:T]``, ``self.wpe.weight``,
``self.wpe(torch.arange(T))``), is an embedding looked up at *fixed* rows: position
``s`` of every sample reads row ``r(s)``, the same for all samples, and
``∂ℓ_n/∂p[r] = ± Σ_{s: r(s) = r} m[n, s]``. Embedding's factors
(:func:`curvlib.rules.embedding.kron`) then apply with ``idx[n, s] = r(s)``:

* ``A [R]``: the diagonal of ``(1/N) Σ_{n,s} e_{r(s)} e_{r(s)}ᵀ``, i.e. how often each
  row is read per sample (``"expand"``: ``/ S``, ``S`` positions);
* ``B [D, D]``: ``Σ_{v,n} (Σ_s m)(Σ_s m)ᵀ`` (``"expand"``: ``Σ_{v,n,s} m mᵀ``).

``"reduce"``'s input factor, the mean over positions of the one-hot inputs, is a dense
``R x R`` matrix: refused like Embedding's on sequences.

The row map ``r(s)`` is read off the op itself, run on one sample with ``h = 0`` and
``p`` replaced by ``row + 1`` (then by ``column + 1``): the op is bias-like exactly when
the output's last dim is ``p``'s columns in order and the rest a selection of rows
(a scale such as ``torch.add(h, p, alpha=2)`` or a broadcast over columns fails the
check). Any other ``≥ 2``-dim generic parameter gets the diagonal of its exact block,
``[F [P]]`` (see :func:`diagonal_block`).
"""

from __future__ import annotations

import operator
from typing import Callable, List, Optional

import torch
from torch import Tensor, nn

from . import embedding, functional
from ._gram import gram
from .._core.batch_layout import batch_first, from_batch_first
from .._core.site import Site, sample_layout

__all__ = ["unused_block", "BIAS_OPS", "bias_like", "row_map", "kron", "squares_per_sample", "diagonal_block", "tied_across_layers", "generic_block"]

#: Ops ``h ± p`` that can make a parameter bias-like.
BIAS_OPS = (operator.add, operator.sub, torch.add, torch.sub, operator.iadd, operator.isub)


def bias_like(site: Site) -> bool:
    """Whether ``site`` is a functional op ``h ± sel(p)`` of one parameter (structure only;
    :func:`row_map` checks the selection numerically)."""
    use = site.meta.get("use")
    return (use is not None and use.node.target in BIAS_OPS and not use.node.kwargs and len(use.params) == 1
            and len(use.inputs) == 1 and all(_selects(node, site.meta["root"]) for node in use.chain))


def _selects(node, root) -> bool:
    """A chain node that reads or selects rows (``p``, ``p[:T]``, ``wpe(arange(T))``) or
    computes the row indices (``arange``, the input's shape)."""
    if node.op in ("get_attr", "placeholder"):
        return True
    if node.op == "call_module":
        return isinstance(root.get_submodule(node.target), nn.Embedding)
    if not node.all_input_nodes and isinstance(getattr(node.target, "value", None), Tensor):
        return True  # a tensor created in forward from constants (``arange(T)`` as a traced constant)
    return node.target in _INDEXING


_INDEXING = (operator.getitem, "__getitem__", torch.arange, "size", getattr, len)


def row_map(site: Site) -> Optional[Tensor]:
    """``r [S]``: the parameter row every output position reads (``None``: not bias-like)."""
    if not bias_like(site):
        return None
    name = site.meta["use"].params[0]
    p = site.saved[f"param:{name}"]
    if p.dim() < 2:
        return None
    rows, cols = p.shape[:-1].numel(), p.shape[-1]
    x = site.saved["in0"]  # batch first; the op runs in its own layout (sample_layout)
    in_dims, out_dim = sample_layout(site, {"in0": x}, x.shape[0] if x.dim() else 0)
    zero = x.new_zeros((1,) + tuple(x.shape[1:]) if in_dims["in0"] is not None else x.shape, dtype=torch.float64)
    zero = from_batch_first(zero, in_dims["in0"]) if in_dims["in0"] else zero
    ids = torch.arange(1, rows + 1, dtype=torch.float64, device=p.device).reshape(p.shape[:-1] + (1,))
    row_ids = _run(site, ids.expand(p.shape), zero)
    col_ids = _run(site, torch.arange(1, cols + 1, dtype=torch.float64, device=p.device).expand(p.shape), zero)
    if row_ids is None or col_ids is None or col_ids.shape[-1] != cols:
        return None
    row_ids, col_ids = batch_first(row_ids, out_dim), batch_first(col_ids, out_dim)
    if not bool((col_ids.abs() == torch.arange(1, cols + 1, dtype=torch.float64, device=p.device)).all()):
        return None
    if not bool((row_ids == row_ids[..., :1]).all()):
        return None
    return (row_ids[0, ..., 0].abs().round().long() - 1).reshape(-1)


def _run(site: Site, value: Tensor, zero: Tensor) -> Optional[Tensor]:
    """The op on one sample with ``h = 0`` and the parameter replaced by ``value``."""
    use = site.meta["use"]
    try:
        out = functional.evaluate(use, site.meta["root"], site.meta["param_names"], {use.params[0]: value},
                                  [zero], constants=site.meta.get("constants"))
    except Exception:  # noqa: BLE001 - an op that cannot take float64 ids is not a plain selection
        return None
    return out if isinstance(out, Tensor) and out.dtype == torch.float64 and out.dim() >= 1 else None


def kron(site: Site, rows: Tensor, m: Tensor, approx: Optional[str], max_dim: Optional[int] = None) -> List[Tensor]:
    """``[A [R], B [D, D]]`` from the root ``m [V, N, *S, D]`` at the op's output (see module doc;
    ``B [D]`` when ``D > max_dim``)."""
    n = m.shape[1]
    name = site.meta["use"].params[0]
    p = site.saved[f"param:{name}"]
    lookup = Site(site.rule, site.params, site.where, saved={"idx": rows.unsqueeze(0).expand(n, -1)},
                  meta={"padding_idx": None, "num_embeddings": p.shape[:-1].numel(),
                        "dtype": m.dtype})
    m = m.reshape(m.shape[0], n, rows.shape[0], m.shape[-1])
    return embedding.kron(lookup, "weight", m, approx, max_dim)


def squares_per_sample(site: Site, rows: Tensor, m: Tensor) -> Tensor:
    """``[N, *p]``: ``Σ_v (∂(m_v · z)/∂p)²`` per sample, all columns ``m [V, N, *S, D]`` at once.

    Column ``v``'s gradient of sample ``n`` at row ``r`` is ``± Σ_{s: r(s) = r} m[v, n, s]``
    (module doc): positions reading one row are summed by an ``index_add`` into the ``U``
    rows read at all (``U ≤ S``), squared and summed over the columns there, and only the
    ``[N, U, D]`` sums are placed among the parameter's ``R`` rows. The ``[V, N, R, D]``
    gradients themselves are never formed (``R``: a position table's length, often many times
    the positions used)."""
    v, n = m.shape[:2]
    p = site.saved[f"param:{site.meta['use'].params[0]}"]
    m = m.reshape(v, n, rows.shape[0], m.shape[-1])
    used, slot = torch.unique(rows, return_inverse=True)
    if used.shape[0] < rows.shape[0]:  # several positions read one row: sum them before the square
        m = m.new_zeros(v, n, used.shape[0], m.shape[-1]).index_add(2, slot, m)
        rows = used
    squares = (m**2).sum(0)  # [N, U, D]
    out = squares.new_zeros(n, p.shape[:-1].numel(), m.shape[-1]).index_add(1, rows, squares)
    return out.reshape((n,) + tuple(p.shape))


def unused_block(p: Tensor, max_dim: Optional[int] = None) -> List[Tensor]:
    """The factors of a parameter the forward does not use: its gradient, and so its every
    curvature block, is zero. In the layout a generic parameter of its shape gets
    (:func:`generic_block`): ``[F [P]]`` for ``≥ 2`` dims, else ``[F [P, P]]`` (diagonal when
    ``P > max_dim``)."""
    S = p.new_zeros((1, 1) + tuple(p.shape))
    return diagonal_block(S) if S.dim() > 3 else [gram(S.reshape(-1, max(p.numel(), 1)), max_dim)]


def diagonal_block(sqrt: Tensor) -> List[Tensor]:
    """``[F [P]]``: the diagonal of the exact block ``Σ_{v,n} s sᵀ`` from ``sqrt [V, N, *p]``
    (the exact/MC GGN's, or for ``KFACEmpirical`` the per-sample gradients': then the sum
    of squared gradients); a 1-D factor stands for a diagonal matrix."""
    return [(sqrt**2).sum((0, 1)).reshape(-1)]


def tied_across_layers(u, family_of=None) -> bool:
    """A parameter used by several sites that are not all Linear weights in one role (tied
    input/output embeddings: ``head.weight = tok.weight``, ``W [V, D]`` read by the Embedding
    at rows ``idx`` and by the Linear with output ``V`` and input ``D``). No single Kronecker product holds
    both uses: the Embedding's ``V`` side is its (one-hot) input, the Linear's its output,
    and a sum of the two pairs' factors, ``(B_lin + diag(A_emb)) ⊗ (A_lin + B_emb)``, would
    add gradient to input covariances, whose split of scale between the factors is
    arbitrary. Kronecker extensions give it the diagonal of its exact block, ``[F [P]]``."""
    if len(u) < 2:
        return False
    kinds = {s.rule.kind for s, _ in u}
    # A Linear or recurrent module applied several times shares its weights over positions.
    families = {family_of[s.where] for s, _ in u} if family_of else {"linear"}
    one_family = len(families) == 1 and families <= {"linear", "rnn"}
    return kinds != {"linear"} or not one_family or len({r for _, r in u}) > 1


def generic_block(u, m_by_site, sqrt: Callable[[], Tensor], approx: Optional[str],
                  max_dim: Optional[int] = None) -> List[Tensor]:
    """Factors of a parameter without Kronecker factors of its rule's own, used by the sites
    ``u`` (``sqrt()``: its ``[V, N, *p]`` root, uses summed): a bias-like ``≥ 2``-dim one
    (``h + self.pos``) gets Embedding's layout at its fixed rows (:func:`kron`); a ``≥ 2``-dim
    generic one or one tied across layers the diagonal of its exact block ``[F [P]]``; the
    others (scale and shift of normalisations, 1-D parameters) the exact block
    ``F = Σ_{v,n} (J_pᵀ m_v)(J_pᵀ m_v)ᵀ [P, P]`` (:mod:`curvlib._core.kronlayout`), or its diagonal
    ``[F [P]]`` when ``P > max_dim``."""
    rows = row_map(u[0][0]) if len(u) == 1 else None
    if rows is not None:
        return kron(u[0][0], rows, m_by_site[u[0][0].key], approx, max_dim)
    S = sqrt()
    if S.dim() > 3 and (all(site.rule.kind == "generic" for site, _ in u) or tied_across_layers(u)):
        return diagonal_block(S)
    return [gram(S.reshape(-1, S[0, 0].numel()), max_dim)]
