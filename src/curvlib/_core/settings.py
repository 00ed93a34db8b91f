"""The tunable sizes and switches of curvlib's memory and speed choices, in one frozen record.

Every stage reads them from :func:`current` when it runs (the refusals made while a call is
planned: when it is planned, once per input signature; the choice of front end: when the model
is traced). The sizes change how much is formed at once or above which size a call is refused,
never a result beyond rounding; the switches choose between two exact ways (the second one the
reference the tests compare with), ``aten_front_end`` between the two front ends.
:func:`override` replaces some of them inside a ``with`` block (the tests use it to reach
every branch on small problems)::

    from curvlib._core import settings

    with settings.override(auto_chunk_bytes=2**20, conv_method="bmm"):
        qs = curvature(model, lossfn, [DiagGGNExact()])(X, y)

The record is process-wide, like torch's own global settings (read by every thread and by
autograd's backward hooks, which run on its device threads): override it around calls, not
concurrently with them. No curvlib imports above :mod:`curvlib._core.sync`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator, Optional

from .sync import LOCK

__all__ = ["Settings", "current", "override"]


@dataclass(frozen=True)
class Settings:
    """The values of curvlib's tunable sizes and switches (defaults: the measured choices)."""

    #: ``chunk_size="auto"``: the pulled-back site outputs of one chunk of root columns
    #: (``[chunk, *site output]`` for every site) take at most this many bytes ...
    auto_chunk_bytes: int = 256 * 2**20
    #: ... or this many under the ``"looped"`` strategy (the CPU default) when no batch diagonal
    #: is requested: there chunks of a few columns stay in cache and are faster as well as
    #: smaller. Batch diagonals sum ``Σ_v m_v²`` over all columns of a chunk before one outer
    #: product per sample, so they keep the larger chunks.
    auto_chunk_bytes_cpu: int = 32 * 2**20
    #: ... and under ``"batched"`` on CUDA, where every chunk costs kernel launches, up to this
    #: share of the device's free memory when that is more.
    auto_chunk_free_share: float = 1 / 8
    #: A root ``[V, N, *out]`` of at most ``1/budget_headroom`` of the free memory last read on its
    #: device is not checked against a new reading.
    budget_headroom: int = 8
    #: A dense Kronecker factor above this many bytes is refused without ``max_factor_dim``
    #: (1 GiB: a side of 16384 in float32, 11585 in float64).
    dense_factor_bytes: int = 2**30
    #: Square-root columns are pulled back one at a time outside torch.func transforms and written
    #: into preallocated results (:mod:`curvlib._evaluate.root_buffers`); ``False``: vmapped over
    #: columns and joined by ``torch.cat`` (the reference the tests compare with).
    loop_sqrt_columns: bool = True
    #: The Hessian diagonal's residual columns pulled back at once at least, unless ``chunk_size``
    #: bounds them; 0: no more than the largest set's.
    packed_columns: int = 0
    #: Sites are read as the backward reaches them only when their outputs take at least this
    #: many bytes together: a hook per site adds a fixed cost to every call, worth it only where
    #: holding every site gradient at once would cost memory.
    stream_min_bytes: int = 16 * 2**20
    #: First-order quantities are read site by site during the loss's backward where that applies
    #: (:func:`curvlib._evaluate.first_order.streams`); ``False``: every site's gradient at the end
    #: of one backward (the reference the tests compare with).
    stream_first_order: bool = True
    #: A second-order root's columns are pulled back one at a time where that applies, each
    #: parameter read as soon as the pullback has passed its sites; ``False``: read after each
    #: whole pullback (the reference the tests compare with).
    stream_columns: bool = True
    #: Models torch.fx cannot follow (or leaves opaque, or that take keyword inputs) are traced
    #: again at the ATen level (:mod:`curvlib._trace.aten`); ``False``: torch.fx's trace is kept,
    #: with opaque leaves and the eager runner (the fallback taken when the ATen trace fails).
    aten_front_end: bool = True
    #: Convolutions' per-sample weight gradients: ``"conv"`` or ``"bmm"`` forces the method
    #: (both exact, only speed differs); ``None`` chooses by shape
    #: (:func:`curvlib.rules.conv.choose_method`).
    conv_method: Optional[str] = None
    #: Target size of one block of a convolution's per-sample, per-column weight gradients
    #: ``[N, B, *W]`` in a GGN diagonal under the ``"looped"`` strategy (at least one column).
    conv_column_block_bytes: int = 2**20
    #: A Linear's individual gradients ``[n', o', I]`` formed at once when their squares are summed
    #: (rows of every sample; one row of a block of samples if even that is larger; also under
    #: autograd or torch.func, and by a GGN diagonal's columns at once). Smaller blocks stay in
    #: cache, but each kernel then costs more on a loaded machine than the cache saves.
    linear_squares_entries: int = 2**24
    #: The largest block of per-sample gradients ``[v, N, *p]`` formed at once beside the result
    #: when a rule forms all root columns in one batched call (a Linear shared by positions, an
    #: Embedding).
    column_block_entries: int = 2**24
    #: KFRA's dense recursion is refused above this many entries (``D² · N``).
    kfra_max_entries: int = 2**27
    #: A dense per-sample residual ``[N, d, d]`` is refused above ``N·d²`` entries.
    max_dense_residual_entries: int = 2**26
    #: A dense node's free parameter whose Hessian diagonal takes more Hessian-vector products
    #: of the node than this over the batch (``N · |p| / rows``) is refused.
    max_free_block_products: int = 2**20
    #: Entries of cumulative class probabilities formed at once when Monte-Carlo labels are drawn
    #: (whole rows, at least one).
    draw_entries: int = 2**20
    #: Under the ``"batched"`` strategy: the least byte budget of one block of conv column gradients ...
    batched_min_bytes: int = 256 * 2**20
    #: ... and on CUDA up to this share of the free device memory.
    batched_free_share: float = 1 / 8


_current = Settings()


def current() -> Settings:
    """The settings in force now (the defaults, or those of the innermost :func:`override`)."""
    return _current


@contextlib.contextmanager
def override(**fields) -> Iterator[Settings]:
    """Replace the named fields of :class:`Settings` inside the ``with`` block (process-wide);
    the previous settings return on exit. An unknown field name is a ``TypeError``."""
    global _current
    with LOCK:
        before = _current
        _current = dataclasses.replace(before, **fields)
        inside = _current
    try:
        yield inside
    finally:
        with LOCK:
            _current = before
