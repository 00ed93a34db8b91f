"""The graph rewrite that gives a node on merged rows the batch as a dim of its own.

:func:`curvlib._plan.batch_merges.split_merged_batches` decides which nodes hold the batch
merged with windows, heads or tokens (``[N·W, S, C]``) and how; :func:`unmerge` rewrites the
graph around one of them: its operands batch first (``[N, W·S, C]``: one leading dim more), the
op as one that takes that dim, its output merged back for its users.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import fx
from torch.nn import functional as F

from . import per_sample_ops as _per_sample_ops
from .._trace.program import Program

__all__ = ["BROADCASTING", "Unmerge", "lone_index", "needs_per_sample", "unmerge"]

#: Ops on parameters (functional sites) that broadcast over leading dims: one more leading dim
#: on their batched operands leaves every entry's value as it was.
BROADCASTING = frozenset({operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub,
                           torch.mul, torch.div, operator.matmul, torch.matmul, torch.bmm, F.linear})
#: Ops that take no extra leading dim, run as the op that does and computes the same values
#: (``bmm`` on ``[B, R, K] @ [B, K, M]`` is ``matmul``, which broadcasts over a leading batch dim).
_BROADCASTING_FORM = {torch.bmm: torch.matmul}


def needs_per_sample(program, node: fx.Node) -> bool:
    """A functional site that takes no extra leading dim on its merged operands."""
    return (node in program.functional and node.op in ("call_function", "call_method")
            and node.target not in BROADCASTING and lone_index(node) is None)


def lone_index(node: fx.Node) -> Optional[fx.Node]:
    """The index tensor of ``p[idx]`` (also written ``p[(idx,)]``), else ``None``."""
    if node.target is not operator.getitem or len(node.args) != 2:
        return None
    idx = node.args[1]
    idx = idx[0] if isinstance(idx, tuple) and len(idx) == 1 else idx
    return idx if isinstance(idx, fx.Node) else None


@dataclass(frozen=True)
class Unmerge:
    """How :func:`unmerge` rewrites a node: the operands at ``positions`` hold the batch merged in
    dim ``d`` (``split = (outer, inner, d)``: the dim is ``[outer, N, inner]``). ``channels``: rows
    ``[R, C]`` of a layer that wants its channels in dim 1 (BatchNorm): it runs on
    ``[N, C, outer·inner]``. ``results``: for a split-rows module, the merged dim of each tensor
    read from its result (by the reading node's name), each merged back where it is read."""

    positions: Tuple[int, ...]
    split: Tuple[int, int, int]
    channels: bool = False
    results: Optional[Dict[str, int]] = None


def unmerge(program: Program, name: str, how: Unmerge) -> Program:
    """Run graph node ``name`` with the batch split off dim ``d`` of its operands (:class:`Unmerge`):
    the batch goes in front and dim ``d`` keeps the ``outer·inner`` rows of one sample, so the
    operand's rank grows by one leading dim and every other dim stays where it was. Its output is
    merged back, so that its users see the same values. An op that takes no extra leading dim
    runs as its broadcasting form (``bmm`` as ``matmul``), or once per sample
    (:class:`curvlib._plan.per_sample_ops.PerSample`). Returns the program with the nodes made
    among its input-dependent ones; its graph and its table of functional uses are edited in place
    (the rewrite's own copy: :func:`curvlib._plan.batch_merges.split_merged_batches`)."""
    graph = program.graph
    node = next(m for m in graph.nodes if m.name == name)
    if node.op == "call_function" and lone_index(node) is not None:
        node.args = (node.args[0], lone_index(node))  # p[(idx,)] is p[idx]: the index as an operand
    made: List[fx.Node] = []

    def add(at, method, *rest, tag):  # one call_method node inserted at ``at``
        with at:
            made.append(graph.create_node("call_method", method, rest, name=f"{name}_{tag}"))
        return made[-1]

    use = program.functional.get(node)
    chain = list(use.chain) if use is not None else []
    swapped = _batch_first_operands(node, how, add, made, chain)
    if needs_per_sample(program, node):
        per_sample = _per_sample_ops.PerSample(node.target, how.positions, node.op == "call_method")
        node.target, node.op = per_sample, "call_function"
    elif node.op == "call_function":
        node.target = _BROADCASTING_FORM.get(node.target, node.target)
    if use is not None:  # (its per-sample recomputation reads these inputs)
        program.functional[node] = dataclasses.replace(use, inputs=tuple(swapped.get(a, a) for a in use.inputs),
                                                       chain=tuple(chain))
    outer, inner, d = how.split
    if how.results is not None:  # each tensor read from the result merged back where it is read
        for read in [m for m in graph.nodes if m.name in how.results]:
            _merge_back(program, read, how.results[read.name], (outer, inner), add)
        return dataclasses.replace(program, dependent=program.dependent | set(made))
    out = add(graph.inserting_after(node), "transpose", node, 1, 2, tag="rows_back") if how.channels else node
    first = add(graph.inserting_after(out), "unflatten", out, d + 1, (outer, inner), tag="split_rows")
    first = first if not how.channels else out  # (the one user of the node's own value)
    back = add(graph.inserting_after(made[-1]), "movedim", made[-1], 0, d + 1, tag="batch_back")
    merged = add(graph.inserting_after(back), "flatten", back, d, d + 2, tag="merge_batch")
    node.replace_all_uses_with(merged, delete_user_cb=lambda user: user is not first)
    _rewire_uses(program, node, merged)
    return dataclasses.replace(program, dependent=program.dependent | set(made))


def _batch_first_operands(node: fx.Node, how: Unmerge, add, made: List[fx.Node], chain: list) -> dict:
    """The node's operands at ``how.positions`` made batch first (``add``: :func:`unmerge`'s node
    maker, which appends to ``made``); an operand of a functional use's parameter-only ``chain``
    (a query repeated N times) keeps its new nodes in the chain. Returns ``{old operand: new}``."""
    outer, inner, d = how.split
    graph, args = node.graph, list(node.args)
    for k in how.positions:
        start = len(made)
        x = add(graph.inserting_before(node), "unflatten", args[k], d, (outer, -1, inner), tag=f"split_batch{k}")
        x = add(graph.inserting_before(node), "movedim", x, d + 1, 0, tag=f"batch_first{k}")
        args[k] = x = add(graph.inserting_before(node), "flatten", x, d + 1, d + 2, tag=f"rows{k}")
        if how.channels:  # [N, R, C] -> [N, C, R]
            args[k] = add(graph.inserting_before(node), "transpose", x, 1, 2, tag=f"channels{k}")
        if node.args[k] in chain:  # a parameter-only operand built for the batch (a query repeated N times)
            chain += made[start:]
            del made[start:]
    swapped = {old: new for old, new in zip(node.args, args) if old is not new}
    node.args = tuple(args)
    return swapped


def _merge_back(program, read: fx.Node, dim: int, rows: Tuple[int, int], add) -> None:
    """``read`` (``[N, …, outer·inner at dim + 1, …]``) merged back to the batch in ``dim``
    for its users (``add``: :func:`unmerge`'s node maker)."""
    graph = program.graph
    first = add(graph.inserting_after(read), "unflatten", read, dim + 1, rows, tag=f"{read.name}_rows")
    back = add(graph.inserting_after(first), "movedim", first, 0, dim + 1, tag=f"{read.name}_batch_back")
    merged = add(graph.inserting_after(back), "flatten", back, dim, dim + 2, tag=f"{read.name}_merge_batch")
    read.replace_all_uses_with(merged, delete_user_cb=lambda user: user is not first)
    _rewire_uses(program, read, merged)


def _rewire_uses(program, old: fx.Node, new: fx.Node) -> None:
    """Functional sites among the users of ``old`` now read ``new`` (its value merged back):
    their recorded inputs follow the graph's arguments, so that their per-sample recomputation
    reads the node its arguments name (two functional sites in a row on merged rows: window
    attention's scores scaled by a parameter, then a bias made from parameters added)."""
    for user, use in list(program.functional.items()):
        if old in use.inputs and user is not old:
            program.functional[user] = dataclasses.replace(
                use, inputs=tuple(new if a is old else a for a in use.inputs))
