"""The numeric tests of one operation for sample mixing (see :mod:`curvlib._plan.mixing_numeric`).

:func:`probe` runs an operation ``call`` on its recorded inputs (``load``) as they are, with
sample ``j``'s rows changed (the **leak test**), and, for a layer the generic rule recomputes
per sample, on sample 0 alone (the **alone test**). Every run draws the same random numbers
(:func:`seeded`), and reads uninitialised memory as the same values.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Optional

import torch
from torch import Tensor

from .._core.sync import LOCK
from .mixing_ops import Batch, leaves_of

__all__ = ["SEED", "FailsAlone", "leak", "probe", "sample_rows", "seeded"]

#: The seed of every run of a test (the alone test's second run: :data:`_OTHER_SEED`).
SEED, _OTHER_SEED = 20240601, 7


@contextlib.contextmanager
def seeded(device: torch.device, seed: int):
    """Same random numbers for every run of a test; the caller's random state untouched
    (the global state is process-wide: other threads wait, :data:`curvlib._core.sync.LOCK`)."""
    with LOCK, torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad(), \
            _filled_memory():
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def _filled_memory():
    """Uninitialised tensors (``empty``, ``new_empty``, ``empty_like``) filled with NaN (integers:
    their largest value), so that entries a model never writes read the same in every run of a
    test (torch's deterministic mode fills them; its checks only warn, and are silenced here)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=not deterministic or warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _same(v: Tensor, leaf) -> Tensor:
    return v.clone()  # an in-place operation must not change the recorded value


def sample_rows(size: int, leaf: Batch, n: int, j: int, device) -> Tensor:
    """Mask of the entries of sample ``j`` along the batch dim."""
    pos = torch.arange(size, device=device)
    return (pos // leaf.s) % n == j


class FailsAlone(Exception):  # a layer's own code fails on one sample alone (the generic rule's batch of one)
    pass


class _CannotFollow(Exception):
    """A batch merged with another dim by an operation whose layout is not known."""


def _perturbed(j: int, n: int, gen: torch.Generator) -> Callable:
    def change(v: Tensor, leaf) -> Tensor:
        if isinstance(leaf, Batch) and leaf.s is None:
            raise _CannotFollow
        if not isinstance(leaf, Batch) or v.numel() == 0:
            return v.clone()
        mine = sample_rows(v.shape[leaf.dim], leaf, n, j, v.device)
        if v.is_floating_point() or v.is_complex():
            shape = [1] * v.dim()
            shape[leaf.dim] = -1
            noise = torch.randn(v.shape, generator=gen, dtype=v.dtype, device="cpu").to(v.device)
            finite = v.isfinite()
            # the scale of the finite entries; infinite entries (-inf masks) stay as they are, and
            # other samples' entries are kept, not multiplied by zero (inf · 0 is NaN)
            scale = float(v.abs().masked_fill(~finite, 0).max()) or 1.0
            return torch.where(mine.reshape(shape) & finite, v + noise * scale, v)
        other = j + 1 if j + 1 < n else j - 1  # integers (indices): another sample's rows
        pos = torch.arange(v.shape[leaf.dim], device=v.device)
        return v.index_select(leaf.dim, torch.where(mine, pos + (other - j) * leaf.s, pos))

    return change


def _gap(a: Tensor, b: Tensor, rel: float) -> float:
    """Largest difference beyond ``rel`` times the scale (0: within it)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    if not (a.is_floating_point() or a.is_complex()):
        return float("inf") if bool((a != b).any()) else 0.0
    same = (a.isnan() & b.isnan()) | (a == b)  # (equal infinities, e.g. masked attention scores)
    diff = (a - b).abs().masked_fill(same, 0).nan_to_num(float("inf"))
    eps = torch.finfo(a.dtype).eps
    scale = max(float(a.abs().nan_to_num(0, 0, 0).max()), float(b.abs().nan_to_num(0, 0, 0).max()))
    gap = float(diff.max())
    return gap if gap > rel(eps) * scale + torch.finfo(a.dtype).tiny else 0.0


def leak(base, out, leaves: list, j: int, n: int) -> float:
    """How much outputs of samples other than ``j`` (and batch-free outputs) changed."""
    for a, b, leaf in zip(leaves_of(base), leaves_of(out), leaves):
        if isinstance(leaf, Batch) and leaf.s is None:
            raise _CannotFollow
        if isinstance(leaf, Batch):
            keep = (~sample_rows(a.shape[leaf.dim], leaf, n, j, a.device)).nonzero().flatten()
            a, b = a.index_select(leaf.dim, keep), b.index_select(leaf.dim, keep.to(b.device))
        elif leaf is not None:
            continue  # shapes that pair or shift samples are refused by the graph check
        gap = _gap(a, b, lambda eps: 64 * eps)
        if gap:
            return gap
    return 0.0


def probe(call: Callable, load: Callable, out_leaves: list, n: int, device, alone: bool) -> Optional[str]:
    """Run the leak test (and, with ``alone``, the alone test) of one operation.

    Args:
        call: ``(args, kwargs) -> output``.
        load: ``fn -> (args, kwargs)`` with every tensor input ``v`` replaced by ``fn(v, layout)``.
        out_leaves: the output's layout per tensor leaf.
        n: ``N`` (at least 2).
    """
    with seeded(device, SEED):
        base = call(*load(_same))
    why = _leak_test(call, load, base, out_leaves, n, device)
    if why or not alone:
        return why
    return _alone_test(call, load, base, out_leaves, n, device)


def _leak_test(call, load, base, out_leaves, n, device) -> Optional[str]:
    gen = torch.Generator().manual_seed(SEED)
    for j in sorted({0, n - 1}):
        try:
            args = load(_perturbed(j, n, gen))
            with seeded(device, SEED):
                out = call(*args)
            gap = leak(base, out, out_leaves, j, n)
        except _CannotFollow:
            return (": its input or output has the batch merged with another dim by an operation "
                    "curvlib cannot follow, so it cannot test whether samples stay apart")
        if gap:
            return (f": changing sample {j}'s input changed other samples' outputs by up to {gap:.3g}, "
                    "so it mixes samples")
    return None


def _alone_test(call, load, base, out_leaves, n: int, device) -> Optional[str]:
    with seeded(device, _OTHER_SEED):
        again = call(*load(_same))
    if any(_gap(a, b, lambda eps: 64 * eps) for a, b in zip(leaves_of(base), leaves_of(again))):
        return None  # random (active dropout): a batch of one draws other numbers

    def first(v: Tensor, leaf) -> Tensor:
        if isinstance(leaf, Batch) and leaf.c == 1:
            return v.narrow(leaf.dim, 0, 1).clone()
        # a constant built with one equal row per sample (a mask expanded to the batch size): a
        # batch of one has one row of it, as the generic rule's split by the plan's dims gives
        equal_rows = leaf is None and v.dim() > 0 and v.shape[0] == n > 1 and torch.equal(v, v[:1].expand_as(v))
        return v[:1].clone() if equal_rows else v.clone()

    try:
        with seeded(device, SEED):
            one = call(*load(first))
    except Exception as exc:  # noqa: BLE001 - the layer's own code on other shapes: its message, in the refusal
        raise FailsAlone(f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}") from exc
    for a, b, leaf in zip(leaves_of(base), leaves_of(one), out_leaves):
        if isinstance(leaf, Batch) and leaf.c == 1:
            gap = _gap(a.narrow(leaf.dim, 0, 1), b, lambda eps: eps**0.5)
            if gap:
                return (f": run on sample 0 alone (a batch of one, as curvlib's generic rule recomputes "
                        f"it) gives an output {gap:.3g} away from its row of the batched output: the "
                        "layer does not treat samples independently")
    return None
