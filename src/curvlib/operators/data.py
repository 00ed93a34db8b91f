"""An operator's data: one batch ``(X, y)`` or a re-iterable loader of them, the same batches in
every pass, each weighted by its share of the data's loss.

The data's loss is the loss of all its samples together, with the loss's own reduction:
``L = Σ_b w_b L_b`` with ``w_b = 1`` for ``reduction="sum"`` and ``w_b = M_b / Σ_b' M_b'`` for
``"mean"`` (``M_b`` the batch's normaliser: its samples, counted targets or entries,
:func:`curvlib.losses.normaliser`). Quantities linear in the loss (the GGN, the Hessian, the
Monte-Carlo Fisher) sum with weights ``w_b``; the empirical Fisher ``Σ_n g_n g_nᵀ``, quadratic in
each individual gradient, with ``w_b²``.
"""

from __future__ import annotations

import collections.abc
from dataclasses import dataclass
from typing import Iterator, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from .._core import inputs as _inputs
from .._core.errors import CurvatureError, CurvatureTypeError
from .._transform.network import Batch, Network

__all__ = ["Data", "BatchSeeds", "pairs", "Sliced", "parameter_groups"]


@dataclass(frozen=True)
class BatchSeeds:
    """The seeds of one batch's random draws: its dropout masks and its Monte-Carlo samples."""

    dropout: int
    samples: int
    device: torch.device

    def generator(self, which: str) -> torch.Generator:
        """A fresh generator at the batch's seed: the same draws in every pass."""
        return torch.Generator(device=self.device).manual_seed(getattr(self, which))


class Data:
    """The batches of an operator (module doc); iterating gives ``(weight, seeds, Batch)``."""

    def __init__(self, network: Network, data, params: Optional[Mapping[str, Tensor]],
                 buffers: Optional[Mapping[str, Tensor]], generator: Optional[torch.Generator]):
        if generator is not None and not isinstance(generator, torch.Generator):
            raise CurvatureTypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}.")
        self.network, self.params, self.buffers = network, params, buffers
        self.single = _is_pair(data)
        if not self.single:
            _check_loader(data)
        self.data = data
        self.prints: List[Tuple] = []
        self.seeds: List[BatchSeeds] = []
        normalisers = []
        first: Optional[Batch] = None
        for X, y in self._pairs():
            seeds = _draw_seeds(generator)
            batch = network.batch(X, y, params, buffers, seeds.generator("dropout"))
            first = first or batch
            self.prints.append(_fingerprint(X, y))
            self.seeds.append(seeds)
            normalisers.append(batch.normaliser())
        if first is None:
            raise CurvatureError("data has no batches: pass (X, y) or a loader yielding at least one (X, y).")
        self.weights = _weights(network, normalisers)
        self.first = first  # (one batch: reused by every product)

    @property
    def count(self) -> int:
        return len(self.seeds)

    def _pairs(self) -> Iterator[Tuple[object, Tensor]]:
        if self.single:
            yield self.data[0], self.data[1]
            return
        for k, pair in enumerate(self.data):
            if not _is_pair(pair):
                raise CurvatureError(
                    f"data's batch {k} is a {type(pair).__name__}, not a pair (X, y): the loader must yield "
                    "(input, target) pairs.")
            yield pair[0], pair[1]

    def __iter__(self) -> Iterator[Tuple[float, BatchSeeds, Batch]]:
        if self.single:
            yield self.weights[0], self.seeds[0], self.first
            return
        k = -1
        for k, (X, y) in enumerate(self._pairs()):
            if k >= self.count or _fingerprint(X, y) != self.prints[k]:
                raise _changed(k)
            seeds = self.seeds[k]
            yield self.weights[k], seeds, self.network.batch(X, y, self.params, self.buffers, seeds.generator("dropout"))
        if k + 1 != self.count:
            raise _changed(k + 1)


def pairs(data) -> Iterator[Tuple[object, Tensor]]:
    """The ``(X, y)`` batches of ``data`` (one pair, or a re-iterable loader of pairs), checked
    as :class:`Data` checks them; one pass over the loader per call."""
    if _is_pair(data):
        yield data[0], data[1]
        return
    _check_loader(data)
    for k, pair in enumerate(data):
        if not _is_pair(pair):
            raise CurvatureError(
                f"data's batch {k} is a {type(pair).__name__}, not a pair (X, y): the loader must yield "
                "(input, target) pairs.")
        yield pair[0], pair[1]


class Sliced:
    """``data``'s batches cut into consecutive slices of at most ``size`` samples: a re-iterable
    loader of smaller batches with the same samples in the same order (``size=None``: ``data``'s
    own batches). A ``"mean"`` loss's slices are weighted by their normalisers, so a quantity
    summed over the data is the same."""

    def __init__(self, data, size: Optional[int]):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise CurvatureError(f"batch_size={size!r}: must be a positive int (samples per call), or None.")
        self.data, self.size = data, size

    def __iter__(self) -> Iterator[Tuple[object, Tensor]]:
        for X, y in pairs(self.data):
            n = _inputs.batch_size(X)
            step = n if self.size is None else self.size
            for start in range(0, n, step):
                yield _inputs.slice_batch(X, start, start + step), y[start:start + step]


def parameter_groups(sizes: Mapping[str, int], columns: Optional[int]) -> List[List[str]]:
    """The parameters (name -> entries ``|p|``) cut, in order, into groups for one ``curvature``
    call each, when each call's results hold ``columns`` model-sized rows per entry besides the
    gradient (a batch's individual gradients, ``N_b``; its root columns, ``C N_b``): each group at
    most ``Σ_p |p| / (1 + columns)`` entries (a larger parameter alone), so that a call's gradient
    and rows together, ``(1 + columns) Σ_{p ∈ group} |p|``, are at most the whole gradient's
    size. ``columns=None``: one group."""
    names = list(sizes)
    if columns is None:
        return [names]
    budget = sum(sizes.values()) / (1 + columns)
    groups: List[List[str]] = []
    held = 0
    for name in names:
        if not groups or held + sizes[name] > budget:
            groups.append([])
            held = 0
        groups[-1].append(name)
        held += sizes[name]
    return groups


def _is_pair(data) -> bool:
    return isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[1], Tensor) \
        and not (isinstance(data[0], (tuple, list)) and len(data[0]) == 2 and isinstance(data[0][1], Tensor))


def _check_loader(data) -> None:
    if isinstance(data, (str, bytes, Tensor)) or not hasattr(data, "__iter__"):
        raise CurvatureTypeError(
            f"data must be a pair (X, y) or a re-iterable loader of pairs (a DataLoader, a list), got "
            f"{type(data).__name__}.")
    if isinstance(data, collections.abc.Iterator):
        raise CurvatureTypeError(
            f"data is a one-pass iterator ({type(data).__name__}): every product iterates over the data "
            "again. Pass a DataLoader or a list of (X, y) pairs.")


def _draw_seeds(generator: Optional[torch.Generator]) -> BatchSeeds:
    device = generator.device if generator is not None else torch.device("cpu")
    draws = torch.randint(0, 2**62, (2,), generator=generator, device=device).tolist()
    return BatchSeeds(int(draws[0]), int(draws[1]), device)


def _fingerprint(X, y: Tensor) -> Tuple:
    """Shapes and sums of the batch's tensors: equal in every pass of a deterministic loader."""
    tensors = list(_inputs.tensors(X)) + [y]
    return tuple((tuple(t.shape), t.dtype, float(t.detach().double().sum()) if t.numel() else 0.0) for t in tensors)


def _changed(k: int) -> CurvatureError:
    return CurvatureError(
        f"data changed between passes (batch {k} differs from the first pass): an operator is one fixed "
        "matrix and iterates over the data in every product. Use a loader that yields the same batches "
        "in the same order (shuffle=False, no random augmentation).")


def _weights(network: Network, normalisers: List[Optional[float]]) -> List[float]:
    """``w_b`` (module doc)."""
    if len(normalisers) == 1:
        return [1.0]
    if any(m is None for m in normalisers):
        raise CurvatureError(
            f"data with {len(normalisers)} batches and lossfn {network.spec.name}: curvlib sums batches by the "
            "reduction of nn.MSELoss, nn.CrossEntropyLoss and nn.BCEWithLogitsLoss, which it cannot know for "
            "another loss. Use one of those, or one batch.")
    total = sum(normalisers)
    if network.spec.reduction == "sum":
        return [1.0] * len(normalisers)
    return [m / total if total else 0.0 for m in normalisers]
