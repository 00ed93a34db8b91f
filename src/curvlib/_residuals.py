"""Second-derivative (residual) terms of the Hessian on general graphs.

With ``g_z = ∂L/∂z`` the gradient at a node ``z = f(u)`` (``u`` its graph
inputs and, for a layer, its parameters), the Hessian is the GGN plus, for
every node, ``J_uᵀ R J_u`` with the node's *residual*

    R = ∇²_u (g_z · f(u))          (per sample; zero for piecewise-linear nodes).

Each residual is split into a positive and a negative part and factored,
``R = Σ_c s_c c cᵀ`` (``s_c = ±1``); the columns ``c`` have a part on the
node's graph inputs (pulled back through the graph like the loss root) and,
for a layer, a *direct* part on its own parameters. Kinds, by structure:

* ``"diag"``: element-wise ``z = φ(a)``: ``R = diag(φ''(a) ⊙ g)``, one column
  per entry;
* ``"product"``: ``z = x ⊙ y`` (same shapes): ``R = [[0, D], [D, 0]]`` with
  ``D = diag(g)``; columns ``(e_k, ±sign(g_k) e_k)·√(|g_k|/2)``;
* ``"bilinear"``: a Linear layer ``y = W x`` whose weight is also used
  upstream of ``x`` (shared modules, tied weights): ``R`` couples ``W_oi`` and
  ``x_si`` with ``g_so``; columns ``(g_s ⊗ e_i / √(2‖g_s‖), ±e_{s,i} √(‖g_s‖/2))``;
* ``"dense"``: any other node (softmax, division, normalisation, attention
  products, layers nonlinear in their input): ``R`` per sample from
  :func:`torch.func.hessian`, factored by ``eigh``. Its size is checked
  before any work.

A factor times its sign summed over columns reproduces ``R`` exactly, so the
Hessian diagonal stays exact; no Jacobian of the network is formed.
"""

from __future__ import annotations

import operator
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, fx
from torch.func import hessian, vmap

from ._errors import CurvatureError
from ._program import Program
from .rules import call_without_hooks, functional
from .rules._site import Recorder
from .rules.elementwise import classify, second_derivative

# Families whose layers are affine in their input: no residual of their own
# (their weight-input coupling matters only for shared weights: "bilinear").
AFFINE_FAMILIES = ("linear", "conv", "conv_transpose", "batchnorm", "embedding")
# Per-sample entries of a dense residual: N·D² must stay below this.
MAX_DENSE_ENTRIES = 2**26

Maker = Callable[[fx.Node, Dict[fx.Node, object], Dict[str, Tensor], frozenset, Recorder], None]


def _describe(program: Program, node: fx.Node) -> str:
    if node.op == "call_module":
        return f"module '{node.target}' ({type(program.root.get_submodule(node.target)).__name__})"
    what = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{what} (graph node '{node.name}')"


def residual_plan(program: Program, shared_linear_layers: frozenset = frozenset()) -> Dict[fx.Node, Tuple[str, Callable]]:
    """Which graph nodes carry a residual, and how to record it.

    Args:
        program: the traced model.
        shared_linear_layers: targets of Linear layers whose weight is used by
            several sites (they get a ``"bilinear"`` residual).

    Returns:
        node -> ``(kind, phi)``: ``phi`` is ``φ(a)`` for ``"diag"``, ``None``
        for ``"product"``/``"bilinear"``, and for ``"dense"`` the node itself
        (the interpreter builds the function from the node).
    """
    graph = program.graph
    dependent = program.dependent
    plan: Dict[fx.Node, Tuple[str, Optional[Callable]]] = {}
    for node in graph.nodes:
        if node not in dependent or node.op in ("placeholder", "output"):
            continue
        layer = program.layers.get(node.target) if node.op == "call_module" else None
        if layer is not None:
            if layer.kind == "rnn":
                raise CurvatureError(
                    f"The Hessian extensions (DiagHessian, BatchDiagHessian, PCHMP) are not "
                    f"supported for module '{layer.path}' ({type(layer.module).__name__}): the "
                    "second derivatives of a recurrent layer's internal nonlinearities are not "
                    "available, even with its parameters frozen. Use the GGN extensions or HMP."
                )
            if layer.kind not in AFFINE_FAMILIES:
                plan[node] = ("dense", None)
            elif node.target in shared_linear_layers:
                plan[node] = ("bilinear", None)
            continue
        if node in program.functional:
            plan[node] = ("dense", None)
            continue
        kind, phi = classify(node, program.root, program.layers, dependent)
        if kind == "elementwise":
            plan[node] = ("diag", phi)
        elif kind == "other":
            if _is_product(node, dependent):
                plan[node] = ("product", None)
            else:
                plan[node] = ("dense", None)
    return plan


def _is_product(node: fx.Node, dependent: set) -> bool:
    if node.op == "call_function" and node.target in (operator.mul, torch.mul):
        pass
    elif not (node.op == "call_method" and node.target == "mul"):
        return False
    args = node.args
    return len(args) == 2 and all(isinstance(a, fx.Node) and a in dependent for a in args)


def is_inplace(program: Program, node: fx.Node) -> bool:
    """Whether the node overwrites its input (``inplace=True`` modules/functions, ``x.relu_()``)."""
    if node.op == "call_module":
        return bool(getattr(program.root.get_submodule(node.target), "inplace", False))
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    name = getattr(node.target, "__name__", "")
    return bool(node.kwargs.get("inplace", False)) or (name.endswith("_") and not name.endswith("__"))


def _out_of_place(fn: Callable) -> Callable:
    """``fn`` applied to a copy of its tensor arguments (for in-place operations)."""
    return lambda *xs, **kw: fn(*(x.clone() if isinstance(x, Tensor) else x for x in xs), **kw)


def record(program: Program, node: fx.Node, kind: str, phi, env: Dict[fx.Node, object],
           params: Dict[str, Tensor], trainable: frozenset, rec: Recorder, dependent: set,
           before: Optional[Dict[fx.Node, Tensor]] = None) -> None:
    """Record the residual of ``node`` (already evaluated into ``env``) with ``rec``.

    ``before``: for an in-place node, copies of its inputs taken before it ran
    (the residual is a function of those values, and they carry the graph).
    """
    env_out = env
    z = env[node]
    inplace = before is not None
    if inplace:
        env = {**env, **before}
        if phi is not None:
            phi = _out_of_place(phi)
    if not isinstance(z, Tensor):
        raise CurvatureError(
            f"The Hessian extensions need the second derivative of graph node '{node.name}' "
            f"({_describe(program, node)}), which returns {type(z).__name__}, not a tensor; "
            "curvlib handles nonlinear operations with one tensor output."
        )
    inputs_nodes = [a for a in node.all_input_nodes if a in dependent]
    if kind == "diag":
        a = env[node.all_input_nodes[0]] if node.op != "call_module" else fx.node.map_arg(node.args, lambda n: env[n])[0]
        env_out[node] = rec.residual(node.name, kind, phi, [a], z)
        return
    if kind == "product":
        x, y = (env[a] for a in node.args)
        if not (isinstance(x, Tensor) and isinstance(y, Tensor) and x.shape == y.shape == z.shape):
            kind = "dense"  # broadcasting product: no structure to exploit
        else:
            env_out[node] = rec.residual(node.name, kind, None, [x, y], z)
            return
    if kind == "bilinear":
        site = rec.sites[-1] if rec.sites and rec.sites[-1].where == program.layers[node.target].path else None
        if site is None or "weight" not in site.params:
            return
        env_out[node] = rec.residual(node.name, kind, None, [site.saved["x"]], z, site=site)
        return
    # dense: the node as a function of its graph inputs (and its trainable parameters)
    inputs = [env[a] for a in inputs_nodes]
    own = _own_parameters(program, node, trainable)
    phi = _node_function(program, node, env, inputs_nodes, params)
    if inplace:
        phi_inplace = phi
        phi = lambda theta, *xs: phi_inplace(theta, *(x.clone() for x in xs))  # noqa: E731
    env_out[node] = rec.residual(node.name, "dense", phi, inputs, z, params={n: params[n] for n in own})


def _own_parameters(program: Program, node: fx.Node, trainable: frozenset) -> List[str]:
    if node.op == "call_module" and node.target in program.layers:
        return [n for n in dict.fromkeys(program.layers[node.target].names.values()) if n in trainable]
    use = program.functional.get(node)
    return [n for n in use.params if n in trainable] if use is not None else []


def _node_function(program: Program, node: fx.Node, env, inputs_nodes, params) -> Callable:
    """``phi(theta, *inputs)``: the node's value with its graph inputs and parameters replaced."""

    def phi(theta: Dict[str, Tensor], *inputs: Tensor):
        local = dict(zip(inputs_nodes, inputs))
        load = lambda a: fx.node.map_arg(a, lambda n: local[n] if n in local else env[n])  # noqa: E731
        args, kwargs = load(node.args), load(node.kwargs)
        if node.op == "call_module":
            layer = program.layers.get(node.target)
            if layer is None:
                return call_without_hooks(program.root.get_submodule(node.target), args, kwargs)
            tensors = {r: theta.get(n, params[n]) for r, n in layer.names.items()}
            return layer.forward(layer.module, layer.path, {}, tensors, args, kwargs, Recorder(None))
        use = program.functional.get(node)
        if use is not None:
            return functional.evaluate(use, program.root, program.param_names, {**params, **theta}, list(inputs))
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)

    return phi


def check_sizes(residuals, n: int) -> None:
    """Refuse dense or bilinear residuals too large to factor (called at planning)."""
    for res in residuals:
        if res.kind == "dense":
            d = sum(a[0].numel() for a in res.inputs) + sum(p.numel() for p in res.params.values())
        elif res.kind == "bilinear":
            d = res.inputs[0][0].numel()
        else:
            continue
        if n * d * d > MAX_DENSE_ENTRIES:
            raise CurvatureError(
                f"The Hessian extensions need the second derivative of graph node '{res.where}', "
                f"a dense {d}x{d} matrix per sample here (N={n}), which is too large "
                f"(limit: N·d² ≤ {MAX_DENSE_ENTRIES}). Use the GGN extensions (DiagGGNExact, "
                "BatchDiagGGNExact) or HMP (exact Hessian-vector products) for this model."
            )


def factor(res, g: Tensor) -> List[Tuple[float, Dict[int, Tensor], Dict[str, Tensor]]]:
    """Signed column sets of the residual: ``[(sign, {input index: [V, *input]}, {param: [V, N, *p]})]``.

    ``g`` is the gradient at the node's output ``[N, *z]``.
    """
    if res.kind == "diag":
        (a,) = res.inputs
        r = second_derivative(res.phi, a) * g
        eye = _eye_columns(a)
        return [(1.0, {0: eye * r.clamp(min=0).sqrt()}, {}), (-1.0, {0: eye * (-r).clamp(min=0).sqrt()}, {})]
    if res.kind == "product":
        x, _ = res.inputs
        eye = _eye_columns(x)
        m = (g.abs() / 2).sqrt()
        s = torch.sign(g)
        pos = {0: eye * m, 1: eye * (m * s)}
        neg = {0: eye * m, 1: eye * (-m * s)}
        return [(1.0, pos, {}), (-1.0, neg, {})]
    if res.kind == "bilinear":
        return _bilinear_columns(res, g)
    return _dense_columns(res, g)


def _eye_columns(a: Tensor) -> Tensor:
    """``[D, 1, *a.shape[1:]]``: one-hot columns over a sample's entries."""
    d = a[0].numel()
    return torch.eye(d, dtype=a.dtype, device=a.device).reshape((d, 1) + tuple(a.shape[1:]))


def _bilinear_columns(res, g: Tensor):
    site = res.site
    (x,) = res.inputs
    n = x.shape[0]
    xs = x.reshape(n, -1, x.shape[-1])  # [N, S, I]
    gs = g.reshape(n, -1, g.shape[-1])  # [N, S, O]
    s, i = xs.shape[1], xs.shape[2]
    norm = gs.norm(dim=2)  # [N, S]
    m = (norm / 2).sqrt()
    # column (s', i'): x-part e_{s',i'} m[n, s'],  W-part g[n, s'] ⊗ e_{i'} / √(2‖g‖)
    eye_s = torch.eye(s, dtype=x.dtype, device=x.device)
    eye_i = torch.eye(i, dtype=x.dtype, device=x.device)
    x_part = torch.einsum("ab,cd,nb->acnbd", eye_s, eye_i, m).reshape((s * i,) + tuple(x.shape))
    w_scale = gs / (2 * norm.clamp_min(torch.finfo(x.dtype).tiny)).sqrt().unsqueeze(-1)  # [N, S, O]
    w_part = torch.einsum("nao,cd->acnod", w_scale, eye_i).reshape(s * i, n, gs.shape[2], i)
    name = site.params["weight"]
    return [(1.0, {0: x_part}, {name: w_part}), (-1.0, {0: -x_part}, {name: w_part})]


def _layout(res):
    """How ``u = (θ, inputs)`` of a dense residual splits: names, shapes and sizes."""
    names = list(res.params)
    shapes_p = [tuple(res.params[k].shape) for k in names]
    sizes_p = [res.params[k].numel() for k in names]
    shapes_in = [tuple(a.shape[1:]) for a in res.inputs]
    sizes_in = [a[0].numel() for a in res.inputs]
    return names, shapes_p, sizes_p, shapes_in, sizes_in


def _dense_columns(res, g: Tensor):
    names, shapes_p, sizes_p, shapes_in, sizes_in = _layout(res)
    n = g.shape[0]
    R = _dense_matrix(res, g)  # [N, D, D]
    evals, evecs = torch.linalg.eigh(R)
    sets = []
    for sign, lam in ((1.0, evals.clamp(min=0)), (-1.0, (-evals).clamp(min=0))):
        cols = (evecs * lam.sqrt().unsqueeze(1)).permute(2, 0, 1)  # [V=D, N, D]
        parts = torch.split(cols, sizes_p + sizes_in, dim=2)
        direct = {k: p.reshape((cols.shape[0], n) + sh) for k, p, sh in zip(names, parts[: len(names)], shapes_p)}
        taps = {
            j: p.reshape((cols.shape[0], n) + sh)
            for j, (p, sh) in enumerate(zip(parts[len(names):], shapes_in))
        }
        sets.append((sign, taps, direct))
    return sets


def _dense_matrix(res, g: Tensor) -> Tensor:
    """Per-sample residual ``R [N, D, D]`` over ``u = (θ, inputs)`` (dense kind)."""
    names, shapes_p, sizes_p, shapes_in, sizes_in = _layout(res)
    n = g.shape[0]
    theta_flat = [res.params[k].reshape(1, -1).expand(n, -1) for k in names]
    u = torch.cat(theta_flat + [a.reshape(n, -1) for a in res.inputs], dim=1)

    def contracted(u_n: Tensor, g_n: Tensor) -> Tensor:
        parts = list(torch.split(u_n, sizes_p + sizes_in))
        theta = {k: p.reshape(sh) for k, p, sh in zip(names, parts[: len(names)], shapes_p)}
        inputs = [p.reshape((1,) + sh) for p, sh in zip(parts[len(names):], shapes_in)]
        return (res.phi(theta, *inputs).squeeze(0) * g_n).sum()

    R = vmap(hessian(contracted))(u, g)
    return (R + R.transpose(1, 2)) / 2


def positive_curvature(res, g: Tensor, modify: str) -> Callable:
    """The residual with its negative curvature clipped (``"clip"``) or flipped (``"abs"``).

    Returns ``apply(tap_tangents, theta_tangents) -> (tap_cotangents, theta_cotangents)``:
    ``mod(R)`` applied per sample to the tangent of ``u = (θ, inputs)``, with
    ``mod`` acting on the eigenvalues of ``R``. ``theta_*`` are dicts (parameter
    name -> ``[*p]``, the same direction for every sample; the cotangent is
    summed over samples). For an element-wise node this is Chen et al.'s
    ``mod(φ''(a) g)``.
    """
    clip = modify == "clip"
    if res.kind == "diag":
        r = second_derivative(res.phi, res.inputs[0]) * g
        m = r.clamp(min=0) if clip else r.abs()
        return lambda taps, theta: ([m * taps[0]], {})
    if res.kind == "product":
        # per entry: [[0, g], [g, 0]] has eigenpairs ±|g|, (1, ±s)/√2 with s = sign(g)
        a, s = g.abs(), torch.sign(g)
        if clip:
            return lambda taps, theta: ([a / 2 * (taps[0] + s * taps[1]), a / 2 * (s * taps[0] + taps[1])], {})
        return lambda taps, theta: ([a * taps[0], a * taps[1]], {})
    if res.kind == "bilinear":
        name = res.site.params["weight"]
        x = res.inputs[0]
        n = x.shape[0]
        gs = g.reshape(n, -1, g.shape[-1])  # [N, S, O]
        norm = gs.norm(dim=2)  # [N, S]
        unit = gs / norm.clamp_min(torch.finfo(g.dtype).tiny).unsqueeze(-1)

        def apply(taps, theta):
            tx = taps[0].reshape(n, -1, x.shape[-1])  # [N, S, I]
            tw = theta.get(name)
            proj = torch.einsum("nso,oi->nsi", unit, tw) if tw is not None else torch.zeros_like(tx)
            if clip:  # eigenvectors (ĝ⊗e_i, e_{s,i})/√2 with eigenvalue ‖g_s‖
                c = norm.unsqueeze(-1) / 2 * (proj + tx)
                cx, cw = c, torch.einsum("nsi,nso->oi", c, unit)
            else:  # |R| = Σ ‖g_s‖ (ĝĝᵀ ⊗ I on W, I on x)
                cx = norm.unsqueeze(-1) * tx
                cw = torch.einsum("nsi,nso,ns->oi", proj, unit, norm)
            return [cx.reshape(taps[0].shape)], ({name: cw} if tw is not None else {})

        return apply
    R = _dense_matrix(res, g)
    evals, evecs = torch.linalg.eigh(R)
    evals = evals.clamp(min=0) if clip else evals.abs()
    M = evecs @ torch.diag_embed(evals) @ evecs.transpose(1, 2)  # [N, D, D]
    names = list(res.params)
    sizes_p = [res.params[k].numel() for k in names]
    n = g.shape[0]

    def apply_dense(taps, theta):
        t_theta = [
            (theta[k].reshape(1, -1) if k in theta else res.params[k].new_zeros(1, res.params[k].numel())).expand(n, -1)
            for k in names
        ]
        t = torch.cat(t_theta + [tt.reshape(n, -1) for tt in taps], dim=1)
        c = torch.einsum("nij,nj->ni", M, t)
        parts = torch.split(c, sizes_p + [a[0].numel() for a in res.inputs], dim=1)
        theta_c = {k: p.sum(0).reshape(res.params[k].shape) for k, p in zip(names, parts[: len(names)]) if k in theta}
        tap_c = [p.reshape(tt.shape) for p, tt in zip(parts[len(names):], taps)]
        return tap_c, theta_c

    return apply_dense
