"""Scores as directional derivatives: ``⟨g_n, v⟩ = (∂ℓ_n/∂f_n) · (J_n v)`` for every example ``n``
of a batch and each preconditioned query ``v``.

One Jacobian-vector product per query (forward mode where torch has one for every operation of
the model; reverse over reverse otherwise, :class:`curvlib.operators.Jacobian`'s), contracted
with each example's output gradient ``∂ℓ_n/∂f_n``. No example's gradient is formed: the memory
is a forward's, the directions (forward mode holds a copy of each beside its parameter: ``P``
entries per query of a chunk) and ``K`` output-sized tangents per chunk of ``K`` queries, all
of it but the directions proportional to the examples per product; the time grows with the
number of queries (one forward-mode pass each).
"""

from __future__ import annotations

from typing import Dict, Mapping

import torch
from torch import Tensor, nn

from .. import losses
from .._core.errors import CurvatureError
from .._transform.network import translated
from ..operators import Jacobian
from ..operators.data import pairs
from ._blocks import dense
from ._fit import layout_of

__all__ = ["Directional", "METHODS", "first_pair", "check_method"]

#: ``scores(method=...)``: each batch's example gradients, or Jacobian-vector products per query
METHODS = ("gradients", "jvp")


class Directional:
    """``[Q, N_b]`` scores of a batch against preconditioned queries, by Jacobian-vector products."""

    def __init__(self, model: nn.Module, lossfn, first, params: Mapping[str, Tensor], buffers, output,
                 chunk_size: int):
        self.jacobian = Jacobian(model, lossfn, first, params=dict(params), buffers=buffers, output=output)
        self.params, self.buffers, self.chunk_size = dict(params), buffers, chunk_size
        self.spec = losses.loss_spec(lossfn)

    def directions(self, factors: Mapping, prepared: Mapping, start: int, stop: int) -> Dict[str, Tensor]:
        """Queries ``start:stop`` as parameter-shaped directions ``{name: [K, *p]}``."""
        out = {}
        for name, block in factors["blocks"].items():
            query = prepared["blocks"][name]
            chunk = tuple(t[start:stop] for t in query) if isinstance(query, tuple) else query[start:stop]
            out[name] = layout_of(block).from_core(dense(chunk))
        return out

    def scores(self, X, y, factors: Mapping, prepared: Mapping) -> Tensor:
        network = self.jacobian.network
        batch = translated(network.model, lambda: network.batch(X, y, self.params, self.buffers))
        normaliser = losses.normaliser(self.spec, y)
        scale = 1.0 if self.spec.reduction == "sum" else float(normaliser)
        with torch.no_grad():
            out = batch.output({})
        # each example's output gradient of its own summed loss: ∂(c Σ ℓ)/∂f times M; the output
        # freed before the products (an output-sized tensor beside their own)
        u = torch.func.grad(batch.loss)(out.detach()) * scale
        del out
        rows = []
        for start in range(0, prepared["count"], self.chunk_size):
            V = self.directions(factors, prepared, start, start + self.chunk_size)
            theta = {n: batch.values[n] for n in V}
            V = {n: v.to(theta[n].dtype) for n, v in V.items()}
            jv = translated(network.model, lambda: self.jacobian.jacobian_products(batch, theta, V))  # [K, N, *out]
            rows.append((jv * u).flatten(2).sum(-1).to(_dtype(prepared)))
            del jv
        return torch.cat(rows)


def check_method(method, chunk_size) -> None:
    if method not in METHODS:
        raise CurvatureError(f"method={method!r} is not supported; use one of {METHODS}.")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise CurvatureError(f"chunk_size={chunk_size!r}: must be a positive int (queries per product).")


def _dtype(prepared: Mapping) -> torch.dtype:
    first = next(iter(prepared["blocks"].values()))
    return (first[0] if isinstance(first, tuple) else first).dtype


def first_pair(data):
    """The first ``(X, y)`` of ``data`` (a pair, or a loader's first batch)."""
    for pair in pairs(data):
        return pair
    raise CurvatureError("train has no batches: pass (X, y) or a loader yielding at least one (X, y).")
