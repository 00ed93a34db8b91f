"""What each graph operation does to the batch axis: op tables and per-op checks.

Used by :mod:`curvlib._plan.independence`. A tensor's *batch layout* is learnt from
its shapes in the two planning passes (batch sizes ``N`` and ``N + 1``): the
one dim whose size changes, with size ``c·N``. With ``c > 1`` the batch is
merged with another axis (``x.reshape(N*T, E)``, ``torch.cat`` along the
batch); entry ``i`` along the dim then belongs to sample ``(i // s) % N``,
where ``s`` (the stride of the batch inside the merged dim) is followed
through the operations that create it (reshapes, ``cat``, ``repeat``).

Operations are classified by name (``kind_of``; an ATen op the front end kept, such as
``aten.new_ones.default``, by its packet's name); each kind says how an
operation can mix the samples of a *batched* input:

* ``elementwise``/``move``/``reduce``/``pick``: never along a surviving batch
  dim; a reduced batch is caught by its output shape;
* ``dim``: mixes along its ``dim`` argument (softmax, cumsum, sort, gather, ...);
* ``contract``: sums over the contracted dims (``@``, ``einsum``, ``F.linear``);
* ``view``: regroups entries; must keep every sample's entries together;
* ``cat``/``repeat``: stack samples' rows; layouts must agree;
* ``index``: ``h[idx]`` with a tensor index in the batch position: decided on the
  index's values (:mod:`curvlib._plan.mixing_index`); where the batch's order is not
  known, only the identity ``torch.arange(N)`` is accepted;
* ``leading``: treats dim 0 as the batch (conv, group/instance norm, ...);
* ``pool``: mixes along its last ``k`` dims;
* ``meta``: reads shapes only (``size``, ``new_zeros``, ``zeros_like``): its output holds no
  sample's values;
* ``unknown``: anything else; tested numerically (:mod:`curvlib._plan.mixing_numeric`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, fx, nn
from torch.nn.modules import activation, dropout, padding, pooling

__all__ = ["Batch", "Odd", "UNKNOWN", "leaves_of", "layout_of", "kind_of", "module_kind", "dims_mixed",
           "operands", "contracted", "index_problem", "view_layout"]


@dataclass(frozen=True)
class Batch:
    """The batch of a tensor: dim ``dim`` has size ``c·N``; entry ``i`` along it
    belongs to sample ``(i // s) % N`` (``s = None``: not known)."""

    dim: int
    c: int = 1
    s: Optional[int] = 1


@dataclass(frozen=True)
class Odd:
    """A tensor whose shape pairs or shifts samples (why, in words)."""

    why: str


UNKNOWN = "unknown"  # shapes of different rank in the two passes (e.g. squeeze() at N = 1)


def leaves_of(value) -> List[Tensor]:
    """The tensors in a node's value (a tensor, or tuples/lists of them), in order."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in leaves_of(v)]
    return []


def _leaf_layout(a: Tensor, b: Tensor, n: int):
    if a.dim() != b.dim():
        return UNKNOWN
    dims = [d for d in range(a.dim()) if a.shape[d] != b.shape[d]]
    if not dims:
        return None
    if len(dims) > 1:
        return Odd(f"its output {list(a.shape)} (for N={n}) has the batch size in dims {dims}: "
                   "it pairs every sample with every other")
    d = dims[0]
    c = b.shape[d] - a.shape[d]
    if c <= 0 or a.shape[d] != c * n:
        return Odd(f"dim {d} of its output has size {a.shape[d]} for N={n} and {b.shape[d]} for "
                   f"N={n + 1}, not a multiple of N: rows of different samples are shifted, cut or padded")
    return Batch(d, c, 1 if c == 1 else None)


def layout_of(value_a, value_b, n: int) -> list:
    """Per tensor leaf: ``None`` (no batch), :class:`Batch`, :class:`Odd` or :data:`UNKNOWN`."""
    la, lb = leaves_of(value_a), leaves_of(value_b)
    if len(la) != len(lb):
        return [UNKNOWN] * len(la)
    return [_leaf_layout(a, b, n) for a, b in zip(la, lb)]


# ----------------------------------------------------------------------------- op tables

_ELEMENTWISE = frozenset("""
add sub mul div truediv floordiv true_divide floor_divide pow mod remainder neg pos abs absolute rsub
multiply divide subtract negative positive exp exp2 expm1 log log2 log10 log1p sqrt rsqrt sin cos tan tanh
sinh cosh asin acos atan atan2 arcsin arccos arctan sigmoid relu relu6 gelu silu elu selu celu leaky_relu
softplus softsign hardtanh hardswish hardsigmoid mish logsigmoid tanhshrink softshrink hardshrink threshold
rrelu prelu erf erfc erfinv clamp clip clamp_min clamp_max where maximum minimum fmax fmin sign sgn square
reciprocal lerp addcmul addcdiv nan_to_num floor ceil round trunc frac eq ne lt le gt ge and or xor invert
not isneginf isposinf logical_and logical_or logical_not logical_xor bitwise_and bitwise_or bitwise_xor bitwise_not isnan
isinf isfinite masked_fill type_as float double half bfloat16 int long bool to contiguous clone cpu cuda
dropout alpha_dropout feature_alpha_dropout dropout1d dropout2d dropout3d real imag conj hypot logaddexp
logit heaviside copysign xlogy embedding one_hot layer_norm rms_norm iadd isub imul itruediv ifloordiv
imod ipow iand ior ixor pad constant_pad_nd
""".split())
_CUT = frozenset(["detach", "data"])  # values kept, gradient path cut
_MOVE = frozenset("""permute transpose t swapaxes swapdims movedim moveaxis unsqueeze squeeze expand expand_as
broadcast_to T mT H mH narrow select unbind split chunk tensor_split split_with_sizes hsplit vsplit
dsplit""".split())
_REDUCE = frozenset("""sum mean prod amax amin max min std var std_mean var_mean norm logsumexp any all median
nanmedian mode nansum nanmean count_nonzero argmax argmin cosine_similarity pairwise_distance cdist aminmax
vector_norm matrix_norm dist mse_loss l1_loss smooth_l1_loss huber_loss cross_entropy nll_loss
binary_cross_entropy binary_cross_entropy_with_logits kl_div""".split())
_META = frozenset("""size dim numel ndimension nelement element_size is_floating_point is_complex stride
storage_offset get_device new_zeros new_ones new_empty new_full zeros_like ones_like empty_like full_like
rand_like randn_like randint_like shape dtype device ndim len""".split())
_VIEW = frozenset("reshape view flatten unflatten view_as reshape_as ravel".split())
_CAT = frozenset("cat concat concatenate hstack vstack stack".split())
_REPEAT = frozenset("repeat tile repeat_interleave".split())
_CONTRACT = frozenset("matmul mm bmm linear einsum imatmul".split())
_LEADING = frozenset("""conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d group_norm
instance_norm local_response_norm pixel_shuffle pixel_unshuffle channel_shuffle native_channel_shuffle
interpolate upsample upsample_nearest upsample_bilinear grid_sample fold batch_norm""".split())
_POOL = frozenset(f"{p}_pool{k}d" for p in ("max", "avg", "lp", "adaptive_max", "adaptive_avg", "fractional_max")
                  for k in (1, 2, 3)) | frozenset(f"max_pool{k}d_with_indices" for k in (1, 2, 3))
_REQUIRED, _ALL, _LEGACY = object(), object(), object()
# name -> (position of the dim argument, counting the input as 0; keyword; default)
_DIM: Dict[str, Tuple[Optional[int], str, object]] = {
    **{k: (1, "dim", _LEGACY) for k in ("softmax", "log_softmax", "softmin")},
    "gumbel_softmax": (4, "dim", -1),
    **{k: (1, "dim", _REQUIRED) for k in ("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp",
                                          "index_select", "gather", "scatter", "scatter_add", "scatter_reduce",
                                          "index_add", "index_copy", "index_fill", "index_reduce")},
    **{k: (1, "dim", -1) for k in ("sort", "argsort", "glu")},
    **{k: (2, "dim", -1) for k in ("topk", "kthvalue", "diff")},
    "normalize": (2, "dim", 1),
    "take_along_dim": (2, "dim", _ALL),
    "flip": (1, "dims", _REQUIRED),
    "roll": (2, "dims", _ALL),
    "rot90": (2, "dims", (0, 1)),
    "fliplr": (None, "", 1),
    "flipud": (None, "", 0),
    "msort": (None, "", 0),
    "unfold": (1, "dimension", _REQUIRED),  # Tensor.unfold (sliding windows); F.unfold is "leading"
}
_OPERATOR_NAMES = {"and_": "and", "or_": "or", "not_": "not", "getitem": "getitem",
                   "iadd": "add", "isub": "sub", "imul": "mul", "itruediv": "truediv"}  # (h += p: in place)


def _name_of_function(target) -> Optional[str]:
    """A torch/operator function's name, or ``None`` for a user function (unknown)."""
    if isinstance(target, torch._ops.OpOverload):  # an ATen op the replay kept: its packet's name
        return target.overloadpacket.__name__  # (aten.new_ones.default: new_ones)
    name = getattr(target, "__name__", None)
    module = getattr(target, "__module__", None) or ""
    if name is None:
        return None
    if module in ("_operator", "operator"):
        return _OPERATOR_NAMES.get(name, name)
    if module.startswith("torch") or module == "builtins" or getattr(torch.Tensor, name, None) is target:
        return name
    return None


def kind_of(node: fx.Node, env_a) -> Tuple[str, str]:
    """``(kind, name)`` of a ``call_function``/``call_method`` node (see the module doc)."""
    if node.meta.get("no_grad") or getattr(node.target, "curvlib_cut", False):
        return "cut", "no_grad"  # run without autograd by the model: constant for every derivative
    if node.op == "call_method":
        name = node.target
        name = name[:-1] if name.endswith("_") and not name.endswith("__") else name
        if name == "unfold":
            return "dim", name
    else:
        name = _name_of_function(node.target)
        if name is None:
            return "unknown", getattr(node.target, "__name__", str(node.target))
        if name == "getattr":
            name = node.args[1]
        elif name == "unfold":  # F.unfold: im2col over dim 0's samples; aten.unfold: Tensor.unfold
            return ("dim" if isinstance(node.target, torch._ops.OpOverload) else "leading"), name
        elif name == "getitem":
            first = env_a.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None
            return ("index" if isinstance(first, Tensor) else "pick"), name
    for kind, names in (("meta", _META), ("cut", _CUT), ("elementwise", _ELEMENTWISE), ("move", _MOVE),
                        ("reduce", _REDUCE), ("view", _VIEW), ("cat", _CAT), ("repeat", _REPEAT),
                        ("contract", _CONTRACT), ("leading", _LEADING), ("pool", _POOL)):
        if name in names:
            return kind, name
    if name in _DIM:
        return "dim", name
    return "unknown", name


def _exact(module: nn.Module, classes: Sequence[type]) -> Optional[type]:
    """The class of ``classes`` that ``module`` is, with that class's own ``forward``."""
    for cls in classes:
        if isinstance(module, cls) and type(module).forward is cls.forward:
            return cls
    return None


def _modules_of(namespace, skip=()) -> Tuple[type, ...]:
    return tuple(c for name, c in vars(namespace).items()
                 if isinstance(c, type) and issubclass(c, nn.Module) and c is not nn.Module and name not in skip)


@functools.lru_cache(maxsize=None)
def _tables() -> Dict[str, Tuple[type, ...]]:
    """Parameter-free ``torch.nn`` module classes by what they do to a batch."""
    mixing = {"Softmax", "Softmin", "LogSoftmax", "Softmax2d", "GLU", "MultiheadAttention"}
    return {
        "elementwise": _modules_of(activation, mixing) + (nn.Identity, dropout._DropoutNd, nn.LayerNorm)
        + _modules_of(padding),
        "pool": tuple(c for c in _modules_of(pooling) if c.__name__[-2:] in ("1d", "2d", "3d")),
        "leading": (nn.GroupNorm, nn.modules.instancenorm._InstanceNorm, nn.LocalResponseNorm, nn.CrossMapLRN2d,
                    nn.PixelShuffle, nn.PixelUnshuffle, nn.ChannelShuffle, nn.Upsample, nn.Fold, nn.Unfold),
    }


def module_kind(module: nn.Module) -> Tuple[str, object]:
    """``(kind, detail)`` of a parameter-free leaf module: detail is the mixed dim(s)
    for ``dim``, the pooled dim count for ``pool``."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "batchnorm", None
    if _exact(module, (nn.Softmax, nn.Softmin, nn.LogSoftmax)) is not None:
        return "dim", (_LEGACY if module.dim is None else module.dim)
    if _exact(module, (nn.Softmax2d,)):
        return "dim", -3
    if _exact(module, (nn.GLU,)):
        return "dim", module.dim
    tables = _tables()
    if _exact(module, tables["elementwise"]):
        return "elementwise", None
    if _exact(module, (nn.Flatten, nn.Unflatten)):
        return "view", None
    if _exact(module, (nn.CosineSimilarity, nn.PairwiseDistance)):
        return "reduce", None
    cls = _exact(module, tables["pool"])
    if cls is not None:
        return "pool", int(cls.__name__[-2])
    if _exact(module, tables["leading"]):
        return "leading", None
    return "unknown", None


# ----------------------------------------------------------------------------- per-op checks


def _arg(args, kwargs, pos, kw, default):
    if pos is not None and len(args) > pos:
        return args[pos]
    return kwargs.get(kw, default)


def dims_mixed(name: str, args, kwargs, ndim: int, detail=None) -> Optional[Tuple[int, ...]]:
    """The dims a ``dim`` op mixes along (normalised), or ``None`` for all of them."""
    if detail is not None:  # a module: its dim attribute
        dims = detail
    else:
        pos, kw, default = _DIM[name]
        dims = default if pos is None else _arg(args, kwargs, pos, kw, default)
        if name == "flip" and isinstance(dims, int) and len(args) > 2:  # Tensor.flip(*dims)
            dims = tuple(args[1:])
    if dims is _ALL or dims is None or dims is _REQUIRED:
        return None
    if dims is _LEGACY:  # F.softmax(x) without dim: torch's legacy choice
        dims = 0 if ndim in (0, 1, 3) else 1
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    return tuple(d % ndim for d in dims) if ndim else ()


def _einsum_dims(equation: str, shapes: Sequence[Tuple[int, ...]]) -> List[set]:
    """Per operand, the dims that ``einsum`` sums over (letters absent from the output)."""
    eq = equation.replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    labels = []
    for term, shape in zip(terms, shapes):
        head, ell, tail = term.partition("...")
        n_ell = len(shape) - len(head) - len(tail) if ell else 0
        labels.append(list(head) + [f"...{i}" for i in range(n_ell)] + list(tail))
    if "->" in eq:
        keep = set(rhs.replace("...", "")) | {lab for ls in labels for lab in ls if lab.startswith("...")}
    else:
        counts: Dict[str, int] = {}
        for ls in labels:
            for lab in ls:
                counts[lab] = counts.get(lab, 0) + 1
        keep = {lab for lab, k in counts.items() if k == 1 or lab.startswith("...")}
    return [{d for d, lab in enumerate(ls) if lab not in keep} for ls in labels]


def operands(name: str, args, kwargs) -> list:
    """The multiplied operands of a ``contract`` op (node args or their values alike)."""
    if name == "einsum":
        rest = list(args[1:])
        return list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
    second = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2", kwargs.get("weight")))
    return [args[0], second]


def contracted(name: str, args, values: Sequence) -> Optional[List[set]]:
    """Per operand (see :func:`operands`), the dims summed over; ``None``: cannot tell."""
    if any(not isinstance(v, Tensor) for v in values):
        return None
    if name == "einsum":
        if not isinstance(args[0], str):
            return None  # sublist format
        return _einsum_dims(args[0], [tuple(v.shape) for v in values])
    a, b = values
    if name == "linear":  # x [..., in] @ W[out, in]ᵀ
        return [{a.dim() - 1}, {b.dim() - 1}]
    return [{a.dim() - 1}, {max(b.dim() - 2, 0)}]


def _is_arange(node, n: int, env_a) -> bool:
    """``torch.arange(N)`` (or ``arange(0, N)``): the identity index along the batch."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not torch.arange:
        return False
    value = env_a.get(node)
    if not isinstance(value, Tensor) or tuple(value.shape) != (n,):
        return False
    args, kw = node.args, node.kwargs
    start_ok = len(args) == 1 or (len(args) == 2 and args[0] == 0)
    return start_ok and kw.get("start", 0) == 0 and kw.get("step", 1) == 1 and "end" not in kw


def index_problem(index_arg, index_val, batch: Batch, ndim: int, n: int, env_a) -> Optional[str]:
    """Why ``h[index]`` mixes samples (a tensor index in the batch position), or ``None``."""
    items = index_arg if isinstance(index_arg, tuple) else (index_arg,)
    values = index_val if isinstance(index_val, tuple) else (index_val,)

    def width(v) -> int:
        if v is None:
            return 0
        if isinstance(v, Tensor) and v.dtype == torch.bool:
            return v.dim()
        return 1

    used = sum(width(v) for v in values if v is not Ellipsis)
    dim = 0
    for item, v in zip(items, values):
        if v is Ellipsis:
            dim += ndim - used
            continue
        w = width(v)
        covers = dim <= batch.dim < dim + w
        if covers and isinstance(v, Tensor) and v.dtype == torch.bool:
            return f"selects rows of the batch dim {batch.dim} by a boolean mask"
        if covers and isinstance(v, (Tensor, list)) and not _is_arange(item, n, env_a):
            return (f"indexes the batch dim {batch.dim} with a tensor (gathers rows of other samples; "
                    "only torch.arange(N) keeps every sample's own row)")
        dim += w
    return None


def view_layout(in_shape, batch: Batch, out_shape, out_batch: Batch, n: int) -> Optional[Batch]:
    """The output batch of a reshape, or ``None`` if the reshape regroups samples.

    In row-major order the input's batch index advances every
    ``S = s · prod(in_shape[dim+1:])`` flat entries; the output keeps whole
    samples together iff that stride falls inside the output's batch dim:
    ``S`` divisible by ``inner = prod(out_shape[dim'+1:])`` and the dim's size
    divisible by ``(S / inner) · N``.
    """
    if batch.s is None:
        return None
    stride = batch.s
    for size in in_shape[batch.dim + 1:]:
        stride *= size
    inner = 1
    for size in out_shape[out_batch.dim + 1:]:
        inner *= size
    if inner == 0 or stride % inner:
        return None
    s = stride // inner
    if out_shape[out_batch.dim] % (s * n):
        return None
    return Batch(out_batch.dim, out_shape[out_batch.dim] // n, s)
