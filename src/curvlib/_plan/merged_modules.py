"""A generic layer on merged rows, given the batch as a dim of its own around it.

A module without a hand-written rule (a mixture of experts' grouped experts, kept whole by
:mod:`curvlib._trace.module_calls`; any opaque module) may take the batch merged with tokens
in dim ``d`` (``[N·T, D]`` rows, sample-major). Unlike a row-wise layer it cannot be handed
an extra leading dim: its ``forward`` is written for its own layout. So the graph gives the
layer batch-first operands (``x.unflatten(d, (outer, -1, inner)).movedim(d + 1, 0)``) and the
layer becomes :class:`SampleRows`, which merges them back before calling the module and
splits its output after: on the whole batch it computes what the module does, and the
generic rule's batch of one (``[1, ...]``) is the module run on one sample's rows in the
module's own layout, exact for a module that maps each sample's rows on their own.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Sequence, Tuple

from torch import Tensor, fx, nn

from ..rules import generic

__all__ = ["SampleRows", "batch_first_module"]

_OWN_ROOT = "_curvlib_own_root"


class SampleRows(nn.Module):
    """``module`` on operands whose dim ``d`` was split into ``[N, outer, inner]`` batch first
    (``positions``: the operands that hold the batch); its output split the same way."""

    def __init__(self, module: nn.Module, positions: Sequence[int], split: Tuple[int, int, int]):
        super().__init__()
        self.module = module
        self.positions, self.split = tuple(positions), split

    def forward(self, *args, **kwargs):
        outer, inner, d = self.split
        merged = [a.movedim(0, d + 1).flatten(d, d + 2) if k in self.positions else a for k, a in enumerate(args)]
        out = self.module(*merged, **kwargs)
        if not isinstance(out, Tensor):
            raise TypeError(f"{type(self.module).__name__} on merged rows returns {type(out).__name__}, not a tensor")
        return out.unflatten(d, (outer, -1, inner)).movedim(d + 1, 0)


def _own_root(model: nn.Module) -> nn.Module:
    """A shallow copy of ``model`` (its submodules, parameters and buffers the same objects) whose
    submodule table is its own, so that modules added to it leave ``model`` as it is."""
    root = copy.copy(model)
    root._modules = dict(model._modules)
    root.__dict__[_OWN_ROOT] = True  # (the copy's attribute table is its own too)
    return root


def batch_first_module(program, name: str, positions: Sequence[int], split: Tuple[int, int, int],
                       as_generic: bool = False):
    """Run the generic layer at graph node ``name`` (a ``call_module``) as :class:`SampleRows` on
    batch-first operands, its output merged back for its users. The wrapper is registered on the
    program's root; a symbolic trace's root, the user's model, is first replaced by a shallow copy
    with a submodule table of its own (same submodules and parameters), so the model is never
    changed. ``as_generic``: a layer with a rule of its own that takes no extra leading dim (a
    convolution) is run by the generic rule there, exact for a layer that acts on each row alone.
    Returns the program with that root and the nodes made among its input-dependent ones (its
    table of layers is edited in place: the rewrite's own copy)."""
    outer, inner, d = split
    graph = program.graph
    if not program.aten and not program.root.__dict__.get(_OWN_ROOT):
        program = dataclasses.replace(program, root=_own_root(program.root))
    node = next(m for m in graph.nodes if m.name == name)
    layer = program.layers.pop(node.target)
    target = "rows__" + node.target.replace(".", "__")
    program.root.add_module(target, SampleRows(layer.module, positions, split))
    program.layers[target] = type(layer)(path=layer.path, module=program.root.get_submodule(target),
                                         names={f"module.{r}": c for r, c in layer.names.items()},
                                         forward=generic.forward if as_generic else layer.forward,
                                         kind="generic" if as_generic else layer.kind, opaque=layer.opaque)
    made = []

    def add(method, *args, tag, after=None):
        with graph.inserting_after(after) if after is not None else graph.inserting_before(node):
            made.append(graph.create_node("call_method", method, args, name=f"{name}_{tag}"))
        return made[-1]

    args = list(node.args)
    for k in positions:
        x = add("unflatten", args[k], d, (outer, -1, inner), tag=f"split_batch{k}")
        args[k] = add("movedim", x, d + 1, 0, tag=f"batch_first{k}")
    node.args, node.target = tuple(args), target
    back = add("movedim", node, 0, d + 1, tag="batch_back", after=node)
    merged = add("flatten", back, d, d + 2, tag="merge_batch", after=back)
    node.replace_all_uses_with(merged, delete_user_cb=lambda user: user is not back)
    return dataclasses.replace(program, dependent=program.dependent | set(made))
