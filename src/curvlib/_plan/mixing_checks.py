"""Per-node structural checks of :mod:`curvlib._plan.independence`: does this node mix samples?

Each function gets the graph walk (layouts of every node so far, hot nodes,
the node values ``env_a`` of the planning pass with ``N`` samples) and one
node with at least one *hot batched* input (``hot_in``: it carries a batch
and depends on a trainable parameter), and returns what the node does, in
words, if it mixes samples; ``None`` otherwise; :data:`PENDING` when it
cannot tell from the graph (the node is then tested numerically).
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, fx, nn

from . import mixing_ops as ops
from .mixing_ops import Batch, Odd

__all__ = ["PENDING", "label", "specific", "shape_rule"]

PENDING = "pending"


def label(node: fx.Node, name: str, module: Optional[nn.Module] = None) -> str:
    """How a node's operation reads in a message (``torch.mean``, ``Tensor.mean``, ``F.softmax``)."""
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_module":
        return f"module '{node.target}' ({type(module).__name__})"
    module_name = getattr(node.target, "__module__", None) or ""
    if name == "getitem":
        return "indexing"
    if module_name in ("_operator", "operator"):
        return f"operator.{getattr(node.target, '__name__', name)}"
    if module_name.startswith("torch.nn.functional") or module_name == "torch._C._nn":
        return f"F.{name}"
    return f"torch.{name}" if module_name.startswith("torch") else name


def specific(walk, node: fx.Node, kind: str, name: str, detail, hot_in) -> Optional[str]:
    """The kind-specific check (see :mod:`curvlib._plan.mixing_ops` for the kinds)."""
    if node.op == "call_module":
        return _module(walk, node, kind, detail, hot_in)
    if node in walk.verdicts:  # indexing along the batch, decided on values (mixing_index)
        return walk.verdicts[node]
    args, kwargs = walk.load(node.args), walk.load(node.kwargs)
    if kind == "dim":
        return _dim(walk, name, args, kwargs, hot_in)
    if kind == "contract":
        return _contract(walk, name, node, args, kwargs, hot_in)
    if kind == "index":
        a, b = node.args[0], walk.batch(node.args[0])
        if a not in hot_in or b is None:
            return None
        why = ops.index_problem(node.args[1], args[1], b, args[0].dim(), walk.n, walk.env_a)
        return f"of '{a.name}' {why}" if why else None
    if kind == "leading":
        return _leading(walk, name, node, args, kwargs, hot_in)
    if kind == "pool":
        return _pool(walk, node.args[0], int(name.rsplit("_pool", 1)[1][0]), hot_in)
    return None


def _dim(walk, name, args, kwargs, hot_in, detail=None) -> Optional[str]:
    """A softmax/cumsum/sort/gather/... along one dim: refused along the batch dim."""
    if not args or not isinstance(args[0], Tensor):
        return None
    ndim = args[0].dim()
    dims = ops.dims_mixed(name, args, kwargs, ndim, detail)
    for a in hot_in:
        b = walk.batch(a)
        if b is None or walk.env_a[a].dim() != ndim:
            continue
        if dims is None:
            return f"over all dims of '{a.name}', the batch dim {b.dim} included"
        if b.dim in dims:
            return f"along the batch dim {b.dim} of '{a.name}'"
    return None


def _contract(walk, name, node, args, kwargs, hot_in):
    """``@``/``einsum``/``F.linear``: refused when a hot operand's batch dim is summed over."""
    nodes, values = ops.operands(name, node.args, node.kwargs), ops.operands(name, args, kwargs)
    dims = ops.contracted(name, args, values)
    if dims is None:
        return PENDING
    for o, summed in zip(nodes, dims):
        b = walk.batch(o) if isinstance(o, fx.Node) else None
        if o in hot_in and b is not None and b.dim in summed:
            return f"sums over the batch dim {b.dim} of '{o.name}' (a contraction across samples)"
    return None


def _leading(walk, name, node, args, kwargs, hot_in) -> Optional[str]:
    """Ops that read dim 0 as the batch (convolutions, group/instance norm, ...)."""
    a = node.args[0]
    if name == "batch_norm":
        training = ops._arg(args, kwargs, 5, "training", False)
        if training or ops._arg(args, kwargs, 1, "running_mean", None) is None:
            return f"normalises '{a.name}' with the statistics of the batch (training=True)"
        return None
    b = walk.batch(a) if a in hot_in else None
    if b is None:
        return None
    if b.dim != 0:
        return f"reads dim 0 of '{a.name}' as the batch, but the batch is in dim {b.dim}"
    ndim = walk.env_a[a].dim()
    if name.startswith("conv") and name[-2:] in ("1d", "2d", "3d") and ndim != int(name[-2]) + 2:
        return f"reads '{a.name}' ({ndim}-D) as one unbatched sample, mixing its batch dim 0 as channels"
    return None


def _pool(walk, a, k: int, hot_in) -> Optional[str]:
    b = walk.batch(a) if a in hot_in else None
    if b is not None and b.dim >= walk.env_a[a].dim() - k:
        return f"pools over the batch dim {b.dim} of '{a.name}'"
    return None


def _sequence(walk, node, module, hot_in) -> Optional[str]:
    """RNN/attention/transformer modules run across their sequence dim: it must not be the batch."""
    batch_first = getattr(module, "batch_first", None)
    if batch_first is None and isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)):
        batch_first = getattr(getattr(module.layers[0], "self_attn", None), "batch_first", None)
    if batch_first is None:
        return None
    if isinstance(module, (nn.RNNBase, nn.TransformerEncoderLayer, nn.TransformerEncoder)):
        positions, verb = (0,), ("recurs" if isinstance(module, nn.RNNBase) else "attends")
    elif isinstance(module, nn.MultiheadAttention):
        positions, verb = (0, 1, 2), "attends"
    else:
        positions, verb = (0, 1), "attends"
    for i in positions:
        a = node.args[i] if i < len(node.args) else None
        b = walk.batch(a) if a in hot_in else None
        if b is None:
            continue
        rank = walk.env_a[a].dim()
        if rank not in (2, 3) or (rank == 3 and b.dim == (0 if batch_first else 1)):
            continue
        return (f"with batch_first={batch_first} reads the batch dim {b.dim} of '{a.name}' ({rank}-D) as "
                f"its sequence dim, so it {verb} across samples")
    return None


def _module(walk, node, kind, detail, hot_in) -> Optional[str]:
    module = detail[0] if isinstance(detail, tuple) else detail
    problem = _sequence(walk, node, module, hot_in)
    if problem or not node.args:
        return problem
    if kind == "batchnorm":
        if module.training or module.running_mean is None:
            return "normalises with the statistics of the batch (training mode or no running statistics)"
        return None
    args, kwargs = walk.load(node.args), walk.load(node.kwargs)
    if kind == "dim":
        return _dim(walk, type(module).__name__, args, kwargs, hot_in, detail=detail[1])
    if kind == "leading":
        b = walk.batch(node.args[0]) if node.args[0] in hot_in else None
        if b is not None and b.dim != 0:
            return f"reads dim 0 of '{node.args[0].name}' as the batch, but the batch is in dim {b.dim}"
    if kind == "pool":
        return _pool(walk, node.args[0], detail[1], hot_in)
    return None


def shape_rule(walk, node, kind: str, hot_in) -> Optional[str]:
    """Refuse an output that lost the batch, pairs samples or shifts them."""
    leaves = walk.layouts[node]
    if not leaves or ops.UNKNOWN in leaves or not hot_in or kind in ("meta", "cut"):
        return None
    a = hot_in[0]
    odd = next((leaf for leaf in leaves if isinstance(leaf, Odd)), None)
    if odd is not None:
        return f"of '{a.name}': {odd.why}"
    if any(isinstance(leaf, Batch) for leaf in leaves):
        return None
    b = walk.batch(a)
    where = f"the batch dim {b.dim}" if b is not None else "the batch"
    how = {"reduce": f"over {where} of '{a.name}'", "index": f"keeps one row of {where} of '{a.name}'",
           "contract": f"sums over {where} of '{a.name}'"}.get(kind, f"removes {where} of '{a.name}'")
    shapes = [list(t.shape) for t in ops.leaves_of(walk.env_a[node])]
    return f"{how}: its output {shapes[0] if len(shapes) == 1 else shapes} is shared by all samples"
