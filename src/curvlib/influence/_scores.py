"""Scores over data: each example's gradient batch by batch, the queries preconditioned once, the
training examples scored against them one batch at a time (never all examples' gradients at once).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Dict, Iterator, Mapping, Optional

import torch
from torch import Tensor, nn

from .. import extensions as ext
from .. import losses
from .._core.errors import CurvatureError, CurvatureTypeError
from .._transform.entry import curvature
from ..operators.data import Sliced, pairs, parameter_groups
from ._directional import Directional, check_method, first_pair
from ._blocks import block_dampings, check_rank, compress, pairwise, precondition, self_scores
from ._fit import check_fitted

__all__ = ["precondition_queries", "scores", "self_influence"]


class Examples:
    """Each example's gradient, batch by batch: ``grad_batch · M_b`` per fitted parameter."""

    def __init__(self, model: nn.Module, lossfn, names, params, buffers, output):
        self.spec = losses.loss_spec(lossfn)
        self.function = curvature(model, lossfn, [ext.BatchGrad()], output=output)
        named = dict(model.named_parameters())
        missing = [n for n in names if (params is None or n not in params) and n not in named]
        if missing:
            raise CurvatureError(f"factors name parameters {missing} that the model does not have.")
        # detached: scores are not differentiated, and values that require grad would take
        # curvature's differentiable (torch.func) route, which custom Functions without
        # setup_context refuse
        self.params = {n: (params[n] if params is not None and n in params else named[n]).detach() for n in names}
        self.buffers = buffers

    def gradients(self, X, y, names=None) -> Dict[str, Tensor]:
        """Parameter name -> ``[N_b, *p]``, each example's loss gradient (summed over its positions),
        for the parameters ``names`` (default: all)."""
        normaliser = losses.normaliser(self.spec, y)
        if normaliser is None:
            raise CurvatureError(f"influence needs each example's own loss; the loss {self.spec.name} has no known "
                                 "reduction (use nn.CrossEntropyLoss, nn.MSELoss or nn.BCEWithLogitsLoss).")
        params = self.params if names is None else {n: self.params[n] for n in names}
        qs = self.function(X, y, params=params, buffers=self.buffers)
        scale = 1.0 if self.spec.reduction == "sum" else normaliser
        # scaled in place: the call's own [N_b, *p] results, not a second copy of them beside the first
        return {n: g.detach().mul_(scale) for n, g in qs.pop("grad_batch").items()}

    def reduced(self, data, size: Optional[int], each: Callable[[Dict[str, Tensor]], Tensor]) -> Iterator[Tensor]:
        """Per slice of ``data`` (at most ``size`` examples; ``None``: its batches), the sum over
        parameter groups of ``each(the group's gradients)``, which may pop (free) them as it goes.
        With a ``size``, the groups hold at most ``P / (1 + size)`` entries each, a call each
        (:func:`curvlib.operators.data.parameter_groups`): a call's gradient and ``[N_b, P_group]``
        together at most the model's gradient; else one group."""
        groups = parameter_groups({n: v.numel() for n, v in self.params.items()}, size)
        for X, y in Sliced(data, size):
            total = None
            for names in groups:
                part = each(self.gradients(X, y, None if len(groups) == 1 else names))
                total = part if total is None else total + part
            yield total


def _examples(model, lossfn, fitted, params, buffers, output) -> Examples:
    check_fitted(fitted)
    return Examples(model, lossfn, tuple(fitted["blocks"]), params, buffers, output)


def precondition_queries(model: nn.Module, lossfn, factors: Mapping, queries, *, damping: Optional[float] = None,
                         query_rank: Optional[int] = None, params: Optional[Mapping[str, Tensor]] = None,
                         buffers: Optional[Mapping[str, Tensor]] = None, output=None) -> dict:
    r"""The queries' gradients preconditioned once, $(G + \lambda)^{-1} g_q$ per block, for ``scores``.

    Args:
        model: the model ``factors`` were fitted on; not changed.
        lossfn: the loss ``factors`` were fitted with.
        factors: what ``curvlib.influence.fit`` returned.
        queries: ``(X, y)`` or a re-iterable loader of pairs: the examples whose predictions are
            explained (test examples).
        damping: $\lambda$, or ``None`` for ``0.1 · mean(s_p)`` per block (kronfluence's heuristic).
        query_rank: keep each preconditioned query's blocks at rank ``r`` (truncated SVD per
            group, where both sides exceed ``r``); ``None``: whole.
        params: parameter name -> value, for the parameters ``factors`` were fitted on (default:
            the model's).
        buffers: buffer name -> tensor, replacing the model's (as for ``curvature``).
        output: the tensor of a container output the loss takes (as for ``curvature``).

    Returns:
        ``{"preconditioned": True, "count": Q, "damping": {name: λ_p}, "blocks": {name: core}}``,
        ``core`` a tensor ``[Q, G, o, a]`` or, compressed, ``(left [Q, G, o, r], right [Q, G, r, a])``.

    Raises:
        CurvatureError: a damping or rank that is not positive, or parameters the model lacks.
        CurvatureTypeError: ``factors`` not what ``fit`` returns.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import influence
        >>> model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        >>> X, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> factors = influence.fit(model, nn.CrossEntropyLoss(), (X, y), strategy="kfac", fisher_type="exact")
        >>> q = influence.precondition_queries(model, nn.CrossEntropyLoss(), factors, (X[:2], y[:2]), query_rank=1)
        >>> [t.shape for t in q["blocks"]["0.weight"]]        # rank 1: [Q, G, o, 1], [Q, G, 1, a]
        [torch.Size([2, 1, 6, 1]), torch.Size([2, 1, 1, 4])]
        >>> influence.scores(model, nn.CrossEntropyLoss(), factors, q, (X, y)).shape
        torch.Size([2, 16])
    """
    check_rank(query_rank)
    examples = _examples(model, lossfn, factors, params, buffers, output)
    dampings = block_dampings(factors, damping)
    parts: Dict[str, list] = {name: [] for name in factors["blocks"]}
    count = 0
    for X, y in pairs(queries):
        grads = examples.gradients(X, y)
        count += next(iter(grads.values())).shape[0]
        for name, block in factors["blocks"].items():
            parts[name].append(compress(precondition(block, dampings[name], grads.pop(name)), query_rank))
    blocks = {name: _cat(chunks) for name, chunks in parts.items()}
    return dict(preconditioned=True, count=count, damping=dampings, blocks=blocks)


def _cat(chunks):
    if isinstance(chunks[0], tuple):
        return tuple(torch.cat(side) for side in zip(*chunks))
    return torch.cat(chunks)


def scores(model: nn.Module, lossfn, factors: Mapping, queries, train, *, damping: Optional[float] = None,
           query_rank: Optional[int] = None, params: Optional[Mapping[str, Tensor]] = None,
           buffers: Optional[Mapping[str, Tensor]] = None, output=None, method: str = "gradients",
           chunk_size: int = 8, batch_size: Optional[int] = None) -> Tensor:
    r"""Pairwise influence ``[Q, N]``: $\operatorname{score}(q, n) = g_q^\top (G + \lambda)^{-1} g_n$ (``curvlib.influence``).

    Args:
        model: the model ``factors`` were fitted on; not changed.
        lossfn: the loss ``factors`` were fitted with.
        factors: what ``curvlib.influence.fit`` returned.
        queries: ``(X, y)``, a loader of pairs, or ``precondition_queries``'s result (then
            ``damping`` and ``query_rank`` were fixed there and must be left ``None``).
        train: ``(X, y)`` or a re-iterable loader: the training examples scored, in order.
        damping: $\lambda$, or ``None`` for ``0.1 · mean(s_p)`` per block.
        query_rank: as for ``precondition_queries``.
        params: parameter name -> value, for the parameters ``factors`` were fitted on (as for
            ``precondition_queries``).
        buffers: buffer name -> tensor, replacing the model's (as for ``curvature``).
        output: the tensor of a container output the loss takes (as for ``curvature``).
        method: ``"gradients"``: each training batch's example gradients ``[N_b, P]``, contracted
            block by block (time independent of ``Q``); ``"jvp"``: one Jacobian-vector product per
            query and batch, contracted with each example's output gradient (memory a forward's,
            the directions' ``P`` entries per query of a chunk, and ``chunk_size`` output-sized
            tangents; never ``[N_b, P]``; time grows with ``Q``).
        chunk_size: queries per Jacobian-vector product (``"jvp"``).
        batch_size: examples per ``curvature`` call (``"gradients"``), the parameters in groups of
            ``≤ P / (1 + N_b)`` entries, a call each; examples per Jacobian-vector product
            (``"jvp"``: its output-sized tangents and activations scale with it). ``None``: the
            loader's batches, all parameters at once.

    Returns:
        ``[Q, N]`` in the factors' dtype: a positive score means training on ``n`` lowered the
        query's loss (up-weighting ``n`` helps ``q``).

    Raises:
        CurvatureError: as ``precondition_queries``; damping or a rank with preconditioned queries.
        CurvatureTypeError: ``factors`` or ``queries`` of the wrong kind.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import influence
        >>> model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        >>> X, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> train = [(X[:8], y[:8]), (X[8:], y[8:])]
        >>> factors = influence.fit(model, nn.CrossEntropyLoss(), train, strategy="diagonal", fisher_type="exact")
        >>> S = influence.scores(model, nn.CrossEntropyLoss(), factors, (X[:3], y[:3]), train, damping=1e-3)
        >>> S.shape
        torch.Size([3, 16])
    """
    check_method(method, chunk_size)
    Sliced(train, batch_size)  # checks the size
    prepared = _prepared(queries, damping, query_rank) or precondition_queries(
        model, lossfn, factors, Sliced(queries, batch_size), damping=damping, query_rank=query_rank, params=params,
        buffers=buffers, output=output)
    examples = _examples(model, lossfn, factors, params, buffers, output)
    if set(prepared["blocks"]) != set(factors["blocks"]):
        raise CurvatureError("the preconditioned queries and the factors name different parameters.")
    if method == "jvp":
        sliced = Sliced(train, batch_size)
        directional = Directional(model, lossfn, first_pair(sliced), examples.params, buffers, output, chunk_size)
        return torch.cat([directional.scores(X, y, factors, prepared) for X, y in sliced], dim=1)
    return torch.cat(list(examples.reduced(train, batch_size, partial(_pairwise, prepared, factors))), dim=1)


def _pairwise(prepared: Mapping, factors: Mapping, grads: Dict[str, Tensor]) -> Tensor:
    """``[Q, N_b]``: ``Σ_p ⟨P g_q, g_n⟩_p`` over the blocks of ``grads``, each freed once contracted."""
    return sum(pairwise(prepared["blocks"][n], factors["blocks"][n], grads.pop(n)) for n in list(grads))


def _self(factors: Mapping, dampings: Mapping[str, float], grads: Dict[str, Tensor]) -> Tensor:
    """``[N_b]``: ``Σ_p g_nᵀ P g_n`` over the blocks of ``grads``, each freed once used."""
    return sum(self_scores(factors["blocks"][n], dampings[n], grads.pop(n)) for n in list(grads))


def _prepared(queries, damping, query_rank) -> Optional[Mapping]:
    """``queries`` if ``precondition_queries`` made them (checked), else ``None``."""
    if not isinstance(queries, Mapping):
        return None
    if not queries.get("preconditioned"):
        raise CurvatureTypeError("queries must be (X, y), a loader of such pairs, or what "
                                 "curvlib.influence.precondition_queries returns.")
    if damping is not None or query_rank is not None:
        raise CurvatureError("queries are already preconditioned: damping and query_rank were fixed by "
                             "precondition_queries; leave them None here.")
    return queries


def self_influence(model: nn.Module, lossfn, factors: Mapping, train, *, damping: Optional[float] = None,
                   params: Optional[Mapping[str, Tensor]] = None, buffers: Optional[Mapping[str, Tensor]] = None,
                   output=None, batch_size: Optional[int] = None) -> Tensor:
    r"""``[N]``: each training example's influence on itself, $g_n^\top (G + \lambda)^{-1} g_n$.

    Args:
        model: the model ``factors`` were fitted on; not changed.
        lossfn: the loss ``factors`` were fitted with.
        factors: what ``curvlib.influence.fit`` returned.
        train: ``(X, y)`` or a re-iterable loader, scored in order, one batch at a time.
        damping: $\lambda$, or ``None`` for ``0.1 · mean(s_p)`` per block.
        params: parameter name -> value, for the parameters ``factors`` were fitted on.
        buffers: buffer name -> tensor, replacing the model's.
        output: the tensor of a container output the loss takes.
        batch_size: examples per ``curvature`` call, the parameters in groups (as for ``scores``;
            ``None``: the loader's batches, all parameters at once).

    Returns:
        ``[N]``, the diagonal of ``scores(..., train, train)`` (large: an example the model
        fits only by itself, often mislabelled).

    Raises:
        CurvatureError: a damping that is not positive, or parameters the model lacks.
        CurvatureTypeError: ``factors`` not what ``fit`` returns.

    Examples::

        >>> import torch
        >>> from torch import nn
        >>> from curvlib import influence
        >>> model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        >>> X, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> factors = influence.fit(model, nn.CrossEntropyLoss(), (X, y), strategy="ekfac", fisher_type="empirical")
        >>> influence.self_influence(model, nn.CrossEntropyLoss(), factors, (X, y)).shape
        torch.Size([16])
    """
    Sliced(train, batch_size)  # checks the size
    examples = _examples(model, lossfn, factors, params, buffers, output)
    dampings = block_dampings(factors, damping)
    return torch.cat(list(examples.reduced(train, batch_size, partial(_self, factors, dampings))))
