"""Second-derivative (residual) terms of the Hessian on general graphs: which
nodes carry one, and how they are recorded during the forward.

With ``g_z = ∂L/∂z`` the gradient at a node ``z = f(u)``, the Hessian is the
GGN plus, for every node, ``J_uᵀ R J_u`` with the node's *residual*

    R = ∇²_u (g_z · f(u))          (per sample; zero for piecewise-linear nodes).

``u`` holds the node's input-dependent graph inputs and, for a layer (or a
node reading parameters directly), those of its own trainable parameters on
which one of its inputs depends (a module used twice, tied weights). A
parameter none of its inputs depends on couples with them in ``R``, but that
coupling enters no diagonal block of the Hessian (no parameter moves both),
so it is left out: for the families affine in their parameters (Linear,
convolutions, normalisations, ...) the parameter leaves ``u`` altogether
(Chen et al.'s modular definition: a Linear layer of an MLP, or a LayerNorm
used once, has only its input's residual); for other layers it keeps its own
block (``Residual.free``). The block products (GGNMP, HMP) and the Hessian
diagonal are exact either way; PCHMP modifies the eigenvalues of this ``R``
restricted, for the block of ``p``, to what moves with ``p`` (the inputs, and
``p`` where it is the node's own): a shared Linear's ``R|x = 0`` leaves the
blocks of the parameters before it as without sharing
(:func:`curvlib._hessian.algebra.positive_curvature`). A dense node's
other tensor inputs (token ids, masks, values that do not depend on the model
input such as ``baddbmm``'s ``torch.zeros(N, T, S)``) are not in ``u``; they
travel with the residual (``meta["fixed"]``, batch dims ``meta["fixed_dims"]``)
so that ``R_n`` uses sample ``n``'s rows where they carry the batch.
Kinds, by structure:

* ``"diag"``: element-wise ``z = φ(a)``: ``R = diag(φ''(a) ⊙ g)`` (one node, or a region of
  element-wise nodes written out in primitives, :mod:`curvlib._hessian.pointwise`);
* ``"row_region"``: a subgraph acting on each row (last axis) of one tensor alone (RMSNorm
  written out in primitives, :mod:`curvlib._hessian.pointwise`): one ``[D, D]`` block per row
  (:func:`curvlib._hessian.norm.region_residual`);
* ``"pair"``: a gated MLP's ``act(a) ⊙ b``, any element-wise ``φ(a, b)`` (:mod:`curvlib._hessian.pairs`);
* ``"product"``: ``z = x ⊙ y`` (same shapes): ``R = [[0, D], [D, 0]]``, ``D = diag(g)``;
* ``"broadcast"``: ``z = x ⊙ y`` broadcasting (squeeze-excite's ``x * s[:, :, None, None]``):
  per shared index, a matrix product ``[T, 1] × [1, S]`` (:mod:`curvlib._hessian.broadcast`);
* ``"bilinear"``: a Linear layer ``y = W x`` whose input depends on its own
  weight (shared modules, tied weights): ``R`` couples ``W_oi`` and ``x_si``
  with ``g_so``;
* ``"softmax"``: ``softmax`` along one axis: per row ``diag(b) − b sᵀ − s bᵀ``,
  rows independent (:mod:`curvlib._hessian.structured`);
* ``"matmul"``: ``z = X Y`` of two graph tensors with the same leading dims
  (attention's ``q kᵀ`` and ``A v``): ``R`` couples ``X`` and ``Y`` through
  ``G ⊗ I`` per leading index, factored by an SVD of ``G``
  (:mod:`curvlib._hessian.structured`);
* ``"norm"``: ``nn.LayerNorm``/``nn.GroupNorm`` whose input does not depend on
  its own parameters: block-diagonal, one ``[d, d]`` block per normalised row
  (closed form, :mod:`curvlib._hessian.norm`);
* ``"dense"``: any other node (division, other normalisations, broadcasting matrix
  products, layers nonlinear in their input): ``R`` per sample from
  :func:`torch.func.hessian`. Its size is checked before any work.

The per-sample algebra (signed columns for the diagonal, eigenvalue-modified
operators for PCHMP) is in :mod:`curvlib._hessian.algebra`.
"""

from __future__ import annotations

import operator
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from .._core.calls import argument
from .._core.errors import CurvatureError
from .._trace.program import Program
from ..rules import FamilyKinds
from .._core.batch_layout import from_batch_first
from .._core.site import Recorder, ResidualParts
from ..rules.elementwise import classify
from .broadcast import broadcastable
from .dense_node import AFFINE_IN_PARAMETERS, Evaluated, record_dense  # noqa: F401 (AFFINE_IN_PARAMETERS: this module's too)
from .pairs import record_pair
from .pointwise import PointwiseRegion, fuse_pointwise_regions
from ..rules.rnn_steps import Coupling

#: Families whose layers are affine in their input: no residual of their own unless the input
#: depends on the weight (:attr:`~curvlib._core.family.Family.affine_in_input`, ``bilinear``).
AFFINE_FAMILIES = FamilyKinds(lambda f: f.affine_in_input)
#: Normalisations with a block-diagonal residual over their input (``"norm"`` kind,
#: :attr:`~curvlib._core.family.Family.norm_residual`).
NORM_FAMILIES = FamilyKinds(lambda f: f.norm_residual is not None)


def _describe(program: Program, node: fx.Node) -> str:
    if node.op == "call_module":
        return f"module '{node.target}' ({type(program.root.get_submodule(node.target)).__name__})"
    what = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{what} (graph node '{node.name}')"


Planned = Tuple[str, Optional[Callable], frozenset]


def residual_plan(program: Program, fuse: bool = True) -> Dict[fx.Node, Planned]:
    """Which graph nodes carry a residual, and how to record it; with ``fuse``, an
    element-wise subgraph as one residual (:func:`curvlib._hessian.pointwise.fuse_pointwise_regions`).

    Returns:
        node -> ``(kind, phi, coupled)``: ``phi`` is ``φ(a)`` for ``"diag"`` (or a region), the
        :class:`~curvlib.rules.rnn_steps.Coupling` for ``"layer"`` (a recurrent module, whose rule
        records its unrolled nodes itself), ``None`` otherwise (a dense node's function is built
        from the node); ``coupled`` the node's own parameters on which one of its inputs depends.
    """
    graph = program.graph
    dependent = program.dependent
    upstream = _upstream_parameters(program)
    plan: Dict[fx.Node, Planned] = {}
    for node in graph.nodes:
        if node not in dependent or node.op in ("placeholder", "output") or node.meta.get("no_grad"):
            continue  # (inside the model's no_grad region: no gradient reaches it, no residual)
        reach = frozenset().union(*(upstream[a] for a in node.all_input_nodes if a in dependent))
        layer = program.layers.get(node.target) if node.op == "call_module" else None
        if layer is not None:
            coupled = frozenset(layer.names.values()) & reach
            if layer.family.recurrent:  # the rule records its unrolled nodes itself
                plan[node] = ("layer", _recurrent_coupling(node, layer, upstream, dependent), coupled)
                continue
            if layer.kind in NORM_FAMILIES and not coupled:
                plan[node] = ("norm", None, coupled)
            elif layer.kind not in AFFINE_FAMILIES:
                plan[node] = ("dense", None, coupled)
            elif layer.family.bilinear and layer.names.get("weight") in coupled:
                plan[node] = ("bilinear", None, coupled)
            continue
        use = program.functional.get(node)
        if use is not None:
            coupled = frozenset(use.params) & reach
            if use.linear is not None:  # F.linear on parameters: a Linear site
                if use.linear["weight"] in coupled:  # (a transposed weight: its dense block, same math)
                    plan[node] = ("dense" if use.transposed else "bilinear", None, coupled)
            elif not (use.affine or (_scaled_by_parameter(node, use) and not coupled)):
                # (affine in inputs and parameters together: no residual, even where an input
                # depends on the parameter, LayoutLM's table read twice and summed; x ⊙ p: none
                # unless x depends on p)
                plan[node] = ("dense", None, coupled)
            continue
        kind, phi = classify(node, program.root, program.layers, dependent)
        if kind == "elementwise":
            plan[node] = ("diag", phi, frozenset())
        elif kind == "other":
            plan[node] = (_structured_kind(node, program.root, dependent), None, frozenset())
    return fuse_pointwise_regions(program, plan) if fuse else plan


_MATMULS = (torch.matmul, operator.matmul, torch.bmm)


def _scaled_by_parameter(node: fx.Node, use) -> bool:
    """``x * p`` (either order) of one input-dependent tensor and a parameter read as it is
    (RMSNorm's ``weight * x``): linear in ``x`` and in ``p`` apart, so with ``p`` not coupled
    its residual is zero (the ``p``-``x`` coupling enters no diagonal block, module doc)."""
    product = (node.op == "call_function" and node.target in (operator.mul, torch.mul)) or \
        (node.op == "call_method" and node.target == "mul")
    if not product or node.kwargs or len(node.args) != 2 or len(use.inputs) != 1 or use.fixed:
        return False
    if not all(n.op == "get_attr" for n in use.chain):
        return False
    return sorted(isinstance(a, fx.Node) and a in use.inputs for a in node.args) == [False, True] and \
        all(isinstance(a, fx.Node) and (a in use.inputs or a in use.chain) for a in node.args)


def _structured_kind(node: fx.Node, root: nn.Module, dependent: set) -> str:
    """``"product"``, ``"matmul"`` (both factors graph tensors), ``"softmax"`` or ``"dense"``
    (shapes are checked again when the node is recorded)."""
    if _is_product(node, dependent):
        return "product"
    args = node.args
    if ((node.op == "call_function" and node.target in _MATMULS) or (node.op == "call_method" and node.target in ("matmul", "bmm"))) \
            and len(args) == 2 and not node.kwargs and all(isinstance(a, fx.Node) and a in dependent for a in args):
        return "matmul"
    if softmax_axis(node, root) is not None:
        return "softmax"
    return "dense"


def softmax_axis(node: fx.Node, root: nn.Module) -> Optional[int]:
    """The axis of ``torch.softmax``/``F.softmax``/``x.softmax``/``nn.Softmax`` on one graph
    tensor (computed in its own dtype or in a ``dtype`` given), else ``None``."""
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        ok = type(module) is nn.Softmax and len(node.args) == 1 and not node.kwargs
        return module.dim if ok and module.dim is not None else None
    if not ((node.op == "call_function" and node.target in (torch.softmax, F.softmax))
            or (node.op == "call_method" and node.target == "softmax")):
        return None
    rest, kwargs = node.args[1:], dict(node.kwargs)
    dim = rest[0] if rest else kwargs.pop("dim", None)
    if len(rest) > 1 or set(kwargs) - {"dtype", "_stacklevel"}:
        return None
    return dim if isinstance(dim, int) else None


def _recurrent_coupling(node: fx.Node, layer, upstream, dependent: set) -> Coupling:
    """Which of a recurrent module's own parameters its input and initial states depend
    on, and whether the initial states depend on the model input (:mod:`curvlib.rules.rnn_steps`)."""
    x_arg = argument(node.args, node.kwargs, 0, "input", None)
    hx_arg = argument(node.args, node.kwargs, 1, "hx", None)
    own = frozenset(layer.names.values())

    def nodes_in(arg) -> List[fx.Node]:
        found: List[fx.Node] = []
        fx.node.map_arg(arg, found.append)
        return found

    def reach(arg) -> frozenset:
        return own & frozenset().union(*(upstream[a] for a in nodes_in(arg)))

    return Coupling(x=reach(x_arg), hx=reach(hx_arg), state_varies=any(a in dependent for a in nodes_in(hx_arg)))


def _upstream_parameters(program: Program) -> Dict[fx.Node, frozenset]:
    """Per node, the parameters (canonical names) its value depends on."""
    upstream: Dict[fx.Node, frozenset] = {}
    for node in program.graph.nodes:
        names = frozenset().union(*(upstream[a] for a in node.all_input_nodes))
        if node.op == "call_module" and node.target in program.layers:
            names |= frozenset(program.layers[node.target].names.values())
        elif node.op == "get_attr":
            value = program.root
            for part in node.target.split("."):
                value = getattr(value, part)
            if isinstance(value, nn.Parameter) and id(value) in program.param_names:
                names |= {program.param_names[id(value)]}
        upstream[node] = names
    return upstream


def _is_product(node: fx.Node, dependent: set) -> bool:
    if node.op == "call_function" and node.target in (operator.mul, torch.mul):
        pass
    elif not (node.op == "call_method" and node.target == "mul"):
        return False
    args = node.args
    return len(args) == 2 and all(isinstance(a, fx.Node) and a in dependent for a in args)


def _out_of_place(fn: Callable) -> Callable:
    """``fn`` applied to a copy of its tensor arguments (for in-place operations)."""
    return lambda *xs, **kw: fn(*(x.clone() if isinstance(x, Tensor) else x for x in xs), **kw)


def record(program: Program, node: fx.Node, planned: Planned, env: Dict[fx.Node, object],
           params: Dict[str, Tensor], trainable: frozenset, rec: Recorder,
           before: Optional[Dict[fx.Node, Tensor]] = None) -> None:
    """Record the residual of ``node`` (already evaluated into ``env``) with ``rec``.

    ``planned``: the node's entry of :func:`residual_plan`. ``before``: for an
    in-place node, copies of its inputs taken before it ran (the residual is a
    function of those values, and they carry the graph).
    """
    kind, phi, coupled = planned
    if kind == "layer":
        return  # recorded by the layer's rule while it ran (recurrent modules)
    env_out = env
    z = env[node]
    inplace = before is not None
    if inplace:
        env = {**env, **before}
        if phi is not None:
            phi = _out_of_place(phi)
    if not isinstance(z, Tensor) and not any(t.is_floating_point() or t.is_complex() for t in _leaves(z)):
        return  # integer or boolean outputs only (indices, counts): not differentiable
    if not isinstance(z, Tensor):
        raise CurvatureError(
            f"The Hessian extensions need the second derivative of graph node '{node.name}' "
            f"({_describe(program, node)}), which returns {type(z).__name__}, not a tensor; "
            "curvlib handles nonlinear operations with one tensor output."
        )
    if not (z.is_floating_point() or z.is_complex()):
        return  # integer or boolean values (indices, masks, comparisons): not differentiable
    at = Evaluated(program, node, env, env_out, z, inplace)
    if _record_structured(at, (kind, phi, coupled), params, rec):
        return
    record_dense(at, params, trainable, coupled, rec)


def _leaves(value) -> List[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    return [t for v in value for t in _leaves(v)] if isinstance(value, (tuple, list)) else []


def _record_structured(at: Evaluated, planned: Planned, params: Dict[str, Tensor], rec: Recorder) -> bool:
    """Record a residual of a structured kind (element-wise, product, softmax rows,
    normalisation rows, ``X @ Y``, a tied Linear's bilinear term); ``False`` when the
    node's values do not have the structure after all (it is then recorded dense)."""
    program, node, env, env_out, z = at.program, at.node, at.env, at.env_out, at.z
    kind, phi, _ = planned
    if kind == "diag":
        if isinstance(phi, PointwiseRegion):  # the region's function of its root's value
            a, phi = env[phi.input_node(program)], phi.function(program)
        elif node.op != "call_module":
            a = env[node.all_input_nodes[0]]
        else:
            a = fx.node.map_arg(node.args, lambda n: env[n])[0]
        env_out[node] = rec.residual(node.name, kind, phi, [a], z)
        return True
    if kind in ("row_region", "pair"):  # a region's function of its roots' values (by rows, by entries)
        env_out[node] = record_pair(program, node, phi, env, rec, z) if kind == "pair" else \
            rec.residual(node.name, kind, phi.function(program), [env[phi.input_node(program)]], z)
        return True
    if kind == "product":
        x, y = (env[a] for a in node.args)
        if not (isinstance(x, Tensor) and isinstance(y, Tensor)):
            return False
        if x.shape == y.shape == z.shape:
            env_out[node] = rec.residual(node.name, kind, None, [x, y], z)
            return True
        if not broadcastable(x, y, z):
            return False  # a factor with fewer dims: recorded dense
        env_out[node] = rec.residual(node.name, "broadcast", None, [x, y], z)
        return True
    if kind == "softmax":
        a = env[node.all_input_nodes[0]]
        if isinstance(a, Tensor) and a.shape == z.shape and a.is_floating_point() and z.is_floating_point():
            env_out[node] = rec.residual(node.name, kind, None, [a], z,
                                         meta={"axis": softmax_axis(node, program.root), "dtype": z.dtype})
            return True
        return False
    if kind == "norm":
        env_out[node] = _record_norm(program, node, env, params, rec, z)
        return True
    if kind == "matmul":
        x, y = (env[a] for a in node.args)
        if x.dim() >= 3 and x.dim() == y.dim() == z.dim() and x.shape[:-2] == y.shape[:-2] == z.shape[:-2]:
            env_out[node] = rec.residual(node.name, kind, None, [x, y], z)
            return True
        return False  # vectors, broadcasting or no leading dims: no structure to exploit
    if kind == "bilinear":
        site = rec.sites[-1] if rec.sites and _site_of(rec.sites[-1], program, node) else None
        if site is None or "weight" not in site.params:
            return True
        # the Linear's input in the layer's own layout (the plan's residual dims describe that;
        # the site keeps it batch first)
        x = from_batch_first(site.saved["x"], rec.batch_dim(site.key))
        env_out[node] = rec.residual(node.name, kind, None, [x], z, ResidualParts(site=site))
        return True
    return False


def _record_norm(program: Program, node: fx.Node, env, params: Dict[str, Tensor], rec: Recorder, z: Tensor):
    """Record a LayerNorm/GroupNorm residual: the input, and what its per-row blocks need
    (``eps``, the weight ``w`` that scales ``g``, the normalised axes or the groups)."""
    layer = program.layers[node.target]
    module = layer.module
    x = fx.node.map_arg(argument(node.args, node.kwargs, 0, "input"), lambda n: env[n])
    weight = params[layer.names["weight"]] if "weight" in layer.names else None
    # the weight stays attached: derivatives of the Hessian diagonal w.r.t. it flow through R
    meta = {"eps": module.eps, "weight": weight, **layer.family.norm_residual(module)}
    return rec.residual(node.name, "norm", None, [x], z, meta=meta)


def _site_of(site, program: Program, node: fx.Node) -> bool:
    """Whether ``site`` was recorded by ``node`` (a Linear layer, or ``F.linear`` on parameters)."""
    if node.op == "call_module":
        return site.where == program.layers[node.target].path
    return site.meta.get("node") == node.name
