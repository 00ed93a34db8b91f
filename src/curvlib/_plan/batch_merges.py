"""The batch merged with windows or heads in dim 0 (``[N·W, S, C]``): planning and Hessian columns.

Window attention (Swin) merges each sample's windows into the batch dim before its layers.
Entry ``i`` of such a dim belongs to sample ``(i // s) % N`` (the layout the
sample-independence analysis follows, :class:`curvlib._plan.mixing_ops.Batch`). Two consequences:

* a parametrized layer on merged rows (:func:`split_merged_batches`) is given the batch as a
  dim of its own by a rewrite of the graph around it, its rows then positions sharing its
  weights (the planner needs every site's batch in one dim of size ``N``);
* a nonlinear node on merged rows treats each row as a sample when it factors its Hessian
  residual; :func:`per_sample` splits its columns per row of a sample.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Tuple

import torch
from torch import Tensor, fx, nn

from . import independence as _independence
from .._hessian import structured as _residual_structured
from .._core.errors import CurvatureError
from .mixing_ops import Batch
from .._core.site import Site

__all__ = ["split_merged_batches", "residual_merges", "per_sample"]


#: Site kinds that treat every entry of their input's dim 0 alike (leading dims are positions).
_ROW_WISE = frozenset({"linear", "layernorm", "embedding"})
#: Ops on parameters (functional sites) that broadcast over leading dims: one more leading dim
#: on their batched operands leaves every entry's value as it was.
_BROADCASTING = frozenset({operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub,
                           torch.mul, torch.div, operator.matmul, torch.matmul, torch.bmm})
#: Ops that take 3-D operands only (``bmm``: entry ``i`` of dim 0 multiplied alone), run on the
#: split operands ``[N, outer, inner, ...]`` as the op that broadcasts over leading dims.
_BROADCASTING_TWIN = {torch.bmm: torch.matmul}


def _merged(shape_a, shape_b, n: int) -> int:
    """``c > 1`` when only dim 0 changes with the batch, from ``c·N`` to ``c·(N + 1)`` entries
    (the batch merged with ``c`` windows or heads); else 0."""
    dims = [d for d, (a, b) in enumerate(zip(shape_a, shape_b)) if a != b]
    if dims != [0] or len(shape_a) != len(shape_b) or shape_a[0] % n or shape_b[0] - shape_a[0] != shape_a[0] // n:
        return 0
    return shape_a[0] // n if shape_a[0] // n > 1 else 0


def split_merged_batches(program, rec_a, rec_b, env_a, env_b, n: int, trainable) -> bool:
    """Give each row-wise site whose input has the batch merged into dim 0 (window attention:
    ``[N·W, S, C]`` into ``qkv``) the batch as a dim of its own, by a rewrite of the graph
    around it; whether anything was rewritten (the plan is then made again).

    Entry ``i`` of a merged dim belongs to sample ``(i // s) % N`` (the layout the
    sample-independence analysis follows, :class:`curvlib._plan.mixing_ops.Batch`), so the dim is
    ``[c/s, N, s]``: the site runs on ``x.unflatten(0, (c/s, -1, s)).movedim(1, 0)`` (its
    windows become positions sharing the weight) and its output is merged back the same way.
    A merge whose order is not known stays refused (:func:`_batch_dim`)."""
    where = {_site_node_name(site) for site, sa, sb in zip(rec_a.sites, rec_a.out_shapes, rec_b.out_shapes)
             if _merged(sa, sb, n) and (site.rule.kind in _ROW_WISE or _broadcasting(site) or _rows_apart(program, site, sa))}
    if not where or program.graph is None:
        return False
    found = _independence.analyse(program, env_a, env_b, n, trainable)
    if found.problem:
        return False
    done = False
    for node in list(program.graph.nodes):
        if _site_path(program, node) not in where:
            continue
        merged = {k: (found.layouts.get(a) or [None])[0] for k, a in enumerate(node.args) if isinstance(a, fx.Node)}
        merged = {k: b for k, b in merged.items() if isinstance(b, Batch) and b.dim == 0 and b.c > 1}
        layouts = set(merged.values())
        if len(layouts) != 1 or (node.op == "call_module" and set(merged) != {0}):
            continue  # (a module's batched input is its first; operands merged alike)
        batch = layouts.pop()
        if not batch.s or batch.c % batch.s:
            continue  # an order the analysis could not follow: refused below
        rows = _rows_apart(program, None, env_a[node].shape, node)
        for graph_program in (program, program.sibling):
            if graph_program is not None:
                _unmerge(graph_program, node.name, sorted(merged), batch.c // batch.s, batch.s, channels=rows)
        done = True
    return done


def _rows_apart(program, site: Optional[Site], shape, node: Optional[fx.Node] = None) -> bool:
    """An eval-mode BatchNorm (running statistics) on rows ``[R, C]``: each row normalised alone,
    so merged rows stay apart (in training mode the batch statistics mix them: not split,
    refused as before)."""
    if site is not None:
        node = next((m for m in program.graph.nodes if m.name == _site_node_name(site)), None) \
            if program.graph is not None else None
    layer = program.layers.get(node.target) if node is not None and node.op == "call_module" else None
    module = layer.module if layer is not None else None
    return (isinstance(module, nn.modules.batchnorm._BatchNorm) and len(shape) == 2
            and not module.training and module.running_mean is not None)


def _site_node_name(site: Site) -> str:
    use = site.meta.get("use")
    return use.node.name if use is not None else site.meta.get("node", site.where)


def _broadcasting(site: Site) -> bool:
    use = site.meta.get("use")
    return use is not None and use.node.op == "call_function" and use.node.target in _BROADCASTING


def _site_path(program, node: fx.Node) -> Optional[str]:
    """The path of the layer ``node`` runs (a module call), or its own name (an op on parameters)."""
    if node.op == "call_module" and node.target in program.layers:
        return program.layers[node.target].path
    return node.name if node in program.functional else None


def _unmerge(program, name: str, positions, outer: int, inner: int, channels: bool = False) -> None:
    """Run graph node ``name`` on its inputs at ``positions`` with the batch split off dim 0
    (``[outer, N, inner]``, the batch in front), and merge its output back, so that its users
    see the same values. ``channels``: rows ``[R, C]`` of a layer that wants its channels in
    dim 1 (BatchNorm): it runs on ``[N, C, outer·inner]``."""
    graph = program.graph
    node = next(m for m in graph.nodes if m.name == name)
    args = list(node.args)
    use = program.functional.get(node)
    chain = list(use.chain) if use is not None else []
    for k in positions:
        with graph.inserting_before(node):
            split = graph.create_node("call_method", "unflatten", (args[k], 0, (outer, -1, inner)),
                                      name=f"{name}_split_batch{k}")
            args[k] = graph.create_node("call_method", "movedim", (split, 1, 0), name=f"{name}_batch_first{k}")
            made = {split, args[k]}
            if channels:  # [N, outer, inner, C] -> [N, C, outer·inner]
                args[k] = graph.create_node("call_method", "flatten", (args[k], 1, 2), name=f"{name}_rows{k}")
                made.add(args[k])
                args[k] = graph.create_node("call_method", "transpose", (args[k], 1, 2), name=f"{name}_channels{k}")
                made.add(args[k])
        if node.args[k] in chain:  # a parameter-only operand built for the batch (a query repeated N times)
            chain += sorted(made, key=lambda m: list(graph.nodes).index(m))
        else:
            program.dependent = frozenset(program.dependent) | made
    swapped = {old: new for old, new in zip(node.args, args) if old is not new}
    node.args = tuple(args)
    if node.op == "call_function":
        node.target = _BROADCASTING_TWIN.get(node.target, node.target)
    if use is not None:  # (its per-sample recomputation reads these inputs)
        program.functional[node] = dataclasses.replace(use, inputs=tuple(swapped.get(a, a) for a in use.inputs),
                                                       chain=tuple(chain))
    first = out = node
    if channels:  # [N, C, outer·inner] -> [N, outer, inner, C]
        with graph.inserting_after(out):
            first = out = graph.create_node("call_method", "transpose", (out, 1, 2), name=f"{name}_rows_back")
        with graph.inserting_after(out):
            out = graph.create_node("call_method", "unflatten", (out, 1, (outer, inner)), name=f"{name}_split_rows")
    with graph.inserting_after(out):
        back = graph.create_node("call_method", "movedim", (out, 0, 1), name=f"{name}_batch_back")
    with graph.inserting_after(back):
        merged = graph.create_node("call_method", "flatten", (back, 0, 2), name=f"{name}_merge_batch")
    consumer = first if channels else back  # (the one user of the node's own value)
    node.replace_all_uses_with(merged, delete_user_cb=lambda user: user is not consumer)
    program.dependent = frozenset(program.dependent) | {first, out, back, merged} - {node}


def residual_merges(program, residuals, dims, independence, n: int) -> Tuple[Optional[Tuple[int, int]], ...]:
    """Per residual, ``(c, s)`` when its node works on ``c`` rows per sample merged into its batch
    dim (window attention's scores ``[N·W·H, S, S]``; row ``i`` of sample ``(i // s) % N``), so
    that its columns are split per row of a sample (:func:`per_sample`);
    ``None`` otherwise. A merge whose order is not known is refused."""
    if program.graph is None or not residuals or independence.problem:  # (mixing is refused on its own)
        return tuple(None for _ in residuals)
    nodes = {node.name: node for node in program.graph.nodes}
    merges = []
    for res, (in_dims, out_dim) in zip(residuals, dims):
        sizes = [a.shape[d] for a, d in zip(res.inputs, in_dims) if a.dim() > d]
        if all(size == n for size in sizes):
            merges.append(None)
            continue
        leaves = (independence.layouts or {}).get(nodes.get(res.where)) or [None]
        batch = leaves[0]
        if not (isinstance(batch, Batch) and batch.s and batch.c % batch.s == 0
                and all(size in (n, batch.c * n) for size in sizes)):
            raise CurvatureError(
                f"The Hessian extensions need the second derivative of graph node '{res.where}' per sample; "
                f"its inputs hold the batch merged with another dim (sizes {sizes} for N={n}) in an order "
                "curvlib cannot follow. Keep the batch in a dim of its own there, or use the GGN extensions "
                "or HMP.")
        merges.append((batch.c, batch.s))
    return tuple(merges)


def per_sample(res, sets, n: int):
    """The column sets of :func:`curvlib._hessian.algebra.factor` for a node whose batch dim merges ``c`` rows per sample
    (``res.meta["merge"] = (c, s)``: row ``i`` belongs to sample ``(i // s) % N``), split per
    row of a sample: ``factor`` treats each row as a sample of its own, so one of its columns
    spans all ``c`` rows of a sample, and where those rows later share a weight its pulled-back
    square would hold cross terms between rows. Column ``(v, w)`` keeps, in every sample, only
    its row ``w``; the direct parts ``[V, N·c, *p]`` become ``[V, N, *p]``. Exact: the node
    acts on each row alone (the planner allows no other merged node), so a sample's residual
    is block diagonal over its rows. Other nodes' sets pass unchanged."""
    merge = res.meta.get("merge")
    if merge is None:
        yield from sets
        return
    c, s = merge
    for sign, taps, direct in sets:
        for w in range(c):
            # row of window w in sample m: i = (w // s)·N·s + m·s + w % s
            rows = (w // s) * n * s + torch.arange(n) * s + w % s
            kept = {j: _keep_rows(t, res.in_dims[j] + 1, rows) for j, t in taps.items()}
            yield sign, kept, {k: d.index_select(1, rows.to(d.device)) for k, d in direct.items()}


def _keep_rows(t, dim: int, rows: Tensor):
    """``t`` (a tensor, or lazy columns built slice by slice) with every entry of ``dim``
    outside ``rows`` zeroed."""
    if isinstance(t, _residual_structured.LazyColumns):
        return _residual_structured.LazyColumns(t.shape[0], lambda a, b: _keep_rows(t[a:b], dim, rows))
    mask = torch.zeros(t.shape[dim], dtype=t.dtype, device=t.device).index_fill_(0, rows.to(t.device), 1)
    return t * mask.reshape((-1,) + (1,) * (t.dim() - dim - 1))
