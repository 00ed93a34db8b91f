"""Which graph nodes share memory, and which nodes write into it in place.

A traced graph shows an in-place write only as a node that takes the written tensor (or a
view of it) as its first argument: ``b = p.clone(); b[2:4].zero_(); F.linear(x, W, b)``
is ``clone -> getitem -> zero_`` beside ``clone -> linear``. The value ``linear`` reads is
the clone *after* the write, so whoever follows a node's arguments (the input-dependence
analysis, a parameter-only chain recomputed from the parameters) must follow the writes
into them as well: :func:`effective_inputs`.
"""

from __future__ import annotations

import operator
from typing import Dict, List

from torch import fx

__all__ = ["VIEWS", "op_name", "writers", "view_base", "effective_inputs"]

# ops whose output may share its input's memory: a write into it is a write into the input
VIEWS = frozenset("""select slice narrow view _unsafe_view expand transpose permute unsqueeze squeeze
as_strided diagonal t alias unflatten getitem split chunk unbind""".split())

_AUGMENTED = ("iadd", "isub", "imul", "itruediv")


def op_name(u: fx.Node) -> str:
    """A call's name without its ATen overload (``aten.select.int``: ``select``)."""
    return (u.target if u.op == "call_method" else getattr(u.target, "__name__", "")).split(".")[0]


def writers(node: fx.Node) -> List[fx.Node]:
    """The nodes that write into ``node``'s memory in place, directly or through a view of it
    (``m[:, 0] = 1``: ``select`` then ``fill_``; ``m.add_(x)``, ``m += x``): its value as a later
    node reads it is theirs too."""
    found, stack = [], [node]
    while stack:
        m = stack.pop()
        for u in m.users:
            if not u.args or u.args[0] is not m or u.op not in ("call_function", "call_method"):
                continue
            name = op_name(u)
            if u.target is operator.setitem or name in _AUGMENTED or (name.endswith("_") and not name.endswith("__")):
                found.append(u)
            elif name in VIEWS:
                stack.append(u)
    return found


def view_base(node: fx.Node) -> fx.Node:
    """The node whose memory ``node`` views (itself when it is no view)."""
    while node.op in ("call_function", "call_method") and node.args and isinstance(node.args[0], fx.Node) \
            and op_name(node) in VIEWS:
        node = node.args[0]
    return node


def effective_inputs(graph: fx.Graph) -> Dict[fx.Node, List[fx.Node]]:
    """Every node's inputs with the in-place writes it sees: the writes into the memory of
    its arguments (through any view of it) that run before it, as the eager forward reads
    them. A write's own inputs (the written view, the value written) follow from it."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    written: Dict[fx.Node, List[fx.Node]] = {}  # memory's base node -> its writers

    def writes_into(a: fx.Node) -> List[fx.Node]:
        base = view_base(a)
        if base not in written:
            written[base] = writers(base)
        return written[base]

    result: Dict[fx.Node, List[fx.Node]] = {}
    for node in graph.nodes:
        inputs = list(node.all_input_nodes)
        extra = [w for a in inputs for w in writes_into(a) if order[w] < order[node] and w is not node]
        result[node] = inputs + [w for w in dict.fromkeys(extra) if w not in inputs]
    return result
