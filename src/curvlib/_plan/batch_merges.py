"""The batch merged with windows or heads in dim 0 (``[N·W, S, C]``): planning and Hessian columns.

Window attention (Swin) merges each sample's windows into the batch dim before its layers.
Entry ``i`` of such a dim belongs to sample ``(i // s) % N`` (the layout the
sample-independence analysis follows, :class:`curvlib._plan.mixing_ops.Batch`). Two consequences:

* a parametrized layer on merged rows (:func:`split_merged_batches`) is given the batch as a
  dim of its own by a rewrite of the graph around it (:mod:`curvlib._plan.unmerge`), its rows then positions sharing its
  weights (the planner needs every site's batch in one dim of size ``N``); an op on
  parameters that takes no extra leading dim (``einsum`` with a relative-position table,
  SAM's ``[N·H, h, w, C]`` queries) runs once per sample on that sample's rows
  (:class:`curvlib._plan.per_sample_ops.PerSample`), where it computes the values it computed on the merged rows;
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
from . import per_sample_ops as _per_sample_ops
from .._hessian import structured as _residual_structured
from .._core.errors import CurvatureError
from .merged_modules import batch_first_module
from .unmerge import BROADCASTING, Unmerge, lone_index, needs_per_sample, unmerge
from .mixing_ops import Batch
from .._core.site import Site
from .._trace.program import Program
from ..rules import FAMILY_OF, FamilyKinds, generic

__all__ = ["split_merged_batches", "residual_merges", "per_sample"]


#: Site kinds that treat every entry of their input's dim 0 alike (leading dims are positions;
#: :attr:`~curvlib._core.family.Family.row_wise`).
_ROW_WISE = FamilyKinds(lambda f: f.row_wise)
#: Site kinds of layers that act on each entry of their input's dim 0 alone but take no extra
#: leading dim (a convolution on ``[N·H, C, h, w]``, MViTv2's pooling of heads merged into the
#: batch; :attr:`~curvlib._core.family.Family.entry_wise`): run by the generic rule on the merged
#: rows (:func:`curvlib._plan.merged_modules.batch_first_module`).
_ENTRY_WISE = FamilyKinds(lambda f: f.entry_wise)


def _merged(shape_a, shape_b, n: int) -> Tuple[int, int]:
    """``(d, c)`` with ``c > 1`` when only dim ``d`` changes with the batch, from ``c·N`` to
    ``c·(N + 1)`` entries (the batch merged with ``c`` windows, heads or tokens); else ``(0, 0)``."""
    dims = [d for d, (a, b) in enumerate(zip(shape_a, shape_b)) if a != b]
    if len(dims) != 1 or len(shape_a) != len(shape_b):
        return 0, 0
    d = dims[0]
    if shape_a[d] % n or shape_b[d] - shape_a[d] != shape_a[d] // n or shape_a[d] // n < 2:
        return 0, 0
    return d, shape_a[d] // n


def split_merged_batches(program, rec_a, rec_b, env_a, env_b, n: int, trainable) -> Optional[Program]:
    """Give each row-wise site whose input has the batch merged into one dim (window attention:
    ``[N·W, S, C]`` into ``qkv``; a mixture of experts' tokens ``[N·T, D]`` into its router, or
    ``[E, N·T, D]`` into a batched expert product) the batch as a dim of its own, by a rewrite of
    the graph around it. Returns the new program (the plan is then made again on it; the fx graphs
    are edited in place, the program given is stale), or ``None`` when nothing was rewritten.

    Entry ``i`` of a merged dim ``d`` belongs to sample ``(i // s) % N`` (the layout the
    sample-independence analysis follows, :class:`curvlib._plan.mixing_ops.Batch`), so the dim is
    ``[c/s, N, s]``: the site runs on ``x.unflatten(d, (c/s, -1, s)).movedim(d + 1, 0)`` (its
    windows or tokens become positions sharing the weight) and its output is merged back the same
    way. A merge whose order is not known stays refused (:func:`curvlib._plan.plan._batch_dim`)."""
    where = {}
    for site, sa, sb in zip(rec_a.sites, rec_a.out_shapes, rec_b.out_shapes):
        d, c = _merged(sa, sb, n)
        if c and (site.rule.kind in _ROW_WISE or _broadcasting(site) or _op_on_parameters(site)
                  or (d == 0 and _rows_apart(program, site, sa)) or _generic_wrappable(program, site)
                  or (d == 0 and site.rule.kind in _ENTRY_WISE)):
            where[_site_node_name(site)] = d
    if not where or program.graph is None:
        return None
    found = _independence.analyse(program, env_a, env_b, n, trainable)
    if found.problem:
        return None
    done, programs = False, [_editable(program), _editable(program.sibling)]  # (the traces on N and N + 1)
    for node in list(program.graph.nodes):
        program = programs[0]
        path = _site_path(program, node)
        if path not in where:
            continue
        # (a split-rows module's sites hold the batch in their own layout, not its output's)
        split = _split_of(program, node, found, None if _splits_rows(program, node) else where[path])
        if split is None:
            continue
        positions, batch = split
        entry_wise = _entry_wise(program, node)
        if entry_wise or _generic_wrappable(program, None, node):  # (its forward keeps its own layout)
            programs = [p and batch_first_module(p, node.name, positions, (batch.c // batch.s, batch.s, batch.dim),
                                                 as_generic=entry_wise) for p in programs]
            done = True
            continue
        results = _result_dims(program, node, env_a, env_b, n, batch.c)
        if results is False:
            continue  # a result the rewrite cannot merge back: refused by the planner
        if needs_per_sample(program, node) and not _per_sample_ops.agrees(node, env_a, positions, batch):
            continue  # the op mixes the rows of a sample: refused by the planner
        rows = results is None and batch.dim == 0 and _rows_apart(program, None, env_a[node].shape, node)
        how = Unmerge(tuple(positions), (batch.c // batch.s, batch.s, batch.dim), channels=rows, results=results)
        programs = [p and unmerge(p, node.name, how) for p in programs]
        done = True
    return dataclasses.replace(programs[0], sibling=programs[1]) if done else None


def _editable(program: Optional[Program]) -> Optional[Program]:
    """``program`` with tables of layers and functional uses of its own, for a rewrite to edit."""
    return program and dataclasses.replace(program, layers=dict(program.layers), functional=dict(program.functional))


def _result_dims(program, node: fx.Node, env_a, env_b, n: int, c: int):
    """``None`` for a node with one tensor as its value. For a module of a family that takes
    split rows (:attr:`curvlib._core.family.Family.split_rows`: a recurrent layer's
    ``(output, (h_n, c_n))``), read by indexing alone: ``{name of the node reading a tensor of
    its result: that tensor's merged dim}``. ``False`` for any other result, or a tensor read
    that does not hold ``c`` rows per sample merged into one dim."""
    if isinstance(env_a.get(node), Tensor):
        return None
    if not _splits_rows(program, node):
        return False
    dims = _read_tensors(node, env_a, env_b, n, c)
    return dims if dims else False


def _splits_rows(program, node: fx.Node) -> bool:
    """``node`` runs a module whose family takes split rows (:attr:`curvlib._core.family.Family.split_rows`)."""
    layer = program.layers.get(node.target) if node.op == "call_module" else None
    return layer is not None and FAMILY_OF[layer.kind].split_rows


def _read_tensors(node: fx.Node, env_a, env_b, n: int, c: int) -> Optional[dict]:
    """``{name: merged dim}`` of the tensors read from ``node``'s result by constant indices
    (``out, (h, c) = lstm(x)``); ``None`` if it is read otherwise or a tensor is not merged so."""
    out = {}
    for user in node.users:
        if user.target is not operator.getitem or user.args[0] is not node or not isinstance(user.args[1], int):
            return None
        a, b = env_a.get(user), env_b.get(user)
        if isinstance(a, Tensor) and isinstance(b, Tensor):
            d, k = _merged(a.shape, b.shape, n)
            if k != c:
                return None
            out[user.name] = d
            continue
        inner = _read_tensors(user, env_a, env_b, n, c)
        if inner is None:
            return None
        out.update(inner)
    return out


def _split_of(program, node: fx.Node, found, out_dim: int):
    """``(positions of the merged operands, their Batch)`` when ``node``'s batched operands are
    merged alike in the dim its output is merged in (``out_dim``; ``None``: any), in a known
    order (operands holding no sample data fit any order); else ``None``."""
    args = (node.args[0], lone_index(node)) if node.op == "call_function" and lone_index(node) else node.args
    merged = {k: (found.layouts.get(a) or [None])[0] for k, a in enumerate(args) if isinstance(a, fx.Node)}
    merged = {k: b for k, b in merged.items() if isinstance(b, Batch) and b.c > 1}
    # rows without sample data in no known order (a learned query repeated N times) fit the others' order
    free = {k for k, b in merged.items() if b.s is None and args[k] not in found.data}
    layouts = {b for k, b in merged.items() if k not in free}
    generic = _generic_wrappable(program, None, node)
    if len(layouts) != 1 or (node.op == "call_module" and not generic and set(merged) != {0}):
        return None  # (a rule's batched input is its first; a generic module's operands merged alike)
    batch = layouts.pop()
    if (out_dim is not None and batch.dim != out_dim) or not batch.s or batch.c % batch.s:
        return None  # an order the analysis could not follow: refused by the planner
    if any((merged[k].dim, merged[k].c) != (batch.dim, batch.c) for k in free):
        return None
    return sorted(merged), batch


def _generic_wrappable(program, site: Optional[Site], node: Optional[fx.Node] = None) -> bool:
    """A layer run by the generic rule (:func:`curvlib._plan.merged_modules.batch_first_module`
    runs it on merged rows)."""
    if site is not None:
        return site.rule is generic.GENERIC
    return node.op == "call_module" and node.target in program.layers and program.layers[node.target].forward is generic.forward


def _entry_wise(program, node: fx.Node) -> bool:
    """A layer of a kind in :data:`_ENTRY_WISE` (run by the generic rule on merged rows)."""
    layer = program.layers.get(node.target) if node.op == "call_module" else None
    return layer is not None and layer.kind in _ENTRY_WISE


def _rows_apart(program, site: Optional[Site], shape, node: Optional[fx.Node] = None) -> bool:
    """An eval-mode BatchNorm (running statistics) on rows ``[R, C]``: each row normalised alone,
    so merged rows stay apart (in training mode the batch statistics mix them: not split,
    refused)."""
    if site is not None:  # (a module's site is named by its path, its graph node by that path's ``_`` form)
        node = next((m for m in program.graph.nodes if _site_path(program, m) == _site_node_name(site)), None) \
            if program.graph is not None else None
    layer = program.layers.get(node.target) if node is not None and node.op == "call_module" else None
    module = layer.module if layer is not None else None
    return (isinstance(module, nn.modules.batchnorm._BatchNorm) and len(shape) == 2
            and not module.training and module.running_mean is not None)


def _site_node_name(site: Site) -> str:
    use = site.meta.get("use")
    return use.node.name if use is not None else site.meta.get("node", site.where)


def _broadcasting(site: Site) -> bool:
    """An op on parameters that broadcasts over leading dims of its batched operands, or
    ``p[idx]`` with one index tensor (a batched expert choice picking expert weights): the
    index's dims lead the output, so one more leading dim of ``idx`` is one more of the output."""
    use = site.meta.get("use")
    if use is None or use.node.op != "call_function":
        return False
    node = use.node
    return node.target in BROADCASTING or lone_index(node) is not None


def _op_on_parameters(site: Site) -> bool:
    """An op in ``forward`` on parameters (a functional site) whose output has the batch merged:
    split off by running it once per sample where it does not broadcast
    (:class:`curvlib._plan.per_sample_ops.PerSample`)."""
    use = site.meta.get("use")
    return use is not None and use.node.op in ("call_function", "call_method")


def _site_path(program, node: fx.Node) -> Optional[str]:
    """The path of the layer ``node`` runs (a module call), or its own name (an op on parameters)."""
    if node.op == "call_module" and node.target in program.layers:
        return program.layers[node.target].path
    return node.name if node in program.functional else None


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
