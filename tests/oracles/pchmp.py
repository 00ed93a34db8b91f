"""Brute-force positive-curvature Hessian blocks (PCHMP) on small graphs (float64).

Nothing of curvlib is used here: the model is traced with a plain
:class:`torch.fx.Tracer` (leaves: modules that own parameters and the
``torch.nn`` built-ins), and every derivative comes from
:mod:`torch.autograd.functional` (double backward of autograd; ``torch.func``'s
second derivative of ``F.layer_norm`` with a weight is wrong in torch 2.13).

Definition. Every graph node that depends on the input is ``z = f(u)``; per
sample ``n`` its residual is

    R_n = ∇²_u (g_{z,n} · f(u)),     g_{z,n} = ∂L/∂z restricted to sample n,

over ``u = (θ, x)``: ``x`` the node's input-dependent tensor arguments
(whole-batch tensors: the rows of the other samples get zero rows and columns
in ``R_n``, hence zero eigenvalues, which no modification changes) and ``θ``
the node's own trainable parameters (a module call's, or those a function
reads through its input-free arguments). The couplings in
``R_n`` of a parameter on which none of the node's inputs depends are
removed (it keeps its own block): they enter no diagonal block of the
Hessian, since no parameter moves both coordinates. For the layers affine in
their parameters (Linear, LayerNorm, GroupNorm) that own block is zero, so
such a parameter contributes nothing: a Linear layer of an MLP has no
residual (Chen et al.'s modular definition), a LayerNorm used once only its
input's, and the first use of a module applied twice only its input's; at
its second use, whose input depends on the module's parameters, ``u``
contains them and couples them with that input. The block of parameter
``p`` is the chain recursion of ``L`` as a function of ``p`` alone: per node,
``u_p`` holds what moves with ``p``, the node's inputs and, where ``p`` is one
of the node's own parameters, ``p`` (the node's other parameters are
constants of ``L(p)``: their rows and columns of ``R_n`` are dropped, so a
later use of a shared Linear, whose ``R|x = 0``, adds nothing to the block of
a parameter before it), and

    PCH_p = Σ_n J_{out,n}ᵀ mod(H_loss,n) J_{out,n} + Σ_nodes Σ_n J_{u_p}ᵀ mod(R_n|u_p) J_{u_p},

``J_{u_p} = ∂u_p/∂p`` (the identity on ``p``'s entry, ``∂x/∂p`` by autograd on
the input part). For a shared parameter this sums the terms of all its uses,
their cross terms included (through ``∂x/∂p`` of a later use's input). ``mod`` acting on the
eigenvalues (``"clip"``: ``max(λ, 0)``, ``"abs"``: ``|λ|``; ``None``: none,
and then the sum is the exact Hessian block, which the tests check against
:func:`hessian_blocks_autograd`). A node reading parameters in the forward
(``F.linear(h, enc.weight.t())``) owns them like a module call. Models with
in-place operations are refused (``NotImplementedError``).
"""

from __future__ import annotations

import operator
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, fx, nn
from torch.autograd.functional import hessian, jacobian

from oracles.first_order import functional_call
from oracles.second_order import loss_hessian_blocks

BLOCK_RTOL = 1e-7  # assert_blocks_close: relative to the largest entry of any block


class _Leaves(fx.Tracer):
    """Leaves: modules owning parameters themselves, the ``torch.nn`` built-ins, and the
    given module types (untraceable modules: one node each, as the caller states)."""

    def __init__(self, leaves: tuple = ()):
        super().__init__()
        self.leaves = tuple(leaves)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return (any(True for _ in m.parameters(recurse=False)) or isinstance(m, self.leaves)
                or super().is_leaf_module(m, qualname))


def mod(M: Tensor, modify: Optional[str]) -> Tensor:
    """``M [..., D, D]`` (symmetric) with its eigenvalues clipped at zero or in absolute value."""
    if modify is None:
        return M
    lam, Q = torch.linalg.eigh((M + M.transpose(-1, -2)) / 2)
    lam = lam.clamp(min=0) if modify == "clip" else lam.abs()
    return Q @ torch.diag_embed(lam) @ Q.transpose(-1, -2)


_IN_PLACE_OPERATORS = frozenset(
    getattr(operator, f"i{op}") for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul")
)


def _in_place(model: nn.Module, node: fx.Node) -> bool:
    """``inplace=True`` modules and functions, ``x.relu_()``, ``x += y``."""
    if node.op == "call_module":
        return bool(getattr(model.get_submodule(node.target), "inplace", False))
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return bool(node.kwargs.get("inplace")) or (name.endswith("_") and not name.endswith("__")) or (
        node.op == "call_function" and node.target in _IN_PLACE_OPERATORS)


def _getattr_path(obj, target: str):
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class _Graph:
    """The traced model, run functionally with every parameter replaceable."""

    def __init__(self, model: nn.Module, leaves: tuple = ()):
        self.model = model
        self.graph = _Leaves(leaves).trace(model)
        self.ids = {}
        for name, p in model.named_parameters():
            self.ids.setdefault(id(p), name)
        self.roles = {  # module target -> role -> canonical parameter name
            n.target: {r: self.ids[id(p)] for r, p in model.get_submodule(n.target).named_parameters(remove_duplicate=False)}
            for n in self.graph.nodes if n.op == "call_module"
        }
        self.dependent = self._dependent()
        self.nodes = [n for n in self.graph.nodes if n in self.dependent and n.op.startswith("call_")]
        self.tensor_nodes = self.nodes  # narrowed to floating tensor values once they are known
        self.float_input = True
        for n in self.nodes:
            if _in_place(model, n):
                raise NotImplementedError(f"oracle: in-place operation at graph node '{n.name}'")

    def _attr(self, node: fx.Node, params: Dict[str, Tensor]):
        value = _getattr_path(self.model, node.target)
        return params[self.ids[id(value)]] if isinstance(value, nn.Parameter) else value

    def _dependent(self) -> set:
        """Nodes depending on the input, and per node the parameters its value depends on."""
        dep, self.upstream = set(), {}
        for n in self.graph.nodes:
            ups = set().union(*(self.upstream[a] for a in n.all_input_nodes)) if n.all_input_nodes else set()
            if n.op == "call_module":
                ups |= set(self.roles[n.target].values())
            elif n.op == "get_attr" and isinstance(_getattr_path(self.model, n.target), nn.Parameter):
                ups.add(self.ids[id(_getattr_path(self.model, n.target))])
            self.upstream[n] = ups
            if n.op == "placeholder" or any(a in dep for a in n.all_input_nodes):
                dep.add(n)
        return dep

    def parameters_of(self, node: fx.Node) -> List[str]:
        """A node's own parameters: a module's, or those read through its input-free arguments."""
        if node.op == "call_module":
            return list(dict.fromkeys(self.roles[node.target].values()))
        constant = [a for a in node.all_input_nodes if a not in self.dependent]
        return sorted(set().union(*(self.upstream[a] for a in constant))) if constant else []

    def call(self, node: fx.Node, params: Dict[str, Tensor], args, kwargs):
        """``node``'s function on given arguments, with the model's parameters ``params``."""
        if node.op == "call_module":
            module = self.model.get_submodule(node.target)
            return functional_call(module, {r: params[c] for r, c in self.roles[node.target].items()}, tuple(args))
        if node.op == "get_attr":
            return self._attr(node, params)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)

    def constants(self, params: Dict[str, Tensor]) -> Dict[fx.Node, object]:
        """The values of the input-free nodes (parameters read in the forward, and ops on them)."""
        env: Dict[fx.Node, object] = {}
        for n in self.graph.nodes:
            if n not in self.dependent and n.op != "output":
                load = lambda a: fx.node.map_arg(a, lambda m: env[m])  # noqa: E731
                env[n] = self.call(n, params, load(n.args), load(n.kwargs))
        return env

    def run(self, X: Tensor, params: Dict[str, Tensor], offsets: Optional[Dict[fx.Node, Tensor]] = None):
        """``(output, env)``: every node's value; ``offsets`` are added to node outputs."""
        env: Dict[fx.Node, object] = {}
        for n in self.graph.nodes:
            load = lambda a: fx.node.map_arg(a, lambda m: env[m])  # noqa: E731
            if n.op == "placeholder":
                env[n] = X
            elif n.op == "output":
                return load(n.args[0]), env
            else:
                env[n] = self.call(n, params, load(n.args), load(n.kwargs))
                if offsets is not None and n in offsets:
                    env[n] = env[n] + offsets[n]
        raise AssertionError("no output node")


def _batch_dims(graph: _Graph, X: Tensor, params: Dict[str, Tensor]) -> Dict[fx.Node, int]:
    """Per node, the one dim of its output whose size follows the batch size (``N`` vs ``N + 1``)."""
    with torch.no_grad():
        _, env_a = graph.run(X, params)
        _, env_b = graph.run(torch.cat([X, X[:1]]), params)
    dims = {}
    for n in graph.tensor_nodes:
        changed = [d for d, (a, b) in enumerate(zip(env_a[n].shape, env_b[n].shape)) if a != b]
        assert len(changed) == 1, f"oracle: node {n.name} has no single batch dim"
        dims[n] = changed[0]
    return dims


def _node_grads(graph: _Graph, lossfn, X, y, params) -> Dict[fx.Node, Tensor]:
    """``g_z = ∂L/∂z`` at every node (zero offsets added to the outputs)."""
    with torch.no_grad():
        _, env = graph.run(X, params)
    offsets = {n: torch.zeros_like(env[n], requires_grad=True) for n in graph.tensor_nodes}
    out, _ = graph.run(X, params, offsets)
    grads = torch.autograd.grad(lossfn(out, y), list(offsets.values()), allow_unused=True)
    return {n: torch.zeros_like(env[n]) if g is None else g for n, g in zip(offsets, grads)}


def _inputs(graph: _Graph, node: fx.Node) -> List[fx.Node]:
    """The node's input-dependent tensor arguments (the model input included; not sizes)."""
    return [a for a in node.all_input_nodes if a in graph.tensor_nodes or (a.op == "placeholder" and graph.float_input)]


def _own(graph: _Graph, node: fx.Node, trainable: Sequence[str]) -> Tuple[List[str], List[str]]:
    """The node's own trainable parameters, and those of them that none of its inputs depends on."""
    upstream = set().union(*(graph.upstream[a] for a in _inputs(graph, node)))
    own = [c for c in graph.parameters_of(node) if c in trainable]
    return own, [c for c in own if c not in upstream]


def _residuals(graph, node, own, free, params, env, g, bdim) -> Tensor:
    """``[N, D, D]``: ``R_n`` over ``u = (own parameters, whole-batch inputs)``, flattened,
    without the couplings of the ``free`` parameters (those no input depends on)."""
    inputs = _inputs(graph, node)
    u0 = tuple(params[c] for c in own) + tuple(env[a] for a in inputs)

    def f(*u):
        theta = {**params, **dict(zip(own, u[: len(own)]))}
        local = {**graph.constants(theta), **dict(zip(inputs, u[len(own):]))}
        load = lambda a: fx.node.map_arg(a, lambda m: local[m] if m in local else env[m])  # noqa: E731
        return graph.call(node, theta, load(node.args), load(node.kwargs))

    sizes = [t.numel() for t in u0]
    if not u0:  # a function of sizes or masks only (no float input, no parameter): no residual
        return g.new_zeros(g.shape[bdim], 0, 0)
    result = []
    for n in range(g.shape[bdim]):
        g_n = torch.zeros_like(g)
        g_n.select(bdim, n).copy_(g.select(bdim, n))
        blocks = hessian(lambda *u: (f(*u) * g_n).sum(), u0)
        rows = [torch.cat([blocks[i][j].reshape(sizes[i], sizes[j]) for j in range(len(u0))], 1) for i in range(len(u0))]
        result.append(torch.cat(rows, 0))
    R = torch.stack(result)
    starts = torch.tensor([0] + sizes).cumsum(0).tolist()
    for k, c in enumerate(own):
        if c in free:  # keep its own block, drop its couplings (they enter no diagonal block)
            block = R[:, starts[k]:starts[k + 1], starts[k]:starts[k + 1]].clone()
            R[:, starts[k]:starts[k + 1], :] = 0
            R[:, :, starts[k]:starts[k + 1]] = 0
            R[:, starts[k]:starts[k + 1], starts[k]:starts[k + 1]] = block
    return R


def _jacobians(graph: _Graph, X: Tensor, params, name: str) -> Tuple[Tensor, Dict[fx.Node, Tensor]]:
    """``∂out/∂p [N, C, P]`` and ``∂x/∂p [x.numel(), P]`` for every node feeding another."""
    feeding = list(dict.fromkeys(a for n in graph.tensor_nodes for a in _inputs(graph, n)))
    p0 = params[name]

    def values(t):
        out, env = graph.run(X, {**params, name: t})
        return (out,) + tuple(env[a] for a in feeding)

    jac = jacobian(values, p0)
    return jac[0].reshape(X.shape[0], -1, p0.numel()), {a: j.reshape(-1, p0.numel()) for a, j in zip(feeding, jac[1:])}


def pchmp_blocks(model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor, modify: Optional[str],
                 leaves: tuple = ()) -> Dict[str, Tensor]:
    """``{name: [P, P]}``: the positive-curvature Hessian block of every trainable parameter.

    ``modify=None`` gives the exact Hessian blocks (a self-check of the decomposition).
    ``leaves``: module types that are one graph node each (whole, like curvlib's opaque modules).
    """
    graph = _Graph(model, leaves)
    params = {n: p.detach() for n, p in model.named_parameters()}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    with torch.no_grad():
        out, env = graph.run(X, params)
    graph.float_input = X.is_floating_point()
    graph.tensor_nodes = [n for n in graph.nodes if isinstance(env[n], Tensor) and env[n].is_floating_point()]
    H_loss = mod(loss_hessian_blocks(lossfn, out, y), modify)  # [N, C, C]
    grads, bdims = _node_grads(graph, lossfn, X, y, params), _batch_dims(graph, X, params)
    nodes = []  # (own parameters, inputs, R [N, D, D])
    for node in graph.tensor_nodes:
        own, free = _own(graph, node, trainable)
        R = _residuals(graph, node, own, free, params, env, grads[node], bdims[node])
        nodes.append((own, _inputs(graph, node), R))
    blocks = {}
    for name in trainable:
        P = params[name].numel()
        J, jac_in = _jacobians(graph, X, params, name)
        total = torch.einsum("ncp,ncd,ndq->pq", J, H_loss, J)
        for own, inputs, R in nodes:
            if R.shape[1] == 0:
                continue
            p0 = params[name]
            # u_p: the node's inputs, and p where it is the node's own parameter; the
            # node's other parameters are constants of L(p) (rows and columns dropped)
            keep = torch.cat([torch.full((params[c].numel(),), c == name) for c in own]
                             + [torch.ones(jac_in[a].shape[0], dtype=torch.bool) for a in inputs])
            Ju = torch.cat([torch.eye(P, dtype=p0.dtype) if c == name else p0.new_zeros(params[c].numel(), P) for c in own]
                           + [jac_in[a] for a in inputs])[keep]  # [D_p, P]: ∂u_p/∂p
            M = mod(R[:, keep][:, :, keep], modify)
            total = total + torch.einsum("dp,nde,eq->pq", Ju, M, Ju)
        blocks[name] = total
    return blocks


def hessian_blocks_autograd(model: nn.Module, lossfn: nn.Module, X: Tensor, y: Tensor) -> Dict[str, Tensor]:
    """``{name: [P, P]}``: ``∇²_p L`` by autograd's double backward (reference for the self-check)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    result = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            H = hessian(lambda t: lossfn(functional_call(model, {**params, name: t}, (X,)), y), params[name])
            result[name] = H.reshape(p.numel(), p.numel())
    return result


def assert_blocks_close(got: Dict[str, Tensor], want: Dict[str, Tensor], what: str) -> None:
    """Every block within ``BLOCK_RTOL`` of the largest entry of any block of ``want``."""
    assert list(got) == list(want), f"{what}: keys {list(got)} != {list(want)}"
    scale = max([float(w.abs().max()) for w in want.values()] + [1e-300])
    for name in want:
        err = float((got[name] - want[name]).abs().max())
        assert err <= BLOCK_RTOL * scale, f"{what}[{name}]: max error {err:.3e}, relative {err / scale:.3e}"
