"""Branches on values in a model traced at the ATen level (:mod:`curvlib._trace.aten`): guards and their
per-sample check.

An ATen-level trace runs the model's Python once: where it reads a value (``if
mask.all()``, Hugging Face's padding-mask shortcut), the graph holds the branch that input
took, behind a guard (:func:`input_branch`) that raises :class:`BranchChanged` for an input
reading otherwise (the call then traces again). The branch is the *batch's*; curvlib's
per-sample quantities are those of each sample alone, so a batch whose samples alone would
read other values is checked (:func:`check_branches_per_sample`).
"""

from __future__ import annotations

import contextlib
import operator
from typing import Dict, List, Optional

import torch
from torch import Tensor, fx, nn
from torch.utils._python_dispatch import TorchDispatchMode

from .._core import outputs as _outputs
from .._core.errors import CurvatureError
from .._core.inputs import batch_size, keyword_inputs, select_batch, slice_batch, trace_leaves
from .program import Program
from .._core.sync import LOCK
from ..rules import math_hooks
from ..rules.functional import run_nodes
from ..rules.generic import restored

__all__ = ["BranchChanged", "input_branch", "guard_values_per_sample", "batch_guard_values",
           "check_branches_per_sample", "without_hooks"]

aten = torch.ops.aten


@contextlib.contextmanager
def without_hooks(model: nn.Module):
    """The model's forward hooks set aside while it is traced (hooks are not part of curvlib's
    math, :func:`curvlib._plan.traces.warn_hooks`), except those computing a parameter (old-style
    ``weight_norm``); put back afterwards. Call under :data:`curvlib._core.sync.LOCK`."""
    saved = []
    for m in model.modules():
        keep = {id(h) for h in math_hooks(m)}
        for store in ("_forward_hooks", "_forward_pre_hooks"):
            hooks = getattr(m, store)
            saved.append((hooks, dict(hooks)))
            for key in [k for k, h in hooks.items() if id(h) not in keep]:
                del hooks[key]
    try:
        yield
    finally:
        for hooks, before in saved:
            hooks.clear()
            hooks.update(before)


class BranchChanged(CurvatureError):
    """The model's Python read another value from the input than when it was traced."""


def input_branch(value: Tensor, expected, where: str):
    """A guard: the model read ``expected`` from ``value`` (``if mask.all()``) when traced; an input
    that reads otherwise takes another branch of the model's code, and the graph does not hold it."""
    if isinstance(value, torch._subclasses.FakeTensor):
        return expected  # (shape passes: no values)
    try:
        actual = value.item()
    except RuntimeError as exc:  # a batched tensor (vmap over the input): no single value
        raise CurvatureError(
            f"The model's forward reads a value from its input ({where}) to choose a branch; under "
            "torch.func.vmap over the input that value differs per member and cannot be checked. "
            "Call curvature's function per member, or vmap over parameters only.") from exc
    if actual != expected:
        raise BranchChanged(f"the model read {actual!r} at {where}, traced with {expected!r}")
    return expected


def guard_values_per_sample(program: Program, X) -> Optional[List[tuple]]:
    """Per sample, the values the graph's guards read for that sample alone, decided cheaply on
    the guards' own ancestry (``mask -> eq -> all``: no parameter, no layer) evaluated on each
    sample's slice of ``X``; ``None`` when that cannot be decided so (a guard reads through
    parameters, or a shape baked in for the batch): see :func:`check_branches_per_sample`."""
    guards = _guards(program)
    needed, stack = set(), [g.args[0] for g in guards if isinstance(g.args[0], fx.Node)]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    if any(a.op == "call_module" or (a.op == "get_attr" and isinstance(operator.attrgetter(a.target)(program.root), nn.Parameter))
           for a in needed):
        return None
    leaves = trace_leaves(X) if program.leaf_inputs else [X]
    n = batch_size(X)
    values = []
    try:
        for i in range(n):
            env = {}
            for k, node in enumerate(n for n in program.graph.nodes if n.op == "placeholder"):
                leaf = leaves[k] if k < len(leaves) else node.args[0]
                env[node] = leaf[i:i + 1] if isinstance(leaf, Tensor) and leaf.dim() and leaf.shape[0] == n else leaf
            run_nodes([m for m in program.graph.nodes if m in needed and m.op != "placeholder"], env, program.root)
            values.append(tuple(env[g.args[0]].item() for g in guards))
    except Exception:  # noqa: BLE001 - a shape baked in for the batch: decide on the model itself
        return None
    return values


def batch_guard_values(program: Program) -> tuple:
    """The values the guards hold: those the traced batch read."""
    return tuple(g.args[1] for g in _guards(program))


def _guards(program: Program) -> list:
    return [g for g in program.graph.nodes if g.op == "call_function" and g.target is input_branch]


def check_branches_per_sample(model: nn.Module, X, output, per_sample: Optional[List[tuple]] = None,
                              batch_values: tuple = ()) -> None:
    """Refuse a batch whose samples, each alone, take other branches than the batch took.

    A guarded graph (:func:`input_branch`) holds the branch the *batch's* values chose (``if
    x.sum() > 0``). curvlib's per-sample quantities are those of each sample run alone. Where
    the samples' guard values (``per_sample``, :func:`guard_values_per_sample`) are known, only
    those differing from the batch's are checked, a group of samples reading the same values at
    a time (Hugging Face's padding-mask shortcut: the unpadded samples, one forward, and one of
    them alone to confirm the group reads as it does); otherwise each sample is run alone
    (``N + 1`` forwards). The values the Python reads (``.item()``, ``bool``) are compared with
    the batch's: where they differ and a sample's output differs from its row of the batch's,
    per-sample quantities are not defined (branches that agree in value pass)."""
    own = {k: v.detach() for k, v in model.named_parameters()}

    def run(x):
        with _Reads() as reads:
            out = (torch.func.functional_call(model, own, (), dict(x)) if keyword_inputs(model, x)
                   else torch.func.functional_call(model, own, (x,)))
        return _outputs.select(out, output)[0], reads.values

    try:
        with torch.no_grad(), LOCK, restored(model), without_hooks(model):
            batch, read = run(X)
            for rows in _groups(per_sample, batch_values, batch_size(X)):
                got, read_got = run(select_batch(X, rows))
                if len(rows) > 1 and run(select_batch(X, rows[:1]))[1] != read_got:
                    got, read_got = None, None  # the group reads otherwise than its members: one by one
                for k, n in enumerate(rows):
                    alone, read_alone = (got[k:k + 1], read_got) if got is not None else run(slice_batch(X, n, n + 1))
                    _same_branch_or_value(batch[n:n + 1], alone, read, read_alone, n, model)
    except RuntimeError as exc:  # a batched input (vmap over X): no single value to read
        raise CurvatureError(
            "The model's forward reads values of its input to choose a branch; under torch.func.vmap over "
            "the input they differ per member. Call curvature's function per member.") from exc


def _groups(per_sample: Optional[List[tuple]], batch_values: tuple, n: int) -> List[List[int]]:
    """Samples to run without the batch: each alone when their guard values are not known, else
    those reading other values than the batch, grouped by the values they read."""
    if per_sample is None:
        return [[i] for i in range(n)]
    groups: Dict[tuple, List[int]] = {}
    for i, values in enumerate(per_sample):
        if values != batch_values:
            groups.setdefault(values, []).append(i)
    return list(groups.values())


def _same_branch_or_value(row: Tensor, alone: Tensor, read, read_alone, n: int, model: nn.Module) -> None:
    if read_alone == read or (alone.shape == row.shape and bool(
            ((alone - row).abs() <= 1e-5 * row.abs().max() + 1e-6).all())):
        return
    raise CurvatureError(
        f"The model's forward ({type(model).__name__}) reads tensor values to choose a branch "
        f"(read {read!r} from the batch, {read_alone!r} from sample {n} alone) and computes "
        f"something else for sample {n} alone than for it in the batch: the branch is chosen by "
        "the whole batch's values, so the samples are not independent and per-sample quantities "
        "are not defined. Make the branch depend on each sample alone (e.g. torch.where on "
        "per-sample conditions).")


class _Reads(TorchDispatchMode):
    """Records the values Python reads from tensors (``.item()``, ``bool(t)``) while active."""

    def __init__(self):
        super().__init__()
        self.values: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten._local_scalar_dense.default:
            self.values.append(out)
        return out


input_branch.curvlib_linear = True  # a constant for the derivatives (curvlib.rules.elementwise)
