"""Samples mixed inside the model: found when a plan is made, refused for per-sample extensions.

Per-sample quantities assume that sample ``n``'s output depends on sample
``n``'s input only. A model that mixes samples (``h - h.mean(0)``, batch
statistics, attention across the batch, ``h[perm]``) breaks that: each
sample's output then depends on the other samples through the parameters,
individual gradients are not defined, and the per-sample read-offs return
numbers that are silently wrong (for ``h - h.mean(0)`` after a Linear layer,
0.3 off an oracle).

:func:`analyse` runs when :func:`curvlib._plan.plan.make_plan` makes a plan, on
the values of every graph node in the two planning passes (batch sizes ``N``
and ``N + 1``, fake tensors): the changing dim of each node's shapes is its
batch (:mod:`curvlib._plan.mixing_ops`). A node is refused when it takes a batched
input that depends on a trainable parameter (*hot*; mixing of values that do
not, e.g. ``X - X.mean(0)`` before every layer, leaves per-sample gradients
exact) and

* its output loses the batch (``h.mean(0)``, ``h[0]``, ``h.t() @ h``), pairs
  samples (``h @ h.T`` is ``[N, N]``) or shifts them (``h[1:] - h[:-1]``);
* it mixes along the batch dim (softmax, cumsum, sort, flip, roll, gather,
  ``F.normalize``, ``F.batch_norm(training=True)``, ``nn.Softmax(dim=0)``, a
  tensor index ``h[perm]``, a contraction over the batch, a reshape that
  regroups rows of different samples, an RNN/attention module whose sequence
  dim holds the batch).

A layer whose own parameters are trainable counts all its batched inputs as
hot (an RNN over the batch mixes its parameters' effect across samples), and
a hot output that lost the batch of a batched input (hot or not) is refused.
``detach`` cuts the dependence (``h - h.detach().mean(0)``: the mean is a
constant for every gradient, which is then exact). Merging the batch with
another dim and splitting it again is allowed (no values mix); a merge whose
order curvlib cannot follow is refused, not guessed.

A tensor that holds no sample's values (*data-free*: made from shapes, dtypes and
constants alone, ``h.new_ones(N, N)``, ``zeros_like``, an ALiBi bias ``[N·H, 1, T]`` built
from ``arange`` and evaluated once by the ATen trace) and no parameter is a constant,
whatever its shape: its batch-sized dims are not a batch, so it mixes nothing. Rows of a
data-free tensor that depends on a parameter (a learned bias expanded to ``[N·H, 1, T]``)
belong to no sample: they pair with any sample's rows in any order, so they take no part in
the check that merged inputs agree in order.

Indexing along the batch dim (``h[idx]``, ``h[mask]``, ``index_select``/``gather`` along
it) is decided on the index's values (:mod:`curvlib._plan.mixing_index`): in the planning
passes when it is built from constants and shapes, on every call when it depends on the
input's values.

Operations outside the tables, parametrized modules without a hand-written
rule and unknown parameter-free modules are *pending*: tested numerically
once per plan, on first use (:mod:`curvlib._plan.mixing_numeric`). Models without
a graph are tested numerically on every call that needs it (their plan is
not cached, and their path may change per call). With ``N = 1`` the numeric
tests have nothing to compare (and one sample cannot mix); the graph checks
still refuse.

:func:`curvlib._plan.mixing_refusals.refuse_mixing` raises before any work when an extension needs
independent samples: all but the block products ``HMP`` and ``GGNMP``, which
come from whole-batch autodiff and stay exact, like ``loss`` and ``grad``.
"""

from __future__ import annotations

import operator
from operator import attrgetter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from torch import Tensor, fx, nn

from .._core import aliasing
from .._trace import graph_facts
from . import mixing_checks as checks, mixing_index as index, mixing_ops as ops
from .mixing_ops import Batch
from . import mixing_numeric as _mixing_numeric

__all__ = ["Independence", "analyse", "refuse_mixing", "refuse_mixing_per_call"]

_UNSET = object()


@dataclass
class Independence:
    """What the planner found (cached with the plan, per input signature).

    Attributes:
        problem: the first mixing node, in words (``None``: none found in the graph).
        pending: nodes to test numerically (generic layers, unknown operations).
        layouts: node -> per tensor leaf :class:`~curvlib._plan.mixing_ops.Batch` or ``None``.
        data: the nodes whose values hold sample data.
        untraced: the model has no graph (tested numerically on every call).
    """

    problem: Optional[str] = None
    pending: Tuple[fx.Node, ...] = ()
    layouts: Dict[fx.Node, list] = field(default_factory=dict)
    untraced: bool = False
    numeric_problem: object = _UNSET
    gathers: Tuple[index.GatherCheck, ...] = ()  # indexing by the input's values: tested per call
    data: frozenset = frozenset()  # nodes holding sample data (the others fit any order of a merged batch)

    def per_call(self, program, X, params, trainable) -> Optional[str]:
        """The verdict on indexing by the input's values, for this call's ``X``."""
        return _mixing_numeric.gather_problem(program, self.gathers, X, params, trainable) if self.gathers else None

    def numeric(self, program, plan, X, params, trainable, runner) -> Optional[str]:
        """The numeric tests' verdict, computed on first use (for a graph, once per plan)."""
        if self.untraced:
            return _mixing_numeric.untraced_problem(program, plan, X, params, trainable, runner)
        if self.numeric_problem is _UNSET:
            self.numeric_problem = _mixing_numeric.pending_problem(program, self, X, params, trainable)
        return self.numeric_problem


def analyse(program, env_a: Dict, env_b: Dict, n: int, trainable) -> Independence:
    """Find the first node mixing hot samples (see the module doc).

    Args:
        program: the traced model.
        env_a, env_b: every node's value in the planning passes with ``N`` and ``N + 1``.
        n: ``N``.
        trainable: names of the parameters whose quantities are wanted.
    """
    if program.graph is None:
        return Independence(untraced=True)
    walk = _Walk(program, env_a, env_b, n, frozenset(trainable))
    guards = _guard_only(program.graph)
    for node in program.graph.nodes:
        if node in guards:
            continue
        problem = walk.visit(node)
        if problem:
            return Independence(problem=problem)
    return Independence(pending=tuple(walk.pending), layouts=walk.layouts, gathers=tuple(walk.gathers),
                        data=frozenset(walk.data))


def _guard_only(graph) -> set:
    """Nodes whose values only reach guards (``curvlib._trace.branches.input_branch``: a branch the model's
    Python took on a value, ``if x.sum() > 0``): they shape no output, so they mix nothing into it.
    A batch-level branch is checked per sample instead (``curvlib._trace.branches.check_branches_per_sample``)."""
    only: set = set()
    for node in reversed(list(graph.nodes)):
        users = list(node.users)
        if users and all(getattr(u.target, "__name__", "") == "input_branch" or u in only for u in users):
            only.add(node)
    return only



class _Walk:
    """One pass over the graph: layouts, hot nodes, the first problem, pending nodes."""

    def __init__(self, program, env_a, env_b, n, trainable):
        self.program, self.env_a, self.env_b, self.n, self.trainable = program, env_a, env_b, n, trainable
        self.layouts: Dict[fx.Node, list] = {}
        self.hot: set = set()
        self.data: set = set()  # nodes whose values depend on the input's values (sample data)
        self.writes: set = set()  # buffers (and views of them) an in-place write filled with sample data
        self.pending: List[fx.Node] = []
        # indexing along the batch decided on values (mixing_index): node -> why it mixes, or None
        self.verdicts: Dict[fx.Node, Optional[str]] = {}
        self.gathers: List[index.GatherCheck] = []
        self.values = (index.Values(program.root, env_a), index.Values((program.sibling or program).root, env_b))

    def batch(self, a) -> Optional[Batch]:
        leaves = self.layouts.get(a, []) if isinstance(a, fx.Node) else []
        return leaves[0] if len(leaves) == 1 and isinstance(leaves[0], Batch) else None

    def batch_of_any(self, a) -> bool:
        return any(isinstance(x, Batch) for x in self.layouts.get(a, []))

    def load(self, arg):
        return fx.node.map_arg(arg, lambda a: self.env_a.get(a))

    def kind(self, node) -> Tuple[str, str, object]:
        """``(kind, name, detail)``: for modules ``detail`` is the module (and its kind's detail)."""
        if node.op != "call_module" or node.meta.get("no_grad"):
            return ops.kind_of(node, self.env_a) + (None,)
        module = attrgetter(node.target)(self.program.root)
        layer = self.program.layers.get(node.target)
        name = type(module).__name__
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return "batchnorm", name, module
        if layer is not None:
            return ("generic" if layer.family.runs_own_code else "layer"), name, module
        kind, detail = ops.module_kind(module)
        return kind, name, (module, detail)

    def owns_trainable(self, node) -> bool:
        if node.op == "get_attr":
            value = attrgetter(node.target)(self.program.root)
            return isinstance(value, nn.Parameter) and self.program.param_names.get(id(value)) in self.trainable
        layer = self.program.layers.get(node.target) if node.op == "call_module" else None
        return layer is not None and any(name in self.trainable for name in layer.names.values())

    def visit(self, node) -> Optional[str]:
        if node.op == "output":
            return None
        self.layouts[node] = ops.layout_of(self.env_a.get(node), self.env_b.get(node), self.n)
        own = self.owns_trainable(node) if node.op in ("get_attr", "call_module") else False
        if node.op in ("placeholder", "get_attr"):
            if own:
                self.hot.add(node)
            if node.op == "placeholder":
                self.data.add(node)
            return None
        kind, name, detail = self.kind(node)
        if kind != "meta" and any(a in self.data for a in node.all_input_nodes):
            self.data.add(node)
        batched = [a for a in node.all_input_nodes if self.batch_of_any(a)]
        # A layer with trainable parameters mixes them into whatever it mixes: all its inputs count.
        hot_in = batched if own else [a for a in batched if a in self.hot]
        hot = kind not in ("meta", "cut") and (own or any(a in self.hot for a in node.all_input_nodes))
        if hot:
            self.hot.add(node)
        elif node not in self.data:
            # no sample's values, no parameter (``h.new_ones(N, N)``, an ALiBi bias): a constant
            self.layouts[node] = [None] * len(self.layouts[node])
            return None
        self.gather(node, kind, name, hot_in)
        problem = self.refine(node, kind, name, hot_in)
        self.written(node, hot)
        if problem or not (hot_in or (hot and batched)):
            return problem
        # a hot output computed from batched values (hot or not) must keep their batch
        return self.check(node, kind, name, detail, hot_in, hot_in or batched)

    def written(self, node, hot: bool) -> None:
        """An in-place write (``buf.add_(h)``, ``buf[:, 1:] = h``) leaves its values in its first
        input and, through views, in their bases: a buffer made from shapes then holds sample data
        (batched as its shapes say, in the order of what was written), hot from a hot write."""
        target = node.args[0] if node.args else None
        if not isinstance(target, fx.Node) or not (node.target is operator.setitem
                                                   or graph_facts.overwrites_input(self.program, node)):
            return
        src = self.batch(node.args[-1]) if isinstance(node.args[-1], fx.Node) else None
        while isinstance(target, fx.Node):
            if node in self.data and target not in self.data:
                self.data.add(target)
                self.writes.add(target)
                leaves = ops.layout_of(self.env_a.get(target), self.env_b.get(target), self.n)
                b = leaves[0] if len(leaves) == 1 else None
                if isinstance(b, Batch) and b.s is None and src is not None and (src.dim, src.c) == (b.dim, b.c):
                    leaves = [src]
                self.layouts[target] = leaves
            if hot:
                self.hot.add(target)
            views = target.op in ("call_function", "call_method") and aliasing.op_name(target) in aliasing.VIEWS
            target = target.args[0] if views and target.args else None

    # -- indexing along the batch, decided on values ----------------------------------
    def gather(self, node, kind, name, hot_in) -> None:
        """Run :mod:`curvlib._plan.mixing_index`'s sample-id test on an op indexing the batch dim:
        in both planning passes when the index is a constant (or shapes), else per call."""
        name = name.split(".")[0]  # (an ATen overload: index_select.default)
        if node.op == "call_module" or not (kind == "index" or name in index.GATHERS):
            return
        src, b = node.args[0], self.batch(node.args[0])
        if b is None or b.s is None:
            return  # (an order curvlib cannot follow: refused)
        values = self.load(node.args)
        found = index.gather_slots(name, node, values, b, self.env_a[src].dim())
        leaves = self.layouts[node]
        if found is None or len(leaves) != 1:
            return
        items, needed = found
        layout = leaves[0]
        for k, (env, n) in enumerate(((self.env_a, self.n), (self.env_b, self.n + 1))):
            flat = index.needed_values(items, needed, self.values[k].get)
            if flat is None:  # depends on the input's values: decided on every call
                if src in hot_in:
                    self.gathers.append(index.gather_check(node, b, layout, values, items, needed))
                self.verdicts[node] = None
                return
            args = fx.node.map_arg(node.args, env.get)
            out = index.run_check(name, node, args, tuple(env[src].shape), b, flat, n)
            why, layout = index.sample_check(out, layout, n)
            if why:
                self.verdicts[node] = (f"of '{src.name}' indexes the batch dim {b.dim} with a tensor that {why}"
                                       if kind == "index" else f"along the batch dim {b.dim} of '{src.name}' {why}")
                return
        if isinstance(layout, Batch):
            leaves[0] = layout
        self.verdicts[node] = None

    # -- layouts of merged batches ------------------------------------------------
    def refine(self, node, kind, name, hot_in) -> Optional[str]:
        """Fill in ``s`` of output batches merged with another dim; a problem if samples regroup."""
        leaves = self.layouts[node]
        if kind == "pick" and isinstance(node.args[1], int):
            src = self.layouts.get(node.args[0], [])
            if len(leaves) == 1 and node.args[1] < len(src) and isinstance(src[node.args[1]], Batch):
                leaves[0] = src[node.args[1]]
            return None
        open_ = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Batch) and leaf.s is None]
        if open_ and self.filled(node):  # one value: read in the batch-major order, as any other fits
            leaves[:] = [Batch(b.dim, b.c, b.c) if i in open_ else b for i, b in enumerate(leaves)]
            return None
        if kind == "view":
            return self._view(node, name, hot_in)
        if not open_:
            return None
        # (rows without sample data, one value, a parameter expanded to the batch's shape: pair in any
        # order; a buffer written into holds the written order, and a view of it keeps that order)
        ins = [b for a in node.all_input_nodes if a in self.data and not self.blank(a)
               for b in self.layouts.get(a, []) if isinstance(b, Batch)]
        for i in open_:
            out = leaves[i]
            if kind == "repeat" and len(ins) == 1:
                # tiles keep the stride; repeat_interleave of single rows repeats each sample c times
                s = ins[0].s if name != "repeat_interleave" else _interleaved_stride(node, ins[0], out)
                leaves[i] = Batch(out.dim, out.c, s)
                continue
            same = [b for b in ins if b.c == out.c] if kind != "cat" or sum(b.c for b in ins) != out.c else ins
            strides = {b.s for b in same}
            if len(strides) == 1:
                leaves[i] = Batch(out.dim, out.c, strides.pop())
            elif len(strides) > 1 and hot_in:
                return (f"graph node '{node.name}' ({checks.label(node, name)} combines tensors "
                        "whose batch is merged with another dim in different orders, so it pairs entries "
                        "of different samples)")
        return None

    def blank(self, a) -> bool:
        """A tensor of one value that no in-place write has filled with sample data since."""
        return self.filled(a) and a not in self.writes

    def filled(self, a) -> bool:
        """A tensor filled with one value (``zeros([N·T, E])``, ``ones_like``): every order of its
        merged batch is the same tensor, so it fits any operand's."""
        if not isinstance(a, fx.Node) or a.op not in ("call_function", "call_method"):
            return False
        value = getattr(a.target, "value", None)  # a constant the ATen replay evaluated (modes.TensorConstant)
        if isinstance(value, Tensor) and not a.all_input_nodes:
            return value.numel() > 0 and bool((value == value.flatten()[0]).all())
        return ops.kind_of(a, self.env_a)[1] in _FILLS

    def _view(self, node, name, hot_in) -> Optional[str]:
        leaves = self.layouts[node]
        src = next((a for a in node.all_input_nodes if self.batch(a) is not None), None)
        if src is None or len(leaves) != 1 or not isinstance(leaves[0], Batch):
            return None
        shape_in, shape_out = tuple(self.env_a[src].shape), tuple(self.env_a[node].shape)
        new = ops.view_layout(shape_in, self.batch(src), shape_out, leaves[0], self.n)
        if new is not None:
            leaves[0] = new
            return None
        leaves[0] = Batch(leaves[0].dim, leaves[0].c, None)
        if src not in hot_in or src not in self.data:  # (no sample data to regroup)
            return None
        module = attrgetter(node.target)(self.program.root) if node.op == "call_module" else None
        what = (f"{checks.label(node, name, module)} of '{src.name}' from {list(shape_in)} to {list(shape_out)}")
        if self.batch(src).s is None:  # merged by an operation whose layout curvlib does not know
            return (f"graph node '{node.name}' ({what}: the batch of '{src.name}' is merged with another "
                    "dim by an operation curvlib cannot follow, so it cannot tell whether samples stay apart)")
        return (f"graph node '{node.name}' ({what} regroups entries of different samples into one "
                f"row: the batch dim {self.batch(src).dim} is not kept whole)")

    # -- the checks -----------------------------------------------------------------
    def check(self, node, kind, name, detail, hot_in, feeding) -> Optional[str]:
        """``hot_in``: batched inputs whose mixing matters; ``feeding``: batched inputs of a hot node."""
        module = (detail[0] if isinstance(detail, tuple) else detail) if node.op == "call_module" else None
        what = checks.specific(self, node, kind, name, detail, hot_in)
        if what is None or what == checks.PENDING:
            pending = what == checks.PENDING or kind in ("generic", "unknown")
            what = checks.shape_rule(self, node, kind, feeding)
            if what is None and pending:
                self.pending.append(node)
        return f"graph node '{node.name}' ({checks.label(node, name, module)} {what})" if what else None


#: ops that create a tensor of one value
_FILLS = frozenset("zeros ones full empty zeros_like ones_like full_like empty_like new_zeros new_ones new_full "
                   "new_empty".split())


def _interleaved_stride(node: fx.Node, src: Batch, out: Batch) -> Optional[int]:
    """``s`` of ``repeat_interleave`` along the batch dim: output entry ``i`` is input entry
    ``i // r`` (``r = out.c / src.c`` repeats), of sample ``(i // (r·s)) % N``; ``None`` when
    the op repeats along another dim of a merged batch or flattens a tensor of several dims."""
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
    if src.s is None or out.c % src.c or (dim is None and src.c > 1) or (dim is not None and dim != src.dim):
        return out.c if src.c == 1 else None
    return src.s * (out.c // src.c)
